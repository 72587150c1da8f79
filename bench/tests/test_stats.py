"""Medians, spread and per-round ratios."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
sys.path.insert(0, os.path.dirname(HERE))  # bench/, for fusexbench

import unittest

from fusexbench.stats import median, per_round_ratios, row_summary, spread_pct, summarize, summarize_matrix


def run(target, rnd, iops, ok=True, lat=10.0, cpu=None):
    return {"target": target, "round": rnd, "ok": ok, "image": "shm-1G", "workload": "w",
            "error": None if ok else "boom",
            "metrics": {"iops": iops, "bw_mib": iops * 4 / 1024,
                        "read": {"iops": iops, "bw_mib": iops * 4 / 1024, "lat_mean_us": lat, "lat_p99_us": 2 * lat},
                        "write": None},
            "server_cpu_us_per_io": cpu}


class MedianTest(unittest.TestCase):
    def test_median(self):
        self.assertEqual(median([3, 1, 2]), 2)
        self.assertEqual(median([4, 1, 2, 3]), 2.5)
        self.assertIsNone(median([]))
        self.assertEqual(median([float("nan"), None, 5]), 5)

    def test_spread(self):
        self.assertAlmostEqual(spread_pct([90, 100, 110]), 10.0)
        self.assertEqual(spread_pct([5, 5, 5]), 0.0)
        self.assertIsNone(spread_pct([]))
        self.assertIsNone(spread_pct([0, 0]))

    def test_summarize(self):
        s = summarize([1.0, 3.0, 2.0, float("nan")])
        self.assertEqual((s["median"], s["min"], s["max"], s["n"]), (2.0, 1.0, 3.0, 3))


class RatioTest(unittest.TestCase):
    def test_per_round(self):
        self.assertEqual(per_round_ratios({1: 10, 2: 20, 3: 30}, {1: 5, 2: 10}), [2.0, 2.0])
        self.assertEqual(per_round_ratios({1: 10}, {1: 0}), [])

    def test_median_of_ratios_differs_from_ratio_of_medians(self):
        # Round drift hits both targets alike: per-round ratios are stable.
        runs = [run("a", 1, 100), run("b", 1, 50),
                run("a", 2, 200), run("b", 2, 100),
                run("a", 3, 60), run("b", 3, 40)]
        s = row_summary(runs, ["a", "b"], "fio")
        self.assertEqual(s["a"]["metrics"]["iops"]["median"], 100)
        self.assertEqual(s["b"]["metrics"]["iops"]["median"], 50)
        self.assertAlmostEqual(s["a"]["ratios"]["b"]["median"], 2.0)
        self.assertAlmostEqual(s["b"]["ratios"]["a"]["median"], 0.5)
        self.assertEqual(s["a"]["ratios"]["b"]["n"], 3)

    def test_failed_runs_excluded_and_reported(self):
        runs = [run("a", 1, 100), run("b", 1, 50), run("a", 2, 999, ok=False), run("b", 2, 50)]
        s = row_summary(runs, ["a", "b"], "fio")
        self.assertEqual(s["a"]["ok_rounds"], 1)
        self.assertEqual(s["a"]["errors"], ["boom"])
        self.assertEqual(s["a"]["metrics"]["iops"]["median"], 100)
        self.assertEqual(s["a"]["ratios"]["b"]["n"], 1)

    def test_missing_metric_is_none(self):
        s = row_summary([run("a", 1, 100)], ["a"], "fio")
        self.assertIsNone(s["a"]["metrics"]["write.iops"]["median"])
        self.assertIsNone(s["a"]["metrics"]["server_cpu_us_per_io"]["median"])
        self.assertEqual(s["a"]["ratios"], {})

    def test_summarize_matrix_rows_in_run_order(self):
        res = {"kind": "fio", "targets": [{"name": "a", "started": True}, {"name": "b", "started": True},
                                          {"name": "c", "started": False}],
               "runs": []}
        for rnd in (1, 2):
            for wl in ("w2", "w1"):
                for t in ("a", "b"):
                    r = run(t, rnd, 100 if t == "a" else 25)
                    r["workload"] = wl
                    res["runs"].append(r)
        rows = summarize_matrix(res)
        self.assertEqual([r["workload"] for r in rows], ["w2", "w1"])
        self.assertEqual(sorted(rows[0]["targets"]), ["a", "b"])
        self.assertAlmostEqual(rows[0]["targets"]["a"]["ratios"]["b"]["median"], 4.0)


if __name__ == "__main__":
    unittest.main()
