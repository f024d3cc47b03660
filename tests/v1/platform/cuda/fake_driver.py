"""FakeCudaDriver -- a FAKE of lmshm's CUDA driver gateway, for CPU-only tests.

It stands in for ``lmshm.platform.cuda.driver.CudaDriver`` (same method names, same
``calls`` counter keyed by the real CUDA call names) and simulates device memory with host
tensors, so that the *logic around* the driver -- refcounts, unwinding, selection, error
wording -- can be tested without a GPU. It proves nothing about CUDA itself: every behaviour
tested with it is also covered by a GPU test (test_cuda_gpu.py).

Copies (``memcpy_async``, ``memcpy_batch_async``) run at once with ``memmove`` between the
*host* addresses the tests' tensors have (the fake's device memory is host tensors), after the
checks the real calls make: equal non-empty arrays, a stream that is live and not the NULL
stream, no copy whose memory is page-locked only in part (``host_registered``), no two copies
of one batch that overlap (their order within a batch is undefined).

Simulated: cudaMalloc-style allocations with legacy IPC handles; VMM chunks (cuMemCreate)
mapped into reserved ranges, exported as real memfd file descriptors or fabric bytes;
one mapping per (process, allocation) for IPC opens; allocation handle values recycled once
released (as the real driver does); failure injection by call name; streams whose work can be
held unfinished (``hold_stream``), events on them, and the 64-bit stream memory write (it
lands at once; nothing waits on a word on the GPU: the server reads it on its host).
``sequence`` lists every successful call in order.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lmshm.platform.cuda import devices
from lmshm.platform.cuda.driver import HANDLE_TYPE_BITS, CudaDriverError, hexptr

UUIDS = (
    "GPU-00000000-1111-2222-3333-444444444444",
    "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee",
)
GRANULARITY = 64 * 1024


@dataclass
class Physical:
    """A physical allocation: cudaMalloc block or cuMemCreate chunk."""

    size: int
    ordinal: int
    kind: str                     # "malloc" | "vmm"
    handle_bits: int = 0          # requestedHandleTypes (vmm)
    buf: torch.Tensor | None = None
    imported: bool = False        # an importer's handle on another process's chunk

    def __post_init__(self) -> None:
        if self.buf is None:
            self.buf = torch.zeros(self.size, dtype=torch.uint8)


@dataclass
class Range:
    """A virtual address range and what is mapped there."""

    base: int
    size: int
    phys: Physical | None
    origin: str                   # "malloc" | "vmm" | "vmm-import" | "ipc"


class _Owned(np.ndarray):
    """An ndarray view that also keeps an arbitrary owner object alive."""


class FakeCudaDriver:
    name = "fake"

    def __init__(self, uuids: tuple[str, ...] = UUIDS) -> None:
        self.uuids = list(uuids)
        self.calls: Counter[str] = Counter()
        self._lock = threading.RLock()
        self._next_va = 0x7F00_0000_0000
        self._next_handle = 0x1000
        self.ranges: dict[int, Range] = {}          # base -> what is mapped there
        self.reserved: dict[int, int] = {}          # reserved VA ranges: base -> size
        self.handles: dict[int, Physical] = {}      # allocation handle -> physical (live handles)
        self.handle_refs: Counter[int] = Counter()  # cuMemCreate/Retain/Import minus cuMemRelease
        self.ipc: dict[bytes, Physical] = {}        # legacy handle bytes -> physical
        self.ipc_open_refs: dict[int, int] = {}     # ipc-mapped base -> driver refcount
        self.fd_inodes: dict[int, Physical] = {}    # memfd inode -> physical
        self.fabric: dict[bytes, Physical] = {}
        self._fail: dict[str, str] = {}
        self._ctx = threading.local()
        self._free_handles: list[int] = []          # released handle values, reused first
        self.sequence: list[str] = []               # successful calls, in order
        self.stream_mem_ops = True                  # CAN_USE_64_BIT_STREAM_MEM_OPS
        self.granularity_queries: list = []         # the handle type each granularity query named
        self._next_stream = 0x5000
        self.streams: set[int] = set()              # live streams
        self.held: set[int] = set()                 # streams whose queued work never finishes
        self._next_event = 0x9000
        self.events: dict[int, int | None] = {}     # event -> stream it waits on (None: done)
        self.batch_supported = True                 # cuMemcpyBatchAsync exists (a 12.8+ driver)
        self.batches: list[dict] = []               # memcpy_batch_async's arguments, in order
        self.copies: list[tuple[int, int, int]] = []   # memcpy_async's (dst, src, bytes), in order
        self.host_registered: list[tuple[int, int]] = []   # (ptr, bytes) page-locked host ranges
        self.copy_bytes = True                      # False: record the arguments only, copy nothing

    # ---- test controls ---------------------------------------------------------------------
    def fail_next(self, call: str, error: str = "CUDA_ERROR_INVALID_VALUE") -> None:
        """Make the next ``call`` fail with ``error``."""
        self._fail[call] = error

    def _enter(self, call: str, subject: str = "") -> None:
        error = self._fail.pop(call, None)
        if error is not None:
            raise CudaDriverError(call, error, subject)
        self.calls[call] += 1
        self.sequence.append(call)

    def _va(self, size: int) -> int:
        va = self._next_va
        self._next_va += (size + GRANULARITY - 1) // GRANULARITY * GRANULARITY + GRANULARITY
        return va

    def _handle(self, phys: Physical) -> int:
        if self._free_handles:
            h = self._free_handles.pop()
        else:
            h = self._next_handle
            self._next_handle += 1
        self.handles[h] = phys
        self.handle_refs[h] = 1
        return h

    def _find(self, ptr: int) -> Range | None:
        for r in self.ranges.values():
            if r.base <= ptr < r.base + r.size:
                return r
        return None

    def malloc(self, size: int, ordinal: int = 0) -> int:
        """A cudaMalloc-style allocation; returns its base."""
        with self._lock:
            phys = Physical(size, ordinal, "malloc")
            base = self._va(size)
            self.ranges[base] = Range(base, size, phys, "malloc")
            return base

    def live_mappings(self) -> int:
        """Consumer-side mappings still open (IPC opens and VMM imports)."""
        return sum(1 for r in self.ranges.values() if r.origin in ("ipc", "vmm-import"))

    def live_imported_handles(self) -> int:
        return sum(1 for p in self.handles.values() if p.imported)

    def read(self, ptr: int, n: int) -> bytes:
        r = self._find(ptr)
        assert r is not None, f"nothing mapped at {hexptr(ptr)}"
        off = ptr - r.base
        return bytes(r.phys.buf[off:off + n].tolist())

    def write(self, ptr: int, data: bytes) -> None:
        r = self._find(ptr)
        assert r is not None, f"nothing mapped at {hexptr(ptr)}"
        off = ptr - r.base
        r.phys.buf[off:off + len(data)] = torch.tensor(list(data), dtype=torch.uint8)

    # ---- the gateway's interface -----------------------------------------------------------
    def current_context(self) -> int:
        return getattr(self._ctx, "value", 0)

    def address_range(self, ptr: int, ordinal: int) -> tuple[int, int]:
        with self._lock:
            r = self._find(ptr)
            if r is None:
                self._fail.setdefault("cuMemGetAddressRange", "CUDA_ERROR_NOT_FOUND")
            self._enter("cuMemGetAddressRange", f"ptr={hexptr(ptr)}")
            return r.base, r.size

    def is_legacy_ipc_capable(self, ptr: int, ordinal: int) -> bool:
        self._enter("cuPointerGetAttribute", f"ptr={hexptr(ptr)}")
        r = self._find(ptr)
        return r is not None and r.phys.kind == "malloc"

    def is_managed(self, ptr: int, ordinal: int) -> bool:
        self._enter("cuPointerGetAttribute", f"ptr={hexptr(ptr)}")
        r = self._find(ptr)
        return r is not None and r.phys.kind == "managed"

    def malloc_managed(self, size: int, ordinal: int = 0) -> int:
        """A cudaMallocManaged allocation: device-addressable, not IPC-capable."""
        ptr = self.malloc(size, ordinal)
        self._find(ptr).phys.kind = "managed"
        return ptr

    def ipc_get_handle(self, base: int, ordinal: int) -> bytes:
        with self._lock:
            r = self.ranges.get(base)
            if r is None or r.phys is None or r.phys.kind != "malloc":
                self._fail.setdefault("cuIpcGetMemHandle", "CUDA_ERROR_INVALID_VALUE")
            self._enter("cuIpcGetMemHandle", f"ptr={hexptr(base)}")
            handle = (b"FAKEIPC\0" + base.to_bytes(8, "little")).ljust(64, b"\0")
            self.ipc[handle] = r.phys
            return handle

    def ipc_open(self, handle: bytes, ordinal: int) -> int:
        with self._lock:
            phys = self.ipc.get(handle)
            if phys is None:
                self._fail.setdefault("cuIpcOpenMemHandle", "CUDA_ERROR_INVALID_HANDLE")
            self._enter("cuIpcOpenMemHandle", "handle")
            for r in self.ranges.values():      # one mapping per (process, allocation)
                if r.origin == "ipc" and r.phys is phys:
                    self.ipc_open_refs[r.base] += 1
                    return r.base
            base = self._va(phys.size)
            self.ranges[base] = Range(base, phys.size, phys, "ipc")
            self.ipc_open_refs[base] = 1
            return base

    def ipc_close(self, ptr: int, ordinal: int) -> None:
        with self._lock:
            r = self.ranges.get(ptr)
            if r is None or r.origin != "ipc":
                self._fail.setdefault("cuIpcCloseMemHandle", "CUDA_ERROR_INVALID_VALUE")
            self._enter("cuIpcCloseMemHandle", f"ptr={hexptr(ptr)}")
            self.ipc_open_refs[ptr] -= 1
            if self.ipc_open_refs[ptr] == 0:
                del self.ipc_open_refs[ptr]
                del self.ranges[ptr]

    # VMM, producer side
    def create_allocation(self, size: int, ordinal: int, handle_type: str) -> int:
        with self._lock:
            self._enter("cuMemCreate")
            bits = HANDLE_TYPE_BITS[handle_type] if handle_type in HANDLE_TYPE_BITS else 0
            return self._handle(Physical(size, ordinal, "vmm", handle_bits=bits))

    def granularity(self, ordinal: int, handle_type: str | None = None) -> int:
        self._enter("cuMemGetAllocationGranularity")
        self.granularity_queries.append(handle_type)
        return GRANULARITY

    def reserve(self, size: int, ordinal: int) -> int:
        with self._lock:
            self._enter("cuMemAddressReserve", f"size={size}")
            va = self._va(size)
            self.reserved[va] = size
            return va

    def free_address(self, ptr: int, size: int, ordinal: int) -> None:
        with self._lock:
            busy = any(ptr <= r.base < ptr + size for r in self.ranges.values())
            if self.reserved.get(ptr) != size or busy:
                self._fail.setdefault("cuMemAddressFree", "CUDA_ERROR_INVALID_VALUE")
            self._enter("cuMemAddressFree", f"ptr={hexptr(ptr)}")
            del self.reserved[ptr]

    def map(self, ptr: int, size: int, handle: int, ordinal: int) -> None:
        with self._lock:
            phys = self.handles.get(handle)
            inside = any(b <= ptr and ptr + size <= b + s for b, s in self.reserved.items())
            if phys is None or size > phys.size or not inside:
                self._fail.setdefault("cuMemMap", "CUDA_ERROR_INVALID_VALUE")
            self._enter("cuMemMap", f"ptr={hexptr(ptr)}")
            self.ranges[ptr] = Range(ptr, size, phys, "vmm-import" if phys.imported else "vmm")

    def set_access(self, ptr: int, size: int, ordinal: int) -> None:
        self._enter("cuMemSetAccess", f"ptr={hexptr(ptr)}")

    def unmap(self, ptr: int, size: int, ordinal: int) -> None:
        with self._lock:
            r = self.ranges.get(ptr)
            if r is None or r.origin not in ("vmm", "vmm-import"):
                self._fail.setdefault("cuMemUnmap", "CUDA_ERROR_INVALID_VALUE")
            self._enter("cuMemUnmap", f"ptr={hexptr(ptr)}")
            del self.ranges[ptr]

    def retain_allocation(self, ptr: int, ordinal: int) -> int:
        with self._lock:
            r = self._find(ptr)
            if r is None or r.phys.kind != "vmm":
                self._fail.setdefault("cuMemRetainAllocationHandle", "CUDA_ERROR_INVALID_VALUE")
            self._enter("cuMemRetainAllocationHandle", f"ptr={hexptr(ptr)}")
            for h, p in self.handles.items():
                if p is r.phys:
                    self.handle_refs[h] += 1
                    return h
            return self._handle(r.phys)

    def release_allocation(self, handle: int, ordinal: int) -> None:
        with self._lock:
            if handle not in self.handles:
                self._fail.setdefault("cuMemRelease", "CUDA_ERROR_INVALID_VALUE")
            self._enter("cuMemRelease", f"allocation handle=0x{handle:x}")
            self.handle_refs[handle] -= 1
            if self.handle_refs[handle] == 0:
                del self.handle_refs[handle]
                del self.handles[handle]
                self._free_handles.append(handle)

    def allocation_handle_types(self, handle: int, ordinal: int) -> int:
        self._enter("cuMemGetAllocationPropertiesFromHandle")
        return self.handles[handle].handle_bits

    def export_posix_fd(self, handle: int, ordinal: int) -> int:
        with self._lock:
            self._enter("cuMemExportToShareableHandle")
            fd = os.memfd_create("fake-vmm-export", os.MFD_CLOEXEC)
            self.fd_inodes[os.fstat(fd).st_ino] = self.handles[handle]
            return fd

    def export_fabric(self, handle: int, ordinal: int) -> bytes:
        with self._lock:
            self._enter("cuMemExportToShareableHandle")
            data = (b"FAKEFAB\0" + handle.to_bytes(8, "little")).ljust(64, b"\0")
            self.fabric[data] = self.handles[handle]
            return data

    def _import(self, phys: Physical) -> int:
        # Same memory, seen through an importer's handle.
        return self._handle(Physical(phys.size, phys.ordinal, "vmm", phys.handle_bits, phys.buf, imported=True))

    def import_posix_fd(self, fd: int, ordinal: int) -> int:
        with self._lock:
            phys = self.fd_inodes.get(os.fstat(fd).st_ino)
            if phys is None:
                self._fail.setdefault("cuMemImportFromShareableHandle", "CUDA_ERROR_INVALID_VALUE")
            self._enter("cuMemImportFromShareableHandle", f"fd={fd}")
            return self._import(phys)

    def import_fabric(self, data: bytes, ordinal: int) -> int:
        with self._lock:
            phys = self.fabric.get(data)
            if phys is None:
                self._fail.setdefault("cuMemImportFromShareableHandle", "CUDA_ERROR_INVALID_VALUE")
            self._enter("cuMemImportFromShareableHandle", "fabric")
            return self._import(phys)

    def device_uuid(self, ordinal: int) -> str:
        return devices.normalize_uuid(self.uuids[ordinal])

    def local_ordinal(self, uuid: str) -> int:
        return devices.resolve_device_uuid(uuid, self.uuids)

    def as_uint8_tensor(self, ptr: int, nbytes: int, ordinal: int, owner: Any) -> torch.Tensor:
        r = self._find(ptr)
        assert r is not None and ptr + nbytes <= r.base + r.size, f"no mapping covers {hexptr(ptr)}+{nbytes}"
        off = ptr - r.base
        view = r.phys.buf.numpy()[off:off + nbytes].view(_Owned)
        view.owner = owner
        return torch.from_numpy(view)

    def vmm_pool(self, chunk: int, chunks: int, ordinal: int = 0, handle_type: str = "posix-fd") -> int:
        """A producer-side VMM range of ``chunks`` chunks mapped back to back; returns its base."""
        va = self.reserve(chunk * chunks, ordinal)
        for i in range(chunks):
            h = self.create_allocation(chunk, ordinal, handle_type)
            self.map(va + i * chunk, chunk, h, ordinal)
        return va

    # ---- streams, events and stream memory operations ----------------------------------------
    def hold_stream(self, stream: int) -> None:
        """Make the work queued on ``stream`` never finish (until ``finish_stream``): events
        recorded on it stay incomplete, as behind a hung copy."""
        self.held.add(stream)

    def finish_stream(self, stream: int) -> None:
        self.held.discard(stream)

    def can_use_64bit_stream_mem_ops(self, ordinal: int) -> bool:
        return self.stream_mem_ops

    def stream_create(self, ordinal: int) -> int:
        with self._lock:
            self._enter("cuStreamCreate", f"device=cuda:{ordinal}")
            s = self._next_stream
            self._next_stream += 0x10
            self.streams.add(s)
            return s

    def stream_destroy(self, stream: int, ordinal: int) -> None:
        with self._lock:
            if stream not in self.streams:
                self._fail.setdefault("cuStreamDestroy", "CUDA_ERROR_INVALID_HANDLE")
            self._enter("cuStreamDestroy", f"stream=0x{stream:x}")
            self.streams.discard(stream)

    def stream_write_value64(self, stream: int, ptr: int, value: int, ordinal: int) -> None:
        """Writes the 8 little-endian bytes at once (the fake runs no queue)."""
        with self._lock:
            self._enter("cuStreamWriteValue64", f"stream=0x{stream:x}, ptr={hexptr(ptr)}")
            self.write(ptr, (value & (1 << 64) - 1).to_bytes(8, "little"))

    def read_u64(self, ptr: int) -> int:
        return int.from_bytes(self.read(ptr, 8), "little")

    def synchronize(self, ordinal: int) -> None:
        self._enter("cuCtxSynchronize", f"device=cuda:{ordinal}")

    def event_create(self, ordinal: int) -> int:
        with self._lock:
            self._enter("cuEventCreate", f"device=cuda:{ordinal}")
            ev = self._next_event
            self._next_event += 0x10
            self.events[ev] = None
            return ev

    def event_record(self, event: int, stream: int, ordinal: int) -> None:
        with self._lock:
            if event not in self.events or stream not in self.streams:
                self._fail.setdefault("cuEventRecord", "CUDA_ERROR_INVALID_HANDLE")
            self._enter("cuEventRecord", f"event=0x{event:x}, stream=0x{stream:x}")
            self.events[event] = stream if stream in self.held else None

    def event_query(self, event: int, ordinal: int) -> bool:
        with self._lock:
            if event not in self.events:
                self._fail.setdefault("cuEventQuery", "CUDA_ERROR_INVALID_HANDLE")
            self._enter("cuEventQuery", f"event=0x{event:x}")
            stream = self.events[event]
            return stream is None or stream not in self.held

    def event_destroy(self, event: int, ordinal: int) -> None:
        with self._lock:
            if event not in self.events:
                self._fail.setdefault("cuEventDestroy", "CUDA_ERROR_INVALID_HANDLE")
            self._enter("cuEventDestroy", f"event=0x{event:x}")
            del self.events[event]

    # ---- copies ---------------------------------------------------------------------------------
    def _check_copy(self, call: str, dst: int, src: int, n: int, stream: int) -> None:
        if not stream or stream not in self.streams:
            raise CudaDriverError(call, "CUDA_ERROR_INVALID_HANDLE" if stream else "CUDA_ERROR_INVALID_VALUE",
                                  f"stream=0x{stream:x}")
        for ptr in (dst, src):
            for base, size in self.host_registered:
                inside = base <= ptr and ptr + n <= base + size
                if not inside and ptr < base + size and base < ptr + n:
                    raise CudaDriverError(call, "CUDA_ERROR_INVALID_VALUE",
                                          f"{hexptr(ptr)}+{n} is page-locked only in part "
                                          f"(registered {hexptr(base)}+{size})")

    def has_memcpy_batch(self, ordinal: int) -> bool:
        return self.batch_supported

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int, ordinal: int) -> None:
        with self._lock:
            self._check_copy("cuMemcpyAsync", dst, src, nbytes, stream)
            self._enter("cuMemcpyAsync", f"dst={hexptr(dst)}, src={hexptr(src)}")
            self.copies.append((dst, src, nbytes))
            if self.copy_bytes:
                ctypes.memmove(dst, src, nbytes)

    def memcpy_async_each(self, dsts: Any, srcs: Any, sizes: Any, stream: int, ordinal: int) -> None:
        for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            self.memcpy_async(d, s, n, stream, ordinal)

    def memcpy_batch_async(self, dsts: Any, srcs: Any, sizes: Any, stream: int, ordinal: int) -> None:
        """FAKE of ``CudaDriver.memcpy_batch_async``: records its arguments (copies of them), checks
        what cuMemcpyBatchAsync requires, then copies."""
        with self._lock:
            if not self.batch_supported:
                raise CudaDriverError("cuMemcpyBatchAsync", "CUDA_ERROR_NOT_SUPPORTED", f"device=cuda:{ordinal}")
            for a in (dsts, srcs, sizes):
                assert isinstance(a, np.ndarray) and a.dtype == np.uint64 and a.ndim == 1, \
                    "the batch's arrays are 1-D uint64 numpy arrays"
            if not (len(dsts) == len(srcs) == len(sizes)) or len(sizes) == 0:
                raise CudaDriverError("cuMemcpyBatchAsync", "CUDA_ERROR_INVALID_VALUE",
                                      f"{len(dsts)} dsts, {len(srcs)} srcs, {len(sizes)} sizes")
            d, s_, n = (a.astype(np.int64) for a in (dsts, srcs, sizes))
            if (n <= 0).any():
                raise CudaDriverError("cuMemcpyBatchAsync", "CUDA_ERROR_INVALID_VALUE", "a copy of 0 bytes")
            order = np.argsort(d)
            if (d[order][1:] < (d + n)[order][:-1]).any():
                raise CudaDriverError("cuMemcpyBatchAsync", "CUDA_ERROR_INVALID_VALUE",
                                      "two copies of one batch write the same bytes (their order is undefined)")
            for i in range(len(n)):
                self._check_copy("cuMemcpyBatchAsync", int(d[i]), int(s_[i]), int(n[i]), stream)
            self._enter("cuMemcpyBatchAsync", f"{len(n)} copies")
            self.batches.append(dict(dsts=d.copy(), srcs=s_.copy(), sizes=n.copy(), stream=stream, ordinal=ordinal))
            if self.copy_bytes:
                for i in range(len(n)):
                    ctypes.memmove(int(d[i]), int(s_[i]), int(n[i]))
