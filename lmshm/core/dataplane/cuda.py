"""CUDA copies: STORE and RETRIEVE of a CUDA registration, one object for both directions.

``CudaCopies.run`` takes a validated job on a copier thread: it reserves (STORE) or pins
(RETRIEVE) the pool's objects, page-locks their extents, waits on the host for the worker's
ordering token (an interprocess event, or in isolated mode a flag word), queues the request's
copies in one plan on a stream of its session, and records the server's event. Default mode
replies at once with that event (the worker's stream waits on it); isolated mode, and any flag
token, replies once the copies are done. Only then are a STORE's objects committed, a
RETRIEVE's unpinned.

The trap: the pool's bytes must never be handed back while the GPU may still read or write
them. Copies past ``cuda_timeout_s`` are quarantined: their objects and registrations stay held
until the GPU is done (``tick``), and the pool stays mapped at shutdown while any remain.
cuda_sync.py has the ordering rules; docs/design/dataplane.md the account.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Hashable, Optional, Sequence, Union

import numpy as np

from lmshm.core.cuda_sync import (
    FLAG_LAYER,
    FLAG_MAGIC,
    PIN_MODES,
    SLOTS,
    CudaSyncError,
    EventKeeper,
    NotSignalled,
    PinError,
    TorchCudaSync,
    check_pin_extent,
    parse_flag_token,
)
from lmshm.core.dataplane.checks import Checks, DataPlaneError
from lmshm.core.dataplane.config import DataPlaneConfig
from lmshm.core.dataplane.jobs import Answer, Copies, CopyJob, CopyRequest, Session, Then, error
from lmshm.core.dataplane.layout import BlockLayout, CopyPlan, plan_cuda_copies
from lmshm.core.errors import ErrorCode, ServerError
from lmshm.core.pool import Pool
from lmshm.core.registry import Registration, Registry
from lmshm.core.tiers.stack import TierStack
from lmshm.platform import ipc_policy
from lmshm.platform.cuda.driver import get_driver
from lmshm.quoting import clip, quote
from lmshm.wire import protocol

logger = logging.getLogger("lmshm.dataplane")


class CudaCopies(Copies):
    def __init__(self, config: DataPlaneConfig, registry: Registry, pool: Pool, tiers: Optional[TierStack],
                 checks: Checks, sync: Optional[TorchCudaSync] = None) -> None:
        super().__init__(pool, tiers)
        self.registry = registry
        self.checks = checks
        self._sync_ = sync                  # TorchCudaSync, made on first CUDA use (tests inject a fake)
        if config.cuda_pin not in PIN_MODES:
            raise DataPlaneError(ErrorCode.INVALID_ARG, f"--cuda-pin {quote(config.cuda_pin, 40)} is not one of "
                                                        f"{', '.join(PIN_MODES)}")
        self.pin = config.cuda_pin          # lazy | start | off (cuda_sync.PIN_MODES)
        try:
            self.pin_extent = check_pin_extent(config.cuda_pin_extent)
        except ValueError as exc:
            raise DataPlaneError(ErrorCode.INVALID_ARG, f"--cuda-pin-extent: {exc}") from None
        self.copy_batch = config.cuda_copy_batch
        self.timeout_s = config.cuda_timeout_s   # a request's copies must complete within this
        self.quarantined = 0                # requests whose copies outlived it (their bytes held)
        self.events = EventKeeper()
        self._no_events_logged = -1e9
        self._quarantine: list = []         # (event, release, held registrations)
        self._quarantine_lock = threading.Lock()
        self._isolated: Optional[bool] = None
        if self.pin == "start" and pool.capacity:
            t0 = time.perf_counter()
            try:
                self.sync().pin(pool.tensor)
            except Exception as exc:
                raise DataPlaneError(ErrorCode.UNAVAILABLE, f"--cuda-pin start: page-locking the pool failed: "
                                                            f"{clip(str(exc), 300)}") from None
            logger.info("lmshm: the pool (%d bytes) is page-locked for CUDA copies (%.1f s)", pool.capacity,
                        time.perf_counter() - t0)

    @property
    def started(self) -> Optional[TorchCudaSync]:
        """The CUDA sync, if a CUDA request (or ``--cuda-pin start``) has made one."""
        return self._sync_

    def sync(self) -> TorchCudaSync:
        if self._sync_ is None:
            self._sync_ = TorchCudaSync(self.pin, self.pin_extent, self.copy_batch)
        return self._sync_

    # ---- one request, either direction ------------------------------------------------
    def run(self, job: CopyJob) -> Union[Answer, Then]:
        """STORE: reserve, copy in, commit once done. RETRIEVE: pin, copy out, unpin once done."""
        store, what, req, session = job.store, job.what, job.req, job.session
        nothing = "nothing was stored" if store else "no block was written"
        redo = "nothing was stored" if store else "recompute these blocks"
        objs: list = []
        if store:
            if session.ended:
                return error(ErrorCode.UNAVAILABLE, "STORE: the session ended before its copy ran")
        else:
            objs, refused = self.pin_sources(job)
            if refused is not None:
                return refused

        def give_back(_ok: bool = False) -> None:   # what this request holds in the pool, unused
            self.pool.abort(objs) if store else self.pool.unpin(objs, retrieved=False)

        if time.monotonic() > job.deadline:
            give_back()
            return self.late(what, nothing)
        sync, dev, cb = self.sync(), job.layout.cuda_device, req.chunk_blocks
        isolated = self._replies_after_copies(req.event)
        if not isolated and not self.events.room():
            give_back()
            return self._no_events(what, nothing)
        size = job.layout.chunk_bytes(cb)
        results: list[int] = []
        done = stream = None
        queued = False
        deadline = time.monotonic() + self.timeout_s
        try:
            stream = sync.stream(dev, session.id)
            base = self.pool.tensor.data_ptr()
            chunks: list[int] = []      # the request's chunks that are copied (a STORE skips those present)
            if store:
                for i, key in enumerate(req.keys):
                    outcome, obj = self.pool.reserve(job.uid, key, size, job.layout.digest, cb)
                    results.append(outcome)
                    if obj is not None:
                        objs.append(obj)
                        chunks.append(i)
            else:
                chunks = list(range(len(objs)))
            views = [self.pool.view(obj) for obj in objs]
            for view in views:   # before the host waits for the worker: a pin is a host call of its own
                sync.pin(self.pool.tensor, view.data_ptr() - base, view.numel() * view.element_size())
            self._order(session, req, sync, dev, what, min(job.deadline, deadline))
            if views:
                plan = self._plan(sync, job.layout, req.block_ids, chunks, [v.data_ptr() for v in views], cb,
                                  store=store)
                queued = True
                sync.submit(plan, stream, dev)
            done, handle = sync.record(stream, dev, not isolated)
        except Exception as exc:
            if queued and stream is not None:   # never hand back pool bytes the GPU may still use
                self._settle(sync, None, stream, dev, deadline, [job.reg], give_back)
            else:
                give_back()
            return self._refused(what, redo, nothing, job.reg, exc)
        outcome: list[bool] = []

        def release(ok: bool) -> None:   # the pool's bytes are let go only once the copies completed
            if not store:
                outcome.append(ok)
                self.pool.unpin(objs, retrieved=ok)
                if not ok:
                    self.pool.count_failure()
                return
            # Isolated mode replies after the copies: done after the worker stopped waiting, they
            # may have read reused blocks. (Default mode replied at once, and the worker's stream
            # waits for the server's event before reusing them.)
            if ok and isolated and time.monotonic() > job.deadline:
                ok = False
                self.late_requests += 1
            outcome.append(ok)
            if not ok:
                self.pool.abort(objs)
                self.pool.count_failure()
                return
            self.commit(objs)

        def after() -> None:
            self._settle(sync, done, stream, dev, deadline, [job.reg], release)

        def reply(event: bytes) -> Answer:
            if store:
                return protocol.StoreReply(results, size * len(objs), event)
            return protocol.RetrieveReply(len(req.keys), size * len(req.keys), event)

        if not isolated:
            self.events.keep(session.id, done)
            return Then(reply(handle), after)
        after()                       # isolated: the reply is the ordering, sent once the copies are done
        if outcome and outcome[0]:
            return reply(b"")
        if store:
            return error(ErrorCode.UNAVAILABLE,
                         f"STORE: the copies did not complete within {self.timeout_s:g} s (the GPU is stuck, "
                         "or they ended past the sender's wait_s); nothing was stored")
        return error(ErrorCode.DATA_LOSS, f"RETRIEVE: the copies did not complete within {self.timeout_s:g} s "
                                          "(the GPU is stuck); recompute these blocks")

    def _refused(self, what: str, redo: str, nothing: str, reg: Registration, exc: Exception) -> Answer:
        """The reply to a request whose copies could not be queued (what it held is handed back)."""
        if isinstance(exc, NotSignalled):     # nothing was queued
            self.late_requests += 1
            return error(ErrorCode.UNAVAILABLE,
                         f"{what}: {exc} was not signalled in time (by the sender's wait_s, or within "
                         f"--cuda-timeout {self.timeout_s:g} s), or the session ended; {nothing}")
        self.pool.count_failure()
        if isinstance(exc, CudaSyncError):
            return error(ErrorCode.INVALID_ARG, f"{what}: {clip(str(exc), 300)}; {redo}")
        if isinstance(exc, PinError):
            logger.error("lmshm: %s", str(exc))   # str: a record keeping exc keeps its frames' tensors
            return error(ErrorCode.UNAVAILABLE, f"{what}: the server could not page-lock its pool ({exc}); {redo}")
        if what == "STORE":
            logger.warning("lmshm: CUDA STORE from %s failed: %s", quote(reg.instance_id, 60), str(exc))
            return error(ErrorCode.DATA_LOSS, f"STORE: the copies could not be queued ({clip(str(exc), 300)}); "
                                              "nothing was stored")
        return error(ErrorCode.DATA_LOSS, f"RETRIEVE: {clip(str(exc), 300)}; recompute these blocks")

    # ---- ordering, plans, completion -----------------------------------------------------
    def _order(self, session: Session, req: CopyRequest, sync: TorchCudaSync, dev: int, what: str, until: float) -> None:
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
            self.checks.owner_of(session, iid, what)
            freg = self.registry.acquire(iid)
        except ServerError as exc:
            raise CudaSyncError(f"the flag page {quote(iid, 60)} of the token: {exc.message}") from None
        try:       # held while its word is read: an unregister waits for the read
            page = freg.tensor(FLAG_LAYER)
            kinds = {(w.device_type, w.device) for w in freg.wrappers}
            if page is None or page.dtype.itemsize != 8 or page.numel() < SLOTS or len(kinds) != 1 \
                    or _ordinal(next(iter(kinds))) != dev:
                raise CudaSyncError(f"instance {quote(iid, 60)} is not a flag page on cuda:{dev} "
                                    f"(one layer {FLAG_LAYER!r} of {SLOTS} 64-bit words)")
            if not sync.wait_word(page, slot, seq, until, ended):
                raise NotSignalled("the worker's flag word")
        finally:
            self.registry.let_go(freg)

    def _no_events(self, what: str, outcome: str) -> protocol.ErrorReply:
        now = time.monotonic()
        if now - self._no_events_logged >= 10.0:      # at most every 10 s: it may hit every request
            self._no_events_logged = now
            logger.warning("lmshm: %d interprocess CUDA events are kept and none of their copies has completed; "
                           "refusing default-mode requests until some have", len(self.events))
        return error(ErrorCode.UNAVAILABLE, f"{what}: the server holds {len(self.events)} interprocess CUDA events "
                                            "whose copies have not completed, its limit (cuda_sync.EVENT_TOTAL_CAP); "
                                            f"{outcome}, retry later")

    def _replies_after_copies(self, token: bytes) -> bool:
        """True: answer once the copies have completed, with no event (isolated mode). A flag
        token always is, whatever mode this server was started in: an isolated worker cannot
        open an interprocess event (no shared /dev/shm) and orders its work by the reply."""
        return token.startswith(FLAG_MAGIC) or self._isolated_mode()

    def _isolated_mode(self) -> bool:
        """True in isolated mode: flag words, replies after completion, no IPC events."""
        if self._isolated is None:
            self._isolated = ipc_policy.is_isolated_ipc()
        return self._isolated

    def _plan(self, sync: TorchCudaSync, layout: BlockLayout, block_ids: Sequence[int], chunks: Sequence[int],
              addrs: list[int], cb: int, *, store: bool) -> CopyPlan:
        """The copies of chunks ``chunks`` (indices into the request) at pool addresses ``addrs``,
        cut at the pool's pin extents (``layout.plan_cuda_copies``)."""
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1, cb)[np.asarray(chunks, dtype=np.intp)]
        extent = 0 if self.pin == "off" else getattr(sync, "pin_extent", self.pin_extent)
        return plan_cuda_copies(layout, ids, addrs, cb, store=store, pool_base=self.pool.tensor.data_ptr(),
                                extent=extent)

    def _settle(self, sync: TorchCudaSync, done: Any, stream: Any, dev: int, deadline: float,
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
                self.quarantined += 1
                return False
        if sync.wait(done, time.monotonic() + 1.0):
            release(False)
            return False
        for reg in hold:
            self.registry.hold_more(reg)
        with self._quarantine_lock:
            self._quarantine.append((done, release, hold))
        self.quarantined += 1
        logger.warning("lmshm: CUDA copies did not complete within %.0f s; their pool bytes and registration "
                       "are held until the GPU is done with them", self.timeout_s)
        return False

    # ---- lifecycle -----------------------------------------------------------------------
    def tick(self) -> None:
        """Expire kept events; hand back what timed-out copies held once the GPU is done."""
        if self._sync_ is None:
            return
        self.events.expire()
        self._drain_quarantine(self._sync_)

    def _drain_quarantine(self, sync: TorchCudaSync) -> None:
        if not self._quarantine:
            return
        with self._quarantine_lock:
            ready = [q for q in self._quarantine if sync.done(q[0])]
            self._quarantine = [q for q in self._quarantine if q not in ready]
        for _, release, hold in ready:
            try:
                release(False)
            finally:
                for reg in hold:
                    self.registry.let_go(reg)

    def session_ended(self, session_id: Hashable) -> Optional[Callable[[], None]]:
        """Drop the session's kept events; returns what must run after its queued jobs (drop its
        streams), or None."""
        self.events.drop(session_id)
        sync = self._sync_
        if sync is None or not hasattr(sync, "drop_session"):
            return None
        return lambda: sync.drop_session(session_id)

    def info(self) -> dict:
        sync = self._sync_
        pinned = sync.pinned_bytes(self.pool.tensor) if sync is not None and hasattr(sync, "pinned_bytes") else 0
        paths = getattr(sync, "_paths", None) or {}
        return dict(cuda_pinned_bytes=pinned, cuda_quarantined=self.quarantined,
                    cuda_events_dropped=self.events.dropped_early,
                    cuda_copy_path="/".join(sorted(set(paths.values()))),
                    cuda_copy_calls=getattr(sync, "copy_calls", 0), cuda_copy_pieces=getattr(sync, "copy_pieces", 0))

    def close(self) -> bool:
        """Wait (5 s at most) for quarantined copies, then unpin the pool. False: copies are
        still on the GPU, and the pool must stay mapped."""
        sync = self._sync_
        if sync is None:
            return True
        deadline = time.monotonic() + 5.0
        while self._quarantine and time.monotonic() < deadline:
            self._drain_quarantine(sync)
            time.sleep(0.01)
        if self._quarantine:
            logger.error("lmshm: %d CUDA request(s) still have copies on the GPU; the pool stays mapped",
                         len(self._quarantine))
            return False                    # DMA may still reach the pool's bytes: keep them
        if hasattr(sync, "unpin_all"):
            try:
                sync.unpin_all([self.pool.tensor])
            except Exception:
                logger.exception("lmshm: unpinning the pool failed")
        return True


def _ordinal(kind: tuple[str, str]) -> int:
    if kind[0] != "cuda":
        return -1
    return get_driver().local_ordinal(kind[1])
