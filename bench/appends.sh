#!/bin/bash
# Appends: sequential 128k O_DIRECT writes past EOF on a growable export of an empty image on
# /dev/shm, for each fusex binary given, all mounted at once, rounds interleaved (order rotated).
# Prints MiB/s per round and the median per binary.
#
#   bench/appends.sh [--rounds N] [--size 512M] [--args "..."] NAME=BINARY [NAME=BINARY...]
#
# Default export args: --passthrough off (with passthrough a growable export's writes go from the
# kernel to the image, not through fusex). Pass --args "" to measure the default configuration.
set -euo pipefail
rounds=5 size=512M args="--passthrough off"
while [[ $# -gt 0 && $1 == --* ]]; do
    case $1 in
        --rounds) rounds=$2; shift 2 ;;
        --size) size=$2; shift 2 ;;
        --args) args=$2; shift 2 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done
[[ $# -gt 0 ]] || { echo "usage: $0 [--rounds N] [--size S] [--args A] NAME=BINARY..." >&2; exit 2; }
work=$(mktemp -d /dev/shm/fusex-appends.XXXXXX)
names=() bins=() pids=()
for t in "$@"; do names+=("${t%%=*}"); bins+=("${t#*=}"); done
cleanup() {
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    for n in "${names[@]}"; do umount -l "$work/$n.mnt" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT
declare -A results
for ((r = 0; r < rounds; r++)); do
    pids=()
    for i in "${!names[@]}"; do
        n=${names[$i]}
        : > "$work/$n.img"
        # shellcheck disable=SC2086
        "${bins[$i]}" mount --writable --growable $args "$work/$n.img" "$work/$n.mnt" 2> "$work/$n.log" &
        pids+=($!)
    done
    for n in "${names[@]}"; do
        for _ in $(seq 200); do grep -q mounted "$work/$n.log" && break; sleep 0.05; done
    done
    k=${#names[@]}
    for ((j = 0; j < k; j++)); do
        i=$(( (j + r) % k )); n=${names[$i]}
        bw=$(fio --name=append --filename="$work/$n.mnt" --rw=write --bs=128k --direct=1 \
            --ioengine=psync --size="$size" --file_append=1 --fallocate=none --output-format=json 2>/dev/null |
            python3 -c 'import json,sys; print(round(json.load(sys.stdin)["jobs"][0]["write"]["bw"]/1024))')
        results[$n]+="$bw "
        echo "round $((r + 1)) $n: $bw MiB/s"
    done
    for p in "${pids[@]}"; do kill -TERM "$p"; done
    for p in "${pids[@]}"; do wait "$p" || true; done
    pids=()
done
for n in "${names[@]}"; do
    python3 "$(dirname "$0")/summary.py" "$n" MiB/s ${results[$n]}
done
