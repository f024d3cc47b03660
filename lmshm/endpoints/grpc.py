"""Triton's gRPC health, metadata and shared-memory RPCs (``inference.GRPCInferenceService``).

``grpcio`` serves; the messages are ``triton_proto``'s (Triton's field numbers). Each RPC is one
call into ``lmshm.Server``; a ``ServerError`` becomes a gRPC status (``triton.GRPC_STATUS``)
with its message as the details. Any other RPC of the service (inference, model control, ...)
answers ``UNIMPLEMENTED``, as grpcio does for a method no handler serves. Requests larger than
``--grpc-max-message-bytes`` are refused by grpcio (``RESOURCE_EXHAUSTED``) before decoding.
``raw_handle`` is the raw 64 bytes of the ``cudaIpcMemHandle_t``, not base64.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import grpc

from lmshm.core.errors import ErrorCode, ServerError
from lmshm.endpoints import triton_proto as pb
from lmshm.endpoints.triton import GRPC_HEADER_PREFIX, ROWS, Restriction, grpc_status
from lmshm.quoting import clip

logger = logging.getLogger("lmshm.grpc")

MAX_DETAILS = 1024
#: What a call without the restricted-API metadata gets (Triton answers UNAVAILABLE).
RESTRICTED_STATUS = grpc.StatusCode.UNAVAILABLE


class GrpcEndpoint:
    protocol = "grpc"

    def __init__(self, server: Any) -> None:
        self.server = server
        config = server.config
        self.host, self.port = config.grpc_host, config.grpc_port
        self.restriction = Restriction(config.grpc_restricted_api, prefix=GRPC_HEADER_PREFIX, word="protocol")
        self._threads = config.endpoint_threads
        self._max = config.grpc_max_message_bytes
        self._grpc: Any = None

    def start(self) -> "GrpcEndpoint":
        handlers = {}
        for rpc, (req, resp) in pb.RPCS.items():
            handlers[rpc] = grpc.unary_unary_rpc_method_handler(
                self._wrap(rpc, getattr(self, f"_{rpc}")),
                request_deserializer=pb.message(req).FromString,
                response_serializer=pb.message(resp).SerializeToString)
        server = grpc.server(ThreadPoolExecutor(self._threads, thread_name_prefix="lmshm-grpc"),
                             handlers=[grpc.method_handlers_generic_handler(pb.SERVICE, handlers)],
                             options=[("grpc.max_receive_message_length", self._max),
                                      ("grpc.max_send_message_length", 64 << 20),
                                      ("grpc.so_reuseport", 0)],
                             maximum_concurrent_rpcs=max(64, 16 * self._threads))
        try:
            port = server.add_insecure_port(f"{self.host}:{self.port}")
        except RuntimeError as exc:
            port, reason = 0, str(exc)
        else:
            reason = "the address is in use or cannot be bound"
        if not port:
            server.stop(None)
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

    # ---- the frame of every RPC ---------------------------------------------------------
    def _wrap(self, rpc: str, fn: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
        guarded = "SharedMemory" in rpc

        def handle(request: Any, context: grpc.ServicerContext) -> Any:
            started = time.monotonic()
            code, status, details = "OK", None, ""
            try:
                if guarded and self.restriction.header:
                    problem = self.restriction.problem(dict(context.invocation_metadata()).get)
                    if problem is not None:
                        code, status, details = "PERMISSION_DENIED", RESTRICTED_STATUS, problem
                if status is None:
                    return fn(request)
            except ServerError as exc:
                code = exc.code.name if isinstance(exc.code, ErrorCode) else str(exc.code)
                status, details = grpc_status(exc.code), exc.message
            except Exception as exc:  # noqa: BLE001 - every RPC gets a status
                logger.exception("lmshm: gRPC %s failed", rpc)
                code, status, details = "INTERNAL", grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
            finally:
                self.server.metrics.observe("grpc", rpc, code, time.monotonic() - started)
            context.abort(status, clip(details, MAX_DETAILS))

        return handle

    # ---- RPCs ---------------------------------------------------------------------------
    def _status(self, kind: str, name: str, response: str) -> Any:
        out = pb.message(response)()
        for reg in self.server.region_status(kind, name):
            row = out.regions[reg.instance_id]
            for field, value in ROWS[kind](reg).items():  # the same rows as HTTP's JSON
                setattr(row, field, value)
        return out

    def _ServerLive(self, request: Any) -> Any:  # noqa: N802 - the RPC's name
        return pb.message("ServerLiveResponse")(live=self.server.live())

    def _ServerReady(self, request: Any) -> Any:  # noqa: N802
        return pb.message("ServerReadyResponse")(ready=self.server.ready())

    def _ServerMetadata(self, request: Any) -> Any:  # noqa: N802
        meta = self.server.metadata()
        return pb.message("ServerMetadataResponse")(name=meta["name"], version=meta["version"],
                                                    extensions=meta["extensions"])

    def _SystemSharedMemoryRegister(self, r: Any) -> Any:  # noqa: N802
        self.server.register_system_region(r.name, key=r.key, offset=r.offset, byte_size=r.byte_size, client="grpc")
        return pb.message("SystemSharedMemoryRegisterResponse")()

    def _SystemSharedMemoryStatus(self, r: Any) -> Any:  # noqa: N802
        return self._status("system", r.name, "SystemSharedMemoryStatusResponse")

    def _SystemSharedMemoryUnregister(self, r: Any) -> Any:  # noqa: N802
        self.server.unregister_region("system", r.name)
        return pb.message("SystemSharedMemoryUnregisterResponse")()

    def _CudaSharedMemoryRegister(self, r: Any) -> Any:  # noqa: N802
        self.server.register_cuda_region(r.name, raw_handle=r.raw_handle, device_id=r.device_id,
                                         byte_size=r.byte_size, client="grpc")
        return pb.message("CudaSharedMemoryRegisterResponse")()

    def _CudaSharedMemoryStatus(self, r: Any) -> Any:  # noqa: N802
        return self._status("cuda", r.name, "CudaSharedMemoryStatusResponse")

    def _CudaSharedMemoryUnregister(self, r: Any) -> Any:  # noqa: N802
        self.server.unregister_region("cuda", r.name)
        return pb.message("CudaSharedMemoryUnregisterResponse")()

