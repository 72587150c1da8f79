#!/usr/bin/env python3
"""fusex benchmark runner.

Runs a matrix of fio workloads (or the file-access test) against several
targets mounted side by side, interleaved round after round, and writes
``bench/results/<date>-<host>/`` with results.json, report.md and PNG plots.

Examples::

    python3 bench/run.py --matrix quick --targets native,fusex,qsd,nbdfuse
    python3 bench/run.py --matrix all --runtime 3 --rounds 3
    python3 bench/run.py --matrix multiqueue --image shm,null --workloads aio
    python3 bench/run.py --matrix qcow2 --image qcow2-sparse --workloads write
    python3 bench/run.py --matrix formats --image vdi-full,vdi-fill --print-table
    python3 bench/run.py --matrix nbd --rounds 5 --print-table
    python3 bench/run.py --matrix dirfs,metadata --fileaccess-cap 120 --print-table
    python3 bench/run.py --report bench/results/2025-11-23-vm     # re-render
    python3 bench/run.py --list

Ctrl-C (or SIGTERM) stops the current run, unmounts everything and still
writes the partial results.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import shutil
import socket
import sys
import tempfile
from typing import Any, Optional

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)
sys.path.insert(0, BENCH_DIR)


def _maybe_reexec_in_venv() -> None:
    """Use bench/.venv (which has matplotlib) when the current Python lacks it."""
    venv_py = os.path.join(BENCH_DIR, ".venv", "bin", "python3")
    if os.environ.get("FUSEXBENCH_NO_VENV") or not os.path.exists(venv_py):
        return
    if os.path.realpath(sys.prefix) == os.path.realpath(os.path.join(BENCH_DIR, ".venv")):
        return
    try:
        import matplotlib  # noqa: F401  type: ignore

        return
    except ImportError:
        pass
    os.environ["FUSEXBENCH_NO_VENV"] = "1"
    os.execv(venv_py, [venv_py, os.path.abspath(__file__), *sys.argv[1:]])


from fusexbench import machine, matrices, plots, report  # noqa: E402
from fusexbench.fio import parse_size  # noqa: E402
from fusexbench.images import Image, bytes_needed, shm_room, sweep_stale  # noqa: E402
from fusexbench.runner import Options, plan, run_matrix  # noqa: E402
from fusexbench.targets import (Interrupted, Tools, catalogue, force_unmount, mounts_under,  # noqa: E402
                                parse_define, signal_guard, unavailable_reason)

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Matrices: " + ", ".join(matrices.MATRICES) + ", all. "
                                       "Targets: " + ", ".join(catalogue()) + ".")
    p.add_argument("--matrix", default="quick", help="matrix name(s), comma-separated, or 'all' (default quick)")
    p.add_argument("--targets", help="comma-separated targets; 'fusex' expands to the matrix's fusex "
                                     "configurations (default: the matrix's own list)")
    p.add_argument("--runtime", type=float, default=5.0, help="seconds per fio job (default 5)")
    p.add_argument("--ramp", type=float, default=1.0, help="fio ramp seconds before measuring (default 1)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--image", help="image kinds shm,disk,null,tree,qcow2-full,qcow2-sparse,qcow2-backing,"
                                   "{vmdk,vpc,vdi,vhdx}-{full,fill},nbd,nbd-delay "
                                   "(default: the matrix's own; quick: shm)")
    p.add_argument("--size", default="1G", help="image size for fio matrices (default 1G)")
    p.add_argument("--disk-dir", default="/var/tmp", help="directory for 'disk' images (default /var/tmp)")
    p.add_argument("--workloads", help="only workloads whose name matches one of these comma patterns")
    p.add_argument("--fusex", help="fusex binary (default: $FUSEX, target/release/fusex, PATH)")
    p.add_argument("--define", action="append", default=[], metavar="NAME=KIND:ARGS",
                   help="extra target configuration, e.g. 'fusex-qd8=fusex:--queue-depth 8', "
                        "'old=fusex@/path/to/fusex:--passthrough off'; the argument format=raw gives it a raw "
                        "file of the same data on the qcow2 and other format images ('qsd-raw=qsd:format=raw')")
    p.add_argument("--fileaccess-cap", type=float, help="seconds cap per file-access pass (default 2 x runtime)")
    p.add_argument("--fill-cap", type=float,
                   help="seconds cap of a fill run (writing workloads on qcow2-sparse/qcow2-backing/*-fill: the whole "
                        "image once; default max(12 x runtime, 30))")
    p.add_argument("--meta-files", type=int, default=100_000,
                   help="metadata matrix: small files of the create/stat/readdir/unlink tree (default 100000)")
    p.add_argument("--tree-files", type=int, default=50_000,
                   help="metadata matrix: files of the synthetic source tree for untar/find/du/git status "
                        "(default 50000)")
    p.add_argument("--no-rotate", action="store_true", help="same target order in every round")
    p.add_argument("--fuse-uring", choices=("auto", "on", "off"), default="auto",
                   help="fuse's enable_uring: auto = set Y (root) only during matrices that compare transports "
                        "(uring), on = for the whole run, off = leave it; always restored afterwards")
    p.add_argument("--out", help="results directory (default bench/results/<date>-<host>[-n])")
    p.add_argument("--print-table", action="store_true", help="print the main markdown tables to stdout")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 if a requested target did not start or any run failed (CI smoke)")
    p.add_argument("--report", metavar="DIR", help="only re-render report.md and plots of DIR/results.json")
    p.add_argument("--list", action="store_true", help="list matrices, workloads and targets, then exit")
    p.add_argument("--dry-run", action="store_true", help="show the plan (targets, workloads, time), run nothing")
    return p.parse_args(argv)


def find_fusex(explicit: Optional[str]) -> Optional[str]:
    """The fusex binary to benchmark."""
    for cand in (explicit, os.environ.get("FUSEX"), os.path.join(REPO_DIR, "target", "release", "fusex")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return os.path.abspath(cand)
    if explicit:
        return None
    return shutil.which("fusex")


def freeze_binary(path: str, workdir: str) -> dict[str, str]:
    """Copy the fusex binary into the run's workdir so a rebuild during the run cannot mix builds.

    Returns {"path": copy, "sha256": digest, "mtime": iso time of the original}.
    """
    dst = os.path.join(workdir, "fusex")
    h = hashlib.sha256()
    with open(path, "rb") as src, open(dst, "wb") as out:
        for chunk in iter(lambda: src.read(1 << 20), b""):
            h.update(chunk)
            out.write(chunk)
    os.chmod(dst, 0o755)
    mtime = dt.datetime.fromtimestamp(os.path.getmtime(path)).astimezone().isoformat(timespec="seconds")
    return {"path": dst, "sha256": h.hexdigest(), "mtime": mtime}


def results_dir(root: str, host: str) -> str:
    """bench/results/<date>-<host>, with -2, -3... if it exists."""
    base = os.path.join(root, f"{dt.date.today().isoformat()}-{host}")
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def render(outdir: str, results: dict[str, Any]) -> str:
    """Write report.md (and plots) for ``results`` into ``outdir``; return the report path."""
    files, note = plots.make_plots(results, outdir)
    text = report.render_report(results, files, note)
    path = os.path.join(outdir, "report.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def dump_results(results: dict[str, Any]) -> str:
    """results.json text: indented, but one line per run (compact, diff-friendly)."""
    runs_by: dict[str, list[dict[str, Any]]] = {}
    shallow = dict(results)
    shallow["matrices"] = []
    for i, res in enumerate(results.get("matrices", [])):
        key = f"@@runs-{i}@@"
        runs_by[key] = res.get("runs", [])
        shallow["matrices"].append({**res, "runs": key})
    text = json.dumps(shallow, indent=1, default=str)
    for key, runs in runs_by.items():
        body = ",\n".join("   " + json.dumps(r, separators=(",", ":"), default=str) for r in runs)
        text = text.replace(json.dumps(key), "[\n" + body + "\n  ]" if runs else "[]")
    return text + "\n"


def write_json(outdir: str, results: dict[str, Any]) -> None:
    tmp = os.path.join(outdir, "results.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(dump_results(results))
    os.replace(tmp, os.path.join(outdir, "results.json"))


def list_all(opts: Options, tools: Tools) -> None:
    for m in matrices.resolve("all"):
        specs, notes, wls = plan(m, opts, tools)
        print(f"{m.name}: {m.title} [{m.seed}] images={','.join(m.images)} "
              f"targets={','.join(s.name for s in specs)}")
        for n in notes:
            print(f"    note: {n}")
        for w in wls:
            print(f"    {w.name:28} {w.describe()}")
    print("targets:")
    for s in opts.catalogue.values():
        print(f"    {s.name:16} {s.kind:8} {' '.join(s.args):22} {s.description}")


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.report:
        with open(os.path.join(args.report, "results.json"), encoding="utf-8") as f:
            results = json.load(f)
        print(render(args.report, results))
        return 0

    cat = catalogue()
    for d in args.define:
        spec = parse_define(d)
        cat[spec.name] = spec
    opts = Options(runtime=args.runtime, ramp=args.ramp, rounds=args.rounds,
                   images=[i.strip() for i in args.image.split(",")] if args.image else None,
                   size=parse_size(args.size), disk_dir=args.disk_dir, workloads=args.workloads,
                   targets=[t.strip() for t in args.targets.split(",")] if args.targets else None,
                   fileaccess_cap=args.fileaccess_cap, rotate=not args.no_rotate, catalogue=cat,
                   fuse_uring=args.fuse_uring, fill_cap=args.fill_cap,
                   meta_files=args.meta_files, tree_files=args.tree_files)
    fusex = find_fusex(args.fusex)
    tools = Tools.discover(fusex)
    try:
        mats = matrices.resolve(args.matrix)
    except KeyError as e:
        print(f"run.py: {e.args[0]}", file=sys.stderr)
        return 2
    if args.list:
        list_all(opts, tools)
        return 0
    if any(m.kind == "fio" for m in mats) and not shutil.which("fio"):
        print("run.py: fio not found (bench/setup.sh installs it)", file=sys.stderr)
        return 2

    total = 0.0
    shm_need = 0
    for m in mats:
        specs, notes, wls = plan(m, opts, tools)
        kinds = opts.images or list(m.images)
        # Matrices run one after another, each removing its images: the largest one counts.
        shm_need = max(shm_need, bytes_needed(kinds, m.image_sizes(opts.size, wls), len(specs)))
        n = 0
        for kind in kinds:
            probe = Image(kind=kind, size=opts.size)
            mounts = sum(1 for s in specs if unavailable_reason(s, probe, tools) is None)
            # fio workloads run on every image; file-access ones on the image of their size
            n += mounts * len(wls) * opts.rounds
        secs = matrices.estimate_seconds(m, n, opts.runtime, opts.ramp, opts.cap(), opts.meta_scale())
        total += secs
        print(f"{m.name}: targets {','.join(s.name for s in specs) or '(none)'}; {len(wls)} workloads; "
              f"images {','.join(kinds)}; ~{n} runs, ~{secs / 60:.1f} min", file=sys.stderr)
        for note in notes:
            print(f"  note: {note}", file=sys.stderr)
    print(f"estimated total: {total / 60:.1f} min", file=sys.stderr)
    if args.dry_run:
        return 0
    room = shm_room()
    if shm_need > room:
        print(f"run.py: the images need up to {shm_need / (1 << 30):.1f} GiB in /dev/shm, which has room for "
              f"{max(room, 0) / (1 << 30):.1f} GiB (free memory less 2 GiB): lower --size or run fewer --image "
              "kinds at a time", file=sys.stderr)
        return 2

    host = socket.gethostname().split(".")[0]
    outdir = os.path.abspath(args.out) if args.out else results_dir(os.path.join(BENCH_DIR, "results"), host)
    os.makedirs(outdir, exist_ok=True)
    stale = sweep_stale([tempfile.gettempdir(), "/dev/shm", opts.disk_dir], lambda p: bool(mounts_under(p)))
    for path in stale:
        print(f"removed stale {path} (from a killed run)", file=sys.stderr)
    workdir = tempfile.mkdtemp(prefix=f"fusexbench-{os.getpid()}-")
    tag = os.path.basename(workdir).replace("fusexbench-", "")
    frozen = freeze_binary(fusex, workdir) if fusex else None
    if frozen:
        tools.fusex = frozen["path"]
    results: dict[str, Any] = {
        "schema": 1,
        "suite": "fusexbench",
        "started": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "finished": None,
        "host": host,
        "command": [os.path.relpath(sys.argv[0], REPO_DIR) if sys.argv else "run.py", *(argv or sys.argv[1:])],
        "machine": {**machine.machine_info(), "background": machine.background_load()},
        "tools": {**machine.tool_versions(fusex, REPO_DIR),
                  **({"fusex_sha256": frozen["sha256"], "fusex_mtime": frozen["mtime"]} if frozen else {})},
        "fusex_help": tools.fusex_help,
        "params": opts.to_json(),
        "matrices": [],
        "interrupted": None,
    }
    bg = results["machine"]["background"]
    if bg.get("busy_cpus", 0) > 0.25:
        print(f"run.py: WARNING: the machine is busy before the run ({bg['busy_cpus']} CPUs; top: "
              + ", ".join(f"{p['comm']}[{p['pid']}] {p['cpus']}" for p in bg.get("top", [])[:4])
              + "): results will be noisy", file=sys.stderr)
    uring_old: Optional[str] = None
    code = 0
    try:
        with signal_guard():
            if args.fuse_uring == "on":
                uring_old = machine.set_fuse_uring("Y")
                results["machine"]["fuse_module"]["enable_uring"] = "Y (set by --fuse-uring on)"
            for m in mats:
                try:
                    res = run_matrix(m, opts, tools, workdir, tag, lambda s: print(s, file=sys.stderr))
                except Interrupted as e:
                    results["matrices"].append(getattr(e, "result", {"name": m.name, "runs": []}))
                    raise
                results["matrices"].append(res)
                write_json(outdir, results)
    except Interrupted as e:
        results["interrupted"] = str(e).split()[-1]
        print(f"\nrun.py: {e}; everything unmounted, writing partial results", file=sys.stderr)
        code = 128 + e.signum
    finally:
        for mnt in mounts_under(workdir):
            force_unmount(mnt, tools.fusermount)
        left = mounts_under(workdir)
        if left:
            print(f"run.py: WARNING: still mounted: {left}", file=sys.stderr)
            code = code or 1
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        if uring_old is not None:
            machine.set_fuse_uring(uring_old)
        results["finished"] = dt.datetime.now().astimezone().isoformat(timespec="seconds")
        write_json(outdir, results)
    path = render(outdir, results)
    print(f"results: {os.path.join(outdir, 'results.json')}\nreport:  {path}", file=sys.stderr)
    if args.print_table:
        print(report.summary_tables(results))
    if args.strict and code == 0:
        problems = strict_problems(results)
        for p in problems:
            print(f"run.py: --strict: {p}", file=sys.stderr)
        code = 1 if problems else 0
    return code


def strict_problems(results: dict[str, Any]) -> list[str]:
    """Why a --strict run failed (targets not started, failed runs, no runs)."""
    out = []
    for res in results.get("matrices", []):
        for t in res.get("targets", []):
            if not t.get("started"):
                out.append(f"{res['name']}: target {t['name']} did not start")
        bad = [r for r in res.get("runs", []) if not r.get("ok")]
        for r in bad[:5]:
            out.append(f"{res['name']}: {r['workload']} on {r['target']} failed: {r.get('error')}")
        if not res.get("runs"):
            out.append(f"{res['name']}: no runs")
        for s in res.get("skipped", []):
            if "did not start" in s or s.startswith("WARNING"):
                out.append(f"{res['name']}: {s}")
    if not results.get("matrices"):
        out.append("no matrix ran")
    return out


if __name__ == "__main__":
    _maybe_reexec_in_venv()
    sys.exit(main())
