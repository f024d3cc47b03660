"""Process-wide switches and wrapper selection."""

from __future__ import annotations

import pytest

from lmshm.platform import ipc_policy
from lmshm.platform.cpu import CpuFdIPCWrapper, CpuShmIPCWrapper
from lmshm.platform.device_registry import resolve_kv_wrapper_factory


@pytest.fixture(autouse=True)
def _reset_switches(monkeypatch):
    monkeypatch.delenv(ipc_policy.ISOLATED_IPC_ENV, raising=False)
    monkeypatch.delenv(ipc_policy.USE_VMM_API_ENV, raising=False)
    monkeypatch.delenv(ipc_policy.CPU_SEGMENTS_ENV, raising=False)
    yield
    ipc_policy.set_isolated_ipc(None)
    ipc_policy.set_use_vmm_api(None)
    ipc_policy.set_cpu_segments(None)


def test_switches_default_off_and_follow_the_environment(monkeypatch):
    assert not ipc_policy.is_isolated_ipc() and not ipc_policy.is_use_vmm_api()
    monkeypatch.setenv("LMSHM_ISOLATED_IPC", "1")
    monkeypatch.setenv("LMSHM_USE_VMM_API", "true")
    assert ipc_policy.is_isolated_ipc() and ipc_policy.is_use_vmm_api()


def test_a_value_set_in_code_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("LMSHM_ISOLATED_IPC", "1")
    ipc_policy.set_isolated_ipc(False)
    assert not ipc_policy.is_isolated_ipc()
    ipc_policy.set_isolated_ipc(None)
    assert ipc_policy.is_isolated_ipc()


def test_a_garbled_environment_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("LMSHM_ISOLATED_IPC", "maybe")
    with pytest.raises(ValueError, match="LMSHM_ISOLATED_IPC='maybe' is not a boolean"):
        ipc_policy.is_isolated_ipc()


def test_set_refuses_non_booleans():
    with pytest.raises(TypeError):
        ipc_policy.set_isolated_ipc("yes")  # type: ignore[arg-type]


def test_cpu_selection_is_evaluated_at_every_call(monkeypatch):
    assert resolve_kv_wrapper_factory("cpu") is CpuFdIPCWrapper          # the default: sealed memfd
    ipc_policy.set_cpu_segments("shm")
    assert resolve_kv_wrapper_factory("cpu") is CpuShmIPCWrapper
    ipc_policy.set_isolated_ipc(True)                                     # isolated: always memfd
    assert resolve_kv_wrapper_factory("cpu") is CpuFdIPCWrapper
    ipc_policy.set_isolated_ipc(False)
    assert resolve_kv_wrapper_factory("cpu") is CpuShmIPCWrapper
    ipc_policy.set_cpu_segments(None)
    monkeypatch.setenv("LMSHM_CPU_SEGMENTS", "shm")
    assert resolve_kv_wrapper_factory("cpu") is CpuShmIPCWrapper


def test_a_tensor_already_in_a_segment_keeps_its_kind_unless_isolated(no_leftovers):
    import torch

    from lmshm.platform.cpu import empty_shared

    named, sealed = empty_shared((8,), torch.uint8, kind="shm"), empty_shared((8,), torch.uint8, kind="memfd")
    assert resolve_kv_wrapper_factory("cpu", named) is CpuShmIPCWrapper       # no migration, no copy
    assert resolve_kv_wrapper_factory("cpu", sealed) is CpuFdIPCWrapper
    ipc_policy.set_cpu_segments("shm")
    assert resolve_kv_wrapper_factory("cpu", sealed) is CpuFdIPCWrapper
    assert resolve_kv_wrapper_factory("cpu", torch.zeros(8)) is CpuShmIPCWrapper  # private: the switch
    ipc_policy.set_isolated_ipc(True)
    assert resolve_kv_wrapper_factory("cpu", named) is CpuFdIPCWrapper        # a name is useless there


@pytest.fixture
def no_leftovers():
    import gc
    import os

    before = set(os.listdir("/dev/shm"))
    yield
    gc.collect()
    assert set(os.listdir("/dev/shm")) - before == set()


def test_a_garbled_segment_kind_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("LMSHM_CPU_SEGMENTS", "posix")
    with pytest.raises(ValueError, match="LMSHM_CPU_SEGMENTS='posix' is not a CPU segment kind"):
        ipc_policy.cpu_segment_kind()
    with pytest.raises(ValueError, match="'memfd' or 'shm'"):
        ipc_policy.set_cpu_segments("posix")


def test_cuda_selection_follows_the_switches_without_importing_cuda_libraries():
    import sys

    from lmshm.platform import cuda

    assert resolve_kv_wrapper_factory("cuda") is cuda.CudaIPCWrapper
    ipc_policy.set_isolated_ipc(True)
    assert resolve_kv_wrapper_factory("cuda") is cuda.RawCudaIPCWrapper
    ipc_policy.set_use_vmm_api(True)
    assert resolve_kv_wrapper_factory("cuda") is cuda.VmmCudaIPCWrapper
    assert "cupy" not in sys.modules and "cuda.bindings" not in sys.modules


def test_unknown_device_type_names_the_supported_ones():
    with pytest.raises(ValueError, match="no IPC wrapper for device type 'xpu'.*cpu, cuda"):
        resolve_kv_wrapper_factory("xpu")
