"""CUDA registrations of one allocation travel as one group: one handle, per-layer offsets.

Against ``fake_driver`` (a FAKE of the driver gateway: logic only). test_cuda_gpu.py covers the
same on a GPU (``test_gpu_layers_of_one_allocation_register_as_one_group``).
"""

from __future__ import annotations

import pytest
import torch

from lmshm.platform.base.ipc_wrapper import DeviceIPCWrapper, WrapperDecodeError
from lmshm.platform.base.mappings import MAPPINGS
from lmshm.platform.cuda import RawCudaIPCWrapper
from lmshm.transport.client import layer_groups

MiB = 1 << 20
LAYERS, LAYER_BYTES = 4, 64 * 1024


class _At:
    """Stands in for a producer tensor: only its address matters to ``sibling_for``."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


def _group(fake_driver, base: int) -> list:
    leader = RawCudaIPCWrapper.from_pointer(base, LAYER_BYTES, torch.float16, (16, 2048), 0, name="layer0")
    leader._keepalive = _At(base)
    return [leader] + [leader.sibling_for(_At(base + i * LAYER_BYTES), 0) for i in range(1, LAYERS)]


def test_the_layers_of_one_allocation_become_one_wire_group(fake_driver):
    base = fake_driver.malloc(1 * MiB)
    wrappers = _group(fake_driver, base)
    assert [w.storage_offset for w in wrappers] == [i * LAYER_BYTES // 2 for i in range(LAYERS)]
    (group,) = layer_groups([f"l{i}" for i in range(LAYERS)], wrappers)
    assert group.storage_offsets == [w.storage_offset for w in wrappers] and len(group.names) == LAYERS


def test_the_consumer_opens_the_allocation_once_and_sees_every_layer(fake_driver, as_consumer):
    base = fake_driver.malloc(1 * MiB)
    for i in range(LAYERS):
        fake_driver.write(base + i * LAYER_BYTES, bytes([i + 1]) * 8)
    wrappers = _group(fake_driver, base)
    as_consumer()
    peer = DeviceIPCWrapper.Deserialize(wrappers[0].Serialize())
    opens = fake_driver.calls["cuIpcOpenMemHandle"]
    t = peer.to_tensor()
    for i, w in enumerate(wrappers):
        layer = t.as_strided(t.size(), t.stride(), w.storage_offset)   # what the registry does per layer
        assert bytes(layer.view(torch.uint8).flatten()[:8].tolist()) == bytes([i + 1]) * 8
    assert fake_driver.calls["cuIpcOpenMemHandle"] == opens + 1
    layer3 = t.as_strided(t.size(), t.stride(), wrappers[3].storage_offset)
    layer3.view(torch.uint8).view(-1)[0] = 0xEE                       # zero copy, layer 3
    assert fake_driver.read(base + 3 * LAYER_BYTES, 1) == b"\xee"
    with pytest.raises(RuntimeError):                                   # past the allocation's end
        t.as_strided(t.size(), t.stride(), (1 * MiB) // 2)
    del t, layer, layer3
    peer.close()
    assert not [k for k in MAPPINGS.keys() if "cuda" in str(k)]


def test_a_sibling_outside_its_allocation_is_refused(fake_driver):
    base = fake_driver.malloc(1 * MiB)
    leader = _group(fake_driver, base)[0]
    assert leader.sibling_for(_At(base - 2), 0) is None                  # before the leader
    assert leader.sibling_for(_At(base + 1 * MiB), 0) is None            # past the allocation
    assert leader.sibling_for(_At(base + 1), 0) is None                  # not on an element
    state = leader.sibling(1 * MiB // 2).__getstate__()
    with pytest.raises(WrapperDecodeError, match="do not fit an allocation"):
        RawCudaIPCWrapper(**state)                                      # a peer's oversized offset
