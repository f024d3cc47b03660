"""The pool's objects: what each tenant (uid) stores, their LRU order, pins, leases and the
accounting, in one ``Arena`` (``memory.py``); ``extents.py``, ``records.py`` and ``tenants.py``
are its parts. An object is *in flight* after ``reserve`` (it owns its bytes, LOOKUP does not
see it) and *ready* after ``commit`` (``abort`` frees it): visible all or nothing. Objects
belong to the uid that stored them; another uid's LOOKUP and RETRIEVE do not see them. Pins keep
a ready object from eviction (a lease holds one per distinct object, a RETRIEVE one while it
copies), within per-uid caps, so the uids together never pin the whole pool. Eviction takes
the least recently used unpinned object of the tenant that holds the most bytes. Every figure
``info()`` reports is a counter: no method walks the objects or the free extents.

Every method takes the pool's one lock, and no copy runs under it. The one trap:
``on_resident`` and ``on_committed`` are called under that lock, so they must not call back
into the pool. docs/design/dataplane.md has the caps, the accounting and their figures.
"""

from __future__ import annotations

import collections
import heapq
import operator
import secrets
import threading
import time
from typing import Callable, Hashable, Iterable, Optional, Sequence

import torch

from lmshm.core.pool.extents import Extents
from lmshm.core.pool.memory import Arena, PoolBytes
from lmshm.core.pool.records import ALIGN, COST, KEY, LAYOUT, NBYTES, OBJECT_COST, OFFSET, UID, Reservation, cost_of
from lmshm.core.pool.tenants import Lease, Tenant

_cost, _key = operator.itemgetter(COST), operator.itemgetter(KEY)


class Pool:
    """See the module docstring. ``capacity`` 0 makes a pool that stores nothing; 0 for
    ``max_objects`` means no cap beside the capacity. ``huge_pages``, ``prefault`` and
    ``populate_ahead`` are the arena's (``memory.Arena``); ``on_resident`` and ``on_committed``
    are told of objects that become visible or are dropped (see their attributes)."""

    def __init__(self, capacity: int, *, max_objects: int = 0, max_pinned_fraction_per_uid: float = 1.0,
                 max_pins_per_uid: int = 1 << 30, huge_pages: bool = True, prefault: bool = False,
                 populate_ahead: int = 0, head_room: int = 0, align: int = ALIGN,
                 on_resident: Optional[Callable[[int, bytes, bool], None]] = None,
                 on_committed: Optional[Callable[[list], None]] = None) -> None:
        self.capacity = capacity
        #: where objects start: a multiple of ``ALIGN`` (a cache line), or of what a tier below
        #: asks (``Tier.align``: the disk's 4 KiB, for writes with ``O_DIRECT`` from the object)
        self.align = -(-max(align, ALIGN) // ALIGN) * ALIGN
        #: bytes kept free right before every object, part of its extent: a tier below the pool
        #: writes its header there and sends header and chunk as one value without copying the
        #: chunk (core/tiers: ``Tier.head_room``); a multiple of ``align``, so objects stay aligned
        self.head_room = -(-head_room // self.align) * self.align
        self.max_objects = max_objects
        self.max_pinned_fraction_per_uid = max_pinned_fraction_per_uid
        self.max_pins_per_uid = max_pins_per_uid
        self._lock = threading.Lock()
        self._tenants: dict[int, Tenant] = {}
        self._leases: dict[bytes, Lease] = {}
        self._session_leases: dict[Hashable, set[bytes]] = {}
        self._expiry: list[tuple[float, bytes]] = []       # a heap; entries of ended leases are skipped
        self._extents = Extents(capacity)
        self.used = 0             # bytes charged: extents and bookkeeping, in flight or ready
        self.objects = 0          # visible
        self.in_flight = 0
        self.pinned = 0           # visible objects with at least one pin
        self.pinned_bytes = 0
        self.lease_pins = 0       # pins held by leases (one per distinct object per lease)
        self._evictable = 0       # objects in some tenant's LRU
        self._evictable_bytes = 0
        self.hits = self.misses = self.stored = self.store_skipped = 0
        self.evictions = self.evicted_bytes = self.retrieved = self.failed = 0
        self.pins_capped = 0      # chunks LOOKUP found but did not pin: a per-uid cap
        #: ``(uid, key, present)`` when an object becomes visible or is dropped (KV events:
        #: core/kv_events.KvIndex.note); called under the pool's lock, so it must not call back
        self.on_resident = on_resident
        #: ``([(uid, key), ...])``: the objects one ``commit`` made visible, in one call (a STORE's
        #: chunks; its ``on_resident`` reports, batched); None: ``on_resident`` for each
        self.on_committed = on_committed
        #: the mapping the objects live in, and who faults its pages in (``memory.py``)
        self.memory = Arena(capacity, huge_pages=huge_pages, prefault=prefault, populate_ahead=populate_ahead)
        #: the objects' bytes: a uint8 tensor and a ``PoolBytes`` over the whole mapping
        self.tensor: torch.Tensor = self.memory.tensor
        self.bytes: PoolBytes = self.memory.bytes
        self.huge_pages = self.memory.huge_pages   # the kernel took MADV_HUGEPAGE for the pool

    def expect_stores(self) -> None:
        """A KV cache was registered: STOREs are coming, so populate ahead now (``populate_ahead``)."""
        with self._lock:
            self.memory.expect_stores()

    # ---- bytes --------------------------------------------------------------------------
    def view(self, obj: tuple) -> torch.Tensor:
        """The object's bytes, as a uint8 tensor over the pool (no copy)."""
        return self.tensor[obj[OFFSET]:obj[OFFSET] + obj[NBYTES]]

    def release(self) -> None:
        """Drop every object and unmap the pool (shutdown). Tensors handed out keep it mapped
        until they are gone."""
        self.memory.stop()
        with self._lock:
            self._tenants.clear()
            self._leases.clear()
            self._session_leases.clear()
            self._expiry = []
            self._extents = Extents(0)
            self.used = self.objects = self.in_flight = self.pinned = self.pinned_bytes = self.lease_pins = 0
            self._evictable = self._evictable_bytes = 0
            self.memory.release()
            self.tensor = self.memory.tensor

    # ---- the state of one object: ready (unpinned), pinned, in flight ------------------
    def _tenant(self, uid: int) -> Tenant:
        t = self._tenants.get(uid)
        if t is None:
            t = self._tenants[uid] = Tenant()
        return t

    def _forget_if_empty(self, uid: int, t: Tenant) -> None:
        if t.empty() and self._tenants.get(uid) is t:
            del self._tenants[uid]

    def _make_ready(self, t: Tenant, obj: tuple) -> None:
        """A new visible object, unpinned, at the LRU's recent end (commit)."""
        t.lru[obj[KEY]] = obj
        t.evictable += 1
        self._evictable += 1
        self._evictable_bytes += obj[COST]

    def _drop(self, t: Tenant, obj: tuple) -> None:
        """Free a visible, unpinned object (evicted, or replaced)."""
        del t.lru[obj[KEY]]
        cost = obj[COST]
        t.evictable -= 1
        self._evictable -= 1
        self._evictable_bytes -= cost
        self.objects -= 1
        self._uncharge(t, obj, cost)
        if self.on_resident is not None:
            self.on_resident(obj[UID], obj[KEY], False)

    def _uncharge(self, t: Tenant, obj: tuple, cost: int) -> None:
        self._extents.give(obj[OFFSET] - self.head_room, cost - OBJECT_COST)
        t.used -= cost
        self.used -= cost
        self._forget_if_empty(obj[UID], t)

    def _pin(self, t: Tenant, obj: tuple) -> None:
        key = obj[KEY]
        if key in t.lru:
            t.lru.move_to_end(key)
        pins = t.pins_of.get(key, 0)
        if not pins:
            cost = obj[COST]
            t.evictable -= 1
            self._evictable -= 1
            self._evictable_bytes -= cost
            t.pinned_bytes += cost
            self.pinned += 1
            self.pinned_bytes += cost
        t.pins_of[key] = pins + 1

    def _unpin(self, t: Tenant, obj: tuple) -> None:
        """One pin fewer; after the last one, eviction may take the object again."""
        self._unpin_all(t, (obj,))

    def _unpin_all(self, t: Tenant, objs: Iterable[tuple]) -> None:
        """``_unpin`` for each object, the counters updated once (a lease ends: 64 objects)."""
        pins_of, lru, aside = t.pins_of, t.lru, t.aside
        if not isinstance(objs, (list, tuple)):
            objs = list(objs)
        keys = list(map(_key, objs))
        if not aside and list(map(pins_of.get, keys)).count(1) == len(keys):
            # Each one's last pin, none set aside (the usual case): in C, no move (its pin moved it).
            collections.deque(map(pins_of.__delitem__, keys), maxlen=0)
            freed, freed_bytes = len(keys), sum(map(_cost, objs))
            objs = ()
        else:
            freed = freed_bytes = 0
        for obj in objs:
            key = obj[KEY]
            pins = pins_of.get(key, 0)
            if pins > 1:
                pins_of[key] = pins - 1
                continue
            if pins != 1:
                continue
            if lru.get(key) is obj:
                pass                            # where its pin put it: used as recently as that
            elif aside.get(key) is obj:
                del aside[key]
                lru[key] = obj
            else:
                continue
            del pins_of[key]
            freed += 1
            freed_bytes += obj[COST]
        t.evictable += freed
        t.pinned_bytes -= freed_bytes
        self.pinned -= freed
        self.pinned_bytes -= freed_bytes
        self._evictable += freed
        self._evictable_bytes += freed_bytes

    def _evict_one(self, requester: Optional[Tenant] = None) -> bool:
        """Drop the least recently used unpinned object of the tenant that holds the most. With
        ``requester`` (a batch's tenant, whose earlier chunks are in flight, not yet evictable):
        nothing, if that tenant holds more than the one that would be evicted from."""
        biggest: Optional[Tenant] = None
        for t in self._tenants.values():   # tenants are uids: a handful, not objects
            if t.evictable and (biggest is None or t.used > biggest.used):
                biggest = t
        if biggest is None or (requester is not None and requester.used > biggest.used):
            return False
        lru, pins_of = biggest.lru, biggest.pins_of
        while lru:                         # ends: ``evictable`` says an unpinned one is in the LRU
            key, victim = next(iter(lru.items()))
            if key not in pins_of:
                break
            del lru[key]                   # pinned: aside until its last pin ends
            biggest.aside[key] = victim
        else:
            return False
        self._drop(biggest, victim)
        self.evictions += 1
        self.evicted_bytes += victim[NBYTES]
        return True

    # ---- store --------------------------------------------------------------------------
    def reserve(self, uid: int, key: bytes, nbytes: int, layout: bytes, blocks: int,
                batch: bool = False) -> tuple[int, Optional[tuple]]:
        """Room for one chunk: ``(Reservation.STORED, object in flight)``, or ``(PRESENT, None)``
        if the key is stored or in flight, or ``(NO_SPACE, None)`` if not enough can be evicted
        (counted in ``store_skipped``).

        ``batch``: the caller holds earlier chunks of the same request in flight and will commit
        them, then ask again, on ``NO_SPACE``, which is then not counted. Committed one by one,
        those chunks would be evictable, and eviction takes from the tenant that holds the most:
        so while this uid holds more than every tenant with evictable objects, a batch evicts
        nothing of another's and gets ``NO_SPACE`` instead (one uid's big STORE must not evict
        a smaller tenant that per-chunk commits would have spared)."""
        count_skip = not batch
        with self._lock:
            t = self._tenants.get(uid)
            existing = None if t is None else (t.visible(key) or t.flight.get(key))
            if existing is not None and existing[LAYOUT] == layout:
                return Reservation.PRESENT, None
            if existing is not None:
                # Same key, other layout: keys carry the layout, so this is a hash collision or a
                # confused engine. The newer bytes win, unless the old object is busy.
                if key in t.pins_of or key in t.flight:
                    self.store_skipped += count_skip
                    return Reservation.NO_SPACE, None
                self._drop(t, existing)
            cost = cost_of(nbytes, self.head_room, self.align)
            if (batch and t is not None and t.pinned_bytes + t.flight_bytes + cost
                    > self.max_pinned_fraction_per_uid * self.capacity):
                # One uid's batch may keep at most that fraction of the pool busy (pinned or in
                # flight): past it, its earlier chunks are committed first (evictable again), so
                # a big STORE of a tenant that pins all it may never leaves others no room.
                return Reservation.NO_SPACE, None
            busy_bytes = self.used - self._evictable_bytes          # what eviction cannot free
            busy_objects = self.objects + self.in_flight - self._evictable
            if (nbytes <= 0 or busy_bytes + cost > self.capacity
                    or (self.max_objects and busy_objects + 1 > self.max_objects)):
                self.store_skipped += count_skip
                return Reservation.NO_SPACE, None
            while True:
                if self.used + cost <= self.capacity and (
                        not self.max_objects or self.objects + self.in_flight < self.max_objects):
                    offset = self._extents.take(cost - OBJECT_COST)
                    if offset is not None:
                        self.memory.advance(offset + cost - OBJECT_COST)
                        offset += self.head_room
                        break
                if not self._evict_one(t if batch else None):   # what is left is fragmented by pinned objects
                    self.store_skipped += count_skip
                    return Reservation.NO_SPACE, None
            obj = (offset, nbytes, layout, blocks, uid, key, cost)
            t = self._tenant(uid)
            t.flight[key] = obj
            t.flight_bytes += cost
            t.used += cost
            self.used += cost
            self.in_flight += 1
            return Reservation.STORED, obj

    def commit(self, objs: Iterable[tuple]) -> None:
        batch = self.on_committed
        committed: list = []
        with self._lock:
            for obj in objs:
                t = self._tenants.get(obj[UID])
                if t is None or t.flight.get(obj[KEY]) is not obj:
                    continue                    # released meanwhile (shutdown)
                del t.flight[obj[KEY]]
                t.flight_bytes -= obj[COST]
                self.in_flight -= 1
                self.objects += 1
                self.stored += 1
                self._make_ready(t, obj)
                if batch is not None:
                    committed.append((obj[UID], obj[KEY]))
                elif self.on_resident is not None:
                    self.on_resident(obj[UID], obj[KEY], True)
            if committed:
                batch(committed)

    def abort(self, objs: Iterable[tuple]) -> None:
        with self._lock:
            for obj in objs:
                t = self._tenants.get(obj[UID])
                if t is None or t.flight.get(obj[KEY]) is not obj:
                    continue
                del t.flight[obj[KEY]]
                t.flight_bytes -= obj[COST]
                self.in_flight -= 1
                self._uncharge(t, obj, obj[COST])

    # ---- lookup and leases --------------------------------------------------------------
    def lookup(self, uid: int, keys: list[list[bytes]], session: Hashable, ttl_s: float) -> tuple[int, bytes]:
        """Leading chunks that every rank has; pins them under a new lease (b"" if none), each
        distinct object once, as many leading chunks as the uid's pin caps allow.

        Every new request of an engine waits for this, on the request loop, so it is written for
        speed: the per-key work runs in C (``map``, ``dict.fromkeys``, ``dict.update``), and
        when the caps allow every chunk found (the usual case) the per-chunk walk is skipped."""
        with self._lock:
            n = min(len(k) for k in keys)
            t = self._tenants.get(uid)
            if t is None or n == 0:
                self.misses += 1 if n else 0
                return 0, b""
            lru, aside = t.lru, t.aside
            found = n
            per_rank = []
            for rank_keys in keys:
                if rank_keys[0] not in lru and rank_keys[0] not in aside:   # the usual miss: a new prefix
                    found = 0
                    break
                rank_keys = rank_keys if len(rank_keys) == found else rank_keys[:found]
                objs = list(map(lru.get, rank_keys))
                if not all(objs):               # (records are non-empty tuples: all() is a C loop)
                    if aside:
                        objs = [o or aside.get(k) for o, k in zip(objs, rank_keys)]
                    if not all(objs):
                        found = objs.index(None)
                per_rank.append((rank_keys, objs))
            if found == 0:
                self.misses += 1
                return 0, b""
            if len(per_rank) == 1:
                rank_keys, objs = per_rank[0]
                if len(objs) > found:
                    rank_keys, objs = rank_keys[:found], objs[:found]
                ones = dict.fromkeys(rank_keys, 1)          # a lease pins each object once
                if len(ones) < found:
                    objs = list(dict(zip(rank_keys, objs)).values())
            else:
                chosen = {o[KEY]: o for i in range(found) for _, objs in per_rank for o in (objs[i],)}
                ones, objs = dict.fromkeys(chosen, 1), list(chosen.values())
            pins_of = t.pins_of
            unpinned = not pins_of or pins_of.keys().isdisjoint(ones)    # none pinned yet: the usual case
            new_bytes = (sum(map(_cost, objs)) if unpinned
                         else sum(o[COST] for o in objs if o[KEY] not in pins_of))
            mine = t.pinned_bytes     # its share: of what the other uids leave unpinned
            share = self.max_pinned_fraction_per_uid * (self.capacity - self.pinned_bytes + mine)
            if mine + new_bytes <= share and t.lease_pins + len(objs) <= self.max_pins_per_uid:
                hits = found
            else:
                hits, chosen = self._capped(t, [objs for _, objs in per_rank], found, share)
                ones, objs, unpinned = dict.fromkeys(chosen, 1), list(chosen.values()), False
            self.hits += hits
            self.misses += 1 if hits < n else 0
            if hits == 0:
                return 0, b""
            # Pin each: a count, and a move to the LRU's recent end (it was just used).
            if unpinned:
                pins_of.update(ones)
                newly, newly_bytes = len(objs), new_bytes
            else:
                newly = newly_bytes = 0
                for obj in objs:
                    key = obj[KEY]
                    pins = pins_of.get(key)
                    if pins is None:
                        pins_of[key] = 1
                        newly += 1
                        newly_bytes += obj[COST]
                    else:
                        pins_of[key] = pins + 1
            if aside:
                for key in ones:
                    if key in lru:              # else set aside by eviction: pinned already
                        lru.move_to_end(key)
            else:
                collections.deque(map(lru.move_to_end, ones), maxlen=0)
            t.evictable -= newly
            self._evictable -= newly
            self._evictable_bytes -= newly_bytes
            t.pinned_bytes += newly_bytes
            self.pinned += newly
            self.pinned_bytes += newly_bytes
            token = secrets.token_bytes(16)
            lease = Lease(token, uid, session, time.monotonic() + ttl_s, objs)
            self._leases[token] = lease
            self._session_leases.setdefault(session, set()).add(token)
            heapq.heappush(self._expiry, (lease.expires, token))
            t.leases += 1
            t.lease_pins += len(objs)
            self.lease_pins += len(objs)
            return hits, token

    def _capped(self, t: Tenant, per_rank: list[list[tuple]], found: int, share: float) -> tuple[int, dict]:
        """``lookup`` when the caps do not allow every chunk found: ``(hits, chosen)``, the
        leading chunks whose objects (all ranks') fit, counting the rest in ``pins_capped``."""
        chosen: dict[bytes, tuple] = {}
        new_bytes = 0
        for i in range(found):                  # chunk i counts if all its ranks' objects fit the caps
            added = step_bytes = 0
            for objs in per_rank:
                obj = objs[i]
                key = obj[KEY]
                if key not in chosen:
                    chosen[key] = obj
                    added += 1
                    if key not in t.pins_of:
                        step_bytes += obj[COST]
            if (t.pinned_bytes + new_bytes + step_bytes > share
                    or t.lease_pins + len(chosen) > self.max_pins_per_uid):
                for _ in range(added):          # this chunk's objects, the last ones added
                    chosen.popitem()
                self.pins_capped += found - i
                return i, chosen
            new_bytes += step_bytes
        return found, chosen

    def _end_lease(self, lease: Lease) -> None:
        del self._leases[lease.token]
        mine = self._session_leases.get(lease.session)
        if mine is not None:
            mine.discard(lease.token)
            if not mine:
                del self._session_leases[lease.session]
        t = self._tenants[lease.uid]
        t.leases -= 1
        self._drop_lease_pins(t, lease.objects)
        self._forget_if_empty(lease.uid, t)
        if len(self._expiry) > 2 * len(self._leases) + 1024:   # keep ended leases' entries bounded
            self._expiry = [(x.expires, x.token) for x in self._leases.values()]
            heapq.heapify(self._expiry)

    def _drop_lease_pins(self, t: Tenant, objs: list) -> None:
        t.lease_pins -= len(objs)
        self.lease_pins -= len(objs)
        self._unpin_all(t, objs)

    def release_lease(self, token: bytes, uid: int) -> bool:
        """End a lease of ``uid`` (another uid's token counts as unknown)."""
        with self._lock:
            lease = self._leases.get(token)
            if lease is None or lease.uid != uid:
                return False
            self._end_lease(lease)
            return True

    def expire(self, now: Optional[float] = None) -> int:
        """End the leases whose time is up (the loop's tick): pops the heap's due entries only."""
        now = time.monotonic() if now is None else now
        ended = 0
        with self._lock:
            while self._expiry and self._expiry[0][0] <= now:
                _, token = heapq.heappop(self._expiry)
                lease = self._leases.get(token)
                if lease is not None and lease.expires <= now:
                    self._end_lease(lease)
                    ended += 1
        return ended

    def release_session(self, session: Hashable) -> int:
        """End every lease of a session that ended."""
        with self._lock:
            tokens = self._session_leases.pop(session, set())
            for token in tokens:
                lease = self._leases.get(token)
                if lease is not None:
                    self._end_lease(lease)
            return len(tokens)

    def leases_of(self, session: Hashable) -> int:
        with self._lock:
            return len(self._session_leases.get(session, ()))

    def leases_of_uid(self, uid: int) -> int:
        with self._lock:
            t = self._tenants.get(uid)
            return t.leases if t is not None else 0

    # ---- retrieve -----------------------------------------------------------------------
    def pin_for_copy(self, uid: int, keys: list[bytes], lease: bytes = b"") -> tuple[list[tuple], Optional[str]]:
        """Pin the ready objects of ``keys`` for a copy out of them; ``(objects, None)``, or
        ``([], why)`` if one is missing. ``lease``'s pins of these keys end here either way."""
        with self._lock:
            t = self._tenants.get(uid)
            objs: list[tuple] = []
            missing: Optional[int] = None
            for i, key in enumerate(keys):
                obj = t.visible(key) if t is not None else None
                if obj is None:
                    missing = i
                    break
                self._pin(t, obj)
                objs.append(obj)
            record = self._leases.get(lease) if lease else None
            if record is not None and record.uid == uid:
                wanted = set(keys)
                taken = [o for o in record.objects if o[KEY] in wanted]
                if taken:
                    record.objects = [o for o in record.objects if o[KEY] not in wanted]
                    self._drop_lease_pins(t, taken)
                    if not record.objects:
                        self._end_lease(record)
            if missing is not None:
                for obj in objs:
                    self._unpin(t, obj)
                if t is not None:
                    self._forget_if_empty(uid, t)
                return [], f"chunk {missing} is not stored (evicted, or never stored)"
            return objs, None

    def unpin(self, objs: Iterable[tuple], *, retrieved: bool) -> None:
        with self._lock:
            objs = list(objs)
            uids = {obj[UID] for obj in objs}
            for uid in uids:
                t = self._tenants.get(uid)
                if t is not None:
                    self._unpin_all(t, objs if len(uids) == 1 else [o for o in objs if o[UID] == uid])
            n = len(objs)
            if retrieved:
                self.retrieved += n

    def count_failure(self) -> None:
        with self._lock:
            self.failed += 1

    # ---- hooks of the tiers below the pool (core/tiers/stack.py) --------------------------
    def hold(self, uid: int, key: bytes) -> Optional[tuple]:
        """Pin the visible object ``(uid, key)`` and return it (None if there is none): a
        write-through reads it, or a LOOKUP keeps it while it promotes later chunks. End
        with ``unpin([obj], retrieved=False)``."""
        with self._lock:
            t = self._tenants.get(uid)
            obj = t.visible(key) if t is not None else None
            if obj is not None:
                self._pin(t, obj)
            return obj

    def announce(self, uid: int, keys: Sequence[bytes]) -> None:
        """Call ``on_resident(uid, key, True)`` again for each of ``keys`` visible now (KV
        events: the advert of a STORE that finds its chunks stored before without one). Under
        the lock drops are told under, so a chunk evicted meanwhile is never announced after
        its removal."""
        if self.on_resident is None:
            return
        with self._lock:
            t = self._tenants.get(uid)
            if t is None:
                return
            for key in keys:
                if t.visible(key) is not None:
                    self.on_resident(uid, key, True)

    def all_visible(self, uid: int, keys: list[list[bytes]]) -> bool:
        """Whether every key of every rank is visible: a LOOKUP the tiers need not see."""
        with self._lock:
            t = self._tenants.get(uid)
            return t is not None and all(t.visible(k) is not None for rank_keys in keys for k in rank_keys)

    # ---- introspection: counters only, whatever the pool holds ---------------------------
    def tenant_usage(self, limit: int = 32) -> list[tuple[int, int, int]]:
        """``(uid, bytes charged, visible objects)`` of the ``limit`` uids that hold the most."""
        with self._lock:
            rows = [(uid, t.used, len(t.lru) + len(t.aside)) for uid, t in self._tenants.items()]
        rows.sort(key=lambda r: -r[1])
        return rows[:limit]

    def info(self) -> dict[str, int]:
        with self._lock:
            return dict(capacity=self.capacity, used=self.used, objects=self.objects, in_flight=self.in_flight,
                        pinned=self.pinned, leases=len(self._leases), hits=self.hits, misses=self.misses,
                        stored=self.stored, store_skipped=self.store_skipped, evictions=self.evictions,
                        evicted_bytes=self.evicted_bytes, retrieved=self.retrieved, failed=self.failed,
                        max_objects=self.max_objects,
                        metadata_bytes=(self.objects + self.in_flight) * OBJECT_COST,
                        pinned_bytes=self.pinned_bytes, lease_pins=self.lease_pins, pins_capped=self.pins_capped,
                        uids=len(self._tenants))
