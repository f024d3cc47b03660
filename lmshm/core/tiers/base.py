"""The tier interface: where a chunk may live below the server's pool, and what each tier counts.

The pool is tier 1: the only place a RETRIEVE copies from. Every other tier (``disk/``,
``remote/``) implements ``Tier`` and is reached only through ``TierStack`` (``stack.py``). A
chunk in a tier is addressed as in the pool, ``(uid, key)``, and stored with what the pool needs
to take it back (``ChunkMeta``: length, layout digest, blocks per chunk), so it is served only
to the same uid and into a registration of the same layout, as a pooled one is.

Rules every implementation keeps (the one thing easy to get wrong is the first):
- ``get_into`` writes only into ``dest``, and returns True only when every byte of it is the
  chunk's, checked (length and checksum); on any doubt it returns False (a miss), never raises;
- ``put`` never raises for a full or failing medium: it returns False and counts a drop;
- every call is bounded in time (the tier's own means, or ``stack.py``'s deadline); a tier
  never blocks an endpoint's loop; usage (``used``) stays within ``capacity``.
"""

from __future__ import annotations

import abc
import hashlib
import math
import os
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from lmshm.wire.protocol import TierInfo


@dataclass(frozen=True)
class ChunkMeta:
    """What the pool needs to take a chunk back: the bytes of the object, and its layout."""

    nbytes: int
    layout: bytes      # the layout digest (copier.BlockLayout.digest)
    blocks: int        # blocks per chunk


class TierStats:
    """A tier's running totals, kept under one lock; ``snapshot`` is what STATUS shows."""

    FIELDS = ("hits", "misses", "promotions", "puts", "drops", "errors", "timeouts", "corrupt", "evictions",
              "read_bytes", "written_bytes", "reads", "writes", "direct_writes", "not_admitted")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values = dict.fromkeys(self.FIELDS, 0)
        self.read_seconds = 0.0
        self.write_seconds = 0.0

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                self.values[name] += n

    def timed_read(self, seconds: float, nbytes: int) -> None:
        with self._lock:
            self.read_seconds += seconds
            self.values["reads"] += 1
            self.values["read_bytes"] += nbytes

    def timed_write(self, seconds: float, nbytes: int) -> None:
        with self._lock:
            self.write_seconds += seconds
            self.values["writes"] += 1
            self.values["written_bytes"] += nbytes

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self.values, read_seconds=self.read_seconds, write_seconds=self.write_seconds)


class SeenOnce:
    """Which items were seen lately, in bounded memory: two Bloom filters of ``remember`` items
    each (1 % false positives), the older dropped when the newer is full. An item is remembered
    for at least ``remember`` and at most ``2 * remember`` new items after it (1M: 2.4 MB); a
    false positive lets one item through a first time. The hash is BLAKE2b under a random key
    per process, so no peer can pick items that collide."""

    def __init__(self, remember: int, false_positives: float = 0.01) -> None:
        self.remember = max(1, remember)
        self.bits = max(64, int(-self.remember * math.log(false_positives) / math.log(2) ** 2))
        self.hashes = max(1, round(self.bits / self.remember * math.log(2)))
        self._key = os.urandom(16)
        self._lock = threading.Lock()
        self._new = bytearray((self.bits + 7) // 8)
        self._old = bytearray(len(self._new))
        self._added = 0

    def check_and_add(self, item: bytes) -> bool:
        """True if ``item`` was seen lately; otherwise remember it and answer False."""
        digest = hashlib.blake2b(item, digest_size=16, key=self._key).digest()
        h1, h2 = int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little") | 1
        where = [(p >> 3, 1 << (p & 7)) for p in ((h1 + i * h2) % self.bits for i in range(self.hashes))]
        with self._lock:
            if all(self._new[i] & bit for i, bit in where) or all(self._old[i] & bit for i, bit in where):
                return True
            for i, bit in where:
                self._new[i] |= bit
            self._added += 1
            if self._added >= self.remember:
                self._old, self._new, self._added = self._new, bytearray(len(self._new)), 0
            return False


class Tier(abc.ABC):
    """One storage tier below the pool. See the module docstring for the rules."""

    #: a short name for STATUS, logs and metrics labels ("disk", "remote")
    name: str = "tier"
    #: bytes the tier may write right before a chunk in the pool, for its header: the pool then
    #: keeps that much free in front of every object (``Pool.head_room``) and ``put`` gets
    #: ``framed``, so header and chunk go out as one value without copying the chunk. 0: none.
    head_room: int = 0
    #: where in memory ``put`` would like a chunk to start (the disk's 4 KiB: direct I/O from
    #: the pool object); the pool aligns its objects to the largest of its tiers'. 0: any.
    align: int = 0

    def __init__(self) -> None:
        self.stats = TierStats()
        #: ``(uid, key)`` when the tier stops holding a chunk (evicted, found damaged, gone from
        #: a remote): KV events (core/kv_events). May be called under the tier's lock.
        self.gone: Optional[Callable[[int, bytes], None]] = None
        #: ``(uid, key)`` when the tier holds a chunk: written, or found held already by ``put``
        #: or ``announce``. A tier that tells ``gone`` under a lock tells this under the same
        #: one, so a chunk is never announced after its removal.
        self.held: Optional[Callable[[int, bytes], None]] = None

    def report_to(self, on_resident: Callable[[int, bytes, bool], None]) -> None:
        """Tell ``on_resident(uid, key, present)`` what ``held`` and ``gone`` would be told (KV
        events: ``KvIndex.recorder(self.name)``). ``Core`` calls it once, before the first chunk."""
        self.held = lambda uid, key: on_resident(uid, key, True)
        self.gone = lambda uid, key: on_resident(uid, key, False)

    def _gone(self, uid: int, key: bytes) -> None:
        if self.gone is not None:
            self.gone(uid, key)

    def _held(self, uid: int, key: bytes) -> None:
        if self.held is not None:
            self.held(uid, key)

    def announce(self, uid: int, keys: Sequence[bytes]) -> None:  # noqa: B027 (optional: a default that does nothing)
        """Tell ``held`` of each of ``keys`` the tier holds, where it knows without a round trip
        (the disk's index; KV events: chunks stored before their advert). A remote says nothing:
        it learns again what it holds only when a chunk is written through."""

    @abc.abstractmethod
    def contains(self, uid: int, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` this tier holds for ``uid`` (a batch: one call per LOOKUP)."""

    @abc.abstractmethod
    def head(self, uid: int, key: bytes) -> Optional[ChunkMeta]:
        """What the tier holds under ``(uid, key)``, or None: enough to reserve a pool slot."""

    #: whether ``heads`` answers several keys in one round trip (a remote), so that a LOOKUP
    #: asks for the headers of the chunks ahead at once, not one round trip per chunk
    batched_heads: bool = False

    def heads(self, uid: int, keys: Sequence[bytes]) -> list[Optional[ChunkMeta]]:
        """``head`` of each key, in order (``batched_heads`` tiers: in one round trip)."""
        return [self.head(uid, k) for k in keys]

    def admit(self, uid: int, key: bytes) -> bool:
        """Whether a chunk just stored into the pool is to be written through to this tier (a
        tier that declines counts it, ``not_admitted``). Called on the storing thread: cheap."""
        return True

    @abc.abstractmethod
    def get_into(self, uid: int, key: bytes, meta: ChunkMeta, dest: memoryview,
                 framed: Optional[memoryview] = None) -> bool:
        """Fill ``dest`` (``meta.nbytes`` bytes of a reserved pool slot) with the chunk; True
        only when every byte is there and checked. A mismatch is a miss (and the tier drops
        the bad copy). The slot stays invisible until the caller commits it after True, and is
        freed after False, so what a failed read left in it is never served. ``framed``, as for
        ``put``: the ``head_room`` bytes before the slot and the slot, the tier's to write."""

    def get_run_into(self, uid: int, jobs: Sequence[tuple[bytes, ChunkMeta, memoryview, Optional[memoryview]]]) -> int:
        """``get_into`` of each ``(key, meta, dest, framed)`` in order, up to the first that
        fails; how many were read. A tier that can ask for a run at once (the remote's
        pipelined ``GET``s) overrides it."""
        for i, (key, meta, dest, framed) in enumerate(jobs):
            if not self.get_into(uid, key, meta, dest, framed):
                return i
        return len(jobs)

    @abc.abstractmethod
    def put(self, uid: int, key: bytes, meta: ChunkMeta, data: memoryview,
            framed: Optional[memoryview] = None) -> bool:
        """Keep ``data`` (a pool object's bytes, read-only for the call) under ``(uid, key)``.
        False (counted as a drop) when it cannot: full, failing, or already held. ``framed``,
        when the pool keeps ``head_room`` bytes before its objects, is those bytes and ``data``
        (which ends it): the tier may write its header into the first ``head_room`` bytes, and
        only there; no other thread reads or writes them meanwhile."""

    @abc.abstractmethod
    def usage(self) -> tuple[int, int, int]:
        """``(capacity, used bytes, objects)``."""

    def close(self) -> None:  # noqa: B027 (optional: a tier may hold nothing open)
        """Release what the tier holds open (files, connections). Idempotent."""

    def info(self, queue_depth: int = 0, queue_limit: int = 0) -> TierInfo:
        capacity, used, objects = self.usage()
        s = self.stats.snapshot()
        return TierInfo(name=self.name, capacity=capacity, used=used, objects=objects, queue_depth=queue_depth,
                        queue_limit=queue_limit, **s)
