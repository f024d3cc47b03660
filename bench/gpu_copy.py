"""GPU benchmark of a CUDA STORE's and RETRIEVE's copies against the DMA limit (issue 42, §1).

Run by scripts/gpu-check (needs one CUDA GPU; UNVERIFIED until it has run on one). In one
process, no server: the data plane's own copy path -- ``dataplane.plan_cuda_copies`` and
``cuda_sync.TorchCudaSync.submit`` on a session stream, the pool page-locked by
``TorchCudaSync.pin`` in ``--extent`` extents -- between a Llama-3-8B-shaped KV cache on the GPU
(32 layers, 8 KV heads, head size 128, bf16, 16-token blocks, allocated as vLLM 0.32 does) and
a host pool, against ONE contiguous ``cuMemcpyAsync`` of the same number of bytes between the
same two buffers, in the same run: the DMA limit. The worker's side (IPC mapping) is left out:
a mapped allocation is the same memory to the copy engine.

For NHD (one 64 KiB piece per layer per block) and BLHNC (the cache registered whole: one 2 MiB
piece per block), 256-token chunks, 1 / 4 / 16 / 64 chunks a request, shuffled block ids, batched
(one ``cuMemcpyBatchAsync``) and per-piece (one ``cuMemcpyAsync`` a piece): GB/s from an event
recorded before the submission to one after it (what a request costs, submission included), the
median of ``--reps``. Pool objects start 4,160 bytes past an extent edge, so some straddle one
and are cut there, as in a running server.

Usage: python bench/gpu_copy.py [--chunks 1,4,16,64] [--reps 5] [--extent-mib 256] [--json OUT]
       [--table OUT]. The table is printed last (and written to --table).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import no_cuda_device, parse_args, skip

L, H, N, C, ITEM = 32, 8, 16, 256, 2          # C: K and V (128 each), bf16: 64 KiB per layer per block
CHUNK_BLOCKS = 16
ORDERS = {"NHD": (0, 1, 3, 2, 4), "BLHNC": (1, 0, 2, 3, 4)}
SKEW = 4160                                    # first object's offset past an extent edge


def log(msg: str) -> None:
    print(f"[gpu-copy] {msg}", file=sys.stderr, flush=True)


def cache(torch, layout: str, blocks: int) -> tuple[list, list, int]:
    shape = [L, blocks, H, N, C * ITEM]
    strides, step = [0] * 5, 1
    for d in reversed(ORDERS[layout]):
        strides[d], step = step, step * shape[d]
    buf = torch.empty(math.prod(shape), dtype=torch.int8, device="cuda:0")
    v = torch.as_strided(buf, shape, strides).view(torch.bfloat16)
    if layout == "BLHNC":
        return ["kv_cache"], [v], 1
    return [f"model.layers.{i}.self_attn.attn" for i in range(L)], [v[i] for i in range(L)], 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", default="1,4,16,64")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--extent-mib", type=int, default=256)
    ap.add_argument("--json")
    ap.add_argument("--table")
    a = parse_args(ap, smoke={"chunks": "1,4", "reps": 1, "extent_mib": 64})
    if a.smoke and no_cuda_device():
        skip("no CUDA device visible (gpu_copy measures copies between a GPU and the pool)")

    import torch

    if not torch.cuda.is_available():
        if a.smoke:
            skip("no CUDA device visible (gpu_copy measures copies between a GPU and the pool)")
        log("no CUDA device visible")
        return 2
    from lmshm.core.cuda_sync import TorchCudaSync
    from lmshm.core.dataplane import BlockLayout, plan_cuda_copies
    from lmshm.platform.cuda.driver import get_driver

    torch.cuda.set_device(0)
    chunks_list = [int(x) for x in a.chunks.split(",")]
    most = max(chunks_list)
    blocks = most * CHUNK_BLOCKS
    extent = a.extent_mib << 20
    chunk_bytes = L * CHUNK_BLOCKS * H * N * C * ITEM            # 32 MiB
    t0 = time.perf_counter()
    pool = torch.empty(SKEW + chunk_bytes * most, dtype=torch.uint8)
    syncs = {True: TorchCudaSync("lazy", extent, copy_batch=True),
             False: TorchCudaSync("lazy", extent, copy_batch=False)}
    syncs[True].pin(pool)                                         # extent by extent, the real pin path
    log(f"pool of {pool.numel() >> 20} MiB pinned in {extent >> 20} MiB extents in {time.perf_counter() - t0:.1f} s")
    drv = get_driver()
    base = pool.data_ptr()
    path = syncs[True].copy_path(0)
    rows = []
    for name in ORDERS:
        names, tensors, block_dim = cache(torch, name, blocks)
        torch.cuda.synchronize()
        layout = BlockLayout.of(names, tensors, block_dim)
        assert layout.chunk_bytes(CHUNK_BLOCKS) == chunk_bytes
        flat = tensors[0].untyped_storage()
        kv_ptr, kv_bytes = flat.data_ptr(), flat.nbytes()
        for n in chunks_list:
            ids = random.Random(n).sample(range(blocks), n * CHUNK_BLOCKS)
            addrs = [base + SKEW + c * chunk_bytes for c in range(n)]
            nbytes = n * chunk_bytes
            row = {"layout": name, "chunks": n, "bytes": nbytes}
            for store in (True, False):
                way = "store" if store else "retrieve"
                for batch in (True, False):
                    sync = syncs[batch]
                    stream = sync.stream(0, "bench")
                    s = int(stream.cuda_stream)

                    def ours() -> None:
                        plan = plan_cuda_copies(layout, ids,  # noqa: F821 (bound above; the del ends the loop)
                                                addrs, CHUNK_BLOCKS, store=store, pool_base=base,
                                                extent=extent)
                        sync.submit(plan, stream, 0)

                    def limit() -> None:                          # one copy of the same bytes, same memories
                        if store:
                            drv.memcpy_async(base + SKEW, kv_ptr, min(nbytes, kv_bytes), s, 0)
                        else:
                            drv.memcpy_async(kv_ptr, base + SKEW, min(nbytes, kv_bytes), s, 0)

                    for label, fn in (("limit", limit), ("batched" if batch else "per-piece", ours)):
                        if label == "limit" and not batch:
                            continue                              # measured once per direction
                        fn()                                      # warm-up
                        torch.cuda.synchronize()
                        times = []
                        for _ in range(a.reps):
                            start = torch.cuda.Event(enable_timing=True)
                            end = torch.cuda.Event(enable_timing=True)
                            start.record(stream)
                            fn()
                            end.record(stream)
                            end.synchronize()
                            times.append(start.elapsed_time(end) / 1e3)
                        row[f"{way}_{label}"] = nbytes / statistics.median(times) / 1e9
            row["pieces"] = len(plan_cuda_copies(layout, ids, addrs, CHUNK_BLOCKS, store=True, pool_base=base,
                                                 extent=extent))
            rows.append(row)
            log(f"{name} x{n}: {row}")
        del tensors, layout, flat
        torch.cuda.empty_cache()
    for sync in syncs.values():
        sync.drop_session("bench")
    syncs[True].unpin_all([pool])
    lines = [f"CUDA STORE/RETRIEVE copies vs one contiguous cuMemcpyAsync of the same bytes (GB/s, median of "
             f"{a.reps}; {torch.cuda.get_device_name(0)}; batch path: {path}; pin extent {extent >> 20} MiB)",
             f"{'layout':6} {'chunks':>6} {'pieces':>6} | {'STORE':>6} {'batched':>8} {'x':>5} {'per-piece':>9} "
             f"{'x':>5} | {'RETR.':>6} {'batched':>8} {'x':>5} {'per-piece':>9} {'x':>5}"]
    for r in rows:
        cells = []
        for way in ("store", "retrieve"):
            lim = r[f"{way}_limit"]
            cells.append(f"{lim:>6.1f} {r[f'{way}_batched']:>8.1f} {r[f'{way}_batched'] / lim:>5.2f} "
                         f"{r[f'{way}_per-piece']:>9.1f} {r[f'{way}_per-piece'] / lim:>5.2f}")
        lines.append(f"{r['layout']:6} {r['chunks']:>6} {r['pieces']:>6} | {cells[0]} | {cells[1]}")
    lines.append("(STORE/RETR.: the limit, one copy; x: that path's share of it; the goal is >= 0.9 at 256-token "
                 "chunks)")
    text = "\n".join(lines)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "path": path, "extent": extent, "rows": rows}, f,
                      indent=1)
    if a.table:
        with open(a.table, "w") as f:
            f.write(text + "\n")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
