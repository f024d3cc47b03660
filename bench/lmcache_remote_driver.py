"""LMCache's Valkey/Redis L2 adapters read back into its own L1 memory: the LMCache side of
bench/remote_readback.py.

    /tmp/lmc-venv/bin/python bench/lmcache_remote_driver.py --url redis://127.0.0.1:PORT \
        [--sizes-kib 256,2048,16384] [--total-mib 256] [--concurrency 1,8] [--reps 5]

Runs in a virtual environment with ``lmcache`` (0.5.6 was measured) and the packages its
adapters import, not in lmshm's: bench/remote_readback.py starts it there. CPU only; made with

    python3 -m venv /tmp/lmc-venv && P=/tmp/lmc-venv/bin/pip
    $P install torch==2.13.0              # the CPU build: check that pip takes no nvidia-* wheel
    $P install --no-deps lmcache==0.5.6   # its metadata asks for cupy, cuda-python, ...
    $P install --no-deps sortedcontainers msgspec 'numpy<=2.2.6' valkey-glide-sync==2.6.0 cffi \
        pycparser 'protobuf<7' numba llvmlite 'prometheus_client<=0.24.1' py-cpuinfo psutil pyyaml \
        pyzmq cryptography aiofile caio requests urllib3 certifi charset-normalizer idna cachetools
    $P install aiohttp transformers       # imported on the way to the adapters; no CUDA wheel

It only calls LMCache's classes, as its storage manager does:

- ``valkey``: ``ValkeyL2Adapter`` (valkey-glide-sync, one client per worker thread);
- ``resp``: the ``resp`` adapter, ``NativeConnectorL2Adapter`` over the C++ RESP client
  ``lmcache.lmcache_redis.LMCacheRedisClient`` (its own worker threads and connections).

For each size, ``total-mib`` of values are allocated from an ``L1MemoryManager`` (as LMCache's
L1 holds them), filled with random bytes and stored with ``submit_store_task``; a second set of
L1 objects, touched beforehand, is the destination. Concurrency is the adapter's
``num_workers``: the number of requests it keeps in flight. One read-back is every key loaded
with ``submit_load_task`` in tasks of 32 keys, all submitted at once, and waited for on the load
event fd, as the prefetch controller does; each one is checked complete (the bitmap) and, after
the last repetition, the bytes are compared with what was stored. Each repetition runs every
(adapter, concurrency) once in a shuffled order after one untimed read each. GB/s: 1e9 payload
bytes per second, median over the repetitions. The last stdout line is one JSON object:
``{"adapters": {name: {size_kib: {conc: gbps}}}, "versions": {...}}``. Keys are deleted at the end.
With ``--serve`` (one size) it runs a repetition per ``rep`` line on stdin and answers each with
its times, so that bench/remote_readback.py alternates its own repetitions with these.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import select
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import parse_args, skip

BATCH = 32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="redis://HOST:PORT of a running Valkey (required)")
    ap.add_argument("--sizes-kib", default="256,2048,16384")
    ap.add_argument("--total-mib", type=int, default=256)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--adapters", default="valkey,resp")
    ap.add_argument("--serve", action="store_true",
                    help="one size, a repetition per 'rep' line on stdin, until 'end' (bench/remote_readback.py)")
    args = parse_args(ap, smoke={"sizes_kib": "256", "total_mib": 2, "concurrency": "1", "reps": 1})
    if args.smoke:
        try:
            import lmcache  # noqa: F401 - only whether it is there
        except ImportError:
            skip("lmcache is not installed in this interpreter: the driver runs in an LMCache venv "
                 "(see its docstring; bench/remote_readback.py --lmcache-python starts it there)")
        if not args.url:
            skip("no --url: the driver reads from a running Valkey (bench/remote_readback.py starts one)")
    if not args.url:
        ap.error("--url is required")
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    host, port = args.url.split("://", 1)[1].rsplit(":", 1)
    sizes = [int(s) for s in args.sizes_kib.split(",")]
    concs = [int(c) for c in args.concurrency.split(",")]
    names = args.adapters.split(",")
    result: dict = {"adapters": {n: {} for n in names}, "cpu": {n: {} for n in names}, "versions": versions()}
    if args.serve and len(sizes) != 1:
        raise SystemExit("--serve takes one size")
    for kib in sizes:
        rb = Readback(host, int(port), names, kib << 10, args.total_mib << 20, concs)
        if args.serve:
            serve(rb)
        else:
            for _ in range(args.reps):
                rb.rep()
        for name, per_conc in rb.finish().items():
            result["adapters"][name][str(kib)] = {str(c): r for c, r in per_conc.items()}
            print(f"{name:7s} {kib:6d} KiB  " + "  ".join(f"c{c}: {r:.2f} GB/s" for c, r in per_conc.items()),
                  file=sys.stderr)
        for name, per_conc in rb.cpu_per_gb().items():
            result["cpu"][name][str(kib)] = {str(c): r for c, r in per_conc.items()}
    print(json.dumps(result))


def versions() -> dict:
    from importlib.metadata import version
    out = {}
    for pkg in ("lmcache", "valkey-glide-sync", "torch"):
        try:
            out[pkg] = version(pkg)
        except Exception:
            out[pkg] = None
    return out


def make_adapter(name: str, host: str, port: int, workers: int):
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    if name == "valkey":
        from lmcache.v1.distributed.l2_adapters.valkey_l2_adapter import ValkeyL2AdapterConfig
        config = ValkeyL2AdapterConfig([(host, port)], num_workers=workers, key_prefix="lmshm-bench")
    elif name == "resp":
        from lmcache.v1.distributed.l2_adapters.resp_l2_adapter import RESPL2AdapterConfig
        config = RESPL2AdapterConfig(host, port, num_workers=workers)
    else:
        raise SystemExit(f"unknown adapter {name!r}: valkey or resp")
    return create_l2_adapter(config)


def wait_all(adapter, task_ids: list[int], load: bool, timeout_s: float = 120.0) -> None:
    """Wait on the adapter's event fd until every task is done; raise unless all keys succeeded."""
    from lmcache.v1.platform.event_notifier import consume_fd
    fd = adapter.get_load_event_fd() if load else adapter.get_store_event_fd()
    pending = set(task_ids)
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout_s
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pending)} tasks not done after {timeout_s} s")
        if poller.poll(1000):
            consume_fd(fd)
        if load:
            for tid in list(pending):
                bitmap = adapter.query_load_result(tid)
                if bitmap is not None:
                    pending.discard(tid)
                    if bitmap.popcount() != bitmap.size():
                        raise RuntimeError(f"load task {tid}: {bitmap.size() - bitmap.popcount()} keys not loaded")
        else:
            for tid, res in adapter.pop_completed_store_tasks().items():
                if not res.is_successful():
                    raise RuntimeError(f"store task {tid} failed")
                pending.discard(tid)


class Readback:
    """One value size: the L1 objects, the adapters (one per name and concurrency), the keys
    written; ``rep`` times one read-back of each, ``finish`` checks the bytes and cleans up."""

    def __init__(self, host: str, port: int, names: list[str], size: int, total: int, concs: list[int]) -> None:
        import torch
        from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
        from lmcache.v1.distributed.config import L1MemoryManagerConfig
        from lmcache.v1.distributed.memory_manager.l1_memory_manager import L1MemoryManager
        self.names, self.size, self.concs = names, size, concs
        self.n = n = max(1, total // size)
        self.l1 = L1MemoryManager(L1MemoryManagerConfig(size_in_bytes=2 * n * (size + 4096) + (64 << 20),
                                                        use_lazy=False, shm_name=""))
        layout = MemoryLayoutDesc([torch.Size([size])], [torch.uint8])
        _, self.src = self.l1.allocate(layout, n)
        _, self.dst = self.l1.allocate(layout, n)
        assert len(self.src) == n and len(self.dst) == n, "L1 allocation failed"
        for obj in self.src:
            obj.raw_data[:size].copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
        for obj in self.dst:
            obj.raw_data[:size].zero_()        # pages faulted before the clock
        self.keys = [ObjectKey(chunk_hash=os.urandom(16), model_name="lmshm-bench", kv_rank=0) for _ in range(n)]
        self.batches = [(self.keys[i:i + BATCH], self.dst[i:i + BATCH]) for i in range(0, n, BATCH)]
        self.adapters = {(name, c): make_adapter(name, host, port, c) for name in names for c in concs}
        self.times: dict[tuple[str, int], list[float]] = {k: [] for k in self.adapters}
        self.cpu: dict[tuple[str, int], list[float]] = {k: [] for k in self.adapters}
        self.last_cpu = 0.0
        self.order = list(self.adapters)
        self.shuffle = random.Random(size)
        for name in names:                     # each adapter's keys written once, by its widest one
            a = self.writer(name)
            wait_all(a, [a.submit_store_task(self.keys[i:i + BATCH], self.src[i:i + BATCH])
                         for i in range(0, n, BATCH)], load=False)
        for a in self.adapters.values():
            self.read(a)                       # untimed: connections and threads warm

    def writer(self, name: str):
        return self.adapters[(name, max(self.concs))]

    def read(self, adapter) -> float:
        """Seconds for one read-back; ``last_cpu``: this process's CPU seconds over it (its
        C++ worker threads included)."""
        c0, t0 = time.process_time(), time.perf_counter()
        wait_all(adapter, [adapter.submit_load_task(k, o) for k, o in self.batches], load=True)
        took = time.perf_counter() - t0
        self.last_cpu = time.process_time() - c0
        return took

    def rep(self) -> dict[tuple[str, int], float]:
        self.shuffle.shuffle(self.order)
        got = {}
        for k in self.order:
            got[k] = self.read(self.adapters[k])
            self.cpu[k].append(self.last_cpu)
        for k, t in got.items():
            self.times[k].append(t)
        return got

    def cpu_per_gb(self) -> dict[str, dict[int, float]]:
        """Median CPU milliseconds of this process per GB (1e9 bytes) read back."""
        out: dict[str, dict[int, float]] = {}
        for (name, c), cs in self.cpu.items():
            out.setdefault(name, {})[c] = statistics.median(cs) * 1e3 / (self.n * self.size / 1e9)
        return out

    def finish(self) -> dict[str, dict[int, float]]:
        """Medians in GB/s; after one more read each, compared with what was stored."""
        try:
            for k in self.order:               # what the last read left is what was stored
                for o in self.dst:
                    o.raw_data[:self.size].zero_()
                self.read(self.adapters[k])
                bad = sum(not s.raw_data[:self.size].equal(d.raw_data[:self.size]) for s, d in zip(self.src, self.dst))
                if bad:
                    raise RuntimeError(f"{k}: {bad} of {self.n} values read back wrong")
        finally:
            for name in self.names:
                self.writer(name).delete(self.keys)
            for a in self.adapters.values():
                a.close()
            self.l1.free(self.src)
            self.l1.free(self.dst)
        out: dict[str, dict[int, float]] = {}
        for (name, c), ts in self.times.items():
            out.setdefault(name, {})[c] = self.n * self.size / statistics.median(ts) / 1e9
        return out


def serve(rb: Readback) -> None:
    """``--serve``: ``ready`` once set up; then per stdin line ``rep``, one JSON line of seconds
    per "name conc"; ``end`` finishes (returns, and main prints the result)."""
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "rep":
            print(json.dumps({f"{name} {c}": t for (name, c), t in rb.rep().items()}), flush=True)
        elif line.strip() == "end":
            return
    raise SystemExit("stdin closed before 'end'")


if __name__ == "__main__":
    logging.getLogger("lmcache").setLevel(logging.WARNING)
    main()
