"""The driver gateway's checking and import discipline, without a GPU."""

from __future__ import annotations

import enum
import subprocess
import sys

import pytest

from lmshm.platform.cuda import driver
from lmshm.platform.cuda.driver import CudaDriverError, check, handle_type_names


class FakeCUresult(enum.IntEnum):
    """Stands in for cuda-python's CUresult enum."""

    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_INVALID_CONTEXT = 201


def test_success_returns_the_outputs_without_the_status():
    assert check("cuInit", (FakeCUresult.CUDA_SUCCESS,)) is None
    assert check("cuMemGetInfo", (FakeCUresult.CUDA_SUCCESS, 5, 10)) == (5, 10)
    assert check("cuIpcOpenMemHandle", (FakeCUresult.CUDA_SUCCESS, 0x7F00)) == 0x7F00


def test_a_failure_names_the_call_the_error_and_the_pointer():
    with pytest.raises(CudaDriverError) as info:
        check("cuIpcGetMemHandle", (FakeCUresult.CUDA_ERROR_INVALID_VALUE, None), "ptr=0x7f0000001000",
              describe=lambda code: "invalid argument")
    err = info.value
    assert str(err) == "cuIpcGetMemHandle failed (CUDA_ERROR_INVALID_VALUE: invalid argument, ptr=0x7f0000001000)"
    assert (err.call, err.error, err.subject) == ("cuIpcGetMemHandle", "CUDA_ERROR_INVALID_VALUE", "ptr=0x7f0000001000")


def test_an_error_code_without_a_name_still_reads():
    with pytest.raises(CudaDriverError, match=r"cuCtxSetCurrent failed \(CUresult 999\)"):
        check("cuCtxSetCurrent", (999,))


def test_a_failing_description_does_not_hide_the_error():
    def broken(_code):
        raise RuntimeError("no driver")

    with pytest.raises(CudaDriverError, match=r"\(CUDA_ERROR_INVALID_CONTEXT, device=cuda:0\)"):
        check("cuCtxGetCurrent", (FakeCUresult.CUDA_ERROR_INVALID_CONTEXT,), "device=cuda:0", describe=broken)


def test_handle_type_bits_read_as_names():
    assert handle_type_names(0) == "NONE"
    assert handle_type_names(0x1) == "POSIX_FILE_DESCRIPTOR"
    assert handle_type_names(0x9) == "POSIX_FILE_DESCRIPTOR|FABRIC"


def test_the_driver_can_be_swapped_and_restored():
    sentinel = object()
    old = driver.install_driver(sentinel)
    try:
        assert driver.get_driver() is sentinel
    finally:
        driver.install_driver(old)
    assert driver.get_driver() is not sentinel


def test_without_cuda_python_the_first_call_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    from lmshm.platform.cuda.errors import CudaUnavailableError

    gateway = driver.CudaDriver()
    with pytest.raises(CudaUnavailableError, match=r"lmshm\[cuda13\]"):
        gateway.address_range(0x1000, 0)


def test_importing_the_cuda_package_imports_no_cuda_library_and_initialises_nothing():
    code = (
        "import sys, lmshm.platform.cuda as c, lmshm.platform.cuda.driver as d\n"
        "from lmshm.platform.device_registry import resolve_kv_wrapper_factory\n"
        "assert resolve_kv_wrapper_factory('cuda') is c.CudaIPCWrapper\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('cupy', 'cuda')]\n"
        "import torch\n"
        "assert not bad, bad\n"
        "assert not torch.cuda.is_initialized()\n"
        "assert d._driver is None\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_missing_nvidia_driver_is_a_clear_error_not_a_library_traceback():
    from lmshm.platform.cuda.errors import CudaUnavailableError

    class NoLibcuda:
        def cuInit(self, flags):
            raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found via system search')

    with pytest.raises(CudaUnavailableError, match="cannot load the CUDA driver.*need an NVIDIA driver"):
        driver.CudaDriver(NoLibcuda()).mem_info(0)


def test_a_failing_driver_call_is_checked_with_its_subject():
    class FailingBindings:
        class CUresult(enum.IntEnum):
            CUDA_SUCCESS = 0
            CUDA_ERROR_INVALID_VALUE = 1

        def cuInit(self, flags):
            return (self.CUresult.CUDA_SUCCESS,)

        def cuCtxGetCurrent(self):
            return (self.CUresult.CUDA_SUCCESS, 1)

        def cuCtxGetDevice(self):
            return (self.CUresult.CUDA_SUCCESS, 0)

        def cuDeviceGet(self, ordinal):
            return (self.CUresult.CUDA_SUCCESS, ordinal)

        def cuDevicePrimaryCtxRetain(self, dev):
            return (self.CUresult.CUDA_SUCCESS, 1)           # the current context is the primary

        def cuIpcCloseMemHandle(self, ptr):
            return (self.CUresult.CUDA_ERROR_INVALID_VALUE,)

        def cuGetErrorString(self, code):
            return (self.CUresult.CUDA_SUCCESS, b"invalid argument")

    gateway = driver.CudaDriver(FailingBindings())
    with pytest.raises(CudaDriverError, match=r"^cuIpcCloseMemHandle failed \(CUDA_ERROR_INVALID_VALUE: invalid argument, ptr=0x7f00\)$"):
        gateway.ipc_close(0x7F00, 0)
    assert gateway.calls["cuIpcCloseMemHandle"] == 0 and gateway.calls["cuInit"] == 1


class ContextBindings:
    """Just enough of cuda-python for the context logic: per-thread current context, devices 0-1
    (primary context of device d: 100 + d), and non-primary contexts made with ``create``."""

    class CUresult(enum.IntEnum):
        CUDA_SUCCESS = 0

    def __init__(self):
        import threading

        self.tls = threading.local()
        self.log = []
        self.ok = self.CUresult.CUDA_SUCCESS
        self.device_of = {100: 0, 101: 1}

    def create(self, ctx, dev):
        """A non-primary context ``ctx`` of device ``dev`` (what cuCtxCreate would make)."""
        self.device_of[ctx] = dev
        return ctx

    def _cur(self):
        return getattr(self.tls, "ctx", 0)

    def cuInit(self, flags):
        return (self.ok,)

    def cuDeviceGet(self, ordinal):
        return (self.ok, ordinal)

    def cuDevicePrimaryCtxRetain(self, dev):
        self.log.append(("retain", dev))
        return (self.ok, 100 + dev)             # primary context of device d is 100 + d

    def cuCtxGetCurrent(self):
        return (self.ok, self._cur())

    def cuCtxGetDevice(self):
        return (self.ok, self.device_of[self._cur()])

    def cuCtxSetCurrent(self, ctx):
        self.log.append(("set", ctx))
        self.tls.ctx = ctx
        return (self.ok,)

    def cuCtxPushCurrent(self, ctx):
        self.log.append(("push", ctx))
        self.tls.stack = getattr(self.tls, "stack", []) + [self._cur()]
        self.tls.ctx = ctx
        return (self.ok,)

    def cuCtxPopCurrent(self):
        self.log.append(("pop", self._cur()))
        popped, self.tls.ctx = self._cur(), self.tls.stack.pop()
        return (self.ok, popped)

    def cuMemGetInfo(self):
        self.log.append(("meminfo", self._cur()))
        return (self.ok, 1, 2)


def test_a_thread_without_a_context_gets_the_devices_primary_context_and_keeps_it():
    import threading

    b = ContextBindings()
    gateway = driver.CudaDriver(b)
    seen = {}

    def fresh_thread():
        seen["before"] = gateway.current_context()
        gateway.mem_info(1)
        seen["after"] = gateway.current_context()

    th = threading.Thread(target=fresh_thread)
    th.start()
    th.join()
    assert seen == {"before": 0, "after": 101}
    assert ("retain", 1) in b.log and ("set", 101) in b.log and ("meminfo", 101) in b.log


def test_a_thread_bound_to_another_device_gets_the_right_context_for_the_call_only():
    b = ContextBindings()
    gateway = driver.CudaDriver(b)
    b.tls.ctx = 100                                   # this thread works on device 0
    gateway.mem_info(1)
    assert b.log[-3:] == [("push", 101), ("meminfo", 101), ("pop", 101)]
    assert gateway.current_context() == 100
    gateway.mem_info(0)                               # already right: nothing pushed
    assert b.log[-1] == ("meminfo", 100) and ("push", 100) not in b.log
    assert gateway.calls["cuDevicePrimaryCtxRetain"] == 2          # once per device, then cached
    gateway.mem_info(0)
    assert gateway.calls["cuDevicePrimaryCtxRetain"] == 2


def test_a_non_primary_context_of_the_same_device_gets_the_primary_pushed_for_the_call():
    # A library's cuCtxCreate context on device 1: imports made there would belong to it, not
    # to the primary context torch and CuPy use (and die with it).
    b = ContextBindings()
    gateway = driver.CudaDriver(b)
    b.tls.ctx = b.create(555, dev=1)
    gateway.mem_info(1)
    assert b.log[-3:] == [("push", 101), ("meminfo", 101), ("pop", 101)]
    assert gateway.current_context() == 555


class _FakeHandle:
    """Stands in for a cuda-python handle object (CUcontext, CUstream ...)."""

    def __init__(self, address: int) -> None:
        self.address = address

    def __int__(self) -> int:
        raise AssertionError("int(cuda_obj) is deprecated in cuda-bindings 13; must not be used")


def test_handles_become_ints_through_get_cuda_native_handle_where_the_bindings_have_it(monkeypatch):
    import types

    utils = types.ModuleType("cuda.bindings.utils")
    seen = []

    def get_cuda_native_handle(obj):
        seen.append(obj)
        if not isinstance(obj, _FakeHandle):
            raise TypeError("Unknown type: " + str(type(obj)))
        return obj.address

    utils.get_cuda_native_handle = get_cuda_native_handle
    monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
    monkeypatch.setitem(sys.modules, "cuda.bindings", types.ModuleType("cuda.bindings"))
    monkeypatch.setitem(sys.modules, "cuda.bindings.utils", utils)
    driver._native_handle_getter.cache_clear()
    try:
        assert driver._as_int(_FakeHandle(0x7F00)) == 0x7F00
        assert driver._as_int(5) == 5 and driver._as_int(None) == 0        # ints need no getter

        class PlainNumber:                                              # a type it has no getter for
            def __int__(self):
                return 42

        assert driver._as_int(PlainNumber()) == 42
        assert len(seen) == 2
    finally:
        driver._native_handle_getter.cache_clear()


def test_without_get_cuda_native_handle_handles_fall_back_to_int(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings.utils", None)      # an older cuda-python
    driver._native_handle_getter.cache_clear()
    try:
        class OldHandle:
            def __int__(self):
                return 0x1234

        assert driver._as_int(OldHandle()) == 0x1234
    finally:
        driver._native_handle_getter.cache_clear()


class EventBindings(ContextBindings):
    """ContextBindings plus events: cuEventQuery says NOT_READY while ``busy`` holds the event."""

    class CUresult(enum.IntEnum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_HANDLE = 400
        CUDA_ERROR_NOT_READY = 600

    def __init__(self):
        super().__init__()
        self.ok = self.CUresult.CUDA_SUCCESS
        self.busy = set()

    def CUevent(self, value):
        return ("event", value)

    def CUstream(self, value):
        return ("stream", value)

    def cuEventCreate(self, flags):
        self.log.append(("create", flags))
        return (self.ok, 0xE0)

    def cuEventRecord(self, event, stream):
        self.log.append(("record", event, stream))
        return (self.ok,)

    def cuEventQuery(self, event):
        if event[1] == 0xBAD:
            return (self.CUresult.CUDA_ERROR_INVALID_HANDLE,)
        return (self.CUresult.CUDA_ERROR_NOT_READY if event[1] in self.busy else self.ok,)

    def cuEventDestroy(self, event):
        self.log.append(("destroy", event))
        return (self.ok,)

    def cuGetErrorString(self, code):
        return (self.ok, b"invalid resource handle")


def test_event_methods_pass_typed_handles_and_read_not_ready_as_false():
    b = EventBindings()
    gateway = driver.CudaDriver(b)
    ev = gateway.event_create(0)
    assert ev == 0xE0 and ("create", 0x2) in b.log                  # CU_EVENT_DISABLE_TIMING
    gateway.event_record(ev, 0x5000, 0)
    assert ("record", ("event", 0xE0), ("stream", 0x5000)) in b.log
    b.busy.add(0xE0)
    assert gateway.event_query(ev, 0) is False
    b.busy.clear()
    assert gateway.event_query(ev, 0) is True
    with pytest.raises(CudaDriverError, match=r"cuEventQuery failed \(CUDA_ERROR_INVALID_HANDLE.*event=0xbad"):
        gateway.event_query(0xBAD, 0)
    gateway.event_destroy(ev, 0)
    assert b.log[-1] == ("destroy", ("event", 0xE0))


class StreamBindings(EventBindings):
    """EventBindings plus streams and stream memory operations, recording each call's arguments."""

    class CUdevice_attribute:
        CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS = 93

    def cuStreamCreate(self, flags):
        self.log.append(("stream-create", flags))
        return (self.ok, 0x5100)

    def cuStreamDestroy(self, stream):
        self.log.append(("stream-destroy", stream))
        return (self.ok,)

    def cuStreamWriteValue64(self, stream, addr, value, flags):
        self.log.append(("write", stream, addr, value, flags))
        return (self.ok,)

    def cuCtxSynchronize(self):
        self.log.append(("ctx-sync",))
        return (self.ok,)

    def cuDeviceGetAttribute(self, attr, dev):
        self.log.append(("attribute", attr))
        return (self.ok, 1)


def test_stream_memory_operations_pass_typed_streams_and_the_default_flags():
    """The isolated mode's flag words: cuda-bindings 13's signature is (stream, addr, value,
    flags); flags 0 is CU_STREAM_WRITE_VALUE_DEFAULT (a fence before the write: the work queued
    before it is visible once the word is). The server reads words on its host, never waits on
    them on the GPU, so the gateway has no cuStreamWaitValue64."""
    b = StreamBindings()
    gateway = driver.CudaDriver(b)
    s = gateway.stream_create(0)
    assert s == 0x5100 and ("stream-create", 0x1) in b.log            # CU_STREAM_NON_BLOCKING
    gateway.stream_write_value64(s, 0x7000_0008, 41, 0)
    assert ("write", ("stream", 0x5100), 0x7000_0008, 41, 0) in b.log
    gateway.synchronize(0)
    assert ("ctx-sync",) in b.log
    assert gateway.can_use_64bit_stream_mem_ops(0) is True
    gateway.stream_destroy(s, 0)
    assert b.log[-1] == ("stream-destroy", ("stream", 0x5100))


# ---- issue 42: a request's copies in one cuMemcpyBatchAsync -----------------------------------
import ctypes

import numpy as np


class BatchBindings(ContextBindings):
    """FAKE cuda-python for the copy calls: ``cuGetProcAddress`` hands out a ctypes callback
    with cuMemcpyBatchAsync's CUDA 12.8 signature that reads back and records what it was given
    (through the raw pointers, as the driver would); ``cuMemcpyAsync`` records its arguments."""

    class CUresult(enum.IntEnum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1

    class CUmemcpySrcAccessOrder(enum.IntEnum):
        CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1     # cuda-bindings 13.0.3: INVALID 0, STREAM 1

    class CUmemcpyAttributes:
        """Its first field, srcAccessOrder, in a 24-byte struct (sizeof(CUmemcpyAttributes))."""

        def __init__(self):
            self._raw = (ctypes.c_uint32 * 6)()

        @property
        def srcAccessOrder(self):
            return self._raw[0]

        @srcAccessOrder.setter
        def srcAccessOrder(self, v):
            self._raw[0] = int(v)

        def getPtr(self):
            return ctypes.addressof(self._raw)

    def __init__(self, entry=True, fail_at=None):
        super().__init__()
        self.entry, self.fail_at, self.batches, self.copies = entry, fail_at, [], []
        sz, vp = ctypes.c_size_t, ctypes.c_void_p
        self._fn = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp, vp, sz, vp, vp, sz, vp, vp)(self._batch)

    def _batch(self, dsts, srcs, sizes, count, attrs, idxs, nattrs, fail, stream):
        read = lambda p, n: list((ctypes.c_uint64 * n).from_address(p))
        self.batches.append(dict(dsts=read(dsts, count), srcs=read(srcs, count), sizes=read(sizes, count),
                                 count=count, order=ctypes.c_uint32.from_address(attrs).value,
                                 idxs=read(idxs, nattrs), nattrs=nattrs, stream=stream, ctx=self._cur()))
        if self.fail_at is not None:
            ctypes.c_size_t.from_address(fail).value = self.fail_at
            return 1
        return 0

    def CUstream(self, s):
        return ("stream", s)

    def cuGetProcAddress(self, symbol, version, flags):
        self.log.append(("proc", symbol, version))
        if not self.entry:                              # a driver older than 12.8
            return (self.CUresult.CUDA_ERROR_INVALID_VALUE, None, None)
        return (self.ok, ctypes.cast(self._fn, ctypes.c_void_p).value, 0)

    def cuMemcpyAsync(self, dst, src, n, stream):
        self.copies.append((dst, src, n, stream, self._cur()))
        return (self.ok,)

    def cuGetErrorString(self, code):
        return (self.ok, b"invalid argument")


def _arrays(n):
    u = np.uint64
    return (np.arange(n, dtype=u) * 4096 + 0x7000_0000, np.arange(n, dtype=u) * 8192 + 0x10_0000, np.full(n, 4096, u))


def test_a_batch_goes_to_the_driver_in_one_call_with_the_12_8_signature_and_stream_order():
    b = BatchBindings()
    gateway = driver.CudaDriver(b)
    d, s, n = _arrays(5)
    assert gateway.has_memcpy_batch(0)
    gateway.memcpy_batch_async(d, s, n, 0x5100, 0)
    (call,) = b.batches
    assert call["dsts"] == d.tolist() and call["srcs"] == s.tolist() and call["sizes"] == n.tolist()
    assert call["count"] == 5 and call["nattrs"] == 1 and call["idxs"] == [0]     # one attribute set, from copy 0
    assert call["order"] == 1                        # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    assert call["stream"] == 0x5100 and call["ctx"] == 100   # on the device's primary context
    assert ("proc", b"cuMemcpyBatchAsync", 12080) in b.log
    assert gateway.calls["cuMemcpyBatchAsync"] == 1


def test_a_batch_the_driver_refuses_names_the_copy_it_blames():
    gateway = driver.CudaDriver(BatchBindings(fail_at=3))
    d, s, n = _arrays(5)
    with pytest.raises(CudaDriverError, match=r"cuMemcpyBatchAsync failed \(CUDA_ERROR_INVALID_VALUE: invalid "
                                              r"argument, copy 3 of 5: dst=0x70003000, src=0x106000, 4096 bytes"):
        gateway.memcpy_batch_async(d, s, n, 0x5100, 0)
    assert gateway.calls["cuMemcpyBatchAsync"] == 0


def test_a_batch_refuses_the_null_stream_and_arrays_of_different_lengths_before_the_driver():
    b = BatchBindings()
    gateway = driver.CudaDriver(b)
    d, s, n = _arrays(4)
    with pytest.raises(ValueError, match="legacy NULL stream"):
        gateway.memcpy_batch_async(d, s, n, 0, 0)
    with pytest.raises(ValueError, match="3 sources, 4 sizes"):
        gateway.memcpy_batch_async(d, s[:3], n, 0x5100, 0)
    with pytest.raises(ValueError, match="non-empty"):
        gateway.memcpy_batch_async(d[:0], s[:0], n[:0], 0x5100, 0)
    assert b.batches == []


def test_a_driver_older_than_12_8_has_no_batch_and_copies_piece_by_piece_in_one_binding():
    b = BatchBindings(entry=False)
    gateway = driver.CudaDriver(b)
    assert not gateway.has_memcpy_batch(0)
    with pytest.raises(CudaDriverError, match="older than CUDA 12.8"):
        gateway.memcpy_batch_async(*_arrays(2), 0x5100, 0)
    d, s, n = _arrays(3)
    gateway.memcpy_async_each(d, s, n, 0x5100, 0)
    assert b.copies == [(int(d[i]), int(s[i]), 4096, ("stream", 0x5100), 100) for i in range(3)]
    assert gateway.calls["cuMemcpyAsync"] == 3


def test_the_copy_path_follows_the_driver_and_the_setting(fake_driver):
    from lmshm.core import cuda_sync

    assert cuda_sync.TorchCudaSync("lazy").copy_path(0) == "batch"
    assert cuda_sync.TorchCudaSync("lazy", copy_batch=False).copy_path(0) == "per-piece"
    assert cuda_sync.TorchCudaSync("off").copy_path(0) == "per-piece"          # pageable memory
    fake_driver.batch_supported = False
    assert cuda_sync.TorchCudaSync("lazy").copy_path(0) == "per-piece"
    with pytest.raises(ValueError, match="multiple of 4 KiB"):
        cuda_sync.TorchCudaSync("lazy", pin_extent=1000)


class GranularityBindings(ContextBindings):
    """ContextBindings plus what a granularity query builds: the allocation property (as
    cuda-python's struct, attributes only) and cuMemGetAllocationGranularity, which records the
    property's requestedHandleTypes."""

    class CUmemAllocationType:
        CU_MEM_ALLOCATION_TYPE_PINNED = 1

    class CUmemLocationType:
        CU_MEM_LOCATION_TYPE_DEVICE = 1

    class CUmemAllocationHandleType:
        CU_MEM_HANDLE_TYPE_NONE = 0
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
        CU_MEM_HANDLE_TYPE_FABRIC = 8

    class CUmemAllocationGranularity_flags:
        CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0

    class CUmemAllocationProp:
        def __init__(self):
            import types

            self.type = 0
            self.location = types.SimpleNamespace(type=0, id=0)
            self.requestedHandleTypes = 0            # CU_MEM_HANDLE_TYPE_NONE

    def cuMemGetAllocationGranularity(self, prop, flag):
        self.log.append(("granularity", prop.location.id, prop.requestedHandleTypes, flag))
        return (self.ok, 2 << 20)


def test_granularity_is_asked_with_the_allocations_own_handle_type():
    b = GranularityBindings()
    gateway = driver.CudaDriver(b)
    assert gateway.granularity(1, "fabric") == 2 << 20
    assert gateway.granularity(0, "posix-fd") == 2 << 20
    assert [e for e in b.log if e[0] == "granularity"] == [("granularity", 1, 8, 0), ("granularity", 0, 1, 0)]
