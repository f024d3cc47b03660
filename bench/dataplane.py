"""Data-plane throughput and latency, against plain memcpy in the same run.

    .venv/bin/python bench/dataplane.py [--request-mib 256] [--reps 12] [--lookups 2000]

One lmshm-server (``--capacity``, default 1 GiB) and this process as the worker: a KV cache of
32 layers x [blocks, 8 heads, 32 tokens, 128] float16 (64 KiB per block and layer) in shared
memory, registered once. Then, each timed from the client (request to reply):

- STORE of ``--request-mib`` per request (chunks of 16 blocks, fresh keys every time): the first
  requests fill untouched pool pages ("cold": the kernel supplies zeroed pages as they are
  written), later ones reuse evicted pages ("warm");
- RETRIEVE of the same bytes into other blocks;
- memcpy (``ctypes.memmove``) of the same number of bytes between two touched buffers, and
  into freshly mapped pages (cold), in this process;
- LOOKUP of 64 keys, and an empty PING, alternating.

Prints medians and the ratios to memcpy.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import parse_args
from _server import BenchServer

from lmshm.platform.cpu import empty_shared
from lmshm.transport.client import MPClient

LAYERS, HEADS, TOKENS, DIM = 32, 8, 32, 128
BLOCK_LAYER_BYTES = HEADS * TOKENS * DIM * 2
CHUNK_BLOCKS = 16


def median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def memcpy_times(nbytes: int, reps: int) -> tuple[list[float], list[float]]:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    warm, cold = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        warm.append(time.perf_counter() - t0)
        m = mmap.mmap(-1, nbytes)
        buf = (ctypes.c_char * nbytes).from_buffer(m)
        t0 = time.perf_counter()
        ctypes.memmove(ctypes.addressof(buf), src.data_ptr(), nbytes)
        cold.append(time.perf_counter() - t0)
        del buf
        m.close()
    return warm, cold


def run_mode(args: argparse.Namespace, mode: str, request_bytes: int, blocks_per_request: int, chunks: int) -> dict:
    num_blocks = 2 * blocks_per_request
    extra = ["--copy-through-mapping"] if mode == "mapping" else []
    with BenchServer("--capacity", args.capacity, "--copy-threads", str(args.copy_threads), *extra) as server:
        pool = empty_shared((LAYERS, num_blocks, HEADS, TOKENS, DIM), torch.float16)
        pool.normal_()
        kv = {f"layer.{i}": pool[i] for i in range(LAYERS)}
        with MPClient(server.url, timeout_s=60) as client:
            iid = client.register_kv_caches(kv, "bench")
            src_blocks = list(range(blocks_per_request))
            dst_blocks = list(range(blocks_per_request, num_blocks))
            if args.shuffled:
                import random

                order = list(range(num_blocks))
                random.Random(0).shuffle(order)
                src_blocks, dst_blocks = order[:blocks_per_request], order[blocks_per_request:]
            stores, keys = [], []
            for rep in range(args.reps):
                keys = [f"r{rep}c{c}".encode().ljust(16, b".") for c in range(chunks)]
                t0 = time.perf_counter()
                reply = client.store(iid, keys, src_blocks, CHUNK_BLOCKS, timeout_s=120)
                stores.append(time.perf_counter() - t0)
                assert reply.nbytes == request_bytes, reply
            retrieves = []
            for _ in range(max(4, args.reps // 2)):
                t0 = time.perf_counter()
                client.retrieve(iid, keys, dst_blocks, CHUNK_BLOCKS, timeout_s=120)
                retrieves.append(time.perf_counter() - t0)
            assert torch.equal(pool[:, dst_blocks], pool[:, src_blocks])
            lookup_keys = [[f"r{args.reps - 1}c{c % chunks}x{c}".encode() for c in range(64)]]
            lookups, pings = [], []
            for _ in range(args.lookups):
                t0 = time.perf_counter()
                client.ping()
                pings.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                client.lookup(lookup_keys)
                lookups.append(time.perf_counter() - t0)
            info = client.status().pool
            client.unregister_kv_caches(iid)
        del kv, pool
    return dict(stores=stores, retrieves=retrieves, lookups=lookups, pings=pings, evictions=info.evictions,
                rc=server.returncode)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--request-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--capacity", default="1GiB")
    ap.add_argument("--copy-threads", type=int, default=2)
    ap.add_argument("--modes", default="file,mapping",
                    help="server copy modes to run side by side: file (the default, preadv/pwritev through the "
                         "segment's file) and mapping (--copy-through-mapping, memmove)")
    ap.add_argument("--shuffled", action="store_true",
                    help="block ids in random order (every block its own run), as a long-running engine has them")
    args = parse_args(ap, smoke={"request_mib": 32, "reps": 2, "lookups": 20, "capacity": "128MiB"})

    request_bytes = args.request_mib << 20
    blocks_per_request = request_bytes // (LAYERS * BLOCK_LAYER_BYTES)
    chunks = blocks_per_request // CHUNK_BLOCKS
    results = {mode: run_mode(args, mode, request_bytes, blocks_per_request, chunks) for mode in args.modes.split(",")}
    warm_cp, cold_cp = memcpy_times(request_bytes, args.reps)

    fill = max(1, min(args.reps - 1, parse_capacity(args.capacity) // request_bytes))
    gbs = lambda s: request_bytes / statistics.median(s) / 1e9
    print(f"{args.request_mib} MiB per request ({chunks} chunks of {CHUNK_BLOCKS} blocks x {LAYERS} layers), "
          f"{args.copy_threads} copy threads, {os.cpu_count()} CPUs, block ids "
          f"{'shuffled' if args.shuffled else 'consecutive'}")
    print(f"{'operation':<34} {'median ms':>10} {'GB/s':>7} {'x memcpy':>9}  n")
    rows = [("memcpy, touched pages", warm_cp, None), ("memcpy, fresh pages", cold_cp, None)]
    for mode, r in results.items():
        rows += [(f"[{mode}] STORE, cold pool pages", r["stores"][:fill], cold_cp),
                 (f"[{mode}] STORE, warm pool pages", r["stores"][fill:], warm_cp),
                 (f"[{mode}] RETRIEVE", r["retrieves"], warm_cp)]
    for name, xs, base in rows:
        ratio = f"{statistics.median(base) / statistics.median(xs):.2f}" if base else "-"
        print(f"{name:<34} {median_ms(xs):>10.1f} {gbs(xs):>7.2f} {ratio:>9}  {len(xs)}")
    for mode, r in results.items():
        print(f"[{mode}] LOOKUP of 64 keys: median {median_ms(r['lookups']) * 1e3:.0f} us; empty PING: median "
              f"{median_ms(r['pings']) * 1e3:.0f} us; ratio {statistics.median(r['lookups']) / statistics.median(r['pings']):.2f} "
              f"(n={args.lookups} each, alternating); evictions {r['evictions']}; server exit status {r['rc']}")
    return 0


def parse_capacity(text: str) -> int:
    from lmshm.core.pool import parse_size

    return parse_size(text)


if __name__ == "__main__":
    sys.exit(main())
