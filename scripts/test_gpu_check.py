#!/usr/bin/env python3
"""Tests of gpu_check.py's CPU-side parts (arguments, NCCL log parsing, result checks,
summary), with sample NCCL log lines and fake results; no torch or GPU needed.

Run: python3 scripts/test_gpu_check.py  (ends with a cargo-style "test result:" line
that scripts/test.sh counts)."""

import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_check as g  # noqa: E402

# Lines as NCCL 2.28 prints them with NCCL_DEBUG=INFO (host:pid:tid [dev] NCCL INFO ...).
PLUGIN_LOG = """\
h100:4242:4242 [0] NCCL INFO NCCL_NET_PLUGIN set by environment to /opt/librailover.so
h100:4242:4242 [0] NCCL INFO NET/Plugin: Loaded net plugin railover (v11)
h100:4242:4242 [0] NCCL INFO cudaDriverVersion 13000
h100:4242:4242 [0] NCCL INFO NCCL version 2.28.9+cuda13.0
h100:4242:4242 [0] NCCL INFO railover: 1 NIC(s): lo
h100:4242:4242 [0] NCCL INFO Using network railover
h100:4242:4250 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/railover/0
h100:4242:4250 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/railover/0
h100:4243:4251 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[0] [receive] via NET/railover/0
"""

SOCKET_LOG = """\
h100:4300:4300 [0] NCCL INFO NCCL version 2.28.9+cuda13.0
h100:4300:4300 [0] NCCL INFO NET/Socket : Using [0]lo:127.0.0.1<0>
h100:4300:4300 [0] NCCL INFO Using network Socket
h100:4300:4310 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Socket/0
"""

FELL_BACK_LOG = """\
h100:4242:4242 [0] NCCL INFO NET/Plugin: Could not find: /opt/librailover.so
h100:4242:4242 [0] NCCL INFO NCCL version 2.28.9+cuda13.0
h100:4242:4242 [0] NCCL INFO Using network Socket
h100:4242:4250 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Socket/0
"""

SHM_LOG = """\
h100:4242:4242 [0] NCCL INFO NET/Plugin: Loaded net plugin railover (v11)
h100:4242:4242 [0] NCCL INFO Using network railover
h100:4242:4250 [0] NCCL INFO Channel 00 : 0[0] -> 1[0] via P2P/IPC
"""


class Args(unittest.TestCase):
    def test_sizes_parse_with_binary_suffixes(self):
        self.assertEqual(g.parse_size("8"), 8)
        self.assertEqual(g.parse_size("4K"), 4096)
        self.assertEqual(g.parse_size("256M"), 256 << 20)
        self.assertEqual(g.parse_size("1g"), 1 << 30)
        with self.assertRaises(ValueError):
            g.parse_size("lots")

    def test_sweep_covers_8_bytes_to_256_mib_in_whole_floats_per_rank(self):
        s = g.sizes(8, 256 << 20)
        self.assertEqual((s[0], s[-1], len(s)), (8, 256 << 20, 26))
        self.assertTrue(all(x % (g.WORLD * g.ELEM) == 0 for x in s))
        self.assertEqual(g.sizes(8, 100), [8, 16, 32, 64, 96])

    def test_plugin_and_out_are_required_and_checked(self):
        with tempfile.NamedTemporaryFile(suffix=".so") as so:
            a = g.parse_args(["--plugin", so.name, "--out", "/tmp/x", "--max-bytes", "1M"])
            self.assertEqual((a.min_bytes, a.max_bytes), (8, 1 << 20))
            self.assertTrue(os.path.isabs(a.plugin))
        for bad in (["--out", "/tmp/x"], ["--plugin", "/nonexistent/librailover.so", "--out", "/tmp/x"]):
            with self.assertRaises(SystemExit), open(os.devnull, "w") as null:
                stderr, sys.stderr = sys.stderr, null
                try:
                    g.parse_args(bad)
                finally:
                    sys.stderr = stderr

    def test_rank_env_gives_distinct_hosts_and_forces_the_transport(self):
        base = {"PATH": "/bin", "NCCL_NET": "IB", "RAILOVER_LOG": "trace", "NCCL_NET_PLUGIN": "x"}
        e0 = g.rank_env(base, 0, "plugin", "/opt/librailover.so")
        e1 = g.rank_env(base, 1, "plugin", "/opt/librailover.so")
        self.assertNotEqual(e0["NCCL_HOSTID"], e1["NCCL_HOSTID"])
        self.assertEqual(e0["NCCL_NET"], "railover")
        self.assertEqual(e0["NCCL_NET_PLUGIN"], "/opt/librailover.so")
        self.assertEqual(e0["NCCL_DEBUG"], "INFO")
        self.assertNotIn("RAILOVER_LOG", e0)
        self.assertEqual(e0["PATH"], "/bin")
        s = g.rank_env(base, 0, "socket", "/opt/librailover.so")
        self.assertEqual((s["NCCL_NET"], s["NCCL_NET_PLUGIN"]), ("Socket", "none"))
        self.assertNotIn("RAILOVER_IFNAME", s)


class Log(unittest.TestCase):
    def test_plugin_log_shows_railover_loaded_and_carrying_every_channel(self):
        info = g.parse_nccl_log(PLUGIN_LOG)
        self.assertEqual(info["nccl_version"], "2.28.9+cuda13.0")
        self.assertEqual(info["loaded"], [{"name": "railover", "table": 11}])
        self.assertEqual(info["using"], ["railover"])
        self.assertEqual(info["channels"], {"railover": 3})
        self.assertEqual(g.check_log(info, "plugin"), [])

    def test_a_fallback_to_socket_is_caught(self):
        p = g.check_log(g.parse_nccl_log(FELL_BACK_LOG), "plugin")
        self.assertTrue(any("Loaded net plugin railover" in x for x in p), p)
        self.assertTrue(any("expected railover" in x for x in p), p)

    def test_channels_that_bypass_the_network_are_caught(self):
        p = g.check_log(g.parse_nccl_log(SHM_LOG), "plugin")
        self.assertTrue(any("did not talk over the network" in x for x in p), p)

    def test_socket_baseline_log(self):
        info = g.parse_nccl_log(SOCKET_LOG)
        self.assertEqual(g.check_log(info, "socket"), [])
        self.assertNotEqual(g.check_log(info, "plugin"), [])

    def test_an_empty_log_is_not_a_pass(self):
        self.assertGreaterEqual(len(g.check_log(g.parse_nccl_log(""), "plugin")), 3)


class Results(unittest.TestCase):
    def fake(self, kind, rank, n, corrupt=None):
        length = g.output_len(kind, g.WORLD, n)
        vals = [g.expected(kind, rank, g.WORLD, n, i) for i in range(length)]
        if corrupt is not None:
            vals[corrupt] += 1
        return [(i, vals[i]) for i in g.sample_indices(length)]

    def test_correct_outputs_pass_for_every_collective_and_rank(self):
        for kind in g.COLLECTIVES:
            for rank in range(g.WORLD):
                self.assertEqual(g.check_samples(kind, rank, g.WORLD, 1000, self.fake(kind, rank, 1000)), [])

    def test_expected_values_follow_the_collective(self):
        # all_reduce: both ranks' patterns summed.
        self.assertEqual(g.expected("all_reduce", 0, 2, 4, 3), g.pattern(0, 3) + g.pattern(1, 3))
        # all_gather: rank 1's block follows rank 0's.
        self.assertEqual(g.expected("all_gather", 0, 2, 4, 5), g.pattern(1, 1))
        # reduce_scatter: rank 1 owns the second half of the summed input.
        self.assertEqual(g.expected("reduce_scatter", 1, 2, 4, 0), g.pattern(0, 4) + g.pattern(1, 4))
        # sendrecv: each rank receives its peer's pattern.
        self.assertEqual(g.expected("sendrecv", 0, 2, 4, 2), g.pattern(1, 2))

    def test_a_wrong_element_or_a_swapped_block_is_reported(self):
        bad = g.check_samples("all_reduce", 0, 2, 1000, self.fake("all_reduce", 0, 1000, corrupt=0))
        self.assertEqual(len(bad), 1)
        self.assertIn("element 0", bad[0])
        # all_gather with the two blocks swapped
        n = 64
        swapped = [(i, g.pattern(1 - i // n, i % n)) for i in g.sample_indices(2 * n)]
        self.assertTrue(g.check_samples("all_gather", 0, 2, n, swapped))

    def test_bus_bandwidth_factors_match_nccl_tests(self):
        self.assertEqual(g.bandwidths("all_reduce", 1e9, 1.0, 2), (1.0, 1.0))
        self.assertEqual(g.bandwidths("all_gather", 1e9, 1.0, 2), (1.0, 0.5))
        self.assertEqual(g.bandwidths("sendrecv", 2e9, 1.0, 2), (2.0, 2.0))
        self.assertAlmostEqual(g.bus_factor("all_reduce", 8), 1.75)


class Summary(unittest.TestCase):
    def res(self, kind, size, busbw, ok=True):
        return {"collective": kind, "size": size, "busbw": busbw, "ok": ok}

    def test_rows_pair_the_transports_and_take_the_ratio(self):
        rows = g.summarize(
            [self.res("all_reduce", 8, 0.5), self.res("sendrecv", 1 << 20, 2.0)],
            [self.res("all_reduce", 8, 1.0)],
        )
        self.assertEqual(rows[0]["ratio"], 0.5)
        self.assertIsNone(rows[1]["socket_busbw"])
        text = g.table(rows)
        self.assertIn("1 MiB", text)
        self.assertIn("0.50", text)

    def test_verdict(self):
        good = {"problems": [], "results": [self.res("all_reduce", 8, 1.0)]}
        wrong = {"problems": [], "results": [self.res("all_reduce", 8, 1.0, ok=False)]}
        unused = {"problems": ["NCCL used ['Socket'], expected railover"], "results": good["results"]}
        self.assertEqual(g.verdict({"plugin": good, "socket": good}), 0)
        self.assertEqual(g.verdict({"plugin": wrong, "socket": good}), 1)
        self.assertEqual(g.verdict({"plugin": unused, "socket": good}), 1)
        self.assertEqual(g.verdict({"plugin": good, "socket": wrong}), 3)
        self.assertEqual(g.verdict({"plugin": {"problems": [], "results": []}, "socket": good}), 1)


if __name__ == "__main__":
    r = unittest.main(exit=False, verbosity=2).result
    failed = len(r.failures) + len(r.errors) + len(r.unexpectedSuccesses)
    skipped = len(r.skipped)
    passed = r.testsRun - failed - skipped
    print(f"test result: {'ok' if failed == 0 else 'FAILED'}. {passed} passed; {failed} failed; {skipped} ignored")
    sys.exit(1 if failed else 0)
