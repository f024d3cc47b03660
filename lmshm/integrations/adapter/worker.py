"""``WorkerSide``: the worker's half of a connector. It runs a step's copies.

RETRIEVE before the forward pass (``load``: it waits, the forward pass needs the blocks),
STORE after it (``save``: asynchronous), and it tracks the stores in flight per request, so
that the engine frees a finished request's blocks only when no store still reads them
(``finished``). Failures are reported, never raised: a failed load is recomputed, a failed store
is a future miss.

Every wait is bounded by the link's timeout. The trap, on CUDA: the ordering event recorded
for a request must stay alive until the server's reply is here (``_InFlight.event``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Protocol

from lmshm.integrations.adapter.link import Link
from lmshm.integrations.adapter.plan import StepPlan
from lmshm.integrations.adapter.stats import WorkerStats
from lmshm.transport.client import Pending


class CudaOrdering(Protocol):
    """How a worker orders its CUDA stream with the server's copies (``WorkerCudaSync``)."""

    def ready(self) -> tuple[Any, bytes]:
        """``(keep, token)`` for a request sent now; keep ``keep`` alive until its reply."""

    def wait(self, handle: bytes) -> None:
        """Make the current stream wait for the server's event from a reply."""


@dataclass
class _InFlight:
    """A STORE sent by the worker: its reply, and (CUDA) the event it must keep alive until then."""

    pending: Pending
    event: Any = None
    settled: bool = False
    sent: float = 0.0


class WorkerSide:
    """The worker's half: runs a step's copies, tracks stores in flight per request.

    Every wait here is bounded: a reply that does not come within the link's timeout counts as a
    failed load (recomputed) or a dropped store."""

    def __init__(self, link: Link, rank: int = 0, *, corrupt_loads: Optional[Callable[[list[int]], None]] = None,
                 fail_loads: bool = False, cuda: Optional[CudaOrdering] = None) -> None:
        self.link = link
        self.rank = rank
        #: For a CUDA KV cache: a ``WorkerCudaSync``. Each request carries an event recorded on
        #: the worker's stream, and the stream waits on the server's event from the reply.
        self.cuda = cuda
        self._stores: dict[str, list[_InFlight]] = {}   # req id -> its STOREs
        self._finishing: set[str] = set()
        self._load_errors: set[int] = set()
        self._corrupt_loads = corrupt_loads        # the control experiment of the real-engine tests
        self._fail_loads = fail_loads              # every load fails (the recompute path, tested for real)
        self.stats = WorkerStats()
        self.loaded_chunks = self.stored_chunks = self.failed_loads = self.dropped_stores = 0

    def load(self, plan: StepPlan) -> None:
        """RETRIEVE every load of this step and wait: the forward pass needs them. A load is
        whole or failed: if any group's RETRIEVE fails, all its blocks are reported."""
        t0 = time.perf_counter()
        self.poll()
        pending = []
        for spec in plan.loads:
            ready = self._cuda_ready() if not self._fail_loads else None
            if self._fail_loads or ready is None:
                self.link.release(spec.lease)
                pending.append((spec, [None], None))
                continue
            ev, handle = ready
            sent = [self.link.retrieve(keys, ids, plan.chunk_blocks, spec.lease, handle, group=g)
                    for g, (keys, ids) in enumerate(zip(spec.keys[self.rank], spec.block_ids)) if keys]
            pending.append((spec, sent, ev))
        for spec, sent, _ev in pending:  # _ev lives until the replies are here
            replies = [self.link.outcome("retrieve", p) if p is not None else None for p in sent]
            if self.cuda is not None:
                for i, reply in enumerate(replies):
                    if reply is not None and not self._cuda_wait(reply.event, "RETRIEVE"):
                        replies[i] = None    # not ordered: the blocks are recomputed
            if any(reply is None for reply in replies):
                self.failed_loads += 1
                self.stats.failed_loads += 1
                self._load_errors.update(b for ids in spec.block_ids for b in ids)
            else:
                chunks = sum(reply.chunks for reply in replies)
                self.loaded_chunks += chunks
                self.stats.loaded_chunks += chunks
                self.stats.loaded_bytes += sum(reply.nbytes for reply in replies)
                if self._corrupt_loads is not None:
                    self._corrupt_loads([b for ids in spec.block_ids for b in ids])
        if plan.loads:
            self.stats.load_s.append(time.perf_counter() - t0)

    def save(self, plan: StepPlan) -> None:
        """Send this step's STOREs; they complete in the background, unless the plan says the
        engine may free their blocks at its next step (``plan.wait_stores``)."""
        self.poll()
        ready = self._cuda_ready() if plan.stores else (None, b"")
        if ready is None:                       # no ordering token: these stores cannot be sent
            self.dropped_stores += len(plan.stores)
            self.stats.dropped_stores += sum(len(k) for spec in plan.stores for k in spec.keys[self.rank])
            plan_stores = []
        else:
            plan_stores = plan.stores
        ev, handle = ready if ready is not None else (None, b"")
        now = time.perf_counter()
        for spec in plan_stores:
            mine = self._stores.setdefault(spec.req_id, [])
            for g, (keys, ids) in enumerate(zip(spec.keys[self.rank], spec.block_ids)):
                if not keys:
                    continue
                adverts = spec.adverts[g] if g < len(spec.adverts) else ()
                p = self.link.store(keys, ids, plan.chunk_blocks, handle, group=g, adverts=adverts,
                                    space=plan.space, pod=plan.pod)
                if p is None:
                    self.dropped_stores += 1
                    self.stats.dropped_stores += len(keys)
                else:
                    mine.append(_InFlight(p, ev, sent=now))
        if plan.wait_stores:
            self.wait_for_stores([s.req_id for s in plan.stores])

    def wait_for_stores(self, req_ids: Optional[Iterable[str]] = None) -> None:
        """Block until the given requests' (default: all) stores are done or have timed out
        (each STORE's reply has its own deadline, so this is bounded by the link's timeout)."""
        ids = list(self._stores) if req_ids is None else [r for r in req_ids if r in self._stores]
        for req_id in ids:
            for store in self._stores.get(req_id, []):
                self._settle(store)

    # ---- CUDA ordering: no CUDA error leaves the connector --------------------------------
    def _cuda_ready(self) -> Optional[tuple[Any, bytes]]:
        """``(keep, token)`` for requests sent now (``(None, b"")`` on CPU); None if the
        ordering token could not be made (counted; the requests are not sent)."""
        if self.cuda is None:
            return None, b""
        try:
            return self.cuda.ready()
        except Exception as exc:
            self.stats.cuda_errors += 1
            self.link.warn("cuda-ready", "cannot make a CUDA ordering token (%s); these blocks are not copied",
                           str(exc))
            return None

    def _cuda_wait(self, handle: bytes, what: str) -> bool:
        try:
            self.cuda.wait(handle)
            return True
        except Exception as exc:
            self.stats.cuda_errors += 1
            self.link.warn("cuda-wait", "cannot wait for the server's %s event (%s)", what, str(exc))
            return False

    def poll(self) -> None:
        """Settle every STORE whose reply is here (each step): the server's event is opened
        and waited on at once, long before the server lets it go (``EVENT_MIN_AGE_S``)."""
        for stores in self._stores.values():
            for st in stores:
                if not st.settled and st.pending.done():
                    self._settle(st)

    def _settle(self, store: _InFlight) -> None:
        if store.settled:
            return
        reply = self.link.outcome("store", store.pending)
        if reply is not None and self.cuda is not None:
            # Counted if it fails: the server keeps its events long past their completion
            # (EVENT_MIN_AGE_S), so an event that cannot be opened here is one it destroyed
            # after its copies were done, or a driver fault.
            self._cuda_wait(reply.event, "STORE")
        if reply is not None:
            ok = sum(1 for r in reply.results if r == 0)
            self.stored_chunks += ok
            self.stats.stored_chunks += ok
            self.stats.stored_bytes += reply.nbytes
            self.stats.store_s.append(time.perf_counter() - store.sent)
        else:
            self.stats.dropped_stores += 1
        store.settled, store.event = True, None

    def finished(self, finished_req_ids: Iterable[str]) -> set[str]:
        """Requests whose blocks may be freed now: finished, and no store in flight."""
        self._finishing.update(r for r in finished_req_ids if r in self._stores)
        self.poll()
        done = set()
        for req_id in list(self._finishing):
            stores = self._stores.get(req_id, [])
            if all(st.settled or st.pending.done() for st in stores):
                for st in stores:
                    self._settle(st)
                del self._stores[req_id]
                self._finishing.discard(req_id)
                done.add(req_id)
        return done

    def abandon(self) -> int:
        """Forget every store still in flight (shutdown, past its bound); how many there were."""
        n = sum(1 for stores in self._stores.values() for st in stores if not st.settled)
        for stores in self._stores.values():
            for st in stores:
                if not st.settled:
                    st.pending.cancel()
                    st.settled, st.event = True, None
        self.stats.dropped_stores += n
        self._stores.clear()
        self._finishing.clear()
        return n

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
