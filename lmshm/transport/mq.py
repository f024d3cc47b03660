"""ZeroMQ transport: the server's ROUTER loop over ``zmtp.ZmtpListener``, and the worker's DEALER.

A request is ``[request_id, body]`` (8-byte id chosen by the client), its reply the same id and
a body; the client drops a reply whose id it no longer waits for. This module moves bytes and
knows nothing of msgpack. The server loop is one thread over one epoll set: the listener, every
connection, and the raw fds the server adds (fd channel, pidfds, wake-up pipe). Requests run in
slices of ``SLICE_S``; requests of peers without a verified session take a bounded share of the
loop's time (``UnverifiedShare``). ``ipc://`` endpoints are bound mode 0600 and only the file
this process created is removed.

One file, over 600 lines: the loop, its fairness between peers and the client that must match
its framing change together. docs/design/transport.md has the details. The trap: a malformed
message must still reach the server as a *problem*, so that it is answered ``INVALID_ARG``.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import os
import select
import socket
import time
from typing import Any, Callable, Optional

import zmq

from lmshm.core.logs import Throttle
from lmshm.platform.base.files import unlink_if_same
from lmshm.transport import zmtp

logger = logging.getLogger(__name__)
_reply_log = Throttle(logger)       # peers cause these: at most a line every 10 s each
_failure_logs: dict[str, Throttle] = {}

DEFAULT_URL = "tcp://127.0.0.1:5555"
REQUEST_ID_BYTES = 8
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class TransportError(RuntimeError):
    """The endpoint is unusable (bad URL, address in use, ...)."""


class TransportTimeout(TimeoutError):
    """No reply from ``url`` within ``timeout_s``."""

    def __init__(self, url: str, timeout_s: float, what: str = "request") -> None:
        super().__init__(
            f"lmshm server at {url} did not answer a {what} within {timeout_s:g} s; "
            "is lmshm-server running there (lmshm status --url URL)?"
        )
        self.url = url
        self.timeout_s = timeout_s


def check_url(url: str) -> str:
    """Validate an endpoint: ``tcp://HOST:PORT`` or ``ipc://PATH``."""
    if url.startswith("ipc://"):
        if len(url) == len("ipc://"):
            raise TransportError(f"{url!r}: ipc:// needs a socket path")
        return url
    if url.startswith("tcp://"):
        host, sep, port = url[len("tcp://"):].rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise TransportError(f"{url!r}: expected tcp://HOST:PORT with a port from 0 to 65535")
        return url
    raise TransportError(f"{url!r}: lmshm speaks tcp://HOST:PORT or ipc://PATH")


def ipc_path(url: str) -> Optional[str]:
    return url[len("ipc://"):] if url.startswith("ipc://") else None


# ---- server side ------------------------------------------------------------------------


def _guarded(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Run one callback of the loop; a failure is logged (at most every 10 s for each ``what``:
    a peer that found a way to make one fail must not flood the log), and the loop goes on."""
    try:
        return fn(*args)
    except Exception:
        throttle = _failure_logs.get(what)
        if throttle is None:
            throttle = _failure_logs.setdefault(what if len(_failure_logs) < 64 else "other", Throttle(logger))
        throttle.exception("lmshm: %s failed; the server goes on", what)
        return False

#: on_request(identity, request_id, body, problem): problem is None for a well-formed frame.
RequestHandler = Callable[[bytes, bytes, Optional[bytes], Optional[str]], None]
#: on_busy(identity, request_id): answer at once that the server will not run this request now.
BusyHandler = Callable[[bytes, bytes], None]

#: The longest the loop spends on requests before it serves the fd channel, pidfds and its
#: wake-up pipe again (a request that runs longer is not cut short).
SLICE_S = 0.01
#: Listen backlog (the kernel caps it at net.core.somaxconn, 4096 by default): connections
#: waiting there hold no fd of the server, and a full TCP backlog drops SYNs, which a client
#: retries only after 1, 3, 7 ... s.
BACKLOG = 4096
#: A connection this young is never shed (``RouterServer.shed``): it has not had its turn yet.
SHED_GRACE_S = 0.25
#: A peer process (``Connection.account``) with more connections than this gets none spared by
#: ``RouterServer.shed`` for a request waiting its turn.
SPARED_PER_ACCOUNT = 4


def bind_tcp(url: str) -> socket.socket:
    """A listening TCP socket for ``tcp://HOST:PORT`` (``*`` = every interface, port 0 = a free
    one), with SO_REUSEADDR as libzmq sets it."""
    host, _, port = url[len("tcp://"):].rpartition(":")
    host = "0.0.0.0" if host == "*" else host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # IPv4 for names, as libzmq (ZMQ_IPV6 off)
    try:
        infos = socket.getaddrinfo(host, int(port), family, socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise TransportError(f"cannot listen on {url}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise TransportError(f"cannot listen on {url}: {exc.strerror}") from None
    return sock


class UnverifiedShare:
    """Requests of peers without a verified session wait here, and use the loop's time only as
    verified sessions leave it.

    Anyone who reaches the endpoint may send HELLO, PING and STATUS; a flood of them must not
    delay the fd channel (where workers prove who they are) or verified sessions. So those
    requests wait here -- at most ``per_peer`` per routing id, none larger than ``max_item``
    (a larger one runs only when nothing waits), at most ``max_count`` in all; more are
    answered "busy" at once -- and run in the second half of each slice of the loop. While
    verified sessions have requests, they may use ``share`` of the loop's time: a token bucket
    in seconds, filled at ``share`` seconds per second up to ``burst_s`` and charged what each
    request took; when no verified request came in a slice, they may use the rest of it. The
    peer that has used the least time so far goes first, so a newcomer's HELLO does not queue
    behind a flood of expensive requests of peers already served. Time is charged to the peer's
    ``account`` (on ipc:// its process, which the kernel names: a flood that reconnects stays
    charged; on tcp:// its connection). Verified sessions' requests never wait here.
    """

    def __init__(self, share: float, *, burst_s: float = 0.1, per_peer: int = 2, max_item: int = 16 << 10,
                 max_count: int = 8192, account: Callable[[bytes], bytes] = lambda identity: identity) -> None:
        self.share = share
        self.burst_s = burst_s
        self.per_peer = per_peer
        self.max_item = max_item
        self.max_count = max_count
        self.credit = burst_s
        self._at = time.monotonic()
        self._account = account
        self._accounts: dict[bytes, bytes] = {}           # waiting peer -> its account
        self._waiting: dict[bytes, collections.deque] = {}
        self._turns: list[tuple[float, int, bytes]] = []      # heap: (time used, arrival, peer)
        self._used: collections.OrderedDict[bytes, float] = collections.OrderedDict()  # recent peers' time
        self._seq = itertools.count()
        self.count = 0
        self.refused = 0

    def refill(self, now: float) -> None:
        self.credit = min(self.burst_s, self.credit + (now - self._at) * self.share)
        self._at = now

    def offer(self, identity: bytes, item: tuple, size: int) -> bool:
        """Queue a request; False if this peer has ``per_peer`` waiting, the request is larger
        than ``max_item`` while others wait, or ``max_count`` wait already."""
        queue = self._waiting.get(identity)
        if ((queue is not None and len(queue) >= self.per_peer) or (size > self.max_item and self.count)
                or self.count >= self.max_count):
            self.refused += 1
            return False
        if queue is None:
            queue = self._waiting[identity] = collections.deque()
            account = self._accounts[identity] = self._account(identity)
            heapq.heappush(self._turns, (self._used.get(account, 0.0), next(self._seq), identity))
        queue.append(item)
        self.count += 1
        return True

    def take(self) -> Optional[tuple[bytes, tuple]]:
        """(peer, request) of the waiting peer that has used the least time."""
        while self._turns:
            _, _, identity = heapq.heappop(self._turns)
            queue = self._waiting.get(identity)
            if not queue:
                continue
            item = queue.popleft()
            self.count -= 1
            if not queue:
                del self._waiting[identity]
            return identity, item
        return None

    def charge(self, identity: bytes, seconds: float) -> None:
        """``identity``'s request took ``seconds`` of the loop: the credit pays, the peer's
        turn moves back."""
        self.credit = max(-self.burst_s, self.credit - seconds)  # a long quiet spell cannot bank a debt
        account = self._accounts.get(identity, identity)
        used = self._used.pop(account, 0.0) + seconds
        self._used[account] = used
        if len(self._used) > self.max_count:
            self._used.popitem(last=False)
        if identity in self._waiting:
            heapq.heappush(self._turns, (used, next(self._seq), identity))
        else:
            self._accounts.pop(identity, None)

    def waiting(self, identity: bytes) -> bool:
        return identity in self._waiting

    def runnable(self, verified_busy: bool = True) -> bool:
        return self.count > 0 and (self.credit > 0 or not verified_busy)


class RouterServer:
    """The server's endpoint and its poll loop: lmshm's own ZMTP listener (``zmtp.ZmtpListener``)
    on ``tcp://`` or ``ipc://``, and the raw fds the server adds. Connections are accepted only
    while more than ``fd_reserve`` fds are free (``count_fds`` may cache; ``fds_opened`` tells it
    of accepts). Requests of verified peers run as they come; the others share
    ``unverified_share`` of the loop's time (``UnverifiedShare``)."""

    def __init__(self, url: str, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 receive_queue: int = 1000, fd_limit: int = 0, fd_reserve: int = 64,
                 count_fds: Optional[Callable[[], int]] = None, fds_opened: Optional[Callable[[int], None]] = None,
                 idle_timeout_s: float = 0.0, unverified_share: float = 1.0) -> None:
        check_url(url)
        if max_message_bytes < 1024:
            raise TransportError(f"max_message_bytes={max_message_bytes} is too small (minimum 1024)")
        self.max_message_bytes = max_message_bytes
        self.receive_queue = receive_queue
        self.fd_limit, self.fd_reserve = fd_limit, fd_reserve
        self._count_fds = count_fds
        self.idle_timeout_s = idle_timeout_s
        self.share = UnverifiedShare(unverified_share, account=self._account)
        self._trusted: Callable[[bytes], bool] = lambda identity: False    # serve() sets it
        self.unanswered = 0      # replies dropped: the peer does not read (its queue is full)
        self._ipc_path: Optional[str] = None
        self._ipc_inode: Optional[tuple[int, int]] = None
        self._next_idle_check = 0.0
        self._polled: dict[int, int] = {}          # fd -> epoll flags registered
        self._fd_callbacks: dict[int, Callable[[], None]] = {}
        sock = self._bind(url)
        try:
            self._epoll = select.epoll()
            self.listener = zmtp.ZmtpListener(sock, max_message_bytes=max_message_bytes, send_queue=receive_queue,
                                              headroom=self._headroom, set_poll=self._set_poll,
                                              accepted=fds_opened or (lambda n: None),
                                              trusted=lambda identity: self._trusted(identity))
        except BaseException:
            sock.close()
            if getattr(self, "_epoll", None) is not None:
                self._epoll.close()
            if self._ipc_path and self._ipc_inode:
                unlink_if_same(self._ipc_path, self._ipc_inode)
            raise

    def _bind(self, url: str) -> socket.socket:
        path = ipc_path(url)
        if path is None:
            sock = bind_tcp(url)
            host, port = sock.getsockname()[:2]
            self.url = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
            return sock
        # The kernel's bind refuses an existing path (libzmq's own bind would first unlink it,
        # and with it a live server's endpoint).
        from lmshm.transport.fdchannel import FdChannelError, bind_unix

        try:
            sock, self._ipc_inode = bind_unix(path, socket.SOCK_STREAM, "ipc endpoint")
        except FdChannelError as exc:
            raise TransportError(f"cannot listen on {url}: {exc}") from None
        self._ipc_path = path
        sock.listen(BACKLOG)
        self.url = url
        return sock

    def _set_poll(self, fd: int, flags: int) -> None:
        """Poll ``fd`` for ``flags`` (zmtp.READABLE | zmtp.WRITABLE), or not at all (0). Every
        fd leaves the set before it is closed."""
        events = (select.EPOLLIN if flags & 1 else 0) | (select.EPOLLOUT if flags & 2 else 0)
        old = self._polled.get(fd)
        if not events:
            if old is not None:
                del self._polled[fd]
                self._epoll.unregister(fd)
        elif old is None:
            self._epoll.register(fd, events)
            self._polled[fd] = events
        elif old != events:
            self._epoll.modify(fd, events)
            self._polled[fd] = events

    def free_fds(self) -> int:
        if not self.fd_limit or self._count_fds is None:
            return 1 << 30
        return self.fd_limit - self._count_fds()

    def _headroom(self) -> int:
        return self.free_fds() - self.fd_reserve

    def watch_fd(self, fd: int, callback: Callable[[], None]) -> None:
        """Call ``callback()`` from the loop whenever ``fd`` is readable."""
        self._set_poll(fd, 1)
        self._fd_callbacks[fd] = callback

    def unwatch_fd(self, fd: int) -> None:
        if self._fd_callbacks.pop(fd, None) is not None:
            self._set_poll(fd, 0)

    def reply(self, identity: bytes, request_id: bytes, body: bytes) -> None:
        if not self.listener.send(identity, [request_id, body]) and self.listener.connection(identity) is not None:
            self.unanswered += 1
            _reply_log.warning("lmshm: could not reply to a peer that does not read: its replies fill the send "
                               "queue (%d replies or %d bytes); %d dropped so far", self.receive_queue,
                               self.listener.send_bytes, self.unanswered)

    def _account(self, identity: bytes) -> bytes:
        conn = self.listener.connection(identity)
        return identity if conn is None else conn.account

    def alive(self, identity: bytes) -> bool:
        """False once the connection of ``identity`` is gone (its reply would be lost)."""
        return self.listener.connection(identity) is not None

    # ---- requests -----------------------------------------------------------------------------
    def _handle(self, on_request: RequestHandler, identity: bytes, rest: list[bytes], problem: Optional[str]) -> None:
        total = sum(len(f) for f in rest)
        request_id = rest[0] if rest and len(rest[0]) == REQUEST_ID_BYTES else b""
        if problem is not None:
            on_request(identity, request_id, None, problem)
        elif total > self.max_message_bytes:
            on_request(identity, request_id, None,
                       f"message of {total} bytes exceeds the server's limit of {self.max_message_bytes} bytes")
        elif len(rest) != 2 or len(rest[0]) != REQUEST_ID_BYTES:
            shape = [len(f) for f in rest]
            on_request(identity, request_id, None,
                       f"malformed message: expected 2 frames [8-byte request id, body], got frame sizes {shape}")
        else:
            on_request(identity, request_id, rest[1], None)

    def _serve_requests(self, on_request: RequestHandler, trusted: Callable[[bytes], bool],
                        on_busy: Optional[BusyHandler],
                        vouched: Optional[Callable[[bytes, list[bytes]], bool]] = None) -> None:
        """One slice: take what arrived (verified peers' requests run at once, the others wait
        in ``share``), then run waiting requests while the share's credit lasts."""
        share = self.share
        start = time.monotonic()
        share.refill(start)
        half, deadline = start + SLICE_S / 2, start + SLICE_S
        verified_busy = False
        while True:
            msg = self.listener.next_message()
            if msg is None:
                break
            identity, rest, problem = msg
            if share.share >= 1.0 or trusted(identity) or (problem is None and vouched is not None
                                                            and vouched(identity, rest)):
                verified_busy = True
                _guarded("a request", self._handle, on_request, *msg)
            elif not share.offer(identity, msg, sum(len(f) for f in rest)):
                rid = rest[0] if rest and len(rest[0]) == REQUEST_ID_BYTES else b""
                if on_busy is not None:
                    _guarded("a busy reply", on_busy, identity, rid)
            if time.monotonic() >= (half if share.count else deadline):
                break
        while share.runnable(verified_busy) and time.monotonic() < deadline:
            identity, msg = share.take()
            if not self.alive(identity):   # its connection was closed meanwhile: nobody would hear
                share.charge(identity, 0.0)
                continue
            t0 = time.perf_counter()
            _guarded("a request", self._handle, on_request, *msg)
            share.charge(identity, time.perf_counter() - t0)

    def _poll_timeout_ms(self, next_tick: float) -> int:
        if self.listener.has_messages() or self.share.count:
            return 0
        return max(0, int((next_tick - time.monotonic()) * 1000))

    def serve(
        self,
        on_request: RequestHandler,
        *,
        on_tick: Callable[[], None],
        tick_s: float,
        stop: Callable[[], bool],
        trusted: Callable[[bytes], bool] = lambda identity: True,
        on_busy: Optional[BusyHandler] = None,
        vouched: Optional[Callable[[bytes, list[bytes]], bool]] = None,
        on_idle: Optional[Callable[[bool], bool]] = None,
        quiet_s: float = 0.001,
    ) -> None:
        """Poll until ``stop()``; ``on_tick()`` runs at least every ``tick_s`` seconds. Requests of
        ``trusted`` peers run at once, and so does one that ``vouched(identity, frames)`` for
        (a message that carries its own proof); the rest share ``unverified_share``.
        ``on_idle(True)`` does a short slice of deferred work and returns whether more is left
        (``on_idle(False)``: whether there is any, doing none). It runs once the loop has had
        nothing to do for ``quiet_s``, so a burst of requests is served first; the loop then
        polls without waiting between slices, so a request that comes meanwhile waits for one
        slice at most."""
        listener = self.listener
        self._trusted = trusted
        next_tick = time.monotonic() + tick_s
        quiet_ms = max(1, int(quiet_s * 1000))
        quiet = False           # the last poll waited quiet_ms for nothing
        while not stop():
            timeout_ms = self._poll_timeout_ms(next_tick)
            waited = False
            if timeout_ms and on_idle is not None:
                if quiet and _guarded("idle work", on_idle, True):
                    timeout_ms = 0
                elif _guarded("idle work", on_idle, False):
                    timeout_ms, waited = min(timeout_ms, quiet_ms), True
            try:
                events = self._epoll.poll(timeout_ms / 1000, 4096)
            except InterruptedError:
                events = []
            except OSError as exc:
                logger.error("lmshm: poll failed: %s", exc.strerror)
                time.sleep(tick_s)
                events = []
            quiet = not events and (waited or quiet)
            callbacks = []
            for fd, flags in events:
                if fd == listener.listen_fd:
                    _guarded("accepting connections", listener.on_listener)
                elif fd in listener.conns:
                    _guarded("a connection", listener.on_event, fd,
                             (zmtp.WRITABLE if flags & select.EPOLLOUT else 0)
                             | (zmtp.READABLE if flags & ~select.EPOLLOUT else 0))
                else:
                    callbacks.append(fd)
            _guarded("parsing", listener.pump)
            _guarded("requests", self._serve_requests, on_request, trusted, on_busy, vouched)
            for fd in callbacks:
                callback = self._fd_callbacks.get(fd)
                if callback is not None:
                    _guarded(f"the callback of fd {fd}", callback)
            if time.monotonic() >= next_tick:
                _guarded("the periodic tick", on_tick)
                next_tick = time.monotonic() + tick_s
            if listener.paused:
                _guarded("the listener", listener.resume)

    # ---- connections --------------------------------------------------------------------------
    def drop_idle(self, has_session: Callable[[bytes], bool]) -> int:
        """Close connections that have had no session for ``idle_timeout_s``, or did not finish
        their handshake by then: a peer must not hold server fds with connections that do
        nothing. A verified session's connection stays however quiet it is."""
        now, dropped = time.monotonic(), 0
        if self.idle_timeout_s <= 0 or now < self._next_idle_check:
            return 0
        self._next_idle_check = now + min(0.25, self.idle_timeout_s / 4)
        for conn in list(self.listener.conns.values()):
            if conn.open and has_session(conn.identity):
                conn.since = now
            elif now - conn.since > self.idle_timeout_s:
                self.listener.close(conn)
                dropped += 1
        return dropped

    def shed(self, keep: Callable[[bytes], bool], low: int, high: int) -> int:
        """When fewer than ``low`` fds are free and a connection waits to be accepted, close
        connections that are only holding fds, the longest-standing first, until ``high`` would
        be free: a flood of connections must not keep a worker from connecting until the idle
        timeout clears it. Spared: a connection younger than ``SHED_GRACE_S``, one whose first
        request still waits its turn (every connection gets one answer) unless its peer process
        holds more than ``SPARED_PER_ACCOUNT`` connections (a flood from one process, on ipc://),
        and one whose peer ``keep(identity)`` (a verified session). A worker whose connection is shed between its
        HELLO and its proof still verifies (the session is its token's), and its client resumes
        the session over a new connection."""
        free = self.free_fds()
        if free >= low or not self.listener.pending():
            return 0
        now = time.monotonic()
        per_account = collections.Counter(c.account for c in self.listener.conns.values())
        victims = heapq.nsmallest(high - free, (
            c for c in self.listener.conns.values()
            if now - c.accepted >= SHED_GRACE_S
            and not (c.open and (keep(c.identity) or (not c.replies and per_account[c.account] <= SPARED_PER_ACCOUNT
                                                      and (c.ready or self.share.waiting(c.identity)))))),
            key=lambda c: c.accepted)
        for conn in victims:
            self.listener.close(conn)
        return len(victims)

    def drain(self, on_request: RequestHandler, limit: int = 4096) -> int:
        """Hand every message already received (and waiting in the share) to ``on_request``
        (used at shutdown)."""
        n = 0
        while n < limit:
            waiting = self.share.take()
            msg = waiting[1] if waiting is not None else self.listener.next_message()
            if msg is None:
                break
            _guarded("a request", self._handle, on_request, *msg)
            if waiting is not None:
                self.share.charge(waiting[0], 0.0)  # its next request takes its turn
            n += 1
        self.listener.flush_all()
        return n

    def close(self) -> None:
        self.listener.flush_all()  # last replies (shutdown's UNAVAILABLE), as far as they go without waiting
        self.listener.close_all()
        self._epoll.close()
        if self._ipc_path and self._ipc_inode:
            unlink_if_same(self._ipc_path, self._ipc_inode)  # only the file this process created
            self._ipc_path = None


# ---- client side ------------------------------------------------------------------------


class DealerClient:
    """One DEALER connection with request/reply matching and a per-request timeout.

    Not thread-safe: callers serialise every call (``MPClient`` holds a lock). After a
    timeout with no other request pending, the socket is closed and a fresh one connected (the "lazy pirate" pattern), so
    a dead or restarted server never leaves stale requests queued; the new socket has a new
    ZeroMQ identity, which is why sessions are resumed by token, not by identity.
    """

    def __init__(self, url: str, *, timeout_s: float = 5.0) -> None:
        self.url = check_url(url)
        self.timeout_s = timeout_s
        self._ctx = zmq.Context()
        self._ids = itertools.count(1)
        self._salt = os.getpid() << 32
        self._sock: Optional[zmq.Socket] = None
        self._pending: set[bytes] = set()
        self._replies: dict[bytes, bytes] = {}
        self._connect()

    def _connect(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 50)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
        sock.connect(self.url)
        self._sock = sock

    def reset(self) -> None:
        """Drop the socket (and anything queued on it, pending requests too) and connect a fresh one."""
        if self._sock is not None:
            self._sock.close(0)
        self._pending.clear()
        self._replies.clear()
        self._connect()

    def send(self, body: bytes) -> bytes:
        """Send one request; returns its request id, for ``wait``. Requests may be pipelined:
        replies are matched by id, in whatever order they come."""
        if self._sock is None:
            raise TransportError("the client is closed")
        rid = ((self._salt | next(self._ids)) & (2**64 - 1)).to_bytes(REQUEST_ID_BYTES, "big")
        self._sock.send_multipart([rid, body], copy=False)
        self._pending.add(rid)
        return rid

    def wait(self, rid: bytes, timeout_s: Optional[float] = None, what: str = "request",
             slice_s: Optional[float] = None) -> Optional[bytes]:
        """The reply to ``rid``. Replies to other pending requests that arrive meanwhile are kept
        for their own ``wait``. With ``slice_s``, returns None after that long without it (the
        request stays pending). After ``timeout_s`` the request is abandoned; if none is pending
        any more, the socket is replaced (a dead server's queue must not linger)."""
        if rid in self._replies:
            self._pending.discard(rid)
            return self._replies.pop(rid)
        if rid not in self._pending:
            raise TransportTimeout(self.url, 0.0, what)  # abandoned, or lost with a replaced socket
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        end = deadline if slice_s is None else min(deadline, time.monotonic() + slice_s)
        polled = False
        while True:
            remaining = end - time.monotonic()
            if remaining <= 0 and polled:   # a zero slice still reads what has arrived
                if end < deadline:
                    return None
                self._pending.discard(rid)
                if not self._pending:
                    self.reset()
                raise TransportTimeout(self.url, timeout, what)
            if self._sock is None:
                raise TransportError("the client is closed")
            polled = True
            if not self._sock.poll(int(remaining * 1000) + 1 if remaining > 0 else 0, zmq.POLLIN):
                continue
            frames = self._sock.recv_multipart()
            if len(frames) != 2:
                continue  # garbage
            if frames[0] == rid:
                self._pending.discard(rid)
                return frames[1]
            if frames[0] in self._pending:
                self._replies[frames[0]] = frames[1]
            # else: a late reply to a request already given up on

    def abandon(self, rid: bytes) -> None:
        """Forget a pending request; its reply, if it comes, is dropped."""
        self._pending.discard(rid)
        self._replies.pop(rid, None)

    def request(self, body: bytes, timeout_s: Optional[float] = None, what: str = "request") -> bytes:
        reply = self.wait(self.send(body), timeout_s, what)
        assert reply is not None
        return reply

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        self._ctx.term()
