"""Targets: what fio runs against, started and stopped by the runner.

A target *configuration* is data (:class:`TargetSpec`: a name, a kind, extra
command-line arguments, the ``fusex mount`` flags it needs).  A *running*
target (:class:`RunningTarget`) is one spec mounted over one image.

Nothing may stay mounted on any exit path:

* every daemon runs in its own session (a terminal Ctrl-C reaches only the
  runner, which then unmounts in order) and with ``PR_SET_PDEATHSIG`` =
  SIGTERM, so even a SIGKILLed runner makes them unmount themselves;
* :class:`TargetGroup` stops everything in ``__exit__`` and from ``atexit``;
* :func:`signal_guard` turns SIGINT/SIGTERM/SIGHUP into :class:`Interrupted`
  so ``with`` blocks unwind; further signals during cleanup are ignored;
* stopping verifies ``/proc/self/mountinfo`` and falls back to
  ``fusermount3 -u -z`` / ``umount -l``.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from .fio import format_size
from .images import Image

KINDS = ("native", "fusex", "qsd", "nbdfuse", "passthrough_hp", "fusex-dir", "bindfs")
DIR_FLAG = "--cache"  # the directory-export-only option: a fusex without it has no directory mode
PTHP_NOPT_FLAG = "--nopassthrough"  # a passthrough_hp that lists it passes reads through by default
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
MOUNT_TIMEOUT_S = 20.0
NBD_FLAG = "--nbd-timeout"  # a fusex without it has no NBD client
STOP_TIMEOUT_S = 15.0


class TargetError(RuntimeError):
    """A target could not be started (the message says why)."""


class Interrupted(Exception):
    """Raised in the main thread when SIGINT/SIGTERM/SIGHUP arrives."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


@dataclass
class TargetSpec:
    """A target configuration: name, kind, extra arguments, requirements.

    ``args`` are appended to the kind's base command (for fusex: options of
    ``fusex mount``).  ``requires`` lists flags that must appear in
    ``fusex mount --help``; configurations needing a missing feature are
    skipped with a note instead of failing.  ``options`` are the knobs as
    data (queues, transport, passthrough, aio) for plots and the report;
    ``options["format"] = "raw"`` asks for a raw file of the same data on the
    per-target image kinds (qcow2, vmdk, vpc, vdi, vhdx; default: the image's own format).
    """

    name: str
    kind: str
    args: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    description: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "args": list(self.args),
                "requires": list(self.requires), "options": dict(self.options),
                "description": self.description}


def catalogue(ncpu: Optional[int] = None) -> dict[str, TargetSpec]:
    """All known target configurations, by name."""
    n = ncpu or os.cpu_count() or 1
    specs = [
        TargetSpec("native", "native", description="the image file itself (the limit)"),
        TargetSpec("fusex", "fusex", description="fusex, default options"),
        TargetSpec("fusex-q1", "fusex", ("--queues", "1"), ("--queues",), {"queues": 1},
                   "fusex, 1 queue"),
        TargetSpec("fusex-qN", "fusex", ("--queues", str(n)), ("--queues",), {"queues": n},
                   f"fusex, {n} queues (one per CPU)"),
        TargetSpec("fusex-legacy", "fusex", ("--transport", "legacy"), ("--transport",),
                   {"transport": "legacy"}, "fusex, legacy /dev/fuse transport"),
        TargetSpec("fusex-uring", "fusex", ("--transport", "uring"), ("--transport",),
                   {"transport": "uring"}, "fusex, FUSE-over-io_uring transport"),
        TargetSpec("fusex-pt-off", "fusex", ("--passthrough", "off"), ("--passthrough",),
                   {"passthrough": "off"}, "fusex, passthrough off"),
        TargetSpec("fusex-legacy-pt-off", "fusex", ("--transport", "legacy", "--passthrough", "off"),
                   ("--transport", "--passthrough"), {"transport": "legacy", "passthrough": "off"},
                   "fusex, legacy /dev/fuse transport, passthrough off"),
        TargetSpec("fusex-uring-pt-off", "fusex", ("--transport", "uring", "--passthrough", "off"),
                   ("--transport", "--passthrough"), {"transport": "uring", "passthrough": "off"},
                   "fusex, FUSE-over-io_uring transport, passthrough off"),
        TargetSpec("fusex-raw", "fusex", ("--passthrough", "off"), ("--passthrough",),
                   {"passthrough": "off", "format": "raw"},
                   "fusex on a raw file of the same data (qcow2 and other format images), passthrough off"),
        TargetSpec("fusex-pt-on", "fusex", ("--passthrough", "on"), ("--passthrough",),
                   {"passthrough": "on"}, "fusex, passthrough on"),
        TargetSpec("fusex-kcache", "fusex", ("--kernel-cache",), ("--kernel-cache",),
                   {"kernel_cache": True}, "fusex, kernel page cache on the export"),
        TargetSpec("fusex-spin", "fusex", ("--spin-us", "20"), ("--spin-us",), {"spin_us": 20},
                   "fusex, 20 us busy-poll before sleeping"),
        TargetSpec("fusex-io-ring", "fusex", ("--io-path", "ring"), ("--io-path",), {"io_path": "ring"},
                   "fusex, image I/O always through io_uring"),
        TargetSpec("fusex-io-inline", "fusex", ("--io-path", "inline"), ("--io-path",), {"io_path": "inline"},
                   "fusex, image I/O as synchronous pread/pwrite on the queue thread"),
        TargetSpec("fusex-io-nowait", "fusex", ("--io-path", "nowait"), ("--io-path",), {"io_path": "nowait"},
                   "fusex, preadv2(RWF_NOWAIT) first, io_uring when it would block"),
        TargetSpec("qsd", "qsd", options={"aio": "io_uring"},
                   description="qemu-storage-daemon FUSE export, aio=io_uring"),
        TargetSpec("qsd-threads", "qsd", options={"aio": "threads"},
                   description="qemu-storage-daemon FUSE export, aio=threads"),
        TargetSpec("nbdfuse", "nbdfuse", options={"aio": "io_uring"},
                   description="nbdfuse (multi-conn) over qemu-nbd, aio=io_uring"),
        TargetSpec("fusex-nbd", "fusex", (), (NBD_FLAG,), {"nbd": True},
                   "fusex's NBD client (one connection per queue), default options"),
        TargetSpec("passthrough_hp", "passthrough_hp", ("--nocache",),
                   options={"splice": True, "cache": False, "threads": "libfuse default"},
                   description="libfuse's passthrough_hp example over the image's directory: splice, "
                               "--nocache, default worker threads"),
        # Directory exports (the dirfs and metadata matrices): the source directory mounted whole.
        TargetSpec("fusex-dir", "fusex-dir", (), (DIR_FLAG,), {"dir": True},
                   "fusex directory export, default options (passthrough auto, cache auto)"),
        TargetSpec("fusex-dir-pt-on", "fusex-dir", ("--passthrough", "on"), (DIR_FLAG, "--passthrough"),
                   {"dir": True, "passthrough": "on"}, "fusex directory export, passthrough on"),
        TargetSpec("fusex-dir-pt-off", "fusex-dir", ("--passthrough", "off"), (DIR_FLAG, "--passthrough"),
                   {"dir": True, "passthrough": "off"}, "fusex directory export, passthrough off"),
        TargetSpec("passthrough_hp-dir", "passthrough_hp", (), options={"dir": True, "passthrough": "off"},
                   description="libfuse's passthrough_hp over the source directory, its defaults (splice, "
                               "cache), without passthrough (--nopassthrough where it has passthrough)"),
        TargetSpec("passthrough_hp-dir-pt", "passthrough_hp", (), options={"dir": True, "passthrough": "on"},
                   description="libfuse's passthrough_hp over the source directory, its defaults with "
                               "passthrough (libfuse 3.17+)"),
        TargetSpec("bindfs", "bindfs", ("--no-allow-other",), options={"dir": True},
                   description="bindfs over the source directory, its defaults (single-threaded)"),
    ]
    return {s.name: s for s in specs}


def parse_define(text: str) -> TargetSpec:
    """Parse ``--define NAME=KIND:ARG ARG...`` into an ad-hoc TargetSpec.

    Example: ``fusex-qd8=fusex:--queue-depth 8``.  For fusex every ``--flag``
    in the arguments becomes a requirement.
    """
    if "=" not in text or ":" not in text.split("=", 1)[1]:
        raise ValueError(f"bad target definition {text!r} (want NAME=KIND:ARGS)")
    name, rest = text.split("=", 1)
    kind, argstr = rest.split(":", 1)
    options: dict[str, Any] = {}
    if kind.startswith(("fusex@", "fusex-dir@")):
        # Another fusex binary (e.g. a build of an earlier commit, for before/after in one run).
        kind, options["binary"] = kind.split("@", 1)
    if kind not in KINDS:
        raise ValueError(f"unknown target kind {kind!r}")
    args = tuple(argstr.split())
    requires = ()
    if "format=raw" in args:  # e.g. qsd-raw=qsd:format=raw (not passed to the command)
        args = tuple(a for a in args if a != "format=raw")
        options["format"] = "raw"
    if kind == "fusex" and "binary" not in options:
        requires = tuple(a.split("=")[0] for a in args if a.startswith("--"))
    if kind == "fusex-dir":  # a directory export with other options, e.g. fusex-dir-spin0=fusex-dir:--spin-us 0
        options["dir"] = True
        if "binary" not in options:
            requires = (DIR_FLAG,) + tuple(a.split("=")[0] for a in args if a.startswith("--"))
    return TargetSpec(name.strip(), kind, args, requires, options, f"{rest.split(':', 1)[0]} {argstr}".strip())


# --------------------------------------------------------------------------- tools


@dataclass
class Tools:
    """Paths of the external programs and what the fusex binary supports."""

    fusex: Optional[str] = None
    fusex_help: str = ""
    qsd: Optional[str] = None
    qemu_nbd: Optional[str] = None
    nbdfuse: Optional[str] = None
    nbdkit: Optional[str] = None
    fusermount: Optional[str] = None
    passthrough_hp: Optional[str] = None
    bindfs: Optional[str] = None
    passthrough_hp_help: Optional[str] = None  # None: not asked yet

    def pthp_has_passthrough(self) -> bool:
        """True if this passthrough_hp passes reads through (lists --nopassthrough in --help)."""
        if not self.passthrough_hp:
            return False
        if self.passthrough_hp_help is None:
            try:
                p = subprocess.run([self.passthrough_hp, "--help"], capture_output=True, text=True, timeout=10)
                self.passthrough_hp_help = p.stdout + p.stderr
            except (OSError, subprocess.TimeoutExpired):
                self.passthrough_hp_help = ""
        return PTHP_NOPT_FLAG in self.passthrough_hp_help

    @classmethod
    def discover(cls, fusex: Optional[str]) -> "Tools":
        t = cls(
            fusex=fusex if fusex and os.access(fusex, os.X_OK) else None,
            qsd=shutil.which("qemu-storage-daemon"),
            qemu_nbd=shutil.which("qemu-nbd"),
            nbdfuse=shutil.which("nbdfuse"),
            nbdkit=shutil.which("nbdkit"),
            fusermount=shutil.which("fusermount3") or shutil.which("fusermount"),
            passthrough_hp=find_passthrough_hp(),
            bindfs=shutil.which("bindfs"),
        )
        if t.fusex:
            t.fusex_help = fusex_help(t.fusex)
        return t

    def fusex_flags(self) -> set[str]:
        """Long flags listed by ``fusex mount --help``."""
        return set(re.findall(r"(--[a-z][a-z0-9-]*)", self.fusex_help))


BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS_DIR = os.path.join(BENCH_DIR, ".peers")  # peers built from source by bench/peers.sh (gitignored)
PASSTHROUGH_HP_BUILT = os.path.join(PEERS_DIR, "bin", "passthrough_hp")
PASSTHROUGH_HP_LOG = os.path.join(PEERS_DIR, "passthrough_hp.log")


def find_passthrough_hp() -> Optional[str]:
    """libfuse's passthrough_hp example: ``$PASSTHROUGH_HP``, bench/.peers/bin, or PATH."""
    for cand in (os.environ.get("PASSTHROUGH_HP"), PASSTHROUGH_HP_BUILT):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return os.path.abspath(cand)
    return shutil.which("passthrough_hp")


def passthrough_hp_version() -> Optional[str]:
    """``<binary> (<source package> <version>)`` of the passthrough_hp in use, None without one."""
    path = find_passthrough_hp()
    if not path:
        return None
    try:
        with open(path + ".version", encoding="utf-8") as f:
            return f"{path} (from {f.read().strip()})"
    except OSError:
        return path


def passthrough_hp_missing() -> str:
    """Why there is no passthrough_hp binary (points at the build log when a build failed)."""
    why = "passthrough_hp not built (bench/setup.sh builds it into bench/.peers/ from the Debian source of the " \
          "installed libfuse3; or set $PASSTHROUGH_HP)"
    if os.path.exists(PASSTHROUGH_HP_LOG):
        try:
            with open(PASSTHROUGH_HP_LOG, encoding="utf-8", errors="replace") as f:
                last = [line.strip() for line in f if line.strip()][-1:]
        except OSError:
            last = []
        why += f"; the last build failed ({PASSTHROUGH_HP_LOG}: {last[0] if last else 'empty'})"
    return why


def fusex_help(binary: str) -> str:
    """Output of ``fusex mount --help`` (empty if it cannot run)."""
    try:
        p = subprocess.run([binary, "mount", "--help"], capture_output=True, text=True, timeout=10)
        return p.stdout + p.stderr
    except (OSError, subprocess.TimeoutExpired):
        return ""


QCOW2_FLAG = "--format"  # a fusex without it has no qcow2 backend: it would export the qcow2 file as raw bytes
# The name `fusex mount --help` lists among --format's values for each of the other formats (QEMU's vpc is
# fusex's vhd): a fusex without that backend would export the image file as raw bytes.
FORMAT_HELP_NAMES = {"vmdk": "vmdk", "vpc": "vhd", "vdi": "vdi", "vhdx": "vhdx"}

_help_cache: dict[str, str] = {}


def image_format(spec: TargetSpec, image: Image) -> str:
    """The format of the file ``spec`` opens on ``image`` (raw, or the image's own format on the
    per-target kinds; native always opens raw)."""
    return image.format_for(spec.options.get("format") or ("raw" if spec.kind == "native" else None))


def missing_backend(help_text: str, fmt: str) -> Optional[str]:
    """What a fusex whose ``mount --help`` is ``help_text`` lacks to serve ``fmt`` (None: nothing)."""
    if fmt == "raw":
        return None
    if QCOW2_FLAG not in re.findall(r"(--[a-z][a-z0-9-]*)", help_text):
        return f"no {QCOW2_FLAG} (no {fmt} backend)"
    name = FORMAT_HELP_NAMES.get(fmt)
    if name and not re.search(rf"\b{name}\b", help_text):
        return f"no {name} among the {QCOW2_FLAG} values (no {fmt} backend)"
    return None


def unavailable_reason(spec: TargetSpec, image: Image, tools: Tools) -> Optional[str]:
    """Why ``spec`` cannot run on ``image`` here, or None if it can."""
    if image.nbd:
        return _nbd_unavailable(spec, image, tools)
    if spec.options.get("nbd"):
        return f"{spec.name} runs on the NBD images only (nbd, nbd-delay)"
    if spec.kind == "native":
        return "native has no null image (nothing to compare against)" if image.kind == "null" else None
    if spec.options.get("dir") or image.kind == "tree":
        return _dir_unavailable(spec, image, tools)
    fmt = image_format(spec, image)
    if spec.kind == "fusex" and spec.options.get("binary"):
        b = spec.options["binary"]
        if not os.access(b, os.X_OK):
            return f"fusex binary {b} is not executable"
        if fmt != "raw":
            if b not in _help_cache:
                _help_cache[b] = fusex_help(b)
            lacks = missing_backend(_help_cache[b], fmt)
            if lacks:
                return f"`{b} mount --help` has {lacks}"
        return None
    if spec.kind == "fusex":
        if not tools.fusex:
            return "fusex binary not found (cargo build --release -p fusex, or --fusex PATH)"
        flags = tools.fusex_flags()
        missing = [r for r in spec.requires if r not in flags]
        if missing:
            return f"`fusex mount --help` has no {', '.join(missing)} (feature not implemented yet)"
        lacks = missing_backend(tools.fusex_help, fmt)
        if lacks:
            return f"`fusex mount --help` has {lacks}"
        return None
    if spec.kind == "qsd":
        return None if tools.qsd else "qemu-storage-daemon not installed (Debian: qemu-system-common)"
    if spec.kind == "nbdfuse":
        if not tools.nbdfuse:
            return "nbdfuse not installed (Debian: libnbd-bin)"
        if not tools.qemu_nbd:
            return "qemu-nbd not installed (Debian: qemu-utils)"
        return None
    if spec.kind == "passthrough_hp":
        if image.kind == "null":
            return "passthrough_hp exports a directory of files: it has no null image"
        if fmt != "raw":
            return f"passthrough_hp exports files as they are (no {fmt})"
        return None if tools.passthrough_hp else passthrough_hp_missing()
    return f"unknown kind {spec.kind}"


def _dir_unavailable(spec: TargetSpec, image: Image, tools: Tools) -> Optional[str]:
    """Why ``spec`` cannot export ``image``'s directory (None if it can)."""
    if not spec.options.get("dir"):
        return f"{spec.name} exports an image, not a directory tree"
    if image.kind not in ("tree", "disk", "shm"):
        return f"directory exports need a source directory ({image.kind} has none)"
    if spec.kind == "fusex-dir":
        if not tools.fusex:
            return "fusex binary not found (cargo build --release -p fusex, or --fusex PATH)"
        missing = [r for r in spec.requires if r not in tools.fusex_flags()]
        if missing:
            return f"`fusex mount --help` has no {', '.join(missing)} (no directory exports)"
        return None
    if spec.kind == "bindfs":
        return None if tools.bindfs else "bindfs not installed (Debian: bindfs; bench/setup.sh installs it)"
    if spec.kind == "passthrough_hp":
        if not tools.passthrough_hp:
            return passthrough_hp_missing()
        if spec.options.get("passthrough") == "on" and not tools.pthp_has_passthrough():
            return (f"this passthrough_hp has no passthrough (no {PTHP_NOPT_FLAG} in its --help: libfuse "
                    "before 3.17)")
        return None
    return f"{spec.kind} has no directory export"


def _nbd_unavailable(spec: TargetSpec, image: Image, tools: Tools) -> Optional[str]:
    """Why ``spec`` cannot be a client of ``image``'s NBD server (None if it can)."""
    if image.kind == "nbd" and not tools.qemu_nbd:
        return "qemu-nbd not installed (Debian: qemu-utils)"
    if image.kind == "nbd-delay" and not tools.nbdkit:
        return "nbdkit not installed (Debian: nbdkit)"
    if spec.kind == "nbdfuse":
        return None if tools.nbdfuse else "nbdfuse not installed (Debian: libnbd-bin)"
    if spec.kind != "fusex":
        return f"{spec.kind} has no NBD client"
    if spec.options.get("binary"):
        b = spec.options["binary"]
        if not os.access(b, os.X_OK):
            return f"fusex binary {b} is not executable"
        if b not in _help_cache:
            _help_cache[b] = fusex_help(b)
        help_text = _help_cache[b]
    elif not tools.fusex:
        return "fusex binary not found (cargo build --release -p fusex, or --fusex PATH)"
    else:
        help_text = tools.fusex_help
    flags = set(re.findall(r"(--[a-z][a-z0-9-]*)", help_text))
    if NBD_FLAG not in flags:
        return f"`fusex mount --help` has no {NBD_FLAG} (no NBD client)"
    missing = [r for r in spec.requires if r not in flags]
    if missing and not spec.options.get("binary"):
        return f"`fusex mount --help` has no {', '.join(missing)} (feature not implemented yet)"
    return None


# --------------------------------------------------------------------------- mounts


def _unescape(s: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


def mount_points() -> list[str]:
    """Mount points listed in /proc/self/mountinfo."""
    out = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 4:
                    out.append(_unescape(parts[4]))
    except OSError:
        pass
    return out


def is_mounted(path: str) -> bool:
    """True if ``path`` is a mount point."""
    return os.path.abspath(path) in mount_points()


def mounts_under(prefix: str) -> list[str]:
    """Mount points at or below ``prefix``."""
    prefix = os.path.abspath(prefix).rstrip("/")
    return [m for m in mount_points() if m == prefix or m.startswith(prefix + "/")]


def force_unmount(path: str, fusermount: Optional[str] = None) -> None:
    """Last resort: lazily unmount ``path`` (fusermount3 -u -z, then umount -l)."""
    cmds = []
    if fusermount:
        cmds.append([fusermount, "-u", "-z", path])
    cmds.append(["umount", "-l", path])
    for cmd in cmds:
        if not is_mounted(path):
            return
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(cmd, capture_output=True, timeout=10)


# --------------------------------------------------------------------------- processes


def _child_setup() -> None:  # pragma: no cover - runs in the forked child
    """In the child: ask the kernel for SIGTERM when the runner dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def spawn(cmd: list[str], log_path: str) -> subprocess.Popen:
    """Start a daemon in its own session, output to ``log_path``."""
    log = open(log_path, "ab")
    try:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_child_setup, close_fds=True)
    finally:
        log.close()


def cpu_seconds(pid: int) -> Optional[float]:
    """utime + stime of ``pid`` (all threads) in seconds, None if gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rindex(")") + 2:].split()
    return (int(rest[11]) + int(rest[12])) / CLK_TCK


def _tail(path: str, n: int = 8) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = [l.rstrip() for l in f.readlines() if l.strip()]
        return " | ".join(lines[-n:])
    except OSError:
        return ""


def _terminate(proc: subprocess.Popen, timeout: float = STOP_TIMEOUT_S) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


# --------------------------------------------------------------------------- running targets


@dataclass
class RunningTarget:
    """One target configuration mounted over one image."""

    spec: TargetSpec
    image: Image
    path: str                      # the file fio opens
    workdir: str
    commands: list[list[str]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list, repr=False)
    logs: list[str] = field(default_factory=list)
    mountpoint: Optional[str] = None
    fusermount: Optional[str] = None
    shared_pids: list[int] = field(default_factory=list)  # a server shared with other targets (NBD images)
    unmount_first: bool = False    # stop() unmounts with `fusermount3 -u` before signalling the daemon
    stopped: bool = False
    dead_reason: Optional[str] = None
    dirty: bool = False            # a write reached the image since it was (re)created

    @property
    def name(self) -> str:
        return self.spec.name

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def cpu_seconds(self) -> Optional[float]:
        """Server CPU time (utime+stime, summed over its processes and a shared server)."""
        parts = self.cpu_parts()
        if parts is None:
            return None
        return sum(parts.values())

    def cpu_parts(self) -> Optional[dict[str, float]]:
        """CPU time per role: ``client`` (the target's own processes) and, on an NBD image,
        ``nbd_server`` (the shared server); ``server`` for targets without a shared server.
        None if a process is gone."""
        if not self.procs:
            return None
        own = [cpu_seconds(pid) for pid in self.pids()]
        shared = [cpu_seconds(pid) for pid in self.shared_pids]
        if any(v is None for v in own + shared):
            return None
        if not self.shared_pids:
            return {"server": sum(v for v in own if v is not None)}
        return {"client": sum(v for v in own if v is not None),
                "nbd_server": sum(v for v in shared if v is not None)}

    def check_alive(self) -> Optional[str]:
        """None if the target is usable, else why not (and remember it)."""
        if self.dead_reason:
            return self.dead_reason
        for p, log in zip(self.procs, self.logs):
            if p.poll() is not None:
                self.dead_reason = f"{os.path.basename(p.args[0])} exited with {p.returncode}: {_tail(log)}"
                return self.dead_reason
        if self.mountpoint and not is_mounted(self.mountpoint):
            self.dead_reason = "export no longer mounted"
            return self.dead_reason
        return None

    def stop(self) -> None:
        """Unmount and stop the daemons (idempotent, never raises)."""
        if self.stopped:
            return
        self.stopped = True
        if self.unmount_first and self.mountpoint and self.fusermount and is_mounted(self.mountpoint):
            # libfuse's way: the daemon sees the connection end and exits by itself.
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                subprocess.run([self.fusermount, "-u", self.mountpoint], capture_output=True, timeout=10)
        # Stop in order: the FUSE server first (it unmounts), then backends.
        for proc in self.procs:
            try:
                _terminate(proc)
            except Exception:  # noqa: BLE001 - cleanup must go on
                pass
            if proc is self.procs[0] and self.mountpoint and is_mounted(self.mountpoint):
                force_unmount(self.mountpoint, self.fusermount)
        if self.mountpoint:
            force_unmount(self.mountpoint, self.fusermount)
            if not is_mounted(self.mountpoint):
                with contextlib.suppress(OSError):
                    (os.rmdir if os.path.isdir(self.mountpoint) else os.unlink)(self.mountpoint)


def _wait_mounted(target: RunningTarget, timeout: float = MOUNT_TIMEOUT_S) -> None:
    assert target.mountpoint
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):  # target.path: the exported file (below the mount point or it)
            if is_mounted(target.mountpoint) and os.path.getsize(target.path) > 0:
                return
        for p, log in zip(target.procs, target.logs):
            if p.poll() is not None:
                raise TargetError(f"{os.path.basename(p.args[0])} exited with {p.returncode}: {_tail(log)}")
        time.sleep(0.02)
    raise TargetError(f"not mounted after {timeout:.0f} s: {_tail(target.logs[0]) if target.logs else ''}")


def _wait_path(path: str, proc: subprocess.Popen, log: str, timeout: float = MOUNT_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return
        if proc.poll() is not None:
            raise TargetError(f"{os.path.basename(proc.args[0])} exited with {proc.returncode}: {_tail(log)}")
        time.sleep(0.02)
    raise TargetError(f"{path} did not appear after {timeout:.0f} s")


NO_LOCKING_FLAG = "--no-locking"  # several fusex targets export one image side by side


def fusex_command(tools: Tools, spec: TargetSpec, image: Image, mnt: str) -> list[str]:
    """``fusex mount --writable [--direct] [--no-locking] ARGS IMAGE MNT``.

    Targets share the image writable (qsd and qemu-nbd run with ``locking=off``
    for the same reason), so fusex skips its image locks where it has them.
    """
    binary = spec.options.get("binary") or tools.fusex
    assert binary
    cmd = [binary, "mount", "--writable"]
    if image.nbd:  # a client of the image's NBD server: no image file of its own to open or lock
        assert image.nbd_uri, "the NBD server must run before its clients mount"
        return cmd + list(spec.args) + [image.nbd_uri, mnt]
    if image.direct:
        cmd.append("--direct")
    if binary == tools.fusex:
        help_text = tools.fusex_help
    else:
        if binary not in _help_cache:
            _help_cache[binary] = fusex_help(binary)
        help_text = _help_cache[binary]
    if NO_LOCKING_FLAG in re.findall(r"(--[a-z][a-z0-9-]*)", help_text):
        cmd.append(NO_LOCKING_FLAG)
    cmd += list(spec.args)
    cmd += [f"null:{format_size(image.size)}" if image.kind == "null" else str(image.path), mnt]
    return cmd


def qsd_command(tools: Tools, spec: TargetSpec, image: Image, mnt: str) -> list[str]:
    """qemu-storage-daemon with a FUSE export of a raw, qcow2, vmdk, vpc, vdi or vhdx file (or null-co).

    A qcow2 overlay's base gets its own file + qcow2 nodes (read-only, same
    aio and cache mode) instead of the ones qemu would open implicitly
    (aio=threads).
    """
    assert tools.qsd
    aio = spec.options.get("aio", "io_uring")
    if image.kind == "null":
        blockdevs = ["--blockdev", f"driver=null-co,node-name=disk,size={image.size},read-zeroes=on"]
    else:
        direct = "on" if image.direct else "off"
        blockdevs = []
        backing = ""
        if image.format == "qcow2" and image.backing:
            blockdevs += [
                "--blockdev", f"driver=file,node-name=base-file,filename={image.backing},cache.direct={direct},"
                              f"aio={aio},locking=off,read-only=on",
                "--blockdev", "driver=qcow2,node-name=base,file=base-file,read-only=on",
            ]
            backing = ",backing=base"
        blockdevs += [
            "--blockdev",
            f"driver=file,node-name=file,filename={image.path},cache.direct={direct},aio={aio},locking=off",
            "--blockdev", f"driver={image.format},node-name=disk,file=file{backing}",
        ]
    return [tools.qsd, *blockdevs, "--export",
            f"type=fuse,id=exp,node-name=disk,mountpoint={mnt},writable=on", *spec.args]


def qemu_nbd_command(tools: Tools, spec: TargetSpec, image: Image, sock: str) -> list[str]:
    """qemu-nbd serving the image on a unix socket (multi-conn capable)."""
    assert tools.qemu_nbd
    aio = spec.options.get("aio", "io_uring")
    base = [tools.qemu_nbd, "--persistent", "--shared=8", f"--socket={sock}"]
    if image.kind == "null":
        return base + ["--image-opts", f"driver=null-co,size={image.size},read-zeroes=on"]
    cache = "none" if image.direct else "writeback"
    return base + [f"--cache={cache}", f"--aio={aio}", "--image-opts",
                   f"driver={image.format},file.driver=file,file.filename={image.path},file.locking=off"]


def source_dir(image: Image) -> str:
    """The directory a directory export mounts: the ``tree`` image itself, or the image file's directory."""
    assert image.path
    return os.path.abspath(image.path) if image.kind == "tree" else os.path.dirname(os.path.abspath(image.path))


def passthrough_hp_command(tools: Tools, spec: TargetSpec, image: Image, mnt: str) -> list[str]:
    """``passthrough_hp --foreground ARGS IMAGE_DIR MNT``: libfuse's example exports a directory,
    so it mounts the image's directory and fio opens ``MNT/<image file name>``.

    A directory target without passthrough gets ``--nopassthrough`` where this passthrough_hp
    has passthrough (libfuse 3.17+; before that it never passes through)."""
    assert tools.passthrough_hp and image.path
    args = list(spec.args)
    if spec.options.get("passthrough") == "off" and tools.pthp_has_passthrough():
        args.append(PTHP_NOPT_FLAG)
    return [tools.passthrough_hp, "--foreground", *args, source_dir(image), mnt]


def fusex_dir_command(tools: Tools, spec: TargetSpec, image: Image, mnt: str) -> list[str]:
    """``fusex mount --writable ARGS SRC_DIR MNT`` (a directory export)."""
    binary = spec.options.get("binary") or tools.fusex
    assert binary
    return [binary, "mount", "--writable", *spec.args, source_dir(image), mnt]


def bindfs_command(tools: Tools, spec: TargetSpec, image: Image, mnt: str) -> list[str]:
    """``bindfs -f ARGS SRC_DIR MNT`` (foreground, so the runner owns the daemon)."""
    assert tools.bindfs
    return [tools.bindfs, "-f", *spec.args, source_dir(image), mnt]


DIR_COMMANDS = {"passthrough_hp": (passthrough_hp_command, "passthrough_hp.log"),
                "fusex-dir": (fusex_dir_command, "fusex.log"),
                "bindfs": (bindfs_command, "bindfs.log")}


def start_dir_target(spec: TargetSpec, image: Image, workdir: str, tools: Tools) -> RunningTarget:
    """Mount a directory export of ``image``'s source directory on ``workdir``/export.d.

    The target's path is the mount point itself (``tree``) or the image file below it."""
    cmd_of, logname = DIR_COMMANDS[spec.kind]
    mnt = os.path.join(workdir, "export.d")
    os.makedirs(mnt, exist_ok=True)
    path = mnt if image.kind == "tree" else os.path.join(mnt, os.path.basename(image.path or ""))
    t = RunningTarget(spec, image, path, workdir, mountpoint=mnt, fusermount=tools.fusermount,
                      unmount_first=True)
    t.config = {"exports": source_dir(image), "writable": True, "args": list(spec.args)}
    if spec.kind == "passthrough_hp":
        t.config["passthrough"] = tools.pthp_has_passthrough() and spec.options.get("passthrough") != "off"
    try:
        _launch(t, cmd_of(tools, spec, image, mnt), logname)
    except BaseException:
        t.stop()
        raise
    return t


def start_passthrough_hp(spec: TargetSpec, image: Image, workdir: str, tools: Tools) -> RunningTarget:
    """Mount passthrough_hp over ``image``'s directory on ``workdir``/export.d (a directory)."""
    assert image.path
    mnt = os.path.join(workdir, "export.d")
    os.makedirs(mnt, exist_ok=True)
    t = RunningTarget(spec, image, os.path.join(mnt, os.path.basename(image.path)), workdir, mountpoint=mnt,
                      fusermount=tools.fusermount, unmount_first=True)
    t.config = {"exports": os.path.dirname(os.path.abspath(image.path)), "writable": True,
                "splice": "--nosplice" not in spec.args, "cache": "--nocache" not in spec.args,
                "threads": "libfuse default" if not {"--num-threads", "--single"} & set(spec.args) else "as in args",
                "image_open": "with the opener's flags (fio: O_DIRECT)"}
    try:
        _launch(t, passthrough_hp_command(tools, spec, image, mnt), "passthrough_hp.log")
    except BaseException:
        t.stop()
        raise
    return t


def start_target(spec: TargetSpec, image: Image, workdir: str, tools: Tools) -> RunningTarget:
    """Mount ``spec`` over ``image`` (files go to ``workdir``).

    Raises :class:`TargetError` if it does not come up; nothing is left
    mounted or running in that case.
    """
    os.makedirs(workdir, exist_ok=True)
    if spec.kind == "native":
        assert image.path
        return RunningTarget(spec, image, image.path, workdir,
                             config={"what": "fio opens the image file directly"})
    if spec.options.get("dir"):
        return start_dir_target(spec, image, workdir, tools)
    if spec.kind == "passthrough_hp":
        return start_passthrough_hp(spec, image, workdir, tools)
    mnt = os.path.join(workdir, "export")
    with open(mnt, "a", encoding="ascii"):
        pass  # qemu-storage-daemon and nbdfuse mount over an existing regular file
    t = RunningTarget(spec, image, mnt, workdir, mountpoint=mnt, fusermount=tools.fusermount)
    try:
        if spec.kind == "fusex" and image.nbd:
            assert image.nbd_server_pid
            t.config = {"nbd_server": image.kind, "uri": image.nbd_uri, "writable": True, "args": list(spec.args)}
            t.shared_pids.append(image.nbd_server_pid)
            _launch(t, fusex_command(tools, spec, image, mnt), "fusex.log")
        elif spec.kind == "fusex":
            cmd = fusex_command(tools, spec, image, mnt)
            t.config = {"image_o_direct": image.direct, "writable": True, "args": list(spec.args),
                        **({"image_format": image.format} if image.per_target else {})}
            _launch(t, cmd, "fusex.log")
        elif spec.kind == "qsd":
            cmd = qsd_command(tools, spec, image, mnt)
            t.config = {"image_o_direct": image.direct, "writable": True,
                        "aio": spec.options.get("aio", "io_uring"), "locking": "off",
                        "backend": "null-co read-zeroes=on" if image.kind == "null" else _backend(image)}
            _launch(t, cmd, "qsd.log")
        elif spec.kind == "nbdfuse" and image.nbd:
            assert tools.nbdfuse and image.nbd_socket and image.nbd_server_pid
            t.config = {"nbd_server": image.kind, "nbdfuse_connections": 4, "writable": True}
            t.shared_pids.append(image.nbd_server_pid)
            _launch(t, [tools.nbdfuse, mnt, "--unix", image.nbd_socket, *spec.args], "nbdfuse.log")
        elif spec.kind == "nbdfuse":
            sock = os.path.join(workdir, "nbd.sock")
            server = qemu_nbd_command(tools, spec, image, sock)
            t.config = {"image_o_direct": image.direct, "writable": True,
                        "qemu_nbd_cache": "none" if image.direct else "writeback",
                        "aio": spec.options.get("aio", "io_uring"), "nbdfuse_connections": 4,
                        "backend": "null-co read-zeroes=on" if image.kind == "null" else _backend(image)}
            log = os.path.join(workdir, "qemu-nbd.log")
            srv = spawn(server, log)
            t.procs.append(srv)
            t.logs.append(log)
            t.commands.append(server)
            _wait_path(sock, srv, log)
            assert tools.nbdfuse
            client = [tools.nbdfuse, mnt, "--unix", sock, *spec.args]
            # _launch puts nbdfuse first, so stop() unmounts before it kills the server.
            _launch(t, client, "nbdfuse.log")
        else:
            raise TargetError(f"unknown kind {spec.kind}")
        if image.format != "raw":
            exported = os.path.getsize(mnt)
            if exported != image.size:
                raise TargetError(f"exports {exported} bytes, not the {image.format} image's virtual size "
                                  f"{image.size} (is the {image.format} format supported?)")
    except BaseException:
        t.stop()
        raise
    return t


def _backend(image: Image) -> str:
    return f"file+{image.format}" + (" over a qcow2 base (file+qcow2, read-only)" if image.backing else "")


def _launch(t: RunningTarget, cmd: list[str], logname: str, wait: bool = True) -> None:
    log = os.path.join(t.workdir, logname)
    t.procs.insert(0, spawn(cmd, log))
    t.logs.insert(0, log)
    t.commands.insert(0, cmd)
    if wait:
        _wait_mounted(t)


# --------------------------------------------------------------------------- group + signals


class TargetGroup:
    """All targets mounted for one matrix; stops them all on exit."""

    def __init__(self, workdir: str, fusermount: Optional[str] = None) -> None:
        self.workdir = workdir
        self.fusermount = fusermount
        self.targets: list[RunningTarget] = []
        atexit.register(self.stop_all)

    def add(self, target: RunningTarget) -> None:
        self.targets.append(target)

    def remove(self, target: RunningTarget) -> None:
        """Forget ``target`` (after stopping it)."""
        self.targets = [t for t in self.targets if t is not target]

    def stop_all(self) -> None:
        """Stop every target (reverse start order), then sweep the workdir."""
        with ignoring_signals():
            for t in reversed(self.targets):
                t.stop()
            for m in mounts_under(self.workdir):
                force_unmount(m, self.fusermount)

    def __enter__(self) -> "TargetGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
        atexit.unregister(self.stop_all)


_interrupted: list[int] = []
_cleaning = [0]


def _handler(signum: int, _frame: object) -> None:
    if _interrupted or _cleaning[0]:
        sys.stderr.write(f"\nfusexbench: {signal.Signals(signum).name} again: still unmounting, please wait\n")
        return
    _interrupted.append(signum)
    raise Interrupted(signum)


@contextlib.contextmanager
def signal_guard() -> Iterator[None]:
    """Turn SIGINT/SIGTERM/SIGHUP into :class:`Interrupted` in the main thread."""
    sigs = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    old = {s: signal.getsignal(s) for s in sigs}
    _interrupted.clear()
    for s in sigs:
        signal.signal(s, _handler)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def ignoring_signals() -> Iterator[None]:
    """While cleaning up, a further Ctrl-C only prints a note."""
    _cleaning[0] += 1
    try:
        yield
    finally:
        _cleaning[0] -= 1


def interrupted_signal() -> Optional[int]:
    """The signal that interrupted the run, if any."""
    return _interrupted[0] if _interrupted else None
