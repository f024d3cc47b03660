"""CPU cost of planning and submitting one request's CUDA copies (issue 42, section 1). No GPU.

The server's side of a CUDA STORE between "the objects are reserved" and "the copies are
queued", for a Llama-3-8B-shaped cache (32 layers, 8 KV heads, head size 128, K and V 128 each,
bf16, 16-token blocks: 64 KiB per layer per block) and 256-token chunks, 1 to 64 chunks a
request, block ids shuffled (no two of a chunk consecutive: the most pieces). Layouts, as vLLM
0.32 allocates them (one int8 buffer, ``as_strided`` to logical ``[L, B, H, N, C]``):

- NHD (LBNHC) and HND (LBHNC): one ``[B, H, N, C]`` view per layer registered; 64 KiB pieces,
  one per layer per block: 512 per chunk;
- BLHNC: the ``[L, B, H, N, C]`` cache registered whole (block_dim 1); one 2 MiB piece a block.

Paths, each timed from the block ids to the last driver call returning:

- ``before``: lmshm's path before issue 42 (``cuda_copies``, kept here for the comparison): per
  chunk, per layer, per piece two tensor slices and one ``copy(dst, src, stream)``, here a
  recording stub in place of ``torch`` ``copy_(non_blocking=True)`` (so the real path was slower
  by that call's cost, ~10 us a piece);
- ``per-piece``: ``plan_cuda_copies`` (numpy) and one ``CudaDriver.memcpy_async`` a piece;
- ``batched``: ``plan_cuda_copies`` and one ``CudaDriver.memcpy_batch_async`` a request.

The last two run lmshm's real driver gateway (context binding, argument marshalling, the
ctypes call into the batch entry point) over ``FakeRecordingBindings``: a FAKE of cuda-python
whose copy calls only record their arguments (the batch entry point is a ctypes callback that
reads the count). The driver's own cost of a call is not in these figures.

Usage: python bench/cuda_submit.py [--chunks 1,4,16,64] [--reps 20] [--json OUT]
Prints a table: us of submission CPU per 256-token chunk, and driver calls per request.
"""

from __future__ import annotations

import argparse
import ctypes
import enum
import json
import math
import os
import random
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import parse_args

from lmshm.core.cuda_sync import submit_copies
from lmshm.core.dataplane.layout import BlockLayout, pieces, plan_cuda_copies
from lmshm.platform.cuda.driver import CudaDriver

L, H, N, C, ITEM = 32, 8, 16, 256, 2          # C: K (128) and V (128) along the last dim, bf16
CHUNK_BLOCKS = 16                              # 256 tokens
ORDERS = {"NHD": (0, 1, 3, 2, 4), "HND": (0, 1, 2, 3, 4), "BLHNC": (1, 0, 2, 3, 4)}


class FakeRecordingBindings:
    """A FAKE of ``cuda.bindings.driver``: just enough for the gateway's context binding and its
    copy calls, which record their arguments and copy nothing."""

    class CUresult(enum.IntEnum):
        CUDA_SUCCESS = 0

    class CUmemcpySrcAccessOrder(enum.IntEnum):
        CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1

    class CUmemcpyAttributes:
        def __init__(self) -> None:
            self._raw = ctypes.create_string_buffer(24)
            self.srcAccessOrder = 0

        def getPtr(self) -> int:
            return ctypes.addressof(self._raw)

    def __init__(self) -> None:
        self.ok = self.CUresult.CUDA_SUCCESS
        self.recorded: list[Any] = []
        proto = ctypes.CFUNCTYPE(ctypes.c_int, *([ctypes.c_void_p] * 3), ctypes.c_size_t, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p)
        self._batch = proto(self._record_batch)

    def _record_batch(self, dsts, srcs, sizes, count, attrs, idxs, nattrs, fail, stream) -> int:
        self.recorded.append(count)
        return 0

    def cuInit(self, flags):
        return (self.ok,)

    def cuDeviceGet(self, ordinal):
        return (self.ok, ordinal)

    def cuDevicePrimaryCtxRetain(self, dev):
        return (self.ok, 100)

    def cuCtxGetCurrent(self):
        return (self.ok, 100)

    def CUstream(self, s):
        return s

    def cuGetProcAddress(self, symbol, version, flags):
        return (self.ok, ctypes.cast(self._batch, ctypes.c_void_p).value, 0)

    def cuMemcpyAsync(self, dst, src, n, stream):
        self.recorded.append(n)
        return (self.ok,)


def cache(layout: str, blocks: int) -> tuple[list[str], list[torch.Tensor], int]:
    """Names, tensors and block_dim, allocated as vLLM 0.32 does (memory never touched)."""
    shape = [L, blocks, H, N, C * ITEM]
    order = ORDERS[layout]
    strides, step = [0] * 5, 1
    for d in reversed(order):
        strides[d], step = step, step * shape[d]
    buf = torch.empty(math.prod(shape), dtype=torch.int8)
    v = torch.as_strided(buf, shape, strides).view(torch.bfloat16)
    if layout == "BLHNC":
        return ["kv_cache"], [v], 1
    return [f"model.layers.{i}.self_attn.attn" for i in range(L)], [v[i] for i in range(L)], 0


def _split(obj: torch.Tensor, layout: BlockLayout, chunk_blocks: int) -> list[torch.Tensor]:
    """An object's bytes as one flat uint8 tensor per layer (the copier's split, kept here with
    the path before issue 42 so that this comparison needs no private helper of the copier)."""
    out, at = [], 0
    for plan in layout.layers:
        n = plan.block_bytes * chunk_blocks
        out.append(obj[at:at + n])
        at += n
    return out


def _runs(block_ids) -> list[tuple[int, int, int]]:
    """``(position in the list, first block, count)`` for each run of consecutive block ids."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            pos, first, n = runs[-1]
            runs[-1] = (pos, first, n + 1)
        else:
            runs.append((i, b, 1))
    return runs


def cuda_copies_before(layout: BlockLayout, block_ids, obj: torch.Tensor, chunk_blocks: int, *, store: bool,
                       copy: Any, stream: Any) -> None:
    """lmshm's CUDA copy path before issue 42 (then ``copier.cuda_copies``), for the comparison."""
    runs = _runs(block_ids)
    for plan, part in zip(layout.layers, _split(obj, layout, chunk_blocks)):
        for o, k, n in pieces(plan, runs, chunk_blocks):
            pool_side, kv_side = part[o:o + n], plan.flat[k:k + n]
            copy(pool_side, kv_side, stream) if store else copy(kv_side, pool_side, stream)


def measure(layout_name: str, chunks_list: list[int], reps: int) -> list[dict]:
    most = max(chunks_list)
    names, tensors, block_dim = cache(layout_name, most * CHUNK_BLOCKS)
    layout = BlockLayout.of(names, tensors, block_dim)
    chunk = layout.chunk_bytes(CHUNK_BLOCKS)
    pool = torch.empty(chunk * most, dtype=torch.uint8)          # never touched
    fake = FakeRecordingBindings()
    drv = CudaDriver(fake)
    rows = []
    for n in chunks_list:
        ids = random.Random(n).sample(range(most * CHUNK_BLOCKS), n * CHUNK_BLOCKS)
        objs = [pool[c * chunk:(c + 1) * chunk] for c in range(n)]
        addrs = [o.data_ptr() for o in objs]
        row = {"layout": layout_name, "chunks": n}

        def before() -> int:
            calls = []
            for c in range(n):
                cuda_copies_before(layout, ids[c * CHUNK_BLOCKS:(c + 1) * CHUNK_BLOCKS], objs[c], CHUNK_BLOCKS,
                                   store=True, copy=lambda d, s, st: calls.append(d), stream=None)
            return len(calls)

        def planned(batch: bool) -> int:
            plan = plan_cuda_copies(layout, ids, addrs, CHUNK_BLOCKS, store=True, pool_base=pool.data_ptr(),
                                    extent=256 << 20)
            return submit_copies(drv, plan, 0x5000, 0, batch)

        for name, fn in (("before", before), ("per-piece", lambda: planned(False)), ("batched", lambda: planned(True))):
            calls = fn()                                          # warm-up, and the call count
            times = []
            for _ in range(reps if n < 64 or name == "batched" else max(3, reps // 4)):
                fake.recorded.clear()
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            row[name] = statistics.median(times) / n * 1e6       # us per chunk
            row[name + "_calls"] = calls
        row["pieces"] = len(plan_cuda_copies(layout, ids, addrs, CHUNK_BLOCKS, store=True,
                                             pool_base=pool.data_ptr(), extent=256 << 20))
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", default="1,4,16,64")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json")
    a = parse_args(ap, smoke={"chunks": "1,4", "reps": 2})
    chunks = [int(x) for x in a.chunks.split(",")]
    rows = [r for lay in ORDERS for r in measure(lay, chunks, a.reps)]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("CPU to plan and submit one STORE's copies, us per 256-token chunk (median), and driver calls per "
          "request; Llama-3-8B geometry, shuffled block ids")
    print(f"{'layout':7} {'chunks':>6} {'pieces':>7} | {'before':>8} {'calls':>6} | {'per-piece':>9} {'calls':>6} | "
          f"{'batched':>8} {'calls':>5}")
    for r in rows:
        print(f"{r['layout']:7} {r['chunks']:>6} {r['pieces']:>7} | {r['before']:>8.1f} {r['before_calls']:>6} | "
              f"{r['per-piece']:>9.1f} {r['per-piece_calls']:>6} | {r['batched']:>8.1f} {r['batched_calls']:>5}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
