"""The data plane's requests: STORE, RETRIEVE, LOOKUP, RELEASE (``lmshm.wire.protocol`` has them).

An endpoint calls these on its request loop with a verified ``Session``. Each is checked there
first (``checks.py``), and a refusal raises ``DataPlaneError`` with the code to answer. STORE and
RETRIEVE are then queued here, on the copier threads (one FIFO per session, so a client's
copies apply in the order it sent them), and answered later through ``reply(identity,
request_id, answer)``: the methods return ``QUEUED``. A LOOKUP that must promote from the tiers
is queued the same way, on promoter threads; other LOOKUPs and RELEASEs answer at once.

Who owns what: ``Core`` builds the pool, the tier stack and the KV event index and hands them
over; the data plane owns its threads, and releases the pool at ``shutdown`` (after its copies,
tiers and quarantined CUDA copies are done). The trap: a queued job holds its registration until
its copy ends, so an unregister or a reclaim waits for the copy.
"""

from __future__ import annotations

import logging
import time
from typing import Hashable, Optional, Union

from lmshm.core.cuda_sync import TorchCudaSync
from lmshm.core.dataplane.checks import Checks
from lmshm.core.dataplane.config import DataPlaneConfig
from lmshm.core.dataplane.cuda import CudaCopies
from lmshm.core.dataplane.executor import OrderedExecutor
from lmshm.core.dataplane.host import HostCopies
from lmshm.core.dataplane.jobs import QUEUED, Answer, CopyJob, CopyRequest, Queued, Reply, ReplyTo, Session, Then, error
from lmshm.core.errors import ErrorCode
from lmshm.core.kv_events import KvIndex
from lmshm.core.pool import Pool, Reservation
from lmshm.core.registry import Registry
from lmshm.core.tiers.stack import TierStack
from lmshm.quoting import clip
from lmshm.wire import protocol

logger = logging.getLogger("lmshm.dataplane")

#: LOOKUPs that promote from the tiers at once, each on a thread of its own (``DataPlane.promoter``),
#: not on the copier threads: a promotion waits for its tier up to the tier's timeout, and on a
#: copier thread that wait held up other sessions' STOREs and RETRIEVEs
PROMOTE_THREADS = 4


class DataPlane:
    """STORE/RETRIEVE/LOOKUP/RELEASE over one pool. See the module documentation."""

    def __init__(self, config: DataPlaneConfig, *, registry: Registry, pool: Pool, reply: Reply,
                 tiers: Optional[TierStack] = None, kv_index: Optional[KvIndex] = None,
                 cuda_sync: Optional[TorchCudaSync] = None) -> None:
        self.config = config
        self.registry = registry
        self.pool = pool
        self.tiers = tiers                  # below the pool (core/tiers): written through, promoted by LOOKUP
        #: KV events (core/kv_events): which advertised chunks each tier can serve
        self.kv = kv_index if kv_index is not None else KvIndex(max_chunks=0)
        self._reply = reply
        self.copier = OrderedExecutor(config.copy_threads)
        self.promoter = OrderedExecutor(PROMOTE_THREADS, "lmshm-promote") if tiers is not None else None
        self.checks = Checks(config, registry, pool, self.copier)
        self.host = HostCopies(pool, tiers)
        self.cuda = CudaCopies(config, registry, pool, tiers, self.checks, cuda_sync)

    @property
    def late_requests(self) -> int:
        """STORE/RETRIEVEs refused or not committed: past their sender's wait_s."""
        return self.host.late_requests + self.cuda.late_requests

    # ---- requests -------------------------------------------------------------------------
    def store(self, session: Session, req: protocol.Store, reply_to: ReplyTo) -> Queued:
        adverts = self.checks.adverts(req)
        return self._queue(session, req, reply_to, adverts)

    def retrieve(self, session: Session, req: protocol.Retrieve, reply_to: ReplyTo) -> Queued:
        return self._queue(session, req, reply_to)

    def lookup(self, session: Session, req: protocol.Lookup,
               reply_to: ReplyTo) -> Union[protocol.LookupReply, Queued]:
        if not self.pool.capacity:
            return protocol.LookupReply(0, b"", 0.0)
        self.checks.lookup(session, req)
        uid = session.peer.uid
        ttl = min(req.ttl_s or self.config.lease_ttl_s, self.config.lease_ttl_s)
        if (self.tiers is not None and self.promoter.pending(session.id) < self.config.max_inflight_per_session
                and not self.pool.all_visible(uid, req.keys)):
            return self._lookup_tiers(session, req, uid, ttl, reply_to)
        hits, lease = self.pool.lookup(uid, req.keys, session.id, ttl)
        return protocol.LookupReply(hits, lease, ttl if hits else 0.0)

    def release(self, session: Session, req: protocol.Release) -> protocol.ReleaseReply:
        return protocol.ReleaseReply(self.pool.release_lease(req.lease, session.peer.uid))

    def _queue(self, session: Session, req: CopyRequest, reply_to: ReplyTo, adverts: int = 0) -> Queued:
        """Check on the loop, hold the registration, and queue the copy on the session's FIFO
        (``adverts``: how many a STORE carries)."""
        job = self.checks.copy_job(session, req)
        copies = self.cuda if job.layout.cuda_device >= 0 else self.host
        advertised = adverts > 0 and self.kv.enabled
        if advertised:      # here, where the request's bytes are in this core's cache (13 µs on a copier)
            try:
                self._advertise(job, adverts)
            except BaseException:           # no job will let the registration go
                self.registry.let_go(job.reg)
                raise

        def run() -> None:
            try:
                try:
                    result = copies.run(job)
                except Exception as exc:    # a bug, not the peer's doing: still one answer, never silence
                    result = self._failed(job.what, exc)
                self._send(reply_to, result)
                if advertised:
                    self._announce(job, result)
            finally:
                self.registry.let_go(job.reg)

        def cancel() -> None:
            try:
                if getattr(req, "lease", b""):
                    self.pool.release_lease(req.lease, job.uid)
                self._reply(*reply_to, error(ErrorCode.UNAVAILABLE, "lmshm-server is shutting down"))
            finally:
                self.registry.let_go(job.reg)

        self.copier.submit(session.id, run, cancel)
        return QUEUED

    @staticmethod
    def _failed(what: str, exc: Exception) -> protocol.ErrorReply:
        """The answer of a queued request whose job raised: INTERNAL, and the traceback logged."""
        logger.exception("lmshm: a %s job failed", what)
        return error(ErrorCode.INTERNAL, f"{what} failed in the server: {type(exc).__name__}: {clip(str(exc), 300)}")

    def _send(self, reply_to: ReplyTo, result: Union[Answer, Then]) -> None:
        if isinstance(result, Then):
            self._reply(*reply_to, result.reply)
            result.after()
        else:
            self._reply(*reply_to, result)

    def _advertise(self, job: CopyJob, adverts: int) -> None:
        """Tell the KV event index what a STORE's chunks are to their engine, before their copy
        (on the loop): queued (one append) still encoded (copied out of the request's buffer),
        decoded, checked and applied later (``KvIndex.drain``). A STORE that commits nothing
        leaves its adverts unresident, and ``KvIndex.prune`` forgets them."""
        req, reg = job.req, job.reg
        self.kv.describe(job.uid, req.space, reg.model_name, req.pod, reg.worker_rank, reg.world_size, req.keys,
                         req.adverts.copy(), reg.instance_id, adverts)

    def _announce(self, job: CopyJob, result: Union[Answer, Then]) -> None:
        """After an advertised STORE's reply: its chunks may be held from before, without an
        advert (the pool: those it did not store now, present already or no room; a tier: any),
        servable now that they have one. Told under the locks the pool and the tiers evict
        under, so never after an eviction of the chunk."""
        reply = result.reply if isinstance(result, Then) else result
        if not isinstance(reply, protocol.StoreReply):
            return
        keys = [k for k, r in zip(job.req.keys, reply.results) if r != Reservation.STORED]
        if keys:
            self.pool.announce(job.uid, keys)
        if self.tiers is not None:
            for t in self.tiers.tiers:
                t.announce(job.uid, job.req.keys)

    def _lookup_tiers(self, session: Session, req: protocol.Lookup, uid: int, ttl: float,
                      reply_to: ReplyTo) -> Queued:
        """A LOOKUP with tiers below the pool: on a promoter thread (``PROMOTE_THREADS``; a
        session's LOOKUPs in order), promote the chunks found only below (at most the tiers'
        ``timeout_s``), then pin the pool's leading chunks under a lease. A LOOKUP waits at most
        that long for a tier, never on the loop, and never holds a copier thread."""
        deadline = time.monotonic() + self.tiers.timeout_s

        def run() -> None:
            if session.ended:
                self._reply(*reply_to, error(ErrorCode.UNAVAILABLE, "LOOKUP: the session ended"))
                return
            try:
                held = self.tiers.promote(uid, req.keys, deadline)
                try:
                    hits, lease = self.pool.lookup(uid, req.keys, session.id, ttl)
                finally:
                    held.release()
                answer: Answer = protocol.LookupReply(hits, lease, ttl if hits else 0.0)
                if session.ended:   # it ended during the promotion: its leases were released before this one
                    self.pool.release_lease(lease, uid)
                    answer = error(ErrorCode.UNAVAILABLE, "LOOKUP: the session ended")
            except Exception as exc:        # as for copies: one answer, never silence
                answer = self._failed("LOOKUP", exc)
            self._reply(*reply_to, answer)

        def cancel() -> None:
            self._reply(*reply_to, error(ErrorCode.UNAVAILABLE, "lmshm-server is shutting down"))

        self.promoter.submit(session.id, run, cancel)
        return QUEUED

    # ---- lifecycle --------------------------------------------------------------------------
    def busy(self) -> bool:
        """A copy or a promotion is queued or running (a hint)."""
        return not self.copier.idle() or (self.promoter is not None and not self.promoter.idle())

    def session_ended(self, session_id: Hashable) -> None:
        self.pool.release_session(session_id)
        drop = self.cuda.session_ended(session_id)
        if drop is not None:     # after the session's queued jobs: the copier runs this in the session's order
            self.copier.submit(session_id, drop, drop)

    def tick(self) -> None:
        self.pool.expire()
        if self.kv.enabled:
            self.kv.prune()
        self.cuda.tick()

    def info(self) -> protocol.PoolInfo:
        tiers = self.tiers.info() if self.tiers is not None else []
        return protocol.PoolInfo(**self.pool.info(), **self.cuda.info(), late=self.late_requests, tiers=tiers)

    def shutdown(self) -> None:
        """Cancel queued copies and promotions, wait for running ones, drop the pool."""
        self.copier.shutdown()
        if self.promoter is not None:
            self.promoter.shutdown()
        if self.tiers is not None and not self.tiers.close():
            return                          # a tier's thread is stuck on the pool's bytes: keep it mapped
        if not self.cuda.close():
            return                          # DMA may still reach the pool's bytes: keep them
        self.pool.release()
