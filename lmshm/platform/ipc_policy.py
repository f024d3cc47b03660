"""Process-wide IPC switches and the choice of wrapper class.

Two switches, each settable in code or through the environment:

- ``isolated_ipc`` (``LMSHM_ISOLATED_IPC``): worker and server share neither ``/dev/shm`` nor
  an IPC namespace (separate containers). CPU memory then travels as memfd file
  descriptors; CUDA memory as raw driver IPC handles instead of PyTorch storage sharing.
- ``use_vmm_api`` (``LMSHM_USE_VMM_API``): CUDA memory was allocated through the VMM API
  (PyTorch expandable segments, vLLM sleep mode) and must be exported as VMM handles.

The choice is evaluated at every call and never cached: a process that flips a switch
gets the other wrapper on its next wrap. A value set in code wins over the environment;
``set_...(None)`` returns to the environment.
"""

from __future__ import annotations

import os

ISOLATED_IPC_ENV = "LMSHM_ISOLATED_IPC"
USE_VMM_API_ENV = "LMSHM_USE_VMM_API"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}

_overrides: dict[str, bool | None] = {ISOLATED_IPC_ENV: None, USE_VMM_API_ENV: None}


def _env_flag(name: str) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}={os.environ[name]!r} is not a boolean; use 1/0, true/false, yes/no or on/off")


def _get(name: str) -> bool:
    value = _overrides[name]
    return _env_flag(name) if value is None else value


def _set(name: str, value: bool | None) -> None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"expected True, False or None, got {value!r}")
    _overrides[name] = value


def set_isolated_ipc(value: bool | None) -> None:
    """Turn isolated IPC on or off for this process (None: follow LMSHM_ISOLATED_IPC)."""
    _set(ISOLATED_IPC_ENV, value)


def is_isolated_ipc() -> bool:
    return _get(ISOLATED_IPC_ENV)


def set_use_vmm_api(value: bool | None) -> None:
    """Turn the CUDA VMM wrapper on or off for this process (None: follow LMSHM_USE_VMM_API)."""
    _set(USE_VMM_API_ENV, value)


def is_use_vmm_api() -> bool:
    return _get(USE_VMM_API_ENV)
