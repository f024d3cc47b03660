"""The server's memory pool: objects (stored chunks), their LRU order, pins and leases.

One anonymous mapping of ``capacity`` bytes, made once and touched lazily (``MAP_NORESERVE``:
pages cost memory only once an object is copied into them). An object is one chunk: whole
blocks of one registration, every layer, packed in registration order. Space is handed out by
a first-fit allocator over free extents, with neighbours merged on free.

Life of an object:
- ``reserve`` makes it *in flight*: it owns its bytes but LOOKUP does not see it;
- ``commit`` after the copy has completed makes it *ready* (visible); ``abort`` frees it.
So an object is visible all or nothing.

Pins keep a ready object from eviction: a lease (LOOKUP) holds one pin per object, a RETRIEVE
holds one while it copies. Eviction takes ready, unpinned objects in LRU order (LOOKUP and
RETRIEVE refresh an object) and is counted. When nothing can be evicted, ``reserve`` says so
and the STORE skips that chunk.

Objects belong to the uid that stored them: LOOKUP and RETRIEVE from another uid do not see
them. Every method takes the pool's one lock; no copy runs under it.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import secrets
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable, Optional

import torch

from lmshm.core.copier import PoolBytes

ALIGN = 64  # bytes; every object starts on a cache line

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)


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


@dataclass(eq=False)
class PoolObject:
    uid: int
    key: bytes
    offset: int
    nbytes: int
    layout: bytes             # the digest of the layout its bytes were packed from
    blocks: int               # blocks per layer (the chunk size)
    ready: bool = False
    pins: int = 0
    stored_at: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class LeaseRecord:
    token: bytes
    uid: int
    session: Hashable
    expires: float
    objects: list[PoolObject]   # one pin each


class Reservation:
    """``reserve``'s answer for one chunk."""

    STORED, PRESENT, NO_SPACE = 0, 1, 2


class Pool:
    """See the module docstring. ``capacity`` 0 makes a pool that stores nothing."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._objects: OrderedDict[tuple[int, bytes], PoolObject] = OrderedDict()  # LRU first
        self._leases: dict[bytes, LeaseRecord] = {}
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity else []  # sorted (offset, size)
        self.used = 0
        self.in_flight = 0
        self.hits = self.misses = self.stored = self.store_skipped = 0
        self.evictions = self.evicted_bytes = self.retrieved = self.failed = 0
        self._addr = 0
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
        self.bytes = PoolBytes(memoryview(self._buf).cast("B") if capacity else memoryview(b""), self._addr)

    # ---- bytes --------------------------------------------------------------------------
    def view(self, obj: PoolObject) -> torch.Tensor:
        """The object's bytes, as a uint8 tensor over the pool (no copy)."""
        return self.tensor[obj.offset:obj.offset + obj.nbytes]

    def _alloc_locked(self, size: int) -> Optional[int]:
        size = -(-size // ALIGN) * ALIGN
        for i, (off, n) in enumerate(self._free):
            if n >= size:
                if n == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, n - size)
                return off
        return None

    def _free_locked(self, offset: int, size: int) -> None:
        size = -(-size // ALIGN) * ALIGN
        i = bisect.bisect_left(self._free, (offset, 0))
        if i < len(self._free) and self._free[i][0] == offset + size:  # merge with the next extent
            size += self._free[i][1]
            del self._free[i]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # and the previous one
            offset, size = self._free[i - 1][0], self._free[i - 1][1] + size
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (offset, size))

    def _drop_locked(self, obj: PoolObject) -> None:
        del self._objects[(obj.uid, obj.key)]
        self._free_locked(obj.offset, obj.nbytes)
        self.used -= obj.nbytes

    def release(self) -> None:
        """Drop every object and unmap the pool (shutdown). Tensors handed out keep it mapped
        until they are gone."""
        with self._lock:
            self._objects.clear()
            self._leases.clear()
            self._free = []
            self.used = self.in_flight = 0
            self.tensor = torch.empty(0, dtype=torch.uint8)
            self.bytes.view.release()
            self._buf = None

    # ---- store --------------------------------------------------------------------------
    def reserve(self, uid: int, key: bytes, nbytes: int, layout: bytes, blocks: int) -> tuple[int, Optional[PoolObject]]:
        """Room for one chunk: ``(Reservation.STORED, object in flight)``, or ``(PRESENT, None)``
        if the key is stored or in flight, or ``(NO_SPACE, None)`` if nothing can be evicted."""
        with self._lock:
            existing = self._objects.get((uid, key))
            if existing is not None and existing.layout == layout:
                return Reservation.PRESENT, None
            if existing is not None:
                # Same key, other layout: keys carry the layout, so this is a hash collision or a
                # confused engine. The newer bytes win, unless the old object is busy.
                if existing.pins or not existing.ready:
                    self.store_skipped += 1
                    return Reservation.NO_SPACE, None
                self._drop_locked(existing)
            if nbytes <= 0 or nbytes > self.capacity:
                self.store_skipped += 1
                return Reservation.NO_SPACE, None
            offset = self._alloc_locked(nbytes)
            if offset is None:
                for victim in [o for o in self._objects.values() if o.ready and not o.pins]:
                    self._drop_locked(victim)
                    self.evictions += 1
                    self.evicted_bytes += victim.nbytes
                    offset = self._alloc_locked(nbytes)
                    if offset is not None:
                        break
            if offset is None:
                self.store_skipped += 1
                return Reservation.NO_SPACE, None
            obj = PoolObject(uid, key, offset, nbytes, layout, blocks)
            self._objects[(uid, key)] = obj
            self.used += nbytes
            self.in_flight += 1
            return Reservation.STORED, obj

    def commit(self, objs: Iterable[PoolObject]) -> None:
        with self._lock:
            for obj in objs:
                obj.ready = True
                obj.stored_at = time.monotonic()
                self.in_flight -= 1
                self.stored += 1

    def abort(self, objs: Iterable[PoolObject]) -> None:
        with self._lock:
            for obj in objs:
                self.in_flight -= 1
                if self._objects.get((obj.uid, obj.key)) is obj:
                    self._drop_locked(obj)

    # ---- lookup and leases --------------------------------------------------------------
    def lookup(self, uid: int, keys: list[list[bytes]], session: Hashable, ttl_s: float) -> tuple[int, bytes]:
        """Leading chunks that every rank has; pins them all under a new lease (b"" if none)."""
        with self._lock:
            n = min(len(k) for k in keys)
            hits = n
            for rank_keys in keys:
                for i in range(min(n, hits)):
                    obj = self._objects.get((uid, rank_keys[i]))
                    if obj is None or not obj.ready:
                        hits = i
                        break
            self.hits += hits
            self.misses += 1 if hits < n else 0
            if hits == 0:
                return 0, b""
            pinned = []
            for rank_keys in keys:
                for key in rank_keys[:hits]:
                    obj = self._objects[(uid, key)]
                    obj.pins += 1
                    self._objects.move_to_end((uid, key))
                    pinned.append(obj)
            token = secrets.token_bytes(16)
            self._leases[token] = LeaseRecord(token, uid, session, time.monotonic() + ttl_s, pinned)
            return hits, token

    def _end_lease_locked(self, lease: LeaseRecord) -> None:
        del self._leases[lease.token]
        for obj in lease.objects:
            obj.pins -= 1

    def release_lease(self, token: bytes, uid: int) -> bool:
        """End a lease of ``uid`` (another uid's token counts as unknown)."""
        with self._lock:
            lease = self._leases.get(token)
            if lease is None or lease.uid != uid:
                return False
            self._end_lease_locked(lease)
            return True

    def expire(self, now: Optional[float] = None) -> int:
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [lease for lease in self._leases.values() if lease.expires <= now]
            for lease in old:
                self._end_lease_locked(lease)
            return len(old)

    def release_session(self, session: Hashable) -> int:
        """End every lease of a session that ended."""
        with self._lock:
            mine = [lease for lease in self._leases.values() if lease.session == session]
            for lease in mine:
                self._end_lease_locked(lease)
            return len(mine)

    def leases_of(self, session: Hashable) -> int:
        with self._lock:
            return sum(1 for lease in self._leases.values() if lease.session == session)

    # ---- retrieve -----------------------------------------------------------------------
    def pin_for_copy(self, uid: int, keys: list[bytes], lease: bytes = b"") -> tuple[list[PoolObject], Optional[str]]:
        """Pin the ready objects of ``keys`` for a copy out of them; ``(objects, None)``, or
        ``([], why)`` if one is missing. ``lease``'s pins of these keys end here either way."""
        with self._lock:
            record = self._leases.get(lease) if lease else None
            if record is not None and record.uid == uid:
                wanted = {(uid, k) for k in keys}
                keep = []
                for obj in record.objects:
                    if (obj.uid, obj.key) in wanted:
                        obj.pins -= 1  # the copy takes its own pin below
                        wanted.discard((obj.uid, obj.key))
                    else:
                        keep.append(obj)
                record.objects = keep
                if not keep:
                    del self._leases[lease]
            objs = []
            for i, key in enumerate(keys):
                obj = self._objects.get((uid, key))
                if obj is None or not obj.ready:
                    for o in objs:
                        o.pins -= 1
                    return [], f"chunk {i} is not stored (evicted, or never stored)"
                obj.pins += 1
                self._objects.move_to_end((uid, key))
                objs.append(obj)
            return objs, None

    def unpin(self, objs: Iterable[PoolObject], *, retrieved: bool) -> None:
        with self._lock:
            n = 0
            for obj in objs:
                obj.pins -= 1
                n += 1
            if retrieved:
                self.retrieved += n

    def count_failure(self) -> None:
        with self._lock:
            self.failed += 1

    # ---- introspection ------------------------------------------------------------------
    def info(self) -> dict[str, int]:
        with self._lock:
            return dict(capacity=self.capacity, used=self.used, objects=len(self._objects) - self.in_flight,
                        in_flight=self.in_flight, pinned=sum(1 for o in self._objects.values() if o.pins),
                        leases=len(self._leases), hits=self.hits, misses=self.misses, stored=self.stored,
                        store_skipped=self.store_skipped, evictions=self.evictions,
                        evicted_bytes=self.evicted_bytes, retrieved=self.retrieved, failed=self.failed)
