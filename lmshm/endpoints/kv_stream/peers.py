"""The KV event endpoints' guard: a cap on connections, the fd reserve, and a cap on what a
subscriber may send, for sockets whose listener is libzmq's.

libzmq accepts every connection and keeps every subscription, with no cap, and cannot close
one peer. ``PeerGuard`` watches a socket's monitor and, for a peer it refuses, calls
``shutdown(2)`` on its fd (never ``close``: libzmq owns it), so libzmq closes the connection
itself and forgets its subscriptions. Refused: connections past ``max_peers`` or while the fd
reserve is short, TCP peers that send past their byte allowance, and ``ipc://`` peers of
another uid. docs/design/kv-stream.md has the figures and the reasons.

The trap: an fd named by an event may be closed and reused before the event is read, so every
action first checks that the fd is still the socket recorded when it was accepted.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import struct
import time
from typing import Optional

import zmq
from zmq.utils.monitor import parse_monitor_message

from lmshm.core.logs import Throttle

logger = logging.getLogger("lmshm.kv_events")
_drop_log = Throttle(logger)

#: fds kept free: the request listener's reserve and its fd channel's room
#: (``lmshm.endpoints.zmq.endpoint.FD_RESERVE + LINK_ROOM``; an eighth of the limit each if less).
FD_RESERVE = 64 + 256
BYTES_PER_S = 1              # what a peer may send per second connected, past max_bytes (heartbeats)
_TCPI_BYTES_RECEIVED = 128   # offset of tcpi_bytes_received in Linux's struct tcp_info (4.1+)
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED

__all__ = ["PeerGuard", "free_fds"]


def free_fds() -> int:
    """fds this process may still open (0 when they cannot be counted: none is free)."""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    try:
        return limit - (len(os.listdir("/proc/self/fd")) - 1)
    except OSError:
        return 0


def _with_fd(fd: int, local: Optional[object], action):
    """``action(sock)`` on fd ``fd`` if it is still a socket bound to ``local`` (None: any);
    the fd is never closed here. None when it is not."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if local is not None and sock.getsockname() != local:
            return None
        return action(sock)
    except OSError:
        return None
    finally:
        sock.detach()


class _Peer:
    __slots__ = ("local", "remote", "since", "tcp", "dropped", "ready")

    def __init__(self, local: object, remote: object, tcp: bool) -> None:
        self.local, self.remote, self.tcp = local, remote, tcp
        self.since, self.dropped, self.ready = time.monotonic(), False, False


class PeerGuard:
    """Guards the connections of ``sock`` (bound; see the module docstring). Only the socket's
    own thread calls it: ``on_events`` when ``monitor`` is readable, ``check`` now and then."""

    def __init__(self, sock: zmq.Socket, *, what: str, max_peers: int, max_bytes: Optional[int],
                 fd_reserve: int = FD_RESERVE) -> None:
        self.what, self.max_peers, self.max_bytes = what, max_peers, max_bytes
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.fd_reserve = min(fd_reserve, limit // 4)
        self._sock = sock
        self.monitor = sock.get_monitor_socket(_EVENTS)
        self.monitor.setsockopt(zmq.LINGER, 0)
        self._peers: dict[int, _Peer] = {}
        # counters (plain ints, read by /metrics from another thread)
        self.refused = 0        # connections shut at once: past max_peers or into the fd reserve
        self.dropped = 0        # peers shut for sending more than max_bytes
        self.evicted = 0        # peers shut before their handshake finished, to make room past max_peers

    @property
    def connected(self) -> int:
        return len(self._peers)

    def on_events(self, limit: int = 4096) -> None:
        """Read the monitor's events (at most ``limit``)."""
        for _ in range(limit):
            try:
                msg = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            fd = msg["value"]
            if msg["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                peer = self._peers.get(fd)
                if peer is not None:
                    peer.ready = True
                continue
            if msg["event"] == zmq.EVENT_DISCONNECTED:
                self._peers.pop(fd, None)
                continue
            self._peers.pop(fd, None)       # a number reused: the old peer is gone
            info = _with_fd(fd, None, _identify)
            if info is None:
                continue                    # closed already (a DISCONNECTED follows)
            local, remote, tcp, uid = info
            peer = self._peers[fd] = _Peer(local, remote, tcp)
            full = len(self._peers) > self.max_peers and not self._evict(fd)
            foreign = uid is not None and uid not in (0, os.geteuid())
            if full or foreign or free_fds() < self.fd_reserve:      # (the fds are counted only under the cap)
                self.refused += 1
                _drop_log.warning("lmshm: a connection to the KV event %s endpoint was refused: %s", self.what,
                                  f"{self.max_peers} are connected" if full else
                                  f"its peer runs as uid {uid}, not the server's" if foreign else
                                  f"fewer than {self.fd_reserve} fds are free (the server's reserve)")
                self._shut(fd, peer)

    def _evict(self, newcomer: int) -> bool:
        """Make room for ``newcomer`` past ``max_peers``: shut the oldest peer that has not
        finished its ZMTP handshake (with CURVE, a client the ZAP handler refused never does), so
        that connections which never greet cannot keep every subscriber out. False if there is
        none, or if shut peers libzmq has not closed yet already number ``max_peers``."""
        live = [fd for fd, p in self._peers.items() if not p.dropped]
        if len(live) <= self.max_peers:
            return True
        if len(self._peers) - len(live) >= self.max_peers:
            return False
        for fd in live:         # oldest first (accepted order)
            peer = self._peers[fd]
            if fd != newcomer and not peer.ready:
                self.evicted += 1
                _drop_log.warning("lmshm: a connection to the KV event %s endpoint that had not finished its "
                                  "handshake was shut to make room for a new one (%d are connected)",
                                  self.what, self.max_peers)
                self._shut(fd, peer)
                return True
        return False

    def check(self) -> None:
        """Forget peers whose fd is no longer theirs (a ``DISCONNECTED`` the monitor's queue
        dropped), and drop TCP peers that sent more than they may."""
        now = time.monotonic()
        for fd, peer in list(self._peers.items()):
            if _with_fd(fd, peer.local, lambda s: s.getpeername()) != peer.remote:
                del self._peers[fd]
                continue
            if self.max_bytes is None or not peer.tcp or peer.dropped:
                continue
            got = _with_fd(fd, peer.local, _bytes_received)
            if got is not None and got > self.max_bytes + BYTES_PER_S * (now - peer.since):
                self.dropped += 1
                _drop_log.warning("lmshm: a KV event %s peer sent %d bytes (at most %d, and %d a second "
                                  "connected); it was disconnected", self.what, got, self.max_bytes, BYTES_PER_S)
                self._shut(fd, peer)

    def _shut(self, fd: int, peer: _Peer) -> None:
        peer.dropped = True         # still counted until libzmq closes it (DISCONNECTED)
        _with_fd(fd, peer.local, lambda s: s.shutdown(socket.SHUT_RDWR))

    def close(self) -> None:
        """Stop monitoring (before the socket closes)."""
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
        self._peers.clear()


def _identify(sock: socket.socket) -> tuple:
    """(local address, peer address, whether TCP, the peer's uid for a Unix socket else None)."""
    unix = sock.family == socket.AF_UNIX
    uid = None
    if unix:
        uid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
    return sock.getsockname(), sock.getpeername(), not unix, uid


def _bytes_received(sock: socket.socket) -> Optional[int]:
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    if len(info) < _TCPI_BYTES_RECEIVED + 8:
        return None
    return struct.unpack_from("=Q", info, _TCPI_BYTES_RECEIVED)[0]
