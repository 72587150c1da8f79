#!/bin/bash
# What one fio workload costs per I/O on a fusex mount: IOPS, the daemon's CPU (utime + stime),
# its voluntary context switches, and the machine's function-call and rescheduling IPIs (the
# interrupts a wakeup of a task on another, idle CPU sends), each divided by the I/Os fio did.
#
# usage: bench/costs.sh IMAGE "FUSEX MOUNT ARGS" "FIO ARGS"
#   e.g. bench/costs.sh /dev/shm/img "--transport legacy" "--rw=randwrite --bs=4k --ioengine=psync"
# FUSEX (default target/release/fusex) picks the binary; RUNTIME (default 4) fio's seconds.
# Root; mounts on a temporary file and unmounts it however the script ends.
set -euo pipefail
[ $# -eq 3 ] || { echo "usage: $0 IMAGE \"FUSEX ARGS\" \"FIO ARGS\"" >&2; exit 2; }
image=$1 fusex_args=$2 fio_args=$3
bin=${FUSEX:-$(dirname "$0")/../target/release/fusex}
dir=$(mktemp -d /tmp/fusex-costs.XXXXXX)
mnt=$dir/export
cleanup() { umount "$mnt" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT
# shellcheck disable=SC2086
"$bin" mount --writable --direct --no-locking $fusex_args "$image" "$mnt" > "$dir/fusex.log" 2>&1 &
pid=$!
for _ in $(seq 50); do grep -q " $mnt " /proc/mounts && break; sleep 0.1; done
grep -q " $mnt " /proc/mounts || { echo "fusex did not mount: $(tail -1 "$dir/fusex.log")" >&2; exit 1; }
ipis() { awk '/^ *(CAL|RES):/ { s = 0; for (i = 2; i <= NF && $i ~ /^[0-9]+$/; i++) s += $i; printf "%s=%d ", $1, s }' /proc/interrupts; }
vcsw() { cat /proc/"$pid"/task/*/status | awk '/^voluntary_ctxt_switches/ { s += $2 } END { print s }'; }
cpu() { awk '{ print $14 + $15 }' /proc/"$pid"/stat; }
i1=$(ipis) c1=$(vcsw) t1=$(cpu)
# shellcheck disable=SC2086
fio --name=costs --filename="$mnt" --direct=1 --time_based --runtime="${RUNTIME:-4}" --size=1G \
    --group_reporting --output-format=json $fio_args > "$dir/fio.json"
i2=$(ipis) c2=$(vcsw) t2=$(cpu)
python3 - "$dir/fio.json" "$i1" "$i2" "$c1" "$c2" "$t1" "$t2" "$(getconf CLK_TCK)" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
ios = j["read"]["total_ios"] + j["write"]["total_ios"]
iops = j["read"]["iops"] + j["write"]["iops"]
a = dict(x.split("=") for x in sys.argv[2].split())
b = dict(x.split("=") for x in sys.argv[3].split())
ipis = " ".join(f"{k.rstrip(':')}/io {(int(b[k]) - int(a[k])) / ios:.2f}" for k in sorted(a))
vcsw = (int(sys.argv[5]) - int(sys.argv[4])) / ios
cpu_us = (int(sys.argv[7]) - int(sys.argv[6])) * 1e6 / int(sys.argv[8]) / ios
print(f"IOPS {iops / 1000:.1f}k  daemon CPU/io {cpu_us:.2f} us  daemon vcsw/io {vcsw:.2f}  {ipis}")
EOF
