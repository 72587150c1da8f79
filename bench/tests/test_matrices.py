"""Matrices follow the issue and the seeds; target expansion and skips."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
sys.path.insert(0, os.path.dirname(HERE))  # bench/, for fusexbench

import unittest

from fusexbench import matrices
from fusexbench.fileaccess import FileAccessWorkload
from fusexbench.targets import catalogue


class MatrixShapeTest(unittest.TestCase):
    def test_all_named(self):
        self.assertEqual(set(matrices.MATRICES),
                         {"quick", "coroutines", "multiqueue", "uring", "zerocopy", "passthrough",
                          "passthrough-fio", "qcow2", "formats", "nbd", "side-by-side", "dirfs", "metadata"})
        self.assertEqual(len(matrices.resolve("all")), 13)
        with self.assertRaises(KeyError):
            matrices.get("nope")

    def test_quick(self):
        m = matrices.get("quick")
        got = {(w.rw, w.bs, w.iodepth, w.numjobs, w.rwmixread) for w in m.workloads}
        self.assertEqual(got, {("randread", "4k", 1, 1, None), ("randread", "4k", 64, 1, None),
                               ("randwrite", "4k", 64, 1, None), ("randrw", "4k", 64, 4, 70),
                               ("read", "128k", 16, 1, None)})
        self.assertEqual(m.images, ("shm",))

    def test_coroutines(self):
        m = matrices.get("coroutines")
        self.assertEqual([(w.rw, w.bs, w.ioengine, w.iodepth, w.numjobs) for w in m.workloads],
                         [("randrw", "4k", "io_uring", 1, 1), ("randrw", "4k", "io_uring", 64, 1)])

    def test_multiqueue(self):
        m = matrices.get("multiqueue")
        self.assertEqual(len(m.workloads), 16)
        self.assertEqual({(w.ioengine, w.iodepth) for w in m.workloads}, {("libaio", 16), ("psync", 1)})
        self.assertEqual({w.numjobs for w in m.workloads}, {1, 4})
        self.assertEqual({w.rw for w in m.workloads}, {"read", "randread", "write", "randwrite"})
        self.assertEqual(m.images, ("shm", "null"))
        self.assertIn("fusex-qN", m.fusex_variants)

    def test_uring(self):
        m = matrices.get("uring")
        self.assertEqual({(w.numjobs, w.iodepth) for w in m.workloads}, {(1, 1), (1, 64), (4, 1), (4, 64)})
        self.assertTrue(all(w.rw == "randrw" and w.rwmixread == 70 for w in m.workloads))

    def test_zerocopy(self):
        m = matrices.get("zerocopy")
        self.assertEqual(len(m.workloads), 16)
        self.assertEqual({(w.iodepth, w.numjobs) for w in m.workloads}, {(1, 1), (64, 1), (16, 4), (64, 16)})
        self.assertEqual({w.bs for w in m.workloads}, {"4k", "128k"})

    def test_passthrough(self):
        m = matrices.get("passthrough")
        self.assertEqual(m.kind, "fileaccess")
        self.assertFalse(m.backend_direct)
        self.assertEqual(len(m.workloads), 3 * 2 * 2 * 3)
        self.assertTrue(all(isinstance(w, FileAccessWorkload) for w in m.workloads))
        self.assertEqual(m.image_sizes(1 << 30), [1 << 20, 500 << 20, 1000 << 20])
        self.assertEqual({w.bufsize for w in m.workloads}, {4096, 128 << 10, 256 << 10})

    def test_passthrough_fio_exports_are_growable(self):
        m = matrices.get("passthrough-fio")
        self.assertEqual(m.images, ("shm", "disk"))
        self.assertEqual(m.fusex_extra, ("--growable",))
        cat = catalogue(ncpu=2)
        s, note = matrices.with_extra(cat["fusex-pt-on"], m.fusex_extra, {"--passthrough", "--growable"})
        self.assertIsNone(note)
        self.assertEqual(s.args, ("--passthrough", "on", "--growable"))
        self.assertEqual({w.rw for w in m.workloads}, {"randread", "randwrite", "read", "write"})

    def test_side_by_side(self):
        m = matrices.get("side-by-side")
        self.assertEqual([(w.name, w.rw, w.bs, w.ioengine, w.iodepth, w.numjobs, w.rwmixread) for w in m.workloads], [
            ("randread-4k-qd1", "randread", "4k", "psync", 1, 1, None),
            ("randwrite-4k-qd1", "randwrite", "4k", "psync", 1, 1, None),
            ("randread-4k-qd64", "randread", "4k", "io_uring", 64, 1, None),
            ("randwrite-4k-qd64", "randwrite", "4k", "io_uring", 64, 1, None),
            ("randrw70-4k-qd64-4j", "randrw", "4k", "io_uring", 64, 4, 70),
            ("randread-4k-libaio-qd16-4j", "randread", "4k", "libaio", 16, 4, None),
            ("read-128k-qd16", "read", "128k", "io_uring", 16, 1, None),
            ("write-128k-qd16", "write", "128k", "io_uring", 16, 1, None),
        ])
        self.assertEqual(m.images, ("shm",))
        self.assertTrue(m.backend_direct)
        self.assertTrue(m.fuse_uring)  # the uring variants need enable_uring=Y
        self.assertEqual(m.fusex_extra, ())  # every variant keeps its own passthrough setting
        cat = catalogue(ncpu=2)
        specs, notes = matrices.expand_targets(list(m.default_targets), m, cat, lambda s: None)
        self.assertEqual([s.name for s in specs],
                         ["native", "fusex", "fusex-legacy", "fusex-uring", "fusex-pt-off", "fusex-legacy-pt-off",
                          "fusex-uring-pt-off", "qsd", "nbdfuse", "passthrough_hp"])
        self.assertEqual(notes, [])
        self.assertEqual(cat["fusex"].args, ())
        self.assertEqual(cat["fusex-legacy-pt-off"].args, ("--transport", "legacy", "--passthrough", "off"))
        self.assertEqual(cat["fusex-uring-pt-off"].args, ("--transport", "uring", "--passthrough", "off"))
        self.assertEqual(cat["fusex-uring-pt-off"].requires, ("--transport", "--passthrough"))
        pg = m.to_json()["peer_goals"]
        self.assertEqual(pg["peers"], ["qsd", "nbdfuse", "passthrough_hp"])
        self.assertEqual(pg["fusex"], ["fusex", "fusex-pt-off"])
        self.assertEqual(pg["vs_peer_min"], 1.3)
        self.assertEqual(pg["vs_native"], {"randread-4k-qd64": 0.50, "randwrite-4k-qd64": 0.48,
                                           "read-128k-qd16": 0.78, "write-128k-qd16": 0.62})
        self.assertEqual(pg["balance"], [["fusex-legacy", "fusex-uring"], ["fusex-legacy-pt-off", "fusex-uring-pt-off"]])
        self.assertEqual(pg["balance_min"], 0.95)
        names = {w.name for w in m.workloads}
        self.assertLessEqual(set(pg["vs_native"]), names)

    def test_unique_names(self):
        for m in matrices.resolve("all"):
            names = [w.name for w in m.workloads]
            self.assertEqual(len(names), len(set(names)), m.name)


class SelectTest(unittest.TestCase):
    def test_select(self):
        m = matrices.get("quick")
        self.assertEqual([w.name for w in matrices.select_workloads(m, "randread-4k-qd1")], ["randread-4k-qd1"])
        self.assertEqual(len(matrices.select_workloads(m, "randread")), 2)
        self.assertEqual(len(matrices.select_workloads(m, None)), 5)


class ExpandTest(unittest.TestCase):
    def setUp(self):
        self.cat = catalogue(ncpu=2)

    def test_fusex_expands_to_variants_when_supported(self):
        m = matrices.get("multiqueue")
        specs, notes = matrices.expand_targets(["native", "fusex", "qsd"], m, self.cat, lambda s: None)
        self.assertEqual([s.name for s in specs], ["native", "fusex-q1", "fusex-qN", "qsd"])
        self.assertEqual(notes, [])
        self.assertEqual(self.cat["fusex-qN"].args, ("--queues", "2"))

    def test_missing_feature_falls_back_and_notes(self):
        m = matrices.get("uring")

        def why_not(spec):
            return "no --transport" if "--transport" in spec.requires else None

        specs, notes = matrices.expand_targets(["native", "fusex"], m, self.cat, why_not)
        self.assertEqual([s.name for s in specs], ["native", "fusex"])
        self.assertIn("Measured fusex in place of fusex-legacy (unavailable).", notes)
        self.assertIn("Skipped fusex-legacy, fusex-uring: no --transport.", notes)

    def test_unavailable_peer_skipped(self):
        m = matrices.get("quick")
        specs, notes = matrices.expand_targets(["native", "nbdfuse"], m, self.cat,
                                               lambda s: "not installed" if s.kind == "nbdfuse" else None)
        self.assertEqual([s.name for s in specs], ["native"])
        self.assertEqual(notes, ["Skipped nbdfuse: not installed."])

    def test_unknown_target(self):
        with self.assertRaises(KeyError):
            matrices.expand_targets(["bogus"], matrices.get("quick"), self.cat, lambda s: None)


if __name__ == "__main__":
    unittest.main()


class ExtraArgsTest(unittest.TestCase):
    def test_transport_matrices_turn_passthrough_off(self):
        cat = catalogue(ncpu=2)
        flags = {"--queues", "--passthrough"}
        for name in ("coroutines", "multiqueue", "uring", "zerocopy"):
            self.assertEqual(matrices.get(name).fusex_extra, ("--passthrough", "off"), name)
        s, note = matrices.with_extra(cat["fusex-qN"], ("--passthrough", "off"), flags)
        self.assertEqual(s.args, ("--queues", "2", "--passthrough", "off"))
        self.assertIn("--passthrough", s.requires)
        self.assertIsNone(note)
        self.assertEqual(cat["fusex-qN"].args, ("--queues", "2"))  # catalogue untouched

    def test_existing_option_and_missing_flag(self):
        cat = catalogue(ncpu=2)
        s, note = matrices.with_extra(cat["fusex-pt-on"], ("--passthrough", "off"), {"--passthrough"})
        self.assertEqual(s.args, ("--passthrough", "on"))
        s, note = matrices.with_extra(cat["fusex"], ("--passthrough", "off"), set())
        self.assertEqual(s.args, ())
        self.assertIn("has no --passthrough", note)
        s, note = matrices.with_extra(cat["qsd"], ("--passthrough", "off"), {"--passthrough"})
        self.assertEqual(s.args, ())
