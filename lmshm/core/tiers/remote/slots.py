"""Cluster slot routing: which node serves a key (``key_slot``, ``SlotMap``).

A Valkey/Redis cluster splits keys over 16384 hash slots: CRC16 (XMODEM) of the key, or of its
``{hash tag}``. ``SlotMap`` holds the map slot -> primary, read by ``CLUSTER SLOTS`` from the
first node that answers (seeds first, then the nodes it knows), at most every
``SLOTS_REFRESH_S`` and by one thread at a time; a ``MOVED`` or ``ASK`` reply notes the slot's
new node at once and has the map read again. Until a map is read, every key goes to the first
seed, which redirects. ``slot_group`` gives the breaker's group of a key (one per 256 slots).

Who owns what: the map is this module's; asking a node is the caller's (``ask`` returns the
parsed map, or None when that node did not answer), so no connection lives here.

The one trap: other threads read the map while it changes, so it is replaced whole, never
updated in place.
"""

from __future__ import annotations

import binascii
import threading
import time
from typing import Callable, Optional, Sequence

SLOTS = 16384
SLOT_GROUPS = 64            # cluster breakers: one per 256 slots
SLOTS_REFRESH_S = 1.0       # a cluster's slot map is re-read at most this often

Node = tuple[str, int]


def key_slot(key: bytes) -> int:
    """The cluster hash slot of ``key``: CRC16 (XMODEM) of the key, or of its ``{hash tag}``."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1:end]
    return binascii.crc_hqx(key, 0) % SLOTS


def slot_group(key: bytes) -> int:
    """The breaker group of ``key`` in a cluster: its slot's 256-slot range."""
    return key_slot(key) * SLOT_GROUPS // SLOTS


class SlotMap:
    """The slot -> node map of a cluster seeded by ``seeds``; ``ask(node)`` reads ``CLUSTER SLOTS``
    there (a map, slots to ``(host, port)``, a host "" meaning the node asked) or None."""

    def __init__(self, seeds: Sequence[Node], ask: Callable[[Node], Optional[dict[int, Node]]]) -> None:
        self.seeds = tuple(seeds)
        self._ask = ask
        self.by_slot: Optional[dict[int, Node]] = None      # None until read; replaced whole
        self.read_at = 0.0
        self._lock = threading.Lock()

    def node(self, key: bytes) -> Node:
        """The primary that serves ``key``'s slot (the map read on first use; a seed until then)."""
        if self.by_slot is None:
            self.load()
        return (self.by_slot or {}).get(key_slot(key), self.seeds[0])

    def load(self) -> None:
        """Read the map from the first node that answers; at most one thread at a time, and at
        most every ``SLOTS_REFRESH_S`` (others go on with the map they have)."""
        if time.monotonic() - self.read_at < SLOTS_REFRESH_S or not self._lock.acquire(blocking=False):
            return
        try:
            self.read_at = time.monotonic()
            known = list(dict.fromkeys(list(self.seeds) + sorted(set((self.by_slot or {}).values()))))
            for node in known:
                slots = self._ask(node)
                if slots is None:
                    continue
                self.by_slot = {s: (h or node[0], p) for s, (h, p) in slots.items()}
                return
        finally:
            self._lock.release()

    def moved(self, moved: tuple[int, str, int], asked: Node) -> Node:
        """Where a ``MOVED`` or ``ASK`` says a slot is (``asked``: the node that said it): noted in
        the map, which is read again."""
        slot, host, port = moved
        node = (host or asked[0], port)
        by_slot = dict(self.by_slot or {})
        by_slot[slot] = node
        self.by_slot = by_slot
        self.load()
        return node
