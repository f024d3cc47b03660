"""CUDA IPC wrappers. PLACEHOLDER until the CUDA issue lands: the classes exist (so that
selection and the unpickler allow-list can name them) but refuse to wrap or map.

Importing this package never imports cupy or cuda-python.
"""

from __future__ import annotations

from lmshm.platform.base.ipc_wrapper import DeviceIPCWrapper


class _UnavailableCudaWrapper(DeviceIPCWrapper):
    device_type = "cuda"

    @classmethod
    def wrap(cls, tensor):  # type: ignore[override]
        raise NotImplementedError(f"{cls.__name__} is not available in this build of lmshm yet")

    def to_tensor(self):  # type: ignore[override]
        raise NotImplementedError(f"{type(self).__name__} is not available in this build of lmshm yet")


class CudaIPCWrapper(_UnavailableCudaWrapper):
    kind = "cuda-torch"


class RawCudaIPCWrapper(_UnavailableCudaWrapper):
    kind = "cuda-raw"


class VmmCudaIPCWrapper(_UnavailableCudaWrapper):
    kind = "cuda-vmm"
