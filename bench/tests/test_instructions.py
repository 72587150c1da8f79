"""bench/instructions.sh: callgrind totals, per-request arithmetic, command lines."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/, for fusexbench

import unittest

from fusexbench.instructions import (Case, Count, fio_command, fusex_command, parse_callgrind_total, per_request,
                                     render)

CALLGRIND = """# callgrind format
version: 1
creator: callgrind-3.19.0
pid: 29538
cmd:  target/release/fusex mount --writable /dev/shm/i /tmp/m
part: 1

desc: I1 cache:
positions: line
events: Ir
summary: 43278963

ob=(1) /usr/lib/x86_64-linux-gnu/libc.so.6
fl=(1) ???
fn=(1) 0x0000000000027200
0 17
totals: 43278963
"""


class CallgrindTest(unittest.TestCase):
    def test_total(self):
        self.assertEqual(parse_callgrind_total(CALLGRIND), 43278963)

    def test_totals_line_alone_and_event_order(self):
        self.assertEqual(parse_callgrind_total("events: Ir\ntotals: 12\n"), 12)
        self.assertEqual(parse_callgrind_total("events: Dr Ir Dw\nsummary: 5 7 9\n"), 7)

    def test_errors(self):
        with self.assertRaises(ValueError):
            parse_callgrind_total("events: Ir\n")
        with self.assertRaises(ValueError):
            parse_callgrind_total("events: Dr\nsummary: 5\n")

    def test_per_request_subtracts_the_baseline(self):
        base = Count("legacy", "baseline", 10, 36_000_000, 14, 10, 0)
        run = Count("legacy", "4k randread", 20000, 106_000_000, 20004, 20000, 0)
        self.assertAlmostEqual(per_request(run, base), 70_000_000 / 19990)
        self.assertIsNone(per_request(base, base))
        table = render([{"transport": "legacy", "case": "4k randread", "fio_ios": 20000, "requests": 20004,
                         "instructions": 106_000_000, "per_request": 3501.75}])
        self.assertIn("| legacy | 4k randread | 20000 | 20004 | 106,000,000 | 3,502 |", table)


class CommandTest(unittest.TestCase):
    def test_fio_does_exactly_the_requests(self):
        cmd = fio_command("fio", "/m", Case("128k read", "read", "128k", 5000), 64 << 20)
        self.assertIn("--io_size=655360000", cmd)  # 5000 x 128 KiB, wrapping around the 64 MiB file
        self.assertIn("--direct=1", cmd)
        self.assertIn("--ioengine=psync", cmd)
        self.assertNotIn("--time_based", cmd)

    def test_fusex_under_callgrind(self):
        cmd = fusex_command("valgrind", "/f", "/i", "/m", "uring", "/o", "/s", ["--spin-us", "0"])
        self.assertEqual(cmd[:3], ["valgrind", "--tool=callgrind", "--callgrind-out-file=/o"])
        i = cmd.index("/f")
        self.assertEqual(cmd[i:], ["/f", "mount", "--writable", "--passthrough", "off", "--transport", "uring",
                                   "--queues", "1", "--stats-file", "/s", "--spin-us", "0", "/i", "/m"])


if __name__ == "__main__":
    unittest.main()
