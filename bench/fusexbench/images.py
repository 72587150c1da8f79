"""Benchmark images: random-byte files on /dev/shm or local disk, or null.

``shm`` (the default) puts a file of random bytes on tmpfs so the storage
costs almost nothing and the FUSE transport is what gets measured; ``disk``
puts it on the local filesystem; ``null`` has no file at all: fusex serves
``null:SIZE`` and the qemu peers ``null-co`` (reads return zeros, writes are
dropped).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Callable, Optional

from .fio import format_size

IMAGE_KINDS = ("shm", "disk", "null")
CHUNK = 16 * 1024 * 1024


@dataclass
class Image:
    """One prepared (or planned) image.

    ``direct`` says whether the servers open it with O_DIRECT (decided per
    image by :func:`probe_direct` and the matrix); ``fs`` is the filesystem
    type it lives on.
    """

    kind: str
    size: int
    path: Optional[str] = None
    direct: bool = False
    fs: str = ""
    note: str = ""
    created: bool = field(default=False, repr=False)

    @property
    def label(self) -> str:
        """Short label such as ``shm-1G``."""
        return f"{self.kind}-{format_size(self.size)}"

    def to_json(self) -> dict[str, object]:
        return {"kind": self.kind, "size": self.size, "label": self.label, "path": self.path,
                "direct": self.direct, "fs": self.fs, "note": self.note}


def fs_type(path: str) -> str:
    """Filesystem type of the mount holding ``path`` (from /proc/self/mounts)."""
    path = os.path.realpath(path)
    best, best_type = "", "?"
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, best_type = mnt, parts[2]
    except OSError:
        pass
    return best_type


def probe_direct(directory: str) -> bool:
    """True if files in ``directory`` can be opened with O_DIRECT.

    tmpfs accepts O_DIRECT since Linux 6.6; older kernels return EINVAL.
    """
    probe = os.path.join(directory, f".odirect-probe-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    else:
        os.close(fd)
        return True
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass


def image_dir(kind: str, disk_dir: str, tag: str) -> Optional[str]:
    """Directory that will hold images of ``kind`` for this run."""
    if kind == "shm":
        return os.path.join("/dev/shm", f"fusexbench-{tag}")
    if kind == "disk":
        return os.path.join(disk_dir, f"fusexbench-{tag}")
    return None


def prepare_image(kind: str, size: int, directory: Optional[str], want_direct: bool = True,
                  name: Optional[str] = None) -> Image:
    """Create (or plan, for null) one image of ``size`` random bytes.

    ``want_direct`` asks for O_DIRECT on the servers' side; it is granted
    only where the filesystem supports it (recorded in ``Image.note``).
    """
    if kind not in IMAGE_KINDS:
        raise ValueError(f"unknown image kind {kind!r} (one of {', '.join(IMAGE_KINDS)})")
    if kind == "null":
        return Image(kind="null", size=size, path=None, direct=False, fs="-",
                     note="no data: reads return zeros, writes are dropped")
    assert directory is not None
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name or f"image-{format_size(size)}.raw")
    write_random(path, size)
    can_direct = probe_direct(directory)
    img = Image(kind=kind, size=size, path=path, fs=fs_type(directory), created=True)
    img.direct = want_direct and can_direct
    if want_direct and not can_direct:
        img.note = f"{img.fs} has no O_DIRECT: every server uses buffered I/O on it"
    elif not want_direct:
        img.note = "buffered I/O on the image for every server (the matrix needs the page cache)"
    else:
        img.note = "O_DIRECT on the image for every server"
    return img


def write_random(path: str, size: int) -> None:
    """Write ``size`` random bytes to ``path`` (reused if already that size)."""
    try:
        if os.path.getsize(path) == size:
            return
    except OSError:
        pass
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        left = size
        while left > 0:
            n = min(CHUNK, left)
            f.write(os.urandom(n))
            left -= n
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove_image(img: Image) -> None:
    """Delete an image this run created, and its directory when empty."""
    if not img.created or not img.path:
        return
    try:
        os.unlink(img.path)
    except FileNotFoundError:
        pass
    try:
        os.rmdir(os.path.dirname(img.path))
    except OSError:
        pass


def drop_caches() -> bool:
    """Write back and drop the page cache (root only). True on success."""
    try:
        subprocess.run(["sync"], check=False)
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def can_drop_caches() -> bool:
    """True if :func:`drop_caches` would work (needs root)."""
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)


def sweep_stale(bases: list[str], mounted: Callable[[str], bool]) -> list[str]:
    """Remove ``fusexbench-<pid>-*`` dirs left by runs that were SIGKILLed.

    A directory is stale when its pid is gone and nothing is mounted in it.
    Returns the removed paths.
    """
    removed = []
    for base in bases:
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in names:
            m = re.match(r"^fusexbench-(\d+)-", name)
            if not m or os.path.exists(f"/proc/{m.group(1)}"):
                continue
            path = os.path.join(base, name)
            if os.path.isdir(path) and not mounted(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def cleanup_dir(directory: Optional[str]) -> None:
    """Remove a per-run image directory and whatever is left in it."""
    if directory and os.path.isdir(directory) and os.path.basename(directory).startswith("fusexbench-"):
        shutil.rmtree(directory, ignore_errors=True)
