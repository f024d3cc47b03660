"""Producer-side shared-memory segments: named POSIX shm and memfd, each backing one torch storage.

Guarantees: named segments are created exclusively (O_EXCL), mode 0600, under a name that says
who made it (``shm_names``); memfds are sealed against shrinking and growing, so a consumer's
mapping never loses pages under it (no SIGBUS); space is reserved up front with
``posix_fallocate``, so a ``/dev/shm`` too small fails here with the sizes, not later.

Who unlinks a named segment: this process, once (when the last tensor on it is freed, on
``unlink()``, or at interpreter exit), never a forked child. If the owner is SIGKILLed,
lmshm-server unlinks it when it reclaims the worker's registrations, and the orphan sweep
(``lmshm gc``) removes a name no server knew. The trap: never ``close()`` the mmap while tensors
may use it; the mapping goes when its last Python reference (the storage) goes.
docs/design/cpu-wrappers.md has the rest.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import logging
import mmap
import os
import shutil
import threading
import weakref
from dataclasses import dataclass, field

import torch

# The name format and its parser live in a torch-free module (``lmshm gc`` uses them);
# re-exported here, where segments are made.
from lmshm.platform.shm_names import (  # noqa: F401 (re-exported: segments is where callers look)
    SEGMENT_PREFIX,
    SHM_DIR_ENV,
    SegmentOwner,
    own_pid_namespace,
    parse_segment_name,
    segment_name,
    shm_dir,
    valid_segment_name,
)

logger = logging.getLogger(__name__)

# memfd seals that make the size immutable.
_SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    raise AssertionError


def _reserve(fd: int, size: int, where: str) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            free = ""
            if where.startswith("/"):
                try:
                    free = f"; {where} has {_human(shutil.disk_usage(where).free)} free"
                except OSError:
                    pass
            raise OSError(
                exc.errno,
                f"cannot reserve {_human(size)} of shared memory in {where}{free}. "
                "Enlarge it (for example `docker run --shm-size=...`, or remount /dev/shm), "
                "shrink the KV pool" + (", or make memfd segments (the default, not LMSHM_CPU_SEGMENTS=shm), "
                                        "which the size of /dev/shm does not limit" if where.startswith("/") else ""),
            ) from None
        raise


@dataclass(eq=False)
class Segment:
    """One shared-memory object created by this process. See the module docstring."""

    kind: str  # "shm" or "memfd"
    name: str  # shm name (no slash) or memfd token
    size: int
    owner_pid: int
    fd: int | None = None  # memfd only: kept open so it can be sent to consumers
    unlinked: bool = False
    base_ptr: int = 0
    _mmap_ref: "weakref.ref[mmap.mmap] | None" = field(default=None, repr=False)

    @property
    def path(self) -> str:
        return os.path.join(shm_dir(), self.name)

    def storage_tensor(self) -> torch.Tensor:
        """A uint8 tensor over the whole segment (None if the mapping is gone)."""
        mm = self._mmap_ref() if self._mmap_ref is not None else None
        if mm is None:
            raise RuntimeError(f"segment {self.name} is no longer mapped")
        return torch.frombuffer(mm, dtype=torch.uint8)

    def unlink(self) -> None:
        """Remove the name (shm) or close the exported fd (memfd). Mappings stay valid."""
        _release_name(self)


_lock = threading.Lock()
# base address of the mapping -> Segment, for every live segment this process created.
_live: dict[int, Segment] = {}


def _release_name(seg: Segment) -> None:
    with _lock:
        if seg.unlinked:
            return
        seg.unlinked = True
    if seg.owner_pid != os.getpid():
        return  # a forked child never unlinks its parent's segments
    if seg.kind == "shm":
        try:
            os.unlink(seg.path)
        except FileNotFoundError:
            pass
        except OSError:
            logger.exception("lmshm: unlinking shared memory %s failed", seg.path)
    elif seg.fd is not None:
        fd, seg.fd = seg.fd, None
        try:
            os.close(fd)
        except OSError:
            logger.exception("lmshm: closing memfd of segment %s failed", seg.name)


def _on_unmapped(seg: Segment) -> None:
    """The last reference to the mapping went away: forget the segment, release its name."""
    with _lock:
        if _live.get(seg.base_ptr) is seg:
            del _live[seg.base_ptr]
    _release_name(seg)


def create_segment(size: int, kind: str = "shm") -> tuple[Segment, torch.Tensor]:
    """Create a segment of ``size`` bytes; return it and a uint8 tensor over all of it.

    The returned tensor (and anything built on its storage) keeps the mapping alive.
    """
    if not isinstance(size, int) or size <= 0:
        raise ValueError(f"segment size must be a positive number of bytes, got {size!r}")
    token = segment_name()  # lmshm-<pid>-<pid-ns>-<random>: says who made it
    if kind == "shm":
        path = os.path.join(shm_dir(), token)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        where = shm_dir()
    elif kind == "memfd":
        fd = os.memfd_create(token, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        path, where = None, "memory (memfd)"
    else:
        raise ValueError(f"unknown segment kind {kind!r}; expected 'shm' or 'memfd'")
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        _reserve(fd, size, where)
        if kind == "memfd":
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SIZE_SEALS)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        if path is not None:
            try:
                os.unlink(path)
            except OSError:
                pass
        raise
    if kind == "shm":
        os.close(fd)  # the mapping holds the object; the name lets consumers open it
        fd = None
    u8 = torch.frombuffer(mm, dtype=torch.uint8)
    seg = Segment(kind=kind, name=token, size=size, owner_pid=os.getpid(), fd=fd,
                  base_ptr=u8.data_ptr(), _mmap_ref=weakref.ref(mm))
    weakref.finalize(mm, _on_unmapped, seg).atexit = False
    with _lock:
        _live[seg.base_ptr] = seg
    return seg, u8


def segment_of(tensor: torch.Tensor) -> Segment | None:
    """The live segment that backs ``tensor``'s storage, if this process created one."""
    if tensor.device.type != "cpu":
        return None
    with _lock:
        seg = _live.get(tensor.untyped_storage().data_ptr())
    if seg is None or seg.unlinked or seg.owner_pid != os.getpid():
        # A forked child wraps into a segment of its own: the server accepts only names that
        # carry the registering process's pid, and a child never unlinks its parent's names.
        return None
    if seg.kind == "shm" and not os.path.exists(seg.path):
        # Someone else removed the name -- lmshm-server does, when it cannot tell this worker
        # from a dead one. The memory is still ours, but no consumer can open it any more.
        with _lock:
            seg.unlinked = True
        return None
    return seg


def live_segments() -> list[Segment]:
    with _lock:
        return [s for s in _live.values() if not s.unlinked]


@atexit.register
def _unlink_all_at_exit() -> None:
    for seg in live_segments():
        _release_name(seg)


def reserved_bytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s whole storage (what a migration copies)."""
    return tensor.untyped_storage().nbytes()
