"""The remote tier's read path: RESP2 over a plain or TLS socket, replies read into given buffers.

Why not glide for reads: it hands a reply over only once it has received all of it, into its
own buffers. Here a ``GET`` reply's length comes first (``$N``): a value of another length than
the header said is refused before a byte of it is received, and the connection is closed; a
value of the right length goes from the kernel straight into the buffer with ``recv_into``, one
copy in all (docs/design/tiers.md). A long value is received in pieces (``PIECE``) when the
caller takes its checksum as it arrives (``progress``).

Only ``AUTH``, ``SELECT``, pipelined bounded ``GETRANGE``s, ``GET`` into a buffer and ``CLUSTER
SLOTS``. Every reply is bounded (``MAX_REPLY``, or the buffer's length for ``GET``), every call
by a deadline, and any surprise but an error reply closes the connection (the next call opens a
new one). The one trap: a connection is used by one thread at a time (``RemoteTier`` keeps one
per thread and node).
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
from typing import Callable, Optional, Sequence, Union

MAX_REPLY = 1 << 20         # bytes of any reply other than a GET into a buffer
MAX_ITEMS = 1 << 16         # elements of an array reply (CLUSTER SLOTS: a few per shard)
FRAMING = 4096              # a reply's bytes past its bound's: type lines, lengths, CRLFs
MAX_DEPTH = 4
MAX_LINE = 4096
SMALL_RECV = 512            # a GET reads its length line with this: little of the value lands before it
WAITALL_FROM = 1 << 20      # a value with this much left is received whole by one call (MSG_WAITALL)
#: With a ``progress`` callback, a value is received in pieces of this many bytes at most, each
#: handed over while it is still in the CPU's cache (half a core's L2 here; a checksum of a
#: 16 MiB value taken after the whole of it arrived read it back from memory at 8-10 GB/s,
#: against 34-45 GB/s from the cache: bench/remote_readback.py)
PIECE = 512 << 10

Reply = Union[bytes, int, None, list, "ErrorReply"]


class ProtocolError(Exception):
    """The server's reply broke the protocol or a bound; the connection is closed."""


class WrongLength(Exception):
    """A ``GET`` reply of another length than the buffer's; the connection is closed."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(f"the value is {nbytes} bytes")
        self.nbytes = nbytes


class ErrorReply(Exception):
    """An error reply (``-ERR ...``, ``-MOVED slot host:port``): the connection stays usable."""

    @property
    def moved(self) -> Optional[tuple[int, str, int]]:
        """``(slot, host, port)`` of a ``MOVED`` or ``ASK`` redirection; None otherwise."""
        words = str(self).split()
        if len(words) != 3 or words[0] not in ("MOVED", "ASK") or not words[1].isdigit():
            return None
        host, _, port = words[2].rpartition(":")
        return (int(words[1]), host, int(port)) if port.isdigit() else None


def command(*args: bytes) -> bytes:
    """One command in RESP's request form (an array of bulk strings)."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


class Connection:
    """One RESP2 connection to ``host:port`` (TLS with ``tls``), authenticated and on database
    ``db``; ``OSError``, ``ProtocolError`` or ``ErrorReply`` from the constructor otherwise."""

    def __init__(self, host: str, port: int, *, timeout_s: float, tls: Optional[ssl.SSLContext] = None,
                 username: str = "", password: str = "", db: int = 0) -> None:
        self.address = (host, port)
        self.timeout_s = timeout_s
        self._pending = bytearray()     # received and not consumed yet
        self._spill = memoryview(bytearray(SMALL_RECV))     # what a scattered read got past a value
        self._deadline = 0.0
        self._left = 0                  # bytes the reply being parsed may still take
        self._rcvtimeo = 0.0
        self.closed = False
        sock = socket.create_connection((host, port), timeout=timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=host)
            else:
                # a plain socket blocks, bounded by the kernel (SO_RCVTIMEO, SO_SNDTIMEO): one
                # system call a read, where Python's own timeout polls before each
                sock.settimeout(None)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(timeout_s))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(timeout_s))
                self._rcvtimeo = timeout_s
        except BaseException:
            sock.close()
            raise
        self.sock: socket.socket = sock
        self.kernel_timeouts = tls is None
        try:
            if password:
                self.call((b"AUTH", username.encode(), password.encode()) if username
                          else (b"AUTH", password.encode()))
            if db:
                self.call((b"SELECT", str(db).encode()))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()

    # ---- requests -------------------------------------------------------------------
    def call(self, args: Sequence[bytes]) -> Reply:
        """One command and its reply (an ``ErrorReply`` raised)."""
        return self.pipeline([args], MAX_REPLY, raise_errors=True)[0]

    def pipeline(self, commands: Sequence[Sequence[bytes]], limit: int, raise_errors: bool = False) -> list[Reply]:
        """The replies to ``commands``, sent at once; each reply at most ``limit`` bytes. Error
        replies are returned as ``ErrorReply`` values (raised with ``raise_errors``)."""
        self._start()
        try:
            self._send(b"".join(command(*c) for c in commands))
            replies = []
            for _ in commands:
                self._left = limit + FRAMING    # the whole reply's bytes, nested arrays included
                replies.append(self._reply(limit, 0))
        except BaseException:
            self.close()
            raise
        if raise_errors:
            for r in replies:
                if isinstance(r, ErrorReply):
                    raise r
        return replies

    def get_into(self, key: bytes, buf: memoryview, progress: Optional[Callable[[int], None]] = None) -> int:
        """``GET key`` read into ``buf`` (``request_gets`` and ``reply_into``)."""
        self.request_gets([key])
        return self.reply_into(buf, progress)

    def request_gets(self, keys: Sequence[bytes]) -> None:
        """Sends a ``GET`` of each key at once; ``reply_into`` then reads their replies in order.
        A caller that stops reading before the last must ``close`` the connection."""
        self._start()
        try:
            self._send(b"".join(command(b"GET", k) for k in keys))
        except BaseException:
            self.close()
            raise

    def reply_into(self, buf: memoryview, progress: Optional[Callable[[int], None]] = None) -> int:
        """The next ``GET`` reply read into ``buf``, within the timeout: ``len(buf)``, or 0 when
        the key is missing; ``WrongLength`` (the connection closed, nothing of the value
        received) when the value is of another length, ``ErrorReply`` for an error reply.
        ``progress(filled)``, if given, is called as the value arrives, with how many bytes of
        ``buf`` are filled (last with ``len(buf)``), a ``PIECE`` at most between calls: a
        checksum taken there reads each piece from the cache (``value.Streamed``)."""
        self._start()
        try:
            line = self._line(SMALL_RECV)
            if line[:1] == b"-":
                raise ErrorReply(line[1:].decode(errors="replace"))
            if line[:1] != b"$":
                raise ProtocolError(f"GET answered {line[:40]!r}")
            n = _int(line[1:])
            if n == -1:
                return 0
            if n != len(buf):
                raise WrongLength(n)
            got = min(len(self._pending), n)
            buf[:got] = self._pending[:got]
            del self._pending[:got]
            if progress is not None:
                progress(got)
            while got < n:
                self._timeout()
                if progress is not None and n - got > PIECE:
                    got += self._recv_piece(buf[got:got + PIECE])
                else:
                    got += self._recv_value(buf[got:])
                if progress is not None:
                    progress(got)
            self._crlf()
        except ErrorReply:
            raise
        except BaseException:
            self.close()
            raise
        return n

    # ---- reading ----------------------------------------------------------------------
    def _start(self) -> None:
        if self.closed:
            raise ConnectionError("closed")
        self._deadline = time.monotonic() + self.timeout_s
        if self.kernel_timeouts and self._rcvtimeo < self.timeout_s / 2:
            self._set_rcvtimeo(self.timeout_s)      # lowered near an earlier deadline

    def _timeout(self) -> None:
        """Bound the next system call by what is left of the deadline."""
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no reply within {self.timeout_s:g} s")
        if not self.kernel_timeouts:
            self.sock.settimeout(left)
        elif left < self._rcvtimeo * 0.9:       # so a call ends at most 11 % past the deadline
            self._set_rcvtimeo(left)

    def _send(self, data: bytes) -> None:
        if not self.kernel_timeouts:
            self.sock.settimeout(self.timeout_s)
        try:
            self.sock.sendall(data)
        except BlockingIOError:
            raise TimeoutError(f"could not send within {self.timeout_s:g} s") from None

    def _set_rcvtimeo(self, seconds: float) -> None:
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))
        self._rcvtimeo = seconds

    def _recv_value(self, rest: memoryview) -> int:
        """Receive into ``rest`` (the rest of a value); how many bytes of it came. On a plain
        socket, a short rest is received with what comes past it (the value's CRLF, the next
        reply's length line) in the spill buffer, in the same system call, kept as pending;
        a long one is received whole by one call."""
        try:
            if not self.kernel_timeouts:
                k = self.sock.recv_into(rest)
            elif len(rest) >= WAITALL_FROM:
                # the kernel fills it before returning (short only at SO_RCVTIMEO or a close):
                # one call where a return per socket-buffer's worth took about 70 for a 16 MiB
                # value (bench/remote_readback.py: 287 -> 244 ms of CPU per GB at 2 MiB)
                k = self.sock.recv_into(rest, 0, socket.MSG_WAITALL)
            else:
                k = self.sock.recvmsg_into([rest, self._spill])[0]
        except BlockingIOError:
            raise TimeoutError(f"no reply within {self.timeout_s:g} s") from None
        if not k:
            raise ConnectionError("the server closed the connection")
        if k > len(rest):
            self._pending += self._spill[:k - len(rest)]
            return len(rest)
        return k

    def _recv_piece(self, piece: memoryview) -> int:
        """Receive into ``piece``, a part of a value short of its end (so nothing past it may be
        received with it); how many bytes came: all of it, on a plain socket (MSG_WAITALL)."""
        try:
            k = self.sock.recv_into(piece, 0, socket.MSG_WAITALL) if self.kernel_timeouts else self.sock.recv_into(piece)
        except BlockingIOError:
            raise TimeoutError(f"no reply within {self.timeout_s:g} s") from None
        if not k:
            raise ConnectionError("the server closed the connection")
        return k

    def _fill(self, size: int) -> None:
        self._timeout()
        try:
            data = self.sock.recv(size)
        except BlockingIOError:
            raise TimeoutError(f"no reply within {self.timeout_s:g} s") from None
        if not data:
            raise ConnectionError("the server closed the connection")
        self._pending += data

    def _line(self, recv_size: int = 65536) -> bytes:
        while True:
            end = self._pending.find(b"\r\n")
            if end >= 0:
                line = bytes(self._pending[:end])
                del self._pending[:end + 2]
                return line
            if len(self._pending) > MAX_LINE:
                raise ProtocolError("a reply line longer than %d bytes" % MAX_LINE)
            self._fill(recv_size)

    def _crlf(self) -> None:
        while len(self._pending) < 2:
            self._fill(SMALL_RECV)      # the next reply's length line too, when it is there
        if self._pending[:2] != b"\r\n":
            raise ProtocolError("a bulk reply not ended by CRLF")
        del self._pending[:2]

    def _spend(self, nbytes: int) -> None:
        self._left -= nbytes
        if self._left < 0:
            raise ProtocolError("a reply longer than its bound")

    def _reply(self, limit: int, depth: int) -> Reply:
        line = self._line()
        self._spend(len(line) + 2)
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            return ErrorReply(rest.decode(errors="replace"))
        if kind == b":":
            return _int(rest)
        if kind == b"$":
            n = _int(rest)
            if n == -1:
                return None
            if not 0 <= n <= limit:
                raise ProtocolError(f"a {n}-byte reply where at most {limit} are expected")
            self._spend(n + 2)
            while len(self._pending) < n + 2:
                self._fill(max(65536, n + 2 - len(self._pending)))
            value = bytes(self._pending[:n])
            if self._pending[n:n + 2] != b"\r\n":
                raise ProtocolError("a bulk reply not ended by CRLF")
            del self._pending[:n + 2]
            return value
        if kind == b"*":
            n = _int(rest)
            if n == -1:
                return None
            if not 0 <= n <= MAX_ITEMS or depth >= MAX_DEPTH:
                raise ProtocolError(f"an array of {n} items at depth {depth}")
            return [self._reply(limit, depth + 1) for _ in range(n)]
        raise ProtocolError(f"an unknown reply {line[:40]!r}")


def _timeval(seconds: float) -> bytes:
    """``seconds`` as a ``struct timeval``, at least a microsecond (0 would mean no bound)."""
    micros = max(1, int(seconds * 1e6))
    return struct.pack("ll", micros // 1_000_000, micros % 1_000_000)


def _int(raw: bytes) -> int:
    if not raw or len(raw) > 20 or not raw.lstrip(b"-").isdigit():
        raise ProtocolError(f"not an integer: {raw[:40]!r}")
    return int(raw)


def tls_context(ca_pem: Optional[bytes]) -> ssl.SSLContext:
    """The client's TLS context: the system's roots, or only ``ca_pem``'s certificates."""
    return ssl.create_default_context(cadata=ca_pem.decode("ascii", errors="replace")) if ca_pem \
        else ssl.create_default_context()


def slot_map(reply: Reply) -> dict[int, tuple[str, int]]:
    """``CLUSTER SLOTS``'s reply as ``{slot: (host, port)}`` of each slot's primary;
    ``ProtocolError`` for a reply of another shape."""
    if not isinstance(reply, list):
        raise ProtocolError("CLUSTER SLOTS did not answer an array")
    slots: dict[int, tuple[str, int]] = {}
    for shard in reply:
        if not (isinstance(shard, list) and len(shard) >= 3 and isinstance(shard[0], int)
                and isinstance(shard[1], int) and isinstance(shard[2], list) and len(shard[2]) >= 2
                and isinstance(shard[2][0], bytes) and isinstance(shard[2][1], int)):
            raise ProtocolError("CLUSTER SLOTS answered an entry of another shape")
        lo, hi = max(0, shard[0]), min(16383, shard[1])
        node = (shard[2][0].decode(errors="replace"), shard[2][1])
        for s in range(lo, hi + 1):
            slots[s] = node
    return slots
