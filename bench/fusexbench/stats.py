"""Medians, spread and per-round ratios over the rounds of a matrix.

Runs on this kind of machine vary by up to +-35 % back to back, so every
figure is the median over rounds, the spread says how far the rounds
strayed, and a ratio between two targets is the median of the ratios taken
within each round (the targets of one round ran minutes apart at most,
under the same conditions).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

FIO_METRICS = (
    "iops", "bw_mib",
    "read.iops", "read.bw_mib", "read.lat_mean_us", "read.lat_p99_us",
    "write.iops", "write.bw_mib", "write.lat_mean_us", "write.lat_p99_us",
    "server_cpu_us_per_io",
)
FILEACCESS_METRICS = ("time_ms", "read_calls", "mib_s", "us_per_call", "server_cpu_us_per_io")
METADATA_METRICS = ("time_ms", "ops", "ops_s", "server_cpu_us_per_io")
KIND_METRICS = {"fileaccess": FILEACCESS_METRICS, "metadata": METADATA_METRICS}


def median(values: Iterable[float]) -> Optional[float]:
    """Median of the finite values (None if there are none)."""
    v = sorted(x for x in values if x is not None and math.isfinite(x))
    if not v:
        return None
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2.0


def spread_pct(values: Iterable[float]) -> Optional[float]:
    """Half the range as a percentage of the median: rounds lie within +-spread."""
    v = [x for x in values if x is not None and math.isfinite(x)]
    m = median(v)
    if not v or m is None or m == 0:
        return None
    return (max(v) - min(v)) / 2.0 / abs(m) * 100.0


def summarize(values: list[float]) -> dict[str, Any]:
    """median/min/max/spread of one metric over rounds."""
    v = [x for x in values if x is not None and math.isfinite(x)]
    return {
        "median": median(v),
        "min": min(v) if v else None,
        "max": max(v) if v else None,
        "spread_pct": spread_pct(v),
        "n": len(v),
    }


def metric(run: dict[str, Any], path: str) -> Optional[float]:
    """Value at dotted ``path`` of a run (``read.iops``), None if absent."""
    if path == "server_cpu_us_per_io":
        v = run.get("server_cpu_us_per_io")
        return float(v) if v is not None else None
    cur: Any = run.get("metrics") or {}
    for part in path.split("."):
        if not isinstance(cur, dict) or cur.get(part) is None:
            return None
        cur = cur[part]
    try:
        return float(cur)
    except (TypeError, ValueError):
        return None


def primary_metric(kind: str) -> str:
    """The figure ratios compare (higher is better): IOPS, MiB/s for fileaccess, operations/s for metadata."""
    return {"fileaccess": "mib_s", "metadata": "ops_s"}.get(kind, "iops")


def per_round_ratios(runs_a: dict[int, float], runs_b: dict[int, float]) -> list[float]:
    """a/b for each round where both have a value."""
    out = []
    for r, a in runs_a.items():
        b = runs_b.get(r)
        if a is not None and b and math.isfinite(a) and math.isfinite(b) and b != 0:
            out.append(a / b)
    return out


def row_summary(runs: list[dict[str, Any]], targets: list[str], kind: str) -> dict[str, Any]:
    """Summary of one row (one image x workload) across targets and rounds.

    Returns ``{target: {"metrics": {path: summarize()}, "ratios": {other:
    {"median", "spread_pct", "n"}}, "ok_rounds": n, "errors": [...]}}``.
    Ratios compare the primary metric of ``target`` to ``other`` per round.
    """
    metrics = KIND_METRICS.get(kind, FIO_METRICS)
    prim = primary_metric(kind)
    by_target: dict[str, list[dict[str, Any]]] = {t: [] for t in targets}
    for run in runs:
        if run.get("target") in by_target:
            by_target[run["target"]].append(run)
    prim_by_round: dict[str, dict[int, float]] = {}
    out: dict[str, Any] = {}
    for t, tr in by_target.items():
        ok = [r for r in tr if r.get("ok")]
        out[t] = {
            "metrics": {p: summarize([metric(r, p) for r in ok]) for p in metrics},
            "ok_rounds": len(ok),
            "errors": sorted({r.get("error") or "" for r in tr if not r.get("ok")} - {""}),
        }
        prim_by_round[t] = {r["round"]: metric(r, prim) for r in ok if metric(r, prim) is not None}
    for t in targets:
        ratios = {}
        for other in targets:
            if other == t:
                continue
            rr = per_round_ratios(prim_by_round[t], prim_by_round[other])
            if rr:
                ratios[other] = {"median": median(rr), "spread_pct": spread_pct(rr), "n": len(rr)}
        out[t]["ratios"] = ratios
    return out


def summarize_matrix(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Summary rows of one matrix result (as stored in results.json).

    One row per (image, workload) in run order, each ``{"image", "workload",
    "targets": row_summary(...)}``; targets in the matrix's order.
    """
    kind = result.get("kind", "fio")
    targets = [t["name"] for t in result.get("targets", []) if t.get("started", True)]
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    order: list[tuple[str, str]] = []
    for run in result.get("runs", []):
        key = (run["image"], run["workload"])
        if key not in rows:
            rows[key] = []
            order.append(key)
        rows[key].append(run)
    out = []
    for key in order:
        present = [t for t in targets if any(r["target"] == t for r in rows[key])]
        out.append({"image": key[0], "workload": key[1],
                    "targets": row_summary(rows[key], present, kind)})
    return out
