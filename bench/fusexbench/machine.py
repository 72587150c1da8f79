"""What the results came from: machine, kernel, FUSE settings, tool versions."""

from __future__ import annotations

import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
from typing import Any, Optional


CLK_TCK = os.sysconf("SC_CLK_TCK")


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _run(cmd: list[str], timeout: float = 10, ok_only: bool = False) -> Optional[str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if ok_only and p.returncode != 0:
        return None
    out = (p.stdout or p.stderr).strip()
    return out or None


def first_line(text: Optional[str]) -> Optional[str]:
    return text.splitlines()[0].strip() if text else None


def cpu_model() -> str:
    info = _read("/proc/cpuinfo") or ""
    m = re.search(r"^model name\s*:\s*(.+)$", info, re.MULTILINE)
    return m.group(1).strip() if m else platform.processor() or "?"


def mem_total_bytes() -> Optional[int]:
    info = _read("/proc/meminfo") or ""
    m = re.search(r"^MemTotal:\s*(\d+)\s*kB", info, re.MULTILINE)
    return int(m.group(1)) * 1024 if m else None


def os_name() -> str:
    rel = _read("/etc/os-release") or ""
    m = re.search(r'^PRETTY_NAME="?([^"\n]+)"?', rel, re.MULTILINE)
    return m.group(1) if m else platform.platform()


def machine_info() -> dict[str, Any]:
    """Kernel, CPUs, memory, OS, virtualization, FUSE module settings."""
    u = os.uname()
    fuse_params = {}
    pdir = "/sys/module/fuse/parameters"
    if os.path.isdir(pdir):
        for name in sorted(os.listdir(pdir)):
            fuse_params[name] = _read(os.path.join(pdir, name))
    virt = _run(["systemd-detect-virt"]) if shutil.which("systemd-detect-virt") else None
    return {
        "host": socket.gethostname(),
        "kernel": u.release,
        "kernel_version": u.version,
        "arch": u.machine,
        "os": os_name(),
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_allowed": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_bytes": mem_total_bytes(),
        "virtualization": virt,
        "cpufreq_governor": _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"),
        "fuse_module": fuse_params,
        "fuse_max_pages_limit": _read("/proc/sys/fs/fuse/max_pages_limit"),
        "uid": os.getuid(),
    }


def _passthrough_hp() -> Optional[str]:
    from .targets import passthrough_hp_version  # targets does not import machine: no cycle

    return passthrough_hp_version()


def tool_versions(fusex: Optional[str] = None, repo: Optional[str] = None) -> dict[str, Optional[str]]:
    """Versions of fio, the peers, the compiler, Python (and matplotlib)."""
    v: dict[str, Optional[str]] = {
        "fio": first_line(_run(["fio", "--version"])),
        "qemu-storage-daemon": first_line(_run(["qemu-storage-daemon", "--version"])),
        "qemu-nbd": first_line(_run(["qemu-nbd", "--version"])),
        "nbdfuse": first_line(_run(["nbdfuse", "--version"])),
        "nbdkit": first_line(_run(["nbdkit", "--version"])),
        "fusermount3": first_line(_run(["fusermount3", "--version"])),
        "gcc": first_line(_run(["gcc", "--version"])),
        "passthrough_hp": _passthrough_hp(),
        "python": sys.version.split()[0],
    }
    try:
        import matplotlib  # type: ignore

        v["matplotlib"] = matplotlib.__version__
    except Exception:  # noqa: BLE001 - optional
        v["matplotlib"] = None
    if fusex:
        v["fusex"] = first_line(_run([fusex, "--version"])) or "(no --version)"
        v["fusex_binary"] = fusex
    if repo:
        v["git_commit"] = _run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], ok_only=True)
        if v["git_commit"]:
            dirty = _run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"], ok_only=True)
            v["git_dirty"] = "yes" if dirty else "no"
    return v


def _proc_cpu() -> dict[int, tuple[float, str]]:
    out: dict[int, tuple[float, str]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as f:
                data = f.read()
            rest = data[data.rindex(")") + 2:].split()
            comm = data[data.index("(") + 1:data.rindex(")")]
            out[int(name)] = ((int(rest[11]) + int(rest[12])) / CLK_TCK, comm)
        except (OSError, ValueError, IndexError):
            continue
    return out


def _cpu_busy() -> tuple[float, float]:
    with open("/proc/stat", encoding="ascii") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return float(sum(vals)), float(idle)


def background_load(seconds: float = 1.0) -> dict[str, Any]:
    """How busy the machine is before the run: busy CPUs and top processes.

    Benchmarks on a machine where something else burns CPU are not
    comparable; the report warns when ``busy_cpus`` exceeds 0.25.
    """
    try:
        t0, i0 = _cpu_busy()
        p0 = _proc_cpu()
        time.sleep(seconds)
        t1, i1 = _cpu_busy()
        p1 = _proc_cpu()
    except OSError:
        return {}
    ncpu = os.cpu_count() or 1
    busy = (1.0 - (i1 - i0) / (t1 - t0)) * ncpu if t1 > t0 else 0.0
    top = []
    for pid, (cpu, comm) in p1.items():
        if pid in p0 and pid != os.getpid():
            d = (cpu - p0[pid][0]) / seconds
            if d >= 0.05:
                top.append({"pid": pid, "cpus": round(d, 2), "comm": comm})
    top.sort(key=lambda x: -x["cpus"])
    return {"busy_cpus": round(busy, 2), "loadavg": (_read("/proc/loadavg") or "").split()[:3], "top": top[:8]}


URING_PARAM = "/sys/module/fuse/parameters/enable_uring"


def fuse_uring_enabled() -> Optional[str]:
    """Value of fuse's enable_uring parameter (Y/N), None if absent."""
    return _read(URING_PARAM)


def set_fuse_uring(value: str) -> Optional[str]:
    """Write fuse's enable_uring parameter (root); return the previous value, None on failure."""
    old = _read(URING_PARAM)
    if old is None:
        return None
    try:
        with open(URING_PARAM, "w", encoding="ascii") as f:
            f.write(value)
    except OSError:
        return None
    return old


def machine_label(m: dict[str, Any]) -> str:
    """One line naming the machine, for figure captions and headings."""
    mem = m.get("memory_bytes")
    mem_s = f"{mem / (1 << 30):.0f} GiB" if mem else "? GiB"
    virt = m.get("virtualization")
    virt_s = f", {virt}" if virt and virt != "none" else ""
    return (f"{m.get('host', '?')}: {m.get('cpus', '?')} x {m.get('cpu_model', '?')}, {mem_s}, "
            f"Linux {m.get('kernel', '?')}{virt_s}")
