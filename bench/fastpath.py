"""STORE and RETRIEVE against a plain memcpy of the same bytes, several server set-ups side by side.

    .venv/bin/python bench/fastpath.py [--request-mib 256] [--reps 15] [--in-order]
        [--modes default=memfd shm-file=shm shm-mapping=shm,--copy-through-mapping]

Each mode is ``NAME=SEGMENTS[,SERVER-ARG...]``: one lmshm-server started with those arguments
(none: its defaults) and a KV cache whose CPU segment is ``memfd`` (the default kind) or ``shm``
(a named segment). A server argument of the form ``ENV=VALUE`` goes into that server's
environment instead of its command line. Every mode's server runs at once, so the modes and the
memcpy see the same machine.

The KV cache is vLLM's CPU layout (``LBHNC``): one ``torch.empty`` buffer of
``[layers, blocks, heads, tokens, head size]`` bfloat16, registered as one view per layer through
``MPClient`` (which moves it into a segment of the mode's kind once, at registration). Block ids
are shuffled, as a long-running engine has them (``--in-order``: consecutive). Each rep, timed
from the client (request to reply), in this order:

- memcpy: ``ctypes.memmove`` of the request's bytes between two touched ``torch.empty`` buffers;
- one STORE per mode of ``--request-mib`` (chunks of 16 blocks, fresh keys);
- memcpy again, and the same bytes copied as the request's pieces (one ``memmove`` per block
  and layer, in the request's block order, one thread: what any copy of these blocks must do);
- one RETRIEVE per mode of the chunks just stored, into other blocks.

The modes take turns going first, rep by rep.

The server's pool holds exactly ``--cold-reps`` requests, so the first STOREs fill untouched pool
pages ("cold") and the later ones reuse evicted pages ("warm"). Prints medians, GB/s, the ratio
of the memcpy median to each median, and the load average before and after.

``--fresh-pages N`` adds what untouched memory costs, in this process, N times each, side by
side: a memcpy of the request's bytes into a fresh anonymous mapping of 4 KiB pages, into one
advised ``MADV_HUGEPAGE``, and ``MADV_POPULATE_WRITE`` of a fresh huge-page mapping followed by
the memcpy (what ``--pool-huge-pages`` and ``--prefault-pool`` do to the pool).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import parse_args
from _server import BenchServer

from lmshm.core.pool import OBJECT_COST
from lmshm.platform import ipc_policy
from lmshm.transport.client import MPClient

CHUNK_BLOCKS = 16
DEFAULT_MODES = ["default=memfd", "shm-file=shm", "shm-mapping=shm,--copy-through-mapping"]


class Mode:
    def __init__(self, spec: str) -> None:
        name, _, rest = spec.partition("=")
        parts = rest.split(",")
        self.name, self.segments = name, parts[0]
        if self.segments not in ("memfd", "shm") or not name:
            raise SystemExit(f"bad mode {spec!r}: NAME=memfd|shm[,SERVER-ARG...]")
        self.args = [p for p in parts[1:] if p.startswith("-")]
        self.env = dict(p.split("=", 1) for p in parts[1:] if not p.startswith("-"))
        self.stores: list[float] = []
        self.cold: list[float] = []
        self.retrieves: list[float] = []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--request-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=15, help="STOREs (and RETRIEVEs) per mode, cold ones included")
    ap.add_argument("--cold-reps", type=int, default=3, help="requests the pool holds: the first STOREs that fill it")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32, help="tokens per block")
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--in-order", action="store_true", help="consecutive block ids instead of shuffled ones")
    ap.add_argument("--modes", nargs="+", default=DEFAULT_MODES)
    ap.add_argument("--fresh-pages", type=int, default=0, metavar="N",
                    help="also time memcpy into fresh pages: 4 KiB, huge, pre-faulted huge (N each)")
    args = parse_args(ap, smoke={"request_mib": 8, "reps": 3, "cold_reps": 1, "layers": 4,
                                 "modes": ["default=memfd", "shm-mapping=shm,--copy-through-mapping"]})

    modes = [Mode(m) for m in args.modes]
    if any("PYTHONPATH" in m.env for m in modes) and os.path.isdir(os.path.join(os.getcwd(), "lmshm")):
        raise SystemExit("a mode sets PYTHONPATH, but the working directory holds an lmshm package: its servers "
                         "(python -m, which puts the working directory first on sys.path) would import that one "
                         "whatever PYTHONPATH says. Run from outside the repository, e.g. cd /tmp")
    block_layer = args.heads * args.tokens * args.head_size * 2
    request = args.request_mib << 20
    blocks = request // (args.layers * block_layer)
    blocks -= blocks % CHUNK_BLOCKS
    request = blocks * args.layers * block_layer
    chunks = blocks // CHUNK_BLOCKS
    capacity = args.cold_reps * (request + chunks * OBJECT_COST) + (64 << 10)
    order = list(range(2 * blocks))
    if not args.in_order:
        random.Random(0).shuffle(order)
    src_blocks, dst_blocks = order[:blocks], order[blocks:]
    load0 = os.getloadavg()

    servers, clients, caches, iids = [], [], [], []
    try:
        for m in modes:
            env = {**os.environ, **m.env} if m.env else None
            servers.append(BenchServer("--capacity", str(capacity), *m.args, env=env))
            kv = torch.empty((args.layers, 2 * blocks, args.heads, args.tokens, args.head_size), dtype=torch.bfloat16)
            kv.normal_()
            ipc_policy.set_cpu_segments(m.segments)
            client = MPClient(servers[-1].url, timeout_s=120)
            clients.append(client)
            views = {f"model.layers.{i}.self_attn": kv[i] for i in range(args.layers)}
            iids.append(client.register_kv_caches(views, model_name="bench"))   # re-points the views, not kv
            caches.append(list(views.values()))
            del kv
        ipc_policy.set_cpu_segments(None)

        src = torch.empty(request, dtype=torch.uint8).fill_(1)
        dst = torch.empty(request, dtype=torch.uint8).fill_(0)

        def memcpy() -> float:
            t0 = time.perf_counter()
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), request)
            return time.perf_counter() - t0

        # The same bytes as the request's pieces: one block of one layer each, from a KV-sized
        # buffer in the request's block order, one thread (what any copy of these blocks does).
        kv_like = torch.ones(2 * request, dtype=torch.uint8)
        pieces = [(kv_like.data_ptr() + (layer * 2 * blocks + b) * block_layer, dst.data_ptr() + i * block_layer)
                  for i, (layer, b) in enumerate((layer, b) for layer in range(args.layers) for b in src_blocks)]

        def scattered() -> float:
            move = ctypes.memmove
            t0 = time.perf_counter()
            for s_addr, d_addr in pieces:
                move(d_addr, s_addr, block_layer)
            return time.perf_counter() - t0

        copies: list[float] = []
        scatter_copies: list[float] = []
        batch = list(zip(modes, clients, iids))
        for rep in range(args.reps):
            copies.append(memcpy())
            keys = [f"rep{rep}.chunk{c}".encode().ljust(16, b".") for c in range(chunks)]
            turn = [(rep + i) % len(modes) for i in range(len(modes))]   # each mode goes first in turn
            for m, client, iid in (batch[i] for i in turn):
                t0 = time.perf_counter()
                reply = client.store(iid, keys, src_blocks, CHUNK_BLOCKS, timeout_s=120)
                took = time.perf_counter() - t0
                assert reply.nbytes == request, (m.name, reply)
                (m.cold if rep < args.cold_reps else m.stores).append(took)
            copies.append(memcpy())
            scatter_copies.append(scattered())
            for m, client, iid in (batch[i] for i in turn):
                t0 = time.perf_counter()
                client.retrieve(iid, keys, dst_blocks, CHUNK_BLOCKS, timeout_s=120)
                m.retrieves.append(time.perf_counter() - t0)
        for m, views in zip(modes, caches):
            assert all(torch.equal(v[dst_blocks], v[src_blocks]) for v in views), f"{m.name}: RETRIEVE wrote other bytes"
        for client, iid in zip(clients, iids):
            client.unregister_kv_caches(iid)
    finally:
        for client in clients:
            client.close()
        for server in servers:
            server.stop()
    load1 = os.getloadavg()

    base = statistics.median(copies)
    print(f"{request / 2**20:.0f} MiB per request ({chunks} chunks of {CHUNK_BLOCKS} blocks x {args.layers} layers, "
          f"{block_layer // 1024} KiB per block and layer), block ids {'in order' if args.in_order else 'shuffled'}; "
          f"{os.cpu_count()} CPUs, load average {load0[0]:.2f} before, {load1[0]:.2f} after")
    print(f"{'operation':<44} {'median ms':>10} {'GB/s':>7} {'x memcpy':>9}  n")
    rows = [("memcpy (ctypes.memmove, touched pages)", copies),
            ("the same, one memmove per block and layer", scatter_copies)]
    for m in modes:
        rows += [(f"[{m.name}] STORE, cold pool pages", m.cold), (f"[{m.name}] STORE", m.stores),
                 (f"[{m.name}] RETRIEVE", m.retrieves)]
    for name, xs in rows:
        if not xs:
            continue
        med = statistics.median(xs)
        print(f"{name:<44} {med * 1e3:>10.1f} {request / med / 1e9:>7.2f} {base / med:>9.2f}  {len(xs)}")
    for m, server in zip(modes, servers):
        extra = " ".join(m.args + [f"{k}={v}" for k, v in m.env.items()]) or "(defaults)"
        print(f"[{m.name}] {m.segments} segment; server {extra}; exit status {server.returncode}")
    if args.fresh_pages:
        fresh_pages(request, args.fresh_pages, base)
    return 0


def fresh_pages(n: int, reps: int, warm: float) -> None:
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    src = torch.ones(n, dtype=torch.uint8)
    times: dict[str, list[float]] = {"memcpy into fresh 4 KiB pages": [], "memcpy into fresh huge pages": [],
                                     "populate huge pages, then memcpy": []}
    for _ in range(reps):
        for name, huge, populate in (("memcpy into fresh 4 KiB pages", False, False),
                                     ("memcpy into fresh huge pages", True, False),
                                     ("populate huge pages, then memcpy", True, True)):
            addr = libc.mmap(None, n, mmap.PROT_READ | mmap.PROT_WRITE,
                             mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000, -1, 0)
            if huge:
                libc.madvise(addr, n, 14)       # MADV_HUGEPAGE
            t0 = time.perf_counter()
            if populate:
                libc.madvise(addr, n, 23)       # MADV_POPULATE_WRITE
            ctypes.memmove(addr, src.data_ptr(), n)
            times[name].append(time.perf_counter() - t0)
            libc.munmap(addr, n)
    for name, xs in times.items():
        med = statistics.median(xs)
        print(f"{name:<44} {med * 1e3:>10.1f} {n / med / 1e9:>7.2f} {warm / med:>9.2f}  {len(xs)}")


if __name__ == "__main__":
    sys.exit(main())
