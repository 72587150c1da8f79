"""The side-by-side matrix's goal table: fusex vs the best peer per round, vs native, legacy vs io_uring."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/, for fusexbench

import unittest

from fusexbench import matrices
from fusexbench.report import balance_ratios, best_by_round, peer_goal_rows, peer_goals_table, summary_tables

IMAGE = "shm-1G"
# IOPS per round (rounds 1, 2, 3); None: the run failed.
ROWS = {
    "randread-4k-qd64": {
        "native": [100, 100, 100], "fusex": [60, 60, 60], "fusex-pt-off": [40, 40, 40],
        "qsd": [20, 30, 25], "nbdfuse": [25, 20, 20], "passthrough_hp": [10, 35, 40],
        "fusex-legacy": [50, 50, 48], "fusex-uring": [52, 51, 50],
        "fusex-legacy-pt-off": [30, 30, 30], "fusex-uring-pt-off": [40, 40, 40],
    },
    "write-128k-qd16": {
        "native": [100, 100, 100], "fusex": [50, 50, 50], "fusex-pt-off": [50, 50, 50],
        "qsd": [30, 30, 30], "passthrough_hp": [None, None, None],
    },
}


def synthetic() -> dict:
    """A side-by-side matrix result with the runs of ROWS."""
    res = matrices.get("side-by-side").to_json()
    runs = []
    for wl, by_target in ROWS.items():
        for target, values in by_target.items():
            for rnd, v in enumerate(values, 1):
                ok = v is not None
                runs.append({"round": rnd, "workload": wl, "image": IMAGE, "target": target, "ok": ok,
                             "error": None if ok else "fio exit 1",
                             "metrics": {"iops": v, "read": None, "write": None} if ok else None,
                             "server_cpu_us_per_io": 5.0 if ok and target != "native" else None})
    names = ["native", "fusex", "fusex-legacy", "fusex-uring", "fusex-pt-off", "fusex-legacy-pt-off",
             "fusex-uring-pt-off", "qsd", "nbdfuse", "passthrough_hp"]
    res.update({"runs": runs, "targets": [{"name": n, "started": True} for n in names],
                "workloads": [{"name": w} for w in ROWS], "images": [{"label": IMAGE, "kind": "shm"}]})
    return res


class PeerGoalTest(unittest.TestCase):
    def setUp(self):
        self.res = synthetic()
        self.rows = {r["workload"]: r for r in peer_goal_rows(self.res, IMAGE)}

    def test_best_peer_is_per_round(self):
        best = best_by_round(self.res, IMAGE, "randread-4k-qd64", ["qsd", "nbdfuse", "passthrough_hp"])
        self.assertEqual(best, {1: ("nbdfuse", 25), 2: ("passthrough_hp", 35), 3: ("passthrough_hp", 40)})
        r = self.rows["randread-4k-qd64"]
        self.assertEqual(r["best_peer"], "passthrough_hp")  # fastest in most rounds
        self.assertEqual(r["best_peer_iops"], 35)
        # fusex/best per round: 2.4, 1.71, 1.5 -> median 1.71; pt-off: 1.6, 1.14, 1.0 -> 1.14
        self.assertAlmostEqual(r["vs_peer"]["fusex"]["median"], 60 / 35)
        self.assertTrue(r["vs_peer"]["fusex"]["ok"])
        self.assertAlmostEqual(r["vs_peer"]["fusex-pt-off"]["median"], 40 / 35)
        self.assertFalse(r["vs_peer"]["fusex-pt-off"]["ok"])

    def test_failed_peer_runs_do_not_count(self):
        r = self.rows["write-128k-qd16"]
        self.assertEqual((r["best_peer"], r["best_peer_iops"]), ("qsd", 30))
        self.assertAlmostEqual(r["vs_peer"]["fusex"]["median"], 50 / 30)

    def test_native_goal_only_on_its_rows(self):
        self.assertEqual(self.rows["randread-4k-qd64"]["vs_native"]["min"], 0.50)
        self.assertTrue(self.rows["randread-4k-qd64"]["vs_native"]["ok"])
        self.assertEqual(self.rows["write-128k-qd16"]["vs_native"]["min"], 0.62)
        self.assertFalse(self.rows["write-128k-qd16"]["vs_native"]["ok"])
        res = synthetic()
        res["peer_goals"]["vs_native"] = {}
        row = peer_goal_rows(res, IMAGE)[0]
        self.assertEqual((row["vs_native"]["median"], row["vs_native"]["ok"]), (0.6, None))

    def test_transport_balance(self):
        self.assertEqual(balance_ratios({1: 50, 2: 40}, {1: 40, 2: 50, 3: 9}), [0.8, 0.8])
        b = self.rows["randread-4k-qd64"]["balance"]
        leg = b["fusex-legacy/fusex-uring"]
        self.assertAlmostEqual(leg["median"], 50 / 52)  # 0.962, 0.980, 0.960
        self.assertTrue(leg["ok"])
        self.assertEqual(leg["faster"], "fusex-uring")
        off = b["fusex-legacy-pt-off/fusex-uring-pt-off"]
        self.assertAlmostEqual(off["median"], 0.75)
        self.assertFalse(off["ok"])
        missing = self.rows["write-128k-qd16"]["balance"]["fusex-legacy/fusex-uring"]
        self.assertEqual((missing["median"], missing["ok"]), (None, None))

    def test_table(self):
        text = "\n".join(peer_goals_table(self.res, IMAGE))
        # row 1: 3 of 5 (fusex/peer, native, legacy/uring met); row 2: 2 of 3 (native missed)
        self.assertIn("**Goals**: 5 of 8 met", text)
        line = next(l for l in text.splitlines() if l.startswith("| `randread-4k-qd64` |"))
        cells = [c.strip() for c in line.split("|")[1:-1]]
        self.assertEqual(cells[1:4], ["60", "40", "35 (passthrough_hp)"])
        self.assertEqual(cells[4], "1.71 \u2713 (\u2265 1.30)")
        self.assertEqual(cells[5], "1.14 \u2717 (\u2265 1.30)")
        self.assertEqual(cells[6], "0.60 \u2713 (\u2265 0.50)")
        self.assertEqual(cells[7], "0.96 \u2713 (\u2265 0.95), fusex-uring faster")
        self.assertEqual(cells[8], "0.75 \u2717 (\u2265 0.95), fusex-uring-pt-off faster")
        line = next(l for l in text.splitlines() if l.startswith("| `write-128k-qd16` |"))
        self.assertIn("- (\u2265 0.95)", line)

    def test_printed_with_the_summary_and_cpu(self):
        text = summary_tables({"matrices": [self.res]})
        self.assertIn("**Goals**: 5 of 8 met", text)
        self.assertIn("**Server CPU per I/O**", text)
        self.assertIn("| workload | fusex | fusex-legacy |", text)
        # the ratio table keeps to each target vs native (45 pairs would not be readable)
        ratios = text.split("**Ratios to native**", 1)[1].split("**Server CPU", 1)[0]
        self.assertIn("| workload | fusex/native | fusex-legacy/native |", ratios)
        self.assertNotIn("fusex/qsd", ratios)

    def test_no_table_without_peer_goals(self):
        res = synthetic()
        del res["peer_goals"]
        self.assertEqual(peer_goals_table(res, IMAGE), [])


if __name__ == "__main__":
    unittest.main()
