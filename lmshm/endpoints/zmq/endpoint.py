"""``lmshm-server``'s ZeroMQ endpoint: lmshm's own protocol, dispatched to the core.

``ZmqEndpoint`` owns only what is ZeroMQ's: the loop (``lmshm.transport.mq``: the ZMTP listener,
the fd channel's sockets, one pidfd per watched worker, a wake-up pipe for signals and copier
replies), the sessions and their kernel-verified identities (``sessions.py``), the fd budget
(``fds.py``), and the dispatch of each request to the core (``lmshm.core.service.Core``). The
loop's tick reclaims silent sessions and keeps the fd channel's deadlines; lease expiry and the
orphan sweep are the core's clock's. STATUS is answered by ``lmshm.Server.status_reply``.

The trust boundary is ``_on_request``: every byte a peer sends becomes the reply it asked for or
an ``ErrorReply`` with a code, never an exception that reaches the loop, never silence. Who may
send what, floods, and shutdown on SIGINT/SIGTERM: docs/design/service.md and security.md.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import signal
import time
from typing import Any, Callable, Optional, Protocol

import msgspec

from lmshm.core.dataplane import QUEUED
from lmshm.core.errors import ServerError
from lmshm.core.logs import Throttle
from lmshm.core.peek import read_layer
from lmshm.core.registry import Registration
from lmshm.core.service import Core
from lmshm.endpoints.zmq.fds import FdBudget, open_fd_count, raise_fd_limit
from lmshm.endpoints.zmq.sessions import Session, SessionLimitError, Sessions, admission_refusal
from lmshm.platform.base.peer import own_pid_namespace
from lmshm.quoting import clip, quote
from lmshm.settings import ServerConfig
from lmshm.transport import mq
from lmshm.transport.fdchannel import FdChannelServer, default_path
from lmshm.wire import codec, protocol
from lmshm.wire.protocol import ErrorCode

logger = logging.getLogger("lmshm.server")
_refused_log = Throttle(logger)     # a peer's malformed messages: at most a line every 10 s

TICK_S = 0.05
WAKE_READ = 4096            # bytes of the wake-up pipe read at once (a byte per wake-up)
#: Units of KV event index work (core/kv_events ``drain``: a residency report 1, an advert 1 and
#: one more per 16 blocks) the loop applies in one slice once it has been idle for IDLE_QUIET_S
#: (what a request that arrives meanwhile waits for: a STORE of 65,536 adverts is applied over
#: many slices); past IDLE_BACKLOG entries queued, also while copies run
IDLE_ENTRIES = 32
IDLE_QUIET_S = 0.001
IDLE_BACKLOG = 4096
#: A KV_EVENTS read applies at most this many units first (about 1 ms): a reader polling during a
#: burst of STOREs does not stall the loop for the whole backlog; what is left comes next read
KV_EVENTS_APPLY = 256
MAX_REPLY_MESSAGE = 1024
#: A HELLO this long at most is looked at for a resume token (``_resumes_verified``).
MAX_RESUME_HELLO = 1024
#: A ZeroMQ connection without a session is closed after this long (or --auth-timeout, if longer).
IDLE_CONNECTION_S = 5.0
#: a KV_EVENTS reply holds about this many bytes of events at most (the rest: the next read)
KV_EVENTS_REPLY_BYTES = 4 << 20
__all__ = ["StatusSource", "ZmqEndpoint"]


class StatusSource(Protocol):
    """What answers STATUS: ``lmshm.Server.status_reply``."""

    def __call__(self, *, offset: int = 0, limit: Optional[int] = None,
                 minor: int = protocol.PROTOCOL_MINOR) -> protocol.StatusReply: ...


class _Refusal(Exception):
    """A request refused with ``code``: raised inside handlers, answered by ``_on_request``."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class ZmqEndpoint:
    """The ZeroMQ endpoint of ``core`` (a ``lmshm.core.service.Core``), with the settings of
    ``config`` (default: the core's, which must then be a ``ServerConfig``). ``status`` builds
    STATUS's reply (``lmshm.Server.status_reply``: the report is the server's, not this
    endpoint's). ``on_stopping`` runs
    once, when shutdown begins, before anything is released (the composer stops its other
    endpoints). The endpoint's shutdown shuts the core down too, between answering what is
    queued and ending the sessions: copies are answered before the sessions they belong to go."""

    protocol_name = "zmq"

    def __init__(self, core: Core, config: Optional[ServerConfig] = None, *,
                 status: StatusSource, on_stopping: Optional[Callable[[], None]] = None) -> None:
        config = config if config is not None else core.config
        self._status_reply = status
        self.core = core
        self.config = config
        self.server_id = core.server_id
        self.started = core.started
        self.fd_limit = raise_fd_limit()
        self.fds = FdBudget(self.fd_limit)   # kept free, the fd channel's room, shedding marks
        self.registry = core.registry
        self.metrics = core.metrics
        self.dataplane = core.dataplane
        self._on_stopping = on_stopping
        self._stopping = False
        # queued requests not answered yet: (name, arrival) by (identity, request_id), oldest
        # first; a list, since a peer may send another request under an id still in flight
        self._deferred_t0: dict[tuple[bytes, bytes], list[tuple[str, float]]] = {}
        self._deferred = 0          # entries in _deferred_t0 (the lmshm_zmq_requests_queued gauge)
        self._active_at = 0.0       # when the loop last took a request other than KV_EVENTS
        self._request_id = b""      # the request being dispatched (the data plane answers queued ones by it)
        self._handlers: dict[type, Callable[[bytes, Any], Any]] = {
            protocol.Hello: self._hello,
            protocol.RegisterKVCache: self._register,
            protocol.UnregisterKVCache: self._unregister,
            protocol.Status: self._status,
            protocol.Ping: self._ping,
            protocol.Peek: self._peek,
            protocol.Store: self._store,
            protocol.Lookup: self._lookup,
            protocol.Retrieve: self._retrieve,
            protocol.Release: self._release,
            protocol.KvEvents: self._kv_events,
        }
        self._completions: collections.deque = collections.deque()
        self.router = mq.RouterServer(config.url, max_message_bytes=config.max_message_bytes,
                                      receive_queue=config.receive_queue, fd_limit=self.fd_limit,
                                      fd_reserve=self.fds.reserve + self.fds.link_room, count_fds=self.fds.count,
                                      fds_opened=self.fds.count.opened,
                                      idle_timeout_s=max(IDLE_CONNECTION_S, config.auth_timeout_s),
                                      unverified_share=config.unverified_share)
        max_sessions = self.fds.max_sessions(config.max_sessions)
        if max_sessions < config.max_sessions:
            logger.warning("lmshm: the open-file limit (%d) allows %d sessions, fewer than --max-sessions %d",
                           self.fd_limit, max_sessions, config.max_sessions)
        self.sessions = Sessions(config, watch=self.router.watch_fd, unwatch=self.router.unwatch_fd,
                                 on_end=self._session_ended, max_sessions=max_sessions)
        try:
            self.fdchannel = FdChannelServer(
                config.fd_socket or default_path(self.router.url),
                may_connect=functools.partial(admission_refusal, config),
                authenticate=self.sessions.verify,
                on_link_closed=self.sessions.link_closed,
                watch=self.router.watch_fd,
                unwatch=self.router.unwatch_fd,
                max_fds_per_session=config.max_fds_per_session,
                max_pending=max(1, min(config.max_pending_auth, self.fds.link_room // 4)),
                auth_timeout_s=config.auth_timeout_s,
                fds_available=self.fds.available,
            )
        except BaseException:
            self.router.close()
            raise
        self._busy_reply = codec.encode(protocol.ErrorReply(
            ErrorCode.UNAVAILABLE, f"lmshm-server is busy: requests of peers without a verified session may use "
                                   f"{config.unverified_share:.0%} of its time (lmshm-server --unverified-share) and "
                                   "more of them are waiting; try again shortly"))
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.router.watch_fd(self._wake_r, self._drain_wakeups)
        self._shed, self._shed_log_at = 0, 0.0   # the tick logs shedding once a second
        self.metrics.add_gauge("lmshm_sessions", "ZeroMQ sessions (verified or not)", lambda: len(self.sessions))
        listener = self.router.listener
        self.metrics.add_gauge("lmshm_zmq_unverified_bytes", "Bytes held for ZeroMQ connections without a verified "
                               "session (their budget: 16 MiB)", lambda: listener.unverified_bytes)
        self.metrics.add_gauge("lmshm_zmq_over_budget_closed", "ZeroMQ connections without a verified session "
                               "closed because together they held more than their budget",
                               lambda: listener.over_budget)
        self.metrics.add_gauge("lmshm_zmq_requests_queued", "ZeroMQ requests queued for the data plane's threads "
                               "and not answered yet", lambda: self._deferred)
        self.metrics.add_gauge("lmshm_zmq_replies_dropped", "Replies dropped because the peer does not read "
                               "(its send queue was full)", lambda: self.router.unanswered)
        kv = core.kv_index      # KV events (core/kv_events): read by KV_EVENTS here and by --kv-events
        # first: the gauges after it read the index, which applies its queue
        self.metrics.add_gauge("lmshm_kv_events_queued", "Adverts and residency reports the KV event index has "
                               "queued and not applied yet (it applies them when idle, or when read)",
                               lambda: kv.queued)
        self.metrics.add_gauge("lmshm_kv_events_index_chunks", "Advertised chunks the KV event index holds "
                               "(--kv-events-index)", lambda: len(kv))
        self.metrics.add_gauge("lmshm_kv_events_unindexed", "Advertised chunks forgotten to make room: the KV event "
                               "index was full (--kv-events-index)", lambda: kv.unindexed)
        self.metrics.add_gauge("lmshm_kv_events_refused", "STOREs whose adverts did not check (not advertised)",
                               lambda: kv.refused)
        self.metrics.add_gauge("lmshm_kv_events_log_trimmed", "KV event log records dropped from its old end "
                               "(--kv-events-buffer)", lambda: kv.log.trimmed)

    def close_transport(self) -> None:
        """Close the fd channel, the wake-up pipe and the socket (the end of ``shutdown``; also
        undoes ``__init__`` when the server cannot be built after all)."""
        self.fdchannel.close()
        self.router.unwatch_fd(self._wake_r)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.router.close()
        self.router = None  # type: ignore[assignment]

    # ---- lifecycle ----------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self.router.url

    @property
    def stopped(self) -> bool:
        return self._stopping or self.router is None

    def request_stop(self, *_: Any) -> None:
        """Ask the loop to stop (any thread, or a signal handler); it wakes up at once."""
        self._stopping = True
        try:
            os.write(self._wake_w, b"!")
        except (BlockingIOError, OSError):  # full (the loop is awake anyway), or already closed
            pass

    def _drain_wakeups(self) -> None:
        # a read shorter than asked emptied the pipe: one system call per wake-up, not two and
        # a BlockingIOError (30 -> 8 µs here, on the way to every copy's reply: docs/benchmarks.md)
        try:
            while len(os.read(self._wake_r, WAKE_READ)) == WAKE_READ:
                pass
        except BlockingIOError:
            pass
        self._send_completions()

    def complete(self, identity: bytes, request_id: bytes, reply: Any) -> None:
        """A copier thread's answer: queued here, sent by the loop (ZeroMQ sockets are not
        thread-safe)."""
        self._completions.append((identity, request_id, reply))
        try:
            os.write(self._wake_w, b"!")
        except BlockingIOError:  # the pipe is full: the loop is awake anyway
            pass

    def _send_completions(self) -> None:
        while self._completions and self.router is not None:
            identity, request_id, reply = self._completions.popleft()
            started = self._deferred_started(identity, request_id)   # on the loop: set before the job ran
            if started is not None:
                self.metrics.observe("zmq", started[0], _code_of(reply), time.monotonic() - started[1])
            try:
                data = codec.encode(reply)
            except Exception as exc:
                logger.exception("lmshm: could not encode a copy's reply")
                data = codec.encode(protocol.ErrorReply(ErrorCode.INTERNAL, clip(str(exc), 300)))
            self.router.reply(identity, request_id, data)

    def _deferred_started(self, identity: bytes, request_id: bytes) -> Optional[tuple[str, float]]:
        """The name and arrival of the oldest queued request of ``identity`` under ``request_id``,
        taken out of ``_deferred_t0``; None if none was recorded."""
        key = (identity, request_id)
        waiting = self._deferred_t0.get(key)
        if not waiting:
            return None
        started = waiting.pop(0)
        if not waiting:
            del self._deferred_t0[key]
        self._deferred -= 1
        return started

    def run(self) -> None:
        """Serve until ``request_stop()``, then shut down (``lmshm.Server.start()``'s thread)."""
        try:
            self._serve()
        finally:
            self.shutdown()

    def serve_forever(self, *, restore_signals: bool = True) -> None:
        """Serve until SIGINT/SIGTERM, then shut down. From the first signal on, further ones
        are ignored; ``restore_signals=False`` (the command line) keeps ignoring them until the
        process exits, so a signal after the release cannot turn exit status 0 into a kill."""
        old_wakeup = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        old_handlers = {sig: signal.signal(sig, self.request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._serve()
        finally:
            try:
                for sig in old_handlers:  # a second signal must not cut the release short
                    signal.signal(sig, signal.SIG_IGN)
                self.shutdown()
            finally:
                signal.set_wakeup_fd(old_wakeup)
                if restore_signals:
                    for sig, handler in old_handlers.items():
                        signal.signal(sig, handler)

    def _serve(self) -> None:
        self.router.serve(self._on_request, on_tick=self._tick, tick_s=TICK_S, stop=lambda: self._stopping,
                          trusted=self._verified_identity, on_busy=self._busy, vouched=self._resumes_verified,
                          on_idle=self._idle if self.core.kv_index.enabled else None, quiet_s=IDLE_QUIET_S)

    def _idle(self, run: bool) -> bool:
        """The loop has had nothing to do for ``IDLE_QUIET_S`` (``run``): apply a few of the KV
        event index's queued entries, unless a copy job runs (they would take turns at the GIL
        with it) and fewer than ``IDLE_BACKLOG`` are queued; True if more are left. Not
        ``run``: whether there is any such work."""
        kv = self.core.kv_index
        queued = kv.queued
        if not queued or (queued < IDLE_BACKLOG and self.dataplane.busy()):
            return False
        if run:
            kv.drain(IDLE_ENTRIES)
        return kv.queued > 0

    def _kv_events_apply(self, queued: int) -> int:
        """How many queued index entries a KV_EVENTS read applies before it reads: none while
        other requests keep the loop busy (one came within ``IDLE_QUIET_S``, or a copy or a
        promotion runs or waits: their replies would wait for this loop) and fewer than
        ``IDLE_BACKLOG`` are queued, as for ``_idle``; else up to ``KV_EVENTS_APPLY``. So during
        a burst of STOREs a reader sees their events once the loop is idle, or once the
        backlog passes ``IDLE_BACKLOG``."""
        if queued < IDLE_BACKLOG and (time.monotonic() - self._active_at < IDLE_QUIET_S or self.dataplane.busy()):
            return 0
        return KV_EVENTS_APPLY

    def _has_session(self, identity: bytes) -> bool:
        return identity in self.sessions

    def _verified_identity(self, identity: bytes) -> bool:
        session = self.sessions.of(identity)
        return session is not None and session.peer is not None

    def _resumes_verified(self, identity: bytes, frames: list[bytes]) -> bool:
        """Whether this message, from a connection without a verified session, is a HELLO that
        resumes a verified session: its token proves it, so it runs at once rather than wait
        among the floods of unverified peers (a worker whose connection was shed before its
        proof comes back this way). Anything else costs a substring test; a small message
        naming a resume token, one decode."""
        if len(frames) != 2 or len(frames[1]) > MAX_RESUME_HELLO or b"resume_token" not in frames[1]:
            return False
        try:
            msg = codec.decode_request(frames[1])
        except Exception:
            return False
        return isinstance(msg, protocol.Hello) and self.sessions.is_verified_token(msg.resume_token)

    def _busy(self, identity: bytes, request_id: bytes) -> None:
        """A request of a peer without a verified session that cannot even wait (see
        ``mq.UnverifiedShare``): answered at once, without being decoded."""
        self.metrics.observe("zmq", "busy", "UNAVAILABLE", 0.0)
        self.router.reply(identity, request_id, self._busy_reply)

    def shutdown(self) -> None:
        """Answer what is queued, release everything, remove socket files. Idempotent."""
        if self.router is None:
            return
        self._stopping = True
        if self._on_stopping is not None:
            self._on_stopping()  # the HTTP and gRPC endpoints: no new regions from here on
        self.router.drain(self._on_request)
        released = self.core.shutdown()  # queued copies are answered UNAVAILABLE, running ones finish
        self._send_completions()
        for session in self.sessions:
            self.sessions.end(session, "server shutdown", orphaned=False)
        self.close_transport()
        logger.info("lmshm-server stopped; released %d registration(s)", released)

    def _tick(self) -> None:
        self.sessions.reap()
        self.fdchannel.expire()
        dropped = self.router.drop_idle(self._has_session)
        if dropped:
            logger.info("lmshm: closed %d ZeroMQ connection(s) without a session for %g s", dropped,
                        self.router.idle_timeout_s)
        self._shed += self.router.shed(self._verified_identity, low=self.fds.shed_below, high=self.fds.shed_to)
        if self._shed and time.monotonic() >= self._shed_log_at:
            logger.warning("lmshm: few file descriptors free: closed %d ZeroMQ connection(s) without a verified "
                           "session, the oldest first, to accept waiting ones", self._shed)
            self._shed, self._shed_log_at = 0, time.monotonic() + 1.0

    # ---- dispatch: the trust boundary ---------------------------------------------------
    def _on_request(self, identity: bytes, request_id: bytes, body: Optional[bytes], problem: Optional[str]) -> None:
        started = time.monotonic()
        self._request_name = "invalid"
        self._request_id = request_id
        try:
            reply = self._dispatch(identity, body, problem)
            if reply is QUEUED:   # the data plane answers it later, through complete()
                self._deferred_t0.setdefault((identity, request_id), []).append((self._request_name, started))
                self._deferred += 1
                return
            self.metrics.observe("zmq", self._request_name, _code_of(reply), time.monotonic() - started)
            data = codec.encode(reply)
        except Exception as exc:
            logger.exception("lmshm: could not build a reply")
            data = codec.encode(protocol.ErrorReply(
                ErrorCode.INTERNAL, clip(f"the server could not encode its reply: {type(exc).__name__}: "
                                         f"{quote(str(exc), 200)}", MAX_REPLY_MESSAGE)))
        self.router.reply(identity, request_id, data)

    def _dispatch(self, identity: bytes, body: Optional[bytes], problem: Optional[str]) -> Any:
        if problem is not None:
            _refused_log.warning("lmshm: refused a message: %s", clip(problem, 300))
            return protocol.ErrorReply(ErrorCode.INVALID_ARG, clip(problem, MAX_REPLY_MESSAGE))
        try:
            request = codec.decode_request(body)
        except Exception as exc:
            _refused_log.warning("lmshm: refused a message: %s", clip(str(exc), 300))
            newer = _newer_hello(body)
            if newer is not None:
                return protocol.ErrorReply(ErrorCode.UNSUPPORTED, newer)
            return protocol.ErrorReply(ErrorCode.INVALID_ARG, clip(str(exc), MAX_REPLY_MESSAGE))
        name = type(request).__name__
        self._request_name = name
        if not isinstance(request, protocol.KvEvents):
            self._active_at = time.monotonic()
        try:
            if self._stopping:
                raise _Refusal(ErrorCode.UNAVAILABLE, "lmshm-server is shutting down")
            session = self.sessions.of(identity)
            if session is not None:
                session.last_seen = time.monotonic()
            elif not isinstance(request, (protocol.Hello, *protocol.SESSIONLESS)):
                raise _Refusal(ErrorCode.UNAVAILABLE,
                               f"no session for this connection: send HELLO before {name} "
                               f"(the server may have restarted; server id {self.server_id})")
            return self._handlers[type(request)](identity, request)
        except _Refusal as exc:
            return protocol.ErrorReply(exc.code, clip(exc.message, MAX_REPLY_MESSAGE))
        except ServerError as exc:  # the registry's, the data plane's, the regions'
            return protocol.ErrorReply(exc.code, clip(exc.message, MAX_REPLY_MESSAGE))
        except Exception as exc:
            logger.exception("lmshm: %s handler failed", name)
            return protocol.ErrorReply(ErrorCode.INTERNAL, clip(
                f"{name} failed in the server: {type(exc).__name__}: {clip(str(exc), 300)}", MAX_REPLY_MESSAGE))

    # ---- handlers -----------------------------------------------------------------------
    def _hello(self, identity: bytes, req: protocol.Hello) -> Any:
        ours = f"{protocol.PROTOCOL_VERSION}.{protocol.PROTOCOL_MINOR}"
        theirs = f"{quote(req.protocol_version)}.{quote(req.protocol_minor)}"
        if req.protocol_version != protocol.PROTOCOL_VERSION:
            raise _Refusal(ErrorCode.UNSUPPORTED,
                           f"protocol version mismatch: the client speaks version {theirs}, this lmshm-server "
                           f"speaks version {ours}, another major version; run the same lmshm release on both sides")
        if req.protocol_minor > protocol.PROTOCOL_MINOR:
            raise _Refusal(ErrorCode.UNSUPPORTED,
                           f"protocol version mismatch: the client speaks version {theirs}, newer than this "
                           f"lmshm-server's {ours}; upgrade lmshm-server (or use a client of version {ours})")
        if req.isolated_ipc != self.config.isolated_ipc:
            onoff = {True: "on", False: "off"}
            raise _Refusal(ErrorCode.UNSUPPORTED,
                           f"isolated_ipc mismatch: the worker has isolated_ipc={onoff[req.isolated_ipc]}, the server "
                           f"has isolated_ipc={onoff[self.config.isolated_ipc]}; set LMSHM_ISOLATED_IPC the same on "
                           "both sides (server: --isolated-ipc / --no-isolated-ipc)")
        self._check_name("client name", req.client_name, allow_empty=True)
        session = self.sessions.of(identity)
        resumed = session is not None
        if session is None and req.resume_token:
            session = self.sessions.resume(identity, req.resume_token)
            resumed = session is not None
        if session is None:
            if not self.fds.available():
                raise _Refusal(ErrorCode.UNAVAILABLE,
                               f"lmshm-server is out of file descriptors ({open_fd_count()} open, limit "
                               f"{self.fd_limit}); try again later, or raise its open-file limit")
            try:
                session = self.sessions.open(identity, req.client_name)
            except SessionLimitError as exc:
                raise _Refusal(ErrorCode.UNAVAILABLE, str(exc)) from None
        session.last_seen = time.monotonic()
        return protocol.HelloReply(
            protocol_version=protocol.PROTOCOL_VERSION, protocol_minor=protocol.PROTOCOL_MINOR,
            server_id=self.server_id, server_pid=os.getpid(),
            server_uid=os.geteuid(), server_pid_ns=own_pid_namespace(),
            session_id=session.id, session_token=session.token, resumed=resumed, verified=session.verified,
            fd_socket=self.fdchannel.path, isolated_ipc=self.config.isolated_ipc,
            heartbeat_interval_s=self.config.heartbeat_interval_s, reap_timeout_s=self.config.reap_timeout_s,
            auth_timeout_s=self.config.auth_timeout_s, max_message_bytes=self.config.max_message_bytes)

    def _verified(self, identity: bytes, what: str) -> Session:
        session = self.sessions.of(identity)
        if session is None or session.peer is None:
            raise _Refusal(ErrorCode.PERMISSION_DENIED,
                           f"{what} needs a verified identity: connect to the fd socket {self.fdchannel.path} and "
                           "present this session's token first (lmshm's MPClient does; the worker must run on "
                           "this host and reach that path)")
        return session

    def _check_name(self, what: str, value: str, *, allow_empty: bool = False) -> None:
        limit = self.config.max_name_bytes
        if len(value) > limit or len(value.encode("utf-8", "surrogatepass")) > limit:
            raise _Refusal(ErrorCode.INVALID_ARG, f"{what} {quote(value, 40)} is longer than {limit} bytes "
                                                  "(lmshm-server --max-name-bytes)")
        if not allow_empty and not value:
            raise _Refusal(ErrorCode.INVALID_ARG, f"{what} is empty")

    def _check_names(self, what: str, names: list[str]) -> None:
        """``_check_name`` for many names; a name of at most limit/4 characters cannot exceed
        the limit in UTF-8, so the common case costs two C-level passes."""
        if all(names) and max(map(len, names), default=0) * 4 <= self.config.max_name_bytes:
            return
        for n in names:
            self._check_name(what, n)

    def _may_touch(self, session: Session, reg: Registration, what: str) -> None:
        if reg.owner != session.id and session.peer.uid not in self.config.admin_uids:
            raise _Refusal(ErrorCode.PERMISSION_DENIED,
                           f"instance {quote(reg.instance_id, 60)} belongs to another session (pid {reg.owner_pid}); "
                           f"only its owner may {what} it (or an --admin-uid)")

    def _register(self, identity: bytes, req: protocol.RegisterKVCache) -> Any:
        try:
            session = self._verified(identity, "REGISTER")
            self._check_name("instance id", req.instance_id)
            self._check_name("model name", req.model_name, allow_empty=True)
            layers = sum(len(g.names) for g in req.groups)
            for g in req.groups:
                self._check_names("layer name", g.names)
            regs, held, holds_id = self.registry.count_owned(session.id, req.instance_id)
            if not holds_id:
                if regs >= self.config.max_registrations_per_session:
                    raise _Refusal(ErrorCode.UNAVAILABLE,
                                   f"this session already holds {regs} registrations, the server's limit "
                                   "(lmshm-server --max-registrations-per-session)")
                if held + layers > self.config.max_layers_per_session:
                    raise _Refusal(ErrorCode.UNAVAILABLE,
                                   f"this session would hold {held + layers} layers, more than the server's limit "
                                   f"of {self.config.max_layers_per_session} (lmshm-server --max-layers-per-session)")
        except BaseException:
            self.registry.refuse(req.groups, self.sessions.of(identity).id)  # dispatch checked the session
            raise
        reg, refreshed = self.registry.register(
            peer=session.peer, client_name=session.client_name, instance_id=req.instance_id,
            model_name=req.model_name, world_size=req.world_size, worker_rank=req.worker_rank, groups=req.groups,
            block_dim=req.block_dim)
        if not refreshed:
            logger.info("lmshm: registered %s for %s: %d layers, %d bytes, block_dim %d", quote(reg.instance_id, 60),
                        session.peer.describe(), reg.num_layers, reg.nbytes, reg.block_dim)
            self.dataplane.pool.expect_stores()     # its first STOREs find populated pages
        return protocol.RegisterReply(reg.instance_id, reg.num_layers, reg.nbytes, refreshed)

    def _unregister(self, identity: bytes, req: protocol.UnregisterKVCache) -> Any:
        session = self._verified(identity, "UNREGISTER")
        self._may_touch(session, self.registry.get(req.instance_id), "unregister")
        deferred = self.registry.unregister(req.instance_id)
        return protocol.UnregisterReply(req.instance_id, deferred)

    def _status(self, identity: bytes, req: protocol.Status) -> Any:
        return self._status_reply(offset=req.offset, limit=req.limit, minor=req.minor)

    def _ping(self, identity: bytes, req: protocol.Ping) -> Any:
        return protocol.Pong(self.server_id, self.sessions.of(identity) is not None)

    def _peek(self, identity: bytes, req: protocol.Peek) -> Any:
        session = self._verified(identity, "PEEK")
        with self.registry.hold(req.instance_id) as reg:
            self._may_touch(session, reg, "peek at")
            return protocol.PeekReply(read_layer(reg, req.layer_name, req.offset, req.length))

    # ---- the data plane (lmshm.core.dataplane) -----------------------------------------
    def _store(self, identity: bytes, req: protocol.Store) -> Any:
        return self.dataplane.store(self._verified(identity, "STORE"), req, (identity, self._request_id))

    def _retrieve(self, identity: bytes, req: protocol.Retrieve) -> Any:
        return self.dataplane.retrieve(self._verified(identity, "RETRIEVE"), req, (identity, self._request_id))

    def _lookup(self, identity: bytes, req: protocol.Lookup) -> Any:
        return self.dataplane.lookup(self._verified(identity, "LOOKUP"), req, (identity, self._request_id))

    def _release(self, identity: bytes, req: protocol.Release) -> Any:
        return self.dataplane.release(self._verified(identity, "RELEASE"), req)

    def _kv_events(self, identity: bytes, req: protocol.KvEvents) -> Any:
        """A connector reads the KV events of its own uid (the kernel's) and namespaces."""
        session = self._verified(identity, "KV_EVENTS")
        kv = self.core.kv_index
        log = kv.log
        records, cursor, lost = log.read(req.after, req.limit, uid=session.peer.uid, spaces=req.spaces,
                                         max_bytes=KV_EVENTS_REPLY_BYTES, apply=self._kv_events_apply(kv.queued))
        # r.ev, not r.event, to skip attach records: r.event builds a BlockStored on each call
        return protocol.KvEventsReply(log.epoch, cursor, lost, [r.event for r in records if r.ev is not None])

    # ---- session ends -------------------------------------------------------------------
    def _session_ended(self, session: Session, reason: str, orphaned: bool) -> None:
        started = time.monotonic()
        self.dataplane.session_ended(session.id)
        released = self.registry.release_owner(session.id, orphaned=orphaned)
        self.fdchannel.close_session(session.id)
        if reason != "server shutdown":
            self.metrics.reclaims.labels("worker exited" if orphaned else "session ended").inc()
            self.metrics.reclaim_latency.observe(time.monotonic() - started)
        log = logger.info if released or reason != "server shutdown" else logger.debug
        log("lmshm: %s ended: %s; reclaimed %s", session.describe(), reason,
            ", ".join(quote(i, 40) for i in released[:8]) + (f" and {len(released) - 8} more" if len(released) > 8 else "")
            if released else "nothing")


def _newer_hello(body: Optional[bytes]) -> Optional[str]:
    """Why a HELLO that did not decode is refused, if it comes from a newer protocol version."""
    try:
        v = msgspec.msgpack.decode(body or b"", type=protocol.HelloVersion)
    except Exception:
        return None
    if v.type != protocol.MsgType.HELLO or (v.protocol_version, v.protocol_minor) <= (
            protocol.PROTOCOL_VERSION, protocol.PROTOCOL_MINOR):
        return None
    return (f"protocol version mismatch: the client speaks version {v.protocol_version}.{v.protocol_minor}, newer "
            f"than this lmshm-server's {protocol.PROTOCOL_VERSION}.{protocol.PROTOCOL_MINOR}; upgrade lmshm-server")


def _code_of(reply: Any) -> str:
    if isinstance(reply, protocol.ErrorReply):
        try:
            return ErrorCode(reply.code).name
        except ValueError:
            return str(reply.code)
    return "OK"
