"""The streams that copy to or from mapped device memory, and waiting for them before an unmap.

``cuMemUnmap`` and ``cuIpcCloseMemHandle`` do not wait for copies still queued on a stream, and
a device-wide ``cuCtxSynchronize`` would let one hung worker's stream stall every tenant's
unmap. So whoever queues copies on mapped memory (the data plane, per session) calls
``register(stream, ordinal)`` once it made the stream and ``unregister`` before destroying it;
a wrapper's last release calls ``quiesce(ordinal)``, which records an event on every stream
registered for that device and polls them until all completed or ``timeout_s`` passed.

When ``quiesce`` returns False the caller does not unmap: ``leak_mapping`` logs an error and
counts it in ``LEAKED_MAPPINGS`` (the memory stays pinned until this process exits; freeing it
under DMA would corrupt whatever reuses it). The registry is process-wide and thread-safe. The
trap: a stream registered twice must be unregistered twice, and a stream destroyed without
``unregister`` can never be proven idle, so every later unmap on its device is leaked instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Hashable

from lmshm.platform.cuda.driver import get_driver

logger = logging.getLogger(__name__)

# Re-entrant: a finaliser (a dropped lease unmapping) may run quiesce() on a thread that is
# inside register() or unregister().
_lock = threading.RLock()
_streams: dict[int, Counter[tuple[int, Hashable]]] = {}   # ordinal -> (stream handle, scope) -> registrations

#: Mappings this process left mapped because a copy stream did not drain in time.
LEAKED_MAPPINGS = 0

_POLL_FIRST_S = 0.0005
_POLL_MAX_S = 0.02


def register(stream_handle: int, ordinal: int, scope: Hashable = None) -> None:
    """Note that ``stream_handle`` (on device ``ordinal``) may copy to or from mapped memory of
    ``scope`` (a session: its copies touch only that session's mappings; None: any mapping)."""
    with _lock:
        _streams.setdefault(ordinal, Counter())[(int(stream_handle), scope)] += 1


def unregister(stream_handle: int, ordinal: int, scope: Hashable = None) -> None:
    """Undo one ``register``; unknown streams are ignored (teardown paths call this)."""
    key = (int(stream_handle), scope)
    with _lock:
        per = _streams.get(ordinal)
        if per is None or per[key] <= 0:
            return
        per[key] -= 1
        if per[key] <= 0:
            del per[key]
        if not per:
            del _streams[ordinal]


def registered(ordinal: int, scope: Hashable = None) -> list[int]:
    """The streams registered for device ``ordinal`` now that can touch ``scope``'s mappings
    (every one with ``scope`` None), a snapshot."""
    with _lock:
        return sorted({h for h, sc in _streams.get(ordinal, ()) if scope is None or sc is None or sc == scope})


def quiesce(ordinal: int, timeout_s: float = 10.0, scope: Hashable = None) -> bool:
    """True once every stream registered for ``ordinal`` that can touch ``scope``'s mappings
    (all of them with ``scope`` None) finished the work queued on it before this call; False if
    one did not within ``timeout_s`` (or its state could not be read). Scoped, one tenant's
    hung stream never delays another tenant's unmap."""
    drv = get_driver()
    events: list[int] = []
    try:
        with _lock:
            streams = registered(ordinal, scope)
            if not streams:
                return True
            for stream in streams:
                ev = drv.event_create(ordinal)
                events.append(ev)
                drv.event_record(ev, stream, ordinal)
        deadline = time.monotonic() + timeout_s
        pause = _POLL_FIRST_S
        pending = list(events)
        while True:
            pending = [ev for ev in pending if not drv.event_query(ev, ordinal)]
            if not pending:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                logger.error("lmshm: %d of %d copy stream(s) on cuda:%d still busy after %.1f s",
                             len(pending), len(events), ordinal, timeout_s)
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, _POLL_MAX_S)
    except Exception:
        logger.exception("lmshm: cannot tell whether the copy streams on cuda:%d are idle", ordinal)
        return False
    finally:
        for ev in events:
            try:
                drv.event_destroy(ev, ordinal)
            except Exception:
                logger.exception("lmshm: destroying a quiesce event failed")


def leak_mapping(what: str) -> None:
    """Leave ``what`` mapped (a copy stream may still use it): log it and count it."""
    global LEAKED_MAPPINGS
    with _lock:
        LEAKED_MAPPINGS += 1
        total = LEAKED_MAPPINGS
    logger.error("lmshm: not unmapping %s: a copy stream on its device did not drain; the mapping "
                 "is leaked until this process exits (%d leaked so far)", what, total)
