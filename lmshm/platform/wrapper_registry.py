"""The explicit allow-list of wrapper classes a peer's payload may name, and the unpickler.

``safe_loads`` decodes wrapper bytes from another process with an unpickler whose
``find_class`` admits exactly the classes listed in ``ALLOWED_WRAPPER_CLASSES`` below, by
``(module, qualname)``, and nothing else (nothing from ``builtins``, ``os``, ...). The list is
written out by hand on purpose: subclassing ``DeviceIPCWrapper`` does not put a class on it, so
no import anywhere can widen what a peer may make this process instantiate. A new wrapper kind
joins by being added here.

This module sits above ``base``, ``cpu`` and ``cuda``; ``base`` never imports ``cpu`` or ``cuda``.
Importing ``lmshm.platform.cuda`` loads no CUDA library (its driver gateway binds cuda-python on
first call), so the allow-list costs a torch import and nothing more.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from lmshm.platform.base.ipc_wrapper import DeviceIPCWrapper, WrapperDecodeError
from lmshm.platform.cpu.wrappers import CpuFdIPCWrapper, CpuShmIPCWrapper
from lmshm.platform.cuda.raw_ipc import RawCudaIPCWrapper
from lmshm.platform.cuda.torch_ipc import CudaIPCWrapper
from lmshm.platform.cuda.vmm_ipc import VmmCudaIPCWrapper

#: Every concrete wrapper class a peer may send. The restricted unpickler names these and only these.
ALLOWED_WRAPPER_CLASSES: tuple[type[DeviceIPCWrapper], ...] = (
    CpuShmIPCWrapper,
    CpuFdIPCWrapper,
    CudaIPCWrapper,
    RawCudaIPCWrapper,
    VmmCudaIPCWrapper,
)

_BY_NAME: dict[tuple[str, str], type[DeviceIPCWrapper]] = {
    (cls.__module__, cls.__qualname__): cls for cls in ALLOWED_WRAPPER_CLASSES
}


def allowed_wrapper_classes() -> list[str]:
    """Dotted names of the allowed classes, sorted (for error messages)."""
    return sorted(f"{m}.{n}" for m, n in _BY_NAME)


class _WrapperUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        cls = _BY_NAME.get((module, name))
        if cls is None:
            raise WrapperDecodeError(
                f"refusing to unpickle {module}.{name}: wrapper payloads may only name lmshm "
                f"wrapper classes ({', '.join(allowed_wrapper_classes()) or 'none registered'})"
            )
        return cls

    def persistent_load(self, pid: Any) -> Any:
        raise WrapperDecodeError("refusing a pickle with persistent ids")


def safe_loads(data: bytes) -> DeviceIPCWrapper:
    """Unpickle wrapper bytes from a peer: only allowed wrapper classes and plain data."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WrapperDecodeError(f"wrapper payload must be bytes, got {type(data).__name__}")
    try:
        obj = _WrapperUnpickler(io.BytesIO(bytes(data))).load()
    except WrapperDecodeError:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformed pickle is a decode error
        raise WrapperDecodeError(f"malformed wrapper payload: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, DeviceIPCWrapper) or not getattr(obj, "_state_checked", False):
        raise WrapperDecodeError(f"wrapper payload decoded to {type(obj).__name__}, not an lmshm wrapper")
    return obj
