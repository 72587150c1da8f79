#!/bin/bash
# Directory-export metadata A/B: both binaries mounted at once (same source filesystem), rounds
# interleaved with the order alternating; untar, find, du, stat walk, rm of a 10k-file tree.
# usage: dircmp.sh ROUNDS NAME=BIN NAME=BIN
set -e
R=$1; shift
base=/var/tmp/dircmp; rm -rf $base; mkdir -p $base
names=(); bins=()
for t in "$@"; do names+=("${t%%=*}"); bins+=("${t#*=}"); done
tar=/work/main/bench/.build/srctree-10000-v1.tar
pids=()
for i in "${!names[@]}"; do
  n=${names[$i]}; mkdir -p $base/$n.src $base/$n.mnt
  ${bins[$i]} mount --writable --daemonize --pid-file $base/$n.pid --log-file $base/$n.log $base/$n.src $base/$n.mnt
done
trap 'for n in "${names[@]}"; do umount -l $base/$n.mnt 2>/dev/null; done' EXIT
t() { local s=$(date +%s%N); "$@" >/dev/null 2>&1; echo $(( ($(date +%s%N)-s)/1000000 )); }
for r in $(seq 1 $R); do
  order=("${!names[@]}"); if (( r % 2 == 0 )); then order=($(printf '%s\n' "${order[@]}" | tac)); fi
  for i in "${order[@]}"; do
    n=${names[$i]}; m=$base/$n.mnt
    sync; echo 3 > /proc/sys/vm/drop_caches
    u=$(t tar -xf $tar -C $m)
    sync; echo 3 > /proc/sys/vm/drop_caches
    f=$(t find $m -type f)
    sync; echo 3 > /proc/sys/vm/drop_caches
    d=$(t du -s $m)
    sync; echo 3 > /proc/sys/vm/drop_caches
    s=$(t find $m -type f -exec stat -c %s {} +)
    x=$(t rm -rf $m/src)
    echo "round $r $n untar $u find $f du $d stat $s rm $x"
  done
done
