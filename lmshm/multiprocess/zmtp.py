"""lmshm-server's listener: ZeroMQ's wire protocol (ZMTP 3.1, NULL mechanism) spoken by the
server's own loop on ``tcp://`` and ``ipc://``, so that libzmq never accepts for the server.

Why not libzmq's listeners: libzmq accepts in its I/O thread whenever a connection waits.
On an ipc listener, an ``accept`` that fails with EMFILE aborts the whole process
(libzmq 4.3.5, ``src/ipc_listener.cpp:297``) -- and Linux allocates the new fd *before* it
looks for a waiting connection, so once the table is full even an accept on an empty
listener fails so (this is how a gRPC connection flood aborted an ipc server although the old
accept gate had swapped in an empty listener). Its tcp listener tolerates EMFILE, but fills the
table to the last slot and then spins, so that the fd channel, mappings and every other fd
the server needs find none. Nor can libzmq adopt a connection someone else accepted:
``ZMQ_USE_FD`` takes a *listening* socket, and its connecters create their own. So here the
loop accepts, and only while the caller's ``headroom()`` (free fds less a reserve) allows;
when it does not, connections wait in the kernel's backlog (the client's connect has
succeeded; its greeting waits) and an EMFILE lost to a race with another thread is harmless.

What it speaks: to a ZeroMQ DEALER or REQ peer it is a ROUTER. It sends its 64-byte greeting
(version 3.1, mechanism NULL) and a READY command (``Socket-Type: ROUTER``) at once, checks the
peer's, then exchanges frames: a flags byte (MORE, LONG, COMMAND) and a 1- or 8-byte length.
Every connection gets a fresh routing id (the peer's ``Identity`` property is ignored: lmshm
resumes sessions by token, never by routing id). A PING command is answered with PONG.

Limits, as libzmq's ROUTER has them: a frame longer than ``max_message_bytes`` closes the
connection (ZMQ_MAXMSGSIZE); a message whose frames add up to more is delivered as a problem,
without its bytes; at most ``send_queue`` replies wait for a peer that does not read, and
more are dropped (ZMQ_SNDHWM). Reading is lazy: a connection is read again only once the
messages already parsed from it were taken (``next_message``, round robin over connections),
so one fast peer cannot fill the server's memory or push others back.

Easy to get wrong: a peer's bytes arrive in any split (libzmq sends its greeting in three
parts, waiting for ours in between), so every parser step must stop cleanly at the end of the
buffer and resume there.
"""

from __future__ import annotations

import collections
import errno
import itertools
import logging
import select
import socket
import struct
import time
from typing import Callable, Optional

logger = logging.getLogger(__name__)

_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04
GREETING = (b"\xff" + b"\x00" * 8 + b"\x7f"           # signature
            + bytes([3, 1])                             # ZMTP 3.1
            + b"NULL".ljust(20, b"\x00")                # mechanism
            + b"\x00" + b"\x00" * 31)                   # as-server (unused by NULL), filler
assert len(GREETING) == 64
#: Socket types a ROUTER talks to (ZMTP 3.1, "Socket Semantics").
PEER_TYPES = (b"DEALER", b"REQ", b"ROUTER")
READ_BYTES = 256 * 1024
READ_PER_EVENT = 4 << 20
BIG_FRAME = 64 * 1024   # a frame this long that has not fully arrived is received into its own buffer
MAX_FRAMES = 1 << 16    # frames of one message; more closes the connection


def _frame(body: bytes, *, more: bool = False, command: bool = False) -> bytes:
    flags = (_MORE if more else 0) | (_COMMAND if command else 0)
    n = len(body)
    if n <= 255:
        return bytes((flags, n))
    return bytes((flags | _LONG,)) + n.to_bytes(8, "big")


def _command(name: bytes, body: bytes = b"") -> bytes:
    data = bytes((len(name),)) + name + body
    return _frame(data, command=True) + data


def _properties(props: dict[bytes, bytes]) -> bytes:
    return b"".join(bytes((len(k),)) + k + len(v).to_bytes(4, "big") + v for k, v in props.items())


def _parse_properties(data: bytes) -> Optional[dict[bytes, bytes]]:
    props, i = {}, 0
    while i < len(data):
        n = data[i]
        name = data[i + 1:i + 1 + n]
        i += 1 + n
        if i + 4 > len(data):
            return None
        size = int.from_bytes(data[i:i + 4], "big")
        i += 4
        if i + size > len(data):
            return None
        props[bytes(name).lower()] = bytes(data[i:i + size])
        i += size
    return props


HANDSHAKE = GREETING + _command(b"READY", _properties({b"Socket-Type": b"ROUTER"}))


class ProtocolError(Exception):
    """The peer broke ZMTP; its connection is closed."""


class Connection:
    """One accepted peer: bytes not parsed yet, whole messages not taken yet, bytes not written."""

    __slots__ = ("sock", "fd", "identity", "account", "accepted", "since", "state", "inbuf", "ready", "out", "parts", "part_bytes",
                 "frames", "oversized", "closed", "polled", "replies", "big", "big_got", "big_more")

    def __init__(self, sock: socket.socket, identity: bytes) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.identity = identity
        #: Whom this connection's unverified requests are charged to: on ipc:// the peer process
        #: (its pid, from the kernel), so that reconnecting does not start a flood afresh; on
        #: tcp:// (no kernel identity for the peer) the connection itself.
        self.account = identity
        self.accepted = self.since = time.monotonic()    # since: accepted, or last seen with a session
        self.state = "greeting"                  # greeting -> ready (awaiting READY) -> open
        self.inbuf = bytearray()
        self.ready: collections.deque = collections.deque()   # (frames, problem) of whole messages
        self.out: collections.deque = collections.deque()     # bytes to write, in order
        self.parts: list[bytes] = []
        self.part_bytes = 0
        self.frames = 0
        self.oversized = False
        self.closed = False
        self.polled = 0                          # the poll flags registered for its fd
        self.replies = 0                         # messages sent to it
        self.big: Optional[bytearray] = None     # a long frame's body, received straight into place
        self.big_got = 0
        self.big_more = False

    @property
    def open(self) -> bool:
        return self.state == "open"

    def parse(self, max_message_bytes: int) -> None:
        """Take every whole greeting, command and message out of ``inbuf``."""
        buf, pos = self.inbuf, 0
        if self.state == "greeting":
            if len(buf) >= 1 and buf[0] != 0xFF:
                raise ProtocolError("not a ZMTP greeting")
            if len(buf) >= 10 and not buf[9] & 1:
                raise ProtocolError("a ZMTP 1.0 peer (lmshm needs ZMTP 3)")
            if len(buf) >= 11 and buf[10] < 3:
                raise ProtocolError(f"a ZMTP {buf[10]}.x peer (lmshm needs ZMTP 3)")
            if len(buf) < 64:
                return
            mechanism = bytes(buf[12:32]).rstrip(b"\x00")
            if mechanism != b"NULL":
                raise ProtocolError(f"security mechanism {mechanism[:20]!r} (lmshm speaks NULL)")
            pos, self.state = 64, "ready"
        n = len(buf)
        view = memoryview(buf)
        try:
            while pos < n:
                flags = buf[pos]
                if flags & ~(_MORE | _LONG | _COMMAND):
                    raise ProtocolError(f"bad frame flags 0x{flags:02x}")
                if flags & _LONG:
                    if pos + 9 > n:
                        break
                    size, head = int.from_bytes(view[pos + 1:pos + 9], "big"), 9
                else:
                    if pos + 2 > n:
                        break
                    size, head = buf[pos + 1], 2
                if size > max_message_bytes:
                    raise ProtocolError(f"a frame of {size} bytes, more than the server's limit of "
                                        f"{max_message_bytes} bytes")
                if pos + head + size > n:
                    if size >= BIG_FRAME and self.state == "open" and not flags & _COMMAND:
                        # The rest goes straight into its own buffer (``Listener._read``): no copies.
                        self.big, self.big_more = bytearray(size), bool(flags & _MORE)
                        self.big_got = n - pos - head
                        self.big[:self.big_got] = view[pos + head:n]
                        pos = n
                    break
                body = bytes(view[pos + head:pos + head + size])
                pos += head + size
                if flags & _COMMAND:
                    self._command(body)
                elif self.state != "open":
                    raise ProtocolError("a message before the handshake")
                else:
                    self._frame(body, bool(flags & _MORE), max_message_bytes)
        finally:
            view.release()
        if pos:
            del buf[:pos]

    def finish_big(self, max_message_bytes: int) -> None:
        body, self.big = self.big, None
        self._frame(body, self.big_more, max_message_bytes)

    def _command(self, body: bytes) -> None:
        if not body or len(body) < 1 + body[0]:
            raise ProtocolError("malformed command")
        name, data = body[1:1 + body[0]], body[1 + body[0]:]
        if self.state == "ready":
            if name != b"READY":
                raise ProtocolError(f"expected READY, got {name[:20]!r}")
            props = _parse_properties(data)
            if props is None:
                raise ProtocolError("malformed READY metadata")
            kind = props.get(b"socket-type", b"")
            if kind not in PEER_TYPES:
                raise ProtocolError(f"a {kind[:20]!r} socket cannot talk to a ROUTER")
            self.state = "open"
        elif name == b"PING" and len(data) >= 2:
            self.out.append(_command(b"PONG", data[2:18]))
        elif name == b"ERROR":
            raise ProtocolError("the peer sent ERROR")
        # anything else (SUBSCRIBE, PONG, ...) means nothing to a ROUTER: ignored

    def _frame(self, body: bytes, more: bool, max_message_bytes: int) -> None:
        self.frames += 1
        if self.frames > MAX_FRAMES:
            raise ProtocolError(f"a message of more than {MAX_FRAMES} frames")
        self.part_bytes += len(body)
        if self.part_bytes > max_message_bytes:
            self.oversized = True
            self.parts.clear()                   # counted, not kept
        elif not self.oversized:
            self.parts.append(body)
        if more:
            return
        problem = (f"message of {self.part_bytes} bytes exceeds the server's limit of {max_message_bytes} bytes"
                   if self.oversized else None)
        self.ready.append((self.parts, problem))
        self.parts, self.part_bytes, self.frames, self.oversized = [], 0, 0, False


#: Poll flags, the values of zmq.POLLIN, zmq.POLLOUT and zmq.POLLERR.
READABLE, WRITABLE, ERROR = 1, 2, 4
#: set_poll(fd, flags): poll ``fd`` for ``flags`` (READABLE, WRITABLE; 0 = not at all).
SetPoll = Callable[[int, int], None]


class ZmtpListener:
    """Accepts connections on a listening stream socket and speaks ZMTP on them (see the module
    docstring).

    The loop drives it: ``on_listener`` accepts, ``on_event`` reads and writes a connection,
    ``next_message`` hands out whole messages round robin, ``send`` queues a reply.
    ``headroom()`` says how many connections may be accepted now (the free fds less a
    reserve); while it says none, the listener is not polled, until ``resume()`` finds room.
    """

    def __init__(self, listener: socket.socket, *, max_message_bytes: int, send_queue: int,
                 headroom: Callable[[], int], set_poll: SetPoll,
                 accepted: Callable[[int], None] = lambda n: None) -> None:
        listener.setblocking(False)
        self.listener = listener
        self.listen_fd = listener.fileno()
        self.max_message_bytes = max_message_bytes
        self.send_queue = send_queue
        self._headroom = headroom
        self._accepted = accepted
        self._set_poll = set_poll
        self.paused = False
        self.conns: dict[int, Connection] = {}              # fd -> connection
        self._by_identity: dict[bytes, Connection] = {}
        self._with_messages: collections.deque[Connection] = collections.deque()
        self._ids = itertools.count(1)
        self.accepted = 0
        self.pauses = 0
        self._log_pause_at = 0.0
        self._set_poll(self.listen_fd, READABLE)

    # ---- accepting --------------------------------------------------------------------------
    def on_listener(self, limit: int = 32) -> int:
        """Accept up to ``limit`` waiting connections, and no more than ``headroom()`` allows;
        pause (stop polling the listener) when it allows none."""
        room = min(limit, self._headroom())
        n = 0
        try:
            while n < room:
                try:
                    sock, _ = self.listener.accept()
                except (BlockingIOError, InterruptedError):
                    return n
                except ConnectionAbortedError:
                    continue
                except OSError as exc:
                    if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                        self._pause(exc.strerror)
                        return n
                    raise
                n += 1
                self._add(sock)
            if room <= 0:
                self._pause("few file descriptors are free")
            return n
        finally:
            self._accepted(n)

    def pending(self) -> bool:
        """Whether a connection waits in the backlog."""
        p = select.poll()
        p.register(self.listen_fd, select.POLLIN)
        return bool(p.poll(0))

    def _pause(self, why: str) -> None:
        if not self.paused:
            self.paused = True
            self.pauses += 1
            self._set_poll(self.listen_fd, 0)
            if time.monotonic() >= self._log_pause_at:  # a flood toggles this many times a second
                self._log_pause_at = time.monotonic() + 10.0
                logger.warning("lmshm: not accepting connections for now (%s); they wait in the backlog "
                               "(%d pauses so far; logged at most every 10 s)", why, self.pauses)

    def resume(self) -> None:
        """Poll the listener again once fds are free (the loop calls this while paused)."""
        if self.paused and self._headroom() > 0:
            self.paused = False
            self._set_poll(self.listen_fd, READABLE)

    def _add(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as libzmq: a reply goes out at once
        identity = b"\x00" + (next(self._ids) & 0xFFFFFFFF).to_bytes(4, "big")  # a generated ROUTER id's shape
        conn = Connection(sock, identity)
        if sock.family == socket.AF_UNIX:
            try:
                pid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))[0]
                conn.account = b"pid:%d" % pid
            except OSError:
                pass
        self.conns[conn.fd] = conn
        self._by_identity[identity] = conn
        self.accepted += 1
        conn.out.append(HANDSHAKE)
        self._flush(conn)
        self._update(conn)

    def _update(self, conn: Connection) -> None:
        if conn.closed:
            return
        want = (0 if conn.ready else READABLE) | (WRITABLE if conn.out else 0)
        if want != conn.polled:
            conn.polled = want
            self._set_poll(conn.fd, want)

    # ---- events -----------------------------------------------------------------------------
    def on_event(self, fd: int, flags: int) -> None:
        conn = self.conns.get(fd)
        if conn is None:
            return
        if flags & WRITABLE:
            self._flush(conn)
        if flags & ~WRITABLE and not conn.closed:   # readable, or hung up / error: recv says which
            self._read(conn)
        self._update(conn)

    def _read(self, conn: Connection) -> None:
        got, had_messages = 0, bool(conn.ready)
        try:
            while got < READ_PER_EVENT:     # what is there, up to a bound: one peer cannot hold the loop
                big = conn.big
                try:
                    if big is not None:
                        with memoryview(big) as view:
                            n = conn.sock.recv_into(view[conn.big_got:])
                        conn.big_got += n
                    else:
                        data = conn.sock.recv(READ_BYTES)
                        n = len(data)
                        conn.inbuf += data
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    n = 0
                if not n:
                    self.close(conn)
                    return
                got += n
                if big is not None:
                    if conn.big_got == len(big):
                        conn.finish_big(self.max_message_bytes)
                elif n < READ_BYTES:
                    break
            if not got:
                return
            if conn.big is None:
                conn.parse(self.max_message_bytes)
        except ProtocolError as exc:
            logger.info("lmshm: closed a ZeroMQ connection: %s", exc)
            self.close(conn)
            return
        if conn.out:
            self._flush(conn)
        if conn.ready and not had_messages:
            self._with_messages.append(conn)

    def _flush(self, conn: Connection) -> None:
        while conn.out and not conn.closed:
            data = conn.out[0]
            try:
                sent = conn.sock.send(data)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.close(conn)
                return
            if sent < len(data):
                conn.out[0] = memoryview(data)[sent:]
                return
            conn.out.popleft()

    # ---- messages ---------------------------------------------------------------------------
    def has_messages(self) -> bool:
        return bool(self._with_messages)

    def next_message(self) -> Optional[tuple[bytes, list[bytes], Optional[str]]]:
        """(identity, frames, problem) of the next whole message, one connection at a time."""
        while self._with_messages:
            conn = self._with_messages.popleft()
            if conn.closed or not conn.ready:
                continue
            frames, problem = conn.ready.popleft()
            if conn.ready:
                self._with_messages.append(conn)
            else:
                self._update(conn)               # read it again
            return conn.identity, frames, problem
        return None

    def send(self, identity: bytes, frames: list[bytes]) -> bool:
        """Queue a reply to ``identity``; False if that peer is gone or has ``send_queue``
        replies waiting already (it does not read)."""
        conn = self._by_identity.get(identity)
        if conn is None or conn.closed or len(conn.out) >= self.send_queue:
            return False
        last = len(frames) - 1
        conn.out.append(b"".join(_frame(f, more=i < last) + f for i, f in enumerate(frames)))
        conn.replies += 1
        self._flush(conn)
        self._update(conn)
        return True

    def connection(self, identity: bytes) -> Optional[Connection]:
        return self._by_identity.get(identity)

    def close(self, conn: Connection) -> None:
        """Forget the connection and close its socket (its fd leaves the poll set first)."""
        if conn.closed:
            return
        conn.closed = True
        self.conns.pop(conn.fd, None)
        if self._by_identity.get(conn.identity) is conn:
            del self._by_identity[conn.identity]
        if conn.polled:
            self._set_poll(conn.fd, 0)
            conn.polled = 0
        conn.ready.clear()
        conn.out.clear()
        conn.inbuf = bytearray()
        conn.sock.close()

    def flush_all(self) -> None:
        """Write what can be written without waiting (before the server closes)."""
        for conn in list(self.conns.values()):
            self._flush(conn)

    def close_all(self) -> None:
        for conn in list(self.conns.values()):
            self.close(conn)
        self._set_poll(self.listen_fd, 0)
        self.listener.close()
