"""Process-wide, reference-counted table of mapped memory: ``MAPPINGS``, lmshm's one refcount.

Every consumer-side mapping (a named POSIX segment, a memfd, a CUDA IPC allocation, a VMM
import) is opened through ``MAPPINGS.acquire(key, opener, closer)``. The first acquire of a key
runs ``opener``; later ones share the mapping and bump a count. Each returns a ``Lease``;
releasing the last lease runs ``closer`` exactly once, and its errors are logged, never raised
(release runs on teardown paths). Tensors built on a mapping hold a lease of their own
(``Lease.child``), so the unmap happens when the last tensor goes, not when a wrapper closes.

The trap: the CUDA driver hands out one mapping per (process, allocation), and one
``cudaIpcCloseMemHandle`` unmaps it for every user in the process. So two wrappers of one
allocation must never open and close on their own; they share one entry here, keyed by the
handle bytes. Registry and wrappers keep no counts of their own.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

logger = logging.getLogger(__name__)


@dataclass
class _Entry:
    value: Any
    closer: Callable[[Any], None]
    refs: int = 0
    opens: int = 1
    meta: dict = field(default_factory=dict)


class Lease:
    """One share of a mapping. ``release()`` is idempotent; dropping it releases too."""

    __slots__ = ("_table", "key", "value", "_released", "__weakref__")

    def __init__(self, table: "MappingTable", key: Hashable, value: Any) -> None:
        self._table = table
        self.key = key
        self.value = value
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def child(self) -> "Lease":
        """Another lease on the same mapping, for an object (a tensor) that outlives this one."""
        if self._released:
            raise RuntimeError(f"lease on {self.key!r} was already released")
        return self._table._add_ref(self.key)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._table._drop_ref(self.key)

    def __del__(self) -> None:  # safety net: a lease garbage-collected unreleased
        try:
            self.release()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"Lease({self.key!r}, {state})"


class MappingTable:
    """Key -> mapped object, with reference counts. One instance per process: ``MAPPINGS``."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._entries: dict[Hashable, _Entry] = {}
        self._opens_total = 0

    def acquire(
        self,
        key: Hashable,
        opener: Callable[[], Any],
        closer: Callable[[Any], None],
    ) -> Lease:
        """Return a lease on ``key``, running ``opener()`` if nothing maps it yet.

        ``opener`` runs under the table lock, so a key is never opened twice concurrently.
        If it raises, nothing is recorded and the exception propagates.
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                value = opener()
                entry = _Entry(value=value, closer=closer)
                self._entries[key] = entry
                self._opens_total += 1
            entry.refs += 1
            return Lease(self, key, entry.value)

    def _add_ref(self, key: Hashable) -> Lease:
        with self._lock:
            entry = self._entries[key]
            entry.refs += 1
            return Lease(self, key, entry.value)

    def _drop_ref(self, key: Hashable) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            entry.refs -= 1
            if entry.refs > 0:
                return
            del self._entries[key]
        try:
            entry.closer(entry.value)
        except Exception:
            logger.exception("lmshm: releasing mapping %r failed", key)

    def refcount(self, key: Hashable) -> int:
        with self._lock:
            entry = self._entries.get(key)
            return 0 if entry is None else entry.refs

    def keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._entries)

    @property
    def opens_total(self) -> int:
        """How many times an opener ran in this process (driver opens, mmaps)."""
        return self._opens_total

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


MAPPINGS = MappingTable()
