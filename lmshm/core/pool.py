"""The server's memory pool: objects (stored chunks), their LRU order, pins, leases, and what
each tenant (uid) may hold of them.

One anonymous mapping of ``capacity`` bytes, made once and touched lazily (``MAP_NORESERVE``:
pages cost memory only once an object is copied into them), advised to use transparent huge
pages (``huge_pages``: a first STORE into untouched pages then takes one fault per 2 MiB
instead of 512; docs/design/dataplane.md has the figures). ``populate_ahead`` (on by default
in the server) keeps that many bytes past the allocator's *frontier* (the highest offset it
ever handed out: it hands out low offsets first, so everything above is untouched) populated
on a background thread, a step at a time, so that a STORE into a new pool, or past what the
pool ever held, finds its pages there; the pool costs at most that much memory more than it
ever held. ``prefault`` fills every page once instead, so that no STORE ever waits for the
kernel to hand out zeroed pages; the pool then costs its whole capacity in memory from the
start (docs/benchmarks.md, "Cold pool pages", measures all three). An object is one chunk: whole
blocks of one registration, every layer, packed in registration order. Space is handed out best
fit from the free extents, with neighbours merged on free (``_Extents``).

Life of an object:
- ``reserve`` makes it *in flight*: it owns its bytes but LOOKUP does not see it;
- ``commit`` after the copy has completed makes it *ready* (visible); ``abort`` frees it.
So an object is visible all or nothing.

Accounting: an object costs its extent (its bytes and the pool's ``head_room``, rounded up to
its ``align``, ``ALIGN`` unless a tier asks for more) plus ``OBJECT_COST`` bytes of
bookkeeping, and ``used`` is the sum of those costs, in flight or ready: the pool's
whole cost in server memory stays within ``capacity``. ``max_objects`` caps the count too.
Every figure ``info()`` reports is a counter kept as objects change; no method walks the
objects or the free extents (lookups are dict lookups, eviction pops the head of an LRU and
sets aside the pinned objects it meets there, lease expiry is a heap), so no request costs time
in proportion to the pool.

Tenants: objects belong to the uid that stored them; LOOKUP and RETRIEVE from another uid do
not see them. Pins keep a ready object from eviction: a lease (LOOKUP) holds one pin per
*distinct* object, a RETRIEVE one while it copies. A uid's pinned objects may cost at most
``max_pinned_fraction_per_uid`` of what the other uids leave unpinned (alone: that fraction of
the pool; two uids pinning all they can at 0.5: a half and a quarter), and its leases hold at
most ``max_pins_per_uid`` pins; a LOOKUP that would pass either answers the leading chunks that
fit. So the uids together never pin the whole pool. Eviction takes the least
recently used unpinned object of the tenant that holds the most bytes (with one tenant: plain
LRU), so a STORE can always evict unpinned objects of the biggest tenant. A STORE's chunks are
reserved as one batch, but a uid's batch keeps at most ``max_pinned_fraction_per_uid`` of the
pool busy, pinned or in flight: past that its earlier chunks are committed first.

The easy thing to get wrong: an object's record is a plain tuple of atomic values
(``OFFSET``, ``NBYTES``, ... index it; ``COST`` is what it is charged), not a class instance.
Python's cyclic GC stops tracking such tuples, so a million objects add nothing to a
collection; a million instances made every full collection take about a second (measured),
stalling every request meanwhile.

Every method takes the pool's one lock; no copy runs under it.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import errno
import heapq
import logging
import mmap
import operator
import os
import secrets
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any, Callable, Hashable, Iterable, Optional, Sequence

import torch

logger = logging.getLogger(__name__)

ALIGN = 64  # bytes; every object starts on a cache line
#: Bytes of server memory one object's bookkeeping takes, charged against the capacity on top of
#: its extent: its record, key and LRU entry, and the free extent beside it in the worst case
#: (measured with tracemalloc in tests/v1/core/test_pool_limits.py; docs/design/dataplane.md).
OBJECT_COST = 640
#: The record of an object: ``(offset, nbytes, layout, blocks, uid, key, cost)``, indexed by these.
OFFSET, NBYTES, LAYOUT, BLOCKS, UID, KEY, COST = range(7)
_cost, _key = operator.itemgetter(COST), operator.itemgetter(KEY)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)   # Linux >= 5.14
#: Bytes pre-faulted per step of the background pre-fault (between steps it checks for shutdown).
PREFAULT_STEP = 64 << 20
#: Bytes populated per step ahead of the frontier: small, so that the thread soon moves past
#: pages that a STORE reached first instead of faulting the same huge pages at once.
POPULATE_STEP = 8 << 20
_HUGE = 2 << 20   # populate steps start on a huge-page boundary of the pool


def _madvise(addr: int, length: int, advice: int) -> int:
    """``madvise``; 0, or the errno."""
    return 0 if _libc.madvise(addr, length, advice) == 0 else ctypes.get_errno()


def parse_size(text: str | int) -> int:
    """``"4GiB"``, ``"512MiB"``, ``"1.5G"``, ``"0"`` or an int -> bytes. Binary units either way."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a size cannot be negative: {text}")
        return text
    s = str(text).strip().lower().replace(" ", "")
    units = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
             "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}
    num = s.rstrip("kmgtib")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in units or value < 0 or value != value:
        raise ValueError(f"not a size: {text!r} (examples: 4GiB, 512MiB, 0)")
    return int(value * units[unit])


def cost_of(nbytes: int, head_room: int = 0, align: int = ALIGN) -> int:
    """What an object of ``nbytes`` is charged against the capacity (in a pool with ``head_room``
    and objects aligned to ``align``)."""
    return -(-(nbytes + head_room) // align) * align + OBJECT_COST


class Reservation:
    """``reserve``'s answer for one chunk."""

    STORED, PRESENT, NO_SPACE = 0, 1, 2


class _Extents:
    """The free extents of the pool's range, indexed so that neither taking nor giving back
    walks them: by start and by end (a freed extent merges with its free neighbours) and by
    size (best fit: the smallest free size that fits, found by bisecting the sorted distinct
    sizes; disjoint extents have at most sqrt(2 * capacity / ALIGN) distinct sizes, 8,192 for
    2 GiB, so that list stays short however fragmented the pool is)."""

    def __init__(self, size: int) -> None:
        self._by_start: dict[int, int] = {}             # start -> size
        self._by_end: dict[int, int] = {}               # end -> start
        self._by_size: dict[int, dict[int, None]] = {}  # size -> starts
        self._sizes: list[int] = []                     # sorted sizes of _by_size
        if size:
            self._add(0, size)

    def take(self, size: int) -> Optional[int]:
        """The start of ``size`` bytes, or None if no free extent is that large."""
        i = bisect.bisect_left(self._sizes, size)
        if i == len(self._sizes):
            return None
        have = self._sizes[i]
        starts = self._by_size[have]
        start, _ = starts.popitem()        # the newest: popitem never walks deleted entries
        del self._by_start[start]
        del self._by_end[start + have]
        if not starts:
            del self._by_size[have]
            del self._sizes[i]
        if have > size:
            self._add(start + size, have - size)
        return start

    def give(self, start: int, size: int) -> None:
        nxt = self._by_start.get(start + size)
        if nxt is not None:
            self._remove(start + size, nxt)
            size += nxt
        prev = self._by_end.get(start)
        if prev is not None:
            self._remove(prev, start - prev)
            start, size = prev, size + start - prev
        self._add(start, size)

    def _add(self, start: int, size: int) -> None:
        self._by_start[start] = size
        self._by_end[start + size] = start
        starts = self._by_size.get(size)
        if starts is None:
            starts = self._by_size[size] = {}
            bisect.insort(self._sizes, size)
        starts[start] = None

    def _remove(self, start: int, size: int) -> None:
        del self._by_start[start]
        del self._by_end[start + size]
        starts = self._by_size[size]
        del starts[start]
        if not starts:
            del self._by_size[size]
            del self._sizes[bisect.bisect_left(self._sizes, size)]

    def __len__(self) -> int:
        return len(self._by_start)


class _PopulateAhead:
    """The pool's pages populated (``MADV_POPULATE_WRITE``) up to ``ahead`` bytes past the
    allocator's frontier, on one thread, ``POPULATE_STEP`` at a time; from the frontier on
    when the STOREs got past what it populated (they fault their own pages meanwhile). Nothing
    is populated before the first KV registration (``start``) or reservation: a server that
    never stores costs no memory, and the first STORE after a registration finds its pages.

    ``advance`` runs in ``reserve`` under the pool's lock and only moves the target and wakes
    the thread, so a STORE never waits for it. The thread holds the mapping (``keep``), not the
    pool: a pool dropped without ``release`` stops it from a finalizer, and is unmapped once it
    has ended. Kernels without ``MADV_POPULATE_WRITE`` (before 5.14) answer EINVAL: one info
    log, the thread ends, the STOREs fault their own pages as with ``populate_ahead`` 0."""

    def __init__(self, addr: int, capacity: int, ahead: int, keep: Any) -> None:
        self.addr, self.capacity, self.ahead = addr, capacity, ahead
        self.frontier = 0                     # the highest end of an extent ever handed out
        self.want = 0                         # populate [done, want); nothing before ``start``
        self.done = 0                         # bytes from 0 that are populated, or below the frontier
        self.populated = 0                    # bytes this thread populated itself
        self.error = 0                        # madvise's errno, if it gave up
        self._wake = threading.Event()
        self._wake.set()
        self._stop = False
        self.thread = threading.Thread(target=self._run, args=(keep,), name="lmshm-pool-populate", daemon=True)
        self.thread.start()

    def advance(self, end: int) -> None:
        """An extent up to ``end`` was handed out (under the pool's lock)."""
        if end > self.frontier:
            self.frontier = end
            want = min(self.capacity, end + self.ahead)
            if want > self.want:
                self.want = want
                self._wake.set()

    def start(self) -> None:
        """Stores are coming (a KV cache was registered): populate the window past the frontier."""
        want = min(self.capacity, self.frontier + self.ahead)
        if want > self.want:
            self.want = want
            self._wake.set()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()

    def _run(self, keep: Any) -> None:
        while not self._stop and self.done < self.capacity:
            self._wake.wait()
            self._wake.clear()                # before reading want: a later advance wakes it again
            while not self._stop:
                start = max(self.done, self.frontier // _HUGE * _HUGE)
                end = min(self.want, start + POPULATE_STEP)
                if start >= end:
                    break
                err = _madvise(self.addr + start, end - start, _MADV_POPULATE_WRITE)
                if err in (errno.EINTR, errno.EAGAIN):
                    continue
                if err:
                    self.error = err
                    logger.info("lmshm: the pool's pages are not populated ahead of STOREs (madvise "
                                "MADV_POPULATE_WRITE: %s; Linux >= 5.14 has it): first STOREs into "
                                "fresh pool memory fault their own pages", os.strerror(err))
                    return
                self.populated += end - start
                self.done = end
        del keep


class _Tenant:
    """One uid's objects and what it holds pinned.

    A visible object is in ``lru`` (least recently used first), or in ``aside`` once eviction
    met it pinned at the LRU's head; from there it returns to the LRU's recent end when its
    last pin ends. A pin is a count in ``pins_of`` plus a move to the LRU's recent end (the
    object was just used); it does not take the object out of the LRU: a LOOKUP pins every
    object it finds, and moving each out of the OrderedDict and back cost more than the rest
    of the request (64 keys: 46 us against 9). So eviction skips pinned objects lazily, each
    at most once per pin, and ``evictable`` counts the unpinned ones. In flight: ``flight``."""

    __slots__ = ("lru", "aside", "flight", "flight_bytes", "pins_of", "evictable", "used", "pinned_bytes",
                 "lease_pins", "leases")

    def __init__(self) -> None:
        self.lru: OrderedDict[bytes, tuple] = OrderedDict()    # visible; least recently used first
        self.aside: dict[bytes, tuple] = {}                    # visible, pinned, met by eviction
        self.flight: dict[bytes, tuple] = {}                   # reserved, copy not complete
        self.flight_bytes = 0     # what those cost
        self.pins_of: dict[bytes, int] = {}                    # key of a pinned object -> its pins
        self.evictable = 0        # visible objects without a pin
        self.used = 0             # bytes charged for its objects
        self.pinned_bytes = 0     # of which pinned
        self.lease_pins = 0       # pins its leases hold
        self.leases = 0

    def visible(self, key: bytes) -> Optional[tuple]:
        return self.lru.get(key) or self.aside.get(key)

    def empty(self) -> bool:
        return not (self.lru or self.aside or self.flight or self.leases)


class _Lease:
    __slots__ = ("token", "uid", "session", "expires", "objects")

    def __init__(self, token: bytes, uid: int, session: Hashable, expires: float, objects: list) -> None:
        self.token, self.uid, self.session, self.expires = token, uid, session, expires
        self.objects = objects    # distinct objects, one pin each


class PoolBytes:
    """The pool as a memoryview, for ``preadv``/``pwritev`` into and out of it."""

    def __init__(self, view: memoryview, addr: int) -> None:
        self.view, self.addr = view, addr

    def at(self, addr: int, n: int) -> memoryview:
        return self.view[addr - self.addr:addr - self.addr + n]


class Pool:
    """See the module docstring. ``capacity`` 0 makes a pool that stores nothing; 0 for
    ``max_objects`` means no cap beside the capacity."""

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
        self._tenants: dict[int, _Tenant] = {}
        self._leases: dict[bytes, _Lease] = {}
        self._session_leases: dict[Hashable, set[bytes]] = {}
        self._expiry: list[tuple[float, bytes]] = []       # a heap; entries of ended leases are skipped
        self._extents = _Extents(capacity)
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
        self._addr = 0
        self.huge_pages = False   # the kernel took MADV_HUGEPAGE for the pool
        self._buf: Any = None
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if capacity:
            addr = _libc.mmap(None, capacity, mmap.PROT_READ | mmap.PROT_WRITE,
                              mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
            if addr is None or addr == ctypes.c_void_p(-1).value:
                err = ctypes.get_errno()
                raise OSError(err, f"cannot reserve a pool of {capacity} bytes: {os.strerror(err)} "
                                   "(lower lmshm-server --capacity)")
            self._addr = addr
            self._buf = (ctypes.c_uint8 * capacity).from_address(addr)
            self._unmap = weakref.finalize(self._buf, _libc.munmap, addr, capacity)
            self.tensor = torch.frombuffer(self._buf, dtype=torch.uint8)
            if huge_pages:
                err = _madvise(addr, capacity, _MADV_HUGEPAGE)
                self.huge_pages = not err
                if err:   # a kernel without THP, or THP off ("never"): 4 KiB pages, nothing else changes
                    logger.info("lmshm: the pool gets no transparent huge pages (madvise: %s)", os.strerror(err))
        self.bytes = PoolBytes(memoryview(self._buf).cast("B") if capacity else memoryview(b""), self._addr)
        self.prefaulted = 0       # bytes the background pre-fault has touched so far
        self._prefault_stop = threading.Event()
        self._prefaulter: Optional[threading.Thread] = None
        if capacity and prefault:
            self._prefaulter = threading.Thread(target=self._prefault, name="lmshm-pool-prefault", daemon=True)
            self._prefaulter.start()
        #: what keeps pages populated past the allocator's frontier (None: off, or ``prefault``)
        self._ahead: Optional[_PopulateAhead] = None
        if capacity and populate_ahead > 0 and not prefault:
            self._ahead = _PopulateAhead(self._addr, capacity, populate_ahead, self._buf)
            weakref.finalize(self, self._ahead.stop)

    def _prefault(self) -> None:
        """Fault every page of the pool in once, a step at a time (``MADV_POPULATE_WRITE``: the
        kernel allocates and zeroes pages that are not there yet and leaves the others alone,
        so STOREs may run meanwhile). Stops early at shutdown. Kernels before 5.14 lack it:
        nothing is pre-faulted there (writing to the pages instead could race a STORE)."""
        for at in range(0, self.capacity, PREFAULT_STEP):
            if self._prefault_stop.is_set():
                return
            n = min(PREFAULT_STEP, self.capacity - at)
            err = _madvise(self._addr + at, n, _MADV_POPULATE_WRITE)
            if err:
                logger.warning("lmshm: pre-faulting the pool stopped at %d of %d bytes (madvise: %s)",
                               at, self.capacity, os.strerror(err))
                return
            self.prefaulted = at + n

    def expect_stores(self) -> None:
        """A KV cache was registered: STOREs are coming, so populate ahead now (``populate_ahead``)."""
        if self._ahead is not None:
            with self._lock:
                self._ahead.start()

    @property
    def populated(self) -> int:
        """Bytes from the pool's start that are populated (by ``prefault`` or ``populate_ahead``)
        or lie below the allocator's frontier."""
        return self._ahead.done if self._ahead is not None else self.prefaulted

    # ---- bytes --------------------------------------------------------------------------
    def view(self, obj: tuple) -> torch.Tensor:
        """The object's bytes, as a uint8 tensor over the pool (no copy)."""
        return self.tensor[obj[OFFSET]:obj[OFFSET] + obj[NBYTES]]

    def release(self) -> None:
        """Drop every object and unmap the pool (shutdown). Tensors handed out keep it mapped
        until they are gone."""
        self._prefault_stop.set()
        if self._prefaulter is not None:
            self._prefaulter.join()
        if self._ahead is not None:
            self._ahead.stop()
            self._ahead.thread.join()
        with self._lock:
            self._tenants.clear()
            self._leases.clear()
            self._session_leases.clear()
            self._expiry = []
            self._extents = _Extents(0)
            self.used = self.objects = self.in_flight = self.pinned = self.pinned_bytes = self.lease_pins = 0
            self._evictable = self._evictable_bytes = 0
            self.tensor = torch.empty(0, dtype=torch.uint8)
            self.bytes.view.release()
            self._buf = None

    # ---- the state of one object: ready (unpinned), pinned, in flight ------------------
    def _tenant(self, uid: int) -> _Tenant:
        t = self._tenants.get(uid)
        if t is None:
            t = self._tenants[uid] = _Tenant()
        return t

    def _forget_if_empty(self, uid: int, t: _Tenant) -> None:
        if t.empty() and self._tenants.get(uid) is t:
            del self._tenants[uid]

    def _make_ready(self, t: _Tenant, obj: tuple) -> None:
        """A new visible object, unpinned, at the LRU's recent end (commit)."""
        t.lru[obj[KEY]] = obj
        t.evictable += 1
        self._evictable += 1
        self._evictable_bytes += obj[COST]

    def _drop(self, t: _Tenant, obj: tuple) -> None:
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

    def _uncharge(self, t: _Tenant, obj: tuple, cost: int) -> None:
        self._extents.give(obj[OFFSET] - self.head_room, cost - OBJECT_COST)
        t.used -= cost
        self.used -= cost
        self._forget_if_empty(obj[UID], t)

    def _pin(self, t: _Tenant, obj: tuple) -> None:
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

    def _unpin(self, t: _Tenant, obj: tuple) -> None:
        """One pin fewer; after the last one, eviction may take the object again."""
        self._unpin_all(t, (obj,))

    def _unpin_all(self, t: _Tenant, objs: Iterable[tuple]) -> None:
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

    def _evict_one(self, requester: Optional[_Tenant] = None) -> bool:
        """Drop the least recently used unpinned object of the tenant that holds the most. With
        ``requester`` (a batch's tenant, whose earlier chunks are in flight, not yet evictable):
        nothing, if that tenant holds more than the one that would be evicted from."""
        biggest: Optional[_Tenant] = None
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
                        if self._ahead is not None:
                            self._ahead.advance(offset + cost - OBJECT_COST)
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
            lease = _Lease(token, uid, session, time.monotonic() + ttl_s, objs)
            self._leases[token] = lease
            self._session_leases.setdefault(session, set()).add(token)
            heapq.heappush(self._expiry, (lease.expires, token))
            t.leases += 1
            t.lease_pins += len(objs)
            self.lease_pins += len(objs)
            return hits, token

    def _capped(self, t: _Tenant, per_rank: list[list[tuple]], found: int, share: float) -> tuple[int, dict]:
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

    def _end_lease(self, lease: _Lease) -> None:
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

    def _drop_lease_pins(self, t: _Tenant, objs: list) -> None:
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
