"""Process-wide IPC switches: what CPU segments are, whether worker and server are isolated, VMM.

- ``cpu_segments`` (``LMSHM_CPU_SEGMENTS``: ``memfd``, the default, or ``shm``): what a new
  lmshm CPU segment is. A memfd is sealed and travels over the fd channel, so lmshm-server
  copies through its mapping; named shm is for consumers that take a name but no fd, and the
  server copies it through its file, safely but slower (docs/design/dataplane.md).
- ``isolated_ipc`` (``LMSHM_ISOLATED_IPC``): worker and server share neither ``/dev/shm`` nor an
  IPC namespace: CPU memory travels as memfds, CUDA memory as raw driver IPC handles.
- ``use_vmm_api`` (``LMSHM_USE_VMM_API``): CUDA memory is exportable VMM memory (cuMemCreate with
  a shareable handle type) and is exported as VMM handles.

A value set in code wins over the environment; ``set_...(None)`` returns to the environment.
The trap: the choice is read at every call and never cached, so a process that flips a switch
gets the other wrapper on its next wrap, and wrappers made before keep their kind.
"""

from __future__ import annotations

import os

ISOLATED_IPC_ENV = "LMSHM_ISOLATED_IPC"
USE_VMM_API_ENV = "LMSHM_USE_VMM_API"
CPU_SEGMENTS_ENV = "LMSHM_CPU_SEGMENTS"
#: The kinds of CPU segment, and the default.
CPU_SEGMENT_KINDS = ("memfd", "shm")
DEFAULT_CPU_SEGMENTS = "memfd"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}

_overrides: dict[str, bool | None] = {ISOLATED_IPC_ENV: None, USE_VMM_API_ENV: None}
_cpu_segments: str | None = None


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


def set_cpu_segments(kind: str | None) -> None:
    """Make new CPU segments ``"memfd"`` (sealed, copied through its mapping by lmshm-server) or
    ``"shm"`` (named, for consumers without the fd channel); None: follow LMSHM_CPU_SEGMENTS."""
    global _cpu_segments
    if kind is not None and kind not in CPU_SEGMENT_KINDS:
        raise ValueError(f"CPU segments are 'memfd' or 'shm', got {kind!r}")
    _cpu_segments = kind


def cpu_segment_kind() -> str:
    """The kind of CPU segment to make now: ``"memfd"`` in isolated mode, else the
    ``cpu_segments`` switch (default ``"memfd"``)."""
    if is_isolated_ipc():
        return "memfd"
    if _cpu_segments is not None:
        return _cpu_segments
    raw = os.environ.get(CPU_SEGMENTS_ENV, "").strip().lower() or DEFAULT_CPU_SEGMENTS
    if raw not in CPU_SEGMENT_KINDS:
        raise ValueError(f"{CPU_SEGMENTS_ENV}={os.environ[CPU_SEGMENTS_ENV]!r} is not a CPU segment kind; "
                         "use memfd (the default: sealed, passed over the fd channel) or shm (named POSIX "
                         "shared memory, for consumers without the fd channel)")
    return raw
