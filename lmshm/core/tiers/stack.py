"""The tiers below the pool, as the data plane uses them: write-through and promotion.

``write_through(objs)``, after a STORE committed them: each object is pinned in the pool
(``Pool.hold``) and queued for each tier, put by two writer threads per tier
(``lmshm-<tier>-writer``), then unpinned. A queue holds at most ``queue_limit`` chunks and its
share of half the pool's bytes; past either the chunk is dropped for that tier and counted
(``drops``): STORE never waits for a tier, and write-through never pins the whole pool.

``promote(uid, keys, deadline)``, for a LOOKUP on a promoter thread: the leading chunks every
rank has in the pool or in some tier; those only in a tier are read into fresh pool objects
(reserve, ``Tier.get_into`` on a reader thread, commit; up to ``READ_GROUP_CHUNKS`` per reader
task). A chunk not read by ``deadline`` ends the prefix (``timeouts``); its read finishes in the
background. RETRIEVE only ever sees the pool, so it never waits on a tier.

The one trap: reserving may evict, and a LOOKUP's later promotions must not evict its own
chunks; so every chunk of the prefix stays pinned from when it is found or committed until
``release`` runs, after the LOOKUP has pinned them under its lease.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import threading
import time
from typing import Any, Optional, Sequence, Union

from lmshm.core.pool import BLOCKS, KEY, LAYOUT, NBYTES, OFFSET, UID, Pool, Reservation
from lmshm.core.tiers.base import ChunkMeta, Tier

logger = logging.getLogger("lmshm.tiers")

HEAD_BATCH = 32     # headers a LOOKUP reads ahead in one round trip (tiers with batched_heads)
READ_GROUP_CHUNKS = 16          # chunks one reader task promotes in a row (at most)
READ_GROUP_BYTES = 4 << 20      # ... and no more bytes than this, past its first chunk


class _Reads:
    """Consecutive chunks of one LOOKUP's promotion that one reader task reads, in order."""

    __slots__ = ("tier", "items", "nbytes", "future")

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self.items: list[tuple[bytes, ChunkMeta, tuple]] = []     # (key, meta, reserved object)
        self.nbytes = 0
        self.future: Optional[cf.Future] = None


class Promotion:
    """What ``promote`` leaves pinned for the LOOKUP; ``release()`` once it has its lease."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.held: list[tuple] = []

    def release(self) -> None:
        if self.held:
            self.pool.unpin(self.held, retrieved=False)
            self.held = []


class _Ahead:
    """One LOOKUP's headers read ahead from the tiers with ``batched_heads``: the first key a
    tier is asked for brings the headers of the next ``HEAD_BATCH`` keys of the LOOKUP's order
    in one round trip (a remote: one per 32 chunks, not one per chunk). A few are read for
    nothing when the prefix ends early; what a header says is checked again by ``get_into``."""

    def __init__(self, order: list[bytes]) -> None:
        self.order = order
        self.position = {k: p for p, k in enumerate(order)}
        self.known: dict[int, dict[bytes, Optional[ChunkMeta]]] = {}

    def head(self, t: int, tier: Tier, uid: int, key: bytes) -> Optional[ChunkMeta]:
        known = self.known.setdefault(t, {})
        if key not in known:
            p = self.position.get(key, len(self.order))
            batch = [k for k in self.order[p:p + HEAD_BATCH] if k not in known] or [key]
            known.update(zip(batch, tier.heads(uid, batch)))
        return known.get(key)


class TierStack:
    def __init__(self, pool: Pool, tiers: Sequence[Tier], *, queue_limit: Union[int, Sequence[int]],
                 timeout_s: float, readers: int = 4, writers: int = 2) -> None:
        self.pool = pool
        self.tiers = list(tiers)
        # one limit for every tier, or one per tier (--disk-queue, --remote-queue)
        self.queue_limits = [queue_limit] * len(self.tiers) if isinstance(queue_limit, int) else list(queue_limit)
        self.timeout_s = timeout_s
        self.readers = readers
        self._queues: list[queue.Queue] = [queue.Queue(maxsize=n) for n in self.queue_limits]
        # half the pool over all tiers: the queues of a slow disk and a slow remote together
        # never pin more than that, so STOREs keep room to evict
        self.queue_bytes_limit = pool.capacity // (2 * max(1, len(self.tiers)))
        self._queued_bytes = [0] * len(self.tiers)
        self._bytes_lock = threading.Lock()
        self._readers = cf.ThreadPoolExecutor(readers, thread_name_prefix="lmshm-tier-read")
        self._busy = threading.Condition()     # reads submitted and not finished
        self._reading = 0
        self._closed = False
        self._writers = [threading.Thread(target=self._write_loop, args=(t, q), name=f"lmshm-{t.name}-writer",
                                          daemon=True) for t, q in zip(self.tiers, self._queues) for _ in range(writers)]
        for w in self._writers:
            w.start()

    # ---- write-through ------------------------------------------------------------------
    def write_through(self, objs: Sequence[tuple]) -> None:
        if self._closed:
            return
        for i, (tier, q) in enumerate(zip(self.tiers, self._queues)):
            for obj in objs:
                if not tier.admit(obj[UID], obj[KEY]):
                    continue
                with self._bytes_lock:
                    room = self._queued_bytes[i] + obj[NBYTES] <= self.queue_bytes_limit
                    if room:
                        self._queued_bytes[i] += obj[NBYTES]
                if not room:
                    tier.stats.add(drops=1)
                    continue
                held = self.pool.hold(obj[UID], obj[KEY])
                try:
                    if held is not obj:             # evicted or replaced already
                        raise LookupError
                    q.put_nowait((i, obj))
                except (queue.Full, LookupError) as why:
                    if held is not None:
                        self.pool.unpin([held], retrieved=False)
                    self._unqueue(i, obj)
                    if isinstance(why, queue.Full):
                        tier.stats.add(drops=1)

    def _unqueue(self, i: int, obj: tuple) -> None:
        with self._bytes_lock:
            self._queued_bytes[i] -= obj[NBYTES]

    def _write_loop(self, tier: Tier, q: queue.Queue) -> None:
        while True:
            try:
                item = q.get(timeout=0.1)
            except queue.Empty:
                if self._closed:
                    return
                continue
            i, obj = item
            if self._closed:                    # shutting down: dropped, as close() drops the queue
                self.pool.unpin([obj], retrieved=False)
                self._unqueue(i, obj)
                tier.stats.add(drops=1)
                continue
            try:
                start, end = obj[OFFSET], obj[OFFSET] + obj[NBYTES]
                data = self.pool.bytes.view[start:end]
                framed = self._framed(tier, start, end)
                tier.put(obj[UID], obj[KEY], ChunkMeta(obj[NBYTES], obj[LAYOUT], obj[BLOCKS]), data, framed)
            except Exception:
                tier.stats.add(drops=1, errors=1)
                logger.exception("lmshm: the %s tier failed a write-through", tier.name)
            finally:
                self.pool.unpin([obj], retrieved=False)
                self._unqueue(i, obj)

    # ---- promotion ----------------------------------------------------------------------
    def promote(self, uid: int, keys: list[list[bytes]], deadline: float) -> Promotion:
        """Make the leading chunks that every rank has somewhere visible in the pool, held,
        as far as ``deadline`` allows (see the module docstring)."""
        done = Promotion(self.pool)
        n = min(len(k) for k in keys) if keys else 0
        # the order chunks are looked for in, for the tiers that read headers ahead in batches
        order = list(dict.fromkeys(rank_keys[i] for i in range(n) for rank_keys in keys))
        ahead = _Ahead(order)
        budget = int(self.pool.capacity * self.pool.max_pinned_fraction_per_uid)
        groups: list[_Reads] = []
        group: Optional[_Reads] = None
        # consecutive chunks of one tier are read by one task, up to READ_GROUP_CHUNKS of them
        # (READ_GROUP_BYTES): a future, a queue hop and a wake-up per group, not per chunk (256
        # KiB chunks: 1,024 a request); small LOOKUPs still spread over every reader
        per_group = max(1, min(READ_GROUP_CHUNKS, n * len(keys) // (2 * self.readers)))
        seen: set[bytes] = set()
        stop = False
        for i in range(n):
            for rank_keys in keys:
                key = rank_keys[i]
                if key in seen:
                    continue
                seen.add(key)
                obj = self.pool.hold(uid, key)
                if obj is not None:
                    done.held.append(obj)
                    continue
                found = self._find(uid, key, deadline, ahead)
                if found is None:
                    stop = True
                    break
                tier, meta = found
                budget -= meta.nbytes
                outcome, obj = self.pool.reserve(uid, key, meta.nbytes, meta.layout, meta.blocks) \
                    if budget >= 0 else (Reservation.NO_SPACE, None)
                if obj is None:
                    stop = True                     # no room, or a STORE of it is in flight
                    break
                if group is not None and (group.tier is not tier or len(group.items) >= per_group
                                          or group.nbytes >= READ_GROUP_BYTES):
                    self._submit_reads(uid, group)
                    group = None
                if group is None:
                    group = _Reads(tier)
                    groups.append(group)
                group.items.append((key, meta, obj))
                group.nbytes += meta.nbytes
            if stop:
                break
        if group is not None:
            self._submit_reads(uid, group)
        failed = False
        for g in groups:
            if failed:
                g.future.add_done_callback(self._finish_late(g))
                continue
            try:
                ok = g.future.result(timeout=max(0.0, deadline - time.monotonic()))
            except cf.TimeoutError:
                g.tier.stats.add(timeouts=1)
                g.future.add_done_callback(self._finish_late(g))
                failed = True
                continue
            objs = [item[2] for item in g.items]
            self._commit_held(objs[:ok], g.tier, done)
            if ok < len(objs):
                self.pool.abort(objs[ok:])
                g.tier.stats.add(misses=1)
                failed = True
        return done

    def _framed(self, tier: Tier, start: int, end: int) -> Optional[memoryview]:
        """The tier's ``head_room`` before an object and the object, when the pool keeps the room."""
        return self.pool.bytes.view[start - tier.head_room:end] if 0 < tier.head_room <= self.pool.head_room else None

    def _submit_reads(self, uid: int, group: "_Reads") -> None:
        """Read the group's chunks on a reader thread, in order, up to the first that fails; its
        future gives how many were read and checked (a tier's exception: logged, a miss)."""
        with self._busy:
            self._reading += 1
        tier = group.tier
        jobs = [(key, meta, self.pool.bytes.view[obj[OFFSET]:obj[OFFSET] + obj[NBYTES]],
                 self._framed(tier, obj[OFFSET], obj[OFFSET] + obj[NBYTES])) for key, meta, obj in group.items]

        def read() -> int:
            try:
                try:
                    return tier.get_run_into(uid, jobs)
                except Exception:
                    logger.exception("lmshm: the %s tier failed a read", tier.name)
                    return 0
            finally:
                with self._busy:
                    self._reading -= 1
                    self._busy.notify_all()
        try:
            group.future = self._readers.submit(read)
        except RuntimeError:                    # closed meanwhile: a miss
            with self._busy:
                self._reading -= 1
            group.future = cf.Future()
            group.future.set_result(0)

    def _find(self, uid: int, key: bytes, deadline: float, ahead: "_Ahead") -> Optional[tuple[Tier, ChunkMeta]]:
        for t, tier in enumerate(self.tiers):
            if time.monotonic() >= deadline:    # a slow tier's lookups used the LOOKUP's time up
                tier.stats.add(timeouts=1)
                return None
            meta = ahead.head(t, tier, uid, key) if tier.batched_heads else tier.head(uid, key)
            if meta is not None:
                tier.stats.add(hits=1)
                return tier, meta
        if self.tiers:
            self.tiers[-1].stats.add(misses=1)
        return None

    def _commit_held(self, objs: list[tuple], tier: Tier, done: Promotion) -> None:
        if not objs:
            return
        self.pool.commit(objs)
        tier.stats.add(promotions=len(objs))
        for obj in objs:
            held = self.pool.hold(obj[UID], obj[KEY])
            if held is not None:
                done.held.append(held)

    def _finish_late(self, group: "_Reads") -> Any:
        """Commit what a group read after its LOOKUP stopped waiting (visible for later LOOKUPs),
        abort the rest."""
        def finish(fut: cf.Future) -> None:
            ok = fut.result() if not fut.cancelled() and fut.exception() is None else 0
            objs = [item[2] for item in group.items]
            if ok:
                self.pool.commit(objs[:ok])
                group.tier.stats.add(promotions=ok)
            self.pool.abort(objs[ok:])
        return finish

    # ---- state and lifecycle ------------------------------------------------------------
    def info(self) -> list:
        return [t.info(q.qsize(), n) for t, q, n in zip(self.tiers, self._queues, self.queue_limits)]

    def close(self, timeout_s: float = 10.0) -> bool:
        """Stop the writers (queued write-throughs are dropped), wait for reads in progress,
        close the tiers. Before the pool is released: the threads read and write its bytes.
        False if a read or write was still stuck (a hung medium) after ``timeout_s``: then the
        pool must stay mapped, or that thread would fault when the medium wakes up."""
        if self._closed:
            return True
        self._closed = True
        for tier, q in zip(self.tiers, self._queues):
            while True:
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
                self.pool.unpin([item[1]], retrieved=False)
                self._unqueue(*item)
                tier.stats.add(drops=1)
        deadline = time.monotonic() + timeout_s
        for w in self._writers:
            w.join(max(0.0, deadline - time.monotonic()))
        self._readers.shutdown(wait=False, cancel_futures=True)
        with self._busy:
            self._busy.wait_for(lambda: self._reading == 0, max(0.0, deadline - time.monotonic()))
            stuck = self._reading
        stuck += sum(w.is_alive() for w in self._writers)
        if stuck:
            logger.error("lmshm: %d tier read(s) or write(s) still stuck after %g s at shutdown; the pool stays "
                         "mapped until the process exits", stuck, timeout_s)
            return False
        for tier in self.tiers:
            tier.close()
        return True
