"""report.md from a results.json: tables of medians, spreads and ratios.

Everything here is a pure function of the stored results (and the list of
plot files), so a report can be re-rendered later with
``run.py --report DIR``.
"""

from __future__ import annotations

import math
import shlex
from typing import Any, Optional

from .machine import machine_label
from .stats import median, metric, per_round_ratios, spread_pct, summarize_matrix

MU = "\u00b5"


# --------------------------------------------------------------------------- formatting


def fmt_sig(v: Optional[float], sig: int = 3) -> str:
    """``v`` with ``sig`` significant digits, no exponent ('-' if missing)."""
    if v is None or not math.isfinite(v):
        return "-"
    if v == 0:
        return "0"
    digits = max(sig - 1 - int(math.floor(math.log10(abs(v)))), 0)
    return f"{v:,.{digits}f}".replace(",", "\u2009") if abs(v) >= 10000 else f"{v:.{digits}f}"


def fmt_count(v: Optional[float]) -> str:
    """IOPS-style: 950, 12.3k, 612k, 1.23M."""
    if v is None or not math.isfinite(v):
        return "-"
    a = abs(v)
    if a >= 1e6:
        return f"{fmt_sig(v / 1e6)}M"
    if a >= 1e3:
        return f"{fmt_sig(v / 1e3)}k"
    if float(v).is_integer():
        return str(int(v))
    return fmt_sig(v)


def fmt_spread(p: Optional[float]) -> str:
    if p is None or not math.isfinite(p):
        return ""
    return f" \u00b1{p:.0f}%"


def fmt_ratio(r: Optional[dict[str, Any]]) -> str:
    """Median per-round ratio, e.g. ``0.83`` (``-`` if none)."""
    if not r or r.get("median") is None:
        return "-"
    return f"{r['median']:.2f}"


def cell(s: Optional[dict[str, Any]], fmt=fmt_count, spread: bool = True) -> str:
    """A summarized metric as ``median ±spread``."""
    if not s or s.get("median") is None:
        return "-"
    show = spread and (s.get("n") or 0) >= 2
    return fmt(s["median"]) + (fmt_spread(s.get("spread_pct")) if show else "")


def table(header: list[str], rows: list[list[str]], align: Optional[list[str]] = None) -> str:
    """A GitHub markdown table."""
    align = align or ["l"] + ["r"] * (len(header) - 1)
    sep = ["---:" if a == "r" else ":---" for a in align]
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def ratio_pairs(targets: list[str]) -> list[tuple[str, str]]:
    """(a, b) pairs shown as a/b: every peer vs native, then every peer pair."""
    peers = [t for t in targets if t != "native"]
    pairs = [(p, "native") for p in peers] if "native" in targets else []
    for i, a in enumerate(peers):
        for b in peers[i + 1:]:
            pairs.append((a, b))
    return pairs


def ratio_table(rows: list[dict[str, Any]], present: list[str], title: str,
                pairs: Optional[list[tuple[str, str]]] = None) -> list[str]:
    """Report lines of the per-workload ratio table for ``pairs`` (default: every pair of ``present``
    targets; none when there is no pair)."""
    pairs = ratio_pairs(present) if pairs is None else pairs
    if not pairs:
        return []
    rr = [[f"`{r['workload']}`"] + [fmt_ratio(r["targets"].get(a, {}).get("ratios", {}).get(b))
                                    for a, b in pairs] for r in rows]
    return ["", title, "", table(["workload"] + [f"{a}/{b}" for a, b in pairs], rr)]


def cmdline(cmd: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)


# --------------------------------------------------------------------------- sections


def header_section(results: dict[str, Any]) -> str:
    m = results.get("machine", {})
    t = results.get("tools", {})
    p = results.get("params", {})
    lines = [
        f"# fusex benchmarks: {results.get('started', '')[:10]} on {m.get('host', '?')}",
        "",
        f"**Machine**: {machine_label(m)}; {m.get('os', '?')}.",
        "",
    ]
    if results.get("interrupted"):
        lines += [f"**Interrupted by {results['interrupted']}: partial results.**", ""]
    bg = m.get("background") or {}
    if (bg.get("busy_cpus") or 0) > 0.25:
        procs = ", ".join(f"{p['comm']} ({p['cpus']:.2f})" for p in bg.get("top", [])[:4])
        lines += [f"**Warning: the machine was busy before the run** ({bg['busy_cpus']:.2f} CPUs in use"
                  + (f": {procs}" if procs else "") + "); figures are less comparable than usual.", ""]
    fuse = m.get("fuse_module") or {}
    tool_rows = [[k, f"`{v}`"] for k, v in t.items() if v]
    lines += [
        f"Runs: {p.get('runtime_s')} s per fio job after {p.get('ramp_s')} s ramp, "
        f"{p.get('rounds')} rounds; all compared targets mounted at once and run interleaved "
        f"(round after round, target order rotated each round). "
        f"Started {results.get('started')}, finished {results.get('finished')}.",
        "",
        "How to read: each figure is the **median over rounds**; `\u00b1n%` is half the range of the "
        "rounds relative to the median; a ratio a/b is the **median of the per-round ratios** of "
        "total IOPS (MiB/s for the file-access test), so >1 means a is faster. "
        f"Latencies are fio total latency (submission + completion) in {MU}s; server CPU is the "
        f"daemons' utime+stime during the measured window divided by the I/Os fio completed.",
        "",
        "<details><summary>Machine and tool versions</summary>",
        "",
        table(["item", "value"], [
            ["kernel", f"`{m.get('kernel')}` `{m.get('kernel_version')}`"],
            ["CPUs", f"{m.get('cpus')} x {m.get('cpu_model')}"],
            ["memory", f"{(m.get('memory_bytes') or 0) / (1 << 30):.1f} GiB"],
            ["virtualization", str(m.get("virtualization"))],
            ["fuse module", ", ".join(f"{k}={v}" for k, v in fuse.items()) or "-"],
            ["fuse max_pages_limit", str(m.get("fuse_max_pages_limit"))],
            ["busy before the run", f"{bg.get('busy_cpus', '?')} CPUs, loadavg {' '.join(bg.get('loadavg', []))}"],
        ] + tool_rows, ["l", "l"]),
        "",
        "</details>",
        "",
    ]
    return "\n".join(lines)


def targets_section(res: dict[str, Any]) -> str:
    rows = []
    for t in res.get("targets", []):
        mounts = [mt for mt in res.get("mounts", []) if mt["target"] == t["name"]]
        cmds = "<br>".join(f"`{cmdline(c)}`" for mt in mounts[:1] for c in mt.get("commands", []))
        cfg = next((mt.get("config") for mt in mounts if mt.get("config")), {}) or {}
        cfg_s = ", ".join(f"{k}={v}" for k, v in cfg.items() if k != "args")
        rows.append([f"**{t['name']}**", t.get("description", ""), cfg_s or "-",
                     cmds or ("(not started)" if not t.get("started") else "-")])
    out = ["#### Targets", "", table(["target", "what", "configuration", "command (first image)"], rows,
                                      ["l", "l", "l", "l"])]
    servers = res.get("servers") or []
    if servers:
        out += ["", "NBD servers (one per image, shared by the clients): " + "; ".join(
            f"`{s['image']}`: `{cmdline(s['command'])}`" for s in servers) + "."]
    images = res.get("images", [])
    if images:
        out += ["", "Images: " + "; ".join(
            f"`{i['label']}` ({i.get('fs', '-')}{', ' + i['note'] if i.get('note') else ''})" for i in images) + "."]
    return "\n".join(out)


def _workload_desc(res: dict[str, Any]) -> dict[str, str]:
    return {w["name"]: w.get("description", "") for w in res.get("workloads", [])}


def row_class(res: dict[str, Any], image: str, workload: str) -> str:
    """``allocating`` for a writing workload on a fresh image (qcow2-sparse, qcow2-backing, FMT-fill), else
    ``other``."""
    img = next((i for i in res.get("images", []) if i.get("label") == image), {})
    wl = next((w for w in res.get("workloads", []) if w.get("name") == workload), {})
    writes = wl.get("rw") not in ("read", "randread")
    return "allocating" if img.get("fresh") and writes else "other"


def incomplete_fills(res: dict[str, Any]) -> set[tuple[str, str, str]]:
    """(image, workload, target) of fill runs that hit their time cap in some round."""
    return {(r["image"], r["workload"], r["target"]) for r in res.get("runs", [])
            if r.get("fill") and not r["fill"].get("complete")}


# Per matrix kind: (figure shown per target, its unit, its format, what the ratio compares).
GOAL_FIGURES = {"fio": ("iops", "IOPS", fmt_count, "IOPS"),
                "fileaccess": ("mib_s", "MiB/s", fmt_sig, "MiB/s"),
                "metadata": ("ops_s", "ops/s", fmt_count, "operations/s")}


def goals_table(res: dict[str, Any], rows: list[dict[str, Any]], image: str) -> list[str]:
    """Report lines of the matrix's goals for one image (none without goals).

    A goal ``{"a", "b", "min", "rows": all|allocating|other}`` asks for the
    median per-round ratio a/b >= min on the rows of that class, of the matrix's primary figure
    (IOPS; MiB/s for the file-access test; operations/s for the metadata matrix).
    """
    kind = res.get("kind", "fio")
    value, unit, fmt, rate = GOAL_FIGURES.get(kind, GOAL_FIGURES["fio"])
    rows = [r for r in rows if r["image"] == image]
    present = {t for r in rows for t in r["targets"]}  # targets that ran on this image
    goals = [g for g in res.get("goals") or [] if g["a"] in present and g["b"] in present]
    if not goals or not rows:
        return []
    pairs: list[tuple[str, str]] = []
    for g in goals:
        if (g["a"], g["b"]) not in pairs:
            pairs.append((g["a"], g["b"]))
    shown: list[str] = []
    for a, b in pairs:
        shown += [t for t in (a, b) if t not in shown]
    capped = incomplete_fills(res)
    bw_all = res.get("bw_columns") == "all"
    met = total = 0
    body = []
    for r in rows:
        cls = row_class(res, image, r["workload"])
        cells = [f"`{r['workload']}`" + (" (alloc.)" if cls == "allocating" else "")]
        for i, t in enumerate(shown):
            mt = r["targets"].get(t, {}).get("metrics", {})
            mark = " \u2021" if (image, r["workload"], t) in capped else ""
            cells.append(cell(mt.get(value), fmt) + mark)
            if kind == "fio" and (i == 0 or bw_all):
                cells.append(cell(mt.get("bw_mib"), fmt_sig, False))
        for a, b in pairs:
            g = next((g for g in goals if (g["a"], g["b"]) == (a, b) and g.get("rows", "all") in ("all", cls)), None)
            ratio = r["targets"].get(a, {}).get("ratios", {}).get(b)
            if g is None:
                cells.append(fmt_ratio(ratio))
                continue
            if not ratio or ratio.get("median") is None:
                cells.append(f"- (\u2265 {g['min']:.2f})")
                continue
            total += 1
            ok = ratio["median"] >= g["min"]
            met += ok
            verdict = "\u2713" if ok else "\u2717"
            cells.append(f"{fmt_ratio(ratio)} {verdict} (\u2265 {g['min']:.2f})")
        body.append(cells)
    header = ["workload"]
    for i, t in enumerate(shown):
        header.append(f"{t} {unit}")
        if kind == "fio" and (i == 0 or bw_all):
            header.append(f"{t} MiB/s")
    header += [f"{a}/{b}" for a, b in pairs]
    out = [f"**Goals**: {met} of {total} met (median per-round {rate} ratio \u2265 the goal in brackets"
           + ("; (alloc.) = allocating writes)" if kind == "fio" else ")"), "", table(header, body)]
    if any(k[0] == image for k in capped):
        out += ["", "\u2021 in some round this fill hit its time cap before writing the whole image "
                "(it then measured mostly the first, allocating writes): the ratio is biased against that target."]
    return out + [""]


def iops_by_round(res: dict[str, Any], image: str, workload: str, target: str) -> dict[int, float]:
    """``target``'s IOPS on one row, by round (successful runs only)."""
    out: dict[int, float] = {}
    for r in res.get("runs", []):
        if (r.get("ok") and r.get("target") == target and r.get("image") == image
                and r.get("workload") == workload):
            v = metric(r, "iops")
            if v is not None:
                out[r["round"]] = v
    return out


def best_by_round(res: dict[str, Any], image: str, workload: str,
                  peers: list[str]) -> dict[int, tuple[str, float]]:
    """Per round, the fastest of ``peers`` on one row and its IOPS."""
    best: dict[int, tuple[str, float]] = {}
    for p in peers:
        for rnd, v in iops_by_round(res, image, workload, p).items():
            if rnd not in best or v > best[rnd][1]:
                best[rnd] = (p, v)
    return best


def balance_ratios(a: dict[int, float], b: dict[int, float]) -> list[float]:
    """Per round, the slower of two targets divided by the faster (1 = equal)."""
    return [min(a[r], b[r]) / max(a[r], b[r]) for r in a if r in b and max(a[r], b[r]) > 0]


def _check(ratios: list[float], goal: Optional[float]) -> dict[str, Any]:
    """Median of per-round ratios, and whether it meets ``goal`` (None: no goal, or no ratio)."""
    med = median(ratios)
    return {"median": med, "rounds": len(ratios), "min": goal,
            "ok": None if goal is None or med is None else med >= goal}


def peer_goal_rows(res: dict[str, Any], image: str) -> list[dict[str, Any]]:
    """The matrix's ``peer_goals`` evaluated on every row of ``image`` (none without them).

    Each row: ``{"workload", "iops": {target: median IOPS}, "best_peer": name, "best_peer_iops",
    "vs_peer": {fusex target: check}, "vs_native": check, "balance": {"a/b": check + "faster"}}``
    where a check is the median of per-round ratios with its goal (see :func:`_check`). The best
    peer of a round is the fastest peer of that round; the row's ``best_peer`` is the one that
    was fastest in most rounds.
    """
    pg = res.get("peer_goals") or {}
    if not pg:
        return []
    fusexes = list(pg.get("fusex", []))
    peers = list(pg.get("peers", []))
    out = []
    workloads = [w["name"] for w in res.get("workloads", [])]
    for wl in workloads:
        best = best_by_round(res, image, wl, peers)
        shown = fusexes + ["native"] + [b for pair in pg.get("balance", []) for b in pair]
        iops = {t: median(iops_by_round(res, image, wl, t).values()) for t in dict.fromkeys(shown)}
        if all(v is None for v in iops.values()) and not best:
            continue
        wins = [name for name, _ in best.values()]
        row: dict[str, Any] = {
            "workload": wl, "iops": iops,
            "best_peer": max(dict.fromkeys(wins), key=wins.count) if wins else None,
            "best_peer_iops": median(v for _, v in best.values()),
            "vs_peer": {}, "balance": {},
        }
        for fx in fusexes:
            fx_r = iops_by_round(res, image, wl, fx)
            row["vs_peer"][fx] = _check(per_round_ratios(fx_r, {r: v for r, (_, v) in best.items()}),
                                        pg.get("vs_peer_min"))
        main = fusexes[0] if fusexes else "fusex"
        row["vs_native"] = _check(per_round_ratios(iops_by_round(res, image, wl, main),
                                                   iops_by_round(res, image, wl, "native")),
                                  (pg.get("vs_native") or {}).get(wl))
        for a, b in pg.get("balance", []):
            ra, rb = iops_by_round(res, image, wl, a), iops_by_round(res, image, wl, b)
            chk = _check(balance_ratios(ra, rb), pg.get("balance_min"))
            ma, mb = median(ra.values()), median(rb.values())
            chk["faster"] = None if ma is None or mb is None else (a if ma >= mb else b)
            row["balance"][f"{a}/{b}"] = chk
        out.append(row)
    return out


def _verdict(chk: dict[str, Any]) -> str:
    """``0.83 ✓ (≥ 0.70)``; without a goal just the ratio; ``- (≥ g)`` when there is no ratio."""
    if chk.get("median") is None:
        return f"- (\u2265 {chk['min']:.2f})" if chk.get("min") is not None else "-"
    text = f"{chk['median']:.2f}"
    if chk.get("ok") is None:
        return text
    return text + (" \u2713" if chk["ok"] else " \u2717") + f" (\u2265 {chk['min']:.2f})"


def peer_goals_table(res: dict[str, Any], image: str) -> list[str]:
    """Report lines of the peer goals (fusex vs best peer, vs native, legacy vs io_uring) of one image."""
    rows = peer_goal_rows(res, image)
    if not rows:
        return []
    pg = res["peer_goals"]
    fusexes = list(pg.get("fusex", []))
    main = fusexes[0] if fusexes else "fusex"
    pairs = [f"{a}/{b}" for a, b in pg.get("balance", [])]
    body = []
    met = total = 0
    for r in rows:
        checks = [r["vs_peer"][fx] for fx in fusexes] + [r["vs_native"]] + [r["balance"][p] for p in pairs]
        for c in checks:
            if c.get("ok") is not None:
                total += 1
                met += bool(c["ok"])
        cells = [f"`{r['workload']}`"] + [fmt_count(r["iops"].get(fx)) for fx in fusexes]
        cells.append(f"{fmt_count(r['best_peer_iops'])} ({r['best_peer'] or '-'})")
        cells += [_verdict(r["vs_peer"][fx]) for fx in fusexes]
        cells.append(_verdict(r["vs_native"]))
        for p in pairs:
            c = r["balance"][p]
            faster = c.get("faster")
            cells.append(_verdict(c) + (f", {faster} faster" if faster and c.get("median") is not None else ""))
        body.append(cells)
    header = (["workload"] + [f"{fx} IOPS" for fx in fusexes] + ["best peer IOPS"]
              + [f"{fx}/best peer" for fx in fusexes] + [f"{main}/native"]
              + [f"{p.replace('/', ' vs ')} (slower/faster)" for p in pairs])
    peers = ", ".join(pg.get("peers", []))
    return [f"**Goals**: {met} of {total} met (median of per-round IOPS ratios \u2265 the goal in brackets; "
            f"best peer = the fastest of {peers} in each round, named by the rounds it won)", "",
            table(header, body), ""]


def _image_kind(res: dict[str, Any], image: str) -> str:
    return next((i.get("kind", "") for i in res.get("images", []) if i.get("label") == image), "")


def scaling_ratios(res: dict[str, Any], target: str, image: str, num: str, den: str) -> list[float]:
    """Per-round IOPS ratios of ``target``'s workload ``num`` to its workload ``den`` on ``image``."""
    by: dict[str, dict[int, float]] = {num: {}, den: {}}
    for r in res.get("runs", []):
        if r.get("ok") and r.get("target") == target and r.get("image") == image and r.get("workload") in by:
            v = metric(r, "iops")
            if v is not None:
                by[r["workload"]][r["round"]] = v
    return per_round_ratios(by[num], by[den])


def scaling_table(res: dict[str, Any], image: str) -> list[str]:
    """Report lines of the matrix's scaling goals (one target, workload vs workload) for one image."""
    goals = [g for g in res.get("scaling_goals") or [] if g["image"] in (image, _image_kind(res, image))]
    body = []
    met = total = 0
    for g in goals:
        rr = scaling_ratios(res, g["target"], image, g["num"], g["den"])
        if not rr:
            continue
        med = median(rr)
        total += 1
        ok = med is not None and med >= g["min"]
        met += ok
        body.append([g["target"], f"`{g['num']}` / `{g['den']}`", f"{med:.1f}" + fmt_spread(spread_pct(rr)),
                     f"{min(rr):.1f}..{max(rr):.1f}", ("\u2713" if ok else "\u2717") + f" (\u2265 {g['min']:.0f})"])
    if not body:
        return []
    return [f"**Scaling goals**: {met} of {total} met (median per-round IOPS ratio of one target's two rows)", "",
            table(["target", "rows", "ratio", "rounds", "goal"], body, ["l", "l", "r", "r", "l"]), ""]


def cpu_roles_table(res: dict[str, Any], rows: list[dict[str, Any]], image: str, present: list[str]) -> list[str]:
    """CPU per I/O split into client and shared NBD server (NBD images only)."""
    runs = [r for r in res.get("runs", []) if r.get("image") == image and r.get("ok") and r.get("cpu_us_per_io_by_role")]
    if not runs:
        return []
    body = []
    for row in rows:
        for t in present:
            rs = [r for r in runs if r["workload"] == row["workload"] and r["target"] == t]
            if not rs:
                continue
            client = median(r["cpu_us_per_io_by_role"].get("client") for r in rs)
            server = median(r["cpu_us_per_io_by_role"].get("nbd_server") for r in rs)
            body.append([f"`{row['workload']}`", t, fmt_sig(client) if client is not None else "-",
                         fmt_sig(server) if server is not None else "-"])
    return ["", f"**CPU per I/O** (median over rounds, {MU}s; client = the FUSE daemon, server = the shared NBD server)",
            "", table(["workload", "target", "client", "NBD server"], body, ["l", "l", "r", "r"])]


def cpu_table(rows: list[dict[str, Any]], present: list[str]) -> list[str]:
    """Server CPU per I/O of every target (median over rounds; native has no server)."""
    shown = [t for t in present if t != "native"]
    body = [[f"`{r['workload']}`"] + [cell(r["targets"].get(t, {}).get("metrics", {}).get("server_cpu_us_per_io"),
                                           fmt_sig, False) for t in shown] for r in rows]
    return ["", f"**Server CPU per I/O** ({MU}s, median over rounds: the daemons' utime+stime in the measured "
            "window / I/Os)", "", table(["workload"] + shown, body)]


def fio_tables(res: dict[str, Any], rows: list[dict[str, Any]], image: str) -> str:
    """Goals (if the matrix has them), IOPS table, ratio table and per-target detail table of one image."""
    targets = [t["name"] for t in res.get("targets", []) if t.get("started")]
    goals = goals_table(res, rows, image) + scaling_table(res, image) + peer_goals_table(res, image)
    rows = [r for r in rows if r["image"] == image]
    present = [t for t in targets if any(t in r["targets"] for r in rows)]
    desc = _workload_desc(res)
    main = []
    for r in rows:
        main.append([f"`{r['workload']}`"] + [cell(r["targets"].get(t, {}).get("metrics", {}).get("iops"))
                                              for t in present])
    out = goals + [f"**IOPS** (read + write; median \u00b1 spread)", "",
                   table(["workload"] + present, main)]
    if res.get("peer_goals") and "native" in present:
        # ten targets make 45 pairs: here only each target vs native (the goal table has fusex vs the
        # peers, the details table every pair)
        out += ratio_table(rows, present, "**Ratios to native** (median of per-round IOPS ratios)",
                           [(t, "native") for t in present if t != "native"])
    else:
        out += ratio_table(rows, present, "**Ratios** (median of per-round IOPS ratios)")
    out += cpu_roles_table(res, rows, image, present)
    if res.get("peer_goals"):
        out += cpu_table(rows, present)
    det = []
    for r in rows:
        for t in present:
            s = r["targets"].get(t)
            if not s:
                continue
            mt = s["metrics"]
            vs_native = fmt_ratio(s["ratios"].get("native")) if t != "native" else ""
            vs_peers = ", ".join(f"{o} {fmt_ratio(v)}" for o, v in s["ratios"].items() if o != "native")
            err = f" ({'; '.join(s['errors'])[:120]})" if s.get("errors") else ""
            det.append([f"`{r['workload']}`", t + err,
                        cell(mt.get("iops")), cell(mt.get("bw_mib"), fmt_sig, False),
                        cell(mt.get("read.lat_mean_us"), fmt_sig, False), cell(mt.get("read.lat_p99_us"), fmt_sig, False),
                        cell(mt.get("write.lat_mean_us"), fmt_sig, False), cell(mt.get("write.lat_p99_us"), fmt_sig, False),
                        cell(mt.get("server_cpu_us_per_io"), fmt_sig, False), vs_native, vs_peers or "-"])
    out += ["", "<details><summary>Details: bandwidth, latency, server CPU, ratios per row</summary>", "",
            table(["workload", "target", "IOPS", "MiB/s", f"read mean {MU}s", f"read p99 {MU}s",
                   f"write mean {MU}s", f"write p99 {MU}s", f"server CPU {MU}s/IO", "vs native", "vs peers"],
                  det, ["l", "l"] + ["r"] * 8 + ["l"]),
            "", "Workloads: " + "; ".join(f"`{r['workload']}` = {desc.get(r['workload'], '')}" for r in rows) + ".",
            "", "</details>"]
    return "\n".join(out)


def fileaccess_tables(res: dict[str, Any], rows: list[dict[str, Any]], image: str) -> str:
    """Time/read-call table and ratios for the passthrough matrix."""
    targets = [t["name"] for t in res.get("targets", []) if t.get("started")]
    rows = [r for r in rows if r["image"] == image]
    present = [t for t in targets if any(t in r["targets"] for r in rows)]
    main = []
    for r in rows:
        cells = []
        for t in present:
            mt = r["targets"].get(t, {}).get("metrics", {})
            calls = mt.get("read_calls", {}).get("median")
            cells.append(cell(mt.get("time_ms"), fmt_sig) + (f" ({fmt_count(calls)})" if calls else ""))
        main.append([f"`{r['workload']}`"] + cells)
    out = goals_table(res, rows, image)
    out += [f"**Time in ms** (read calls), median \u00b1 spread", "", table(["file-size-mode-buffer-cache"] + present, main)]
    out += ratio_table(rows, present, "**Speed ratios** (median of per-round MiB/s ratios; >1 = faster)")
    det = []
    for r in rows:
        for t in present:
            s = r["targets"].get(t)
            if not s:
                continue
            mt = s["metrics"]
            err = f" ({'; '.join(s['errors'])[:120]})" if s.get("errors") else ""
            det.append([f"`{r['workload']}`", t + err, cell(mt.get("mib_s"), fmt_sig),
                        cell(mt.get("us_per_call"), fmt_sig, False),
                        cell(mt.get("server_cpu_us_per_io"), fmt_sig, False)])
    out += ["", "<details><summary>Details: MiB/s, time per read call, server CPU per call</summary>", "",
            table(["workload", "target", "MiB/s", f"{MU}s per read call", f"server CPU {MU}s/call"], det,
                  ["l", "l", "r", "r", "r"]),
            "", "</details>"]
    return "\n".join(out)


def metadata_tables(res: dict[str, Any], rows: list[dict[str, Any]], image: str) -> str:
    """Goals, time table, operations/s and ratio tables for the metadata matrix."""
    targets = [t["name"] for t in res.get("targets", []) if t.get("started")]
    rows = [r for r in rows if r["image"] == image]
    present = [t for t in targets if any(t in r["targets"] for r in rows)]
    timed, rates = [], []
    for r in rows:
        mts = [r["targets"].get(t, {}).get("metrics", {}) for t in present]
        ops = next((m.get("ops", {}).get("median") for m in mts if m.get("ops", {}).get("median")), None)
        name = f"`{r['workload']}`" + (f" ({fmt_count(ops)})" if ops else "")
        timed.append([name] + [cell(m.get("time_ms"), fmt_sig) for m in mts])
        rates.append([name] + [cell(m.get("ops_s")) for m in mts])
    out = goals_table(res, rows, image)
    out += ["**Time in ms** of the whole operation (operations in brackets), median \u00b1 spread", "",
            table(["operation"] + present, timed), "", "**Operations per second**, median \u00b1 spread", "",
            table(["operation"] + present, rates)]
    out += ratio_table(rows, present, "**Speed ratios** (median of per-round operations/s ratios; >1 = faster)")
    out += cpu_table(rows, present)
    desc = _workload_desc(res)
    out += ["", "Operations: " + "; ".join(f"`{r['workload']}` = {desc.get(r['workload'], '')}" for r in rows) + "."]
    return "\n".join(out)


def commands_section(res: dict[str, Any]) -> str:
    """One example command line per workload (first target's run)."""
    seen: dict[str, list[str]] = {}
    for run in res.get("runs", []):
        seen.setdefault(run["workload"], run.get("command", []))
    if not seen:
        return ""
    lines = ["<details><summary>Exact command lines (one per workload; every run's is in results.json)</summary>",
             "", "```"]
    lines += [cmdline(c) for c in seen.values()]
    lines += ["```", "", "</details>"]
    return "\n".join(lines)


def matrix_section(res: dict[str, Any], plots: Optional[list[tuple[str, str]]] = None,
                   plot_note: Optional[str] = None) -> str:
    rows = summarize_matrix(res)
    out = [f"## {res['name']}: {res.get('title', '')}", ""]
    seed = res.get("seed")
    out += [f"Reproduces: {res.get('reproduces', '')}" + (f" (seeds/{seed})" if seed and seed != "-" else "") + ".", ""]
    if res.get("interrupted"):
        out += [f"**Interrupted ({res['interrupted']}); rows may have fewer rounds.**", ""]
    for n in res.get("notes", []):
        out.append(f"- {n}")
    for n in res.get("skipped", []):
        out.append(f"- {n}" if not n.startswith("WARNING") else f"- **{n}**")
    if res.get("notes") or res.get("skipped"):
        out.append("")
    if res.get("fuse_enable_uring"):
        out += [f"FUSE module `enable_uring` during this matrix: {res['fuse_enable_uring']}.", ""]
    out += [targets_section(res), ""]
    images: list[str] = []
    for r in rows:
        if r["image"] not in images:
            images.append(r["image"])
    for image in images:
        info = next((i for i in res.get("images", []) if i["label"] == image), {})
        out += [f"### {res['name']} on `{image}`" + (f" ({info.get('fs')})" if info.get("fs") else ""), ""]
        if res.get("kind") == "fileaccess":
            out += [fileaccess_tables(res, rows, image), ""]
        elif res.get("kind") == "metadata":
            out += [metadata_tables(res, rows, image), ""]
        else:
            out += [fio_tables(res, rows, image), ""]
        for path, caption in (plots or []):
            if f"-{image}-" in path or path.endswith(f"-{image}.png"):
                out += [f"![{caption}]({path})", ""]
    if not rows:
        out += ["No runs completed.", ""]
    if plot_note:
        out += [f"_{plot_note}_", ""]
    out += [commands_section(res), ""]
    return "\n".join(out)


def render_report(results: dict[str, Any], plots: Optional[dict[str, list[tuple[str, str]]]] = None,
                  plot_note: Optional[str] = None) -> str:
    """The whole report.md for one results.json."""
    parts = [header_section(results)]
    for res in results.get("matrices", []):
        parts.append(matrix_section(res, (plots or {}).get(res["name"]), plot_note))
    return "\n".join(parts).rstrip() + "\n"


def summary_tables(results: dict[str, Any]) -> str:
    """Just the main tables (IOPS and ratios) of every matrix, for the terminal."""
    out = []
    for res in results.get("matrices", []):
        rows = summarize_matrix(res)
        images = sorted({r["image"] for r in rows}, key=[r["image"] for r in rows].index)
        for image in images:
            out.append(f"### {res['name']} on `{image}`\n")
            body = {"fileaccess": fileaccess_tables, "metadata": metadata_tables}.get(
                res.get("kind", "fio"), fio_tables)(res, rows, image)
            out.append(body.split("\n<details>")[0].rstrip() + "\n")
    return "\n".join(out)
