"""CUDA IPC wrappers: torch storage sharing, raw driver IPC handles, and VMM handles.

- ``CudaIPCWrapper`` ("cuda-torch", the default): any stride; needs a shared /dev/shm.
- ``RawCudaIPCWrapper`` ("cuda-raw", ``isolated_ipc``): cudaMalloc memory without /dev/shm or
  the fd channel; also built from a raw pointer (``from_pointer``) for TRT-LLM.
- ``VmmCudaIPCWrapper`` ("cuda-vmm", ``use_vmm_api``): exportable cuMemCreate memory, as a
  POSIX fd over the fd channel or a fabric handle (``empty_vmm`` allocates such memory).
- ``streams``: the copy streams a consumer waits for before it unmaps.

Selection (``device_registry``): use_vmm_api -> VMM, else isolated_ipc -> raw, else torch.
The trap: importing this package must not initialise CUDA or import cupy or cuda-python;
``driver.py`` is the only module that touches cuda-python, on first call.
docs/design/cuda-wrappers.md has the rest.
"""

from __future__ import annotations

from lmshm.platform.cuda.devices import UnknownDeviceError, resolve_device_uuid
from lmshm.platform.cuda.driver import CudaDriverError
from lmshm.platform.cuda.errors import (
    CudaExportError,
    CudaUnavailableError,
    FdChannelRequiredError,
    NotCudaMallocMemoryError,
    NotVmmMemoryError,
    VmmNotExportableError,
    VmmSpansChunksError,
    fd_channel_required,
)
from lmshm.platform.cuda.raw_ipc import RawCudaIPCWrapper
from lmshm.platform.cuda.torch_ipc import CudaIPCWrapper
from lmshm.platform.cuda.vmm_alloc import empty_vmm
from lmshm.platform.cuda.vmm_ipc import VmmCudaIPCWrapper

__all__ = [
    "CudaDriverError",
    "CudaExportError",
    "CudaIPCWrapper",
    "CudaUnavailableError",
    "FdChannelRequiredError",
    "NotCudaMallocMemoryError",
    "NotVmmMemoryError",
    "RawCudaIPCWrapper",
    "UnknownDeviceError",
    "VmmCudaIPCWrapper",
    "VmmNotExportableError",
    "VmmSpansChunksError",
    "empty_vmm",
    "fd_channel_required",
    "resolve_device_uuid",
]
