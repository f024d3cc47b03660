"""Disk promotion in process: chunk files opened by one ``openat2`` against step by step, alternately.

    PYTHONPATH=. .venv/bin/python bench/disk_open_ab.py [--dir /var/tmp] [--sizes-kib 256,2048]
                                                        [--total-mib 256] [--reps 12]

Per size: a ``DiskTier`` in a fresh directory under ``--dir``, ``total-mib`` of chunks written,
a ``Pool`` made as the server makes it (pages faulted in) and a ``TierStack`` on it. Each
repetition empties the pool (untimed) and promotes every chunk (``TierStack.promote``, what a
LOOKUP runs: O_DIRECT reads into the pool on the stack's readers, each chunk checked), once
with the tier's ``openat2`` opener (``lmshm/platform/openat2.py``: one system call below the held
``<uid>/<xx>`` fd) and once with it off (``<yy>`` opened and checked, then the file), in
alternating order. Prints medians of GB/s and of the process's CPU time per GB (user + system,
all threads), and the median of the per-repetition ratios.
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import parse_args
from _server import empty_pool

from lmshm.core.pool import Pool, cost_of
from lmshm.core.tiers.base import ChunkMeta
from lmshm.core.tiers.disk import DiskTier
from lmshm.core.tiers.disk.format import file_bytes
from lmshm.core.tiers.stack import TierStack


def run(directory: str, size: int, total: int, reps: int) -> dict[bool, list[tuple[float, float]]]:
    n = max(1, total // size)
    tier = DiskTier(directory, n * file_bytes(size) + (64 << 20))
    if tier._open_below is None:
        raise SystemExit("openat2 is not available here: nothing to compare")
    meta = ChunkMeta(size, b"bench-layout", 1)
    src = mmap.mmap(-1, size)
    src.write(os.urandom(size))
    keys = [b"open-ab-%d" % i for i in range(n)]
    for k in keys:
        assert tier.put(1, k, meta, memoryview(src)), "put failed"
    pool = Pool(n * cost_of(size, 0, Pool.__init__.__kwdefaults__["align"]) + (16 << 20), prefault=True)
    stack = TierStack(pool, [tier], queue_limit=1, timeout_s=60)
    openers = (tier._open_below, tier._open_below_direct)
    out: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    try:
        for rep in range(reps + 1):
            for use in ((True, False) if rep % 2 else (False, True)):
                tier._open_below, tier._open_below_direct = openers if use else (None, None)
                empty_pool(pool)
                r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                held = stack.promote(1, [keys], time.monotonic() + 60)
                took = time.perf_counter() - t0
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                try:
                    if len(held.held) != n:
                        raise RuntimeError(f"promoted {len(held.held)} of {n}: {tier.stats.snapshot()}")
                finally:
                    held.release()
                if rep:                                   # the first pair warms up
                    gb = n * size / 1e9
                    cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
                    out[use].append((gb / took, cpu / gb * 1e3))
    finally:
        stack.close()
        pool.release()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/var/tmp", help="where the chunk files go (a directory of its own is made)")
    ap.add_argument("--sizes-kib", default="256,2048")
    ap.add_argument("--total-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=12)
    args = parse_args(ap, smoke={"sizes_kib": "256", "total_mib": 2, "reps": 1})
    print(f"# {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; {args.total_mib} MiB per size, "
          f"{args.reps} repetitions, medians")
    print("| chunk | step by step: GB/s (CPU ms/GB) | openat2 | openat2 / step by step: rate | CPU |")
    print("|---|---|---|---|---|")
    for kib in (int(s) for s in args.sizes_kib.split(",")):
        directory = tempfile.mkdtemp(prefix="lmshm-open-ab-", dir=args.dir)
        try:
            r = run(directory, kib << 10, args.total_mib << 20, args.reps)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        cell = {u: (statistics.median(x[0] for x in r[u]), statistics.median(x[1] for x in r[u])) for u in r}
        rate = statistics.median(a[0] / b[0] for a, b in zip(r[True], r[False]))
        cpu = statistics.median(a[1] / b[1] for a, b in zip(r[True], r[False]))
        print(f"| {kib} KiB | {cell[False][0]:.2f} ({cell[False][1]:.0f}) | {cell[True][0]:.2f} ({cell[True][1]:.0f}) "
              f"| {rate:.3f} | {cpu:.3f} |")


if __name__ == "__main__":
    main()
