"""``LmshmConnector``: a vLLM v1 KV connector that offloads and reuses KV blocks through lmshm-server.

Load it with::

    KVTransferConfig(kv_connector="LmshmConnector", kv_connector_module_path="lmshm.integrations.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"lmshm.url": "tcp://127.0.0.1:5555"})

Keys of ``kv_connector_extra_config`` (all optional; ``docs/vllm.md`` has the details):

- ``lmshm.url``: the server (default ``$LMSHM_URL``, else tcp://127.0.0.1:5555);
- ``lmshm.chunk_tokens``: tokens per stored chunk, a multiple of the block size (default: the
  block size);
- ``lmshm.salt``: mixed into every key, to keep tenants or model builds apart (default "");
- ``lmshm.store`` / ``lmshm.load``: turn storing or loading off (default both on);
- ``lmshm.timeout_s`` (STORE/RETRIEVE, default 5), ``lmshm.lookup_timeout_s`` (default 1),
  ``lmshm.retry_s``: after a failure, lmshm is skipped for this long (default 5);
- ``lmshm.load_failure_policy``: vLLM's ``kv_load_failure_policy`` for this connector,
  ``recompute`` (default) or ``fail``;
- ``lmshm.test_corrupt_loads``: overwrite every loaded block with noise after it arrives, and
  ``lmshm.test_fail_loads``: treat every load as failed (the tests' control experiments; never in
  production).

The logic lives in the engine-neutral ``lmshm.integrations.adapter``; this class only translates
vLLM's objects. Scheduler side: ``get_num_new_matched_tokens`` looks up whole chunks beyond what
vLLM already has, ``build_connector_meta`` plans the step's loads and stores, and
``request_finished`` keeps a request's blocks while a store from them is in flight. Worker side:
``register_kv_caches`` registers the KV caches (again after a server restart), ``start_load_kv``
retrieves before the forward pass, ``wait_for_save`` sends the stores, ``get_finished`` reports
requests whose stores are done, ``handle_preemptions`` waits for stores of preempted requests.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from lmshm.integrations.adapter import (
    Link,
    LinkConfig,
    Namespace,
    SchedulerSide,
    StepPlan,
    WorkerSide,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("lmshm.vllm")

_KEYS = {
    "lmshm.url": str, "lmshm.chunk_tokens": int, "lmshm.salt": str, "lmshm.store": bool, "lmshm.load": bool,
    "lmshm.timeout_s": float, "lmshm.lookup_timeout_s": float, "lmshm.retry_s": float,
    "lmshm.load_failure_policy": str, "lmshm.test_corrupt_loads": bool, "lmshm.test_fail_loads": bool,
}


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
    policy = out.get("lmshm.load_failure_policy", "recompute")
    if policy not in ("recompute", "fail"):
        raise ValueError(f"lmshm.load_failure_policy must be 'recompute' or 'fail', got {policy!r}")
    return out


class LmshmConnectorMetadata(KVConnectorMetadata):
    """One step's plan, from the scheduler to every worker (pickled across processes)."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


def _layout_fingerprint(vllm_config: "VllmConfig", kv_cache_config: Any) -> str:
    parts = [f"block_size={vllm_config.cache_config.block_size}",
             f"cache_dtype={vllm_config.cache_config.cache_dtype}"]
    for group in getattr(kv_cache_config, "kv_cache_groups", []) or []:
        spec = group.kv_cache_spec
        fields = {k: getattr(spec, k) for k in ("block_size", "num_kv_heads", "head_size", "dtype")
                  if hasattr(spec, k)}
        parts.append(f"{type(spec).__name__}{sorted(fields.items())}x{len(group.layer_names)}")
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import (
            get_kv_connector_cache_layout,
        )

        parts.append(f"cache_layout={get_kv_connector_cache_layout(vllm_config)}")
    except Exception:  # noqa: BLE001 - older or newer vLLM: the spec above still separates layouts
        pass
    return ";".join(parts)


class LmshmConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        s = _settings(ktc.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ValueError("LmshmConnector does not support pipeline parallelism yet (pipeline_parallel_size > 1)")
        world = parallel.tensor_parallel_size
        block_size = vllm_config.cache_config.block_size
        chunk_tokens = s.get("lmshm.chunk_tokens", block_size)
        model = vllm_config.model_config
        namespace = Namespace(model=f"{model.model}@{getattr(model, 'revision', None) or ''}",
                              dtype=str(model.dtype), layout=_layout_fingerprint(vllm_config, kv_cache_config),
                              world_size=world, chunk_tokens=chunk_tokens, salt=s.get("lmshm.salt", ""))
        side = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self._link = Link(LinkConfig(url=s.get("lmshm.url"), client_name=f"vllm-{side}",
                                     timeout_s=s.get("lmshm.timeout_s", 5.0),
                                     lookup_timeout_s=s.get("lmshm.lookup_timeout_s", 1.0),
                                     retry_s=s.get("lmshm.retry_s", 5.0)))
        self._model_name = str(model.model)
        self._world = world
        self._kv_caches: dict[str, torch.Tensor] = {}
        if role == KVConnectorRole.SCHEDULER:
            ktc.kv_load_failure_policy = s.get("lmshm.load_failure_policy", "recompute")
            self._scheduler: Optional[SchedulerSide] = SchedulerSide(
                self._link, namespace, chunk_tokens=chunk_tokens, block_size=block_size,
                store=s.get("lmshm.store", True), load=s.get("lmshm.load", True))
            self._worker: Optional[WorkerSide] = None
        else:
            self._scheduler = None
            self._rank = _tp_rank()
            corrupt = self._corrupt if s.get("lmshm.test_corrupt_loads", False) else None
            self._worker = WorkerSide(self._link, self._rank, corrupt_loads=corrupt,
                                      fail_loads=s.get("lmshm.test_fail_loads", False))

    # ---- worker side --------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)
        first = next(iter(self._kv_caches.values()), None)
        if first is not None and first.is_cuda:
            from lmshm.core.cuda_sync import WorkerCudaSync

            self._worker.cuda = WorkerCudaSync(first.device.index or 0)
        self._link.register(self._kv_caches, model_name=self._model_name, world_size=self._world, rank=self._rank)
        self._link.wait_connected(self._link.config.timeout_s)

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

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.wait_for_stores()
        self._link.close()

    # ---- scheduler side -----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        tokens = request.prompt_token_ids or []
        return self._scheduler.matched_tokens(request.request_id, tokens, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        block_ids = blocks.get_block_ids()[0] if num_external_tokens else []
        self._scheduler.allocated(request.request_id, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        sched = self._scheduler
        plan = sched.plan()
        for req_id in scheduler_output.preempted_req_ids or ():
            sched.preempted(req_id, plan)
        sched.take_loads(plan)
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            sched.scheduled(new.req_id, block_ids=new.block_ids[0], replace_blocks=True,
                            computed_after_step=new.num_computed_tokens + scheduled.get(new.req_id, 0),
                            plan=plan, tokens=new.prompt_token_ids or [])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            sched.scheduled(req_id, block_ids=new_blocks[0] if new_blocks is not None else None,
                            replace_blocks=req_id in cached.resumed_req_ids,
                            computed_after_step=cached.num_computed_tokens[i] + scheduled.get(req_id, 0), plan=plan)
        return LmshmConnectorMetadata(plan)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        return self._scheduler.finished(request.request_id), None


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no parallel state (single process): rank 0
        return 0
