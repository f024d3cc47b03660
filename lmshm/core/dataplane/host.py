"""Host copies: blocks between a CPU registration and the pool, and the CPU STORE/RETRIEVE.

``copy_chunks`` moves one request's chunks: a ``memmove`` per contiguous piece (a torch
``copy_`` from 1 MiB) through the mapping of memory the server maps safely (a sealed memfd),
``preadv``/``pwritev`` through a named segment's file (``open_checked``: still the file that
was registered), numpy row copies with the GIL released for row layouts, split over up to
``copy_parallelism()`` threads when large. ``HostCopies`` runs a CPU registration's requests on
a copier thread: STORE reserves, copies and commits in batches; RETRIEVE pins, copies, unpins.

The trap: a named segment's owner may truncate it at any time; a copy through the mapping
would then die of SIGBUS, so a CPU layer that is not a sealed memfd is copied through its file
(``checks.with_files`` decides, once per registration).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch

from lmshm.core.dataplane.jobs import Answer, Copies, CopyJob, Then, error
from lmshm.core.dataplane.layout import BlockLayout, FileSide, LayerPlan, _runs, _split, pieces
from lmshm.core.errors import ErrorCode
from lmshm.core.pool import PoolBytes, Reservation
from lmshm.quoting import clip, quote
from lmshm.wire import protocol

logger = logging.getLogger("lmshm.dataplane")

#: A piece of at least this many bytes is copied by torch (several threads); shorter ones by
#: one ``memmove`` each, whose call costs ~1 us against ~10 us for a torch ``copy_``.
TORCH_COPY_BYTES = 1 << 20

_memmove = ctypes.memmove


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

        def copy(p: LayerPlan, o: np.ndarray) -> None:
            _take_or_put(p, o, ids, chunk_blocks, store)
        short = True
    else:
        runs = _runs(block_ids)
        pairs = list(zip(layout.layers, _split(obj, layout, chunk_blocks)))

        def copy(p: LayerPlan, o: torch.Tensor) -> None:
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


class HostCopies(Copies):
    """STORE and RETRIEVE of CPU registrations, on a copier thread."""

    def run(self, job: CopyJob) -> Union[Answer, Then]:
        return self._store(job) if job.store else self._retrieve(job)

    def _store(self, job: CopyJob) -> Answer:
        req, layout, reg, deadline = job.req, job.layout, job.reg, job.deadline
        if job.session.ended:
            return error(ErrorCode.UNAVAILABLE, "STORE: the session ended before its copy ran")
        if time.monotonic() > deadline:   # the worker may be reusing these blocks by now
            return self.late("STORE", "nothing was stored")
        cb = req.chunk_blocks
        size = layout.chunk_bytes(cb)
        results: list[int] = []
        copied = 0
        checked = False
        pending: list[tuple[int, tuple]] = []      # reserved, not yet copied: (chunk index, object)

        def flush() -> Optional[protocol.ErrorReply]:
            """Copy the pending chunks in one batch; commit those before the first failure."""
            nonlocal checked, copied
            done, exc = 0, None
            try:
                if not checked:   # once per request, before the first copy (a stat per wrapper)
                    for w in reg.wrappers:
                        w.verify_mapped()
                    checked = True
                done, exc = copy_chunks(layout, [(req.block_ids[i * cb:(i + 1) * cb], self.pool.view(obj))
                                                 for i, obj in pending], cb, store=True, pool=self.pool.bytes)
            except Exception as failed:
                exc = failed
            if time.monotonic() > deadline:   # copied after the worker stopped waiting: maybe reused blocks
                self.pool.abort([obj for _, obj in pending])
                pending.clear()
                return self.late("STORE", f"{copied // size if size else 0} earlier chunk(s) were stored, "
                                          "this batch was not")
            if done:
                self.commit([obj for _, obj in pending[:done]])   # one hold of the pool's lock, one KV events report
                copied += size * done
            self.pool.abort([obj for _, obj in pending[done:]])
            if exc is None:
                pending.clear()
                return None
            i = pending[done][0]
            self.pool.count_failure()
            logger.warning("lmshm: STORE into the pool from %s failed: %s", quote(reg.instance_id, 60), str(exc))
            return error(ErrorCode.DATA_LOSS, f"STORE: chunk {i} could not be copied ({clip(str(exc), 300)}); "
                                              f"{sum(r == Reservation.STORED for r in results[:i])} earlier "
                                              "chunk(s) were stored, this and later ones were not")

        # Reserved as far as the pool has room, copied in one batch (copy_chunks: one hand-over
        # between the copy threads per batch, not per chunk). A chunk that finds no room while
        # this request holds chunks in flight (a request larger than the pool) first has those
        # copied and committed, which makes them evictable, and is then reserved again.
        i = 0
        while i < len(req.keys):
            outcome, obj = self.pool.reserve(job.uid, req.keys[i], size, layout.digest, cb, batch=bool(pending))
            if outcome == Reservation.NO_SPACE and pending:
                refused = flush()
                if refused is not None:
                    return refused
                continue
            results.append(outcome)
            if obj is not None:
                pending.append((i, obj))
            i += 1
        refused = flush() if pending else None
        return refused if refused is not None else protocol.StoreReply(results, copied)

    def _retrieve(self, job: CopyJob) -> Answer:
        objs, refused = self.pin_sources(job)
        if refused is not None:
            return refused
        if time.monotonic() > job.deadline:   # the worker computes these blocks itself by now
            self.pool.unpin(objs, retrieved=False)
            return self.late("RETRIEVE", "no block was written")
        req, layout = job.req, job.layout
        cb = req.chunk_blocks
        try:
            for w in job.reg.wrappers:
                w.verify_mapped()
            _, failed = copy_chunks(layout, [(req.block_ids[i * cb:(i + 1) * cb], self.pool.view(obj))
                                             for i, obj in enumerate(objs)], cb, store=False, pool=self.pool.bytes)
            if failed is not None:
                raise failed
        except Exception as exc:
            self.pool.unpin(objs, retrieved=False)
            self.pool.count_failure()
            logger.warning("lmshm: RETRIEVE into %s failed: %s", quote(job.reg.instance_id, 60), str(exc))
            return error(ErrorCode.DATA_LOSS, f"RETRIEVE: the copy failed ({clip(str(exc), 300)}); the "
                                              "blocks' contents are undefined, recompute them")
        self.pool.unpin(objs, retrieved=True)
        return protocol.RetrieveReply(len(req.keys), layout.chunk_bytes(cb) * len(req.keys))
