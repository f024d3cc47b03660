"""The pool's memory: one anonymous mapping of ``capacity`` bytes, its huge pages and who faults
its pages in. It knows bytes and pages, nothing of objects or tenants (``store.py``).

The mapping is made once with ``MAP_NORESERVE``: a page costs memory only once it is written.
``huge_pages`` asks for transparent huge pages (one fault per 2 MiB instead of 512).
``populate_ahead`` keeps that many bytes past the allocator's *frontier* (the highest offset it
ever handed out; ``advance`` moves it) populated on a background thread, so that a STORE into
fresh memory finds its pages; ``prefault`` instead faults the whole mapping in once, at the cost
of all of it in memory. docs/design/dataplane.md ("Cold pages") has the figures.

The one trap: the threads hold the mapping's buffer, not the arena, and ``release`` (or a
finalizer, for an arena dropped without it) stops them; the mapping is unmapped only once no
thread and no tensor over it is left.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import weakref
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)   # Linux >= 5.14
#: Bytes pre-faulted per step of the background pre-fault (between steps it checks for shutdown).
PREFAULT_STEP = 64 << 20
#: Bytes populated per step ahead of the frontier: small, so that the thread soon moves past
#: pages that a STORE reached first instead of faulting the same huge pages at once.
POPULATE_STEP = 8 << 20
_HUGE = 2 << 20   # populate steps start on a huge-page boundary of the pool


def _madvise(addr: int, length: int, advice: int) -> int:
    """``madvise``; 0, or the errno."""
    return 0 if _libc.madvise(addr, length, advice) == 0 else ctypes.get_errno()


def parse_size(text: str | int) -> int:
    """``"4GiB"``, ``"512MiB"``, ``"1.5G"``, ``"0"`` or an int -> bytes. Binary units either way."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a size cannot be negative: {text}")
        return text
    s = str(text).strip().lower().replace(" ", "")
    units = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
             "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}
    num = s.rstrip("kmgtib")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in units or value < 0 or value != value:
        raise ValueError(f"not a size: {text!r} (examples: 4GiB, 512MiB, 0)")
    return int(value * units[unit])


class _PopulateAhead:
    """The pool's pages populated (``MADV_POPULATE_WRITE``) up to ``ahead`` bytes past the
    allocator's frontier, on one thread, ``POPULATE_STEP`` at a time; from the frontier on
    when the STOREs got past what it populated (they fault their own pages meanwhile). Nothing
    is populated before the first KV registration (``start``) or reservation: a server that
    never stores costs no memory, and the first STORE after a registration finds its pages.

    ``advance`` runs in ``reserve`` under the pool's lock and only moves the target and wakes
    the thread, so a STORE never waits for it. The thread holds the mapping (``keep``), not the
    pool: a pool dropped without ``release`` stops it from a finalizer, and is unmapped once it
    has ended. Kernels without ``MADV_POPULATE_WRITE`` (before 5.14) answer EINVAL: one info
    log, the thread ends, the STOREs fault their own pages as with ``populate_ahead`` 0."""

    def __init__(self, addr: int, capacity: int, ahead: int, keep: Any) -> None:
        self.addr, self.capacity, self.ahead = addr, capacity, ahead
        self.frontier = 0                     # the highest end of an extent ever handed out
        self.want = 0                         # populate [done, want); nothing before ``start``
        self.done = 0                         # bytes from 0 that are populated, or below the frontier
        self.populated = 0                    # bytes this thread populated itself
        self.error = 0                        # madvise's errno, if it gave up
        self._wake = threading.Event()
        self._wake.set()
        self._stop = False
        self.thread = threading.Thread(target=self._run, args=(keep,), name="lmshm-pool-populate", daemon=True)
        self.thread.start()

    def advance(self, end: int) -> None:
        """An extent up to ``end`` was handed out (under the pool's lock)."""
        if end > self.frontier:
            self.frontier = end
            want = min(self.capacity, end + self.ahead)
            if want > self.want:
                self.want = want
                self._wake.set()

    def start(self) -> None:
        """Stores are coming (a KV cache was registered): populate the window past the frontier."""
        want = min(self.capacity, self.frontier + self.ahead)
        if want > self.want:
            self.want = want
            self._wake.set()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()

    def _run(self, keep: Any) -> None:
        while not self._stop and self.done < self.capacity:
            self._wake.wait()
            self._wake.clear()                # before reading want: a later advance wakes it again
            while not self._stop:
                start = max(self.done, self.frontier // _HUGE * _HUGE)
                end = min(self.want, start + POPULATE_STEP)
                if start >= end:
                    break
                err = _madvise(self.addr + start, end - start, _MADV_POPULATE_WRITE)
                if err in (errno.EINTR, errno.EAGAIN):
                    continue
                if err:
                    self.error = err
                    logger.info("lmshm: the pool's pages are not populated ahead of STOREs (madvise "
                                "MADV_POPULATE_WRITE: %s; Linux >= 5.14 has it): first STOREs into "
                                "fresh pool memory fault their own pages", os.strerror(err))
                    return
                self.populated += end - start
                self.done = end
        del keep


class PoolBytes:
    """The pool as a memoryview, for ``preadv``/``pwritev`` into and out of it."""

    def __init__(self, view: memoryview, addr: int) -> None:
        self.view, self.addr = view, addr

    def at(self, addr: int, n: int) -> memoryview:
        return self.view[addr - self.addr:addr - self.addr + n]


class Arena:
    """The mapping (``tensor`` and ``bytes`` over it, at ``addr``), its huge pages and its
    background faulting; see the module docstring. ``capacity`` 0 maps nothing.

    ``advance`` and ``expect_stores`` only move a target and wake a thread: the pool calls
    them under its lock, and they never wait for a page."""

    def __init__(self, capacity: int, *, huge_pages: bool = True, prefault: bool = False,
                 populate_ahead: int = 0) -> None:
        self.capacity = capacity
        self.addr = 0
        self.huge_pages = False   # the kernel took MADV_HUGEPAGE for the mapping
        self._buf: Any = None
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if capacity:
            addr = _libc.mmap(None, capacity, mmap.PROT_READ | mmap.PROT_WRITE,
                              mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
            if addr is None or addr == ctypes.c_void_p(-1).value:
                err = ctypes.get_errno()
                raise OSError(err, f"cannot reserve a pool of {capacity} bytes: {os.strerror(err)} "
                                   "(lower lmshm-server --capacity)")
            self.addr = addr
            self._buf = (ctypes.c_uint8 * capacity).from_address(addr)
            self._unmap = weakref.finalize(self._buf, _libc.munmap, addr, capacity)
            self.tensor = torch.frombuffer(self._buf, dtype=torch.uint8)
            if huge_pages:
                err = _madvise(addr, capacity, _MADV_HUGEPAGE)
                self.huge_pages = not err
                if err:   # a kernel without THP, or THP off ("never"): 4 KiB pages, nothing else changes
                    logger.info("lmshm: the pool gets no transparent huge pages (madvise: %s)", os.strerror(err))
        self.bytes = PoolBytes(memoryview(self._buf).cast("B") if capacity else memoryview(b""), self.addr)
        self.prefaulted = 0       # bytes the background pre-fault has touched so far
        self._prefault_stop = threading.Event()
        self.prefaulter: Optional[threading.Thread] = None
        if capacity and prefault:
            self.prefaulter = threading.Thread(target=self._prefault, name="lmshm-pool-prefault", daemon=True)
            self.prefaulter.start()
        #: what keeps pages populated past the allocator's frontier (None: off, or ``prefault``)
        self.ahead: Optional[_PopulateAhead] = None
        if capacity and populate_ahead > 0 and not prefault:
            self.ahead = _PopulateAhead(self.addr, capacity, populate_ahead, self._buf)
            weakref.finalize(self, self.ahead.stop)

    def _prefault(self) -> None:
        """Fault every page in once, a step at a time (``MADV_POPULATE_WRITE``: the kernel
        allocates and zeroes pages that are not there yet and leaves the others alone, so
        STOREs may run meanwhile). Stops early at shutdown. Kernels before 5.14 lack it:
        nothing is pre-faulted there (writing to the pages instead could race a STORE)."""
        for at in range(0, self.capacity, PREFAULT_STEP):
            if self._prefault_stop.is_set():
                return
            n = min(PREFAULT_STEP, self.capacity - at)
            err = _madvise(self.addr + at, n, _MADV_POPULATE_WRITE)
            if err:
                logger.warning("lmshm: pre-faulting the pool stopped at %d of %d bytes (madvise: %s)",
                               at, self.capacity, os.strerror(err))
                return
            self.prefaulted = at + n

    def advance(self, end: int) -> None:
        """The allocator handed out bytes up to ``end``: keep the window past it populated."""
        if self.ahead is not None:
            self.ahead.advance(end)

    def expect_stores(self) -> None:
        """STOREs are coming: populate the window past the frontier now (``populate_ahead``)."""
        if self.ahead is not None:
            self.ahead.start()

    @property
    def populated(self) -> int:
        """Bytes from the start that are populated (by ``prefault`` or ``populate_ahead``) or lie
        below the allocator's frontier."""
        return self.ahead.done if self.ahead is not None else self.prefaulted

    def stop(self) -> None:
        """Stop and join the background threads (the first step of ``release``)."""
        self._prefault_stop.set()
        if self.prefaulter is not None:
            self.prefaulter.join()
        if self.ahead is not None:
            self.ahead.stop()
            self.ahead.thread.join()

    def release(self) -> None:
        """Drop this arena's views of the mapping; it is unmapped once the tensors handed out
        are gone. ``stop`` first."""
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self.bytes.view.release()
        self._buf = None
