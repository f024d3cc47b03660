"""Triton's HTTP/REST routes for health, metadata and shared memory, plus ``/metrics``.

``aiohttp`` parses HTTP and routes; an event loop on a thread of its own serves the endpoint.
Every route is one call into ``lmshm.Server`` (made on that loop: registry operations are
short). Errors are Triton's ``{"error": "..."}`` bodies with Triton's status codes
(``triton.HTTP_STATUS``): an unknown route 404, a wrong method 405, a body over
``--http-max-body-bytes`` or malformed JSON 400, a missing restricted-API header 403.

Routes (``{kind}`` is ``systemsharedmemory`` or ``cudasharedmemory``):
- ``GET /v2/health/live``, ``GET /v2/health/ready``: 200, or 400 when not live/ready;
- ``GET /v2``: ``{"name", "version", "extensions"}``;
- ``POST /v2/{kind}/region/{name}/register``: system ``{"key", "offset", "byte_size"}``, CUDA
  ``{"raw_handle": {"b64": ...}, "device_id", "byte_size"}``;
- ``GET /v2/{kind}[/region/{name}]/status``: a JSON array of regions;
- ``POST /v2/{kind}[/region/{name}]/unregister``;
- ``GET /metrics``: Prometheus text.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import threading
import time
from typing import Any, Awaitable, Callable, Optional

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from lmshm.core.errors import ErrorCode, ServerError
from lmshm.endpoints.triton import ROWS, Restriction, http_status
from lmshm.quoting import clip, quote

logger = logging.getLogger("lmshm.http")

_KINDS = {"systemsharedmemory": "system", "cudasharedmemory": "cuda"}
_OP_NAMES = {"system": "SystemSharedMemory", "cuda": "CudaSharedMemory"}
MAX_ERROR = 1024


def _json_error(status: int, message: str) -> web.Response:
    return web.json_response({"error": clip(message, MAX_ERROR)}, status=status)


def _field(body: dict, name: str, kind: type, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        raise ServerError(ErrorCode.INVALID_ARG, f"the request body has no '{name}'")
    if kind is int and (type(value) is not int):
        raise ServerError(ErrorCode.INVALID_ARG,
                          f"'{name}' must be an integer, got {type(value).__name__} {quote(value, 40)}")
    if kind is str and not isinstance(value, str):
        raise ServerError(ErrorCode.INVALID_ARG, f"'{name}' must be a string, got {type(value).__name__}")
    if kind is dict and not isinstance(value, dict):
        raise ServerError(ErrorCode.INVALID_ARG, f"'{name}' must be a JSON object, got {type(value).__name__}")
    return value


class HttpEndpoint:
    protocol = "http"

    def __init__(self, server: Any) -> None:
        self.server = server
        config = server.config
        self.host, self.port = config.http_host, config.http_port
        self.max_body = config.http_max_body_bytes
        self.max_connections = config.http_max_connections
        self.restriction = Restriction(config.http_restricted_api)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._runner: Optional[web.AppRunner] = None
        self._thread: Optional[threading.Thread] = None

    # ---- lifecycle ----------------------------------------------------------------------
    def _app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body, middlewares=[self._middleware])
        r = app.router
        r.add_get("/v2/health/live", self._live)
        r.add_get("/v2/health/ready", self._ready)
        r.add_get("/v2", self._metadata)
        r.add_get("/metrics", self._metrics)
        for word in _KINDS:
            r.add_post(f"/v2/{word}/region/{{name}}/register", self._register)
            r.add_get(f"/v2/{word}/status", self._status)
            r.add_get(f"/v2/{word}/region/{{name}}/status", self._status)
            r.add_post(f"/v2/{word}/unregister", self._unregister)
            r.add_post(f"/v2/{word}/region/{{name}}/unregister", self._unregister)
        return app

    def start(self) -> "HttpEndpoint":
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                runner = web.AppRunner(self._app(), access_log=None, handle_signals=False)
                loop.run_until_complete(runner.setup())
                listener = loop.run_until_complete(loop.create_server(
                    _Capped(runner.server, self.max_connections), self.host, self.port, reuse_address=True,
                    backlog=128))
                self._runner = runner
                self.port = listener.sockets[0].getsockname()[1]
            except BaseException as exc:  # noqa: BLE001 - reported to start()'s caller
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                listener.close()
                loop.run_until_complete(listener.wait_closed())
                loop.run_until_complete(runner.cleanup())
                loop.close()

        self._thread = threading.Thread(target=run, name="lmshm-http", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            exc = failure[0]
            raise ServerError(ErrorCode.UNAVAILABLE,
                              f"cannot serve HTTP on {self.host}:{self.port}: {exc}") from None
        logger.info("lmshm: HTTP endpoint on %s:%d", self.host, self.port)
        return self

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._thread = None
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    # ---- the frame of every request -----------------------------------------------------
    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                          ) -> web.StreamResponse:
        started = time.monotonic()
        name = "unknown"
        try:
            info = request.match_info
            route = info.route.resource.canonical if info.route.resource is not None else ""
            name = _operation(route, request.path)
            if "sharedmemory" in route:
                problem = self.restriction.problem(request.headers.get)
                if problem is not None:
                    return self._done(name, "PERMISSION_DENIED", started, _json_error(403, problem))
            response = await handler(request)
            return self._done(name, "OK", started, response)
        except ServerError as exc:
            code = exc.code.name if isinstance(exc.code, ErrorCode) else str(exc.code)
            return self._done(name, code, started, _json_error(http_status(exc.code), exc.message))
        except web.HTTPRequestEntityTooLarge:
            await _drain(request, 16 * self.max_body)
            response = _json_error(
                400, f"the request body is larger than {self.max_body} bytes (lmshm-server --http-max-body-bytes)")
            response.force_close()
            return self._done(name, "INVALID_ARG", started, response)
        except web.HTTPMethodNotAllowed as exc:
            return self._done(name, "INVALID_ARG", started, _json_error(
                405, f"{request.method} is not allowed on {quote(request.path, 120)}; use "
                     f"{', '.join(sorted(exc.allowed_methods))}"))
        except web.HTTPNotFound:
            return self._done(name, "NOT_FOUND", started,
                              _json_error(404, f"no route {quote(request.path, 120)} on this lmshm-server"))
        except web.HTTPException as exc:
            return self._done(name, "INVALID_ARG", started, _json_error(exc.status, exc.reason))
        except Exception as exc:  # noqa: BLE001 - every request gets an answer
            logger.exception("lmshm: HTTP %s %s failed", request.method, clip(request.path, 120))
            return self._done(name, "INTERNAL", started,
                              _json_error(500, f"{type(exc).__name__}: {clip(str(exc), 300)}"))

    def _done(self, name: str, code: str, started: float, response: web.StreamResponse) -> web.StreamResponse:
        self.server.metrics.observe("http", name, code, time.monotonic() - started)
        return response

    async def _body(self, request: web.Request) -> dict:
        raw = await request.read()
        if not raw:
            return {}
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ServerError(ErrorCode.INVALID_ARG, f"the request body is not valid JSON: {clip(str(exc), 200)}"
                              ) from None
        if not isinstance(body, dict):
            raise ServerError(ErrorCode.INVALID_ARG, f"the request body must be a JSON object, got "
                                                     f"{type(body).__name__}")
        return body

    # ---- routes -------------------------------------------------------------------------
    async def _live(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.server.live() else 400)

    async def _ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.server.ready() else 400)

    async def _metadata(self, request: web.Request) -> web.Response:
        meta = self.server.metadata()
        return web.json_response({"name": meta["name"], "version": meta["version"],
                                  "extensions": meta["extensions"]})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.server.metrics_text(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _register(self, request: web.Request) -> web.Response:
        kind = _kind_of(request)
        name = request.match_info["name"]
        body = await self._body(request)
        if kind == "system":
            self.server.register_system_region(
                name, key=_field(body, "key", str), offset=_field(body, "offset", int, 0),
                byte_size=_field(body, "byte_size", int), client="http")
        else:
            handle = _field(body, "raw_handle", dict)
            b64 = handle.get("b64")
            if not isinstance(b64, str):
                raise ServerError(ErrorCode.INVALID_ARG, "'raw_handle' must be {\"b64\": \"<base64 handle>\"}")
            try:
                raw = base64.b64decode(b64, validate=True)
            except (binascii.Error, ValueError):
                raise ServerError(ErrorCode.INVALID_ARG, "'raw_handle.b64' is not valid base64") from None
            self.server.register_cuda_region(name, raw_handle=raw, device_id=_field(body, "device_id", int),
                                             byte_size=_field(body, "byte_size", int), client="http")
        return web.Response(status=200)

    async def _status(self, request: web.Request) -> web.Response:
        kind = _kind_of(request)
        regs = self.server.region_status(kind, request.match_info.get("name", ""))
        return web.json_response([ROWS[kind](r) for r in regs])

    async def _unregister(self, request: web.Request) -> web.Response:
        await request.read()  # the body, if any, counts against the limit; it carries nothing
        self.server.unregister_region(_kind_of(request), request.match_info.get("name", ""))
        return web.Response(status=200)


class _Capped:
    """aiohttp's protocol factory, with at most ``limit`` connections open at once: one more is
    closed as soon as it is accepted, so a flood of connections cannot take the server's fds
    (every other endpoint and every mapping needs them too)."""

    def __init__(self, factory: Callable[[], asyncio.Protocol], limit: int) -> None:
        self._factory, self._limit, self.open = factory, limit, 0

    def __call__(self) -> asyncio.Protocol:
        if self.open >= self._limit:
            return _Refuse()
        proto = _Counted(self._factory(), self)
        self.open += 1
        return proto


class _Counted(asyncio.Protocol):
    """Passes every event to aiohttp's protocol; counts the connection out when it ends."""

    def __init__(self, inner: asyncio.Protocol, cap: _Capped) -> None:
        self._inner, self._cap = inner, cap

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> Optional[bool]:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self._cap.open -= 1
        self._inner.connection_lost(exc)


class _Refuse(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.abort()  # type: ignore[attr-defined]


async def _drain(request: web.Request, limit: int) -> None:
    """Read and drop what is left of a refused body, up to ``limit`` bytes and one second, so
    the client reads the 400 instead of a reset (closing with unread data sends an RST)."""

    async def drop() -> None:
        left = limit
        while left > 0:
            chunk = await request.content.readany()
            if not chunk:
                return
            left -= len(chunk)

    try:
        await asyncio.wait_for(drop(), 1.0)
    except (asyncio.TimeoutError, ConnectionError, web.HTTPException):
        pass


def _kind_of(request: web.Request) -> str:
    return _KINDS[request.path.split("/", 3)[2]]


def _operation(route: str, path: str) -> str:
    """The request type for metrics: the gRPC RPC name of the same operation."""
    if route == "/v2/health/live":
        return "ServerLive"
    if route == "/v2/health/ready":
        return "ServerReady"
    if route == "/v2":
        return "ServerMetadata"
    if route == "/metrics":
        return "Metrics"
    for word, kind in _KINDS.items():
        if route.startswith(f"/v2/{word}/"):
            return _OP_NAMES[kind] + route.rsplit("/", 1)[1].capitalize()
    return "unknown"
