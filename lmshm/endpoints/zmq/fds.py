"""The ZeroMQ endpoint's file-descriptor budget: what it keeps free, and when it sheds.

Every connection, fd-channel link and pidfd costs a descriptor, and a server out of them can
neither map a registration nor accept the worker that would end the shortage. So
``FD_RESERVE`` stay free for the server's own work, ``LINK_ROOM`` more for the fd channel, and
ZeroMQ connections are accepted only above both; when few are free and connections wait,
those without a verified session are shed, oldest first (``mq.RouterServer.shed``).

The trap: counting open fds lists /proc/self/fd (about 0.8 ms at 1,000 fds), so the count is
cached for 50 ms (``FdCount``) and the reserve absorbs what such a count can miss.
"""

from __future__ import annotations

import os
import resource
import time

#: File descriptors kept free for the server's own work (mapping, logging, accepting); an
#: eighth of the open-file limit if that is less, as are LINK_ROOM and SHED_TO (SHED_BELOW: a 16th).
FD_RESERVE = 64
#: File descriptors a verified session costs: its ZeroMQ connection, fd-channel link, pidfd.
FDS_PER_SESSION = 3
#: ZeroMQ connections are accepted only while more than FD_RESERVE + LINK_ROOM fds are free:
#: the last LINK_ROOM above the reserve are the fd channel's (a verified session's link and pidfd).
#: Connections that have not authenticated yet (2 fds each) may hold at most half of it, so
#: --max-pending-auth is lowered to LINK_ROOM / 4 where the room is smaller than it needs.
LINK_ROOM = 256
#: When fewer than FD_RESERVE + LINK_ROOM + SHED_BELOW fds are free and a connection waits to be
#: accepted, connections without a verified session are closed, oldest first, until
#: FD_RESERVE + LINK_ROOM + SHED_TO would be free (``RouterServer.shed``).
SHED_BELOW, SHED_TO = 32, 96


def raise_fd_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit to its hard limit; return the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def open_fd_count(limit: int = 1 << 30) -> int:
    """Open fds of this process; ``limit`` when they cannot be counted (EMFILE: none is free)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # minus the one listdir itself holds
    except OSError:
        return limit


class FdCount:
    """``open_fd_count`` at most once per ``ttl_s``: listing /proc/self/fd costs ~0.8 ms at
    1,000 fds, and the loop asks on every HELLO and accept. The fd reserve absorbs what a
    count this old can miss."""

    def __init__(self, limit: int, ttl_s: float = 0.05) -> None:
        self.limit, self.ttl_s = limit, ttl_s
        self._value, self._at = 0, float("-inf")

    def __call__(self) -> int:
        now = time.monotonic()
        if now - self._at > self.ttl_s:
            self._value, self._at = open_fd_count(self.limit), now
        return self._value

    def opened(self, n: int) -> None:
        """``n`` fds were opened since the last count (accepts): count them until the next one."""
        self._value += n


class FdBudget:
    """The budget for an open-file ``limit``: the reserve, the fd channel's room and the
    shedding marks, each scaled down for a small limit (an eighth of it; SHED_BELOW a 16th)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = FdCount(limit)
        self.reserve = min(FD_RESERVE, limit // 8)
        self.link_room = min(LINK_ROOM, limit // 8)
        self.shed_below = self.reserve + self.link_room + min(SHED_BELOW, limit // 16)
        self.shed_to = self.reserve + self.link_room + min(SHED_TO, limit // 8)

    def max_sessions(self, wanted: int) -> int:
        """At most ``wanted`` sessions, and no more than the fds above the reserve can hold."""
        return min(wanted, max(1, (self.limit - self.reserve) // FDS_PER_SESSION))

    def available(self, opening: int = 0) -> bool:
        """Whether ``opening`` more fds (a new fd-channel connection: 2) leave the reserve free."""
        if self.count() + self.reserve + opening >= self.limit:
            return False
        self.count.opened(opening)
        return True
