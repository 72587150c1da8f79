"""File-access program output, progress/ETA, image helpers."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
sys.path.insert(0, os.path.dirname(HERE))  # bench/, for fusexbench

import io
import json
import shutil
import subprocess
import tempfile
import unittest

from fusexbench import fileaccess, images
from fusexbench.progress import Progress, fmt_duration


class FileAccessTest(unittest.TestCase):
    def test_parse_complete(self):
        line = json.dumps({"path": "/f", "mode": "seq", "bufsize": 4096, "size": 1 << 20, "bytes": 1 << 20,
                           "calls": 256, "ns": 8_000_000, "complete": True})
        m = fileaccess.parse_output("noise\n" + line + "\n")
        self.assertAlmostEqual(m["time_ms"], 8.0)
        self.assertEqual(m["read_calls"], 256)
        self.assertAlmostEqual(m["mib_s"], 125.0)
        self.assertAlmostEqual(m["us_per_call"], 31.25)

    def test_parse_capped_extrapolates_time(self):
        line = json.dumps({"path": "/f", "mode": "rand", "bufsize": 4096, "size": 1000, "bytes": 250,
                           "calls": 10, "ns": 1_000_000, "complete": False})
        m = fileaccess.parse_output(line)
        self.assertFalse(m["complete"])
        self.assertAlmostEqual(m["time_ms"], 4.0)
        self.assertAlmostEqual(m["measured_ms"], 1.0)

    @unittest.skipUnless(shutil.which("gcc") or shutil.which("cc"), "no C compiler")
    def test_program_reads_every_block(self):
        binary = fileaccess.build()
        with tempfile.NamedTemporaryFile() as f:
            f.write(os.urandom(1 << 20))
            f.flush()
            for mode, buf, calls in (("seq", 4096, 256), ("rand", 131072, 8), ("rand", 3 << 20, 1)):
                w = fileaccess.FileAccessWorkload("t", 1 << 20, mode, buf, "warm")
                out = subprocess.run(fileaccess.command(binary, f.name, w, 0), capture_output=True,
                                     text=True, check=True).stdout
                m = fileaccess.parse_output(out)
                self.assertEqual((m["read_calls"], m["bytes"], m["complete"]), (calls, 1 << 20, True), mode)


class ProgressTest(unittest.TestCase):
    def test_eta_uses_estimate_then_pace(self):
        now = [0.0]
        p = Progress(10, 6.0, stream=io.StringIO(), clock=lambda: now[0])
        self.assertEqual(p.eta(), 60.0)
        now[0] = 8.0
        p.step()
        p.step()
        self.assertEqual(p.eta(), 32.0)  # 8 left x 4 s
        self.assertIn("2/10", p.line("x"))
        self.assertIn("ETA 32s", p.line())

    def test_non_tty_prints_lines(self):
        s = io.StringIO()
        p = Progress(2, 1.0, stream=s)
        p.show("a")
        p.step()
        p.show("b")
        self.assertEqual(len(s.getvalue().splitlines()), 2)

    def test_durations(self):
        self.assertEqual(fmt_duration(5), "5s")
        self.assertEqual(fmt_duration(75), "1m15s")
        self.assertEqual(fmt_duration(3700), "1h01m")


class ImageTest(unittest.TestCase):
    def test_random_image_and_direct_probe(self):
        with tempfile.TemporaryDirectory() as d:
            img = images.prepare_image("disk", 1 << 20, os.path.join(d, "fusexbench-t"))
            self.assertEqual(os.path.getsize(img.path), 1 << 20)
            self.assertEqual(img.label, "disk-1M")
            self.assertIsInstance(img.direct, bool)
            images.remove_image(img)
            self.assertFalse(os.path.exists(img.path))

    def test_null_has_no_file(self):
        img = images.prepare_image("null", 1 << 30, None)
        self.assertIsNone(img.path)
        self.assertEqual(img.label, "null-1G")

    def test_sweep_stale(self):
        with tempfile.TemporaryDirectory() as d:
            dead = os.path.join(d, "fusexbench-999999999-abc")
            alive = os.path.join(d, f"fusexbench-{os.getpid()}-abc")
            other = os.path.join(d, "something-else")
            for p in (dead, alive, other):
                os.makedirs(p)
            removed = images.sweep_stale([d], lambda p: False)
            self.assertEqual(removed, [dead])
            self.assertTrue(os.path.isdir(alive) and os.path.isdir(other))


if __name__ == "__main__":
    unittest.main()


class RunCliTest(unittest.TestCase):
    """The CLI's pure helpers (importing run.py must not re-exec or run anything)."""

    def setUp(self):
        import importlib

        self.run = importlib.import_module("run")

    def test_strict_problems(self):
        ok = {"matrices": [{"name": "quick", "targets": [{"name": "native", "started": True}],
                            "runs": [{"ok": True, "workload": "w", "target": "native"}], "skipped": []}]}
        self.assertEqual(self.run.strict_problems(ok), [])
        bad = json.loads(json.dumps(ok))
        bad["matrices"][0]["targets"].append({"name": "fusex", "started": False})
        bad["matrices"][0]["runs"].append({"ok": False, "workload": "w", "target": "fusex", "error": "x"})
        self.assertEqual(len(self.run.strict_problems(bad)), 2)
        self.assertEqual(self.run.strict_problems({"matrices": []}), ["no matrix ran"])

    def test_results_dir_is_unique(self):
        with tempfile.TemporaryDirectory() as d:
            a = self.run.results_dir(d, "host")
            os.makedirs(a)
            b = self.run.results_dir(d, "host")
            self.assertNotEqual(a, b)
            self.assertTrue(b.endswith("-host-2"))

    def test_dump_results_one_line_per_run(self):
        with open(os.path.join(DATA, "results-quick-small.json"), encoding="utf-8") as f:
            results = json.load(f)
        text = self.run.dump_results(results)
        self.assertEqual(json.loads(text), results)
        runs = results["matrices"][0]["runs"]
        run_lines = [l for l in text.splitlines() if l.startswith('   {"command":')]
        self.assertEqual(len(run_lines), len(runs))

    def test_args_defaults(self):
        a = self.run.parse_args([])
        self.assertEqual((a.matrix, a.runtime, a.ramp, a.rounds), ("quick", 5.0, 1.0, 3))
