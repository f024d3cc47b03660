"""Names of lmshm shared-memory segments: the format, the parser, where they live. No torch.

Every segment this package creates (a named POSIX shm object in ``shm_dir()`` or a memfd token)
is named ``lmshm-<pid>-<pid-ns>-<random>``: the creator's pid as seen in its own PID namespace,
the inode of that namespace (``0`` when /proc could not be read), both lowercase hex without
leading zeros, and 16 lowercase hex digits of randomness. ``parse_segment_name`` is the one
exact reader of it; anything else is not a name of ours.

The trap: a pid alone means nothing outside its namespace (a worker in a container that shares
``/dev/shm`` has pids that collide with ours); only the pair says who made a name. This module
imports nothing heavy, so ``lmshm gc`` and the orphan sweep use it without torch.
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass

SEGMENT_PREFIX = "lmshm-"
SHM_DIR_ENV = "LMSHM_SHM_DIR"

# The loose wire-level shape: what a peer may name in a wrapper (no path characters).
_NAME_RE = re.compile(re.escape(SEGMENT_PREFIX) + r"[0-9a-f-]{1,90}")
# The exact format written by segment_name(); pid fits a pid_t, the namespace inode 64 bits.
_EXACT_RE = re.compile(
    re.escape(SEGMENT_PREFIX)
    + r"(?P<pid>[1-9a-f][0-9a-f]{0,7})-(?P<ns>0|[1-9a-f][0-9a-f]{0,15})-(?P<rand>[0-9a-f]{16})"
)
_PID_T_MAX = (1 << 31) - 1

# (pid, namespace inode) of the last process that read it: a process never changes its own
# PID namespace, but a forked child may live in another one (its parent's pid_for_children).
_ns_cache: tuple[int, int] | None = None


def shm_dir() -> str:
    """Where named segments live: /dev/shm unless LMSHM_SHM_DIR says otherwise."""
    return os.environ.get(SHM_DIR_ENV, "/dev/shm")


def valid_segment_name(name: object) -> bool:
    """A name this package could have made: ``lmshm-`` then hex digits and dashes.

    The loose check used on the wire (it also admits names of older versions and test
    tokens); use ``parse_segment_name`` to know who made a name.
    """
    return isinstance(name, str) and _NAME_RE.fullmatch(name) is not None


@dataclass(frozen=True)
class SegmentOwner:
    """Who created a segment: its pid, in the PID namespace whose inode is ``pid_ns``.

    ``pid_ns == 0`` means the creator could not read its namespace; such a name proves no
    namespace and the orphan sweep never removes it.
    """

    pid: int
    pid_ns: int


def parse_segment_name(name: object) -> SegmentOwner | None:
    """The creator recorded in a segment name, or None if ``name`` is not exactly the format.

    Exactly: ``lmshm-<pid>-<pid-ns>-<random>`` as in the module docstring -- lowercase hex
    without leading zeros, ``1 <= pid <= 2**31 - 1``, pid-ns up to 16 hex digits (``0`` for
    unknown), random exactly 16 hex digits, nothing before or after. Names of older versions
    (``lmshm-<pid>-<random>``), uppercase hex, paths and non-strings give None.
    ``parse_segment_name(segment_name())`` is ``SegmentOwner(os.getpid(), own_pid_namespace())``.
    """
    if not isinstance(name, str):
        return None
    m = _EXACT_RE.fullmatch(name)
    if m is None:
        return None
    pid = int(m["pid"], 16)
    if pid > _PID_T_MAX:
        return None
    return SegmentOwner(pid=pid, pid_ns=int(m["ns"], 16))


def own_pid_namespace() -> int:
    """The inode of this process's PID namespace, or 0 if /proc cannot tell. Fork-safe."""
    global _ns_cache
    pid = os.getpid()
    cached = _ns_cache
    if cached is not None and cached[0] == pid:
        return cached[1]
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0  # not cached: /proc may be mounted later
    _ns_cache = (pid, ns)
    return ns


def segment_name() -> str:
    """A fresh name for a segment created by this process (see the module docstring)."""
    return f"{SEGMENT_PREFIX}{os.getpid():x}-{own_pid_namespace():x}-{secrets.token_hex(8)}"


__all__ = [
    "SEGMENT_PREFIX",
    "SHM_DIR_ENV",
    "SegmentOwner",
    "own_pid_namespace",
    "parse_segment_name",
    "segment_name",
    "shm_dir",
    "valid_segment_name",
]
