"""The nbd matrix: NBD image kinds, their shared servers, client commands, goals in the report."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/, for fusexbench

import socket
import subprocess
import tempfile
import unittest

from fusexbench import matrices, nbdserver, runner
from fusexbench.images import NBD_KINDS, Image, image_dir, prepare_image, remove_image
from fusexbench.report import render_report, scaling_ratios
from fusexbench.targets import Tools, catalogue, fusex_command, start_target, unavailable_reason

HELP = "  --writable\n  --direct\n  --queues <QUEUES>\n  --nbd-timeout <SECONDS>\n  --no-locking"
TOOLS = Tools(fusex="/bin/fusex", fusex_help=HELP, qemu_nbd="/usr/bin/qemu-nbd", nbdfuse="/usr/bin/nbdfuse",
              nbdkit="/usr/bin/nbdkit", qsd="/usr/bin/qemu-storage-daemon")
NBD = Image("nbd", 1 << 30, "/dev/shm/x/nbd-1G.raw", direct=True, fs="tmpfs", nbd_socket="/t/s.sock",
            nbd_server_pid=1)
DELAY = Image("nbd-delay", 1 << 30, "/dev/shm/x/nbd-delay-1G.raw", direct=True, fs="tmpfs")
SHM = Image("shm", 1 << 30, "/dev/shm/x/image.raw", direct=True, fs="tmpfs")


class MatrixTest(unittest.TestCase):
    def test_rows_images_targets_goals(self):
        m = matrices.get("nbd")
        got = [(w.rw, w.bs, w.ioengine, w.iodepth, w.numjobs, w.rwmixread) for w in m.workloads]
        self.assertEqual(got, [("randread", "4k", "psync", 1, 1, None), ("randread", "4k", "io_uring", 64, 1, None),
                               ("randwrite", "4k", "psync", 1, 1, None), ("randwrite", "4k", "io_uring", 64, 1, None),
                               ("randrw", "4k", "io_uring", 64, 4, 70), ("read", "128k", "io_uring", 16, 1, None)])
        self.assertEqual(m.images, NBD_KINDS)
        self.assertEqual(m.goals, [{"a": "fusex-nbd", "b": "nbdfuse", "min": 2.0, "rows": "all"}])
        self.assertEqual({(g["image"], g["num"], g["den"], g["min"]) for g in m.scaling_goals},
                         {("nbd-delay", "randread-4k-qd64", "randread-4k-qd1", 40.0),
                          ("nbd-delay", "randwrite-4k-qd64", "randwrite-4k-qd1", 40.0)})
        self.assertIn("scaling_goals", m.to_json())

    def test_plan_expands_fusex_to_the_nbd_client(self):
        opts = runner.Options(catalogue=catalogue(ncpu=2))
        specs, notes, _ = runner.plan(matrices.get("nbd"), opts, TOOLS)
        self.assertEqual([s.name for s in specs], ["fusex-nbd", "nbdfuse"])
        self.assertEqual(notes, [])
        # Without an NBD client in the binary, fusex-nbd is skipped with the reason.
        old = Tools(fusex="/bin/fusex", fusex_help="  --writable", nbdfuse="/x", qemu_nbd="/x", nbdkit="/x")
        specs, notes, _ = runner.plan(matrices.get("nbd"), opts, old)
        self.assertEqual([s.name for s in specs], ["nbdfuse"])
        self.assertIn("--nbd-timeout", notes[0])


class AvailabilityTest(unittest.TestCase):
    def setUp(self):
        self.cat = catalogue(ncpu=2)

    def test_only_nbd_clients_on_nbd_images(self):
        self.assertIsNone(unavailable_reason(self.cat["fusex-nbd"], NBD, TOOLS))
        self.assertIsNone(unavailable_reason(self.cat["nbdfuse"], DELAY, TOOLS))
        self.assertIn("no NBD client", unavailable_reason(self.cat["native"], NBD, TOOLS))
        self.assertIn("no NBD client", unavailable_reason(self.cat["qsd"], NBD, TOOLS))
        self.assertIn("NBD images only", unavailable_reason(self.cat["fusex-nbd"], SHM, TOOLS))

    def test_missing_servers(self):
        no_kit = Tools(fusex="/bin/fusex", fusex_help=HELP, qemu_nbd="/q", nbdfuse="/n")
        self.assertIn("nbdkit", unavailable_reason(self.cat["fusex-nbd"], DELAY, no_kit))
        self.assertIsNone(unavailable_reason(self.cat["fusex-nbd"], NBD, no_kit))
        self.assertIn("qemu-nbd", nbdserver.missing_tool(NBD, None, "/k"))
        self.assertIsNone(nbdserver.missing_tool(SHM, None, None))


class CommandTest(unittest.TestCase):
    def test_fusex_is_a_client_of_the_socket(self):
        cmd = fusex_command(TOOLS, catalogue()["fusex-nbd"], NBD, "/m")
        self.assertEqual(cmd, ["/bin/fusex", "mount", "--writable", "nbd+unix:///?socket=/t/s.sock", "/m"])

    def test_servers(self):
        q = nbdserver.server_command(NBD, "/s", "/usr/bin/qemu-nbd", None)
        self.assertEqual(q[:4], ["/usr/bin/qemu-nbd", "--persistent", "--shared=16", "--socket=/s"])
        self.assertIn("--cache=none", q)
        self.assertIn(f"driver=raw,file.driver=file,file.filename={NBD.path},file.locking=off", q)
        k = nbdserver.server_command(DELAY, "/s", None, "/usr/bin/nbdkit")
        self.assertEqual(k[:8], ["/usr/bin/nbdkit", "--foreground", "--exit-with-parent", "--unix", "/s",
                                 "--threads", "64", "--filter=delay"])
        self.assertEqual(k[8:], ["file", f"file={DELAY.path}", "delay-read=1ms", "delay-write=1ms",
                                 "delay-zero=1ms"])
        with self.assertRaises(nbdserver.ServerError):
            nbdserver.server_command(DELAY, "/s", "/q", None)
        with self.assertRaises(nbdserver.ServerError):
            nbdserver.server_command(SHM, "/s", "/q", "/k")


class ImageTest(unittest.TestCase):
    def test_nbd_images_live_on_shm_with_their_own_file(self):
        self.assertEqual(image_dir("nbd-delay", "/var/tmp", "t"), "/dev/shm/fusexbench-t")
        with tempfile.TemporaryDirectory() as d:
            a = prepare_image("nbd", 8192, d)
            b = prepare_image("nbd-delay", 8192, d)
            try:
                self.assertNotEqual(a.path, b.path)
                self.assertTrue(a.nbd and b.nbd and not SHM.nbd)
                self.assertIsNone(a.nbd_uri)
                self.assertIn("qemu-nbd", a.note)
                self.assertIn("nbdkit", b.note)
            finally:
                remove_image(a)
                remove_image(b)


class ServerLifecycleTest(unittest.TestCase):
    """A real server process: started, reachable, its clients count its CPU, stopped."""

    def test_fake_server_on_a_socket(self):
        with tempfile.TemporaryDirectory() as d:
            img = Image("nbd", 4096, os.path.join(d, "i.raw"))
            sock = os.path.join(d, "srv", "nbd.sock")
            listener = ("import socket,sys,time;s=socket.socket(socket.AF_UNIX);s.bind(sys.argv[1]);"
                        "s.listen(8);time.sleep(60)")
            orig = nbdserver.server_command
            nbdserver.server_command = lambda image, path, q, k: [sys.executable, "-c", listener, path]
            try:
                srv = nbdserver.start_server(img, os.path.dirname(sock), None, None)
            finally:
                nbdserver.server_command = orig
            try:
                self.assertEqual(img.nbd_socket, sock)
                self.assertEqual(img.nbd_uri, f"nbd+unix:///?socket={sock}")
                self.assertEqual(img.nbd_server_pid, srv.pid)
                c = socket.socket(socket.AF_UNIX)
                c.connect(sock)
                c.close()
                # A client target's CPU is split into its own and the shared server's.
                t = start_target(catalogue()["native"], Image("shm", 4096, img.path), os.path.join(d, "w"), TOOLS)
                t.procs.append(subprocess.Popen([sys.executable, "-c", "pass"]))
                t.procs[-1].wait()
                self.assertIsNone(t.cpu_parts())  # a process is gone
                t.procs = [srv.proc]
                t.shared_pids = [srv.pid]
                self.assertEqual(set(t.cpu_parts()), {"client", "nbd_server"})
                t.procs = []
            finally:
                srv.stop()
            self.assertIsNone(srv.proc)
            self.assertFalse(os.path.exists(sock))

    def test_server_that_exits_is_an_error(self):
        with tempfile.TemporaryDirectory() as d:
            img = Image("nbd", 4096, os.path.join(d, "i.raw"))
            orig = nbdserver.server_command
            nbdserver.server_command = lambda image, path, q, k: [sys.executable, "-c", "print('nope')"]
            try:
                with self.assertRaises(nbdserver.ServerError) as e:
                    nbdserver.start_server(img, d, None, None)
            finally:
                nbdserver.server_command = orig
            self.assertIn("nope", str(e.exception))
            self.assertIsNone(img.nbd_socket)


def _run(target, image, workload, rnd, iops, by_role=None):
    return {"ok": True, "target": target, "image": image, "workload": workload, "round": rnd,
            "metrics": {"iops": iops, "bw_mib": iops / 256}, "server_cpu_us_per_io": 10.0,
            **({"cpu_us_per_io_by_role": by_role} if by_role else {})}


class ReportTest(unittest.TestCase):
    def result(self):
        m = matrices.get("nbd")
        runs = []
        for rnd, (qd1, qd64, nf) in enumerate([(1000, 45000, 5000), (900, 30000, 4000)], 1):
            runs += [_run("fusex-nbd", "nbd-delay-1G", "randread-4k-qd1", rnd, qd1, {"client": 50, "nbd_server": 40}),
                     _run("nbdfuse", "nbd-delay-1G", "randread-4k-qd1", rnd, qd1),
                     _run("fusex-nbd", "nbd-delay-1G", "randread-4k-qd64", rnd, qd64),
                     _run("nbdfuse", "nbd-delay-1G", "randread-4k-qd64", rnd, nf)]
        res = {**m.to_json(), "targets": [{"name": "fusex-nbd", "started": True}, {"name": "nbdfuse", "started": True}],
               "images": [{"kind": "nbd-delay", "label": "nbd-delay-1G", "size": 1 << 30}],
               "servers": [{"image": "nbd-delay-1G", "command": ["nbdkit", "--threads", "64"]}],
               "workloads": [], "runs": runs, "mounts": []}
        return res

    def test_scaling_ratio_per_round(self):
        res = self.result()
        self.assertEqual(sorted(scaling_ratios(res, "fusex-nbd", "nbd-delay-1G", "randread-4k-qd64",
                                               "randread-4k-qd1")), [100 / 3, 45.0])

    def test_report_has_goals_scaling_cpu_split_and_server(self):
        text = render_report({"machine": {}, "tools": {}, "params": {}, "matrices": [self.result()]})
        self.assertIn("fusex-nbd/nbdfuse", text)
        self.assertIn("**Scaling goals**: 0 of 1 met", text)  # the median of 33.3 and 45 is 39.2
        self.assertIn("| 39.2 \u00b115% | 33.3..45.0 | \u2717 (\u2265 40) |", text)
        self.assertIn("| `randread-4k-qd1` | fusex-nbd | 50.0 | 40.0 |", text)
        self.assertIn("`nbdkit --threads 64`", text)


if __name__ == "__main__":
    unittest.main()
