"""Run one matrix: prepare images, mount every target, run interleaved rounds.

All compared targets are mounted at once; each round runs every workload
on every target before the next round starts, and the target order rotates
from round to round so no target always runs first.  Each run records the
exact command line, the parsed figures and the server's CPU time.
"""

from __future__ import annotations

import datetime as _dt
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from . import fileaccess as fa
from . import images as imgs
from . import machine
from . import metadata as meta
from . import nbdserver
from .fio import FioWorkload, fio_command, parse_fio_json
from .matrices import Matrix, Workload, estimate_seconds, expand_targets, select_workloads, with_extra
from .progress import Progress
from .targets import (Interrupted, RunningTarget, TargetError, TargetGroup, TargetSpec, Tools, image_format,
                      mounts_under, start_target, unavailable_reason)

FIO_GRACE_S = 90.0
# A fill run writes the whole fresh image once; the cap only stops a very slow target.
FILL_CAP_FACTOR = 12.0
FILL_CAP_MIN_S = 30.0


@dataclass
class Options:
    """Run parameters shared by all matrices of one invocation."""

    runtime: float = 5.0
    ramp: float = 1.0
    rounds: int = 3
    images: Optional[list[str]] = None   # None: each matrix's own default
    size: int = 1 << 30
    disk_dir: str = "/var/tmp"
    workloads: Optional[str] = None
    targets: Optional[list[str]] = None  # None: each matrix's default
    fio: str = "fio"
    fileaccess_cap: Optional[float] = None
    rotate: bool = True
    fuse_uring: str = "auto"             # auto: enable for matrices that need it; on; off
    fill_cap: Optional[float] = None     # seconds cap of a fill run (fresh images); None: fill_cap_s()
    meta_files: int = 100_000            # metadata matrix: small files in the create/stat/readdir/unlink tree
    tree_files: int = 50_000             # metadata matrix: files of the synthetic source tree (untar...)
    catalogue: dict[str, TargetSpec] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"runtime_s": self.runtime, "ramp_s": self.ramp, "rounds": self.rounds,
                "images": self.images, "image_size": self.size, "disk_dir": self.disk_dir,
                "workloads": self.workloads, "targets": self.targets,
                "fileaccess_cap_s": self.cap(), "fill_cap_s": self.fill_cap_s(),
                "rotate_order": self.rotate, "fuse_uring": self.fuse_uring,
                "meta_files": self.meta_files, "tree_files": self.tree_files}

    def meta_scale(self) -> float:
        """Size of the metadata rows against the default sizes (for time estimates)."""
        return max(self.meta_files / 100_000, self.tree_files / 50_000, 0.02)

    def cap(self) -> float:
        """Time cap of one file-access pass (seconds)."""
        return self.fileaccess_cap if self.fileaccess_cap is not None else max(2.0 * self.runtime, 2.0)

    def fill_cap_s(self) -> float:
        """Time cap of one fill run (a writing workload on a fresh image; seconds)."""
        return self.fill_cap if self.fill_cap is not None else max(FILL_CAP_FACTOR * self.runtime, FILL_CAP_MIN_S)


def _now() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


def plan(m: Matrix, opts: Options, tools: Tools) -> tuple[list[TargetSpec], list[str], list[Workload]]:
    """Target configurations, notes and workloads this run will use for ``m``."""
    kinds = opts.images or list(m.images)
    # NBD images take only NBD clients: probe with one when the run uses them.
    probe = imgs.Image(kind=next((k for k in kinds if k in imgs.NBD_KINDS), "shm"), size=opts.size)
    requested = opts.targets or list(m.default_targets)
    specs, notes = expand_targets(requested, m, opts.catalogue,
                                  lambda s: unavailable_reason(s, probe, tools))
    flags = tools.fusex_flags()
    out = []
    for s in specs:
        s2, note = with_extra(s, m.fusex_extra, flags)
        out.append(s2)
        if note:
            notes.append(note)
    return out, notes, select_workloads(m, opts.workloads)


def run_matrix(m: Matrix, opts: Options, tools: Tools, workdir: str, tag: str,
               log: Callable[[str], None]) -> dict[str, Any]:
    """Run matrix ``m``; returns its result dict (see results.json schema in docs).

    Raises :class:`~fusexbench.targets.Interrupted` on a signal; the partial
    result is then in the exception's ``result`` attribute.
    """
    specs, notes, workloads = plan(m, opts, tools)
    result: dict[str, Any] = {**m.to_json(), "started": _now(), "finished": None, "notes": list(m.notes),
                              "skipped": notes, "images": [], "targets": [], "mounts": [],
                              "workloads": [_workload_json(w) for w in workloads], "runs": [],
                              "interrupted": None}
    kinds = opts.images or list(m.images)
    uring_prev: Optional[str] = None
    if m.fuse_uring and opts.fuse_uring == "auto" and machine.fuse_uring_enabled() == "N":
        uring_prev = machine.set_fuse_uring("Y")
        if uring_prev is None:
            result["notes"].append("Could not set enable_uring=Y (needs root): io_uring configurations may fail.")
    result["fuse_enable_uring"] = machine.fuse_uring_enabled()
    created: list[imgs.Image] = []
    servers: list[nbdserver.NbdServer] = []
    result["servers"] = []
    dirs: set[str] = set()
    group = TargetGroup(workdir, tools.fusermount)
    try:
        with group:
            # Images.
            images: list[imgs.Image] = []
            for kind in kinds:
                d = imgs.image_dir(kind, opts.disk_dir, tag)
                if d:
                    dirs.add(d)
                for size in m.image_sizes(opts.size, workloads):
                    log(f"{m.name}: preparing {kind} image of {size >> 20} MiB")
                    copies = None
                    if kind in imgs.PER_TARGET_KINDS:  # one copy per target that can run on it
                        probe = imgs.Image(kind=kind, size=size)
                        copies = {s.name: image_format(s, probe) for s in specs
                                  if unavailable_reason(s, probe, tools) is None}
                    img = imgs.prepare_image(kind, size, d, want_direct=m.backend_direct, targets=copies)
                    created.append(img)
                    if img.nbd:  # the one server every client target of this image connects to
                        missing = nbdserver.missing_tool(img, tools.qemu_nbd, tools.nbdkit)
                        if missing:
                            result["skipped"].append(f"Skipped image {img.label}: {missing}.")
                            continue
                        try:
                            srv = nbdserver.start_server(img, os.path.join(workdir, m.name, img.label, "server"),
                                                         tools.qemu_nbd, tools.nbdkit)
                        except nbdserver.ServerError as e:
                            result["skipped"].append(f"Skipped image {img.label}: its NBD server did not start: {e}")
                            continue
                        servers.append(srv)
                        result["servers"].append(srv.to_json())
                    images.append(img)
                    result["images"].append(img.to_json())
            # Mounts.
            running: dict[tuple[str, str], RunningTarget] = {}
            started: set[str] = set()
            for img in images:
                for spec in specs:
                    reason = unavailable_reason(spec, img, tools)
                    if reason:
                        result["skipped"].append(f"Skipped {spec.name} on {img.label}: {reason}.")
                        continue
                    wd = os.path.join(workdir, m.name, img.label, spec.name)
                    try:
                        t = start_target(spec, img.for_target(spec.name), wd, tools)
                    except TargetError as e:
                        result["skipped"].append(f"Skipped {spec.name} on {img.label}: did not start: {e}")
                        result["mounts"].append({"target": spec.name, "image": img.label, "error": str(e)})
                        continue
                    group.add(t)
                    running[(img.label, spec.name)] = t
                    started.add(spec.name)
                    result["mounts"].append({"target": spec.name, "image": img.label,
                                             "commands": t.commands, "config": t.config})
            result["targets"] = [{**s.to_json(), "started": s.name in started} for s in specs]
            # Jobs: round -> workload -> image -> target (rotated per round).
            names = [s.name for s in specs]
            jobs: list[tuple[int, Workload, imgs.Image, str]] = []
            for rnd in range(1, opts.rounds + 1):
                order = names[(rnd - 1) % len(names):] + names[:(rnd - 1) % len(names)] if (
                    opts.rotate and names) else names
                for w in workloads:
                    for img in images:
                        if not _applies(w, img):
                            continue
                        for name in order:
                            if (img.label, name) in running:
                                jobs.append((rnd, w, img, name))
            est = estimate_seconds(m, 1, opts.runtime, opts.ramp, opts.cap(), opts.meta_scale())
            log(f"{m.name}: {len(jobs)} runs ({len(running)} mounts x {len(workloads)} workloads x "
                f"{opts.rounds} rounds), about {len(jobs) * est / 60:.1f} min")
            progress = Progress(len(jobs), est)
            fa_bin = fa.build() if m.kind == "fileaccess" else None
            meta_bin = meta.build() if m.kind == "metadata" else None
            tarball, entries = None, 0
            if m.kind == "metadata" and any(w.op in meta.TREE_OPS for w in workloads
                                            if isinstance(w, meta.MetaWorkload)):
                log(f"{m.name}: building the synthetic source tree of {opts.tree_files} files (once)")
                tarball = meta.build_tarball(opts.tree_files)
                entries = meta.tarball_entries(tarball)
                result["tarball"] = {"path": tarball, "entries": entries, "files": opts.tree_files}
            tmp = os.path.join(workdir, m.name, "out")
            os.makedirs(tmp, exist_ok=True)
            meta_failed: dict[tuple[str, int], dict[str, str]] = {}  # (target, round) -> op -> error
            try:
                for i, (rnd, w, img, name) in enumerate(jobs):
                    progress.show(f"{m.name} r{rnd} {w.name} @ {name}" +
                                  (f" [{img.label}]" if len(images) > 1 else ""))
                    t = running[(img.label, name)]
                    if t.dirty and imgs.needs_renewal(img, name):
                        t = running[(img.label, name)] = renew_target(t, img, tools, group)
                    if isinstance(w, FioWorkload):
                        fill = img.fresh and w.writes
                        run = run_fio(w, img, t, opts, os.path.join(tmp, f"fio-{i}.json"), fill=fill)
                        if w.writes:
                            t.dirty = True
                        if img.per_target:
                            run["image_allocated_bytes"] = imgs.allocated_bytes(t.image.path)
                    elif isinstance(w, meta.MetaWorkload):
                        assert meta_bin
                        failed = meta_failed.setdefault((name, rnd), {})
                        why = meta.skipped_after(w.op, failed)
                        if why:
                            run = {"command": None, "ok": False, "error": why, "metrics": None,
                                   "started": _now()}
                        else:
                            run = run_metadata(w, t, opts, meta_bin, tarball or "", entries)
                        if not run["ok"]:
                            failed[w.op] = run["error"] or "failed"
                    else:
                        assert fa_bin
                        run = run_fileaccess(w, img, t, opts, fa_bin)
                    run.update({"round": rnd, "workload": w.name, "image": img.label, "target": t.name,
                                "seq": i, "loadavg1": _loadavg1()})
                    result["runs"].append(run)
                    if not run["ok"]:
                        progress.note(f"  {t.name} {w.name} round {rnd}: {run['error']}")
                    progress.step()
            finally:
                progress.finish()
    except Interrupted as e:
        result["interrupted"] = signal.Signals(e.signum).name
        e.result = result  # type: ignore[attr-defined]
        raise
    finally:
        for srv in servers:  # after `with group` stopped their clients
            srv.stop()
        if uring_prev is not None:
            machine.set_fuse_uring(uring_prev)
        for img in created:
            imgs.remove_image(img)
        for d in dirs:
            imgs.cleanup_dir(d)
        result["finished"] = _now()
        left = mounts_under(workdir)
        if left:
            result["skipped"].append(f"WARNING: still mounted after cleanup: {left}")
    return result


def renew_target(t: RunningTarget, img: imgs.Image, tools: Tools, group: TargetGroup) -> RunningTarget:
    """Stop ``t``, re-create its copy of ``img`` as new and mount it again.

    If that fails, the stopped target is returned marked unusable (its runs fail with the reason).
    """
    t.stop()
    group.remove(t)
    try:
        imgs.renew_copy(img, t.name)
        t2 = start_target(t.spec, img.for_target(t.name), t.workdir, tools)
    except (TargetError, RuntimeError, OSError) as e:
        t.dead_reason = f"re-creating the image and mounting again failed: {e}"
        t.dirty = False  # no retry before every run: its runs fail with the reason
        return t
    group.add(t2)
    return t2


def _applies(w: Workload, img: imgs.Image) -> bool:
    if isinstance(w, fa.FileAccessWorkload):
        return img.size == w.size
    if isinstance(w, meta.MetaWorkload):
        return img.kind == "tree"
    return True


def _workload_json(w: Workload) -> dict[str, Any]:
    if isinstance(w, FioWorkload):
        return {"name": w.name, "kind": "fio", "rw": w.rw, "bs": w.bs, "iodepth": w.iodepth,
                "numjobs": w.numjobs, "ioengine": w.ioengine, "rwmixread": w.rwmixread,
                "options": w.options(), "description": w.describe()}
    if isinstance(w, meta.MetaWorkload):
        return {"name": w.name, "kind": "metadata", "op": w.op, "description": w.describe()}
    return {"name": w.name, "kind": "fileaccess", "size": w.size, "mode": w.mode,
            "bufsize": w.bufsize, "cache": w.cache, "description": w.describe()}


def _server_cpu(t: RunningTarget, a: Optional[dict[str, float]], b: Optional[dict[str, float]],
                ios: int) -> dict[str, Any]:
    """CPU time between the two samples, in total and (with a shared NBD server) per role."""
    if a is None or b is None:
        return {"server_cpu_s": None, "server_cpu_us_per_io": None}
    parts = {k: max(b[k] - a.get(k, 0.0), 0.0) for k in b}
    cpu = sum(parts.values())
    out: dict[str, Any] = {"server_cpu_s": cpu, "server_cpu_us_per_io": cpu * 1e6 / ios if ios else None}
    if "nbd_server" in parts:
        out["cpu_us_per_io_by_role"] = {k: v * 1e6 / ios if ios else None for k, v in parts.items()}
    return out


def run_fio(w: FioWorkload, img: imgs.Image, t: RunningTarget, opts: Options, out: str,
            fill: bool = False) -> dict[str, Any]:
    """One fio run; server CPU is sampled after the ramp and at the end.

    ``fill``: every job writes (or reads and writes) each block of the fresh
    image once, measured from the first I/O (no ramp), capped at
    ``opts.fill_cap_s()``; the record's ``fill`` says whether it completed.
    """
    runtime, ramp = (opts.fill_cap_s(), 0.0) if fill else (opts.runtime, opts.ramp)
    cmd = fio_command(w, t.path, img.size, runtime, ramp, opts.fio, output=out, time_based=not fill)
    rec: dict[str, Any] = {"command": cmd, "ok": False, "error": None, "metrics": None,
                           "started": _now()}
    dead = t.check_alive()
    if dead:
        rec["error"] = f"target unusable: {dead}"
        return rec
    _unlink(out)
    t0 = time.monotonic()
    errlog = out + ".stderr"
    with open(errlog, "wb") as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
    try:
        try:
            proc.wait(timeout=ramp if ramp > 0 else 0.01)
        except subprocess.TimeoutExpired:
            pass
        cpu_a = t.cpu_parts()
        try:
            proc.wait(timeout=runtime + ramp + FIO_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rec["error"] = f"fio did not finish within {runtime + ramp + FIO_GRACE_S:.0f} s (killed)"
            t.check_alive()
            return rec
        cpu_b = t.cpu_parts()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rec["elapsed_s"] = round(time.monotonic() - t0, 3)
    stderr = _read(errlog).strip()
    try:
        metrics = parse_fio_json(_read(out))
    except (ValueError, KeyError) as e:
        rec["error"] = f"fio exit {proc.returncode}: {stderr[-300:] or e}"
        t.check_alive()
        return rec
    rec["metrics"] = metrics
    rec.update(_server_cpu(t, cpu_a, cpu_b, metrics["ios"]))
    if fill:
        rec["fill"] = fill_record(w, img.size, metrics)
    if proc.returncode != 0 or metrics.get("error"):
        rec["error"] = f"fio exit {proc.returncode}, error {metrics.get('error')}: {stderr[-300:]}"
        return rec
    rec["ok"] = True
    return rec


def fill_record(w: FioWorkload, size: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """How far a fill run got: every job should move ``size`` bytes (reads + writes)."""
    expected = size * w.numjobs
    done = sum(metrics[d]["io_bytes"] for d in ("read", "write") if metrics.get(d))
    return {"expected_bytes": expected, "done_bytes": done, "complete": done >= expected}


def run_fileaccess(w: fa.FileAccessWorkload, img: imgs.Image, t: RunningTarget, opts: Options,
                   binary: str) -> dict[str, Any]:
    """One timed pass of the file-access program (after dropping or warming caches)."""
    cap = opts.cap()
    cmd = fa.command(binary, t.path, w, cap)
    rec: dict[str, Any] = {"command": cmd, "ok": False, "error": None, "metrics": None, "started": _now()}
    dead = t.check_alive()
    if dead:
        rec["error"] = f"target unusable: {dead}"
        return rec
    if w.cache == "cold":
        if not imgs.drop_caches():
            rec["error"] = "cold cache needs root (cannot write /proc/sys/vm/drop_caches)"
            return rec
        rec["prepare"] = "sync; echo 3 > /proc/sys/vm/drop_caches"
    else:
        warm = fa.command(binary, t.path, fa.FileAccessWorkload("warm", w.size, "seq", 1 << 20, "warm"),
                          max(4 * cap, 30))
        rec["prepare"] = " ".join(warm)
        subprocess.run(warm, capture_output=True, timeout=max(4 * cap, 30) + FIO_GRACE_S)
    t0 = time.monotonic()
    cpu_a = t.cpu_parts()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=cap + FIO_GRACE_S)
    except subprocess.TimeoutExpired:
        rec["error"] = "fileaccess timed out"
        return rec
    cpu_b = t.cpu_parts()
    rec["elapsed_s"] = round(time.monotonic() - t0, 3)
    if p.returncode != 0:
        rec["error"] = f"fileaccess exit {p.returncode}: {p.stderr.strip()[-300:]}"
        t.check_alive()
        return rec
    metrics = fa.parse_output(p.stdout)
    rec["metrics"] = metrics
    rec.update(_server_cpu(t, cpu_a, cpu_b, metrics["ios"]))
    rec["ok"] = True
    return rec


META_TIMEOUT_S = 3600.0


def meta_workdir(t: RunningTarget) -> str:
    """Where target ``t`` does the metadata rows: its own subdirectory of the source, seen through it."""
    return os.path.join(t.path, t.name)


def run_metadata(w: meta.MetaWorkload, t: RunningTarget, opts: Options, binary: str, tarball: str,
                 entries: int) -> dict[str, Any]:
    """One timed metadata row on ``t``: its untimed preparation, drop caches, the timed command."""
    cmds = meta.commands(w, meta_workdir(t), opts.meta_files, binary, tarball)
    rec: dict[str, Any] = {"command": cmds[-1], "ok": False, "error": None, "metrics": None, "started": _now()}
    dead = t.check_alive()
    if dead:
        rec["error"] = f"target unusable: {dead}"
        return rec
    try:
        os.makedirs(meta_workdir(t), exist_ok=True)
        for prep in cmds[:-1]:
            p = subprocess.run(prep, capture_output=True, text=True, timeout=META_TIMEOUT_S)
            if p.returncode != 0:
                rec["error"] = f"preparation {' '.join(prep[:3])} exit {p.returncode}: {p.stderr.strip()[-300:]}"
                t.check_alive()
                return rec
        if cmds[:-1]:
            rec["prepare"] = [" ".join(c) for c in cmds[:-1]]
        if not imgs.drop_caches():
            rec["error"] = "dropping caches needs root (cannot write /proc/sys/vm/drop_caches)"
            return rec
        cpu_a = t.cpu_parts()
        t0 = time.monotonic_ns()
        p = subprocess.run(cmds[-1], capture_output=True, text=True, timeout=META_TIMEOUT_S)
        ns = time.monotonic_ns() - t0
        cpu_b = t.cpu_parts()
    except (OSError, subprocess.TimeoutExpired) as e:
        rec["error"] = f"{w.op}: {e}"
        t.check_alive()
        return rec
    rec["elapsed_s"] = round(ns / 1e9, 3)
    if p.returncode != 0:
        rec["error"] = f"{w.op} exit {p.returncode}: {p.stderr.strip()[-300:]}"
        t.check_alive()
        return rec
    try:
        metrics = meta.parse_output(w, p.stdout, ns, entries)
    except (ValueError, KeyError) as e:
        rec["error"] = str(e)
        return rec
    rec["metrics"] = metrics
    rec.update(_server_cpu(t, cpu_a, cpu_b, metrics["ios"]))
    rec["ok"] = True
    return rec


def _loadavg1() -> Optional[float]:
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _unlink(path: str) -> None:
    """Remove a stale output file before a run."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""
