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
records, each with the uid and namespace ("space") it belongs to and who it is for (``scope``).
Readers keep a cursor: the server's ZMQ publisher reads every record, a connector reads its own
uid's and space's (``KV_EVENTS``) and republishes them on its engine's stream.

Tenants. An advert is a tenant's claim: nothing one uid advertises may remove, hide or replace
what another's resident chunks advertise. A chunk is its uid's (its identity and keys carry the
uid); its hashes and token keys are looked up only once a tier holds it; a hash keeps every
resident chunk posted under it, token keys carry the uid; a ``BlockRemoved`` reaches the node
stream only for blocks no other chunk of the model still serves from that tier (``Record.scope``);
a full index forgets from the uid whose chunks cost the most (``KvIndex``'s docstring).

Medium and locality per tier (``TIER_MEDIA``): the pool is ``CPU``/``LOCAL``, the disk
``STORAGE``/``LOCAL``, the remote ``STORAGE``/``REMOTE``.

``describe`` and ``note`` only queue; ``drain`` applies the queue in order, off the STORE's
path, in units of work (a STORE of 65,536 adverts over many calls: ``_advance``); every reader
drains first (``KvIndex``'s docstring says who drains when, and how much).

The easy thing to get wrong: the pool and the disk tier call ``note`` under their own locks
(the same locks their removals are told under, so a chunk is never announced after its
removal), from any thread, and the queue keeps that order. So this module never calls back
into the pool or a tier, holds its own lock only for bounded work, and is bounded everywhere,
in bytes as well as counts: the queue (``MAX_QUEUED`` entries, ``MAX_QUEUED_ADVERTS`` adverts
and batched notes, ``MAX_QUEUED_ADVERT_BYTES`` of encoded adverts: past them, whoever adds
applies some), the index (``max_chunks`` chunks and ``max_bytes``, each chunk charged
``chunk_cost`` to its uid's share; a full index forgets the least recently stored chunk of the
uid holding the most, with a ``BlockRemoved`` for each tier it was servable from, counted: the
remote evicts without telling, so entries it alone held would otherwise stay until the index
refused every new chunk; adverts not resident yet, per uid, ``MAX_UNRESIDENT``), the ring
(``records`` and ``max_bytes``; the oldest go, a reader behind them is told it lost some;
``BlockStored`` records keep their tokens packed), engines (``MAX_PODS_PER_UID``).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import heapq
import itertools
import logging
import struct
import sys
import threading
import time
from array import array
from collections import OrderedDict, deque
from typing import Any, Iterable, Optional, Sequence

import msgspec

from lmshm.quoting import quote
from lmshm.wire.vllm_events import (  # noqa: F401 - re-exported: vLLM's format, which the index builds
    AllBlocksCleared,
    BadBatch,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    decode_batch,
    encode_batch,
)

TIER_MEDIA = {"pool": ("CPU", "LOCAL"), "disk": ("STORAGE", "LOCAL"), "remote": ("STORAGE", "REMOTE")}
_OTHER_MEDIA = ("STORAGE", "LOCAL")

logger = logging.getLogger("lmshm.kv_events")


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
    cost: int = 0                       # bytes charged to its uid's share (chunk_cost)
    posted: bool = False                # its hashes and token keys are in the lookup maps (resident)
    keys: dict = {}                     # rank -> that rank's key
    where: dict = {}                    # tier -> the ranks holding it there, a bit each
    servable: tuple = ()                # tiers BlockStored was sent for (and not removed)
    tkeys: tuple = ()                   # per block, its token_key (token_keys)
    xheld: int = 0                      # what its decoded extra keys hold (_held_bytes)

    def rank_of(self, key: bytes) -> int:
        for rank, k in self.keys.items():
            if k == key:
                return rank
        return -1


def _new_chunk(ident: tuple, uid: int, space: bytes, model: str, world: int, advert: Any, born: float) -> _Chunk:
    extra = advert.extra_keys
    chunk = _Chunk(ident, uid, space, model, world, advert.group, tuple(advert.block_hashes),
                   advert.parent_block_hash, advert.tokens, advert.block_size, advert.lora_name,
                   None if extra is None else _frozen(extra, {}), born)
    chunk.tkeys = token_keys(chunk)
    chunk.xheld = 0 if chunk.extra is None else _held_bytes(chunk.extra, set())
    chunk.cost = chunk_cost(len(chunk.hashes), len(chunk.tokens), getattr(advert, "extra_size", 0),
                            _text_bytes(chunk.lora), chunk.xheld)
    return chunk


def _held_bytes(value: Any, seen: set) -> int:
    """What decoded extra keys hold: every distinct object (``_frozen`` made equal values one)
    once. Small values of many kinds decode to more than twice their encoded size: a one-item
    list of a 16-bit int is 4 bytes encoded, 84 bytes decoded."""
    if id(value) in seen:
        return 0
    seen.add(id(value))
    n = sys.getsizeof(value)
    if type(value) is tuple:
        for v in value:
            n += _held_bytes(v, seen)
    return n


def _text_bytes(text: Optional[str]) -> int:
    """What a LoRA name costs where it is kept (a chunk, a record): its own string, up to
    16 KiB for 4,096 characters (``MAX_TEXT``) of 4 bytes each."""
    return 0 if text is None else sys.getsizeof(text)


#: What an indexed chunk costs the server's memory, as ``chunk_cost`` estimates it (calibrated
#: with tracemalloc on CPython 3.11, rounded up: 1.5 KiB measured for a one-block chunk of 16
#: tokens, 0.48 MiB for the wire's largest advert, 0.57 MiB charged): the chunk and its entries
#: in the index's maps and its share, each block's hash, token key (a tuple and a 16-byte
#: digest) and map entries, its packed tokens, and its extra keys decoded (equal values shared)
CHUNK_BYTES = 1280
BLOCK_BYTES = 256
EXTRA_FACTOR = 2


def chunk_cost(blocks: int, token_bytes: int, extra_bytes: int, text_bytes: int = 0, extra_held: int = 0) -> int:
    """Bytes an indexed chunk of ``blocks`` blocks, ``token_bytes`` of packed token ids,
    ``extra_bytes`` of encoded extra keys (``extra_held`` decoded, ``_held_bytes``: the more of
    it and twice the encoded size) and a LoRA name of ``text_bytes`` (``_text_bytes``) is
    charged (its uid's share, the index's bound)."""
    return CHUNK_BYTES + BLOCK_BYTES * blocks + token_bytes + max(EXTRA_FACTOR * extra_bytes, extra_held) \
        + text_bytes


def _frozen(value: Any, seen: dict) -> Any:
    """``value`` with every list made a tuple (extra keys: plain values, ``check_advert``), equal
    values one object (``seen``: a LoRA's name on each of 1,024 blocks is one string and one
    tuple, not 1,024 of each)."""
    if isinstance(value, (list, tuple)):
        value = tuple([_frozen(v, seen) for v in value])
    try:
        return seen.setdefault((type(value), value), value)
    except TypeError:           # not hashable (never, for checked extra keys): kept as it is
        return value


def token_keys(chunk: _Chunk) -> tuple:
    """Per block of ``chunk``, its ``token_key`` (``KvIndex.hashes_of_tokens`` walks them from
    the first block), or None for a block a lookup by tokens cannot name (``block_salt``)."""
    tokens = chunk.tokens
    if not tokens:
        return ()
    step = 4 * chunk.block_size
    hashes, uid = chunk.hashes, chunk.uid
    if chunk.extra is None and chunk.lora is None:      # no salt, nothing unnamed: the common case
        if len(hashes) == 1:
            return ((uid, chunk.parent, _digest(tokens), None, None),)
        # a list first: tuple() of a generator allocates the outer tuple before its items, and
        # the GC untracks a tuple only once its items are (a collection later, or never)
        return tuple([(uid, hashes[i - 1] if i else chunk.parent, _digest(tokens[i * step:(i + 1) * step]), None, None)
                      for i in range(len(hashes))])
    extra = chunk.extra or (None,) * len(hashes)
    out: list[Optional[TokenKey]] = []
    for i in range(len(hashes)):
        parent = hashes[i - 1] if i else chunk.parent
        salt = block_salt(extra[i], chunk.lora, parent is None)
        out.append(None if salt is UNNAMED else
                   token_key(uid, parent, _digest(tokens[i * step:(i + 1) * step]), chunk.lora, salt))
    return tuple(out)


#: ``(uid, parent block hash, the digest of the block's packed tokens, LoRA name, cache salt)``:
#: what a lookup by token ids can name a block by, in one uid's chains (a uid's adverts never
#: name a block in another's). The salt is the first block's only (None elsewhere). The digest
#: (``_digest``: BLAKE2b, 16 bytes) keeps the key small: a block of 64 tokens is 256 bytes packed.
TokenKey = tuple[int, Any, bytes, Optional[str], Optional[str]]
UNNAMED = object()


def token_key(uid: int, parent: Any, digest: bytes, lora: Optional[str], salt: Optional[str]) -> TokenKey:
    return (uid, parent, digest, lora, salt)


def _digest(tokens: bytes) -> bytes:
    """A block's packed tokens as a token key holds them (collision-resistant: within one uid's
    keys, a tenant could only confuse its own lookups)."""
    return hashlib.blake2b(tokens, digest_size=16).digest()


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


# ---- the event log ------------------------------------------------------------------------

#: ``Record.scope``: who a record is for. ``BOTH``: the owner's feed (KV_EVENTS of its uid and
#: space, its engines' topics) and the node's (the publisher's node topics). ``OWNER``: the
#: owner's only (its chunk left a tier, but another chunk advertising those blocks in the same
#: model and group is still servable from it: the node still holds them). ``NODE``: the node's
#: only (the part of an ``OWNER`` removal whose blocks no other chunk still serves).
BOTH, OWNER, NODE = 0, 1, 2


class _Stored(msgspec.Struct, gc=False):
    """A ``BlockStored`` kept packed: its chunk's own hashes, tokens (4 bytes a token) and extra
    keys, shared with the index while the chunk is indexed, never its token keys or maps (what a
    record keeps alive is what ``event_bytes`` charges it); the event is built when a reader
    asks for it (``Record.event``)."""

    hashes: tuple
    parent: Any
    tokens: bytes
    block_size: int
    lora: Optional[str]
    extra: Optional[tuple]
    group: int
    medium: str
    locality: str
    xheld: int = 0          # what ``extra`` holds decoded (``_held_bytes``): what event_bytes charges for it

    def build(self) -> BlockStored:
        # tuples, not lists (they encode alike): a tuple of ints or bytes leaves the cyclic
        # GC's care at its first collection, where a list stays
        return BlockStored(self.hashes, self.parent, _int_tuple(self.tokens), self.block_size, None, self.medium,
                           self.lora, self.extra, self.group, None, None, self.locality)


class Record(msgspec.Struct, frozen=True, gc=False):
    """One entry of the event log: an event (or an engine seen for the first time: ``pod``),
    whose it is (``uid``, ``space``, ``model``) and who it is for (``scope``: ``BOTH``,
    ``OWNER`` or ``NODE``, see above). ``pod`` with ``ev`` None: an engine attached to
    (uid, space), or with ``detach`` left it (its uid had ``MAX_PODS_PER_UID`` newer ones, or
    the namespace has no chunk left). Readers of the owner's feed (``EventLog.read`` with a
    ``uid``) never get ``NODE`` records; the node stream must skip ``OWNER`` records on node
    topics (and may use them, not ``NODE`` ones, on a uid's engine topics). ``event`` builds a
    ``BlockStored`` from its packed form on each call (``ev``); ``size``: what ``event_bytes``
    says the event encodes to, what the log's byte bound counts."""

    n: int                   # position in the log, from 1
    uid: int
    space: bytes
    model: str
    ev: Any                  # a KvEvent, a _Stored, or None (attach records)
    pod: str = ""            # attach records: an engine that advertises into (uid, space)
    scope: int = BOTH
    size: int = 0
    detach: bool = False     # with ``pod``: that engine is gone from (uid, space) (its topic may go)

    @property
    def event(self) -> Optional[KvEvent]:
        ev = self.ev
        return ev.build() if type(ev) is _Stored else ev


class _Run:
    """One reader key's records (a uid's, or a uid's in one space), oldest first, from ``head``
    on (the ones before it left the ring): a read finds its start by bisection."""

    __slots__ = ("records", "head", "bytes")

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.head = 0
        self.bytes = 0          # the sizes of its records from head on

    def drop_first(self) -> None:
        self.bytes -= self.records[self.head].size
        self.head += 1
        if self.head >= 64 and self.head * 2 >= len(self.records):
            del self.records[:self.head]
            self.head = 0

    def __len__(self) -> int:
        return len(self.records) - self.head

    def after(self, n: int) -> int:
        return bisect.bisect_right(self.records, n, lo=self.head, key=_record_n)


def _record_n(r: Record) -> int:
    return r.n


class EventLog:
    """A bounded ring of ``Record``s (``records`` of them and ``max_bytes`` of events, as
    ``event_bytes`` counts them, at most); readers keep their own cursor (``n`` of the last
    read). ``before_read`` (set by the ``KvIndex`` that owns the log) runs before each read: the
    index applies what it has queued, so a reader sees every STORE answered before it.

    Besides the ring, each uid's records and each (uid, space)'s are kept in order (``_Run``):
    a reader of its own uid's spaces finds where to start by bisection and visits only its own
    records, so a read costs what it returns, not the ring's length."""

    def __init__(self, records: int = 65536, max_bytes: Optional[int] = None) -> None:
        self.capacity = max(16, records)
        self.max_bytes = max_bytes if max_bytes is not None else max(LOG_BYTES, LOG_BYTES_PER_RECORD * self.capacity)
        self._ring: deque[Record] = deque()
        self._runs: dict[Any, _Run] = {}        # uid -> its run, (uid, space) -> its run
        # uid -> n of its newest record trimmed (per uid, not per space: a tenant makes spaces,
        # never uids; MAX_GONE kept, then the floor)
        self._gone: OrderedDict[Any, int] = OrderedDict()
        self._gone_floor = 0
        # each uid's records stay readable by its own feed, past the ring, while they are at
        # most a quarter of its bounds (``_trim_run``)
        self.run_records = max(16, self.capacity // RUN_SHARE)
        self.run_bytes = self.max_bytes // RUN_SHARE
        self._owners: set[int] = set()         # uids whose runs extend touched (under the lock)
        self._lock = threading.Lock()
        self._next = 1
        self.bytes = 0            # event_bytes of the records in the ring
        self.trimmed = 0          # records dropped from the ring's old end
        self.epoch = ""           # set by the owner: a new value means the log started over
        self.before_read: Optional[Any] = None
        # the node stream's reader (``read(..., node=True)``: the publisher): n of its cursor,
        # and the bytes of records after it, in all and per uid. Records it has not read stay
        # past the bounds, up to twice them; a uid with more than an eighth of the ring unread
        # while it lags a quarter gets no new adverts applied (``lagging``)
        self.node_at: Optional[int] = None
        self.node_unread = 0
        self._unread: dict[int, int] = {}

    def append(self, uid: int, space: bytes, model: str, event: Optional[KvEvent], pod: str = "") -> None:
        self.extend(((uid, space, model, event, pod),))

    def extend(self, entries: Iterable[tuple]) -> None:
        """Append ``(uid, space, model, event, pod[, scope[, detach]])`` tuples in order
        (``event`` a ``KvEvent``, a ``_Stored`` or None), under one hold of the lock."""
        with self._lock:
            ring, runs, n = self._ring, self._runs, self._next
            owners = self._owners
            for entry in entries:
                uid, space, model, ev, pod = entry[:5]
                scope = entry[5] if len(entry) > 5 else BOTH
                size = event_bytes(ev)
                r = Record(n, uid, space, model, ev, pod, scope, size, len(entry) > 6 and entry[6])
                ring.append(r)
                self.bytes += size
                if self.node_at is not None:
                    self.node_unread += size
                    self._unread[uid] = self._unread.get(uid, 0) + size
                n += 1
                if scope != NODE and uid >= 0:          # the owner's feed: what KV_EVENTS reads
                    for k in (uid, (uid, space)):
                        run = runs.get(k)
                        if run is None:
                            run = runs[k] = _Run()
                        run.records.append(r)
                        run.bytes += size
                    owners.add(uid)
            self._next = n
            over = 0
            node_at = self.node_at
            while len(ring) > 1 and (len(ring) > self.capacity or self.bytes > self.max_bytes) and (
                    node_at is None or ring[0].n <= node_at
                    or len(ring) > 2 * self.capacity or self.bytes > 2 * self.max_bytes):
                r = ring.popleft()
                self.bytes -= r.size
                if node_at is not None and r.n > node_at:
                    self._read_by_node(r)
                if r.scope != NODE and r.uid >= 0:
                    owners.add(r.uid)
                over += 1
            self.trimmed += over
            for uid in owners:
                self._trim_run(uid)
            owners.clear()

    def _read_by_node(self, r: Record) -> None:
        self.node_unread -= r.size
        left = self._unread.get(r.uid, 0) - r.size
        if left > 0:
            self._unread[r.uid] = left
        else:
            self._unread.pop(r.uid, None)

    def lagging(self, uid: int) -> bool:
        """The node stream's reader is behind by more than a quarter of the ring's bytes, and
        more than an eighth of them are ``uid``'s: its new adverts are not applied (a tenant
        that produces events faster than the publisher sends them would otherwise push
        unsent records off the ring, and the node topics would start over with
        AllBlocksCleared for every tenant)."""
        return self.node_unread > self.max_bytes >> 2 and self._unread.get(uid, 0) > self.max_bytes >> 3

    def _trim_run(self, uid: int) -> None:
        """Drop ``uid``'s oldest records that left the ring while its run is past the uid's own
        bound (``run_records``, ``run_bytes``): a uid's records leave its feed only by its own
        records' doing, never another tenant's flood of the shared ring."""
        runs = self._runs
        run = runs.get(uid)
        if run is None:
            return
        first = self._ring[0].n if self._ring else self._next
        records = run.records
        dropped = 0
        while len(run) and records[run.head].n < first and (
                len(run) > self.run_records or run.bytes > self.run_bytes):
            r = records[run.head]
            run.drop_first()
            k = (uid, r.space)
            space_run = runs[k]
            space_run.drop_first()              # its head too: a space's run is a part of the uid's, in order
            if not len(space_run):
                del runs[k]
            dropped = r.n
        if not len(run):
            del runs[uid]
        if dropped:
            gone = self._gone
            gone[uid] = dropped
            gone.move_to_end(uid)
            while len(gone) > MAX_GONE:
                _, n = gone.popitem(last=False)
                self._gone_floor = max(self._gone_floor, n)

    @property
    def last(self) -> int:
        return self._next - 1

    @property
    def oldest(self) -> int:
        with self._lock:
            return self._ring[0].n if self._ring else self._next

    def read(self, after: int, limit: int, uid: Optional[int] = None, spaces: Optional[Iterable[bytes]] = None,
             max_bytes: int = 1 << 62, apply: Optional[int] = None, node: bool = False
             ) -> tuple[list[Record], int, bool]:
        """``(records, cursor, lost)``: up to ``limit`` records after ``after`` (of ``uid`` and
        ``spaces``, if given: the owner's feed, ``NODE`` records left out), the cursor to read
        from next, and whether records the reader had not read were dropped from the ring
        (``after`` below the oldest one kept; for a uid's read, one of *its uid's* records, which
        its feed keeps past the ring up to a quarter of it: another tenant's flood of records
        never makes a reader of its own feed start over). ``after`` -1: from the oldest kept,
        nothing lost. ``node``: this is the node stream's reader (the publisher): records after
        its cursor stay past the bounds, up to twice them (``lagging``).
        ``max_bytes`` bounds the events' encoded size (roughly; at least one record is
        returned). ``apply``: how much of the index's queue ``before_read`` applies first (None:
        all; ``KvIndex.drain``)."""
        if self.before_read is not None:
            self.before_read(apply)
        with self._lock:
            ring = self._ring
            first = ring[0].n if ring else self._next
            if after < 0:
                after = first - 1
            lost = after + 1 < first
            if uid is None:
                out = self._scan(after, first, limit, max_bytes, lost)
                if node:
                    self._node_read(out[1])
                return out
            keys = [uid] if spaces is None else [(uid, s) for s in dict.fromkeys(spaces)]
            if lost:
                lost = after < max(self._gone_floor, self._gone.get(uid, 0))
            parts = []
            for k in keys:
                run = self._runs.get(k)
                if run is not None:
                    i = run.after(after)
                    if i < len(run.records):
                        parts.append(itertools.islice(run.records, i, None))
            source = parts[0] if len(parts) == 1 else heapq.merge(*parts, key=_record_n)
            out: list[Record] = []
            size = 0
            cursor = self._next - 1                 # all read, unless a bound stops it first
            for r in source:
                size += r.size
                if out and size > max_bytes:
                    cursor = out[-1].n
                    break
                out.append(r)
                if len(out) >= limit:
                    cursor = r.n
                    break
            return out, cursor, lost

    def release_node(self) -> None:
        """The node stream's reader stopped: the ring keeps its own bounds again."""
        with self._lock:
            self.node_at = None
            self.node_unread, self._unread = 0, {}

    def _node_read(self, cursor: int) -> None:
        """The node stream's reader read up to ``cursor``: the records it passed are read."""
        at = self.node_at
        self.node_at = cursor
        if at is None:                  # its first read: what it has not read yet, counted
            self.node_unread, self._unread = 0, {}
            for r in self._ring:
                if r.n > cursor:
                    self.node_unread += r.size
                    self._unread[r.uid] = self._unread.get(r.uid, 0) + r.size
            return
        ring = self._ring
        if not ring:
            return
        for i in range(max(0, at + 1 - ring[0].n), len(ring)):
            r = ring[i]
            if r.n > cursor:
                break
            self._read_by_node(r)

    def _scan(self, after: int, first: int, limit: int, max_bytes: int, lost: bool) -> tuple[list[Record], int, bool]:
        ring = self._ring
        out: list[Record] = []
        size = 0
        cursor = max(after, first - 1)
        for i in range(max(0, after + 1 - first), len(ring)):
            r = ring[i]
            cursor = r.n
            size += r.size
            if out and size > max_bytes:
                cursor = r.n - 1
                break
            out.append(r)
            if len(out) >= limit:
                break
        return out, min(cursor, self._next - 1), lost


def event_bytes(event: Any) -> int:
    """About how many bytes ``event`` (a ``KvEvent`` or its packed ``_Stored`` form) encodes to
    (a bound for replies, buffers and the log)."""
    # a LoRA name counts as the string it is kept as (up to 16 KiB; its encoding is no more
    # than that, but for 3-byte characters)
    if type(event) is _Stored:
        return 160 + 34 * len(event.hashes) + (5 * len(event.tokens) >> 2) \
            + max(64 * len(event.extra or ()), event.xheld) + _text_bytes(event.lora)
    if isinstance(event, BlockStored):
        return 160 + 34 * len(event.block_hashes) + 5 * len(event.token_ids) + 64 * len(event.extra_keys or ()) \
            + _text_bytes(event.lora_name)
    if isinstance(event, BlockRemoved):
        return 80 + 34 * len(event.block_hashes)
    return 32


#: A uid's records that left the ring stay in its own feed (``EventLog._trim_run``) while they
#: are at most 1/RUN_SHARE of the ring's records and bytes: another tenant's flood of the ring
#: never trims a reader's own unread records; the log holds at most the ring and, per uid that
#: has records, a quarter of it besides.
RUN_SHARE = 4
#: Uids whose newest trimmed record the log remembers (to tell a reader it lost one of its
#: uid's); a reader whose uid was forgotten is told it lost some if it is behind the newest
#: record forgotten so.
MAX_GONE = 1 << 16
#: The log's byte bound (``EventLog.max_bytes``): 1 KiB per record it may hold, at least 64 MiB
#: (64 MiB for the default 65,536 records; 150 of the largest adverts' events at least): a full
#: ring of the largest adverts' events would be 28 GiB.
LOG_BYTES_PER_RECORD = 1024
LOG_BYTES = 64 << 20
#: The index's byte bound (``KvIndex.max_bytes``, ``chunk_cost``): 2 KiB per chunk it may hold,
#: at least 64 MiB (512 MiB for the default 262,144 chunks): one chunk of the wire's largest
#: adverts is charged about 0.57 MiB, one of 16 tokens about 1.6 KiB.
INDEX_BYTES_PER_CHUNK = 2048
INDEX_BYTES = 64 << 20
#: Adverts whose chunk is not resident yet (a STORE's, before its copy commits; forever, for a
#: STORE that stores nothing, until ``prune``), per uid: at most this many, and an eighth of
#: the index's bytes or UNRESIDENT_BYTES, whichever is more; past that the uid's oldest such
#: advert is forgotten (the index's own bounds apply besides).
MAX_UNRESIDENT = 1 << 16
UNRESIDENT_BYTES = 64 << 20
#: Engines (``Store.pod``) remembered per uid: attach records name them, a detach record
#: forgets the least recently seen past this many (the publisher frees its topic)
MAX_PODS_PER_UID = 64
#: Chunks of one uid posted under one block hash (more are indexed, but not found by that hash):
#: a lookup visits each chunk posted under a hash, so a tenant cannot make that list long.
MAX_SAME_HASH = 4

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
#: 4 KiB encoded) applied under one hold of the index's lock (a few hundred µs at most).
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


class _Share:
    """One uid's part of the index: its chunks, least recently stored first (what a full index
    forgets of the uid holding the most), those not resident yet, and the bytes they cost."""

    __slots__ = ("lru", "unresident", "bytes", "unresident_bytes")

    def __init__(self) -> None:
        self.lru: OrderedDict[tuple, _Chunk] = OrderedDict()
        self.unresident: OrderedDict[tuple, _Chunk] = OrderedDict()
        self.bytes = 0
        self.unresident_bytes = 0


class _Describing:
    """A queued STORE's adverts being applied in steps (``KvIndex._advance``)."""

    __slots__ = ("entry", "items", "done")

    def __init__(self, entry: tuple) -> None:
        self.entry = entry
        self.items: Optional[list] = None       # the adverts, one per key (encoded or not)
        self.done = 0                           # how many are applied


class KvIndex:
    """See the module docstring. ``max_chunks`` 0 turns events off (nothing is indexed).

    ``describe`` and ``note`` only queue (``_queue``, a deque: appending is atomic, and takes
    no lock, so the pool may call ``note`` under its own); ``drain`` applies the queue in the
    order it was filled, under the index's lock, ``DRAIN_BATCH`` units of work at a time (a
    STORE of many adverts takes several: ``_advance``). Whatever reads the index drains first
    (the log's readers, ``leading``, ``hashes_of_tokens``, ``len``), so no reader sees less than
    the STOREs answered before it (but a KV_EVENTS read, which applies at most
    ``server.KV_EVENTS_APPLY`` units); the server's request loop drains a few whenever it has
    nothing else to do (``on_idle``); and a queue past ``MAX_QUEUED`` entries (or
    ``MAX_QUEUED_ADVERTS`` adverts) is drained in part by whoever adds to it.

    Who may change what. A chunk is its uid's: its ``ident`` and its keys carry the uid, so no
    other uid's STORE or residency report names it. Its hashes and token keys are *posted* (the
    lookup maps, ``_by_hash`` and ``_by_tokens``) only once a tier holds it, and a hash keeps
    every chunk posted under it (``_by_hash``: one chunk, or a dict of them by ``id``), so
    another uid's adverts can add to what a lookup finds, never take away from it; token keys
    carry the uid (``token_key``), and a lookup by tokens walks each uid's chains. A
    ``BlockRemoved`` goes to the node stream only for the blocks no other servable chunk of the
    same model and group still holds in that tier (``_emit_removed``)."""

    def __init__(self, *, max_chunks: int = 1 << 18, records: int = 65536, max_bytes: Optional[int] = None,
                 log_bytes: Optional[int] = None) -> None:
        self.max_chunks = max_chunks
        self.max_bytes = max_bytes if max_bytes is not None else max(INDEX_BYTES, INDEX_BYTES_PER_CHUNK * max_chunks)
        self.max_unresident_bytes = max(self.max_bytes >> 3, UNRESIDENT_BYTES)
        self.log = EventLog(records, log_bytes)
        self.log.before_read = self.drain
        self._lock = threading.Lock()
        self._queue: deque[tuple] = deque()
        self._current: Optional[_Describing] = None    # the STORE being applied in steps
        self._pending: list[tuple] = []            # records of the batch being applied (drain)
        self._queued_adverts = 0                   # adverts and batched notes in _queue (under _count_lock)
        self._queued_bytes = 0                     # their bytes, those queued encoded (under _count_lock)
        self._queued_by_uid: dict[int, tuple[int, int]] = {}   # uid -> its adverts and bytes queued
        #: decodes a STORE's encoded adverts (``messages.unpack_adverts``, set by the data plane:
        #: the messages import this module, so it cannot import them)
        self.unpack_adverts: Optional[Any] = None
        self._count_lock = threading.Lock()
        self._by_key: dict[tuple[int, bytes], _Chunk] = {}   # (uid, key) -> its chunk (rank: chunk.rank_of)
        self._by_id: dict[tuple[int, bytes, int, bytes], _Chunk] = {}   # (uid, space, group, chunk id) -> chunk
        self._shares: dict[int, _Share] = {}                 # uid -> its chunks (each in one share)
        self._by_hash: dict[Any, Any] = {}        # a block hash -> the resident chunk(s) posted under it
        self._by_tokens: dict[TokenKey, Any] = {}  # a block's token_key -> its hash, or {hash: chunks}
        self._block_sizes: dict[int, int] = {}     # block size -> chunks of it
        self.bytes = 0                             # chunk_cost of every chunk indexed
        self._pods: dict[int, OrderedDict[tuple[bytes, str], str]] = {}   # uid -> (space, pod) -> model, LRU
        self._space_chunks: dict[tuple[int, bytes], int] = {}   # (uid, space) -> chunks indexed
        self._pruned_at = 0.0
        self.unindexed = 0        # chunks forgotten to make room: the index was full
        self.refused = 0          # STOREs whose adverts did not check (check_advert): not advertised
        self.queue_refused = 0    # ... of them, refused because their uid's queued adverts were at the bound
        self.lag_refused = 0      # ... or because the node stream lagged, much of it their uid's (EventLog.lagging)
        self.unresident_dropped = 0   # adverts forgotten: their uid had MAX_UNRESIDENT waiting
        self.stored_events = self.removed_events = 0
        self.failed = 0           # queued entries whose application raised (a bug; logged)

    @property
    def enabled(self) -> bool:
        return self.max_chunks > 0

    def __len__(self) -> int:
        self.drain()
        return len(self._by_id)

    @property
    def chunks(self) -> int:
        """Chunks indexed, without applying the queue (O(1))."""
        return len(self._by_id)

    @property
    def queued(self) -> int:
        """Entries not applied yet (a STORE being applied in steps counts as one)."""
        return len(self._queue) + (self._current is not None)

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
        if not self._by_key and not self._queue and self._current is None:
            return
        self._queue.append((uid, key, tier, present))
        if len(self._queue) > MAX_QUEUED:
            self.drain(4 * DRAIN_BATCH)

    def recorder(self, tier: str) -> Any:
        """``note`` for one tier, as ``record(uid, key, present)``: what the pool (its
        ``on_resident``) and the tiers call, one Python call per report."""
        queue, by_key, append = self._queue, self._by_key, self._queue.append

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
        queue, by_key, append = self._queue, self._by_key, self._queue.append

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
        (no yield of the CPU between batches: ``sched_yield`` on a busy machine gave it to
        another process, 340 µs a call measured). Returns the units done."""
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
                if self._pending:        # the batch's records, in order, under one hold of the log's lock
                    self.log.extend(self._pending)
                    self._pending.clear()
            if not step:
                break
            done += step
        return done

    def _apply(self, entry: tuple) -> int:
        """One queued entry (under the lock); the units of work it took."""
        try:
            if len(entry) == 4:
                self._note(*entry)
                return 1
            if len(entry) == 2:
                pairs, tier = entry
                try:
                    for uid, key in pairs:
                        self._note(uid, key, tier, True)
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
                    if self.unpack_adverts is None:
                        raise ValueError("encoded adverts, and no decoder for them")
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
                part = self.unpack_adverts(_array_of(part))
                if len(part) != end - start:
                    raise ValueError("an advert is not one msgpack value")
            checked = [a if isinstance(a, CheckedAdvert) else check_advert(a) for a in part]
            if not start and pod:
                self._attach(uid, space, model, pod)
            self._describe(uid, space, model, rank, world, keys[start:end], checked)
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

    # ---- applying them (under the index's lock) -----------------------------------------
    def _attach(self, uid: int, space: bytes, model: str, pod: str) -> None:
        """An engine (``pod``) advertises into (uid, space): an attach record the first time; a
        uid keeps its ``MAX_PODS_PER_UID`` most recently seen (a detach record for the one it
        forgets), and no uid's engines ever push out another's."""
        pods = self._pods.get(uid)
        if pods is None:
            pods = self._pods[uid] = OrderedDict()
        if (space, pod) in pods:
            pods.move_to_end((space, pod))
            return
        pods[(space, pod)] = model
        self._pending.append((uid, space, model, None, pod))
        if len(pods) > MAX_PODS_PER_UID:
            (old_space, old_pod), old_model = pods.popitem(last=False)
            self._pending.append((uid, old_space, old_model, None, old_pod, BOTH, True))

    def _space_left(self, uid: int, space: bytes) -> None:
        """(uid, space) has no chunk left: its engines detach (their topics may be freed)."""
        pods = self._pods.get(uid)
        if not pods:
            return
        for (s, pod), model in list(pods.items()):
            if s == space:
                del pods[(s, pod)]
                self._pending.append((uid, s, model, None, pod, BOTH, True))
        if not pods:
            del self._pods[uid]

    def _describe(self, uid: int, space: bytes, model: str, rank: int, world: int,
                  keys: Sequence[bytes], adverts: Sequence[CheckedAdvert]) -> None:
        by_id, by_key = self._by_id, self._by_key
        share = self._shares.get(uid)
        if share is None:
            share = self._shares[uid] = _Share()
        born = time.monotonic()
        for key, advert in zip(keys, adverts):
            ident = (uid, space, advert.group, bytes(advert.chunk))
            chunk = by_id.get(ident)
            ranks: dict = {}
            if chunk is not None and not chunk.posted and not any(chunk.where.values()) and (
                    chunk.hashes != tuple(advert.block_hashes) or chunk.tokens != advert.tokens):
                ranks = dict(chunk.keys)        # held nowhere yet: the newer advert says what it is
                self._space_chunks[(uid, space)] += 1       # (not emptied meanwhile: its engines stay)
                self._drop_chunk(chunk)
                self._space_chunks[(uid, space)] -= 1
                chunk = None
            if chunk is None:
                chunk = _new_chunk(ident, uid, space, model, world, advert, born)
                self._make_room(share, chunk.cost)
                if self._shares.get(uid) is not share:      # its uid's last chunk was forgotten
                    share = self._shares[uid] = _Share()
                by_id[ident] = chunk
                self._space_chunks[(uid, space)] = self._space_chunks.get((uid, space), 0) + 1
                share.lru[ident] = chunk
                share.unresident[ident] = chunk
                share.bytes += chunk.cost
                share.unresident_bytes += chunk.cost
                self.bytes += chunk.cost
                self._block_sizes[chunk.block_size] = self._block_sizes.get(chunk.block_size, 0) + 1
                ranks[rank] = key
                chunk.keys = ranks
                for k in ranks.values():
                    by_key[(uid, k)] = chunk
            else:
                share.lru.move_to_end(ident)
                old = chunk.keys.get(rank)
                if old is not None and old != key:
                    by_key.pop((uid, old), None)
                chunk.keys[rank] = key
            by_key[(uid, key)] = chunk

    def _make_room(self, share: _Share, cost: int) -> None:
        """Before a chunk costing ``cost`` joins ``share``: forget the uid's oldest adverts not
        resident yet past its own bound (``MAX_UNRESIDENT``, an eighth of ``max_bytes``), then,
        while the index is full (``max_chunks``, ``max_bytes``), the least recently stored
        chunk of the uid whose chunks cost the most: a tenant's adverts push out its own
        first, never a smaller tenant's."""
        while share.unresident and (len(share.unresident) >= MAX_UNRESIDENT
                                    or share.unresident_bytes + cost > self.max_unresident_bytes):
            self._drop_chunk(next(iter(share.unresident.values())))     # never servable: no event
            self.unresident_dropped += 1
        while self._by_id and (len(self._by_id) >= self.max_chunks or self.bytes + cost > self.max_bytes):
            victim = max(self._shares.values(), key=_share_bytes)
            if not victim.lru:
                break
            self._forget(next(iter(victim.lru.values())))

    def _note(self, uid: int, key: bytes, tier: str, present: bool) -> None:
        chunk = self._by_key.get((uid, key))
        if chunk is None:
            return
        bit = 1 << chunk.rank_of(key)
        ranks = chunk.where.get(tier, 0)
        if present:
            ranks |= bit
            share = self._shares[chunk.uid]
            if share.unresident.pop(chunk.ident, None) is not None:
                share.unresident_bytes -= chunk.cost
            if share.lru.get(chunk.ident) is chunk:
                share.lru.move_to_end(chunk.ident)
            if not chunk.posted:
                self._post(chunk)
        else:
            ranks &= ~bit
        chunk.where[tier] = ranks
        full = ranks.bit_count() >= chunk.world
        if full and tier not in chunk.servable:
            chunk.servable += (tier,)
            self._emit_stored(chunk, tier)
        elif not full and tier in chunk.servable:
            chunk.servable = tuple(t for t in chunk.servable if t != tier)
            self._emit_removed(chunk, tier)
        if not present and not any(chunk.where.values()):
            self._drop_chunk(chunk)

    def _post(self, chunk: _Chunk) -> None:
        """Put a resident chunk's hashes and token keys in the lookup maps, beside any other
        chunk's (``MAX_SAME_HASH`` of one uid per hash)."""
        chunk.posted = True
        by_hash, by_tokens, cid, uid = self._by_hash, self._by_tokens, id(chunk), chunk.uid
        for h in chunk.hashes:
            cur = by_hash.get(h)
            if cur is None:
                by_hash[h] = chunk
            elif cur is chunk:
                continue
            elif type(cur) is dict:
                if cid not in cur and sum(1 for c in cur.values() if c.uid == uid) < MAX_SAME_HASH:
                    cur[cid] = chunk
            else:
                by_hash[h] = {id(cur): cur, cid: chunk}
        for tk, h in zip(chunk.tkeys, chunk.hashes):
            if tk is None:
                continue
            cur = by_tokens.get(tk, _NONE)
            if cur is _NONE:
                by_tokens[tk] = h
            elif type(cur) is dict:
                cur[h] = cur.get(h, 0) + 1
            else:
                by_tokens[tk] = {cur: 2} if cur == h else {cur: 1, h: 1}

    def _unpost(self, chunk: _Chunk) -> None:
        chunk.posted = False
        by_hash, by_tokens, cid = self._by_hash, self._by_tokens, id(chunk)
        for h in chunk.hashes:
            cur = by_hash.get(h)
            if cur is chunk:
                del by_hash[h]
            elif type(cur) is dict and cur.pop(cid, None) is not None and len(cur) == 1:
                by_hash[h] = next(iter(cur.values()))
        for tk, h in zip(chunk.tkeys, chunk.hashes):
            if tk is None:
                continue
            cur = by_tokens.get(tk, _NONE)
            if type(cur) is dict:
                left = cur.get(h, 0) - 1
                if left > 0:
                    cur[h] = left
                elif left == 0:
                    del cur[h]
                if len(cur) == 1:
                    (only, refs), = cur.items()
                    if refs == 1:
                        by_tokens[tk] = only
                elif not cur:
                    del by_tokens[tk]
            elif cur is not _NONE and cur == h:
                del by_tokens[tk]

    def _others(self, chunk: _Chunk, h: Any) -> Iterable[_Chunk]:
        cur = self._by_hash.get(h)
        if cur is None or cur is chunk:
            return ()
        if type(cur) is dict:
            return (c for c in cur.values() if c is not chunk)
        return (cur,)

    def _forget(self, chunk: _Chunk) -> None:
        """Make room: forget ``chunk`` and tell readers it is gone from every tier it was
        servable from. A router then misses a chunk lmshm may still hold, which costs a
        recomputation, never a request sent for nothing."""
        for tier in sorted(chunk.servable):
            chunk.servable = tuple(t for t in chunk.servable if t != tier)
            self._emit_removed(chunk, tier)
        self._drop_chunk(chunk)
        self.unindexed += 1

    def _drop_chunk(self, chunk: _Chunk) -> None:
        if self._by_id.get(chunk.ident) is not chunk:
            return
        del self._by_id[chunk.ident]
        share = self._shares[chunk.uid]
        share.lru.pop(chunk.ident, None)
        if share.unresident.pop(chunk.ident, None) is not None:
            share.unresident_bytes -= chunk.cost
        share.bytes -= chunk.cost
        self.bytes -= chunk.cost
        if not share.lru:
            del self._shares[chunk.uid]
        left = self._space_chunks[(chunk.uid, chunk.space)] - 1
        if left:
            self._space_chunks[(chunk.uid, chunk.space)] = left
        else:
            del self._space_chunks[(chunk.uid, chunk.space)]
            self._space_left(chunk.uid, chunk.space)
        left = self._block_sizes[chunk.block_size] - 1
        if left:
            self._block_sizes[chunk.block_size] = left
        else:
            del self._block_sizes[chunk.block_size]
        for key in chunk.keys.values():
            if self._by_key.get((chunk.uid, key)) is chunk:
                del self._by_key[(chunk.uid, key)]
        if chunk.posted:
            self._unpost(chunk)

    def _emit_stored(self, chunk: _Chunk, tier: str) -> None:
        medium, locality = TIER_MEDIA.get(tier, _OTHER_MEDIA)
        self.stored_events += 1
        self._pending.append((chunk.uid, chunk.space, chunk.model,
                              _Stored(chunk.hashes, chunk.parent, chunk.tokens, chunk.block_size, chunk.lora,
                                      chunk.extra, chunk.group, medium, locality, chunk.xheld), ""))

    def _emit_removed(self, chunk: _Chunk, tier: str) -> None:
        """``chunk`` (no longer counting ``tier`` in its ``servable``) left ``tier``: its owner
        is told; the node stream only of the blocks no other chunk of the same model and group
        still serves from ``tier`` (none: the owner alone is told)."""
        medium, locality = TIER_MEDIA.get(tier, _OTHER_MEDIA)
        self.removed_events += 1
        gone = [h for h in chunk.hashes
                if not any(c.model == chunk.model and c.group == chunk.group and tier in c.servable
                           for c in self._others(chunk, h))]
        event = BlockRemoved(chunk.hashes, medium, chunk.group, locality)
        if len(gone) == len(chunk.hashes):
            self._pending.append((chunk.uid, chunk.space, chunk.model, event, "", BOTH))
            return
        self._pending.append((chunk.uid, chunk.space, chunk.model, event, "", OWNER))
        if gone:
            self._pending.append((chunk.uid, chunk.space, chunk.model,
                                  BlockRemoved(tuple(gone), medium, chunk.group, locality), "", NODE))

    def prune(self, older_than_s: float = 60.0) -> int:
        """Forget adverts whose chunk never became resident anywhere (its STORE failed or found
        no room) once they are ``older_than_s`` old; returns how many."""
        now = time.monotonic()
        if now - self._pruned_at < min(10.0, older_than_s) or not self._shares:
            return 0
        # no drain first: this runs on the request loop's tick, and an advert still queued is
        # younger than any it forgets; each share's oldest come first, so it visits no more
        # than it forgets (and one more per uid)
        self._pruned_at = now
        cutoff = now - older_than_s
        stale = 0
        with self._lock:
            for share in list(self._shares.values()):
                while share.unresident:
                    chunk = next(iter(share.unresident.values()))
                    if chunk.born >= cutoff:
                        break
                    self._drop_chunk(chunk)
                    stale += 1
            if self._pending:               # detach records of namespaces left empty
                self.log.extend(self._pending)
                self._pending.clear()
        return stale

    def cleared(self, model: str = "") -> None:
        """Everything the index knew is gone (the server starts, or lost its pool)."""
        self.drain()
        with self._lock:
            self._by_key.clear()
            self._by_id.clear()
            self._shares.clear()
            self._by_hash.clear()
            self._by_tokens.clear()
            self._block_sizes.clear()
            self._space_chunks.clear()
            self.bytes = 0
            self.log.append(-1, b"", model, AllBlocksCleared())

    # ---- the pull endpoint's question ---------------------------------------------------
    def leading(self, hashes: Sequence[Any], tiers: Sequence[str]) -> dict[str, int]:
        """How many leading blocks of ``hashes`` each tier can serve, whole chunks only (any
        chunk posted under a hash may serve it)."""
        self.drain()
        out = {}
        with self._lock:
            for tier in tiers:
                p = 0
                while p < len(hashes):
                    cur = self._by_hash.get(hashes[p])
                    if cur is None:
                        break
                    n = 0
                    for chunk in (cur.values() if type(cur) is dict else (cur,)):
                        if tier in chunk.servable and chunk.hashes[0] == hashes[p]:
                            m = len(chunk.hashes)
                            # its last hash first: a chunk posted under this hash that spans
                            # other blocks costs one comparison, not a slice of m
                            if m > n and p + m <= len(hashes) and hashes[p + m - 1] == chunk.hashes[-1] \
                                    and tuple(hashes[p:p + m]) == chunk.hashes:
                                n = m
                    if not n:
                        break
                    p += n
                out[tier] = p
        return out

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
                blocks.append(_digest(_packed(token_ids[b * block_size:(b + 1) * block_size])))
            except (OverflowError, TypeError):       # not int32: no advert has it
                break
        chains: dict[tuple, None] = {}
        if not blocks:
            return []
        with self._lock:
            by_tokens = self._by_tokens
            for uid in list(self._shares):
                out: list[Any] = []
                prev = None
                for b, tokens in enumerate(blocks):
                    h = by_tokens.get((uid, prev, tokens, lora, salt if b == 0 else None), _NONE)
                    if h is _NONE:
                        break
                    if type(h) is dict:          # this uid's forks: the newest
                        h = next(reversed(h))
                    out.append(h)
                    prev = h
                if out:
                    chains[tuple(out)] = None
        return sorted((list(c) for c in chains), key=len, reverse=True)

    def hashes_of_tokens(self, token_ids: Sequence[int], block_size: int, lora: Optional[str] = None,
                         salt: Optional[str] = None) -> list[Any]:
        """The longest of ``chains_of_tokens`` ([] for none)."""
        chains = self.chains_of_tokens(token_ids, block_size, lora, salt)
        return chains[0] if chains else []

    def block_sizes(self) -> list[int]:
        """The block sizes of the chunks indexed (the first 64 of them, O(1))."""
        with self._lock:
            return list(itertools.islice(self._block_sizes, 64))


_NONE = object()


def _share_bytes(share: _Share) -> int:
    return share.bytes


class CheckedAdvert:
    """An ``Advert`` whose fields were checked, its extra keys decoded, its token ids packed
    (little-endian int32, ``tokens``)."""

    __slots__ = ("chunk", "group", "block_size", "block_hashes", "parent_block_hash", "tokens", "lora_name",
                 "extra_keys", "extra_size")

    def __init__(self, advert: Any, tokens: bytes, extra: Optional[list]) -> None:
        self.chunk, self.group, self.block_size = advert.chunk, advert.group, advert.block_size
        self.block_hashes, self.parent_block_hash = advert.block_hashes, advert.parent_block_hash
        self.tokens = tokens
        self.lora_name, self.extra_keys = advert.lora_name, extra
        self.extra_size = len(advert.extra_keys or b"")     # encoded: what chunk_cost charges

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
        except Exception as exc:
            raise ValueError(f"extra_keys are not msgpack: {type(exc).__name__}") from None
        if not isinstance(extra, list) or len(extra) != n or not all(_plain(e, 2) for e in extra):
            raise ValueError("extra_keys must be one entry per block: null or a list of plain values")
    return CheckedAdvert(advert, tokens, extra)

