"""The passthrough matrix's file-access test (bench/fileaccess.c).

The C program reads one file sequentially (``read``) or in a shuffled block
order (``pread``) with a given buffer size, timing the whole pass and
counting read calls, like the test in seeds/004.  This module compiles it
into ``bench/.build/`` and parses its one-line JSON output.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any, Optional

from .fio import format_size

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(BENCH_DIR, "fileaccess.c")
BUILD_DIR = os.path.join(BENCH_DIR, ".build")
BINARY = os.path.join(BUILD_DIR, "fileaccess")


@dataclass(frozen=True)
class FileAccessWorkload:
    """Read a whole file of ``size`` bytes in ``mode`` with ``bufsize`` reads.

    ``cache`` is ``cold`` (page cache dropped first) or ``warm`` (the file
    was read once through the same path just before).
    """

    name: str
    size: int
    mode: str      # seq | rand
    bufsize: int
    cache: str     # cold | warm
    kind: str = field(default="fileaccess", compare=False)

    def describe(self) -> str:
        return (f"{'sequential' if self.mode == 'seq' else 'random'} read of {format_size(self.size)}"
                f" with {format_size(self.bufsize)} buffers, {self.cache} cache")


def build_c(source: str, binary: str, cc: Optional[str] = None) -> str:
    """Compile the C helper ``source`` into ``binary`` unless it is newer; return ``binary``."""
    if os.path.exists(binary) and os.path.getmtime(binary) >= os.path.getmtime(source):
        return binary
    compiler = cc or shutil.which("gcc") or shutil.which("cc")
    if not compiler:
        raise RuntimeError(f"no C compiler (apt-get install gcc) for bench/{os.path.basename(source)}")
    os.makedirs(os.path.dirname(binary), exist_ok=True)
    subprocess.run([compiler, "-O2", "-Wall", "-Wextra", "-o", binary, source], check=True)
    return binary


def build(cc: Optional[str] = None) -> str:
    """Compile fileaccess.c if needed; return the binary path."""
    return build_c(SOURCE, BINARY, cc)


def command(binary: str, path: str, w: FileAccessWorkload, max_seconds: float) -> list[str]:
    """Command line of one measured pass."""
    return [binary, path, w.mode, str(w.bufsize), f"{max_seconds:g}"]


def parse_output(text: str) -> dict[str, Any]:
    """Parse the program's JSON line into the suite's figures.

    ``complete`` is false when the pass hit the time cap; ``time_ms`` is
    then extrapolated to the whole file and ``mib_s``/``us_per_call`` are
    the comparable figures.
    """
    line = next((l for l in reversed(text.strip().splitlines()) if l.startswith("{")), None)
    if line is None:
        raise ValueError(f"no JSON in fileaccess output: {text[:200]!r}")
    d = json.loads(line)
    seconds = d["ns"] / 1e9
    done = d["bytes"]
    total = d.get("size") or done
    mib_s = done / (1 << 20) / seconds if seconds > 0 else float("nan")
    time_ms = d["ns"] / 1e6
    if not d.get("complete", True) and done > 0:
        time_ms = time_ms * total / done
    return {
        "time_ms": time_ms,
        "measured_ms": d["ns"] / 1e6,
        "read_calls": int(d["calls"]),
        "bytes": int(done),
        "size": int(total),
        "complete": bool(d.get("complete", True)),
        "mib_s": mib_s,
        "us_per_call": (d["ns"] / 1e3 / d["calls"]) if d["calls"] else float("nan"),
        "iops": d["calls"] / seconds if seconds > 0 else float("nan"),
        "ios": int(d["calls"]),
    }
