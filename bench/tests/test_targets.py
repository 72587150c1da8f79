"""Target configurations as data: command lines, requirements, mount table parsing."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
sys.path.insert(0, os.path.dirname(HERE))  # bench/, for fusexbench

import tempfile
import unittest
from unittest import mock

from fusexbench import targets
from fusexbench.images import Image
from fusexbench.targets import (Tools, catalogue, fusex_command, parse_define, passthrough_hp_command,
                                qemu_nbd_command, qsd_command, unavailable_reason)

TOOLS = Tools(fusex="/bin/fusex", fusex_help="  --writable\n  --direct\n  --queues <QUEUES>\n  --kernel-cache",
              qsd="/usr/bin/qemu-storage-daemon", qemu_nbd="/usr/bin/qemu-nbd", nbdfuse="/usr/bin/nbdfuse",
              fusermount="/bin/fusermount3")
SHM = Image("shm", 1 << 30, "/dev/shm/x/image.raw", direct=True, fs="tmpfs")
BUF = Image("disk", 1 << 30, "/var/tmp/x/image.raw", direct=False, fs="ext4")
NULL = Image("null", 1 << 30)


class CommandTest(unittest.TestCase):
    def setUp(self):
        self.cat = catalogue(ncpu=4)

    def test_fusex(self):
        self.assertEqual(fusex_command(TOOLS, self.cat["fusex-qN"], SHM, "/m"),
                         ["/bin/fusex", "mount", "--writable", "--direct", "--queues", "4", SHM.path, "/m"])
        self.assertEqual(fusex_command(TOOLS, self.cat["fusex"], BUF, "/m"),
                         ["/bin/fusex", "mount", "--writable", BUF.path, "/m"])
        self.assertEqual(fusex_command(TOOLS, self.cat["fusex"], NULL, "/m")[-2:], ["null:1G", "/m"])
        # A fusex with image locks gets --no-locking: the targets share the image.
        locking = Tools(fusex="/bin/fusex", fusex_help=TOOLS.fusex_help + "\n  --no-locking")
        self.assertEqual(fusex_command(locking, self.cat["fusex"], BUF, "/m"),
                         ["/bin/fusex", "mount", "--writable", "--no-locking", BUF.path, "/m"])

    def test_qsd(self):
        cmd = qsd_command(TOOLS, self.cat["qsd"], SHM, "/m")
        self.assertIn(f"driver=file,node-name=file,filename={SHM.path},cache.direct=on,aio=io_uring,locking=off", cmd)
        self.assertIn("type=fuse,id=exp,node-name=disk,mountpoint=/m,writable=on", cmd)
        self.assertIn("cache.direct=off,aio=threads", " ".join(qsd_command(TOOLS, self.cat["qsd-threads"], BUF, "/m")))
        null = " ".join(qsd_command(TOOLS, self.cat["qsd"], NULL, "/m"))
        self.assertIn("driver=null-co,node-name=disk,size=1073741824,read-zeroes=on", null)

    def test_qemu_nbd(self):
        cmd = qemu_nbd_command(TOOLS, self.cat["nbdfuse"], SHM, "/s")
        self.assertIn("--cache=none", cmd)
        self.assertIn("--aio=io_uring", cmd)
        self.assertIn("--socket=/s", cmd)
        self.assertIn("--cache=writeback", qemu_nbd_command(TOOLS, self.cat["nbdfuse"], BUF, "/s"))
        self.assertIn("driver=null-co,size=1073741824,read-zeroes=on", qemu_nbd_command(TOOLS, self.cat["nbdfuse"], NULL, "/s"))


class PassthroughHpTest(unittest.TestCase):
    def setUp(self):
        self.cat = catalogue(ncpu=2)
        self.tools = Tools(passthrough_hp="/p/passthrough_hp", fusermount="/bin/fusermount3")

    def test_command_exports_the_image_directory(self):
        spec = self.cat["passthrough_hp"]
        self.assertEqual(spec.kind, "passthrough_hp")
        self.assertEqual(passthrough_hp_command(self.tools, spec, SHM, "/w/export.d"),
                         ["/p/passthrough_hp", "--foreground", "--nocache", "/dev/shm/x", "/w/export.d"])
        s = parse_define("php-nosplice=passthrough_hp:--nocache --nosplice")
        self.assertEqual(passthrough_hp_command(self.tools, s, SHM, "/m")[1:4],
                         ["--foreground", "--nocache", "--nosplice"])

    def test_availability(self):
        spec = self.cat["passthrough_hp"]
        self.assertIsNone(unavailable_reason(spec, SHM, self.tools))
        self.assertIn("no null image", unavailable_reason(spec, NULL, self.tools))
        qcow = Image("qcow2-full", 1 << 20, "/dev/shm/x/a.qcow2", format="qcow2")
        self.assertIn("no qcow2", unavailable_reason(spec, qcow, self.tools))
        with mock.patch.object(targets, "PASSTHROUGH_HP_LOG", "/nonexistent/log"):
            self.assertIn("bench/setup.sh builds it", unavailable_reason(spec, SHM, Tools()))
        with tempfile.NamedTemporaryFile("w", suffix=".log") as log:
            log.write("peers.sh: g++ failed on x.cc\n")
            log.flush()
            with mock.patch.object(targets, "PASSTHROUGH_HP_LOG", log.name):
                self.assertIn("g++ failed", unavailable_reason(spec, SHM, Tools()))

    def test_found_through_environment(self):
        with mock.patch.dict(os.environ, {"PASSTHROUGH_HP": "/bin/true"}):
            self.assertEqual(targets.find_passthrough_hp(), "/bin/true")

    def test_not_started_when_binary_fails(self):
        # a "server" that exits at once: start fails with its exit status, nothing stays behind
        with tempfile.TemporaryDirectory() as d:
            img = Image("shm", 4096, os.path.join(d, "img", "i.raw"))
            os.makedirs(os.path.dirname(img.path))
            with open(img.path, "wb") as f:
                f.write(b"\0" * 4096)
            tools = Tools(passthrough_hp="/bin/false")
            with self.assertRaises(targets.TargetError) as e:
                targets.start_target(self.cat["passthrough_hp"], img, os.path.join(d, "w"), tools)
            self.assertIn("exited with 1", str(e.exception))
            self.assertFalse(os.path.exists(os.path.join(d, "w", "export.d")))


class AvailabilityTest(unittest.TestCase):
    def setUp(self):
        self.cat = catalogue(ncpu=2)

    def test_feature_detection(self):
        self.assertIsNone(unavailable_reason(self.cat["fusex-q1"], SHM, TOOLS))
        reason = unavailable_reason(self.cat["fusex-uring"], SHM, TOOLS)
        self.assertIn("--transport", reason)
        self.assertIn("--queues", TOOLS.fusex_flags())

    def test_missing_tools(self):
        none = Tools()
        self.assertIn("fusex binary not found", unavailable_reason(self.cat["fusex"], SHM, none))
        self.assertIn("qemu-system-common", unavailable_reason(self.cat["qsd"], SHM, none))
        self.assertIn("libnbd-bin", unavailable_reason(self.cat["nbdfuse"], SHM, none))

    def test_native_has_no_null(self):
        self.assertIsNone(unavailable_reason(self.cat["native"], SHM, TOOLS))
        self.assertIsNotNone(unavailable_reason(self.cat["native"], NULL, TOOLS))

    def test_define(self):
        s = parse_define("before=fusex@/bin/true:--queues 1")
        self.assertEqual((s.kind, s.options["binary"], s.requires), ("fusex", "/bin/true", ()))
        self.assertEqual(fusex_command(TOOLS, s, SHM, "/m")[0], "/bin/true")
        self.assertIsNone(unavailable_reason(s, SHM, TOOLS))
        s = parse_define("fusex-qd8=fusex:--queue-depth 8 --spin-us=20")
        self.assertEqual((s.name, s.kind, s.args), ("fusex-qd8", "fusex", ("--queue-depth", "8", "--spin-us=20")))
        self.assertEqual(s.requires, ("--queue-depth", "--spin-us"))
        self.assertIsNotNone(unavailable_reason(s, SHM, TOOLS))
        # A directory export by another binary (before/after in one run).
        s = parse_define("before-dir=fusex-dir@/bin/true:--no-read-ahead")
        self.assertEqual((s.kind, s.options["binary"], s.requires), ("fusex-dir", "/bin/true", ()))
        self.assertTrue(s.options["dir"])
        with self.assertRaises(ValueError):
            parse_define("nonsense")
        with self.assertRaises(ValueError):
            parse_define("x=weird:--a")


class MountTableTest(unittest.TestCase):
    def test_parse_mountinfo_with_escapes(self):
        info = ("22 1 0:21 / / rw - ext4 /dev/vda rw\n"
                "90 22 0:50 / /tmp/fusexbench-1-a/with\\040space/export rw - fuse /dev/fuse rw\n")
        with mock.patch("builtins.open", mock.mock_open(read_data=info)):
            self.assertEqual(targets.mount_points(), ["/", "/tmp/fusexbench-1-a/with space/export"])
            self.assertEqual(targets.mounts_under("/tmp/fusexbench-1-a"),
                             ["/tmp/fusexbench-1-a/with space/export"])
            self.assertEqual(targets.mounts_under("/tmp/fusexbench-1"), [])

    def test_cpu_seconds_of_self(self):
        v = targets.cpu_seconds(os.getpid())
        self.assertIsNotNone(v)
        self.assertGreaterEqual(v, 0)
        self.assertIsNone(targets.cpu_seconds(2 ** 22 + 12345))

    def test_native_target_needs_no_process(self):
        with tempfile.TemporaryDirectory() as d:
            img = Image("shm", 4096, os.path.join(d, "i.raw"))
            t = targets.start_target(catalogue()["native"], img, os.path.join(d, "w"), TOOLS)
            self.assertEqual(t.path, img.path)
            self.assertIsNone(t.cpu_seconds())
            self.assertIsNone(t.check_alive())
            t.stop()


if __name__ == "__main__":
    unittest.main()
