"""``LmshmConnector``: vLLM's calls, translated into the engine-neutral adapter's.

The scheduler-side instance owns a ``SchedulerSide`` (and an ``EventFeed`` with KV events on),
each worker-side instance a ``WorkerSide``; they share nothing but the ``StepPlan`` vLLM carries
in its connector metadata. This module only translates vLLM's objects (requests, block tables,
scheduler output, KV cache tensors); the logic is in ``lmshm.integrations.adapter``.

The trap: every call here runs on the engine's own threads, so none may raise past a request
or wait without a bound: a server that is down costs misses, never a stalled or failed engine.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import TYPE_CHECKING, Any, Optional

import msgspec
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from lmshm.core.cuda_sync import WorkerCudaSync
from lmshm.integrations.adapter import (
    EventFeed,
    Link,
    LinkConfig,
    Namespace,
    SchedulerSide,
    StepPlan,
    WorkerSide,
    packed_tokens,
)
from lmshm.integrations.vllm.layout import LayoutRefused, cache_groups, layout_fingerprint, registration_groups
from lmshm.integrations.vllm.settings import REQUEST_KEYS, check_block_hashes, read_settings, required_kv_layout
from lmshm.integrations.vllm.stats import KVConnectorStats, LmshmConnectorStats, prom_metrics
from lmshm.platform.cpu import move_to_shared

try:  # vLLM >= 0.32
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover - older vLLM: no worker-to-scheduler metadata
    KVConnectorWorkerMetadata = object  # type: ignore[misc,assignment]

try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _HOST: Any = CacheHitSource.HOST
except ImportError:  # pragma: no cover
    _HOST = None

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("lmshm.vllm")

#: vLLM's null block (freed sliding-window blocks are replaced by it in a request's block
#: table): block 0, the first block the BlockPool takes for itself (vllm/v1/core/block_pool.py).
_NULL_BLOCK = 0


class LmshmConnectorMetadata(KVConnectorMetadata):
    """One step's plan, from the scheduler to every worker (pickled across processes)."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class LmshmWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc,valid-type]
    """From the workers to the scheduler, per step: a worker that refused its KV layout turns
    lmshm off for the whole engine (every rank must load, or none)."""

    def __init__(self, refused: str = "") -> None:
        self.refused = refused

    def aggregate(self, other: "LmshmWorkerMetadata") -> "LmshmWorkerMetadata":
        return LmshmWorkerMetadata(self.refused or getattr(other, "refused", ""))


class LmshmConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector interface over lmshm-server (docs/vllm.md). One instance per role:
    the scheduler's holds a ``SchedulerSide``, each worker's a ``WorkerSide``."""

    if _HOST is not None:
        _cache_hit_source = _HOST   # vLLM's cache-hit source: lmshm-server's pool is host memory

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        s = read_settings(ktc.kv_connector_extra_config)
        check_block_hashes(vllm_config)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ValueError("LmshmConnector does not support pipeline parallelism yet (pipeline_parallel_size > 1)")
        world = parallel.tensor_parallel_size
        block_size = vllm_config.cache_config.block_size
        chunk_tokens = s.get("lmshm.chunk_tokens", block_size)
        if chunk_tokens <= 0 or chunk_tokens % block_size:
            raise ValueError(f"lmshm.chunk_tokens ({chunk_tokens}) must be a positive multiple of the block size "
                             f"({block_size})")
        hash_block = getattr(kv_cache_config, "hash_block_size", None) or block_size
        if chunk_tokens % hash_block:
            raise ValueError(f"lmshm.chunk_tokens ({chunk_tokens}) must be a multiple of vLLM's hash block size "
                             f"({hash_block})")
        self._hashes_per_chunk = chunk_tokens // hash_block
        self._groups, self._group_layers = cache_groups(kv_cache_config)
        sizes = {getattr(g.kv_cache_spec, "block_size", block_size)
                 for g in getattr(kv_cache_config, "kv_cache_groups", None) or []}
        if sizes - {block_size}:
            raise ValueError(f"LmshmConnector needs one block size for every KV cache group; this model has "
                             f"{sorted(sizes | {block_size})}")
        model = vllm_config.model_config
        namespace = Namespace(model=f"{model.model}@{getattr(model, 'revision', None) or ''}",
                              dtype=str(model.dtype), layout=layout_fingerprint(vllm_config, kv_cache_config),
                              world_size=world, chunk_tokens=chunk_tokens, salt=s.get("lmshm.salt", ""))
        side = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self._link = Link(LinkConfig(url=s.get("lmshm.url"), client_name=f"vllm-{side}",
                                     timeout_s=s.get("lmshm.timeout_s", 5.0),
                                     lookup_timeout_s=s.get("lmshm.lookup_timeout_s", 1.0),
                                     retry_s=s.get("lmshm.retry_s", 5.0)))
        self._shutdown_s = s.get("lmshm.shutdown_timeout_s", 10.0)
        self._model_name = str(model.model)
        self._world = world
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._refused = ""
        events_config = getattr(vllm_config, "kv_events_config", None)
        self._events = s.get("lmshm.kv_events", bool(getattr(events_config, "enable_kv_cache_events", False)))
        self._hash_block = hash_block
        self._feed: Optional[EventFeed] = None
        if role == KVConnectorRole.SCHEDULER:
            ktc.kv_load_failure_policy = s.get("lmshm.load_failure_policy", "recompute")
            self._scheduler: Optional[SchedulerSide] = SchedulerSide(
                self._link, namespace, chunk_tokens=chunk_tokens, block_size=block_size,
                store=s.get("lmshm.store", True), load=s.get("lmshm.load", True), groups=self._groups,
                null_block=_NULL_BLOCK)
            self._worker: Optional[WorkerSide] = None
            if self._events:
                self._scheduler.pod = s.get("lmshm.kv_events_pod", "") or _pod_name(events_config)
                self._feed = EventFeed(self._link, [self._scheduler.space])
            # The engine's first requests are looked up as soon as it starts: connect now, so
            # they can hit (a slow start, with the machine busy, used to miss the first step).
            # A server that does not answer costs this wait once; the engine then goes on
            # without lmshm and connects in the background.
            self._link.wait_connected(self._link.config.timeout_s)
        else:
            self._scheduler = None
            self._rank = _tp_rank()
            corrupt = self._corrupt if s.get("lmshm.test_corrupt_loads", False) else None
            fail_rank = s.get("lmshm.test_fail_loads_rank", -1)
            fail = s.get("lmshm.test_fail_loads", False) or fail_rank == self._rank
            self._worker = WorkerSide(self._link, self._rank, corrupt_loads=corrupt, fail_loads=fail)

    @property
    def requires_kv_delivery(self) -> bool:
        """False: lmshm is a best-effort cache. A store dropped because its request was
        preempted is a future miss, not lost output, so vLLM need not recompute the request."""
        return False

    # ---- worker side --------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        cpu = [t for t in kv_caches.values() if t.device.type == "cpu"]
        if cpu:
            # Now, in the engine's thread: the registration itself may run later, in the
            # background, while the engine writes its caches (see move_to_shared).
            move_to_shared(cpu)
        try:
            groups, block_dim = self._layer_groups(kv_caches)
        except LayoutRefused as exc:
            self._refused = str(exc)
            logger.error("lmshm: LmshmConnector refuses this engine's KV cache layout, and the engine runs without "
                         "lmshm: %s", exc)
            return
        self._kv_caches = dict(kv_caches)
        first = next(iter(self._kv_caches.values()), None)
        if first is not None and first.is_cuda:
            # Isolated mode registers a flag page through the link's client, once it is up.
            self._worker.cuda = WorkerCudaSync(first.device.index or 0, client=self._link.client)
        self._link.register_groups(groups, model_name=self._model_name, world_size=self._world, rank=self._rank,
                                   block_dim=block_dim)
        self._link.wait_connected(self._link.config.timeout_s)

    def _layer_groups(self, kv_caches: dict[str, torch.Tensor]) -> tuple[list[dict[str, torch.Tensor]], int]:
        """The registered tensors, one dict per KV cache group, and their block dimension;
        ``LayoutRefused`` if lmshm cannot move them."""
        if self._kv_cache_config is None or not getattr(self._kv_cache_config, "kv_cache_groups", None):
            raise LayoutRefused("vLLM gave the connector no kv_cache_config: the layers' KV cache specs are unknown")
        return registration_groups(kv_caches, self._kv_cache_config), 0

    def build_connector_worker_meta(self) -> Optional[LmshmWorkerMetadata]:
        return LmshmWorkerMetadata(self._refused) if self._refused else None

    def _plan(self) -> Optional[StepPlan]:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, LmshmConnectorMetadata) else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        plan = self._plan()
        if plan is not None and plan.loads:
            self._worker.load(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole chunks of every layer are stored in wait_for_save

    def wait_for_save(self) -> None:
        plan = self._plan()
        if plan is not None and plan.stores:
            self._worker.save(plan)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if isinstance(kv_connector_metadata, LmshmConnectorMetadata) and kv_connector_metadata.plan.preempted:
            self._worker.wait_for_stores(kv_connector_metadata.plan.preempted)  # their blocks are reused now

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        if self._worker is None:
            return None, None
        done = self._worker.finished(finished_req_ids)
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def _corrupt(self, block_ids: list[int]) -> None:
        ids = torch.tensor(block_ids, dtype=torch.long)
        gen = torch.Generator().manual_seed(1234)
        for t in self._kv_caches.values():
            noise = torch.randn(t[ids].shape, generator=gen) * 4
            t[ids] = noise.to(t.dtype)

    def get_kv_connector_stats(self) -> Optional[LmshmConnectorStats]:
        if KVConnectorStats is None:
            return None
        if self._scheduler is not None:
            data = self._scheduler.stats.take()
        else:
            data = self._worker.stats.take()
        stats = LmshmConnectorStats(data=data)
        return None if stats.is_empty() else stats

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> Optional[str]:
        """The layout ``lmshm.kv_layout`` asks for (off by default: the engine's choice), or None
        where the attention backend refuses it: on the CPU (its backend takes only LBHNC), and
        where an explicitly chosen backend does not list it (``supported_kv_cache_layouts``).
        With the backend left to vLLM, vLLM drops a preference its backends refuse, and says so."""
        wanted = required_kv_layout(vllm_config)
        if wanted:
            logger.info("lmshm: asking vLLM for the %s KV cache layout (lmshm.kv_layout)", wanted)
        return wanted or None

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None) -> Optional[LmshmConnectorStats]:
        if KVConnectorStats is None:
            return None
        return LmshmConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        return prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Wait for the stores in flight, at most ``lmshm.shutdown_timeout_s`` (each STORE also
        has its own reply deadline), then abandon the rest and close the link."""
        if self._worker is not None:
            deadline = time.monotonic() + self._shutdown_s
            for req_id in list(self._worker._stores):
                if time.monotonic() >= deadline:
                    break
                self._worker.wait_for_stores([req_id])
            dropped = self._worker.abandon()
            if dropped:
                logger.warning("lmshm: shutdown abandoned %d STOREs still in flight", dropped)
        if self._scheduler is not None:
            self._scheduler.step_done()
        self._link.close()

    # ---- scheduler side -----------------------------------------------------------------
    def _request_switches(self, request: Any) -> tuple[bool, bool]:
        """``(load, store)`` from ``kv_transfer_params={"lmshm": {"load": bool, "store": bool}}``.
        Anything malformed is ignored with a warning: a request never stops the engine."""
        params = getattr(request, "kv_transfer_params", None)
        mine = params.get("lmshm") if isinstance(params, dict) else None
        if mine is None:
            return True, True
        if not isinstance(mine, dict) or set(mine) - set(REQUEST_KEYS) or \
                not all(isinstance(v, bool) for v in mine.values()):
            self._link.warn("params", "request %s: kv_transfer_params['lmshm'] must be a dict of %s to booleans, "
                                      "got %r; ignored", str(request.request_id)[:64], " and ".join(REQUEST_KEYS),
                                      str(mine)[:200])
            return True, True
        return mine.get("load", True), mine.get("store", True)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        load, store = self._request_switches(request)
        if getattr(request, "skip_reading_prefix_cache", False):
            load = False   # prompt_logprobs and friends: vLLM needs the prompt computed
        tokens = request.prompt_token_ids or []
        matched = self._scheduler.matched_tokens(
            request.request_id, tokens, num_computed_tokens, hashes=list(request.block_hashes),
            hashes_per_chunk=self._hashes_per_chunk, load=load, store=store,
            describe=self._describer(request) if self._events else None)
        return matched, False

    def _describer(self, request: Any) -> Any:
        """What chunk ``c`` of ``request`` is to vLLM, as its own ``BlockStored`` says it
        (block_pool.py): the hash-block size, block hashes, parent hash, token ids (packed:
        ``packed_tokens``), LoRA name and per-block extra keys (cache salt, multimodal ids,
        prompt-embeds digests)."""
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys,
            maybe_convert_block_hash,
            to_event_extra_keys,
        )

        k, size = self._hashes_per_chunk, self._hash_block
        lora = request.lora_request.name if getattr(request, "lora_request", None) else None

        def describe(c: int) -> Optional[tuple]:
            hashes = request.block_hashes
            first = c * k
            if len(hashes) < first + k:
                return None
            extra, mm = [], 0
            for b in range(first, first + k):
                keys, mm = generate_block_hash_extra_keys(request, b * size, (b + 1) * size, mm)
                extra.append(keys)
            extra_keys = to_event_extra_keys(extra)
            return (size, [maybe_convert_block_hash(h) for h in hashes[first:first + k]],
                    maybe_convert_block_hash(hashes[first - 1]) if first else None,
                    packed_tokens(request.all_token_ids[first * size:(first + k) * size]), lora,
                    msgspec.msgpack.encode(extra_keys) if extra_keys else None)

        return describe

    def take_events(self) -> Any:
        """What lmshm-server can now serve or no longer serve for this engine, as vLLM's own
        KV events (republished on the engine's stream); never blocks the scheduler."""
        if self._feed is None:
            return ()
        events = self._feed.take()
        return [_to_vllm_event(e) for e in events] if events else ()

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        block_ids = blocks.get_block_ids() if num_external_tokens else ()
        self._scheduler.allocated(request.request_id, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        sched = self._scheduler
        plan = sched.plan()
        for req_id in scheduler_output.preempted_req_ids or ():
            sched.preempted(req_id, plan)
        sched.take_loads(plan)
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            sched.scheduled(new.req_id, block_ids=new.block_ids, replace_blocks=True,
                            computed_after_step=new.num_computed_tokens + scheduled.get(new.req_id, 0), plan=plan)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            sched.scheduled(req_id, block_ids=new_blocks, replace_blocks=req_id in cached.resumed_req_ids,
                            computed_after_step=cached.num_computed_tokens[i] + scheduled.get(req_id, 0), plan=plan)
        return LmshmConnectorMetadata(plan)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.step_done()
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        refused = getattr(meta, "refused", "")
        if refused and (self._scheduler.do_load or self._scheduler.do_store):
            logger.error("lmshm: a worker refused its KV cache layout; lmshm is off for this engine: %s", refused)
            self._scheduler.do_load = self._scheduler.do_store = False

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        return self._scheduler.finished(request.request_id), None

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, Optional[dict[str, Any]]]:
        return self._scheduler.finished(request.request_id), None


def _pod_name(events_config: Any) -> str:
    """The name lmshm-server uses for this engine in per-engine topics (``kv@<pod>@<model>``):
    ``lmshm.kv_events_pod``, else the host name (one engine per pod, as llm-d deploys them)."""
    return socket.gethostname()


def _to_vllm_event(event: Any) -> Any:
    """lmshm's copy of a KV event as vLLM's own struct (the same fields and wire format)."""
    from vllm.distributed import kv_events as vk

    cls = getattr(vk, type(event).__name__)
    return cls(**msgspec.structs.asdict(event))


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return 0
