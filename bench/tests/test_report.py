"""Report rendering from a stored results.json."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
sys.path.insert(0, os.path.dirname(HERE))  # bench/, for fusexbench

import copy
import json
import tempfile
import unittest

from fusexbench import plots
from fusexbench.report import (fmt_count, fmt_ratio, fmt_sig, ratio_pairs, render_report, summary_tables,
                               table)
from fusexbench.stats import summarize_matrix


def load():
    with open(os.path.join(DATA, "results-quick-small.json"), encoding="utf-8") as f:
        return json.load(f)


class FormatTest(unittest.TestCase):
    def test_counts(self):
        self.assertEqual(fmt_count(950), "950")
        self.assertEqual(fmt_count(12345), "12.3k")
        self.assertEqual(fmt_count(612000), "612k")
        self.assertEqual(fmt_count(1234567), "1.23M")
        self.assertEqual(fmt_count(None), "-")
        self.assertEqual(fmt_count(float("nan")), "-")

    def test_sig_and_ratio(self):
        self.assertEqual(fmt_sig(1.2345), "1.23")
        self.assertEqual(fmt_sig(123.45), "123")
        self.assertEqual(fmt_sig(0), "0")
        self.assertEqual(fmt_ratio({"median": 0.8349}), "0.83")
        self.assertEqual(fmt_ratio(None), "-")

    def test_pairs(self):
        self.assertEqual(ratio_pairs(["native", "fusex", "qsd", "nbdfuse"]),
                         [("fusex", "native"), ("qsd", "native"), ("nbdfuse", "native"),
                          ("fusex", "qsd"), ("fusex", "nbdfuse"), ("qsd", "nbdfuse")])
        self.assertEqual(ratio_pairs(["fusex-q1", "qsd"]), [("fusex-q1", "qsd")])

    def test_table(self):
        t = table(["a", "b"], [["x", "1"]])
        self.assertEqual(t.splitlines(), ["| a | b |", "| :--- | ---: |", "| x | 1 |"])


class RenderTest(unittest.TestCase):
    def setUp(self):
        self.results = load()
        self.text = render_report(self.results, {"quick": [("quick-shm-64M-bars.png", "bars")]})

    def test_header_machine_and_tools(self):
        m = self.results["machine"]
        self.assertIn(f"on {m['host']}", self.text.splitlines()[0])
        self.assertIn(m["kernel"], self.text)
        self.assertIn("fio-3.33", self.text)
        self.assertIn("median of the per-round ratios", self.text)

    def test_tables_carry_medians_and_ratios(self):
        rows = summarize_matrix(self.results["matrices"][0])
        row = next(r for r in rows if r["workload"] == "randread-4k-qd1")
        med = row["targets"]["fusex"]["metrics"]["iops"]["median"]
        self.assertIn(fmt_count(med), self.text)
        ratio = row["targets"]["fusex"]["ratios"]["native"]["median"]
        after = self.text.split("**Ratios**", 1)[1]
        line = next(l for l in after.splitlines() if l.startswith("| `randread-4k-qd1` |"))
        self.assertEqual(line.split("|")[2].strip(), f"{ratio:.2f}")  # first column: fusex/native
        self.assertIn("| workload | fusex/native | qsd/native | fusex/qsd |", self.text)

    def test_details_row_per_target_with_vs_columns(self):
        det = [l for l in self.text.splitlines() if l.startswith("| `randrw70-4k-qd64-4j` | ")
               and l.count("|") == 12]
        self.assertEqual(len(det), 3)
        fusex = next(l for l in det if l.split("|")[2].strip() == "fusex")
        self.assertRegex(fusex, r"qsd \d+\.\d\d")

    def test_commands_configuration_and_plots(self):
        self.assertIn("--writable --direct", self.text)
        self.assertIn("cache.direct=on", self.text)
        self.assertIn("fio --name=randread-4k-qd1", self.text)
        self.assertIn("![bars](quick-shm-64M-bars.png)", self.text)

    def test_skips_and_interruption_are_reported(self):
        r = copy.deepcopy(self.results)
        r["interrupted"] = "SIGINT"
        r["matrices"][0]["skipped"].append("Skipped fusex-qN: `fusex mount --help` has no --queues.")
        text = render_report(r, None, "Plots skipped: no matplotlib.")
        self.assertIn("Interrupted by SIGINT", text)
        self.assertIn("- Skipped fusex-qN: `fusex mount --help` has no --queues.", text)
        self.assertIn("_Plots skipped: no matplotlib._", text)

    def test_failed_target_shows_dash_and_error(self):
        r = copy.deepcopy(self.results)
        for run in r["matrices"][0]["runs"]:
            if run["target"] == "qsd":
                run["ok"] = False
                run["error"] = "target unusable: export no longer mounted"
        text = render_report(r)
        self.assertIn("qsd (target unusable: export no longer mounted)", text)

    def test_summary_tables_only_main_tables(self):
        s = summary_tables(self.results)
        self.assertIn("**IOPS**", s)
        self.assertIn("**Ratios**", s)
        self.assertNotIn("<details>", s)

    def test_deterministic(self):
        self.assertEqual(self.text, render_report(load(), {"quick": [("quick-shm-64M-bars.png", "bars")]}))


@unittest.skipIf(plots.available() is not None, "matplotlib not installed")
class PlotTest(unittest.TestCase):
    def test_plots_written(self):
        with tempfile.TemporaryDirectory() as d:
            files, note = plots.make_plots(load(), d)
            self.assertIsNone(note)
            names = [f for f, _ in files["quick"]]
            self.assertIn("quick-shm-64M-bars.png", names)
            for f in names:
                self.assertGreater(os.path.getsize(os.path.join(d, f)), 1000)


if __name__ == "__main__":
    unittest.main()


class FileAccessRenderTest(unittest.TestCase):
    def test_time_calls_and_speed_ratios(self):
        def run(target, rnd, ms, calls):
            return {"round": rnd, "workload": "1M-seq-4k-warm", "image": "disk-1M", "target": target,
                    "ok": True, "error": None, "command": ["fileaccess", "/f", "seq", "4096", "4"],
                    "metrics": {"time_ms": ms, "read_calls": calls, "mib_s": 1000.0 / ms,
                                "us_per_call": ms * 1000 / calls, "complete": True},
                    "server_cpu_us_per_io": None if target == "native" else 1.5}
        res = {"name": "passthrough", "title": "t", "kind": "fileaccess", "seed": "004.txt",
               "targets": [{"name": "native", "started": True}, {"name": "fusex-pt-on", "started": True}],
               "images": [{"label": "disk-1M", "fs": "ext4"}], "workloads": [], "notes": [], "skipped": [],
               "runs": [run("native", 1, 2.0, 256), run("fusex-pt-on", 1, 4.0, 256),
                        run("native", 2, 2.0, 256), run("fusex-pt-on", 2, 8.0, 256)]}
        text = render_report({"machine": {}, "params": {}, "matrices": [res]})
        self.assertIn("| `1M-seq-4k-warm` | 2.00 ±0% (256) | 6.00 ±33% (256) |", text)
        self.assertIn("| workload | fusex-pt-on/native |", text)
        self.assertIn("| `1M-seq-4k-warm` | 0.38 |", text)  # median of 0.5 and 0.25
