"""The formats matrix: VMDK, VHD (vpc) and VDI image kinds, their copies, targets and goals table."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/, for fusexbench

import json
import shutil
import subprocess
import tempfile
import unittest

from fusexbench import images, matrices
from fusexbench.images import Image
from fusexbench.report import goals_table, row_class
from fusexbench.stats import summarize_matrix
from fusexbench.targets import (Tools, catalogue, fusex_command, image_format, missing_backend, parse_define,
                                qsd_command, unavailable_reason)

QEMU_IMG = shutil.which("qemu-img")
QEMU_IO = shutil.which("qemu-io")
# Under CI a missing qemu-img fails these tests instead of skipping them.
NEED_QEMU = unittest.skipUnless(QEMU_IMG or os.environ.get("CI") == "true", "no qemu-img")
# What `fusex mount --help` shows of --format (clap lists the values).
HELP_ALL = ("  --writable\n  --direct\n  --no-locking\n  --passthrough <MODE>\n  --format <FORMAT>\n"
            "          Possible values:\n          - auto\n          - raw\n          - qcow2\n"
            "          - vhd:   VHD, fixed or dynamic (QEMU's vpc)\n          - vmdk\n          - vdi\n"
            "          - vhdx\n")
HELP_QCOW2_ONLY = "  --writable\n  --passthrough <MODE>\n  --format <FORMAT>\n   [possible values: auto, raw, qcow2]"
TOOLS = Tools(fusex="/bin/fusex", fusex_help=HELP_ALL, qsd="/usr/bin/qemu-storage-daemon",
              fusermount="/bin/fusermount3")
FORMATS = ("vmdk", "vpc", "vdi", "vhdx")
MIB = 1 << 20


def qemu_info(path):
    out = subprocess.run([QEMU_IMG, "info", "--output=json", path], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def qemu_map(path, fmt):
    out = subprocess.run([QEMU_IMG, "map", "-f", fmt, "--output=json", path], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


def has_data(path, fmt, fresh_size):
    """Whether the image at ``path`` has any block allocated. QEMU's vhdx driver reports every block
    as data, so there the file's growth past its fresh size (a new block is appended) tells."""
    if fmt == "vhdx":
        return os.path.getsize(path) > fresh_size
    return any(e["data"] for e in qemu_map(path, fmt))


class MatrixTest(unittest.TestCase):
    def test_rows_images_targets_goals(self):
        m = matrices.get("formats")
        got = [(w.rw, w.bs, w.iodepth, w.numjobs, w.ioengine) for w in m.workloads]
        self.assertEqual(got, [("randread", "4k", 1, 1, "psync"), ("randread", "4k", 64, 1, "io_uring"),
                               ("randwrite", "4k", 1, 1, "psync"), ("randwrite", "4k", 64, 1, "io_uring"),
                               ("read", "128k", 16, 1, "io_uring"), ("write", "128k", 16, 1, "io_uring")])
        self.assertEqual(m.images, ("vmdk-full", "vmdk-fill", "vpc-full", "vpc-fill", "vdi-full", "vdi-fill",
                                    "vhdx-full", "vhdx-fill"))
        self.assertTrue(set(m.images) <= set(images.IMAGE_KINDS))
        specs, notes = matrices.expand_targets(list(m.default_targets), m, catalogue(ncpu=2), lambda s: None)
        self.assertEqual([s.name for s in specs], ["fusex", "fusex-raw", "qsd"])
        self.assertEqual(specs[0].args, ())  # the format image: fusex's defaults
        self.assertEqual(specs[1].args, ("--passthrough", "off"))
        self.assertEqual(notes, [])
        self.assertEqual({(g["a"], g["b"], g["min"], g["rows"]) for g in m.goals},
                         {("fusex", "fusex-raw", 0.7, "other"), ("fusex", "qsd", 2.0, "all")})
        js = m.to_json()
        self.assertEqual((js["goals"], js["bw_columns"]), (m.goals, "all"))
        self.assertNotIn("bw_columns", matrices.get("qcow2").to_json())

    def test_estimate_counts_every_image(self):
        m = matrices.get("formats")
        # 6 images x 3 targets x 6 workloads x 3 rounds
        self.assertEqual(matrices.estimate_seconds(m, 6 * 3 * 6 * 3, 5, 1), 324 * 6.6)


class KindTest(unittest.TestCase):
    def test_kinds_formats_and_freshness(self):
        for fmt in FORMATS:
            full, fill = Image(f"{fmt}-full", MIB), Image(f"{fmt}-fill", MIB)
            for img in (full, fill):
                self.assertTrue(img.per_target)
                self.assertEqual(img.own_format, fmt)
                self.assertEqual(img.format_for(None), fmt)
                self.assertEqual(img.format_for("raw"), "raw")
                self.assertTrue(images.image_dir(img.kind, "/var/tmp", "t").startswith("/dev/shm/"))
            self.assertFalse(images.is_empty_kind(full.kind))
            self.assertTrue(images.is_empty_kind(fill.kind))
        self.assertEqual(images.kind_format("qcow2-backing"), "qcow2")
        self.assertEqual(images.kind_format("shm"), "raw")
        self.assertEqual(Image("shm", MIB).format_for(None), "raw")
        self.assertEqual(images.create_options("vpc"), ["-o", "subformat=dynamic,force_size=on"])
        self.assertEqual(images.create_options("qcow2"), [])

    def test_target_formats(self):
        cat = catalogue(ncpu=2)
        img = Image("vdi-fill", MIB)
        self.assertEqual(image_format(cat["fusex"], img), "vdi")
        self.assertEqual(image_format(cat["qsd"], img), "vdi")
        self.assertEqual(image_format(cat["fusex-raw"], img), "raw")
        self.assertEqual(image_format(cat["native"], img), "raw")
        self.assertEqual(image_format(parse_define("qsd-raw=qsd:format=raw"), img), "raw")


class AvailabilityTest(unittest.TestCase):
    def setUp(self):
        self.cat = catalogue(ncpu=2)

    def test_fusex_needs_the_format_backend(self):
        old = Tools(fusex="/bin/fusex", fusex_help=HELP_QCOW2_ONLY)
        for fmt, name in (("vmdk", "vmdk"), ("vpc", "vhd"), ("vdi", "vdi"), ("vhdx", "vhdx")):
            img = Image(f"{fmt}-full", MIB)
            self.assertIn(f"no {name} among the --format values", unavailable_reason(self.cat["fusex"], img, old))
            self.assertIsNone(unavailable_reason(self.cat["fusex-raw"], img, old))
            self.assertIsNone(unavailable_reason(self.cat["fusex"], img, TOOLS))
            self.assertIsNone(unavailable_reason(self.cat["qsd"], img, TOOLS))
            self.assertIn(f"no {fmt}", unavailable_reason(self.cat["passthrough_hp"], img, TOOLS))
        self.assertIn("no --format", missing_backend("  --writable", "vdi"))
        self.assertIsNone(missing_backend("", "raw"))
        self.assertIsNone(missing_backend(HELP_QCOW2_ONLY, "qcow2"))
        # `vhdx` is not `vhd`
        self.assertIsNotNone(missing_backend("--format <F> [possible values: vhdx]", "vpc"))

    def test_other_binary_is_asked_too(self):
        before = parse_define("before=fusex@/bin/true:")  # prints no help: no backend
        self.assertIn("no --format", unavailable_reason(before, Image("vpc-fill", MIB), TOOLS))
        self.assertIsNone(unavailable_reason(before, Image("shm", MIB), TOOLS))


class CommandTest(unittest.TestCase):
    def test_qsd_drivers(self):
        cat = catalogue(ncpu=2)
        for fmt in FORMATS:
            img = Image(f"{fmt}-full", MIB, f"/dev/shm/x/a.qsd.{fmt}", direct=False, format=fmt)
            cmd = qsd_command(TOOLS, cat["qsd"], img, "/m")
            self.assertEqual(cmd[1:5], ["--blockdev", f"driver=file,node-name=file,filename=/dev/shm/x/a.qsd.{fmt},"
                                                      "cache.direct=off,aio=io_uring,locking=off",
                                        "--blockdev", f"driver={fmt},node-name=disk,file=file"])
            self.assertIn("type=fuse,id=exp,node-name=disk,mountpoint=/m,writable=on", cmd)

    def test_fusex_default_options(self):
        cat = catalogue(ncpu=2)
        img = Image("vmdk-fill", MIB, "/d/a.fusex.vmdk", direct=False, format="vmdk")
        self.assertEqual(fusex_command(TOOLS, cat["fusex"], img, "/m"),
                         ["/bin/fusex", "mount", "--writable", "--no-locking", "/d/a.fusex.vmdk", "/m"])


@NEED_QEMU
class ImageTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="fusexbench-test-")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def test_full_copies_hold_the_same_data_every_block_allocated(self):
        size = 4 * MIB  # two VHD blocks, four VDI blocks, 64 VMDK grains
        for fmt in FORMATS:
            with self.subTest(fmt=fmt):
                targets = {"fusex": fmt, "qsd": fmt, "fusex-raw": "raw"}
                img = images.prepare_image(f"{fmt}-full", size, self.dir, targets=targets)
                self.assertFalse(img.fresh)
                self.assertFalse(img.direct)  # fusex refuses --direct on these formats: buffered for all
                self.assertIn("buffered I/O on the image for every server", img.note)
                q, f, r = (img.for_target(t).path for t in ("qsd", "fusex", "fusex-raw"))
                self.assertEqual(len({q, f, r}), 3)
                self.assertEqual(img.for_target("qsd").format, fmt)
                self.assertEqual(img.for_target("fusex-raw").format, "raw")
                info = qemu_info(q)
                self.assertEqual((info["format"], info["virtual-size"]), (fmt, size))
                self.assertEqual(os.path.getsize(r), size)
                for path in (q, f):
                    subprocess.run([QEMU_IMG, "compare", "-f", "raw", "-F", fmt, r, path], check=True,
                                   capture_output=True)
                    extents = qemu_map(path, fmt)
                    self.assertEqual(sum(e["length"] for e in extents), size)
                    self.assertTrue(all(e["data"] for e in extents), extents)
                self.assertFalse(any(images.needs_renewal(img, t) for t in targets))
                self.assertEqual(sorted(os.listdir(self.dir)),
                                 sorted(os.path.basename(c["path"]) for c in img.copies.values()))
                images.remove_image(img)
                self.assertFalse(os.path.exists(self.dir))

    def test_fill_images_are_empty_and_renewed(self):
        size = 4 * MIB
        for fmt in FORMATS:
            with self.subTest(fmt=fmt):
                img = images.prepare_image(f"{fmt}-fill", size, self.dir,
                                           targets={"fusex": fmt, "fusex-raw": "raw"}, want_direct=True)
                self.assertTrue(img.fresh)
                self.assertFalse(img.direct)
                self.assertIn("re-created before any run that follows a write", img.note)
                path, raw = img.for_target("fusex").path, img.for_target("fusex-raw").path
                info = qemu_info(path)
                self.assertEqual((info["format"], info["virtual-size"]), (fmt, size))
                if fmt == "vmdk":
                    self.assertEqual(info["format-specific"]["data"]["create-type"], "monolithicSparse")
                fresh = os.path.getsize(path)
                self.assertFalse(has_data(path, fmt, fresh))
                self.assertEqual(images.allocated_bytes(raw), 0)
                self.assertEqual(os.path.getsize(raw), size)
                self.assertTrue(images.needs_renewal(img, "fusex"))
                self.assertTrue(images.needs_renewal(img, "fusex-raw"))  # a sparse file fills too
                with open(raw, "r+b") as fh:
                    fh.write(b"x" * 8192)
                images.renew_copy(img, "fusex-raw")
                self.assertEqual(images.allocated_bytes(raw), 0)
                if QEMU_IO:
                    subprocess.run([QEMU_IO, "-f", fmt, "-c", "write -P 7 0 64k", path], check=True,
                                   capture_output=True)
                    self.assertTrue(has_data(path, fmt, fresh))
                    images.renew_copy(img, "fusex")
                    self.assertFalse(has_data(path, fmt, fresh))
                    self.assertEqual(qemu_info(path)["virtual-size"], size)
                images.remove_image(img)
                self.assertFalse(os.path.exists(self.dir))

    def test_a_foreign_format_is_refused(self):
        with self.assertRaises(ValueError):
            images.prepare_image("vdi-fill", MIB, self.dir, targets={"fusex": "qcow2"})


def _run(image, workload, target, rnd, iops, fill=None):
    r = {"round": rnd, "workload": workload, "image": image, "target": target, "ok": True,
         "metrics": {"iops": iops, "bw_mib": iops * 4 / 1024, "read": None, "write": None}}
    if fill is not None:
        r["fill"] = {"expected_bytes": 100, "done_bytes": 100, "complete": fill}
    return r


class GoalsReportTest(unittest.TestCase):
    def setUp(self):
        m = matrices.get("formats").to_json()
        figures = {  # (image, workload): (fusex, fusex-raw, qsd)
            ("vpc-full-1G", "randwrite-4k-qd1"): (80, 100, 40),    # 0.8 ok, 2.0 ok
            ("vpc-fill-1G", "randread-4k-qd1"): (60, 100, 20),     # 0.6 no, 3.0 ok
            ("vpc-fill-1G", "randwrite-4k-qd1"): (50, 100, 30),    # 0.5 (no goal: allocating), 1.67 no
        }
        runs = []
        for rnd in (1, 2):
            for (image, wl), vals in figures.items():
                for t, v in zip(("fusex", "fusex-raw", "qsd"), vals):
                    fill = True if image.startswith("vpc-fill") and "write" in wl else None
                    runs.append(_run(image, wl, t, rnd, v, fill))
        m.update({"targets": [{"name": n, "started": True} for n in ("fusex", "fusex-raw", "qsd")],
                  "images": [{"label": "vpc-full-1G", "kind": "vpc-full", "fresh": False},
                             {"label": "vpc-fill-1G", "kind": "vpc-fill", "fresh": True}],
                  "workloads": [{"name": "randread-4k-qd1", "kind": "fio", "rw": "randread"},
                                {"name": "randwrite-4k-qd1", "kind": "fio", "rw": "randwrite"}],
                  "runs": runs, "skipped": [], "mounts": []})
        self.res = m
        self.rows = summarize_matrix(m)

    def test_goal_cells_with_every_targets_bandwidth(self):
        full = "\n".join(goals_table(self.res, self.rows, "vpc-full-1G"))
        self.assertIn("**Goals**: 2 of 2 met", full)
        self.assertIn("| workload | fusex IOPS | fusex MiB/s | fusex-raw IOPS | fusex-raw MiB/s | qsd IOPS | "
                      "qsd MiB/s | fusex/fusex-raw | fusex/qsd |", full)
        self.assertIn("| `randwrite-4k-qd1` | 80 \u00b10% | 0.312 | 100 \u00b10% | 0.391 | 40 \u00b10% | 0.156 | "
                      "0.80 \u2713 (\u2265 0.70) | 2.00 \u2713 (\u2265 2.00) |", full)

    def test_allocating_rows_have_no_raw_goal(self):
        self.assertEqual(row_class(self.res, "vpc-fill-1G", "randwrite-4k-qd1"), "allocating")
        self.assertEqual(row_class(self.res, "vpc-fill-1G", "randread-4k-qd1"), "other")
        fill = "\n".join(goals_table(self.res, self.rows, "vpc-fill-1G"))
        self.assertIn("**Goals**: 1 of 3 met", fill)
        self.assertIn("| 0.60 \u2717 (\u2265 0.70) | 3.00 \u2713 (\u2265 2.00) |", fill)
        self.assertIn("`randwrite-4k-qd1` (alloc.)", fill)
        self.assertIn("| 0.50 | 1.67 \u2717 (\u2265 2.00) |", fill)


if __name__ == "__main__":
    unittest.main()


class SpaceTest(unittest.TestCase):
    def test_bytes_needed_counts_a_copy_per_target_and_a_source(self):
        gib = 1 << 30
        # 8 format kinds x (3 targets + 1 source) x 1 GiB: more than this machine's 24 GiB of memory.
        self.assertEqual(images.bytes_needed(list(images.FORMAT_KINDS), [gib], 3), 32 * gib)
        self.assertEqual(images.bytes_needed(["shm", "null", "disk"], [gib], 3), gib)
        self.assertEqual(images.bytes_needed(["vdi-fill"], [MIB, 2 * MIB], 2), 9 * MIB)

    def test_shm_room_is_below_free_memory(self):
        with open("/proc/meminfo") as fh:
            avail = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
        self.assertLessEqual(images.shm_room(), avail - (2 << 30))
