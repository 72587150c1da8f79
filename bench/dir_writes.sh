#!/bin/bash
# Small writes into a directory export: `dd bs=4k count=N conv=fsync` of a new file, for each
# fusex binary given, all mounted at once over their own subdirectory of one source directory
# (on --disk-dir, ext4 here), rounds interleaved (order rotated). Prints MB/s per round (dd's
# figure) and the median per binary. Measures what a write(2) costs through the mount, e.g.
# the GETXATTR of security.capability the kernel sends before each one unless the server
# handles set-id bits itself (FUSE_HANDLE_KILLPRIV_V2).
#
#   bench/dir_writes.sh [--rounds N] [--count N] [--disk-dir D] [--args "..."] NAME=BINARY...
#
# Default export args: --writable (passthrough as fusex decides). --args "--passthrough off"
# measures writes served by fusex itself.
set -euo pipefail
rounds=5 count=20000 disk=/var/tmp args=""
while [[ $# -gt 0 && $1 == --* ]]; do
    case $1 in
        --rounds) rounds=$2; shift 2 ;;
        --count) count=$2; shift 2 ;;
        --disk-dir) disk=$2; shift 2 ;;
        --args) args=$2; shift 2 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done
[[ $# -gt 0 ]] || { echo "usage: $0 [--rounds N] [--count N] [--disk-dir D] [--args A] NAME=BINARY..." >&2; exit 2; }
work=$(mktemp -d "$disk/fusex-dir-writes.XXXXXX")
names=() bins=() pids=()
for t in "$@"; do names+=("${t%%=*}"); bins+=("${t#*=}"); done
cleanup() {
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    for n in "${names[@]}"; do umount -l "$work/$n.mnt" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT
for i in "${!names[@]}"; do
    n=${names[$i]}
    mkdir -p "$work/src/$n" "$work/$n.mnt"
    # shellcheck disable=SC2086
    "${bins[$i]}" mount --writable $args "$work/src/$n" "$work/$n.mnt" 2> "$work/$n.log" &
    pids+=($!)
done
for n in "${names[@]}"; do
    for _ in $(seq 200); do grep -q mounted "$work/$n.log" && break; sleep 0.05; done
    grep -q mounted "$work/$n.log" || { cat "$work/$n.log" >&2; exit 1; }
done
declare -A results
k=${#names[@]}
for ((r = 0; r < rounds; r++)); do
    for ((j = 0; j < k; j++)); do
        i=$(( (j + r) % k )); n=${names[$i]}
        rm -f "$work/$n.mnt/f"
        sync
        mbs=$(dd if=/dev/zero of="$work/$n.mnt/f" bs=4k count="$count" conv=fsync 2>&1 |
            awk '/copied/ {print $(NF-1)}')
        results[$n]+="$mbs "
        echo "round $((r + 1)) $n: $mbs MB/s"
    done
done
for n in "${names[@]}"; do
    python3 "$(dirname "$0")/summary.py" "$n" MB/s ${results[$n]}
done
