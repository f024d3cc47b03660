"""lmshm-server's listener: ZMTP 3.1 (mechanism NULL) spoken by the server's own loop, a ROUTER
to libzmq's DEALER and REQ peers, on ``tcp://`` and ``ipc://``.

Why not libzmq's listeners: they accept in libzmq's thread whenever a connection waits, and on
EMFILE an ipc one aborts the process while a tcp one fills the fd table. Here the loop accepts,
only while the caller's ``headroom()`` allows; the rest wait in the kernel's backlog.

Memory follows the bytes a peer sent, never the lengths it claims; peers without a verified
session get smaller limits and a shared budget; work per turn of the loop is bounded. One
file, over 600 lines: the greeting, the frame parser and those limits are one state machine
per connection, and splitting them would spread one peer's state over several modules.
docs/design/transport.md has the limits and the reasons. The trap: a peer's bytes arrive in any
split, so every parser step must stop cleanly at the end of the buffer and resume there.
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

from lmshm.core.logs import Throttle

logger = logging.getLogger(__name__)
_closed_log = Throttle(logger)      # peers cause these: at most a line every 10 s each
_budget_log = Throttle(logger)

_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04
GREETING = (b"\xff" + b"\x00" * 8 + b"\x7f"           # signature
            + bytes([3, 1])                             # ZMTP 3.1
            + b"NULL".ljust(20, b"\x00")                # mechanism
            + b"\x00" + b"\x00" * 31)                   # as-server (unused by NULL), filler
assert len(GREETING) == 64
#: Socket types a ROUTER talks to (ZMTP 3.1, "Socket Semantics").
PEER_TYPES = (b"DEALER", b"REQ", b"ROUTER")
READ_BYTES = 256 * 1024
READ_PER_EVENT = 4 << 20      # the most one read event takes from a verified peer
BIG_FRAME = 64 * 1024   # a frame this long that has not fully arrived is received into its own buffer
MAX_FRAMES = 1 << 16    # frames of one message; more closes the connection
KEPT_FRAMES = 16        # frames of one message that are kept; past them it is a problem (lmshm's have 2)
MAX_COMMAND = 64 << 10  # a longer command (READY, PING, ...) closes the connection
#: Work one parse may do: frames and commands taken, and whole messages parsed ahead of the
#: server (then the connection waits: nothing more is parsed or read until they are taken).
PARSE_ITEMS = 256
READY_AHEAD = 16
#: A peer without a verified session (``trusted`` says which) may send HELLO, PING and STATUS,
#: all small: its messages may hold at most this many bytes (a longer one is read and thrown
#: away as it arrives, and answered as a problem), one read event takes at most this much of
#: it, and at most two of its messages are parsed ahead.
UNVERIFIED_MESSAGE = 64 << 10
UNVERIFIED_READ = 64 << 10
UNVERIFIED_AHEAD = 2
#: What all connections without a verified session may hold together (bytes received and not
#: yet taken by the server); past it, the ones holding the most are closed.
UNVERIFIED_BUDGET = 16 << 20
#: Bytes queued for a peer that does not read: past ``OUT_PAUSE`` its connection is not read
#: or parsed (so its PINGs and requests make no more output) until they drain; a reply is
#: refused when ``send_bytes`` would be passed (unless nothing else waits).
OUT_PAUSE = 256 << 10
SEND_BYTES = 8 << 20

_scratch = bytearray(READ_BYTES)     # where the bytes of a frame being thrown away are received


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
    """One accepted peer: bytes not parsed yet, whole messages not taken yet, bytes not written.

    Memory held for it grows only with the bytes it sent: a long frame is received into a
    buffer that grows as its bytes arrive (never allocated from the length its header claims),
    and a frame longer than the peer may send is received into a scratch buffer and thrown away.
    """

    __slots__ = ("sock", "fd", "identity", "account", "accepted", "since", "state", "inbuf", "ready", "ready_bytes",
                 "out", "out_bytes", "parts", "part_bytes", "frames", "oversized", "refused", "closed", "polled",
                 "replies", "big", "big_size", "big_more", "skip", "skip_more", "unparsed", "charged")

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
        self.ready_bytes = 0                     # the bytes of the frames in ``ready``
        self.out: collections.deque = collections.deque()     # bytes to write, in order
        self.out_bytes = 0
        self.parts: list[bytes] = []
        self.part_bytes = 0                      # bytes of the message so far, kept or not
        self.frames = 0
        self.oversized = False                   # the message so far is over a limit: counted, not kept
        self.refused = ("", 0)                   # which limit it is over, and the limit
        self.closed = False
        self.polled = 0                          # the poll flags registered for its fd
        self.replies = 0                         # messages sent to it
        self.big: Optional[bytearray] = None     # a long frame's body so far, received straight into place
        self.big_size = 0
        self.big_more = False
        self.skip = 0                            # bytes of a refused frame still to be thrown away
        self.skip_more = False
        self.unparsed = False                    # parse stopped with whole frames left in ``inbuf``
        self.charged = 0                         # what it counts against the unverified budget

    @property
    def open(self) -> bool:
        return self.state == "open"

    def held(self) -> int:
        """Bytes received from this peer and not yet taken by the server."""
        return (len(self.inbuf) + (len(self.big) if self.big is not None else 0) + self.ready_bytes
                + sum(len(p) for p in self.parts))

    def queue(self, data: bytes) -> None:
        self.out.append(data)
        self.out_bytes += len(data)

    def parse(self, max_message_bytes: int, trusted: bool = True) -> None:
        """Take whole greetings, commands and messages out of ``inbuf``, as much as one parse
        may (``PARSE_ITEMS``, ``READY_AHEAD``, ``OUT_PAUSE``); ``unparsed`` says whether it
        stopped with bytes left that may hold more. ``trusted``: a peer with a verified
        session, whose messages may be ``max_message_bytes`` long (else ``UNVERIFIED_MESSAGE``)."""
        buf, pos = self.inbuf, 0
        self.unparsed = False
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
        limit = max_message_bytes if trusted else min(max_message_bytes, UNVERIFIED_MESSAGE)
        ahead = READY_AHEAD if trusted else UNVERIFIED_AHEAD
        items = 0
        try:
            while pos < n:
                if items >= PARSE_ITEMS or len(self.ready) >= ahead or self.out_bytes >= OUT_PAUSE:
                    self.unparsed = True
                    break
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
                more = bool(flags & _MORE)
                if flags & _COMMAND:
                    if size > MAX_COMMAND:
                        raise ProtocolError(f"a command of {size} bytes (at most {MAX_COMMAND})")
                    if pos + head + size > n:
                        break
                    body = bytes(view[pos + head:pos + head + size])
                    pos += head + size
                    items += 1
                    self._command(body)
                    continue
                if self.state != "open":
                    raise ProtocolError("a message before the handshake")
                items += 1
                if size > limit - self.part_bytes or self.frames >= KEPT_FRAMES:
                    # Over a limit: its bytes are thrown away as they arrive, and its message is
                    # answered as a problem; nothing is allocated for it.
                    self._refuse(size, trusted or limit == max_message_bytes, limit)
                    have = min(size, n - pos - head)
                    pos += head + have
                    if have < size:
                        self.skip, self.skip_more = size - have, more
                        break
                    self._end_frame(more)
                    continue
                if pos + head + size > n:
                    if size >= BIG_FRAME:
                        # The rest goes straight into its own buffer (``ZmtpListener._read``),
                        # which grows with what arrives.
                        self.big, self.big_size, self.big_more = bytearray(view[pos + head:n]), size, more
                        pos = n
                    break
                body = bytes(view[pos + head:pos + head + size])
                pos += head + size
                self._frame(body, more)
        finally:
            view.release()
        if pos:
            del buf[:pos]

    def finish_big(self) -> None:
        body, self.big = self.big, None
        self._frame(body, self.big_more)

    def skipped(self, n: int) -> None:
        """``n`` more bytes of a refused frame were thrown away."""
        self.skip -= n
        if not self.skip:
            self._end_frame(self.skip_more)

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
            self.queue(_command(b"PONG", data[2:18]))
        elif name == b"ERROR":
            raise ProtocolError("the peer sent ERROR")
        # anything else (SUBSCRIBE, PONG, ...) means nothing to a ROUTER: ignored

    def _refuse(self, size: int, trusted: bool, limit: int) -> None:
        """The frame of ``size`` bytes that starts now is not kept (see ``parse``)."""
        if not self.oversized:
            self.refused = ("frames" if self.frames >= KEPT_FRAMES else "limit" if trusted else "unverified", limit)
        self.oversized = True
        self.parts.clear()
        self.part_bytes += size
        self.frames += 1

    def _problem(self) -> str:
        kind, limit = self.refused
        if kind == "frames":
            return f"a message of more than {KEPT_FRAMES} frames (lmshm's requests have 2)"
        if kind == "limit":
            return f"message of {self.part_bytes} bytes exceeds the server's limit of {limit} bytes"
        return (f"message of {self.part_bytes} bytes from a peer without a verified session: such a peer may send "
                f"messages of at most {limit} bytes (HELLO, PING and STATUS); a worker proves its identity on the "
                "fd channel first")

    def _frame(self, body: bytes, more: bool) -> None:
        self.frames += 1
        self.part_bytes += len(body)
        if not self.oversized:
            self.parts.append(body)
        self._end_frame(more)

    def _end_frame(self, more: bool) -> None:
        if self.frames > MAX_FRAMES:
            raise ProtocolError(f"a message of more than {MAX_FRAMES} frames")
        if more:
            return
        if self.oversized:
            self.ready.append(([], self._problem()))
        else:
            self.ready.append((self.parts, None))
            self.ready_bytes += self.part_bytes
        self.parts, self.part_bytes, self.frames, self.oversized, self.refused = [], 0, 0, False, ("", 0)


#: Poll flags, the values of zmq.POLLIN, zmq.POLLOUT and zmq.POLLERR.
READABLE, WRITABLE, ERROR = 1, 2, 4
#: set_poll(fd, flags): poll ``fd`` for ``flags`` (READABLE, WRITABLE; 0 = not at all).
SetPoll = Callable[[int, int], None]


class ZmtpListener:
    """Accepts connections on a listening stream socket and speaks ZMTP on them (see the module
    docstring).

    The loop drives it: ``on_listener`` accepts, ``on_event`` reads and writes a connection,
    ``pump`` parses what earlier reads left (one bounded parse per connection and call),
    ``next_message`` hands out whole messages round robin, ``send`` queues a reply.
    ``headroom()`` says how many connections may be accepted now (the free fds less a
    reserve); while it says none, the listener is not polled, until ``resume()`` finds room.
    ``trusted(identity)`` says whether a connection's peer has a verified session: the others
    get the ``UNVERIFIED_*`` limits and share ``unverified_budget`` bytes among them.
    """

    def __init__(self, listener: socket.socket, *, max_message_bytes: int, send_queue: int,
                 headroom: Callable[[], int], set_poll: SetPoll,
                 accepted: Callable[[int], None] = lambda n: None,
                 trusted: Callable[[bytes], bool] = lambda identity: True,
                 send_bytes: int = SEND_BYTES, unverified_budget: int = UNVERIFIED_BUDGET) -> None:
        listener.setblocking(False)
        self.listener = listener
        self.listen_fd = listener.fileno()
        self.max_message_bytes = max_message_bytes
        self.send_queue = send_queue
        self.send_bytes = send_bytes
        self.trusted = trusted
        self.unverified_budget = unverified_budget
        self.unverified_bytes = 0           # what connections without a verified session hold
        self.over_budget = 0                # connections closed for the budget
        self._to_parse: collections.deque[Connection] = collections.deque()
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
        conn.queue(HANDSHAKE)
        self._flush(conn)
        self._update(conn)

    def _update(self, conn: Connection) -> None:
        """Poll its fd for what it waits for: read only while nothing it sent waits to be parsed
        or taken, and little waits to be written to it."""
        if conn.closed:
            return
        reading = not conn.ready and not conn.unparsed and conn.out_bytes < OUT_PAUSE
        want = (READABLE if reading else 0) | (WRITABLE if conn.out else 0)
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
        trusted = self.trusted(conn.identity)
        budget = READ_PER_EVENT if trusted else UNVERIFIED_READ
        chunk = min(READ_BYTES, budget)
        got, had_messages = 0, bool(conn.ready)
        try:
            while got < budget:     # what is there, up to a bound: one peer cannot hold the loop
                big = conn.big
                try:
                    if conn.skip:
                        with memoryview(_scratch) as view:
                            n = conn.sock.recv_into(view[:min(conn.skip, chunk)])
                    elif big is not None:
                        data = conn.sock.recv(min(conn.big_size - len(big), chunk))
                        n = len(data)
                        big += data
                    else:
                        data = conn.sock.recv(chunk)
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
                if conn.skip:
                    conn.skipped(n)
                elif big is not None:
                    if len(big) == conn.big_size:
                        conn.finish_big()
                elif n < chunk:
                    break
            if not got:
                return
            if conn.big is None and not conn.skip:
                conn.parse(self.max_message_bytes, trusted)
        except ProtocolError as exc:
            self._broke(conn, exc)
            return
        self._settle(conn, trusted, had_messages)
        if not trusted and self.unverified_bytes > self.unverified_budget:
            self._enforce_budget()

    def _settle(self, conn: Connection, trusted: bool, had_messages: bool) -> None:
        """After a read or parse: write what it produced, queue its messages and what is left
        to parse, and charge what it holds to the unverified budget."""
        if conn.out:
            self._flush(conn)
        if conn.closed:
            return
        if conn.ready and not had_messages:
            self._with_messages.append(conn)
        elif conn.unparsed and not conn.ready and conn.out_bytes < OUT_PAUSE:
            self._to_parse.append(conn)      # stopped at PARSE_ITEMS: the loop's next turn goes on
        self._charge(conn, trusted)

    def _charge(self, conn: Connection, trusted: Optional[bool] = None) -> None:
        if trusted is None:
            trusted = self.trusted(conn.identity)
        held = 0 if trusted or conn.closed else conn.held()
        self.unverified_bytes += held - conn.charged
        conn.charged = held

    def _enforce_budget(self) -> None:
        """Connections without a verified session hold more than ``unverified_budget``: close
        the ones that hold the most (an honest peer's HELLO is parsed as it arrives and holds
        nothing), until three quarters of the budget are left."""
        goal = self.unverified_budget * 3 // 4
        for conn in sorted((c for c in self.conns.values() if c.charged), key=lambda c: c.charged, reverse=True):
            if self.unverified_bytes <= goal:
                break
            self.close(conn)
            self.over_budget += 1
        _budget_log.warning("lmshm: connections without a verified session held more than %d bytes they sent and "
                            "the server had not taken yet; closed the ones holding the most (%d so far)",
                            self.unverified_budget, self.over_budget)

    def pump(self) -> None:
        """Parse once more each connection whose last parse stopped at its bound (the loop
        calls this every turn, so other peers are served between two parses of a flood)."""
        for _ in range(len(self._to_parse)):
            conn = self._to_parse.popleft()
            if conn.closed or conn.ready or not conn.unparsed or conn.out_bytes >= OUT_PAUSE:
                continue
            trusted = self.trusted(conn.identity)
            try:
                conn.parse(self.max_message_bytes, trusted)
            except ProtocolError as exc:
                self._broke(conn, exc)
                continue
            self._settle(conn, trusted, False)
            self._update(conn)

    def _broke(self, conn: Connection, exc: ProtocolError) -> None:
        """The peer broke ZMTP: its connection is closed (and a line logged, rate-limited)."""
        _closed_log.info("lmshm: closed a ZeroMQ connection: %s", exc)
        self.close(conn)

    def _flush(self, conn: Connection) -> None:
        paused = conn.out_bytes >= OUT_PAUSE
        while conn.out and not conn.closed:
            data = conn.out[0]
            try:
                sent = conn.sock.send(data)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.close(conn)
                return
            conn.out_bytes -= sent
            if sent < len(data):
                conn.out[0] = memoryview(data)[sent:]
                break
            conn.out.popleft()
        if paused and conn.out_bytes < OUT_PAUSE and conn.unparsed and not conn.ready and not conn.closed:
            self._to_parse.append(conn)      # it stopped parsing for its output; that has drained

    # ---- messages ---------------------------------------------------------------------------
    def has_messages(self) -> bool:
        """Whether messages wait to be taken, or input to be parsed (the loop must not sleep)."""
        return bool(self._with_messages or self._to_parse)

    def next_message(self) -> Optional[tuple[bytes, list[bytes], Optional[str]]]:
        """(identity, frames, problem) of the next whole message, one connection at a time."""
        while self._with_messages:
            conn = self._with_messages.popleft()
            if conn.closed or not conn.ready:
                continue
            frames, problem = conn.ready.popleft()
            for f in frames:
                conn.ready_bytes -= len(f)
            if conn.ready:
                self._with_messages.append(conn)
            elif conn.unparsed:
                self._to_parse.append(conn)      # more whole frames may wait in its buffer
            self._update(conn)                   # read it again once nothing waits
            if conn.charged:
                self._charge(conn)
            return conn.identity, frames, problem
        return None

    def send(self, identity: bytes, frames: list[bytes]) -> bool:
        """Queue a reply to ``identity``; False if that peer is gone or has ``send_queue``
        replies waiting already (it does not read)."""
        conn = self._by_identity.get(identity)
        if conn is None or conn.closed or len(conn.out) >= self.send_queue:
            return False
        size = sum(len(f) + 9 for f in frames)
        if conn.out_bytes and conn.out_bytes + size > self.send_bytes:
            return False
        last = len(frames) - 1
        conn.queue(b"".join(_frame(f, more=i < last) + f for i, f in enumerate(frames)))
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
        self.unverified_bytes -= conn.charged
        conn.charged = 0
        conn.ready.clear()
        conn.out.clear()
        conn.out_bytes = conn.ready_bytes = 0
        conn.inbuf = bytearray()
        conn.big = None
        conn.parts = []
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
