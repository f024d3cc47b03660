"""The fd side channel: a Unix socket beside the server that carries file descriptors.

Why: a memfd (isolated CPU mode) or a VMM POSIX-fd handle cannot travel as bytes; the
kernel must copy the descriptor into the server (SCM_RIGHTS). ZeroMQ cannot do that, so
each worker session also opens one connection to this ``AF_UNIX``/``SOCK_SEQPACKET`` socket
(message boundaries are kept, and the fds ride on the message that names their tokens).

Conversation, one small JSON message each way, every client message acknowledged:
  client: {"op": "auth", "token": <session_token from HELLO_REPLY>}      server: {"ok": true}
  client: {"op": "fds", "tokens": [t1, t2, ...]}  + SCM_RIGHTS [fd1, ...]  server: {"ok": true}
Failures answer ``{"ok": false, "code": "PERMISSION_DENIED" | "INVALID_ARG", "error": ...}``.

Ownership: received fds go to ``FD_INBOX`` filed under the *session*; the inbox owns them,
and they are closed exactly once when the session ends (``close_session``). An fd that comes
without a matching token, on an unauthenticated connection, or twice, is closed at once.

Security: the socket file is created mode 0600 and the peer's credentials (SO_PEERCRED) must
show the server's uid (or root) before anything is read. The connection also serves as the
session's liveness link: the kernel closes it when the worker dies, in any PID namespace,
and the server reclaims the session on that EOF.

Easy to get wrong: ``recvmsg`` may deliver fds even when the message is refused, and may
truncate them (MSG_CTRUNC); every path below closes what arrived before answering.
"""

from __future__ import annotations

import array
import json
import logging
import os
import socket
import struct
import tempfile
from dataclasses import dataclass
from typing import Callable, Hashable, Optional

from lmshm.platform.base.fds import FD_INBOX

logger = logging.getLogger(__name__)

MAX_FDS_PER_MESSAGE = 250   # below the kernel's SCM_MAX_FD (253)
MAX_MESSAGE_BYTES = 64 * 1024
_ANCILLARY = socket.CMSG_SPACE(MAX_FDS_PER_MESSAGE * array.array("i").itemsize)


class FdChannelError(RuntimeError):
    """The fd channel refused a request or could not be reached."""

    def __init__(self, message: str, code: str = "UNAVAILABLE") -> None:
        super().__init__(message)
        self.code = code


def default_path(url: str) -> str:
    """The fd socket that belongs to a server endpoint: beside an ipc:// socket, else in /tmp."""
    if url.startswith("ipc://"):
        return url[len("ipc://"):] + ".fds"
    hostport = url.split("://", 1)[-1].replace(":", "-").replace("/", "_").replace("*", "0")
    return os.path.join(tempfile.gettempdir(), f"lmshm-{hostport}.fds")


def _peer_uid(sock: socket.socket) -> tuple[int, int]:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# ---- server side ------------------------------------------------------------------------


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer_pid: int
    session: Optional[Hashable] = None


class FdChannelServer:
    """Listens on ``path``; files received fds in ``FD_INBOX`` under the peer's session.

    ``authenticate(token)`` maps a session token to a session id (or None);
    ``on_link_closed(session)`` runs when an authenticated connection ends (the worker
    closed it or died). ``watch(fd, callback)``/``unwatch(fd)`` hook sockets into the
    server's poll loop; nothing here blocks.
    """

    def __init__(
        self,
        path: str,
        *,
        authenticate: Callable[[str], Optional[Hashable]],
        on_link_closed: Callable[[Hashable], None],
        watch: Callable[[int, Callable[[], None]], None],
        unwatch: Callable[[int], None],
    ) -> None:
        self.path = path
        self._authenticate = authenticate
        self._on_link_closed = on_link_closed
        self._watch, self._unwatch = watch, unwatch
        self._conns: dict[int, _Conn] = {}
        self._links: dict[Hashable, _Conn] = {}
        self._uid = os.geteuid()
        self._listener = self._listen(path)
        self._watch(self._listener.fileno(), self._accept)

    @staticmethod
    def _listen(path: str) -> socket.socket:
        if os.path.exists(path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # stale: nobody listens there any more
            else:
                raise FdChannelError(f"fd socket {path} is in use by another lmshm-server; choose another --fd-socket")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old = os.umask(0o177)
        try:
            sock.bind(path)
        except OSError as exc:
            sock.close()
            raise FdChannelError(f"cannot create fd socket {path}: {exc.strerror}") from None
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        sock.listen(128)
        sock.setblocking(False)
        return sock

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(False)
        pid, uid = _peer_uid(sock)
        if uid != self._uid and uid != 0:
            logger.warning("lmshm: fd channel refused pid %d (uid %d, server uid %d)", pid, uid, self._uid)
            self._send(sock, {"ok": False, "code": "PERMISSION_DENIED",
                              "error": f"peer uid {uid} differs from the server's uid {self._uid}"})
            sock.close()
            return
        conn = _Conn(sock, pid)
        self._conns[sock.fileno()] = conn
        self._watch(sock.fileno(), lambda: self._readable(conn))

    @staticmethod
    def _send(sock: socket.socket, msg: dict) -> bool:
        try:
            sock.send(json.dumps(msg).encode())
            return True
        except OSError:
            return False

    def _readable(self, conn: _Conn) -> None:
        try:
            data, ancdata, flags, _ = conn.sock.recvmsg(MAX_MESSAGE_BYTES, _ANCILLARY)
        except BlockingIOError:
            return
        except OSError:
            data, ancdata, flags = b"", [], 0
        fds: list[int] = []
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
                fds.extend(arr)
        if not data:
            _close_fds(fds)
            self._drop(conn)
            return
        try:
            reply = self._handle(conn, data, fds, flags)
        except FdChannelError as exc:
            reply = {"ok": False, "code": exc.code, "error": str(exc)}
        if not self._send(conn.sock, reply):
            self._drop(conn)

    def _handle(self, conn: _Conn, data: bytes, fds: list[int], flags: int) -> dict:
        try:
            if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
                raise FdChannelError("message or descriptors truncated; send at most "
                                     f"{MAX_FDS_PER_MESSAGE} fds per message", "INVALID_ARG")
            try:
                msg = json.loads(data)
                op = msg["op"]
            except (ValueError, KeyError, TypeError):
                raise FdChannelError("malformed fd-channel message", "INVALID_ARG") from None
            if op == "auth":
                if fds:
                    raise FdChannelError("send fds only after auth", "INVALID_ARG")
                return self._auth(conn, msg.get("token"))
            if op == "fds":
                if conn.session is None:
                    raise FdChannelError("authenticate with the session token before sending fds",
                                         "PERMISSION_DENIED")
                tokens = msg.get("tokens")
                if not isinstance(tokens, list) or len(tokens) != len(fds) or not all(
                        isinstance(t, str) and 0 < len(t) <= 256 for t in tokens):
                    raise FdChannelError(f"expected one token string per fd, got {len(fds)} fds and "
                                         f"tokens {str(tokens)[:200]}", "INVALID_ARG")
                owned, fds = fds, []  # from here on, _file owns (files or closes) every fd
                self._file(conn.session, tokens, owned)
                return {"ok": True, "received": len(tokens)}
            raise FdChannelError(f"unknown fd-channel op {op!r}", "INVALID_ARG")
        finally:
            _close_fds(fds)

    def _auth(self, conn: _Conn, token: object) -> dict:
        session = self._authenticate(token) if isinstance(token, str) else None
        if session is None:
            raise FdChannelError("unknown session token: say HELLO on the ZeroMQ endpoint first",
                                 "PERMISSION_DENIED")
        old = self._links.get(session)
        if old is not None and old is not conn:
            self._forget(old)  # the client reconnected its link: the old one is stale
        conn.session = session
        self._links[session] = conn
        return {"ok": True}

    @staticmethod
    def _file(session: Hashable, tokens: list[str], fds: list[int]) -> None:
        refused = []
        for token, fd in zip(tokens, fds):
            owner = FD_INBOX.session_of(token)
            if owner is None:
                FD_INBOX.put(token, fd, session)
                continue
            os.close(fd)  # a duplicate: the inbox already has this object's fd
            if owner != session:
                refused.append(token)
        if refused:
            raise FdChannelError(f"fd tokens {refused[:4]} belong to another session", "PERMISSION_DENIED")

    def _forget(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if self._conns.pop(fd, None) is not None:
            self._unwatch(fd)
        conn.sock.close()

    def _drop(self, conn: _Conn) -> None:
        """The peer closed the connection (or died)."""
        self._forget(conn)
        if conn.session is not None and self._links.get(conn.session) is conn:
            del self._links[conn.session]
            self._on_link_closed(conn.session)

    def has_link(self, session: Hashable) -> bool:
        return session in self._links

    def close_session(self, session: Hashable) -> int:
        """Close the session's link and every fd it delivered. Returns the number of fds."""
        conn = self._links.pop(session, None)
        if conn is not None:
            self._forget(conn)
        return FD_INBOX.close_session(session)

    def close(self) -> None:
        for conn in list(self._conns.values()):
            self._forget(conn)
        for session in list(self._links):
            FD_INBOX.close_session(session)
        self._links.clear()
        self._unwatch(self._listener.fileno())
        self._listener.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


# ---- client side ------------------------------------------------------------------------


class FdChannelClient:
    """A worker's link to the server's fd channel (blocking, with a timeout)."""

    def __init__(self, path: str, session_token: str, *, timeout_s: float = 5.0) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(path)
            self._call({"op": "auth", "token": session_token})
        except OSError as exc:
            self._sock.close()
            raise FdChannelError(
                f"cannot reach the lmshm fd socket {path}: {exc.strerror or exc}. In isolated mode "
                "the worker must see the server's fd socket (mount it into the container, or pass "
                "fd_socket=... / LMSHM_FD_SOCKET)") from None
        except FdChannelError:
            self._sock.close()
            raise

    def _call(self, msg: dict, fds: list[int] = ()) -> dict:
        data = json.dumps(msg).encode()
        if fds:
            self._sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        else:
            self._sock.send(data)
        raw = self._sock.recv(MAX_MESSAGE_BYTES)
        if not raw:
            raise FdChannelError(f"the lmshm fd socket {self.path} closed the connection")
        reply = json.loads(raw)
        if not reply.get("ok"):
            raise FdChannelError(f"fd channel {self.path}: {reply.get('error')}", reply.get("code", "INTERNAL"))
        return reply

    def send_fds(self, fds: dict[str, int]) -> None:
        """Send ``{token: fd}``; the fds stay open and owned by the caller."""
        items = list(fds.items())
        for i in range(0, len(items), MAX_FDS_PER_MESSAGE):
            chunk = items[i:i + MAX_FDS_PER_MESSAGE]
            self._call({"op": "fds", "tokens": [t for t, _ in chunk]}, [fd for _, fd in chunk])

    def broken(self) -> bool:
        """True if the server end is gone (EOF or error pending on the socket)."""
        try:
            return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def close(self) -> None:
        self._sock.close()
