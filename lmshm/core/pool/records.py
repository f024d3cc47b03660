"""What the pool keeps per object, and what an object costs.

An object is one chunk: whole blocks of one registration, every layer, packed in registration
order. Its record is the tuple ``(offset, nbytes, layout, blocks, uid, key, cost)``, indexed by
``OFFSET`` ... ``COST``. It is charged ``cost_of(nbytes)``: its extent (its bytes and the pool's
``head_room``, rounded up to its alignment) plus ``OBJECT_COST`` bytes of bookkeeping, so the
pool's whole cost in server memory stays within its capacity. The store (``store.py``) owns
every record and hands them out; nobody else changes one.

The one trap: a record is a plain tuple of atomic values, not a class instance. Python's
cyclic GC stops tracking such tuples, so a million objects add nothing to a collection; a
million instances stall every request during each full collection (docs/design/dataplane.md).
"""

from __future__ import annotations

ALIGN = 64  # bytes; every object starts on a cache line
#: Bytes of server memory one object's bookkeeping takes, charged against the capacity on top of
#: its extent: its record, key and LRU entry, and the free extent beside it in the worst case
#: (measured with tracemalloc in tests/v1/core/test_pool_limits.py; docs/design/dataplane.md).
OBJECT_COST = 640
#: The record of an object: ``(offset, nbytes, layout, blocks, uid, key, cost)``, indexed by these.
OFFSET, NBYTES, LAYOUT, BLOCKS, UID, KEY, COST = range(7)


def cost_of(nbytes: int, head_room: int = 0, align: int = ALIGN) -> int:
    """What an object of ``nbytes`` is charged against the capacity (in a pool with ``head_room``
    and objects aligned to ``align``)."""
    return -(-(nbytes + head_room) // align) * align + OBJECT_COST


class Reservation:
    """``reserve``'s answer for one chunk."""

    STORED, PRESENT, NO_SPACE = 0, 1, 2
