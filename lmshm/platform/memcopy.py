"""Streaming stores for the server's block copies: glibc's non-temporal threshold, set at exec.

A ``memmove`` writes its destination either through the caches, which first reads every
destination cache line (a read-for-ownership: three bytes cross the memory bus per byte copied),
or with non-temporal stores, which skip that read (two). glibc on x86-64 streams only copies
larger than ``x86_non_temporal_threshold``, by default three quarters of the shared cache per
thread: 114 MiB on the machine of docs/benchmarks.md. A 256 MiB ``memcpy`` streams; the data
plane's copies are one block of one layer each (16 KiB to a few MiB) and did not, so they ran
at 0.5-0.7 of a memcpy of the same bytes, whatever else was done.

The threshold is read once, from ``GLIBC_TUNABLES``, when a process starts. So ``lmshm-server``
runs ``reexec_with_streaming_copies()`` first thing: unless the environment already names the
tunable (the operator's value wins) or ``LMSHM_STREAMING_COPIES=0``, it adds
``x86_non_temporal_threshold=STREAMING_THRESHOLD`` and executes the same command line again
(same pid, same open files), before anything heavy is imported. Only glibc on x86-64 has the
tunable; elsewhere nothing happens. Copies of at least ``STREAMING_THRESHOLD`` bytes then
stream: the pool is read by nobody until a RETRIEVE, and a worker reads its KV cache from memory
anyway after another process wrote it. An application that embeds ``lmshm.Server`` sets the
tunable in its own environment, or not (docs/design/dataplane.md).
"""

from __future__ import annotations

import os
import sys

#: Copies of at least this many bytes use non-temporal stores (glibc's minimum is 0x4040).
STREAMING_THRESHOLD = 0x10000
TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
ENV = "LMSHM_STREAMING_COPIES"
_OFF = {"0", "false", "no", "off"}


def tunables_with_streaming(current: str) -> str | None:
    """``GLIBC_TUNABLES`` with the threshold added, or None when it already names one."""
    entries = [e for e in current.split(":") if e]
    if any(e.split("=", 1)[0] == TUNABLE for e in entries):
        return None
    return ":".join(entries + [f"{TUNABLE}={STREAMING_THRESHOLD:#x}"])


def _has_tunable() -> bool:
    if sys.platform != "linux" or os.uname().machine not in ("x86_64", "amd64"):
        return False
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc ")
    except (ValueError, OSError):   # not glibc (musl has no such name)
        return False


def streaming_state() -> str:
    """What this process does, in words, for the server's log."""
    if not _has_tunable():
        return "glibc's x86-64 streaming-store tunable is not available here"
    for entry in os.environ.get("GLIBC_TUNABLES", "").split(":"):
        name, _, value = entry.partition("=")
        if name == TUNABLE:
            return f"copies of at least {value} bytes use non-temporal stores (GLIBC_TUNABLES)"
    return "copies use glibc's default non-temporal threshold"


def reexec_with_streaming_copies() -> None:
    """Execute this process's command line again with the streaming threshold set, if that
    applies (see the module docstring); return when it does not or the exec fails."""
    if os.environ.get(ENV, "").strip().lower() in _OFF or not _has_tunable():
        return
    tunables = tunables_with_streaming(os.environ.get("GLIBC_TUNABLES", ""))
    argv = getattr(sys, "orig_argv", None)
    if tunables is None or not argv or not sys.executable:
        return
    env = {**os.environ, "GLIBC_TUNABLES": tunables}
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, env)
    except OSError:
        return  # keep running with glibc's default threshold
