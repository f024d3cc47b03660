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

import dataclasses
import hashlib
import logging
import sys
import threading
import time
import uuid
from array import array
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
    group: int = 0            # the engine's KV cache group (hybrid models have several)

    def for_rank(self, rank: int, group: int = 0) -> "Namespace":
        return dataclasses.replace(self, rank=rank, group=group)

    @property
    def digest(self) -> bytes:
        text = "\x1f".join(["lmshm-ns-2", self.model, self.dtype, self.layout, str(self.world_size),
                            str(self.rank), str(self.chunk_tokens), self.salt, str(self.group)])
        return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=KEY_BYTES).digest()


def _salt_root(salt: bytes) -> bytes:
    """Where a chain starts: nothing, or a digest of the request's salt (a tenant, an adapter)."""
    if not salt:
        return b""
    return hashlib.blake2b(b"lmshm-salt\x1f" + salt, digest_size=KEY_BYTES).digest()


def chunk_keys(namespace: bytes, tokens: Sequence[int], chunk_tokens: int, salt: bytes = b"") -> list[bytes]:
    """Keys of every *whole* chunk of ``tokens``, chained from the first.

    ``salt`` is the request's own identity (a tenant, a LoRA adapter, ...): two requests with
    the same tokens and different salts share no key. Engines without block hashes of their
    own (TRT-LLM) use this."""
    keys: list[bytes] = []
    prev = _salt_root(salt)
    for c in range(len(tokens) // chunk_tokens):
        h = hashlib.blake2b(digest_size=KEY_BYTES)
        h.update(prev)
        h.update(namespace)
        chunk = tokens[c * chunk_tokens:(c + 1) * chunk_tokens]
        h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in chunk))
        prev = h.digest()
        keys.append(prev)
    return keys


def chunk_keys_from_hashes(namespace: bytes, block_hashes: Sequence[bytes], hashes_per_chunk: int) -> list[bytes]:
    """Keys of every whole chunk from the engine's own chained block hashes (vLLM's
    ``request.block_hashes``, which already cover the cache salt, LoRA, multimodal inputs and
    prompt embeddings): ``k_i = H(k_{i-1}, namespace, hash of chunk i's last block)``."""
    keys: list[bytes] = []
    prev = b""
    for c in range(len(block_hashes) // hashes_per_chunk):
        h = hashlib.blake2b(digest_size=KEY_BYTES)
        h.update(prev)
        h.update(namespace)
        h.update(b"engine-block-hash")
        h.update(bytes(block_hashes[(c + 1) * hashes_per_chunk - 1]))
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
        self._registration: Optional[Callable[[Any], Any]] = None
        self.instance_ids: list[str] = []     # one per KV cache group
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
        from lmshm.transport.client import MPClient

        try:
            client = MPClient(self.config.url, timeout_s=self.config.timeout_s,
                              client_name=self.config.client_name)
        except Exception as exc:
            self._warn.warn("connect", "cannot reach lmshm-server at %s: %s; lookups miss and stores are dropped "
                            "until it answers", self.config.url or "the default URL", str(exc))
            with self._lock:
                self._connecting = False
                self._down_until = time.monotonic() + self.config.retry_s
            return
        registration = None
        with self._lock:
            if self._closed:
                self._connecting = False
                client.close()
                return
            self._client = client         # before _connecting is cleared: wait_connected reads both unlocked
            self._connecting = False
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
        """Wait, at most ``timeout_s``, until the link is connected (and registered, if a
        registration was asked for); False at once when the connection attempt failed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._client is not None and (self.instance_ids or self._registration is None):
                return True
            if self._client is None and not self._connecting:
                return False
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
                 rank: int = 0, instance_id: Optional[str] = None, block_dim: int = 0) -> None:
        """Register the engine's KV caches now if the server is up, else as soon as it is."""
        self.register_groups([kv_caches], model_name=model_name, world_size=world_size, rank=rank,
                             instance_id=instance_id, block_dim=block_dim)

    def register_groups(self, groups: Sequence[Mapping[str, Any]], *, model_name: str = "", world_size: int = 1,
                        rank: int = 0, instance_id: Optional[str] = None, block_dim: int = 0) -> None:
        """One registration per KV cache group (a hybrid model's groups have block tables of
        their own); ``group=g`` in ``store``/``retrieve`` picks one."""
        base = instance_id or f"{self.config.client_name or 'lmshm'}-{uuid.uuid4().hex[:12]}"
        ids = [base if len(groups) == 1 else f"{base}-g{g}" for g in range(len(groups))]

        def registrar(client: Any) -> list[str]:
            done: list[str] = []
            try:
                for iid, kv in zip(ids, groups):
                    done.append(client.register_kv_caches(kv, iid, model_name=model_name, world_size=world_size,
                                                          rank=rank, block_dim=block_dim))
            except Exception:
                for iid in done:  # all groups or none
                    try:
                        client.unregister_kv_caches(iid)
                    except Exception:
                        logger.debug("lmshm: unregistering %s after a failed registration failed", iid)
                raise
            return done

        self.register_with(registrar)

    def register_with(self, registrar: Callable[[Any], Any]) -> None:
        """``register`` with the caller's own call: ``registrar(client)`` registers and returns
        the instance id (or one per group). It runs now if the server is up, else once it is."""
        with self._lock:
            self._registration = registrar
            client = self._client
        if client is not None:
            self._register_now(registrar)
        else:
            self._connect_in_background()

    def _register_now(self, registrar: Callable[[Any], Any]) -> None:
        try:
            ids = registrar(self._client)
            self.instance_ids = [ids] if isinstance(ids, str) else list(ids)
        except Exception as exc:
            self._failed("register", exc)

    @property
    def instance_id(self) -> Optional[str]:
        return self.instance_ids[0] if self.instance_ids else None

    # ---- requests -----------------------------------------------------------------------
    def lookup(self, keys: list[list[bytes]], ttl_s: float = 0.0) -> tuple[int, bytes]:
        """``(leading chunks every rank has, lease)``; ``(0, b"")`` whenever anything fails."""
        from lmshm.wire import protocol

        client = self.client()
        if client is None or not keys or not keys[0]:
            return 0, b""
        try:
            reply = client.submit(protocol.Lookup(keys, ttl_s), self.config.lookup_timeout_s).result()
            return reply.hits, reply.lease
        except Exception as exc:
            self._failed("lookup", exc)
            return 0, b""

    def release(self, lease: bytes) -> None:
        from lmshm.wire import protocol

        client = self.client()
        if client is None or not lease:
            return
        try:
            # Not awaited: cancel() makes the client drop the reply when it comes.
            client.submit(protocol.Release(lease), self.config.lookup_timeout_s).cancel()
        except Exception as exc:
            self._failed("release", exc)

    def _instance(self, group: int) -> Optional[str]:
        ids = self.instance_ids
        return ids[group] if group < len(ids) else None

    def store(self, keys: list[bytes], block_ids: list[int], chunk_blocks: int, event: bytes = b"",
              group: int = 0, adverts: Sequence[tuple] = (), space: bytes = b"", pod: str = "") -> Any:
        """A ``Pending`` STORE, or None if it was dropped (no server, nothing registered).
        ``adverts``: one ``Advert``'s fields per key (KV events), or none."""
        client = self.client()
        iid = self._instance(group)
        if client is None or iid is None or not keys:
            return None
        try:
            ads = None
            if adverts:
                from lmshm.wire import protocol

                ads = [_advert(protocol, a) for a in adverts]
            return client.store(iid, keys, block_ids, chunk_blocks, wait=False,
                                timeout_s=self.config.timeout_s, event=event, adverts=ads, space=space, pod=pod)
        except Exception as exc:
            self._failed("store", exc)
            return None

    def retrieve(self, keys: list[bytes], block_ids: list[int], chunk_blocks: int, lease: bytes = b"",
                 event: bytes = b"", group: int = 0) -> Any:
        """A ``Pending`` RETRIEVE, or None if it cannot be sent (treat as a failure)."""
        client = self.client()
        iid = self._instance(group)
        if client is None or iid is None:
            return None
        try:
            return client.retrieve(iid, keys, block_ids, chunk_blocks, lease, wait=False,
                                   timeout_s=self.config.timeout_s, event=event)
        except Exception as exc:
            self._failed("retrieve", exc)
            return None

    def outcome(self, what: str, pending: Any) -> Optional[Any]:
        """``pending.result()``, or None (logged, rate-limited) if it failed."""
        from lmshm.transport.client import ServerError, ServerTimeout

        try:
            return pending.result()
        except ServerTimeout as exc:
            self._failed(what, exc)
        except ServerError as exc:  # the server answered: it is up, this request failed
            self._warn.warn(what, "%s failed: %s", what.upper(), str(exc))
        except Exception as exc:
            self._failed(what, exc)
        return None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                logger.debug("lmshm: closing the client failed", exc_info=True)


# ---- per-request bookkeeping ------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    """One KV cache group of the engine: its layers share a block table.

    ``window``: 0 for full attention; else a sliding window of that many tokens. The engine then
    frees a request's blocks that fall out of the window (vLLM puts its null block in their
    place), so a load skips chunks whose blocks are null, and a store must finish before the
    engine's next step can free its blocks (``WorkerSide.save`` waits for those)."""

    window: int = 0


@dataclass
class LoadSpec:
    req_id: str
    keys: list[list[list[bytes]]]   # [rank][group]: the chunks to load
    block_ids: list[list[int]]      # [group]
    lease: bytes


@dataclass
class StoreSpec:
    req_id: str
    keys: list[list[list[bytes]]]   # [rank][group]: the chunks to store
    block_ids: list[list[int]]      # [group]
    adverts: list[list[tuple]] = field(default_factory=list)   # [group]: per chunk, an Advert's fields (KV events)


@dataclass
class StepPlan:
    """What the worker does in one engine step (crosses processes: plain data only)."""

    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    chunk_blocks: int = 1
    wait_stores: bool = False       # a window group: stores finish within the step
    space: bytes = b""              # KV events: the engine's namespace and pod name (see EventFeed)
    pod: str = ""


@dataclass
class _Request:
    prompt_len: int
    keys: list[list[list[bytes]]]   # [rank][group]: every whole chunk of the prompt
    block_ids: list[list[int]] = field(default_factory=list)   # [group]
    stored: int = 0           # chunks [0, stored) need no store
    lease: bytes = b""
    hit_chunks: int = 0
    load: Optional[tuple[int, int]] = None   # (first chunk, chunks) to load
    has_stores: bool = False
    num_computed: int = 0     # locally computed tokens when lmshm was last asked
    do_load: bool = True
    do_store: bool = True
    #: KV events: chunk index -> (block_size, block_hashes, parent, token_ids, lora_name,
    #: extra_keys as msgpack): what the chunk is to the engine (``Advert``'s fields but two)
    describe: Optional[Callable[[int], Optional[tuple]]] = None

    @property
    def chunks(self) -> int:
        return len(self.keys[0][0])


class SchedulerSide:
    """The scheduler's half: lookups, load and store plans, which requests hold their blocks.

    A request's identity is either the engine's own chained block hashes (``hashes`` with
    ``hashes_per_chunk``: vLLM), or its tokens plus a per-request ``salt`` (engines without
    block hashes). Keys are per rank and per KV cache group; a chunk counts as a hit only when
    every rank has it for every group."""

    def __init__(self, link: Link, namespace: Namespace, *, chunk_tokens: int, block_size: int,
                 store: bool = True, load: bool = True, groups: Sequence[Group] = (Group(),),
                 null_block: int = 0) -> None:
        if chunk_tokens <= 0 or chunk_tokens % block_size:
            raise ValueError(f"lmshm.chunk_tokens ({chunk_tokens}) must be a positive multiple of the block size "
                             f"({block_size})")
        if any(g.window for g in groups) and chunk_tokens != block_size:
            raise ValueError(f"lmshm.chunk_tokens ({chunk_tokens}) must equal the block size ({block_size}) for a "
                             "model with sliding-window layers: the engine frees blocks one at a time as they fall "
                             "out of the window, and a chunk is loaded whole or not at all")
        self.link = link
        self.groups = list(groups)
        self.namespaces = [[namespace.for_rank(r, g).digest for g in range(len(self.groups))]
                           for r in range(namespace.world_size)]
        self.chunk_tokens = chunk_tokens
        self.chunk_blocks = chunk_tokens // block_size
        self.null_block = null_block
        self.do_store, self.do_load = store, load
        self._reqs: dict[str, _Request] = {}
        self._loads: list[str] = []
        self._leases_after_step: list[bytes] = []
        self.stats = SchedulerStats()
        #: KV events (``EventFeed``): the namespace every rank and group advertises under
        self.space = namespace.for_rank(0, 0).digest
        self.pod = ""

    def _request(self, req_id: str, tokens: Sequence[int], hashes: Optional[Sequence[bytes]] = None,
                 hashes_per_chunk: int = 1, salt: bytes = b"") -> _Request:
        r = self._reqs.get(req_id)
        if r is None:
            whole = len(tokens) // self.chunk_tokens
            if hashes is not None:
                keys = [[chunk_keys_from_hashes(ns, hashes[:whole * hashes_per_chunk], hashes_per_chunk)
                         for ns in rank] for rank in self.namespaces]
            else:
                keys = [[chunk_keys(ns, tokens, self.chunk_tokens, salt) for ns in rank] for rank in self.namespaces]
            r = self._reqs[req_id] = _Request(len(tokens), keys, [[] for _ in self.groups])
        return r

    def _lookup_keys(self, r: _Request) -> list[list[bytes]]:
        return [keys for rank in r.keys for keys in rank]

    def matched_tokens(self, req_id: str, tokens: Sequence[int], num_computed: int, *,
                       hashes: Optional[Sequence[bytes]] = None, hashes_per_chunk: int = 1, salt: bytes = b"",
                       load: bool = True, store: bool = True,
                       describe: Optional[Callable[[int], Optional[tuple]]] = None) -> int:
        """Tokens beyond ``num_computed`` that lmshm can supply (whole chunks; a full-prompt hit
        leaves the last token to compute). ``load``/``store``: this request's own switches.
        ``describe``: for KV events, what chunk ``c`` is to the engine (see ``_Request``)."""
        r = self._request(req_id, tokens, hashes, hashes_per_chunk, salt)
        r.do_load, r.do_store = load, store
        if describe is not None:
            r.describe = describe
        r.num_computed = num_computed
        if r.lease:
            self.link.release(r.lease)
            r.lease, r.hit_chunks = b"", 0
        if not (self.do_load and r.do_load) or num_computed % self.chunk_tokens:
            return 0
        first = num_computed // self.chunk_tokens
        if first >= r.chunks:
            return 0
        t0 = time.perf_counter()
        hits, lease = self.link.lookup(self._lookup_keys(r))
        self.stats.lookup(time.perf_counter() - t0)
        if hits <= first:
            self.link.release(lease)
            return 0
        r.lease, r.hit_chunks = lease, hits
        matched = min(hits * self.chunk_tokens, r.prompt_len - 1)
        self.stats.hit_tokens += max(0, matched - num_computed)
        return max(0, matched - num_computed)

    def allocated(self, req_id: str, block_ids: Sequence[Sequence[int]], num_external: int) -> None:
        """Blocks were allocated for the request (one list per group); load ``num_external``
        tokens into them."""
        r = self._reqs.get(req_id)
        if r is None:
            return
        num_computed = r.num_computed
        if num_external <= 0:
            if r.lease:
                self.link.release(r.lease)
                r.lease, r.hit_chunks = b"", 0
            return
        r.block_ids = [list(b) for b in block_ids]
        first = num_computed // self.chunk_tokens
        chunks = -(-(num_computed + num_external) // self.chunk_tokens) - first
        r.load = (first, chunks)
        r.stored = max(r.stored, first + chunks)
        self._loads.append(req_id)

    def scheduled(self, req_id: str, *, block_ids: Optional[Sequence[Sequence[int]]], replace_blocks: bool,
                  computed_after_step: int, plan: StepPlan, tokens: Optional[Sequence[int]] = None,
                  hashes: Optional[Sequence[bytes]] = None, hashes_per_chunk: int = 1) -> None:
        """A request runs this step; ``computed_after_step`` tokens will be in its blocks.
        ``block_ids``: per group, the request's blocks (``replace_blocks``) or its new ones."""
        r = self._reqs.get(req_id)
        if r is None:
            if tokens is None:
                return
            r = self._request(req_id, tokens, hashes, hashes_per_chunk)
        if block_ids is not None:
            for g, ids in enumerate(block_ids):
                r.block_ids[g] = list(ids) if replace_blocks else r.block_ids[g] + list(ids)
        if not (self.do_store and r.do_store) or self.link.client() is None:
            return
        done = min(r.chunks, computed_after_step // self.chunk_tokens)
        if done <= r.stored or any(len(ids) < done * self.chunk_blocks for ids in r.block_ids):
            return
        keys, ids, adverts = [[[] for _ in self.groups] for _ in r.keys], [], []
        for g, group in enumerate(self.groups):
            chosen = range(r.stored, done)
            if group.window:  # never read a null block: chunks that left the window are not stored
                chosen = [c for c in chosen if not self._has_null(r.block_ids[g], c)]
            for rank, rank_keys in zip(keys, r.keys):
                rank[g] = [rank_keys[g][c] for c in chosen]
            ids.append([b for c in chosen for b in chunk_block_ids(r.block_ids[g], c, 1, self.chunk_blocks)])
            adverts.append(self._adverts(r, g, chosen))
        plan.stores.append(StoreSpec(req_id, keys, ids, adverts if any(adverts) else []))
        plan.space, plan.pod = self.space, self.pod
        plan.wait_stores = plan.wait_stores or any(g.window for g in self.groups)
        r.stored = done
        r.has_stores = True

    def _adverts(self, r: _Request, group: int, chunks: Iterable[int]) -> list[tuple]:
        """``Advert`` fields for each chunk (KV events; its identity is rank 0's key), or none
        at all when the engine gives no description (or fails to: the chunks are stored unadvertised)."""
        if r.describe is None:
            return []
        out = []
        try:
            for c in chunks:
                info = r.describe(c)
                if info is None:
                    return []
                out.append((r.keys[0][group][c], group, *info))
        except Exception as exc:
            logger.debug("lmshm: describing chunks for KV events failed: %s", exc)
            return []
        return out

    def _has_null(self, block_ids: Sequence[int], chunk: int) -> bool:
        return self.null_block in chunk_block_ids(block_ids, chunk, 1, self.chunk_blocks)

    def take_loads(self, plan: StepPlan) -> None:
        for req_id in self._loads:
            r = self._reqs.get(req_id)
            if r is None or r.load is None:
                continue
            first, chunks = r.load
            keys, ids = [[[] for _ in self.groups] for _ in r.keys], []
            partial = False
            for g, group in enumerate(self.groups):
                chosen = range(first, first + chunks)
                if group.window:  # the engine keeps only the window's blocks; the rest are null
                    chosen = [c for c in chosen if not self._has_null(r.block_ids[g], c)]
                    partial = partial or len(chosen) < chunks
                for rank, rank_keys in zip(keys, r.keys):
                    rank[g] = [rank_keys[g][c] for c in chosen]
                ids.append([b for c in chosen for b in chunk_block_ids(r.block_ids[g], c, 1, self.chunk_blocks)])
            plan.loads.append(LoadSpec(req_id, keys, ids, r.lease))
            if partial:  # the RETRIEVEs end the lease's pins of what they load; release the rest
                self._leases_after_step.append(r.lease)
            r.load, r.lease = None, b""
        self._loads.clear()

    def step_done(self) -> None:
        """The engine finished a step: leases its loads did not use up end now."""
        for lease in self._leases_after_step:
            self.link.release(lease)
        self._leases_after_step.clear()

    def preempted(self, req_id: str, plan: StepPlan) -> None:
        r = self._reqs.get(req_id)
        if r is not None:
            r.block_ids, r.stored, r.load = [[] for _ in self.groups], 0, None
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


# ---- KV events: what the server can serve, for the engine's own event stream -----------


class EventFeed:
    """Reads the server's KV events for this engine's namespace (``KV_EVENTS``) without ever
    blocking the engine: ``take()`` returns what arrived since the last call and sends the next
    read, at most one in flight, at most every ``every_s``.

    Every engine of the same uid and namespace gets every event, so a chunk one engine stored
    is advertised on the stream of every engine that can load it, and its removal too. When the
    server restarted (a new epoch) or its log dropped events this feed had not read, the feed
    cannot know what is still there: it sends ``BlockRemoved`` for every block it advertised
    (per medium, locality and group) and starts over. It never sends ``AllBlocksCleared``: on
    an engine's stream that would clear the engine's own GPU blocks from a router's view."""

    MAX_TRACKED = 1 << 20     # advertised hashes remembered for those removals

    def __init__(self, link: Link, spaces: Sequence[bytes], *, every_s: float = 0.05, limit: int = 1024) -> None:
        self.link = link
        self.spaces = list(spaces)
        self.every_s = every_s
        self.limit = limit
        self.cursor = -1
        self.epoch = ""
        self._pending: Any = None
        self._next_at = 0.0
        self._advertised: dict[tuple, set] = {}
        self._tracked = 0
        self.received = self.resets = 0

    def take(self) -> list[Any]:
        out: list[Any] = []
        p = self._pending
        if p is not None and p.done():
            self._pending = None
            try:
                reply = p.result()
            except Exception as exc:
                logger.debug("lmshm: KV_EVENTS failed: %s", exc)
                self._next_at = time.monotonic() + max(1.0, self.link.config.retry_s)
                reply = None
            if reply is not None:
                out = self._apply(reply)
        if self._pending is None and time.monotonic() >= self._next_at:
            self._next_at = time.monotonic() + self.every_s
            client = self.link.client()
            if client is not None:
                from lmshm.wire import protocol

                try:
                    self._pending = client.submit(protocol.KvEvents(self.spaces, self.cursor, self.limit),
                                                  self.link.config.lookup_timeout_s)
                except Exception as exc:
                    logger.debug("lmshm: sending KV_EVENTS failed: %s", exc)
        return out

    def _apply(self, reply: Any) -> list[Any]:
        out: list[Any] = []
        if not self.epoch and self.cursor == -1:
            self.epoch = reply.epoch        # the first read: from the start of this server's log
        if reply.epoch != self.epoch:
            # a new server: what the old one advertised is gone; this reply read the new log
            # from the old cursor, so read it again from its start
            if self.epoch:
                out.extend(self.forget_all())
                self.resets += 1
            self.epoch, self.cursor = reply.epoch, -1
            self._next_at = 0.0
            return out
        if reply.lost:     # events this feed never saw were dropped: removals may be among them
            out.extend(self.forget_all())
            self.resets += 1
        self.cursor = reply.cursor
        for event in reply.events:
            kind = type(event).__name__
            where = (getattr(event, "medium", None), getattr(event, "locality", None),
                     getattr(event, "group_idx", None))
            if kind == "BlockStored":
                seen = self._advertised.setdefault(where, set())
                for h in event.block_hashes:
                    if h not in seen and self._tracked < self.MAX_TRACKED:
                        seen.add(h)
                        self._tracked += 1
            elif kind == "BlockRemoved":
                seen = self._advertised.get(where, set())
                for h in event.block_hashes:
                    if h in seen:
                        seen.discard(h)
                        self._tracked -= 1
            else:
                continue      # AllBlocksCleared is never republished (see the class docstring)
            out.append(event)
        self.received += len(out)
        return out

    def forget_all(self) -> list[Any]:
        """``BlockRemoved`` for every block advertised so far (and forget them)."""
        from lmshm.core.kv_events import BlockRemoved

        out = [BlockRemoved(block_hashes=sorted(hashes, key=repr), medium=medium, group_idx=group, locality=locality)
               for (medium, locality, group), hashes in self._advertised.items() if hashes]
        self._advertised.clear()
        self._tracked = 0
        return out


# ---- statistics -------------------------------------------------------------------------


@dataclass
class SchedulerStats:
    """The scheduler's counters since they were last taken (``take``)."""

    lookups: int = 0
    hit_tokens: int = 0
    lookup_s: list[float] = field(default_factory=list)

    def lookup(self, seconds: float) -> None:
        self.lookups += 1
        if len(self.lookup_s) < 10_000:
            self.lookup_s.append(seconds)

    def take(self) -> dict[str, Any]:
        out = {"lookups": self.lookups, "hit_tokens": self.hit_tokens, "lookup_s": self.lookup_s}
        self.lookups, self.hit_tokens, self.lookup_s = 0, 0, []
        return out


@dataclass
class WorkerStats:
    """One worker's counters since they were last taken (``take``)."""

    loaded_chunks: int = 0
    loaded_bytes: int = 0
    stored_chunks: int = 0
    stored_bytes: int = 0
    failed_loads: int = 0
    dropped_stores: int = 0
    cuda_errors: int = 0        # an ordering step failed in the worker: a miss or a dropped store
    load_s: list[float] = field(default_factory=list)
    store_s: list[float] = field(default_factory=list)

    def take(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            setattr(self, f.name, [] if f.name.endswith("_s") else 0)
        return out


@dataclass
class _InFlight:
    """A STORE sent by the worker: its reply, and (CUDA) the event it must keep alive until then."""

    pending: Any
    event: Any = None
    settled: bool = False
    sent: float = 0.0


class WorkerSide:
    """The worker's half: runs a step's copies, tracks stores in flight per request.

    Every wait here is bounded: a reply that does not come within the link's timeout counts as a
    failed load (recomputed) or a dropped store."""

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
        self.stats = WorkerStats()
        self.loaded_chunks = self.stored_chunks = self.failed_loads = self.dropped_stores = 0

    def load(self, plan: StepPlan) -> None:
        """RETRIEVE every load of this step and wait: the forward pass needs them. A load is
        whole or failed: if any group's RETRIEVE fails, all its blocks are reported."""
        t0 = time.perf_counter()
        self.poll()
        pending = []
        for spec in plan.loads:
            ready = self._cuda_ready() if not self._fail_loads else None
            if self._fail_loads or ready is None:
                self.link.release(spec.lease)
                pending.append((spec, [None], None))
                continue
            ev, handle = ready
            sent = [self.link.retrieve(keys, ids, plan.chunk_blocks, spec.lease, handle, group=g)
                    for g, (keys, ids) in enumerate(zip(spec.keys[self.rank], spec.block_ids)) if keys]
            pending.append((spec, sent, ev))
        for spec, sent, _ev in pending:  # _ev lives until the replies are here
            replies = [self.link.outcome("retrieve", p) if p is not None else None for p in sent]
            if self.cuda is not None:
                for i, reply in enumerate(replies):
                    if reply is not None and not self._cuda_wait(reply.event, "RETRIEVE"):
                        replies[i] = None    # not ordered: the blocks are recomputed
            if any(reply is None for reply in replies):
                self.failed_loads += 1
                self.stats.failed_loads += 1
                self._load_errors.update(b for ids in spec.block_ids for b in ids)
            else:
                chunks = sum(reply.chunks for reply in replies)
                self.loaded_chunks += chunks
                self.stats.loaded_chunks += chunks
                self.stats.loaded_bytes += sum(reply.nbytes for reply in replies)
                if self._corrupt_loads is not None:
                    self._corrupt_loads([b for ids in spec.block_ids for b in ids])
        if plan.loads:
            self.stats.load_s.append(time.perf_counter() - t0)

    def save(self, plan: StepPlan) -> None:
        """Send this step's STOREs; they complete in the background, unless the plan says the
        engine may free their blocks at its next step (``plan.wait_stores``)."""
        self.poll()
        ready = self._cuda_ready() if plan.stores else (None, b"")
        if ready is None:                       # no ordering token: these stores cannot be sent
            self.dropped_stores += len(plan.stores)
            self.stats.dropped_stores += sum(len(k) for spec in plan.stores for k in spec.keys[self.rank])
            plan_stores = []
        else:
            plan_stores = plan.stores
        ev, handle = ready if ready is not None else (None, b"")
        now = time.perf_counter()
        for spec in plan_stores:
            mine = self._stores.setdefault(spec.req_id, [])
            for g, (keys, ids) in enumerate(zip(spec.keys[self.rank], spec.block_ids)):
                if not keys:
                    continue
                adverts = spec.adverts[g] if g < len(spec.adverts) else ()
                p = self.link.store(keys, ids, plan.chunk_blocks, handle, group=g, adverts=adverts,
                                    space=plan.space, pod=plan.pod)
                if p is None:
                    self.dropped_stores += 1
                    self.stats.dropped_stores += len(keys)
                else:
                    mine.append(_InFlight(p, ev, sent=now))
        if plan.wait_stores:
            self.wait_for_stores([s.req_id for s in plan.stores])

    def wait_for_stores(self, req_ids: Optional[Iterable[str]] = None) -> None:
        """Block until the given requests' (default: all) stores are done or have timed out
        (each STORE's reply has its own deadline, so this is bounded by the link's timeout)."""
        ids = list(self._stores) if req_ids is None else [r for r in req_ids if r in self._stores]
        for req_id in ids:
            for store in self._stores.get(req_id, []):
                self._settle(store)

    # ---- CUDA ordering: no CUDA error leaves the connector --------------------------------
    def _cuda_ready(self) -> Optional[tuple[Any, bytes]]:
        """``(keep, token)`` for requests sent now (``(None, b"")`` on CPU); None if the
        ordering token could not be made (counted; the requests are not sent)."""
        if self.cuda is None:
            return None, b""
        try:
            return self.cuda.ready()
        except Exception as exc:
            self.stats.cuda_errors += 1
            self.link._warn.warn("cuda-ready", "lmshm: cannot make a CUDA ordering token (%s); these blocks are "
                                 "not copied", str(exc))
            return None

    def _cuda_wait(self, handle: bytes, what: str) -> bool:
        try:
            self.cuda.wait(handle)
            return True
        except Exception as exc:
            self.stats.cuda_errors += 1
            self.link._warn.warn("cuda-wait", "lmshm: cannot wait for the server's %s event (%s)", what, str(exc))
            return False

    def poll(self) -> None:
        """Settle every STORE whose reply is here (each step): the server's event is opened
        and waited on at once, long before the server lets it go (``EVENT_MIN_AGE_S``)."""
        for stores in self._stores.values():
            for st in stores:
                if not st.settled and st.pending.done():
                    self._settle(st)

    def _settle(self, store: _InFlight) -> None:
        if store.settled:
            return
        reply = self.link.outcome("store", store.pending)
        if reply is not None and self.cuda is not None:
            # Counted if it fails: the server keeps its events long past their completion
            # (EVENT_MIN_AGE_S), so an event that cannot be opened here is one it destroyed
            # after its copies were done, or a driver fault.
            self._cuda_wait(reply.event, "STORE")
        if reply is not None:
            ok = sum(1 for r in reply.results if r == 0)
            self.stored_chunks += ok
            self.stats.stored_chunks += ok
            self.stats.stored_bytes += reply.nbytes
            self.stats.store_s.append(time.perf_counter() - store.sent)
        else:
            self.stats.dropped_stores += 1
        store.settled, store.event = True, None

    def finished(self, finished_req_ids: Iterable[str]) -> set[str]:
        """Requests whose blocks may be freed now: finished, and no store in flight."""
        self._finishing.update(r for r in finished_req_ids if r in self._stores)
        self.poll()
        done = set()
        for req_id in list(self._finishing):
            stores = self._stores.get(req_id, [])
            if all(st.settled or st.pending.done() for st in stores):
                for st in stores:
                    self._settle(st)
                del self._stores[req_id]
                self._finishing.discard(req_id)
                done.add(req_id)
        return done

    def abandon(self) -> int:
        """Forget every store still in flight (shutdown, past its bound); how many there were."""
        n = sum(1 for stores in self._stores.values() for st in stores if not st.settled)
        for stores in self._stores.values():
            for st in stores:
                if not st.settled:
                    st.pending.cancel()
                    st.settled, st.event = True, None
        self.stats.dropped_stores += n
        self._stores.clear()
        self._finishing.clear()
        return n

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors


def packed_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as an ``Advert`` carries them (3.8's ``tokens``): little-endian int32, 4 bytes
    a token. ``OverflowError`` for an id outside int32 (no engine's vocabulary is that large)."""
    packed = array("i", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _advert(protocol: Any, fields: tuple) -> Any:
    """An ``Advert`` from its fields, the token ids packed (``packed_tokens``): the server
    decodes one bytes object, not a list of ints. ``fields[5]``, the token ids, may come packed
    already (the vLLM describer packs them, so the scheduler's metadata carries bytes) or as a list."""
    tokens = fields[5]
    if not isinstance(tokens, (bytes, bytearray)):
        tokens = packed_tokens(tokens)
    return protocol.Advert(*fields[:5], [], *fields[6:8], tokens=bytes(tokens))
