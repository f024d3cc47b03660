"""``openat2(2)`` (Linux 5.6+) through ctypes: open a path below a directory fd in one system call.

The path follows no link on the way (``RESOLVE_NO_SYMLINKS``) and cannot leave the directory
(``RESOLVE_BENEATH``) or its mount (``RESOLVE_NO_XDEV``). The disk tier opens each chunk file
this way below its held directory fd, in one call where checking each step took three (why:
docs/design/tiers.md). Python's ``os`` has no ``openat2``. The trap: ``opener`` is None where
the kernel, the C library or a seccomp filter refuses the call (``ENOSYS``, ``EPERM``); callers
must keep a step-by-step path for that case.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
from typing import Any, Callable, Optional

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
#: every link refused, nothing above the directory fd, nothing on another mount
STRICT = RESOLVE_NO_XDEV | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH

#: openat2's number where it is the generic one (the architectures lmshm runs on)
_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437, "ppc64le": 437, "s390x": 437, "riscv64": 437}


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


@functools.lru_cache(maxsize=1)
def _syscall() -> Optional[tuple[Any, int]]:
    """``(libc's syscall, openat2's number)`` if the kernel opens ``.`` below ``/`` with it
    (tried once per process), else None: ENOSYS, EPERM (seccomp), another architecture."""
    number = _SYS_OPENAT2.get(platform.machine())
    if not sys.platform.startswith("linux") or number is None:
        return None
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    syscall.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
    probe = _OpenHow(os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, 0, STRICT)
    root = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = syscall(number, root, b".", ctypes.addressof(probe), ctypes.sizeof(probe))
        if fd < 0:
            return None
        os.close(fd)
    finally:
        os.close(root)
    return syscall, number


def opener(flags: int, resolve: int = STRICT) -> Optional[Callable[[int, str], int]]:
    """``open_below(dir_fd, path) -> fd`` (``flags``, ``resolve``; ``OSError`` with the errno
    the kernel gave), or None where ``openat2`` is not available (``_syscall``)."""
    found = _syscall()
    if found is None:
        return None
    syscall, number = found
    how = _OpenHow(flags | os.O_CLOEXEC, 0, resolve)
    address, size = ctypes.addressof(how), ctypes.sizeof(how)

    def open_below(dir_fd: int, path: str) -> int:
        fd = syscall(number, dir_fd, path.encode(), address, size)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
        return fd
    open_below.how = how            # type: ignore[attr-defined]  # kept alive with the function
    return open_below
