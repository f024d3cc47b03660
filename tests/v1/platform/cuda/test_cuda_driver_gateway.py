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
