"""Benchmark images: random-byte files on /dev/shm or local disk, null, qcow2, VMDK, VHD or VDI.

``shm`` (the default) puts a file of random bytes on tmpfs so the storage
costs almost nothing and the FUSE transport is what gets measured; ``disk``
puts it on the local filesystem; ``null`` has no file at all: fusex serves
``null:SIZE`` and the qemu peers ``null-co`` (reads return zeros, writes are
dropped).

The qcow2 kinds (on /dev/shm too) give every target its *own copy* of the
image, because two daemons must never open the same writable qcow2; a target
configuration says whether it wants the qcow2 or a raw file of the same data
(``TargetSpec.options["format"]``):

* ``qcow2-full``: random bytes, every cluster allocated (``qemu-img convert
  -O qcow2`` of a random raw file); the raw copies hold the same bytes.
* ``qcow2-sparse``: an empty qcow2 (no cluster allocated; the raw copy is a
  sparse file).  *Fresh*: re-created before a run once a write touched it,
  so writes always fill an empty image (first writes allocate clusters).
* ``qcow2-backing``: an empty qcow2 overlay over a fully allocated qcow2 base
  of random bytes (reads come from the base, writes allocate clusters in the
  overlay, copying the rest of the cluster from the base); the base is shared
  read-only by the overlays, the raw copies hold the base's bytes.  The
  overlays are fresh like the sparse image; a raw copy needs no renewal (raw
  writes change no layout).

The other formats (``formats`` matrix) work the same way, one pair of kinds
per format FMT in :data:`DISK_FORMATS` (``vmdk``, ``vpc`` = VHD, ``vdi``, ``vhdx``):

* ``FMT-full``: ``qemu-img convert -O FMT`` of a random raw file (every block
  allocated); the raw copies hold the same bytes.
* ``FMT-fill``: a freshly created empty image (``qemu-img create``, each
  format's default dynamic subformat); fresh like ``qcow2-sparse``, raw copies
  are sparse files.

fusex refuses ``--direct`` on these formats, so every server opens them (and
their raw copies) buffered: see :func:`prepare_image`.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from .fio import format_size

QCOW2_KINDS = ("qcow2-full", "qcow2-sparse", "qcow2-backing")
# qemu-img format name (= qemu-storage-daemon driver) -> its -o options for a dynamic image of exactly
# the requested size: VHD needs force_size=on, else qemu-img rounds the size to a CHS geometry (and
# marks the image so that readers take the footer's size: creator "qem2").
DISK_FORMATS: dict[str, tuple[str, ...]] = {
    "vmdk": ("subformat=monolithicSparse",),
    "vpc": ("subformat=dynamic", "force_size=on"),
    "vdi": ("preallocation=off",),
    "vhdx": ("subformat=dynamic",),
}
FORMAT_KINDS = tuple(f"{fmt}-{state}" for fmt in DISK_FORMATS for state in ("full", "fill"))
# Kinds where every target gets its own copy (its format, or raw with the same data).
PER_TARGET_KINDS = QCOW2_KINDS + FORMAT_KINDS
# Served by an NBD server the runner starts (see nbdserver.py); the clients connect to its socket.
NBD_KINDS = ("nbd", "nbd-delay")
# ``tree``: an empty source directory on the disk directory (the metadata matrix), no image file.
IMAGE_KINDS = ("shm", "disk", "null", "tree") + QCOW2_KINDS + FORMAT_KINDS + NBD_KINDS
FORMATS = ("raw", "qcow2") + tuple(DISK_FORMATS)
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
    format: str = "raw"                 # format of ``path`` (of a target's view: of its copy)
    backing: Optional[str] = None       # qcow2 overlays: the base image (qcow2)
    fresh: bool = False                 # re-created before a run once a write touched it
    copies: dict[str, dict[str, str]] = field(default_factory=dict)  # target -> {path, format}
    sources: dict[str, str] = field(default_factory=dict, repr=False)  # what copies are made of
    nbd_socket: Optional[str] = None    # NBD kinds: the running server's unix socket
    nbd_server_pid: Optional[int] = None  # NBD kinds: the server's pid (its CPU counts for every client)

    @property
    def nbd(self) -> bool:
        """True if the clients reach this image through an NBD server (the NBD kinds)."""
        return self.kind in NBD_KINDS

    @property
    def nbd_uri(self) -> Optional[str]:
        """``nbd+unix:///?socket=PATH`` of the running server (None before it runs)."""
        return f"nbd+unix:///?socket={self.nbd_socket}" if self.nbd_socket else None

    @property
    def label(self) -> str:
        """Short label such as ``shm-1G`` (``tree`` for the source directory: it has no size)."""
        return "tree" if self.kind == "tree" else f"{self.kind}-{format_size(self.size)}"

    @property
    def per_target(self) -> bool:
        """True if every target gets its own copy (the qcow2 kinds and the other formats' kinds)."""
        return self.kind in PER_TARGET_KINDS

    @property
    def own_format(self) -> str:
        """The format this kind is about: qcow2, a :data:`DISK_FORMATS` key, or raw."""
        return kind_format(self.kind)

    def format_for(self, wanted: Optional[str]) -> str:
        """The format a target wanting ``wanted`` (None: the image's own) gets."""
        if self.kind in PER_TARGET_KINDS:
            return wanted or self.own_format
        return "raw"

    def for_target(self, name: str) -> "Image":
        """What target ``name`` opens: its own copy for the per-target kinds, else this image."""
        if not self.per_target:
            return self
        c = self.copies[name]
        return replace(self, path=c["path"], format=c["format"],
                       backing=self.sources.get("base") if c["format"] == "qcow2" else None,
                       copies={}, sources={}, created=False)

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"kind": self.kind, "size": self.size, "label": self.label, "path": self.path,
                                  "direct": self.direct, "fs": self.fs, "note": self.note}
        if self.nbd:
            out["nbd_socket"] = self.nbd_socket
        if self.per_target:
            out.update({"fresh": self.fresh, "copies": {k: dict(v) for k, v in self.copies.items()},
                        "base": self.sources.get("base")})
        return out


def kind_format(kind: str) -> str:
    """The image format of kind ``kind`` (``qcow2-sparse`` -> qcow2, ``vpc-fill`` -> vpc, ``shm`` -> raw)."""
    if kind in QCOW2_KINDS:
        return "qcow2"
    if kind in FORMAT_KINDS:
        return kind.rsplit("-", 1)[0]
    return "raw"


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
    if kind == "shm" or kind in PER_TARGET_KINDS or kind in NBD_KINDS:
        return os.path.join("/dev/shm", f"fusexbench-{tag}")
    if kind in ("disk", "tree"):
        return os.path.join(disk_dir, f"fusexbench-{tag}")
    return None


def bytes_needed(kinds: list[str], sizes: list[int], copies: int) -> int:
    """Upper bound of what ``kinds`` of ``sizes`` take in /dev/shm for a run of ``copies`` targets:
    a per-target kind holds one copy per target (a fill image grows to its size) plus a base or a
    conversion source; the other shm kinds one file each."""
    total = 0
    for kind in kinds:
        if image_dir(kind, "", "") is None or kind in ("disk", "tree"):
            continue
        per = copies + 1 if kind in PER_TARGET_KINDS else 1
        total += per * sum(sizes)
    return total


def shm_room(path: str = "/dev/shm") -> int:
    """Bytes a run may put in tmpfs ``path``: its free space, at most what memory has available
    (tmpfs pages are memory; a tmpfs mounted larger than RAM would otherwise look roomier than it
    is), less 2 GiB kept for the servers, fio and the rest of the machine."""
    st = os.statvfs(path)
    room = st.f_bavail * st.f_frsize
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    room = min(room, int(line.split()[1]) * 1024)
    except OSError:
        pass
    return room - (2 << 30)


def prepare_image(kind: str, size: int, directory: Optional[str], want_direct: bool = True,
                  name: Optional[str] = None, targets: Optional[dict[str, str]] = None) -> Image:
    """Create (or plan, for null) one image of ``size`` random bytes.

    ``want_direct`` asks for O_DIRECT on the servers' side; it is granted
    only where the filesystem supports it (recorded in ``Image.note``).
    The per-target kinds make one copy per target: ``targets`` maps target
    name to the format it gets (see :meth:`Image.format_for`).  The
    :data:`FORMAT_KINDS` never get O_DIRECT: fusex refuses ``--direct`` on
    those formats, so every server (and fusex on the raw copy) opens them
    buffered, for the same conditions.
    """
    if kind not in IMAGE_KINDS:
        raise ValueError(f"unknown image kind {kind!r} (one of {', '.join(IMAGE_KINDS)})")
    if kind == "null":
        return Image(kind="null", size=size, path=None, direct=False, fs="-",
                     note="no data: reads return zeros, writes are dropped")
    assert directory is not None
    os.makedirs(directory, exist_ok=True)
    if kind == "tree":
        path = os.path.join(directory, name or "tree")
        os.makedirs(path, exist_ok=True)
        fs = fs_type(directory)
        return Image(kind="tree", size=size, path=path, fs=fs, created=True,
                     note=f"a source directory on {fs}; every target works in its own subdirectory of it")
    if kind in PER_TARGET_KINDS:
        img = prepare_per_target(kind, size, directory, targets or {})
    else:
        default = f"{kind}-{format_size(size)}.raw" if kind in NBD_KINDS else f"image-{format_size(size)}.raw"
        path = os.path.join(directory, name or default)
        write_random(path, size)
        img = Image(kind=kind, size=size, path=path, fs=fs_type(directory), created=True)
    can_direct = probe_direct(directory)
    img.direct = want_direct and can_direct and kind not in FORMAT_KINDS
    if want_direct and kind in FORMAT_KINDS:
        img.note = ("buffered I/O on the image for every server (fusex refuses --direct on "
                    f"{kind_format(kind)} images; the raw copies are opened the same way)")
    elif want_direct and not can_direct:
        img.note = f"{img.fs} has no O_DIRECT: every server uses buffered I/O on it"
    elif not want_direct:
        img.note = "buffered I/O on the image for every server (the matrix needs the page cache)"
    else:
        img.note = "O_DIRECT on the image for every server"
    if img.per_target:
        img.note = f"{PER_TARGET_NOTES[kind]}; {img.note}"
    if img.nbd:
        img.note = f"{NBD_NOTES[kind]}; {img.note}"
    return img


NBD_NOTES = {
    "nbd": "random bytes on /dev/shm served by one qemu-nbd on a unix socket (multi-conn), shared by every client",
    "nbd-delay": ("random bytes on /dev/shm served by one nbdkit (file plugin, delay filter: 1 ms per read, write "
                  "and zero request, --threads 64) on a unix socket, shared by every client"),
}


# --------------------------------------------------------------------------- qcow2

QCOW2_NOTES = {
    "qcow2-full": ("random bytes, every qcow2 cluster allocated (qemu-img convert -O qcow2 of a random raw file; "
                   "64 KiB clusters); every target has its own copy, raw copies hold the same bytes"),
    "qcow2-sparse": ("empty qcow2 (64 KiB clusters, nothing allocated; raw copies are sparse files), "
                     "one per target, re-created before any run that follows a write"),
    "qcow2-backing": ("empty qcow2 overlay (64 KiB clusters) over a fully allocated qcow2 base of random bytes, "
                      "one overlay per target (the base is shared read-only), re-created before any run that "
                      "follows a write; raw copies hold the base's bytes"),
}


FORMAT_NOTES = {
    "full": ("random bytes, every block allocated (qemu-img convert -O {fmt} -o {opts} of a random raw file); "
             "every target has its own copy, raw copies hold the same bytes"),
    "fill": ("empty {fmt} (qemu-img create -f {fmt} -o {opts}: nothing allocated; raw copies are sparse files), "
             "one per target, re-created before any run that follows a write"),
}
PER_TARGET_NOTES = {**QCOW2_NOTES, **{
    kind: FORMAT_NOTES[kind.rsplit("-", 1)[1]].format(fmt=kind_format(kind),
                                                       opts=",".join(DISK_FORMATS[kind_format(kind)]))
    for kind in FORMAT_KINDS}}


def create_options(fmt: str) -> list[str]:
    """``-o OPTS`` for ``qemu-img create``/``convert`` to ``fmt`` (none for raw and qcow2)."""
    opts = DISK_FORMATS.get(fmt)
    return ["-o", ",".join(opts)] if opts else []


def qemu_img(*args: str) -> None:
    """Run ``qemu-img ARGS`` (raises RuntimeError with its message on failure)."""
    exe = shutil.which("qemu-img")
    if not exe:
        raise RuntimeError("qemu-img not found (Debian: qemu-utils); the qcow2 images need it")
    p = subprocess.run([exe, *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"qemu-img {' '.join(args)}: {(p.stderr or p.stdout).strip()}")


def copy_path(img: Image, target: str, fmt: str) -> str:
    """Where target ``target``'s copy of ``img`` lives."""
    assert img.sources.get("dir")
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", target)
    return os.path.join(img.sources["dir"], f"{img.label}.{safe}.{fmt}")


def is_empty_kind(kind: str) -> bool:
    """True for the kinds whose every copy starts empty (``qcow2-sparse``, ``FMT-fill``)."""
    return kind == "qcow2-sparse" or (kind in FORMAT_KINDS and kind.endswith("-fill"))


def prepare_per_target(kind: str, size: int, directory: str, targets: dict[str, str]) -> Image:
    """The sources of a per-target kind and one copy per target (``targets``: name -> format)."""
    own = kind_format(kind)
    for t, fmt in targets.items():
        if fmt not in ("raw", own):
            raise ValueError(f"target {t}: image format {fmt!r} on a {kind} image (raw or {own})")
    img = Image(kind=kind, size=size, fs=fs_type(directory), created=True, format=own,
                fresh=not kind.endswith("-full"))
    label = img.label
    img.sources["dir"] = directory
    try:
        if not is_empty_kind(kind):  # the data: random bytes, converted to the kind's format
            raw = os.path.join(directory, f"{label}.data.raw")
            write_random(raw, size)
            img.sources["raw"] = raw
            out = os.path.join(directory, f"{label}.{'base' if kind == 'qcow2-backing' else 'data'}.{own}")
            qemu_img("convert", "-f", "raw", "-O", own, *create_options(own), raw, out)
            img.sources["base" if kind == "qcow2-backing" else own] = out
        # The last target to need a source takes it (a rename), unless renewing copies needs it later.
        left = {fmt: sum(1 for f in targets.values() if f == fmt) for fmt in FORMATS}
        for target, fmt in targets.items():
            left[fmt] -= 1
            make_copy(img, target, fmt, take=left[fmt] == 0)
        for role in FORMATS:
            src = img.sources.pop(role, None)
            if src:
                _unlink_quiet(src)
    except BaseException:
        remove_image(img)
        raise
    img.path = img.sources.get("base")
    return img


def make_copy(img: Image, target: str, fmt: str, take: bool = False) -> str:
    """(Re)create target ``target``'s copy of ``img`` in format ``fmt``; returns its path.

    ``take``: the source file may be moved instead of copied (nobody needs it later).
    """
    path = copy_path(img, target, fmt)
    _unlink_quiet(path)
    if is_empty_kind(img.kind):
        if fmt != "raw":
            qemu_img("create", "-q", "-f", fmt, *create_options(fmt), path, str(img.size))
        else:
            with open(path, "wb") as f:
                f.truncate(img.size)
    elif img.kind == "qcow2-backing" and fmt == "qcow2":
        base = img.sources["base"]
        qemu_img("create", "-q", "-f", "qcow2", "-b", base, "-F", "qcow2", path, str(img.size))
    else:  # the data's raw file, or the full qcow2
        src = img.sources.get(fmt)
        if not src or not os.path.exists(src):
            raise RuntimeError(f"{img.label}: no {fmt} source left to copy for {target}")
        if take:
            os.replace(src, path)
        else:
            shutil.copyfile(src, path)
    img.copies[target] = {"path": path, "format": fmt}
    return path


def needs_renewal(img: Image, target: str) -> bool:
    """True if ``target``'s copy is re-created after writes (fresh kinds; not raw copies of data)."""
    if not img.fresh or target not in img.copies:
        return False
    return is_empty_kind(img.kind) or img.copies[target]["format"] != "raw"


def renew_copy(img: Image, target: str) -> str:
    """Re-create ``target``'s copy as new (the target must not have it open)."""
    return make_copy(img, target, img.copies[target]["format"])


def allocated_bytes(path: Optional[str]) -> Optional[int]:
    """Bytes the file occupies on its filesystem (st_blocks), None if unknown."""
    try:
        return os.stat(path).st_blocks * 512 if path else None
    except OSError:
        return None


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


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
    """Delete an image this run created (with its copies and sources), and its directory when empty."""
    if not img.created:
        return
    if img.kind == "tree":
        shutil.rmtree(img.path or "", ignore_errors=True)
        return
    paths = [c["path"] for c in img.copies.values()]
    paths += [p for role, p in img.sources.items() if role != "dir"]
    if img.path:
        paths.append(img.path)
    for p in paths:
        _unlink_quiet(p)
    if paths:
        try:
            os.rmdir(os.path.dirname(paths[0]))
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
