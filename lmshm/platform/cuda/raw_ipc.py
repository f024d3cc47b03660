"""RawCudaIPCWrapper: legacy CUDA IPC handles, with no /dev/shm and no IPC namespace needed.

Producer: find the allocation holding the tensor (``cuMemGetAddressRange``), take an IPC
handle of its *base* (``cuIpcGetMemHandle``), and send the 64 handle bytes with the tensor's
byte offset inside the allocation -- tensors are usually interior pointers of a
caching-allocator block. The rendezvous happens inside the kernel driver, so worker and server
may live in separate containers. TRT-LLM-style pools that no torch tensor describes use
``RawCudaIPCWrapper.from_pointer(ptr, nbytes, dtype, shape, device)``.

Consumer: ``cuIpcOpenMemHandle`` maps the whole allocation and returns its base; the tensor is
rebuilt at ``base + alloc_offset``. The driver keeps one mapping per (process, allocation) (older
drivers tore it down at the first ``cuIpcCloseMemHandle``; current ones count opens), so the
open goes through the process-wide ``MAPPINGS`` table keyed by the handle bytes: one open per
allocation, the last release closes, close is idempotent and a failing close is logged.

Only cudaMalloc-style memory has legacy IPC handles: memory from the VMM API (PyTorch expandable
segments, vLLM sleep mode) or from cudaMallocAsync pools is refused with a hint to use
``use_vmm_api``. A handle cannot be opened in the process that exported it, and the exporter must
still be alive when the consumer opens it.
"""

from __future__ import annotations

import logging
from typing import Any, Hashable

from lmshm.platform.cuda._common import (
    DeviceMapping,
    FlatCudaWrapper,
    check_bytes,
    producer_id,
)
from lmshm.platform.cuda.driver import (
    IPC_HANDLE_BYTES,
    CudaDriverError,
    get_driver,
    hexptr,
)
from lmshm.platform.cuda.errors import (
    NOT_CUDA_MALLOC_HINT,
    CudaExportError,
    NotCudaMallocMemoryError,
)

logger = logging.getLogger(__name__)


class RawCudaIPCWrapper(FlatCudaWrapper):
    """A CUDA tensor shared through a driver IPC handle of its allocation (isolated mode)."""

    kind = "cuda-raw"
    extra_fields = ("producer", "ipc_handle", "alloc_offset", "alloc_size")

    @classmethod
    def _export(cls, ptr: int, nbytes: int, dtype: str, shape: tuple[int, ...], stride: tuple[int, ...],
                ordinal: int, name: str, **options: Any) -> "RawCudaIPCWrapper":
        if options:
            raise TypeError(f"{cls.__name__}.wrap() takes no options, got {sorted(options)}")
        drv = get_driver()
        uuid = drv.device_uuid(ordinal)
        where = f"{name!r} (ptr={hexptr(ptr)}, cuda:{ordinal} {uuid})"
        try:
            base, size = drv.address_range(ptr, ordinal)
        except CudaDriverError as exc:
            raise CudaExportError(
                f"cannot share {where}: {exc}",
                "the pointer is not device memory of this process on that GPU (freed, host "
                "memory, or another device)",
            ) from exc
        if ptr + nbytes > base + size:
            raise CudaExportError(
                f"cannot share {where}: its {nbytes} bytes run past the end of the allocation "
                f"[{hexptr(base)}, {hexptr(base + size)})",
                "a legacy IPC handle covers one cudaMalloc allocation; share each allocation separately",
            )
        try:
            capable = drv.is_legacy_ipc_capable(base, ordinal)
        except CudaDriverError:
            capable = True  # drivers without the attribute: let cuIpcGetMemHandle decide
        if not capable:
            raise NotCudaMallocMemoryError(
                f"cannot export {where} as a CUDA IPC handle "
                "(CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE is false)",
                NOT_CUDA_MALLOC_HINT,
            )
        try:
            handle = drv.ipc_get_handle(base, ordinal)
        except CudaDriverError as exc:
            raise NotCudaMallocMemoryError(f"cannot export {where}: {exc}", NOT_CUDA_MALLOC_HINT) from exc
        return cls(dtype=dtype, shape=shape, stride=stride, storage_offset=0, device=uuid,
                   producer=producer_id(), ipc_handle=handle, alloc_offset=ptr - base, alloc_size=size)

    def _validate_extra(self) -> None:
        super()._validate_extra()
        check_bytes(type(self), "ipc_handle", self.ipc_handle, sizes=(IPC_HANDLE_BYTES,))

    def _mapping_key(self) -> Hashable:
        return ("cuda-ipc", self.ipc_handle)

    def _open(self, ordinal: int) -> DeviceMapping:
        if self._exported_here():
            raise RuntimeError(
                f"{type(self).__name__}: a CUDA IPC handle cannot be opened in the process that "
                "exported it (the driver refuses); map it in another process, or use the original "
                "tensor here"
            )
        drv = get_driver()
        base = drv.ipc_open(self.ipc_handle, ordinal)
        try:
            # Trust the driver's size of what it mapped over the peer's word, where it tells.
            _, size = drv.address_range(base, ordinal)
        except CudaDriverError as exc:
            logger.debug("lmshm: no address range for an IPC mapping (%s); using the producer's size", exc)
            size = self.alloc_size
        return DeviceMapping(base=base, size=size, ordinal=ordinal)

    @staticmethod
    def _close_mapping(mapping: DeviceMapping) -> None:
        get_driver().ipc_close(mapping.base, mapping.ordinal)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["handle"] = self.ipc_handle[:8].hex()
        return d

