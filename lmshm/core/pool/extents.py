"""Where an object's bytes go: the free extents of the pool's range, handed out best fit.

``take`` finds the smallest free extent that fits by bisecting the sorted distinct sizes;
``give`` merges a freed extent with its free neighbours, found by start and by end. Neither
walks the extents, so no request costs time in proportion to the pool. Offsets only: the
bytes are the arena's (``memory.py``), the objects the store's (``store.py``).

The one trap: disjoint extents have at most sqrt(2 * capacity / ALIGN) distinct sizes (8,192
for 2 GiB), which keeps the sorted list short however fragmented the pool is; callers must
hand out multiples of the alignment for that bound to hold.
"""

from __future__ import annotations

import bisect
from typing import Optional


class Extents:
    """The free extents of ``[0, size)``, indexed by start, by end and by size."""

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
