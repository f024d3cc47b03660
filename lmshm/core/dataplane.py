"""The data plane's requests: STORE, LOOKUP, RETRIEVE, RELEASE (protocol.py has the messages).

The request loop calls the methods here. Each validates on the loop -- verified caller, an
instance it owns, block-id counts and bounds, a layout that moves in few byte runs along the
registration's ``block_dim``, the session's and its uid's limits -- *before* anything is
copied, and raises ``DataPlaneError`` with the code to answer. STORE and RETRIEVE then become
jobs on the copier threads (``OrderedExecutor``, one FIFO per session, so a client's copies
apply in the order it sent them); a job answers its request itself through
``reply(identity, request_id, reply)``, which the server sends from the loop. LOOKUP and
RELEASE touch only the pool's tables (no walk over its objects) and answer at once.

A job holds its registration (``Registry.acquire``) from validation until its copy ends, so an
unregister or a reclaim waits for the copy, and checks each mapping (``verify_mapped``) just
before it touches it. The objects it creates are visible only once their copy has completed.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from lmshm.core.copier import (
    BlockLayout,
    FileSide,
    LayoutError,
    OrderedExecutor,
    copy_chunks,
    plan_cuda_copies,
)
from lmshm.core.cuda_sync import (
    FLAG_LAYER,
    FLAG_MAGIC,
    PIN_EXTENT,
    PIN_MODES,
    SLOTS,
    CudaSyncError,
    EventKeeper,
    NotSignalled,
    PinError,
    check_pin_extent,
    parse_flag_token,
)
from lmshm.core.errors import ErrorCode, ServerError
from lmshm.core.kv_events import KvIndex
from lmshm.core.pool import BLOCKS, LAYOUT, Pool, Reservation
from lmshm.core.tiers.stack import TierStack
from lmshm.quoting import clip, quote
from lmshm.wire import protocol  # the data plane's part of the wire protocol

logger = logging.getLogger("lmshm.dataplane")

Reply = Callable[[bytes, bytes, Any], None]


class DataPlaneError(ServerError):
    """A refused data-plane request (a ``ServerError``: its code is the reply's)."""


class Deferred:
    """A handler's answer when a job will reply later: on ``executor`` (an ``OrderedExecutor``;
    None: the data plane's copier threads)."""

    __slots__ = ("session", "job", "cancel", "executor")

    def __init__(self, session: Hashable, job: Callable[[bytes, bytes], None],
                 cancel: Callable[[bytes, bytes], None], executor: Any = None) -> None:
        self.session, self.job, self.cancel, self.executor = session, job, cancel, executor


#: LOOKUPs that promote from the tiers at once, each on a thread of its own (``DataPlane.promoter``),
#: not on the copier threads: a promotion waits for its tier up to the tier's timeout, and on a
#: copier thread that wait held up other sessions' STOREs and RETRIEVEs
PROMOTE_THREADS = 4

#: A request's sender stops waiting ``wait_s`` after sending; the server takes 10 % of it and
#: this much off, for the trips and a loop turn, when it decides whether a copy is too late.
SENDER_MARGIN_S = 0.05


def _error(code: ErrorCode, message: str) -> protocol.ErrorReply:
    return protocol.ErrorReply(int(code), clip(message, 1024))


class _Then:
    """A job's reply, and what the job does after sending it (CUDA: wait for the server's
    event, then commit or unpin)."""

    __slots__ = ("reply", "after")

    def __init__(self, reply: Any, after: Callable[[], None]) -> None:
        self.reply, self.after = reply, after


class DataPlane:
    def __init__(self, *, registry: Any, capacity: int, copy_threads: int, lease_ttl_s: float,
                 max_inflight_per_session: int, max_leases_per_session: int, reply: Reply,
                 cuda_sync: Any = None, through_files: bool = True, max_objects: int = 0,
                 max_pinned_fraction_per_uid: float = 1.0, max_pins_per_uid: int = 1 << 30,
                 max_leases_per_uid: int = 1 << 30, tiers: Sequence[Any] = (), tier_queue: Any = 256,
                 tier_timeout_s: float = 0.5, pool_huge_pages: bool = True,
                 prefault_pool: bool = False, pool_populate_ahead: int = 0, cuda_pin: str = "lazy",
                 cuda_timeout_s: float = 30.0, cuda_pin_extent: int = PIN_EXTENT, cuda_copy_batch: bool = True,
                 kv_index: Any = None) -> None:
        self.registry = registry
        self.pool = Pool(capacity, max_objects=max_objects, max_pinned_fraction_per_uid=max_pinned_fraction_per_uid,
                         max_pins_per_uid=max_pins_per_uid, huge_pages=pool_huge_pages, prefault=prefault_pool,
                         populate_ahead=pool_populate_ahead,
                         head_room=max((t.head_room for t in tiers), default=0),
                         align=max((t.align for t in tiers), default=0))
        self.copier = OrderedExecutor(copy_threads)
        self.lease_ttl_s = lease_ttl_s
        self.max_inflight = max_inflight_per_session
        self.max_leases = max_leases_per_session
        self.max_leases_per_uid = max_leases_per_uid
        self._reply = reply
        self._cuda_sync = cuda_sync        # TorchCudaSync, made on first CUDA use (tests inject a fake)
        self.events = EventKeeper()
        self._no_events_logged = -1e9
        if cuda_pin not in PIN_MODES:
            raise DataPlaneError(ErrorCode.INVALID_ARG, f"--cuda-pin {quote(cuda_pin, 40)} is not one of "
                                                        f"{', '.join(PIN_MODES)}")
        self.cuda_pin = cuda_pin            # lazy | start | off (cuda_sync.PIN_MODES)
        try:
            self.cuda_pin_extent = check_pin_extent(cuda_pin_extent)
        except ValueError as exc:
            raise DataPlaneError(ErrorCode.INVALID_ARG, f"--cuda-pin-extent: {exc}") from None
        self.cuda_copy_batch = cuda_copy_batch   # one cuMemcpyBatchAsync per request where the driver has it
        self.cuda_timeout_s = cuda_timeout_s   # a CUDA request's copies must complete within this
        self.cuda_quarantined = 0           # requests whose copies outlived it (their bytes held)
        self.late_requests = 0              # STORE/RETRIEVEs refused or not committed: past their sender's wait_s
        self._quarantine: list = []         # (event, release, held registrations)
        self._quarantine_lock = threading.Lock()
        self._isolated: bool | None = None
        self.through_files = through_files  # named shm: preadv/pwritev (SIGBUS-safe), else memmove
        # the tiers below the pool (core/tiers): written through after STORE, promoted by LOOKUP
        self.tiers = TierStack(self.pool, tiers, queue_limit=tier_queue, timeout_s=tier_timeout_s) if tiers else None
        self.promoter = OrderedExecutor(PROMOTE_THREADS, "lmshm-promote") if tiers else None
        #: KV events (core/kv_events): which advertised chunks each tier can serve
        self.kv = kv_index if kv_index is not None else KvIndex(max_chunks=0)
        if self.kv.enabled:
            kv = self.kv
            self.pool.on_resident = kv.recorder("pool")
            self.pool.on_committed = kv.batch_recorder("pool")
            if self.tiers is not None:
                for t in self.tiers.tiers:
                    record = kv.recorder(t.name)
                    t.held = lambda uid, key, record=record: record(uid, key, True)
                    t.gone = lambda uid, key, record=record: record(uid, key, False)
        if cuda_pin == "start" and self.pool.capacity:
            t0 = time.perf_counter()
            try:
                self._sync().pin(self.pool.tensor)
            except Exception as exc:
                raise DataPlaneError(ErrorCode.UNAVAILABLE, f"--cuda-pin start: page-locking the pool failed: "
                                                            f"{clip(str(exc), 300)}") from None
            logger.info("lmshm: the pool (%d bytes) is page-locked for CUDA copies (%.1f s)", self.pool.capacity,
                        time.perf_counter() - t0)

    # ---- validation, on the loop --------------------------------------------------------
    def _owned(self, session: Any, instance_id: str, what: str) -> Any:
        if not self.pool.capacity:
            raise DataPlaneError(ErrorCode.UNAVAILABLE,
                                 f"{what}: this lmshm-server has no pool (started with --capacity 0)")
        reg = self._owner_of(session, instance_id, what)
        if self.copier.pending(session.id) >= self.max_inflight:
            raise DataPlaneError(ErrorCode.UNAVAILABLE,
                                 f"{what}: this session already has {self.max_inflight} STORE/RETRIEVE requests in "
                                 "flight, the server's limit (lmshm-server --max-inflight-per-session)")
        return reg

    def _owner_of(self, session: Any, instance_id: str, what: str) -> Any:
        """``instance_id``'s registration if ``session`` owns it (nothing about the in-flight
        limit: a running request's flag page is checked with this, and it counts itself)."""
        reg = self.registry.get(instance_id)
        if reg.owner != session.id:
            raise DataPlaneError(ErrorCode.PERMISSION_DENIED,
                                 f"{what}: instance {quote(instance_id, 60)} belongs to another session "
                                 f"(pid {reg.owner_pid}); only the worker that registered it may copy blocks "
                                 "in or out of it")
        return reg

    def _layout(self, reg: Any) -> BlockLayout:
        if reg.block_layout is None:
            tensors = [reg.tensor(n) for n in reg.layer_names]
            if any(t is None for t in tensors):
                raise DataPlaneError(ErrorCode.NOT_FOUND, f"instance {quote(reg.instance_id, 60)} is being released")
            kinds = {w.device_type for w in reg.wrappers}
            devices = {w.device for w in reg.wrappers}
            if len(kinds) > 1 or len(devices) > 1:
                raise DataPlaneError(ErrorCode.UNSUPPORTED,
                                     f"instance {quote(reg.instance_id, 60)} spans {', '.join(sorted(devices))}: the "
                                     "data plane moves registrations of one device")
            try:
                layout = BlockLayout.of(reg.layer_names, tensors, reg.block_dim)
                if kinds == {"cpu"} and self.through_files:
                    layout = self._with_files(reg, layout)
                if kinds == {"cuda"}:
                    from lmshm.platform.cuda.driver import get_driver

                    layout = dataclasses.replace(layout, cuda_device=get_driver().local_ordinal(next(iter(devices))))
                reg.block_layout = layout
            except LayoutError as exc:
                reg.block_layout = exc
        if isinstance(reg.block_layout, LayoutError):
            raise DataPlaneError(ErrorCode.LAYOUT, f"instance {quote(reg.instance_id, 60)}: {reg.block_layout}")
        return reg.block_layout

    @staticmethod
    def _with_files(reg: Any, layout: BlockLayout) -> BlockLayout:
        """Choose how each CPU layer is copied. A sealed shmem memfd (checked when it was
        mapped, ``CpuFdIPCWrapper``) keeps every byte it has, so it is copied through the
        mapping, one ``memmove`` per piece. A named segment can be truncated or punched by its owner at
        any time, so it is copied through its file (``preadv``/``pwritev``: a short count, never
        SIGBUS). Anything else is refused before a byte moves."""
        plans = []
        for plan in layout.layers:
            found = reg.layer(plan.name)
            wrapper = found[1] if found else None
            if wrapper is not None and wrapper.mapping_cannot_fault():
                plans.append(plan)
                continue
            backing = getattr(wrapper, "backing_file", None)
            where = backing() if backing is not None else None
            if where is None:
                raise LayoutError(f"layer {plan.name!r} is neither a sealed memfd nor a named segment the server "
                                  "can copy through its file")
            path, inode, start = where
            plans.append(dataclasses.replace(plan, file=FileSide(path, inode, plan.base - start)))
        return dataclasses.replace(layout, layers=tuple(plans))

    def _sync(self) -> Any:
        if self._cuda_sync is None:
            from lmshm.core.cuda_sync import TorchCudaSync

            self._cuda_sync = TorchCudaSync(self.cuda_pin, self.cuda_pin_extent, self.cuda_copy_batch)
        return self._cuda_sync

    def _run(self, identity: bytes, rid: bytes, result: Any) -> None:
        if isinstance(result, _Then):
            self._reply(identity, rid, result.reply)
            result.after()
        else:
            self._reply(identity, rid, result)

    @staticmethod
    def _check_blocks(what: str, layout: BlockLayout, keys: list[bytes], block_ids: list[int],
                      chunk_blocks: int) -> None:
        if len(block_ids) != len(keys) * chunk_blocks:
            raise DataPlaneError(ErrorCode.INVALID_ARG,
                                 f"{what}: {len(keys)} chunk(s) of {chunk_blocks} block(s) need "
                                 f"{len(keys) * chunk_blocks} block ids, the request has {len(block_ids)}")
        if block_ids and max(block_ids) >= layout.num_blocks:
            bad = next(b for b in block_ids if b >= layout.num_blocks)
            raise DataPlaneError(ErrorCode.INVALID_ARG,
                                 f"{what}: block id {bad} is out of range; the registration has "
                                 f"{layout.num_blocks} blocks")

    # ---- requests -----------------------------------------------------------------------
    def store(self, session: Any, req: protocol.Store) -> Deferred:
        try:
            n = protocol.advert_count(req.adverts)
        except ValueError as exc:
            raise DataPlaneError(ErrorCode.INVALID_ARG, f"STORE: {exc}") from None
        if n and n != len(req.keys):
            raise DataPlaneError(ErrorCode.INVALID_ARG, f"STORE: {n} adverts for {len(req.keys)} keys "
                                                        "(one per key, or none)")
        return self._copy_job(session, req, "STORE", self._store, self._store_cuda, n)

    def _advertise(self, uid: int, reg: Any, req: protocol.Store, adverts: int) -> None:
        """Tell the KV event index what a STORE's chunks are to their engine, before their copy
        (on the loop): queued (one append) still encoded (copied out of the request's buffer),
        decoded, checked and applied later (``KvIndex.drain``). A STORE that commits nothing
        leaves its adverts unresident, and ``KvIndex.prune`` forgets them."""
        self.kv.describe(uid, req.space, reg.model_name, req.pod, reg.worker_rank, reg.world_size, req.keys,
                         req.adverts.copy(), reg.instance_id, adverts)

    def _announce(self, uid: int, req: protocol.Store, result: Any) -> None:
        """After an advertised STORE's reply: its chunks may be held from before, without an
        advert (the pool: those it did not store now, present already or no room; a tier: any),
        servable now that they have one. Told under the locks the pool and the tiers evict
        under, so never after an eviction of the chunk."""
        reply = result.reply if isinstance(result, _Then) else result
        if not isinstance(reply, protocol.StoreReply):
            return
        keys = [k for k, r in zip(req.keys, reply.results) if r != Reservation.STORED]
        if keys:
            self.pool.announce(uid, keys)
        if self.tiers is not None:
            for t in self.tiers.tiers:
                t.announce(uid, req.keys)

    def retrieve(self, session: Any, req: protocol.Retrieve) -> Deferred:
        return self._copy_job(session, req, "RETRIEVE", self._retrieve, self._retrieve_cuda)

    def _copy_job(self, session: Any, req: Any, what: str, on_cpu: Callable[..., Any],
                  on_cuda: Callable[..., Any], adverts: int = 0) -> Deferred:
        """Validate on the loop, hold the registration, and return the copier job
        (``adverts``: how many a STORE carries)."""
        reg = self._owned(session, req.instance_id, what)
        layout = self._layout(reg)
        self._check_blocks(what, layout, req.keys, req.block_ids, req.chunk_blocks)
        reg = self.registry.acquire(req.instance_id)
        uid = session.peer.uid
        copy = on_cuda if layout.cuda_device >= 0 else on_cpu
        deadline = self._sender_deadline(req)
        advertised = adverts > 0 and self.kv.enabled
        if advertised:      # here, where the request's bytes are in this core's cache (13 µs on a copier)
            self._advertise(uid, reg, req, adverts)

        def job(identity: bytes, rid: bytes) -> None:
            try:
                result = copy(session, reg, layout, uid, req, deadline)
                self._run(identity, rid, result)
                if advertised:
                    self._announce(uid, req, result)
            finally:
                self.registry.let_go(reg)

        def cancel(identity: bytes, rid: bytes) -> None:
            if getattr(req, "lease", b""):
                self.pool.release_lease(req.lease, uid)
            self._cancelled(reg)(identity, rid)

        return Deferred(session.id, job, cancel)

    @staticmethod
    def _sender_deadline(req: Any) -> float:
        """When the sender stops waiting for this request's reply, on this server's clock,
        from ``wait_s`` counted from now (the request was just decoded), less a margin for the
        trip each way and a loop turn: 10 %, and 50 ms more (at most another 10 %). ``inf`` when
        the sender did not say."""
        wait = getattr(req, "wait_s", 0.0)
        return time.monotonic() + wait * 0.9 - min(SENDER_MARGIN_S, wait * 0.1) if wait else float("inf")

    def _late(self, what: str, outcome: str) -> protocol.ErrorReply:
        self.late_requests += 1
        return _error(ErrorCode.UNAVAILABLE, f"{what}: the request waited past its sender's timeout (wait_s) "
                                             f"before its copy could run; {outcome}")

    def _store(self, session: Any, reg: Any, layout: BlockLayout, uid: int, req: protocol.Store,
               deadline: float = float("inf")) -> Any:
        if session.ended:
            return _error(ErrorCode.UNAVAILABLE, "STORE: the session ended before its copy ran")
        if time.monotonic() > deadline:   # the worker may be reusing these blocks by now
            return self._late("STORE", "nothing was stored")
        cb = req.chunk_blocks
        size = layout.chunk_bytes(cb)
        results: list[int] = []
        copied = 0
        checked = False
        pending: list[tuple[int, tuple]] = []      # reserved, not yet copied: (chunk index, object)

        def flush() -> Any:
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
                return self._late("STORE", f"{copied // size if size else 0} earlier chunk(s) were stored, "
                                           "this batch was not")
            if done:
                objs = [obj for _, obj in pending[:done]]
                self.pool.commit(objs)              # one hold of the pool's lock, one KV events report
                if self.tiers is not None:
                    self.tiers.write_through(objs)
                copied += size * done
            self.pool.abort([obj for _, obj in pending[done:]])
            if exc is None:
                pending.clear()
                return None
            i = pending[done][0]
            self.pool.count_failure()
            logger.warning("lmshm: STORE into the pool from %s failed: %s", quote(reg.instance_id, 60), str(exc))
            return _error(ErrorCode.DATA_LOSS, f"STORE: chunk {i} could not be copied ({clip(str(exc), 300)}); "
                                               f"{sum(r == Reservation.STORED for r in results[:i])} earlier "
                                               "chunk(s) were stored, this and later ones were not")

        # Reserved as far as the pool has room, copied in one batch (copy_chunks: one hand-over
        # between the copy threads per batch, not per chunk). A chunk that finds no room while
        # this request holds chunks in flight (a request larger than the pool) first has those
        # copied and committed, which makes them evictable, and is then reserved again.
        i = 0
        while i < len(req.keys):
            outcome, obj = self.pool.reserve(uid, req.keys[i], size, layout.digest, cb, batch=bool(pending))
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

    def _pin_sources(self, session: Any, reg: Any, layout: BlockLayout, uid: int,
                     req: protocol.Retrieve) -> tuple[list, Any]:
        """Pin a RETRIEVE's chunks: ``(objects, None)``, or ``([], error reply)`` with nothing
        left pinned: a chunk missing, of another layout or chunk size, or the session gone."""
        objs, missing = self.pool.pin_for_copy(uid, req.keys, req.lease)
        if missing is not None:
            self.pool.count_failure()
            return [], _error(ErrorCode.NOT_FOUND, f"RETRIEVE: {missing}; no block was written")
        cb = req.chunk_blocks
        for i, obj in enumerate(objs):
            if obj[LAYOUT] != layout.digest or obj[BLOCKS] != cb:
                self.pool.unpin(objs, retrieved=False)
                self.pool.count_failure()
                return [], _error(ErrorCode.LAYOUT,
                                  f"RETRIEVE: chunk {i} was stored from another layout ({obj[BLOCKS]} blocks per "
                                  f"chunk, layout {obj[LAYOUT].hex()}) than instance {quote(reg.instance_id, 60)} has "
                                  f"({cb} blocks, layout {layout.digest.hex()}); no block was written")
        if session.ended:
            self.pool.unpin(objs, retrieved=False)
            return [], _error(ErrorCode.UNAVAILABLE, "RETRIEVE: the session ended before its copy ran")
        return objs, None

    def _retrieve(self, session: Any, reg: Any, layout: BlockLayout, uid: int, req: protocol.Retrieve,
                  deadline: float = float("inf")) -> Any:
        objs, refused = self._pin_sources(session, reg, layout, uid, req)
        if refused is not None:
            return refused
        if time.monotonic() > deadline:   # the worker computes these blocks itself by now
            self.pool.unpin(objs, retrieved=False)
            return self._late("RETRIEVE", "no block was written")
        cb = req.chunk_blocks
        try:
            for w in reg.wrappers:
                w.verify_mapped()
            _, failed = copy_chunks(layout, [(req.block_ids[i * cb:(i + 1) * cb], self.pool.view(obj))
                                             for i, obj in enumerate(objs)], cb, store=False, pool=self.pool.bytes)
            if failed is not None:
                raise failed
        except Exception as exc:
            self.pool.unpin(objs, retrieved=False)
            self.pool.count_failure()
            logger.warning("lmshm: RETRIEVE into %s failed: %s", quote(reg.instance_id, 60), str(exc))
            return _error(ErrorCode.DATA_LOSS, f"RETRIEVE: the copy failed ({clip(str(exc), 300)}); the "
                                               "blocks' contents are undefined, recompute them")
        self.pool.unpin(objs, retrieved=True)
        return protocol.RetrieveReply(len(req.keys), layout.chunk_bytes(cb) * len(req.keys))

    # ---- CUDA registrations (cuda_sync.py has the ordering rules) ----------------------
    def _cuda_order(self, session: Any, req: Any, sync: Any, dev: int, what: str, until: float) -> None:
        """Wait on the host for the worker's ordering token, until ``until`` at most, and no
        longer than the session lives (``NotSignalled`` otherwise); nothing is queued on the GPU
        before it returns, and nothing queued after it waits on the worker. A worker that died
        with its signal pending thus holds no stream, no copy thread past its deadline or its
        session's end, and no mapping (cuda_sync's docstring: never wait on the GPU for a
        worker)."""
        token = req.event
        if not token:
            return
        ended = lambda: session.ended
        flag = parse_flag_token(token)
        if flag is None:
            ev = sync.open_ipc_event(token, dev)
            if not sync.wait(ev, until, ended):
                raise NotSignalled("the worker's CUDA event")
            return
        slot, seq, iid = flag
        try:
            self._owner_of(session, iid, what)
            freg = self.registry.acquire(iid)
        except ServerError as exc:
            raise CudaSyncError(f"the flag page {quote(iid, 60)} of the token: {exc.message}") from None
        try:       # held while its word is read: an unregister waits for the read
            page = freg.tensor(FLAG_LAYER)
            kinds = {(w.device_type, w.device) for w in freg.wrappers}
            if page is None or page.dtype.itemsize != 8 or page.numel() < SLOTS or len(kinds) != 1 \
                    or self._cuda_ordinal(next(iter(kinds))) != dev:
                raise CudaSyncError(f"instance {quote(iid, 60)} is not a flag page on cuda:{dev} "
                                    f"(one layer {FLAG_LAYER!r} of {SLOTS} 64-bit words)")
            if not sync.wait_word(page, slot, seq, until, ended):
                raise NotSignalled("the worker's flag word")
        finally:
            self.registry.let_go(freg)

    @staticmethod
    def _cuda_ordinal(kind: tuple[str, str]) -> int:
        if kind[0] != "cuda":
            return -1
        from lmshm.platform.cuda.driver import get_driver

        return get_driver().local_ordinal(kind[1])

    def _no_events(self, what: str, outcome: str) -> protocol.ErrorReply:
        now = time.monotonic()
        if now - self._no_events_logged >= 10.0:      # at most every 10 s: it may hit every request
            self._no_events_logged = now
            logger.warning("lmshm: %d interprocess CUDA events are kept and none of their copies has completed; "
                           "refusing default-mode requests until some have", len(self.events))
        return _error(ErrorCode.UNAVAILABLE, f"{what}: the server holds {len(self.events)} interprocess CUDA events "
                                             "whose copies have not completed, its limit (cuda_sync.EVENT_TOTAL_CAP); "
                                             f"{outcome}, retry later")

    def _replies_after_copies(self, token: bytes) -> bool:
        """True: answer once the copies have completed, with no event (isolated mode). A flag
        token always is, whatever mode this server was started in: an isolated worker cannot
        open an interprocess event (no shared /dev/shm) and orders its work by the reply."""
        return token.startswith(FLAG_MAGIC) or self._cuda_mode()

    def _cuda_mode(self) -> bool:
        """True in isolated mode: flag words, replies after completion, no IPC events."""
        if self._isolated is None:
            from lmshm.platform import ipc_policy

            self._isolated = ipc_policy.is_isolated_ipc()
        return self._isolated

    def _settle_cuda(self, sync: Any, done: Any, stream: Any, dev: int, deadline: float,
                     hold: list, release: Callable[[bool], None]) -> bool:
        """Wait (bounded) for ``done``; then ``release(True)``. Past the deadline (the GPU is
        stuck: no copy waits on a worker's signal), quarantine: ``release(False)`` runs once
        the GPU is done, with the registrations in ``hold`` still held."""
        if done is not None and sync.wait(done, deadline):
            release(True)
            return True
        if done is None:
            try:
                done, _ = sync.record(stream, dev, False)
            except Exception:
                logger.exception("lmshm: cannot record an event after failed CUDA copies; their pool bytes "
                                 "are kept out of use")
                self.cuda_quarantined += 1
                return False
        if sync.wait(done, time.monotonic() + 1.0):
            release(False)
            return False
        for reg in hold:
            self.registry.hold_more(reg)
        with self._quarantine_lock:
            self._quarantine.append((done, release, hold))
        self.cuda_quarantined += 1
        logger.warning("lmshm: CUDA copies did not complete within %.0f s; their pool bytes and registration "
                       "are held until the GPU is done with them", self.cuda_timeout_s)
        return False

    def _cuda_plan(self, sync: Any, layout: BlockLayout, block_ids: Sequence[int], chunks: Sequence[int],
                   addrs: list[int], cb: int, *, store: bool) -> Any:
        """The copies of chunks ``chunks`` (indices into the request) at pool addresses ``addrs``,
        cut at the pool's pin extents (``copier.plan_cuda_copies``)."""
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1, cb)[np.asarray(chunks, dtype=np.intp)]
        extent = 0 if self.cuda_pin == "off" else getattr(sync, "pin_extent", self.cuda_pin_extent)
        return plan_cuda_copies(layout, ids, addrs, cb, store=store, pool_base=self.pool.tensor.data_ptr(),
                                extent=extent)

    def _drain_quarantine(self, sync: Any = None) -> None:
        """Hand back what timed-out copies held, once the GPU is done with it (the loop's tick)."""
        if not self._quarantine:
            return
        sync = sync or self._sync()
        with self._quarantine_lock:
            ready = [q for q in self._quarantine if sync.done(q[0])]
            self._quarantine = [q for q in self._quarantine if q not in ready]
        for _, release, hold in ready:
            try:
                release(False)
            finally:
                for reg in hold:
                    self.registry.let_go(reg)

    def _store_cuda(self, session: Any, reg: Any, layout: BlockLayout, uid: int, req: protocol.Store,
                    sender: float = float("inf")) -> Any:
        if session.ended:
            return _error(ErrorCode.UNAVAILABLE, "STORE: the session ended before its copy ran")
        if time.monotonic() > sender:
            return self._late("STORE", "nothing was stored")
        sync, dev, cb = self._sync(), layout.cuda_device, req.chunk_blocks
        isolated = self._replies_after_copies(req.event)
        if not isolated and not self.events.room():
            return self._no_events("STORE", "nothing was stored")
        size = layout.chunk_bytes(cb)
        objs: list = []
        results: list[int] = []
        done = stream = None
        queued = False
        deadline = time.monotonic() + self.cuda_timeout_s
        try:
            stream = sync.stream(dev, session.id)
            base = self.pool.tensor.data_ptr()
            chunks, addrs = [], []
            for i, key in enumerate(req.keys):
                outcome, obj = self.pool.reserve(uid, key, size, layout.digest, cb)
                results.append(outcome)
                if obj is not None:
                    objs.append(obj)
                    chunks.append(i)
                    addrs.append(self.pool.view(obj).data_ptr())
            for addr in addrs:   # before the host waits for the worker: a pin is a host call of its own
                sync.pin(self.pool.tensor, addr - base, size)
            self._cuda_order(session, req, sync, dev, "STORE", min(sender, deadline))
            if chunks:
                plan = self._cuda_plan(sync, layout, req.block_ids, chunks, addrs, cb, store=True)
                queued = True
                sync.submit(plan, stream, dev)
            done, handle = sync.record(stream, dev, not isolated)
        except Exception as exc:
            def failed(_ok: bool) -> None:
                self.pool.abort(objs)
            if queued and stream is not None:   # never hand back pool bytes the GPU may still write
                self._settle_cuda(sync, None, stream, dev, deadline, [reg], failed)
            else:
                failed(False)
            if isinstance(exc, NotSignalled):     # nothing was queued; what was reserved is handed back
                self.late_requests += 1
                return _error(ErrorCode.UNAVAILABLE,
                              f"STORE: {exc} was not signalled in time (by the sender's wait_s, or within "
                              f"--cuda-timeout {self.cuda_timeout_s:g} s), or the session ended; nothing was stored")
            self.pool.count_failure()
            if isinstance(exc, CudaSyncError):
                return _error(ErrorCode.INVALID_ARG, f"STORE: {exc}; nothing was stored")
            if isinstance(exc, PinError):
                logger.error("lmshm: %s", str(exc))   # str: a record keeping exc keeps its frames' tensors
                return _error(ErrorCode.UNAVAILABLE, f"STORE: the server could not page-lock its pool ({exc}); "
                                                     "nothing was stored")
            logger.warning("lmshm: CUDA STORE from %s failed: %s", quote(reg.instance_id, 60), str(exc))
            return _error(ErrorCode.DATA_LOSS, f"STORE: the copies could not be queued ({clip(str(exc), 300)}); "
                                               "nothing was stored")
        outcome: list[bool] = []

        def release(ok: bool) -> None:   # visible only once the copies have completed
            # Isolated mode replies after the copies: done after the worker stopped waiting, they
            # may have read reused blocks. (Default mode replied at once, and the worker's stream
            # waits for the server's event before reusing them.)
            if ok and isolated and time.monotonic() > sender:
                ok = False
                self.late_requests += 1
            outcome.append(ok)
            if not ok:
                self.pool.abort(objs)
                self.pool.count_failure()
                return
            self.pool.commit(objs)
            if self.tiers is not None:
                self.tiers.write_through(objs)

        def after() -> None:
            self._settle_cuda(sync, done, stream, dev, deadline, [reg], release)

        if not isolated:
            self.events.keep(session.id, done)
            return _Then(protocol.StoreReply(results, size * len(objs), handle), after)
        after()                       # isolated: the reply is the ordering, sent once the copies are done
        if not outcome or not outcome[0]:
            return _error(ErrorCode.UNAVAILABLE,
                          f"STORE: the copies did not complete within {self.cuda_timeout_s:g} s (the GPU is "
                          "stuck, or they ended past the sender's wait_s); nothing was stored")
        return protocol.StoreReply(results, size * len(objs), b"")

    def _retrieve_cuda(self, session: Any, reg: Any, layout: BlockLayout, uid: int, req: protocol.Retrieve,
                       sender: float = float("inf")) -> Any:
        objs, refused = self._pin_sources(session, reg, layout, uid, req)
        if refused is not None:
            return refused
        if time.monotonic() > sender:
            self.pool.unpin(objs, retrieved=False)
            return self._late("RETRIEVE", "no block was written")
        cb = req.chunk_blocks
        sync, dev = self._sync(), layout.cuda_device
        isolated = self._replies_after_copies(req.event)
        if not isolated and not self.events.room():
            self.pool.unpin(objs, retrieved=False)
            return self._no_events("RETRIEVE", "no block was written")
        done = stream = None
        queued = False
        deadline = time.monotonic() + self.cuda_timeout_s
        try:
            stream = sync.stream(dev, session.id)
            base = self.pool.tensor.data_ptr()
            views = [self.pool.view(obj) for obj in objs]
            for view in views:   # before the host waits for the worker: a pin is a host call of its own
                sync.pin(self.pool.tensor, view.data_ptr() - base, view.numel() * view.element_size())
            self._cuda_order(session, req, sync, dev, "RETRIEVE", min(sender, deadline))
            if views:
                plan = self._cuda_plan(sync, layout, req.block_ids, range(len(views)),
                                       [v.data_ptr() for v in views], cb, store=False)
                queued = True
                sync.submit(plan, stream, dev)
            done, handle = sync.record(stream, dev, not isolated)
        except Exception as exc:
            def failed(_ok: bool) -> None:
                self.pool.unpin(objs, retrieved=False)
            if queued and stream is not None:   # never let pool bytes go that the GPU may still read
                self._settle_cuda(sync, None, stream, dev, deadline, [reg], failed)
            else:
                failed(False)
            if isinstance(exc, NotSignalled):     # nothing was queued
                self.late_requests += 1
                return _error(ErrorCode.UNAVAILABLE,
                              f"RETRIEVE: {exc} was not signalled in time (by the sender's wait_s, or within "
                              f"--cuda-timeout {self.cuda_timeout_s:g} s), or the session ended; no block was "
                              "written")
            self.pool.count_failure()
            if isinstance(exc, PinError):
                logger.error("lmshm: %s", str(exc))   # str: a record keeping exc keeps its frames' tensors
                return _error(ErrorCode.UNAVAILABLE, f"RETRIEVE: the server could not page-lock its pool "
                                                     f"({exc}); recompute these blocks")
            code = ErrorCode.INVALID_ARG if isinstance(exc, CudaSyncError) else ErrorCode.DATA_LOSS
            return _error(code, f"RETRIEVE: {clip(str(exc), 300)}; recompute these blocks")
        outcome: list[bool] = []

        def release(ok: bool) -> None:   # the pool's bytes stay pinned until the GPU has read them
            outcome.append(ok)
            self.pool.unpin(objs, retrieved=ok)
            if not ok:
                self.pool.count_failure()

        def after() -> None:
            self._settle_cuda(sync, done, stream, dev, deadline, [reg], release)

        nbytes = layout.chunk_bytes(cb) * len(req.keys)
        if not isolated:
            self.events.keep(session.id, done)
            return _Then(protocol.RetrieveReply(len(req.keys), nbytes, handle), after)
        after()
        if not outcome or not outcome[0]:
            return _error(ErrorCode.DATA_LOSS,
                          f"RETRIEVE: the copies did not complete within {self.cuda_timeout_s:g} s (the GPU is "
                          "stuck); recompute these blocks")
        return protocol.RetrieveReply(len(req.keys), nbytes, b"")

    def _cancelled(self, reg: Any) -> Callable[[bytes, bytes], None]:
        def cancel(identity: bytes, rid: bytes) -> None:
            try:
                self._reply(identity, rid, _error(ErrorCode.UNAVAILABLE, "lmshm-server is shutting down"))
            finally:
                self.registry.let_go(reg)
        return cancel

    def lookup(self, session: Any, req: protocol.Lookup) -> Any:
        if not self.pool.capacity:
            return protocol.LookupReply(0, b"", 0.0)
        lengths = {len(k) for k in req.keys}
        if len(lengths) != 1:
            raise DataPlaneError(ErrorCode.INVALID_ARG,
                                 f"LOOKUP: every rank must list the same number of keys, got {sorted(lengths)}")
        if sum(len(k) for k in req.keys) > protocol.MAX_KEYS:
            raise DataPlaneError(ErrorCode.INVALID_ARG, f"LOOKUP: more than {protocol.MAX_KEYS} keys in all")
        if self.pool.leases_of(session.id) >= self.max_leases:
            raise DataPlaneError(ErrorCode.UNAVAILABLE,
                                 f"LOOKUP: this session holds {self.max_leases} leases, the server's limit "
                                 "(lmshm-server --max-leases-per-session); RELEASE or RETRIEVE them")
        uid = session.peer.uid
        if self.pool.leases_of_uid(uid) >= self.max_leases_per_uid:
            raise DataPlaneError(ErrorCode.UNAVAILABLE,
                                 f"LOOKUP: uid {uid} holds {self.max_leases_per_uid} leases over all its sessions, the "
                                 "server's limit (lmshm-server --max-leases-per-uid); RELEASE or RETRIEVE them")
        ttl = min(req.ttl_s or self.lease_ttl_s, self.lease_ttl_s)
        if (self.tiers is not None and self.promoter.pending(session.id) < self.max_inflight
                and not self.pool.all_visible(uid, req.keys)):
            return self._lookup_tiers(session, req, uid, ttl)
        hits, lease = self.pool.lookup(uid, req.keys, session.id, ttl)
        return protocol.LookupReply(hits, lease, ttl if hits else 0.0)

    def _lookup_tiers(self, session: Any, req: protocol.Lookup, uid: int, ttl: float) -> Deferred:
        """A LOOKUP with tiers below the pool: on a promoter thread (``PROMOTE_THREADS``; a
        session's LOOKUPs in order), promote the chunks found only below (at most
        ``tier_timeout_s``), then pin the pool's leading chunks under a lease. A LOOKUP waits at
        most that long for a tier, never on the loop, and never holds a copier thread."""
        deadline = time.monotonic() + self.tiers.timeout_s

        def job(identity: bytes, rid: bytes) -> None:
            if session.ended:
                self._reply(identity, rid, _error(ErrorCode.UNAVAILABLE, "LOOKUP: the session ended"))
                return
            held = self.tiers.promote(uid, req.keys, deadline)
            try:
                hits, lease = self.pool.lookup(uid, req.keys, session.id, ttl)
            finally:
                held.release()
            self._reply(identity, rid, protocol.LookupReply(hits, lease, ttl if hits else 0.0))

        def cancel(identity: bytes, rid: bytes) -> None:
            self._reply(identity, rid, _error(ErrorCode.UNAVAILABLE, "lmshm-server is shutting down"))

        return Deferred(session.id, job, cancel, self.promoter)

    def busy(self) -> bool:
        """A copy or a promotion is queued or running (a hint)."""
        return not self.copier.idle() or (self.promoter is not None and not self.promoter.idle())

    def release(self, session: Any, req: protocol.Release) -> protocol.ReleaseReply:
        return protocol.ReleaseReply(self.pool.release_lease(req.lease, session.peer.uid))

    # ---- lifecycle ----------------------------------------------------------------------
    def session_ended(self, session_id: Hashable) -> None:
        self.pool.release_session(session_id)
        self.events.drop(session_id)
        if self._cuda_sync is not None and hasattr(self._cuda_sync, "drop_session"):
            # after the session's queued jobs: the copier runs this in the session's order
            def drop() -> None:
                self._cuda_sync.drop_session(session_id)
            self.copier.submit(session_id, drop, drop)

    def tick(self) -> None:
        self.pool.expire()
        if self.kv.enabled:
            self.kv.prune()
        if self._cuda_sync is not None:
            self.events.expire()
            self._drain_quarantine(self._cuda_sync)

    def info(self) -> protocol.PoolInfo:
        tiers = self.tiers.info() if self.tiers is not None else []
        sync = self._cuda_sync
        pinned = sync.pinned_bytes(self.pool.tensor) if sync is not None and hasattr(sync, "pinned_bytes") else 0
        paths = getattr(sync, "_paths", None) or {}
        return protocol.PoolInfo(**self.pool.info(), cuda_pinned_bytes=pinned, cuda_quarantined=self.cuda_quarantined,
                                 cuda_events_dropped=self.events.dropped_early, late=self.late_requests, tiers=tiers,
                                 cuda_copy_path="/".join(sorted(set(paths.values()))),
                                 cuda_copy_calls=getattr(sync, "copy_calls", 0),
                                 cuda_copy_pieces=getattr(sync, "copy_pieces", 0))

    def shutdown(self) -> None:
        """Cancel queued copies and promotions, wait for running ones, drop the pool."""
        self.copier.shutdown()
        if self.promoter is not None:
            self.promoter.shutdown()
        if self.tiers is not None and not self.tiers.close():
            return                          # a tier's thread is stuck on the pool's bytes: keep it mapped
        if self._cuda_sync is not None:
            deadline = time.monotonic() + 5.0
            while self._quarantine and time.monotonic() < deadline:
                self._drain_quarantine(self._cuda_sync)
                time.sleep(0.01)
            if self._quarantine:
                logger.error("lmshm: %d CUDA request(s) still have copies on the GPU; the pool stays mapped",
                             len(self._quarantine))
                return                      # DMA may still reach the pool's bytes: keep them
        if self._cuda_sync is not None and hasattr(self._cuda_sync, "unpin_all"):
            try:
                self._cuda_sync.unpin_all([self.pool.tensor])
            except Exception:
                logger.exception("lmshm: unpinning the pool failed")
        self.pool.release()
