#!/bin/bash
# Long-running checks that do not fit `make test`:
#  1. verified fio storms on every transport, read mode and queue count: mixed block sizes
#     (512 B .. 1 MiB, unaligned offsets), 4 jobs x QD32, crc32c verify; afterwards the export
#     and the image must hash the same;
#  2. a mixed storm per transport: 4 jobs x QD128 random 4 KiB .. 1 MiB reads and writes with
#     verify, reporting requests and the daemon's peak RSS;
#  3. the fsx random-operation test with many more operations (STRESS_FSX_OPS, default 50000);
#  4. the end-to-end suite repeated, to shake out flaky tests.
# Environment: STRESS_SECONDS (per fio storm, default 60), STRESS_E2E_ROUNDS (default 3).
# Every mount made here is unmounted on every exit path.
set -euo pipefail

cd "$(dirname "$0")/.."
SECONDS_EACH=${STRESS_SECONDS:-60}
E2E_ROUNDS=${STRESS_E2E_ROUNDS:-3}
FUSEX=${FUSEX:-target/release/fusex}
WORK=$(mktemp -d /dev/shm/fusex-stress.XXXXXX)
MNT="$WORK/export"
DAEMON=""

cleanup() {
    if [ -n "$DAEMON" ] && kill -0 "$DAEMON" 2>/dev/null; then
        kill -TERM "$DAEMON" 2>/dev/null || true
        wait "$DAEMON" 2>/dev/null || true
    fi
    if grep -q " $MNT " /proc/self/mountinfo 2>/dev/null; then
        umount -l "$MNT" || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

[ -x "$FUSEX" ] || { echo "stress: $FUSEX missing (run: make release)" >&2; exit 1; }
command -v fio >/dev/null || { echo "stress: fio missing (run: make deps)" >&2; exit 1; }

start_export() { # image MiB, fusex mount options...: a fresh random image, exported writable
    local mib=$1
    shift
    head -c $((mib << 20)) /dev/urandom >"$WORK/disk.img"
    "$FUSEX" mount --writable --stats-file "$WORK/stats.json" "$@" "$WORK/disk.img" "$MNT" 2>"$WORK/daemon.log" &
    DAEMON=$!
    for _ in $(seq 200); do
        grep -q "mounted " "$WORK/daemon.log" && break
        kill -0 "$DAEMON" 2>/dev/null || { cat "$WORK/daemon.log" >&2; exit 1; }
        sleep 0.05
    done
}

stop_export() { # label: SIGTERM; the export and the image must have hashed the same, no mount left
    local a b
    a=$(sha256sum <"$MNT")
    kill -TERM "$DAEMON"
    wait "$DAEMON"
    DAEMON=""
    b=$(sha256sum <"$WORK/disk.img")
    if [ "$a" != "$b" ]; then
        echo "stress: $1: export and image differ afterwards" >&2
        exit 1
    fi
    if grep -q " $MNT " /proc/self/mountinfo; then
        echo "stress: $1: still mounted after SIGTERM" >&2
        exit 1
    fi
}

requests() { # from the last run's stats file
    python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["requests"])' "$WORK/stats.json"
}

storm() { # label, fusex mount options...
    local label=$1
    shift
    start_export 256 "$@"
    # Each pass: 4 jobs, each writing its own 64 MiB quarter in random order with mixed block
    # sizes at QD32, then reading it all back against crc32c; then one job writing a 16 MiB
    # stretch sequentially with random unaligned sizes (100..70000 bytes) through the page cache,
    # and verifying it. Passes repeat until the time is up.
    local end=$((SECONDS + SECONDS_EACH)) passes=0
    while [ "$SECONDS" -lt "$end" ] || [ "$passes" -eq 0 ]; do
        fio --name=storm --filename="$MNT" --thread --numjobs=4 --offset_increment=64M --size=64M \
            --ioengine=io_uring --iodepth=32 --direct=1 --rw=randwrite \
            --bssplit=4k/40:64k/30:128k/20:1m/10 --verify=crc32c --verify_fatal=1 --verify_state_save=0 \
            --randseed=$((passes + 1)) --output-format=terse >>"$WORK/fio.out"
        fio --name=unaligned --filename="$MNT" --offset=$(((passes % 15) << 24)) --size=16M \
            --ioengine=psync --rw=write --bsrange=100-70000 --bs_unaligned \
            --verify=crc32c --verify_fatal=1 --verify_state_save=0 --output-format=terse >>"$WORK/fio.out"
        passes=$((passes + 1))
    done
    stop_export "$label"
    echo "stress: $label: ok ($passes passes, $(requests) requests)"
}

mixed() { # label, fusex mount options...
    # 4 jobs x QD128, random reads and writes (50/50) of 4 KiB .. 1 MiB, each job in its own
    # quarter, every block written carrying a crc32c header that reads check (verify_backlog
    # re-reads written blocks while the mix runs); then the export and the image must hash the
    # same. Reports requests, the run's length and the daemon's peak RSS (VmHWM).
    local label=$1
    shift
    start_export 512 "$@"
    local start=$SECONDS
    fio --name=mixed --filename="$MNT" --thread --numjobs=4 --offset_increment=128M --size=128M \
        --ioengine=io_uring --iodepth=128 --direct=1 --rw=randrw --rwmixread=50 \
        --bsrange=4k-1m --blockalign=4k --time_based --runtime="$SECONDS_EACH" \
        --verify=crc32c --verify_backlog=64 --verify_fatal=1 --verify_state_save=0 \
        --output-format=terse >>"$WORK/fio.out"
    local hwm
    hwm=$(awk '/^VmHWM/ {print $2 " " $3}' "/proc/$DAEMON/status")
    stop_export "$label"
    echo "stress: $label: ok ($(requests) requests in $((SECONDS - start)) s, daemon peak RSS $hwm)"
}

uring=$(cat /sys/module/fuse/parameters/enable_uring 2>/dev/null || echo N)
mixed "mixed 4k-1M randrw QD128 x 4, legacy" --transport legacy
if [ "$uring" = Y ]; then
    mixed "mixed 4k-1M randrw QD128 x 4, io_uring" --transport uring
fi

for t in legacy uring; do
    [ "$t" = uring ] && [ "$uring" != Y ] && continue
    start=$SECONDS
    FSX_OPS=${STRESS_FSX_OPS:-50000} FUSEX_E2E_TRANSPORT=$t cargo test -q -p fusex-e2e --test fsx
    echo "stress: fsx, ${STRESS_FSX_OPS:-50000} operations per image (raw x2, qcow2), $t: ok in $((SECONDS - start)) s"
done

for q in 1 2 4; do
    storm "legacy multishot, $q queues" --transport legacy --queues "$q"
    storm "legacy poll, $q queues" --transport legacy --legacy-read poll --queues "$q"
    if [ "$uring" = Y ]; then
        storm "io_uring, $q queues" --transport uring --queues "$q"
    fi
done
[ "$uring" = Y ] || echo "stress: enable_uring=N: io_uring storms skipped (make deps sets it)"

for r in $(seq "$E2E_ROUNDS"); do
    echo "stress: end-to-end suite, round $r of $E2E_ROUNDS"
    FUSEX_E2E_TRANSPORT=legacy cargo test -q -p fusex-e2e -- --test-threads=4
    if [ "$uring" = Y ]; then
        FUSEX_E2E_TRANSPORT=uring cargo test -q -p fusex-e2e -- --test-threads=4
    fi
done
echo "stress: all ok"
