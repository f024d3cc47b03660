"""The fd side channel: a Unix socket beside the server that proves who a worker is and carries
its file descriptors.

The kernel vouches for the peer (``SO_PEERCRED``: pid, uid, gid; ``SO_PEERPIDFD``: a pidfd),
and a worker binds that to its ZeroMQ session by presenting the session's token here; memfds
and VMM handles travel as ``SCM_RIGHTS``; the link closing tells the server the worker is gone.
Received fds go to ``FD_INBOX`` under the session; any fd that comes without a matching token,
over a limit or twice is closed before the answer goes out.

One file, over 600 lines: the server and the client speak one small protocol (``Auth``,
``SendFds``, ``Ack``, ``Refused``) and are kept side by side. docs/design/transport.md has the
details. The trap: ``recvmsg`` may deliver (or truncate) fds with a refused message, so every
path closes what arrived; and the client checks the listener's credentials before it sends.
"""

from __future__ import annotations

import array
import errno
import logging
import os
import select
import socket
import stat
import struct
import tempfile
import time
from dataclasses import dataclass
from typing import Annotated, Callable, Hashable, Optional, Union

import msgspec

from lmshm.core.logs import Throttle
from lmshm.platform.base.fds import FD_INBOX
from lmshm.platform.base.files import file_id, unlink_if_same
from lmshm.quoting import clip

logger = logging.getLogger(__name__)
_no_auth_log = Throttle(logger)      # a flood of silent connections: a line every 10 s

MAX_FDS_PER_MESSAGE = 250   # below the kernel's SCM_MAX_FD (253)
#: Connections waiting to be accepted hold no fd of the server. As deep as the kernel allows
#: (net.core.somaxconn caps it), so that a flood of connections leaves a worker room to queue.
BACKLOG = 4096
#: Accepts per turn of the loop, at most: enough to drain a flood's backlog quickly (an honest
#: worker's token is read as it is accepted), few enough to keep the loop's turn short
#: (~30 us each).
ACCEPT_BATCH = 64
MAX_MESSAGE_BYTES = 64 * 1024
MAX_TOKEN_CHARS = 256
_ANCILLARY = socket.CMSG_SPACE(MAX_FDS_PER_MESSAGE * array.array("i").itemsize)
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux >= 6.5


# ---- messages ---------------------------------------------------------------------------


class _FdMessage(msgspec.Struct, frozen=True, tag_field="op", forbid_unknown_fields=True):
    pass


Token = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TOKEN_CHARS)]


class Auth(_FdMessage, tag="auth"):
    """Bind this connection to the session whose secret token it presents."""

    token: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class SendFds(_FdMessage, tag="fds"):
    """One token per fd riding on this message (SCM_RIGHTS), in the same order."""

    tokens: Annotated[list[Token], msgspec.Meta(max_length=MAX_FDS_PER_MESSAGE)]


class Ack(_FdMessage, tag="ack"):
    received: int = 0        # fds filed
    pid: int = 0             # auth: the worker's pid as the server sees it
    uid: int = 0             # auth: the worker's uid as the kernel reported it


class Refused(_FdMessage, tag="refused"):
    code: str                # an ErrorCode name: PERMISSION_DENIED, INVALID_ARG, UNAVAILABLE
    error: str


_to_server = msgspec.msgpack.Decoder(Union[Auth, SendFds])
_to_client = msgspec.msgpack.Decoder(Union[Ack, Refused])
_encode = msgspec.msgpack.Encoder().encode


#: How a refusal of a token the server does not know (any more) begins; the client then says
#: HELLO again.
UNKNOWN_TOKEN = "unknown session token"


#: The refusal when the server has no fd to spare: it passes as connections close, so clients
#: ask again (``FdChannelClient.send_fds`` until its deadline).
OUT_OF_FDS = "the server is out of file descriptors; try again later"


class FdChannelError(RuntimeError):
    """The fd channel refused a request or could not be reached. ``retry``: the cause passes
    (the server was out of fds or connections, its backlog was full); trying again may work."""

    def __init__(self, message: str, code: str = "UNAVAILABLE", *, retry: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.retry = retry


@dataclass(frozen=True)
class Credentials:
    """What the kernel says about the process on the other end of a Unix socket."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> Credentials:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return Credentials(*struct.unpack("3i", raw))


def peer_pidfd(sock: socket.socket, pid: int) -> Optional[int]:
    """A pidfd of the peer: SO_PEERPIDFD where the kernel has it, else pidfd_open(pid)."""
    try:
        return struct.unpack("i", sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD, 4))[0]
    except OSError:
        pass
    if pid <= 0:
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def user_runtime_dir() -> str:
    """``$TMPDIR/lmshm-<uid>``: a directory only this uid may enter (created mode 0700).

    Refuses a path that is a symlink, belongs to another uid or is open to others: a squatter
    must not be able to place the server's fd socket where workers would trust it.
    """
    path = os.path.join(tempfile.gettempdir(), f"lmshm-{os.geteuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise FdChannelError(
            f"{path} must be a directory of uid {os.geteuid()} with mode 0700 (it is "
            f"{'a directory' if stat.S_ISDIR(st.st_mode) else 'not a directory'} of uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):o}); remove it, or pass --fd-socket PATH")
    return path


def default_path(url: str) -> str:
    """The fd socket of a server endpoint: beside an ipc:// socket, else in ``user_runtime_dir()``."""
    if url.startswith("ipc://"):
        return url[len("ipc://"):] + ".fds"
    hostport = url.split("://", 1)[-1].replace(":", "-").replace("/", "_").replace("*", "0")
    return os.path.join(user_runtime_dir(), f"{hostport}.fds")


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def bind_unix(path: str, kind: int, what: str) -> tuple[socket.socket, tuple[int, int]]:
    """Bind a Unix socket at ``path`` (mode 0600) without ever removing a live one.

    ``bind`` itself refuses an existing path, so nothing is taken over. An existing path is
    probed: a listener there is another server (refused); a socket file of our own uid that
    nobody accepts on is a leftover of a killed server and is replaced; anything else is refused.
    Returns the socket and the identity of the file it created, so that ``unlink_if_same``
    removes only that file.
    """
    sock = socket.socket(socket.AF_UNIX, kind)
    for attempt in (1, 2):
        old = os.umask(0o177)
        try:
            sock.bind(path)
            break
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or attempt == 2 or not _stale_socket(path, kind):
                sock.close()
                if exc.errno == errno.EADDRINUSE:
                    raise FdChannelError(f"{what} {path} is in use (another lmshm-server listens there, or the "
                                         "path is not a socket file of this user); choose another path") from None
                raise FdChannelError(f"cannot create {what} {path}: {exc.strerror}") from None
            logger.warning("lmshm: replacing %s %s: a socket file nobody listens on", what, path)
            os.unlink(path)
        finally:
            os.umask(old)
    os.chmod(path, 0o600)
    return sock, file_id(os.lstat(path))


def _stale_socket(path: str, kind: int) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        return False
    probe = socket.socket(socket.AF_UNIX, kind)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    finally:
        probe.close()
    return False


class SpareFd:
    """One file descriptor held in reserve, so that a process out of fds can still accept a
    waiting peer -- to refuse it -- instead of leaving its listener readable (a busy loop)."""

    def __init__(self) -> None:
        self._fd: Optional[int] = self._open()

    @staticmethod
    def _open() -> Optional[int]:
        try:
            return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None

    def accept(self, listener: socket.socket) -> Optional[socket.socket]:
        """Free the spare fd, accept one connection on ``listener``, take the spare back."""
        if self._fd is None:
            return None
        os.close(self._fd)
        self._fd = None
        try:
            return listener.accept()[0]
        except OSError:
            return None
        finally:
            self._fd = self._open()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# ---- server side ------------------------------------------------------------------------


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    creds: Credentials
    pidfd: Optional[int]
    accepted: float
    session: Optional[Hashable] = None


#: authenticate(token, creds, pidfd) -> session id; raises FdChannelError to refuse. On success
#: the callee owns ``pidfd`` (it may be None).
Authenticate = Callable[[str, Credentials, Optional[int]], Hashable]


class FdChannelServer:
    """Listens on ``path``; verifies peers; files received fds in ``FD_INBOX`` under their session.

    ``may_connect(creds)`` returns None to admit a peer or a refusal message (the uid policy);
    ``authenticate`` binds a connection to a session (see ``Authenticate``);
    ``on_link_closed(session)`` runs when an authenticated connection ends. ``watch``/``unwatch``
    hook sockets into the server's poll loop; nothing here blocks.
    """

    def __init__(
        self,
        path: str,
        *,
        may_connect: Callable[[Credentials], Optional[str]],
        authenticate: Authenticate,
        on_link_closed: Callable[[Hashable], None],
        watch: Callable[[int, Callable[[], None]], None],
        unwatch: Callable[[int], None],
        max_fds_per_session: int = 1024,
        max_pending: int = 64,
        auth_timeout_s: float = 5.0,
        fds_available: Callable[[int], bool] = lambda opening: True,
    ) -> None:
        self.path = path
        self._may_connect = may_connect
        self._authenticate = authenticate
        self._on_link_closed = on_link_closed
        self._watch, self._unwatch = watch, unwatch
        self.max_fds_per_session = max_fds_per_session
        self.max_pending = max_pending
        self.auth_timeout_s = auth_timeout_s
        self._fds_available = fds_available
        self._conns: dict[int, _Conn] = {}
        self._pending: dict[int, _Conn] = {}     # unauthenticated connections, oldest first
        self._links: dict[Hashable, _Conn] = {}
        self.displaced = 0
        self.refused = 0
        self._refusal_log_at = 0.0
        self._listener, self._inode = bind_unix(path, socket.SOCK_SEQPACKET, "fd socket")
        self._spare = SpareFd()
        self._listener.listen(BACKLOG)
        self._listener.setblocking(False)
        self._watch(self._listener.fileno(), self._accept)

    def _refuse_with_spare(self) -> None:
        sock = self._spare.accept(self._listener)
        if sock is not None:
            self._refuse(sock, "UNAVAILABLE", OUT_OF_FDS)

    def _log_refusal(self, line: str) -> None:
        """A refusal's warning, at most one line a second (a flood of refusals must not flood the log)."""
        self.refused += 1
        now = time.monotonic()
        if now >= self._refusal_log_at:
            logger.warning("lmshm: %s (%d refused so far; logged at most once a second)", line, self.refused)
            self._refusal_log_at = now + 1.0

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _refuse(self, sock: socket.socket, code: str, error: str) -> None:
        self._send(sock, Refused(code, error))
        sock.close()

    def _accept(self) -> None:
        """Accept what waits, ``ACCEPT_BATCH`` at most, reading each newcomer at once: an honest
        worker sends its token right after connecting, so it is usually verified as it is
        accepted and never waits. A connection that has sent nothing yet waits among at most
        ``max_pending``; past that (or when fds are short) the oldest of them gives way -- but only
        one accepted before this batch, which has had its turn to be read."""
        batch_start = time.monotonic()
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    raise
                logger.error("lmshm: fd channel cannot accept a connection: %s", exc.strerror)
                self._refuse_with_spare()
                return
            self._admit(sock, batch_start)

    def _give_way(self, batch_start: float) -> bool:
        """Close the oldest unauthenticated connection if it was accepted before ``batch_start``."""
        oldest = next(iter(self._pending.values()), None)
        if oldest is None or oldest.accepted >= batch_start:
            return False
        self.displaced += 1
        self._send(oldest.sock, Refused("UNAVAILABLE", "displaced by a newer connection before it "
                                                       "authenticated; try again"))
        self._forget(oldest)
        return True

    def _admit(self, sock: socket.socket, batch_start: float) -> None:
        try:
            creds = peer_credentials(sock)
        except OSError:
            sock.close()
            return
        refusal = self._may_connect(creds)
        if refusal is not None:
            self._log_refusal(f"fd channel refused pid {creds.pid} (uid {creds.uid}): {refusal}")
            return self._refuse(sock, "PERMISSION_DENIED", refusal)
        # 2 fds: this socket and the peer's pidfd; when they are short, the oldest unauthenticated
        # connection's become this one's.
        if not self._fds_available(2) and not self._give_way(batch_start):
            self._log_refusal(f"fd channel refused pid {creds.pid}: out of file descriptors")
            return self._refuse(sock, "UNAVAILABLE", OUT_OF_FDS)
        sock.setblocking(False)
        fd = sock.fileno()
        conn = _Conn(sock, creds, peer_pidfd(sock, creds.pid), time.monotonic())
        self._conns[fd] = conn
        self._readable(conn)
        if self._conns.get(fd) is not conn:      # it closed, or was refused and dropped
            return
        if conn.session is None:                  # nothing (valid) yet: it waits for its turn
            if len(self._pending) >= self.max_pending and not self._give_way(batch_start):
                self._log_refusal(f"fd channel refused pid {creds.pid}: too many connections waiting")
                self._send(sock, Refused("UNAVAILABLE", "the server has too many connections waiting to "
                                                        "authenticate; try again"))
                self._forget(conn)
                return
            self._pending[fd] = conn
        self._watch(fd, lambda: self._readable(conn))

    @staticmethod
    def _send(sock: socket.socket, msg: Union[Ack, Refused]) -> bool:
        try:
            sock.send(_encode(msg))
            return True
        except OSError:
            return False

    def _readable(self, conn: _Conn) -> None:
        try:
            data, ancdata, flags, _ = conn.sock.recvmsg(MAX_MESSAGE_BYTES, _ANCILLARY,
                                                        socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):
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
            reply: Union[Ack, Refused] = self._handle(conn, data, fds, flags)
        except FdChannelError as exc:
            reply = Refused(exc.code, clip(str(exc), 512))
        finally:
            _close_fds(fds)  # _handle empties ``fds`` of what it filed
        if not self._send(conn.sock, reply):
            self._drop(conn)

    def _handle(self, conn: _Conn, data: bytes, fds: list[int], flags: int) -> Ack:
        if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
            raise FdChannelError(f"message or descriptors truncated; send at most {MAX_FDS_PER_MESSAGE} fds "
                                 f"and {MAX_MESSAGE_BYTES} bytes per message", "INVALID_ARG")
        try:
            msg = _to_server.decode(data)
        except Exception as exc:
            raise FdChannelError(f"malformed fd-channel message ({len(data)} bytes): {clip(str(exc), 200)}",
                                 "INVALID_ARG") from None
        if isinstance(msg, Auth):
            if fds:
                raise FdChannelError("send fds only after auth", "INVALID_ARG")
            return self._auth(conn, msg.token)
        if conn.session is None:
            raise FdChannelError("authenticate with the session token before sending fds", "PERMISSION_DENIED")
        if len(msg.tokens) != len(fds):
            raise FdChannelError(f"expected one token per fd, got {len(fds)} fds and {len(msg.tokens)} tokens",
                                 "INVALID_ARG")
        held = FD_INBOX.count(conn.session)
        if fds and not self._fds_available(len(fds)):  # they arrived already: closed with the refusal
            raise FdChannelError(OUT_OF_FDS, "UNAVAILABLE")
        if held + len(fds) > self.max_fds_per_session:
            raise FdChannelError(
                f"this session would hold {held + len(fds)} undelivered fds, more than the server's limit of "
                f"{self.max_fds_per_session} (lmshm-server --max-fds-per-session)", "UNAVAILABLE")
        filed = 0
        while fds:
            token, fd = msg.tokens[filed], fds.pop(0)
            filed += 1
            FD_INBOX.put(token, fd, conn.session)  # a duplicate token: the first fd stands, this one closes
        return Ack(received=filed)

    def _auth(self, conn: _Conn, token: str) -> Ack:
        pidfd, conn.pidfd = conn.pidfd, None
        try:
            session = self._authenticate(token, conn.creds, pidfd)  # owns pidfd from here on
        except FdChannelError:
            raise
        old = self._links.get(session)
        if old is not None and old is not conn:
            self._forget(old)  # the client reconnected its link: the old one is stale
        conn.session = session
        self._pending.pop(conn.sock.fileno(), None)
        self._links[session] = conn
        return Ack(pid=conn.creds.pid, uid=conn.creds.uid)

    def expire(self, now: Optional[float] = None) -> int:
        """Close connections that did not authenticate within ``auth_timeout_s``."""
        now = time.monotonic() if now is None else now
        late = [c for c in self._pending.values() if now - c.accepted > self.auth_timeout_s]
        for conn in late:
            _no_auth_log.info("lmshm: fd channel dropped pid %d: no auth within %g s", conn.creds.pid,
                              self.auth_timeout_s)
            self._send(conn.sock, Refused("UNAVAILABLE", f"no auth within {self.auth_timeout_s:g} s"))
            self._forget(conn)
        return len(late)

    def _forget(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if fd >= 0 and self._conns.pop(fd, None) is not None:
            self._pending.pop(fd, None)
            self._unwatch(fd)
        conn.sock.close()
        if conn.pidfd is not None:
            os.close(conn.pidfd)
            conn.pidfd = None

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
        unlink_if_same(self.path, self._inode)
        self._spare.close()


# ---- client side ------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpectedServer:
    """Who must be listening on the fd socket: the server the client said HELLO to."""

    pid: int          # the server's pid as the server sees itself
    uid: int
    pid_ns: int       # inode of the server's PID namespace (0: unknown)


def _own_pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def check_listener(creds: Credentials, expected: ExpectedServer, path: str) -> None:
    """Refuse a listener that is not the server we said HELLO to.

    In the server's PID namespace the listener's pid must be the server's; from another
    namespace (a container) pids cannot be compared, and its uid must be the server's.
    """
    same_ns = expected.pid_ns != 0 and expected.pid_ns == _own_pid_ns()
    if same_ns and creds.pid != expected.pid:
        raise FdChannelError(
            f"the process listening on the fd socket {path} is pid {creds.pid}, not the lmshm-server "
            f"(pid {expected.pid}) this client said HELLO to; refusing to send it anything", "PERMISSION_DENIED")
    if creds.uid != expected.uid:
        raise FdChannelError(
            f"the process listening on the fd socket {path} runs as uid {creds.uid}, the lmshm-server "
            f"this client said HELLO to as uid {expected.uid}; refusing to send it anything", "PERMISSION_DENIED")


class FdChannelClient:
    """A worker's link to the server's fd channel (blocking, with a timeout).

    Connecting checks the listener (``check_listener``) before the session token goes out,
    then authenticates; ``verified_pid`` is the worker's pid as the server sees it.
    """

    def __init__(self, path: str, session_token: str, *, expected: Optional[ExpectedServer] = None,
                 timeout_s: float = 5.0) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(path)
            if expected is not None:
                check_listener(peer_credentials(self._sock), expected, path)
            ack = self._call(Auth(session_token))
            self.verified_pid = ack.pid
        except OSError as exc:
            self._sock.close()
            busy = exc.errno in (errno.EAGAIN, errno.ECONNRESET, errno.EPIPE)  # a full backlog, a refused newcomer
            raise FdChannelError(
                f"cannot reach the lmshm fd socket {path}: {exc.strerror or exc}. The worker must reach the "
                "server's fd socket to prove who it is (same host; mount the socket's directory into the "
                "container, and pass fd_socket=... / LMSHM_FD_SOCKET where it has another path)", retry=busy) from None
        except FdChannelError:
            self._sock.close()
            raise

    def _call(self, msg: Union[Auth, SendFds], fds: list[int] = ()) -> Ack:
        data = _encode(msg)
        if fds:
            self._sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        else:
            self._sock.send(data)
        raw = self._sock.recv(MAX_MESSAGE_BYTES)
        if not raw:
            raise FdChannelError(f"the lmshm fd socket {self.path} closed the connection")
        try:
            reply = _to_client.decode(raw)
        except msgspec.DecodeError as exc:
            raise FdChannelError(f"fd channel {self.path}: undecodable answer: {exc}", "INTERNAL") from None
        if isinstance(reply, Refused):
            raise FdChannelError(f"fd channel {self.path}: {reply.error}", reply.code,
                                 retry=reply.code == "UNAVAILABLE")
        return reply

    def send_fds(self, fds: dict[str, int], deadline: Optional[float] = None) -> None:
        """Send ``{token: fd}``; the fds stay open and owned by the caller. A message the server
        refuses for want of fds (``OUT_OF_FDS``: it filed none of them) is sent again, with a
        growing pause, until ``deadline`` (``time.monotonic()``; None: not at all)."""
        items = list(fds.items())
        for i in range(0, len(items), MAX_FDS_PER_MESSAGE):
            chunk = items[i:i + MAX_FDS_PER_MESSAGE]
            pause = 0.01
            while True:
                try:
                    self._call(SendFds([t for t, _ in chunk]), [fd for _, fd in chunk])
                    break
                except FdChannelError as exc:
                    if (OUT_OF_FDS not in str(exc) or deadline is None
                            or time.monotonic() + pause > deadline):
                        raise
                time.sleep(pause)
                pause = min(2 * pause, 0.2)

    def broken(self) -> bool:
        """True if the server end is gone (EOF or error pending on the socket). Never waits: the
        socket has a timeout, and Python waits that long for data before any ``recv``, whatever
        its flags."""
        poll = select.poll()
        poll.register(self._sock.fileno(), select.POLLIN)
        if not poll.poll(0):
            return False
        try:
            return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, TimeoutError):
            return False
        except OSError:
            return True

    def close(self) -> None:
        self._sock.close()


__all__ = ["OUT_OF_FDS", "UNKNOWN_TOKEN", "Ack", "Auth", "Credentials", "ExpectedServer", "FdChannelClient", "FdChannelError",
           "FdChannelServer", "Refused", "SendFds", "bind_unix", "default_path"]
