"""STORE and RETRIEVE round trips of small and mid-sized requests, this tree against another, side by side.

    PYTHONPATH=$PWD .venv/bin/python bench/request_latency.py --compare-tree /tmp/before \\
        [--cases "64x1,256x1,256x16,2048x4"] [--rounds 12] [--requests 10] [--pace-ms 5]

What a request costs apart from its copy: the hand-over from the server's request loop to a
copier thread and back, the reply's send, the client's wake-up. ``--compare-tree DIR`` starts a
second server from another checkout (``git archive`` of the commit before, say) with the same
flags; without it there is one server and no ratio. Each case ``KIBxN`` is a registration of
one-block chunks of KIB KiB (8 layers, CPU tensors) and requests of N chunks: a STORE of N new
keys, then a RETRIEVE of those keys into other blocks, each timed at the client
(``time.perf_counter`` around the call). The servers' requests are taken in turn, one each, the
order rotating, after a ``--pace-ms`` sleep (an engine's step between two requests); a round is
``--requests`` of each per case and server. Prints, per case and request, each server's median
round trip and the median over rounds of the per-round ratio this / compared, with its min-max.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _common import parse_args
from _server import BenchServer

from lmshm.transport.client import MPClient
from lmshm.wire import protocol

LAYERS = 8
BLOCKS = 64


class Side:
    """One server: a client and a registration per case."""

    def __init__(self, url: str, cases: list[tuple[int, int]]) -> None:
        self.client = MPClient(url, client_name="bench-request-latency", timeout_s=60)
        self.iids: dict[tuple[int, int], str] = {}
        self.kv = {}
        for kib, n in cases:
            per_layer = (kib << 10) // LAYERS // 2         # bytes of a block in one layer (float16)
            self.kv[(kib, n)] = {f"layer.{i}": torch.randn(BLOCKS, per_layer).half() for i in range(LAYERS)}
            self.iids[(kib, n)] = self.client.register_kv_caches(self.kv[(kib, n)], model_name="bench",
                                                                 world_size=1, rank=0)

    def store_retrieve(self, case: tuple[int, int]) -> tuple[float, float]:
        n = case[1]
        keys = [os.urandom(16) for _ in range(n)]
        t0 = time.perf_counter()
        r = self.client.store(self.iids[case], keys, list(range(n)), 1)
        t1 = time.perf_counter()
        if list(r.results) != [protocol.StoreResult.STORED] * n:
            raise RuntimeError(f"STORE results {list(r.results)}")
        self.client.retrieve(self.iids[case], keys, list(range(BLOCKS - n, BLOCKS)), 1)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    def close(self) -> None:
        self.client.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare-tree", default="", help="another checkout whose server runs beside this one's")
    ap.add_argument("--cases", default="64x1,256x1,256x16,2048x4",
                    help="KiB per chunk x chunks per request, comma-separated (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--requests", type=int, default=10, help="STOREs (and RETRIEVEs) per case, server and round")
    ap.add_argument("--pace-ms", type=float, default=5.0, help="sleep before each request pair (default 5)")
    ap.add_argument("--capacity", default="1GiB")
    args = parse_args(ap, smoke={"cases": "64x1,256x4", "rounds": 1, "requests": 2, "pace_ms": 0.0, "capacity": "64MiB"})
    try:
        cases = [(int(kib), int(n)) for kib, n in (c.strip().split("x") for c in args.cases.split(","))]
    except ValueError:
        raise SystemExit(f"--cases is KIBxN[,KIBxN...], e.g. 64x1,256x16: {args.cases!r}") from None
    for kib, n in cases:
        if kib <= 0 or kib % 64 or not 0 < n <= BLOCKS // 2:
            raise SystemExit(f"a case is KIBxN with KIB a multiple of 64 and 1 <= N <= {BLOCKS // 2}: {kib}x{n}")
    trees = [("this", None)] + ([("compared", args.compare_tree)] if args.compare_tree else [])
    servers = [BenchServer("--capacity", args.capacity, quiet=True, cwd=tree) for _, tree in trees]
    load0 = os.getloadavg()[0]
    times = {(name, case, op): [] for name, _ in trees for case in cases for op in ("STORE", "RETRIEVE")}
    ratios = {(case, op): [] for case in cases for op in ("STORE", "RETRIEVE")}
    try:
        sides = [Side(s.url, cases) for s in servers]
        for case in cases:                      # warm-up: connections, first-touch pages
            for side in sides:
                for _ in range(3):
                    side.store_retrieve(case)
        for rnd in range(args.rounds):
            order = list(range(len(sides)))
            got = {(i, case, op): [] for i in order for case in cases for op in ("STORE", "RETRIEVE")}
            for r in range(args.requests):
                for case in cases[rnd % len(cases):] + cases[:rnd % len(cases)]:
                    for i in order[(r + rnd) % len(order):] + order[:(r + rnd) % len(order)]:
                        time.sleep(args.pace_ms / 1e3)
                        st, rt = sides[i].store_retrieve(case)
                        got[(i, case, "STORE")].append(st)
                        got[(i, case, "RETRIEVE")].append(rt)
            for (i, case, op), v in got.items():
                times[(trees[i][0], case, op)] += v
            if len(sides) == 2:
                for case in cases:
                    for op in ("STORE", "RETRIEVE"):
                        ratios[(case, op)].append(statistics.median(got[(0, case, op)])
                                                  / statistics.median(got[(1, case, op)]))
        for side in sides:
            side.close()
    finally:
        for s in servers:
            s.stop()
    print(f"# {args.rounds} rounds x {args.requests} requests per case and server, {args.pace_ms:g} ms before "
          f"each STORE + RETRIEVE pair, servers in turn; load average {load0:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after")
    head = "| case | request | this |" + (" compared | **this / compared** (min-max over rounds) |" if len(trees) == 2 else "")
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for case in cases:
        for op in ("STORE", "RETRIEVE"):
            this = statistics.median(times[("this", case, op)]) * 1e6
            line = f"| {case[0]} KiB x{case[1]} | {op} | {this:.0f} µs |"
            if len(trees) == 2:
                other = statistics.median(times[("compared", case, op)]) * 1e6
                r = ratios[(case, op)]
                line += f" {other:.0f} µs | **{statistics.median(r):.3f}** ({min(r):.2f}-{max(r):.2f}) |"
            print(line)


if __name__ == "__main__":
    main()
