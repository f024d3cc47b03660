"""Triton's gRPC health, metadata and shared-memory RPCs (``inference.GRPCInferenceService``).

``grpcio`` serves; the messages are ``triton_proto``'s. Each RPC is one call into
``lmshm.Server``; a ``ServerError`` becomes a gRPC status (``triton.GRPC_STATUS``) with its
message as the details, and every other RPC of the service answers ``UNIMPLEMENTED``.
``raw_handle`` is the raw 64 bytes of the ``cudaIpcMemHandle_t``, not base64.

Bounds, because any local user can reach the port: ``--grpc-max-message-bytes`` per request,
``--grpc-max-connections`` connections (grpcio closes newcomers at the cap; it cannot make an
old one give way), deadlines for the preface, idle connections and a connection's age, and
``STREAMS_PER_CONNECTION`` calls per connection (docs/design/security.md has the residuals).
The trap: grpcio gives a unary call its thread *before* its message arrives, so calls that
never send one held every thread. Every RPC here is served stream-unary: the handler waits
for its message and ``_Watchdog`` cancels the call after ``--grpc-request-timeout``.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import grpc

from lmshm.core.errors import ErrorCode, ServerError
from lmshm.endpoints import triton_proto as pb
from lmshm.endpoints.triton import GRPC_HEADER_PREFIX, ROWS, Restriction, connection_budget, grpc_status
from lmshm.quoting import clip

logger = logging.getLogger("lmshm.grpc")

MAX_DETAILS = 1024
#: What a call without the restricted-API metadata gets (Triton answers UNAVAILABLE).
RESTRICTED_STATUS = grpc.StatusCode.UNAVAILABLE
#: Calls one connection may carry at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS).
STREAMS_PER_CONNECTION = 4
#: Every connection ends after this long (GOAWAY; clients reconnect for their next call), so a
#: client that keeps starting calls cannot hold a connection for ever.
MAX_CONNECTION_AGE_S = 30.0
#: How often the watchdog looks for calls whose message is late (seconds).
WATCH_S = 0.25


class GrpcEndpoint:
    protocol = "grpc"

    def __init__(self, server: Any) -> None:
        self.server = server
        config = server.config
        self.host, self.port = config.grpc_host, config.grpc_port
        self.restriction = Restriction(config.grpc_restricted_api, prefix=GRPC_HEADER_PREFIX, word="protocol")
        self._threads = config.endpoint_threads
        self._max = config.grpc_max_message_bytes
        self.max_connections = connection_budget(config.grpc_max_connections, "--grpc-max-connections")
        self.idle_timeout_s = config.grpc_idle_timeout_s
        self.request_timeout_s = config.grpc_request_timeout_s
        self._running = threading.BoundedSemaphore(self._threads)
        self._watchdog: Optional[_Watchdog] = None
        self._grpc: Any = None

    def options(self) -> list[tuple[str, Any]]:
        """grpcio's server arguments: sizes, the connection cap and every connection deadline."""
        request_ms = int(self.request_timeout_s * 1000)
        return [("grpc.max_receive_message_length", self._max),
                ("grpc.max_send_message_length", 64 << 20),
                ("grpc.so_reuseport", 0),
                ("grpc.max_allowed_incoming_connections", self.max_connections),
                ("grpc.server_handshake_timeout_ms", request_ms),
                ("grpc.max_connection_idle_ms", int(self.idle_timeout_s * 1000)),
                ("grpc.max_connection_age_ms", int(MAX_CONNECTION_AGE_S * 1000)),
                ("grpc.max_connection_age_grace_ms", request_ms),
                ("grpc.max_concurrent_streams", STREAMS_PER_CONNECTION)]

    def start(self) -> "GrpcEndpoint":
        handlers = {}
        for rpc, (req, resp) in pb.RPCS.items():
            # stream-unary on our side, unary on the wire (gRPC does not tell them apart): the
            # handler, not grpcio, waits for the request message, so it can give up on it.
            handlers[rpc] = grpc.stream_unary_rpc_method_handler(
                self._wrap(rpc, pb.message(req), getattr(self, f"_{rpc}")),
                response_serializer=pb.message(resp).SerializeToString)
        calls = self.max_connections * STREAMS_PER_CONNECTION
        self._watchdog = _Watchdog(self.request_timeout_s)
        server = grpc.server(ThreadPoolExecutor(calls, thread_name_prefix="lmshm-grpc"),
                             handlers=[grpc.method_handlers_generic_handler(pb.SERVICE, handlers)],
                             options=self.options(), maximum_concurrent_rpcs=calls)
        try:
            port = server.add_insecure_port(f"{self.host}:{self.port}")
        except RuntimeError as exc:
            port, reason = 0, str(exc)
        else:
            reason = "the address is in use or cannot be bound"
        if not port:
            server.stop(None)
            self._watchdog.stop()
            raise ServerError(ErrorCode.UNAVAILABLE, f"cannot serve gRPC on {self.host}:{self.port}: {reason}")
        self.port = port
        server.start()
        self._grpc = server
        logger.info("lmshm: gRPC endpoint on %s:%d", self.host, self.port)
        return self

    def stop(self) -> None:
        server, self._grpc = self._grpc, None
        if server is not None:
            server.stop(grace=1.0).wait(5)
        if self._watchdog is not None:
            self._watchdog.stop()

    # ---- the frame of every RPC ---------------------------------------------------------
    def _wrap(self, rpc: str, request_type: Any, fn: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
        guarded = "SharedMemory" in rpc

        def handle(requests: Any, context: grpc.ServicerContext) -> Any:
            started = time.monotonic()
            code, status, details = "OK", None, ""
            try:
                if guarded and self.restriction.header:
                    problem = self.restriction.problem(dict(context.invocation_metadata()).get)
                    if problem is not None:
                        code, status, details = "PERMISSION_DENIED", RESTRICTED_STATUS, problem
                if status is None:
                    raw = self._message(rpc, requests, context)
                    try:
                        request = request_type.FromString(raw)
                    except Exception:
                        raise ServerError(ErrorCode.INVALID_ARG,
                                          f"the request is not a valid {request_type.DESCRIPTOR.name} message"
                                          ) from None
                    with self._running:
                        return fn(request)
            except _Late as exc:
                code, status, details = "INVALID_ARG", exc.status, exc.details
            except ServerError as exc:
                code = exc.code.name if isinstance(exc.code, ErrorCode) else str(exc.code)
                status, details = grpc_status(exc.code), exc.message
            except Exception as exc:
                logger.exception("lmshm: gRPC %s failed", rpc)
                code, status, details = "INTERNAL", grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
            finally:
                self.server.metrics.observe("grpc", rpc, code, time.monotonic() - started)
            context.abort(status, clip(details, MAX_DETAILS))

        return handle

    def _message(self, rpc: str, requests: Any, context: grpc.ServicerContext) -> bytes:
        """The call's one request message, or ``_Late`` if it does not come (in time)."""
        assert self._watchdog is not None
        ticket = self._watchdog.arm(context)
        try:
            raw = next(requests, None)
        except grpc.RpcError:
            raw = None
        finally:
            fired = self._watchdog.disarm(ticket)
        if fired:
            raise _Late(grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"the request message did not arrive within {self.request_timeout_s:g} s "
                        "(lmshm-server --grpc-request-timeout)")
        if raw is None:  # the client ended its side without a message (grpcio's own answer)
            raise _Late(grpc.StatusCode.UNIMPLEMENTED, f'"/{pb.SERVICE}/{rpc}" requires exactly one request message.')
        return raw

    # ---- RPCs ---------------------------------------------------------------------------
    def _status(self, kind: str, name: str, response: str) -> Any:
        out = pb.message(response)()
        for reg in self.server.region_status(kind, name):
            row = out.regions[reg.instance_id]
            for field, value in ROWS[kind](reg).items():  # the same rows as HTTP's JSON
                setattr(row, field, value)
        return out

    def _ServerLive(self, request: Any) -> Any:
        return pb.message("ServerLiveResponse")(live=self.server.live())

    def _ServerReady(self, request: Any) -> Any:
        return pb.message("ServerReadyResponse")(ready=self.server.ready())

    def _ServerMetadata(self, request: Any) -> Any:
        meta = self.server.metadata()
        return pb.message("ServerMetadataResponse")(name=meta["name"], version=meta["version"],
                                                    extensions=meta["extensions"])

    def _SystemSharedMemoryRegister(self, r: Any) -> Any:
        self.server.register_system_region(r.name, key=r.key, offset=r.offset, byte_size=r.byte_size, client="grpc")
        return pb.message("SystemSharedMemoryRegisterResponse")()

    def _SystemSharedMemoryStatus(self, r: Any) -> Any:
        return self._status("system", r.name, "SystemSharedMemoryStatusResponse")

    def _SystemSharedMemoryUnregister(self, r: Any) -> Any:
        self.server.unregister_region("system", r.name)
        return pb.message("SystemSharedMemoryUnregisterResponse")()

    def _CudaSharedMemoryRegister(self, r: Any) -> Any:
        self.server.register_cuda_region(r.name, raw_handle=r.raw_handle, device_id=r.device_id,
                                         byte_size=r.byte_size, client="grpc")
        return pb.message("CudaSharedMemoryRegisterResponse")()

    def _CudaSharedMemoryStatus(self, r: Any) -> Any:
        return self._status("cuda", r.name, "CudaSharedMemoryStatusResponse")

    def _CudaSharedMemoryUnregister(self, r: Any) -> Any:
        self.server.unregister_region("cuda", r.name)
        return pb.message("CudaSharedMemoryUnregisterResponse")()



class _Late(Exception):
    """A call without its request message: ``status`` and ``details`` for the client."""

    def __init__(self, status: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.status, self.details = status, details


class _Watchdog:
    """Cancels calls whose request message has not arrived ``timeout_s`` after they started.

    One thread; ``arm`` and ``disarm`` are O(1). Armed calls are at most the connection cap
    times ``STREAMS_PER_CONNECTION``, so each pass looks at every one of them."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._armed: dict[int, tuple[float, Any]] = {}
        self._fired: set[int] = set()
        self._next = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lmshm-grpc-watchdog", daemon=True)
        self._thread.start()

    def arm(self, context: Any) -> int:
        with self._lock:
            self._next += 1
            self._armed[self._next] = (time.monotonic() + self.timeout_s, context)
            return self._next

    def disarm(self, ticket: int) -> bool:
        """Forget ``ticket``; True if its call was cancelled for being late."""
        with self._lock:
            self._armed.pop(ticket, None)
            if ticket in self._fired:
                self._fired.discard(ticket)
                return True
            return False

    def _run(self) -> None:
        while not self._stop.wait(WATCH_S):
            now = time.monotonic()
            with self._lock:
                late = [(t, ctx) for t, (at, ctx) in self._armed.items() if at <= now]
                for ticket, _ in late:
                    del self._armed[ticket]
                    self._fired.add(ticket)
            for _, context in late:
                try:
                    context.cancel()  # the waiting handler wakes up and answers
                except Exception:
                    logger.debug("lmshm: cancelling a late gRPC call failed", exc_info=True)

    def stop(self) -> None:
        self._stop.set()
