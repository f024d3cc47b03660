"""Triton's HTTP/REST routes for health, metadata and shared memory, plus ``/metrics``.

Every route is one call into ``lmshm.Server``, made on the endpoint's own event loop and thread
(``aiohttp`` parses and routes); the status page and KV lookups add their routes
(``status_page``, ``kv_lookup``). Errors are Triton's ``{"error": ...}`` bodies with Triton's
status codes (``triton.HTTP_STATUS``); docs/triton.md lists the routes and their answers.

Guarantees, in the middleware, before a body is read: what a web page could send is refused
(``browser_guard``), a body is bounded (``--http-max-body-bytes`` for a KV lookup, which takes
its bytes from ``kv_lookup.BYTES_HELD``; ``OTHER_MAX_BODY`` for every other route) and must
arrive within its deadline; every answer, aiohttp's own 400s included (``_SecuredHandler``),
carries ``browser_guard.SECURITY_HEADERS``. Connections, their cap and deadlines are
``http_connections``'. The trap: a restricted-API check belongs only on the shared-memory
routes; ``/metrics``, ``/status`` and the KV lookup are open to whoever reaches the port.
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
from aiohttp.web_protocol import RequestHandler
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from lmshm.core.errors import ErrorCode, ServerError
from lmshm.endpoints.browser_guard import SECURITY_HEADERS, BrowserGuard
from lmshm.endpoints.http_connections import Conn, Connections
from lmshm.endpoints.kv_lookup import BYTES_HELD as LOOKUP_BYTES_HELD
from lmshm.endpoints.kv_lookup import OPERATIONS as KV_LOOKUP_OPERATIONS
from lmshm.endpoints.kv_lookup import PATH as KV_LOOKUP_PATH
from lmshm.endpoints.kv_lookup import RETRY_AFTER_S, KvLookup
from lmshm.endpoints.status_page import OPERATIONS as STATUS_PAGE_OPERATIONS
from lmshm.endpoints.status_page import StatusPage
from lmshm.endpoints.triton import ROWS, Restriction, connection_budget, http_status
from lmshm.quoting import clip, quote

logger = logging.getLogger("lmshm.http")

_KINDS = {"systemsharedmemory": "system", "cudasharedmemory": "cuda"}
_OP_NAMES = {"system": "SystemSharedMemory", "cuda": "CudaSharedMemory"}
MAX_ERROR = 1024
#: The largest body of any request but ``POST /v1/kv/lookup`` (a register's is a few hundred
#: bytes), whatever ``--http-max-body-bytes`` says: that limit, raised for lookups by tokens, made
#: every other route read that much per connection with no budget (``kv_lookup.BYTES_HELD`` bounds
#: lookups'): 48 connections sending 8 MiB bodies to ``/v2/health/live`` held 390 MiB.
OTHER_MAX_BODY = 64 << 10


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
        self.max_connections = connection_budget(config.http_max_connections, "--http-max-connections")
        self.idle_timeout_s = config.http_idle_timeout_s
        self.request_timeout_s = config.http_request_timeout_s
        self.connections: Optional[Connections] = None
        self.restriction = Restriction(config.http_restricted_api)
        self.kv_lookup = KvLookup(server)
        self.guard = BrowserGuard(config.http_host, config.http_allow_hosts)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._runner: Optional[web.AppRunner] = None
        self._thread: Optional[threading.Thread] = None

    # ---- lifecycle ----------------------------------------------------------------------
    def _app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body, middlewares=[self._middleware])
        app.on_response_prepare.append(_secure)
        r = app.router
        r.add_get("/v2/health/live", self._live)
        r.add_get("/v2/health/ready", self._ready)
        r.add_get("/v2", self._metadata)
        r.add_get("/metrics", self._metrics)
        StatusPage(self.server).add_routes(r)   # GET /status, /status.json (status_page.py)
        self.kv_lookup.add_routes(r)            # POST, GET /v1/kv/lookup (kv_lookup.py)
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
                # aiohttp's own keep-alive timer is only a backstop: Connections keeps the deadlines.
                runner = web.AppRunner(self._app(), access_log=None, handle_signals=False,
                                       keepalive_timeout=self.idle_timeout_s + self.request_timeout_s + 1)
                loop.run_until_complete(runner.setup())
                connections = Connections(_secured_handlers(runner.server), self.max_connections, self.idle_timeout_s,
                                           self.request_timeout_s, loop)
                try:
                    self.port = connections.listen(self.host, self.port)
                except BaseException:
                    loop.run_until_complete(runner.cleanup())
                    raise
                self.connections = connections
                sweeper = loop.create_task(connections.sweep_forever())
                self._runner = runner
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                sweeper.cancel()
                connections.close_listener()
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
        conn = self.connections.of(request) if self.connections is not None else None
        limit = self.max_body  # this request's body limit
        held = None  # a lookup's kv_lookup.Ticket: bytes of its body taken from kv_lookup.BYTES_HELD
        try:
            info = request.match_info
            route = info.route.resource.canonical if info.route.resource is not None else ""
            name = _operation(route, request.path)
            # The headers are here; the body must follow within the request's deadline.
            if conn is not None:
                conn.reading_body()
            refusal = self.guard.problem(request.method, request.headers.get)
            if refusal is not None:      # before the body is read: browser_guard.py
                await _drain(request, self.max_body)
                response = _json_error(*refusal)
                response.force_close()
                return self._done(name, "PERMISSION_DENIED", started, response)
            if route == KV_LOOKUP_PATH and request.method == "POST":
                arrived = not request.body_exists or request.content.is_eof()
                held = self.kv_lookup.admit(request, self.max_body, arrived, asyncio.get_running_loop().time())
                if held is None:
                    return self._done(name, "UNAVAILABLE", started, await self._lookups_busy(request))
            elif self.max_body > OTHER_MAX_BODY:   # only a lookup needs a large body (and is budgeted)
                limit = OTHER_MAX_BODY
                request = request.clone(client_max_size=limit)
                if request.content_length is not None and request.content_length > limit:
                    raise web.HTTPRequestEntityTooLarge(limit, request.content_length)
            read = await self._read_body(request, conn, held.evicted if held is not None else None)
            if held is not None and held.evicted.done():    # it gave way to another lookup: kv_lookup.GIVE_WAY_S
                return self._done(name, "UNAVAILABLE", started, await self._lookups_busy(request))
            if not read:
                response = _json_error(408, f"the request did not arrive within {self.request_timeout_s:g} s of its "
                                            "first byte (lmshm-server --http-request-timeout)")
                response.force_close()
                return self._done(name, "INVALID_ARG", started, response)
            if held is not None:
                self.kv_lookup.arrived(held)
            if conn is not None:
                conn.in_progress()
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
            response = _json_error(400, f"the request body is larger than {limit} bytes " + (
                "(lmshm-server --http-max-body-bytes)" if limit == self.max_body else
                f"(this route's limit; --http-max-body-bytes {self.max_body} is for {KV_LOOKUP_PATH} only)"))
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
        except ConnectionError:
            # The connection went while its body was read (the client left, or it gave way to a
            # new one): nobody reads an answer, so give aiohttp a closing one, without a log.
            response = web.Response(status=400)
            response.force_close()
            return self._done(name, "INVALID_ARG", started, response)
        except Exception as exc:
            logger.exception("lmshm: HTTP %s %s failed", request.method, clip(request.path, 120))
            return self._done(name, "INTERNAL", started,
                              _json_error(500, f"{type(exc).__name__}: {clip(str(exc), 300)}"))
        finally:
            if held is not None:
                self.kv_lookup.release(held)
            if conn is not None:
                conn.answered()

    async def _lookups_busy(self, request: web.Request) -> web.Response:
        """The answer to a lookup that finds ``kv_lookup.BYTES_HELD`` held: its body is dropped, not kept."""
        await _drain(request, self.max_body)
        response = _json_error(503, f"KV lookups waiting or running hold {LOOKUP_BYTES_HELD} bytes of request bodies "
                                    f"already: try again in {RETRY_AFTER_S} s (Retry-After)")
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        response.force_close()
        return response

    async def _read_body(self, request: web.Request, conn: Optional["Conn"],
                         give_way: "Optional[asyncio.Future[None]]" = None) -> bool:
        """Read the whole body (aiohttp keeps it for the handler's ``read()``) before the
        request's deadline; False if it did not arrive in time, or ``give_way`` was done first
        (a lookup's body gave way to another's: ``kv_lookup.GIVE_WAY_S``). Over the size limit
        raises ``HTTPRequestEntityTooLarge``."""
        if not request.body_exists or request.content.is_eof():
            await request.read()  # all here already: no timer needed (the usual case)
            return True
        left = conn.time_left() if conn is not None else self.request_timeout_s
        reading = asyncio.ensure_future(request.read())
        try:
            done, _ = await asyncio.wait({reading} | ({give_way} if give_way is not None else set()),
                                         timeout=max(left, 0.05), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not reading.done():
                reading.cancel()
        if reading in done:
            reading.result()     # raises what the read raised (too large, the connection went)
            return True
        return False

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
        except RecursionError:  # json's C parser counts its depth against the recursion limit
            raise ServerError(ErrorCode.INVALID_ARG, "the request body nests arrays or objects too deeply; a request "
                                                     "is one flat JSON object") from None
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


async def _secure(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer's ``SECURITY_HEADERS`` (a route may set its own Content-Security-Policy)."""
    for header, value in SECURITY_HEADERS.items():
        response.headers.setdefault(header, value)


class _SecuredHandler(RequestHandler):
    """aiohttp's connection handler, whose own answers carry ``SECURITY_HEADERS`` too: a request
    aiohttp cannot parse (a request line or header over 8190 bytes, a malformed header) is
    answered 400 by aiohttp itself, before routing, so neither the middleware nor
    ``on_response_prepare`` sees it. Without ``Cross-Origin-Resource-Policy`` on it, a page of
    any origin told this endpoint from a closed port: ``fetch(url + "a".repeat(9000), {mode:
    "no-cors"})`` resolved here and failed there, where every other answer fails alike."""

    __slots__ = ()

    def handle_error(self, request: Any, status: int = 500, exc: Optional[BaseException] = None,
                     message: Optional[str] = None) -> web.StreamResponse:
        response = super().handle_error(request, status, exc, message)
        for header, value in SECURITY_HEADERS.items():
            response.headers.setdefault(header, value)
        return response


def _secured_handlers(server: Any) -> Callable[[], RequestHandler]:
    """``server``'s handler factory (an aiohttp ``Server``), making ``_SecuredHandler``s."""
    def make() -> RequestHandler:
        handler = server()
        handler.__class__ = _SecuredHandler      # the same slots: only handle_error differs
        return handler
    return make


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
    if route in STATUS_PAGE_OPERATIONS:
        return STATUS_PAGE_OPERATIONS[route]
    if route in KV_LOOKUP_OPERATIONS:
        return KV_LOOKUP_OPERATIONS[route]
    for word, kind in _KINDS.items():
        if route.startswith(f"/v2/{word}/"):
            return _OP_NAMES[kind] + route.rsplit("/", 1)[1].capitalize()
    return "unknown"
