"""CUDA IPC wrappers.

- ``CudaIPCWrapper`` ("cuda-torch"): PyTorch storage sharing; any stride; needs a shared /dev/shm
  (and, for expandable-segments memory, pidfd_getfd rights on the worker: see torch_ipc.py).
- ``RawCudaIPCWrapper`` ("cuda-raw"): legacy driver IPC handles of cudaMalloc memory; needs no
  shared /dev/shm (``isolated_ipc``); separate containers need a shared PID namespace at least,
  and that is unverified on hardware; also built from a raw pointer (``from_pointer``) for TRT-LLM.
- ``VmmCudaIPCWrapper`` ("cuda-vmm"): cuMemCreate memory created exportable (POSIX fd or fabric:
  PyTorch expandable segments, ``empty_vmm``) as a POSIX fd (over the server's fd channel) or a
  fabric handle (``use_vmm_api``). vLLM sleep mode's memory has no shareable handle type.
- ``streams``: the copy streams a consumer waits for before it unmaps (``quiesce``).

Selection (``device_registry.resolve_kv_wrapper_factory("cuda")``): use_vmm_api -> VMM, else
isolated_ipc -> raw, else torch. Importing this package imports neither cupy nor cuda-python and
does not initialise CUDA: ``driver.py`` is the only module that touches cuda-python, on first call.
See docs/design/cuda-wrappers.md.
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
