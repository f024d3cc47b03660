"""RawCudaIPCWrapper: legacy CUDA IPC handles, with no /dev/shm and no fd channel needed.

Producer: find the allocation holding the tensor (``cuMemGetAddressRange``), take an IPC handle
of its *base* (``cuIpcGetMemHandle``), and send the 64 handle bytes with the tensor's byte
offset inside the allocation. Pools no torch tensor describes use ``from_pointer``. Only
cudaMalloc-style memory has such handles: VMM and cudaMallocAsync memory is refused, with a
hint that names what it is and where it can go.

Consumer: ``cuIpcOpenMemHandle`` maps the whole allocation, once per session and allocation
(``MAPPINGS``, keyed by session and handle bytes); the last release closes it, after
``streams.quiesce`` says no registered copy stream still works on the device (else the mapping
is leaked and counted, never closed under DMA). The trap: a handle cannot be opened in the
process that exported it, and separate containers need a shared PID namespace at least,
which no GPU run has proved yet. docs/design/cuda-wrappers.md has the rest.
"""

from __future__ import annotations

import logging
from typing import Any, Hashable

from lmshm.platform.cuda import streams
from lmshm.platform.cuda._common import (
    DeviceMapping,
    FlatCudaWrapper,
    check_bytes,
    producer_id,
    quietly,
)
from lmshm.platform.cuda.driver import (
    IPC_HANDLE_BYTES,
    CudaDriverError,
    get_driver,
    handle_type_names,
    hexptr,
)
from lmshm.platform.cuda.errors import (
    NOT_CUDA_MALLOC_HINT,
    CudaExportError,
    NotCudaMallocMemoryError,
    vmm_not_cuda_malloc_hint,
)

logger = logging.getLogger(__name__)


def _not_cuda_malloc_hint(ptr: int, ordinal: int) -> str:
    """The hint for memory without a legacy IPC handle, naming the VMM handle types it was
    created with when it is cuMemCreate memory (so the user is sent where it can go)."""
    drv = get_driver()
    try:
        alloc = drv.retain_allocation(ptr, ordinal)
    except CudaDriverError:
        return NOT_CUDA_MALLOC_HINT      # not VMM memory either
    try:
        requested = handle_type_names(drv.allocation_handle_types(alloc, ordinal))
    except CudaDriverError:
        return NOT_CUDA_MALLOC_HINT
    finally:
        quietly("releasing a retained allocation handle", drv.release_allocation, alloc, ordinal)
    return vmm_not_cuda_malloc_hint(requested)


class RawCudaIPCWrapper(FlatCudaWrapper):
    """A CUDA tensor shared through a driver IPC handle of its allocation (isolated mode: no
    shared /dev/shm needed; across containers unverified, see the module docstring)."""

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
                _not_cuda_malloc_hint(ptr, ordinal),
            )
        try:
            handle = drv.ipc_get_handle(base, ordinal)
        except CudaDriverError as exc:
            raise NotCudaMallocMemoryError(f"cannot export {where}: {exc}",
                                           _not_cuda_malloc_hint(ptr, ordinal)) from exc
        return cls(dtype=dtype, shape=shape, stride=stride, storage_offset=0, device=uuid,
                   producer=producer_id(), ipc_handle=handle, alloc_offset=ptr - base, alloc_size=size)

    def _validate_extra(self) -> None:
        super()._validate_extra()
        check_bytes(type(self), "ipc_handle", self.ipc_handle, sizes=(IPC_HANDLE_BYTES,))

    def _mapping_key(self) -> Hashable:
        # Scoped to the session, as the VMM key is: a mapping's close waits only for its own
        # session's copy streams (``streams.quiesce(scope=...)``), so a mapping shared with
        # another session could be closed under that session's copies. The driver counts opens
        # of one allocation in one process, so each session's open and close are its own.
        return ("cuda-ipc", self._scope(), self.ipc_handle)

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
        # Scoped to the opening session: the registry admits only the producer's own session to a
        # handle, so that session's copy streams are the ones that can touch this mapping.
        return DeviceMapping(base=base, size=size, ordinal=ordinal, scope=self._scope())

    @staticmethod
    def _close_mapping(mapping: DeviceMapping) -> None:
        if not streams.quiesce(mapping.ordinal, scope=mapping.scope):
            streams.leak_mapping(f"a CUDA IPC mapping at {hexptr(mapping.base)} ({mapping.size} bytes, "
                                 f"cuda:{mapping.ordinal})")
            return
        get_driver().ipc_close(mapping.base, mapping.ordinal)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["handle"] = self.ipc_handle[:8].hex()
        return d

