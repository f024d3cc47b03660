"""The HTTP endpoint's connections: its fd budget, their deadlines, and who gives way at the cap.

Guarantees: at most ``--http-max-connections`` connections are open, plus ``CLOSING_MAX`` closed
by this side whose fd the loop has not let go yet. At the cap a new connection makes the oldest
one *without a request in progress* close (idle, or still sending its request), once that one
has waited ``GIVE_WAY_AFTER_S``; until then new connections wait in the kernel's backlog, first
come first served, so a flood that keeps reopening connections cannot displace an honest client
before its request is read. A connection with no request closes after ``--http-idle-timeout``;
a request's headers and body must arrive within ``--http-request-timeout`` of its first byte.

Ownership: ``Connections`` accepts on its own listening sockets and owns every ``Conn``; each
``Conn`` wraps aiohttp's protocol for one connection. Both run on the endpoint's event loop
only, so they take no lock. The trap: aiohttp writes a response *after* the middleware returns,
so a connection is "in progress" only while its handler runs; a client that does not read its
answer is idle, and gives way like any other.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections import OrderedDict
from typing import Any, Callable, Optional

from aiohttp import web

logger = logging.getLogger("lmshm.http")

#: How often deadlines are checked (seconds): a deadline may be overrun by this much.
SWEEP_S = 0.25
#: The kernel's queue of connections not accepted yet (they hold no fd of ours); as deep as
#: net.core.somaxconn allows, so that under a flood a client waits its turn there instead of
#: losing its SYN (TCP tries again only after 1, 3, 7 ... s).
BACKLOG = 4096
#: Connections accepted per turn of the loop, and connections closed by the endpoint that may
#: still hold their fd (they close on the loop's next turn): the fd budget is the cap plus this.
ACCEPT_BURST = CLOSING_MAX = 32
#: A connection without a request in progress gives way to a new one only after waiting this
#: long (see the module docstring): first come, first served.
GIVE_WAY_AFTER_S = 0.25


class Connections:
    """The endpoint's listening socket and connections: the cap, the deadlines, who gives way.

    Each connection is *idle* (new, or kept alive after an answer), *reading* (a request's
    bytes are arriving), or *in progress* (its handler runs). Idle and reading connections wait
    in ``_waiting``, oldest first (by when they entered that state); those in progress are in
    ``_busy``. At the cap, a new connection makes the first waiting one close; if none waits, the
    new one is closed. ``sweep_forever`` closes waiting connections past their deadline. Each
    connection's protocol wraps aiohttp's (``factory``). All of it runs on the endpoint's event
    loop only, so it needs no lock."""

    def __init__(self, factory: Callable[[], Any], limit: int, idle_s: float, request_s: float,
                 loop: asyncio.AbstractEventLoop) -> None:
        self._factory, self.limit = factory, limit
        self.idle_s, self.request_s = idle_s, request_s
        self._loop = loop
        self._waiting: "OrderedDict[Conn, None]" = OrderedDict()
        self._busy: set[Conn] = set()
        self._by_handler: dict[Any, Conn] = {}
        self.closed = {"evicted": 0, "idle": 0, "slow": 0, "refused": 0}
        self._listeners: list[socket.socket] = []
        self._paused = True                 # not accepting (until listen())
        self._closing = 0   # connections closed by this side whose fd is not released yet

    def __len__(self) -> int:
        return len(self._waiting) + len(self._busy)

    # ---- accepting: our own loop, so that the fds stay within the budget ----------------------
    def listen(self, host: str, port: int) -> int:
        """Bind and listen on ``host:port`` (every address ``host`` resolves to, as asyncio's
        ``create_server`` does); returns the port."""
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        try:
            for family, kind, proto, _, address in dict.fromkeys(infos):
                sock = socket.socket(family, kind, proto)
                self._listeners.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
                sock.listen(BACKLOG)
                sock.setblocking(False)
        except BaseException:
            self.close_listener()
            raise
        self._resume_all()
        return self._listeners[0].getsockname()[1]

    def close_listener(self) -> None:
        if not self._paused:
            for sock in self._listeners:
                if sock.fileno() >= 0:
                    self._loop.remove_reader(sock.fileno())
        self._paused = True
        for sock in self._listeners:
            sock.close()
        self._listeners = []

    def _accept(self, listener: socket.socket) -> None:
        """Accept what is pending, a burst at a time. Connections made to give way close on the
        loop's next turn; while ``CLOSING_MAX`` of them have not, accepting waits, so the fds
        never exceed the cap by more than that."""
        for _ in range(ACCEPT_BURST):
            if self._closing >= CLOSING_MAX:
                self._pause()
                return
            wait_s = self.room_in()
            if wait_s > 0:   # the cap is full and nobody may give way yet: the backlog waits
                self._pause(wait_s)
                return
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    logger.warning("lmshm: the HTTP endpoint cannot accept (%s); trying again in a second",
                                   exc.strerror)
                    self._pause(1.0)
                return
            conn = self.admit()
            if conn is None:
                sock.close()
                continue
            self._loop.create_task(self._adopt(sock, conn))

    async def _adopt(self, sock: socket.socket, conn: "Conn") -> None:
        try:
            await self._loop.connect_accepted_socket(lambda: conn, sock)
        except Exception:
            sock.close()
            conn.connection_lost(None)

    def _pause(self, retry_s: Optional[float] = None) -> None:
        if not self._paused:
            self._paused = True
            for sock in self._listeners:
                self._loop.remove_reader(sock.fileno())
        if retry_s is not None:
            self._loop.call_later(retry_s, self._resume)

    def _resume(self) -> None:
        if self._paused and self._listeners:
            self._resume_all()

    def _resume_all(self) -> None:
        self._paused = False
        for sock in self._listeners:
            self._loop.add_reader(sock.fileno(), self._accept, sock)

    def room_in(self) -> float:
        """Seconds until a new connection can have a place: 0 below the cap or when the first
        waiting connection has waited ``GIVE_WAY_AFTER_S``; a short wait when every connection has
        a request in progress."""
        if len(self) < self.limit:
            return 0.0
        if not self._waiting:
            return 0.05
        first = next(iter(self._waiting))
        return max(0.0, first.since + GIVE_WAY_AFTER_S - self.now())

    def admit(self) -> Optional["Conn"]:
        """A new connection's place: the oldest waiting connection gives way at the cap; None if
        every connection has a request in progress."""
        if len(self) >= self.limit:
            if not self._waiting:
                self.closed["refused"] += 1
                return None
            next(iter(self._waiting)).close("evicted")
        conn = Conn(self._factory(), self)
        self._waiting[conn] = None
        return conn

    def closing(self, conn: "Conn", why: str) -> None:
        """This side closes ``conn`` (``why``: a key of ``closed``); its fd goes on the loop's next turn."""
        self._closing += 1
        self.closed[why] += 1
        self.forget(conn)

    def released(self) -> None:
        """A connection this side closed has let its fd go."""
        self._closing -= 1
        if self._closing < CLOSING_MAX // 2:
            self._resume()

    def of(self, request: web.Request) -> Optional["Conn"]:
        return self._by_handler.get(request.protocol)

    def now(self) -> float:
        return self._loop.time()

    # ---- bookkeeping, called by Conn -----------------------------------------------------
    def moved(self, conn: "Conn") -> None:
        """``conn`` entered a waiting state now: it goes to the back of the line."""
        self._busy.discard(conn)
        self._waiting[conn] = None
        self._waiting.move_to_end(conn)

    def busy(self, conn: "Conn") -> None:
        self._waiting.pop(conn, None)
        self._busy.add(conn)

    def attach(self, conn: "Conn") -> None:
        self._by_handler[conn.inner] = conn

    def forget(self, conn: "Conn") -> None:
        self._waiting.pop(conn, None)
        self._busy.discard(conn)
        self._by_handler.pop(conn.inner, None)

    # ---- deadlines ------------------------------------------------------------------------
    def sweep(self) -> None:
        now = self.now()
        for conn in list(self._waiting):
            if now >= conn.deadline():
                conn.close("idle" if conn.state == _IDLE else "slow")

    async def sweep_forever(self) -> None:
        reported = dict(self.closed)
        next_report = self.now() + 10
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                self.sweep()
                if self.now() >= next_report and self.closed != reported:
                    logger.info("lmshm: the HTTP endpoint closed connections (%s so far; %d open, at most %d): "
                                "see --http-max-connections, --http-idle-timeout, --http-request-timeout",
                                ", ".join(f"{n} {why}" for why, n in self.closed.items()), len(self), self.limit)
                    reported, next_report = dict(self.closed), self.now() + 10
            except Exception:
                logger.exception("lmshm: the HTTP connection sweep failed")


_IDLE, _READING, _BODY, _BUSY = "idle", "reading", "body", "busy"


class Conn(asyncio.Protocol):
    """One connection: passes every event to aiohttp's protocol (``inner``) and keeps the
    connection's state and deadline in its ``Connections``."""

    def __init__(self, inner: asyncio.Protocol, table: Connections) -> None:
        self.inner, self._table = inner, table
        self.transport: Optional[asyncio.BaseTransport] = None
        self.state, self.since = _IDLE, table.now()
        self.gone = False
        self._made = False               # aiohttp's protocol saw connection_made
        self._closed_here = False        # closed by close(): its fd is counted as closing

    def deadline(self) -> float:
        if self.state == _IDLE:
            return self.since + self._table.idle_s
        if self.state == _READING:
            return self.since + self._table.request_s
        return self.since + self._table.request_s + 1.0  # _BODY: the middleware answers 408 first

    def time_left(self) -> float:
        return self.since + self._table.request_s - self._table.now()

    def _enter(self, state: str) -> None:
        if self.gone:
            return
        self.state, self.since = state, self._table.now()
        self._table.moved(self)

    # ---- the middleware's marks -------------------------------------------------------------
    def reading_body(self) -> None:
        """The request's headers were parsed (its deadline runs from its first byte)."""
        if self.state == _IDLE:          # a pipelined request: its bytes came while the last one ran
            self._enter(_READING)
        if not self.gone:
            self.state = _BODY

    def in_progress(self) -> None:
        if not self.gone:
            self.state = _BUSY
            self._table.busy(self)

    def answered(self) -> None:
        self._enter(_IDLE)

    # ---- asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        if self.gone:                    # it gave way before the loop got to it
            transport.abort()  # type: ignore[attr-defined]
            return
        self._table.attach(self)
        self._made = True
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.state == _IDLE:
            self._enter(_READING)
        self.inner.data_received(data)

    def eof_received(self) -> Optional[bool]:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        if self._closed_here:
            self._closed_here = False
            self._table.released()
        self.gone = True
        self._table.forget(self)
        if self._made:
            self._made = False
            self.inner.connection_lost(exc)

    def close(self, why: str) -> None:
        """Close now (reset: nothing more is read or written) and stop counting it."""
        if self.gone:
            return
        self.gone = True
        self._closed_here = True
        self._table.closing(self, why)
        if self.transport is not None:
            self.transport.abort()  # type: ignore[attr-defined]
