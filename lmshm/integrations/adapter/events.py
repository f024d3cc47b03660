"""``EventFeed``: what lmshm-server can serve, as KV events for the engine's own event stream.

It reads the server's KV events for this engine's namespace (``KV_EVENTS``) without ever
blocking the engine, and remembers which blocks it advertised, so that it can take them back.
Used by the scheduler side of a connector; vLLM's ``take_events`` republishes what it returns.

The trap: never republish ``AllBlocksCleared``. On an engine's stream it would clear the
engine's own GPU blocks from a router's view; when the feed loses track (a new server, dropped
events) it sends ``BlockRemoved`` for what it advertised instead (see the class docstring).
"""

from __future__ import annotations

import logging
import time
from typing import Optional, Sequence, Union

from lmshm.core.kv_events import BlockRemoved, BlockStored
from lmshm.integrations.adapter.link import Link
from lmshm.transport.client import Pending
from lmshm.wire import protocol

logger = logging.getLogger("lmshm.connector")

#: What a feed passes on: ``AllBlocksCleared`` never (see ``EventFeed``).
Event = Union[BlockStored, BlockRemoved]


class EventFeed:
    """Reads the server's KV events for this engine's namespace (``KV_EVENTS``) without ever
    blocking the engine: ``take()`` returns what arrived since the last call and sends the next
    read, at most one in flight, at most every ``every_s``.

    Every engine of the same uid and namespace gets every event, so a chunk one engine stored
    is advertised on the stream of every engine that can load it, and its removal too. When the
    server restarted (a new epoch) or its log dropped events this feed had not read, the feed
    cannot know what is still there: it sends ``BlockRemoved`` for every block it advertised
    (per medium, locality and group) and starts over. It never sends ``AllBlocksCleared``: on
    an engine's stream that would clear the engine's own GPU blocks from a router's view."""

    MAX_TRACKED = 1 << 20     # advertised hashes remembered for those removals

    def __init__(self, link: Link, spaces: Sequence[bytes], *, every_s: float = 0.05, limit: int = 1024) -> None:
        self.link = link
        self.spaces = list(spaces)
        self.every_s = every_s
        self.limit = limit
        self.cursor = -1
        self.epoch = ""
        self._pending: Optional[Pending] = None
        self._next_at = 0.0
        self._advertised: dict[tuple, set] = {}
        self._tracked = 0
        self.received = self.resets = 0

    def take(self) -> list[Event]:
        out: list[Event] = []
        p = self._pending
        if p is not None and p.done():
            self._pending = None
            try:
                reply = p.result()
            except Exception as exc:
                logger.debug("lmshm: KV_EVENTS failed: %s", exc)
                self._next_at = time.monotonic() + max(1.0, self.link.config.retry_s)
                reply = None
            if reply is not None:
                out = self._apply(reply)
        if self._pending is None and time.monotonic() >= self._next_at:
            self._next_at = time.monotonic() + self.every_s
            client = self.link.client()
            if client is not None:
                try:
                    self._pending = client.submit(protocol.KvEvents(self.spaces, self.cursor, self.limit),
                                                  self.link.config.lookup_timeout_s)
                except Exception as exc:
                    logger.debug("lmshm: sending KV_EVENTS failed: %s", exc)
        return out

    def _apply(self, reply: protocol.KvEventsReply) -> list[Event]:
        out: list[Event] = []
        if not self.epoch and self.cursor == -1:
            self.epoch = reply.epoch        # the first read: from the start of this server's log
        if reply.epoch != self.epoch:
            # a new server: what the old one advertised is gone; this reply read the new log
            # from the old cursor, so read it again from its start
            if self.epoch:
                out.extend(self.forget_all())
                self.resets += 1
            self.epoch, self.cursor = reply.epoch, -1
            self._next_at = 0.0
            return out
        if reply.lost:     # events this feed never saw were dropped: removals may be among them
            out.extend(self.forget_all())
            self.resets += 1
        self.cursor = reply.cursor
        for event in reply.events:
            kind = type(event).__name__
            where = (getattr(event, "medium", None), getattr(event, "locality", None),
                     getattr(event, "group_idx", None))
            if kind == "BlockStored":
                seen = self._advertised.setdefault(where, set())
                for h in event.block_hashes:
                    if h not in seen and self._tracked < self.MAX_TRACKED:
                        seen.add(h)
                        self._tracked += 1
            elif kind == "BlockRemoved":
                seen = self._advertised.get(where, set())
                for h in event.block_hashes:
                    if h in seen:
                        seen.discard(h)
                        self._tracked -= 1
            else:
                continue      # AllBlocksCleared is never republished (see the class docstring)
            out.append(event)
        self.received += len(out)
        return out

    def forget_all(self) -> list[Event]:
        """``BlockRemoved`` for every block advertised so far (and forget them)."""
        out = [BlockRemoved(block_hashes=sorted(hashes, key=repr), medium=medium, group_idx=group, locality=locality)
               for (medium, locality, group), hashes in self._advertised.items() if hashes]
        self._advertised.clear()
        self._tracked = 0
        return out
