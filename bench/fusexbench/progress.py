"""A dependency-free progress line on stderr: done/total, elapsed, ETA."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


def fmt_duration(seconds: float) -> str:
    """``75`` -> ``1m15s``; ``3700`` -> ``1h01m``."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


class Progress:
    """Tracks ``total`` jobs; ETA blends the plan with the measured pace.

    On a terminal the line is redrawn in place; otherwise (CI logs) one line
    is printed per job.
    """

    def __init__(self, total: int, est_per_job: float, stream: Optional[TextIO] = None,
                 width: int = 24, clock=time.monotonic) -> None:
        self.total = max(total, 1)
        self.est = est_per_job
        self.stream = stream or sys.stderr
        self.width = width
        self.clock = clock
        self.start = clock()
        self.done = 0
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def eta(self) -> float:
        """Seconds left: remaining jobs x (measured pace, or the estimate)."""
        left = self.total - self.done
        if self.done:
            pace = (self.clock() - self.start) / self.done
        else:
            pace = self.est
        return left * pace

    def line(self, label: str = "") -> str:
        frac = self.done / self.total
        fill = int(round(frac * self.width))
        bar = "#" * fill + "." * (self.width - fill)
        return (f"[{bar}] {self.done}/{self.total} {frac * 100:3.0f}%  "
                f"elapsed {fmt_duration(self.clock() - self.start)}  ETA {fmt_duration(self.eta())}"
                + (f"  {label}" if label else ""))

    def show(self, label: str = "") -> None:
        """Redraw (tty) or print the current state before a job starts."""
        text = self.line(label)
        if self.tty:
            cols = 160
            self.stream.write("\r" + text[:cols] + "\x1b[K")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def step(self, label: str = "") -> None:
        """Mark one job done."""
        self.done += 1
        if self.tty:
            self.show(label)

    def note(self, text: str) -> None:
        """Print a message without garbling the bar."""
        if self.tty:
            self.stream.write("\r\x1b[K")
        self.stream.write(text + "\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
