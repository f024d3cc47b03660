"""Wrapping a worker's KV caches in one call, all or nothing.

``wrap_kv_caches({"model.layers.0.attn": t0, ...})`` returns one wrapper per layer, in dict
order, each chosen by the tensor's device type under the current switches (see
``device_registry``). Before anything is wrapped the batch is checked: it must be a
non-empty dict of tensors of one rank (engines never mix ranks within one model; a mix
means a bug upstream). If layer k fails, the wrappers of layers < k are closed and the
segments this call created are released (names unlinked, fds closed) before the error --
naming layer k and the cause -- propagates. Migrated tensors stay valid either way: they
keep their private mapping of the (now nameless) segment.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Mapping

import torch

from lmshm.platform.base.ipc_wrapper import DeviceIPCWrapper
from lmshm.platform.device_registry import resolve_kv_wrapper_factory


class KVCacheWrapError(RuntimeError):
    """Wrapping one layer of a batch failed; everything wrapped before it was released."""

    def __init__(self, layer_index: int, layer_name: str, cause: BaseException) -> None:
        self.layer_index = layer_index
        self.layer_name = layer_name
        super().__init__(
            f"wrapping KV cache layer {layer_index} ({layer_name!r}) failed: "
            f"{type(cause).__name__}: {cause}"
        )


def wrap_one_kv_cache(tensor: torch.Tensor, name: str = "tensor") -> DeviceIPCWrapper:
    """Wrap one tensor with the wrapper its device type selects right now."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    cls = resolve_kv_wrapper_factory(tensor.device.type, tensor)
    return cls.wrap(tensor, name=name)


def _check_batch(kv_caches: Mapping[str, torch.Tensor]) -> None:
    if not isinstance(kv_caches, Mapping):
        raise TypeError(f"kv_caches must be a dict of layer name -> tensor, got {type(kv_caches).__name__}")
    if not kv_caches:
        raise ValueError("kv_caches is empty: there is nothing to wrap")
    by_rank: dict[int, list[str]] = defaultdict(list)
    for name, t in kv_caches.items():
        if not isinstance(name, str):
            raise TypeError(f"layer names must be strings, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"layer {name!r}: expected a torch.Tensor, got {type(t).__name__}")
        by_rank[t.dim()].append(name)
    if len(by_rank) > 1:
        parts = "; ".join(
            f"rank {r}: {len(names)} layer(s), e.g. {', '.join(repr(n) for n in names[:2])}"
            for r, names in sorted(by_rank.items())
        )
        raise ValueError(f"KV caches mix tensor ranks ({parts}); every layer must have the same rank")


def _cpu_scope() -> contextlib.AbstractContextManager:
    from lmshm.platform.cpu import migration_scope

    return migration_scope()


def wrap_kv_caches(kv_caches: Mapping[str, torch.Tensor]) -> list[DeviceIPCWrapper]:
    """One wrapper per layer, in dict order; all or nothing (see the module docstring).

    Layers that are views of one storage with one dtype, shape and stride (the per-layer
    slices of a KV pool) are wrapped once; the others become ``sibling()``s of that first
    wrapper, which costs a dict copy instead of a full wrap, and lets the client send the
    whole run as one group.
    """
    _check_batch(kv_caches)
    wrapped: list[DeviceIPCWrapper] = []
    leaders: dict[tuple, DeviceIPCWrapper] = {}
    with _cpu_scope() as created_segments:
        for index, (name, tensor) in enumerate(kv_caches.items()):
            try:
                storage_ptr = tensor.untyped_storage().data_ptr()
                key = (storage_ptr, tensor.dtype, tensor.shape, tensor.stride(), tensor.get_device())
                leader = leaders.get(key)
                if leader is not None:
                    sibling = leader.sibling_for(tensor, storage_ptr)  # type: ignore[attr-defined]
                    if sibling is not None:
                        wrapped.append(sibling)
                        continue
                wrapper = wrap_one_kv_cache(tensor, name)
                wrapped.append(wrapper)
                if wrapper.groupable:
                    leaders[key] = wrapper
            except Exception as exc:
                release_wrappers(wrapped)
                for seg in created_segments:
                    seg.unlink()
                raise KVCacheWrapError(index, name, exc) from exc
    return wrapped


def release_wrappers(wrappers: list[DeviceIPCWrapper]) -> None:
    """Close every wrapper (idempotent, never raises), last first: a ``sibling()`` comes after
    its leader in ``wrap_kv_caches``' list, so every sibling is closed before the leader that
    owns what they share (the VMM kind's exported fd, which a sibling exports while its
    leader is open)."""
    for w in reversed(list(wrappers)):
        w.close()
