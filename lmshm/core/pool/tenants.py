"""The store's bookkeeping per tenant (uid) and per lease, touched only under the pool's lock.

A ``Tenant`` holds one uid's objects: the visible ones in LRU order (or set aside while
pinned), the ones in flight, its pins and what they cost. A ``Lease`` holds a LOOKUP's pins,
one per distinct object. Both hold records (``records.py``), never copies of them: a record is
the same tuple in every place it is listed, and the store compares them by identity.

The one trap: a pin does not take an object out of the LRU (see ``Tenant``), so whoever walks
the LRU for a victim must skip pinned objects and set them aside, as ``Pool._evict_one`` does.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Optional


class Tenant:
    """One uid's objects and what it holds pinned.

    A visible object is in ``lru`` (least recently used first), or in ``aside`` once eviction
    met it pinned at the LRU's head; from there it returns to the LRU's recent end when its
    last pin ends. A pin is a count in ``pins_of`` plus a move to the LRU's recent end (the
    object was just used); it does not take the object out of the LRU: a LOOKUP pins every
    object it finds, and moving each out of the OrderedDict and back would cost more than the
    rest of the request. So eviction skips pinned objects lazily, each at most once per pin,
    and ``evictable`` counts the unpinned ones. In flight: ``flight``."""

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


class Lease:
    """A LOOKUP's pins: one per distinct object, held until RELEASE, a RETRIEVE takes them
    over, the TTL ends (``expires``, monotonic) or the session ends."""

    __slots__ = ("token", "uid", "session", "expires", "objects")

    def __init__(self, token: bytes, uid: int, session: Hashable, expires: float, objects: list) -> None:
        self.token, self.uid, self.session, self.expires = token, uid, session, expires
        self.objects = objects    # distinct objects, one pin each
