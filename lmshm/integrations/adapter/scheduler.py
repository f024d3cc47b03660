"""``SchedulerSide``: the scheduler's half of a connector. It decides; the workers copy.

Per request it keeps the chunk keys (per rank and KV cache group), the lease of its last
LOOKUP, its blocks, and how far it was stored. Each step it fills a ``StepPlan``: the loads the
engine accepted, the stores of chunks computed since, the preempted requests whose stores must
finish before their blocks are reused. It sends only LOOKUP and RELEASE itself.

The trap: a lease pins what a LOOKUP found until a RETRIEVE uses it or a RELEASE ends it. Every
path that drops a request's load (no blocks, preemption, finish, a partial window load) must
release its lease, or the server keeps those chunks pinned until the lease expires.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

from lmshm.integrations.adapter.keys import Namespace, chunk_block_ids, chunk_keys, chunk_keys_from_hashes
from lmshm.integrations.adapter.link import Link
from lmshm.integrations.adapter.plan import Group, LoadSpec, StepPlan, StoreSpec
from lmshm.integrations.adapter.stats import SchedulerStats

logger = logging.getLogger("lmshm.connector")


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
