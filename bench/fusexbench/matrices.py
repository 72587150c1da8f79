"""Benchmark matrices, named after the published measurement they reproduce.

The originals are in ``/work/shared/seeds`` (see its README):

* ``quick``       - the everyday check (~2 min per round with 3 targets).
* ``coroutines``  - seeds/000: QEMU FUSE export in coroutines, randrw 4k io_uring QD1/QD64.
* ``multiqueue``  - seeds/001: QEMU FUSE multi-threading, {seq,rand}x{read,write}x{aio,sync}
                    x numjobs {1,4} on file and null, 1 vs N queues.
* ``zerocopy``    - seeds/002: FUSE zero copy RFC, 4k/128k read/randread at (QD, jobs).
* ``uring``       - seeds/003: QEMU FUSE-over-io_uring, 1 GiB 70/30 randrw, {1,4}x{1,64}.
* ``passthrough`` - seeds/004: passthrough file-access test, 1M/500M/1000M files.
* ``passthrough-fio`` - the passthrough issue's goals (fio, growable export).
* ``qcow2``       - the qcow2 issue's goals: fusex on qcow2 vs fusex on the same
                    data as raw vs qemu-storage-daemon on the same qcow2.
* ``formats``     - issue 30's goals: fusex on VMDK, VHD (vpc), VDI and VHDX vs fusex on
                    the same data as raw vs qemu-storage-daemon on the same image.
* ``nbd``         - the NBD issue's goals: fusex's NBD client vs nbdfuse, clients of one
                    qemu-nbd and of one nbdkit with 1 ms injected latency.
* ``side-by-side`` - issue #14's goals: fusex (default, each transport, passthrough on
                    and off) vs native, qsd, nbdfuse and libfuse's passthrough_hp.
* ``dirfs``       - seeds/004 on directory exports: fusex's directory mode (passthrough
                    on, off, defaults) vs passthrough_hp (with and without passthrough),
                    bindfs and native, caches dropped before every pass (issue #27).
* ``metadata``    - issue #27's metadata goals: create/stat/readdir/unlink of 100k small
                    files, untar of a ~50k-file source tree, find, du, git status.

A matrix says which fusex configurations it compares (``fusex_variants``):
when the user asks for ``fusex`` the runner substitutes these; a tuple means
"the first of these that this fusex binary supports".
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Union

from .fileaccess import FileAccessWorkload
from .fio import FioWorkload, parse_size
from .metadata import META_OPS, TREE_OPS, MetaWorkload
from .targets import TargetSpec

Workload = Union[FioWorkload, FileAccessWorkload, MetaWorkload]
Variant = Union[str, tuple[str, ...]]


@dataclass
class Matrix:
    """A named set of workloads, images and fusex configurations."""

    name: str
    title: str
    seed: str
    reproduces: str
    workloads: list[Workload]
    images: tuple[str, ...] = ("shm",)
    fusex_variants: tuple[Variant, ...] = ("fusex",)
    default_targets: tuple[str, ...] = ("native", "fusex", "qsd", "nbdfuse")
    backend_direct: bool = True
    kind: str = "fio"
    fuse_uring: bool = False
    fusex_extra: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)
    goals: list[dict[str, Any]] = field(default_factory=list)
    # One target's IOPS on one workload against another of its workloads (same image):
    # {"target", "image", "num", "den", "min"}: the median per-round num/den >= min.
    scaling_goals: list[dict[str, Any]] = field(default_factory=list)
    # fusex against the best of several peers, against native, and transport against transport:
    # {"fusex": [targets], "peers": [targets], "vs_peer_min", "vs_native": {workload: min},
    #  "balance": [[a, b], ...], "balance_min"} (see report.peer_goal_rows).
    peer_goals: dict[str, Any] = field(default_factory=dict)
    # "all": the goals table shows every target's MiB/s next to its IOPS (default: the first target's only).
    bw_columns: str = "first"

    def image_sizes(self, default_size: int, workloads: Optional[list[Workload]] = None) -> list[int]:
        """Image sizes needed: one for fio matrices, one per file size for fileaccess."""
        if self.kind == "fileaccess":
            wl = self.workloads if workloads is None else workloads
            return sorted({w.size for w in wl if isinstance(w, FileAccessWorkload)})
        if self.kind == "metadata":
            return [0]  # one source directory
        return [default_size]

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "title": self.title, "seed": self.seed,
                "reproduces": self.reproduces, "kind": self.kind, "images": list(self.images),
                "fusex_variants": [list(v) if isinstance(v, tuple) else v for v in self.fusex_variants],
                "backend_direct": self.backend_direct, "fuse_uring": self.fuse_uring,
                "fusex_extra": list(self.fusex_extra), "notes": list(self.notes),
                **({"goals": [dict(g) for g in self.goals]} if self.goals else {}),
                **({"scaling_goals": [dict(g) for g in self.scaling_goals]} if self.scaling_goals else {}),
                **({"peer_goals": dict(self.peer_goals)} if self.peer_goals else {}),
                **({"bw_columns": self.bw_columns} if self.bw_columns != "first" else {})}


TRANSPORT_NOTE = ("fusex runs with `--passthrough off` here: this matrix measures the request transport, "
                  "which passthrough would bypass for reads.")
PT_OFF = ("--passthrough", "off")


def _fio(name: str, rw: str, bs: str, qd: int, jobs: int = 1, engine: str = "io_uring",
         mix: Optional[int] = None) -> FioWorkload:
    return FioWorkload(name=name, rw=rw, bs=bs, iodepth=qd, numjobs=jobs, ioengine=engine, rwmixread=mix)


def quick() -> Matrix:
    return Matrix(
        name="quick",
        title="Quick check",
        seed="-",
        reproduces="DESIGN.md section 5 transport-ceiling table (4k QD1/QD64, 4 jobs, 128k)",
        workloads=[
            _fio("randread-4k-qd1", "randread", "4k", 1, engine="psync"),
            _fio("randread-4k-qd64", "randread", "4k", 64),
            _fio("randwrite-4k-qd64", "randwrite", "4k", 64),
            _fio("randrw70-4k-qd64-4j", "randrw", "4k", 64, jobs=4, mix=70),
            _fio("read-128k-qd16", "read", "128k", 16),
        ],
        fusex_variants=("fusex", "fusex-pt-off"),
        default_targets=("native", "fusex", "qsd", "nbdfuse"),
        notes=["`fusex` is fusex as installed (passthrough auto: reads may bypass fusex); "
               "`fusex-pt-off` sends every request through fusex's transport."],
    )


def coroutines() -> Matrix:
    return Matrix(
        name="coroutines",
        title="QEMU FUSE export in coroutines",
        seed="000_3f055b950e059908.txt",
        reproduces="fio randrw 4k, io_uring, iodepth 1 and 64, one job (QEMU coroutine FUSE export, Mar 2025)",
        workloads=[
            _fio("randrw-4k-qd1", "randrw", "4k", 1, mix=50),
            _fio("randrw-4k-qd64", "randrw", "4k", 64, mix=50),
        ],
        fusex_extra=PT_OFF,
        notes=[TRANSPORT_NOTE],
    )


def multiqueue() -> Matrix:
    wl: list[Workload] = []
    for jobs in (1, 4):
        for sync in (False, True):
            for direction in ("read", "write"):
                for pattern in ("seq", "rand"):
                    rw = direction if pattern == "seq" else f"rand{direction}"
                    engine, qd = ("psync", 1) if sync else ("libaio", 16)
                    name = f"{pattern}{direction}-{'sync' if sync else 'aio'}-{jobs}j"
                    wl.append(_fio(name, rw, "4k", qd, jobs=jobs, engine=engine))
    return Matrix(
        name="multiqueue",
        title="Multi-queue (cloned /dev/fuse fds)",
        seed="001_8eeecc7af9341bed.txt",
        reproduces=("{seq,rand} x {read,write} x {aio: libaio QD16, sync: psync QD1} x numjobs {1,4}, "
                    "file and null backends, 1 vs N queues (QEMU FUSE multi-threading, Jul 2025)"),
        workloads=wl,
        images=("shm", "null"),
        fusex_variants=(("fusex-q1", "fusex"), "fusex-qN"),
        default_targets=("native", "fusex", "qsd"),
        fusex_extra=PT_OFF,
        notes=[TRANSPORT_NOTE],
    )


def zerocopy() -> Matrix:
    wl: list[Workload] = []
    for bs in ("4k", "128k"):
        for rw in ("read", "randread"):
            for qd, jobs in ((1, 1), (64, 1), (16, 4), (64, 16)):
                wl.append(_fio(f"{rw}-{bs}-qd{qd}-{jobs}j", rw, bs, qd, jobs=jobs))
    return Matrix(
        name="zerocopy",
        title="Zero copy (io_uring fixed buffers)",
        seed="002_50d4f9716c6972ed.txt",
        reproduces="4k and 128k read/randread IOPS at (QD, jobs) in {(1,1),(64,1),(16,4),(64,16)} (FUSE zero-copy RFC, Oct 2025)",
        workloads=wl,
        default_targets=("native", "fusex", "qsd"),
        fusex_extra=PT_OFF,
        notes=[TRANSPORT_NOTE],
    )


def uring() -> Matrix:
    wl: list[Workload] = []
    for jobs in (1, 4):
        for qd in (1, 64):
            wl.append(_fio(f"randrw70-4k-qd{qd}-{jobs}j", "randrw", "4k", qd, jobs=jobs, mix=70))
    return Matrix(
        name="uring",
        title="FUSE-over-io_uring transport",
        seed="003_8fa16c596afe041b.txt",
        reproduces="1 GiB file, 70/30 randrw 4k, (jobs, QD) in {1,4}x{1,64}; bandwidth and mean latency, legacy vs io_uring (QEMU FUSE-over-io_uring v4, 2026)",
        workloads=wl,
        fusex_variants=(("fusex-legacy", "fusex"), "fusex-uring"),
        default_targets=("native", "fusex", "qsd"),
        fuse_uring=True,
        fusex_extra=PT_OFF,
        notes=[TRANSPORT_NOTE, "FUSE-over-io_uring needs /sys/module/fuse/parameters/enable_uring = Y: with --fuse-uring auto "
               "(the default) the runner sets it for this matrix only (root) and restores it afterwards."],
    )


def passthrough() -> Matrix:
    wl: list[Workload] = []
    for size in ("1M", "500M", "1000M"):
        for cache in ("cold", "warm"):
            for mode in ("seq", "rand"):
                for buf in ("4k", "128k", "256k"):
                    wl.append(FileAccessWorkload(
                        name=f"{size}-{mode}-{buf}-{cache}", size=parse_size(size), mode=mode,
                        bufsize=parse_size(buf), cache=cache))
    return Matrix(
        name="passthrough",
        title="Passthrough file-access test",
        seed="004_7b719478e50ca2e8.txt",
        reproduces=("files of 1 MiB, 500 MiB, 1000 MiB read sequentially and randomly with 4 KiB, 128 KiB, "
                    "256 KiB buffers, time and read calls, cold and warm cache (FUSE passthrough question, Nov 2024)"),
        workloads=wl,
        images=("disk",),
        fusex_variants=(("fusex-pt-off", "fusex"), "fusex-pt-on", "fusex-kcache"),
        default_targets=("native", "fusex"),
        backend_direct=False,
        kind="fileaccess",
        notes=["Servers use buffered I/O on the files here: passthrough means the backing file's page cache.",
               "Cold = `sync; echo 3 > /proc/sys/vm/drop_caches` before the pass (root only); "
               "warm = the file was read once through the same path just before.",
               "On /dev/shm (tmpfs) dropping caches does not evict the file itself: only the FUSE side is cold."],
    )


def passthrough_fio() -> Matrix:
    return Matrix(
        name="passthrough-fio",
        title="Passthrough vs native (fio)",
        seed="-",
        reproduces=("4k randread QD1 and QD64, 4k randwrite QD64, 128k sequential read and write QD16 on a "
                    "growable writable export, passthrough on and off, /dev/shm and local disk"),
        workloads=[
            _fio("randread-4k-qd1", "randread", "4k", 1, engine="psync"),
            _fio("randread-4k-qd64", "randread", "4k", 64),
            _fio("randwrite-4k-qd64", "randwrite", "4k", 64),
            _fio("read-128k-qd16", "read", "128k", 16),
            _fio("write-128k-qd16", "write", "128k", 16),
        ],
        images=("shm", "disk"),
        fusex_variants=("fusex-pt-on", "fusex-pt-off"),
        default_targets=("native", "fusex"),
        fusex_extra=("--growable",),
        notes=["The export is `--writable --growable`: only then may the kernel pass writes straight to the "
               "image (a fixed-size export takes writes itself so nothing can grow the image).",
               "fio opens with O_DIRECT: natively and passed through that is O_DIRECT on the image; "
               "without passthrough it is FUSE direct I/O to fusex (image opened `--direct` where the "
               "filesystem allows it)."],
    )


def qcow2() -> Matrix:
    return Matrix(
        name="qcow2",
        title="qcow2 images",
        seed="-",
        reproduces=("4k randread/randwrite QD1 and QD64, 70/30 4k x 4 jobs, 128k sequential read and write, on a "
                    "fully allocated qcow2, a sparse qcow2 being filled and a qcow2 overlay over a backing file; "
                    "fusex on the qcow2 vs fusex on the same data as raw (passthrough off) vs "
                    "qemu-storage-daemon on the same qcow2 (the qcow2 issue's goals)"),
        workloads=[
            _fio("randread-4k-qd1", "randread", "4k", 1, engine="psync"),
            _fio("randread-4k-qd64", "randread", "4k", 64),
            _fio("randwrite-4k-qd1", "randwrite", "4k", 1, engine="psync"),
            _fio("randwrite-4k-qd64", "randwrite", "4k", 64),
            _fio("randrw70-4k-qd64-4j", "randrw", "4k", 64, jobs=4, mix=70),
            _fio("read-128k-qd16", "read", "128k", 16),
            _fio("write-128k-qd16", "write", "128k", 16),
        ],
        images=("qcow2-full", "qcow2-sparse", "qcow2-backing"),
        fusex_variants=("fusex", "fusex-raw"),
        default_targets=("fusex", "qsd", "native"),
        goals=[
            {"a": "fusex", "b": "fusex-raw", "min": 0.7, "rows": "all"},
            {"a": "fusex", "b": "qsd", "min": 2.0, "rows": "other"},
            {"a": "fusex", "b": "qsd", "min": 1.5, "rows": "allocating"},
        ],
        notes=["`fusex` is fusex with its default options on a qcow2 (format auto-detected); `fusex-raw` is fusex "
               "with `--passthrough off` on a raw file holding the same data; `qsd` is qemu-storage-daemon's FUSE "
               "export of the same qcow2 (`driver=qcow2` over `driver=file,aio=io_uring`); `native` is fio on "
               "its own raw copy with no FUSE (on `qcow2-sparse` a sparse file, so its writes are a fill; on "
               "`qcow2-backing` the base's data, so its writes overwrite): what the filesystem itself does for a "
               "fill and for an overwrite. Every target has its own copy of the image.",
               "`qcow2-sparse` and `qcow2-backing` start every run that follows a write with a new empty image "
               "(overlay), unmounted and mounted again around it. On them a writing workload is a *fill*: each "
               "fio job goes over the whole image once (every block exactly once, in random order for the "
               "random modes; no `--time_based`, no ramp, so the first allocations count), the same work for "
               "every target; the run's cap (`fill_cap_s`) only stops a very slow target, and a fill that hit "
               "it is marked. With 64 KiB clusters, a 4k random fill allocates a cluster with 1 write in 16 "
               "(on the overlay: copying the rest of the cluster from the base); a 128k sequential fill "
               "allocates with every write. Reads of `qcow2-sparse` read unallocated clusters (zeros).",
               "Goals (qcow2 issue): fusex/fusex-raw >= 0.70 on every row, fusex/qsd >= 2 on every row, and "
               ">= 1.5 for allocating writes (the writing rows of `qcow2-sparse` and `qcow2-backing`)."],
    )


FORMAT_IMAGES = tuple(f"{fmt}-{state}" for fmt in ("vmdk", "vpc", "vdi", "vhdx") for state in ("full", "fill"))


def formats() -> Matrix:
    return Matrix(
        name="formats",
        title="VMDK, VHD, VDI and VHDX images",
        seed="-",
        reproduces=("4k randread/randwrite QD1 and QD64, 128k sequential read and write, on a fully allocated "
                    "and on an empty (being filled) image of each format: VMDK (monolithicSparse), VHD (vpc, "
                    "dynamic), VDI (dynamic) and VHDX (dynamic); fusex on the image vs fusex on the same data as raw (passthrough "
                    "off) vs qemu-storage-daemon on the same image (issue 30's goals)"),
        workloads=[
            _fio("randread-4k-qd1", "randread", "4k", 1, engine="psync"),
            _fio("randread-4k-qd64", "randread", "4k", 64),
            _fio("randwrite-4k-qd1", "randwrite", "4k", 1, engine="psync"),
            _fio("randwrite-4k-qd64", "randwrite", "4k", 64),
            _fio("read-128k-qd16", "read", "128k", 16),
            _fio("write-128k-qd16", "write", "128k", 16),
        ],
        images=FORMAT_IMAGES,
        fusex_variants=("fusex", "fusex-raw"),
        default_targets=("fusex", "qsd"),
        goals=[
            {"a": "fusex", "b": "fusex-raw", "min": 0.7, "rows": "other"},
            {"a": "fusex", "b": "qsd", "min": 2.0, "rows": "all"},
        ],
        bw_columns="all",
        notes=["`fusex` is fusex with its default options on the image (format auto-detected); `fusex-raw` is "
               "fusex with `--passthrough off` on a raw file holding the same data; `qsd` is "
               "qemu-storage-daemon's FUSE export of the same image (`driver=vmdk|vpc|vdi|vhdx` over "
               "`driver=file,aio=io_uring`). Every target has its own copy of the image. fusex refuses "
               "`--direct` on these formats, so every server opens its copy buffered (on /dev/shm a copy "
               "either way); fio uses O_DIRECT on the exports as everywhere.",
               "Images (`qemu-img`, each format's default dynamic subformat): `FMT-full` is `qemu-img convert "
               "-O FMT` of a raw file of random bytes (every block allocated; the raw copies hold those bytes), "
               "`FMT-fill` an empty image from `qemu-img create` (raw copies: sparse files). VMDK: "
               "`subformat=monolithicSparse` (64 KiB grains); VHD: `subformat=dynamic,force_size=on` (2 MiB "
               "blocks; force_size keeps the virtual size exact instead of rounding it to a CHS geometry); "
               "VDI: `preallocation=off` (1 MiB blocks); VHDX: `subformat=dynamic` (QEMU's default block size, "
               "8 MiB for images up to 1 GiB).",
               "`FMT-fill` starts every run that follows a write with a new empty image, unmounted and mounted "
               "again around it. On it a writing workload is a *fill*: each fio job goes over the whole image "
               "once (every block exactly once, in random order for the random modes; no `--time_based`, no "
               "ramp), the same work for every target; the run's cap (`fill_cap_s`) only stops a very slow "
               "target, and a fill that hit it is marked. A 4k random fill allocates a block with 1 write in 16 "
               "(VMDK), 256 (VDI) or 512 (VHD); a 128k sequential fill with every write (VMDK, two grains), "
               "1 in 8 (VDI) or 1 in 16 (VHD). Reads of `FMT-fill` read unallocated blocks (zeros).",
               "Goals (issue 30): fusex/fusex-raw >= 0.70 where no allocation happens (every row but the "
               "writing rows of `FMT-fill`), fusex/qsd >= 2 on every row."],
    )


def nbd() -> Matrix:
    return Matrix(
        name="nbd",
        title="NBD clients",
        seed="-",
        reproduces=("4k randread/randwrite QD1 and QD64, 70/30 4k x 4 jobs, 128k sequential read, through fusex's "
                    "NBD client and through nbdfuse, both clients of one qemu-nbd on a unix socket, and of one "
                    "nbdkit adding 1 ms per request with 64 threads (the NBD issue's goals)"),
        workloads=[
            _fio("randread-4k-qd1", "randread", "4k", 1, engine="psync"),
            _fio("randread-4k-qd64", "randread", "4k", 64),
            _fio("randwrite-4k-qd1", "randwrite", "4k", 1, engine="psync"),
            _fio("randwrite-4k-qd64", "randwrite", "4k", 64),
            _fio("randrw70-4k-qd64-4j", "randrw", "4k", 64, jobs=4, mix=70),
            _fio("read-128k-qd16", "read", "128k", 16),
        ],
        images=("nbd", "nbd-delay"),
        fusex_variants=("fusex-nbd",),
        default_targets=("fusex", "nbdfuse"),
        goals=[{"a": "fusex-nbd", "b": "nbdfuse", "min": 2.0, "rows": "all"}],
        scaling_goals=[
            {"target": "fusex-nbd", "image": "nbd-delay", "num": "randread-4k-qd64", "den": "randread-4k-qd1",
             "min": 40.0},
            {"target": "fusex-nbd", "image": "nbd-delay", "num": "randwrite-4k-qd64", "den": "randwrite-4k-qd1",
             "min": 40.0},
        ],
        notes=["One NBD server per image, started by the runner before the clients mount and shared by them: "
               "`nbd` is qemu-nbd (`--shared=16`, so a writable export advertises multi-conn; O_DIRECT on the "
               "image), `nbd-delay` is nbdkit's file plugin behind the delay filter (1 ms before every read, "
               "write and zero request) with `--threads 64`. Only one client does I/O at a time; the server's "
               "CPU time counts for the client that ran (server CPU = client + NBD server).",
               "`fusex-nbd` is `fusex mount --writable nbd+unix:///?socket=...` with default options (one "
               "connection per queue); `nbdfuse` is nbdfuse with its defaults (4 connections).",
               "Goals (NBD issue): fusex-nbd/nbdfuse >= 2 on every row; on `nbd-delay`, fusex-nbd's 4k QD64 "
               ">= 40 x its 4k QD1."],
    )


SBS_PEERS = ("qsd", "nbdfuse", "passthrough_hp")


def side_by_side() -> Matrix:
    return Matrix(
        name="side-by-side",
        title="Side by side: fusex's configurations, its peers and native",
        seed="-",
        reproduces=("4k randread/randwrite psync QD1 and io_uring QD64, 70/30 4k QD64 x 4 jobs, 4k randread libaio "
                    "QD16 x 4 jobs, 128k sequential read and write QD16, on one 1 GiB image on /dev/shm: fusex "
                    "with each transport and passthrough setting against native, qemu-storage-daemon, nbdfuse "
                    "and libfuse's passthrough_hp (issue #14's goals)"),
        workloads=[
            _fio("randread-4k-qd1", "randread", "4k", 1, engine="psync"),
            _fio("randwrite-4k-qd1", "randwrite", "4k", 1, engine="psync"),
            _fio("randread-4k-qd64", "randread", "4k", 64),
            _fio("randwrite-4k-qd64", "randwrite", "4k", 64),
            _fio("randrw70-4k-qd64-4j", "randrw", "4k", 64, jobs=4, mix=70),
            _fio("randread-4k-libaio-qd16-4j", "randread", "4k", 16, jobs=4, engine="libaio"),
            _fio("read-128k-qd16", "read", "128k", 16),
            _fio("write-128k-qd16", "write", "128k", 16),
        ],
        fusex_variants=("fusex", "fusex-legacy", "fusex-uring", "fusex-pt-off", "fusex-legacy-pt-off",
                        "fusex-uring-pt-off"),
        default_targets=("native", "fusex") + SBS_PEERS,
        fuse_uring=True,
        peer_goals={
            "fusex": ["fusex", "fusex-pt-off"],
            "peers": list(SBS_PEERS),
            "vs_peer_min": 1.3,
            "vs_native": {"randread-4k-qd64": 0.50, "randwrite-4k-qd64": 0.48,
                          "read-128k-qd16": 0.78, "write-128k-qd16": 0.62},
            "balance": [["fusex-legacy", "fusex-uring"], ["fusex-legacy-pt-off", "fusex-uring-pt-off"]],
            "balance_min": 0.95,
        },
        notes=["`fusex` runs with the binary's defaults (passthrough auto: reads of the raw image may bypass "
               "fusex); `-legacy`/`-uring` force the transport, `-pt-off` sends every request through fusex. "
               "The peers: qemu-storage-daemon's FUSE export (`qsd`), nbdfuse over qemu-nbd, and libfuse 3's "
               "`passthrough_hp` example (splice on, `--nocache`, its default worker threads), a libfuse server "
               "without passthrough, mounted over the image's directory (fio opens MNT/<image file>).",
               "Goals (issue #14), each a median of per-round ratios: fusex/best peer >= 1.3 on every row "
               "(best peer: the fastest of qsd, nbdfuse and passthrough_hp in that round; for `fusex` and "
               "`fusex-pt-off`); fusex/native >= 0.50 on randread-4k-qd64, >= 0.48 on randwrite-4k-qd64, "
               ">= 0.78 on read-128k-qd16, >= 0.62 on write-128k-qd16; legacy vs io_uring transport, slower/"
               "faster of the pair >= 0.95 on every row (with and without passthrough).",
               "FUSE-over-io_uring needs enable_uring = Y: with --fuse-uring auto (the default) the runner sets "
               "it for this matrix only (root) and restores it afterwards."],
    )


DIR_VARIANTS = ("fusex-dir", "fusex-dir-pt-on", "fusex-dir-pt-off")
DIR_PEERS = ("passthrough_hp-dir", "passthrough_hp-dir-pt", "bindfs")
DIR_TARGETS_NOTE = ("`fusex-dir` is `fusex mount --writable SRC_DIR MNT` with its defaults (passthrough auto, "
                    "cache auto); `-pt-on`/`-pt-off` set `--passthrough`. `passthrough_hp-dir` is libfuse's "
                    "passthrough_hp example with its defaults (splice, kernel cache) and without passthrough "
                    "(`--nopassthrough` where the binary has passthrough, libfuse 3.17+; the libfuse bench/peers.sh "
                    "builds has none), `passthrough_hp-dir-pt` the same with passthrough (skipped when the binary "
                    "has none); `bindfs` is bindfs with its defaults (`-f --no-allow-other`). All mount the "
                    "same source directory at once; `native` uses it directly.")


def dirfs() -> Matrix:
    wl: list[Workload] = []
    for size in ("1M", "500M", "1000M"):
        for mode in ("seq", "rand"):
            for buf in ("4k", "128k", "256k"):
                wl.append(FileAccessWorkload(name=f"{size}-{mode}-{buf}", size=parse_size(size), mode=mode,
                                             bufsize=parse_size(buf), cache="cold"))
    return Matrix(
        name="dirfs",
        title="Directory exports: the passthrough file-access test",
        seed="004_7b719478e50ca2e8.txt",
        reproduces=("files of 1 MiB, 500 MiB, 1000 MiB in a source directory read sequentially and randomly with "
                    "4 KiB, 128 KiB, 256 KiB buffers, page cache dropped before every pass; fusex's directory "
                    "export with passthrough on and off against passthrough_hp with and without passthrough, "
                    "bindfs and native (FUSE passthrough question, Nov 2024; issue #27)"),
        workloads=wl,
        images=("disk",),
        fusex_variants=DIR_VARIANTS,
        default_targets=("native", "fusex") + DIR_PEERS,
        backend_direct=False,
        kind="fileaccess",
        goals=[
            {"a": "fusex-dir-pt-on", "b": "fusex-dir-pt-off", "min": 1.0, "rows": "all"},
            {"a": "fusex-dir", "b": "native", "min": 0.9, "rows": "all"},
            {"a": "fusex-dir-pt-on", "b": "native", "min": 0.9, "rows": "all"},
        ],
        notes=[DIR_TARGETS_NOTE,
               "Each file is `image-SIZE.raw` of random bytes in one directory on the disk directory "
               "(`--disk-dir`); every pass opens `MNT/image-SIZE.raw` through its target.",
               "Cold = `sync; echo 3 > /proc/sys/vm/drop_caches` before every pass (root only).",
               "Goals (issue #27), medians of per-round MiB/s ratios: fusex with passthrough never slower than "
               "without (fusex-dir-pt-on/fusex-dir-pt-off >= 1.00) and fusex >= 0.90 x native "
               "(fusex-dir and fusex-dir-pt-on) on every row."],
    )


def metadata() -> Matrix:
    return Matrix(
        name="metadata",
        title="Directory exports: metadata",
        seed="-",
        reproduces=("create, stat, readdir and unlink of 100k small files in a tree, untar of a synthetic "
                    "~50k-file source tree, find and du over it, git status in it; fusex's directory export "
                    "against passthrough_hp, bindfs and native (issue #27)"),
        workloads=[MetaWorkload(op, op) for op in META_OPS + TREE_OPS],
        images=("tree",),
        fusex_variants=DIR_VARIANTS,
        default_targets=("native", "fusex") + DIR_PEERS,
        backend_direct=False,
        kind="metadata",
        goals=[
            {"a": "fusex-dir", "b": "bindfs", "min": 2.0, "rows": "all"},
            {"a": "fusex-dir", "b": "passthrough_hp-dir", "min": 1.3, "rows": "all"},
            {"a": "fusex-dir", "b": "passthrough_hp-dir-pt", "min": 1.3, "rows": "all"},
        ],
        notes=[DIR_TARGETS_NOTE,
               "The source is one directory on the disk directory (`--disk-dir`); each target works in its own "
               "subdirectory of it, through its mount (`MNT/<target>/`), natively in `SRC/native/`.",
               "Per round and target the rows run in this order, each timed as a whole after `sync; echo 3 > "
               "/proc/sys/vm/drop_caches`: `create` (bench/metaops.c: 100 directories of 1000 files of 100 "
               "bytes, `--meta-files`), `stat` (lstat of each), `readdir` (each directory read, no stat), "
               "`unlink` (every file and directory), `untar` (`tar -xf` of the synthetic source tree, "
               "`--tree-files`), `find` (`find -type f`), `du` (`du -s`), `git-status` (`git status "
               "--porcelain`, after one untimed run that refreshes the index). The untarred tree is removed "
               "(untimed, through the target) before the next round's untar.",
               "The source tree is synthetic and deterministic (no real source tree is fetched): "
               "`bench/.build/srctree-N-v1.tar`, N files in nested directories of 5-40 files, sizes "
               "log-uniform from 64 B to 32 KiB, text contents, committed as one git repository "
               "(`src/.git`, objects in one pack, included in the tarball and in the counts).",
               "Figures: operations per second (files, or tarball entries for untar/du/git-status, or lines "
               "for find) and the time of the whole operation.",
               "Goals (issue #27), medians of per-round ratios: fusex (defaults) >= 2 x bindfs and >= 1.3 x "
               "passthrough_hp on every row."],
    )


MATRICES: dict[str, Callable[[], Matrix]] = {
    "quick": quick,
    "coroutines": coroutines,
    "multiqueue": multiqueue,
    "uring": uring,
    "zerocopy": zerocopy,
    "passthrough": passthrough,
    "passthrough-fio": passthrough_fio,
    "qcow2": qcow2,
    "formats": formats,
    "nbd": nbd,
    "side-by-side": side_by_side,
    "dirfs": dirfs,
    "metadata": metadata,
}


def get(name: str) -> Matrix:
    """The matrix called ``name``."""
    try:
        return MATRICES[name]()
    except KeyError:
        raise KeyError(f"unknown matrix {name!r} (one of: {', '.join(MATRICES)}, all)") from None


def resolve(names: str) -> list[Matrix]:
    """``quick``, ``quick,uring`` or ``all``."""
    if names.strip() == "all":
        return [f() for f in MATRICES.values()]
    return [get(n.strip()) for n in names.split(",") if n.strip()]


def with_extra(spec: TargetSpec, extra: tuple[str, ...], flags: set[str]) -> tuple[TargetSpec, Optional[str]]:
    """``spec`` with the matrix's extra fusex arguments appended (if fusex supports them).

    An option the configuration already sets (``fusex-pt-on`` has ``--passthrough``) is not
    added again. Returns (spec, note or None).
    """
    if spec.kind != "fusex" or not extra:
        return spec, None
    if extra[0] in spec.args:
        return spec, None
    if extra[0] not in flags:
        return spec, f"{spec.name}: `fusex mount --help` has no {extra[0]}; ran without {' '.join(extra)}."
    return replace(spec, args=tuple(spec.args) + tuple(extra),
                   requires=tuple(spec.requires) + (extra[0],),
                   description=f"{spec.description}, {' '.join(extra)}"), None


def select_workloads(m: Matrix, patterns: Optional[str]) -> list[Workload]:
    """Workloads whose name equals or contains one of the comma patterns."""
    if not patterns:
        return list(m.workloads)
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    exact = [w for w in m.workloads if w.name in pats]
    if exact and len(exact) == len(pats):
        return exact
    return [w for w in m.workloads if any(p in w.name for p in pats)]


def expand_targets(requested: list[str], m: Matrix, catalogue: dict[str, TargetSpec],
                   why_not: Callable[[TargetSpec], Optional[str]]) -> tuple[list[TargetSpec], list[str]]:
    """Turn the requested target names into configurations for ``m``.

    ``fusex`` expands to the matrix's fusex variants; an unavailable variant
    is skipped with a note (or replaced by the next alternative in a tuple).
    Returns (specs, notes).
    """
    specs: list[TargetSpec] = []
    skipped: dict[str, list[str]] = {}  # reason -> names
    notes: list[str] = []

    def add(spec: TargetSpec) -> None:
        if spec.name not in {s.name for s in specs}:
            specs.append(spec)

    for name in requested:
        if name == "fusex":
            for variant in m.fusex_variants:
                alts = variant if isinstance(variant, tuple) else (variant,)
                for i, alt in enumerate(alts):
                    reason = why_not(catalogue[alt])
                    if reason is None:
                        if i > 0:
                            notes.append(f"Measured {alt} in place of {', '.join(alts[:i])} (unavailable).")
                        add(catalogue[alt])
                        break
                    skipped.setdefault(reason, []).append(alt)
            continue
        if name not in catalogue:
            raise KeyError(f"unknown target {name!r} (known: {', '.join(catalogue)})")
        reason = why_not(catalogue[name])
        if reason is None:
            add(catalogue[name])
        else:
            skipped.setdefault(reason, []).append(name)
    for reason, names in skipped.items():
        notes.append(f"Skipped {', '.join(names)}: {reason}.")
    return specs, notes


META_JOB_S = 12.0  # one metadata row on one target at 100k files / a 50k-file tree, caches dropped


def estimate_seconds(m: Matrix, n_jobs: int, runtime: float, ramp: float,
                     cap: Optional[float] = None, meta_scale: float = 1.0) -> float:
    """Rough wall time of ``n_jobs`` runs of matrix ``m``.

    File-access passes are mostly short; the few big cold random ones hit the cap.
    """
    if m.kind == "fileaccess":
        c = cap if cap is not None else max(2.0 * runtime, 2.0)
        return n_jobs * (0.15 * c + 0.3)
    if m.kind == "metadata":
        return n_jobs * META_JOB_S * meta_scale
    return n_jobs * (runtime + ramp + 0.6)
