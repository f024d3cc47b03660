"""KV events: what the pool and the tiers below it hold, in vLLM's format, for routers.

A connector sends, with each STORE, an ``Advert`` per chunk (the engine's block hashes, tokens,
LoRA, extra keys). ``KvIndex`` (one per server) remembers them, learns from the pool and the
tiers which ranks hold each chunk where (``note``), and appends ``BlockStored`` when a chunk
becomes servable from a tier and ``BlockRemoved`` when it stops being so to its ``EventLog``,
which the publisher and each connector's ``KV_EVENTS`` read. What is applied lives in
``maps.IndexMaps``; design and figures: docs/design/kv-events.md.

``describe`` and ``note`` only queue; ``drain`` applies the queue in order, off the STORE's path,
in bounded units of work, and every reader drains first. The one trap: the pool and the disk
tier call ``note`` under their own locks (the locks they evict under, so a chunk is never
announced after its removal), from any thread. So queueing takes no lock of the index, the
index never calls back into the pool or a tier, it holds its own lock only for bounded work,
and the queue is bounded in entries, adverts and bytes (past them, whoever adds applies some).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from typing import Any, Optional, Sequence

import msgspec

from lmshm.core.kv_events.adverts import CheckedAdvert, block_digest, check_advert
from lmshm.core.kv_events.format import AllBlocksCleared, packed_tokens
from lmshm.core.kv_events.log import EventLog
from lmshm.core.kv_events.maps import IndexMaps
from lmshm.quoting import quote
from lmshm.wire.protocol import unpack_adverts

logger = logging.getLogger("lmshm.kv_events")

#: Queued entries (a STORE's adverts, one residency note, one commit's notes) past which the
#: thread that queues one applies a batch itself: the queue's bound (the adverts and the
#: commits' notes in it are bounded by ``MAX_QUEUED_ADVERTS``).
MAX_QUEUED = 1 << 16
MAX_QUEUED_ADVERTS = 1 << 16
#: Bytes of queued encoded adverts (a STORE's, as they came) past which, as past the above, the
#: thread that queues more applies a batch itself: a peer's adverts may be 320 KiB each (the
#: wire's limits), so the count alone would let the queue hold gigabytes. Both bound each
#: uid's queued adverts too: a STORE that would take its uid past either is not advertised
#: (``queue_refused``), so the queue holds at most that much per uid, however fast it floods.
MAX_QUEUED_ADVERT_BYTES = 64 << 20
#: Units of work (``_units``: a residency report 1, an advert 1 and one more per 16 blocks or
#: 4 KiB encoded) applied under one hold of the index's lock: what bounds how long it is held.
DRAIN_BATCH = 32

_raw_items = msgspec.msgpack.Decoder(list[msgspec.Raw])


def _array_of(raws: Sequence[msgspec.Raw]) -> msgspec.Raw:
    """A msgpack array of the already encoded ``raws``."""
    n = len(raws)
    head = bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 \
        else b"\xdd" + n.to_bytes(4, "big")
    return msgspec.Raw(head + b"".join(bytes(r) for r in raws))


def _units(advert: Any) -> int:
    if isinstance(advert, msgspec.Raw):
        return 1 + (len(advert) >> 12)
    return 1 + (len(advert.block_hashes) >> 4)


class _Describing:
    """A queued STORE's adverts being applied in steps (``KvIndex._advance``)."""

    __slots__ = ("entry", "items", "done")

    def __init__(self, entry: tuple) -> None:
        self.entry = entry
        self.items: Optional[list] = None       # the adverts, one per key (encoded or not)
        self.done = 0                           # how many are applied



class KvIndex:
    """The server's KV event index and its log. ``max_chunks`` 0 turns events off (nothing is
    indexed). A STORE's adverts may come still encoded (``msgspec.Raw``): the index decodes them
    with the wire's ``unpack_adverts`` when it applies them, off the request loop.

    ``describe`` and ``note`` only queue (``_queue``, a deque: appending is atomic, and takes
    no lock, so the pool may call ``note`` under its own); ``drain`` applies the queue in the
    order it was filled, under the index's lock, ``DRAIN_BATCH`` units of work at a time (a
    STORE of many adverts takes several: ``_advance``). Whatever reads the index drains first
    (the log's readers, ``leading``, ``hashes_of_tokens``, ``len``), so no reader sees less than
    the STOREs answered before it (but a KV_EVENTS read, which applies at most
    ``server.KV_EVENTS_APPLY`` units); the server's request loop drains a few whenever it has
    nothing else to do (``on_idle``); and a queue past ``MAX_QUEUED`` entries (or
    ``MAX_QUEUED_ADVERTS`` adverts) is drained in part by whoever adds to it. Who may change
    what in the maps: ``maps``'s docstring."""

    def __init__(self, *, max_chunks: int = 1 << 18, records: int = 65536, max_bytes: Optional[int] = None,
                 log_bytes: Optional[int] = None) -> None:
        self.max_chunks = max_chunks
        self.maps = IndexMaps(max_chunks, max_bytes)
        self.log = EventLog(records, log_bytes, before_read=self.drain)
        self._lock = threading.Lock()
        self._queue: deque[tuple] = deque()
        self._current: Optional[_Describing] = None    # the STORE being applied in steps
        self._queued_adverts = 0                   # adverts and batched notes in _queue (under _count_lock)
        self._queued_bytes = 0                     # their bytes, those queued encoded (under _count_lock)
        self._queued_by_uid: dict[int, tuple[int, int]] = {}   # uid -> its adverts and bytes queued
        self._count_lock = threading.Lock()
        self._pruned_at = 0.0
        self.refused = 0          # STOREs whose adverts did not check (check_advert): not advertised
        self.queue_refused = 0    # ... of them, refused because their uid's queued adverts were at the bound
        self.lag_refused = 0      # ... or because the node stream lagged, much of it their uid's (EventLog.lagging)
        self.failed = 0           # queued entries whose application raised (a bug; logged)

    @property
    def enabled(self) -> bool:
        return self.max_chunks > 0

    def __len__(self) -> int:
        self.drain()
        return len(self.maps.by_id)

    @property
    def chunks(self) -> int:
        """Chunks indexed, without applying the queue (O(1))."""
        return len(self.maps.by_id)

    @property
    def queued(self) -> int:
        """Entries not applied yet (a STORE being applied in steps counts as one)."""
        return len(self._queue) + (self._current is not None)

    @property
    def bytes(self) -> int:
        """``chunk_cost`` of every chunk indexed (at most ``max_bytes``)."""
        return self.maps.bytes

    @property
    def max_bytes(self) -> int:
        return self.maps.max_bytes

    @property
    def unindexed(self) -> int:
        """Chunks forgotten to make room: the index was full."""
        return self.maps.unindexed

    @property
    def unresident_dropped(self) -> int:
        """Adverts forgotten: their uid had ``MAX_UNRESIDENT`` waiting."""
        return self.maps.unresident_dropped

    @property
    def stored_events(self) -> int:
        return self.maps.stored_events

    @property
    def removed_events(self) -> int:
        return self.maps.removed_events

    # ---- what a STORE says, what the pool and the tiers hold: queued --------------------
    def describe(self, uid: int, space: bytes, model: str, pod: str, rank: int, world: int,
                 keys: Sequence[bytes], adverts: Any, source: str = "", count: int = 0) -> None:
        """Remember what each of a STORE's chunks is to its engine (queued before its copy
        commits). ``adverts``: the request's, still encoded (``Store.adverts``, with ``count``:
        how many, ``messages.advert_count``), or as ``Advert``s, or ``CheckedAdvert``s; decoded
        and checked when applied (``check_advert``; a STORE's adverts are applied in slices of
        ``DRAIN_BATCH`` units, and from a slice that does not check on, none is; ``source``
        names the sender in the log line of a refusal)."""
        if isinstance(adverts, msgspec.Raw):        # encoded: its length is bytes, not adverts
            n, size = count or 0, len(adverts)
        else:
            n, size = len(adverts), 0
        if not self.enabled or not n:
            return
        if self.log.lagging(uid):
            # the node stream is behind, much of it this uid's: stored, not advertised
            self.refused += 1
            self.lag_refused += 1
            return
        with self._count_lock:
            mine = self._queued_by_uid.get(uid, (0, 0))
            if mine[0] + n > MAX_QUEUED_ADVERTS or mine[1] + size > MAX_QUEUED_ADVERT_BYTES:
                # its uid's queued adverts are at the bound: this STORE is stored, not
                # advertised (so a flood grows neither the queue nor another tenant's wait)
                self.refused += 1
                self.queue_refused += 1
                return
            self._queued_by_uid[uid] = (mine[0] + n, mine[1] + size)
            self._queued_adverts += n
            self._queued_bytes += size
            over = self._queued_adverts > MAX_QUEUED_ADVERTS or self._queued_bytes > MAX_QUEUED_ADVERT_BYTES
        self._queue.append((uid, space, model, pod, rank, world, keys, adverts, source, n, size))
        if over or len(self._queue) > MAX_QUEUED:
            self.drain(4 * DRAIN_BATCH)

    def note(self, uid: int, key: bytes, tier: str, present: bool) -> None:
        """``(uid, key)`` is now held in ``tier`` (or not); emits, once applied, when that
        changes whether its chunk is servable from the tier. Queued in call order: the pool and
        the disk call it under the locks they evict under."""
        if not self.maps.by_key and not self._queue and self._current is None:
            return
        self._queue.append((uid, key, tier, present))
        if len(self._queue) > MAX_QUEUED:
            self.drain(4 * DRAIN_BATCH)

    def recorder(self, tier: str) -> Any:
        """``note`` for one tier, as ``record(uid, key, present)``: what the pool (its
        ``on_resident``) and the tiers call, one Python call per report."""
        queue, by_key, append = self._queue, self.maps.by_key, self._queue.append

        def record(uid: int, key: bytes, present: bool) -> None:
            if not by_key and not queue and self._current is None:
                return
            append((uid, key, tier, present))
            if len(queue) > MAX_QUEUED:
                self.drain(4 * DRAIN_BATCH)
        return record

    def batch_recorder(self, tier: str) -> Any:
        """``record(pairs)``: each ``(uid, key)`` of ``pairs`` is now held in ``tier``, as
        ``recorder``'s calls would say, in one queue entry (the pool's commit of a STORE's
        chunks)."""
        queue, by_key, append = self._queue, self.maps.by_key, self._queue.append

        def record(pairs: list) -> None:
            if not by_key and not queue and self._current is None:
                return
            with self._count_lock:          # its reports count as adverts do (MAX_QUEUED_ADVERTS)
                self._queued_adverts += len(pairs)
                over = self._queued_adverts > MAX_QUEUED_ADVERTS
            append((pairs, tier))
            if over or len(queue) > MAX_QUEUED:
                self.drain(4 * DRAIN_BATCH)
        return record

    def drain(self, limit: Optional[int] = None) -> int:
        """Apply queued entries in order: all of them (at most what was queued when it began,
        so a producer as fast cannot keep it here), or about ``limit`` units of work (``_units``:
        a residency report is one, a STORE's advert one and one more per 16 blocks; a STORE of
        many adverts is applied over several calls), ``DRAIN_BATCH`` under one hold of the lock
        (no yield of the CPU between batches: on a busy machine ``sched_yield`` gives the CPU to
        another process, docs/design/kv-events.md). Returns the units done."""
        queue = self._queue
        if not queue and self._current is None:
            return 0
        entries = len(queue) if limit is None else -1       # all: what is queued now, no more
        budget = (1 << 62) if limit is None else limit
        done = 0
        while done < budget:
            step = 0
            with self._lock:
                while step < DRAIN_BATCH and done + step < budget:
                    if self._current is not None:
                        step += self._advance(min(DRAIN_BATCH - step, budget - done - step))
                        continue
                    if entries == 0:
                        break
                    try:
                        entry = queue.popleft()
                    except IndexError:          # another thread drained it meanwhile
                        break
                    entries -= 1
                    step += self._apply(entry)
                self._flush()            # the batch's records, in order
            if not step:
                break
            done += step
        return done

    def _apply(self, entry: tuple) -> int:
        """One queued entry (under the lock); the units of work it took."""
        try:
            if len(entry) == 4:
                self.maps.note(*entry)
                return 1
            if len(entry) == 2:
                pairs, tier = entry
                try:
                    for uid, key in pairs:
                        self.maps.note(uid, key, tier, True)
                finally:
                    with self._count_lock:
                        self._queued_adverts -= len(pairs)
                return max(1, len(pairs))
            self._current = _Describing(entry)
            return 0
        except Exception:
            self.failed += 1
            logger.exception("lmshm: applying a KV event index entry failed")
            return 1

    def _advance(self, room: int) -> int:
        """Apply the next slice of the STORE being applied (``_current``): about ``room``
        units, at least one advert; the units taken."""
        cur = self._current
        uid, space, model, pod, rank, world, keys, adverts, source, n, size = cur.entry
        units = 0
        try:
            if cur.items is None:
                if isinstance(adverts, msgspec.Raw):
                    cur.items = _raw_items.decode(adverts)
                    units = 1 + (len(cur.items) >> 8)
                else:
                    cur.items = list(adverts)
                if len(cur.items) != len(keys):
                    raise ValueError(f"{len(cur.items)} adverts for {len(keys)} keys")
            items, start = cur.items, cur.done
            if self.log.lagging(uid):
                self.lag_refused += 1
                raise ValueError("the node stream is behind, much of it this uid's events: the rest not advertised")
            end = start
            while end < len(items) and (end == start or units < room):
                units += _units(items[end])
                end += 1
            part = items[start:end]
            if part and isinstance(part[0], msgspec.Raw):
                part = unpack_adverts(_array_of(part))
                if len(part) != end - start:
                    raise ValueError("an advert is not one msgpack value")
            checked = [a if isinstance(a, CheckedAdvert) else check_advert(a) for a in part]
            if not start and pod:
                self.maps.attach(uid, space, model, pod)
            self.maps.describe(uid, space, model, rank, world, keys[start:end], checked)
            cur.done = end
            if end < len(items):
                return units
        except ValueError as exc:     # msgspec's DecodeError and ValidationError among them
            self.refused += 1
            logger.debug("lmshm: STORE adverts from %s ignored: %s", quote(source, 60), exc)
        except Exception:
            self.failed += 1
            logger.exception("lmshm: applying a KV event index entry failed")
        self._current = None
        with self._count_lock:
            self._queued_adverts -= n
            self._queued_bytes -= size
            mine = self._queued_by_uid.pop(uid, (n, size))
            if mine != (n, size):
                self._queued_by_uid[uid] = (mine[0] - n, mine[1] - size)
        return max(units, 1)


    def prune(self, older_than_s: float = 60.0) -> int:
        """Forget adverts whose chunk never became resident anywhere (its STORE failed or found
        no room) once they are ``older_than_s`` old; returns how many."""
        now = time.monotonic()
        if now - self._pruned_at < min(10.0, older_than_s) or not self.maps.shares:
            return 0
        # no drain first: this runs on the request loop's tick, and an advert still queued is
        # younger than any it forgets
        self._pruned_at = now
        with self._lock:
            stale = self.maps.drop_unresident(now - older_than_s)
            self._flush()               # detach records of namespaces left empty
        return stale

    def cleared(self, model: str = "") -> None:
        """Everything the index knew is gone (the server starts, or lost its pool)."""
        self.drain()
        with self._lock:
            self.maps.clear()
            self.log.append(-1, b"", model, AllBlocksCleared())

    def _flush(self) -> None:
        """Append the records the maps made, in order, under one hold of the log's lock (the
        index's lock held)."""
        pending = self.maps.pending
        if pending:
            self.log.extend(pending)
            pending.clear()

    # ---- the pull endpoint's question ---------------------------------------------------
    def leading(self, hashes: Sequence[Any], tiers: Sequence[str]) -> dict[str, int]:
        """How many leading blocks of ``hashes`` each tier can serve, whole chunks only (any
        chunk posted under a hash may serve it)."""
        self.drain()
        with self._lock:
            return {tier: self.maps.leading(hashes, tier) for tier in tiers}

    def chains_of_tokens(self, token_ids: Sequence[int], block_size: int, lora: Optional[str] = None,
                         salt: Optional[str] = None) -> list[list[Any]]:
        """The engine block hashes of ``token_ids``'s whole blocks, for LoRA adapter ``lora``
        and cache salt ``salt`` (None: none), as far as each uid's adverts name them: from the
        first block (no parent), each block's tokens under its parent's hash (``token_key``).
        One chain per uid that knows the first block (distinct chains only, longest first)."""
        self.drain()
        blocks: list[bytes] = []
        for b in range(len(token_ids) // block_size):
            try:
                blocks.append(block_digest(packed_tokens(token_ids[b * block_size:(b + 1) * block_size])))
            except (OverflowError, TypeError):       # not int32: no advert has it
                break
        if not blocks:
            return []
        with self._lock:
            return self.maps.chains(blocks, lora, salt)

    def hashes_of_tokens(self, token_ids: Sequence[int], block_size: int, lora: Optional[str] = None,
                         salt: Optional[str] = None) -> list[Any]:
        """The longest of ``chains_of_tokens`` ([] for none)."""
        chains = self.chains_of_tokens(token_ids, block_size, lora, salt)
        return chains[0] if chains else []

    def block_sizes(self) -> list[int]:
        """The block sizes of the chunks indexed (the first 64 of them, O(1))."""
        with self._lock:
            return list(itertools.islice(self.maps.sizes, 64))
