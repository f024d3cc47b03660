"""CPU IPC wrappers: sealed memfds (``CpuFdIPCWrapper``, the default) and named POSIX shm.

The wire carries the segment's name, or a token for its fd (which travels over a Unix socket),
the storage's byte offset in the segment, and the caller's exact view. The consumer maps the
object once per process (``MAPPINGS``), checks that the view fits inside it, and rebuilds the
view over the mapping; the mapping lives until the last tensor built on it is gone.

Producer side: a tensor already in an lmshm segment of the right kind wraps without a copy; a
private tensor is *migrated*: its storage is copied once into a new segment and the caller's
tensor is re-pointed there (``tensor.set_``). The trap: other views of the old storage that
were not passed in keep pointing at the private memory, so writes through them are not shared.
Allocate pools with ``empty_shared()`` to avoid the migration and its copy.
docs/design/cpu-wrappers.md has the rest.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import errno
import fcntl
import mmap
import os
import stat
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator

import torch

from lmshm.platform.base.fds import FD_INBOX
from lmshm.platform.base.files import file_id, unlink_if_same
from lmshm.platform.base.ipc_wrapper import (
    DeviceIPCWrapper,
    WrapperDecodeError,
    dtype_name,
)
from lmshm.platform.base.mappings import MAPPINGS
from lmshm.platform.base.peer import Peer
from lmshm.platform.contiguity import is_dense, require_dense
from lmshm.platform.cpu import segments
from lmshm.platform.cpu.segments import Segment
from lmshm.quoting import quote

# Within one batch: data_ptr of a migrated private storage -> (old storage, new segment,
# uint8 tensor over it). Holding the old storage keeps its address from being reused.
_migrations: contextvars.ContextVar[dict[int, tuple[Any, Segment, torch.Tensor]] | None] = (
    contextvars.ContextVar("lmshm_cpu_migrations", default=None)
)
# Segments created by the current batch, so that a rollback can release their names.
_created: contextvars.ContextVar[list[Segment] | None] = contextvars.ContextVar(
    "lmshm_cpu_created", default=None
)


@contextlib.contextmanager
def migration_scope() -> Iterator[list[Segment]]:
    """Share migrations across several ``wrap()`` calls; yields the segments created."""
    created: list[Segment] = []
    t1 = _migrations.set({})
    t2 = _created.set(created)
    try:
        yield created
    finally:
        _migrations.reset(t1)
        _created.reset(t2)


def _repoint(tensor: torch.Tensor, u8: torch.Tensor) -> None:
    with torch.no_grad():
        tensor.set_(u8.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())


def _place_in_segment(tensor: torch.Tensor, kind: str) -> Segment:
    """Make sure ``tensor`` lives in a live segment of ``kind``; migrate it if not."""
    seg = segments.segment_of(tensor)
    if seg is not None and seg.kind == kind:
        return seg
    storage = tensor.untyped_storage()
    scope = _migrations.get()
    key = storage.data_ptr()
    if scope is not None and key in scope and scope[key][1].kind == kind and not scope[key][1].unlinked:
        _, seg, u8 = scope[key]
        _repoint(tensor, u8)
        return seg
    seg, u8 = segments.create_segment(storage.nbytes(), kind)
    created = _created.get()
    if created is not None:
        created.append(seg)
    u8.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
    if scope is not None:
        scope[key] = (storage, seg, u8)
    _repoint(tensor, u8)
    return seg


class CpuSegmentWrapper(DeviceIPCWrapper):
    """Shared logic of the two CPU kinds. Not registered itself (it has no ``kind``)."""

    device_type = "cpu"
    groupable = True  # to_tensor() builds on a storage that spans the whole segment
    segment_kind: ClassVar[str] = ""
    extra_fields = ("segment", "segment_bytes", "byte_offset")

    # ---- producer --------------------------------------------------------------------------
    @classmethod
    def wrap(cls, tensor: torch.Tensor, name: str = "tensor") -> "CpuSegmentWrapper":
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise ValueError(f"{name}: {cls.__name__} wraps CPU tensors, got one on {tensor.device}")
        dt = dtype_name(tensor.dtype)
        require_dense(tensor, name)
        seg = _place_in_segment(tensor, cls.segment_kind)
        wrapper = cls(dtype=dt, shape=tuple(tensor.shape), stride=tuple(tensor.stride()),
                      storage_offset=tensor.storage_offset(), device="cpu",
                      segment=seg.name, segment_bytes=seg.size, byte_offset=0)
        # Keep the segment mapped for as long as the producer wrapper is open.
        wrapper._producer = (seg, tensor.untyped_storage())
        return wrapper

    def sibling_for(self, tensor: torch.Tensor, storage_ptr: int) -> "CpuSegmentWrapper":
        """A wrapper for ``tensor``, a view with this wrapper's dtype, shape and stride over
        the storage (at ``storage_ptr``) this wrapper's tensor had when it was wrapped (see
        ``wrap_kv_caches``)."""
        seg = self.__dict__["_producer"][0]
        if storage_ptr != seg.base_ptr:
            _place_in_segment(tensor, self.segment_kind)  # the group migrated: follow it
        return self.sibling(tensor.storage_offset())

    def _close_extra(self) -> None:
        self.__dict__.pop("_producer", None)

    # ---- wire checks -----------------------------------------------------------------------
    def _validate_extra(self) -> None:
        if not segments.valid_segment_name(self.segment):
            raise WrapperDecodeError(f"{type(self).__name__}: invalid segment name {self.segment!r}")
        for f in ("segment_bytes", "byte_offset"):
            v = getattr(self, f)
            if type(v) is not int or v < 0 or v >= 1 << 62:
                raise WrapperDecodeError(f"{type(self).__name__}: {f} must be a non-negative int, got {v!r}")
        if not is_dense(self.shape, self.stride):
            raise WrapperDecodeError(
                f"{type(self).__name__}: shape={self.shape}, stride={self.stride} is not a dense layout "
                "(producers wrap only dense views; an overlapping or gapped view is refused)")
        if self.byte_offset % self.torch_dtype.itemsize:
            raise WrapperDecodeError(
                f"{type(self).__name__}: byte_offset {self.byte_offset} is not aligned to {self.dtype}"
            )

    def _required_bytes(self) -> int:
        """Bytes of the object the view needs: offset of its last element, plus one."""
        item = self.torch_dtype.itemsize
        if self.numel == 0:
            return self.byte_offset
        return self.byte_offset + self.storage_offset * item + self.span_bytes

    # ---- consumer --------------------------------------------------------------------------
    def _open_fd(self) -> int:
        """An fd for the object; the caller closes it once the object is mapped."""
        raise NotImplementedError

    def _map(self) -> "_Mapping":
        fd = self._open_fd()
        try:
            self._check_fd(fd)   # before the size is read: a memfd's seals say whether it may shrink
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"segment {self.segment!r} is not a shared-memory file")
            peer = self._peer
            if peer is not None and st.st_uid != peer.uid:
                raise PermissionError(
                    f"segment {self.segment!r} belongs to uid {st.st_uid}, not to this worker's uid "
                    f"{peer.uid}: a worker may register only memory it owns")
            if st.st_size != self.segment_bytes:
                raise ValueError(
                    f"segment {self.segment!r} has {st.st_size} bytes, the wrapper says "
                    f"{self.segment_bytes}: it was replaced or truncated"
                )
            _check_allocated(self.segment, st)
            self._check_object(fd, st)
            buf, start = _map_shared(fd, st.st_size, self.segment)
        finally:
            os.close(fd)
        return _Mapping(buf, start, st.st_size, file_id(st))

    def _check_fd(self, fd: int) -> None:
        """Kind-specific checks on the opened object, before its size is read."""

    def _check_object(self, fd: int, st: os.stat_result) -> None:
        """Kind-specific checks on the opened object, once its size is known."""

    def _mapping_key(self) -> tuple:
        return (self.kind, self._scope(), self.segment)

    def to_tensor(self) -> torch.Tensor:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} for {self.segment!r} is closed")
        need = self._required_bytes()
        if need > self.segment_bytes:
            raise ValueError(
                f"view does not fit its segment {self.segment!r}: needs bytes up to {need} "
                f"(byte_offset={self.byte_offset}, storage_offset={self.storage_offset}, "
                f"shape={self.shape}, stride={self.stride}, dtype={self.dtype}) but the "
                f"segment has {self.segment_bytes}"
            )
        if self._lease is None:
            self._lease = MAPPINGS.acquire(self._mapping_key(), self._map, _drop_mapping)
        mapping: _Mapping = self._lease.value
        self._inode = mapping.inode
        u8 = torch.frombuffer(mapping.buf, dtype=torch.uint8)
        item = self.torch_dtype.itemsize
        out = torch.empty(0, dtype=self.torch_dtype)
        out.set_(u8.untyped_storage(), self.byte_offset // item + self.storage_offset,
                 self.shape, self.stride)
        return out

    def verify_mapped(self) -> None:
        lease = self._lease
        if lease is None or lease.released:
            raise RuntimeError(f"segment {self.segment!r} is not mapped")
        mapping: _Mapping = lease.value
        try:
            st = os.stat(mapping.map_file())
        except OSError as exc:
            raise OSError(exc.errno, f"cannot check segment {self.segment!r} before reading it: "
                                     f"{exc.strerror}") from None
        if st.st_size < mapping.size:
            raise OSError(errno.EIO, f"segment {self.segment!r} was truncated after it was registered "
                                     f"({st.st_size} of {mapping.size} bytes left); refusing to touch it")
        _check_allocated(self.segment, st, after_register=True)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["segment"] = self.segment
        return d


@dataclass(frozen=True)
class _Mapping:
    """A consumer-side mapping of one segment: its bytes, where they lie, which inode they are."""

    buf: Any                 # a ctypes array over the mapping; unmapped when the last user lets go
    start: int
    size: int
    inode: tuple[int, int]

    def map_file(self) -> str:
        """This mapping's entry in /proc/self/map_files: stat() it to see the object's size now,
        without holding an fd (the entry names the file even after it is unlinked)."""
        end = self.start + (-(-self.size // mmap.PAGESIZE)) * mmap.PAGESIZE
        return f"/proc/self/map_files/{self.start:x}-{end:x}"


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _map_shared(fd: int, size: int, name: str, offset: int = 0) -> tuple[Any, int]:
    """Map ``size`` bytes of ``fd`` from ``offset`` (a multiple of the page size) shared and
    read-write; return (buffer, address).

    Not ``mmap.mmap``: Python's mmap keeps a dup of the fd for its whole life, so a server
    mapping 1,000 segments would hold 1,000 fds. This mapping holds none. The buffer unmaps
    itself (``munmap``) when its last reference -- every tensor built on it -- is gone.
    """
    if size <= 0:
        raise ValueError(f"segment {name!r} is empty; there is nothing to map")
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, offset)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot map {name!r} ({size} bytes at offset {offset}): {os.strerror(err)}")
    buf = (ctypes.c_uint8 * size).from_address(addr)
    weakref.finalize(buf, _libc.munmap, addr, size)
    return buf, addr


def _check_allocated(name: str, st: os.stat_result, *, after_register: bool = False) -> None:
    """Refuse an object with holes: touching a hole of a full tmpfs raises SIGBUS."""
    if st.st_blocks * 512 < st.st_size:
        when = ("has holes now (pages were punched out after it was registered)" if after_register
                else "is sparse (its pages are not allocated)")
        raise OSError(
            errno.EIO,
            f"segment {name!r} {when}: {st.st_blocks * 512} of {st.st_size} bytes are backed by memory. "
            "Reading a hole of a full /dev/shm would crash the reader, so lmshm maps only fully "
            "allocated segments (lmshm.empty_shared reserves every page with posix_fallocate)")


#: Seals a memfd must carry before lmshm maps it: it can never shrink, so every mapped byte stays
#: inside the file. (F_SEAL_GROW is not needed: growing moves no page under a mapping.)
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK
#: ``statfs.f_type`` of shmem/tmpfs: memfds of the kernel's internal mount, and /dev/shm.
TMPFS_MAGIC = 0x01021994
_libc.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]


def _fs_type(fd: int) -> int:
    buf = ctypes.create_string_buffer(256)    # struct statfs: f_type (a long) comes first
    if _libc.fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fstatfs: {os.strerror(err)}")
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def sealed_shmem(fd: int, what: str) -> int:
    """Check that ``fd`` is a shmem memfd sealed against shrinking; return its seals, or raise
    ``PermissionError`` saying why it may not be mapped.

    Why each check: without F_SEAL_SHRINK its owner may truncate the file under the mapping,
    and touching a page past the new end raises SIGBUS. A hugetlbfs memfd (MFD_HUGETLB) takes
    seals too, but a hole punched in it refaults only while free huge pages remain, else
    SIGBUS; a shmem page always refaults (as zeros), so only shmem is accepted. Seals are
    never removed once set, so a check made before the size is read holds for good."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise PermissionError(f"{what} is not a memfd (it takes no seals); lmshm maps only memfds "
                              "sealed against shrinking, whose pages cannot vanish under the mapping") from None
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise PermissionError(f"{what} is not sealed against shrinking (seals {seals:#x}); refusing to map "
                              "memory its owner could truncate under us. lmshm.empty_shared seals its memfds "
                              "(F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)")
    fs = _fs_type(fd)
    if fs != TMPFS_MAGIC:
        raise PermissionError(f"{what} is not on shmem (filesystem magic {fs:#x}; a MFD_HUGETLB memfd?): a hole "
                              "punched in huge-page memory can fault SIGBUS, so lmshm maps only shmem memfds")
    return seals


def _drop_mapping(mapping: _Mapping) -> None:
    # Never munmap here: tensors built on the mapping hold its buffer and keep it mapped;
    # the buffer's finaliser unmaps it when the last of them is freed.
    del mapping


class CpuShmIPCWrapper(CpuSegmentWrapper):
    """A CPU tensor in a named POSIX shared-memory segment (``LMSHM_CPU_SEGMENTS=shm``), for
    consumers that can open a name but receive no fd."""

    kind = "cpu-shm"
    segment_kind = "shm"

    def _admit_extra(self, peer: Peer) -> None:
        owner = segments.parse_segment_name(self.segment)
        if owner is None:
            raise PermissionError(f"segment name {quote(self.segment)} is not one lmshm makes "
                                  "(lmshm-<pid>-<pid namespace>-<random>)")
        if not peer.ns_pid or not peer.pid_ns:
            raise PermissionError(
                f"segment {self.segment!r}: the server cannot see this worker's pid ({peer.describe()}: "
                "another PID namespace), so it cannot check that the worker made the segment. Share the "
                "PID namespace with the server (docker --pid=container:...), or register memfd segments "
                "(the default, not LMSHM_CPU_SEGMENTS=shm: fds instead of names)")
        if (owner.pid, owner.pid_ns) != (peer.ns_pid, peer.pid_ns):
            raise PermissionError(
                f"segment {self.segment!r} was made by pid {owner.pid}, not by this worker ({peer.describe()}); "
                "a worker may register only segments it created")

    def _check_object(self, fd: int, st: os.stat_result) -> None:
        if st.st_nlink != 1:
            raise PermissionError(f"segment {self.segment!r} has {st.st_nlink} links; lmshm segments have "
                                  "exactly one name (a hard link could stand for another segment)")

    def _open_fd(self) -> int:
        path = os.path.join(segments.shm_dir(), self.segment)
        try:
            return os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"shared-memory segment {path} does not exist: the producer released it, or "
                "runs in another IPC namespace / container without a shared /dev/shm (there, let it "
                "make memfd segments, the default, not LMSHM_CPU_SEGMENTS=shm; or use isolated mode, "
                "LMSHM_ISOLATED_IPC=1)"
            ) from None

    def mapping_cannot_fault(self) -> bool:
        """A named segment's owner may truncate it or punch holes in it at any time (nothing
        can seal a name), so the data plane copies through its file (``backing_file``)."""
        return False

    def backing_file(self) -> tuple[str, tuple[int, int], int] | None:
        """Consumer side, once mapped: ``(path, (st_dev, st_ino), address of the mapping)``, so the
        data plane can copy through the file (``preadv``/``pwritev``) instead of the mapping."""
        lease = self._lease
        if lease is None or lease.released:
            return None
        mapping: _Mapping = lease.value
        return os.path.join(segments.shm_dir(), self.segment), mapping.inode, mapping.start

    def release_orphaned(self) -> None:
        """The producer died without unlinking: remove the name so /dev/shm does not fill up --
        only if the name still stands for the very object this wrapper mapped."""
        inode = self.__dict__.get("_inode")
        if inode is None:
            return  # never mapped here: not ours to remove
        unlink_if_same(os.path.join(segments.shm_dir(), self.segment), inode)


class CpuFdIPCWrapper(CpuSegmentWrapper):
    """A CPU tensor in a sealed memfd; the fd travels out of band (the default CPU kind).

    The consumer maps only a memfd on the kernel's internal shmem mount that is sealed against
    shrinking (``sealed_shmem``), checked before it reads the size: such a file keeps every
    byte it has, so no access through the mapping can raise SIGBUS, whatever its owner does
    later (a punched hole reads back as zeros). That is what lets lmshm-server copy it with
    ``memmove`` (``mapping_cannot_fault``).

    The wire carries ``segment`` as a token. The producer's ``export_fds()`` gives
    ``{token: fd}`` to send with SCM_RIGHTS; the consumer files the received fd in
    ``FD_INBOX`` under that token before calling ``to_tensor()``.
    """

    kind = "cpu-memfd"
    segment_kind = "memfd"
    fd_channel_hint = (
        "CPU memory travels as sealed memfd file descriptors over the server's fd side channel "
        "(the default; always in isolated mode): start lmshm-server with --fd-socket on a path "
        "the worker can reach (pass it as fd_socket=PATH or LMSHM_FD_SOCKET if the worker sees "
        "it elsewhere). Consumers that cannot receive fds need named segments: "
        "LMSHM_CPU_SEGMENTS=shm, or empty_shared(..., kind='shm'), where worker and consumer "
        "share /dev/shm"
    )

    def mapping_cannot_fault(self) -> bool:
        """Consumer side: True once mapped (``_map`` verified the seals and the filesystem)."""
        lease = self._lease
        return lease is not None and not lease.released

    def export_fds(self) -> dict[str, int]:
        producer = self.__dict__.get("_producer")
        if producer is None or producer[0].fd is None:
            raise RuntimeError(
                f"{type(self).__name__} {self.segment!r}: no fd to export (only the producer "
                "that wrapped the tensor can export it, while the wrapper is open)"
            )
        return {self.segment: producer[0].fd}

    def fd_tokens(self) -> tuple[str, ...]:
        return (self.segment,)

    def _open_fd(self) -> int:
        return FD_INBOX.take(self.segment, self._scope())

    def _check_fd(self, fd: int) -> None:
        sealed_shmem(fd, f"memfd {self.segment!r}")


__all__ = ["CpuFdIPCWrapper", "CpuSegmentWrapper", "CpuShmIPCWrapper", "migration_scope"]


#: The mapper regions use (lmshm.core.regions): no fd kept, unmapped with its last tensor.
map_shared = _map_shared
