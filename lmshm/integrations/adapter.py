"""The engine-neutral half of every lmshm connector: keys, chunk math, and the requests.

Nothing here imports an engine. A connector (``vllm.py``, ``trtllm.py``) translates its engine's
objects into the calls below:

- ``Namespace`` and ``chunk_keys``: a chunk is ``chunk_tokens`` consecutive prompt tokens
  (whole KV blocks). Its key is chained, ``k_i = H(k_{i-1}, namespace, tokens of chunk i)``
  (BLAKE2b-256), so a key names the whole prefix up to its chunk. The namespace digest covers the
  model, dtype, KV layout fingerprint, world size, rank and an optional salt: bytes stored under
  one layout are never found by another. (The server checks the layout too, on RETRIEVE.)
- ``Link``: one connection to lmshm-server that never stalls or crashes the engine. It connects
  in the background, and while the server is down or unreachable every call returns at once:
  lookups miss, stores are dropped, retrieves fail, with a rate-limited warning. After a server
  restart ``MPClient`` re-registers the KV caches by itself.
- ``SchedulerSide`` / ``WorkerSide``: per-request bookkeeping. The scheduler decides which
  chunks to load (LOOKUP) and to store; the worker runs the copies (RETRIEVE before the forward
  pass, STORE after it, asynchronously) and reports failures and finished stores.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

logger = logging.getLogger("lmshm.connector")

KEY_BYTES = 32


# ---- keys -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Namespace:
    """What must match for stored KV bytes to be valid for another engine."""

    model: str
    dtype: str
    layout: str               # a fingerprint of the KV layout: shapes, strides, block size, backend
    world_size: int = 1
    rank: int = 0
    chunk_tokens: int = 0
    salt: str = ""

    def for_rank(self, rank: int) -> "Namespace":
        return Namespace(self.model, self.dtype, self.layout, self.world_size, rank, self.chunk_tokens, self.salt)

    @property
    def digest(self) -> bytes:
        text = "\x1f".join(["lmshm-ns-1", self.model, self.dtype, self.layout, str(self.world_size),
                            str(self.rank), str(self.chunk_tokens), self.salt])
        return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=KEY_BYTES).digest()


def chunk_keys(namespace: bytes, tokens: Sequence[int], chunk_tokens: int) -> list[bytes]:
    """Keys of every *whole* chunk of ``tokens``, chained from the first."""
    keys: list[bytes] = []
    prev = b""
    for c in range(len(tokens) // chunk_tokens):
        h = hashlib.blake2b(digest_size=KEY_BYTES)
        h.update(prev)
        h.update(namespace)
        chunk = tokens[c * chunk_tokens:(c + 1) * chunk_tokens]
        h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in chunk))
        prev = h.digest()
        keys.append(prev)
    return keys


def chunk_block_ids(block_ids: Sequence[int], first_chunk: int, chunks: int, chunk_blocks: int) -> list[int]:
    """The block ids of chunks ``[first_chunk, first_chunk + chunks)`` of a request."""
    return list(block_ids[first_chunk * chunk_blocks:(first_chunk + chunks) * chunk_blocks])


# ---- the link to the server -------------------------------------------------------------


class _RateLimited:
    def __init__(self, every_s: float = 30.0) -> None:
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self.suppressed = 0

    def warn(self, what: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last.get(what, -1e9) >= self.every_s:
            self._last[what] = now
            extra = f" ({self.suppressed} similar warnings suppressed)" if self.suppressed else ""
            self.suppressed = 0
            logger.warning("lmshm: " + message + extra, *args)
        else:
            self.suppressed += 1


@dataclass
class LinkConfig:
    url: Optional[str] = None         # None: $LMSHM_URL or tcp://127.0.0.1:5555
    client_name: str = ""
    timeout_s: float = 5.0            # STORE and RETRIEVE
    lookup_timeout_s: float = 1.0
    retry_s: float = 5.0              # after a failure, calls return at once for this long
    warn_every_s: float = 30.0


class Link:
    """See the module docstring. Thread-safe."""

    def __init__(self, config: LinkConfig, *, connect_now: bool = True) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._client: Any = None
        self._down_until = 0.0
        self._connecting = False
        self._closed = False
        self._registration: Optional[Callable[[Any], str]] = None
        self.instance_id: Optional[str] = None
        self._warn = _RateLimited(config.warn_every_s)
        if connect_now:
            self._connect_in_background()

    # ---- connection ---------------------------------------------------------------------
    def _connect_in_background(self) -> None:
        with self._lock:
            if self._connecting or self._client is not None or self._closed:
                return
            self._connecting = True
        threading.Thread(target=self._connect, name="lmshm-connect", daemon=True).start()

    def _connect(self) -> None:
        from lmshm.multiprocess.client import MPClient

        try:
            client = MPClient(self.config.url, timeout_s=self.config.timeout_s,
                              client_name=self.config.client_name)
        except Exception as exc:  # noqa: BLE001 - a missing server is not the engine's problem
            self._warn.warn("connect", "cannot reach lmshm-server at %s: %s; lookups miss and stores are dropped "
                            "until it answers", self.config.url or "the default URL", str(exc))
            with self._lock:
                self._connecting = False
                self._down_until = time.monotonic() + self.config.retry_s
            return
        registration = None
        with self._lock:
            self._connecting = False
            if self._closed:
                client.close()
                return
            self._client = client
            registration = self._registration
        logger.info("lmshm: connected to lmshm-server at %s", client.url)
        if registration is not None:
            self._register_now(registration)

    def client(self) -> Any:
        """The connected ``MPClient``, or None (then a connection attempt starts, at most every
        ``retry_s``)."""
        client = self._client
        if client is not None:
            return client if time.monotonic() >= self._down_until else None
        if time.monotonic() >= self._down_until:
            self._connect_in_background()
        return None

    def wait_connected(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._client is not None and (self.instance_id or self._registration is None):
                return True
            time.sleep(0.02)
        return False

    def _failed(self, what: str, exc: BaseException) -> None:
        self._down_until = time.monotonic() + self.config.retry_s
        # str(exc), never exc: a log record keeping the exception would keep its traceback's
        # frames, and the KV tensors in them, alive
        self._warn.warn(what, "%s failed: %s (the engine goes on without lmshm for %g s)", what.upper(), str(exc),
                        self.config.retry_s)

    # ---- registration -------------------------------------------------------------------
    def register(self, kv_caches: Mapping[str, Any], *, model_name: str = "", world_size: int = 1,
                 rank: int = 0, instance_id: Optional[str] = None) -> None:
        """Register the engine's KV caches now if the server is up, else as soon as it is."""
        iid = instance_id or f"{self.config.client_name or 'lmshm'}-{uuid.uuid4().hex[:12]}"
        self.register_with(lambda client: client.register_kv_caches(
            kv_caches, iid, model_name=model_name, world_size=world_size, rank=rank))

    def register_with(self, registrar: Callable[[Any], str]) -> None:
        """``register`` with the caller's own call: ``registrar(client)`` registers and returns
        the instance id. It runs now if the server is up, else once it is."""
        with self._lock:
            self._registration = registrar
            client = self._client
        if client is not None:
            self._register_now(registrar)
        else:
            self._connect_in_background()

    def _register_now(self, registrar: Callable[[Any], str]) -> None:
        try:
            self.instance_id = registrar(self._client)
        except Exception as exc:  # noqa: BLE001
            self._failed("register", exc)

    # ---- requests -----------------------------------------------------------------------
    def lookup(self, keys: list[list[bytes]], ttl_s: float = 0.0) -> tuple[int, bytes]:
        """``(leading chunks every rank has, lease)``; ``(0, b"")`` whenever anything fails."""
        from lmshm.multiprocess import protocol

        client = self.client()
        if client is None or not keys or not keys[0]:
            return 0, b""
        try:
            reply = client.submit(protocol.Lookup(keys, ttl_s), self.config.lookup_timeout_s).result()
            return reply.hits, reply.lease
        except Exception as exc:  # noqa: BLE001
            self._failed("lookup", exc)
            return 0, b""

    def release(self, lease: bytes) -> None:
        from lmshm.multiprocess import protocol

        client = self.client()
        if client is None or not lease:
            return
        try:
            # Not awaited: cancel() makes the client drop the reply when it comes.
            client.submit(protocol.Release(lease), self.config.lookup_timeout_s).cancel()
        except Exception as exc:  # noqa: BLE001
            self._failed("release", exc)

    def store(self, keys: list[bytes], block_ids: list[int], chunk_blocks: int, event: bytes = b"") -> Any:
        """A ``Pending`` STORE, or None if it was dropped (no server, nothing registered)."""
        client = self.client()
        if client is None or self.instance_id is None or not keys:
            return None
        try:
            return client.store(self.instance_id, keys, block_ids, chunk_blocks, wait=False,
                                timeout_s=self.config.timeout_s, event=event)
        except Exception as exc:  # noqa: BLE001
            self._failed("store", exc)
            return None

    def retrieve(self, keys: list[bytes], block_ids: list[int], chunk_blocks: int, lease: bytes = b"",
                 event: bytes = b"") -> Any:
        """A ``Pending`` RETRIEVE, or None if it cannot be sent (treat as a failure)."""
        client = self.client()
        if client is None or self.instance_id is None:
            return None
        try:
            return client.retrieve(self.instance_id, keys, block_ids, chunk_blocks, lease, wait=False,
                                   timeout_s=self.config.timeout_s, event=event)
        except Exception as exc:  # noqa: BLE001
            self._failed("retrieve", exc)
            return None

    def outcome(self, what: str, pending: Any) -> Optional[Any]:
        """``pending.result()``, or None (logged, rate-limited) if it failed."""
        from lmshm.multiprocess.client import ServerError, ServerTimeout

        try:
            return pending.result()
        except ServerTimeout as exc:
            self._failed(what, exc)
        except ServerError as exc:  # the server answered: it is up, this request failed
            self._warn.warn(what, "%s failed: %s", what.upper(), str(exc))
        except Exception as exc:  # noqa: BLE001
            self._failed(what, exc)
        return None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001
                logger.debug("lmshm: closing the client failed", exc_info=True)


# ---- per-request bookkeeping ------------------------------------------------------------


@dataclass
class LoadSpec:
    req_id: str
    keys: list[list[bytes]]   # per rank, the chunks to load
    block_ids: list[int]
    lease: bytes


@dataclass
class StoreSpec:
    req_id: str
    keys: list[list[bytes]]   # per rank, the chunks to store
    block_ids: list[int]


@dataclass
class StepPlan:
    """What the worker does in one engine step (crosses processes: plain data only)."""

    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    chunk_blocks: int = 1


@dataclass
class _Request:
    tokens: list[int]
    keys: list[list[bytes]]   # per rank, every whole chunk of the prompt
    block_ids: list[int] = field(default_factory=list)
    stored: int = 0           # chunks [0, stored) need no store
    lease: bytes = b""
    hit_chunks: int = 0
    load: Optional[tuple[int, int]] = None   # (first chunk, chunks) to load
    has_stores: bool = False
    num_computed: int = 0     # locally computed tokens when lmshm was last asked


class SchedulerSide:
    """The scheduler's half: lookups, load and store plans, which requests hold their blocks."""

    def __init__(self, link: Link, namespace: Namespace, *, chunk_tokens: int, block_size: int,
                 store: bool = True, load: bool = True) -> None:
        if chunk_tokens % block_size:
            raise ValueError(f"lmshm.chunk_tokens ({chunk_tokens}) must be a multiple of the block size ({block_size})")
        self.link = link
        self.namespaces = [namespace.for_rank(r).digest for r in range(namespace.world_size)]
        self.chunk_tokens = chunk_tokens
        self.chunk_blocks = chunk_tokens // block_size
        self.do_store, self.do_load = store, load
        self._reqs: dict[str, _Request] = {}
        self._loads: list[str] = []

    def _request(self, req_id: str, tokens: Sequence[int]) -> _Request:
        r = self._reqs.get(req_id)
        if r is None:
            tokens = list(tokens)
            keys = [chunk_keys(ns, tokens, self.chunk_tokens) for ns in self.namespaces]
            r = self._reqs[req_id] = _Request(tokens, keys)
        return r

    def matched_tokens(self, req_id: str, tokens: Sequence[int], num_computed: int) -> int:
        """Tokens beyond ``num_computed`` that lmshm can supply (whole chunks; a full-prompt hit
        leaves the last token to compute)."""
        r = self._request(req_id, tokens)
        r.num_computed = num_computed
        if r.lease:
            self.link.release(r.lease)
            r.lease, r.hit_chunks = b"", 0
        if not self.do_load or num_computed % self.chunk_tokens:
            return 0
        first = num_computed // self.chunk_tokens
        if first >= len(r.keys[0]):
            return 0
        hits, lease = self.link.lookup(r.keys)
        if hits <= first:
            self.link.release(lease)
            return 0
        r.lease, r.hit_chunks = lease, hits
        matched = min(hits * self.chunk_tokens, len(r.tokens) - 1)
        return max(0, matched - num_computed)

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external: int) -> None:
        """Blocks were allocated for the request; load ``num_external`` tokens into them."""
        r = self._reqs.get(req_id)
        if r is None:
            return
        num_computed = r.num_computed
        r.block_ids = list(block_ids)
        if num_external <= 0:
            if r.lease:
                self.link.release(r.lease)
                r.lease, r.hit_chunks = b"", 0
            return
        first = num_computed // self.chunk_tokens
        chunks = -(-(num_computed + num_external) // self.chunk_tokens) - first
        r.load = (first, chunks)
        r.stored = max(r.stored, first + chunks)
        self._loads.append(req_id)

    def scheduled(self, req_id: str, *, block_ids: Optional[Sequence[int]], replace_blocks: bool,
                  computed_after_step: int, plan: StepPlan, tokens: Optional[Sequence[int]] = None) -> None:
        """A request runs this step; ``computed_after_step`` tokens will be in its blocks."""
        r = self._reqs.get(req_id)
        if r is None:
            if tokens is None:
                return
            r = self._request(req_id, tokens)
        if block_ids is not None:
            r.block_ids = list(block_ids) if replace_blocks else r.block_ids + list(block_ids)
        if not self.do_store or self.link.client() is None:
            return
        done = min(len(r.keys[0]), computed_after_step // self.chunk_tokens)
        if done > r.stored and len(r.block_ids) >= done * self.chunk_blocks:
            plan.stores.append(StoreSpec(req_id, [k[r.stored:done] for k in r.keys],
                                         chunk_block_ids(r.block_ids, r.stored, done - r.stored, self.chunk_blocks)))
            r.stored = done
            r.has_stores = True

    def take_loads(self, plan: StepPlan) -> None:
        for req_id in self._loads:
            r = self._reqs.get(req_id)
            if r is None or r.load is None:
                continue
            first, chunks = r.load
            plan.loads.append(LoadSpec(req_id, [k[first:first + chunks] for k in r.keys],
                                       chunk_block_ids(r.block_ids, first, chunks, self.chunk_blocks), r.lease))
            r.load, r.lease = None, b""  # the worker's RETRIEVE ends the lease
        self._loads.clear()

    def preempted(self, req_id: str, plan: StepPlan) -> None:
        r = self._reqs.get(req_id)
        if r is not None:
            r.block_ids, r.stored, r.load = [], 0, None
            if r.has_stores:
                plan.preempted.append(req_id)

    def finished(self, req_id: str) -> bool:
        """The request is done. True: the worker still stores from its blocks; free them only
        when it reports the request finished."""
        r = self._reqs.pop(req_id, None)
        if r is None:
            return False
        if r.lease:
            self.link.release(r.lease)
        return r.has_stores

    def plan(self) -> StepPlan:
        return StepPlan(chunk_blocks=self.chunk_blocks)


@dataclass
class _InFlight:
    """A STORE sent by the worker: its reply, and (CUDA) the event it must keep alive until then."""

    pending: Any
    event: Any = None
    settled: bool = False


class WorkerSide:
    """The worker's half: runs a step's copies, tracks stores in flight per request."""

    def __init__(self, link: Link, rank: int = 0, *, corrupt_loads: Optional[Callable[[list[int]], None]] = None,
                 fail_loads: bool = False, cuda: Any = None) -> None:
        self.link = link
        self.rank = rank
        #: For a CUDA KV cache: a ``WorkerCudaSync``. Each request carries an event recorded on
        #: the worker's stream, and the stream waits on the server's event from the reply.
        self.cuda = cuda
        self._stores: dict[str, list[_InFlight]] = {}   # req id -> its STOREs
        self._finishing: set[str] = set()
        self._load_errors: set[int] = set()
        self._corrupt_loads = corrupt_loads        # the control experiment of the real-engine tests
        self._fail_loads = fail_loads              # every load fails (the recompute path, tested for real)
        self.loaded_chunks = self.stored_chunks = self.failed_loads = self.dropped_stores = 0

    def load(self, plan: StepPlan) -> None:
        """RETRIEVE every load of this step and wait: the forward pass needs them."""
        pending = []
        for spec in plan.loads:
            if self._fail_loads:
                self.link.release(spec.lease)
                pending.append((spec, None, None))
                continue
            ev, handle = self.cuda.ready() if self.cuda is not None else (None, b"")
            p = self.link.retrieve(spec.keys[self.rank], spec.block_ids, plan.chunk_blocks, spec.lease, handle)
            pending.append((spec, p, ev))
        for spec, p, _ev in pending:  # _ev lives until the reply is here
            reply = self.link.outcome("retrieve", p) if p is not None else None
            if reply is not None and self.cuda is not None:
                self.cuda.wait(reply.event)
            if reply is None:
                self.failed_loads += 1
                self._load_errors.update(spec.block_ids)
            else:
                self.loaded_chunks += reply.chunks
                if self._corrupt_loads is not None:
                    self._corrupt_loads(spec.block_ids)

    def save(self, plan: StepPlan) -> None:
        """Send this step's STOREs; they complete in the background."""
        ev, handle = self.cuda.ready() if self.cuda is not None and plan.stores else (None, b"")
        for spec in plan.stores:
            p = self.link.store(spec.keys[self.rank], spec.block_ids, plan.chunk_blocks, handle)
            self._stores.setdefault(spec.req_id, [])
            if p is None:
                self.dropped_stores += 1
            else:
                self._stores[spec.req_id].append(_InFlight(p, ev))

    def wait_for_stores(self, req_ids: Optional[Iterable[str]] = None) -> None:
        """Block until the given requests' (default: all) stores are done."""
        ids = list(self._stores) if req_ids is None else [r for r in req_ids if r in self._stores]
        for req_id in ids:
            for store in self._stores.get(req_id, []):
                self._settle(store)

    def _settle(self, store: _InFlight) -> None:
        if store.settled:
            return
        reply = self.link.outcome("store", store.pending)
        if reply is not None:
            self.stored_chunks += sum(1 for r in reply.results if r == 0)
            if self.cuda is not None:
                self.cuda.wait(reply.event)  # the blocks are reused only after the server read them
        store.settled, store.event = True, None

    def finished(self, finished_req_ids: Iterable[str]) -> set[str]:
        """Requests whose blocks may be freed now: finished, and no store in flight."""
        self._finishing.update(r for r in finished_req_ids if r in self._stores)
        done = set()
        for req_id in list(self._finishing):
            stores = self._stores.get(req_id, [])
            if all(st.pending.done() for st in stores):
                for st in stores:
                    self._settle(st)
                del self._stores[req_id]
                self._finishing.discard(req_id)
                done.add(req_id)
        return done

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
