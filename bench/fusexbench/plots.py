"""PNG plots (matplotlib, optional): bars per workload, latency per QD, scaling.

Every figure carries the machine it came from in its footer.  Figures are
saved small (80 dpi, 64-colour palette) so they can be committed.
"""

from __future__ import annotations

import math
import os
import re
import textwrap
from typing import Any, Optional

from .machine import machine_label
from .stats import summarize_matrix

FIXED_COLOURS = {"native": "#7f7f7f", "qsd": "#ff7f0e", "qsd-threads": "#ffbb78", "nbdfuse": "#d62728"}
FUSEX_COLOURS = ["#1f77b4", "#2ca02c", "#9467bd", "#17becf", "#8c564b", "#e377c2"]


def available() -> Optional[str]:
    """None if matplotlib can be used, else the reason."""
    try:
        import matplotlib  # noqa: F401  type: ignore

        return None
    except Exception as e:  # noqa: BLE001
        return f"matplotlib not available ({e.__class__.__name__}); run bench/setup.sh for plots"


def colours(targets: list[str]) -> dict[str, str]:
    out, i = {}, 0
    for t in targets:
        if t in FIXED_COLOURS:
            out[t] = FIXED_COLOURS[t]
        else:
            out[t] = FUSEX_COLOURS[i % len(FUSEX_COLOURS)]
            i += 1
    return out


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 8, "axes.titlesize": 9, "legend.fontsize": 7,
                         "axes.grid": True, "grid.alpha": 0.3})
    return plt


def _footer(fig, results: dict[str, Any]) -> None:
    """Machine, date and run parameters in small print at the bottom."""
    label = re.sub(r"\((R|TM)\)", "", machine_label(results.get("machine", {})))
    p = results.get("params", {})
    text = (f"{label} | {results.get('started', '')[:10]} | {p.get('runtime_s'):g} s jobs x "
            f"{p.get('rounds')} rounds: median, whiskers min..max")
    width = int(fig.get_figwidth() * 19)
    fig.text(0.005, 0.005, "\n".join(textwrap.wrap(text, width)), fontsize=6, color="#555555",
             ha="left", va="bottom")


def _save(fig, path: str) -> None:
    fig.savefig(path, dpi=90)
    try:  # shrink: palette PNG
        from PIL import Image

        with Image.open(path) as im:
            q = im.convert("RGB").quantize(colors=64)
        q.save(path, optimize=True)
    except Exception:  # noqa: BLE001 - keep the RGBA file
        pass


def _short(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:.2g}M" if v < 1e7 else f"{v / 1e6:.0f}M"
    if v >= 1e3:
        return f"{v / 1e3:.3g}k"
    return f"{v:.3g}"


def _started(res: dict[str, Any]) -> list[str]:
    return [t["name"] for t in res.get("targets", []) if t.get("started")]


def _med(row: dict[str, Any], target: str, metric: str) -> tuple[Optional[float], Optional[float], Optional[float]]:
    s = row["targets"].get(target, {}).get("metrics", {}).get(metric) or {}
    return s.get("median"), s.get("min"), s.get("max")


def bars(results: dict[str, Any], res: dict[str, Any], rows: list[dict[str, Any]], image: str,
         path: str, metric: str, ylabel: str) -> bool:
    """Grouped bars: one group per workload, one bar per target."""
    plt = _plt()
    rows = [r for r in rows if r["image"] == image]
    targets = [t for t in _started(res) if any(t in r["targets"] for r in rows)]
    if not rows or not targets:
        return False
    col = colours(_started(res))
    n = len(targets)
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(min(max(5.0, 0.55 * len(rows) * max(n, 2) / 2 + 2), 13), 3.9))
    vals_all = []
    label_bars = len(rows) * n <= 48
    for i, t in enumerate(targets):
        xs, ys, lo, hi = [], [], [], []
        for j, r in enumerate(rows):
            m, mn, mx = _med(r, t, metric)
            if m is None:
                continue
            xs.append(j + (i - (n - 1) / 2) * width)
            ys.append(m)
            lo.append(max(m - (mn if mn is not None else m), 0))
            hi.append(max((mx if mx is not None else m) - m, 0))
            vals_all.append(m)
        ax.bar(xs, ys, width, yerr=[lo, hi], label=t, color=col[t], capsize=1.5,
               error_kw={"elinewidth": 0.7, "ecolor": "#333333"})
        if label_bars:
            for x, y, h in zip(xs, ys, hi):
                ax.annotate(_short(y), (x, y + h), xytext=(0, 2), textcoords="offset points", ha="center",
                            va="bottom", fontsize=5.5, rotation=90 if n > 2 else 0, color="#222222")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["workload"] for r in rows], rotation=30 if len(rows) > 4 else 0,
                       ha="right" if len(rows) > 4 else "center")
    positive = [v for v in vals_all if v and v > 0]
    if positive and max(positive) / min(positive) > 30:
        ax.set_yscale("log")
        ylabel += " (log scale)"
    ax.set_ylabel(ylabel)
    ax.set_title(f"{res['name']} on {image}: {ylabel.split(' (')[0]} per workload")
    if ax.get_yscale() == "log":
        lo_, hi_ = ax.get_ylim()
        ax.set_ylim(lo_, hi_ * 2.5)
    else:
        ax.set_ylim(0, ax.get_ylim()[1] * 1.12)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    _footer(fig, results)
    _save(fig, path)
    plt.close(fig)
    return True


def _series(res: dict[str, Any], vary: str) -> list[tuple[str, list[tuple[int, str]]]]:
    """Workload series differing only in ``vary`` (iodepth/numjobs), >= 2 points."""
    groups: dict[tuple, list[tuple[int, str]]] = {}
    labels: dict[tuple, str] = {}
    for w in res.get("workloads", []):
        if w.get("kind") != "fio":
            continue
        key = tuple((k, w.get(k)) for k in ("rw", "bs", "ioengine", "rwmixread", "iodepth", "numjobs") if k != vary)
        groups.setdefault(key, []).append((int(w[vary]), w["name"]))
        mix = f" {w['rwmixread']}/{100 - w['rwmixread']}" if w.get("rwmixread") else ""
        other = f"{w['numjobs']} job(s)" if vary == "iodepth" else f"QD{w['iodepth']}"
        labels[key] = f"{w['rw']}{mix} {w['bs']} {w['ioengine']}, {other}"
    out = []
    for key, pts in groups.items():
        if len({p[0] for p in pts}) >= 2:
            out.append((labels[key], sorted(pts)))
    return out


def _grid(plt, n: int):
    cols = min(3, n)
    rows_ = math.ceil(n / cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(3.3 * cols + 0.4, 2.6 * rows_ + 0.5), squeeze=False)
    for k in range(n, rows_ * cols):
        axes[k // cols][k % cols].set_visible(False)
    return fig, [axes[k // cols][k % cols] for k in range(n)]


def latency_per_qd(results: dict[str, Any], res: dict[str, Any], rows: list[dict[str, Any]], image: str,
                   path: str) -> bool:
    """Mean latency (solid) and p99 (dashed) against queue depth, per series."""
    series = _series(res, "iodepth")
    if not series:
        return False
    plt = _plt()
    rows_by = {r["workload"]: r for r in rows if r["image"] == image}
    targets = _started(res)
    col = colours(targets)
    fig, axes = _grid(plt, len(series))
    for ax, (label, pts) in zip(axes, series):
        for t in targets:
            for metric, style in (("lat_mean_us", "-"), ("lat_p99_us", ":")):
                xs, ys = [], []
                for qd, name in pts:
                    r = rows_by.get(name)
                    if not r:
                        continue
                    m = _med(r, t, f"read.{metric}")[0]
                    if m is None:
                        m = _med(r, t, f"write.{metric}")[0]
                    if m is not None:
                        xs.append(qd)
                        ys.append(m)
                if xs:
                    ax.plot(xs, ys, style, marker="o" if style == "-" else None, ms=3, color=col[t],
                            label=t if style == "-" else None)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("queue depth (iodepth)")
        ax.set_ylabel("latency \u00b5s (read; write if none)")
        ax.set_title(label)
    axes[0].legend(loc="upper left")
    fig.suptitle(f"{res['name']} on {image}: latency per queue depth (solid = mean, dotted = p99)", fontsize=9)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    _footer(fig, results)
    _save(fig, path)
    plt.close(fig)
    return True


def scaling(results: dict[str, Any], res: dict[str, Any], rows: list[dict[str, Any]], image: str,
            path: str) -> bool:
    """IOPS against fusex queue count (if configurations differ), else against fio jobs."""
    plt = _plt()
    rows_img = [r for r in rows if r["image"] == image]
    qtargets = [(t["options"]["queues"], t["name"]) for t in res.get("targets", [])
                if t.get("started") and isinstance(t.get("options"), dict) and t["options"].get("queues")]
    if len({q for q, _ in qtargets}) >= 2 and rows_img:
        qtargets.sort()
        counts = sorted({q for q, _ in qtargets})
        if len(counts) == 2:
            # Two configurations: one bar per workload, the median of per-round ratios.
            (q0, t0), (q1, t1) = qtargets[0], qtargets[-1]
            names, vals, errs = [], [], []
            for r in rows_img:
                rr = r["targets"].get(t1, {}).get("ratios", {}).get(t0)
                if rr and rr.get("median") is not None:
                    names.append(r["workload"])
                    vals.append(rr["median"])
                    sp = rr.get("spread_pct") or 0.0
                    errs.append(rr["median"] * sp / 100.0)
            if not names:
                plt.close("all")
                return False
            fig, ax = plt.subplots(figsize=(6.8, 0.28 * len(names) + 1.4))
            ys = list(range(len(names)))[::-1]
            cols = ["#2ca02c" if v >= 1.0 else "#d62728" for v in vals]
            ax.barh(ys, vals, xerr=errs, color=cols, height=0.65, capsize=1.5,
                    error_kw={"elinewidth": 0.7, "ecolor": "#333333"})
            for y, v, e in zip(ys, vals, errs):
                ax.annotate(f"{v:.2f}x", (v + e, y), xytext=(3, 0), textcoords="offset points", va="center",
                            fontsize=6)
            ax.axvline(1.0, color="#555555", lw=0.8)
            ax.set_yticks(ys)
            ax.set_yticklabels(names)
            ax.set_xlim(0, max([v + e for v, e in zip(vals, errs)] + [1.0]) * 1.15)
            ax.set_xlabel(f"IOPS with {q1} queues / IOPS with {q0} queue{'s' if q0 > 1 else ''} "
                          f"(median of per-round ratios)")
            ax.set_title(f"{res['name']} on {image}: scaling from {q0} to {q1} fusex queues")
        else:
            fig, ax = plt.subplots(figsize=(6.8, 3.9))
            base_q, base_t = qtargets[0]
            for r in rows_img:
                base = _med(r, base_t, "iops")[0]
                xs, ys_ = [], []
                for q, name in qtargets:
                    m = _med(r, name, "iops")[0]
                    if m is not None and base:
                        xs.append(q)
                        ys_.append(m / base)
                if len(xs) >= 2:
                    ax.plot(xs, ys_, marker="o", ms=3, label=r["workload"])
            ax.axhline(1.0, color="#888888", lw=0.8)
            ax.set_xticks(counts)
            ax.set_xlabel("fusex queues")
            ax.set_ylabel(f"IOPS relative to {base_q} queue{'s' if base_q > 1 else ''}")
            ax.set_title(f"{res['name']} on {image}: scaling per fusex queue count")
            ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    else:
        series = _series(res, "numjobs")
        if not series or not rows_img:
            plt.close("all")
            return False
        rows_by = {r["workload"]: r for r in rows_img}
        targets = _started(res)
        col = colours(targets)
        fig, axes = _grid(plt, len(series))
        for ax, (label, pts) in zip(axes, series):
            for t in targets:
                xs, ys = [], []
                for jobs, name in pts:
                    r = rows_by.get(name)
                    m = _med(r, t, "iops")[0] if r else None
                    if m is not None:
                        xs.append(jobs)
                        ys.append(m)
                if xs:
                    ax.plot(xs, ys, marker="o", ms=3, color=col[t], label=t)
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, ax.get_ylim()[1] * 1.1)
            ax.set_xlabel("fio jobs (submitters)")
            ax.set_ylabel("IOPS")
            ax.set_title(label)
        axes[0].legend(loc="best")
        fig.suptitle(f"{res['name']} on {image}: scaling with parallel submitters "
                     f"(one fusex queue configuration)", fontsize=9)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    _footer(fig, results)
    _save(fig, path)
    plt.close(fig)
    return True


def fileaccess_bars(results: dict[str, Any], res: dict[str, Any], rows: list[dict[str, Any]], image: str,
                    path: str) -> bool:
    return bars(results, res, rows, image, path, "mib_s", "MiB/s")


def make_plots(results: dict[str, Any], outdir: str) -> tuple[dict[str, list[tuple[str, str]]], Optional[str]]:
    """Draw every plot of ``results`` into ``outdir``.

    Returns ({matrix: [(file name, caption)]}, note); the note says why there
    are no plots when matplotlib is missing.
    """
    why = available()
    if why:
        return {}, f"Plots skipped: {why}."
    out: dict[str, list[tuple[str, str]]] = {}
    for res in results.get("matrices", []):
        rows = summarize_matrix(res)
        images = []
        for r in rows:
            if r["image"] not in images:
                images.append(r["image"])
        files: list[tuple[str, str]] = []
        for image in images:
            base = f"{res['name']}-{image}-"
            if res.get("kind") == "fileaccess":
                if fileaccess_bars(results, res, rows, image, os.path.join(outdir, base + "bars.png")):
                    files.append((base + "bars.png", f"{res['name']} on {image}: MiB/s per test"))
                continue
            if res.get("kind") == "metadata":
                if bars(results, res, rows, image, os.path.join(outdir, base + "bars.png"), "ops_s", "operations/s"):
                    files.append((base + "bars.png", f"{res['name']} on {image}: operations/s per row"))
                continue
            if bars(results, res, rows, image, os.path.join(outdir, base + "bars.png"), "iops", "IOPS"):
                files.append((base + "bars.png", f"{res['name']} on {image}: IOPS per workload"))
            if latency_per_qd(results, res, rows, image, os.path.join(outdir, base + "latency.png")):
                files.append((base + "latency.png", f"{res['name']} on {image}: latency per queue depth"))
            if scaling(results, res, rows, image, os.path.join(outdir, base + "scaling.png")):
                files.append((base + "scaling.png", f"{res['name']} on {image}: scaling"))
        out[res["name"]] = files
    return out, None
