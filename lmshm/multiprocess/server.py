"""``lmshm-server``: the cache-server process that maps workers' KV caches.

One thread runs everything: the ROUTER loop (``mq.RouterServer``) polls the ZeroMQ socket,
the fd channel's Unix sockets, one pidfd per watched worker and the signal wake-up pipe.
Handlers are short (decoding, mapping, bookkeeping), so nothing needs a second thread.

Sessions. A worker's HELLO opens a session: a number, a secret token (it authenticates the
fd channel and lets the client resume the session from a fresh ZeroMQ socket), the worker's
pid and how the server can tell when it is gone. The session owns its registrations (in the
``Registry``) and the fds it sent (in ``FD_INBOX``); ending a session releases both, once.

A session ends -- and its registrations are reclaimed -- on the first of:
- the worker's pidfd becomes readable (same boot id and PID namespace: the process exited,
  however it died; this is what makes SIGKILL reclaim take milliseconds);
- its fd-channel connection reaches EOF (the kernel closes it when the worker dies, in any
  namespace; also a client's clean close);
- nothing heard from it for ``reap_timeout_s`` (clients PING every heartbeat interval).
When the owner is known dead, the wrappers' ``release_orphaned()`` also runs, so segment
names a SIGKILLed worker could not unlink do not stay in /dev/shm.

SIGINT/SIGTERM: requests already queued are answered UNAVAILABLE, every registration is
released, every fd closed, socket files removed, and the process exits 0.

Every request gets a reply (protocol.py); a handler that raises becomes INTERNAL.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import select
import signal
import sys
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional

import torch

from lmshm.multiprocess import codec, mq, protocol
from lmshm.multiprocess.fdchannel import FdChannelError, FdChannelServer, default_path
from lmshm.multiprocess.protocol import ErrorCode
from lmshm.multiprocess.registry import Registry, RegistryError
from lmshm.platform import ipc_policy
from lmshm.platform.base.mappings import MAPPINGS

logger = logging.getLogger("lmshm.server")

TICK_S = 0.05
#: How long a live, pid-watched worker may be without its fd-channel link before its session
#: ends: a dying process closes its sockets a moment before its pidfd turns readable.
LINK_GRACE_S = 0.25


@dataclass
class ServerConfig:
    url: str = mq.DEFAULT_URL
    isolated_ipc: bool = False
    reap_timeout_s: float = 10.0
    fd_socket: str = ""                  # "" = derived from the endpoint (fdchannel.default_path)
    max_message_bytes: int = mq.DEFAULT_MAX_MESSAGE_BYTES
    log_level: str = "INFO"
    allow_foreign_unregister: bool = False

    @property
    def heartbeat_interval_s(self) -> float:
        return min(5.0, max(0.05, self.reap_timeout_s / 4))


@dataclass(eq=False)
class Session:
    id: int
    token: str
    identity: bytes
    pid: int
    client_name: str
    pidfd: Optional[int] = None
    link_lost: Optional[float] = None    # when its fd-channel link closed while the pid lived
    last_seen: float = field(default_factory=time.monotonic)


class Server:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.server_id = secrets.token_hex(8)
        self.started = time.monotonic()
        self.registry = Registry()
        self._boot_id, self._pid_ns = protocol.host_identity()
        self._sessions: dict[int, Session] = {}
        self._by_identity: dict[bytes, Session] = {}
        self._by_token: dict[str, Session] = {}
        self._next_session = 1
        self._stopping = False
        self._handlers: dict[type, Callable[[bytes, Any], Any]] = {
            protocol.Hello: self._hello,
            protocol.RegisterKVCache: self._register,
            protocol.UnregisterKVCache: self._unregister,
            protocol.Status: self._status,
            protocol.Ping: self._ping,
            protocol.Peek: self._peek,
        }
        self.router = mq.RouterServer(config.url, max_message_bytes=config.max_message_bytes)
        try:
            self.fdchannel = FdChannelServer(
                config.fd_socket or default_path(self.router.url),
                authenticate=self._authenticate_link,
                on_link_closed=self._link_closed,
                watch=self.router.watch_fd,
                unwatch=self.router.unwatch_fd,
            )
        except BaseException:
            self.router.close()
            raise
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.router.watch_fd(self._wake_r, self._drain_wakeups)

    # ---- lifecycle ----------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self.router.url

    def request_stop(self, *_: Any) -> None:
        self._stopping = True

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self._wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def serve_forever(self) -> None:
        old_wakeup = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        old_handlers = {sig: signal.signal(sig, self.request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.router.serve(self._on_request, on_tick=self._reap_silent, tick_s=TICK_S,
                              stop=lambda: self._stopping)
        finally:
            signal.set_wakeup_fd(old_wakeup)
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
            self.shutdown()

    def shutdown(self) -> None:
        """Answer what is queued, release everything, remove socket files. Idempotent."""
        if self.router is None:
            return
        self._stopping = True
        self.router.drain(self._on_request)
        released = self.registry.release_all()
        for session in list(self._sessions.values()):
            self._end_session(session, "server shutdown", orphaned=False)
        self.fdchannel.close()
        self.router.unwatch_fd(self._wake_r)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.router.close()
        self.router = None  # type: ignore[assignment]
        logger.info("lmshm-server stopped; released %d registration(s)", released)

    # ---- dispatch -----------------------------------------------------------------------
    def _on_request(self, identity: bytes, request_id: bytes, body: Optional[bytes], problem: Optional[str]) -> None:
        reply = self._dispatch(identity, body, problem)
        self.router.reply(identity, request_id, codec.encode(reply))

    def _dispatch(self, identity: bytes, body: Optional[bytes], problem: Optional[str]) -> Any:
        if problem is not None:
            logger.warning("lmshm: refused a message: %s", problem)
            return protocol.ErrorReply(ErrorCode.INVALID_ARG, problem)
        try:
            request = codec.decode_request(body)
        except codec.CodecError as exc:
            logger.warning("lmshm: refused a message: %s", exc)
            return protocol.ErrorReply(ErrorCode.INVALID_ARG, str(exc))
        try:
            if self._stopping:
                return protocol.ErrorReply(ErrorCode.UNAVAILABLE, "lmshm-server is shutting down")
            session = self._by_identity.get(identity)
            if session is not None:
                session.last_seen = time.monotonic()
            elif not isinstance(request, (protocol.Hello, *protocol.SESSIONLESS)):
                return protocol.ErrorReply(
                    ErrorCode.UNAVAILABLE,
                    f"no session for this connection: send HELLO before {type(request).__name__} "
                    f"(the server may have restarted; server id {self.server_id})")
            return self._handlers[type(request)](identity, request)
        except RegistryError as exc:
            return protocol.ErrorReply(exc.code, exc.message)
        except Exception as exc:  # noqa: BLE001 - every request gets a reply
            logger.exception("lmshm: %s handler failed", type(request).__name__)
            return protocol.ErrorReply(ErrorCode.INTERNAL, f"{type(request).__name__} failed in the server: "
                                       f"{type(exc).__name__}: {exc}")

    # ---- handlers -----------------------------------------------------------------------
    def _hello(self, identity: bytes, req: protocol.Hello) -> Any:
        if req.protocol_version != protocol.PROTOCOL_VERSION:
            return protocol.ErrorReply(
                ErrorCode.UNSUPPORTED,
                f"protocol version mismatch: the client speaks version {req.protocol_version}, this "
                f"lmshm-server speaks version {protocol.PROTOCOL_VERSION}; run the same lmshm release on both sides")
        if req.isolated_ipc != self.config.isolated_ipc:
            onoff = {True: "on", False: "off"}
            return protocol.ErrorReply(
                ErrorCode.UNSUPPORTED,
                f"isolated_ipc mismatch: the worker (pid {req.pid}) has isolated_ipc={onoff[req.isolated_ipc]}, "
                f"the server has isolated_ipc={onoff[self.config.isolated_ipc]}; set LMSHM_ISOLATED_IPC the same "
                "on both sides (server: --isolated-ipc / --no-isolated-ipc)")
        session = self._by_identity.get(identity)
        resumed = session is not None
        if session is None and req.resume_token:
            old = self._by_token.get(req.resume_token)
            if old is not None and old.pid == req.pid:
                self._by_identity.pop(old.identity, None)
                old.identity = identity
                self._by_identity[identity] = session = old
                resumed = True
        if session is None:
            session = self._open_session(identity, req)
        session.last_seen = time.monotonic()
        return protocol.HelloReply(
            protocol_version=protocol.PROTOCOL_VERSION, server_id=self.server_id, server_pid=os.getpid(),
            session_id=session.id, session_token=session.token, resumed=resumed,
            fd_socket=self.fdchannel.path, isolated_ipc=self.config.isolated_ipc,
            heartbeat_interval_s=self.config.heartbeat_interval_s, reap_timeout_s=self.config.reap_timeout_s,
            max_message_bytes=self.config.max_message_bytes, pid_watched=session.pidfd is not None)

    def _open_session(self, identity: bytes, req: protocol.Hello) -> Session:
        session = Session(self._next_session, secrets.token_hex(16), identity, req.pid, req.client_name)
        self._next_session += 1
        if req.boot_id and req.boot_id == self._boot_id and req.pid_namespace == self._pid_ns:
            try:
                session.pidfd = os.pidfd_open(req.pid)
            except OSError as exc:  # gone already, or no pidfd support: fall back to link/heartbeat
                logger.info("lmshm: cannot watch pid %d (%s); relying on disconnect and heartbeat", req.pid, exc)
        if session.pidfd is not None:
            self.router.watch_fd(session.pidfd, lambda: self._pid_exited(session))
        self._sessions[session.id] = session
        self._by_identity[identity] = session
        self._by_token[session.token] = session
        logger.info("lmshm: session %d opened for pid %d %s(%s)", session.id, req.pid,
                    f"'{req.client_name}' " if req.client_name else "",
                    "pid watched" if session.pidfd is not None else "heartbeat only")
        return session

    def _register(self, identity: bytes, req: protocol.RegisterKVCache) -> Any:
        session = self._by_identity[identity]
        reg, refreshed = self.registry.register(
            owner=session.id, owner_pid=session.pid, client_name=session.client_name,
            instance_id=req.instance_id, model_name=req.model_name, world_size=req.world_size,
            worker_rank=req.worker_rank, groups=req.groups)
        if not refreshed:
            logger.info("lmshm: registered %r for pid %d: %d layers, %d bytes", reg.instance_id,
                        session.pid, reg.num_layers, reg.nbytes)
        return protocol.RegisterReply(reg.instance_id, reg.num_layers, reg.nbytes, refreshed)

    def _unregister(self, identity: bytes, req: protocol.UnregisterKVCache) -> Any:
        session = self._by_identity[identity]
        deferred = self.registry.unregister(req.instance_id, owner=session.id,
                                            force=self.config.allow_foreign_unregister)
        return protocol.UnregisterReply(req.instance_id, deferred)

    def _status(self, identity: bytes, req: protocol.Status) -> Any:
        now = time.time()
        regs = [
            protocol.RegistrationInfo(
                instance_id=r.instance_id, owner_session=r.owner, owner_pid=r.owner_pid,
                client_name=r.client_name, model_name=r.model_name, world_size=r.world_size,
                worker_rank=r.worker_rank, num_layers=r.num_layers, nbytes=r.nbytes,
                kinds=sorted({w.kind for w in r.wrappers}), devices=sorted({w.device for w in r.wrappers}),
                age_s=round(now - r.created, 3))
            for r in sorted(self.registry.registrations(), key=lambda r: r.created)
        ]
        return protocol.StatusReply(
            server_id=self.server_id, server_pid=os.getpid(), protocol_version=protocol.PROTOCOL_VERSION,
            isolated_ipc=self.config.isolated_ipc, uptime_s=round(time.monotonic() - self.started, 3),
            sessions=len(self._sessions), mappings=len(MAPPINGS), draining=self.registry.draining,
            registrations=regs)

    def _ping(self, identity: bytes, req: protocol.Ping) -> Any:
        return protocol.Pong(self.server_id, identity in self._by_identity)

    def _peek(self, identity: bytes, req: protocol.Peek) -> Any:
        if not 0 <= req.length <= protocol.PEEK_MAX_BYTES:
            return protocol.ErrorReply(ErrorCode.INVALID_ARG,
                                       f"peek length {req.length} is not in [0, {protocol.PEEK_MAX_BYTES}]")
        with self.registry.hold(req.instance_id) as reg:
            tensor = reg.tensor(req.layer_name)
            if tensor is None:
                return protocol.ErrorReply(ErrorCode.NOT_FOUND,
                                           f"instance {req.instance_id!r} has no layer {req.layer_name!r}")
            item = tensor.element_size()
            span = (sum((s - 1) * st for s, st in zip(tensor.shape, tensor.stride())) + 1) * item \
                if tensor.numel() else 0
            if not 0 <= req.offset <= span:
                return protocol.ErrorReply(ErrorCode.INVALID_ARG,
                                           f"peek offset {req.offset} is outside layer {req.layer_name!r} ({span} bytes)")
            n = min(req.length, span - req.offset)
            u8 = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(
                tensor.untyped_storage(), tensor.storage_offset() * item + req.offset, (n,))
            return protocol.PeekReply(u8.cpu().numpy().tobytes())  # a GPU layer: one small D2H copy

    # ---- session ends -------------------------------------------------------------------
    def _pid_exited(self, session: Session) -> None:
        self._end_session(session, f"worker pid {session.pid} exited", orphaned=True)

    def _authenticate_link(self, token: str) -> Optional[int]:
        session = self._by_token.get(token)
        if session is None:
            return None
        session.link_lost = None  # a (re)connected link
        return session.id

    def _link_closed(self, session_id: Any) -> None:
        session = self._sessions.get(session_id)
        if session is None:
            return
        if self._pid_alive(session):
            # A dying process closes its sockets before its pidfd turns readable. Give the
            # pidfd a moment to say "exited" (orphaned: unlink names); a worker that merely
            # closed its client is released after the grace period (_reap_silent).
            session.link_lost = time.monotonic()
            return
        self._end_session(session, "fd-channel connection closed", orphaned=True)

    def _pid_alive(self, session: Session) -> bool:
        """True only if the pidfd proves the worker still runs."""
        if session.pidfd is None:
            return False
        return not select.select([session.pidfd], [], [], 0)[0]

    def _reap_silent(self) -> None:
        now = time.monotonic()
        deadline = now - self.config.reap_timeout_s
        for session in list(self._sessions.values()):
            if session.link_lost is not None and now - session.link_lost > LINK_GRACE_S:
                self._end_session(session, "fd-channel connection closed by a live worker",
                                  orphaned=not self._pid_alive(session))
            elif session.last_seen < deadline:
                self._end_session(session, f"no message for {self.config.reap_timeout_s:g} s",
                                  orphaned=not self._pid_alive(session))

    def _end_session(self, session: Session, reason: str, *, orphaned: bool) -> None:
        if self._sessions.pop(session.id, None) is None:
            return
        if self._by_identity.get(session.identity) is session:
            del self._by_identity[session.identity]
        self._by_token.pop(session.token, None)
        released = self.registry.release_owner(session.id, orphaned=orphaned)
        self.fdchannel.close_session(session.id)
        if session.pidfd is not None:
            self.router.unwatch_fd(session.pidfd)
            os.close(session.pidfd)
            session.pidfd = None
        log = logger.info if released or reason != "server shutdown" else logger.debug
        log("lmshm: session %d (pid %d) ended: %s; reclaimed %s", session.id, session.pid, reason,
            ", ".join(repr(i) for i in released) or "nothing")


# ---- command line -----------------------------------------------------------------------

_ENV = {
    "url": "LMSHM_URL",
    "host": "LMSHM_HOST",
    "port": "LMSHM_PORT",
    "isolated_ipc": ipc_policy.ISOLATED_IPC_ENV,
    "reap_timeout_s": "LMSHM_REAP_TIMEOUT",
    "fd_socket": "LMSHM_FD_SOCKET",
    "max_message_bytes": "LMSHM_MAX_MESSAGE_BYTES",
    "log_level": "LMSHM_LOG_LEVEL",
    "allow_foreign_unregister": "LMSHM_ALLOW_FOREIGN_UNREGISTER",
}
# TOML key -> config field
_TOML_KEYS = {"url": "url", "host": "host", "port": "port", "isolated_ipc": "isolated_ipc",
              "reap_timeout": "reap_timeout_s", "fd_socket": "fd_socket",
              "max_message_bytes": "max_message_bytes", "log_level": "log_level",
              "allow_foreign_unregister": "allow_foreign_unregister"}


class ConfigError(ValueError):
    pass


def _parse_bool(name: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    value = str(raw).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean; use true/false, 1/0, yes/no or on/off")


def _load_toml(path: str) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ConfigError("reading --config needs Python >= 3.11 (tomllib) or the tomli package") from None
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    data = data.get("lmshm-server", data)  # accept a [lmshm-server] table or top-level keys
    unknown = sorted(set(data) - set(_TOML_KEYS))
    if unknown:
        raise ConfigError(f"config file {path}: unknown key(s) {', '.join(unknown)}; known: {', '.join(_TOML_KEYS)}")
    return {_TOML_KEYS[k]: v for k, v in data.items()}


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmshm-server",
        description="Map inference workers' KV caches with zero copies and keep a registry of them. "
                    "Every option also reads an environment variable (shown) and a key of the --config "
                    "TOML file; the command line wins over the environment, which wins over the file.")
    p.add_argument("--url", help=f"endpoint, tcp://HOST:PORT or ipc://PATH (LMSHM_URL; default {mq.DEFAULT_URL})")
    p.add_argument("--host", help="TCP host when --url is not given (LMSHM_HOST; default 127.0.0.1)")
    p.add_argument("--port", type=int, help="TCP port when --url is not given; 0 picks a free one (LMSHM_PORT; default 5555)")
    p.add_argument("--isolated-ipc", action=argparse.BooleanOptionalAction, default=None,
                   help="workers share neither /dev/shm nor an IPC namespace: CPU memory arrives as memfd fds "
                        "(LMSHM_ISOLATED_IPC; default off). Workers must use the same setting.")
    p.add_argument("--reap-timeout", type=float, dest="reap_timeout_s", metavar="SECONDS",
                   help="reclaim a session silent for this long (LMSHM_REAP_TIMEOUT; default 10). Dead "
                        "same-host workers are reclaimed at once through pidfd or their fd-channel link.")
    p.add_argument("--fd-socket", metavar="PATH",
                   help="Unix socket for file descriptors (LMSHM_FD_SOCKET; default beside the endpoint)")
    p.add_argument("--max-message-bytes", type=int, metavar="N",
                   help=f"largest request accepted (LMSHM_MAX_MESSAGE_BYTES; default {mq.DEFAULT_MAX_MESSAGE_BYTES})")
    p.add_argument("--allow-foreign-unregister", action=argparse.BooleanOptionalAction, default=None,
                   help="let any client unregister any instance (LMSHM_ALLOW_FOREIGN_UNREGISTER; default off)")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR (LMSHM_LOG_LEVEL; default INFO)")
    p.add_argument("--config", metavar="FILE", help="TOML file with any of the keys above (LMSHM_CONFIG)")
    return p


def resolve_config(args: argparse.Namespace, environ: Optional[dict[str, str]] = None) -> ServerConfig:
    env = os.environ if environ is None else environ
    config_path = args.config or env.get("LMSHM_CONFIG")
    from_file = _load_toml(config_path) if config_path else {}
    merged: dict[str, Any] = {}
    for key, env_name in _ENV.items():
        cli = getattr(args, key, None)
        if cli is not None:
            merged[key] = cli
        elif env.get(env_name, "") != "":
            merged[key] = env[env_name]
        elif key in from_file:
            merged[key] = from_file[key]
    def number(key: str, kind: type, value: Any) -> Any:
        try:
            if isinstance(value, bool):
                raise ValueError
            return kind(value)
        except (TypeError, ValueError):
            toml_key = next(k for k, v in _TOML_KEYS.items() if v == key)
            raise ConfigError(f"bad setting {toml_key} ({_ENV[key]}, or --config key {toml_key!r}): expected "
                              f"{'an integer' if kind is int else 'a number'}, got {value!r}") from None

    if "url" not in merged and ("host" in merged or "port" in merged):
        port = number("port", int, merged.get("port", 5555))
        merged["url"] = f"tcp://{merged.get('host', '127.0.0.1')}:{port}"
    merged.pop("host", None)
    merged.pop("port", None)
    try:
        for key in ("isolated_ipc", "allow_foreign_unregister"):
            if key in merged:
                merged[key] = _parse_bool(_ENV[key], merged[key])
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"bad setting: {exc}") from None
    if "reap_timeout_s" in merged:
        merged["reap_timeout_s"] = number("reap_timeout_s", float, merged["reap_timeout_s"])
    if "max_message_bytes" in merged:
        merged["max_message_bytes"] = number("max_message_bytes", int, merged["max_message_bytes"])
    config = ServerConfig(**{f.name: merged[f.name] for f in fields(ServerConfig) if f.name in merged})
    if config.reap_timeout_s <= 0:
        raise ConfigError(f"--reap-timeout must be positive, got {config.reap_timeout_s}")
    if config.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ConfigError(f"--log-level {config.log_level!r}: use DEBUG, INFO, WARNING or ERROR")
    mq.check_url(config.url)
    return config


def main(argv: Optional[list[str]] = None) -> int:
    args = build_arg_parser().parse_args(argv)
    try:
        config = resolve_config(args)
    except (ConfigError, mq.TransportError) as exc:
        print(f"lmshm-server: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s lmshm-server %(levelname)s %(message)s")
    ipc_policy.set_isolated_ipc(config.isolated_ipc)
    try:
        server = Server(config)
    except (mq.TransportError, FdChannelError) as exc:
        print(f"lmshm-server: {exc}", file=sys.stderr)
        return 1
    print(f"lmshm-server listening on {server.url} (fd socket {server.fdchannel.path}, "
          f"isolated_ipc={'on' if config.isolated_ipc else 'off'}, pid {os.getpid()})", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
