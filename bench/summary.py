#!/usr/bin/env python3
"""One line per binary for the A/B shell benchmarks (appends.sh, dir_writes.sh): the median of
the rounds, half their range relative to it, and the rounds themselves.

    python3 bench/summary.py NAME UNIT VALUE...
"""
import statistics
import sys

name, unit, vals = sys.argv[1], sys.argv[2], [float(v) for v in sys.argv[3:]]
med = statistics.median(vals)
spread = (max(vals) - min(vals)) / med * 100 if med else 0
print(f"{name}: median {med:.0f} {unit} (±{spread / 2:.0f}%), rounds {' '.join(f'{v:.0f}' for v in vals)}")
