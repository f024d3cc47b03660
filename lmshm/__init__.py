"""lmshm: zero-copy KV-cache registration between inference workers and a cache server.

The names a user imports from ``lmshm`` (``MPClient``, ``Server``, ``wrap_kv_caches``,
``empty_shared``, the IPC switches, the errors) are listed in ``_EXPORTS`` with the module that
defines each, and resolved lazily on first use, so that ``import lmshm`` stays cheap and never
imports torch, CUDA libraries, ZeroMQ or the server. These names are the public API: a module
may move, and its entry here moves with it. The trap: code inside lmshm imports a name from the
module that defines it, never through ``lmshm`` (``from lmshm import MPClient``): that is an
import of the top level, an upward edge that ``tests/v1/test_layering.py`` refuses.
"""

from __future__ import annotations

import importlib
from typing import Any

from lmshm._version import __version__

_EXPORTS = {
    "MPClient": "lmshm.transport.client",
    "LmshmError": "lmshm.core.errors",
    "ServerError": "lmshm.core.errors",
    "ServerTimeout": "lmshm.transport.client",
    "wrap_kv_caches": "lmshm.platform.kv_wrap",
    "wrap_one_kv_cache": "lmshm.platform.kv_wrap",
    "DeviceIPCWrapper": "lmshm.platform.base.ipc_wrapper",
    "set_isolated_ipc": "lmshm.platform.ipc_policy",
    "is_isolated_ipc": "lmshm.platform.ipc_policy",
    "set_use_vmm_api": "lmshm.platform.ipc_policy",
    "is_use_vmm_api": "lmshm.platform.ipc_policy",
    "set_cpu_segments": "lmshm.platform.ipc_policy",
    "cpu_segment_kind": "lmshm.platform.ipc_policy",
    "empty_shared": "lmshm.platform.cpu",
    "Server": "lmshm.server",
    "View": "lmshm.core.service",
    "API_VERSION": "lmshm.server",
    "check_api_version": "lmshm.server",
    "ServerConfig": "lmshm.settings",
    "ErrorCode": "lmshm.core.errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lmshm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
