#!/usr/bin/env python3
"""Drive a QMP-controlled storage daemon (qemu-storage-daemon, or `fusex serve` as its drop-in)
through one fixed scenario and print a normalized JSON transcript on stdout.

    qmp_service.py PROGRAM WORKDIR

PROGRAM is the daemon's argv prefix as one string split on spaces ("qemu-storage-daemon",
"/path/fusex serve"); WORKDIR is an empty directory the script fills. Run as root. The transcript
printed for qemu-storage-daemon is kept in tests/qmp_service_qsd.json (regenerate it with
`qmp_service.py qemu-storage-daemon DIR > tests/qmp_service_qsd.json`; tests/serve.rs checks it
is current): the same script run against fusex must print the same text. Every path is written with WORKDIR replaced by "$W", and QEMU's
generated node names ("#block123") as "#block". Every wait is bounded: what does not happen in
time is recorded as "timeout". Exits 0 if the scenario ran to its end, else 1 with a one-line
reason on stderr (the transcript so far is still printed). Needs only the stdlib, qemu.qmp
(scripts/deps.sh installs it into target/qmp-venv), qemu-img and qemu-io.
"""

import asyncio
import errno
import json
import os
import re
import subprocess
import sys

from qemu.qmp import ConnectError, EventListener, ExecuteError, QMPClient

MiB = 1 << 20
TIMEOUT = 5  # seconds, for any QMP command, file I/O or event that should be quick


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def pattern(n, step=7):
    """Deterministic contents of a.raw (and, with another step, w.raw): a byte ramp that shifts
    every 4 KiB."""
    return bytes((i * step + (i >> 12)) & 0xFF for i in range(n))


class Scenario:
    def __init__(self, program, workdir):
        self.program = program.split()
        self.w = os.path.realpath(workdir)
        self.transcript = []
        self.proc = None
        self.qmp = None
        self.quit_sent = False
        self.events = EventListener(names="BLOCK_EXPORT_DELETED")

    def p(self, name):
        return os.path.join(self.w, name)

    # --- recording -----------------------------------------------------------------------------

    def norm(self, v):
        """Replace WORKDIR by "$W" and generated node names by "#block" in every string, and
        sort object members by key (their order in a QMP answer carries no meaning)."""
        if isinstance(v, str):
            return re.sub(r"#block\d+", "#block", v.replace(self.w, "$W"))
        if isinstance(v, list):
            return [self.norm(x) for x in v]
        if isinstance(v, dict):
            return {k: self.norm(v[k]) for k in sorted(v)}
        return v

    def record(self, step, **kv):
        entry = {"step": step}
        entry.update(self.norm(kv))
        self.transcript.append(entry)
        log("step:", json.dumps(entry))
        return entry

    async def cmd(self, cmd, args=None):
        """Run one QMP command; returns ("return", value), ("error", {class, desc}) or
        ("timeout", True)."""
        try:
            r = await asyncio.wait_for(self.qmp.execute(cmd, args), TIMEOUT)
            return "return", r
        except ExecuteError as e:
            err = e.received["error"]
            return "error", {"class": err["class"], "desc": err["desc"]}
        except asyncio.TimeoutError:
            return "timeout", True

    async def step(self, name, cmd, args=None, post=None):
        """Run a command and record it as a step; `post` reshapes a successful return. A command
        that times out is recorded, then ends the scenario: QMP answers in order, so every later
        command would wait behind it."""
        kind, v = await self.cmd(cmd, args)
        if kind == "return" and post:
            v = post(v)
        self.record(name, **{kind: v})
        if kind == "timeout":
            raise RuntimeError(f"{cmd} got no answer in {TIMEOUT} s")
        return kind, v

    async def event(self, timeout):
        """The next BLOCK_EXPORT_DELETED as {event, data} (no timestamp), or "timeout"."""
        try:
            ev = await asyncio.wait_for(self.events.get(), timeout)
            return {"event": ev["event"], "data": ev.get("data")}
        except asyncio.TimeoutError:
            return "timeout"

    async def io(self, fn, *args):
        """Blocking file I/O (possibly on a FUSE mount) in a thread, bounded by TIMEOUT. Returns
        the result, {"errno": NAME} or "timeout" (a killed daemon later unblocks the thread)."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn, *args), TIMEOUT)
        except asyncio.TimeoutError:  # first: since Python 3.11 it is a subclass of OSError
            return "timeout"
        except OSError as e:
            return {"errno": errno.errorcode.get(e.errno, str(e.errno))}

    # --- setup and teardown --------------------------------------------------------------------

    def make_images(self):
        with open(self.p("a.raw"), "wb") as f:
            f.write(pattern(4 * MiB))
        with open(self.p("w.raw"), "wb") as f:
            f.write(pattern(2 * MiB, step=13))
        for argv in (["qemu-img", "create", "-q", "-f", "qcow2", self.p("b.qcow2"), "8M"],
                     ["qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 0 64k", self.p("b.qcow2")],
                     # A backing chain of nodes: ov.qcow2 over base.raw, its header then
                     # naming a file that does not exist, so only the node can back it.
                     ["qemu-img", "create", "-q", "-f", "raw", self.p("base.raw"), "4M"],
                     ["qemu-io", "-f", "raw", "-c", "write -P 0x11 0 1M", self.p("base.raw")],
                     ["qemu-img", "create", "-q", "-f", "qcow2", "-b", self.p("base.raw"),
                      "-F", "raw", self.p("ov.qcow2")],
                     ["qemu-io", "-f", "qcow2", "-c", "write -P 0x22 512k 64k", self.p("ov.qcow2")],
                     ["qemu-img", "rebase", "-u", "-b", self.p("gone.raw"), "-F", "raw",
                      self.p("ov.qcow2")],
                     ["qemu-img", "create", "-q", "-f", "qcow2", self.p("ov9.qcow2"), "1M"],
                     # An overlay whose header names its backing file, as most overlays do.
                     ["qemu-img", "create", "-q", "-f", "qcow2", "-b", self.p("base.raw"),
                      "-F", "raw", self.p("hdr.qcow2")],
                     ["qemu-io", "-f", "qcow2", "-c", "write -P 0x33 0 64k", self.p("hdr.qcow2")]):
            subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        for m in ("a.mnt", "b.mnt", "c.mnt", "d.mnt", "e.mnt", "ov.mnt", "hdr.mnt", "w.mnt"):  # mountpoints are regular files
            open(self.p(m), "wb").close()

    async def start(self):
        sock = self.p("qmp.sock")
        if os.path.lexists(sock):  # left by an earlier run in the same WORKDIR
            os.unlink(sock)
        argv = self.program + [
            "--chardev", f"socket,id=mon0,path={sock},server=on,wait=off",
            "--monitor", "chardev=mon0",
            # An IOThread for the export, as qemu-storage-daemon's users often give one.
            "--object", "iothread,id=io0",
            "--blockdev", f"driver=file,node-name=file0,filename={self.p('a.raw')},aio=io_uring",
            # The driver first without its key, as qemu-storage-daemon takes it too.
            "--blockdev", "raw,node-name=fmt0,file=file0",
            "--export", f"type=fuse,id=exp0,node-name=fmt0,mountpoint={self.p('a.mnt')},"
                        "writable=on,iothread=io0",
        ]
        log("starting:", " ".join(argv))
        self.daemon_log = open(self.p("daemon.log"), "wb")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.daemon_log,
                                     stderr=subprocess.STDOUT)
        self.qmp = QMPClient("qmp_service")
        self.qmp.register_listener(self.events)
        for _ in range(100):  # up to 10 s for the socket to appear and accept
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited early with status {self.proc.returncode}")
            if os.path.exists(sock):
                try:
                    await asyncio.wait_for(self.qmp.connect(sock), TIMEOUT)
                    return
                except (ConnectError, OSError, asyncio.TimeoutError) as e:
                    log("connect:", repr(e))
                    self.qmp = QMPClient("qmp_service")
                    self.qmp.register_listener(self.events)
            await asyncio.sleep(0.1)
        raise RuntimeError("QMP socket never became ready")

    def mounts(self):
        """Mount points under WORKDIR, from /proc/self/mountinfo."""
        out = []
        with open("/proc/self/mountinfo") as f:
            for line in f:
                mp = line.split()[4].replace("\\040", " ")
                if mp.startswith(self.w + "/"):
                    out.append(mp)
        return sorted(out)

    async def cleanup(self):
        if self.qmp is not None:
            try:
                await asyncio.wait_for(self.qmp.disconnect(), TIMEOUT)
            except Exception as e:  # after quit the daemon has closed the connection first
                if not self.quit_sent:
                    log("disconnect:", repr(e))
        if self.proc is not None and self.proc.poll() is None:
            log("daemon still running: killing it")
            self.proc.kill()
            self.proc.wait()
        for mp in self.mounts():
            log("unmounting leftover", mp)
            subprocess.run(["umount", "-l", mp], check=False)
        if self.proc is not None:
            self.daemon_log.close()
            with open(self.p("daemon.log"), "rb") as f:
                text = f.read().decode(errors="replace").strip()
            if text:
                log("--- daemon output ---\n" + text)

    # --- the scenario --------------------------------------------------------------------------

    async def run(self):
        sort_exports = lambda r: sorted(r, key=lambda e: e["id"])

        # 0. What the daemon is and offers: query-version's shape (the numbers differ), and
        #    the export commands both have among query-commands' names.
        shape = lambda v: {k: sorted(v[k]) if isinstance(v[k], dict) else type(v[k]).__name__
                           for k in v}
        await self.step("query-version", "query-version", post=shape)
        shared = {"blockdev-add", "blockdev-del", "block-export-add", "block-export-del",
                  "query-block-exports", "query-named-block-nodes", "query-version",
                  "query-commands", "qmp_capabilities", "quit", "object-add", "object-del"}
        await self.step("query-commands", "query-commands",
                        post=lambda r: sorted(c["name"] for c in r if c["name"] in shared))

        # 1. The export given on the command line (a block backend of its own, which
        # query-block does not list).
        await self.step("query-block-exports", "query-block-exports", post=sort_exports)
        await self.step("query-block", "query-block")
        await self.step("query-block: an argument", "query-block", {"x": 1})

        def same(got, want):
            """{"bytes-equal": bool}, or the failed I/O's {"result": errno or "timeout"}."""
            return {"bytes-equal": got == want} if isinstance(got, bytes) else {"result": got}

        # 2. Data through the command-line export matches the image, both ways.
        expect = bytearray(pattern(4 * MiB))

        def read_mnt(path, n, off=0):
            with open(path, "rb") as f:
                return os.pread(f.fileno(), n, off)

        got = await self.io(read_mnt, self.p("a.mnt"), 64 * 1024)
        self.record("read a.mnt", **same(got, bytes(expect[:64 * 1024])))
        data = bytes([0xC3]) * 4096

        def write_mnt():
            fd = os.open(self.p("a.mnt"), os.O_RDWR)
            try:
                n = os.pwrite(fd, data, 8192)
                os.fsync(fd)
                return n
            finally:
                os.close(fd)

        n = await self.io(write_mnt)
        expect[8192:8192 + 4096] = data
        with open(self.p("a.raw"), "rb") as f:
            raw = f.read()
        self.record("write a.mnt", written=n, **same(raw, bytes(expect)))

        # 3. Nodes and exports added at run time.
        await self.step("blockdev-add null0", "blockdev-add",
                        {"driver": "null-co", "node-name": "null0", "size": 1 << 30})
        await self.step("blockdev-add q0", "blockdev-add",
                        {"driver": "qcow2", "node-name": "q0",
                         "file": {"driver": "file", "filename": self.p("b.qcow2")}})
        await self.step("block-export-add exp1", "block-export-add",
                        {"type": "fuse", "id": "exp1", "node-name": "q0",
                         "mountpoint": self.p("b.mnt")})
        got = await self.io(read_mnt, self.p("b.mnt"), 64 * 1024)
        self.record("read b.mnt", **same(got, b"\x5a" * 64 * 1024))
        st = await self.io(os.stat, self.p("b.mnt"))
        self.record("stat b.mnt", size=st.st_size if isinstance(st, os.stat_result) else st)
        await self.step("block-export-add exp2", "block-export-add",
                        {"type": "fuse", "id": "exp2", "node-name": "null0",
                         "mountpoint": self.p("e.mnt"), "writable": True})
        await self.step("query-block-exports", "query-block-exports", post=sort_exports)

        # 4. The node graph, reduced to fields a drop-in must agree on.
        def nodes(r):
            named = [n for n in r if not n["node-name"].startswith("#")]
            return {
                "implicit-nodes": len(r) - len(named),
                "nodes": [{"node-name": n["node-name"], "drv": n["drv"], "ro": n["ro"],
                           "file": n["file"],
                           "virtual-size": n.get("image", {}).get("virtual-size"),
                           "format": n.get("image", {}).get("format")}
                          for n in sorted(named, key=lambda n: n["node-name"])],
            }

        await self.step("query-named-block-nodes", "query-named-block-nodes", post=nodes)

        # 4b. Block statistics: none without query-nodes (an export's block backend has no
        # name), one entry per node with it, each with every member a client reads.
        def blockstats(r):
            return {
                "nodes": sorted(e["node-name"] for e in r
                                if not e["node-name"].startswith("#")),
                "stats-members": sorted(set().union(*(e["stats"].keys() for e in r))),
                "counts-are-numbers": all(isinstance(v, int) for e in r
                                          for k, v in e["stats"].items()
                                          if k.endswith(("_bytes", "_operations", "_ns"))),
            }

        await self.step("query-blockstats", "query-blockstats")
        await self.step("query-blockstats query-nodes", "query-blockstats",
                        {"query-nodes": True}, post=blockstats)
        await self.step("query-blockstats: bad argument", "query-blockstats", {"bogus": 1})

        # 5. Errors: each request is valid but for one fault.
        fuse = lambda **kv: dict({"type": "fuse", "id": "exp9", "node-name": "null0",
                                  "mountpoint": self.p("d.mnt")}, **kv)
        errors = [
            ("export: duplicate id", "block-export-add", fuse(id="exp1")),
            ("export: unknown node", "block-export-add", fuse(**{"node-name": "nonode"})),
            ("export: missing mountpoint file", "block-export-add",
             fuse(mountpoint=self.p("missing.mnt"))),
            ("export: unknown argument", "block-export-add", fuse(bogus=1)),
            ("export: writable wrong type", "block-export-add", fuse(writable="yes")),
            ("export: no mountpoint", "block-export-add",
             {"type": "fuse", "id": "exp9", "node-name": "null0"}),
            ("export: nbd without server", "block-export-add",
             {"type": "nbd", "id": "exp9", "node-name": "null0"}),
            ("blockdev-add: duplicate node-name", "blockdev-add",
             {"driver": "null-co", "node-name": "null0"}),
            ("blockdev-add: missing file", "blockdev-add",
             {"driver": "file", "node-name": "f9", "filename": self.p("missing.img")}),
            ("blockdev-add: unknown driver", "blockdev-add",
             {"driver": "vmdkx", "node-name": "v9"}),
            ("blockdev-del: node in use", "blockdev-del", {"node-name": "fmt0"}),
            ("blockdev-del: unknown node", "blockdev-del", {"node-name": "nonode"}),
            ("block-export-del: unknown id", "block-export-del", {"id": "nope"}),
            ("block-export-del: bad mode", "block-export-del", {"id": "exp1", "mode": "bogus"}),
        ]
        for name, cmd, args in errors:
            await self.step(name, cmd, args)
        await self.step("blockdev-add: no node-name", "blockdev-add",
                        {"driver": "null-co", "size": MiB})
        await self.step("blockdev-add ro0 read-only", "blockdev-add",
                        {"driver": "null-co", "node-name": "ro0", "size": MiB,
                         "read-only": True})
        await self.step("export: writable from a read-only node", "block-export-add",
                        fuse(**{"node-name": "ro0", "writable": True}))
        await self.step("blockdev-del ro0", "blockdev-del", {"node-name": "ro0"})

        # 5b. Options both take: cache.direct on a node; growable and allow-other on an export.
        await self.step("blockdev-add cd0 cache.direct", "blockdev-add",
                        {"driver": "null-co", "node-name": "cd0", "size": MiB,
                         "cache": {"direct": True}})
        open(self.p("cd.mnt"), "wb").close()
        await self.step("block-export-add exp8 growable allow-other", "block-export-add",
                        {"type": "fuse", "id": "exp8", "node-name": "cd0",
                         "mountpoint": self.p("cd.mnt"), "growable": False,
                         "allow-other": "off"})
        self.record("exp8 size", size=os.stat(self.p("cd.mnt")).st_size)
        await self.step("block-export-del exp8", "block-export-del", {"id": "exp8"})
        self.record("event after exp8", event=await self.event(TIMEOUT))
        await self.step("blockdev-del cd0", "blockdev-del", {"node-name": "cd0"})

        # 5c. A backing chain built from nodes, as management tools build it: the overlay's
        #     `backing` names a node, in place of the file its header names.
        await self.step("blockdev-add base", "blockdev-add",
                        {"driver": "raw", "node-name": "base", "read-only": True,
                         "file": {"driver": "file", "filename": self.p("base.raw")}})
        await self.step("blockdev-add ov backing base", "blockdev-add",
                        {"driver": "qcow2", "node-name": "ov", "backing": "base",
                         "file": {"driver": "file", "filename": self.p("ov.qcow2")}})
        await self.step("blockdev-add: backing node missing", "blockdev-add",
                        {"driver": "qcow2", "node-name": "ov9", "backing": "nonode",
                         "file": {"driver": "file", "filename": self.p("ov9.qcow2")}})
        await self.step("query-named-block-nodes ov", "query-named-block-nodes",
                        post=lambda r: [{"backing_file": n.get("backing_file"),
                                         "backing_file_depth": n["backing_file_depth"]}
                                        for n in r if n["node-name"] == "ov"])
        await self.step("block-export-add exp7 over ov", "block-export-add",
                        {"type": "fuse", "id": "exp7", "node-name": "ov",
                         "mountpoint": self.p("ov.mnt")})
        want = b"\x11" * (512 * 1024) + b"\x22" * (64 * 1024) + b"\x11" * (448 * 1024)
        got = await self.io(read_mnt, self.p("ov.mnt"), MiB)
        self.record("read ov.mnt", **same(got, want))
        await self.step("blockdev-del: backing node in use", "blockdev-del",
                        {"node-name": "base"})
        await self.step("block-export-del exp7", "block-export-del", {"id": "exp7"})
        self.record("event after exp7", event=await self.event(TIMEOUT))
        await self.step("blockdev-del ov", "blockdev-del", {"node-name": "ov"})
        # The backing file the header names, opened by the node itself.
        await self.step("blockdev-add hdr", "blockdev-add",
                        {"driver": "qcow2", "node-name": "hdr",
                         "file": {"driver": "file", "filename": self.p("hdr.qcow2")}})
        await self.step("block-export-add exp6 over hdr", "block-export-add",
                        {"type": "fuse", "id": "exp6", "node-name": "hdr",
                         "mountpoint": self.p("hdr.mnt")})
        want = b"\x33" * (64 * 1024) + b"\x11" * (960 * 1024) + b"\x00" * MiB
        got = await self.io(read_mnt, self.p("hdr.mnt"), 2 * MiB)
        self.record("read hdr.mnt", **same(got, want))
        await self.step("block-export-del exp6", "block-export-del", {"id": "exp6"})
        self.record("event after exp6", event=await self.event(TIMEOUT))
        await self.step("blockdev-del hdr", "blockdev-del", {"node-name": "hdr"})
        await self.step("blockdev-del base", "blockdev-del", {"node-name": "base"})

        # 5d. IOThreads (objects of their own, named by an export) and a file node's `aio`.
        await self.step("object-add io1", "object-add", {"qom-type": "iothread", "id": "io1"})
        for name, args in [
            ("object-add: duplicate id", {"qom-type": "iothread", "id": "io1"}),
            ("object-add: duplicate of the command line's", {"qom-type": "iothread", "id": "io0"}),
            ("object-add: no id", {"qom-type": "iothread"}),
            ("object-add: unknown type", {"qom-type": "bogus-type", "id": "x9"}),
            ("object-add: unknown property", {"qom-type": "iothread", "id": "io9", "bogus": 1}),
            ("object-add: property of the wrong type",
             {"qom-type": "iothread", "id": "io9", "poll-max-ns": "many"}),
        ]:
            await self.step(name, "object-add", args)
        await self.step("object-add io2 with properties", "object-add",
                        {"qom-type": "iothread", "id": "io2", "poll-max-ns": 0,
                         "poll-grow": 2, "poll-shrink": 0, "aio-max-batch": 0})
        await self.step("blockdev-add th0 aio=threads", "blockdev-add",
                        {"driver": "file", "node-name": "th0", "filename": self.p("a.raw"),
                         "aio": "threads", "read-only": True})
        await self.step("blockdev-del th0", "blockdev-del", {"node-name": "th0"})
        for name, args in [
            ("blockdev-add: aio=native without cache.direct",
             {"driver": "file", "node-name": "f9", "filename": self.p("a.raw"),
              "aio": "native"}),
            ("blockdev-add: aio bad value",
             {"driver": "file", "node-name": "f9", "filename": self.p("a.raw"), "aio": "bogus"}),
        ]:
            await self.step(name, "blockdev-add", args)
        await self.step("blockdev-add nat0 aio=native cache.direct", "blockdev-add",
                        {"driver": "raw", "node-name": "nat0", "read-only": True,
                         "file": {"driver": "file", "filename": self.p("base.raw"),
                                  "aio": "native", "cache": {"direct": True}}})
        open(self.p("io.mnt"), "wb").close()
        await self.step("block-export-add: iothread not found", "block-export-add",
                        {"type": "fuse", "id": "exp5", "node-name": "nat0",
                         "mountpoint": self.p("io.mnt"), "iothread": "io9"})
        await self.step("block-export-add exp5 iothread io1", "block-export-add",
                        {"type": "fuse", "id": "exp5", "node-name": "nat0",
                         "mountpoint": self.p("io.mnt"), "iothread": "io1",
                         "fixed-iothread": True})
        got = await self.io(read_mnt, self.p("io.mnt"), 2 * MiB)
        self.record("read io.mnt", **same(got, b"\x11" * MiB + b"\x00" * MiB))
        await self.step("block-export-del exp5", "block-export-del", {"id": "exp5"})
        self.record("event after exp5", event=await self.event(TIMEOUT))
        await self.step("blockdev-del nat0", "blockdev-del", {"node-name": "nat0"})
        await self.step("object-del io1", "object-del", {"id": "io1"})
        await self.step("object-del io2", "object-del", {"id": "io2"})
        await self.step("object-del: unknown id", "object-del", {"id": "io1"})
        await self.step("object-add io1 again", "object-add", {"qom-type": "iothread", "id": "io1"})
        await self.step("object-del io1 again", "object-del", {"id": "io1"})

        # 5e. A raw node's offset and size: a byte range of its file served as the export, and
        # the ranges the file does not hold.
        def window(offset, size=None):
            args = {"driver": "raw", "node-name": "win0", "offset": offset,
                    "file": {"driver": "file", "filename": self.p("w.raw")}}
            if size is not None:
                args["size"] = size
            return args

        for name, args in [
            ("blockdev-add: offset past the end", window(3 * MiB)),
            ("blockdev-add: offset and size past the end", window(MiB, 2 * MiB)),
            ("blockdev-add: size not a multiple of 512", window(0, 1000)),
        ]:
            await self.step(name, "blockdev-add", args)
        await self.step("blockdev-add win0 offset size", "blockdev-add",
                        window(512 * 1024, MiB))
        await self.step("query-named-block-nodes win0", "query-named-block-nodes",
                        # Such a node's file is a `json:{...}` pseudo-filename of its options.
                        post=lambda r: [{"drv": n["drv"], "file": n["file"],
                                         "image-filename": n["image"]["filename"],
                                         "virtual-size": n["image"]["virtual-size"]}
                                        for n in r if n["node-name"] == "win0"])
        await self.step("block-export-add exp6 on win0", "block-export-add",
                        {"type": "fuse", "id": "exp6", "node-name": "win0",
                         "mountpoint": self.p("w.mnt"), "writable": True})
        st = await self.io(os.stat, self.p("w.mnt"))
        self.record("stat w.mnt", size=st.st_size if isinstance(st, os.stat_result) else st)
        w_expect = bytearray(pattern(2 * MiB, step=13))
        got = await self.io(read_mnt, self.p("w.mnt"), 2 * MiB)
        self.record("read w.mnt", **same(got, bytes(w_expect[512 * 1024:512 * 1024 + MiB])))
        w_data = bytes([0x6B]) * 8192

        def write_window():
            fd = os.open(self.p("w.mnt"), os.O_RDWR)
            try:
                n = os.pwrite(fd, w_data, MiB - 8192)
                os.fsync(fd)
                return n
            finally:
                os.close(fd)

        n = await self.io(write_window)
        w_expect[512 * 1024 + MiB - 8192:512 * 1024 + MiB] = w_data
        with open(self.p("w.raw"), "rb") as f:
            w_raw = f.read()
        self.record("write w.mnt at the range's end", written=n, **same(w_raw, bytes(w_expect)))
        await self.step("block-export-del exp6", "block-export-del", {"id": "exp6"})
        self.record("event after exp6", event=await self.event(TIMEOUT))
        await self.step("blockdev-del win0", "blockdev-del", {"node-name": "win0"})
        await self.step("blockdev-add win0 offset only", "blockdev-add", window(1536 * 1024))
        await self.step("query-named-block-nodes win0 offset only", "query-named-block-nodes",
                        post=lambda r: [{"file": n["file"],
                                         "virtual-size": n["image"]["virtual-size"]}
                                        for n in r if n["node-name"] == "win0"])
        await self.step("blockdev-del win0 again", "blockdev-del", {"node-name": "win0"})

        # 5f. A qcow2 node's metadata cache sizes, clean interval and overlap checks: QEMU's
        #     rules for the three sizes and the interval, the two forms of overlap-check, and an
        #     export that reads the same.
        qc = lambda **kv: dict({"driver": "qcow2", "node-name": "cq",
                                "file": {"driver": "file", "filename": self.p("hdr.qcow2")}},
                               **kv)
        for name, args in [
            ("blockdev-add: three cache sizes",
             qc(**{"cache-size": MiB, "l2-cache-size": 512 * 1024,
                   "refcount-cache-size": 256 * 1024})),
            ("blockdev-add: l2-cache-size over cache-size",
             qc(**{"cache-size": MiB, "l2-cache-size": 2 * MiB})),
            ("blockdev-add: refcount-cache-size over cache-size",
             qc(**{"cache-size": MiB, "refcount-cache-size": 2 * MiB})),
            ("blockdev-add: cache-size wrong type", qc(**{"cache-size": "1M"})),
            ("blockdev-add: overlap-check bad mode", qc(**{"overlap-check": "bogus"})),
            ("blockdev-add: overlap-check bad template",
             qc(**{"overlap-check": {"template": "bogus"}})),
            ("blockdev-add: overlap-check unknown check",
             qc(**{"overlap-check": {"bogus": True}})),
            ("blockdev-add: overlap-check check wrong type",
             qc(**{"overlap-check": {"main-header": "yes"}})),
            ("blockdev-add: cache-clean-interval negative", qc(**{"cache-clean-interval": -1})),
            ("blockdev-add: cache-clean-interval over 32 bits",
             qc(**{"cache-clean-interval": 1 << 32})),
            ("blockdev-add: cache-clean-interval wrong type",
             qc(**{"cache-clean-interval": "600"})),
        ]:
            await self.step(name, "blockdev-add", args)
        for name, args in [
            ("cache-size", {"cache-size": 2 * MiB}),
            ("cache-size and l2-cache-size",
             {"cache-size": 2 * MiB, "l2-cache-size": 1536 * 1024}),
            ("cache-size and refcount-cache-size",
             {"cache-size": 2 * MiB, "refcount-cache-size": 256 * 1024}),
            ("overlap-check none", {"overlap-check": "none"}),
            ("cache-clean-interval 0", {"cache-clean-interval": 0}),
            ("cache-clean-interval 4294967295", {"cache-clean-interval": (1 << 32) - 1}),
            ("overlap-check checks", {"overlap-check": {"template": "cached",
                                                        "inactive-l2": True,
                                                        "bitmap-directory": False}}),
        ]:
            await self.step(f"blockdev-add cq {name}", "blockdev-add", qc(**args))
            await self.step(f"blockdev-del cq {name}", "blockdev-del", {"node-name": "cq"})
        await self.step("blockdev-add cq l2-cache-size refcount-cache-size overlap-check all "
                        "cache-clean-interval 1", "blockdev-add",
                        qc(**{"l2-cache-size": 128 * 1024, "refcount-cache-size": 128 * 1024,
                              "overlap-check": "all", "cache-clean-interval": 1}))
        open(self.p("cq.mnt"), "wb").close()
        await self.step("block-export-add exp4 over cq", "block-export-add",
                        {"type": "fuse", "id": "exp4", "node-name": "cq",
                         "mountpoint": self.p("cq.mnt")})
        want = b"\x33" * (64 * 1024) + b"\x11" * (960 * 1024) + b"\x00" * MiB
        got = await self.io(read_mnt, self.p("cq.mnt"), 2 * MiB)
        self.record("read cq.mnt", **same(got, want))
        await self.step("block-export-del exp4", "block-export-del", {"id": "exp4"})
        self.record("event after exp4", event=await self.event(TIMEOUT))
        await self.step("blockdev-del cq", "blockdev-del", {"node-name": "cq"})

        # 6. Removal of exports and nodes.
        await self.step("block-export-del exp2", "block-export-del", {"id": "exp2"})
        self.record("event after exp2", event=await self.event(TIMEOUT))
        await self.step("query-block-exports", "query-block-exports", post=sort_exports)
        await self.step("blockdev-del null0", "blockdev-del", {"node-name": "null0"})
        await self.step("block-export-del exp1 hard", "block-export-del",
                        {"id": "exp1", "mode": "hard"})
        self.record("event after exp1", event=await self.event(TIMEOUT))
        await self.step("blockdev-del q0", "blockdev-del", {"node-name": "q0"})
        await self.step("query-named-block-nodes names", "query-named-block-nodes",
                        post=lambda r: sorted(n["node-name"] for n in r))

        # 7. Safe removal of an export whose file is held open.
        await self.step("blockdev-add null1", "blockdev-add",
                        {"driver": "null-co", "node-name": "null1", "size": 64 * MiB})
        await self.step("block-export-add exp3", "block-export-add",
                        {"type": "fuse", "id": "exp3", "node-name": "null1",
                         "mountpoint": self.p("c.mnt"), "writable": True})
        fd = await self.io(os.open, self.p("c.mnt"), os.O_RDWR)
        if not isinstance(fd, int):
            raise RuntimeError(f"cannot open c.mnt: {fd}")
        # null-co returns unspecified bytes (read-zeroes is off): record only the length.
        plen = lambda r: {"len": len(r)} if isinstance(r, bytes) else r
        self.record("pread c.mnt", result=plen(await self.io(os.pread, fd, 4096, 0)))
        kind, _ = await self.step("block-export-del exp3 safe", "block-export-del",
                                  {"id": "exp3", "mode": "safe"})
        ev = "not waited"
        if kind == "return":
            ev = await self.event(2)
            self.record("event within 2 s", event=ev)
            # Not the range read before: qemu-storage-daemon lets the kernel page-cache it and
            # fusex serves with direct I/O, so only a range never read (32 MiB), which has to
            # reach the daemon, tells the same thing of both.
            self.record("pread kept fd, unread range",
                        result=plen(await self.io(os.pread, fd, 4096, 32 * MiB)))
        self.record("close fd", result=await self.io(os.close, fd))
        if kind == "return" and ev == "timeout":
            self.record("event after close", event=await self.event(TIMEOUT))
        await self.step("query-block-exports", "query-block-exports", post=sort_exports)

        # No BLOCK_EXPORT_DELETED beyond the ones waited for above (e.g. none twice).
        self.record("unclaimed events",
                    events=[{"event": e["event"], "data": e.get("data")} for e in self.events.clear()])

        # 8. quit: the daemon exits and leaves nothing mounted.
        self.quit_sent = True
        await self.step("quit", "quit")
        try:
            code = await asyncio.wait_for(asyncio.to_thread(self.proc.wait), 10)
        except asyncio.TimeoutError:
            code = "timeout"
        self.record("exit", code=code, **{"still-mounted": self.mounts()})


async def main():
    if len(sys.argv) != 3:
        print("usage: qmp_service.py PROGRAM WORKDIR", file=sys.stderr)
        return 2
    s = Scenario(sys.argv[1], sys.argv[2])
    reason = None
    try:
        s.make_images()
        await s.start()
        await s.run()
    except Exception as e:  # report any failure in one line, after printing what we have
        reason = f"{type(e).__name__}: {e}"
    finally:
        await s.cleanup()
    print(json.dumps(s.transcript, indent=2))
    if reason:
        print(f"qmp_service.py: scenario did not finish: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
