"""Sessions and liveness: who each connection is, and when its registrations must go.

A worker's HELLO opens a session: a number and a secret token. It stays *unverified* until the
worker presents the token on the fd channel; then the kernel's word about that connection
(``SO_PEERCRED``, ``SO_PEERPIDFD``) becomes the session's ``Peer``, once, never re-read from
anything the worker says. A session ends, and its registrations are reclaimed, when its pidfd
fires, its fd-channel link closes (after ``LINK_GRACE_S``), it never verified within
``auth_timeout_s``, or, unwatched, it was silent for ``reap_timeout_s``; unverified sessions
past ``max_pending_auth`` are parked, their tokens still valid (docs/design/service.md,
"Sessions and reclaim"). ``admission_refusal`` is the fd channel's uid/gid policy.

The trap: only an *exited* owner's names may be unlinked (``orphaned``); a live worker that
merely closed its client keeps its segments.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import os
import secrets
import select
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from lmshm.platform.base.peer import Peer, namespace_view
from lmshm.quoting import quote
from lmshm.settings import ServerConfig
from lmshm.transport.fdchannel import UNKNOWN_TOKEN, Credentials, FdChannelError

logger = logging.getLogger("lmshm.server")

LINK_GRACE_S = 0.25
_MAC_BYTES = 16


@dataclass(eq=False)
class Session:
    id: int
    token: str
    identity: bytes                      # the ZeroMQ routing id of its current connection
    client_name: str
    opened: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)
    peer: Optional[Peer] = None          # set once the fd channel verified it
    pidfd: Optional[int] = None
    link_lost: Optional[float] = None    # when its fd-channel link closed while the pid lived
    ended: bool = False                  # set once, when the session ends (copier jobs look)

    @property
    def verified(self) -> bool:
        return self.peer is not None

    def describe(self) -> str:
        who = self.peer.describe() if self.peer else "unverified"
        return f"session {self.id} ({who}{', ' + quote(self.client_name, 40) if self.client_name else ''})"


def pid_alive(pidfd: Optional[int]) -> bool:
    """True only if ``pidfd`` proves the process still runs (poll: no fd-number limit)."""
    if pidfd is None:
        return False
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return not p.poll(0)


class SessionLimitError(Exception):
    """A new session or identity would exceed a limit; the message says which."""


class Sessions:
    """The session table. ``on_end(session, reason, orphaned)`` releases what a session held."""

    def __init__(self, config: ServerConfig, *, watch: Callable[[int, Callable[[], None]], None],
                 unwatch: Callable[[int], None], on_end: Callable[[Session, str, bool], None],
                 max_sessions: int) -> None:
        self.config = config
        self._watch, self._unwatch, self._on_end = watch, unwatch, on_end
        self.max_sessions = max_sessions
        self._by_id: dict[int, Session] = {}
        self._by_identity: dict[bytes, Session] = {}
        self._by_token: dict[str, Session] = {}
        self._pending: collections.OrderedDict[int, Session] = collections.OrderedDict()  # unverified, oldest first
        self._key = secrets.token_bytes(32)  # seals tokens (``_seal``); never leaves this process
        self.displaced = 0                   # sessions parked so far
        self._displaced_log_at = 0.0
        self._next = 1

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._by_id.values()))

    def of(self, identity: bytes) -> Optional[Session]:
        return self._by_identity.get(identity)

    def __contains__(self, identity: bytes) -> bool:
        """Whether the ZeroMQ connection ``identity`` has a session (verified or not)."""
        return identity in self._by_identity

    # ---- opening and verifying ------------------------------------------------------------
    def open(self, identity: bytes, client_name: str) -> Session:
        """A new, unverified session. Sessions that have not proven their identity yet are
        capped at ``max_pending_auth``; past that, or when the table is full, the oldest of them
        gives way (``_make_room``), so HELLOs alone cannot lock verified workers out."""
        self._make_room(for_pending=True)
        if len(self._by_id) >= self.max_sessions:
            raise SessionLimitError(f"the server holds {len(self._by_id)} verified sessions, its limit "
                                    f"(lmshm-server --max-sessions, and the open-file limit)")
        issued_ns = time.monotonic_ns()
        session = Session(self._next, self._seal(self._next, issued_ns, identity), identity, client_name,
                          opened=issued_ns / 1e9)
        self._next += 1
        self._insert(session)
        logger.debug("lmshm: session %d opened%s", session.id, f" for {quote(client_name, 40)}" if client_name else "")
        return session

    def _seal(self, session_id: int, issued_ns: int, identity: bytes) -> str:
        """A session's token: its number, HELLO time and connection, and a MAC over them under
        ``_key``. Unforgeable and unguessable without the key; ``_unseal`` reads it back."""
        body = session_id.to_bytes(8, "big") + issued_ns.to_bytes(8, "big") + identity
        return (body + hashlib.blake2b(body, key=self._key, digest_size=_MAC_BYTES).digest()).hex()

    def _unseal(self, token: str) -> Optional[tuple[int, int, bytes]]:
        """(session id, issued_ns, identity) of a token this server sealed; None otherwise."""
        try:
            raw = bytes.fromhex(token)
        except ValueError:
            return None
        if not 16 + _MAC_BYTES <= len(raw) <= 16 + 32 + _MAC_BYTES:
            return None
        body, mac = raw[:-_MAC_BYTES], raw[-_MAC_BYTES:]
        if not hmac.compare_digest(mac, hashlib.blake2b(body, key=self._key, digest_size=_MAC_BYTES).digest()):
            return None
        return int.from_bytes(body[:8], "big"), int.from_bytes(body[8:16], "big"), body[16:]

    def _insert(self, session: Session) -> None:
        self._by_id[session.id] = session
        self._by_identity[session.identity] = session
        self._by_token[session.token] = session
        self._pending[session.id] = session

    def _make_room(self, *, for_pending: bool) -> None:
        """Park the oldest unverified session if the pending cap (``for_pending``) or the table
        is full. A parked session holds no slot and nothing is kept of it, but its sealed token
        still verifies on the fd channel until ``auth_timeout_s`` after its HELLO (``_unpark``):
        a flood of HELLOs can displace an honest worker's session between its HELLO and its
        proof, but cannot void the proof."""
        while self._pending and ((for_pending and len(self._pending) >= self.config.max_pending_auth)
                                 or len(self._by_id) >= self.max_sessions):
            _, oldest = self._pending.popitem(last=False)
            del self._by_id[oldest.id]
            del self._by_token[oldest.token]
            if self._by_identity.get(oldest.identity) is oldest:
                del self._by_identity[oldest.identity]
            self.displaced += 1
            now = time.monotonic()
            if now >= self._displaced_log_at:  # a flood displaces thousands a second: one line a second
                logger.info("lmshm: %s displaced by newer sessions while it had not proven its identity (parked: its "
                            "token still verifies until --auth-timeout; %d displaced so far)", oldest.describe(),
                            self.displaced)
                self._displaced_log_at = now + 1.0

    def _unpark(self, token: str) -> Optional[Session]:
        """A displaced session whose worker now proves its identity takes a slot again (see
        ``_make_room``); None if its token is not one this server sealed, too old, or its
        connection has opened another session meanwhile. Raises ``FdChannelError`` if verified
        sessions fill the table. (A session that ended can come back this way too, within
        ``auth_timeout_s`` of its HELLO and only to the holder of its token: it comes back empty,
        its registrations reclaimed, and must prove its identity again.)"""
        sealed = self._unseal(token)
        if sealed is None:
            return None
        session_id, issued_ns, identity = sealed
        opened = issued_ns / 1e9
        if time.monotonic() - opened > self.config.auth_timeout_s or session_id in self._by_id:
            return None
        if identity in self._by_identity:
            return None
        self._make_room(for_pending=False)
        if len(self._by_id) >= self.max_sessions:
            raise FdChannelError(f"the server holds {len(self._by_id)} verified sessions, its limit (lmshm-server "
                                 "--max-sessions, and the open-file limit)", "UNAVAILABLE")
        session = Session(session_id, token, identity, "", opened=opened)
        self._insert(session)
        logger.debug("lmshm: session %d came back from the parked ones to prove its identity", session.id)
        return session

    def is_verified_token(self, token: str) -> bool:
        """Whether ``token`` is that of a live session that has proven its identity."""
        session = self._by_token.get(token) if token else None
        return session is not None and session.peer is not None

    def resume(self, identity: bytes, token: str) -> Optional[Session]:
        old = self._by_token.get(token) if token else None
        if old is None:
            return None
        if self._by_identity.get(old.identity) is old:
            del self._by_identity[old.identity]
        old.identity = identity
        self._by_identity[identity] = old
        return old

    def verify(self, token: str, creds: Credentials, pidfd: Optional[int]) -> int:
        """Bind the kernel's ``creds`` (and ``pidfd``, now ours) to the session holding ``token``."""
        session = self._by_token.get(token) or self._unpark(token)
        try:
            if session is None:
                raise FdChannelError(f"{UNKNOWN_TOKEN}: say HELLO on the ZeroMQ endpoint first",
                                     "PERMISSION_DENIED")
            if session.peer is not None:
                if (creds.pid, creds.uid) != (session.peer.pid, session.peer.uid):
                    raise FdChannelError(
                        f"session {session.id} belongs to {session.peer.describe()}; this connection comes from "
                        f"pid {creds.pid} (uid {creds.uid})", "PERMISSION_DENIED")
                session.link_lost = None
                return session.id
            same_uid = sum(1 for s in self._by_id.values() if s.peer is not None and s.peer.uid == creds.uid)
            if same_uid >= self.config.max_sessions_per_uid:
                raise FdChannelError(f"uid {creds.uid} already holds {same_uid} sessions, the server's limit "
                                     "(lmshm-server --max-sessions-per-uid)", "UNAVAILABLE")
            if pidfd is not None and not pid_alive(pidfd):
                raise FdChannelError("the connecting process exited", "UNAVAILABLE")
            ns_pid, pid_ns = namespace_view(creds.pid)
            if pidfd is not None and not pid_alive(pidfd):  # /proc was read while it still lived
                raise FdChannelError("the connecting process exited", "UNAVAILABLE")
            session.peer = Peer(session=session.id, pid=creds.pid, uid=creds.uid, gid=creds.gid,
                                ns_pid=ns_pid, pid_ns=pid_ns)
            self._pending.pop(session.id, None)
            session.pidfd, pidfd = pidfd, None
            session.link_lost = None
            if session.pidfd is not None:
                watched = session
                self._watch(session.pidfd, lambda: self.end(watched, f"worker pid {watched.peer.pid} exited",
                                                            orphaned=True))
            logger.info("lmshm: %s verified (%s)", session.describe(),
                        "pid watched" if session.pidfd is not None else "not watchable: heartbeat only")
            return session.id
        finally:
            if pidfd is not None:
                os.close(pidfd)

    # ---- liveness -------------------------------------------------------------------------
    def link_closed(self, session_id: int) -> None:
        session = self._by_id.get(session_id)
        if session is None:
            return
        if pid_alive(session.pidfd):
            session.link_lost = time.monotonic()  # let the pidfd speak first (LINK_GRACE_S)
            return
        self.end(session, "fd-channel connection closed", orphaned=True)

    def reap(self, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        timeout = self.config.auth_timeout_s
        for session in list(self._pending.values()):
            if now - session.opened > timeout:
                self.end(session, f"identity not proven on the fd channel within {timeout:g} s", orphaned=False)
        for session in list(self._by_id.values()):
            if session.link_lost is not None and now - session.link_lost > LINK_GRACE_S:
                self.end(session, "fd-channel connection closed by a live worker",
                         orphaned=not pid_alive(session.pidfd))
            elif session.pidfd is None and now - session.last_seen > self.config.reap_timeout_s:
                self.end(session, f"no message for {self.config.reap_timeout_s:g} s", orphaned=False)

    def end(self, session: Session, reason: str, *, orphaned: bool) -> None:
        if self._by_id.pop(session.id, None) is None:
            return
        session.ended = True
        self._pending.pop(session.id, None)
        if self._by_identity.get(session.identity) is session:
            del self._by_identity[session.identity]
        self._by_token.pop(session.token, None)
        try:
            self._on_end(session, reason, orphaned)
        finally:
            if session.pidfd is not None:
                self._unwatch(session.pidfd)
                os.close(session.pidfd)
                session.pidfd = None


def admission_refusal(config: ServerConfig, creds: Credentials) -> Optional[str]:
    """The uid policy of the fd channel: None (admitted) for the server's uid, root, an
    ``--allow-uid`` or a member of an ``--allow-gid``; else why the peer is refused."""
    if creds.uid in (os.geteuid(), 0) or creds.uid in config.allowed_uids:
        return None
    if config.allowed_gids and _groups_of(creds) & set(config.allowed_gids):
        return None
    return (f"peer uid {creds.uid} is not admitted: the server runs as uid {os.geteuid()}; "
            "admit others with --allow-uid / --allow-gid")


def _groups_of(creds: Credentials) -> set[int]:
    groups = {creds.gid}
    try:
        with open(f"/proc/{creds.pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    groups.update(int(g) for g in line.split()[1:])
                    break
    except (OSError, ValueError):
        pass
    return groups
