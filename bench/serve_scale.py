#!/usr/bin/env python3
"""Scale benchmark for QMP-driven FUSE export daemons: qemu-storage-daemon and `fusex serve`.

    target/qmp-venv/bin/python3 bench/serve_scale.py \\
        --target qsd=qemu-storage-daemon \\
        --target fusex='target/release/fusex serve' \\
        [--exports 100] [--rounds 200] [--busy] [--interleave K] \\
        [--workdir DIR] [--json FILE]

For each target (NAME=ARGV, ARGV split on spaces, the daemon's argv prefix; both take
qemu-storage-daemon's command line), in a fresh daemon per run:

1. launch: start it with only a QMP monitor socket, then add N exports over QMP (node i is null-co
   1 GiB if i%3==0, raw on a 64 MiB sparse file if i%3==1, qcow2 64 MiB if i%3==2; each exported
   read-only on its own regular-file mountpoint). "launch s" is the wall time from the first
   blockdev-add to the last block-export-add's return. Then every mountpoint is checked: stat
   (size must be the node's) and a 4 KiB pread; "serve fail" counts the mountpoints that failed.
2. idle cost: VmRSS and Threads of the daemon (from /proc/PID/status), plus the RSS of any
   descendant process (there should be none). RSS is measured again after the churn.
3. churn: R rounds of blockdev-add (fresh null-co node) + block-export-add (fresh mountpoint),
   then block-export-del + its BLOCK_EXPORT_DELETED event + blockdev-del. Per round: add =
   blockdev-add + block-export-add, del = block-export-del until the event is seen, add+del = the
   whole round. Median, p90, p99 and max in ms (nearest-rank percentiles).
4. --busy: an extra export of a 256 MiB raw file full of data; fio 4k randread QD64 (or, with
   --busy-workload randrw70, 70/30 random read/write QD64 x 4 jobs on a writable export)
   (libaio, direct=1, time based, --busy-runtime s after --busy-ramp s of warm-up) on it, in
   passes that alternate: a baseline, a pass while churning (the churn loop runs for as long as
   fio does), a baseline, ... --busy-passes K churning passes, K+1 baselines. Each churning
   pass's ratio is its IOPS over the mean of the two baselines around it; "busy ratio" is the
   median of the K ratios (min and max beside it), so a drift of the machine during the run is
   not taken for the churn's cost. The churning passes' rounds are reported as busy_churn in
   the JSON ("busy rounds" is how many ran). A faster daemon churns more rounds in the same
   time: pass --busy-rate N (rounds/s) to load every target the same. --busy-burn MS replaces
   each round by MS ms of CPU spent in this script: what that CPU alone costs the busy export on
   the machine (with both CPUs saturated every consumer takes its share from fio).
   The unpaced churn of step 3 also reports the CPU a round costs the daemon and this script's
   QMP client (churn_cpu_ms in the JSON).
   fusex serves a raw image file with FUSE passthrough by default (the kernel reads the file,
   fusex sees no READ): --export-args fusex='{"__org.fusex_passthrough": "off"}' makes its
   busy export (and the raw ones at launch) go through the daemon, as they do in qsd.
5. teardown: quit, wait for exit (kill after 30 s), `umount -l` anything left mounted under the
   run's directory. "quit s" is quit until exit; "left mounted" counts mounts still there after
   a clean exit (a drop-in must unmount all of its exports on quit).

--interleave K repeats the whole per-target measurement K times, alternating the target order
(A B, B A, ...); each run is a row, and a second table gives each figure's spread (min-max) per
target. A run that fails (a QMP error, a timeout, a daemon that dies) is reported with its error
and the runs go on. Every wait is bounded; the daemon is killed and mounts removed in finally
blocks, also on Ctrl-C or SIGTERM.

Output: a markdown table on stdout, progress on stderr, raw numbers with --json FILE. Needs
root, the stdlib, qemu.qmp (target/qmp-venv), qemu-img and, for --busy, fio.
"""

import argparse
import asyncio
import json
import math
import os
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from qemu.qmp import ConnectError, EventListener, ExecuteError, QMPClient

MiB = 1 << 20
GiB = 1 << 30


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


class RunError(Exception):
    pass


# --- statistics ---------------------------------------------------------------------------------

def pct(sorted_vals, q):
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_vals:
        return None
    k = max(1, math.ceil(q * len(sorted_vals)))
    return sorted_vals[min(k, len(sorted_vals)) - 1]


def summary(vals_ms):
    s = sorted(vals_ms)
    if not s:
        return None
    return {"n": len(s), "median": pct(s, 0.5), "p90": pct(s, 0.9), "p99": pct(s, 0.99),
            "max": s[-1], "min": s[0], "mean": sum(s) / len(s)}


# --- /proc ---------------------------------------------------------------------------------------

def proc_status(pid):
    """{"rss_mib", "hwm_mib", "threads"} of a live process, or None if it is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k == "VmRSS":
                    out["rss_mib"] = int(v.split()[0]) / 1024
                elif k == "VmHWM":
                    out["hwm_mib"] = int(v.split()[0]) / 1024
                elif k == "Threads":
                    out["threads"] = int(v.split()[0])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return out


def descendants(pid):
    """Pids of every live descendant of pid (from /proc/*/stat's ppid)."""
    parent = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
        except OSError:
            continue
        fields = st[st.rfind(")") + 2:].split()
        parent[int(d)] = int(fields[1])
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def process_cost(pid):
    st = proc_status(pid)
    if st is None:
        raise RunError(f"daemon process {pid} is gone")
    kids = descendants(pid)
    kid_rss = 0.0
    kid_desc = []
    for k in kids:
        ks = proc_status(k)
        if ks is None:
            continue
        kid_rss += ks.get("rss_mib", 0.0)
        try:
            with open(f"/proc/{k}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            cmd = "?"
        kid_desc.append({"pid": k, "rss_mib": ks.get("rss_mib"), "cmdline": cmd})
    st.update({"children": len(kid_desc), "children_rss_mib": kid_rss, "children_detail": kid_desc,
               "total_rss_mib": st.get("rss_mib", 0.0) + kid_rss})
    return st


def cpu_s(pid):
    """User + system CPU seconds of a live process (all its threads, ended ones included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_s():
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def mounts_under(d):
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].replace("\\040", " ")
            if mp.startswith(d + "/"):
                out.append(mp)
    return sorted(out)


# --- one run of one target -----------------------------------------------------------------------

class Run:
    def __init__(self, name, argv, rundir, opts):
        self.name = name
        self.argv = argv
        self.d = rundir
        self.o = opts
        self.proc = None
        self.qmp = None
        self.events = EventListener(names="BLOCK_EXPORT_DELETED")
        self.daemon_log = None
        self.quit_sent = False
        self.r = {"target": name, "argv": argv, "dir": rundir}

    def p(self, name):
        return os.path.join(self.d, name)

    # QMP helpers ---------------------------------------------------------------------------------

    def export(self, **kv):
        """block-export-add arguments: a read-only fuse export, plus this target's --export-args."""
        extra = self.o.export_args.get(self.name, {})
        return dict({"type": "fuse", "writable": False}, **kv, **extra)

    async def cmd(self, cmd, args=None):
        """Run a command; a QMP error or a timeout raises RunError naming the command."""
        try:
            return await asyncio.wait_for(self.qmp.execute(cmd, args), self.o.timeout)
        except ExecuteError as e:
            err = e.received.get("error", {})
            raise RunError(f"{cmd} {json.dumps(args)} -> error {err.get('class')}: "
                           f"{err.get('desc')}") from None
        except asyncio.TimeoutError:
            raise RunError(f"{cmd} {json.dumps(args)} -> no answer in {self.o.timeout} s") from None

    async def wait_deleted(self, export_id):
        """Wait for BLOCK_EXPORT_DELETED {id: export_id}; other events are logged and kept."""
        deadline = time.monotonic() + self.o.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RunError(f"no BLOCK_EXPORT_DELETED for {export_id} in {self.o.timeout} s")
            try:
                ev = await asyncio.wait_for(self.events.get(), left)
            except asyncio.TimeoutError:
                continue
            data = ev.get("data") or {}
            if data.get("id") == export_id:
                return
            log(f"  [{self.name}] unexpected event while waiting for {export_id}: {ev}")
            self.r.setdefault("unexpected_events", []).append(ev)

    async def io(self, fn, *args):
        """Blocking file I/O (maybe on a FUSE mount) in a thread, bounded by --timeout."""
        return await asyncio.wait_for(asyncio.to_thread(fn, *args), self.o.timeout)

    def check_alive(self):
        if self.proc is not None and self.proc.poll() is not None:
            raise RunError(f"daemon exited with status {self.proc.returncode}")

    # setup ---------------------------------------------------------------------------------------

    def make_files(self):
        n = self.o.exports
        t0 = time.monotonic()
        for i in range(n):
            open(self.p(f"e{i}.mnt"), "wb").close()
            if i % 3 == 1:
                with open(self.p(f"r{i}.raw"), "wb") as f:
                    f.truncate(64 * MiB)
            elif i % 3 == 2:
                subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", self.p(f"q{i}.qcow2"),
                                "64M"], check=True, stdout=subprocess.DEVNULL, timeout=60)
        if self.o.busy:
            chunk = os.urandom(MiB)
            with open(self.p("busy.raw"), "wb") as f:
                for _ in range(256):
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            open(self.p("busy.mnt"), "wb").close()
        log(f"  [{self.name}] images and mountpoints made in {time.monotonic() - t0:.1f} s")

    def node_args(self, i):
        if i % 3 == 0:
            return {"driver": "null-co", "node-name": f"n{i}", "size": GiB}, GiB
        if i % 3 == 1:
            return {"driver": "raw", "node-name": f"n{i}",
                    "file": {"driver": "file", "filename": self.p(f"r{i}.raw")}}, 64 * MiB
        return {"driver": "qcow2", "node-name": f"n{i}",
                "file": {"driver": "file", "filename": self.p(f"q{i}.qcow2")}}, 64 * MiB

    async def start(self):
        sock = self.p("qmp.sock")
        argv = self.argv + ["--chardev", f"socket,id=mon0,path={sock},server=on,wait=off",
                            "--monitor", "chardev=mon0"]
        self.r["daemon_argv"] = argv
        log(f"  [{self.name}] starting: {shlex.join(argv)}")
        self.daemon_log = open(self.p("daemon.log"), "wb")
        t0 = time.monotonic()
        # Own session: a Ctrl-C on the terminal reaches only this script, which then cleans up.
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.daemon_log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.r["pid"] = self.proc.pid
        deadline = t0 + self.o.timeout
        last = None
        while time.monotonic() < deadline:
            self.check_alive()
            if os.path.exists(sock):
                self.qmp = QMPClient(f"serve_scale-{self.name}")
                self.qmp.register_listener(self.events)
                try:
                    await asyncio.wait_for(self.qmp.connect(sock),
                                           max(0.1, deadline - time.monotonic()))
                    self.r["startup_s"] = time.monotonic() - t0
                    return
                except (ConnectError, OSError, asyncio.TimeoutError) as e:
                    last = e
                    self.qmp = None
            await asyncio.sleep(0.05)
        raise RunError(f"QMP socket {sock} not ready in {self.o.timeout} s (last: {last!r})")

    # phases --------------------------------------------------------------------------------------

    async def launch(self):
        n = self.o.exports
        t0 = time.perf_counter()
        for i in range(n):
            args, _ = self.node_args(i)
            await self.cmd("blockdev-add", args)
            await self.cmd("block-export-add", self.export(**{"id": f"e{i}", "node-name": f"n{i}",
                                                              "mountpoint": self.p(f"e{i}.mnt")}))
            if (i + 1) % 25 == 0 or i + 1 == n:
                log(f"  [{self.name}] {i + 1}/{n} exports added "
                    f"({time.perf_counter() - t0:.2f} s)")
        self.r["launch_s"] = time.perf_counter() - t0
        q = await self.cmd("query-block-exports")
        self.r["exports_listed"] = len(q)

    async def check_serving(self):
        def probe(path, size):
            st = os.stat(path)
            if st.st_size != size:
                return f"size {st.st_size}, expected {size}"
            fd = os.open(path, os.O_RDONLY)
            try:
                got = os.pread(fd, 4096, 0)
            finally:
                os.close(fd)
            if len(got) != 4096:
                return f"pread returned {len(got)} bytes"
            return None

        failures = []
        t0 = time.perf_counter()
        for i in range(self.o.exports):
            _, size = self.node_args(i)
            path = self.p(f"e{i}.mnt")
            try:
                why = await self.io(probe, path, size)
            except asyncio.TimeoutError:
                why = f"timeout ({self.o.timeout} s)"
            except OSError as e:
                why = f"{type(e).__name__}: {e}"
            if why:
                failures.append({"export": f"e{i}", "error": why})
                if len(failures) <= 5:
                    log(f"  [{self.name}] e{i} does not serve: {why}")
        self.r["serve_check_s"] = time.perf_counter() - t0
        self.r["serve_failures"] = len(failures)
        self.r["serve_failure_detail"] = failures
        log(f"  [{self.name}] serving check: {len(failures)} of {self.o.exports} failed "
            f"({self.r['serve_check_s']:.2f} s)")

    async def idle_cost(self, key):
        await asyncio.sleep(self.o.settle)
        self.check_alive()
        c = process_cost(self.proc.pid)
        self.r[key] = c
        log(f"  [{self.name}] {key}: RSS {c['rss_mib']:.1f} MiB, {c['threads']} threads, "
            f"{c['children']} children ({c['children_rss_mib']:.1f} MiB)")

    async def churn_round(self, tag, r, lat):
        node, eid, mnt = f"{tag}{r}", f"{tag}x{r}", self.p(f"{tag}{r}.mnt")
        open(mnt, "wb").close()
        t0 = time.perf_counter()
        await self.cmd("blockdev-add", {"driver": "null-co", "node-name": node, "size": GiB})
        tn = time.perf_counter()
        await self.cmd("block-export-add", self.export(**{"id": eid, "node-name": node,
                                                          "mountpoint": mnt}))
        t1 = time.perf_counter()
        await self.cmd("block-export-del", {"id": eid})
        await self.wait_deleted(eid)
        t2 = time.perf_counter()
        await self.cmd("blockdev-del", {"node-name": node})
        t3 = time.perf_counter()
        lat["node_add"].append((tn - t0) * 1e3)  # the blockdev-add part of "add"
        lat["add"].append((t1 - t0) * 1e3)
        lat["del"].append((t2 - t1) * 1e3)
        lat["total"].append((t3 - t0) * 1e3)

    async def churn(self):
        self.events.clear()
        lat = {"node_add": [], "add": [], "del": [], "total": []}
        t0 = time.perf_counter()
        # The CPU a round costs the daemon and this script's QMP client (unpaced rounds, one at
        # a time, nothing else running).
        cpu0 = (cpu_s(self.proc.pid), own_cpu_s())
        try:
            for r in range(self.o.rounds):
                await self.churn_round("c", r, lat)
                if (r + 1) % 50 == 0:
                    log(f"  [{self.name}] churn {r + 1}/{self.o.rounds} "
                        f"({time.perf_counter() - t0:.1f} s)")
        finally:
            self.r["churn_rounds_done"] = len(lat["total"])
            self.r["churn_s"] = time.perf_counter() - t0
            self.r["churn_ms"] = lat
            self.r["churn"] = {k: summary(v) for k, v in lat.items()}
        n = len(lat["total"])
        if n:
            self.r["churn_cpu_ms"] = {"daemon": (cpu_s(self.proc.pid) - cpu0[0]) * 1e3 / n,
                                      "client": (own_cpu_s() - cpu0[1]) * 1e3 / n}
            log(f"  [{self.name}] churn CPU per round: daemon "
                f"{self.r['churn_cpu_ms']['daemon']:.2f} ms, QMP client (this script) "
                f"{self.r['churn_cpu_ms']['client']:.2f} ms")
        c = self.r["churn"]
        log(f"  [{self.name}] churn: add {c['add']['median']:.2f}/{c['add']['p99']:.2f} ms, "
            f"del {c['del']['median']:.2f}/{c['del']['p99']:.2f} ms, "
            f"add+del {c['total']['median']:.2f}/{c['total']['p99']:.2f} ms (median/p99)")

    # busy ----------------------------------------------------------------------------------------

    async def fio(self, label):
        path = self.p("busy.mnt")
        if self.o.busy_workload == "randrw70":
            mix = ["--rw=randrw", "--rwmixread=70", "--numjobs=4", "--group_reporting"]
        else:
            mix = ["--rw=randread", "--readonly"]
        argv = ["fio", f"--name={label}", f"--filename={path}", "--bs=4k",
                "--iodepth=64", "--ioengine=libaio", "--direct=1", "--time_based",
                f"--runtime={self.o.busy_runtime}", f"--ramp_time={self.o.busy_ramp}",
                "--thread", "--output-format=json"] + mix
        self.r.setdefault("fio_argv", argv)
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
        def kill_all():
            # --thread keeps fio's job in fio's own process; forked job processes (setsid, so
            # not in fio's process group) would keep the file open, and the export busy, after
            # fio dies. Kill any descendant all the same.
            for pid in [proc.pid] + descendants(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

        try:
            out, err = await asyncio.wait_for(proc.communicate(),
                                              self.o.busy_runtime + self.o.busy_ramp + 60)
        except asyncio.TimeoutError:
            kill_all()
            await asyncio.wait_for(proc.wait(), 10)
            raise RunError(f"fio ({label}) did not finish in time")
        except asyncio.CancelledError:
            kill_all()
            raise
        if proc.returncode != 0:
            raise RunError(f"fio ({label}) exited {proc.returncode}: "
                           f"{err.decode(errors='replace').strip()[-500:]}")
        text = out.decode(errors="replace")
        try:  # fio may print warnings before the JSON
            res = json.loads(text[text.index("{"):])
        except ValueError as e:
            raise RunError(f"fio ({label}) output is not JSON: {e}: {text[:300]!r}")
        job = res["jobs"][0]
        if job.get("error"):
            raise RunError(f"fio ({label}) job error {job['error']}")
        rd, wr = job["read"], job["write"]
        return {"iops": rd["iops"] + wr["iops"], "bw_kib": rd["bw"] + wr["bw"],
                "lat_mean_us": rd["lat_ns"]["mean"] / 1e3,
                "io_kbytes": rd["io_kbytes"] + wr["io_kbytes"]}

    async def churning_pass(self, lat):
        """One fio pass on the busy export while the churn loop runs (paced by --busy-rate);
        the rounds' latencies are appended to ``lat``."""
        self.events.clear()
        fio_task = asyncio.create_task(self.fio("churn"))
        r = 0
        t0 = time.perf_counter()
        cpu0 = (cpu_s(self.proc.pid), own_cpu_s())
        try:
            while not fio_task.done():
                if self.o.busy_rate:  # pace the rounds: the same churn load on every target
                    wait = t0 + r / self.o.busy_rate - time.perf_counter()
                    if wait > 0:
                        await asyncio.wait({fio_task}, timeout=wait)
                        continue
                if self.o.busy_burn:
                    # Calibration: the CPU of a round without its work (see --busy-burn).
                    until = time.thread_time() + self.o.busy_burn / 1e3
                    while time.thread_time() < until:
                        pass
                else:
                    await self.churn_round("b", len(lat["total"]), lat)
                r += 1
            res = await fio_task
            # What the rounds cost under load (the daemon's figure includes serving the busy
            # export).
            el = time.perf_counter() - t0
            res["rounds"] = r
            res["cpu_per_s"] = {"daemon": (cpu_s(self.proc.pid) - cpu0[0]) / el,
                                "client": (own_cpu_s() - cpu0[1]) / el}
            return res
        finally:
            if not fio_task.done():
                fio_task.cancel()
                try:
                    await fio_task
                except BaseException:
                    pass

    async def busy(self):
        await self.cmd("blockdev-add", {"driver": "raw", "node-name": "nbusy",
                                        "file": {"driver": "file", "filename": self.p("busy.raw")}})
        kv = {"id": "busy", "node-name": "nbusy", "mountpoint": self.p("busy.mnt")}
        if self.o.busy_workload == "randrw70":
            kv["writable"] = True
        await self.cmd("block-export-add", self.export(**kv))
        if self.o.busy_workload == "randrw70":
            # The first writes through a fresh export run slower than any later ones (both
            # daemons: the first baseline came out 0.6x of a second one), which made the ratio
            # of a first run meaningless; an unmeasured pass first.
            log(f"  [{self.name}] fio warm-up ({self.o.busy_runtime} s, not counted)")
            await self.fio("warmup")
        # Baseline and churning passes alternate, starting and ending with a baseline (B C B C
        # ... B): each churning pass is compared with the mean of the baselines either side of
        # it, so a drift of the machine over the run (another tenant, the host) is not taken
        # for the churn's cost. The busy ratio is the median of those per-pass ratios.
        passes = max(1, self.o.busy_passes)
        bases, churns, ratios = [], [], []
        lat = {"node_add": [], "add": [], "del": [], "total": []}
        for k in range(passes + 1):
            log(f"  [{self.name}] fio baseline {k + 1}/{passes + 1} ({self.o.busy_runtime} s)")
            base = await self.fio("baseline")
            bases.append(base)
            log(f"  [{self.name}] fio baseline: {base['iops']:.0f} IOPS")
            if k > 0:
                around = (bases[k - 1]["iops"] + base["iops"]) / 2
                ratios.append(churns[-1]["iops"] / around if around else None)
                if ratios[-1] is not None:
                    log(f"  [{self.name}] churning pass {k}/{passes}: ratio {ratios[-1]:.3f}")
            if k == passes:
                break
            log(f"  [{self.name}] fio while churning {k + 1}/{passes} ({self.o.busy_runtime} s)")
            churns.append(await self.churning_pass(lat))
            c = churns[-1]
            log(f"  [{self.name}] fio during churn: {c['iops']:.0f} IOPS, {c['rounds']} rounds, "
                f"CPU/s: this script {c['cpu_per_s']['client']:.3f}, daemon "
                f"{c['cpu_per_s']['daemon']:.3f}")
        self.r["busy_churn_rounds"] = len(lat["total"])
        self.r["busy_churn_ms"] = lat
        self.r["busy_churn"] = {k: summary(v) for k, v in lat.items()}
        self.r["fio_baseline"] = bases[0]
        self.r["fio_baselines"] = bases
        self.r["fio_churn"] = churns[0]
        self.r["fio_churns"] = churns
        self.r["busy_ratios"] = ratios
        good = sorted(x for x in ratios if x is not None)
        self.r["busy_ratio"] = statistics.median(good) if good else None
        self.r["busy_ratio_min"] = good[0] if good else None
        self.r["busy_ratio_max"] = good[-1] if good else None
        if good:
            log(f"  [{self.name}] busy ratio: median {self.r['busy_ratio']:.3f} of {len(good)} "
                f"passes ({good[0]:.3f}–{good[-1]:.3f}), {len(lat['total'])} churn rounds")
        else:
            raise RunError("no baseline pass completed any I/O: no busy ratio")
        await self.cmd("block-export-del", {"id": "busy"})
        await self.wait_deleted("busy")
        await self.cmd("blockdev-del", {"node-name": "nbusy"})

    # teardown ------------------------------------------------------------------------------------

    async def quit(self):
        self.quit_sent = True
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(self.qmp.execute("quit"), self.o.timeout)
        except Exception as e:  # the daemon may close the connection before or after the reply
            log(f"  [{self.name}] quit: {e!r}")
        try:
            code = await asyncio.wait_for(asyncio.to_thread(self.proc.wait), self.o.quit_timeout)
        except asyncio.TimeoutError:
            raise RunError(f"daemon still running {self.o.quit_timeout} s after quit")
        self.r["quit_s"] = time.monotonic() - t0
        self.r["exit_code"] = code
        left = mounts_under(self.d)
        self.r["left_mounted"] = len(left)
        if left:
            log(f"  [{self.name}] still mounted after a clean exit: {left[:5]}"
                f"{' ...' if len(left) > 5 else ''}")
        log(f"  [{self.name}] quit: exit {code} after {self.r['quit_s']:.2f} s")
        if code != 0:
            raise RunError(f"daemon exited with status {code} after quit")

    async def cleanup(self):
        if self.qmp is not None:
            try:
                await asyncio.wait_for(self.qmp.disconnect(), 5)
            except BaseException as e:
                if not self.quit_sent:
                    log(f"  [{self.name}] disconnect: {e!r}")
        if self.proc is not None and self.proc.poll() is None:
            if not self.quit_sent:
                try:  # a daemon we did not get to quit: SIGTERM first (it unmounts), then kill
                    self.proc.terminate()
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass
            if self.proc.poll() is None:
                log(f"  [{self.name}] daemon {self.proc.pid} still running: killing it")
                self.proc.kill()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    log(f"  [{self.name}] daemon {self.proc.pid} did not die in 10 s")
        for mp in mounts_under(self.d):
            subprocess.run(["umount", "-l", mp], check=False, timeout=30,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        left = mounts_under(self.d)
        if left:
            log(f"  [{self.name}] could not unmount: {left}")
        if self.daemon_log is not None:
            self.daemon_log.close()
            self.daemon_log = None
            with open(self.p("daemon.log"), "rb") as f:
                text = f.read().decode(errors="replace").strip()
            self.r["daemon_log_tail"] = text[-4000:]
            if text and ("error" in self.r):
                log(f"  [{self.name}] --- daemon output (tail) ---\n{text[-2000:]}")
        try:
            os.unlink(self.p("busy.raw"))
        except FileNotFoundError:
            pass

    async def run(self):
        try:
            await asyncio.to_thread(self.make_files)
            await self.start()
            await self.launch()
            await self.check_serving()
            await self.idle_cost("idle")
            if self.o.busy:
                await self.busy()
            await self.churn()
            await self.idle_cost("after_churn")
            await self.quit()
        except Exception as e:  # recorded with the run; the other runs go on
            self.r["error"] = str(e) if isinstance(e, RunError) else f"{type(e).__name__}: {e}"
            if self.proc is not None and not self.quit_sent:
                try:  # a lost connection is most often a dead daemon: say so
                    self.r["error"] += f" (daemon exited with status {self.proc.wait(1)})"
                except subprocess.TimeoutExpired:
                    pass
            log(f"  [{self.name}] FAILED: {self.r['error']}")
        finally:
            await self.cleanup()
        return self.r


# --- report -------------------------------------------------------------------------------------

def f(v, fmt="{:.1f}"):
    return "-" if v is None else fmt.format(v)


def g(r, *path):
    for k in path:
        if not isinstance(r, dict) or r.get(k) is None:
            return None
        r = r[k]
    return r


FIGURES = [  # (column, path, format)
    ("launch s", ("launch_s",), "{:.2f}"),
    ("serve fail", ("serve_failures",), "{}"),
    ("RSS MiB", ("idle", "rss_mib"), "{:.1f}"),
    ("threads", ("idle", "threads"), "{}"),
    ("child RSS MiB", ("idle", "children_rss_mib"), "{:.1f}"),
    ("add med ms", ("churn", "add", "median"), "{:.2f}"),
    ("add p99 ms", ("churn", "add", "p99"), "{:.2f}"),
    ("del med ms", ("churn", "del", "median"), "{:.2f}"),
    ("del p99 ms", ("churn", "del", "p99"), "{:.2f}"),
    ("add+del med ms", ("churn", "total", "median"), "{:.2f}"),
    ("add+del p99 ms", ("churn", "total", "p99"), "{:.2f}"),
    ("busy ratio", ("busy_ratio",), "{:.3f}"),
    ("busy ratio min", ("busy_ratio_min",), "{:.3f}"),
    ("busy ratio max", ("busy_ratio_max",), "{:.3f}"),
    ("busy rounds", ("busy_churn_rounds",), "{}"),
    ("RSS after churn MiB", ("after_churn", "rss_mib"), "{:.1f}"),
    ("quit s", ("quit_s",), "{:.2f}"),
    ("left mounted", ("left_mounted",), "{}"),
]


def table(results, busy):
    figs = [x for x in FIGURES if busy or not x[0].startswith("busy")]
    head = ["target", "run", "exports"] + [c for c, _, _ in figs] + ["error"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        row = [r["target"], str(r["run"]), str(r["exports"])]
        row += [f(g(r, *p), fmt) for _, p, fmt in figs]
        row.append((r.get("error") or "").replace("|", "\\|"))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def spread(results, targets, busy):
    figs = [x for x in FIGURES if busy or not x[0].startswith("busy")]
    out = {}
    head = ["target", "runs"] + [c for c, _, _ in figs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, _ in targets:
        rs = [r for r in results if r["target"] == name]
        out[name] = {}
        row = [name, str(len(rs))]
        for col, p, fmt in figs:
            vals = [g(r, *p) for r in rs if g(r, *p) is not None]
            if vals:
                out[name][col] = {"min": min(vals), "max": max(vals)}
                row.append(f"{fmt.format(min(vals))}–{fmt.format(max(vals))}")
            else:
                row.append("-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines), out


# --- main ---------------------------------------------------------------------------------------

def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", action="append", required=True, metavar="NAME=ARGV",
                    help="a daemon to measure: NAME=argv prefix, split on spaces (repeatable)")
    ap.add_argument("--exports", type=int, default=100, help="exports added at launch (100)")
    ap.add_argument("--rounds", type=int, default=200, help="churn rounds (200)")
    ap.add_argument("--workdir", help="directory for images, mountpoints and logs "
                    "(default: a new one under /var/tmp, kept)")
    ap.add_argument("--busy", action="store_true", help="also fio randread during churn")
    ap.add_argument("--busy-workload", choices=["randread", "randrw70"], default="randread",
                    help="fio on the busy export: 4k randread QD64 (default), or randrw70: "
                         "4k 70/30 random read/write QD64 x 4 jobs (the export is writable)")
    ap.add_argument("--busy-runtime", type=int, default=10, help="fio seconds per run (10)")
    ap.add_argument("--busy-passes", type=int, default=5, metavar="K",
                    help="churning fio passes, each between two baseline passes (5); the busy "
                    "ratio is the median of their ratios")
    ap.add_argument("--busy-ramp", type=int, default=2,
                    help="fio warm-up seconds before each measured --busy-runtime (2)")
    ap.add_argument("--busy-rate", type=float, default=0, metavar="N",
                    help="churn at most N rounds/s while fio runs (default: as fast as the "
                    "daemon goes; a fixed rate makes the busy ratio comparable across targets)")
    ap.add_argument("--busy-burn", type=float, default=0, metavar="MS",
                    help="calibration: instead of each churn round, spin MS ms of CPU in this "
                    "script (at --busy-rate): what that much CPU alone costs the busy export on "
                    "this machine (for example the QMP client's share of a round)")
    ap.add_argument("--export-args", action="append", default=[], metavar="NAME=JSON",
                    help="extra block-export-add arguments for target NAME's every export, e.g. "
                    """fusex='{"__org.fusex_passthrough": "off"}' (repeatable)""")
    ap.add_argument("--interleave", type=int, default=1, metavar="K",
                    help="repeat everything K times, alternating the target order (1)")
    ap.add_argument("--json", metavar="FILE", help="write the raw numbers here")
    ap.add_argument("--timeout", type=float, default=30,
                    help="bound, in s, on any QMP command, event, startup or file probe (30)")
    ap.add_argument("--quit-timeout", type=float, default=30,
                    help="seconds to wait for the daemon to exit after quit (30)")
    ap.add_argument("--settle", type=float, default=1.0,
                    help="seconds to wait before reading /proc for the idle cost (1)")
    o = ap.parse_args()
    targets = []
    for t in o.target:
        name, eq, argv = t.partition("=")
        if not eq or not name or not argv.split():
            ap.error(f"--target wants NAME=ARGV, got {t!r}")
        if any(name == n for n, _ in targets):
            ap.error(f"target name {name!r} given twice")
        targets.append((name, argv.split()))
    extra = {}
    for t in o.export_args:
        name, eq, js = t.partition("=")
        try:
            v = json.loads(js)
        except ValueError as e:
            ap.error(f"--export-args {t!r}: {e}")
        if not eq or not isinstance(v, dict) or name not in [n for n, _ in targets]:
            ap.error(f"--export-args wants NAME=JSON object for a --target NAME, got {t!r}")
        extra.setdefault(name, {}).update(v)
    o.export_args = extra
    if o.busy_burn < 0 or (o.busy_burn and not (o.busy and o.busy_rate > 0)):
        ap.error("--busy-burn needs --busy and a --busy-rate, and a positive MS")
    if o.exports < 0 or o.rounds < 1 or o.interleave < 1:
        ap.error("--exports must be >= 0, --rounds and --interleave >= 1")
    return o, targets


async def main():
    o, targets = parse_args()
    # SIGTERM cancels the run like Ctrl-C does (asyncio.run turns SIGINT into a cancel): the
    # finally blocks stop the daemon and unmount, and the partial results are still printed.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    if os.geteuid() != 0:
        log("warning: not root; FUSE mounts and umount -l will likely fail")
    if o.workdir:
        work = os.path.realpath(o.workdir)
        os.makedirs(work, exist_ok=True)
    else:
        work = tempfile.mkdtemp(prefix="serve_scale.", dir="/var/tmp")
    log(f"workdir {work}")
    results = []
    interrupted = None
    try:
        for k in range(o.interleave):
            order = targets if k % 2 == 0 else list(reversed(targets))
            for name, argv in order:
                rundir = os.path.join(work, f"{k}-{name}")
                if os.path.exists(rundir):
                    if mounts_under(rundir):
                        raise SystemExit(f"{rundir} has mounts under it; unmount them first")
                    subprocess.run(["rm", "-rf", "--one-file-system", rundir], check=True)
                os.makedirs(rundir)
                log(f"run {k + 1}/{o.interleave}: {name} ({o.exports} exports, {o.rounds} rounds)")
                run = Run(name, argv, rundir, o)
                run.r.update({"run": k + 1, "exports": o.exports, "rounds": o.rounds})
                results.append(run.r)
                await run.run()
    except (KeyboardInterrupt, asyncio.CancelledError) as e:
        interrupted = "cancelled (SIGINT or SIGTERM)" if isinstance(e, asyncio.CancelledError) \
            else repr(e)
        if results and not results[-1].get("error"):
            results[-1]["error"] = "interrupted"
        log(f"interrupted: {interrupted}; partial results follow")
    print(table(results, o.busy))
    spread_out = None
    if o.interleave > 1:
        text, spread_out = spread(results, targets, o.busy)
        print()
        print("Spread (min–max over runs):")
        print()
        print(text)
    if o.json:
        doc = {"config": {"targets": [{"name": n, "argv": a} for n, a in targets],
                          "exports": o.exports, "rounds": o.rounds, "busy": o.busy,
                          "busy_runtime": o.busy_runtime, "busy_ramp": o.busy_ramp,
                          "busy_rate": o.busy_rate, "busy_passes": o.busy_passes,
                          "busy_burn": o.busy_burn,
                          "export_args": o.export_args,
                          "interleave": o.interleave,
                          "timeout": o.timeout, "workdir": work,
                          "host": os.uname().nodename, "kernel": os.uname().release,
                          "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
               "runs": results, "spread": spread_out, "interrupted": interrupted}
        with open(o.json, "w") as fh:
            json.dump(doc, fh, indent=1)
        log(f"raw numbers in {o.json}")
    failed = interrupted or any(r.get("error") for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main()))
    except KeyboardInterrupt:
        sys.exit(130)
