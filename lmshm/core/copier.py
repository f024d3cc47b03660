"""How the data plane moves blocks: layouts, the copies themselves, and ordered copier threads.

A registration names its **block dimension** (``block_dim``, 0 unless it says otherwise): the
dim of every layer tensor whose index is the block id. vLLM 0.32's per-layer ``[B, H, N, C]``
views have it first; a whole ``[L, B, H, N, C]`` cache, or an older K/V-first layer
``(2, num_blocks, ...)``, second. ``BlockLayout`` takes that dim as the block index (as
``movedim(block_dim, 0)`` would) and orders the other dims by stride, largest first: the order
their bytes lie in memory, whatever permuted view (NHD over HND) the engine hands out. The
innermost dims that are dense form one *run*; the other dims inside a block make a grid of at
most ``MAX_RUNS`` runs (K/V-first layouts: 2; vLLM's head-major layout: one per KV head). The
plan is arithmetic on shape, stride and dtype (``geometry``), so a worker can run it without a
server (``check_movable``). Each layer's part of a chunk object in the
pool is ``[grid][block][run]``: runs of one grid position are packed block after block, so a run
of consecutive block ids whose runs follow each other in memory (K of blocks 4..7 in a
K/V-first layout) is one contiguous copy on both sides. Every copy -- ``memmove`` (a torch
``copy_`` for pieces of 1 MiB or more) through the mapping of memory the server maps safely (a
sealed memfd), ``preadv``/``pwritev`` through a named-shm file, a CUDA async copy -- is such a
contiguous piece: no staging buffer, no strided copy. A CUDA request's pieces are planned for
all its chunks at once with numpy (``plan_cuda_copies``: a per-layout template broadcast
against the block ids, cut at the pool's pin extents) and queued in one driver call.

The layout digest (stored with each object) covers names, dtypes, block_dim, each layer's block
shape, the memory order of its dims and where its runs split, not ``num_blocks``: bytes packed
from one layout are never copied into a registration of another.

``OrderedExecutor`` runs copies on worker threads, never on the request loop, and keeps each
client's jobs in the order it sent them.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import functools
import hashlib
import logging
import math
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)

#: Byte runs one block of one layer may take; more is refused with a LAYOUT error.
MAX_RUNS = 8
#: Bumped when the packing of chunk objects changes: part of every layout digest.
_PACKING = 2


class LayoutError(ValueError):
    """The registration cannot be moved block by block; the message names the layout."""


@dataclass(frozen=True)
class FileSide:
    """Where a layer's bytes lie in its named shared-memory file, for copies through the file."""

    path: str
    inode: tuple[int, int]    # (st_dev, st_ino) the server mapped: a replaced name is refused
    offset0: int              # file offset of block 0's first byte


@dataclass(frozen=True)
class Geometry:
    """How one block of one layer lies in memory (pure arithmetic on shape, stride, dtype)."""

    num_blocks: int
    block_stride: int         # bytes from one block to the next
    run: int                  # bytes of one dense run
    offsets: tuple[int, ...]  # byte offset of each run from the block's first byte, packed order
    desc: tuple               # what the digest covers for this layer

    @property
    def block_bytes(self) -> int:
        return self.run * len(self.offsets)


@dataclass(frozen=True)
class LayerPlan:
    name: str
    flat: torch.Tensor        # uint8 over the layer's whole storage (the server's mapping)
    start: int                # index in ``flat`` of block 0's first byte
    geometry: Geometry
    file: FileSide | None = None  # named shm: copied with preadv/pwritev through this file

    @property
    def block_bytes(self) -> int:
        return self.geometry.block_bytes

    @property
    def block_stride(self) -> int:
        return self.geometry.block_stride

    @property
    def dense(self) -> bool:
        """One block is one byte run."""
        return len(self.geometry.offsets) == 1

    @property
    def base(self) -> int:
        """Address of block 0's first byte."""
        return self.flat.data_ptr() + self.start

    @functools.cached_property
    def rows(self) -> list[np.ndarray]:
        """Per grid position, the layer's blocks as the rows of a ``[num_blocks, run]`` numpy
        view of the mapping (CPU layers whose runs of one grid position are back to back)."""
        g, flat = self.geometry, self.flat.numpy()
        size = g.num_blocks * g.run
        return [flat[self.start + off:self.start + off + size].reshape(g.num_blocks, g.run) for off in g.offsets]


@dataclass(frozen=True)
class BlockLayout:
    layers: tuple[LayerPlan, ...]
    num_blocks: int

    @functools.cached_property
    def rows(self) -> bool:
        """Every layer is on the CPU, copied through its mapping (not a file), and the runs of one
        grid position follow each other block after block (every dense layer; K/V-first layers
        too): the copies go by ``_take_or_put``, rows of numpy views."""
        return all(p.file is None and p.flat.device.type == "cpu" and p.geometry.block_stride == p.geometry.run
                   for p in self.layers)
    block_bytes: int          # one block of every layer
    digest: bytes             # see the module docstring; not num_blocks
    cuda_device: int = -1     # the registration's GPU (ordinal), or -1 for CPU memory
    block_dim: int = 0

    def chunk_bytes(self, chunk_blocks: int) -> int:
        return self.block_bytes * chunk_blocks

    @classmethod
    def of(cls, names: Sequence[str], tensors: Sequence[torch.Tensor], block_dim: int = 0) -> "BlockLayout":
        """Plan every layer; ``block_dim`` indexes each tensor's dims (the caller's logical
        shape). Raises ``LayoutError`` naming the first layer that cannot be moved."""
        geometries = _geometries(names, tensors, block_dim)
        plans = tuple(_plan_layer(name, t, g) for name, t, g in zip(names, tensors, geometries))
        fingerprint = (_PACKING, block_dim, [(name, g.desc) for name, g in zip(names, geometries)])
        digest = hashlib.blake2b(repr(fingerprint).encode(), digest_size=16).digest()
        return cls(plans, geometries[0].num_blocks, sum(g.block_bytes for g in geometries), digest,
                   block_dim=block_dim)


def check_movable(names: Sequence[str], tensors: Sequence[torch.Tensor], block_dim: int = 0) -> None:
    """Raise ``LayoutError`` unless the data plane can move these layers along ``block_dim``.

    What the server checks at the first STORE or RETRIEVE, without a server: a worker calls it
    before it registers (shape, stride and dtype only; the memory is not touched)."""
    _geometries(names, tensors, block_dim)


def _geometries(names: Sequence[str], tensors: Sequence[torch.Tensor], block_dim: int) -> list[Geometry]:
    names, tensors = list(names), list(tensors)
    if not tensors:
        raise LayoutError("the registration has no layers")
    if len(names) != len(tensors):
        raise LayoutError(f"{len(names)} layer names for {len(tensors)} tensors")
    out: list[Geometry] = []
    for name, t in zip(names, tensors):
        g = geometry(name, tuple(t.shape), tuple(t.stride()), t.element_size(), str(t.dtype), block_dim)
        if out and g.num_blocks != out[0].num_blocks:
            raise LayoutError(f"layer {name!r} has {g.num_blocks} blocks along dim {block_dim}, layer {names[0]!r} "
                              f"has {out[0].num_blocks}: every layer of a registration must have the same number "
                              "of blocks")
        out.append(g)
    return out


def _describe(shape: Sequence[int], stride: Sequence[int], dtype: str) -> str:
    return f"shape {tuple(shape)}, stride {tuple(stride)}, dtype {dtype.removeprefix('torch.')}"


def geometry(name: str, shape: tuple[int, ...], stride: tuple[int, ...], item: int, dtype: str,
             block_dim: int = 0) -> Geometry:
    """One layer's block geometry along ``block_dim``, or ``LayoutError`` saying why it cannot be
    moved. Strides are in elements, as torch gives them."""
    what = _describe(shape, stride, dtype)
    if not 0 <= block_dim < len(shape):
        raise LayoutError(f"layer {name!r} ({what}): block_dim {block_dim} is not one of its "
                          f"{len(shape)} dimensions")
    if shape[block_dim] < 1:
        raise LayoutError(f"layer {name!r} ({what}) has no blocks along dim {block_dim}")
    # The dims inside a block, in memory order: by stride, largest first (stable for ties).
    inner = [(d, shape[d], stride[d] * item) for d in range(len(shape)) if d != block_dim and shape[d] != 1]
    if any(st <= 0 for _, _, st in inner):
        raise LayoutError(f"layer {name!r} ({what}) has a zero or negative stride inside a block")
    inner.sort(key=lambda d: -d[2])
    # The dense tail: dims whose stride is the bytes of everything after them.
    run, tail = item, 0
    while tail < len(inner) and inner[-1 - tail][2] == run:
        run *= inner[-1 - tail][1]
        tail += 1
    grid = inner[:len(inner) - tail]
    runs = math.prod(size for _, size, _ in grid)
    if runs > MAX_RUNS:
        raise LayoutError(
            f"layer {name!r} ({what}): along block_dim {block_dim}, one block is {runs} separate byte runs of "
            f"{run} bytes; the data plane moves at most {MAX_RUNS} runs per block (block_dim must name the "
            "block index, and each block must be mostly dense)")
    block_stride = stride[block_dim] * item
    # No two bytes of the layer may alias (a RETRIEVE into one block would write another):
    # sorted by stride, every dim must step past everything the smaller dims cover.
    extent = run
    steps = [(size, st) for _, size, st in grid] + [(shape[block_dim], block_stride)]
    for size, step in sorted(steps, key=lambda d: d[1]):
        if size > 1 and step < extent:
            raise LayoutError(f"layer {name!r} ({what}): its blocks overlap in memory (a stride of "
                              f"{step} bytes inside a span of {extent})")
        extent += (size - 1) * step
    offsets = [0]
    for _, size, st in grid:
        offsets = [o + i * st for o in offsets for i in range(size)]
    block_shape = tuple(s for d, s in enumerate(shape) if d != block_dim)
    order = tuple(d for d, _, _ in inner)   # logical dims (size > 1), in memory order
    desc = (dtype, block_shape, order, len(grid))
    return Geometry(shape[block_dim], block_stride, run, tuple(offsets), desc)


def _plan_layer(name: str, t: torch.Tensor, g: Geometry) -> LayerPlan:
    item = t.element_size()
    flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    start = t.storage_offset() * item
    end = start + (g.num_blocks - 1) * g.block_stride + g.offsets[-1] + g.run
    if end > flat.numel():  # the tensor's own view guarantees this; checked, not assumed
        raise LayoutError(f"layer {name!r} ({_describe(t.shape, t.stride(), str(t.dtype))}) reaches byte {end} "
                          f"of a storage of {flat.numel()}")
    return LayerPlan(name, flat, start, g)


def _split(obj: torch.Tensor, layout: BlockLayout, chunk_blocks: int) -> list[torch.Tensor]:
    """An object's bytes as one flat uint8 tensor per layer (``[grid][block][run]`` each)."""
    out, at = [], 0
    for plan in layout.layers:
        n = plan.block_bytes * chunk_blocks
        out.append(obj[at:at + n])
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


def pieces(plan: LayerPlan, runs: list[tuple[int, int, int]], chunk_blocks: int) -> list[tuple[int, int, int]]:
    """The contiguous copies of one layer: ``(offset in the layer's part of the object, offset in
    ``plan.flat``, bytes)``. Consecutive blocks merge when their runs follow each other in memory."""
    g = plan.geometry
    run, stride = g.run, g.block_stride
    out: list[tuple[int, int, int]] = []
    for k, off in enumerate(g.offsets):
        obj0, kv0 = k * chunk_blocks * run, plan.start + off
        for pos, first, n in runs:
            if n == 1 or stride == run:
                out.append((obj0 + pos * run, kv0 + first * stride, n * run))
            else:
                out.extend((obj0 + (pos + j) * run, kv0 + (first + j) * stride, run) for j in range(n))
    return out


#: A piece of at least this many bytes is copied by torch (several threads); shorter ones by
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


def _file_pieces(plan: LayerPlan, obj_layer: torch.Tensor, todo: list[tuple[int, int, int]], store: bool,
                 pool: PoolBytes) -> None:
    """Copy through the file, not the mapping: a segment its owner truncates or punches holes in
    makes ``preadv`` return short (refused below) instead of killing the server with SIGBUS,
    and ``pwritev`` only writes the file again."""
    side = plan.file
    obj, shift = obj_layer.data_ptr(), side.offset0 - plan.start   # file offset of flat[i]: i + shift
    fd = open_checked(side)
    try:
        for o, k, n in todo:
            mv = pool.at(obj + o, n)
            off = k + shift
            done = os.preadv(fd, [mv], off) if store else os.pwritev(fd, [mv], off)
            if done != n:
                raise OSError(errno.EIO, f"{side.path} was truncated during the copy ({done} of {n} bytes "
                                         f"at offset {off})")
    finally:
        os.close(fd)


def _take_or_put(plan: LayerPlan, obj_all: np.ndarray, ids: np.ndarray, chunk_blocks: int, store: bool) -> None:
    """Per grid position, the blocks as rows of a ``[num_blocks, run]`` array: STORE ``np.take``
    of the rows ``ids`` into the object's ``[blocks, run]`` part, RETRIEVE an indexed assignment
    back. Both loop in C with the GIL released, one ``memmove`` per row: two copier threads run
    at once, where a Python loop of ``memmove`` calls spends their time taking turns at the GIL
    (a shuffled 256 MiB request: 0.60x of one memcpy that way, 0.9-1.1x this way; docs/benchmarks.md).
    ``mode="clip"``: ``out`` is then written directly (the default ``"raise"`` buffers it);
    the ids were checked against ``num_blocks`` already, so nothing is clipped."""
    g = plan.geometry
    n = len(ids) * g.run
    for k, kv in enumerate(plan.rows):
        obj0 = k * chunk_blocks * g.run
        part = obj_all[obj0:obj0 + n].reshape(len(ids), g.run)
        if store:
            np.take(kv, ids, axis=0, out=part, mode="clip")
        else:
            kv[ids] = part


def _copy_layer(plan: LayerPlan, obj_layer: torch.Tensor, runs: list[tuple[int, int, int]], chunk_blocks: int,
                *, store: bool, pool: PoolBytes | None = None) -> None:
    todo = pieces(plan, runs, chunk_blocks)
    if plan.file is not None and pool is not None:
        _file_pieces(plan, obj_layer, todo, store, pool)
        return
    if plan.flat.device.type == "cpu":
        obj, kv = obj_layer.data_ptr(), plan.flat.data_ptr()
        for o, k, n in todo:
            if n >= TORCH_COPY_BYTES:
                a, b = obj_layer[o:o + n], plan.flat[k:k + n]
                (a.copy_(b) if store else b.copy_(a))
            else:
                _memmove(obj + o, kv + k, n) if store else _memmove(kv + k, obj + o, n)
        return
    for o, k, n in todo:
        a, b = obj_layer[o:o + n], plan.flat[k:k + n]
        (a.copy_(b) if store else b.copy_(a))


def copy_parallelism() -> int:
    """Threads that share one large CPU copy: the CPUs this process may run on, at most 8 (one
    thread rarely fills a machine's memory bandwidth; past a few, they only compete for it)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


#: A chunk of at least this many bytes is split by layer over ``copy_parallelism()`` threads.
_SPLIT_BYTES = 1 << 20
#: Chunks smaller than this are copied on the calling thread, one by one: a numpy call on a few
#: hundred bytes is mostly Python, so two threads would only take turns at the GIL, and take it
#: from the request loop too (4,096 chunks of 256 bytes in one STORE, under a flood).
_BATCH_CHUNK_BYTES = 64 << 10
_splitter: ThreadPoolExecutor | None = None
_splitter_lock = threading.Lock()


def _layer_parts(layout: BlockLayout, obj: torch.Tensor, chunk_blocks: int) -> list[tuple[LayerPlan, np.ndarray]]:
    """Each layer with its part of the object, as a numpy view (``[grid][block][run]``)."""
    obj_all, at, pairs = obj.numpy(), 0, []
    for p in layout.layers:
        n = p.block_bytes * chunk_blocks
        pairs.append((p, obj_all[at:at + n]))
        at += n
    return pairs


def _each_layer(layout: BlockLayout, block_ids: Sequence[int], obj: torch.Tensor, chunk_blocks: int,
                store: bool, pool: PoolBytes | None) -> None:
    if block_ids and (min(block_ids) < 0 or max(block_ids) >= layout.num_blocks):
        raise ValueError(f"block ids must lie in [0, {layout.num_blocks}), got {min(block_ids)}..{max(block_ids)}")
    if layout.rows:
        ids = np.asarray(block_ids, dtype=np.intp)
        pairs = _layer_parts(layout, obj, chunk_blocks)

        def copy(p: LayerPlan, o: Any) -> None:
            _take_or_put(p, o, ids, chunk_blocks, store)
        short = True
    else:
        runs = _runs(block_ids)
        pairs = list(zip(layout.layers, _split(obj, layout, chunk_blocks)))

        def copy(p: LayerPlan, o: Any) -> None:
            _copy_layer(p, o, runs, chunk_blocks, store=store, pool=pool)
        # Split what no torch copy parallelises: short runs (memmove; ctypes drops the GIL) and
        # copies through files (preadv/pwritev; the kernel's copy runs on the calling thread).
        # (numpy's row copies above are always split: they drop the GIL for the whole layer.)
        short = (len(runs) * 2 > len(block_ids) or runs[0][2] * layout.layers[0].geometry.run < TORCH_COPY_BYTES
                 or (store and pool is not None and layout.layers[0].file is not None))
    ways = min(copy_parallelism(), len(pairs))
    # (Not pwritev of long runs: writers of one tmpfs file serialise on its inode lock; two threads were slower.)
    if short and ways > 1 and layout.chunk_bytes(chunk_blocks) >= _SPLIT_BYTES:
        # Contiguous runs of layers: each thread writes its own stretch of the object, so two
        # threads never fault the same (huge) pool page at once.
        # Taken from a shared queue of stretches, 4 per thread: a thread held up (by the loop,
        # another request) leaves its later stretches to the others.
        n = ways * 4 if len(pairs) >= ways * 4 else ways
        cut = [len(pairs) * i // n for i in range(n + 1)]
        stretches = iter([pairs[cut[i]:cut[i + 1]] for i in range(n)])

        def layers() -> None:
            for part in stretches:          # a list iterator hands each stretch out once
                for p, o in part:
                    copy(p, o)

        _on_threads(layers, ways)
        return
    for p, o in pairs:
        copy(p, o)


def _threads() -> ThreadPoolExecutor:
    global _splitter
    with _splitter_lock:
        if _splitter is None:
            _splitter = ThreadPoolExecutor(copy_parallelism(), thread_name_prefix="lmshm-copy-split")
        return _splitter


def _on_threads(work: Callable[[], None], ways: int) -> None:
    """Run ``work`` on this thread and ``ways - 1`` copy threads at once (each takes its share
    from a queue ``work`` shares), and return when all have; their first error is raised."""
    others = [_threads().submit(work) for _ in range(ways - 1)]
    try:
        work()
    finally:
        for f in others:
            f.result()


def copy_chunks(layout: BlockLayout, chunks: Sequence[tuple[Sequence[int], torch.Tensor]], chunk_blocks: int,
                *, store: bool, pool: PoolBytes | None = None) -> tuple[int, BaseException | None]:
    """The chunks of one request: STORE (``store``) gathers blocks ``ids`` into each object,
    RETRIEVE scatters each object into them. Returns ``(len(chunks), None)``, or the index of the
    first chunk that failed and why (later ones may have been copied or not: the caller treats
    them as not copied).

    Row layouts (``BlockLayout.rows``) of 1 MiB or more go as one batch over
    ``copy_parallelism()`` threads: units of whole chunks, or of stretches of a chunk's layers
    when the request has fewer chunks than about 4 per thread, taken from one shared queue, so
    the threads hand over once per request instead of once per chunk (a 256 MiB request of
    4 MiB chunks had 64 hand-overs). A unit writes a contiguous stretch of one object (STORE) or
    reads one (RETRIEVE). Other layouts go chunk by chunk (``gather``/``scatter``)."""
    ways = copy_parallelism()
    chunk = layout.chunk_bytes(chunk_blocks)
    if not layout.rows or ways < 2 or len(chunks) < 2 or chunk * len(chunks) < _SPLIT_BYTES \
            or chunk < _BATCH_CHUNK_BYTES:
        for c, (ids, obj) in enumerate(chunks):
            try:
                _each_layer(layout, ids, obj, chunk_blocks, store=store, pool=pool)
            except Exception as exc:
                return c, exc
        return len(chunks), None
    per_chunk = min(len(layout.layers), max(1, -(-4 * ways // len(chunks))))
    units: list[tuple[int, np.ndarray, list]] = []
    errors: list[BaseException | None] = [None] * len(chunks)
    for c, (ids, obj) in enumerate(chunks):
        if ids and (min(ids) < 0 or max(ids) >= layout.num_blocks):
            # copied: the chunks before it; this one and later ones are not
            errors[c] = ValueError(f"block ids must lie in [0, {layout.num_blocks}), got {min(ids)}..{max(ids)}")
            break
        rows = np.asarray(ids, dtype=np.intp)
        pairs = _layer_parts(layout, obj, chunk_blocks)
        cut = [len(pairs) * i // per_chunk for i in range(per_chunk + 1)]
        units += [(c, rows, pairs[cut[i]:cut[i + 1]]) for i in range(per_chunk)]
    queue = iter(units)                     # a list iterator hands each unit out once

    def work() -> None:
        for c, rows, part in queue:
            if errors[c] is not None:
                continue
            try:
                for p, o in part:
                    _take_or_put(p, o, rows, chunk_blocks, store)
            except Exception as exc:
                errors[c] = exc

    _on_threads(work, min(ways, len(units) or 1))
    bad = next((c for c, e in enumerate(errors) if e is not None), None)
    return (len(chunks), None) if bad is None else (bad, errors[bad])


@dataclass(frozen=True)
class CopyPlan:
    """One request's CUDA copies as three equal-length ``uint64`` arrays: destination and source
    addresses and byte counts, every piece contiguous on both sides (``plan_cuda_copies``)."""

    dst: np.ndarray
    src: np.ndarray
    size: np.ndarray

    def __len__(self) -> int:
        return len(self.size)

    @property
    def nbytes(self) -> int:
        return int(self.size.sum())


@dataclass(frozen=True)
class _Template:
    """Per (layer, run of a block) -- a template entry -- the address of block 0's run in the KV
    cache and the byte distance from one block to the next; per entry and position in a chunk,
    the piece's offset in a chunk object and its bytes (``[entries, chunk_blocks]``)."""

    kv0: np.ndarray
    stride: np.ndarray
    obj_off: np.ndarray
    size: np.ndarray


def _template(layout: BlockLayout, chunk_blocks: int) -> _Template:
    cache = layout.__dict__.setdefault("_cuda_templates", {})   # frozen: cached by hand, like cached_property
    t = cache.get(chunk_blocks)
    if t is None:
        kv0, stride, run, start, at = [], [], [], [], 0
        for p in layout.layers:
            g = p.geometry
            for k, off in enumerate(g.offsets):
                kv0.append(p.base + off)
                stride.append(g.block_stride)
                run.append(g.run)
                start.append((at + k * g.run) * chunk_blocks)   # object: [layer][grid][block][run]
            at += g.block_bytes
        run_, pos = np.asarray(run, dtype=np.int64)[:, None], np.arange(chunk_blocks, dtype=np.int64)[None, :]
        t = _Template(np.asarray(kv0, dtype=np.int64)[:, None], np.asarray(stride, dtype=np.int64)[:, None],
                      np.asarray(start, dtype=np.int64)[:, None] + pos * run_,
                      np.broadcast_to(run_, (len(run), chunk_blocks)))
        cache[chunk_blocks] = t
    return t


def plan_cuda_copies(layout: BlockLayout, block_ids: Any, objs: Any, chunk_blocks: int, *, store: bool,
                     pool_base: int = 0, extent: int = 0) -> CopyPlan:
    """The copies of a request's chunks on a CUDA registration, computed with numpy, not a
    Python loop per piece.

    ``block_ids``: ``[chunks, chunk_blocks]`` (or flat, ``chunk_blocks`` per chunk); ``objs``:
    each chunk object's address in the pool. The layout's template (one entry per layer and
    run of a block, made once per chunk size) is broadcast against the block ids into
    ``[chunk][layer, run][block]`` pieces; neighbouring pieces that follow each other on both
    sides merge into one (a run of consecutive block ids in a K/V-first or block-outermost
    layout; layers that lie back to back). With ``extent`` > 0 a piece is then cut where its
    pool side crosses a multiple of ``extent`` from ``pool_base``: the pool is page-locked in
    extents, and the driver refuses a copy whose host range is registered in part
    (``cuda_sync.TorchCudaSync.pin``)."""
    t = _template(layout, chunk_blocks)
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1, 1, chunk_blocks)
    obj = np.asarray(objs, dtype=np.int64).reshape(-1, 1, 1)
    if len(obj) != len(ids):
        raise ValueError(f"{len(obj)} chunk objects for {len(ids)} chunks of {chunk_blocks} blocks")
    if ids.size and (ids.min() < 0 or ids.max() >= layout.num_blocks):
        raise ValueError(f"block ids must lie in [0, {layout.num_blocks}), got {ids.min()}..{ids.max()}")
    # [chunk, template entry, block]: the block axis last, so that consecutive ids are neighbours
    kv = (t.kv0 + ids * t.stride).reshape(-1)
    pool = (obj + t.obj_off).reshape(-1)
    size = np.broadcast_to(t.size, (len(obj), *t.size.shape)).reshape(-1)
    if len(size) > 1:
        end = kv[:-1] + size[:-1]
        joins = end == kv[1:]
        joins &= (pool[:-1] + size[:-1]) == pool[1:]
        if joins.any():
            first = np.flatnonzero(np.concatenate(([True], ~joins)))
            kv, pool, size = kv[first], pool[first], np.add.reduceat(size, first)
    if extent > 0 and len(size):
        rel = obj.reshape(-1) - pool_base          # only pieces of an object that crosses an edge can
        if (rel // extent != (rel + layout.chunk_bytes(chunk_blocks) - 1) // extent).any():
            kv, pool, size = _split_at_extents(kv, pool, size, pool_base, extent)
    u = np.uint64
    return CopyPlan(pool.view(u), kv.view(u), size.astype(u)) if store else \
        CopyPlan(kv.view(u), pool.view(u), size.astype(u))


def _split_at_extents(kv: np.ndarray, pool: np.ndarray, size: np.ndarray, base: int,
                      extent: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut each piece where its pool side ``[pool, pool + size)`` crosses ``base + i * extent``."""
    rel = pool - base
    first = rel // extent
    parts = (rel + size - 1) // extent - first + 1
    if (parts == 1).all():
        return kv, pool, size
    idx = np.repeat(np.arange(len(size)), parts)
    nth = np.arange(len(idx)) - np.repeat(np.cumsum(parts) - parts, parts)   # 0, 1, .. within a piece
    lo = np.maximum(rel[idx], (first[idx] + nth) * extent)
    hi = np.minimum(rel[idx] + size[idx], (first[idx] + nth + 1) * extent)
    shift = lo - rel[idx]
    return kv[idx] + shift, pool[idx] + shift, hi - lo


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
    """Jobs run on ``threads`` worker threads; jobs of one key run one at a time, in order.

    The workers are this class's own, started with the first job and blocked on a
    ``queue.SimpleQueue`` of keys that have jobs, not a ``ThreadPoolExecutor``: its ``submit``
    (a future, a work item, a Python semaphore) cost the request loop about 24 µs a job here
    against 5 for a ``SimpleQueue.put``, and its worker ran more Python (holding the GIL the
    loop waits for to send the reply) after each job (docs/benchmarks.md, "Hand-overs")."""

    def __init__(self, threads: int, name: str = "lmshm-copy") -> None:
        self._size = max(1, threads)
        self._name = name
        self._workers: list[threading.Thread] = []
        self._ready: queue.SimpleQueue[Hashable | None] = queue.SimpleQueue()   # keys whose jobs wait
        self._lock = threading.Lock()
        self._queues: dict[Hashable, collections.deque] = {}
        self._closed = False

    def submit(self, key: Hashable, job: Callable[[], None], cancel: Callable[[], None]) -> None:
        """Queue ``job`` behind ``key``'s earlier jobs. ``cancel`` runs instead if the executor
        shuts down first."""
        with self._lock:
            refused = self._closed
            if not refused:
                queue_ = self._queues.get(key)
                if queue_ is None:
                    queue_ = self._queues[key] = collections.deque()
                    if len(self._workers) < self._size:
                        self._start_worker()
                    self._ready.put(key)    # under the lock: never behind shutdown's stop marks
                queue_.append((job, cancel))
        if refused:
            cancel()

    def _start_worker(self) -> None:
        """One more worker (under ``_lock``): the first jobs start them, up to ``threads``."""
        worker = threading.Thread(target=self._work, name=f"{self._name}_{len(self._workers)}", daemon=True)
        self._workers.append(worker)
        worker.start()

    def pending(self, key: Hashable) -> int:
        with self._lock:
            queue_ = self._queues.get(key)
            return len(queue_) if queue_ is not None else 0

    def idle(self) -> bool:
        """No job is queued or running (a hint: one may be submitted right after)."""
        return not self._queues

    def _work(self) -> None:
        while True:
            key = self._ready.get()
            if key is None:             # shutdown: each worker takes one, after the keys before it
                return
            self._drain(key)

    def _drain(self, key: Hashable) -> None:
        while True:
            with self._lock:
                queue_ = self._queues[key]
                if not queue_:
                    del self._queues[key]
                    return
                job, cancel = queue_[0]
                closed = self._closed
            try:
                (cancel if closed else job)()
            except Exception:
                logger.exception("lmshm: a copy job failed")
            with self._lock:
                queue_.popleft()

    def shutdown(self) -> None:
        """Cancel queued jobs, wait for running ones."""
        with self._lock:
            self._closed = True
            workers = list(self._workers)
        for _ in workers:
            self._ready.put(None)
        for worker in workers:
            if worker is not threading.current_thread():
                worker.join()
