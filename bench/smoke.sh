#!/bin/bash
# CI smoke run of the benchmark runner, end to end, no thresholds:
# a 1-second subset of the `quick` matrix against `native` and `fusex` on a
# small /dev/shm image, with the system python3 (no matplotlib: plots are
# skipped with a note), then (if fusex has its qcow2 backend) a 1-second
# subset of the `qcow2` matrix on a 64 MiB overlay. Fails if a target does
# not start, a run fails, the report is missing, or anything is left mounted.
#   FUSEX=path/to/fusex bash bench/smoke.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
fusex=${FUSEX:-$repo/target/release/fusex}
out=$(mktemp -d "${TMPDIR:-/tmp}/fusexbench-smoke.XXXXXX")
trap 'rm -rf "$out"' EXIT
mkdir "$out/tmp"  # the runner's mount points go here, so the check below sees only ours

TMPDIR="$out/tmp" FUSEXBENCH_NO_VENV=1 python3 "$here/run.py" --matrix quick --targets native,fusex \
    --workloads randread-4k-qd1,randwrite-4k-qd64,randrw70 \
    --runtime 1 --ramp 0 --rounds 1 --size 256M \
    --fusex "$fusex" --out "$out" --strict --print-table

test -s "$out/results.json"
test -s "$out/report.md"
python3 - "$out/results.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
m = r["matrices"][0]
runs = m["runs"]
started = [t["name"] for t in m["targets"] if t["started"]]
assert "native" in started and any(t.startswith("fusex") for t in started), started
assert len(runs) == len(started) * len(m["workloads"]), f"{len(runs)} runs for {started}"
for run in runs:
    assert run["ok"], run
    m = run["metrics"]
    assert m["iops"] > 0 and run["command"][0].endswith("fio"), run
    for d in ("read", "write"):
        if m[d]:
            assert m[d]["lat_mean_us"] > 0 and m[d]["lat_p99_us"] > 0, run
print(f"smoke: {len(runs)} runs ok; targets {sorted({x['target'] for x in runs})}")
PY
# qcow2 (when this fusex has the qcow2 backend): fusex on fresh qcow2 overlays and on the same data
# as raw, a read and a fill run each, 64 MiB; checks the export and that the fills completed.
if "$fusex" mount --help 2>&1 | grep -q -- '--format' && command -v qemu-img >/dev/null; then
    TMPDIR="$out/tmp" FUSEXBENCH_NO_VENV=1 python3 "$here/run.py" --matrix qcow2 --targets fusex \
        --image qcow2-backing --workloads randread-4k-qd64,randwrite-4k-qd64 \
        --runtime 1 --ramp 0 --rounds 1 --size 64M --fusex "$fusex" --out "$out/qcow2" --strict
    python3 - "$out/qcow2/results.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))["matrices"][0]
started = sorted(t["name"] for t in m["targets"] if t["started"])
assert started == ["fusex", "fusex-raw"], started
assert len(m["runs"]) == 4 and all(r["ok"] and r["metrics"]["iops"] > 0 for r in m["runs"]), m["runs"]
fills = [r["fill"] for r in m["runs"] if "write" in r["workload"]]
assert len(fills) == 2 and all(f["complete"] for f in fills), fills
print(f"smoke: qcow2 {len(m['runs'])} runs ok (fills complete)")
PY
else
    echo "smoke: qcow2 skipped (no --format in \`fusex mount --help\`, or no qemu-img)"
fi
if grep -qF "$out" /proc/self/mountinfo; then
    echo "smoke: something is still mounted:" >&2
    grep -F "$out" /proc/self/mountinfo >&2
    exit 1
fi
echo "smoke: ok (nothing left mounted)"
