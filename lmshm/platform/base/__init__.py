"""The wrapper contract and the process-wide machinery every wrapper kind shares.

Names are resolved lazily, so that importing a torch-free submodule (``base.fds``, which the
fd channel of ``lmshm status`` and of the client uses) does not import torch through
``ipc_wrapper``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DeviceIPCWrapper": "lmshm.platform.base.ipc_wrapper",
    "dtype_from_name": "lmshm.platform.base.ipc_wrapper",
    "dtype_name": "lmshm.platform.base.ipc_wrapper",
    "MAPPINGS": "lmshm.platform.base.mappings",
    "Lease": "lmshm.platform.base.mappings",
    "MappingTable": "lmshm.platform.base.mappings",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lmshm.platform.base' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
