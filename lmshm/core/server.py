"""``lmshm.Server``: the cache server as a library, the analogue of Triton's in-process C API.

One object owns everything that outlives a request: the registry (KV-cache registrations and
Triton-style regions, one namespace), the mapping table's shares, session reclaim, the data
plane, and the metrics. The endpoints are thin adapters over it and keep no registry state:
- ZeroMQ (``lmshm.multiprocess.server.ZmqEndpoint``): lmshm's own protocol, always on; its loop
  also runs the server's periodic work (lease expiry, reclaim of silent sessions, orphan sweep);
- HTTP (``--http-port``) and gRPC (``--grpc-port``): Triton's health, metadata and
  shared-memory routes (``lmshm.endpoints``), plus ``/metrics`` on HTTP.

Use it in a process of your own::

    with lmshm.Server(lmshm.ServerConfig(url="tcp://127.0.0.1:0", http_port=0)) as server:
        server.register_system_region("input0", key="/my_shm", offset=0, byte_size=1 << 20)
        with server.region_view("input0", offset=0, byte_size=4096) as view:
            view.tensor[:4] = 7          # the client's shm sees it at once

Threads: ``start()`` runs the ZeroMQ loop on a thread of its own and the HTTP and gRPC
endpoints on theirs; ``serve_forever()`` runs the loop on the calling thread (the command line,
with SIGINT/SIGTERM handling). Every public method is safe from any thread.

Who releases what:
- ``stop()`` (or leaving the ``with``) stops the endpoints, answers what is queued, releases
  every registration and region, closes every fd and removes the socket files;
- a ``View`` holds its registration: an unregister while it is open takes the name out of the
  namespace at once and releases the mapping when the last view closes (``close()``, the
  ``with`` block, or garbage collection). The view's tensor keeps the bytes mapped for as long
  as it lives, even after that, so a tensor never points at unmapped memory;
- regions are the client's objects: the server never creates, truncates or unlinks them.

Errors: every refusal is a ``lmshm.ServerError`` with an ``ErrorCode``, the same code that
ZeroMQ, HTTP and gRPC callers receive.

Versions: ``API_VERSION`` is ``(major, minor)``. Pass the version your code was written for as
``api_version=``; a newer minor, or another major, is refused with ``Unsupported``.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import weakref
from typing import Any, Optional

from lmshm.core import regions
from lmshm.core.errors import ErrorCode, ServerError, Unsupported
from lmshm.core.metrics import Metrics
from lmshm.core.registry import Registration, Registry
from lmshm.multiprocess.config import ServerConfig
from lmshm.quoting import quote

logger = logging.getLogger("lmshm.server")

#: The in-process API's version: a new method or field bumps the minor; a change that can
#: break a caller bumps the major.
API_VERSION = (1, 0)
#: Triton extensions the HTTP and gRPC endpoints implement (``GET /v2``'s ``extensions``).
EXTENSIONS = ("system_shared_memory", "cuda_shared_memory")
REGION_KINDS = ("system", "cuda")


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
    from lmshm import __version__

    return __version__


class View:
    """Bytes of a registration, as a tensor, held open until ``close()``.

    ``tensor`` aliases the registered memory (no copy). While the view is open its
    registration cannot be released: an unregister is deferred until the last view closes.
    """

    def __init__(self, registry: Registry, reg: Registration, tensor: Any) -> None:
        self.name = reg.instance_id
        self.kind = reg.kind
        self.tensor = tensor
        self._finalizer = weakref.finalize(self, registry.let_go, reg)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Let the registration go (idempotent). The tensor stays valid while you hold it."""
        self._finalizer()

    def __enter__(self) -> "View":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"View({self.name!r}, {self.kind}, {tuple(self.tensor.shape)}, {state})"


class Server:
    """The lmshm cache server, in this process. See the module documentation."""

    API_VERSION = API_VERSION

    def __init__(self, config: Optional[ServerConfig] = None, *, api_version: Any = None) -> None:
        if api_version is not None:
            check_api_version(api_version)
        from lmshm.core.dataplane import DataPlane
        from lmshm.multiprocess.server import ZmqEndpoint

        self.config = config if config is not None else ServerConfig()
        self.server_id = secrets.token_hex(8)
        self.started = time.monotonic()
        self.registry = Registry()
        self.metrics = Metrics(self)
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._side: list[Any] = []      # the HTTP and gRPC endpoints, once started
        self._stopped = False
        self._serving = False
        self.zmq = ZmqEndpoint(self, on_stopping=self._stop_side_endpoints)
        try:
            self.dataplane = DataPlane(
                registry=self.registry, capacity=self.config.capacity, copy_threads=self.config.copy_threads,
                lease_ttl_s=self.config.lease_ttl_s, max_inflight_per_session=self.config.max_inflight_per_session,
                max_leases_per_session=self.config.max_leases_per_session, reply=self.zmq.complete,
                through_files=not self.config.copy_through_mapping, max_objects=self.config.max_objects,
                max_pinned_fraction_per_uid=self.config.max_pinned_fraction_per_uid,
                max_pins_per_uid=self.config.max_pins_per_uid, max_leases_per_uid=self.config.max_leases_per_uid)
        except BaseException:
            self.zmq.close_transport()
            raise
        self.zmq.dataplane = self.dataplane

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

    def start_side_endpoints(self) -> None:
        """Bind and start the HTTP and gRPC endpoints the config asks for (``start()`` and
        ``serve_forever()`` call this). A port that cannot be bound raises ``Unavailable``."""
        with self._lock:
            if self._side or self._stopped:
                return
            try:
                if self.config.http_port is not None:
                    from lmshm.endpoints.http import HttpEndpoint

                    self._side.append(HttpEndpoint(self).start())
                if self.config.grpc_port is not None:
                    from lmshm.endpoints.grpc import GrpcEndpoint

                    self._side.append(GrpcEndpoint(self).start())
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
            except Exception:  # noqa: BLE001 - shutdown goes on
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
        from lmshm.multiprocess import protocol

        return {"name": "lmshm", "version": _version(), "extensions": list(EXTENSIONS),
                "api_version": list(API_VERSION),
                "protocol_version": [protocol.PROTOCOL_VERSION, protocol.PROTOCOL_MINOR],
                "server_id": self.server_id}

    def status(self) -> Any:
        """What ``lmshm status`` shows: a ``protocol.StatusReply``."""
        return self.zmq.status_reply()

    def session_count(self) -> int:
        return len(self.zmq.sessions)

    def pool_info(self) -> Any:
        return self.dataplane.info()

    def metrics_text(self) -> bytes:
        """The Prometheus exposition text (what ``GET /metrics`` serves)."""
        return self.metrics.text()

    # ---- registrations ------------------------------------------------------------------
    def registrations(self, kind: Optional[str] = None) -> list[Registration]:
        """Live registrations (KV caches and regions), oldest first; only ``kind`` if given."""
        regs = sorted(self.registry.registrations(), key=lambda r: r.created)
        return [r for r in regs if kind is None or r.kind == kind]

    def unregister(self, instance_id: str) -> bool:
        """Unregister a KV-cache registration, whoever owns it (the application is the
        operator). Returns True if the release waits for open views or copies."""
        reg = self.registry.get(instance_id)
        if reg.kind != "kv":
            raise ServerError(ErrorCode.NOT_FOUND, f"{quote(instance_id, 80)} is a {reg.describe_kind()}; "
                                                   "unregister it with unregister_region()")
        return self.registry.unregister(instance_id)

    def layer_view(self, instance_id: str, layer_name: str) -> View:
        """A worker's KV-cache layer as a tensor (the same memory, no copy), held open."""
        reg = self.registry.acquire(instance_id)
        try:
            found = reg.layer(layer_name) if reg.kind == "kv" else None
            if found is None:
                raise ServerError(ErrorCode.NOT_FOUND, f"{quote(instance_id, 80)} has no layer {quote(layer_name, 80)}")
            return View(self.registry, reg, found[0])
        except BaseException:
            self.registry.let_go(reg)
            raise

    # ---- regions (Triton's shared-memory extension) -----------------------------------
    def _check_region_name(self, name: Any) -> str:
        if not isinstance(name, str):
            raise ServerError(ErrorCode.INVALID_ARG, f"a region name must be a string, got {type(name).__name__}")
        limit = self.config.max_name_bytes
        if len(name.encode("utf-8", "surrogatepass")) > limit:
            raise ServerError(ErrorCode.INVALID_ARG, f"region name {quote(name, 40)} is longer than {limit} bytes "
                                                     "(lmshm-server --max-name-bytes)")
        return name

    def register_system_region(self, name: str, key: str, byte_size: int, offset: int = 0, *,
                               client: str = "in-process") -> Registration:
        """Map ``byte_size`` bytes at ``offset`` of the POSIX shm object ``key`` as ``name``."""
        self._check_region_name(name)
        file_name = regions.validate_system(key, offset, byte_size)
        allowed = tuple(self.config.allowed_uids)
        reg = self.registry.add_region(
            name, "system", lambda: regions.open_system(key, file_name, offset, byte_size, allowed), client_name=client,
            max_regions=self.config.max_regions)
        logger.debug("lmshm: registered system region %s (%s, %d bytes at %d)", quote(name, 60), quote(key, 60),
                     byte_size, offset)
        return reg

    def register_cuda_region(self, name: str, raw_handle: bytes, device_id: int, byte_size: int, *,
                             client: str = "in-process") -> Registration:
        """Open a client's ``cudaIpcMemHandle_t`` (64 bytes) on ``device_id`` as ``name``."""
        self._check_region_name(name)
        regions.validate_cuda(raw_handle, device_id, byte_size)
        reg = self.registry.add_region(
            name, "cuda", lambda: regions.open_cuda(bytes(raw_handle), device_id, byte_size), client_name=client,
            max_regions=self.config.max_regions)
        logger.debug("lmshm: registered CUDA region %s (device %d, %d bytes)", quote(name, 60), device_id, byte_size)
        return reg

    def region_status(self, kind: str, name: str = "") -> list[Registration]:
        """The regions of ``kind`` ("system" or "cuda"), or just ``name`` (NOT_FOUND if it is
        not a region of that kind; the message names the kind it has)."""
        self._check_kind(kind)
        if name:
            return [self.registry.region(self._check_region_name(name), kind)]
        return sorted(self.registry.regions(kind), key=lambda r: r.instance_id)  # Triton lists by name

    def unregister_region(self, kind: str, name: str = "") -> int:
        """Unregister region ``name`` of ``kind``, or every region of ``kind`` if ``name`` is
        empty. An unknown name, or a name of another kind, is not an error (Triton's rule).
        Returns how many regions left the namespace."""
        self._check_kind(kind)
        if name:
            return int(self.registry.unregister_region(self._check_region_name(name), kind))
        return self.registry.unregister_regions(kind)

    def region_view(self, name: str, offset: int = 0, byte_size: Optional[int] = None) -> View:
        """``byte_size`` bytes (default: to the end) at ``offset`` of region ``name`` as a
        uint8 tensor over the same memory, bounds- and overflow-checked; held open."""
        reg = self.registry.acquire(self._check_region_name(name))
        try:
            if reg.region is None:
                raise ServerError(ErrorCode.NOT_FOUND, f"{quote(name, 80)} is a {reg.describe_kind()}, not a region; "
                                                       "use layer_view()")
            size = reg.region.byte_size
            if byte_size is None:
                byte_size = size - offset if type(offset) is int else 0
            tensor = regions.view_of(reg.bases[0], size, offset, byte_size, f"region {quote(name, 80)}")
            return View(self.registry, reg, tensor)
        except BaseException:
            self.registry.let_go(reg)
            raise

    @staticmethod
    def _check_kind(kind: str) -> None:
        if kind not in REGION_KINDS:
            raise ServerError(ErrorCode.INVALID_ARG, f"region kind must be one of {', '.join(REGION_KINDS)}, "
                                                     f"got {quote(kind, 20)}")

