"""vLLM's KV cache layout, as lmshm registers it: which tensors, with which block dimension.

``registration_groups`` turns what ``register_kv_caches`` receives into one dict of tensors per
KV cache group, each with its block dimension first, read from the layers' KV cache specs (never
guessed from sizes). ``cache_groups`` says which groups lmshm serves (full attention, MLA,
sliding window) and refuses the others (Mamba/SSM) at start-up. docs/vllm.md lists the layouts.

The trap: in a block-outermost layout (BLHNC, BLNHC, BHLNC) one layer's view has gaps (the other
layers' pages), which no wrapper can share; the layers of one ``KVCacheTensor`` are registered
together, as one dense ``[blocks, layers, ...]`` view (``_combined``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lmshm.core.dataplane import LayoutError, check_movable
from lmshm.integrations.adapter import Group
from lmshm.platform.contiguity import is_dense

if TYPE_CHECKING:
    from vllm.config import VllmConfig


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


def cache_groups(kv_cache_config: Any) -> tuple[list[Group], list[list[str]]]:
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


def layout_fingerprint(vllm_config: "VllmConfig", kv_cache_config: Any) -> str:
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
