"""``kv_connector_extra_config``: the ``lmshm.*`` keys the connector reads, and their checks.

Every key is typed; an unknown or mistyped ``lmshm.*`` key stops the engine at start-up with
the known keys named (a typo must not silently turn a feature off). Keys without the ``lmshm.``
prefix belong to vLLM or other connectors and are left alone. docs/vllm.md lists every key.

The trap: vLLM may hand strings for booleans (from a JSON command line): ``"false"`` is False.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

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

#: Per-request switches in ``SamplingParams.extra_args["kv_transfer_params"]["lmshm"]``.
REQUEST_KEYS = ("load", "store")


def read_settings(extra: Optional[dict]) -> dict[str, Any]:
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


def check_block_hashes(vllm_config: "VllmConfig") -> None:
    algo = vllm_config.cache_config.prefix_caching_hash_algo
    if algo not in _SHAREABLE_HASHES:
        raise ValueError(f"LmshmConnector keys chunks by vLLM's block hashes, which must agree across engine "
                         f"processes and resist collisions between tenants; prefix_caching_hash_algo={algo!r} does "
                         f"neither. Set prefix_caching_hash_algo to one of {', '.join(_SHAREABLE_HASHES)} "
                         "(--prefix-caching-hash-algo sha256, the default)")


def required_kv_layout(vllm_config: Any) -> str:
    """What ``LmshmConnector.get_required_kvcache_layout`` answers ("" for None)."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    wanted = read_settings(getattr(ktc, "kv_connector_extra_config", None)).get("lmshm.kv_layout", "")
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
