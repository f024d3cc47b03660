"""The index's maps: which ranks hold each advertised chunk in which tier, and the lookups.

``IndexMaps`` is what ``KvIndex`` applies its queue to. A chunk is its uid's (its identity and
keys carry the uid); its hashes and token keys are *posted* (``by_hash``, ``by_tokens``) only
once a tier holds it, and a hash keeps every resident chunk posted under it, so one uid's
adverts can add to what a lookup finds, never take away from it. Each uid's chunks are a
``_Share``: a full index forgets the least recently stored chunk of the uid whose chunks cost
the most, and adverts not resident yet are bounded per uid (``MAX_UNRESIDENT``). A chunk that
becomes servable from a tier (every rank holds it there) or stops being so adds a record to
``pending``, which ``KvIndex`` appends to the log.

No lock of its own: every method runs under ``KvIndex``'s lock, and never calls back into the
pool or a tier. The one trap: ``by_key`` is read without that lock, by the residency reports'
fast path (``KvIndex.note``: is anything indexed at all?), so it is emptied in place
(``clear``), never replaced by another dict.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Iterable, Optional, Sequence

from lmshm.core.kv_events.adverts import CheckedAdvert, Chunk, TokenKey, new_chunk
from lmshm.core.kv_events.format import BlockRemoved, media_of
from lmshm.core.kv_events.log import BOTH, NODE, OWNER, PackedStored

#: The index's byte bound (``KvIndex.max_bytes``, ``chunk_cost``): 2 KiB per chunk it may hold,
#: at least 64 MiB (what one chunk is charged: docs/design/kv-events.md, "Bounds").
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


class _Share:
    """One uid's part of the index: its chunks, least recently stored first (what a full index
    forgets of the uid holding the most), those not resident yet, and the bytes they cost."""

    __slots__ = ("lru", "unresident", "bytes", "unresident_bytes")

    def __init__(self) -> None:
        self.lru: OrderedDict[tuple, Chunk] = OrderedDict()
        self.unresident: OrderedDict[tuple, Chunk] = OrderedDict()
        self.bytes = 0
        self.unresident_bytes = 0


class IndexMaps:
    """The chunks indexed and the maps that find them (see the module docstring); every method
    is called under ``KvIndex``'s lock."""

    def __init__(self, max_chunks: int, max_bytes: Optional[int] = None) -> None:
        self.max_chunks = max_chunks
        self.max_bytes = max_bytes if max_bytes is not None else max(INDEX_BYTES, INDEX_BYTES_PER_CHUNK * max_chunks)
        self.max_unresident_bytes = max(self.max_bytes >> 3, UNRESIDENT_BYTES)
        self.pending: list[tuple] = []              # records to append to the log, in order
        self.by_key: dict[tuple[int, bytes], Chunk] = {}    # (uid, key) -> its chunk (rank: chunk.rank_of)
        self.by_id: dict[tuple[int, bytes, int, bytes], Chunk] = {}    # (uid, space, group, chunk id) -> chunk
        self.shares: dict[int, _Share] = {}                 # uid -> its chunks (each in one share)
        self.by_hash: dict[Any, Any] = {}         # a block hash -> the resident chunk(s) posted under it
        self.by_tokens: dict[TokenKey, Any] = {}  # a block's token_key -> its hash, or {hash: chunks}
        self.sizes: dict[int, int] = {}           # block size -> chunks of it
        self.bytes = 0                            # chunk_cost of every chunk indexed
        self.pods: dict[int, OrderedDict[tuple[bytes, str], str]] = {}   # uid -> (space, pod) -> model, LRU
        self.space_chunks: dict[tuple[int, bytes], int] = {}   # (uid, space) -> chunks indexed
        self.unindexed = 0        # chunks forgotten to make room: the index was full
        self.unresident_dropped = 0   # adverts forgotten: their uid had MAX_UNRESIDENT waiting
        self.stored_events = self.removed_events = 0

    def attach(self, uid: int, space: bytes, model: str, pod: str) -> None:
        """An engine (``pod``) advertises into (uid, space): an attach record the first time; a
        uid keeps its ``MAX_PODS_PER_UID`` most recently seen (a detach record for the one it
        forgets), and no uid's engines ever push out another's."""
        pods = self.pods.get(uid)
        if pods is None:
            pods = self.pods[uid] = OrderedDict()
        if (space, pod) in pods:
            pods.move_to_end((space, pod))
            return
        pods[(space, pod)] = model
        self.pending.append((uid, space, model, None, pod))
        if len(pods) > MAX_PODS_PER_UID:
            (old_space, old_pod), old_model = pods.popitem(last=False)
            self.pending.append((uid, old_space, old_model, None, old_pod, BOTH, True))

    def _space_left(self, uid: int, space: bytes) -> None:
        """(uid, space) has no chunk left: its engines detach (their topics may be freed)."""
        pods = self.pods.get(uid)
        if not pods:
            return
        for (s, pod), model in list(pods.items()):
            if s == space:
                del pods[(s, pod)]
                self.pending.append((uid, s, model, None, pod, BOTH, True))
        if not pods:
            del self.pods[uid]

    def describe(self, uid: int, space: bytes, model: str, rank: int, world: int,
                 keys: Sequence[bytes], adverts: Sequence[CheckedAdvert]) -> None:
        """Rank ``rank``'s ``keys`` are these chunks (``adverts``, checked): a chunk new to the
        index joins its uid's share, not resident yet (nothing is posted or emitted)."""
        by_id, by_key = self.by_id, self.by_key
        share = self.shares.get(uid)
        if share is None:
            share = self.shares[uid] = _Share()
        born = time.monotonic()
        for key, advert in zip(keys, adverts):
            ident = (uid, space, advert.group, bytes(advert.chunk))
            chunk = by_id.get(ident)
            ranks: dict = {}
            if chunk is not None and not chunk.posted and not any(chunk.where.values()) and (
                    chunk.hashes != tuple(advert.block_hashes) or chunk.tokens != advert.tokens):
                ranks = dict(chunk.keys)        # held nowhere yet: the newer advert says what it is
                self.space_chunks[(uid, space)] += 1       # (not emptied meanwhile: its engines stay)
                self._drop_chunk(chunk)
                self.space_chunks[(uid, space)] -= 1
                chunk = None
            if chunk is None:
                chunk = new_chunk(ident, uid, space, model, world, advert, born)
                self._make_room(share, chunk.cost)
                if self.shares.get(uid) is not share:      # its uid's last chunk was forgotten
                    share = self.shares[uid] = _Share()
                by_id[ident] = chunk
                self.space_chunks[(uid, space)] = self.space_chunks.get((uid, space), 0) + 1
                share.lru[ident] = chunk
                share.unresident[ident] = chunk
                share.bytes += chunk.cost
                share.unresident_bytes += chunk.cost
                self.bytes += chunk.cost
                self.sizes[chunk.block_size] = self.sizes.get(chunk.block_size, 0) + 1
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
        while self.by_id and (len(self.by_id) >= self.max_chunks or self.bytes + cost > self.max_bytes):
            victim = max(self.shares.values(), key=_share_bytes)
            if not victim.lru:
                break
            self._forget(next(iter(victim.lru.values())))

    def note(self, uid: int, key: bytes, tier: str, present: bool) -> None:
        """``(uid, key)`` is held in ``tier`` now (or not): its chunk is posted once resident,
        emits when that changes whether it is servable from ``tier``, and is dropped once held
        nowhere."""
        chunk = self.by_key.get((uid, key))
        if chunk is None:
            return
        bit = 1 << chunk.rank_of(key)
        ranks = chunk.where.get(tier, 0)
        if present:
            ranks |= bit
            share = self.shares[chunk.uid]
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

    def _post(self, chunk: Chunk) -> None:
        """Put a resident chunk's hashes and token keys in the lookup maps, beside any other
        chunk's (``MAX_SAME_HASH`` of one uid per hash)."""
        chunk.posted = True
        by_hash, by_tokens, cid, uid = self.by_hash, self.by_tokens, id(chunk), chunk.uid
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

    def _unpost(self, chunk: Chunk) -> None:
        chunk.posted = False
        by_hash, by_tokens, cid = self.by_hash, self.by_tokens, id(chunk)
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

    def _others(self, chunk: Chunk, h: Any) -> Iterable[Chunk]:
        cur = self.by_hash.get(h)
        if cur is None or cur is chunk:
            return ()
        if type(cur) is dict:
            return (c for c in cur.values() if c is not chunk)
        return (cur,)

    def _forget(self, chunk: Chunk) -> None:
        """Make room: forget ``chunk`` and tell readers it is gone from every tier it was
        servable from. A router then misses a chunk lmshm may still hold, which costs a
        recomputation, never a request sent for nothing."""
        for tier in sorted(chunk.servable):
            chunk.servable = tuple(t for t in chunk.servable if t != tier)
            self._emit_removed(chunk, tier)
        self._drop_chunk(chunk)
        self.unindexed += 1

    def _drop_chunk(self, chunk: Chunk) -> None:
        if self.by_id.get(chunk.ident) is not chunk:
            return
        del self.by_id[chunk.ident]
        share = self.shares[chunk.uid]
        share.lru.pop(chunk.ident, None)
        if share.unresident.pop(chunk.ident, None) is not None:
            share.unresident_bytes -= chunk.cost
        share.bytes -= chunk.cost
        self.bytes -= chunk.cost
        if not share.lru:
            del self.shares[chunk.uid]
        left = self.space_chunks[(chunk.uid, chunk.space)] - 1
        if left:
            self.space_chunks[(chunk.uid, chunk.space)] = left
        else:
            del self.space_chunks[(chunk.uid, chunk.space)]
            self._space_left(chunk.uid, chunk.space)
        left = self.sizes[chunk.block_size] - 1
        if left:
            self.sizes[chunk.block_size] = left
        else:
            del self.sizes[chunk.block_size]
        for key in chunk.keys.values():
            if self.by_key.get((chunk.uid, key)) is chunk:
                del self.by_key[(chunk.uid, key)]
        if chunk.posted:
            self._unpost(chunk)

    def _emit_stored(self, chunk: Chunk, tier: str) -> None:
        medium, locality = media_of(tier)
        self.stored_events += 1
        self.pending.append((chunk.uid, chunk.space, chunk.model,
                              PackedStored(chunk.hashes, chunk.parent, chunk.tokens, chunk.block_size, chunk.lora,
                                      chunk.extra, chunk.group, medium, locality, chunk.xheld), ""))

    def _emit_removed(self, chunk: Chunk, tier: str) -> None:
        """``chunk`` (no longer counting ``tier`` in its ``servable``) left ``tier``: its owner
        is told; the node stream only of the blocks no other chunk of the same model and group
        still serves from ``tier`` (none: the owner alone is told)."""
        medium, locality = media_of(tier)
        self.removed_events += 1
        gone = [h for h in chunk.hashes
                if not any(c.model == chunk.model and c.group == chunk.group and tier in c.servable
                           for c in self._others(chunk, h))]
        event = BlockRemoved(chunk.hashes, medium, chunk.group, locality)
        if len(gone) == len(chunk.hashes):
            self.pending.append((chunk.uid, chunk.space, chunk.model, event, "", BOTH))
            return
        self.pending.append((chunk.uid, chunk.space, chunk.model, event, "", OWNER))
        if gone:
            self.pending.append((chunk.uid, chunk.space, chunk.model,
                                  BlockRemoved(tuple(gone), medium, chunk.group, locality), "", NODE))


    def drop_unresident(self, cutoff: float) -> int:
        """Forget adverts whose chunk never became resident anywhere and that were made before
        ``cutoff`` (``time.monotonic``); each share's oldest come first, so it visits no more
        than it forgets (and one more per uid). Returns how many."""
        stale = 0
        for share in list(self.shares.values()):
            while share.unresident:
                chunk = next(iter(share.unresident.values()))
                if chunk.born >= cutoff:
                    break
                self._drop_chunk(chunk)
                stale += 1
        return stale

    def clear(self) -> None:
        """Forget every chunk (the engines attached stay: ``pods``). No record is added."""
        self.by_key.clear()
        self.by_id.clear()
        self.shares.clear()
        self.by_hash.clear()
        self.by_tokens.clear()
        self.sizes.clear()
        self.space_chunks.clear()
        self.bytes = 0

    # ---- the lookups ------------------------------------------------------------------------
    def leading(self, hashes: Sequence[Any], tier: str) -> int:
        """How many leading blocks of ``hashes`` ``tier`` can serve, whole chunks only (any
        chunk posted under a hash may serve it)."""
        p = 0
        while p < len(hashes):
            cur = self.by_hash.get(hashes[p])
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
        return p

    def chains(self, blocks: Sequence[bytes], lora: Optional[str], salt: Optional[str]) -> list[list[Any]]:
        """Per uid whose adverts name the first of ``blocks`` (each a ``block_digest``), the
        engine block hashes of as many as they name in a row (distinct chains only, longest
        first)."""
        chains: dict[tuple, None] = {}
        by_tokens = self.by_tokens
        for uid in list(self.shares):
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


_NONE = object()


def _share_bytes(share: _Share) -> int:
    return share.bytes
