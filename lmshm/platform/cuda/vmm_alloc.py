"""``empty_vmm()``: a tensor in CUDA VMM memory (cuMemCreate + cuMemMap), exportable.

For pools that must be shared with ``VmmCudaIPCWrapper`` -- and for the tests and benchmark,
which need VMM memory without enabling expandable segments. The memory is one or more physical
chunks (each a cuMemCreate allocation, created with the requested shareable handle type) mapped
back to back into one reserved address range; ``chunk_bytes`` smaller than the total mimics
PyTorch's expandable segments.

Lifetime: the returned tensor (and every view of it) keeps the allocation alive; when the last
one is freed the device is synchronised (``cuCtxSynchronize``: this is the producer's own memory,
and any of its streams may still use it), then the chunks are unmapped and released and the
range is freed. Nothing else owns it.
"""

from __future__ import annotations

from typing import Any

import torch

from lmshm.platform.base.ipc_wrapper import dtype_name
from lmshm.platform.cuda import devices
from lmshm.platform.cuda._common import quietly
from lmshm.platform.cuda.driver import get_driver


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class VmmAllocation:
    """Reserved range + mapped chunks; ``release()`` undoes everything (idempotent)."""

    def __init__(self, nbytes: int, ordinal: int, handle_type: str, chunk_bytes: int | None) -> None:
        drv = get_driver()
        self.ordinal = ordinal
        gran = drv.granularity(ordinal, handle_type)
        chunk = _round_up(chunk_bytes or nbytes, gran)
        self.chunk_bytes = chunk
        self.size = _round_up(nbytes, chunk)
        self.handles: list[int] = []
        self._mapped: list[int] = []
        self.va = drv.reserve(self.size, ordinal)
        try:
            for off in range(0, self.size, chunk):
                h = drv.create_allocation(chunk, ordinal, handle_type)
                self.handles.append(h)
                drv.map(self.va + off, chunk, h, ordinal)
                self._mapped.append(off)
            drv.set_access(self.va, self.size, ordinal)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        if self.va is None:
            return
        drv = get_driver()
        if self._mapped:
            # Work queued on this memory (kernels, copies of any stream of this process) must
            # finish before the unmap: cuMemUnmap does not wait for it (PyTorch's expandable
            # segments synchronise before unmapping for the same reason).
            quietly("synchronizing before unmapping a VMM allocation", drv.synchronize, self.ordinal)
        for off in self._mapped:
            quietly("unmapping a VMM chunk", drv.unmap, self.va + off, self.chunk_bytes, self.ordinal)
        for h in self.handles:
            quietly("releasing a VMM chunk", drv.release_allocation, h, self.ordinal)
        quietly("freeing a VMM range", drv.free_address, self.va, self.size, self.ordinal)
        self._mapped, self.handles, self.va = [], [], None

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:
            pass


def empty_vmm(shape: tuple[int, ...], dtype: torch.dtype, device: Any = None, *,
              handle_type: str = "posix-fd", chunk_bytes: int | None = None) -> torch.Tensor:
    """An uninitialised tensor in VMM memory exportable as ``handle_type`` (posix-fd or fabric)."""
    dtype_name(dtype)
    ordinal = devices.ordinal_of("cuda" if device is None else device)
    numel = 1
    for s in shape:
        numel *= int(s)
    nbytes = numel * dtype.itemsize
    if nbytes <= 0:
        raise ValueError(f"empty_vmm needs a non-empty shape, got {tuple(shape)}")
    alloc = VmmAllocation(nbytes, ordinal, handle_type, chunk_bytes)
    flat = get_driver().as_uint8_tensor(alloc.va, nbytes, ordinal, alloc)
    return flat.view(dtype).view(tuple(int(s) for s in shape))
