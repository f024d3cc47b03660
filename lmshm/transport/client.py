"""The worker-side client ``MPClient`` (``lmshm.MPClient``): register KV caches and keep them.

It says HELLO, opens the fd-channel link, wraps and registers tensors, and keeps each live
registration's wrappers: they keep the segments alive, and the heartbeat re-registers them when
the server restarted. One lock serialises the DEALER socket. Server errors become
``ServerError`` subclasses; silence, ``ServerTimeout``. docs/design/transport.md has the rest.
The trap: ``lmshm status`` imports this module, so the wrapping code (torch) is imported only
when a registration needs it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

import msgspec

from lmshm.core.errors import (  # noqa: F401 - re-exported: lmshm.MPClient raises these
    AlreadyExists,
    DataLoss,
    ErrorCode,
    InternalServerError,
    InvalidArgument,
    LayoutMismatch,
    LmshmError,
    NotFound,
    PermissionDenied,
    ServerError,
    Unavailable,
    Unsupported,
    error,
)
from lmshm.platform import ipc_policy
from lmshm.transport import mq
from lmshm.transport.fdchannel import UNKNOWN_TOKEN, ExpectedServer, FdChannelClient, FdChannelError
from lmshm.wire import codec, protocol

if TYPE_CHECKING:  # torch and the wrappers load when something is registered, not for status
    import torch

    from lmshm.platform.base.ipc_wrapper import DeviceIPCWrapper

logger = logging.getLogger(__name__)

URL_ENV = "LMSHM_URL"
FD_SOCKET_ENV = "LMSHM_FD_SOCKET"


# ---- errors -----------------------------------------------------------------------------


def server_error(reply: protocol.ErrorReply) -> ServerError:
    return error(reply.code, reply.message)


class ServerTimeout(LmshmError, TimeoutError):
    """The server did not answer in time; ``url`` names it."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(message)
        self.url = url


class _TokenExpired(Exception):
    """The fd channel no longer knew this HELLO's token (it came after --auth-timeout)."""


class MessageTooLarge(LmshmError, ValueError):
    """A request is larger than the server accepts (``--max-message-bytes``)."""


# ---- the client -------------------------------------------------------------------------


class Pending:
    """A request in flight (``MPClient.submit``). ``result()`` waits for its reply."""

    _SLICE_S = 0.02  # the client's lock is let go this often while waiting

    def __init__(self, client: "MPClient", rid: bytes, what: str, timeout_s: float) -> None:
        self._client, self._rid, self.what = client, rid, what
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        self._outcome: Optional[tuple[bool, Any]] = None

    def done(self) -> bool:
        """True once the reply is here (or the request failed); never blocks for long."""
        if self._outcome is None:
            self._poll(0.0)
        return self._outcome is not None

    def _poll(self, slice_s: float) -> None:
        dealer = self._client._dealer
        remaining = self._deadline - time.monotonic()
        try:
            with self._client._lock:
                raw = dealer.wait(self._rid, max(0.0, remaining), what=self.what, slice_s=slice_s)
            if raw is None:
                return
            self._outcome = (True, _decoded(dealer, raw))
        except mq.TransportTimeout as exc:
            self._outcome = (False, ServerTimeout(exc.url, f"{self.what} to {exc.url} got no reply within "
                                                           f"{self._timeout_s:g} s"))
        except (LmshmError, mq.TransportError) as exc:
            self._outcome = (False, exc if isinstance(exc, LmshmError) else LmshmError(str(exc)))

    def result(self) -> Any:
        """The reply struct; raises its ``ServerError``, ``ServerTimeout`` or ``LmshmError``."""
        while self._outcome is None:
            self._poll(self._SLICE_S)
        ok, value = self._outcome
        if not ok:
            raise value
        return value

    def cancel(self) -> None:
        """Stop waiting; a late reply is dropped."""
        if self._outcome is None:
            with self._client._lock:
                self._client._dealer.abandon(self._rid)
            self._outcome = (False, LmshmError(f"{self.what} was cancelled"))


@dataclass
class _Cached:
    """A live registration, kept so that it can be re-sent after a server restart."""

    request: protocol.RegisterKVCache
    wrappers: list[DeviceIPCWrapper]


def layer_groups(names: list[str], wrappers: list[DeviceIPCWrapper]) -> list[protocol.LayerGroup]:
    """Fold (name, wrapper) pairs into wire groups: a run of consecutive wrappers derived from
    one leader (``wrap_kv_caches`` makes them for the views of one pool) becomes one group."""
    groups: list[protocol.LayerGroup] = []
    run_names: list[str] = []
    run_offsets: list[int] = []
    head: Optional[DeviceIPCWrapper] = None
    for name, w in zip(names, wrappers):
        if head is not None and (w.leader or w) is (head.leader or head):
            run_names.append(name)
            run_offsets.append(w.storage_offset)
            continue
        if head is not None:
            groups.append(protocol.LayerGroup(head, run_names, run_offsets))
        head, run_names, run_offsets = w, [name], [w.storage_offset]
    if head is not None:
        groups.append(protocol.LayerGroup(head, run_names, run_offsets))
    return groups


def _check_block_dim(block_dim: int) -> None:
    if type(block_dim) is not int or not 0 <= block_dim <= protocol.MAX_BLOCK_DIM:
        raise ValueError(f"block_dim must be an int from 0 to {protocol.MAX_BLOCK_DIM}, got {block_dim!r}")


def _encode(dealer: mq.DealerClient, msg: Any, max_bytes: Optional[int]) -> bytes:
    body = codec.encode(msg)
    if max_bytes is not None and len(body) > max_bytes:
        raise MessageTooLarge(
            f"{type(msg).__name__} is {len(body)} bytes, more than the server at {dealer.url} accepts "
            f"({max_bytes} bytes, lmshm-server --max-message-bytes)")
    return body


def _exchange(dealer: mq.DealerClient, msg: Any, timeout_s: Optional[float] = None,
              max_bytes: Optional[int] = None) -> Any:
    """Send one request, return the reply struct; error replies raise ``ServerError``."""
    body = _encode(dealer, msg, max_bytes)
    try:
        raw = dealer.request(body, timeout_s, what=type(msg).__name__.upper())
    except mq.TransportTimeout as exc:
        raise ServerTimeout(exc.url, str(exc)) from None
    return _decoded(dealer, raw)


def _decoded(dealer: mq.DealerClient, raw: bytes) -> Any:
    try:
        reply = codec.decode_reply(raw)
    except codec.CodecError as exc:
        raise LmshmError(f"undecodable reply from {dealer.url}: {exc}") from None
    if isinstance(reply, protocol.ErrorReply):
        raise server_error(reply)
    return reply


class MPClient:
    """A worker's connection to lmshm-server. See the module docstring.

    ``url`` defaults to ``$LMSHM_URL`` or tcp://127.0.0.1:5555. ``fd_socket`` overrides the
    fd-channel path the server announces (when the worker sees it under another path, e.g. in
    a container); ``$LMSHM_FD_SOCKET`` does the same. ``heartbeat_interval_s`` overrides the
    server's suggestion; ``heartbeat=False`` turns the thread off (then nothing re-registers
    after a restart, and the server reclaims a silent session after its reap timeout).
    """

    def __init__(
        self,
        url: Optional[str] = None,
        *,
        timeout_s: float = 10.0,
        client_name: str = "",
        fd_socket: Optional[str] = None,
        heartbeat: bool = True,
        heartbeat_interval_s: Optional[float] = None,
    ) -> None:
        self.url = mq.check_url(url or os.environ.get(URL_ENV) or mq.DEFAULT_URL)
        self.timeout_s = timeout_s
        self.client_name = client_name
        self._fd_socket_override = fd_socket or os.environ.get(FD_SOCKET_ENV) or None
        self._lock = threading.RLock()
        self._dealer = mq.DealerClient(self.url, timeout_s=timeout_s)
        self._link: Optional[FdChannelClient] = None
        self._hello: Optional[protocol.HelloReply] = None
        self._cached: dict[str, _Cached] = {}
        self._closed = False
        self._stop = threading.Event()
        self._heartbeat_thread: Optional[threading.Thread] = None
        #: Times this client re-registered its caches after a server restart.
        self.reregistrations = 0
        try:
            with self._lock:
                self._say_hello()
        except BaseException:
            self._teardown()
            raise
        if heartbeat:
            interval = heartbeat_interval_s or self._hello.heartbeat_interval_s
            self._heartbeat_thread = threading.Thread(
                target=self._heartbeat, args=(interval,), name="lmshm-heartbeat", daemon=True)
            self._heartbeat_thread.start()

    # ---- session ------------------------------------------------------------------------
    @property
    def session_id(self) -> Optional[int]:
        return None if self._hello is None else self._hello.session_id

    @property
    def server_id(self) -> Optional[str]:
        return None if self._hello is None else self._hello.server_id

    def _say_hello(self) -> protocol.HelloReply:
        resume = self._hello.session_token if self._hello is not None else ""
        hello = protocol.Hello(protocol_version=protocol.PROTOCOL_VERSION, protocol_minor=protocol.PROTOCOL_MINOR,
                               isolated_ipc=ipc_policy.is_isolated_ipc(), client_name=self.client_name,
                               resume_token=resume)
        deadline, pause = time.monotonic() + self.timeout_s, 0.01
        while True:  # a busy server (out of fds or sessions, a flood) is asked again until the timeout
            try:
                reply = _exchange(self._dealer, hello)
            except Unavailable:
                if time.monotonic() + pause > deadline:
                    raise
                time.sleep(pause)
                pause = min(2 * pause, 0.2)
                continue
            if reply.resumed and self._link is not None and not self._link.broken():
                break
            try:
                self._open_link(reply, deadline)
                break
            except _TokenExpired as exc:  # the proof came after --auth-timeout (a flood): a new session
                if time.monotonic() + pause > deadline:
                    raise LmshmError(f"cannot prove this worker's identity to the lmshm server at {self.url}: "
                                     f"{exc}") from None
        self._hello = reply
        return reply

    def _open_link(self, hello: protocol.HelloReply, deadline: float) -> None:
        """Connect the fd channel: it proves this process's identity to the server (the kernel
        reports our pid and uid there), carries fds, and tells the server when we die."""
        if self._link is not None:
            self._link.close()
            self._link = None
        path = self._fd_socket_override or hello.fd_socket
        expected = ExpectedServer(pid=hello.server_pid, uid=hello.server_uid, pid_ns=hello.server_pid_ns)
        pause = 0.01
        while True:  # a busy server (out of fds, a full backlog, a flood of connections) is retried
            try:
                self._link = FdChannelClient(path, hello.session_token, expected=expected,
                                             timeout_s=max(0.1, deadline - time.monotonic()))
                return
            except FdChannelError as exc:
                if str(exc).startswith(f"fd channel {path}: {UNKNOWN_TOKEN}"):
                    raise _TokenExpired(str(exc)) from None
                if not exc.retry or time.monotonic() + pause > deadline:
                    raise LmshmError(f"cannot prove this worker's identity to the lmshm server at {self.url}: "
                                     f"{exc}") from None
            time.sleep(pause)
            pause = min(2 * pause, 0.2)

    def _request(self, msg: Any, timeout_s: Optional[float] = None) -> Any:
        """One exchange; a lost session (server restarted) is re-established once."""
        with self._lock:
            if self._closed:
                raise LmshmError("this MPClient is closed")
            max_bytes = self._hello.max_message_bytes if self._hello else None
            try:
                return _exchange(self._dealer, msg, timeout_s, max_bytes)
            except Unavailable as exc:
                if "no session" not in exc.message:
                    raise
            self._recover()
            return _exchange(self._dealer, msg, timeout_s, max_bytes)

    def _recover(self) -> None:
        """Say HELLO again; if the server no longer knows us, re-register everything."""
        old_server = self.server_id
        reply = self._say_hello()
        if reply.resumed:
            return
        logger.warning("lmshm: server at %s %s; re-registering %d instance(s)", self.url,
                       "restarted" if reply.server_id != old_server else "dropped this session",
                       len(self._cached))
        for iid, cached in list(self._cached.items()):
            try:
                self._send_fds([g.wrapper for g in cached.request.groups])
                _exchange(self._dealer, cached.request, None, reply.max_message_bytes)
            except LmshmError as exc:
                logger.error("lmshm: re-registering %r failed: %s", iid, exc)
        self.reregistrations += 1

    def _heartbeat(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                if self._closed:
                    return
                # submit(): the lock is held in short slices, so a dead server never blocks the
                # requests of other threads for the length of a heartbeat timeout.
                pong = self.submit(protocol.Ping(), min(self.timeout_s, max(1.0, 2 * interval))).result()
                with self._lock:
                    if self._closed:
                        return
                    if pong.server_id != self.server_id or not pong.session_known:
                        self._recover()
            except ServerTimeout:
                logger.debug("lmshm: heartbeat to %s timed out", self.url)
            except Exception as exc:
                logger.warning("lmshm: heartbeat to %s failed: %s", self.url, exc)

    def _send_fds(self, wrappers: list[DeviceIPCWrapper]) -> None:
        fds: dict[str, int] = {}
        needy: list[DeviceIPCWrapper] = []
        for w in wrappers:
            exported = w.export_fds()
            if exported:
                fds.update(exported)
                needy.append(w)
        if not fds:
            return
        if self._link is None:
            raise LmshmError(self._fd_channel_message(
                needy, f"this client has no fd-channel link to the server at {self.url}"))
        try:   # memfds are the default CPU kind: a flood that holds the server's fds must not stop them
            self._link.send_fds(fds, deadline=time.monotonic() + self.timeout_s)
        except (FdChannelError, OSError) as exc:
            raise LmshmError(self._fd_channel_message(needy, f"sending them failed: {exc}")) from None

    @staticmethod
    def _fd_channel_message(wrappers: list[DeviceIPCWrapper], reason: str) -> str:
        kinds = sorted({w.kind for w in wrappers})
        hints = list(dict.fromkeys(type(w).fd_channel_hint for w in wrappers if type(w).fd_channel_hint))
        return (f"{len(wrappers)} wrapper(s) of kind {', '.join(kinds)} hand their memory over as file "
                f"descriptors, but {reason}. " + " ".join(hints))

    # ---- public API ---------------------------------------------------------------------
    def register_kv_caches(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        instance_id: Optional[str] = None,
        *,
        model_name: str = "",
        world_size: int = 1,
        rank: int = 0,
        block_dim: int = 0,
    ) -> str:
        """Register every layer with the server, all or nothing. Returns the instance id.

        ``block_dim`` is the dim of every layer's shape, as passed here, whose index is the block
        id (vLLM FlashAttention's ``(2, num_blocks, ...)``: 1); the data plane moves blocks along
        it. ``lmshm.core.dataplane.check_movable`` says beforehand whether it can.

        CPU tensors not allocated with ``lmshm.empty_shared`` are moved into shared memory
        once (see ``wrap_kv_caches``).
        """
        from lmshm.platform.kv_wrap import wrap_kv_caches  # lazy: torch; `lmshm status` imports this module

        _check_block_dim(block_dim)
        return self.register_wrappers(list(kv_caches), wrap_kv_caches(kv_caches), instance_id,
                                      model_name=model_name, world_size=world_size, rank=rank, block_dim=block_dim)

    def register_wrappers(
        self,
        names: list[str],
        wrappers: list[DeviceIPCWrapper],
        instance_id: Optional[str] = None,
        *,
        model_name: str = "",
        world_size: int = 1,
        rank: int = 0,
        block_dim: int = 0,
    ) -> str:
        """``register_kv_caches`` for wrappers made by the caller (e.g. one
        ``RawCudaIPCWrapper.from_pointer`` over a pool no tensor describes). Takes ownership
        of the wrappers: they are closed on failure and at unregister. ``block_dim`` indexes the
        wrappers' shape. A re-registration after a server restart sends the same request."""
        from lmshm.platform.kv_wrap import release_wrappers  # lazy: torch; `lmshm status` imports this module

        try:
            _check_block_dim(block_dim)
        except ValueError:
            release_wrappers(wrappers)
            raise
        instance_id = instance_id or uuid.uuid4().hex
        groups = layer_groups(names, wrappers)
        request = protocol.RegisterKVCache(
            instance_id=instance_id, model_name=model_name, world_size=world_size, worker_rank=rank,
            groups=groups, block_dim=block_dim)
        try:
            with self._lock:
                self._send_fds([g.wrapper for g in groups])
                self._request(request)
                previous = self._cached.pop(instance_id, None)
                self._cached[instance_id] = _Cached(request, wrappers)
        except BaseException:
            release_wrappers(wrappers)
            raise
        if previous is not None:
            release_wrappers(previous.wrappers)
        return instance_id

    def unregister_kv_caches(self, instance_id: str) -> bool:
        """Release ``instance_id`` on the server. Returns True if the server deferred it."""
        from lmshm.platform.kv_wrap import release_wrappers  # lazy: torch; `lmshm status` imports this module

        with self._lock:
            try:
                reply = self._request(protocol.UnregisterKVCache(instance_id))
            except NotFound:
                cached = self._cached.pop(instance_id, None)
                if cached is not None:
                    release_wrappers(cached.wrappers)
                raise
            cached = self._cached.pop(instance_id, None)
        if cached is not None:
            release_wrappers(cached.wrappers)
        return reply.deferred

    def registered(self) -> list[str]:
        """Instance ids this client registered and has not unregistered."""
        with self._lock:
            return list(self._cached)

    def status(self, offset: int = 0, limit: int = protocol.STATUS_PAGE) -> protocol.StatusReply:
        """The server, and ``limit`` (at most ``protocol.STATUS_PAGE``) of its registrations from
        the ``offset``-th, oldest first, with their total and a line per owner."""
        return self._request(protocol.Status(offset, limit, protocol.PROTOCOL_MINOR))

    # ---- the data plane ----------------------------------------------------------------
    def submit(self, msg: Any, timeout_s: Optional[float] = None) -> Pending:
        """Send ``msg`` without waiting; ``Pending.result()`` has its reply. Requests submitted
        by one client are applied by the server in the order they were sent."""
        with self._lock:
            if self._closed:
                raise LmshmError("this MPClient is closed")
            body = _encode(self._dealer, msg, self._hello.max_message_bytes if self._hello else None)
            rid = self._dealer.send(body)
        return Pending(self, rid, type(msg).__name__.upper(), self.timeout_s if timeout_s is None else timeout_s)

    def store(self, instance_id: str, keys: list[bytes], block_ids: list[int], chunk_blocks: int,
              *, wait: bool = True, timeout_s: Optional[float] = None, event: bytes = b"",
              adverts: Optional[list] = None, space: bytes = b"", pod: str = "") -> Any:
        """Copy chunks of blocks into the server's pool (``protocol.Store``). Returns the
        ``StoreReply``, or with ``wait=False`` a ``Pending`` for it. ``event``: for a CUDA
        registration, the IPC handle of an event recorded after the blocks were written.
        ``adverts`` (one ``protocol.Advert`` per key), ``space`` and ``pod``: what the chunks
        are to the engine, for the server's KV events (docs/design/kv-events.md)."""
        wait_s = _wait_s(self.timeout_s if timeout_s is None else timeout_s)
        msg = protocol.Store(instance_id, keys, block_ids, chunk_blocks, event, wait_s=wait_s,
                             adverts=protocol.pack_adverts(adverts), space=space, pod=pod)
        p = self.submit(msg, timeout_s)
        return p.result() if wait else p

    def retrieve(self, instance_id: str, keys: list[bytes], block_ids: list[int], chunk_blocks: int,
                 lease: bytes = b"", *, wait: bool = True, timeout_s: Optional[float] = None,
                 event: bytes = b"") -> Any:
        """Copy stored chunks into blocks (``protocol.Retrieve``); all or nothing. ``event``: for
        a CUDA registration, an event recorded after the worker last used the blocks."""
        wait_s = _wait_s(self.timeout_s if timeout_s is None else timeout_s)
        p = self.submit(protocol.Retrieve(instance_id, keys, block_ids, chunk_blocks, lease, event, wait_s=wait_s),
                        timeout_s)
        return p.result() if wait else p

    def lookup(self, keys: list[list[bytes]], ttl_s: float = 0.0,
               timeout_s: Optional[float] = None) -> protocol.LookupReply:
        """Leading chunks stored for every rank (``keys[rank]``), pinned under a lease."""
        return self._request(protocol.Lookup(keys, ttl_s), timeout_s)

    def kv_events(self, spaces: list[bytes], after: int = -1, limit: int = 1024,
                  timeout_s: Optional[float] = None) -> protocol.KvEventsReply:
        """The server's KV events for this uid in ``spaces`` after log position ``after``."""
        return self._request(protocol.KvEvents(spaces, after, limit), timeout_s)

    def release(self, lease: bytes, timeout_s: Optional[float] = None) -> bool:
        """End a LOOKUP lease early. False if it had already ended."""
        return self._request(protocol.Release(lease), timeout_s).released

    def ping(self) -> float:
        """One empty round trip; returns its duration in seconds."""
        t0 = time.perf_counter()
        self._request(protocol.Ping())
        return time.perf_counter() - t0

    def peek(self, instance_id: str, layer_name: str, offset: int = 0, length: int = 64) -> bytes:
        """Bytes of a registered layer, read by the server through its own mapping."""
        return self._request(protocol.Peek(instance_id, layer_name, offset, length)).data

    def close(self) -> None:
        """Unregister what this client registered (best effort), stop the heartbeat, disconnect."""
        if self._closed:
            return
        self._stop.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(timeout=self.timeout_s + 1)
        with self._lock:
            for iid in list(self._cached):
                try:
                    _exchange(self._dealer, protocol.UnregisterKVCache(iid), min(self.timeout_s, 2.0))
                except LmshmError as exc:
                    logger.info("lmshm: unregistering %r at close failed: %s", iid, exc)
            self._closed = True
            self._teardown()

    def _teardown(self) -> None:
        from lmshm.platform.kv_wrap import release_wrappers  # lazy: torch; `lmshm status` imports this module

        for cached in self._cached.values():
            release_wrappers(cached.wrappers)
        self._cached.clear()
        if self._link is not None:
            self._link.close()
            self._link = None
        self._dealer.close()

    def __enter__(self) -> "MPClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def query_status(url: Optional[str] = None, timeout_s: float = 5.0, *, offset: int = 0,
                 limit: Optional[int] = protocol.STATUS_PAGE) -> protocol.StatusReply:
    """STATUS without a session (what ``lmshm status`` uses): the server, and ``limit``
    registrations (None: every one) from the ``offset``-th, oldest first, with their total
    (``registrations_total``) and a line per owner (``owners``). More than
    ``protocol.STATUS_PAGE`` take one request per page, on one connection; a registration
    that comes or goes between two pages may be missed or listed twice. A 3.3 server, which
    refuses the new fields, is asked the old way: it lists every registration, and this
    function returns its ``StatusReply`` (no total, no owners) with the ones asked for."""
    dealer = mq.DealerClient(mq.check_url(url or os.environ.get(URL_ENV) or mq.DEFAULT_URL), timeout_s=timeout_s)
    try:
        first = min(protocol.STATUS_PAGE, protocol.STATUS_PAGE if limit is None else limit)
        try:
            reply = _exchange(dealer, protocol.Status(offset, first, protocol.PROTOCOL_MINOR))
        except InvalidArgument as exc:
            if "unknown field" not in str(exc):
                raise
            old = _exchange(dealer, protocol.Status())           # a 3.3 server: every registration
            end = None if limit is None else offset + limit
            return msgspec.structs.replace(old, registrations=old.registrations[offset:end])
        rows = list(reply.registrations)
        while (limit is None or len(rows) < limit) and offset + len(rows) < reply.registrations_total:
            want = protocol.STATUS_PAGE if limit is None else min(protocol.STATUS_PAGE, limit - len(rows))
            page = _exchange(dealer, protocol.Status(offset + len(rows), want, protocol.PROTOCOL_MINOR))
            if not page.registrations:
                break                                            # fewer now than when we began
            rows += page.registrations
            reply = page
        return msgspec.structs.replace(reply, registrations=rows, offset=offset)
    finally:
        dealer.close()


def status_as_dict(status: protocol.StatusReply) -> dict[str, Any]:
    return msgspec.to_builtins(status)


def _wait_s(timeout_s: Any) -> float:
    """The ``wait_s`` a STORE/RETRIEVE carries: how long this client waits for its reply."""
    try:
        t = float(timeout_s)
    except (TypeError, ValueError):
        return 0.0
    return min(t, 3600.0) if t > 0 else 0.0
