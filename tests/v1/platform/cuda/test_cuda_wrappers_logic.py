"""Refcount, unwinding, selection and error wording of the CUDA wrappers -- on a CPU, against
``fake_driver`` (a fake of the driver gateway). test_cuda_gpu.py covers the same behaviour on a
real GPU; these tests pin the logic around the driver.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from fake_driver import GRANULARITY, UUIDS

from lmshm.platform import ipc_policy
from lmshm.platform.base.fds import FD_INBOX
from lmshm.platform.base.ipc_wrapper import DeviceIPCWrapper, WrapperDecodeError
from lmshm.platform.base.mappings import MAPPINGS
from lmshm.platform.cuda import (
    CudaIPCWrapper,
    NotCudaMallocMemoryError,
    NotVmmMemoryError,
    RawCudaIPCWrapper,
    UnknownDeviceError,
    VmmCudaIPCWrapper,
    VmmNotExportableError,
    VmmSpansChunksError,
    fd_channel_required,
)
from lmshm.platform.device_registry import resolve_kv_wrapper_factory

MiB = 1 << 20


def over_the_wire(w: DeviceIPCWrapper) -> DeviceIPCWrapper:
    return DeviceIPCWrapper.Deserialize(w.Serialize())


def deliver_fds(w: DeviceIPCWrapper, session=None) -> None:
    for token, fd in w.export_fds().items():
        FD_INBOX.put(token, os.dup(fd), session)


@pytest.fixture
def fd_session():
    yield "test"
    FD_INBOX.close_session(None)


# ---- raw: legacy IPC ----------------------------------------------------------------------

def test_raw_round_trip_rebuilds_an_interior_view_over_the_same_bytes(fake_driver, as_consumer):
    base = fake_driver.malloc(1 * MiB)
    ptr = base + 4096                                        # an interior pointer
    fake_driver.write(ptr, bytes(range(16)) * 4)
    w = RawCudaIPCWrapper.from_pointer(ptr, 64, torch.float16, (4, 8), 0, name="layer0")
    assert (w.alloc_offset, w.alloc_size, w.device) == (4096, 1 * MiB, UUIDS[0])
    as_consumer()
    peer = over_the_wire(w)
    t = peer.to_tensor()
    assert t.dtype == torch.float16 and t.shape == (4, 8)
    assert bytes(t.view(torch.uint8).flatten().tolist()) == bytes(range(16)) * 4
    t.view(torch.uint8)[0, 0] = 0xAB                         # zero copy: the producer sees it
    assert fake_driver.read(ptr, 1) == b"\xab"
    del t
    peer.close()
    w.close()
    assert fake_driver.live_mappings() == 0


def test_two_wrappers_on_one_allocation_open_it_once_and_the_last_close_unmaps(fake_driver, as_consumer):
    base = fake_driver.malloc(1 * MiB)
    fake_driver.write(base + 8192, b"\x07" * 16)
    a = RawCudaIPCWrapper.from_pointer(base, 4096, torch.uint8, (4096,), 0)
    b = RawCudaIPCWrapper.from_pointer(base + 8192, 16, torch.uint8, (16,), 0)
    as_consumer()
    a, b = over_the_wire(a), over_the_wire(b)
    opens = MAPPINGS.opens_total
    ta, tb = a.to_tensor(), b.to_tensor()
    assert fake_driver.calls["cuIpcOpenMemHandle"] == 1 and MAPPINGS.opens_total == opens + 1
    a.close()
    del ta
    assert fake_driver.calls["cuIpcCloseMemHandle"] == 0      # b still maps it
    assert bytes(tb.tolist()) == b"\x07" * 16
    b.close()
    assert fake_driver.calls["cuIpcCloseMemHandle"] == 0      # tb still lives
    del tb
    assert fake_driver.calls["cuIpcCloseMemHandle"] == 1 and fake_driver.live_mappings() == 0
    b.close()                                                 # idempotent
    assert fake_driver.calls["cuIpcCloseMemHandle"] == 1


def test_a_failing_unmap_is_logged_not_raised(fake_driver, as_consumer, caplog):
    base = fake_driver.malloc(1 * MiB)
    w = RawCudaIPCWrapper.from_pointer(base, 1024, torch.bfloat16, (512,), 0)
    as_consumer()
    w = over_the_wire(w)
    w.to_tensor()
    fake_driver.fail_next("cuIpcCloseMemHandle", "CUDA_ERROR_INVALID_CONTEXT")
    with caplog.at_level(logging.ERROR):
        w.close()
    assert "releasing mapping" in caplog.text and "CUDA_ERROR_INVALID_CONTEXT" in caplog.text
    assert not [k for k in MAPPINGS.keys() if k[0] == "cuda-ipc"]
    fake_driver.ranges.clear()


def test_a_handle_is_never_opened_by_the_process_that_exported_it(fake_driver):
    base = fake_driver.malloc(1 * MiB)
    w = RawCudaIPCWrapper.from_pointer(base, 1024, torch.uint8, (1024,), 0)
    with pytest.raises(RuntimeError, match="cannot be opened in the process that exported it"):
        over_the_wire(w).to_tensor()
    assert fake_driver.calls["cuIpcOpenMemHandle"] == 0


def test_raw_on_vmm_memory_says_the_memory_is_not_cudamalloc_and_what_to_do(fake_driver):
    va = fake_driver.vmm_pool(GRANULARITY, 1)                      # POSIX-fd exportable
    with pytest.raises(NotCudaMallocMemoryError) as info:
        RawCudaIPCWrapper.from_pointer(va, 1024, torch.float16, (512,), 0, name="model.layers.3.attn")
    msg = str(info.value)
    assert "'model.layers.3.attn'" in msg and f"ptr={hex(va)}" in msg and UUIDS[0] in msg
    assert "requestedHandleTypes=POSIX_FILE_DESCRIPTOR" in msg and "expandable" in msg
    assert "LMSHM_USE_VMM_API=1" in msg
    assert fake_driver.handle_refs[next(iter(fake_driver.handles))] == 1   # the probe's retain was released


def test_raw_on_sleep_mode_memory_names_handle_type_none_and_does_not_send_it_to_the_vmm_wrapper(fake_driver):
    # vLLM sleep mode (csrc/cumem_allocator.cpp) never sets requestedHandleTypes: nothing can
    # export it, so "enable use_vmm_api" would send the user to a second refusal.
    va = fake_driver.vmm_pool(GRANULARITY, 1, handle_type="none")
    with pytest.raises(NotCudaMallocMemoryError) as info:
        RawCudaIPCWrapper.from_pointer(va, 1024, torch.float16, (512,), 0, name="kv")
    msg = str(info.value)
    assert "requestedHandleTypes=NONE" in msg and "sleep mode" in msg and "cannot be exported" in msg
    assert "LMSHM_USE_VMM_API=1" not in msg
    assert "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR" in msg and "empty_vmm" in msg


def test_raw_on_fabric_only_memory_says_to_export_fabric_handles(fake_driver):
    va = fake_driver.vmm_pool(GRANULARITY, 1, handle_type="fabric")   # expandable segments that got FABRIC
    with pytest.raises(NotCudaMallocMemoryError) as info:
        RawCudaIPCWrapper.from_pointer(va, 1024, torch.float16, (512,), 0)
    msg = str(info.value)
    assert "requestedHandleTypes=FABRIC" in msg and "LMSHM_VMM_HANDLE_TYPE=fabric" in msg


def test_raw_on_memory_that_is_not_vmm_either_names_both_allocations_that_work(fake_driver):
    ptr = fake_driver.malloc_managed(1 * MiB)
    with pytest.raises(NotCudaMallocMemoryError) as info:
        RawCudaIPCWrapper.from_pointer(ptr, 1024, torch.float16, (512,), 0)
    msg = str(info.value)
    assert "no cuMemCreate allocation either" in msg and "cudaMalloc" in msg
    assert "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR" in msg


def test_raw_reports_the_driver_error_when_the_handle_export_fails(fake_driver):
    base = fake_driver.malloc(1 * MiB)
    fake_driver.fail_next("cuIpcGetMemHandle", "CUDA_ERROR_INVALID_VALUE")
    with pytest.raises(NotCudaMallocMemoryError, match=r"cuIpcGetMemHandle failed \(CUDA_ERROR_INVALID_VALUE.*use_vmm_api"):
        RawCudaIPCWrapper.from_pointer(base, 1024, torch.uint8, (1024,), 0)


def test_raw_refuses_a_pointer_outside_any_allocation(fake_driver):
    with pytest.raises(Exception, match=r"cuMemGetAddressRange failed \(CUDA_ERROR_NOT_FOUND, ptr=0x1000\)"):
        RawCudaIPCWrapper.from_pointer(0x1000, 16, torch.uint8, (16,), 0)


def test_from_pointer_checks_its_arguments(fake_driver):
    base = fake_driver.malloc(1 * MiB)
    with pytest.raises(ValueError, match="nbytes=100 does not match shape"):
        RawCudaIPCWrapper.from_pointer(base, 100, torch.float16, (64,), 0)
    with pytest.raises(ValueError, match="not a dense layout"):
        RawCudaIPCWrapper.from_pointer(base, 64, torch.float16, (4, 8), 0, stride=(16, 1))
    with pytest.raises(ValueError, match="not aligned"):
        RawCudaIPCWrapper.from_pointer(base + 1, 64, torch.float16, (32,), 0)
    # a transposed (permuted) dense layout is fine, as is a device named by UUID
    w = RawCudaIPCWrapper.from_pointer(base, 64, "float16", (8, 4), UUIDS[0], stride=(1, 8))
    assert w.stride == (1, 8)
    w.close()


def test_an_unknown_gpu_is_named_with_the_visible_ones(fake_driver, as_consumer):
    base = fake_driver.malloc(1 * MiB)
    w = RawCudaIPCWrapper.from_pointer(base, 16, torch.uint8, (16,), 0)
    as_consumer()
    w = over_the_wire(w)
    fake_driver.uuids = [UUIDS[1]]
    with pytest.raises(UnknownDeviceError, match=f"GPU {UUIDS[0]} is not visible.*cuda:0={UUIDS[1]}"):
        w.to_tensor()
    assert fake_driver.calls["cuIpcOpenMemHandle"] == 0


def test_the_consumer_checks_the_view_against_the_mapped_size(fake_driver, as_consumer):
    base = fake_driver.malloc(64 * 1024)
    w = RawCudaIPCWrapper.from_pointer(base, 1024, torch.uint8, (1024,), 0)
    as_consumer()
    state = w.__getstate__()
    state.update(alloc_size=1 * MiB, alloc_offset=512 * 1024)  # a peer lying about the allocation
    liar = RawCudaIPCWrapper.__new__(RawCudaIPCWrapper)
    liar.__setstate__(state)
    with pytest.raises(ValueError, match="run past the mapped allocation"):
        liar.to_tensor()
    assert fake_driver.live_mappings() == 0 and fake_driver.calls["cuIpcCloseMemHandle"] == 1


@pytest.mark.parametrize("field,value,match", [
    ("ipc_handle", b"short", "ipc_handle must be 64 bytes"),
    ("device", "cuda:0", "device must be a GPU UUID"),
    ("alloc_offset", -1, "alloc_offset must be an int"),
    ("alloc_offset", 1 * MiB, "do not fit an allocation"),
    ("alloc_offset", 1, "not aligned"),
    ("stride", (16, 2), "not a dense layout"),
    ("storage_offset", 1 << 40, "do not fit an allocation"),   # a group's later layer past the end
    ("producer", "me", "malformed producer id"),
])
def test_malformed_raw_fields_from_a_peer_are_refused(fake_driver, field, value, match):
    base = fake_driver.malloc(1 * MiB)
    w = RawCudaIPCWrapper.from_pointer(base, 64, torch.float16, (4, 8), 0)
    state = w.__getstate__()
    state[field] = value
    w.close()
    with pytest.raises(WrapperDecodeError, match=match):
        RawCudaIPCWrapper.__new__(RawCudaIPCWrapper).__setstate__(state)


# ---- VMM -------------------------------------------------------------------------------------

def test_vmm_posix_fd_round_trip_travels_by_token_and_maps_once(fake_driver, as_consumer, fd_session):
    va = fake_driver.vmm_pool(GRANULARITY, 2)
    fake_driver.write(va + GRANULARITY + 256, b"\x5a" * 32)
    lead = VmmCudaIPCWrapper.from_pointer(va + GRANULARITY + 256, 256, torch.float8_e4m3fn, (256,), 0)
    views = [lead] + [lead.sibling(256 * i) for i in (1, 2)]          # one export, three layers
    assert all(v.handle_type == "posix-fd" and v.alloc_size == GRANULARITY for v in views)
    assert lead.alloc_offset == 256 and len({v.export_nonce for v in views}) == 1
    exported = [v.export_fds() for v in views]
    assert all(e == {lead.fd_token: lead._fd} for e in exported)      # siblings give the leader's fd
    deliver_fds(lead)
    as_consumer()
    peers = [over_the_wire(v) for v in views]
    ts = [p.to_tensor() for p in peers]
    assert fake_driver.calls["cuMemImportFromShareableHandle"] == 1
    assert ts[0].dtype == torch.float8_e4m3fn
    assert bytes(ts[0].view(torch.uint8)[:32].tolist()) == b"\x5a" * 32
    for p in peers:
        p.close()
    assert fake_driver.live_mappings() == 1                   # the tensors keep it
    del ts
    assert fake_driver.live_mappings() == 0 and fake_driver.live_imported_handles() == 0
    assert not fake_driver.reserved.keys() - {va}             # the importer's range is freed
    fd = lead._fd
    for v in reversed(views):
        v.close()
    with pytest.raises(OSError):
        os.fstat(fd)                                           # the producer's fd is closed


def test_two_separate_exports_of_one_chunk_import_it_separately(fake_driver, as_consumer, fd_session):
    # Each export has its own nonce (a recycled handle value must never reuse a mapping), so
    # only siblings share an import; two exports of one live chunk cost two imports, no more.
    va = fake_driver.vmm_pool(GRANULARITY, 1)
    a = VmmCudaIPCWrapper.from_pointer(va, 256, torch.uint8, (256,), 0)
    b = VmmCudaIPCWrapper.from_pointer(va + 256, 256, torch.uint8, (256,), 0)
    assert a.alloc_id == b.alloc_id and a.export_nonce != b.export_nonce
    deliver_fds(a)
    deliver_fds(b)
    as_consumer()
    pa, pb = over_the_wire(a), over_the_wire(b)
    ta, tb = pa.to_tensor(), pb.to_tensor()
    assert fake_driver.calls["cuMemImportFromShareableHandle"] == 2
    del ta, tb
    pa.close()
    pb.close()
    a.close()
    b.close()
    assert fake_driver.live_mappings() == 0


def test_vmm_fabric_handles_travel_inside_the_wrapper(fake_driver, as_consumer):
    va = fake_driver.vmm_pool(GRANULARITY, 1, handle_type="fabric")
    w = VmmCudaIPCWrapper.from_pointer(va, 1024, torch.bfloat16, (512,), 0, handle_type="fabric")
    assert w.export_fds() == {} and len(w.fabric_handle) == 64 and not w.needs_fd_channel
    as_consumer()
    peer = over_the_wire(w)
    t = peer.to_tensor()
    assert t.shape == (512,) and t.dtype == torch.bfloat16
    del t
    peer.close()
    w.close()
    assert fake_driver.live_mappings() == 0


def test_the_handle_type_follows_the_environment(fake_driver, monkeypatch):
    va = fake_driver.vmm_pool(GRANULARITY, 1, handle_type="fabric")
    monkeypatch.setenv("LMSHM_VMM_HANDLE_TYPE", "fabric")
    w = VmmCudaIPCWrapper.from_pointer(va, 16, torch.uint8, (16,), 0)
    assert w.handle_type == "fabric"
    w.close()
    monkeypatch.setenv("LMSHM_VMM_HANDLE_TYPE", "dmabuf")
    with pytest.raises(ValueError, match="LMSHM_VMM_HANDLE_TYPE='dmabuf'.*posix-fd or fabric"):
        VmmCudaIPCWrapper.from_pointer(va, 16, torch.uint8, (16,), 0)


def test_a_tensor_spanning_two_chunks_is_refused_with_a_hint(fake_driver):
    va = fake_driver.vmm_pool(GRANULARITY, 2)
    with pytest.raises(VmmSpansChunksError) as info:
        VmmCudaIPCWrapper.from_pointer(va + GRANULARITY - 64, 128, torch.uint8, (128,), 0, name="kv")
    msg = str(info.value)
    assert "span several physical allocations" in msg and "expandable segments" in msg and "'kv'" in msg
    assert fake_driver.calls["cuMemExportToShareableHandle"] == 0


def test_an_allocation_not_exportable_as_requested_is_refused_with_a_hint(fake_driver):
    va = fake_driver.vmm_pool(GRANULARITY, 1, handle_type="fabric")
    with pytest.raises(VmmNotExportableError) as info:
        VmmCudaIPCWrapper.from_pointer(va, 16, torch.uint8, (16,), 0, handle_type="posix-fd")
    msg = str(info.value)
    assert "requestedHandleTypes=FABRIC" in msg and "LMSHM_VMM_HANDLE_TYPE" in msg
    assert fake_driver.handle_refs[next(iter(fake_driver.handles))] == 1   # the retain was released


def test_vmm_on_cudamalloc_memory_says_to_turn_use_vmm_api_off(fake_driver):
    base = fake_driver.malloc(1 * MiB)
    with pytest.raises(NotVmmMemoryError, match=r"it is cudaMalloc memory, not VMM memory.*LMSHM_USE_VMM_API=0"):
        VmmCudaIPCWrapper.from_pointer(base, 16, torch.uint8, (16,), 0)
    # a driver that cannot answer the attribute query: the retain's own error is reported
    fake_driver.fail_next("cuPointerGetAttribute", "CUDA_ERROR_INVALID_VALUE")
    with pytest.raises(NotVmmMemoryError, match=r"cuMemRetainAllocationHandle failed.*LMSHM_USE_VMM_API=0"):
        VmmCudaIPCWrapper.from_pointer(base, 16, torch.uint8, (16,), 0)


@pytest.mark.parametrize("failing", ["cuMemAddressReserve", "cuMemMap", "cuMemSetAccess"])
def test_a_failed_import_undoes_every_step_that_succeeded(fake_driver, as_consumer, fd_session, failing):
    va = fake_driver.vmm_pool(GRANULARITY, 1)
    w = VmmCudaIPCWrapper.from_pointer(va, 16, torch.uint8, (16,), 0)
    deliver_fds(w)
    as_consumer()
    peer = over_the_wire(w)
    reserved_before = dict(fake_driver.reserved)
    fake_driver.fail_next(failing, "CUDA_ERROR_OUT_OF_MEMORY")
    with pytest.raises(Exception, match=f"{failing} failed"):
        peer.to_tensor()
    assert fake_driver.reserved == reserved_before
    assert fake_driver.live_mappings() == 0 and fake_driver.live_imported_handles() == 0
    assert peer._lease is None and not [k for k in MAPPINGS.keys() if k[0] == "cuda-vmm"]
    w.close()


def test_a_missing_fd_points_at_the_fd_channel(fake_driver, as_consumer):
    va = fake_driver.vmm_pool(GRANULARITY, 1)
    w = VmmCudaIPCWrapper.from_pointer(va, 16, torch.uint8, (16,), 0)
    as_consumer()
    with pytest.raises(LookupError, match="no file descriptor was received.*SCM_RIGHTS"):
        over_the_wire(w).to_tensor()
    w.close()


def test_only_the_producer_can_export_the_fd(fake_driver):
    va = fake_driver.vmm_pool(GRANULARITY, 1)
    w = VmmCudaIPCWrapper.from_pointer(va, 16, torch.uint8, (16,), 0)
    with pytest.raises(RuntimeError, match="only the producer"):
        over_the_wire(w).export_fds()
    w.close()
    with pytest.raises(RuntimeError, match="only the producer"):
        w.export_fds()


def test_the_fd_channel_error_says_what_to_change():
    err = fd_channel_required("layers 0-31", "connect /tmp/lmshm.fds: No such file or directory")
    msg = str(err)
    assert msg.startswith("layers 0-31: cannot register VMM memory exported as POSIX file descriptors")
    assert "/tmp/lmshm.fds" in msg and "LMSHM_VMM_HANDLE_TYPE=fabric" in msg and "use_vmm_api" in msg


@pytest.mark.parametrize("change,match", [
    (dict(handle_type="ipc"), "handle_type must be one of"),
    (dict(fd_token="../../etc/passwd"), "valid fd_token"),
    (dict(fabric_handle=b"x" * 64), "no fabric handle"),
    (dict(alloc_id=-5), "alloc_id must be an int"),
])
def test_malformed_vmm_fields_from_a_peer_are_refused(fake_driver, change, match):
    va = fake_driver.vmm_pool(GRANULARITY, 1)
    w = VmmCudaIPCWrapper.from_pointer(va, 16, torch.uint8, (16,), 0)
    state = w.__getstate__()
    state.update(change)
    w.close()
    with pytest.raises(WrapperDecodeError, match=match):
        VmmCudaIPCWrapper.__new__(VmmCudaIPCWrapper).__setstate__(state)


# ---- torch storage sharing: wire checks only (the rest needs a GPU) ------------------------

def torch_wrapper_state(**change):
    state = dict(dtype="float16", shape=(4, 8), stride=(1, 4), storage_offset=2, device=UUIDS[0],
                 producer="123-0123456789ab", torch_handle=b"c" + b"\0" * 64, storage_bytes=1024,
                 storage_byte_offset=0, ref_counter_handle=b"/torch_1_2", ref_counter_offset=3,
                 event_handle=b"\0" * 64, event_sync_required=True)
    state.update(change)
    return state


def test_the_torch_wrapper_carries_plain_data_and_any_stride():
    w = CudaIPCWrapper(**torch_wrapper_state())
    peer = over_the_wire(w)
    assert peer == w and peer.stride == (1, 4) and peer.storage_offset == 2


@pytest.mark.parametrize("change,match", [
    (dict(event_sync_required=1), "event_sync_required must be a bool"),
    (dict(storage_bytes=16), "needs 68 bytes of a 16-byte storage"),
    (dict(torch_handle=b""), "torch_handle is empty"),
    (dict(ref_counter_handle="not bytes"), "ref_counter_handle must be bytes"),
])
def test_malformed_torch_fields_from_a_peer_are_refused(change, match):
    with pytest.raises(WrapperDecodeError, match=match):
        CudaIPCWrapper(**torch_wrapper_state(**change))


def test_wrapping_a_cpu_tensor_with_a_cuda_wrapper_is_a_clear_error():
    for cls in (CudaIPCWrapper, RawCudaIPCWrapper, VmmCudaIPCWrapper):
        with pytest.raises(ValueError, match=f"{cls.__name__} wraps CUDA tensors, got one on cpu"):
            cls.wrap(torch.zeros(4), name="layer0")


# ---- selection ----------------------------------------------------------------------------

@pytest.fixture
def switches(monkeypatch):
    monkeypatch.delenv(ipc_policy.ISOLATED_IPC_ENV, raising=False)
    monkeypatch.delenv(ipc_policy.USE_VMM_API_ENV, raising=False)
    yield
    ipc_policy.set_isolated_ipc(None)
    ipc_policy.set_use_vmm_api(None)


@pytest.mark.parametrize("isolated,vmm,expected", [
    (False, False, CudaIPCWrapper),
    (True, False, RawCudaIPCWrapper),
    (False, True, VmmCudaIPCWrapper),
    (True, True, VmmCudaIPCWrapper),
])
def test_cuda_selection_follows_design_section_3(switches, isolated, vmm, expected):
    ipc_policy.set_isolated_ipc(isolated)
    ipc_policy.set_use_vmm_api(vmm)
    assert resolve_kv_wrapper_factory("cuda") is expected


def test_cuda_selection_reads_the_environment_at_every_call(switches, monkeypatch):
    assert resolve_kv_wrapper_factory("cuda") is CudaIPCWrapper
    monkeypatch.setenv("LMSHM_ISOLATED_IPC", "1")
    assert resolve_kv_wrapper_factory("cuda") is RawCudaIPCWrapper
    monkeypatch.setenv("LMSHM_USE_VMM_API", "on")
    assert resolve_kv_wrapper_factory("cuda") is VmmCudaIPCWrapper


# ---- the GPU tests' producer plumbing (no GPU needed for this part) ---------------------------

def test_the_spawned_producer_answers_reports_errors_and_passes_fds():
    from cuda_testing import PeerError, Producer

    with Producer() as producer:
        assert producer.pid == producer.proc.pid != os.getpid()
        out = producer.call("memfd", b"over SCM_RIGHTS")
        fd = out["fds"]["selftest"]
        try:
            assert os.pread(fd, 64, 0) == b"over SCM_RIGHTS"
        finally:
            os.close(fd)
        with pytest.raises(PeerError, match="KeyError: 'nothing'"):
            producer.call("digest", "nothing")
        producer.call("close_wrappers")
    assert not producer.proc.is_alive()


def test_threads_mapping_one_wrapper_at_once_leave_one_lease(fake_driver, as_consumer):
    import threading

    base = fake_driver.malloc(1 * MiB)
    w = RawCudaIPCWrapper.from_pointer(base, 4096, torch.uint8, (4096,), 0)
    as_consumer()
    peer = over_the_wire(w)
    barrier = threading.Barrier(4)
    tensors = []

    def map_it():
        barrier.wait()
        tensors.append(peer.to_tensor())

    threads = [threading.Thread(target=map_it) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(tensors) == 4 and fake_driver.calls["cuIpcOpenMemHandle"] == 1
    key = ("cuda-ipc", None, peer.ipc_handle)        # no session outside a server
    assert MAPPINGS.refcount(key) == 1 + 4            # the wrapper's lease + one per tensor
    tensors.clear()
    peer.close()
    w.close()
    assert fake_driver.live_mappings() == 0


@pytest.mark.parametrize("n", [1, 250, 251, 252, 251 * 3 + 7, (251 << 16) + 1000])
def test_the_fill_pattern_matches_its_formula_without_a_tensor_sized_temporary(n):
    from cuda_testing import PATTERN_PRIME, fill_pattern

    u8 = torch.zeros(n, dtype=torch.uint8)
    fill_pattern(u8, seed=7)
    want = ((torch.arange(n, dtype=torch.int64) * 131 + 7) % PATTERN_PRIME).to(torch.uint8)
    assert torch.equal(u8, want)


# ---- VMM siblings own no fd (issue 26, item 3) -------------------------------------------------

def test_closing_a_sibling_never_closes_a_file_that_reused_the_leaders_fd_number(fake_driver):
    va = fake_driver.vmm_pool(GRANULARITY, 1)
    lead = VmmCudaIPCWrapper.from_pointer(va, 256, torch.uint8, (256,), 0)
    sib = lead.sibling(256)
    fd = lead._fd
    assert sib.export_fds() == {lead.fd_token: fd}                # the leader's, while it is open
    lead.close()
    null = os.open("/dev/null", os.O_RDONLY)
    if null != fd:                                   # take the freed number for certain
        os.dup2(null, fd)
        os.close(null)
        null = fd
    try:
        sib.close()
        assert os.readlink(f"/proc/self/fd/{null}") == "/dev/null"   # still open
    finally:
        os.close(null)
    assert "_fd" not in sib.__dict__                                # sibling() never copied it


def test_a_sibling_exports_nothing_once_its_leader_is_closed(fake_driver):
    va = fake_driver.vmm_pool(GRANULARITY, 1)
    lead = VmmCudaIPCWrapper.from_pointer(va, 256, torch.uint8, (256,), 0)
    sib = lead.sibling(256)
    lead.close()
    with pytest.raises(RuntimeError, match="sibling of a leader that was closed"):
        sib.export_fds()
    sib.close()


def test_release_wrappers_closes_every_sibling_before_its_leader(fake_driver, monkeypatch):
    from lmshm.platform.kv_wrap import release_wrappers

    va = fake_driver.vmm_pool(GRANULARITY, 1)
    lead = VmmCudaIPCWrapper.from_pointer(va, 256, torch.uint8, (256,), 0)
    group = [lead, lead.sibling(256), lead.sibling(512)]
    fd = lead._fd
    seen = []
    original = VmmCudaIPCWrapper._close_extra

    def spy(self):
        seen.append((self is lead, lead.closed))
        original(self)

    monkeypatch.setattr(VmmCudaIPCWrapper, "_close_extra", spy)
    release_wrappers(group)
    assert seen == [(False, False), (False, False), (True, True)]
    with pytest.raises(OSError):
        os.fstat(fd)


# ---- VMM export nonce (issue 26, item 10) ------------------------------------------------------

def test_a_recycled_allocation_handle_value_does_not_reuse_the_old_exports_mapping(fake_driver, fd_session):
    # The producer frees a chunk and makes another; the driver hands out the same handle value.
    # A consumer still holding the first mapping must import the second chunk, not alias it.
    va1 = fake_driver.vmm_pool(GRANULARITY, 1)
    fake_driver.write(va1, b"\x11" * 16)
    w1 = VmmCudaIPCWrapper.from_pointer(va1, 16, torch.uint8, (16,), 0)
    deliver_fds(w1)
    p1 = over_the_wire(w1)
    t1 = p1.to_tensor()
    fake_driver.unmap(va1, GRANULARITY, 0)                          # the producer frees chunk 1
    fake_driver.release_allocation(w1.alloc_id, 0)
    w1.close()
    va2 = fake_driver.vmm_pool(GRANULARITY, 1)
    fake_driver.write(va2, b"\x22" * 16)
    w2 = VmmCudaIPCWrapper.from_pointer(va2, 16, torch.uint8, (16,), 0)
    assert w2.alloc_id == w1.alloc_id and w2.alloc_size == w1.alloc_size   # recycled
    deliver_fds(w2)
    p2 = over_the_wire(w2)
    t2 = p2.to_tensor()
    assert fake_driver.calls["cuMemImportFromShareableHandle"] == 2
    assert bytes(t2.tolist()) == b"\x22" * 16 and bytes(t1.tolist()) == b"\x11" * 16
    assert w2.export_nonce != w1.export_nonce
    del t1, t2
    p1.close()
    p2.close()
    w2.close()


@pytest.mark.parametrize("nonce", [-1, 1 << 64, "x", None])
def test_a_malformed_export_nonce_from_a_peer_is_refused(fake_driver, nonce):
    va = fake_driver.vmm_pool(GRANULARITY, 1)
    w = VmmCudaIPCWrapper.from_pointer(va, 16, torch.uint8, (16,), 0)
    state = dict(w.__getstate__(), export_nonce=nonce)
    with pytest.raises(WrapperDecodeError, match="export_nonce must be an int"):
        VmmCudaIPCWrapper.__new__(VmmCudaIPCWrapper).__setstate__(state)
    w.close()


# ---- hints name the allocation's real handle types (issue 26, item 8) ---------------------------

def test_vmm_on_sleep_mode_memory_says_nothing_can_export_it(fake_driver):
    va = fake_driver.vmm_pool(GRANULARITY, 1, handle_type="none")   # requestedHandleTypes never set
    with pytest.raises(VmmNotExportableError) as info:
        VmmCudaIPCWrapper.from_pointer(va, 16, torch.uint8, (16,), 0, name="kv")
    msg = str(info.value)
    assert "requestedHandleTypes=NONE" in msg and "sleep mode" in msg and "cumem_allocator" in msg
    assert "cannot export it as any shareable handle" in msg and "empty_vmm" in msg
    assert "LMSHM_VMM_HANDLE_TYPE=posix-fd|fabric" not in msg


def test_vmm_fabric_only_memory_asked_for_a_posix_fd_names_expandable_segments_fabric_first(fake_driver):
    va = fake_driver.vmm_pool(GRANULARITY, 1, handle_type="fabric")
    with pytest.raises(VmmNotExportableError) as info:
        VmmCudaIPCWrapper.from_pointer(va, 16, torch.uint8, (16,), 0, handle_type="posix-fd")
    msg = str(info.value)
    assert "requestedHandleTypes=FABRIC, not POSIX_FILE_DESCRIPTOR" in msg
    assert "try FABRIC first" in msg and "LMSHM_VMM_HANDLE_TYPE=fabric" in msg


def test_vmm_posix_fd_memory_asked_for_fabric_says_to_export_a_posix_fd(fake_driver):
    va = fake_driver.vmm_pool(GRANULARITY, 1)
    with pytest.raises(VmmNotExportableError, match=r"not FABRIC: export it as a POSIX fd \(LMSHM_VMM_HANDLE_TYPE=posix-fd"):
        VmmCudaIPCWrapper.from_pointer(va, 16, torch.uint8, (16,), 0, handle_type="fabric")


def test_vmm_on_cudamalloc_memory_says_what_allocation_the_vmm_wrapper_needs(fake_driver):
    base = fake_driver.malloc(1 * MiB)
    with pytest.raises(NotVmmMemoryError) as info:
        VmmCudaIPCWrapper.from_pointer(base, 16, torch.uint8, (16,), 0)
    msg = str(info.value)
    assert "cuMemCreate with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in CUmemAllocationProp.requestedHandleTypes" in msg
    assert "lmshm.platform.cuda.empty_vmm" in msg


# ---- quiesce before unmap (issue 26, item 7) ---------------------------------------------------

@pytest.fixture
def copy_stream(fake_driver):
    from lmshm.platform.cuda import streams

    s = fake_driver.stream_create(0)
    streams.register(s, 0)
    yield s
    streams.unregister(s, 0)
    fake_driver.finish_stream(s)


def test_quiesce_is_true_with_no_streams_and_with_idle_ones(fake_driver, copy_stream):
    from lmshm.platform.cuda import streams

    assert streams.registered(0) == [copy_stream] and streams.registered(1) == []
    assert streams.quiesce(1)                                   # nothing registered on cuda:1
    assert fake_driver.calls["cuEventRecord"] == 0
    assert streams.quiesce(0, timeout_s=1.0)
    assert fake_driver.calls["cuEventRecord"] == 1 and fake_driver.events == {}   # destroyed


def test_quiesce_is_false_when_a_stream_never_drains(fake_driver, copy_stream):
    import time

    from lmshm.platform.cuda import streams

    fake_driver.hold_stream(copy_stream)
    t0 = time.monotonic()
    assert not streams.quiesce(0, timeout_s=0.05)
    assert 0.05 <= time.monotonic() - t0 < 2 and fake_driver.events == {}
    fake_driver.finish_stream(copy_stream)
    assert streams.quiesce(0, timeout_s=0.05)


def test_one_sessions_hung_stream_never_delays_another_sessions_unmap(fake_driver):
    from lmshm.platform.cuda import streams

    hung, idle = fake_driver.stream_create(0), fake_driver.stream_create(0)
    streams.register(hung, 0, "session-a")
    streams.register(idle, 0, "session-b")
    try:
        fake_driver.hold_stream(hung)
        assert streams.quiesce(0, timeout_s=0.05, scope="session-b")        # b's mappings: only b's streams
        assert not streams.quiesce(0, timeout_s=0.05, scope="session-a")
        assert not streams.quiesce(0, timeout_s=0.05)                        # unscoped: every stream
        assert streams.registered(0, "session-b") == [idle]
    finally:
        fake_driver.finish_stream(hung)
        streams.unregister(hung, 0, "session-a")
        streams.unregister(idle, 0, "session-b")
        fake_driver.stream_destroy(hung, 0)
        fake_driver.stream_destroy(idle, 0)
    assert streams.registered(0) == []


def test_a_stream_registered_twice_stays_until_unregistered_twice(fake_driver):
    from lmshm.platform.cuda import streams

    s = fake_driver.stream_create(0)
    streams.register(s, 0)
    streams.register(s, 0)
    streams.unregister(s, 0)
    assert streams.registered(0) == [s]
    streams.unregister(s, 0)
    streams.unregister(s, 0)                                    # unknown now: ignored
    assert streams.registered(0) == []


def test_an_unreadable_stream_counts_as_busy(fake_driver, copy_stream):
    from lmshm.platform.cuda import streams

    fake_driver.fail_next("cuEventRecord", "CUDA_ERROR_INVALID_HANDLE")
    assert not streams.quiesce(0, timeout_s=0.05)
    assert fake_driver.events == {}


def _mapped_vmm(fake_driver):
    va = fake_driver.vmm_pool(GRANULARITY, 1)
    w = VmmCudaIPCWrapper.from_pointer(va, 16, torch.uint8, (16,), 0)
    deliver_fds(w)
    peer = over_the_wire(w)
    peer.to_tensor()                                            # dropped at once: the lease alone holds it
    return w, peer


def _mapped_raw(fake_driver, as_consumer):
    base = fake_driver.malloc(1 * MiB)
    w = RawCudaIPCWrapper.from_pointer(base, 16, torch.uint8, (16,), 0)
    as_consumer()
    peer = over_the_wire(w)
    peer.to_tensor()
    return w, peer


@pytest.mark.parametrize("kind,unmap", [("vmm", "cuMemUnmap"), ("raw", "cuIpcCloseMemHandle")])
def test_the_last_close_waits_for_the_copy_streams_then_unmaps(fake_driver, as_consumer, fd_session,
                                                              copy_stream, kind, unmap):
    w, peer = _mapped_vmm(fake_driver) if kind == "vmm" else _mapped_raw(fake_driver, as_consumer)
    peer.close()
    seq = fake_driver.sequence
    assert seq.index("cuEventRecord") < seq.index("cuEventQuery") < seq.index(unmap)
    assert fake_driver.live_mappings() == 0
    w.close()


@pytest.mark.parametrize("kind,unmap", [("vmm", "cuMemUnmap"), ("raw", "cuIpcCloseMemHandle")])
def test_a_close_under_a_stream_that_never_drains_leaks_the_mapping_instead_of_unmapping(
        fake_driver, as_consumer, fd_session, copy_stream, monkeypatch, caplog, kind, unmap):
    import functools

    from lmshm.platform.cuda import streams

    monkeypatch.setattr(streams, "quiesce", functools.partial(streams.quiesce, timeout_s=0.05))
    w, peer = _mapped_vmm(fake_driver) if kind == "vmm" else _mapped_raw(fake_driver, as_consumer)
    fake_driver.hold_stream(copy_stream)
    leaked = streams.LEAKED_MAPPINGS
    with caplog.at_level(logging.ERROR, logger="lmshm.platform.cuda.streams"):
        peer.close()
    assert fake_driver.calls[unmap] == 0 and fake_driver.live_mappings() == 1
    assert streams.LEAKED_MAPPINGS == leaked + 1
    assert "not unmapping" in caplog.text and "leaked" in caplog.text
    w.close()


def test_releasing_a_vmm_allocation_synchronizes_before_it_unmaps(fake_driver):
    from lmshm.platform.cuda.vmm_alloc import VmmAllocation

    alloc = VmmAllocation(3 * GRANULARITY, 0, "posix-fd", GRANULARITY)
    alloc.release()
    seq = fake_driver.sequence
    assert seq.count("cuMemUnmap") == 3
    assert seq.index("cuCtxSynchronize") < seq.index("cuMemUnmap")
    alloc.release()                                             # idempotent: nothing more
    assert fake_driver.sequence.count("cuCtxSynchronize") == 1


# ---- cuda-torch on expandable segments (issue 26, item 10) -------------------------------------

def test_cuda_torch_on_expandable_segments_says_the_server_needs_pidfd_getfd_rights(monkeypatch):
    expandable = CudaIPCWrapper(**torch_wrapper_state(torch_handle=b"\x02e" + b"\0" * 64))
    malloc = CudaIPCWrapper(**torch_wrapper_state(torch_handle=b"\x02c" + b"\0" * 64))
    assert expandable.expandable_segment and not malloc.expandable_segment

    def refuse(*args):
        raise RuntimeError("pidfd_getfd: Operation not permitted")

    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", staticmethod(refuse), raising=False)
    with pytest.raises(RuntimeError) as info:
        expandable._open(0)
    msg = str(info.value)
    assert "pidfd_getfd: Operation not permitted" in msg and "expandable_segments:True" in msg
    assert "PID namespace" in msg and "CAP_SYS_PTRACE" in msg and "ptrace_scope" in msg
    assert "LMSHM_USE_VMM_API=1" in msg
    with pytest.raises(RuntimeError, match=r"^pidfd_getfd: Operation not permitted$"):
        malloc._open(0)                                         # cudaMalloc blocks: torch's error as is


def test_fabric_imports_and_allocations_ask_the_granularity_of_fabric_handles(fake_driver, as_consumer):
    """cuMemGetAllocationGranularity answers per allocation property, requestedHandleTypes
    included: asking without the handle type asked about some other allocation (issue 42 §4)."""
    from lmshm.platform.cuda.vmm_alloc import VmmAllocation

    va = fake_driver.vmm_pool(GRANULARITY, 1, handle_type="fabric")
    w = VmmCudaIPCWrapper.from_pointer(va, 1024, torch.bfloat16, (512,), 0, handle_type="fabric")
    as_consumer()
    peer = over_the_wire(w)
    t = peer.to_tensor()
    del t
    peer.close()
    w.close()
    assert fake_driver.granularity_queries == ["fabric"]
    alloc = VmmAllocation(GRANULARITY, 0, "fabric", None)
    alloc.release()
    assert fake_driver.granularity_queries == ["fabric", "fabric"]


def test_two_sessions_naming_one_raw_handle_each_close_their_own_mapping_after_their_own_streams(
        fake_driver, as_consumer, monkeypatch):
    """Keyed by the handle alone, a raw mapping opened by session A was shared with session B,
    and its last close quiesced only A's copy streams: B's copies could still run into it."""
    import functools

    from lmshm.platform.base.mappings import MAPPINGS
    from lmshm.platform.base.peer import local_peer
    from lmshm.platform.cuda import streams

    monkeypatch.setattr(streams, "quiesce", functools.partial(streams.quiesce, timeout_s=0.05))
    base = fake_driver.malloc(1 * MiB)
    w = RawCudaIPCWrapper.from_pointer(base, 16, torch.uint8, (16,), 0)
    as_consumer()
    a, b = over_the_wire(w), over_the_wire(w)
    a.admit(local_peer("session-a"))
    b.admit(local_peer("session-b"))
    a.to_tensor()
    b.to_tensor()
    assert sorted(k[1] for k in MAPPINGS.keys() if k[0] == "cuda-ipc") == ["session-a", "session-b"]
    assert fake_driver.calls["cuIpcOpenMemHandle"] == 2                   # one open each: the driver counts
    busy = fake_driver.stream_create(0)
    streams.register(busy, 0, "session-b")                                # B's copy still runs
    fake_driver.hold_stream(busy)
    try:
        a.close()                                                         # A's own: closed at once
        assert fake_driver.calls["cuIpcCloseMemHandle"] == 1 and fake_driver.live_mappings() == 1
        b.close()                                                         # under B's copy: leaked, not closed
        assert fake_driver.calls["cuIpcCloseMemHandle"] == 1
    finally:
        streams.unregister(busy, 0, "session-b")
        fake_driver.finish_stream(busy)
        if fake_driver.live_mappings():                                   # what the leak kept
            fake_driver.ipc_close(next(iter(fake_driver.ipc_open_refs)), 0)
        w.close()
