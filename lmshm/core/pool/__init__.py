"""The server's memory pool: KV chunks stored as objects in one anonymous mapping.

Two rooms: ``memory.py`` owns the mapping (huge pages, prefault, populate-ahead: which pages
exist); ``store.py`` owns the objects (tenants, LRU, pins, leases, accounting: what lives in
them), with ``extents.py`` (where an object's bytes go), ``records.py`` (what an object is
and costs) and ``tenants.py`` (a uid's objects and pins, a lease). ``Pool`` is the one entry point: it makes
its ``Arena`` and takes one lock for every change of its objects.

The one trap: an object's record is a tuple indexed by ``OFFSET`` ... ``COST``, not a class;
read it with those names. docs/design/dataplane.md has the mechanism and its figures.
"""

from lmshm.core.pool.memory import Arena, PoolBytes, parse_size
from lmshm.core.pool.records import (
    ALIGN,
    BLOCKS,
    COST,
    KEY,
    LAYOUT,
    NBYTES,
    OBJECT_COST,
    OFFSET,
    UID,
    Reservation,
    cost_of,
)
from lmshm.core.pool.store import Pool

__all__ = ["ALIGN", "BLOCKS", "COST", "KEY", "LAYOUT", "NBYTES", "OBJECT_COST", "OFFSET", "UID", "Arena", "Pool", "PoolBytes",
           "Reservation", "cost_of", "parse_size"]
