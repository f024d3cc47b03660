"""The CUDA ordering of the data plane: streams, ordering tokens, async copies, pinning.

A CUDA STORE or RETRIEVE carries the worker's ordering token: an interprocess CUDA event
(default mode; the server answers with an event of its own, which the worker's stream waits on)
or a flag word in a page the worker registered (``FLAG_MAGIC`` tokens, isolated mode; the reply,
sent once the copies are done, is the ordering). ``TorchCudaSync`` is the server's side (one
stream per session, the pool page-locked in ``PIN_EXTENT`` extents, one batched copy call per
request, ``EventKeeper`` for the events it answers with); ``WorkerCudaSync`` the worker's.

The trap: **the server's streams never wait on the GPU for a worker's signal.** A worker that
dies before signalling would block the stream for good, and with it the pool's bytes and the
dead worker's mapping; the server waits on the host, bounded by the request's deadline and its
session's life, before it queues anything. docs/design/dataplane.md ("The CUDA ordering") has
the full rules; the logic tests use a fake (``tests/v1/platform/cuda/fake_sync.py``).
"""

from __future__ import annotations

import collections
import logging
import struct
import threading
import time
from typing import Any, Callable, Hashable, Optional

from lmshm.platform import ipc_policy
from lmshm.platform.cuda import streams
from lmshm.platform.cuda.driver import get_driver

logger = logging.getLogger(__name__)

IPC_EVENT_HANDLE_BYTES = 64
#: Flag tokens: magic, slot (u32), sequence number (u64), then the flag page's instance id.
FLAG_MAGIC = b"LMF1"
_FLAG_HEAD = struct.Struct("<4sIQ")
FLAG_TOKEN_MAX_ID = 64 - _FLAG_HEAD.size      # the id's bytes: a token fits the wire's 64
#: 64-bit words in a worker's flag page (one per request in flight; reused round-robin).
SLOTS = 1024
FLAG_LAYER = "lmshm.flags"
#: Default-mode server events are kept at least this long after their reply...
EVENT_MIN_AGE_S = 30.0
#: ...and at most this many per session (the oldest completed ones go first past it)...
EVENT_CAP = 4096
#: ...and in the whole process: interprocess events are a scarce driver resource (PyTorch's
#: CudaIPCTypes.h reports about 22,000 recorded blocking ones as a practical limit, and keeps
#: 1,000 itself; the workers hold theirs too). Past it the oldest completed ones go early; when
#: none has completed, new default-mode requests are refused until some have.
EVENT_TOTAL_CAP = 8192
#: The pool is page-locked in extents of this many bytes, as copies first touch them
#: (``--cuda-pin-extent``). The driver refuses a copy whose host range is registered in part,
#: so every copy is cut at extent boundaries (``copier.plan_cuda_copies``).
PIN_EXTENT = 256 << 20
PIN_MODES = ("lazy", "start", "off")
#: How a request's copies reach the driver: "batch" (one ``cuMemcpyBatchAsync`` per request,
#: CUDA 12.8+) or "per-piece" (one ``cuMemcpyAsync`` per piece: older drivers, or
#: ``--cuda-copy-batch off``).
COPY_PATHS = ("batch", "per-piece")
_U64 = (1 << 64) - 1


class CudaSyncError(RuntimeError):
    """A worker's ordering token could not be used (bad event handle, bad flag token)."""


class NotSignalled(RuntimeError):
    """The worker's ordering token was not signalled by the time the server had to start."""


class PinError(RuntimeError):
    """Page-locking part of the pool failed (the server's problem, not the worker's)."""


def flag_token(slot: int, seq: int, instance_id: str) -> bytes:
    iid = instance_id.encode()
    if len(iid) > FLAG_TOKEN_MAX_ID:
        raise ValueError(f"a flag page's instance id is at most {FLAG_TOKEN_MAX_ID} bytes")
    return _FLAG_HEAD.pack(FLAG_MAGIC, slot, seq) + iid


def parse_flag_token(token: bytes) -> Optional[tuple[int, int, str]]:
    """``(slot, seq, instance id)`` of a flag token; None if ``token`` is not one;
    ``CudaSyncError`` if it says it is one but is malformed."""
    if not token.startswith(FLAG_MAGIC):
        return None
    if len(token) <= _FLAG_HEAD.size:
        raise CudaSyncError(f"a flag token is {_FLAG_HEAD.size} bytes and an instance id, got {len(token)} bytes")
    _, slot, seq = _FLAG_HEAD.unpack_from(token)
    if slot >= SLOTS:
        raise CudaSyncError(f"flag slot {slot} is out of range (a flag page has {SLOTS} words)")
    try:
        iid = token[_FLAG_HEAD.size:].decode()
    except UnicodeDecodeError:
        raise CudaSyncError("a flag token's instance id is not UTF-8") from None
    return slot, seq, iid


def extents(offset: int, nbytes: int, size: int, extent: int) -> range:
    """The indices of the ``extent``-byte extents of a ``size``-byte pool that
    ``[offset, offset + nbytes)`` touches."""
    if size <= 0:
        return range(0)
    first, last = offset // extent, (offset + max(nbytes, 1) - 1) // extent
    return range(first, min(last, (size - 1) // extent) + 1)


def check_pin_extent(extent: int) -> int:
    """``extent`` if it can be a pin extent (a positive multiple of 4 KiB), else ValueError."""
    if extent <= 0 or extent % 4096:
        raise ValueError(f"the pool's pin extent must be a positive multiple of 4 KiB, got {extent} bytes")
    return extent


def submit_copies(drv: Any, plan: Any, stream: int, device: int, batch: bool) -> int:
    """Queue a request's copies (a ``copier.CopyPlan``) on ``stream``: one
    ``cuMemcpyBatchAsync`` with ``batch``, else one ``cuMemcpyAsync`` per piece. Returns the
    number of driver calls made."""
    if not len(plan):
        return 0
    if batch:
        drv.memcpy_batch_async(plan.dst, plan.src, plan.size, stream, device)
        return 1
    drv.memcpy_async_each(plan.dst, plan.src, plan.size, stream, device)
    return len(plan)


def poll_until(ready: Callable[[], bool], deadline: float, stop: Optional[Callable[[], bool]] = None) -> bool:
    """True once ``ready()`` is; False at ``deadline`` (monotonic) if it is not, or as soon as
    ``stop()`` is true (its request's session ended). Sleeps between polls, from 20 us doubling
    to 1 ms: a host wait never spins a core."""
    pause = 20e-6
    while not ready():
        now = time.monotonic()
        if now >= deadline or (stop is not None and stop()):
            return False
        time.sleep(min(pause, deadline - now))
        pause = min(pause * 2, 1e-3)
    return True


class TorchCudaSync:
    """The real gateway: streams per session, events through ``torch.cuda``, flag words read on
    the host, extent-wise pool pinning, a request's copies through the driver gateway (one
    batch, or one call per piece)."""

    def __init__(self, pin: str = "lazy", pin_extent: int = PIN_EXTENT, copy_batch: bool = True) -> None:
        import torch

        if pin not in PIN_MODES:
            raise ValueError(f"cuda pin mode must be one of {PIN_MODES}, got {pin!r}")
        self._torch = torch
        self._drv = get_driver()
        self.pin_mode = pin
        self.pin_extent = check_pin_extent(pin_extent)
        self.copy_batch = copy_batch        # False: per-piece copies even where the driver batches
        self._paths: dict[int, str] = {}    # device -> its copy path (COPY_PATHS), once known
        self.copy_calls = 0                 # driver calls that queued copies
        self.copy_pieces = 0                # contiguous pieces they copied
        self._streams: dict[tuple[int, Hashable], Any] = {}
        self._pinned: dict[int, set[int]] = {}     # pool base -> pinned extent indices
        self._lock = threading.Lock()

    # ---- streams -----------------------------------------------------------------------
    def stream(self, device: int, session: Hashable = None) -> Any:
        """The session's own non-blocking stream on ``device`` (made on first use)."""
        key = (device, session)
        with self._lock:
            s = self._streams.get(key)
            if s is None:
                handle = self._drv.stream_create(device)
                s = self._torch.cuda.ExternalStream(handle, device=self._torch.device("cuda", device))
                self._streams[key] = s
                _streams_registry().register(handle, device, session)
            return s

    def drop_session(self, session: Hashable) -> None:
        """Destroy the session's streams (queued work completes first: the driver's rule)."""
        with self._lock:
            gone = [(k, s) for k, s in self._streams.items() if k[1] == session]
            for k, _ in gone:
                del self._streams[k]
        for (device, _), s in gone:
            handle = int(s.cuda_stream)
            _streams_registry().unregister(handle, device, session)
            try:
                self._drv.stream_destroy(handle, device)
            except Exception:
                logger.exception("lmshm: destroying a session's CUDA stream failed")

    # ---- the worker's ordering token -----------------------------------------------------
    def open_ipc_event(self, handle: bytes, device: int) -> Any:
        """The worker's interprocess event (``CudaSyncError`` if it cannot be opened)."""
        if len(handle) != IPC_EVENT_HANDLE_BYTES:
            raise CudaSyncError(f"cannot open the worker's CUDA event: a handle is {IPC_EVENT_HANDLE_BYTES} "
                                f"bytes, got {len(handle)}")
        try:
            return self._torch.cuda.Event.from_ipc_handle(device, handle)
        except Exception as exc:
            raise CudaSyncError(f"cannot open the worker's CUDA event: {exc}") from None

    def wait_word(self, page: Any, slot: int, seq: int, deadline: float,
                  stop: Optional[Callable[[], bool]] = None) -> bool:
        """Wait on the host, until ``deadline`` at most (or ``stop()``), for the worker's word to
        reach ``seq`` (cyclic greater-or-equal); the word is read with a synchronous 8-byte copy."""
        return poll_until(lambda: ((int(page[slot].item()) - seq) & _U64) < 1 << 63, deadline, stop)

    # ---- copies and completion -------------------------------------------------------------
    def copy_path(self, device: int) -> str:
        """"batch" where the driver has ``cuMemcpyBatchAsync`` and batching is on, else "per-piece".
        An unpinned pool (``--cuda-pin off``) goes per piece too: the batch's pageable-memory
        behaviour is untested, and those copies are staged by the driver anyway."""
        path = self._paths.get(device)
        if path is None:
            batch = self.copy_batch and self.pin_mode != "off" and self._drv.has_memcpy_batch(device)
            path = "batch" if batch else "per-piece"
            self._paths[device] = path
            logger.info("lmshm: CUDA copies on cuda:%d go %s", device,
                        "in one cuMemcpyBatchAsync per request" if path == "batch" else "one cuMemcpyAsync per piece")
        return path

    def submit(self, plan: Any, stream: Any, device: int) -> None:
        """Queue a request's copies (``copier.CopyPlan``) on ``stream`` (``submit_copies``)."""
        calls = submit_copies(self._drv, plan, int(stream.cuda_stream), device, self.copy_path(device) == "batch")
        with self._lock:                    # copier threads submit at once
            self.copy_calls += calls
            self.copy_pieces += len(plan)

    def record(self, stream: Any, device: int, interprocess: bool = True) -> tuple[Any, bytes]:
        """An event recorded now on ``stream`` (blocking-sync: a host wait sleeps), and its
        IPC handle when ``interprocess`` (b"" otherwise)."""
        ev = self._torch.cuda.Event(interprocess=interprocess, blocking=True)
        ev.record(stream)
        return ev, bytes(ev.ipc_handle()) if interprocess else b""

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def wait(self, event: Any, deadline: float, stop: Optional[Callable[[], bool]] = None) -> bool:
        """True once ``event`` has completed; False at ``deadline`` (monotonic), or once
        ``stop()`` is true, if it has not."""
        return poll_until(lambda: bool(event.query()), deadline, stop)

    # ---- pinning the pool --------------------------------------------------------------------
    def pin(self, pool: Any, offset: int = 0, nbytes: int = -1) -> None:
        """Page-lock the pool's extents that ``[offset, offset + nbytes)`` touches (all of it
        with ``nbytes`` -1, or in ``start`` mode); ``PinError`` if the driver refuses."""
        if self.pin_mode == "off":
            return
        base, size = pool.data_ptr(), pool.numel() * pool.element_size()
        if not size:
            return
        if nbytes < 0 or self.pin_mode == "start":
            offset, nbytes = 0, size
        ext = self.pin_extent
        with self._lock:
            done = self._pinned.setdefault(base, set())
            for i in extents(offset, nbytes, size, ext):
                if i in done:
                    continue
                start = i * ext
                length = min(ext, size - start)
                t0 = time.perf_counter()
                rc = self._torch.cuda.cudart().cudaHostRegister(base + start, length, 0)
                if int(rc) != 0:
                    raise PinError(f"cudaHostRegister of {length} bytes of the pool at offset {start} failed: "
                                   f"error {int(rc)} (lmshm-server --cuda-pin off copies without pinning)")
                done.add(i)
                logger.debug("lmshm: pinned pool extent %d (%d bytes) in %.3f s", i, length,
                             time.perf_counter() - t0)

    def pinned_bytes(self, pool: Any) -> int:
        size = pool.numel() * pool.element_size()
        with self._lock:
            done = self._pinned.get(pool.data_ptr(), set())
            return sum(min(self.pin_extent, size - i * self.pin_extent) for i in done)

    def unpin_all(self, tensors: list) -> None:
        with self._lock:
            for t in tensors:
                base = t.data_ptr()
                for i in sorted(self._pinned.pop(base, set())):
                    self._torch.cuda.cudart().cudaHostUnregister(base + i * self.pin_extent)


def _streams_registry() -> Any:
    """``lmshm.platform.cuda.streams``: the process's copy streams, which a consumer's unmap
    waits on (bounded) before it frees memory they may still be copying."""
    return streams


class WorkerCudaSync:
    """The worker's half: an ordering token per request, and the wait on the server's reply.

    In isolated mode (``ipc_policy.is_isolated_ipc()``, or ``isolated=True``) it needs the
    ``client`` (an ``MPClient``, or a callable returning one or None): on first use it registers
    a flag page of ``SLOTS`` words with the server, under an instance id of its own, registers it
    again (under a new id) whenever the client, or the server behind it, is another one than it
    was registered with (a server restart forgets it), and unregisters it in ``close()``. A
    device without 64-bit stream memory operations cannot write flag words: every token is
    refused then, saying so."""

    def __init__(self, device: int, client: Any = None, *, isolated: Optional[bool] = None) -> None:
        import torch

        self._torch = torch
        self.device = device
        if isolated is None:
            isolated = ipc_policy.is_isolated_ipc()
        self.isolated = bool(isolated)
        if self.isolated and client is None:
            raise ValueError("WorkerCudaSync in isolated mode needs the client: its flag page is registered "
                             "with the server")
        self._client = client
        self._page: Any = None
        self._page_id = ""
        self._registered_with: Any = None
        self._registered_at: Any = None          # the server id the page was registered with
        self._seq = 0
        self._lock = threading.Lock()
        self._refused = ""
        if self.isolated:
            try:
                usable = get_driver().can_use_64bit_stream_mem_ops(device)
            except Exception as exc:
                usable, self._refused = False, f"isolated mode needs the CUDA driver's stream memory operations: {exc}"
            if not usable and not self._refused:
                self._refused = (f"isolated mode (--isolated-ipc, LMSHM_ISOLATED_IPC) orders requests with 64-bit "
                                 f"stream memory operations (cuStreamWriteValue64), which cuda:{device} or its driver "
                                 "does not support (CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS is 0); run "
                                 "worker and server without isolated mode, sharing /dev/shm")
            if self._refused:
                logger.error("lmshm: %s", self._refused)

    def _flag_page(self) -> tuple[Any, str]:
        import secrets

        client = self._client() if callable(self._client) else self._client   # a client, or what gives one
        if client is None:
            raise RuntimeError("no connection to lmshm-server yet: the flag page cannot be registered")
        server = getattr(client, "server_id", None)
        if self._page is not None and client is self._registered_with and server == self._registered_at:
            return self._page, self._page_id
        if self._page is None:
            page = self._torch.zeros(SLOTS, dtype=self._torch.int64, device=f"cuda:{self.device}")
            self._torch.cuda.synchronize(self.device)          # the zeros are there before any wait
        else:
            page = self._page                 # its words only grow: the server reads the newest
        old, old_client = self._page_id, self._registered_with
        iid = f"lmshm-flags-{secrets.token_hex(8)}"      # a new id: never one the client re-sent itself
        client.register_kv_caches({FLAG_LAYER: page}, iid, model_name=FLAG_LAYER)
        self._registered_with, self._registered_at = client, server
        self._page, self._page_id = page, iid
        if old:
            logger.info("lmshm: the isolated-mode flag page is registered again (%s, after %s): the server or "
                        "the client is another one", iid, old)
            try:
                old_client.unregister_kv_caches(old)
            except Exception:
                logger.debug("lmshm: unregistering the old flag page failed", exc_info=True)
        return page, iid

    def ready(self) -> tuple[Any, bytes]:
        """The token for a request sent now: after the work queued so far on the current
        stream. Keep the first item alive until the reply."""
        if self._refused:
            raise CudaSyncError(self._refused)
        stream = self._torch.cuda.current_stream(self.device)
        if not self.isolated:
            ev = self._torch.cuda.Event(interprocess=True, blocking=False)
            ev.record(stream)
            return ev, bytes(ev.ipc_handle())
        with self._lock:
            page, iid = self._flag_page()
            self._seq += 1
            seq = self._seq
        slot = seq % SLOTS
        get_driver().stream_write_value64(int(stream.cuda_stream), page.data_ptr() + 8 * slot, seq, self.device)
        return None, flag_token(slot, seq, iid)

    def wait(self, handle: bytes) -> None:
        """Make the current stream wait for the server's event (no host-side wait). Isolated
        mode's replies carry none: they come once the server's copies are done, and an
        interprocess event in one is refused (``CudaSyncError``): it would need the /dev/shm
        isolated mode does without, and a reply that carries one did not wait for the copies."""
        if not handle:
            return
        if self.isolated:
            raise CudaSyncError("the server answered an isolated-mode request with an interprocess CUDA event; "
                                "its copies may still be running: treat the request as failed (is lmshm-server "
                                "older than this client?)")
        ev = self._torch.cuda.Event.from_ipc_handle(self.device, handle)
        self._torch.cuda.current_stream(self.device).wait_event(ev)

    def close(self) -> None:
        if self._page is not None:
            try:
                self._registered_with.unregister_kv_caches(self._page_id)
            except Exception:
                logger.debug("lmshm: unregistering the flag page failed", exc_info=True)
        self._page = None


class EventKeeper:
    """The server's default-mode reply events per session: each is kept until its copies have
    completed and ``EVENT_MIN_AGE_S`` have passed since its reply. Past ``EVENT_CAP`` in one
    session, or ``EVENT_TOTAL_CAP`` in all, the oldest completed ones go early (``dropped_early``
    counts them; past the total, down to 7/8 of it, so the sort runs once per many requests).
    An event whose copies have not completed is never dropped: ``room()`` says whether a new one
    may be made."""

    def __init__(self, min_age_s: float = EVENT_MIN_AGE_S, cap: int = EVENT_CAP,
                 done: Any = None, total_cap: int = EVENT_TOTAL_CAP) -> None:
        self._min_age = min_age_s
        self._cap = cap
        self._total_cap = total_cap
        self._done = done if done is not None else (lambda ev: bool(ev.query()))
        self._lock = threading.Lock()
        self._by_session: dict[Any, collections.deque] = {}
        self._count = 0
        self.dropped_early = 0

    def keep(self, session: Any, event: Any, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            q = self._by_session.setdefault(session, collections.deque())
            q.append((now, event))
            self._count += 1
            self._trim(q, now)
            if self._count > self._total_cap:
                self._drop_oldest_completed(self._count - self._total_cap * 7 // 8)

    def room(self) -> bool:
        """True if one more event may be kept: under ``EVENT_TOTAL_CAP``, after dropping the
        oldest completed ones early if need be. False: every kept event's copies are still
        running (refuse the request)."""
        with self._lock:
            if self._count < self._total_cap:
                return True
            self._drop_oldest_completed(self._count - self._total_cap * 7 // 8)
            return self._count < self._total_cap

    def _trim(self, q: collections.deque, now: float) -> None:
        before = len(q)
        while q and now - q[0][0] >= self._min_age and self._done(q[0][1]):
            q.popleft()
        if len(q) > self._cap:           # the oldest completed ones, wherever they are
            keep = collections.deque()
            extra = len(q) - self._cap
            for item in q:
                if extra and self._done(item[1]):
                    extra -= 1
                    self.dropped_early += 1
                else:
                    keep.append(item)
            q.clear()
            q.extend(keep)
        self._count -= before - len(q)

    def _drop_oldest_completed(self, n: int) -> None:
        """Drop up to ``n`` completed events, oldest first, over all sessions (under the lock)."""
        done = sorted((t, id(ev), session) for session, q in self._by_session.items() for t, ev in q
                      if self._done(ev))[:max(n, 0)]
        if not done:
            return
        gone = {(session, i) for _, i, session in done}
        for session, q in list(self._by_session.items()):
            kept = [(t, ev) for t, ev in q if (session, id(ev)) not in gone]
            if len(kept) != len(q):
                q.clear()
                q.extend(kept)
            if not q:
                del self._by_session[session]
        self._count -= len(done)
        self.dropped_early += len(done)

    def expire(self, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            for session, q in list(self._by_session.items()):
                self._trim(q, now)
                if not q:
                    del self._by_session[session]

    def drop(self, session: Any) -> None:
        with self._lock:
            self._count -= len(self._by_session.pop(session, ()))

    def __len__(self) -> int:
        with self._lock:
            return self._count
