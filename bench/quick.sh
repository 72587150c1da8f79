#!/bin/sh
# Quick check: the `quick` matrix, native vs fusex vs qemu-storage-daemon, on a
# 1 GiB image of random bytes on /dev/shm, in one run (3 interleaved rounds of
# 5 s jobs by default); prints the markdown tables and writes
# bench/results/<date>-<host>/. Extra arguments go to run.py, e.g.
#   bench/quick.sh --runtime 2 --rounds 1 --targets native,fusex,qsd,nbdfuse
set -eu
here=$(cd "$(dirname "$0")" && pwd)
py=python3
[ -x "$here/.venv/bin/python3" ] && py="$here/.venv/bin/python3"
exec "$py" "$here/run.py" --matrix quick --targets native,fusex,qsd --image shm --size 1G --print-table "$@"
