"""Which wrapper class serves which device type.

Selection is a function evaluated at every call (design.md section 3); nothing here caches
a class, so flipping ``isolated_ipc`` or ``use_vmm_api`` takes effect on the next wrap.

- cpu:  isolated_ipc -> CpuFdIPCWrapper (memfd, fd over the side channel)
        a tensor already in an lmshm segment -> the wrapper of that segment's kind (no copy)
        otherwise    -> the ``cpu_segments`` switch: CpuFdIPCWrapper (memfd, the default) or
                        CpuShmIPCWrapper (named POSIX shared memory)
- cuda: use_vmm_api  -> VmmCudaIPCWrapper
        isolated_ipc -> RawCudaIPCWrapper (driver IPC handles)
        otherwise    -> CudaIPCWrapper (PyTorch storage sharing)
"""

from __future__ import annotations

from typing import Any, Callable

from lmshm.platform import ipc_policy
from lmshm.platform.base.ipc_wrapper import DeviceIPCWrapper


def _select_cpu(tensor: Any = None) -> type[DeviceIPCWrapper]:
    from lmshm.platform import cpu

    if ipc_policy.is_isolated_ipc():
        return cpu.CpuFdIPCWrapper
    seg = cpu.segment_of(tensor) if tensor is not None else None
    kind = seg.kind if seg is not None else ipc_policy.cpu_segment_kind()
    return cpu.CpuFdIPCWrapper if kind == "memfd" else cpu.CpuShmIPCWrapper


def _select_cuda(tensor: Any = None) -> type[DeviceIPCWrapper]:
    from lmshm.platform import cuda

    if ipc_policy.is_use_vmm_api():
        return cuda.VmmCudaIPCWrapper
    if ipc_policy.is_isolated_ipc():
        return cuda.RawCudaIPCWrapper
    return cuda.CudaIPCWrapper


_SELECTORS: dict[str, Callable[..., type[DeviceIPCWrapper]]] = {
    "cpu": _select_cpu,
    "cuda": _select_cuda,
}


def supported_device_types() -> list[str]:
    return sorted(_SELECTORS)


def resolve_kv_wrapper_factory(device_type: str, tensor: Any = None) -> type[DeviceIPCWrapper]:
    """The wrapper class for ``device_type`` under the current switches (and, for CPU, the
    segment ``tensor`` already lives in, if any)."""
    selector = _SELECTORS.get(device_type)
    if selector is None:
        raise ValueError(
            f"no IPC wrapper for device type {device_type!r}; lmshm supports "
            f"{', '.join(supported_device_types())}"
        )
    return selector(tensor)
