"""User-space instructions per FUSE request of fusex, counted by valgrind's callgrind.

fusex runs under ``valgrind --tool=callgrind`` (one queue, passthrough off, no busy-polling, one
transport at a time) over an image on /dev/shm; fio sends a fixed number of requests through the
export; at unmount callgrind writes the instructions the daemon executed (``Ir``, all threads)
and fusex's ``--stats-file`` the requests it served. A baseline mount of the same transport with
a tiny fio run (10 I/Os) is subtracted, so start-up, INIT, OPEN and unmount do not count::

    instructions/request = (Ir - Ir_baseline) / (requests - requests_baseline)

Only fusex's own process is counted (user space: callgrind sees no kernel work). ``--spin-us 0``
by default: an idle busy-poll would add instructions that depend on timing, not on requests
(valgrind runs the daemon ~50x slower). Hardware counters (``perf stat -e instructions:u``) are
not available on these VMs, hence callgrind.

``bash bench/instructions.sh [FUSEX]`` runs it and prints a transport x request table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

from . import machine
from .fio import parse_size
from .images import write_random
from .targets import Interrupted, _child_setup, force_unmount, is_mounted, signal_guard

MOUNT_TIMEOUT_S = 120.0   # valgrind starts slowly
EXIT_TIMEOUT_S = 120.0    # callgrind writes its output at exit
BASELINE_IOS = 10


@dataclass(frozen=True)
class Case:
    """One fio request pattern: ``ios`` requests of ``bs`` bytes (psync, QD1, O_DIRECT)."""

    label: str
    rw: str
    bs: str
    ios: int


@dataclass
class Count:
    """What one mount under callgrind executed and served."""

    transport: str
    case: str
    fio_ios: int
    instructions: int
    requests: int
    reads: int
    writes: int


def parse_callgrind_total(text: str) -> int:
    """Total ``Ir`` of a callgrind output file (its ``totals:`` or ``summary:`` line).

    The figures on those lines follow the ``events:`` line's order; ``Ir`` is the first
    unless ``events:`` says otherwise.
    """
    events = ["Ir"]
    total: Optional[list[str]] = None
    for line in text.splitlines():
        if line.startswith("events:"):
            events = line.split(":", 1)[1].split()
        elif line.startswith(("totals:", "summary:")) and total is None:
            total = line.split(":", 1)[1].split()
    if total is None:
        raise ValueError("no totals: or summary: line in the callgrind output")
    if "Ir" not in events:
        raise ValueError(f"callgrind counted {events}, not Ir")
    return int(total[events.index("Ir")])


def per_request(count: Count, base: Count) -> Optional[float]:
    """Instructions per request of ``count`` above the baseline ``base`` (None if no requests)."""
    reqs = count.requests - base.requests
    return (count.instructions - base.instructions) / reqs if reqs > 0 else None


def fusex_command(valgrind: str, fusex: str, image: str, mnt: str, transport: str, out: str, stats: str,
                  extra: list[str]) -> list[str]:
    """``valgrind --tool=callgrind ... fusex mount --writable --passthrough off --transport T --queues 1``."""
    return [valgrind, "--tool=callgrind", f"--callgrind-out-file={out}", "--trace-children=no",
            fusex, "mount", "--writable", "--passthrough", "off", "--transport", transport, "--queues", "1",
            "--stats-file", stats, *extra, image, mnt]


def fio_command(fio: str, path: str, case: Case, size: int) -> list[str]:
    """fio doing exactly ``case.ios`` requests: ``--io_size`` = ios x bs, wrapping around the file."""
    return [fio, "--name=count", f"--filename={path}", f"--rw={case.rw}", f"--bs={case.bs}", "--direct=1",
            "--ioengine=psync", "--iodepth=1", f"--size={size}", f"--io_size={case.ios * parse_size(case.bs)}",
            "--randrepeat=0", "--allow_file_create=0", "--output-format=json"]


def _wait_mounted(mnt: str, proc: subprocess.Popen, log: str) -> None:
    deadline = time.monotonic() + MOUNT_TIMEOUT_S
    while time.monotonic() < deadline:
        if is_mounted(mnt):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"fusex under valgrind exited with {proc.returncode}: {_tail(log)}")
        time.sleep(0.1)
    raise RuntimeError(f"not mounted after {MOUNT_TIMEOUT_S:.0f} s: {_tail(log)}")


def _tail(path: str, n: int = 6) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return " | ".join(line.strip() for line in f.readlines()[-n:])
    except OSError:
        return ""


def _stop(fusex: str, mnt: str, proc: subprocess.Popen) -> None:
    """Unmount (``fusex umount``: under valgrind fusex does not see SIGTERM), let valgrind write its
    output, and make sure nothing stays mounted."""
    if is_mounted(mnt):
        subprocess.run([fusex, "umount", mnt], capture_output=True, timeout=60)
    try:
        proc.wait(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    force_unmount(mnt, shutil.which("fusermount3"))


def count(fusex: str, image: str, size: int, transport: str, case: Case, workdir: str,
          extra: list[str], fio: str = "fio", valgrind: str = "valgrind") -> Count:
    """Mount fusex under callgrind, run ``case`` through it, unmount; the daemon's totals."""
    tag = re.sub(r"[^a-z0-9]+", "-", f"{transport}-{case.label}-{case.ios}")
    mnt, out, stats, log = (os.path.join(workdir, f"{tag}.{x}") for x in ("mnt", "callgrind", "stats.json", "log"))
    with open(log, "wb") as lf:
        proc = subprocess.Popen(fusex_command(valgrind, fusex, image, mnt, transport, out, stats, extra),
                                stdin=subprocess.DEVNULL, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_child_setup)
    try:
        _wait_mounted(mnt, proc, log)
        p = subprocess.run(fio_command(fio, mnt, case, size), capture_output=True, text=True, timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(f"fio exit {p.returncode}: {p.stderr.strip()[-300:]}")
        job = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0]
        fio_ios = int(job["read"]["total_ios"]) + int(job["write"]["total_ios"])
    finally:
        _stop(fusex, mnt, proc)
    with open(out, encoding="utf-8", errors="replace") as f:
        instructions = parse_callgrind_total(f.read())
    with open(stats, encoding="utf-8") as f:
        st = json.load(f)
    ops = st.get("ops", {})
    return Count(transport, case.label, fio_ios, instructions, int(st["requests"]),
                 int(ops.get("READ", 0)), int(ops.get("WRITE", 0)))


def render(rows: list[dict[str, Any]]) -> str:
    """Markdown table: transport x case -> instructions per request."""
    out = ["| transport | fio job | fio I/Os | FUSE requests | instructions | instructions/request |",
           "| :--- | :--- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ipr = r["per_request"]
        out.append(f"| {r['transport']} | {r['case']} | {r['fio_ios']} | {r['requests']} | {r['instructions']:,} "
                   f"| {'-' if ipr is None else f'{ipr:,.0f}'} |")
    return "\n".join(out)


CASES = (Case("4k randread", "randread", "4k", 20000), Case("128k read", "read", "128k", 5000))


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="fusex's user-space instructions per FUSE request (callgrind)")
    p.add_argument("fusex", nargs="?", default=None, help="fusex binary (default: $FUSEX or target/release/fusex)")
    p.add_argument("--transports", default="legacy,uring", help="comma-separated (default legacy,uring)")
    p.add_argument("--ios-4k", type=int, default=CASES[0].ios, help="4k random reads per count (default 20000)")
    p.add_argument("--ios-128k", type=int, default=CASES[1].ios, help="128k sequential reads (default 5000)")
    p.add_argument("--size", default="64M", help="image size on /dev/shm (default 64M)")
    p.add_argument("--spin-us", default="0", help="fusex --spin-us (default 0: no idle busy-polling)")
    p.add_argument("--json", help="also write the counts here as JSON")
    p.add_argument("--fusex-arg", action="append", default=[],
                   help="one more fusex mount option word (repeatable), e.g. --fusex-arg=--latency=off")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    fusex = args.fusex or os.environ.get("FUSEX") or os.path.join(repo, "target", "release", "fusex")
    for tool in ("valgrind", "fio"):
        if not shutil.which(tool):
            print(f"instructions: {tool} not found (scripts/deps.sh --bench installs it)", file=sys.stderr)
            return 2
    if not os.access(fusex, os.X_OK):
        print(f"instructions: no fusex binary at {fusex}", file=sys.stderr)
        return 2
    cases = [Case(CASES[0].label, CASES[0].rw, CASES[0].bs, args.ios_4k),
             Case(CASES[1].label, CASES[1].rw, CASES[1].bs, args.ios_128k)]
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    try:
        with signal_guard():
            rows = measure_all(fusex, transports, cases, parse_size(args.size), ["--spin-us", args.spin_us, *args.fusex_arg])
    except Interrupted as e:
        print(f"instructions: {e}; unmounted, nothing measured", file=sys.stderr)
        return 128 + e.signum
    more = "".join(f" {a}" for a in args.fusex_arg)
    print(f"fusex {fusex}: user-space instructions per FUSE request (callgrind Ir above a {BASELINE_IOS}-I/O "
          f"baseline; --queues 1 --passthrough off --spin-us {args.spin_us}{more}; fio psync QD1 O_DIRECT, "
          f"{args.size} image on /dev/shm)\n")
    print(render(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"fusex": fusex, "spin_us": args.spin_us, "rows": rows}, f, indent=1)
    return 0


def measure_all(fusex: str, transports: list[str], cases: list[Case], size: int,
                extra: list[str]) -> list[dict[str, Any]]:
    """A baseline and every case, per transport, on a fresh random image on /dev/shm."""
    baseline = Case("baseline", "randread", "4k", BASELINE_IOS)
    workdir = tempfile.mkdtemp(prefix="fusex-instr-")
    shm = tempfile.mkdtemp(prefix="fusex-instr-", dir="/dev/shm")
    image = os.path.join(shm, "image.raw")
    uring_old: Optional[str] = None
    rows: list[dict[str, Any]] = []
    try:
        write_random(image, size)
        if "uring" in transports and machine.fuse_uring_enabled() == "N":
            uring_old = machine.set_fuse_uring("Y")
        for tr in transports:
            print(f"instructions: {tr}: baseline ({BASELINE_IOS} I/Os)", file=sys.stderr)
            base = count(fusex, image, size, tr, baseline, workdir, extra)
            rows.append({**asdict(base), "per_request": None})
            for case in cases:
                print(f"instructions: {tr}: {case.ios} x {case.label}", file=sys.stderr)
                c = count(fusex, image, size, tr, case, workdir, extra)
                rows.append({**asdict(c), "per_request": per_request(c, base)})
    finally:
        if uring_old is not None:
            machine.set_fuse_uring(uring_old)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
    return rows

if __name__ == "__main__":
    sys.exit(main())
