"""``lmshm.Server`` and ``lmshm-server``: the core composed with its endpoints.

Above every layer (docs/design/layers.md), it builds the core (``lmshm.core.service.Core``), the
ZeroMQ endpoint over it (``lmshm.endpoints.zmq``, always on) and, when the config asks, the HTTP
and gRPC endpoints and the KV event stream (``lmshm.endpoints.kv_stream``), and wires the calls
that go up: a copier job's reply goes to the ZeroMQ endpoint, whose shutdown first stops the
others. It owns the status report (``status_reply``) that STATUS, the HTTP status page and
``status()`` share. It is the analogue of Triton's in-process C API::

    with lmshm.Server(lmshm.ServerConfig(url="tcp://127.0.0.1:0", http_port=0)) as server:
        server.register_system_region("input0", key="/my_shm", offset=0, byte_size=1 << 20)

Every public method is safe from any thread; every refusal is a ``lmshm.ServerError``. Threads,
who releases what and ``API_VERSION``: docs/design/service.md ("lmshm.Server, in process").
``main()`` is ``lmshm-server``'s command line (``python -m lmshm.server`` runs it too).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
from typing import Any, Optional

from lmshm._version import __version__
from lmshm.core.errors import ErrorCode, ServerError, Unsupported
from lmshm.core.registry import Registration
from lmshm.core.service import Core, View
from lmshm.endpoints.kv_stream.publisher import KvEventPublisher
from lmshm.endpoints.zmq.endpoint import ZmqEndpoint
from lmshm.endpoints.zmq.fds import open_fd_count
from lmshm.platform import ipc_policy
from lmshm.platform.base.fds import FD_INBOX
from lmshm.platform.base.mappings import MAPPINGS
from lmshm.quoting import quote
from lmshm.settings import ConfigError, ServerConfig, build_arg_parser, resolve_config
from lmshm.transport import mq
from lmshm.transport.fdchannel import FdChannelError
from lmshm.wire import protocol

logger = logging.getLogger("lmshm.server")

#: The in-process API's version: a new method or field bumps the minor; a change that can
#: break a caller bumps the major.
API_VERSION = (1, 0)
#: Triton extensions the HTTP and gRPC endpoints implement (``GET /v2``'s ``extensions``).
EXTENSIONS = ("system_shared_memory", "cuda_shared_memory")

__all__ = ["API_VERSION", "EXTENSIONS", "Server", "View", "check_api_version", "main"]


def check_api_version(wanted: Any) -> None:
    """Refuse a caller written for an API this server does not provide."""
    if (not isinstance(wanted, (tuple, list)) or len(wanted) != 2
            or not all(type(v) is int and v >= 0 for v in wanted)):
        raise ServerError(ErrorCode.INVALID_ARG, f"api_version must be (major, minor), got {quote(wanted, 40)}")
    major, minor = wanted
    have_major, have_minor = API_VERSION
    if major != have_major:
        raise Unsupported(ErrorCode.UNSUPPORTED,
                          f"this code was written for lmshm API {major}.{minor}, but lmshm {_version()} provides API "
                          f"{have_major}.{have_minor}, another major version: install a matching lmshm")
    if minor > have_minor:
        raise Unsupported(ErrorCode.UNSUPPORTED,
                          f"this code needs lmshm API {major}.{minor}, but lmshm {_version()} provides only "
                          f"{have_major}.{have_minor}: upgrade lmshm")


def _version() -> str:
    return __version__


class Server:
    """The lmshm cache server, in this process. See the module documentation."""

    API_VERSION = API_VERSION

    def __init__(self, config: Optional[ServerConfig] = None, *, api_version: Any = None) -> None:
        if api_version is not None:
            check_api_version(api_version)
        self.config = config if config is not None else ServerConfig()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._side: list[Any] = []      # the HTTP and gRPC endpoints, once started
        self._stopped = False
        self._serving = False
        self.core = Core(self.config, reply=self._copy_done)
        try:
            self.zmq = ZmqEndpoint(self.core, self.config, status=self.status_reply,
                                   on_stopping=self._stop_side_endpoints)
        except BaseException:
            self.core.shutdown()
            raise
        try:
            self.core.start()           # the first orphan sweep, then the clock
        except BaseException:
            self.zmq.shutdown()
            raise

    def _copy_done(self, identity: bytes, request_id: bytes, reply: Any) -> None:
        self.zmq.complete(identity, request_id, reply)  # only ZeroMQ requests queue copies

    # ---- the core's parts ---------------------------------------------------------------
    @property
    def server_id(self) -> str:
        return self.core.server_id

    @property
    def started(self) -> float:
        return self.core.started

    @property
    def registry(self) -> Any:
        return self.core.registry

    @property
    def dataplane(self) -> Any:
        return self.core.dataplane

    @property
    def metrics(self) -> Any:
        return self.core.metrics

    # ---- lifecycle ----------------------------------------------------------------------
    @property
    def api_version(self) -> tuple[int, int]:
        return API_VERSION

    @property
    def url(self) -> str:
        """The ZeroMQ endpoint workers connect to."""
        return self.zmq.url

    @property
    def fd_socket(self) -> str:
        return self.zmq.fdchannel.path

    @property
    def http_port(self) -> Optional[int]:
        return next((e.port for e in self._side if e.protocol == "http"), None)

    @property
    def grpc_port(self) -> Optional[int]:
        return next((e.port for e in self._side if e.protocol == "grpc"), None)

    @property
    def kv_events(self) -> Optional[KvEventPublisher]:
        """The KV event publisher (``--kv-events``), once started: its ``endpoint``, counters."""
        return next((e for e in self._side if e.protocol == KvEventPublisher.protocol), None)

    def start_side_endpoints(self) -> None:
        """Bind and start the HTTP and gRPC endpoints and the KV event publisher the config asks
        for (``start()`` and ``serve_forever()`` call this). A port that cannot be bound raises
        ``Unavailable``."""
        with self._lock:
            if self._side or self._stopped:
                return
            try:
                if self.config.http_port is not None:    # lazy: aiohttp and grpcio load only when asked for
                    from lmshm.endpoints.http import HttpEndpoint

                    self._side.append(HttpEndpoint(self).start())
                if self.config.grpc_port is not None:
                    from lmshm.endpoints.grpc import GrpcEndpoint

                    self._side.append(GrpcEndpoint(self).start())
                if self.config.kv_events:
                    self._side.append(KvEventPublisher.from_config(self.core, self.config).start())
            except BaseException:
                for endpoint in self._side:
                    endpoint.stop()
                self._side.clear()
                raise

    def _stop_side_endpoints(self) -> None:
        with self._lock:
            side, self._side = self._side, []
        for endpoint in reversed(side):
            try:
                endpoint.stop()
            except Exception:
                logger.exception("lmshm: stopping the %s endpoint failed", endpoint.protocol)

    def start(self) -> "Server":
        """Serve in the background: the endpoints and the ZeroMQ loop on threads of their own."""
        if self._thread is not None or self._serving:
            return self
        if self._stopped:
            raise ServerError(ErrorCode.UNAVAILABLE, "this lmshm.Server was stopped; create a new one")
        try:
            self.start_side_endpoints()
        except BaseException:
            self.stop()
            raise
        self._thread = threading.Thread(target=self.zmq.run, name="lmshm-loop", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self, *, restore_signals: bool = True) -> None:
        """Serve on this thread until SIGINT/SIGTERM (or ``stop()`` from another thread), then
        release everything. Must run on the main thread (signals)."""
        if self._thread is not None:
            raise RuntimeError("this lmshm.Server already serves on a background thread (start())")
        self._serving = True
        try:
            self.start_side_endpoints()
        except BaseException:
            self.stop()
            raise
        self.zmq.serve_forever(restore_signals=restore_signals)
        self._stopped = True

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the endpoints, release every registration and region. Idempotent."""
        self._stopped = True
        self._stop_side_endpoints()
        thread = self._thread
        if thread is not None:
            self.zmq.request_stop()
            thread.join(timeout_s)
            if thread.is_alive():
                logger.error("lmshm: the server loop did not stop within %g s", timeout_s)
                return
        elif self._serving:
            self.zmq.request_stop()
            return
        self.zmq.shutdown()  # idempotent: a loop that ended has released everything already
        self.core.shutdown()  # idempotent: the endpoint's shutdown shut the core down

    shutdown = stop

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- health and metadata ------------------------------------------------------------
    def live(self) -> bool:
        return not self.zmq.stopped

    def ready(self) -> bool:
        """Live, serving, and not shutting down."""
        return not self._stopped and not self.zmq.stopped

    def metadata(self) -> dict[str, Any]:
        return {"name": "lmshm", "version": _version(), "extensions": list(EXTENSIONS),
                "api_version": list(API_VERSION),
                "protocol_version": [protocol.PROTOCOL_VERSION, protocol.PROTOCOL_MINOR],
                "server_id": self.server_id}

    def status(self) -> Any:
        """What ``lmshm status`` shows: a ``protocol.StatusReply``."""
        return self.status_reply()

    def status_reply(self, *, offset: int = 0, limit: Optional[int] = None,
                     minor: int = protocol.PROTOCOL_MINOR) -> protocol.StatusReply:
        """The server and ``limit`` registrations from the ``offset``-th, oldest first (in
        process: every one by default; a STATUS request: at most ``protocol.STATUS_PAGE``).
        The page costs its rows, and the summary one line per owner: never a walk of them all.
        ``minor`` < 4: a ``StatusReply`` (what a 3.3 client decodes); else a ``StatusPageReply``.
        One report for every endpoint: ZeroMQ's STATUS, the HTTP status page, ``status()``."""
        now = time.time()
        page, total = self.registry.page(offset, len(self.registry) if limit is None else limit)
        regs = []
        for r in page:
            region = r.region
            if region is None:
                kinds, devices = sorted({w.kind for w in r.wrappers}), sorted({w.device for w in r.wrappers})
            else:
                kinds, devices = [f"{r.kind}-region"], [region.device]
            regs.append(protocol.RegistrationInfo(
                instance_id=r.instance_id, owner_session=r.owner if isinstance(r.owner, int) else 0,
                owner_pid=r.owner_pid, owner_uid=r.owner_uid, client_name=r.client_name, model_name=r.model_name,
                world_size=r.world_size, worker_rank=r.worker_rank, num_layers=r.num_layers, nbytes=r.nbytes,
                kinds=kinds, devices=devices, age_s=round(now - r.created, 3), kind=r.kind,
                key=getattr(region, "key", ""), offset=getattr(region, "offset", 0),
                device_id=getattr(region, "device_id", -1), block_dim=r.block_dim))
        common = dict(
            server_id=self.server_id, server_pid=os.getpid(), protocol_version=protocol.PROTOCOL_VERSION,
            isolated_ipc=self.config.isolated_ipc, uptime_s=round(time.monotonic() - self.started, 3),
            sessions=len(self.zmq.sessions), mappings=len(MAPPINGS), draining=self.registry.draining,
            open_fds=open_fd_count(), fd_limit=self.zmq.fd_limit, inbox_fds=len(FD_INBOX), registrations=regs,
            pool=self.dataplane.info(), protocol_minor=protocol.PROTOCOL_MINOR)
        if minor < 4:
            return protocol.StatusReply(**common)
        return protocol.StatusPageReply(**common, registrations_total=total, offset=offset, owners=[
            protocol.OwnerSummary(
                kind="regions" if first.region is not None else "kv",
                owner_session=first.owner if isinstance(first.owner, int) else 0,
                owner_pid=first.owner_pid, owner_uid=first.owner_uid, client_name=first.client_name,
                registrations=count, layers=layers, nbytes=nbytes)
            for first, count, layers, nbytes in self.registry.owners()])

    def session_count(self) -> int:
        return len(self.zmq.sessions)

    def pool_info(self) -> Any:
        return self.core.pool_info()

    def metrics_text(self) -> bytes:
        """The Prometheus exposition text (what ``GET /metrics`` serves)."""
        return self.core.metrics_text()

    # ---- registrations and regions: the core's (lmshm.core.service.Core) -----------------
    def registrations(self, kind: Optional[str] = None) -> list[Registration]:
        """Live registrations (KV caches and regions), oldest first; only ``kind`` if given."""
        return self.core.registrations(kind)

    def unregister(self, instance_id: str) -> bool:
        """Unregister a KV-cache registration, whoever owns it (the application is the
        operator). Returns True if the release waits for open views or copies."""
        return self.core.unregister(instance_id)

    def layer_view(self, instance_id: str, layer_name: str) -> View:
        """A worker's KV-cache layer as a tensor (the same memory, no copy), held open."""
        return self.core.layer_view(instance_id, layer_name)

    def register_system_region(self, name: str, key: str, byte_size: int, offset: int = 0, *,
                               client: str = "in-process") -> Registration:
        """Map ``byte_size`` bytes at ``offset`` of the POSIX shm object ``key`` as ``name``."""
        return self.core.register_system_region(name, key, byte_size, offset, client=client)

    def register_cuda_region(self, name: str, raw_handle: bytes, device_id: int, byte_size: int, *,
                             client: str = "in-process") -> Registration:
        """Open a client's ``cudaIpcMemHandle_t`` (64 bytes) on ``device_id`` as ``name``."""
        return self.core.register_cuda_region(name, raw_handle, device_id, byte_size, client=client)

    def region_status(self, kind: str, name: str = "") -> list[Registration]:
        """The regions of ``kind`` ("system" or "cuda"), or just ``name`` (NOT_FOUND if it is
        not a region of that kind; the message names the kind it has)."""
        return self.core.region_status(kind, name)

    def unregister_region(self, kind: str, name: str = "") -> int:
        """Unregister region ``name`` of ``kind``, or every region of ``kind`` if ``name`` is
        empty. An unknown name, or a name of another kind, is not an error (Triton's rule).
        Returns how many regions left the namespace."""
        return self.core.unregister_region(kind, name)

    def region_view(self, name: str, offset: int = 0, byte_size: Optional[int] = None) -> View:
        """``byte_size`` bytes (default: to the end) at ``offset`` of region ``name`` as a
        uint8 tensor over the same memory, bounds- and overflow-checked; held open."""
        return self.core.region_view(name, offset, byte_size)


# ---- lmshm-server's command line ----------------------------------------------------------


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
    except (mq.TransportError, FdChannelError, ServerError) as exc:
        print(f"lmshm-server: {exc}", file=sys.stderr)
        return 1
    try:
        server.start_side_endpoints()
    except Exception as exc:
        server.stop()
        print(f"lmshm-server: {exc}", file=sys.stderr)
        return 1
    # What the imports and the start made (torch's modules among them: about 170,000 objects)
    # lives as long as the process: out of the cyclic GC's reach, so that a full collection,
    # which holds every thread, no longer walks it (74 ms a collection before, in process).
    # Here only, never in an application that embeds lmshm.Server: its objects are its own.
    # Before the ready line, so that whoever waits for it finds the gauge.
    gc.collect()
    gc.freeze()
    server.metrics.add_gauge("lmshm_gc_frozen_objects", "Objects made before the server said it was ready, "
                             "kept out of the cyclic GC's collections (gc.freeze)", gc.get_freeze_count)
    extra = "".join(f", {name} on {host}:{port}" for name, host, port in (
        ("HTTP", config.http_host, server.http_port), ("gRPC", config.grpc_host, server.grpc_port)) if port is not None)
    events = server.kv_events
    if events is not None:
        extra += f", KV events {'on' if events.binds else 'to'} {events.endpoint}" + (
            f" (replay {events.replay_endpoint})" if events.replay_endpoint else "")
    print(f"lmshm-server listening on {server.url} (fd socket {server.fd_socket}{extra}, "
          f"isolated_ipc={'on' if config.isolated_ipc else 'off'}, pid {os.getpid()})", flush=True)
    server.serve_forever(restore_signals=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
