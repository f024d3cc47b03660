"""How the data plane moves blocks: layouts, the copies themselves, and ordered copier threads.

A registration's layers are tensors whose dim 0 is the block index (vLLM's CPU layout
``[num_blocks, kv_heads, block_size, 2 * head_size]``, a TRT-LLM pool ``[blocks, layers, 2, ...]``).
``BlockLayout`` checks, once per registration, that one block of each layer is at most
``MAX_RUNS`` dense byte runs at a fixed spacing, and builds per layer a uint8 view
``[num_blocks, *run_grid, run_bytes]`` over the server's own mapping. A chunk object in the pool
is, layer after layer, its blocks' runs packed densely. Copies go per layer and run of consecutive block ids:
one ``memmove`` (or a torch ``copy_`` for long runs), straight between the worker's mapping
and the pool: no staging buffer.

``OrderedExecutor`` runs copies on worker threads, never on the request loop, and keeps each
client's jobs in the order it sent them.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import hashlib
import logging
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import torch

logger = logging.getLogger(__name__)

#: Byte runs one block of one layer may take; more is refused with a LAYOUT error.
MAX_RUNS = 8


class LayoutError(ValueError):
    """The registration cannot be moved block by block; the message names the layout."""


@dataclass(frozen=True)
class FileSide:
    """Where a layer's bytes lie in its named shared-memory file, for copies through the file."""

    path: str
    inode: tuple[int, int]    # (st_dev, st_ino) the server mapped: a replaced name is refused
    offset0: int              # file offset of block 0


@dataclass(frozen=True)
class LayerPlan:
    name: str
    view: torch.Tensor        # uint8 [num_blocks, *grid, run_bytes] over the server's mapping
    block_bytes: int
    dense: bool               # one block is one byte run (no grid)
    base: int                 # address of block 0 (CPU)
    block_stride: int         # bytes from one block to the next
    file: FileSide | None = None  # set for dense layers of named shm: copied with preadv/pwritev


@dataclass(frozen=True)
class BlockLayout:
    layers: tuple[LayerPlan, ...]
    num_blocks: int
    block_bytes: int          # one block of every layer
    digest: bytes             # names, dtypes, per-block shapes and strides; not num_blocks
    cuda_device: int = -1     # the registration's GPU (ordinal), or -1 for CPU memory

    def chunk_bytes(self, chunk_blocks: int) -> int:
        return self.block_bytes * chunk_blocks

    @classmethod
    def of(cls, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> "BlockLayout":
        plans = []
        blocks = None
        fingerprint = []
        for name, t in zip(names, tensors):
            plan, desc = _plan_layer(name, t)
            if blocks is None:
                blocks = t.shape[0]
            elif t.shape[0] != blocks:
                raise LayoutError(f"layer {name!r} has {t.shape[0]} blocks, layer {names[0]!r} has {blocks}: "
                                  "every layer of a registration must have the same number of blocks")
            plans.append(plan)
            fingerprint.append((name, desc))
        if not plans:
            raise LayoutError("the registration has no layers")
        digest = hashlib.blake2b(repr(fingerprint).encode(), digest_size=16).digest()
        return cls(tuple(plans), int(blocks), sum(p.block_bytes for p in plans), digest)


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, stride {tuple(t.stride())}, dtype {str(t.dtype).removeprefix('torch.')}"


def _plan_layer(name: str, t: torch.Tensor) -> tuple[LayerPlan, tuple]:
    if t.dim() < 1 or t.shape[0] < 1:
        raise LayoutError(f"layer {name!r} ({_describe(t)}) has no block dimension (dim 0)")
    item = t.element_size()
    dims = [(s, st * item) for s, st in zip(t.shape[1:], t.stride()[1:]) if s != 1]
    if any(st <= 0 for _, st in dims):
        raise LayoutError(f"layer {name!r} ({_describe(t)}) has a zero or negative stride inside a block")
    # The dense tail: dims whose stride is the bytes of everything after them.
    run = item
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    grid = dims
    runs = math.prod(s for s, _ in grid)
    if runs > MAX_RUNS:
        raise LayoutError(
            f"layer {name!r} ({_describe(t)}): one block is {runs} separate byte runs of {run} bytes; the data "
            f"plane moves at most {MAX_RUNS} runs per block (dim 0 must be the block index, and each block "
            "mostly dense)")
    block_stride = t.stride(0) * item
    # No two bytes of the layer may alias (a RETRIEVE into one block would write another):
    # sorted by stride, every dim must step past everything the smaller dims cover.
    extent = run
    for size, step in sorted([*grid, (t.shape[0], block_stride)], key=lambda d: d[1]):
        if size > 1 and step < extent:
            raise LayoutError(f"layer {name!r} ({_describe(t)}): its blocks overlap in memory (a stride of "
                              f"{step} bytes inside a span of {extent})")
        extent += (size - 1) * step
    u8 = torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        t.untyped_storage(), t.storage_offset() * item,
        (t.shape[0], *[s for s, _ in grid], run), (block_stride, *[st for _, st in grid], 1))
    desc = (str(t.dtype), tuple(t.shape[1:]), tuple(t.stride()[1:]))
    return LayerPlan(name, u8, runs * run, not grid, u8.data_ptr(), block_stride), desc


def _split(obj: torch.Tensor, layout: BlockLayout, chunk_blocks: int) -> list[torch.Tensor]:
    """An object's bytes as one ``[chunk_blocks, *grid, run]`` tensor per layer."""
    out, at = [], 0
    for plan in layout.layers:
        n = plan.block_bytes * chunk_blocks
        out.append(obj[at:at + n].view(chunk_blocks, *plan.view.shape[1:]))
        at += n
    return out


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(position in the list, first block, count)`` for each run of consecutive block ids."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            pos, first, n = runs[-1]
            runs[-1] = (pos, first, n + 1)
        else:
            runs.append((i, b, 1))
    return runs


#: A run of at least this many bytes is copied by torch (several threads); shorter ones by
#: one ``memmove`` each, whose call costs ~1 us against ~10 us for a torch ``copy_``.
TORCH_COPY_BYTES = 1 << 20

_memmove = ctypes.memmove


class PoolBytes:
    """The pool as a memoryview, for ``preadv``/``pwritev`` into and out of it."""

    def __init__(self, view: memoryview, addr: int) -> None:
        self.view, self.addr = view, addr

    def at(self, addr: int, n: int) -> memoryview:
        return self.view[addr - self.addr:addr - self.addr + n]


def open_checked(side: FileSide) -> int:
    """An fd for a layer's file, if it is still the file the server mapped; else OSError."""
    fd = os.open(side.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != side.inode:
        os.close(fd)
        raise OSError(errno.ESTALE, f"{side.path} is no longer the segment that was registered")
    return fd


def _grid_offsets(plan: LayerPlan) -> tuple[list[int], int]:
    """Byte offsets of a block's runs inside the block, in packed order, and the run's bytes."""
    sizes, strides, run = plan.view.shape[1:-1], plan.view.stride()[1:-1], plan.view.shape[-1]
    offsets = [0]
    for size, stride in zip(sizes, strides):
        offsets = [o + i * stride for o in offsets for i in range(size)]
    return offsets, run


def _file_runs(plan: LayerPlan, obj_layer: torch.Tensor, runs: list[tuple[int, int, int]], store: bool,
               pool: PoolBytes) -> None:
    """Copy through the file, not the mapping: a segment its owner truncates or punches holes in
    makes ``preadv`` return short (refused below) instead of killing the server with SIGBUS,
    and ``pwritev`` only writes the file again."""
    side, bb, stride = plan.file, plan.block_bytes, plan.block_stride
    obj = obj_layer.data_ptr()
    if plan.dense and stride == bb:       # a run of consecutive blocks is one range of the file
        pieces = [(obj + pos * bb, side.offset0 + first * bb, n * bb) for pos, first, n in runs]
    else:                                 # block by block, run by run
        offsets, run = _grid_offsets(plan)
        pieces = [(obj + (pos + j) * bb + k * run, side.offset0 + (first + j) * stride + off, run)
                  for pos, first, n in runs for j in range(n) for k, off in enumerate(offsets)]
    fd = open_checked(side)
    try:
        for addr, off, n in pieces:
            mv = pool.at(addr, n)
            done = os.preadv(fd, [mv], off) if store else os.pwritev(fd, [mv], off)
            if done != n:
                raise OSError(errno.EIO, f"{side.path} was truncated during the copy ({done} of {n} bytes "
                                         f"at offset {off})")
    finally:
        os.close(fd)


def _copy_runs(plan: LayerPlan, obj_layer: torch.Tensor, runs: list[tuple[int, int, int]], *, store: bool,
               pool: PoolBytes | None = None) -> None:
    bb = plan.block_bytes
    if plan.file is not None and pool is not None:
        _file_runs(plan, obj_layer, runs, store, pool)
        return
    if plan.dense and plan.view.device.type == "cpu":
        obj_base = obj_layer.data_ptr()
        for pos, first, n in runs:
            if n * bb >= TORCH_COPY_BYTES and plan.block_stride == bb:
                a, b = obj_layer[pos:pos + n], plan.view[first:first + n]
                (a.copy_(b) if store else b.copy_(a))
            elif plan.block_stride == bb:
                o, k = obj_base + pos * bb, plan.base + first * bb
                _memmove(o, k, n * bb) if store else _memmove(k, o, n * bb)
            else:
                for j in range(n):
                    o, k = obj_base + (pos + j) * bb, plan.base + (first + j) * plan.block_stride
                    _memmove(o, k, bb) if store else _memmove(k, o, bb)
        return
    for pos, first, n in runs:
        a, b = obj_layer[pos:pos + n], plan.view[first:first + n]
        (a.copy_(b) if store else b.copy_(a))


#: Helpers that split one large copy of short runs by layer (ctypes drops the GIL in memmove).
_SPLIT_THREADS = 2
_SPLIT_BYTES = 8 << 20
_splitter: ThreadPoolExecutor | None = None
_splitter_lock = threading.Lock()


def _each_layer(layout: BlockLayout, block_ids: Sequence[int], obj: torch.Tensor, chunk_blocks: int,
                store: bool, pool: PoolBytes | None) -> None:
    global _splitter
    runs = _runs(block_ids)
    pairs = list(zip(layout.layers, _split(obj, layout, chunk_blocks)))
    # Split what no torch copy parallelises: short runs (memmove) and copies through files
    # (preadv/pwritev; the kernel's copy runs on the calling thread).
    short = (len(runs) * 2 > len(block_ids) or runs[0][2] * layout.layers[0].block_bytes < TORCH_COPY_BYTES
             or (store and pool is not None and layout.layers[0].file is not None))
    # (Not pwritev: writers of one tmpfs file serialise on its inode lock; two threads were slower.)
    if short and len(pairs) > 1 and layout.chunk_bytes(chunk_blocks) >= _SPLIT_BYTES:
        with _splitter_lock:
            if _splitter is None:
                _splitter = ThreadPoolExecutor(_SPLIT_THREADS, thread_name_prefix="lmshm-copy-split")
        half = len(pairs) // 2
        other = _splitter.submit(lambda: [_copy_runs(p, o, runs, store=store, pool=pool) for p, o in pairs[half:]])
        for p, o in pairs[:half]:
            _copy_runs(p, o, runs, store=store, pool=pool)
        other.result()
        return
    for p, o in pairs:
        _copy_runs(p, o, runs, store=store, pool=pool)


def cuda_copies(layout: BlockLayout, block_ids: Sequence[int], obj: torch.Tensor, chunk_blocks: int,
                *, store: bool, copy: Any, stream: Any) -> None:
    """The copies of one chunk on a CUDA registration, queued with ``copy(dst, src, stream)``
    (one per layer and run of consecutive blocks; the caller's stream orders them)."""
    runs = _runs(block_ids)
    for plan, part in zip(layout.layers, _split(obj, layout, chunk_blocks)):
        for pos, first, n in runs:
            pool_side, kv_side = part[pos:pos + n], plan.view[first:first + n]
            copy(pool_side, kv_side, stream) if store else copy(kv_side, pool_side, stream)


def gather(layout: BlockLayout, block_ids: Sequence[int], obj: torch.Tensor, chunk_blocks: int,
           pool: PoolBytes | None = None) -> None:
    """STORE: copy blocks ``block_ids`` of every layer into ``obj`` (a pool object's bytes).
    With ``pool``, layers that have a ``file`` are read through it."""
    _each_layer(layout, block_ids, obj, chunk_blocks, store=True, pool=pool)


def scatter(layout: BlockLayout, block_ids: Sequence[int], obj: torch.Tensor, chunk_blocks: int,
            pool: PoolBytes | None = None) -> None:
    """RETRIEVE: copy ``obj`` into blocks ``block_ids`` of every layer.

    Per run of consecutive block ids, not torch's ``index_copy_``/``index_put_``, which reach
    only 2-3 GB/s here (bench/dataplane.py)."""
    _each_layer(layout, block_ids, obj, chunk_blocks, store=False, pool=pool)


class OrderedExecutor:
    """Jobs run on ``threads`` worker threads; jobs of one key run one at a time, in order."""

    def __init__(self, threads: int) -> None:
        self._threads = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="lmshm-copy")
        self._lock = threading.Lock()
        self._queues: dict[Hashable, collections.deque] = {}
        self._closed = False

    def submit(self, key: Hashable, job: Callable[[], None], cancel: Callable[[], None]) -> None:
        """Queue ``job`` behind ``key``'s earlier jobs. ``cancel`` runs instead if the executor
        shuts down first."""
        with self._lock:
            if self._closed:
                start = False
            else:
                queue = self._queues.get(key)
                start = queue is None
                if start:
                    queue = self._queues[key] = collections.deque()
                queue.append((job, cancel))
        if self._closed:
            cancel()
        elif start:
            self._threads.submit(self._drain, key)

    def pending(self, key: Hashable) -> int:
        with self._lock:
            queue = self._queues.get(key)
            return len(queue) if queue is not None else 0

    def _drain(self, key: Hashable) -> None:
        while True:
            with self._lock:
                queue = self._queues[key]
                if not queue:
                    del self._queues[key]
                    return
                job, cancel = queue[0]
                closed = self._closed
            try:
                (cancel if closed else job)()
            except Exception:  # noqa: BLE001 - jobs answer their own errors; this is a bug
                logger.exception("lmshm: a copy job failed")
            with self._lock:
                queue.popleft()

    def shutdown(self) -> None:
        """Cancel queued jobs, wait for running ones."""
        with self._lock:
            self._closed = True
        self._threads.shutdown(wait=True)
