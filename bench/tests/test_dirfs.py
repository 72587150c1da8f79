"""Issue #27's matrices: directory exports (dirfs, metadata), their targets and goals (no mounts)."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/, for fusexbench

import tempfile
import unittest

from fusexbench import matrices, metadata, runner
from fusexbench.images import Image, prepare_image, remove_image
from fusexbench.metadata import MetaWorkload
from fusexbench.report import goals_table, metadata_tables, render_report, summary_tables
from fusexbench.runner import Options, plan
from fusexbench.stats import primary_metric, summarize_matrix
from fusexbench.targets import (Tools, bindfs_command, catalogue, fusex_dir_command, parse_define,
                                passthrough_hp_command, source_dir, unavailable_reason)

DIR_HELP = "  --writable\n  --passthrough <MODE>\n  --cache <MODE>\n"
TOOLS = Tools(fusex="/bin/fusex", fusex_help=DIR_HELP, passthrough_hp="/p/passthrough_hp",
              bindfs="/usr/bin/bindfs", fusermount="/bin/fusermount3", passthrough_hp_help="  --nocache\n")
TOOLS_PT = Tools(fusex="/bin/fusex", fusex_help=DIR_HELP, passthrough_hp="/p/passthrough_hp",
                 bindfs="/usr/bin/bindfs", passthrough_hp_help="  --nocache\n  --nopassthrough\n")
DISK = Image("disk", 1 << 20, "/var/tmp/fb/image-1M.raw", fs="ext4")
TREE = Image("tree", 0, "/var/tmp/fb/tree", fs="ext4")


class MatrixTest(unittest.TestCase):
    def test_dirfs_is_seed_004_cold_on_directories(self):
        m = matrices.get("dirfs")
        self.assertEqual(m.kind, "fileaccess")
        self.assertEqual(m.seed, "004_7b719478e50ca2e8.txt")
        self.assertEqual(len(m.workloads), 3 * 2 * 3)
        self.assertEqual({w.size for w in m.workloads}, {1 << 20, 500 << 20, 1000 << 20})
        self.assertEqual({w.bufsize for w in m.workloads}, {4096, 128 << 10, 256 << 10})
        self.assertEqual({w.mode for w in m.workloads}, {"seq", "rand"})
        self.assertEqual({w.cache for w in m.workloads}, {"cold"})
        self.assertEqual(m.image_sizes(1 << 30), [1 << 20, 500 << 20, 1000 << 20])
        self.assertFalse(m.backend_direct)
        self.assertEqual(m.fusex_variants, ("fusex-dir", "fusex-dir-pt-on", "fusex-dir-pt-off"))
        self.assertEqual(m.default_targets,
                         ("native", "fusex", "passthrough_hp-dir", "passthrough_hp-dir-pt", "bindfs"))
        goals = {(g["a"], g["b"]): g["min"] for g in m.goals}
        self.assertEqual(goals, {("fusex-dir-pt-on", "fusex-dir-pt-off"): 1.0, ("fusex-dir", "native"): 0.9,
                                 ("fusex-dir-pt-on", "native"): 0.9})

    def test_metadata_rows_in_order(self):
        m = matrices.get("metadata")
        self.assertEqual(m.kind, "metadata")
        self.assertEqual([w.op for w in m.workloads],
                         ["create", "stat", "readdir", "unlink", "untar", "find", "du", "git-status"])
        self.assertEqual(m.images, ("tree",))
        self.assertEqual(m.image_sizes(1 << 30), [0])
        goals = {(g["a"], g["b"]): g["min"] for g in m.goals}
        self.assertEqual(goals[("fusex-dir", "bindfs")], 2.0)
        self.assertEqual(goals[("fusex-dir", "passthrough_hp-dir")], 1.3)
        self.assertEqual(primary_metric("metadata"), "ops_s")

    def test_all_includes_them_and_json(self):
        names = [m.name for m in matrices.resolve("all")]
        self.assertIn("dirfs", names)
        self.assertIn("metadata", names)
        self.assertEqual(matrices.get("metadata").to_json()["kind"], "metadata")

    def test_plan_expands_fusex_and_skips_missing_peers(self):
        opts = Options(catalogue=catalogue(), images=["tree"])
        specs, notes, wls = plan(matrices.get("metadata"), opts, TOOLS)
        self.assertEqual([s.name for s in specs],
                         ["native", "fusex-dir", "fusex-dir-pt-on", "fusex-dir-pt-off", "passthrough_hp-dir",
                          "bindfs"])
        self.assertTrue(any("passthrough_hp-dir-pt" in n and "no passthrough" in n for n in notes), notes)
        self.assertEqual(len(wls), 8)
        # A fusex without directory exports: its directory targets are skipped, not failed.
        old = Tools(fusex="/bin/fusex", fusex_help="  --writable\n  --passthrough <MODE>\n", bindfs=None)
        specs, notes, _ = plan(matrices.get("dirfs"), opts, old)
        self.assertEqual([s.name for s in specs], ["native"])
        self.assertTrue(any("no --cache" in n for n in notes), notes)
        self.assertTrue(any("bindfs not installed" in n for n in notes), notes)

    def test_estimates(self):
        m = matrices.get("metadata")
        self.assertEqual(matrices.estimate_seconds(m, 10, 5, 1, None, 1.0), 10 * matrices.META_JOB_S)
        self.assertLess(Options(meta_files=1000, tree_files=500).meta_scale(), 0.05)


class TargetTest(unittest.TestCase):
    def setUp(self):
        self.cat = catalogue(ncpu=2)

    def test_source_dir(self):
        self.assertEqual(source_dir(DISK), "/var/tmp/fb")
        self.assertEqual(source_dir(TREE), "/var/tmp/fb/tree")

    def test_fusex_dir(self):
        self.assertEqual(fusex_dir_command(TOOLS, self.cat["fusex-dir"], TREE, "/w/export.d"),
                         ["/bin/fusex", "mount", "--writable", "/var/tmp/fb/tree", "/w/export.d"])
        self.assertEqual(fusex_dir_command(TOOLS, self.cat["fusex-dir-pt-off"], DISK, "/m"),
                         ["/bin/fusex", "mount", "--writable", "--passthrough", "off", "/var/tmp/fb", "/m"])
        self.assertEqual(fusex_dir_command(TOOLS, self.cat["fusex-dir-pt-on"], DISK, "/m")[3:5],
                         ["--passthrough", "on"])

    def test_defined_fusex_dir(self):
        # --define NAME=fusex-dir:ARGS is a directory export with those options.
        spec = parse_define("fusex-dir-spin0=fusex-dir:--spin-us 0")
        self.assertIsNone(unavailable_reason(spec, TREE, Tools(fusex="/bin/fusex", fusex_help=DIR_HELP + "  --spin-us\n")))
        self.assertIn("--spin-us", unavailable_reason(spec, TREE, TOOLS))
        self.assertEqual(fusex_dir_command(TOOLS, spec, TREE, "/m"),
                         ["/bin/fusex", "mount", "--writable", "--spin-us", "0", "/var/tmp/fb/tree", "/m"])

    def test_passthrough_hp_dir(self):
        # libfuse before 3.17: no passthrough, so nothing to turn off.
        self.assertEqual(passthrough_hp_command(TOOLS, self.cat["passthrough_hp-dir"], TREE, "/m"),
                         ["/p/passthrough_hp", "--foreground", "/var/tmp/fb/tree", "/m"])
        # A passthrough_hp with passthrough: --nopassthrough for the target without it.
        self.assertEqual(passthrough_hp_command(TOOLS_PT, self.cat["passthrough_hp-dir"], TREE, "/m"),
                         ["/p/passthrough_hp", "--foreground", "--nopassthrough", "/var/tmp/fb/tree", "/m"])
        self.assertEqual(passthrough_hp_command(TOOLS_PT, self.cat["passthrough_hp-dir-pt"], TREE, "/m"),
                         ["/p/passthrough_hp", "--foreground", "/var/tmp/fb/tree", "/m"])
        # The image target keeps its own command line.
        self.assertEqual(passthrough_hp_command(TOOLS, self.cat["passthrough_hp"], DISK, "/m"),
                         ["/p/passthrough_hp", "--foreground", "--nocache", "/var/tmp/fb", "/m"])

    def test_bindfs(self):
        self.assertEqual(bindfs_command(TOOLS, self.cat["bindfs"], TREE, "/m"),
                         ["/usr/bin/bindfs", "-f", "--no-allow-other", "/var/tmp/fb/tree", "/m"])

    def test_availability(self):
        self.assertIsNone(unavailable_reason(self.cat["fusex-dir"], TREE, TOOLS))
        self.assertIsNone(unavailable_reason(self.cat["native"], TREE, TOOLS))
        self.assertIsNone(unavailable_reason(self.cat["passthrough_hp-dir-pt"], TREE, TOOLS_PT))
        self.assertIn("no passthrough", unavailable_reason(self.cat["passthrough_hp-dir-pt"], TREE, TOOLS))
        # Image targets have nothing to export from a bare directory.
        self.assertIn("not a directory", unavailable_reason(self.cat["fusex"], TREE, TOOLS))
        self.assertIn("not a directory", unavailable_reason(self.cat["passthrough_hp"], TREE, TOOLS))
        self.assertIn("need a source directory",
                      unavailable_reason(self.cat["bindfs"], Image("null", 1 << 30), TOOLS))


class MetadataOpsTest(unittest.TestCase):
    def test_tree_shape(self):
        self.assertEqual(metadata.tree_shape(100_000), (100, 1000))
        self.assertEqual(metadata.tree_shape(500), (1, 500))
        self.assertEqual(metadata.tree_shape(2500), (2, 1000))

    def test_commands(self):
        mk = lambda op: metadata.commands(MetaWorkload(op, op), "/m/t", 100_000, "/b/metaops", "/b/src.tar")
        self.assertEqual(mk("create"), [["rm", "-rf", "/m/t/files"],
                                        ["/b/metaops", "create", "/m/t/files", "100", "1000", "100"]])
        self.assertEqual(mk("unlink"), [["/b/metaops", "unlink", "/m/t/files", "100", "1000", "100"]])
        self.assertEqual(mk("untar"), [["rm", "-rf", "/m/t/src"], ["tar", "-xmf", "/b/src.tar", "-C", "/m/t"]])
        self.assertEqual(mk("find"), [["find", "/m/t/src", "-type", "f"]])
        self.assertEqual(mk("du"), [["du", "-s", "/m/t/src"]])
        git = mk("git-status")
        self.assertEqual(len(git), 2)  # one untimed index refresh, then the timed run
        self.assertEqual(git[0], git[1])
        self.assertEqual(git[1][-4:], ["-C", "/m/t/src", "status", "--porcelain"])

    def test_parse(self):
        m = metadata.parse_output(MetaWorkload("stat", "stat"), '{"op":"stat","ops":1000,"ns":2000000}\n', 5, 0)
        self.assertEqual((m["ops"], m["time_ms"]), (1000, 2.0))
        self.assertAlmostEqual(m["ops_s"], 500_000.0)
        m = metadata.parse_output(MetaWorkload("find", "find"), "a\nb\nc\n", 3_000_000_000, 99)
        self.assertEqual(m["ops"], 3)
        self.assertAlmostEqual(m["ops_s"], 1.0)
        m = metadata.parse_output(MetaWorkload("du", "du"), "123\t/x\n", 1_000_000_000, 99)
        self.assertEqual(m["ops"], 99)
        with self.assertRaises(ValueError):
            metadata.parse_output(MetaWorkload("stat", "stat"), "garbage", 1, 0)

    def test_synthetic_tree_is_deterministic(self):
        def snapshot(root):
            out = []
            for d, dirs, files in os.walk(root):
                dirs.sort()
                for f in sorted(files):
                    with open(os.path.join(d, f), "rb") as fh:
                        out.append((os.path.relpath(os.path.join(d, f), root), fh.read()))
            return out

        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
            self.assertEqual(metadata.synthetic_tree(os.path.join(a, "src"), 300), 300)
            self.assertEqual(metadata.synthetic_tree(os.path.join(b, "src"), 300), 300)
            sa, sb = snapshot(os.path.join(a, "src")), snapshot(os.path.join(b, "src"))
            self.assertEqual(len(sa), 300)
            self.assertEqual(sa, sb)
            sizes = sorted(len(c) for _, c in sa)
            self.assertGreaterEqual(sizes[0], 64)
            self.assertLess(sizes[-1], 32768)
            self.assertTrue(any("/" in p for p, _ in sa))  # nested directories

    def test_tree_image(self):
        with tempfile.TemporaryDirectory() as d:
            img = prepare_image("tree", 0, os.path.join(d, "fusexbench-x"))
            self.assertEqual(img.label, "tree")
            self.assertTrue(os.path.isdir(img.path))
            with open(os.path.join(img.path, "leftover"), "w", encoding="ascii") as f:
                f.write("x")
            remove_image(img)
            self.assertFalse(os.path.exists(img.path))

    def test_applies(self):
        w = MetaWorkload("stat", "stat")
        self.assertTrue(runner._applies(w, TREE))
        self.assertFalse(runner._applies(w, DISK))


def _run(target, workload, rnd, value, kind):
    metrics = ({"ops_s": value, "time_ms": 1000.0 / value, "ops": 1} if kind == "metadata"
               else {"mib_s": value, "time_ms": 1000.0 / value, "read_calls": 256})
    return {"target": target, "workload": workload, "round": rnd, "image": "tree" if kind == "metadata" else "disk-1M",
            "ok": True, "metrics": metrics, "command": ["x"]}


def _result(kind, name, figures):
    """A stored matrix result: ``figures`` = {workload: {target: [value per round]}}."""
    m = matrices.get(name)
    targets = sorted({t for f in figures.values() for t in f})
    runs = [_run(t, wl, i + 1, v, kind) for wl, f in figures.items() for t, vals in f.items()
            for i, v in enumerate(vals)]
    return {**m.to_json(), "targets": [{"name": t, "started": True} for t in targets],
            "workloads": [{"name": wl, "kind": kind, "description": wl} for wl in figures],
            "images": [{"label": runs[0]["image"], "kind": "tree" if kind == "metadata" else "disk"}],
            "runs": runs, "mounts": [], "notes": [], "skipped": []}


class GoalTest(unittest.TestCase):
    def test_metadata_goals(self):
        res = _result("metadata", "metadata", {
            # fusex 2.5x bindfs and 1.5x passthrough_hp: both met
            "create": {"fusex-dir": [250, 250, 250], "bindfs": [100, 100, 100],
                       "passthrough_hp-dir": [166, 166, 166], "native": [1000, 1000, 1000]},
            # fusex 1.5x bindfs (missed), 1.2x passthrough_hp (missed)
            "stat": {"fusex-dir": [150, 150, 150], "bindfs": [100, 100, 100],
                     "passthrough_hp-dir": [125, 125, 125], "native": [1000, 1000, 1000]},
        })
        rows = summarize_matrix(res)
        lines = "\n".join(goals_table(res, rows, "tree")).splitlines()
        self.assertTrue(lines[0].startswith("**Goals**: 2 of 4 met"), lines[0])
        text = "\n".join(lines)
        self.assertIn("operations/s", lines[0])
        self.assertIn("| `create` |", text)
        create = next(l for l in lines if l.startswith("| `create`"))
        self.assertEqual(create.count("\u2713"), 2)
        stat = next(l for l in lines if l.startswith("| `stat`"))
        self.assertEqual(stat.count("\u2717"), 2)
        self.assertIn("2.50 \u2713 (\u2265 2.00)", create)
        # The goal naming passthrough_hp-dir-pt is left out when that target did not run.
        self.assertNotIn("passthrough_hp-dir-pt", text)
        body = metadata_tables(res, rows, "tree")
        self.assertIn("**Operations per second**", body)
        report = render_report({"matrices": [res], "machine": {}, "tools": {}, "params": {}})
        self.assertIn("## metadata: Directory exports: metadata", report)
        self.assertIn("**Goals**: 2 of 4 met", summary_tables({"matrices": [res]}))

    def test_dirfs_goals_on_mib_s(self):
        res = _result("fileaccess", "dirfs", {
            "1M-seq-4k": {"native": [100, 100, 100], "fusex-dir": [95, 95, 95],
                          "fusex-dir-pt-on": [99, 99, 99], "fusex-dir-pt-off": [80, 80, 80]},
            "1M-rand-4k": {"native": [100, 100, 100], "fusex-dir": [85, 85, 85],
                           "fusex-dir-pt-on": [79, 79, 79], "fusex-dir-pt-off": [80, 80, 80]},
        })
        rows = summarize_matrix(res)
        lines = "\n".join(goals_table(res, rows, "disk-1M")).splitlines()
        # seq: 3 of 3; rand: pt-on/pt-off 0.99 (missed), fusex-dir/native 0.85 (missed), pt-on/native 0.79 (missed)
        self.assertTrue(lines[0].startswith("**Goals**: 3 of 6 met"), lines[0])
        self.assertIn("MiB/s", lines[2])
        rand = next(l for l in lines if l.startswith("| `1M-rand-4k`"))
        self.assertIn("0.99 \u2717 (\u2265 1.00)", rand)


if __name__ == "__main__":
    unittest.main()


class MetadataPrerequisiteTest(unittest.TestCase):
    def test_rows_over_a_failed_tree_are_not_run(self):
        from fusexbench import metadata as meta
        self.assertIsNone(meta.skipped_after("stat", {}))
        self.assertIsNone(meta.skipped_after("create", {"untar": "x"}))
        why = meta.skipped_after("find", {"untar": "untar exit 2: Too many open files"})
        self.assertIn("untar", why)
        self.assertIn("Too many open files", why)
        self.assertIsNotNone(meta.skipped_after("unlink", {"create": "x"}))
        self.assertIsNone(meta.skipped_after("du", {"create": "x"}))
        for op, pre in meta.PREREQUISITE.items():
            self.assertIn(op, meta.META_OPS + meta.TREE_OPS)
            self.assertIn(pre, meta.META_OPS + meta.TREE_OPS)
