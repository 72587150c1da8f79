"""The qcow2 matrix: per-target image copies, renewal, fill runs, qsd command lines, goals table."""

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
from fusexbench.fio import FioWorkload, fio_command
from fusexbench.images import Image
from fusexbench.report import goals_table, incomplete_fills, render_report, row_class, summary_tables
from fusexbench.runner import Options, fill_record, renew_target
from fusexbench.stats import summarize_matrix
from fusexbench.targets import (TargetGroup, Tools, catalogue, image_format, parse_define, qemu_nbd_command,
                                qsd_command, start_target, unavailable_reason)

QEMU_IMG = shutil.which("qemu-img")
HELP_QCOW2 = "  --writable\n  --direct\n  --passthrough <MODE>\n  --format <FORMAT>"
TOOLS = Tools(fusex="/bin/fusex", fusex_help=HELP_QCOW2, qsd="/usr/bin/qemu-storage-daemon",
              qemu_nbd="/usr/bin/qemu-nbd", nbdfuse="/usr/bin/nbdfuse", fusermount="/bin/fusermount3")


def qemu_info(path):
    out = subprocess.run([QEMU_IMG, "info", "--output=json", path], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


class MatrixTest(unittest.TestCase):
    def test_rows_images_targets_goals(self):
        m = matrices.get("qcow2")
        got = [(w.rw, w.bs, w.iodepth, w.numjobs, w.rwmixread) for w in m.workloads]
        self.assertEqual(got, [("randread", "4k", 1, 1, None), ("randread", "4k", 64, 1, None),
                               ("randwrite", "4k", 1, 1, None), ("randwrite", "4k", 64, 1, None),
                               ("randrw", "4k", 64, 4, 70), ("read", "128k", 16, 1, None),
                               ("write", "128k", 16, 1, None)])
        self.assertEqual(m.images, ("qcow2-full", "qcow2-sparse", "qcow2-backing"))
        specs, notes = matrices.expand_targets(list(m.default_targets), m, catalogue(ncpu=2), lambda s: None)
        self.assertEqual([s.name for s in specs], ["fusex", "fusex-raw", "qsd", "native"])
        self.assertEqual(specs[0].args, ())  # qcow2: default flags
        self.assertEqual(specs[1].args, ("--passthrough", "off"))
        self.assertEqual({(g["b"], g["min"], g["rows"]) for g in m.goals},
                         {("fusex-raw", 0.7, "all"), ("qsd", 2.0, "other"), ("qsd", 1.5, "allocating")})
        self.assertEqual(m.to_json()["goals"], m.goals)
        self.assertNotIn("goals", matrices.get("quick").to_json())


class FormatAndAvailabilityTest(unittest.TestCase):
    def setUp(self):
        self.cat = catalogue(ncpu=2)

    def test_formats(self):
        full = Image("qcow2-full", 1 << 30)
        shm = Image("shm", 1 << 30)
        self.assertEqual(image_format(self.cat["fusex"], full), "qcow2")
        self.assertEqual(image_format(self.cat["qsd"], full), "qcow2")
        self.assertEqual(image_format(self.cat["fusex-raw"], full), "raw")
        self.assertEqual(image_format(self.cat["native"], full), "raw")
        self.assertEqual(image_format(self.cat["fusex"], shm), "raw")
        s = parse_define("qsd-raw=qsd:format=raw")
        self.assertEqual((s.kind, s.args, s.options["format"]), ("qsd", (), "raw"))

    def test_fusex_without_qcow2_backend_is_skipped(self):
        full = Image("qcow2-sparse", 1 << 30)
        old = Tools(fusex="/bin/fusex", fusex_help="  --writable\n  --passthrough <MODE>")
        self.assertIn("--format", unavailable_reason(self.cat["fusex"], full, old))
        self.assertIsNone(unavailable_reason(self.cat["fusex-raw"], full, old))
        self.assertIsNone(unavailable_reason(self.cat["fusex"], Image("shm", 1 << 30), old))
        self.assertIsNone(unavailable_reason(self.cat["fusex"], full, TOOLS))
        self.assertIsNone(unavailable_reason(self.cat["native"], full, TOOLS))
        # An other fusex binary is asked too (an old one would export the qcow2 file as raw bytes).
        before = parse_define("before=fusex@/bin/true:")
        self.assertIn("no qcow2 backend", unavailable_reason(before, full, TOOLS))


class CommandTest(unittest.TestCase):
    def test_qsd_qcow2_and_overlay(self):
        cat = catalogue(ncpu=2)
        img = Image("qcow2-full", 1 << 30, "/dev/shm/x/a.qsd.qcow2", direct=True, format="qcow2")
        cmd = qsd_command(TOOLS, cat["qsd"], img, "/m")
        self.assertEqual(cmd[1:5], ["--blockdev", "driver=file,node-name=file,filename=/dev/shm/x/a.qsd.qcow2,"
                                                  "cache.direct=on,aio=io_uring,locking=off",
                                    "--blockdev", "driver=qcow2,node-name=disk,file=file"])
        ov = Image("qcow2-backing", 1 << 30, "/d/o.qcow2", direct=False, format="qcow2", backing="/d/base.qcow2")
        cmd = qsd_command(TOOLS, cat["qsd"], ov, "/m")
        self.assertIn("driver=file,node-name=base-file,filename=/d/base.qcow2,cache.direct=off,aio=io_uring,"
                      "locking=off,read-only=on", cmd)
        self.assertIn("driver=qcow2,node-name=base,file=base-file,read-only=on", cmd)
        self.assertIn("driver=qcow2,node-name=disk,file=file,backing=base", cmd)
        self.assertLess(cmd.index("driver=qcow2,node-name=base,file=base-file,read-only=on"),
                        cmd.index("driver=qcow2,node-name=disk,file=file,backing=base"))
        raw = Image("qcow2-full", 1 << 30, "/d/r.raw", format="raw")
        self.assertIn("driver=raw,node-name=disk,file=file", qsd_command(TOOLS, cat["qsd"], raw, "/m"))
        nbd = qemu_nbd_command(TOOLS, cat["nbdfuse"], img, "/s")
        self.assertTrue(nbd[-1].startswith("driver=qcow2,file.driver=file,"))

    def test_fill_runs_are_not_time_based(self):
        w = FioWorkload("w", "randwrite", "4k", 64)
        self.assertTrue(w.writes)
        self.assertFalse(FioWorkload("r", "randread", "4k", 1).writes)
        self.assertTrue(FioWorkload("m", "randrw", "4k", 1, rwmixread=70).writes)
        cmd = fio_command(w, "/f", 1 << 20, 60, 0, time_based=False)
        self.assertNotIn("--time_based", cmd)
        self.assertIn("--runtime=60s", cmd)
        self.assertFalse(any(c.startswith("--ramp_time") for c in cmd))
        self.assertIn("--time_based", fio_command(w, "/f", 1 << 20, 5, 1))

    def test_fill_record_and_cap(self):
        w = FioWorkload("m", "randrw", "4k", 64, numjobs=4, rwmixread=70)
        metrics = {"read": {"io_bytes": 700}, "write": {"io_bytes": 300}}
        self.assertEqual(fill_record(w, 250, metrics), {"expected_bytes": 1000, "done_bytes": 1000, "complete": True})
        self.assertFalse(fill_record(w, 300, metrics)["complete"])
        self.assertFalse(fill_record(w, 300, {"read": None, "write": {"io_bytes": 5}})["complete"])
        self.assertEqual(Options(runtime=5).fill_cap_s(), 60)
        self.assertEqual(Options(runtime=1).fill_cap_s(), 30)
        self.assertEqual(Options(runtime=5, fill_cap=7).fill_cap_s(), 7)


class ImageTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="fusexbench-test-")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def test_sparse_raw_copies_renew_without_qemu(self):
        img = images.prepare_image("qcow2-sparse", 1 << 20, self.dir, targets={"a": "raw", "b": "raw"})
        self.assertTrue(img.fresh and img.per_target)
        self.assertEqual(set(img.copies), {"a", "b"})
        view = img.for_target("a")
        self.assertEqual((view.format, view.size, view.kind, view.label), ("raw", 1 << 20, "qcow2-sparse",
                                                                           "qcow2-sparse-1M"))
        self.assertEqual(os.path.getsize(view.path), 1 << 20)
        self.assertEqual(images.allocated_bytes(view.path), 0)
        self.assertNotEqual(view.path, img.for_target("b").path)
        with open(view.path, "r+b") as f:
            f.write(b"x" * 8192)
        self.assertGreater(images.allocated_bytes(view.path), 0)
        self.assertTrue(images.needs_renewal(img, "a"))
        images.renew_copy(img, "a")
        self.assertEqual(images.allocated_bytes(view.path), 0)
        self.assertIn("re-created", img.note)
        self.assertEqual(img.to_json()["copies"]["a"], {"path": view.path, "format": "raw"})
        images.remove_image(img)
        self.assertFalse(os.path.exists(self.dir))

    def test_runner_renews_a_mounted_target(self):
        img = images.prepare_image("qcow2-sparse", 1 << 20, self.dir, targets={"native": "raw"})
        spec = catalogue()["native"]
        wd = os.path.join(self.dir, "w")
        t = start_target(spec, img.for_target("native"), wd, TOOLS)
        with open(t.path, "r+b") as f:
            f.write(b"x" * 8192)
        t.dirty = True
        with TargetGroup(wd) as group:
            group.add(t)
            t2 = renew_target(t, img, TOOLS, group)
            self.assertIsNot(t2, t)
            self.assertFalse(t2.dirty)
            self.assertEqual(group.targets, [t2])
            self.assertEqual(images.allocated_bytes(t2.path), 0)
        images.remove_image(img)

    @unittest.skipUnless(QEMU_IMG, "no qemu-img")
    def test_full_copies_hold_the_same_data(self):
        targets = {"fusex": "qcow2", "qsd": "qcow2", "fusex-raw": "raw"}
        img = images.prepare_image("qcow2-full", 1 << 20, self.dir, targets=targets)
        self.assertFalse(img.fresh)
        q, r = img.for_target("qsd").path, img.for_target("fusex-raw").path
        self.assertEqual(qemu_info(q)["format"], "qcow2")
        self.assertEqual(qemu_info(q)["virtual-size"], 1 << 20)
        self.assertEqual(os.path.getsize(r), 1 << 20)
        subprocess.run([QEMU_IMG, "compare", "-f", "raw", "-F", "qcow2", r, q], check=True, capture_output=True)
        subprocess.run([QEMU_IMG, "compare", "-f", "qcow2", "-F", "qcow2", img.for_target("fusex").path, q],
                       check=True, capture_output=True)
        self.assertNotEqual(img.for_target("fusex").path, q)
        self.assertFalse(images.needs_renewal(img, "qsd"))
        # only the copies are left (the sources were moved or removed)
        self.assertEqual(sorted(os.listdir(self.dir)), sorted(os.path.basename(c["path"]) for c in img.copies.values()))
        images.remove_image(img)
        self.assertFalse(os.path.exists(self.dir))

    @unittest.skipUnless(QEMU_IMG, "no qemu-img")
    def test_backing_overlays_and_sparse_qcow2(self):
        img = images.prepare_image("qcow2-backing", 1 << 20, self.dir,
                                   targets={"fusex": "qcow2", "qsd": "qcow2", "fusex-raw": "raw"})
        base = img.sources["base"]
        ov = img.for_target("qsd")
        self.assertEqual(ov.backing, base)
        self.assertIsNone(img.for_target("fusex-raw").backing)
        info = qemu_info(ov.path)
        self.assertEqual((info["format"], info["virtual-size"]), ("qcow2", 1 << 20))
        self.assertEqual(info["backing-filename"], base)
        subprocess.run([QEMU_IMG, "compare", "-F", "raw", ov.path, img.for_target("fusex-raw").path], check=True,
                       capture_output=True)
        self.assertTrue(images.needs_renewal(img, "qsd"))
        self.assertFalse(images.needs_renewal(img, "fusex-raw"))  # raw writes change no layout
        images.remove_image(img)
        self.assertFalse(os.path.exists(self.dir))
        sparse = images.prepare_image("qcow2-sparse", 1 << 20, self.dir, targets={"fusex": "qcow2"})
        info = qemu_info(sparse.for_target("fusex").path)
        self.assertEqual((info["format"], info["virtual-size"]), ("qcow2", 1 << 20))
        self.assertNotIn("backing-filename", info)
        images.remove_image(sparse)


def _run(image, workload, target, rnd, iops, fill=None):
    r = {"round": rnd, "workload": workload, "image": image, "target": target, "ok": True,
         "metrics": {"iops": iops, "bw_mib": iops * 4 / 1024, "read": None, "write": None}}
    if fill is not None:
        r["fill"] = {"expected_bytes": 100, "done_bytes": 100 if fill else 50, "complete": fill}
    return r


def goals_results():
    m = matrices.get("qcow2").to_json()
    runs = []
    figures = {  # (image, workload): (fusex, fusex-raw, qsd)
        ("qcow2-full-1G", "randread-4k-qd1"): (80, 100, 30),       # 0.8 ok, 2.67 ok
        ("qcow2-full-1G", "randwrite-4k-qd1"): (60, 100, 40),      # 0.6 no, 1.5 no (other: 2)
        ("qcow2-sparse-1G", "randread-4k-qd1"): (90, 100, 60),     # 0.9 ok, 1.5 no
        ("qcow2-sparse-1G", "randwrite-4k-qd1"): (90, 100, 50),    # 0.9 ok, 1.8 ok (allocating: 1.5)
    }
    for rnd in (1, 2):
        for (image, wl), vals in figures.items():
            for t, v in zip(("fusex", "fusex-raw", "qsd"), vals):
                fill = None
                if image.startswith("qcow2-sparse") and "write" in wl:
                    fill = not (t == "qsd" and rnd == 2)
                runs.append(_run(image, wl, t, rnd, v, fill))
    m.update({"targets": [{"name": n, "started": True} for n in ("fusex", "fusex-raw", "qsd")],
              "images": [{"label": "qcow2-full-1G", "kind": "qcow2-full", "fresh": False},
                         {"label": "qcow2-sparse-1G", "kind": "qcow2-sparse", "fresh": True}],
              "workloads": [{"name": "randread-4k-qd1", "kind": "fio", "rw": "randread"},
                            {"name": "randwrite-4k-qd1", "kind": "fio", "rw": "randwrite"}],
              "runs": runs, "skipped": [], "mounts": []})
    return {"started": "2026-01-01T00:00:00", "machine": {"host": "h"}, "tools": {}, "params": {},
            "matrices": [m]}


class GoalsReportTest(unittest.TestCase):
    def setUp(self):
        self.results = goals_results()
        self.res = self.results["matrices"][0]
        self.rows = summarize_matrix(self.res)

    def test_row_classes_and_capped_fills(self):
        self.assertEqual(row_class(self.res, "qcow2-sparse-1G", "randwrite-4k-qd1"), "allocating")
        self.assertEqual(row_class(self.res, "qcow2-sparse-1G", "randread-4k-qd1"), "other")
        self.assertEqual(row_class(self.res, "qcow2-full-1G", "randwrite-4k-qd1"), "other")
        self.assertEqual(incomplete_fills(self.res), {("qcow2-sparse-1G", "randwrite-4k-qd1", "qsd")})

    def test_goal_cells(self):
        full = "\n".join(goals_table(self.res, self.rows, "qcow2-full-1G"))
        self.assertIn("**Goals**: 2 of 4 met", full)
        self.assertIn("| workload | fusex IOPS | fusex MiB/s | fusex-raw IOPS | qsd IOPS | fusex/fusex-raw | fusex/qsd |",
                      full)
        self.assertIn("| `randread-4k-qd1` | 80 \u00b10% | 0.312 | 100 \u00b10% | 30 \u00b10% | 0.80 \u2713 (\u2265 0.70) | 2.67 \u2713 (\u2265 2.00) |",
                      full)
        self.assertIn("0.60 \u2717 (\u2265 0.70) | 1.50 \u2717 (\u2265 2.00)", full)
        self.assertNotIn("\u2021", full)
        sparse = "\n".join(goals_table(self.res, self.rows, "qcow2-sparse-1G"))
        self.assertIn("**Goals**: 3 of 4 met", sparse)
        self.assertIn("`randwrite-4k-qd1` (alloc.)", sparse)
        self.assertIn("| 50 \u00b10% \u2021 | 0.90 \u2713 (\u2265 0.70) | 1.80 \u2713 (\u2265 1.50) |", sparse)
        self.assertIn("hit its time cap", sparse)

    def test_goals_need_the_targets(self):
        res = json.loads(json.dumps(self.res))
        res["targets"] = [t for t in res["targets"] if t["name"] != "fusex"]
        self.assertEqual(goals_table(res, summarize_matrix(res), "qcow2-full-1G"), [])
        # fusex did not start on one image: no goals table there, the other image keeps its own
        res = json.loads(json.dumps(self.res))
        res["runs"] = [r for r in res["runs"] if not (r["target"] == "fusex" and r["image"] == "qcow2-full-1G")]
        rows = summarize_matrix(res)
        self.assertEqual(goals_table(res, rows, "qcow2-full-1G"), [])
        self.assertIn("**Goals**: 3 of 4 met", "\n".join(goals_table(res, rows, "qcow2-sparse-1G")))

    def test_report_and_summary_carry_goals(self):
        text = render_report(self.results)
        self.assertEqual(text.count("**Goals**"), 2)
        self.assertIn("**Goals**", summary_tables(self.results))


if __name__ == "__main__":
    unittest.main()
