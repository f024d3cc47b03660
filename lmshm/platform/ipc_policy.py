"""Process-wide IPC switches and the choice of wrapper class.

Three switches, each settable in code or through the environment:

- ``cpu_segments`` (``LMSHM_CPU_SEGMENTS``, ``memfd`` or ``shm``; default ``memfd``): what a
  new lmshm CPU segment is (``empty_shared``, ``move_to_shared``, a private tensor migrated at
  wrap). A memfd is sealed against shrinking and growing, travels as a file descriptor over the
  server's fd channel (every ``MPClient`` has one), and lmshm-server copies it straight through
  its mapping. ``shm`` makes named POSIX segments in ``/dev/shm`` instead: for consumers that can
  take a name but no fd (the wrapper layer on its own, ``Serialize`` to a file); lmshm-server
  then copies through the segment's file, safely but 1.3-2.2x slower (docs/design/dataplane.md).
- ``isolated_ipc`` (``LMSHM_ISOLATED_IPC``): worker and server share neither ``/dev/shm`` nor
  an IPC namespace (separate containers). CPU memory then always travels as memfd file
  descriptors, whatever ``cpu_segments`` says; CUDA memory as raw driver IPC handles instead
  of PyTorch storage sharing (no /dev/shm needed; across containers they need a shared PID
  namespace at least, and that case is unverified on hardware: see ``cuda/raw_ipc.py``).
- ``use_vmm_api`` (``LMSHM_USE_VMM_API``): CUDA memory was allocated through the VMM API with a
  shareable handle type (cuMemCreate with POSIX_FILE_DESCRIPTOR or FABRIC: PyTorch expandable
  segments, ``lmshm.platform.cuda.empty_vmm``) and must be exported as VMM handles. vLLM sleep
  mode's memory is VMM memory created with no shareable handle type: nothing can export it.

The choice is evaluated at every call and never cached: a process that flips a switch
gets the other wrapper on its next wrap. A value set in code wins over the environment;
``set_...(None)`` returns to the environment.
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
