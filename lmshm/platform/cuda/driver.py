"""The one gateway to the CUDA driver: the only module that imports cuda-python.

Every driver call goes through ``CudaDriver._call``, which raises ``CudaDriverError`` carrying
the call's name, the CUDA error name and text, and the pointer, handle or device involved;
wrappers call the small methods here and never see a raw ``(CUresult, ...)`` tuple. cuda-python
is imported on the first call, never at module import (``cuda.bindings``, else ``cuda.cuda``).
A thread with no current context gets the device's primary context (the one torch and CuPy use)
bound first; a thread in any other context gets it pushed for the call and popped after. The
trap that makes this necessary: a call without the right context fails as if the pointer were
bad, or maps into a context that may be destroyed under the mapping.

The object is process-wide and swappable (``install_driver``): CPU tests install the fake in
``tests/v1/platform/cuda/fake_driver.py``. It is one file over 600 lines on purpose: the single
gateway is the point (every call and its check in one place), and its parts share the bindings.
docs/design/cuda-wrappers.md ("The driver gateway") has the rest.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import threading
from collections import Counter
from typing import Any, Callable, Iterator

import numpy as np

from lmshm.platform.cuda.errors import CudaUnavailableError

logger = logging.getLogger(__name__)

IPC_HANDLE_BYTES = 64      # sizeof(CUipcMemHandle) == sizeof(cudaIpcMemHandle_t)
FABRIC_HANDLE_BYTES = 64   # sizeof(CUmemFabricHandle)
_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1

# CUmemAllocationHandleType bits, by the names lmshm uses on the wire and in messages.
HANDLE_TYPE_BITS = {"posix-fd": 0x1, "fabric": 0x8}
_HANDLE_BIT_NAMES = {0x1: "POSIX_FILE_DESCRIPTOR", 0x2: "WIN32", 0x4: "WIN32_KMT", 0x8: "FABRIC"}
#: cuMemcpyBatchAsync's ABI lmshm calls: CUDA 12.8's, with ``failIdx`` (CUDA 13.0 drivers still
#: serve it by version; its own ``_v2`` dropped that argument).
_BATCH_ABI_VERSION = 12080
_NO_FAIL = (1 << 64) - 1       # what failIdx holds when no single copy is to blame


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed. ``call``, ``error`` (e.g. CUDA_ERROR_INVALID_VALUE) and
    ``subject`` (the pointer, handle or device) are kept as attributes."""

    def __init__(self, call: str, error: str, subject: str = "", description: str = "") -> None:
        self.call = call
        self.error = error
        self.subject = subject
        self.description = description
        detail = error + (f": {description}" if description else "") + (f", {subject}" if subject else "")
        super().__init__(f"{call} failed ({detail})")


def hexptr(ptr: int) -> str:
    return f"0x{int(ptr):x}"


def handle_digest(handle: bytes) -> str:
    """A short, recognisable spelling of handle bytes for messages."""
    return bytes(handle[:8]).hex() + ("..." if len(handle) > 8 else "")


def handle_type_names(bits: int) -> str:
    if bits == 0:
        return "NONE"
    names = [name for bit, name in _HANDLE_BIT_NAMES.items() if bits & bit]
    rest = bits & ~sum(_HANDLE_BIT_NAMES)
    if rest:
        names.append(hex(rest))
    return "|".join(names)


def error_name(code: Any) -> str:
    name = getattr(code, "name", None)
    return name if isinstance(name, str) else f"CUresult {int(code)}"


def check(call: str, result: Any, subject: str = "",
          describe: Callable[[Any], str] | None = None) -> Any:
    """Check what a cuda-python call returned: ``(CUresult, *outputs)``.

    Returns None, the single output, or the tuple of outputs. A non-zero CUresult raises
    CudaDriverError naming ``call``, the error and ``subject``.
    """
    if isinstance(result, tuple):
        code, outputs = result[0], result[1:]
    else:
        code, outputs = result, ()
    if int(code) != 0:
        description = ""
        if describe is not None:
            try:
                description = describe(code)
            except Exception:
                description = ""
        raise CudaDriverError(call, error_name(code), subject, description)
    if not outputs:
        return None
    return outputs[0] if len(outputs) == 1 else outputs


def load_bindings() -> Any:
    """The cuda-python driver module, imported now."""
    try:
        from cuda.bindings import driver  # cuda-python >= 12.6, 13.x
    except ImportError:
        try:
            from cuda import cuda as driver  # type: ignore[no-redef]  # cuda-python 12.0 - 12.5
        except ImportError as exc:
            raise CudaUnavailableError(
                "lmshm's CUDA wrappers need cuda-python (import name cuda.bindings): install "
                "'lmshm[cuda13]' for CUDA 13 or 'lmshm[cuda12]' for CUDA 12"
            ) from exc
    return driver


@functools.lru_cache(maxsize=1)
def _native_handle_getter() -> Callable[[Any], int] | None:
    """``cuda.bindings.utils.get_cuda_native_handle`` where the bindings have it (12.8+, 13.x),
    else None. ``int(cuda_obj)`` is deprecated there and due for removal."""
    try:
        from cuda.bindings.utils import get_cuda_native_handle
    except ImportError:
        return None
    return get_cuda_native_handle


def _as_int(value: Any) -> int:
    """An integer from a cuda-python handle/pointer object (or an int)."""
    if value is None:
        return 0
    if isinstance(value, int):
        return int(value)
    native = _native_handle_getter()
    if native is not None:
        try:
            return int(native(value))
        except TypeError:
            pass  # a type it has no getter for (an output that is a plain number): int() below
    try:
        return int(value)
    except TypeError:
        return ctypes.c_void_p.from_address(int(value.getPtr())).value or 0


def _struct_bytes(obj: Any, size: int) -> bytes:
    return ctypes.string_at(int(obj.getPtr()), size)


def _fill_struct(obj: Any, data: bytes) -> Any:
    ctypes.memmove(int(obj.getPtr()), bytes(data), len(data))
    return obj


class CudaDriver:
    """The real driver, over cuda-python. One per process (``get_driver()``)."""

    name = "cuda-python"

    def __init__(self, bindings: Any = None) -> None:
        self._bindings = bindings
        # Re-entrant: a finaliser (a dropped lease unmapping) may make a driver call on a thread
        # that is inside one of the locked sections below.
        self._lock = threading.RLock()
        self._initialized = False
        self._devices: dict[int, Any] = {}
        self._primary: dict[int, Any] = {}
        self.calls: Counter[str] = Counter()

    # ---- plumbing --------------------------------------------------------------------------
    @property
    def b(self) -> Any:
        if self._bindings is None:
            self._bindings = load_bindings()
        return self._bindings

    def _describe(self, code: Any) -> str:
        text = check("cuGetErrorString", self.b.cuGetErrorString(code))
        return text.decode() if isinstance(text, bytes) else str(text or "")

    def _call(self, name: str, *args: Any, subject: str = "") -> Any:
        out = check(name, getattr(self.b, name)(*args), subject, self._describe)
        self.calls[name] += 1
        return out

    def _init(self) -> None:
        if self._initialized:
            return
        with self._lock:
            if not self._initialized:
                try:
                    self._call("cuInit", 0)
                except CudaDriverError:
                    raise
                except Exception as exc:  # libcuda missing: cuda-python raises its own error types
                    raise CudaUnavailableError(
                        f"cannot load the CUDA driver ({type(exc).__name__}: {exc}); lmshm's CUDA "
                        "wrappers need an NVIDIA driver and a GPU in this process's container"
                    ) from exc
                self._initialized = True

    def _device(self, ordinal: int) -> Any:
        dev = self._devices.get(ordinal)
        if dev is None:
            self._init()
            dev = self._call("cuDeviceGet", ordinal, subject=f"device=cuda:{ordinal}")
            self._devices[ordinal] = dev
        return dev

    def _primary_context(self, ordinal: int) -> Any:
        ctx = self._primary.get(ordinal)
        if ctx is None:
            dev = self._device(ordinal)
            with self._lock:
                ctx = self._primary.get(ordinal)
                if ctx is None:
                    # Retained for the life of the process: torch and CuPy use the same one.
                    ctx = self._call("cuDevicePrimaryCtxRetain", dev, subject=f"device=cuda:{ordinal}")
                    self._primary[ordinal] = ctx
        return ctx

    def current_context(self) -> int:
        """The calling thread's current context handle, 0 if it has none."""
        self._init()
        return _as_int(self._call("cuCtxGetCurrent"))

    @contextlib.contextmanager
    def bound(self, ordinal: int) -> Iterator[None]:
        """Run the block with device ``ordinal``'s primary context current on this thread.

        Compares contexts, not devices: a non-primary context of the same device (one a library
        made with cuCtxCreate) is another address space for imports and events, so the primary
        one is pushed for the call and the thread's own context restored after."""
        self._init()
        current = _as_int(self._call("cuCtxGetCurrent"))
        primary = self._primary_context(ordinal)
        if current == 0:
            self._call("cuCtxSetCurrent", primary, subject=f"device=cuda:{ordinal}")
            yield
            return
        if current == _as_int(primary):
            yield
            return
        self._call("cuCtxPushCurrent", primary, subject=f"device=cuda:{ordinal}")
        try:
            yield
        finally:
            try:
                self._call("cuCtxPopCurrent")
            except CudaDriverError:
                logger.exception("lmshm: restoring this thread's CUDA context failed")

    # ---- pointers and legacy IPC -----------------------------------------------------------
    def address_range(self, ptr: int, ordinal: int) -> tuple[int, int]:
        """(base, size) of the allocation -- for VMM memory, of the mapped chunk -- holding ``ptr``."""
        with self.bound(ordinal):
            base, size = self._call("cuMemGetAddressRange", ptr, subject=f"ptr={hexptr(ptr)}")
        return _as_int(base), int(size)

    def is_legacy_ipc_capable(self, ptr: int, ordinal: int) -> bool:
        attr = self.b.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
        with self.bound(ordinal):
            return bool(self._call("cuPointerGetAttribute", attr, ptr, subject=f"ptr={hexptr(ptr)}"))

    def is_managed(self, ptr: int, ordinal: int) -> bool:
        """True for unified (cudaMallocManaged) memory, which has no IPC handle of any kind."""
        attr = self.b.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_MANAGED
        with self.bound(ordinal):
            return bool(self._call("cuPointerGetAttribute", attr, ptr, subject=f"ptr={hexptr(ptr)}"))

    def ipc_get_handle(self, base: int, ordinal: int) -> bytes:
        with self.bound(ordinal):
            handle = self._call("cuIpcGetMemHandle", base, subject=f"ptr={hexptr(base)}")
        return _struct_bytes(handle, IPC_HANDLE_BYTES)

    def ipc_open(self, handle: bytes, ordinal: int) -> int:
        h = _fill_struct(self.b.CUipcMemHandle(), handle)
        with self.bound(ordinal):
            ptr = self._call("cuIpcOpenMemHandle", h, _IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
                             subject=f"handle={handle_digest(handle)}, device=cuda:{ordinal}")
        return _as_int(ptr)

    def ipc_close(self, ptr: int, ordinal: int) -> None:
        with self.bound(ordinal):
            self._call("cuIpcCloseMemHandle", ptr, subject=f"ptr={hexptr(ptr)}")

    # ---- VMM ------------------------------------------------------------------------------
    def _handle_type(self, kind: str) -> Any:
        t = self.b.CUmemAllocationHandleType
        return {"posix-fd": t.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                "fabric": t.CU_MEM_HANDLE_TYPE_FABRIC}[kind]

    def _device_prop(self, ordinal: int, handle_type: str | None = None) -> Any:
        b = self.b
        prop = b.CUmemAllocationProp()
        prop.type = b.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = b.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        if handle_type is not None:
            prop.requestedHandleTypes = self._handle_type(handle_type)
        return prop

    def retain_allocation(self, ptr: int, ordinal: int) -> int:
        with self.bound(ordinal):
            return _as_int(self._call("cuMemRetainAllocationHandle", ptr, subject=f"ptr={hexptr(ptr)}"))

    def release_allocation(self, handle: int, ordinal: int) -> None:
        with self.bound(ordinal):
            self._call("cuMemRelease", handle, subject=f"allocation handle=0x{handle:x}")

    def allocation_handle_types(self, handle: int, ordinal: int) -> int:
        """The requestedHandleTypes bitmask the allocation was created with."""
        with self.bound(ordinal):
            prop = self._call("cuMemGetAllocationPropertiesFromHandle", handle,
                              subject=f"allocation handle=0x{handle:x}")
        try:
            return int(prop.requestedHandleTypes)
        except (TypeError, ValueError):
            # A combination of bits is no member of the enum: read the C field itself
            # (CUmemAllocationProp: int type; int requestedHandleTypes; ...).
            return ctypes.c_int.from_address(int(prop.getPtr()) + 4).value

    def export_posix_fd(self, handle: int, ordinal: int) -> int:
        with self.bound(ordinal):
            fd = self._call("cuMemExportToShareableHandle", handle, self._handle_type("posix-fd"), 0,
                            subject=f"allocation handle=0x{handle:x}, type=POSIX_FILE_DESCRIPTOR")
        return int(fd)

    def export_fabric(self, handle: int, ordinal: int) -> bytes:
        with self.bound(ordinal):
            fh = self._call("cuMemExportToShareableHandle", handle, self._handle_type("fabric"), 0,
                            subject=f"allocation handle=0x{handle:x}, type=FABRIC")
        return _struct_bytes(fh, FABRIC_HANDLE_BYTES)

    def import_posix_fd(self, fd: int, ordinal: int) -> int:
        with self.bound(ordinal):
            # For POSIX fds the driver takes the fd itself in the void* slot.
            return _as_int(self._call("cuMemImportFromShareableHandle", int(fd), self._handle_type("posix-fd"),
                                      subject=f"fd={fd}, device=cuda:{ordinal}"))

    def import_fabric(self, data: bytes, ordinal: int) -> int:
        fh = _fill_struct(self.b.CUmemFabricHandle(), data)
        with self.bound(ordinal):
            # For fabric handles the driver takes a pointer to the 64-byte handle.
            return _as_int(self._call("cuMemImportFromShareableHandle", int(fh.getPtr()),
                                      self._handle_type("fabric"),
                                      subject=f"fabric handle={handle_digest(data)}, device=cuda:{ordinal}"))

    def granularity(self, ordinal: int, handle_type: str | None = None) -> int:
        """The minimum granularity of an allocation on ``ordinal`` exportable as ``handle_type``
        (the allocation's own: the driver may answer another one per requestedHandleTypes)."""
        flag = self.b.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        with self.bound(ordinal):
            return int(self._call("cuMemGetAllocationGranularity", self._device_prop(ordinal, handle_type), flag,
                                  subject=f"device=cuda:{ordinal}, handle type={handle_type or 'none'}"))

    def reserve(self, size: int, ordinal: int) -> int:
        with self.bound(ordinal):
            return _as_int(self._call("cuMemAddressReserve", size, 0, 0, 0, subject=f"size={size}"))

    def free_address(self, ptr: int, size: int, ordinal: int) -> None:
        with self.bound(ordinal):
            self._call("cuMemAddressFree", ptr, size, subject=f"ptr={hexptr(ptr)}, size={size}")

    def map(self, ptr: int, size: int, handle: int, ordinal: int) -> None:
        with self.bound(ordinal):
            self._call("cuMemMap", ptr, size, 0, handle, 0,
                       subject=f"ptr={hexptr(ptr)}, size={size}, allocation handle=0x{handle:x}")

    def unmap(self, ptr: int, size: int, ordinal: int) -> None:
        with self.bound(ordinal):
            self._call("cuMemUnmap", ptr, size, subject=f"ptr={hexptr(ptr)}, size={size}")

    def set_access(self, ptr: int, size: int, ordinal: int) -> None:
        b = self.b
        desc = b.CUmemAccessDesc()
        desc.location.type = b.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = ordinal
        desc.flags = b.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        with self.bound(ordinal):
            self._call("cuMemSetAccess", ptr, size, [desc], 1,
                       subject=f"ptr={hexptr(ptr)}, size={size}, device=cuda:{ordinal}")

    def create_allocation(self, size: int, ordinal: int, handle_type: str) -> int:
        """cuMemCreate of ``size`` bytes on ``ordinal``, exportable as ``handle_type``."""
        with self.bound(ordinal):
            return _as_int(self._call("cuMemCreate", size, self._device_prop(ordinal, handle_type), 0,
                                      subject=f"size={size}, device=cuda:{ordinal}, handle type={handle_type}"))

    # ---- streams and stream memory operations ----------------------------------------------
    # The isolated mode's ordering (``lmshm.core.cuda_sync``): a word in legacy-IPC device
    # memory that the worker's stream writes and the server reads on its host (never a GPU-side
    # wait: a dead worker would block it for good). Needs nothing an IPC event needs (no shared
    # /dev/shm), only what a legacy memory handle needs.
    def can_use_64bit_stream_mem_ops(self, ordinal: int) -> bool:
        try:
            return bool(self.device_attribute("CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS", ordinal))
        except (AttributeError, CudaDriverError):
            return False

    def stream_create(self, ordinal: int) -> int:
        """A new non-blocking stream on ``ordinal``'s primary context (its handle)."""
        with self.bound(ordinal):
            return _as_int(self._call("cuStreamCreate", 0x1, subject=f"device=cuda:{ordinal}"))  # CU_STREAM_NON_BLOCKING

    def stream_destroy(self, stream: int, ordinal: int) -> None:
        """Destroy a stream; work still queued on it completes first (the driver's rule)."""
        with self.bound(ordinal):
            self._call("cuStreamDestroy", self.b.CUstream(stream), subject=f"stream=0x{stream:x}")

    def stream_write_value64(self, stream: int, ptr: int, value: int, ordinal: int) -> None:
        """Queue ``*ptr = value`` (8 bytes) on ``stream``, after the work queued before it."""
        with self.bound(ordinal):
            self._call("cuStreamWriteValue64", self.b.CUstream(stream), ptr, value, 0,
                       subject=f"stream=0x{stream:x}, ptr={hexptr(ptr)}")

    # ---- copies (``lmshm.core.cuda_sync``: a request's copies between the pool and a KV cache) ---
    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int, ordinal: int) -> None:
        """Queue one copy of ``nbytes`` on ``stream`` (``cuMemcpyAsync``: unified addressing
        tells host from device memory)."""
        with self.bound(ordinal):
            self._call("cuMemcpyAsync", dst, src, nbytes, self.b.CUstream(stream),
                       subject=f"dst={hexptr(dst)}, src={hexptr(src)}, {nbytes} bytes, stream=0x{stream:x}")

    def memcpy_async_each(self, dsts: Any, srcs: Any, sizes: Any, stream: int, ordinal: int) -> None:
        """Queue ``len(sizes)`` copies on ``stream``, one ``cuMemcpyAsync`` each (drivers older
        than 12.8, or ``--cuda-copy-batch off``); the context is bound once for all of them."""
        call, cu = self.b.cuMemcpyAsync, self.b.CUstream(stream)
        with self.bound(ordinal):
            for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
                check("cuMemcpyAsync", call(d, s, n, cu),
                      f"dst={hexptr(d)}, src={hexptr(s)}, {n} bytes, stream=0x{stream:x}", self._describe)
        self.calls["cuMemcpyAsync"] += len(sizes)

    def has_memcpy_batch(self, ordinal: int) -> bool:
        """True if the driver has ``cuMemcpyBatchAsync`` (CUDA 12.8+)."""
        try:
            return self._batch_entry(ordinal) is not None
        except CudaDriverError:
            return False

    def _batch_entry(self, ordinal: int) -> Any:
        """``cuMemcpyBatchAsync``'s CUDA 12.8 entry point as a ctypes function, or None where the
        driver is older. Looked up once (``cuGetProcAddress`` for version 12080)."""
        entry = self.__dict__.get("_batch_fn", False)
        if entry is not False:
            return entry
        with self._lock:
            entry = self.__dict__.get("_batch_fn", False)
            if entry is not False:
                return entry
            entry = None
            with self.bound(ordinal):
                try:
                    pfn, status = self._call("cuGetProcAddress", b"cuMemcpyBatchAsync", _BATCH_ABI_VERSION, 0)
                except (CudaDriverError, TypeError, ValueError) as exc:   # older than 12.8: INVALID_VALUE;
                    logger.info("lmshm: cuMemcpyBatchAsync is not available (%s); CUDA copies go one by one", exc)
                    pfn, status = 0, None                # (cuda-python < 12.6 returns no status: Type/ValueError)
            if pfn and int(status) == 0:         # CU_GET_PROC_ADDRESS_SUCCESS
                sz, vp = ctypes.c_size_t, ctypes.c_void_p
                # CUDA 12.8's prototype (the driver API reference; no 12.8 header was at hand to check):
                #   CUresult cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                #     size_t count, CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs,
                #     size_t *failIdx, CUstream hStream)
                # cuda-bindings 13.0.3's wrapper passes the same arguments but failIdx (13.0's _v2).
                entry = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp, vp, sz, vp, vp, sz, vp, vp)(int(pfn))
                attrs = self.b.CUmemcpyAttributes()
                attrs.srcAccessOrder = self.b.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
                self._batch_attrs = attrs           # kept: the entry reads it through its pointer
            self.__dict__["_batch_fn"] = entry
        return entry

    def memcpy_batch_async(self, dsts: Any, srcs: Any, sizes: Any, stream: int, ordinal: int) -> None:
        """Queue ``len(sizes)`` copies on ``stream`` in one ``cuMemcpyBatchAsync`` call.

        ``dsts``, ``srcs``, ``sizes``: C-contiguous ``uint64`` numpy arrays of one length (> 0).
        One attribute set for all copies: sources read in stream order
        (``CU_MEMCPY_SRC_ACCESS_ORDER_STREAM``: a STORE reads blocks the worker's GPU work
        wrote; the server's host wait saw its signal before the batch was queued), no location
        hints, no flags.

        Called through the raw entry point, not cuda-bindings' wrapper: in cuda-bindings 13.0.3
        (``driver.pyx``) the wrapper is ``cuMemcpyBatchAsync(dsts, srcs, sizes, count, attrs,
        attrsIdxs, numAttrs, hStream)``, with ``dsts``/``srcs`` lists of ``CUdeviceptr``
        objects and no ``failIdx`` (CUDA 13 dropped it; the 12.x bindings return it), so a
        request's 512 pieces cost ~150 us of Python object building (docs/benchmarks-history.md, "CUDA copy submission")
        before the driver sees them. The same wrapper frees its copies of the arrays as soon as
        the call returns: the driver has read the descriptors by then, so ours need not outlive
        the call either. The stream must not be the legacy NULL stream (the driver refuses it)."""
        n = len(sizes)
        if not (len(dsts) == len(srcs) == n) or n == 0:
            raise ValueError(f"a batch of copies needs equal, non-empty arrays: {len(dsts)} destinations, "
                             f"{len(srcs)} sources, {n} sizes")
        if not stream:
            raise ValueError("cuMemcpyBatchAsync refuses the legacy NULL stream: copies go on a session stream")
        entry = self._batch_entry(ordinal)
        if entry is None:
            raise CudaDriverError("cuMemcpyBatchAsync", "CUDA_ERROR_NOT_SUPPORTED",
                                  f"device=cuda:{ordinal}", "the driver is older than CUDA 12.8")
        arrays = [np.ascontiguousarray(a, dtype=np.uint64) for a in (dsts, srcs, sizes)]
        zero = ctypes.c_size_t(0)
        fail = ctypes.c_size_t(_NO_FAIL)
        with self.bound(ordinal):
            rc = entry(*(a.ctypes.data for a in arrays), n, int(self._batch_attrs.getPtr()),
                       ctypes.addressof(zero), 1, ctypes.addressof(fail), stream)
        if rc != 0:
            at = fail.value
            piece = (f"copy {at} of {n}: dst={hexptr(int(arrays[0][at]))}, src={hexptr(int(arrays[1][at]))}, "
                     f"{int(arrays[2][at])} bytes" if at < n else f"{n} copies")
            check("cuMemcpyBatchAsync", (self.b.CUresult(rc),), f"{piece}, stream=0x{stream:x}", self._describe)
        self.calls["cuMemcpyBatchAsync"] += 1

    def synchronize(self, ordinal: int) -> None:
        """cuCtxSynchronize on ``ordinal``'s context: every stream of this process is idle after."""
        with self.bound(ordinal):
            self._call("cuCtxSynchronize", subject=f"device=cuda:{ordinal}")

    # ---- events (the consumers' quiesce before an unmap, ``lmshm.platform.cuda.streams``) ------
    def event_create(self, ordinal: int) -> int:
        """A new event without timing (CU_EVENT_DISABLE_TIMING) on ``ordinal``'s primary context."""
        with self.bound(ordinal):
            return _as_int(self._call("cuEventCreate", 0x2, subject=f"device=cuda:{ordinal}"))

    def event_record(self, event: int, stream: int, ordinal: int) -> None:
        """Record ``event`` on ``stream``: it completes when the work queued before it has."""
        with self.bound(ordinal):
            self._call("cuEventRecord", self.b.CUevent(event), self.b.CUstream(stream),
                       subject=f"event=0x{event:x}, stream=0x{stream:x}")

    def event_query(self, event: int, ordinal: int) -> bool:
        """True if ``event`` completed, False while it has not (CUDA_ERROR_NOT_READY); any other
        result raises CudaDriverError."""
        with self.bound(ordinal):
            result = self.b.cuEventQuery(self.b.CUevent(event))
        code = result[0] if isinstance(result, tuple) else result
        if int(code) != 0 and error_name(code) == "CUDA_ERROR_NOT_READY":
            return False
        check("cuEventQuery", result, f"event=0x{event:x}", self._describe)
        self.calls["cuEventQuery"] += 1
        return True

    def event_destroy(self, event: int, ordinal: int) -> None:
        with self.bound(ordinal):
            self._call("cuEventDestroy", self.b.CUevent(event), subject=f"event=0x{event:x}")

    # ---- devices ---------------------------------------------------------------------------
    def device_attribute(self, name: str, ordinal: int) -> int:
        attr = getattr(self.b.CUdevice_attribute, name)
        return int(self._call("cuDeviceGetAttribute", attr, self._device(ordinal),
                              subject=f"{name}, device=cuda:{ordinal}"))

    def mem_info(self, ordinal: int) -> tuple[int, int]:
        """(free, total) bytes of device ``ordinal``."""
        with self.bound(ordinal):
            free, total = self._call("cuMemGetInfo", subject=f"device=cuda:{ordinal}")
        return int(free), int(total)

    def device_uuid(self, ordinal: int) -> str:
        from lmshm.platform.cuda import devices

        return devices.device_uuid(ordinal)

    def local_ordinal(self, uuid: str) -> int:
        from lmshm.platform.cuda import devices

        return devices.local_ordinal(uuid)

    # ---- memory as tensors -----------------------------------------------------------------
    def as_uint8_tensor(self, ptr: int, nbytes: int, ordinal: int, owner: Any) -> Any:
        """A torch uint8 tensor over device memory that keeps ``owner`` alive."""
        from lmshm.platform.cuda.rebuild import uint8_tensor

        return uint8_tensor(ptr, nbytes, ordinal, owner)


_driver: Any = None
_driver_lock = threading.Lock()


def get_driver() -> Any:
    """The process's driver gateway (created on first use; imports nothing until called)."""
    global _driver
    if _driver is None:
        with _driver_lock:
            if _driver is None:
                _driver = CudaDriver()
    return _driver


def install_driver(driver: Any) -> Any:
    """Replace the process's driver gateway (tests install ``fake_driver``); returns the old one."""
    global _driver
    with _driver_lock:
        old, _driver = _driver, driver
    return old
