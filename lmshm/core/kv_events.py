"""KV events: what the pool and the tiers below it hold, in vLLM's KV-event format, for routers.

A KV-aware router (llm-d's indexer, Dynamo's KV router, the vLLM router) learns where a prefix
is cached from ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events keyed by the
*engine's* block hashes. lmshm's keys are its own (``adapter.chunk_keys_from_hashes``), so a
connector that wants its chunks advertised sends, with each STORE, an ``Advert`` per chunk: the
engine's block hashes, parent hash, token ids, LoRA name and extra keys (``messages.Advert``).

``KvIndex`` (one per server) keeps, per advertised chunk, which ranks hold it in which tier
(``pool``, ``disk``, ``remote``; a tensor-parallel engine stores one key per rank). A chunk is
*servable* from a tier when every rank of its engine has it there; the index emits
``BlockStored`` when a chunk becomes servable from a tier and ``BlockRemoved`` when it stops
being so (eviction, corruption found, a remote value gone), into ``EventLog``: a bounded ring of
records, each with the uid and namespace ("space") it belongs to. Readers keep a cursor: the
server's ZMQ publisher reads every record, a connector reads its own uid's and space's
(``KV_EVENTS``) and republishes them on its engine's stream.

Medium and locality per tier (``TIER_MEDIA``): the pool is ``CPU``/``LOCAL``, the disk
``STORAGE``/``LOCAL``, the remote ``STORAGE``/``REMOTE``.

``describe`` and ``note`` only queue; ``drain`` applies the queue in order, off the STORE's
path (``KvIndex``'s docstring says who drains when); every reader drains first.

The easy thing to get wrong: the pool and the disk tier call ``note`` under their own locks
(the same locks their removals are told under, so a chunk is never announced after its
removal), from any thread, and the queue keeps that order. So this module never calls back
into the pool or a tier, holds its own lock only for dict work, and is bounded everywhere: the
queue (``MAX_QUEUED`` entries, ``MAX_QUEUED_ADVERTS`` adverts and batched notes,
``MAX_QUEUED_ADVERT_BYTES`` of encoded adverts: past them, whoever adds applies some),
``max_chunks`` adverts (a full index forgets its least recently stored chunk, with a
``BlockRemoved`` for each tier it was servable from, counted: the remote evicts without
telling, so entries it alone held would otherwise stay until the index refused every new chunk), ``records`` in the ring (the oldest go; a
reader behind them is told it lost some).
"""

from __future__ import annotations

import functools
import logging
import struct
import sys
import threading
import time
from array import array
from collections import OrderedDict, deque
from typing import Any, Iterable, Optional, Sequence, Union

import msgspec

from lmshm.quoting import quote

TIER_MEDIA = {"pool": ("CPU", "LOCAL"), "disk": ("STORAGE", "LOCAL"), "remote": ("STORAGE", "REMOTE")}
_OTHER_MEDIA = ("STORAGE", "LOCAL")

BlockHashValue = Union[int, bytes]

logger = logging.getLogger("lmshm.kv_events")


# ---- vLLM's wire format (vllm/distributed/kv_events.py, vLLM 0.32): a map tagged by "type" ----


class KvEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base of the three events; the tag is the class name, in the ``"type"`` field."""


class BlockStored(KvEvent):
    block_hashes: list[BlockHashValue]
    parent_block_hash: Optional[BlockHashValue]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Any]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None


class BlockRemoved(KvEvent):
    block_hashes: list[BlockHashValue]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class AllBlocksCleared(KvEvent):
    pass


class KvEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


_encoder = msgspec.msgpack.Encoder()


def encode_batch(events: Sequence[KvEvent], ts: Optional[float] = None) -> bytes:
    """One ``KVEventBatch`` payload, as vLLM's publisher sends it."""
    return _encoder.encode(KvEventBatch(time.time() if ts is None else ts, list(events)))


_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                  "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality",
                  "ownership", "session_id")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_FIELDS = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS, "AllBlocksCleared": ()}


class BadBatch(ValueError):
    """A payload that is not a KV event batch in either encoding."""


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]]]:
    """``(ts, events)`` from a ``KVEventBatch`` payload in either encoding vLLM has used: events
    as maps tagged by ``"type"`` (vLLM >= 0.20, PR #42892) or as positional arrays whose first
    item is the tag (before). Each event comes back as a dict with ``"type"`` and its fields."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise BadBatch(f"not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise BadBatch("a KV event batch is an array [ts, events, (data_parallel_rank)]")
    out = []
    for item in raw[1]:
        if isinstance(item, dict):
            kind = item.get("type")
            if kind not in _FIELDS:
                raise BadBatch(f"unknown event type {str(kind)[:40]!r}")
            out.append(dict(item))
        elif isinstance(item, list) and item and item[0] in _FIELDS:
            names = _FIELDS[item[0]]
            event = {"type": item[0]}
            event.update(zip(names, item[1:1 + len(names)]))
            out.append(event)
        else:
            raise BadBatch("an event is a map with a 'type' or an array starting with its tag")
    return float(raw[0]), out


# ---- the index: which ranks hold an advertised chunk in which tier ----------------------


def _packed(tokens: Sequence[int]) -> bytes:
    """Token ids as the index keeps them: little-endian int32 (``Advert.tokens``'s form)."""
    a = array("i", tokens)
    if _BIG_ENDIAN:
        a.byteswap()
    return a.tobytes()


def _ints(tokens: bytes) -> list[int]:
    """The token ids of packed ``tokens`` (little-endian int32), as a list."""
    if _BIG_ENDIAN:
        a = array("i", tokens)
        a.byteswap()
        return a.tolist()
    return memoryview(tokens).cast("i").tolist()


_BIG_ENDIAN = sys.byteorder == "big"


@functools.lru_cache(maxsize=64)
def _unpacker(n: int) -> Any:
    return struct.Struct(f"<{n}i").unpack


def _int_tuple(tokens: bytes) -> tuple:
    """The token ids of packed ``tokens`` as a tuple: what an event carries (one unpack, about
    half of ``tuple(_ints(tokens))``)."""
    return _unpacker(len(tokens) >> 2)(tokens)


class _Chunk(msgspec.Struct, gc=False):
    """One advertised chunk. Never tracked by the cyclic GC (``gc=False``): every field is an
    atom, a tuple of atoms or a dict of atoms, none refers back to a chunk, so no cycle can
    form. As a class of its own with a list, sets and a dict of sets it was 7 tracked objects a
    chunk, and a full index at the default (262,144 chunks) made every full collection of the
    server take 466 ms, every thread held, where it takes 2 ms without (in process; test
    ``test_the_index_and_the_log_add_nothing_for_the_cyclic_gc_to_walk``)."""

    ident: tuple
    uid: int
    space: bytes
    model: str
    world: int
    group: int
    hashes: tuple                       # the engine's block hashes
    parent: Any
    tokens: bytes                       # packed int32 (CheckedAdvert)
    block_size: int
    lora: Optional[str]
    extra: Optional[tuple]              # per block, its extra keys (lists made tuples)
    born: float
    keys: dict = {}                     # rank -> that rank's key
    where: dict = {}                    # tier -> the ranks holding it there, a bit each
    servable: tuple = ()                # tiers BlockStored was sent for (and not removed)
    tkeys: tuple = ()                   # per block, its token_key (token_keys)

    def rank_of(self, key: bytes) -> int:
        for rank, k in self.keys.items():
            if k == key:
                return rank
        return -1


def _new_chunk(ident: tuple, uid: int, space: bytes, model: str, world: int, advert: Any, born: float) -> _Chunk:
    extra = advert.extra_keys
    chunk = _Chunk(ident, uid, space, model, world, advert.group, tuple(advert.block_hashes),
                   advert.parent_block_hash, advert.tokens, advert.block_size, advert.lora_name,
                   None if extra is None else _frozen(extra), born)
    chunk.tkeys = token_keys(chunk)
    return chunk


def _frozen(value: Any) -> Any:
    """``value`` with every list made a tuple (extra keys: plain values, ``check_advert``)."""
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


def token_keys(chunk: _Chunk) -> tuple:
    """Per block of ``chunk``, its ``token_key`` (``KvIndex.hashes_of_tokens`` walks them from
    the first block), or None for a block a lookup by tokens cannot name (``block_salt``)."""
    tokens = chunk.tokens
    if not tokens:
        return ()
    step = 4 * chunk.block_size
    hashes = chunk.hashes
    if chunk.extra is None and chunk.lora is None:      # no salt, nothing unnamed: the common case
        if len(hashes) == 1:
            return ((chunk.parent, tokens, None, None),)
        return tuple((hashes[i - 1] if i else chunk.parent, tokens[i * step:(i + 1) * step], None, None)
                     for i in range(len(hashes)))
    extra = chunk.extra or (None,) * len(hashes)
    out: list[Optional[TokenKey]] = []
    for i in range(len(hashes)):
        parent = hashes[i - 1] if i else chunk.parent
        salt = block_salt(extra[i], chunk.lora, parent is None)
        out.append(None if salt is UNNAMED else
                   token_key(parent, tokens[i * step:(i + 1) * step], chunk.lora, salt))
    return tuple(out)


#: ``(parent block hash, the block's packed tokens, LoRA name, cache salt)``: what a lookup by
#: token ids can name a block by. The salt is the first block's only (None elsewhere).
TokenKey = tuple[Any, bytes, Optional[str], Optional[str]]
UNNAMED = object()


def token_key(parent: Any, tokens: bytes, lora: Optional[str], salt: Optional[str]) -> TokenKey:
    return (parent, tokens, lora, salt)


def block_salt(extra: Any, lora: Optional[str], first: bool) -> Any:
    """The cache salt a block's extra keys carry (None: none), or ``UNNAMED`` when they carry
    more than a lookup by tokens can say. In vLLM's events (``to_event_extra_keys``) a block's
    keys are its LoRA name (every block of a LoRA request), ``[identifier, offset]`` per
    multimodal input, the cache salt (the first block only), a prompt-embeds digest (bytes),
    in that order. So a block is named by its tokens, LoRA and salt when its keys are exactly
    ``[lora]`` (nothing without one), plus, on the first block, one string."""
    keys = list(extra) if isinstance(extra, (list, tuple)) else [] if extra is None else [extra]
    head = [lora] if lora is not None else []
    if keys == head:
        return None
    if first and len(keys) == len(head) + 1 and keys[:-1] == head and isinstance(keys[-1], str):
        return keys[-1]
    return UNNAMED


class Record(msgspec.Struct, frozen=True, gc=False):
    """One entry of the event log: an event (or an engine seen for the first time: ``pod``)
    and whose it is."""

    n: int                   # position in the log, from 1
    uid: int
    space: bytes
    model: str
    event: Optional[KvEvent]
    pod: str = ""            # attach records: an engine that advertises into (uid, space)


class EventLog:
    """A bounded ring of ``Record``s; readers keep their own cursor (``n`` of the last read).
    ``before_read`` (set by the ``KvIndex`` that owns the log) runs before each read: the
    index applies what it has queued, so a reader sees every STORE answered before it."""

    def __init__(self, records: int = 65536) -> None:
        self.capacity = max(16, records)
        self._ring: deque[Record] = deque()
        self._lock = threading.Lock()
        self._next = 1
        self.trimmed = 0          # records dropped from the ring's old end
        self.epoch = ""           # set by the owner: a new value means the log started over
        self.before_read: Optional[Any] = None

    def append(self, uid: int, space: bytes, model: str, event: Optional[KvEvent], pod: str = "") -> None:
        self.extend(((uid, space, model, event, pod),))

    def extend(self, entries: Iterable[tuple]) -> None:
        """Append ``(uid, space, model, event, pod)`` tuples in order, under one hold of the lock."""
        with self._lock:
            ring, n = self._ring, self._next
            for uid, space, model, event, pod in entries:
                ring.append(Record(n, uid, space, model, event, pod))
                n += 1
            self._next = n
            over = len(ring) - self.capacity
            if over > 0:
                for _ in range(over):
                    ring.popleft()
                self.trimmed += over

    @property
    def last(self) -> int:
        return self._next - 1

    @property
    def oldest(self) -> int:
        with self._lock:
            return self._ring[0].n if self._ring else self._next

    def read(self, after: int, limit: int, uid: Optional[int] = None, spaces: Optional[Iterable[bytes]] = None,
             max_bytes: int = 1 << 62, apply: Optional[int] = None) -> tuple[list[Record], int, bool]:
        """``(records, cursor, lost)``: up to ``limit`` records after ``after`` (of ``uid`` and
        ``spaces``, if given), the cursor to read from next, and whether records the reader had
        not read were dropped from the ring (``after`` below the oldest one kept). ``after``
        -1: from the oldest kept, nothing lost. ``max_bytes`` bounds the events' encoded size
        (roughly; at least one record is returned). ``apply``: how many queued index entries
        ``before_read`` applies first (None: all)."""
        if self.before_read is not None:
            self.before_read(apply)
        wanted = set(spaces) if spaces is not None else None
        out: list[Record] = []
        size = 0
        with self._lock:
            ring = self._ring
            first = ring[0].n if ring else self._next
            if after < 0:
                after = first - 1
            lost = after + 1 < first
            cursor = max(after, first - 1)
            for i in range(max(0, after + 1 - first), len(ring)):
                r = ring[i]
                cursor = r.n
                if (uid is None or r.uid == uid) and (wanted is None or r.space in wanted):
                    size += event_bytes(r.event)
                    if out and size > max_bytes:
                        cursor = r.n - 1
                        break
                    out.append(r)
                    if len(out) >= limit:
                        break
        return out, min(cursor, self._next - 1), lost


def event_bytes(event: Optional[KvEvent]) -> int:
    """About how many bytes ``event`` encodes to (a bound for replies and buffers)."""
    if isinstance(event, BlockStored):
        return 160 + 34 * len(event.block_hashes) + 5 * len(event.token_ids) + 64 * len(event.extra_keys or ())
    if isinstance(event, BlockRemoved):
        return 80 + 34 * len(event.block_hashes)
    return 32


#: Queued entries (a STORE's adverts, one residency note, one commit's notes) past which the
#: thread that queues one applies a batch itself: the queue's bound (the adverts and the
#: commits' notes in it are bounded by ``MAX_QUEUED_ADVERTS``).
MAX_QUEUED = 1 << 16
MAX_QUEUED_ADVERTS = 1 << 16
#: Bytes of queued encoded adverts (a STORE's, as they came) past which, as past the above, the
#: thread that queues more applies a batch itself: a peer's adverts may be 320 KiB each (the
#: wire's limits), so the count alone would let the queue hold gigabytes
MAX_QUEUED_ADVERT_BYTES = 64 << 20
#: Entries applied under one hold of the index's lock (a few hundred µs at most).
DRAIN_BATCH = 32


class KvIndex:
    """See the module docstring. ``max_chunks`` 0 turns events off (nothing is indexed).

    ``describe`` and ``note`` only queue (``_queue``, a deque: appending is atomic, and takes
    no lock, so the pool may call ``note`` under its own); ``drain`` applies the queue in the
    order it was filled, under the index's lock, ``DRAIN_BATCH`` entries at a time. Whatever
    reads the index drains first (the log's readers, ``leading``, ``hashes_of_tokens``,
    ``len``), so no reader sees less than the STOREs answered before it (but a KV_EVENTS
    read, which applies at most ``server.KV_EVENTS_APPLY`` entries); the server's
    request loop drains a few entries whenever it has nothing else to do (``on_idle``); and a
    queue past ``MAX_QUEUED`` entries (or ``MAX_QUEUED_ADVERTS`` adverts) is drained in part by
    whoever adds to it."""

    def __init__(self, *, max_chunks: int = 1 << 18, records: int = 65536) -> None:
        self.max_chunks = max_chunks
        self.log = EventLog(records)
        self.log.before_read = self.drain
        self._lock = threading.Lock()
        self._queue: deque[tuple] = deque()
        self._pending: list[tuple] = []            # records of the batch being applied (drain)
        self._queued_adverts = 0                   # adverts and batched notes in _queue (under _count_lock)
        self._queued_bytes = 0                     # their bytes, those queued encoded (under _count_lock)
        #: decodes a STORE's encoded adverts (``messages.unpack_adverts``, set by the data plane:
        #: the messages import this module, so it cannot import them)
        self.unpack_adverts: Optional[Any] = None
        self._count_lock = threading.Lock()
        self._by_key: dict[tuple[int, bytes], _Chunk] = {}   # (uid, key) -> its chunk (rank: chunk.rank_of)
        # (uid, space, group, chunk id) -> chunk, least recently stored first (what a full index forgets)
        self._by_id: OrderedDict[tuple[int, bytes, int, bytes], _Chunk] = OrderedDict()
        self._by_hash: dict[Any, _Chunk] = {}                            # an engine block hash -> its chunk
        self._by_tokens: dict[TokenKey, Any] = {}                        # a block's token_key -> its hash
        self._pods: set[tuple[int, bytes, str]] = set()
        self._unresident: dict[tuple, _Chunk] = {}       # indexed, not yet held anywhere (see prune)
        self._pruned_at = 0.0
        self.unindexed = 0        # chunks forgotten to make room: the index was full
        self.refused = 0          # STOREs whose adverts did not check (check_advert): not advertised
        self.stored_events = self.removed_events = 0
        self.failed = 0           # queued entries whose application raised (a bug; logged)

    @property
    def enabled(self) -> bool:
        return self.max_chunks > 0

    def __len__(self) -> int:
        self.drain()
        return len(self._by_id)

    @property
    def queued(self) -> int:
        """Entries not applied yet."""
        return len(self._queue)

    # ---- what a STORE says, what the pool and the tiers hold: queued --------------------
    def describe(self, uid: int, space: bytes, model: str, pod: str, rank: int, world: int,
                 keys: Sequence[bytes], adverts: Any, source: str = "", count: int = 0) -> None:
        """Remember what each of a STORE's chunks is to its engine (queued before its copy
        commits). ``adverts``: the request's, still encoded (``Store.adverts``, with ``count``:
        how many, ``messages.advert_count``), or as ``Advert``s, or ``CheckedAdvert``s; decoded and checked when applied
        (``check_advert``, all or none; ``source`` names the sender in the log line of a
        refusal)."""
        if isinstance(adverts, msgspec.Raw):        # encoded: its length is bytes, not adverts
            n, size = count or 0, len(adverts)
        else:
            n, size = len(adverts), 0
        if not self.enabled or not n:
            return
        with self._count_lock:
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
        if not self._by_key and not self._queue:
            return
        self._queue.append((uid, key, tier, present))
        if len(self._queue) > MAX_QUEUED:
            self.drain(4 * DRAIN_BATCH)

    def recorder(self, tier: str) -> Any:
        """``note`` for one tier, as ``record(uid, key, present)``: what the pool (its
        ``on_resident``) and the tiers call, one Python call per report."""
        queue, by_key, append = self._queue, self._by_key, self._queue.append

        def record(uid: int, key: bytes, present: bool) -> None:
            if not by_key and not queue:
                return
            append((uid, key, tier, present))
            if len(queue) > MAX_QUEUED:
                self.drain(4 * DRAIN_BATCH)
        return record

    def batch_recorder(self, tier: str) -> Any:
        """``record(pairs)``: each ``(uid, key)`` of ``pairs`` is now held in ``tier``, as
        ``recorder``'s calls would say, in one queue entry (the pool's commit of a STORE's
        chunks)."""
        queue, by_key, append = self._queue, self._by_key, self._queue.append

        def record(pairs: list) -> None:
            if not by_key and not queue:
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
        so a producer as fast cannot keep it here), or ``limit``, ``DRAIN_BATCH`` under one
        hold of the lock (no yield of the CPU between batches: ``sched_yield`` on a busy
        machine gave it to another process, 340 µs a call measured). Returns how many."""
        queue = self._queue
        if not queue:
            return 0
        todo = len(queue) if limit is None else min(limit, len(queue))
        done = 0
        while done < todo:
            adverts = size = 0
            with self._lock:
                for _ in range(min(DRAIN_BATCH, todo - done)):
                    try:
                        entry = queue.popleft()
                    except IndexError:          # another thread drained it meanwhile
                        todo = done
                        break
                    done += 1
                    try:
                        if len(entry) == 4:
                            self._note(*entry)
                        elif len(entry) == 2:
                            pairs, tier = entry
                            adverts += len(pairs)
                            for uid, key in pairs:
                                self._note(uid, key, tier, True)
                        else:
                            adverts += entry[9]
                            size += entry[10]
                            self._describe(*entry[:9])
                    except Exception:  # noqa: BLE001 - a bug; the entries after it still apply
                        self.failed += 1
                        logger.exception("lmshm: applying a KV event index entry failed")
                if self._pending:        # the batch's records, in order, under one hold of the log's lock
                    self.log.extend(self._pending)
                    self._pending.clear()
            if adverts:
                with self._count_lock:
                    self._queued_adverts -= adverts
                    self._queued_bytes -= size
        return done

    # ---- applying them (under the index's lock) -----------------------------------------
    def _describe(self, uid: int, space: bytes, model: str, pod: str, rank: int, world: int,
                  keys: Sequence[bytes], adverts: Any, source: str) -> None:
        try:
            if isinstance(adverts, msgspec.Raw):
                adverts = self._unpack(adverts, len(keys))
            adverts = [a if isinstance(a, CheckedAdvert) else check_advert(a) for a in adverts]
        except ValueError as exc:     # msgspec's DecodeError and ValidationError among them
            self.refused += 1
            logger.debug("lmshm: STORE adverts from %s ignored: %s", quote(source, 60), exc)
            return
        if pod and (uid, space, pod) not in self._pods and len(self._pods) < 4096:
            self._pods.add((uid, space, pod))
            self._pending.append((uid, space, model, None, pod))
        by_id, by_key, unresident = self._by_id, self._by_key, self._unresident
        by_hash, by_tokens = self._by_hash, self._by_tokens
        born = time.monotonic()
        for key, advert in zip(keys, adverts):
            ident = (uid, space, advert.group, bytes(advert.chunk))
            chunk = by_id.get(ident)
            if chunk is None:
                if len(by_id) >= self.max_chunks:
                    self._forget_oldest()
                chunk = by_id[ident] = _new_chunk(ident, uid, space, model, world, advert, born)
                unresident[ident] = chunk
                for h in chunk.hashes:
                    by_hash[h] = chunk
                for tk, h in zip(chunk.tkeys, chunk.hashes):
                    if tk is not None:
                        by_tokens[tk] = h
                chunk.keys = {rank: key}
            else:
                by_id.move_to_end(ident)
                old = chunk.keys.get(rank)
                if old is not None and old != key:
                    by_key.pop((uid, old), None)
                chunk.keys[rank] = key
            by_key[(uid, key)] = chunk

    def _unpack(self, adverts: msgspec.Raw, keys: int) -> list:
        """A STORE's encoded adverts, decoded by ``unpack_adverts``: ``ValueError`` when they do
        not decode, or are not one per key."""
        if self.unpack_adverts is None:
            raise ValueError("encoded adverts, and no decoder for them")
        out = self.unpack_adverts(adverts)
        if len(out) != keys:
            raise ValueError(f"{len(out)} adverts for {keys} keys")
        return out

    def _note(self, uid: int, key: bytes, tier: str, present: bool) -> None:
        chunk = self._by_key.get((uid, key))
        if chunk is None:
            return
        bit = 1 << chunk.rank_of(key)
        ranks = chunk.where.get(tier, 0)
        if present:
            ranks |= bit
            self._unresident.pop(chunk.ident, None)
            if self._by_id.get(chunk.ident) is chunk:
                self._by_id.move_to_end(chunk.ident)
        else:
            ranks &= ~bit
        chunk.where[tier] = ranks
        full = ranks.bit_count() >= chunk.world
        if full and tier not in chunk.servable:
            chunk.servable += (tier,)
            self._emit(chunk, tier, True)
        elif not full and tier in chunk.servable:
            chunk.servable = tuple(t for t in chunk.servable if t != tier)
            self._emit(chunk, tier, False)
        if not present and not any(chunk.where.values()):
            self._drop_chunk(chunk)

    def _forget_oldest(self) -> None:
        """Make room (the index is full): forget the least recently stored chunk, and tell
        readers it is gone from every tier it was servable from. A router then misses a chunk
        lmshm may still hold, which costs a recomputation, never a request sent for nothing."""
        _, chunk = self._by_id.popitem(last=False)
        for tier in sorted(chunk.servable):
            self._emit(chunk, tier, False)
        chunk.servable = ()
        self._drop_chunk(chunk)
        self.unindexed += 1

    def _drop_chunk(self, chunk: _Chunk) -> None:
        if self._by_id.get(chunk.ident) is chunk:
            del self._by_id[chunk.ident]
        if self._unresident.get(chunk.ident) is chunk:
            del self._unresident[chunk.ident]
        for key in chunk.keys.values():
            if self._by_key.get((chunk.uid, key)) is chunk:
                del self._by_key[(chunk.uid, key)]
        tokens = chunk.tkeys
        for i, h in enumerate(chunk.hashes):
            if self._by_hash.get(h) is chunk:
                del self._by_hash[h]
                if tokens and tokens[i] is not None and self._by_tokens.get(tokens[i]) == h:
                    del self._by_tokens[tokens[i]]

    def _emit(self, chunk: _Chunk, tier: str, stored: bool) -> None:
        # tuples, not lists (they encode alike): a tuple of ints or bytes leaves the cyclic
        # GC's care at its first collection, where a list stays: a full log of lists made
        # every full collection of the server walk 65,536 more objects (3.7 -> 13.7 ms in
        # process; with tuples 4.5 ms)
        medium, locality = TIER_MEDIA.get(tier, _OTHER_MEDIA)
        if stored:      # positional: BlockStored's fields in order (block_hashes ... locality)
            event: KvEvent = BlockStored(chunk.hashes, chunk.parent, _int_tuple(chunk.tokens), chunk.block_size,
                                         None, medium, chunk.lora, chunk.extra, chunk.group, None, None, locality)
            self.stored_events += 1
        else:
            event = BlockRemoved(chunk.hashes, medium, chunk.group, locality)
            self.removed_events += 1
        self._pending.append((chunk.uid, chunk.space, chunk.model, event, ""))

    def prune(self, older_than_s: float = 60.0) -> int:
        """Forget adverts whose chunk never became resident anywhere (its STORE failed or found
        no room) once they are ``older_than_s`` old; returns how many."""
        now = time.monotonic()
        if now - self._pruned_at < min(10.0, older_than_s) or not self._unresident:
            return 0
        self.drain()
        self._pruned_at = now
        cutoff = now - older_than_s
        with self._lock:
            stale = [c for c in self._unresident.values() if c.born < cutoff and not any(c.where.values())]
            for c in stale:
                self._drop_chunk(c)
        return len(stale)

    def cleared(self, model: str = "") -> None:
        """Everything the index knew is gone (the server starts, or lost its pool)."""
        self.drain()
        with self._lock:
            self._by_key.clear()
            self._by_id.clear()
            self._by_hash.clear()
            self._by_tokens.clear()
            self._unresident.clear()
            self.log.append(-1, b"", model, AllBlocksCleared())

    # ---- the pull endpoint's question ---------------------------------------------------
    def leading(self, hashes: Sequence[Any], tiers: Sequence[str]) -> dict[str, int]:
        """How many leading blocks of ``hashes`` each tier can serve, whole chunks only."""
        self.drain()
        out = {}
        with self._lock:
            for tier in tiers:
                p = 0
                while p < len(hashes):
                    chunk = self._by_hash.get(hashes[p])
                    if chunk is None or tier not in chunk.servable:
                        break
                    n = len(chunk.hashes)
                    if chunk.hashes[0] != hashes[p] or tuple(hashes[p:p + n]) != chunk.hashes:
                        break
                    p += n
                out[tier] = p
        return out

    def hashes_of_tokens(self, token_ids: Sequence[int], block_size: int, lora: Optional[str] = None,
                         salt: Optional[str] = None) -> list[Any]:
        """The engine block hashes of ``token_ids``'s whole blocks, for LoRA adapter ``lora``
        and cache salt ``salt`` (None: none), as far as the index has seen them: from the first
        block (no parent), each block's tokens under its parent's hash (``token_key``)."""
        self.drain()
        out: list[Any] = []
        prev = None
        with self._lock:
            for b in range(len(token_ids) // block_size):
                try:
                    tokens = _packed(token_ids[b * block_size:(b + 1) * block_size])
                except (OverflowError, TypeError):       # not int32: no advert has it
                    break
                h = self._by_tokens.get(token_key(prev, tokens, lora, salt if b == 0 else None))
                if h is None:
                    break
                out.append(h)
                prev = h
        return out

    def block_sizes(self) -> set[int]:
        self.drain()
        with self._lock:
            return {c.block_size for c in list(self._by_id.values())[:64]}


class CheckedAdvert:
    """An ``Advert`` whose fields were checked, its extra keys decoded, its token ids packed
    (little-endian int32, ``tokens``)."""

    __slots__ = ("chunk", "group", "block_size", "block_hashes", "parent_block_hash", "tokens", "lora_name",
                 "extra_keys")

    def __init__(self, advert: Any, tokens: bytes, extra: Optional[list]) -> None:
        self.chunk, self.group, self.block_size = advert.chunk, advert.group, advert.block_size
        self.block_hashes, self.parent_block_hash = advert.block_hashes, advert.parent_block_hash
        self.tokens = tokens
        self.lora_name, self.extra_keys = advert.lora_name, extra

    @property
    def token_ids(self) -> list[int]:
        return _ints(self.tokens)


def _plain(value: Any, depth: int) -> bool:
    if isinstance(value, (str, bytes, int, float)) or value is None:
        return True
    return depth > 0 and isinstance(value, list) and len(value) <= 16 and all(_plain(v, depth - 1) for v in value)


def check_advert(advert: Any) -> CheckedAdvert:
    """``advert`` made safe to keep and republish, or ``ValueError``: its token ids (a list,
    or packed in ``tokens``: one or the other) must be whole blocks (or absent), and its extra
    keys one entry per block of plain values (strings, bytes, numbers, short lists of them), as
    vLLM's are."""
    n = len(advert.block_hashes)
    packed = getattr(advert, "tokens", b"")
    if packed:
        if advert.token_ids:
            raise ValueError("token ids both as a list and packed")
        if len(packed) != 4 * n * advert.block_size:
            raise ValueError(f"{len(packed)} bytes of packed token ids for {n} blocks of {advert.block_size} "
                             "(4 bytes a token)")
        tokens = bytes(packed)
    elif advert.token_ids:
        if len(advert.token_ids) != n * advert.block_size:
            raise ValueError(f"{len(advert.token_ids)} token ids for {n} blocks of {advert.block_size}")
        try:
            tokens = _packed(advert.token_ids)
        except (OverflowError, TypeError):
            raise ValueError("token ids must be 32-bit integers") from None
    else:
        tokens = b""
    extra = None
    if advert.extra_keys:
        try:
            extra = msgspec.msgpack.decode(advert.extra_keys)
        except Exception as exc:  # noqa: BLE001 - hostile bytes: not advertised
            raise ValueError(f"extra_keys are not msgpack: {type(exc).__name__}") from None
        if not isinstance(extra, list) or len(extra) != n or not all(_plain(e, 2) for e in extra):
            raise ValueError("extra_keys must be one entry per block: null or a list of plain values")
    return CheckedAdvert(advert, tokens, extra)

