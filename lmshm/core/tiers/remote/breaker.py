"""A circuit breaker per group of calls: a remote that fails is skipped for a while, then probed.

``Breaker`` counts consecutive failures per group (one group for a standalone server, one per
256 hash slots in a cluster: ``slots.slot_group``). After ``BREAKER_FAILURES`` in a row the
group is skipped for a back-off (``BACKOFF_S``, doubling to ``MAX_BACKOFF_S``); then one call is
let through to probe it, and its success closes the breaker.

The one trap: while the probe is out, the others wait one more back-off rather than pile onto a
remote that may still be down; a caller must report every outcome it was allowed (``success``
or ``failure``), or the group stays half open.
"""

from __future__ import annotations

import threading
import time

BREAKER_FAILURES = 3
BACKOFF_S, MAX_BACKOFF_S = 1.0, 30.0


class Breaker:
    """Consecutive failures per group; after ``BREAKER_FAILURES`` the group is skipped for a
    back-off (doubling up to ``MAX_BACKOFF_S``), then one call probes it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failures: dict[int, int] = {}
        self._open_until: dict[int, float] = {}
        self._backoff: dict[int, float] = {}

    def allow(self, group: int) -> bool:
        with self._lock:
            until = self._open_until.get(group)
            if until is None:
                return True
            if time.monotonic() < until:
                return False
            # half open: let this call probe; others wait for its outcome for one more back-off
            self._open_until[group] = time.monotonic() + self._backoff[group]
            return True

    def success(self, group: int) -> None:
        with self._lock:
            self._failures.pop(group, None)
            self._open_until.pop(group, None)
            self._backoff.pop(group, None)

    def failure(self, group: int) -> bool:
        """Count one; True when this failure opened (or re-opened) the breaker."""
        with self._lock:
            n = self._failures.get(group, 0) + 1
            self._failures[group] = n
            if n < BREAKER_FAILURES:
                return False
            backoff = min(MAX_BACKOFF_S, self._backoff.get(group, BACKOFF_S / 2) * 2)
            self._backoff[group] = backoff
            self._open_until[group] = time.monotonic() + backoff
            return True

    def open_groups(self) -> int:
        now = time.monotonic()
        with self._lock:
            return sum(until > now for until in self._open_until.values())
