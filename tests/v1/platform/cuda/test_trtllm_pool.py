"""The TRT-LLM adapter's device-pool registration.

With the FAKE driver (logic only: which memory is refused, and why; what the wrapper covers),
and on a GPU (skipped without one): a cudaMalloc pool registered with a real lmshm-server as one
raw IPC wrapper, block dim 0.
"""

from __future__ import annotations

import pytest
import torch

from lmshm.integrations.trtllm import PoolPointer, TrtllmKVPool, UnsupportedPoolMemory, wrap_device_pool
from lmshm.platform.cuda.raw_ipc import RawCudaIPCWrapper

MiB = 1 << 20
SHAPE = (32, 4, 2, 16, 2, 64)   # [blocks, layers, K/V, tokens per block, heads, head size]


def _nbytes(dtype: torch.dtype = torch.float16) -> int:
    n = dtype.itemsize
    for s in SHAPE:
        n *= s
    return n


def test_a_cudamalloc_pool_becomes_one_raw_wrapper_over_the_whole_pool(fake_driver):
    base = fake_driver.malloc(_nbytes() + MiB)
    w = wrap_device_pool(PoolPointer(base + 4096, SHAPE, torch.float16, 0))
    assert isinstance(w, RawCudaIPCWrapper)
    assert w.shape == SHAPE and w.alloc_offset == 4096 and w.nbytes == _nbytes()
    w.close()


def test_unified_memory_is_refused_with_the_reason(fake_driver):
    ptr = fake_driver.malloc_managed(_nbytes())
    with pytest.raises(UnsupportedPoolMemory, match="unified memory.*cudaMallocManaged.*no CUDA IPC handle"):
        wrap_device_pool(PoolPointer(ptr, SHAPE, torch.float16, 0))


def test_a_vmm_pool_is_refused_with_what_to_use_instead(fake_driver):
    ptr = fake_driver.vmm_pool(2 * MiB, 2)
    shape = (16, 4, 2, 16, 2, 64)
    with pytest.raises(UnsupportedPoolMemory, match="not cudaMalloc memory.*VMM.*LMSHM_USE_VMM_API"):
        wrap_device_pool(PoolPointer(ptr, shape, torch.float16, 0))


def test_a_pool_of_another_shape_is_refused():
    with pytest.raises(ValueError, match=r"\[blocks, layers, 2, \.\.\.\]"):
        TrtllmKVPool(torch.zeros(4, 2, 3, 8), model="m", tokens_per_block=8, link=object())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")
def test_gpu_a_cudamalloc_pool_registers_with_a_real_server():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "server"))
    from harness import ServerProcess, scratch_dir

    from lmshm.transport.client import query_status

    pool = torch.zeros(SHAPE, dtype=torch.float16, device="cuda:0")
    with scratch_dir() as tmp:
        server = ServerProcess(tmp)
        try:
            kv = TrtllmKVPool(pool, model="tiny", tokens_per_block=16, url=server.url)
            kv.register("trtllm-gpu")
            assert kv.link.wait_connected(30) and kv.link.instance_id == "trtllm-gpu"
            (reg,) = query_status(server.url).registrations
            assert reg.kinds == ["cuda-raw"] and reg.nbytes == _nbytes() and reg.num_layers == 1
            kv.close()
        finally:
            assert server.stop() == 0, server.log()
