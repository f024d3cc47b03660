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

The easy thing to get wrong: the pool and the disk tier call ``note`` under their own locks
(the same locks their removals are told under, so a chunk is never announced after its
removal), from any thread. So this module never calls back into the pool or a tier, holds its
own lock only for dict work, and is bounded everywhere: ``max_chunks`` adverts (a full index
forgets its least recently stored chunk, with a ``BlockRemoved`` for each tier it was servable
from, counted: the remote evicts without telling, so entries it alone held would otherwise
stay until the index refused every new chunk), ``records`` in the ring (the oldest go; a
reader behind them is told it lost some).
"""

from __future__ import annotations

import hashlib
import threading
import time
from array import array
from collections import OrderedDict, deque
from typing import Any, Iterable, Optional, Sequence, Union

import msgspec

TIER_MEDIA = {"pool": ("CPU", "LOCAL"), "disk": ("STORAGE", "LOCAL"), "remote": ("STORAGE", "REMOTE")}

BlockHashValue = Union[int, bytes]


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


class _Chunk:
    __slots__ = ("ident", "uid", "space", "model", "group", "world", "hashes", "parent", "tokens", "block_size",
                 "lora", "extra", "keys", "where", "servable", "born")

    def __init__(self, ident: tuple, uid: int, space: bytes, model: str, world: int, advert: Any) -> None:
        self.ident = ident
        self.uid, self.space, self.model, self.world = uid, space, model, world
        self.group = advert.group
        self.hashes = list(advert.block_hashes)
        self.parent = advert.parent_block_hash
        self.tokens = advert.token_ids
        self.block_size = advert.block_size
        self.lora = advert.lora_name
        self.extra = advert.extra_keys
        self.keys: dict[int, bytes] = {}            # rank -> that rank's key
        self.where: dict[str, set[int]] = {}        # tier -> ranks holding it there
        self.servable: set[str] = set()             # tiers BlockStored was sent for (and not removed)
        self.born = time.monotonic()


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
    """A bounded ring of ``Record``s; readers keep their own cursor (``n`` of the last read)."""

    def __init__(self, records: int = 65536) -> None:
        self.capacity = max(16, records)
        self._ring: deque[Record] = deque()
        self._lock = threading.Lock()
        self._next = 1
        self.trimmed = 0          # records dropped from the ring's old end
        self.epoch = ""           # set by the owner: a new value means the log started over

    def append(self, uid: int, space: bytes, model: str, event: Optional[KvEvent], pod: str = "") -> None:
        with self._lock:
            self._ring.append(Record(self._next, uid, space, model, event, pod))
            self._next += 1
            if len(self._ring) > self.capacity:
                self._ring.popleft()
                self.trimmed += 1

    @property
    def last(self) -> int:
        return self._next - 1

    @property
    def oldest(self) -> int:
        with self._lock:
            return self._ring[0].n if self._ring else self._next

    def read(self, after: int, limit: int, uid: Optional[int] = None, spaces: Optional[Iterable[bytes]] = None,
             max_bytes: int = 1 << 62) -> tuple[list[Record], int, bool]:
        """``(records, cursor, lost)``: up to ``limit`` records after ``after`` (of ``uid`` and
        ``spaces``, if given), the cursor to read from next, and whether records the reader had
        not read were dropped from the ring (``after`` below the oldest one kept). ``after``
        -1: from the oldest kept, nothing lost. ``max_bytes`` bounds the events' encoded size
        (roughly; at least one record is returned)."""
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


class KvIndex:
    """See the module docstring. ``max_chunks`` 0 turns events off (nothing is indexed)."""

    def __init__(self, *, max_chunks: int = 1 << 18, records: int = 65536) -> None:
        self.max_chunks = max_chunks
        self.log = EventLog(records)
        self._lock = threading.Lock()
        self._by_key: dict[tuple[int, bytes], _Chunk] = {}
        # (uid, space, group, chunk id) -> chunk, least recently stored first (what a full index forgets)
        self._by_id: OrderedDict[tuple[int, bytes, int, bytes], _Chunk] = OrderedDict()
        self._by_hash: dict[Any, _Chunk] = {}                            # an engine block hash -> its chunk
        self._chain: dict[Any, bytes] = {}                               # block hash -> token-chain digest
        self._by_tokens: dict[bytes, Any] = {}                           # token-chain digest -> block hash
        self._pods: set[tuple[int, bytes, str]] = set()
        self._unresident: dict[tuple, _Chunk] = {}       # indexed, not yet held anywhere (see prune)
        self._pruned_at = 0.0
        self.unindexed = 0        # chunks forgotten to make room: the index was full
        self.refused = 0          # STOREs whose adverts did not check (check_advert): not advertised
        self.stored_events = self.removed_events = 0

    @property
    def enabled(self) -> bool:
        return self.max_chunks > 0

    def __len__(self) -> int:
        return len(self._by_id)

    # ---- what a STORE says --------------------------------------------------------------
    def describe(self, uid: int, space: bytes, model: str, pod: str, rank: int, world: int,
                 keys: Sequence[bytes], adverts: Sequence[Any]) -> None:
        """Remember what each of a STORE's chunks is to its engine (before its copy commits)."""
        if not self.enabled or not adverts:
            return
        with self._lock:
            if pod and (uid, space, pod) not in self._pods and len(self._pods) < 4096:
                self._pods.add((uid, space, pod))
                self.log.append(uid, space, model, None, pod)
            for key, advert in zip(keys, adverts):
                ident = (uid, space, advert.group, bytes(advert.chunk))
                chunk = self._by_id.get(ident)
                if chunk is None:
                    if len(self._by_id) >= self.max_chunks:
                        self._forget_oldest()
                    chunk = self._by_id[ident] = _Chunk(ident, uid, space, model, world, advert)
                    self._unresident[ident] = chunk
                    self._index_hashes(chunk)
                else:
                    self._by_id.move_to_end(ident)
                old = chunk.keys.get(rank)
                if old is not None and old != key:
                    self._by_key.pop((uid, old), None)
                chunk.keys[rank] = key
                self._by_key[(uid, key)] = chunk

    def _index_hashes(self, chunk: _Chunk) -> None:
        prev = b"" if chunk.parent is None else self._chain.get(chunk.parent)
        bs = chunk.block_size
        for i, h in enumerate(chunk.hashes):
            self._by_hash[h] = chunk
            if prev is not None and len(chunk.tokens) >= (i + 1) * bs:
                prev = token_chain(prev, chunk.tokens[i * bs:(i + 1) * bs])
                self._chain[h] = prev
                self._by_tokens[prev] = h

    # ---- residency ----------------------------------------------------------------------
    def note(self, uid: int, key: bytes, tier: str, present: bool) -> None:
        """``(uid, key)`` is now held in ``tier`` (or not); emits when that changes whether its
        chunk is servable from the tier."""
        if not self._by_key:
            return
        with self._lock:
            chunk = self._by_key.get((uid, key))
            if chunk is None:
                return
            rank = next((r for r, k in chunk.keys.items() if k == key), None)
            if rank is None:
                return
            ranks = chunk.where.setdefault(tier, set())
            (ranks.add if present else ranks.discard)(rank)
            if present:
                self._unresident.pop(chunk.ident, None)
                if self._by_id.get(chunk.ident) is chunk:
                    self._by_id.move_to_end(chunk.ident)
            full = len(ranks) >= chunk.world
            if full and tier not in chunk.servable:
                chunk.servable.add(tier)
                self._emit(chunk, tier, True)
            elif not full and tier in chunk.servable:
                chunk.servable.discard(tier)
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
        chunk.servable.clear()
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
        for h in chunk.hashes:
            if self._by_hash.get(h) is chunk:
                del self._by_hash[h]
                digest = self._chain.pop(h, None)
                if digest is not None and self._by_tokens.get(digest) == h:
                    del self._by_tokens[digest]

    def _emit(self, chunk: _Chunk, tier: str, stored: bool) -> None:
        medium, locality = TIER_MEDIA.get(tier, ("STORAGE", "LOCAL"))
        if stored:
            event: KvEvent = BlockStored(block_hashes=chunk.hashes, parent_block_hash=chunk.parent,
                                         token_ids=list(chunk.tokens), block_size=chunk.block_size, lora_id=None,
                                         medium=medium, lora_name=chunk.lora, extra_keys=chunk.extra,
                                         group_idx=chunk.group, locality=locality)
            self.stored_events += 1
        else:
            event = BlockRemoved(block_hashes=chunk.hashes, medium=medium, group_idx=chunk.group, locality=locality)
            self.removed_events += 1
        self.log.append(chunk.uid, chunk.space, chunk.model, event)

    def prune(self, older_than_s: float = 60.0) -> int:
        """Forget adverts whose chunk never became resident anywhere (its STORE failed or found
        no room) once they are ``older_than_s`` old; returns how many."""
        now = time.monotonic()
        if now - self._pruned_at < min(10.0, older_than_s) or not self._unresident:
            return 0
        self._pruned_at = now
        cutoff = now - older_than_s
        with self._lock:
            stale = [c for c in self._unresident.values() if c.born < cutoff and not any(c.where.values())]
            for c in stale:
                self._drop_chunk(c)
        return len(stale)

    def cleared(self, model: str = "") -> None:
        """Everything the index knew is gone (the server starts, or lost its pool)."""
        with self._lock:
            self._by_key.clear()
            self._by_id.clear()
            self._by_hash.clear()
            self._chain.clear()
            self._by_tokens.clear()
            self._unresident.clear()
            self.log.append(-1, b"", model, AllBlocksCleared())

    # ---- the pull endpoint's question ---------------------------------------------------
    def leading(self, hashes: Sequence[Any], tiers: Sequence[str]) -> dict[str, int]:
        """How many leading blocks of ``hashes`` each tier can serve, whole chunks only."""
        out = {}
        with self._lock:
            for tier in tiers:
                p = 0
                while p < len(hashes):
                    chunk = self._by_hash.get(hashes[p])
                    if chunk is None or tier not in chunk.servable:
                        break
                    n = len(chunk.hashes)
                    if chunk.hashes[0] != hashes[p] or list(hashes[p:p + n]) != chunk.hashes:
                        break
                    p += n
                out[tier] = p
        return out

    def hashes_of_tokens(self, token_ids: Sequence[int], block_size: int) -> list[Any]:
        """The engine block hashes of ``token_ids``'s whole blocks, as far as the index has seen
        them (the chain of token digests from the first block)."""
        out = []
        prev = b""
        with self._lock:
            for b in range(len(token_ids) // block_size):
                prev = token_chain(prev, token_ids[b * block_size:(b + 1) * block_size])
                h = self._by_tokens.get(prev)
                if h is None:
                    break
                out.append(h)
        return out

    def block_sizes(self) -> set[int]:
        with self._lock:
            return {c.block_size for c in list(self._by_id.values())[:64]}


class CheckedAdvert:
    """An ``Advert`` whose fields were checked, its extra keys decoded."""

    __slots__ = ("chunk", "group", "block_size", "block_hashes", "parent_block_hash", "token_ids", "lora_name",
                 "extra_keys")

    def __init__(self, advert: Any, extra: Optional[list]) -> None:
        self.chunk, self.group, self.block_size = advert.chunk, advert.group, advert.block_size
        self.block_hashes, self.parent_block_hash = advert.block_hashes, advert.parent_block_hash
        self.token_ids = array("i", advert.token_ids)   # 4 bytes a token, not a Python int each
        self.lora_name, self.extra_keys = advert.lora_name, extra


def _plain(value: Any, depth: int) -> bool:
    if isinstance(value, (str, bytes, int, float)) or value is None:
        return True
    return depth > 0 and isinstance(value, list) and len(value) <= 16 and all(_plain(v, depth - 1) for v in value)


def check_advert(advert: Any) -> CheckedAdvert:
    """``advert`` made safe to keep and republish, or ``ValueError``: its token ids must be
    whole blocks (or absent), and its extra keys one entry per block of plain values (strings,
    bytes, numbers, short lists of them), as vLLM's are."""
    n = len(advert.block_hashes)
    if advert.token_ids and len(advert.token_ids) != n * advert.block_size:
        raise ValueError(f"{len(advert.token_ids)} token ids for {n} blocks of {advert.block_size}")
    extra = None
    if advert.extra_keys:
        try:
            extra = msgspec.msgpack.decode(advert.extra_keys)
        except Exception as exc:  # noqa: BLE001 - hostile bytes: not advertised
            raise ValueError(f"extra_keys are not msgpack: {type(exc).__name__}") from None
        if not isinstance(extra, list) or len(extra) != n or not all(_plain(e, 2) for e in extra):
            raise ValueError("extra_keys must be one entry per block: null or a list of plain values")
    return CheckedAdvert(advert, extra)


def token_chain(prev: bytes, tokens: Sequence[int]) -> bytes:
    """The digest of a block's tokens chained onto its parent's: the index's own key for "this
    many tokens, exactly these", used to answer lookups by token ids."""
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens))
    return h.digest()
