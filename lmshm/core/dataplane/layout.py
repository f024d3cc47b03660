"""The block layout: where a registration's blocks lie, and the pieces a chunk's copy moves.

``BlockLayout.of`` reads shape, stride and dtype only (no memory is touched), so a worker runs
the same check without a server (``check_movable``). A layer's blocks are indexed by the
registration's ``block_dim``; the other dims, ordered by stride, make at most ``MAX_RUNS``
contiguous runs per block, and a chunk object in the pool holds each layer's part as
``[grid][block][run]``. ``pieces`` (host copies) and ``plan_cuda_copies`` (one request's CUDA
copies, with numpy) turn block ids into contiguous pieces on both sides: no staging buffer,
no strided copy.

The trap: the layout digest stored with each object covers everything that decides where a
byte lies (names, dtypes, ``block_dim``, block shape, memory order, run splits) but not
``num_blocks``; bump ``_PACKING`` whenever the packing of objects changes, or bytes packed one
way are read back another. docs/design/dataplane.md has the full account.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

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

