#!/usr/bin/env bash
# The end-to-end suite (tests/, package fusex-e2e) once per transport.
#
# The fusex binary and the test binaries are built with the whole workspace selected, as
# `make unit` selects it: Cargo unifies features over the selected packages, so this reuses the
# unit tests' build of every crate (`cargo build -p fusex` and `cargo test -p fusex-e2e`
# compiled clap, serde_json, imago and the backend again, with other features). Then each pass
# runs every binary, four tests at a time, from tests/ (where `cargo test` would run them), and
# the failed binaries are listed at the end.
#   E2E_TRANSPORTS="legacy uring"  the passes to run (FUSE-over-io_uring needs enable_uring=Y)
#   E2E_TEST_THREADS=4              tests at once within a binary
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
transports=${E2E_TRANSPORTS:-legacy uring}
threads=${E2E_TEST_THREADS:-4}
# Binaries whose tests name their transports themselves (or mount nothing, or only through
# `fusex serve`, whose exports choose their own): the first pass runs them, a second would
# repeat it.
once=" uring install serve top "

# Build (errors shown as cargo shows them), then learn the test binaries from cargo's report.
cargo build --locked --workspace --bins --tests
mapfile -t bins < <(cargo test --locked --workspace --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if (m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]
            and "/tests#fusex-e2e@" in m["package_id"]):
        print(m["executable"])
')
if [ ${#bins[@]} -eq 0 ]; then
    echo "e2e: cargo reported no test binaries of fusex-e2e" >&2
    exit 1
fi

failed=()
first=1
for t in $transports; do
    for b in "${bins[@]}"; do
        name=$(basename "$b")
        if [ $first = 0 ] && [[ "$once" == *" ${name%-*} "* ]]; then
            continue
        fi
        echo "     Running ${name%-*} (FUSEX_E2E_TRANSPORT=$t)"
        if ! (cd "$root/tests" && FUSEX_E2E_TRANSPORT=$t "$b" --test-threads="$threads"); then
            failed+=("$t: ${name%-*}")
        fi
    done
    first=0
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "e2e: failed:" >&2
    printf '  %s\n' "${failed[@]}" >&2
    exit 1
fi
echo "e2e: every binary passed on: $transports"
