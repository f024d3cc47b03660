"""STORE and RETRIEVE on a CUDA registration: the order of the GPU work the data plane asks for.

Against ``fake_driver`` and ``FakeCudaSync`` (FAKES: logic only). The same requests run on a GPU,
through a real server and a worker process, in ``test_cuda_server_e2e.py``
(``test_gpu_store_and_retrieve_are_ordered_by_events``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fake_sync import FakeCudaSync
from lmshm.core.dataplane import DataPlane
from lmshm.multiprocess import protocol
from lmshm.multiprocess.protocol import ErrorCode, LayerGroup
from lmshm.core.registry import Registry
from lmshm.platform.base.ipc_wrapper import DeviceIPCWrapper
from lmshm.platform.base.peer import local_peer
from lmshm.platform.cuda import RawCudaIPCWrapper

BLOCKS, BLOCK_SHAPE = 8, (2, 16, 8)                   # float16: 512 bytes a block
BLOCK_BYTES = 2 * 16 * 8 * 2
LAYER_BYTES = BLOCKS * BLOCK_BYTES


@pytest.fixture
def gpu_registration(fake_driver, as_consumer):
    base = fake_driver.malloc(1 << 20)
    for layer in range(2):
        for b in range(BLOCKS):
            fake_driver.write(base + layer * LAYER_BYTES + b * BLOCK_BYTES, bytes([16 * layer + b + 1]) * BLOCK_BYTES)
    leader = RawCudaIPCWrapper.from_pointer(base, LAYER_BYTES, torch.float16, (BLOCKS, *BLOCK_SHAPE), 0)
    as_consumer()
    wire = DeviceIPCWrapper.Deserialize(leader.Serialize())
    registry = Registry()
    peer = local_peer("s1")
    registry.register(peer=peer, instance_id="gpu", model_name="m", world_size=1, worker_rank=0,
                      groups=[LayerGroup(wire, ["l0", "l1"], [0, LAYER_BYTES // 2])])
    replies: list = []
    sync = FakeCudaSync()
    dp = DataPlane(registry=registry, capacity=1 << 20, copy_threads=1, lease_ttl_s=30, max_inflight_per_session=8,
                   max_leases_per_session=8, reply=lambda i, r, rep: replies.append(rep), cuda_sync=sync)
    session = SimpleNamespace(id="s1", peer=peer, ended=False)
    yield SimpleNamespace(dp=dp, sync=sync, replies=replies, session=session, base=base, fake=fake_driver)
    dp.shutdown()
    registry.release_all()
    leader.close()


def run(dp, session, req):
    d = dp.store(session, req) if isinstance(req, protocol.Store) else dp.retrieve(session, req)
    d.job(b"id", b"rid")


def block(fake, base, layer, b) -> bytes:
    return fake.read(base + layer * LAYER_BYTES + b * BLOCK_BYTES, BLOCK_BYTES)


def test_a_store_waits_for_the_worker_replies_then_commits_after_the_gpu_is_done(gpu_registration):
    g = gpu_registration
    seen_at_sync = []
    g.sync.on_synchronize = lambda: seen_at_sync.append((len(g.replies), g.dp.pool.info()["objects"]))
    run(g.dp, g.session, protocol.Store("gpu", [b"k0"], [1, 2], 2, event=b"W" * 64))
    (reply,) = g.replies
    assert reply.results == [protocol.StoreResult.STORED] and reply.event == bytes([1]) * 64
    # the worker's event first; then the copies (2 layers x 1 run); the server's event; the reply;
    # and only then the wait for that event, after which the chunk becomes visible
    assert g.sync.log == ["stream:0", "wait:W", "pin", "copy", "copy", "record:1", "sync:event1"]
    assert seen_at_sync == [(1, 0)]
    assert g.dp.pool.info()["objects"] == 1 and len(g.dp.events) == 1


def test_a_retrieve_writes_the_blocks_and_unpins_only_after_the_gpu_read_them(gpu_registration):
    g = gpu_registration
    run(g.dp, g.session, protocol.Store("gpu", [b"k0"], [1, 2], 2, event=b"W" * 64))
    hits, lease = g.dp.pool.lookup(g.session.peer.uid, [[b"k0"]], "s1", 30)
    assert hits == 1
    pinned_at_sync = []
    g.sync.on_synchronize = lambda: pinned_at_sync.append(g.dp.pool.info()["pinned"])
    g.sync.log.clear()
    run(g.dp, g.session, protocol.Retrieve("gpu", [b"k0"], [5, 6], 2, lease, event=b"X" * 64))
    reply = g.replies[-1]
    assert isinstance(reply, protocol.RetrieveReply) and reply.chunks == 1 and reply.event == bytes([2]) * 64
    assert g.sync.log == ["stream:0", "wait:X", "pin", "copy", "copy", "record:2", "sync:event2"]
    assert pinned_at_sync == [1] and g.dp.pool.info()["pinned"] == 0 and g.dp.pool.info()["leases"] == 0
    for layer in range(2):
        assert block(g.fake, g.base, layer, 5) == block(g.fake, g.base, layer, 1)
        assert block(g.fake, g.base, layer, 6) == block(g.fake, g.base, layer, 2)
        assert block(g.fake, g.base, layer, 7) == bytes([16 * layer + 8]) * BLOCK_BYTES   # untouched


def test_an_unusable_worker_event_stores_nothing(gpu_registration):
    g = gpu_registration
    run(g.dp, g.session, protocol.Store("gpu", [b"k0"], [1, 2], 2, event=b"short"))
    (reply,) = g.replies
    assert isinstance(reply, protocol.ErrorReply) and reply.code == ErrorCode.INVALID_ARG
    assert "64 bytes" in reply.message and "nothing was stored" in reply.message
    info = g.dp.pool.info()
    assert (info["objects"], info["in_flight"], info["used"], info["failed"]) == (0, 0, 0, 1)
    assert "copy" not in g.sync.log


def test_a_sessions_events_go_with_it(gpu_registration):
    g = gpu_registration
    run(g.dp, g.session, protocol.Store("gpu", [b"k0"], [1, 2], 2))
    assert "wait:W" not in g.sync.log and len(g.dp.events) == 1   # no worker event: nothing to wait on
    g.dp.session_ended("s1")
    assert len(g.dp.events) == 0


# vLLM 0.32 layouts on a GPU (tests/v1/multiprocess/test_kv_layouts.py has the table): a head-major
# layer (LHBNC: H runs a block, each layer one [B, H, N, C] view) and a block-outermost cache
# registered whole ([L, B, H, N, C], BLNHC, block_dim 1).
L, B, H, N, C = 2, 8, 2, 4, 8                     # float16


def _strides(shape, order):
    strides, step = [0] * len(shape), 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    return tuple(strides)


@pytest.mark.parametrize("layout", ["head-major", "block-outermost"])
def test_multi_run_and_block_dim_layouts_copy_contiguous_pieces_and_the_right_bytes(fake_driver, as_consumer, layout):
    shape5 = (L, B, H, N, C)
    nbytes = L * B * H * N * C * 2
    base = fake_driver.malloc(nbytes)
    fake_driver.write(base, bytes(torch.randint(0, 256, (nbytes,), dtype=torch.uint8).tolist()))
    if layout == "head-major":                     # physical [L, H, B, N, C]; one view per layer
        s5 = _strides(shape5, (0, 2, 1, 3, 4))
        leader = RawCudaIPCWrapper.from_pointer(base, nbytes // L, torch.float16, shape5[1:], 0, stride=s5[1:])
        groups, block_dim = lambda w: [LayerGroup(w, ["l0", "l1"], [0, s5[0]])], 0
    else:                                          # physical [B, L, N, H, C]; the whole cache
        s5 = _strides(shape5, (1, 0, 3, 2, 4))
        leader = RawCudaIPCWrapper.from_pointer(base, nbytes, torch.float16, shape5, 0, stride=s5)
        groups, block_dim = lambda w: [LayerGroup(w, ["kv"], [0])], 1
    as_consumer()
    wire = DeviceIPCWrapper.Deserialize(leader.Serialize())
    registry, peer, sync = Registry(), local_peer("s1"), FakeCudaSync()
    registry.register(peer=peer, instance_id="gpu", model_name="m", world_size=1, worker_rank=0,
                      groups=groups(wire), block_dim=block_dim)
    replies: list = []
    dp = DataPlane(registry=registry, capacity=1 << 20, copy_threads=1, lease_ttl_s=30, max_inflight_per_session=8,
                   max_leases_per_session=8, reply=lambda i, r, rep: replies.append(rep), cuda_sync=sync)
    session = SimpleNamespace(id="s1", peer=peer, ended=False)

    def cache() -> torch.Tensor:      # [L, B, H, N, C] as the worker sees it
        raw = torch.tensor(list(fake_driver.read(base, nbytes)), dtype=torch.uint8).view(torch.float16)
        return raw.as_strided(shape5, s5)

    try:
        before = cache().clone()
        run(dp, session, protocol.Store("gpu", [b"k0"], [2, 3, 4, 6], 4))
        assert isinstance(replies[-1], protocol.StoreReply), replies[-1]
        # head-major: per layer, per head, blocks 2-4 are one piece and block 6 another: 2*2*2;
        # block-outermost: a block is one run, so blocks 2-4 are one piece, block 6 another
        assert sync.log.count("copy") == (8 if layout == "head-major" else 2)
        sync.log.clear()
        run(dp, session, protocol.Retrieve("gpu", [b"k0"], [7, 0, 1, 5], 4))
        assert isinstance(replies[-1], protocol.RetrieveReply), replies[-1]
        assert sync.log.count("copy") == (12 if layout == "head-major" else 3)
        after = cache()
        for src, dst in zip([2, 3, 4, 6], [7, 0, 1, 5]):
            assert torch.equal(after[:, dst].view(torch.int16), before[:, src].view(torch.int16)), (src, dst)
        for untouched in (2, 3, 4, 6):
            assert torch.equal(after[:, untouched].view(torch.int16), before[:, untouched].view(torch.int16))
    finally:
        dp.shutdown()
        registry.release_all()
        leader.close()
