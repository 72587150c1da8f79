"""fio workloads: command-line building and JSON result parsing.

Every fio run of the suite uses ``--output-format=json`` with
``--group_reporting`` so one job entry carries the figures of all
``numjobs`` clones; :func:`parse_fio_json` turns that entry into the flat
figures the report uses (IOPS, MiB/s, mean and p99 latency per direction).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

MIB = 1024 * 1024

#: fio options every workload gets (besides name/filename/size/time).
COMMON_OPTIONS: tuple[str, ...] = (
    "--direct=1",
    "--group_reporting",
    "--randrepeat=0",
    "--lat_percentiles=1",
    "--fallocate=none",
    "--allow_file_create=0",
    "--output-format=json",
)


@dataclass(frozen=True)
class FioWorkload:
    """One fio job description (what to run, not where).

    ``rw`` is fio's ``--rw`` (read, randread, write, randwrite, rw, randrw);
    ``rwmixread`` applies to the mixed modes only.
    """

    name: str
    rw: str
    bs: str
    iodepth: int
    numjobs: int = 1
    ioengine: str = "io_uring"
    rwmixread: Optional[int] = None
    kind: str = field(default="fio", compare=False)

    def options(self) -> list[str]:
        """The workload-specific fio options (no filename/size/time)."""
        opts = [
            f"--rw={self.rw}",
            f"--bs={self.bs}",
            f"--ioengine={self.ioengine}",
            f"--iodepth={self.iodepth}",
            f"--numjobs={self.numjobs}",
        ]
        if self.rwmixread is not None and self.rw in ("rw", "randrw", "readwrite"):
            opts.append(f"--rwmixread={self.rwmixread}")
        return opts

    @property
    def writes(self) -> bool:
        """True if the workload writes (write, randwrite, rw, randrw, ...)."""
        return self.rw not in ("read", "randread")

    def series_key(self, vary: str) -> tuple[Any, ...]:
        """Key shared by workloads that differ only in ``vary``.

        ``vary`` is ``"iodepth"`` or ``"numjobs"``; used to draw latency per
        queue depth and scaling curves.
        """
        d = asdict(self)
        d.pop("name")
        d.pop("kind")
        d.pop(vary)
        return tuple(sorted(d.items()))

    def series_label(self, vary: str) -> str:
        """Human label of the series this workload belongs to (see series_key)."""
        parts = [self.rw]
        if self.rwmixread is not None and self.rw in ("rw", "randrw"):
            parts.append(f"{self.rwmixread}/{100 - self.rwmixread}")
        parts.append(self.bs)
        parts.append(self.ioengine)
        if vary != "iodepth":
            parts.append(f"QD{self.iodepth}")
        if vary != "numjobs":
            parts.append(f"{self.numjobs} job" + ("s" if self.numjobs > 1 else ""))
        return " ".join(parts)

    def describe(self) -> str:
        """One-line human description."""
        mix = f" {self.rwmixread}/{100 - self.rwmixread}" if self.rwmixread is not None else ""
        return (f"{self.rw}{mix} bs={self.bs} {self.ioengine} QD{self.iodepth}"
                f" x{self.numjobs} job{'s' if self.numjobs > 1 else ''}")


def fio_command(
    workload: FioWorkload,
    filename: str,
    size_bytes: int,
    runtime_s: float,
    ramp_s: float,
    fio_bin: str = "fio",
    output: Optional[str] = None,
    time_based: bool = True,
) -> list[str]:
    """Build the exact fio command line for one run.

    ``output`` (a path) sends the JSON to a file instead of stdout, which
    keeps it free of stray warnings.  Without ``time_based`` each job goes
    over the file once (every block exactly once, random order for the
    random modes) and ``runtime_s`` only caps it.
    """
    cmd = [fio_bin, f"--name={workload.name}", f"--filename={filename}"]
    cmd += workload.options()
    cmd += [f"--size={size_bytes}"] + (["--time_based"] if time_based else []) + [f"--runtime={_secs(runtime_s)}"]
    if ramp_s > 0:
        cmd.append(f"--ramp_time={_secs(ramp_s)}")
    cmd += list(COMMON_OPTIONS)
    if output:
        cmd.append(f"--output={output}")
    return cmd


def _secs(value: float) -> str:
    """fio time value: integer seconds when whole, else milliseconds."""
    if float(value).is_integer():
        return f"{int(value)}s"
    return f"{int(round(value * 1000))}ms"


def extract_json(text: str) -> dict[str, Any]:
    """Parse fio's JSON output, tolerating warnings printed before it."""
    start = text.find("{")
    if start < 0:
        raise ValueError("no JSON object in fio output")
    return json.loads(text[start:])


def _percentile(lat: dict[str, Any], pct: str) -> Optional[float]:
    table = lat.get("percentile") or {}
    for key, value in table.items():
        try:
            if abs(float(key) - float(pct)) < 1e-9:
                return float(value)
        except ValueError:
            continue
    return None


def parse_direction(d: dict[str, Any]) -> Optional[dict[str, float]]:
    """Figures of one fio direction block (``read``/``write``); None if idle.

    Latencies are total latency (submission + completion) in microseconds;
    p99 comes from ``lat_ns`` percentiles (``--lat_percentiles=1``) and
    falls back to ``clat_ns`` for output produced without that option.
    """
    ios = int(d.get("total_ios", 0) or 0)
    if ios <= 0 and float(d.get("iops", 0) or 0) <= 0:
        return None
    lat = d.get("lat_ns") or {}
    clat = d.get("clat_ns") or {}
    p99 = _percentile(lat, "99") if lat else None
    p99_src = "lat"
    if p99 is None:
        p99 = _percentile(clat, "99")
        p99_src = "clat"
    mean = lat.get("mean") if lat.get("N") or lat.get("mean") else clat.get("mean")
    bw_bytes = d.get("bw_bytes")
    if bw_bytes is None:
        bw_bytes = float(d.get("bw", 0)) * 1024  # KiB/s in old fio
    return {
        "iops": float(d.get("iops", 0.0)),
        "bw_mib": float(bw_bytes) / MIB,
        "lat_mean_us": float(mean) / 1000.0 if mean is not None else float("nan"),
        "lat_p99_us": p99 / 1000.0 if p99 is not None else float("nan"),
        "p99_of": p99_src,
        "ios": ios,
        "io_bytes": int(d.get("io_bytes", 0) or 0),
        "runtime_ms": int(d.get("runtime", 0) or 0),
    }


def parse_fio_json(data: dict[str, Any] | str) -> dict[str, Any]:
    """Flatten fio JSON (one group-reported job) into the suite's figures.

    Returns ``{"read": {...} | None, "write": {...} | None, "iops": total,
    "bw_mib": total, "ios": total, "usr_cpu": %, "sys_cpu": %, "error": n,
    "fio_version": str}``.  Several job entries (no group reporting) are
    summed (IOPS, bandwidth, ios) and averaged (latency, weighted by ios).
    """
    if isinstance(data, str):
        data = extract_json(data)
    jobs = data.get("jobs") or []
    if not jobs:
        raise ValueError("fio JSON has no jobs")
    out: dict[str, Any] = {"fio_version": data.get("fio version", "")}
    for direction in ("read", "write"):
        parts = [p for p in (parse_direction(j.get(direction, {})) for j in jobs) if p]
        out[direction] = _merge(parts) if parts else None
    out["iops"] = sum(out[d]["iops"] for d in ("read", "write") if out[d])
    out["bw_mib"] = sum(out[d]["bw_mib"] for d in ("read", "write") if out[d])
    out["ios"] = sum(out[d]["ios"] for d in ("read", "write") if out[d])
    out["usr_cpu"] = sum(float(j.get("usr_cpu", 0)) for j in jobs)
    out["sys_cpu"] = sum(float(j.get("sys_cpu", 0)) for j in jobs)
    out["error"] = max(int(j.get("error", 0) or 0) for j in jobs)
    return out


def _merge(parts: list[dict[str, float]]) -> dict[str, float]:
    if len(parts) == 1:
        return parts[0]
    ios = sum(p["ios"] for p in parts) or 1
    merged = {
        "iops": sum(p["iops"] for p in parts),
        "bw_mib": sum(p["bw_mib"] for p in parts),
        "lat_mean_us": sum(p["lat_mean_us"] * p["ios"] for p in parts) / ios,
        "lat_p99_us": max(p["lat_p99_us"] for p in parts),
        "p99_of": parts[0]["p99_of"],
        "ios": sum(p["ios"] for p in parts),
        "io_bytes": sum(p["io_bytes"] for p in parts),
        "runtime_ms": max(p["runtime_ms"] for p in parts),
    }
    return merged


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Parse ``1G``, ``512M``, ``4k``, ``4096`` (powers of 1024) to bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"bad size: {text!r}")
    mult = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * mult)


def format_size(n: int) -> str:
    """Inverse of parse_size for exact multiples: 1073741824 -> '1G'."""
    for suffix, mult in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{suffix}"
    return str(n)
