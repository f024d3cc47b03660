"""Device memory -> torch tensor, without a copy: CuPy UnownedMemory -> DLPack -> torch.

The consumer gets a bare device pointer from the driver (an IPC or VMM mapping). torch has no
public "tensor from a device pointer with an owner" call, so the bytes go through CuPy:
``UnownedMemory(ptr, nbytes, owner)`` -> a flat ``uint8`` CuPy array -> ``torch.from_dlpack``.
The torch tensor keeps the CuPy array alive, the array keeps the memory object alive, and the
memory object keeps ``owner`` alive -- lmshm passes a mapping lease there, so the mapping is
unmapped only after the last tensor (or view of it) is freed.

Always ``uint8`` first, then ``Tensor.view(dtype)``: bfloat16 and the fp8 types have no CuPy
dtype. CuPy is imported on first use only.
"""

from __future__ import annotations

from typing import Any

import torch

from lmshm.platform.cuda.errors import CudaUnavailableError


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise CudaUnavailableError(
            "mapping CUDA memory into torch needs CuPy: install cupy-cuda13x (CUDA 13) or "
            "cupy-cuda12x (CUDA 12), e.g. 'lmshm[cuda13]'"
        ) from exc
    return cupy


def uint8_tensor(ptr: int, nbytes: int, ordinal: int, owner: Any) -> torch.Tensor:
    """A 1-D uint8 tensor on ``cuda:ordinal`` over ``nbytes`` at ``ptr``, keeping ``owner`` alive."""
    if nbytes <= 0:
        raise ValueError(f"cannot build a tensor over {nbytes} bytes")
    cupy = _cupy()
    with cupy.cuda.Device(ordinal):
        mem = cupy.cuda.UnownedMemory(int(ptr), int(nbytes), owner, ordinal)
        flat = cupy.ndarray((int(nbytes),), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        return torch.from_dlpack(flat)


def view_as(flat_u8: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...],
            stride: tuple[int, ...], storage_offset: int = 0) -> torch.Tensor:
    """Reinterpret bytes as ``dtype`` and lay the caller's view (shape, stride, offset in
    elements) over them."""
    typed = flat_u8.view(dtype)
    return typed.as_strided(shape, stride, storage_offset)
