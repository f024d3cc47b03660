"""CUDA regions from ``tritonclient.utils.cuda_shared_memory``, registered over HTTP and gRPC
with an application that embeds ``lmshm.Server``. Needs a GPU (``scripts/gpu-check`` runs it).

The client (this process) allocates and exports; the server (the embedded app, another OS
process) opens the handle: the driver refuses to open it in the exporting process.

Written against tritonclient 2.73's ``cuda_shared_memory``: ``set_shared_memory_region(handle,
values)`` and ``get_contents_as_numpy(handle, datatype, shape)`` take no ``offset`` (unlike
``tritonclient.utils.shared_memory``'s): reads take the region's prefix and slice it.
"""

from __future__ import annotations

import numpy as np
import pytest
from triton_harness import STATUS, Triton

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture
def cuda_shm():
    cudashm = pytest.importorskip("tritonclient.utils.cuda_shared_memory")
    made = []

    def make(byte_size: int):
        handle = cudashm.create_shared_memory_region(f"lmshm_gpu_{len(made)}", byte_size, 0)
        made.append(handle)
        return cudashm, handle

    yield make
    for handle in made:
        cudashm.destroy_shared_memory_region(handle)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_gpu_cuda_region_register_status_view_both_ways_and_unregister(app, cuda_shm, protocol):
    cudashm, handle = cuda_shm(1 << 20)
    cudashm.set_shared_memory_region(handle, [np.arange(256, dtype=np.uint8)])
    c = Triton(protocol, app)
    try:
        raw = cudashm.get_raw_handle(handle)
        c.register_cuda("gpu0", raw, 0, 1 << 20)
        assert c.cuda_status() == [{"name": "gpu0", "device_id": 0, "byte_size": 1 << 20}]
        status, message = c.error(c.status, "gpu0")
        assert status == STATUS["NOT_FOUND"][protocol] and "is a CUDA shared memory region" in message
        status, _ = c.error(c.register_cuda, "gpu0", raw, 0, 1 << 20)
        assert status == STATUS["ALREADY_EXISTS"][protocol]
        view = app.ok("view", name="gpu0", offset=0, byte_size=256)["view"]
        try:
            assert bytes.fromhex(app.ok("read", view=view)["hex"]) == bytes(range(256))
            app.ok("write", view=view, hex="ab" * 16, at=32)
            # 2.73: no offset argument; read the first 48 bytes and slice
            got = cudashm.get_contents_as_numpy(handle, np.uint8, [48])
            assert bytes(got[32:48]) == b"\xab" * 16 and bytes(got[:32]) == bytes(range(32))
            c.unregister_cuda("gpu0")
            assert c.cuda_status() == [] and app.ok("status")["draining"] == 1
        finally:
            app.ok("close", view=view)
        assert app.ok("status")["draining"] == 0
    finally:
        c.unregister_cuda()
        c.close()


def test_gpu_cuda_region_larger_than_its_allocation_is_invalid(app, cuda_shm):
    cudashm, handle = cuda_shm(1 << 20)
    c = Triton("grpc", app)
    try:
        status, message = c.error(c.register_cuda, "toolarge", cudashm.get_raw_handle(handle), 0, 64 << 20)
        assert status == STATUS["INVALID_ARG"]["grpc"] and "cannot open the CUDA IPC handle" in message
        assert c.cuda_status() == []
    finally:
        c.close()
