"""fio command building and JSON parsing."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
sys.path.insert(0, os.path.dirname(HERE))  # bench/, for fusexbench

import json
import unittest

from fusexbench.fio import (FioWorkload, extract_json, fio_command, format_size, parse_direction,
                            parse_fio_json, parse_size)


def load(name):
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
        return f.read()


class ParseTest(unittest.TestCase):
    def test_group_reported_randrw(self):
        m = parse_fio_json(load("fio-randrw-2jobs.json"))
        self.assertEqual(m["fio_version"], "fio-3.33")
        raw = json.loads(load("fio-randrw-2jobs.json"))["jobs"][0]
        self.assertAlmostEqual(m["read"]["iops"], raw["read"]["iops"])
        self.assertAlmostEqual(m["write"]["iops"], raw["write"]["iops"])
        self.assertAlmostEqual(m["iops"], raw["read"]["iops"] + raw["write"]["iops"])
        self.assertAlmostEqual(m["read"]["bw_mib"], raw["read"]["bw_bytes"] / 1048576)
        self.assertAlmostEqual(m["read"]["lat_mean_us"], raw["read"]["lat_ns"]["mean"] / 1000)
        self.assertAlmostEqual(m["read"]["lat_p99_us"], raw["read"]["lat_ns"]["percentile"]["99.000000"] / 1000)
        self.assertEqual(m["read"]["p99_of"], "lat")
        self.assertEqual(m["ios"], raw["read"]["total_ios"] + raw["write"]["total_ios"])
        self.assertEqual(m["error"], 0)

    def test_warning_preamble_and_idle_direction(self):
        data = json.loads(load("fio-randrw-2jobs.json"))
        job = data["jobs"][0]
        job["write"] = {k: 0 for k in ("iops", "bw", "bw_bytes", "total_ios", "io_bytes", "runtime")}
        text = "fio: some warning about the file\n" + json.dumps(data)
        m = parse_fio_json(text)
        self.assertIsNone(m["write"])
        self.assertAlmostEqual(m["iops"], m["read"]["iops"])

    def test_clat_fallback_without_lat_percentiles(self):
        d = {"iops": 10.0, "bw_bytes": 40960, "total_ios": 10, "io_bytes": 40960, "runtime": 1000,
             "lat_ns": {"mean": 5000.0, "N": 10},
             "clat_ns": {"mean": 4000.0, "N": 10, "percentile": {"99.000000": 9000, "50.000000": 4000}}}
        p = parse_direction(d)
        self.assertEqual(p["p99_of"], "clat")
        self.assertAlmostEqual(p["lat_p99_us"], 9.0)
        self.assertAlmostEqual(p["lat_mean_us"], 5.0)

    def test_several_jobs_are_summed(self):
        data = json.loads(load("fio-randrw-2jobs.json"))
        data["jobs"].append(json.loads(json.dumps(data["jobs"][0])))
        one = parse_fio_json(load("fio-randrw-2jobs.json"))
        two = parse_fio_json(data)
        self.assertAlmostEqual(two["read"]["iops"], 2 * one["read"]["iops"])
        self.assertAlmostEqual(two["read"]["lat_mean_us"], one["read"]["lat_mean_us"])

    def test_no_json(self):
        with self.assertRaises(ValueError):
            extract_json("fio: error\n")
        with self.assertRaises(ValueError):
            parse_fio_json({"jobs": []})


class CommandTest(unittest.TestCase):
    def test_command_line(self):
        w = FioWorkload("randrw70-4k-qd64-4j", "randrw", "4k", 64, numjobs=4, rwmixread=70)
        cmd = fio_command(w, "/mnt/x", 1 << 30, 5, 1, output="/tmp/o.json")
        self.assertEqual(cmd[:3], ["fio", "--name=randrw70-4k-qd64-4j", "--filename=/mnt/x"])
        for opt in ("--rw=randrw", "--bs=4k", "--ioengine=io_uring", "--iodepth=64", "--numjobs=4",
                    "--rwmixread=70", "--size=1073741824", "--time_based", "--runtime=5s",
                    "--ramp_time=1s", "--direct=1", "--group_reporting", "--randrepeat=0",
                    "--output-format=json", "--output=/tmp/o.json"):
            self.assertIn(opt, cmd)

    def test_zero_ramp_and_fractional_runtime(self):
        w = FioWorkload("r", "randread", "4k", 1, ioengine="psync")
        cmd = fio_command(w, "/f", 4096, 0.5, 0)
        self.assertIn("--runtime=500ms", cmd)
        self.assertFalse(any(c.startswith("--ramp_time") for c in cmd))
        self.assertFalse(any(c.startswith("--rwmixread") for c in cmd))

    def test_series_key(self):
        a = FioWorkload("a", "randread", "4k", 1)
        b = FioWorkload("b", "randread", "4k", 64)
        c = FioWorkload("c", "randread", "4k", 64, numjobs=4)
        self.assertEqual(a.series_key("iodepth"), b.series_key("iodepth"))
        self.assertNotEqual(a.series_key("numjobs"), b.series_key("numjobs"))
        self.assertEqual(b.series_key("numjobs"), c.series_key("numjobs"))


class SizeTest(unittest.TestCase):
    def test_sizes(self):
        self.assertEqual(parse_size("1G"), 1 << 30)
        self.assertEqual(parse_size("4k"), 4096)
        self.assertEqual(parse_size("500M"), 500 << 20)
        self.assertEqual(parse_size("4096"), 4096)
        self.assertEqual(parse_size(7), 7)
        self.assertEqual(format_size(1 << 30), "1G")
        self.assertEqual(format_size(1000 << 20), "1000M")
        self.assertEqual(format_size(1000), "1000")
        with self.assertRaises(ValueError):
            parse_size("lots")


if __name__ == "__main__":
    unittest.main()
