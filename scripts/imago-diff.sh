#!/usr/bin/env bash
# Prints fusex's patch set on imago as a unified diff: vendor/imago against the published crate
# (which cargo fetches into its registry; `cargo fetch` with the patch removed would, too). With
# --check, fails unless every file the diff touches is listed in vendor/imago/PATCHES.md.
#
# Usage: scripts/imago-diff.sh [--check]
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(sed -n 's/^version = "\(.*\)"/\1/p' vendor/imago/Cargo.toml | head -1)
# The published crate, as cargo keeps it (downloaded with `cargo download`-like means: a crate
# file is a gzipped tarball).
cache="${CARGO_HOME:-$HOME/.cargo}/registry"
crate=$(find "$cache/cache" -name "imago-$version.crate" 2>/dev/null | head -1 || true)
if [ -z "$crate" ]; then
  # Fetch it: a throwaway project depending on exactly this version, without the patch.
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  mkdir -p "$tmp/p/src" && : >"$tmp/p/src/lib.rs"
  printf '[package]\nname = "p"\nversion = "0.0.0"\nedition = "2021"\n[dependencies]\nimago = "=%s"\n' \
    "$version" >"$tmp/p/Cargo.toml"
  cargo fetch -q --manifest-path "$tmp/p/Cargo.toml"
  crate=$(find "$cache/cache" -name "imago-$version.crate" | head -1)
fi
up=$(mktemp -d); trap 'rm -rf "$up" ${tmp:-}' EXIT
tar -xzf "$crate" -C "$up"
diff -ru --exclude=.cargo-ok --exclude=PATCHES.md "$up/imago-$version" vendor/imago \
  | sed "s|$up/imago-$version|imago-$version|" >"$up/patch" || true
if [ "${1:-}" = "--check" ]; then
  missing=0
  while read -r f; do
    grep -q "\`$f\`" vendor/imago/PATCHES.md || { echo "imago-diff: $f differs from imago $version but vendor/imago/PATCHES.md does not list it" >&2; missing=1; }
  done < <(grep -E '^(\+\+\+ vendor/imago/|Only in vendor/imago)' "$up/patch" \
    | sed -E 's|^\+\+\+ vendor/imago/([^[:space:]]+).*|\1|; s|^Only in vendor/imago/?([^:]*): (.*)|\1/\2|; s|^/||')
  exit $missing
fi
cat "$up/patch"
