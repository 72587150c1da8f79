#!/bin/sh
# fusex's user-space instructions per FUSE request, counted with valgrind's callgrind
# (hardware counters are not available on these VMs): fusex mounted under callgrind with
# --queues 1 --passthrough off --spin-us 0, once per transport (legacy, uring), runs 20000 4k
# random reads and 5000 128k sequential reads (fio psync QD1 O_DIRECT) on a 64 MiB image on
# /dev/shm; a 10-I/O mount of the same transport is the baseline subtracted; the requests come
# from fusex's --stats-file. Prints a markdown table. Root (fusex mounts with mount(2); uring
# needs enable_uring=Y, set for the run and restored). About 2-3 minutes.
#   bash bench/instructions.sh [path/to/fusex] [--transports legacy,uring] [--ios-4k N]
#        [--ios-128k N] [--size 64M] [--spin-us US] [--json FILE] [--fusex-arg=WORD ...]
# Details: bench/fusexbench/instructions.py, docs/benchmarks.md.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" exec python3 -m fusexbench.instructions "$@"
