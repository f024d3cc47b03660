"""ZeroMQ transport: the server's ROUTER loop and the worker's DEALER with timeouts.

Frames. A request is ``[request_id, body]`` (the ROUTER adds the peer's identity in front);
the reply is ``[request_id, body]``. ``request_id`` is 8 bytes chosen by the client; the
client ignores any reply whose id is not the one it waits for, so a late answer to a request
it gave up on can never be taken for the answer to the next one. This module moves bytes and
knows nothing of msgpack or the protocol.

The server loop is single-threaded: one ``zmq.Poller`` watches the ROUTER and any raw file
descriptors the server adds (the fd channel's sockets, pidfds of watched workers, the
signal wake-up pipe), and calls back. Nothing here blocks for longer than one tick.

Limits. ``max_message_bytes`` is set as ZMQ_MAXMSGSIZE on the ROUTER, so libzmq drops the
*connection* of a peer that sends a larger frame before the bytes are buffered (the peer
sees no reply; lmshm's client checks the limit before sending and fails with a clear
error instead). A message that passes libzmq but is malformed -- wrong number of frames,
an id that is not 8 bytes, more bytes in total than the limit -- is handed to the server as
a *problem* so that it still gets an ``INVALID_ARG`` reply.

``ipc://`` endpoints are created mode 0600 by binding the Unix socket here and handing it to
libzmq (``ZMQ_USE_FD``), so that a live endpoint is never taken over (libzmq's own bind unlinks
the path first); on close only the file this process created is removed. ``tcp://HOST:0`` binds a free port; ``url`` then reports the real one.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import zmq

from lmshm.platform.base.files import fd_id, unlink_if_same

logger = logging.getLogger(__name__)

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


@dataclass
class _Connection:
    socket_id: Optional[tuple[int, int]]   # (st_dev, st_ino) of the accepted socket
    since: float                         # accepted, or last seen with a session
    identity: Optional[bytes] = None     # the ROUTER identity its messages carry


def _shutdown_if(fd: int, socket_id: Optional[tuple[int, int]]) -> bool:
    """``shutdown()`` the socket behind ``fd`` if it is still ``socket_id``. libzmq then sees
    EOF and closes the connection itself (its fd is never closed behind its back)."""
    if socket_id is None:
        return False
    try:
        dup = os.dup(fd)  # hold it: from here on the number cannot come to mean another socket
    except OSError:
        return False
    try:
        if fd_id(dup) != socket_id:
            return False
        sock = socket.socket(fileno=dup)
        dup = -1
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
        finally:
            sock.close()
        return True
    finally:
        if dup >= 0:
            os.close(dup)


def _guarded(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Run one callback of the loop; a failure is logged, and the loop goes on."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - nothing a peer triggers may stop the loop
        logger.exception("lmshm: %s failed; the server goes on", what)
        return False

#: on_request(identity, request_id, body, problem): problem is None for a well-formed frame.
RequestHandler = Callable[[bytes, bytes, Optional[bytes], Optional[str]], None]


class AcceptGate:
    """Keeps libzmq's ipc listener from ever meeting EMFILE, which aborts the process.

    libzmq 4.3.5 asserts when ``accept`` on an ipc listener fails with EMFILE
    (src/ipc_listener.cpp; its tcp listener tolerates it). We own that listening socket
    (``ZMQ_USE_FD``), so when free fds run low the gate *closes*: ``dup2`` puts a private,
    empty listening socket under the fd number libzmq accepts on (its accepts then answer
    EAGAIN), while this process drains the real listener's backlog itself, closing each pending
    connection (the client's ZeroMQ socket retries later). When fds are free again the real
    listener goes back under libzmq. ``check()`` runs on every accepted connection (a socket
    monitor) and on every tick. The easy thing to get wrong: libzmq must see its own listener
    again before it closes the socket (``open()`` in ``close()``), or its epoll removal fails.
    """

    def __init__(self, listen_fd: int, *, fd_limit: int, low: int, high: int,
                 count_fds: Callable[[], int]) -> None:
        self.listen_fd = listen_fd                      # the number libzmq accepts on
        self._real = socket.socket(fileno=os.dup(listen_fd))  # our reference to the real listener
        self._real.setblocking(False)
        self._dummy = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._dummy.setblocking(False)
        self._dummy.bind("")                            # autobind: an abstract address nobody knows
        self._dummy.listen(1)
        self.fd_limit, self.low, self.high = fd_limit, low, high
        self._count_fds = count_fds
        self.closed = False
        self.refused = 0
        from lmshm.multiprocess.fdchannel import SpareFd

        self._spare = SpareFd()

    @property
    def real_fd(self) -> int:
        return self._real.fileno()

    def check(self) -> Optional[bool]:
        """Close or open the gate by the free fd count; returns the new state if it changed."""
        free = self.fd_limit - self._count_fds()
        if not self.closed and free < self.low:
            os.dup2(self._dummy.fileno(), self.listen_fd, inheritable=False)
            self.closed = True
            logger.warning("lmshm: %d of %d file descriptors in use: refusing new ipc connections until "
                           "some are free", self.fd_limit - free, self.fd_limit)
            return True
        if self.closed and free > self.high:
            self.open()
            logger.warning("lmshm: file descriptors free again (%d in use): accepting ipc connections "
                           "(%d refused meanwhile)", self.fd_limit - free, self.refused)
            return False
        return None

    def open(self) -> None:
        if self.closed:
            os.dup2(self._real.fileno(), self.listen_fd, inheritable=False)
            self.closed = False

    def refuse_pending(self) -> None:
        """While closed: accept and close what waits on the real listener."""
        for _ in range(64):
            try:
                conn, _ = self._real.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE):
                    return
                conn = self._spare.accept(self._real)
                if conn is None:
                    return
            conn.close()
            self.refused += 1

    def close(self) -> None:
        self.open()
        self._real.close()
        self._dummy.close()
        self._spare.close()


class RouterServer:
    """A bound ROUTER socket and the poll loop around it."""

    def __init__(self, url: str, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 receive_queue: int = 1000, fd_limit: int = 0, fd_reserve: int = 64,
                 count_fds: Optional[Callable[[], int]] = None, idle_timeout_s: float = 0.0) -> None:
        check_url(url)
        if max_message_bytes < 1024:
            raise TransportError(f"max_message_bytes={max_message_bytes} is too small (minimum 1024)")
        self.max_message_bytes = max_message_bytes
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._sock.setsockopt(zmq.RCVHWM, receive_queue)
        self._sock.setsockopt(zmq.SNDHWM, receive_queue)
        if idle_timeout_s > 0:  # a connection that never completes the ZMTP handshake goes too
            self._sock.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(idle_timeout_s * 1000)))
        self.idle_timeout_s = idle_timeout_s
        self._conns: dict[int, _Connection] = {}  # fd -> what we know of that ZeroMQ connection
        self._ipc_path: Optional[str] = None
        self._ipc_inode: Optional[tuple[int, int]] = None
        self._ipc_listener = None
        self._listen_fd: Optional[int] = None
        self.gate: Optional[AcceptGate] = None
        self._monitor = None
        try:
            self.url = self._bind(url)
            if self._listen_fd is not None and fd_limit and count_fds is not None:
                # Backlog 64 bounds a burst; the gate closes with room for two bursts to spare.
                self.gate = AcceptGate(self._listen_fd, fd_limit=fd_limit, low=fd_reserve + 128,
                                       high=fd_reserve + 192, count_fds=count_fds)
            if self.gate is not None or idle_timeout_s > 0:
                self._monitor = self._sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        except BaseException:
            self.close()
            raise
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        if self._monitor is not None:
            self._poller.register(self._monitor, zmq.POLLIN)
        self._fd_callbacks: dict[int, Callable[[], None]] = {}

    def _bind(self, url: str) -> str:
        path = ipc_path(url)
        bind_to = url
        if url.startswith("tcp://") and url.endswith(":0"):
            bind_to = url[:-2] + ":*"
        if path:
            # Bind the Unix socket ourselves and hand it to libzmq (ZMQ_USE_FD): the kernel's
            # bind refuses an existing path, where libzmq's own bind would first unlink it --
            # and with it a live server's endpoint.
            from lmshm.multiprocess.fdchannel import FdChannelError, bind_unix

            try:
                self._ipc_listener, self._ipc_inode = bind_unix(path, socket.SOCK_STREAM, "ipc endpoint")
            except FdChannelError as exc:
                raise TransportError(f"cannot listen on {url}: {exc}") from None
            self._ipc_listener.listen(64)
            self._ipc_path = path
            self._listen_fd = self._ipc_listener.fileno()
            self._sock.setsockopt(zmq.USE_FD, self._listen_fd)
        try:
            self._sock.bind(bind_to)
        except zmq.ZMQError as exc:
            raise TransportError(f"cannot listen on {url}: {exc.strerror}") from None
        if self._ipc_listener is not None:
            self._ipc_listener.detach()  # libzmq owns (and closes) the listening fd now
            self._ipc_listener = None
            return url
        return self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def watch_fd(self, fd: int, callback: Callable[[], None]) -> None:
        """Call ``callback()`` from the loop whenever ``fd`` is readable."""
        self._poller.register(fd, zmq.POLLIN)
        self._fd_callbacks[fd] = callback

    def unwatch_fd(self, fd: int) -> None:
        if self._fd_callbacks.pop(fd, None) is not None:
            self._poller.unregister(fd)

    def reply(self, identity: bytes, request_id: bytes, body: bytes) -> None:
        try:
            self._sock.send_multipart([identity, request_id, body], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:  # peer gone or its queue full: the reply is lost, not us
            logger.warning("lmshm: could not reply to a peer: %s", exc.strerror)

    def _receive_one(self, on_request: RequestHandler) -> bool:
        try:
            frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        if self.idle_timeout_s > 0:
            self._saw(frames[0])
        identity, rest = frames[0].bytes, [f.bytes for f in frames[1:]]
        total = sum(len(f) for f in rest)
        request_id = rest[0] if rest and len(rest[0]) == REQUEST_ID_BYTES else b""
        if total > self.max_message_bytes:
            on_request(identity, request_id, None,
                       f"message of {total} bytes exceeds the server's limit of {self.max_message_bytes} bytes")
        elif len(rest) != 2 or len(rest[0]) != REQUEST_ID_BYTES:
            shape = [len(f) for f in rest]
            on_request(identity, request_id, None,
                       f"malformed message: expected 2 frames [8-byte request id, body], got frame sizes {shape}")
        else:
            on_request(identity, request_id, rest[1], None)
        return True

    def serve(
        self,
        on_request: RequestHandler,
        *,
        on_tick: Callable[[], None],
        tick_s: float,
        stop: Callable[[], bool],
        batch: int = 64,
    ) -> None:
        """Poll until ``stop()``; ``on_tick()`` runs at least every ``tick_s`` seconds."""
        next_tick = time.monotonic() + tick_s
        while not stop():
            timeout_ms = max(0, int((next_tick - time.monotonic()) * 1000))
            try:
                events = dict(self._poller.poll(timeout_ms))
            except zmq.ZMQError as exc:
                if exc.errno != errno.EINTR:
                    logger.error("lmshm: poll failed: %s", exc.strerror)
                    time.sleep(tick_s)
                events = {}
            if self._monitor is not None and self._monitor in events:
                _guarded("the accept gate", self._on_accepted)
            if self._sock in events:
                for _ in range(batch):  # bounded, so fds and ticks are never starved
                    if self._monitor is not None and self._monitor.poll(0):
                        _guarded("the accept gate", self._on_accepted)  # a burst: react between requests
                    if not _guarded("a request", self._receive_one, on_request):
                        break
            for fd, callback in list(self._fd_callbacks.items()):
                if fd in events and fd in self._fd_callbacks:
                    _guarded(f"the callback of fd {fd}", callback)
            if time.monotonic() >= next_tick:
                if self.gate is not None:
                    _guarded("the accept gate", self._check_gate)
                _guarded("the periodic tick", on_tick)
                next_tick = time.monotonic() + tick_s

    def _on_accepted(self) -> None:
        """Drain the monitor (connections accepted and gone), then look at the fd headroom once."""
        while True:
            try:
                event = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if self.idle_timeout_s > 0 and len(event[0]) == 6:
                kind, fd = struct.unpack("=HI", event[0])
                if kind == zmq.EVENT_ACCEPTED:
                    self._conns[fd] = _Connection(fd_id(fd), time.monotonic())
                elif kind == zmq.EVENT_DISCONNECTED:
                    self._conns.pop(fd, None)
        if self.gate is not None:
            self._check_gate()

    def _saw(self, identity_frame: Any) -> None:
        """A message came in: remember which connection (fd) carries which peer identity."""
        try:
            fd = identity_frame.get(zmq.SRCFD)
        except zmq.ZMQError:
            return
        conn = self._conns.get(fd)
        if conn is not None:
            conn.identity = identity_frame.bytes

    def drop_idle(self, has_session: Callable[[bytes], bool]) -> int:
        """Shut down connections that have had no session for ``idle_timeout_s``: a peer must
        not hold server fds with connections that do nothing. A connection is dropped only if
        its fd still names the very socket that was accepted (same socket inode)."""
        now, dropped = time.monotonic(), 0
        for fd, conn in list(self._conns.items()):
            if conn.identity is not None and has_session(conn.identity):
                conn.since = now
                continue
            if now - conn.since <= self.idle_timeout_s:
                continue
            del self._conns[fd]
            if _shutdown_if(fd, conn.socket_id):
                dropped += 1
        return dropped

    def _check_gate(self) -> None:
        changed = self.gate.check()
        if changed is True:
            self.watch_fd(self.gate.real_fd, self.gate.refuse_pending)
        elif changed is False:
            self.unwatch_fd(self.gate.real_fd)

    def drain(self, on_request: RequestHandler, limit: int = 1024) -> int:
        """Hand every message already queued to ``on_request`` (used at shutdown)."""
        n = 0
        while n < limit and self._receive_one(on_request):
            n += 1
        return n

    def close(self) -> None:
        if self.gate is not None:
            self.gate.open()  # libzmq must find its own listener when it closes (epoll removal)
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._monitor = None
        self._sock.close(0)
        self._ctx.term()
        if self.gate is not None:
            self.gate.close()
            self.gate = None
        if self._ipc_listener is not None:  # bind failed before libzmq took it
            self._ipc_listener.close()
            self._ipc_listener = None
        if self._ipc_listener is not None:
            self._ipc_listener.close()
            self._ipc_listener = None
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
        while True:
            remaining = end - time.monotonic()
            if remaining <= 0:
                if end < deadline:
                    return None
                self._pending.discard(rid)
                if not self._pending:
                    self.reset()
                raise TransportTimeout(self.url, timeout, what)
            if self._sock is None:
                raise TransportError("the client is closed")
            if not self._sock.poll(int(remaining * 1000) + 1, zmq.POLLIN):
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
