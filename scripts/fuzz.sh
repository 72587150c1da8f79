#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ for FUZZ_SECONDS each (default 600), one after another,
# after installing what is missing (the nightly toolchain through rustup, cargo-fuzz through
# `cargo install --locked`). Each target starts from its corpus in fuzz/corpus/TARGET, topped up
# with the seed requests fuzz/examples/seeds.rs writes (valid INIT, LOOKUP, GETATTR, OPEN, READ,
# WRITE, FALLOCATE, LSEEK, FLUSH, FSYNC, RELEASE, ... with realistic headers). A crash stops the
# run with a non-zero exit; its input is in fuzz/artifacts/TARGET/.
#
# Usage: scripts/fuzz.sh [--setup-only] [TARGET...]
# Environment: FUZZ_SECONDS (per target, default 600), FUZZ_TARGETS (space separated, default all).
set -euo pipefail

cd "$(dirname "$0")/.."
SECONDS_EACH=${FUZZ_SECONDS:-600}
TOOLCHAIN=nightly
setup_only=false
targets=()
for a in "$@"; do
  case "$a" in
    --setup-only) setup_only=true ;;
    *) targets+=("$a") ;;
  esac
done
if [ ${#targets[@]} -eq 0 ]; then
  read -r -a targets <<<"${FUZZ_TARGETS:-decode serve_legacy serve_uring serve_dir nbd_reply qcow2_check image qmp_input}"
fi

command -v rustup >/dev/null || { echo "fuzz: rustup missing (run: make deps)" >&2; exit 1; }
if ! rustup toolchain list | grep -q "^$TOOLCHAIN"; then
  echo "fuzz: installing the $TOOLCHAIN toolchain (cargo-fuzz needs it for the sanitizers)"
  rustup toolchain install "$TOOLCHAIN" --profile minimal
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz: installing cargo-fuzz"
  cargo install --locked cargo-fuzz
fi
$setup_only && exit 0

# Seed requests, written by the same code the stable unit tests run the harness over.
cargo run -q --manifest-path fuzz/Cargo.toml --no-default-features --example seeds -- fuzz/corpus

mkdir -p fuzz/logs
for t in "${targets[@]}"; do
  echo "fuzz: $t for ${SECONDS_EACH}s (log: fuzz/logs/$t.log)"
  # -a: debug assertions (and overflow checks) on, so arithmetic overflow is a crash, not a wrap.
  if ! cargo "+$TOOLCHAIN" fuzz run -a "$t" "fuzz/corpus/$t" -- \
      -max_total_time="$SECONDS_EACH" -print_final_stats=1 -timeout=10 \
      >"fuzz/logs/$t.log" 2>&1; then
    tail -n 60 "fuzz/logs/$t.log" >&2
    echo "fuzz: $t failed; the input is in fuzz/artifacts/$t/ (reproduce: cargo +$TOOLCHAIN fuzz run -a $t FILE)" >&2
    exit 1
  fi
  # The last status line (coverage, features, corpus) and the final execution count.
  grep -E "^#[0-9]+" "fuzz/logs/$t.log" | tail -n 1
  grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "fuzz/logs/$t.log" || true
  echo "fuzz: $t corpus now $(find "fuzz/corpus/$t" -type f | wc -l) inputs"
done
