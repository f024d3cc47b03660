"""``LmshmConnector``: a vLLM v1 KV connector that offloads and reuses KV blocks through lmshm-server.

Load it with::

    KVTransferConfig(kv_connector="LmshmConnector", kv_connector_module_path="lmshm.integrations.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"lmshm.url": "tcp://127.0.0.1:5555"})

``docs/vllm.md`` lists the ``kv_connector_extra_config`` keys and the per-request
``kv_transfer_params``. The logic lives in the engine-neutral ``lmshm.integrations.adapter``;
this class translates vLLM's objects:

- **Keys** come from vLLM's own ``request.block_hashes`` (which cover the cache salt, LoRA,
  multimodal inputs and prompt embeddings), chained per chunk and mixed with lmshm's namespace:
  model, dtype, layout, world size, rank, KV cache group, chunk size and ``lmshm.salt``. Two
  requests that vLLM's own prefix cache keeps apart are kept apart here too. The block hash must
  be the same in every engine process: a cryptographic ``prefix_caching_hash_algo`` is required.
- **Scheduler side:** ``get_num_new_matched_tokens`` looks up whole chunks beyond what vLLM
  already has, ``build_connector_meta`` plans the step's loads and stores,
  ``request_finished``/``request_finished_all_groups`` keep a request's blocks while a store
  from them is in flight.
- **Worker side:** ``register_kv_caches`` checks the layout (vLLM's ``[blocks, heads, tokens,
  content]`` per layer, any stride order) and registers one instance per KV cache group,
  ``start_load_kv`` retrieves before the forward pass, ``wait_for_save`` sends the stores,
  ``get_finished`` reports requests whose stores are done. A layout lmshm cannot move is refused
  at ``register_kv_caches`` with a logged error, and the engine runs on without lmshm.
- **Hybrid models** (``SupportsHMA``): full-attention and sliding-window groups. Mamba/SSM
  groups are refused at start-up.
- **KV events** (``take_events``; on with vLLM's ``--kv-events-config`` or ``lmshm.kv_events``):
  every STORE carries what its chunks are to vLLM (block hashes, parent, token ids, LoRA name,
  extra keys), and the scheduler side republishes on the engine's own stream what lmshm-server
  says it can serve: ``BlockStored``/``BlockRemoved`` with medium ``CPU`` (pool) or ``STORAGE``
  (disk, remote), for every engine of the same uid and namespace (docs/design/kv-events.md).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from lmshm.integrations.adapter import (
    EventFeed,
    Group,
    Link,
    LinkConfig,
    Namespace,
    SchedulerSide,
    StepPlan,
    WorkerSide,
    _RateLimited,
    packed_tokens,
)

try:  # vLLM >= 0.32
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover - older vLLM: no worker-to-scheduler metadata
    KVConnectorWorkerMetadata = object  # type: ignore[misc,assignment]

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
except ImportError:  # pragma: no cover
    KVConnectorStats = KVConnectorPromMetrics = None  # type: ignore[misc,assignment]

try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _HOST: Any = CacheHitSource.HOST
except ImportError:  # pragma: no cover
    _HOST = None

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("lmshm.vllm")

_KEYS = {
    "lmshm.url": str, "lmshm.chunk_tokens": int, "lmshm.salt": str, "lmshm.store": bool, "lmshm.load": bool,
    "lmshm.timeout_s": float, "lmshm.lookup_timeout_s": float, "lmshm.retry_s": float,
    "lmshm.shutdown_timeout_s": float, "lmshm.load_failure_policy": str, "lmshm.test_corrupt_loads": bool,
    "lmshm.test_fail_loads": bool, "lmshm.test_fail_loads_rank": int,
    "lmshm.kv_events": bool, "lmshm.kv_events_pod": str, "lmshm.kv_layout": str,
}

#: Layouts ``lmshm.kv_layout`` may ask vLLM for: block-outermost ones, where one block of every
#: layer is one byte run, so a CUDA STORE or RETRIEVE copies one piece a block, not one a layer.
_ASKABLE_LAYOUTS = ("BLHNC", "BLNHC")

#: ``prefix_caching_hash_algo`` values whose block hashes agree across processes and resist
#: collisions (vllm/v1/core/kv_cache_utils.py: the non-cryptographic xxhash algorithms get a
#: random per-process seed unless PYTHONHASHSEED is set, and their collisions can be crafted).
_SHAREABLE_HASHES = ("sha256", "sha256_cbor")

#: vLLM's null block (freed sliding-window blocks are replaced by it in a request's block
#: table): block 0, the first block the BlockPool takes for itself (vllm/v1/core/block_pool.py).
_NULL_BLOCK = 0

#: Per-request switches in ``SamplingParams.extra_args["kv_transfer_params"]["lmshm"]``.
_REQUEST_KEYS = ("load", "store")


def _settings(extra: Optional[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in (extra or {}).items():
        if not str(key).startswith("lmshm."):
            continue
        kind = _KEYS.get(key)
        if kind is None:
            raise ValueError(f"unknown kv_connector_extra_config key {key!r}; LmshmConnector knows "
                             + ", ".join(sorted(_KEYS)))
        if kind is bool and isinstance(value, str):
            value = value.strip().lower() in ("1", "true", "yes", "on")
        try:
            out[key] = kind(value)
        except (TypeError, ValueError):
            raise ValueError(f"kv_connector_extra_config {key!r}: expected {kind.__name__}, got {value!r}") from None
    layout = out.get("lmshm.kv_layout", "")
    if layout and layout not in _ASKABLE_LAYOUTS:
        raise ValueError(f"lmshm.kv_layout must be one of {', '.join(_ASKABLE_LAYOUTS)} (or empty: the engine's "
                         f"choice), got {layout!r}")
    policy = out.get("lmshm.load_failure_policy", "recompute")
    if policy not in ("recompute", "fail"):
        raise ValueError(f"lmshm.load_failure_policy must be 'recompute' or 'fail', got {policy!r}")
    return out


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


# ---- statistics, in vLLM's logged stats and its Prometheus metrics ----------------------

_COUNTERS = ("lookups", "hit_tokens", "loaded_chunks", "loaded_bytes", "stored_chunks", "stored_bytes",
             "failed_loads", "dropped_stores", "cuda_errors")
_TIMINGS = ("lookup_s", "load_s", "store_s")
_MAX_SAMPLES = 10_000


@dataclass
class LmshmConnectorStats(KVConnectorStats if KVConnectorStats is not None else object):  # type: ignore[misc]
    """Counters (summed over ranks and the scheduler) and latency samples (seconds)."""

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in _COUNTERS:
            self.data.setdefault(name, 0)
        for name in _TIMINGS:
            self.data.setdefault(name, [])

    def reset(self) -> None:
        self.data = {}
        self.__post_init__()

    def aggregate(self, other: Any) -> "LmshmConnectorStats":
        theirs = getattr(other, "data", {}) or {}
        for name in _COUNTERS:
            self.data[name] += int(theirs.get(name, 0))
        for name in _TIMINGS:
            room = _MAX_SAMPLES - len(self.data[name])
            self.data[name].extend(list(theirs.get(name, []))[:max(0, room)])
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {name: self.data[name] for name in _COUNTERS}
        for name in _TIMINGS:
            samples = self.data[name]
            out[f"{name[:-2]}_p50_ms"] = round(statistics.median(samples) * 1e3, 3) if samples else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in _COUNTERS) and not any(self.data[n] for n in _TIMINGS)


if KVConnectorPromMetrics is not None:

    class LmshmPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc,valid-type]
        """``vllm:lmshm_*`` counters and latency histograms, one series per engine."""

        _HELP = {
            "lookups": "LOOKUPs the scheduler sent to lmshm-server",
            "hit_tokens": "prompt tokens lmshm-server offered to supply",
            "loaded_chunks": "chunks loaded from lmshm-server (every rank)",
            "loaded_bytes": "KV bytes loaded from lmshm-server (every rank)",
            "stored_chunks": "chunks stored in lmshm-server (every rank)",
            "stored_bytes": "KV bytes stored in lmshm-server (every rank)",
            "failed_loads": "loads that failed and were recomputed",
            "dropped_stores": "STOREs dropped (server unreachable, timed out, or shut down first)",
            "cuda_errors": "CUDA ordering steps that failed in the worker (each a recomputed load or dropped store)",
        }

        def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                     per_engine_labelvalues: dict[int, list[object]]) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self._counters: dict[str, dict[int, Any]] = {}
            self._histograms: dict[str, dict[int, Any]] = {}
            for name in _COUNTERS:
                metric = self._counter_cls(name=f"vllm:lmshm_{name}", documentation=self._HELP[name],
                                           labelnames=labelnames)
                self._counters[name] = {i: metric.labels(*v) for i, v in per_engine_labelvalues.items()}
            buckets = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
            for name in _TIMINGS:
                metric = self._histogram_cls(name=f"vllm:lmshm_{name[:-2]}_seconds",
                                             documentation=f"lmshm {name[:-2]} latency (seconds)",
                                             buckets=buckets, labelnames=labelnames)
                self._histograms[name] = {i: metric.labels(*v) for i, v in per_engine_labelvalues.items()}

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            for name in _COUNTERS:
                value = int(transfer_stats_data.get(name, 0))
                if value and engine_idx in self._counters[name]:
                    self._counters[name][engine_idx].inc(value)
            for name in _TIMINGS:
                hist = self._histograms[name].get(engine_idx)
                for sample in transfer_stats_data.get(name, []) if hist is not None else ():
                    hist.observe(float(sample))


# ---- the KV layout ----------------------------------------------------------------------


class LayoutRefused(ValueError):
    """lmshm cannot move this engine's KV blocks; the message says why."""


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, stride {tuple(t.stride())}, dtype {str(t.dtype).removeprefix('torch.')}"


def block_view(name: str, tensor: torch.Tensor, spec: Any, num_blocks: int) -> tuple[torch.Tensor, int]:
    """``(tensor, block_dim)`` for one layer, from its KV cache spec, never from sizes alone.

    vLLM 0.32 gives every attention layer the logical shape ``[blocks, heads, tokens per block,
    content]`` (``compute_layer_kv_cache_shape_bytes``; the content is K and V of one token, in
    bytes), with the stride order of the resolved ``KVCacheLayout`` on top (LBHNC, LBNHC, LHBNC,
    BLHNC, BLNHC, BHLNC). The block dimension is 0. If the attention kernel splits a block into
    kernel blocks, dim 0 counts those, and the view regroups them per block."""
    try:
        from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes
    except ImportError:
        raise LayoutRefused("this vLLM has no compute_layer_kv_cache_shape_bytes (vLLM < 0.32): LmshmConnector "
                            "knows the KV layout of vLLM 0.32") from None
    try:
        blocks, heads, tokens, content = compute_layer_kv_cache_shape_bytes(spec, num_blocks)
    except Exception as exc:
        raise LayoutRefused(f"layer {name!r}: its KV cache spec {type(spec).__name__} has no per-token layout "
                            f"({exc})") from None
    item = tensor.element_size()
    if tensor.dim() == 4 and tensor.shape[0] % num_blocks == 0 and tensor.shape[0] // num_blocks >= 1:
        ratio = tensor.shape[0] // num_blocks
        try:
            kernel = compute_layer_kv_cache_shape_bytes(spec, num_blocks, spec.block_size // ratio)
        except Exception:
            kernel = None
        if kernel is not None and tuple(tensor.shape[1:3]) == kernel[1:3] and tensor.shape[3] * item == kernel[3]:
            return (tensor if ratio == 1 else tensor.unflatten(0, (num_blocks, ratio))), 0
    raise LayoutRefused(f"layer {name!r} ({_describe(tensor)}) is not vLLM's [blocks, heads, tokens, content] KV "
                        f"layout for its spec {type(spec).__name__} (expected [{num_blocks}, {heads}, {tokens}, "
                        f"{content // item}])")


def _combined(names: list[str], views: list[torch.Tensor], kv_tensor: Any) -> torch.Tensor:
    """One ``[blocks, layers, ...]`` view over the layers of one of vLLM's ``KVCacheTensor``s
    (its layers are views of one buffer, ``layer_stride`` bytes apart). A block-outermost layout
    (BLHNC, BLNHC, BHLNC) gives each layer a view with gaps (the other layers' pages), which a
    wrapper cannot share on its own; together they are one dense run per block."""
    first = views[0]
    item = first.element_size()
    if kv_tensor.layer_stride % item:
        raise LayoutRefused(f"layers {names[:3]}: layer stride {kv_tensor.layer_stride} bytes is not a whole "
                            f"number of {first.dtype} elements")
    step = kv_tensor.layer_stride // item
    combined = first.as_strided((first.shape[0], len(views), *first.shape[1:]),
                                (first.stride(0), step, *first.stride()[1:]), first.storage_offset())
    for layer, (name, view) in enumerate(zip(names, views)):
        same = combined[:, layer]
        if (view.data_ptr(), view.shape, view.stride()) != (same.data_ptr(), same.shape, same.stride()):
            raise LayoutRefused(f"layer {name!r} ({_describe(view)}) is not where vLLM's kv_cache_tensors say "
                                f"(layer {layer} of {names[:3]}..., layer stride {kv_tensor.layer_stride} bytes)")
    return combined


def registration_groups(kv_caches: dict[str, torch.Tensor], kv_cache_config: Any) -> list[dict[str, torch.Tensor]]:
    """What ``register_kv_caches`` registers: per KV cache group, the tensors to register (each
    with its block dimension first), or ``LayoutRefused`` if lmshm cannot move them.

    Layer-outermost layouts register each layer's view. Block-outermost ones register, per
    ``KVCacheTensor``, one view of all its layers (see ``_combined``), under the first layer's
    name with a ``+N`` suffix."""
    from lmshm.core.dataplane import LayoutError, check_movable
    from lmshm.platform.contiguity import is_dense

    num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
    if num_blocks <= 0:
        raise LayoutRefused("vLLM's kv_cache_config has no num_blocks")
    tensor_of = {name: t for t in getattr(kv_cache_config, "kv_cache_tensors", None) or [] for name in t.layers}
    groups: list[dict[str, torch.Tensor]] = []
    for group in kv_cache_config.kv_cache_groups:
        names = [n for n in group.layer_names if n in kv_caches]
        if not names:
            raise LayoutRefused(f"KV cache group of layers {group.layer_names[:3]} has no tensor in "
                                "register_kv_caches")
        views = {n: block_view(n, kv_caches[n], group.kv_cache_spec, num_blocks)[0] for n in names}
        out: dict[str, torch.Tensor] = {}
        pending: dict[int, list[str]] = {}
        for n in names:
            v = views[n]
            if is_dense(tuple(v.shape), tuple(v.stride())) or n not in tensor_of:
                out[n] = v
            else:  # a block-outermost layout: combine the layers of its KVCacheTensor
                pending.setdefault(id(tensor_of[n]), []).append(n)
        for members in pending.values():
            combined = _combined(members, [views[n] for n in members], tensor_of[members[0]])
            if not is_dense(tuple(combined.shape), tuple(combined.stride())):
                raise LayoutRefused(f"layers {members[:3]}... ({_describe(combined)} together) leave gaps between "
                                    "blocks (page padding, or another group's layers): lmshm shares dense "
                                    "memory only")
            out[f"{members[0]}+{len(members) - 1}"] = combined
        try:
            check_movable(list(out), list(out.values()), 0)
        except LayoutError as exc:
            raise LayoutRefused(str(exc)) from None
        groups.append(out)
    return groups


def _groups(kv_cache_config: Any) -> tuple[list[Group], list[list[str]]]:
    """lmshm's view of vLLM's KV cache groups; refuses what it cannot serve (at start-up)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    groups, names = [], []
    for i, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or []):
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            groups.append(Group(window=int(spec.sliding_window)))
        elif isinstance(spec, FullAttentionSpec):
            groups.append(Group())
        else:
            raise ValueError(f"LmshmConnector does not support KV cache group {i} ({type(spec).__name__}, layers "
                             f"{', '.join(group.layer_names[:3])}...): it stores attention KV only (full attention, "
                             "MLA and sliding window). Mamba/SSM and other state layers are not supported; run this "
                             "model without LmshmConnector")
        names.append(list(group.layer_names))
    return groups or [Group()], names


def _layout_fingerprint(vllm_config: "VllmConfig", kv_cache_config: Any) -> str:
    cache = vllm_config.cache_config
    parts = [f"block_size={cache.block_size}", f"cache_dtype={cache.cache_dtype}"]
    for group in getattr(kv_cache_config, "kv_cache_groups", []) or []:
        spec = group.kv_cache_spec
        fields = {k: getattr(spec, k) for k in ("block_size", "num_kv_heads", "head_size", "head_size_v", "dtype",
                                                 "sliding_window")
                  if hasattr(spec, k)}
        parts.append(f"{type(spec).__name__}{sorted(fields.items())}x{len(group.layer_names)}")
    layout = getattr(cache, "kv_cache_layout", None)
    if layout is not None:
        parts.append(f"kv_cache_layout={layout}")
    return ";".join(parts)


def _check_block_hashes(vllm_config: "VllmConfig") -> None:
    algo = vllm_config.cache_config.prefix_caching_hash_algo
    if algo not in _SHAREABLE_HASHES:
        raise ValueError(f"LmshmConnector keys chunks by vLLM's block hashes, which must agree across engine "
                         f"processes and resist collisions between tenants; prefix_caching_hash_algo={algo!r} does "
                         f"neither. Set prefix_caching_hash_algo to one of {', '.join(_SHAREABLE_HASHES)} "
                         "(--prefix-caching-hash-algo sha256, the default)")


def required_kv_layout(vllm_config: Any) -> str:
    """What ``LmshmConnector.get_required_kvcache_layout`` answers ("" for None)."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    wanted = _settings(getattr(ktc, "kv_connector_extra_config", None)).get("lmshm.kv_layout", "")
    if not wanted:
        return ""
    device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "") or "")
    if device and device != "cuda":
        logger.warning("lmshm: lmshm.kv_layout=%s ignored: the %s attention backend takes only its own layout",
                       wanted, device)
        return ""
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    if backend is not None:
        try:
            supported = backend.get_class().supported_kv_cache_layouts()
        except Exception as exc:
            logger.warning("lmshm: lmshm.kv_layout=%s ignored: attention backend %s does not say which layouts "
                           "it takes (%s)", wanted, getattr(backend, "name", backend), exc)
            return ""
        if supported is not None and wanted not in [getattr(x, "name", str(x)) for x in supported]:
            logger.warning("lmshm: lmshm.kv_layout=%s ignored: attention backend %s takes only %s", wanted,
                           getattr(backend, "name", backend), ", ".join(getattr(x, "name", str(x)) for x in supported))
            return ""
    return wanted


class LmshmConnector(KVConnectorBase_V1, SupportsHMA):
    if _HOST is not None:
        _cache_hit_source = _HOST   # vLLM's cache-hit source: lmshm-server's pool is host memory

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        s = _settings(ktc.kv_connector_extra_config)
        _check_block_hashes(vllm_config)
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
        self._groups, self._group_layers = _groups(kv_cache_config)
        sizes = {getattr(g.kv_cache_spec, "block_size", block_size)
                 for g in getattr(kv_cache_config, "kv_cache_groups", None) or []}
        if sizes - {block_size}:
            raise ValueError(f"LmshmConnector needs one block size for every KV cache group; this model has "
                             f"{sorted(sizes | {block_size})}")
        model = vllm_config.model_config
        namespace = Namespace(model=f"{model.model}@{getattr(model, 'revision', None) or ''}",
                              dtype=str(model.dtype), layout=_layout_fingerprint(vllm_config, kv_cache_config),
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
        self._warn = _RateLimited()
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
            from lmshm.platform.cpu import move_to_shared

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
            from lmshm.core.cuda_sync import WorkerCudaSync

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
        if KVConnectorPromMetrics is None:
            return None
        return LmshmPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

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
        if not isinstance(mine, dict) or set(mine) - set(_REQUEST_KEYS) or \
                not all(isinstance(v, bool) for v in mine.values()):
            self._warn.warn("params", "request %s: kv_transfer_params['lmshm'] must be a dict of %s to booleans, "
                            "got %r; ignored", str(request.request_id)[:64], " and ".join(_REQUEST_KEYS),
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
        import msgspec
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
    import socket

    return socket.gethostname()


def _to_vllm_event(event: Any) -> Any:
    """lmshm's copy of a KV event as vLLM's own struct (the same fields and wire format)."""
    import msgspec
    from vllm.distributed import kv_events as vk

    cls = getattr(vk, type(event).__name__)
    return cls(**msgspec.structs.asdict(event))


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return 0
