"""STORE and RETRIEVE on a CUDA registration: the order of the GPU work the data plane asks for.

Against ``fake_driver`` and ``FakeCudaSync`` (FAKES: logic only). The same requests run on a GPU,
through a real server and a worker process, in ``test_cuda_server_e2e.py``
(``test_gpu_store_and_retrieve_are_ordered_by_events``).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from fake_sync import FakeCudaSync

from lmshm.core.dataplane import DataPlane, DataPlaneConfig
from lmshm.core.pool import Pool
from lmshm.core.registry import Registry
from lmshm.platform.base.ipc_wrapper import DeviceIPCWrapper
from lmshm.platform.base.peer import local_peer
from lmshm.platform.cuda import RawCudaIPCWrapper
from lmshm.wire import protocol
from lmshm.wire.protocol import ErrorCode, LayerGroup

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
    dp = DataPlane(DataPlaneConfig(copy_threads=1, max_inflight_per_session=8, max_leases_per_session=8),
                   registry=registry, pool=Pool(1 << 20), reply=lambda i, r, rep: replies.append(rep),
                   cuda_sync=sync)
    session = SimpleNamespace(id="s1", peer=peer, ended=False)
    yield SimpleNamespace(dp=dp, sync=sync, replies=replies, session=session, base=base, fake=fake_driver)
    dp.shutdown()
    registry.release_all()
    leader.close()


def run(dp, session, req):
    """Queue the request on the data plane's copier thread and wait for its job to end."""
    (dp.store if isinstance(req, protocol.Store) else dp.retrieve)(session, req, (b"id", b"rid"))
    deadline = time.monotonic() + 120     # a request whose signal never comes waits --cuda-timeout (30 s)
    while not dp.copier.idle():
        assert time.monotonic() < deadline, "the copy job did not end"
        time.sleep(0.001)


def block(fake, base, layer, b) -> bytes:
    return fake.read(base + layer * LAYER_BYTES + b * BLOCK_BYTES, BLOCK_BYTES)


def test_a_store_waits_for_the_worker_replies_then_commits_after_the_gpu_is_done(gpu_registration):
    g = gpu_registration
    seen_at_sync = []
    g.sync.on_synchronize = lambda: seen_at_sync.append((len(g.replies), g.dp.pool.info()["objects"]))
    run(g.dp, g.session, protocol.Store("gpu", [b"k0"], [1, 2], 2, event=b"W" * 64))
    (reply,) = g.replies
    assert reply.results == [protocol.StoreResult.STORED] and reply.event == bytes([1]) * 64
    # the pool's extent pinned first; then the worker's event waited for on the host (never on
    # the GPU: no stream wait); then the copies (2 layers x 1 run) in one driver call; the
    # server's event; the reply; and only then the wait for that event, after which the chunk
    # becomes visible
    assert g.sync.log == ["stream:0", "pin", "host-wait:W", "copy", "record:1", "sync:event1"]
    (batch,) = g.fake.batches
    assert batch["sizes"].tolist() == [2 * BLOCK_BYTES] * 2 and g.sync.copy_calls == 1
    from lmshm.cli import format_status_table

    status = SimpleNamespace(registrations=[], server_pid=1, uptime_s=1.0, isolated_ipc=False, sessions=1,
                             mappings=1, open_fds=3, fd_limit=1024, inbox_fds=0, draining=0, pool=g.dp.info())
    assert "copies in one cuMemcpyBatchAsync per request (1 driver call(s), 2 piece(s))" in \
        format_status_table(status)
    assert seen_at_sync == [(1, 0)]
    assert g.dp.pool.info()["objects"] == 1 and len(g.dp.cuda.events) == 1


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
    # the worker's event is waited on from the host first: no copy into its blocks is queued
    # that could run after it stopped waiting
    assert g.sync.log == ["stream:0", "pin", "host-wait:X", "copy", "record:2", "sync:event2"]
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
    assert "host-wait:W" not in g.sync.log and len(g.dp.cuda.events) == 1   # no worker event: nothing to wait on
    g.dp.session_ended("s1")
    assert len(g.dp.cuda.events) == 0


# vLLM 0.32 layouts on a GPU (tests/v1/server/test_kv_layouts.py has the table): a head-major
# layer (LHBNC: H runs a block, each layer one [B, H, N, C] view) and a block-outermost cache
# registered whole ([L, B, H, N, C], BLNHC, block_dim 1).
L, B, H, N, C = 2, 8, 2, 4, 8                     # float16


def _strides(shape, order):
    strides, step = [0] * len(shape), 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    return tuple(strides)


@pytest.mark.parametrize("batch", [True, False], ids=["batched", "per-piece"])
@pytest.mark.parametrize("layout", ["head-major", "block-outermost"])
def test_multi_run_and_block_dim_layouts_copy_contiguous_pieces_and_the_right_bytes(fake_driver, as_consumer, layout,
                                                                                    batch):
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
    registry, peer, sync = Registry(), local_peer("s1"), FakeCudaSync(copy_batch=batch)
    registry.register(peer=peer, instance_id="gpu", model_name="m", world_size=1, worker_rank=0,
                      groups=groups(wire), block_dim=block_dim)
    replies: list = []
    dp = DataPlane(DataPlaneConfig(copy_threads=1, max_inflight_per_session=8, max_leases_per_session=8),
                   registry=registry, pool=Pool(1 << 20), reply=lambda i, r, rep: replies.append(rep),
                   cuda_sync=sync)
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
        pieces = 8 if layout == "head-major" else 2
        assert sync.log.count("copy") == (1 if batch else pieces) and sync.copy_pieces == pieces
        assert len(fake_driver.batches[-1]["sizes"] if batch else fake_driver.copies) == pieces
        sync.log.clear()
        run(dp, session, protocol.Retrieve("gpu", [b"k0"], [7, 0, 1, 5], 4))
        assert isinstance(replies[-1], protocol.RetrieveReply), replies[-1]
        pieces = 12 if layout == "head-major" else 3
        assert sync.log.count("copy") == (1 if batch else pieces) and len(fake_driver.batches) == (2 if batch else 0)
        assert dp.info().cuda_copy_path == ("batch" if batch else "per-piece")
        after = cache()
        for src, dst in zip([2, 3, 4, 6], [7, 0, 1, 5]):
            assert torch.equal(after[:, dst].view(torch.int16), before[:, src].view(torch.int16)), (src, dst)
        for untouched in (2, 3, 4, 6):
            assert torch.equal(after[:, untouched].view(torch.int16), before[:, untouched].view(torch.int16))
    finally:
        dp.shutdown()
        registry.release_all()
        leader.close()


# ---- isolated mode's flag words, deadlines, quarantine, event lifetimes (issue 26: 2, 4, 5, 7) ----
import ctypes
import threading
import time

from lmshm.core import cuda_sync
from lmshm.core.cuda_sync import FLAG_LAYER, SLOTS, EventKeeper, flag_token, parse_flag_token


def _word(ptr: int) -> int:
    return int.from_bytes(ctypes.string_at(ptr, 8), "little")


@pytest.fixture
def isolated(gpu_registration, fake_driver, as_consumer):
    """The same registration, in isolated mode, with a flag page registered by the same session."""
    g = gpu_registration
    page_base = fake_driver.malloc(SLOTS * 8)
    as_consumer()                                # back to the producer's identity to export it
    owner = RawCudaIPCWrapper.from_pointer(page_base, SLOTS * 8, torch.int64, (SLOTS,), 0)
    as_consumer()
    g.as_consumer = as_consumer
    wire = DeviceIPCWrapper.Deserialize(owner.Serialize())
    g.dp.registry.register(peer=g.session.peer, instance_id="flags-1", model_name=FLAG_LAYER, world_size=1,
                           worker_rank=0, groups=[LayerGroup(wire, [FLAG_LAYER], [0])])
    g.dp.cuda._isolated = True
    g.sync.read_word = _word
    g.page = g.dp.registry.get("flags-1").tensor(FLAG_LAYER)
    yield g
    g.page = None                               # the server-side view holds the mapping
    owner.close()


def _set_word(g, slot: int, value: int) -> None:
    g.page[slot] = value                 # the fake's "device" memory is host memory


def test_a_flag_token_round_trips_and_refuses_what_is_not_one():
    t = flag_token(7, 123456789, "flags-1")
    assert len(t) <= 64 and parse_flag_token(t) == (7, 123456789, "flags-1")
    assert parse_flag_token(b"W" * 64) is None                    # an IPC event handle
    for bad in (cuda_sync.FLAG_MAGIC + b"\0" * 4, flag_token(0, 1, "x")[:16] + b"\xff\xfe"):
        with pytest.raises(cuda_sync.CudaSyncError):
            parse_flag_token(bad)
    with pytest.raises(cuda_sync.CudaSyncError, match="out of range"):
        parse_flag_token(cuda_sync._FLAG_HEAD.pack(cuda_sync.FLAG_MAGIC, SLOTS, 1) + b"flags-1")


def test_isolated_store_waits_on_the_workers_word_and_replies_only_after_the_copies(isolated):
    g = isolated
    _set_word(g, 5, 41)                                  # the worker's stream wrote 41 (>= 41: go)
    seen = []
    g.sync.on_synchronize = lambda: seen.append((len(g.replies), g.dp.pool.info()["objects"]))
    run(g.dp, g.session, protocol.Store("gpu", [b"k0"], [1, 2], 2, event=flag_token(5, 41, "flags-1")))
    (reply,) = g.replies
    assert reply.results == [protocol.StoreResult.STORED] and reply.event == b""   # no IPC event to open
    assert g.sync.log == ["stream:0", "pin", "host-wait-flag:41", "copy", "record:1", "sync:event1"]
    assert seen == [(0, 0)]                      # the wait came before the reply and the commit
    assert g.dp.pool.info()["objects"] == 1 and len(g.dp.cuda.events) == 0
    assert g.dp.registry.get("flags-1").holds == 0


def test_isolated_retrieve_unpins_before_its_reply(isolated):
    g = isolated
    _set_word(g, 1, 1)
    run(g.dp, g.session, protocol.Store("gpu", [b"k0"], [1, 2], 2, event=flag_token(1, 1, "flags-1")))
    hits, lease = g.dp.pool.lookup(g.session.peer.uid, [[b"k0"]], "s1", 30)
    _set_word(g, 2, 2)
    run(g.dp, g.session, protocol.Retrieve("gpu", [b"k0"], [5, 6], 2, lease, event=flag_token(2, 2, "flags-1")))
    reply = g.replies[-1]
    assert isinstance(reply, protocol.RetrieveReply) and reply.event == b"" and g.dp.pool.info()["pinned"] == 0
    assert block(g.fake, g.base, 0, 5) == block(g.fake, g.base, 0, 1)


def test_an_isolated_store_whose_word_never_comes_queues_nothing_and_holds_nothing(isolated):
    """The worker's word is waited for on the host: at the deadline the STORE fails with nothing
    queued (the pool bytes it reserved and pinned before the wait are handed back), so no stream
    waits on the worker and nothing goes to the quarantine."""
    g = isolated
    g.dp.cuda.timeout_s = 0.05
    reg = g.dp.registry.get("gpu")
    run(g.dp, g.session, protocol.Store("gpu", [b"k0"], [1, 2], 2, event=flag_token(3, 9, "flags-1")))
    (reply,) = g.replies
    assert isinstance(reply, protocol.ErrorReply) and reply.code == ErrorCode.UNAVAILABLE, reply
    assert "flag word was not signalled in time" in reply.message and "nothing was stored" in reply.message
    assert g.sync.log == ["stream:0", "pin", "host-wait-flag:9"]     # no copy, no GPU-side wait
    info = g.dp.pool.info()
    assert (info["in_flight"], info["objects"], info["used"]) == (0, 0, 0)
    assert reg.holds == 0 and g.dp.registry.get("flags-1").holds == 0
    assert g.dp.cuda.quarantined == 0 and not g.dp.cuda._quarantine and g.dp.late_requests == 1


def test_a_default_mode_store_whose_worker_event_never_completes_queues_nothing_and_holds_nothing(gpu_registration):
    """Issue 42 §3: the worker died before its event completed. Queued behind that event on the
    GPU, the copies never ran: the stream blocked for good and the quarantine held the dead
    worker's mapping and the reserved pool bytes until a restart."""
    g = gpu_registration
    g.dp.cuda.timeout_s = 0.05
    g.sync.worker_pending = True
    run(g.dp, g.session, protocol.Store("gpu", [b"k0"], [1, 2], 2, event=b"W" * 64))
    (reply,) = g.replies
    assert isinstance(reply, protocol.ErrorReply) and reply.code == ErrorCode.UNAVAILABLE, reply
    assert "CUDA event was not signalled in time" in reply.message and "nothing was stored" in reply.message
    assert g.sync.log == ["stream:0", "pin", "host-wait:W"] and g.sync.made == []   # nothing queued, no event
    info = g.dp.pool.info()
    assert (info["in_flight"], info["objects"], info["used"]) == (0, 0, 0)
    assert g.dp.registry.get("gpu").holds == 0 and g.dp.cuda.quarantined == 0 and not g.dp.cuda._quarantine
    assert len(g.dp.cuda.events) == 0 and g.dp.late_requests == 1


@pytest.mark.parametrize("what", ["STORE", "RETRIEVE"])
@pytest.mark.parametrize("token", ["event", "flag"])
def test_a_worker_that_dies_during_the_host_wait_frees_the_copy_thread_at_once(isolated, what, token):
    """The session ends (the worker died) while its request waits for its signal: the wait stops
    then, not at --cuda-timeout, and its registrations are let go, so the reclaim can unmap."""
    g = isolated
    _set_word(g, 1, 1)
    run(g.dp, g.session, protocol.Store("gpu", [b"k0"], [1, 2], 2, event=flag_token(1, 1, "flags-1")))
    lease = g.dp.pool.lookup(g.session.peer.uid, [[b"k0"]], "s1", 30)[1] if what == "RETRIEVE" else b""
    g.dp.cuda._isolated = token == "flag"
    g.sync.log.clear()
    g.sync.worker_pending = True                                       # an event: never completes
    g.dp.cuda.timeout_s = 30.0
    ev = b"W" * 64 if token == "event" else flag_token(2, 5, "flags-1")   # a word: never written
    req = (protocol.Store("gpu", [b"k1"], [3, 4], 2, event=ev) if what == "STORE"
           else protocol.Retrieve("gpu", [b"k0"], [5, 6], 2, lease, event=ev))
    g.sync.on_host_wait = lambda: threading.Timer(0.05, setattr, (g.session, "ended", True)).start()
    t0 = time.monotonic()
    run(g.dp, g.session, req)
    assert time.monotonic() - t0 < 2.0, "the host wait went on after the session ended"
    reply = g.replies[-1]
    assert isinstance(reply, protocol.ErrorReply) and reply.code == ErrorCode.UNAVAILABLE, reply
    assert "copy" not in g.sync.log
    info = g.dp.pool.info()
    assert (info["in_flight"], info["pinned"]) == (0, 0) and g.dp.cuda.quarantined == 0
    assert g.dp.registry.get("gpu").holds == 0 and g.dp.registry.get("flags-1").holds == 0


def test_with_cuda_pin_off_no_copy_is_queued_before_the_token_is_seen_on_the_host(isolated):
    """--cuda-pin off: a copy to pageable memory returns only when it is done, so a copy queued
    behind a GPU-side wait on the worker would block its thread without a bound. The word is
    read on the host first, and the copies come after it reached the number."""
    g = isolated
    g.dp.cuda.pin = "off"
    g.sync.on_host_wait = lambda: threading.Timer(0.05, _set_word, (g, 6, 12)).start()   # written late
    run(g.dp, g.session, protocol.Store("gpu", [b"k0"], [1, 2], 2, event=flag_token(6, 12, "flags-1")))
    (reply,) = g.replies
    assert isinstance(reply, protocol.StoreReply), reply
    assert g.sync.log[:3] == ["stream:0", "pin", "host-wait-flag:12"] and "copy" in g.sync.log
    assert not any(x.startswith("wait") for x in g.sync.log)          # nothing waits on the GPU


def test_a_default_mode_copy_past_its_deadline_holds_its_bytes_until_the_gpu_is_done(gpu_registration):
    g = gpu_registration
    g.dp.cuda.timeout_s = 0.05
    g.sync.hold_events = True
    run(g.dp, g.session, protocol.Store("gpu", [b"k0"], [1, 2], 2, event=b"W" * 64))
    (reply,) = g.replies
    assert isinstance(reply, protocol.StoreReply)       # replied at once, the worker waits on the GPU
    assert g.dp.pool.info()["in_flight"] == 1 and g.dp.registry.get("gpu").holds == 1
    assert any(x.startswith("timeout:") for x in g.sync.log)
    g.sync.complete_all()
    g.dp.tick()
    info = g.dp.pool.info()
    assert (info["in_flight"], info["objects"], info["failed"]) == (0, 0, 1)   # failed, never committed
    assert g.dp.registry.get("gpu").holds == 0


def test_a_failure_after_copies_were_queued_waits_for_the_gpu_before_aborting(gpu_registration, monkeypatch):
    g = gpu_registration
    real_record = g.sync.record
    calls = []

    def record(stream, device, interprocess=True):
        calls.append(interprocess)
        if len(calls) == 1:
            raise RuntimeError("cudaEventRecord failed (injected)")
        return real_record(stream, device, interprocess)

    monkeypatch.setattr(g.sync, "record", record)
    g.sync.hold_events = True
    g.dp.cuda.timeout_s = 0.05
    run(g.dp, g.session, protocol.Store("gpu", [b"k0"], [1, 2], 2, event=b"W" * 64))
    (reply,) = g.replies
    assert isinstance(reply, protocol.ErrorReply) and reply.code == ErrorCode.DATA_LOSS
    assert calls == [True, False]                     # a plain event to learn when the copies are done
    assert g.dp.pool.info()["in_flight"] == 1         # not aborted while the queued copies may run
    g.sync.complete_all()
    g.dp.tick()
    assert g.dp.pool.info()["in_flight"] == 0 and g.dp.registry.get("gpu").holds == 0


def test_a_flag_token_naming_anothers_page_is_refused(isolated, fake_driver):
    g = isolated
    other = local_peer("s2")
    page = fake_driver.malloc(SLOTS * 8)
    g.as_consumer()
    owner = RawCudaIPCWrapper.from_pointer(page, SLOTS * 8, torch.int64, (SLOTS,), 0)
    g.as_consumer()
    try:
        wire = DeviceIPCWrapper.Deserialize(owner.Serialize())
        g.dp.registry.register(peer=other, instance_id="flags-2", model_name=FLAG_LAYER, world_size=1,
                               worker_rank=0, groups=[LayerGroup(wire, [FLAG_LAYER], [0])])
        run(g.dp, g.session, protocol.Store("gpu", [b"k0"], [1, 2], 2, event=flag_token(0, 1, "flags-2")))
        (reply,) = g.replies
        assert isinstance(reply, protocol.ErrorReply) and reply.code == ErrorCode.INVALID_ARG, reply
        assert "belongs to another session" in reply.message and "copy" not in g.sync.log
        assert g.dp.pool.info()["in_flight"] == 0
    finally:
        owner.close()


def test_a_flag_page_of_the_wrong_shape_is_refused(gpu_registration):
    g = gpu_registration
    g.dp.cuda._isolated = True
    run(g.dp, g.session, protocol.Store("gpu", [b"k0"], [1, 2], 2, event=flag_token(0, 1, "gpu")))
    (reply,) = g.replies
    assert isinstance(reply, protocol.ErrorReply) and reply.code == ErrorCode.INVALID_ARG
    assert "is not a flag page" in reply.message and g.dp.registry.get("gpu").holds == 0


def test_a_sessions_streams_are_dropped_after_its_queued_jobs(gpu_registration):
    g = gpu_registration
    run(g.dp, g.session, protocol.Store("gpu", [b"k0"], [1, 2], 2))
    g.dp.session_ended("s1")
    deadline = time.monotonic() + 5
    while not g.sync.dropped and time.monotonic() < deadline:
        time.sleep(0.01)
    assert g.sync.dropped == ["s1"]


class _Ev:
    def __init__(self, done: bool) -> None:
        self.finished = done


def test_server_events_live_until_done_and_old_enough_and_the_cap_takes_only_completed_ones():
    keeper = EventKeeper(min_age_s=30, cap=3, done=lambda ev: ev.finished)
    pending, old = _Ev(False), _Ev(True)
    keeper.keep("s", old, now=0)
    keeper.keep("s", pending, now=1)
    keeper.expire(now=10)
    assert len(keeper) == 2                     # younger than 30 s: kept, though done
    keeper.expire(now=40)
    assert len(keeper) == 1                     # the old done one went; the pending one stays
    keeper.expire(now=1000)
    assert len(keeper) == 1                     # pending: never destroyed under the worker
    for i in range(4):
        keeper.keep("s", _Ev(True), now=1000 + i)
    assert len(keeper) == 3 and keeper.dropped_early == 2   # past the cap: the oldest completed went early
    pending.finished = True
    keeper.expire(now=2000)
    assert len(keeper) == 0


class FakeCudart:
    """A FAKE of ``torch.cuda.cudart()``: records cudaHostRegister calls (no memory is locked)."""

    def __init__(self, fail: bool = False) -> None:
        self.registered: list[tuple[int, int]] = []
        self.fail = fail

    def cudaHostRegister(self, ptr, size, flags):
        if self.fail:
            return 2                               # cudaErrorMemoryAllocation
        self.registered.append((ptr, size))
        return 0

    def cudaHostUnregister(self, ptr):
        self.registered = [r for r in self.registered if r[0] != ptr]
        return 0


def test_the_pool_is_pinned_in_extents_as_copies_use_them(monkeypatch, fake_driver):
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    sync = cuda_sync.TorchCudaSync("lazy")
    pool = torch.empty(3 * cuda_sync.PIN_EXTENT + 4096, dtype=torch.uint8, device="meta")
    pool = SimpleNamespace(data_ptr=lambda: 1 << 40, numel=lambda: 3 * cuda_sync.PIN_EXTENT + 4096,
                           element_size=lambda: 1)
    sync.pin(pool, 10, 100)
    assert cudart.registered == [(1 << 40, cuda_sync.PIN_EXTENT)]           # one extent, not the pool
    sync.pin(pool, cuda_sync.PIN_EXTENT - 10, 20)                           # straddles into the second
    sync.pin(pool, 3 * cuda_sync.PIN_EXTENT, 10)                            # the short last extent
    assert cudart.registered[1:] == [((1 << 40) + cuda_sync.PIN_EXTENT, cuda_sync.PIN_EXTENT),
                                     ((1 << 40) + 3 * cuda_sync.PIN_EXTENT, 4096)]
    assert sync.pinned_bytes(pool) == 2 * cuda_sync.PIN_EXTENT + 4096
    sync.unpin_all([pool])
    assert cudart.registered == []
    start = cuda_sync.TorchCudaSync("start")
    start.pin(pool, 0, 1)
    assert sum(size for _, size in cudart.registered) == 3 * cuda_sync.PIN_EXTENT + 4096
    off = cuda_sync.TorchCudaSync("off")
    before = list(cudart.registered)
    off.pin(pool, 0, 1)
    assert cudart.registered == before
    with pytest.raises(cuda_sync.PinError, match="cuda-pin off"):
        cudart.fail = True
        cuda_sync.TorchCudaSync("lazy").pin(SimpleNamespace(data_ptr=lambda: 1 << 41, numel=lambda: 10,
                                                            element_size=lambda: 1), 0, 1)


def test_a_pin_failure_is_the_servers_unavailable_not_the_workers_error(gpu_registration, monkeypatch):
    g = gpu_registration

    def refuse(pool, offset=0, nbytes=-1):
        raise cuda_sync.PinError("cudaHostRegister ... failed: error 2")

    monkeypatch.setattr(g.sync, "pin", refuse)
    run(g.dp, g.session, protocol.Store("gpu", [b"k0"], [1, 2], 2))
    (reply,) = g.replies
    assert isinstance(reply, protocol.ErrorReply) and reply.code == ErrorCode.UNAVAILABLE
    assert "page-lock" in reply.message and g.dp.pool.info()["in_flight"] == 0


def test_an_unknown_pin_mode_is_refused_naming_the_choices():
    with pytest.raises(Exception, match="lazy, start, off"):
        DataPlane(DataPlaneConfig(copy_threads=1, cuda_pin="eager"), registry=Registry(), pool=Pool(1 << 20),
                  reply=lambda *a: None)


def test_shutdown_keeps_the_pool_while_quarantined_copies_may_still_reach_it(gpu_registration, monkeypatch):
    g = gpu_registration
    g.dp.cuda.timeout_s = 0.01
    g.sync.hold_events = True
    run(g.dp, g.session, protocol.Store("gpu", [b"k0"], [1, 2], 2, event=b"W" * 64))
    released = []
    monkeypatch.setattr(g.dp.pool, "release", lambda: released.append(True))
    monkeypatch.setattr(time, "monotonic", lambda t=[0.0]: t.__setitem__(0, t[0] + 1.0) or t[0])  # 5 s pass fast
    g.dp.shutdown()
    assert released == [] and g.dp.cuda._quarantine            # still mapped: the GPU may write into it
    monkeypatch.undo()
    g.sync.complete_all()
    g.dp.cuda._drain_quarantine(g.sync)
    assert g.dp.registry.get("gpu").holds == 0


def test_a_retrieve_whose_signal_never_comes_queues_nothing_and_writes_no_block(isolated):
    """Its copies would write the worker's blocks: none is queued before the signal is seen."""
    g = isolated
    _set_word(g, 1, 1)
    run(g.dp, g.session, protocol.Store("gpu", [b"k0"], [1, 2], 2, event=flag_token(1, 1, "flags-1")))
    hits, lease = g.dp.pool.lookup(g.session.peer.uid, [[b"k0"]], "s1", 30)
    g.sync.log.clear()
    before = [block(g.fake, g.base, 0, b) for b in (5, 6)]
    g.dp.cuda.timeout_s = 0.05          # the signal never comes: no need to wait the default 30 s
    run(g.dp, g.session, protocol.Retrieve("gpu", [b"k0"], [5, 6], 2, lease, event=flag_token(2, 7, "flags-1")))
    reply = g.replies[-1]
    assert isinstance(reply, protocol.ErrorReply) and reply.code == ErrorCode.UNAVAILABLE, reply
    assert "flag word was not signalled in time" in reply.message and "no block was written" in reply.message
    assert g.sync.log == ["stream:0", "pin", "host-wait-flag:7"]
    assert [block(g.fake, g.base, 0, b) for b in (5, 6)] == before
    info = g.dp.pool.info()
    assert info["pinned"] == 0 and info["leases"] == 0 and g.dp.late_requests == 1
    assert g.dp.registry.get("flags-1").holds == 0


def test_a_default_mode_retrieve_whose_worker_event_is_pending_queues_nothing(gpu_registration):
    g = gpu_registration
    run(g.dp, g.session, protocol.Store("gpu", [b"k0"], [1, 2], 2, event=b"W" * 64))
    hits, lease = g.dp.pool.lookup(g.session.peer.uid, [[b"k0"]], "s1", 30)
    g.sync.log.clear()
    g.sync.worker_pending = True
    g.dp.cuda.timeout_s = 0.05
    run(g.dp, g.session, protocol.Retrieve("gpu", [b"k0"], [5, 6], 2, lease, event=b"X" * 64))
    reply = g.replies[-1]
    assert isinstance(reply, protocol.ErrorReply) and reply.code == ErrorCode.UNAVAILABLE, reply
    assert "CUDA event was not signalled" in reply.message
    assert g.sync.log == ["stream:0", "pin", "host-wait:X"] and g.dp.pool.info()["pinned"] == 0


def test_an_isolated_store_done_after_its_sender_stopped_waiting_is_not_committed(isolated):
    """Isolated mode answers after the copies: done past wait_s, they may have read blocks the
    worker had already reused."""
    g = isolated
    _set_word(g, 4, 4)
    g.sync.on_synchronize = lambda: time.sleep(0.15)             # the copies take longer than wait_s
    run(g.dp, g.session, protocol.Store("gpu", [b"k0"], [1, 2], 2, event=flag_token(4, 4, "flags-1"), wait_s=0.1))
    (reply,) = g.replies
    assert isinstance(reply, protocol.ErrorReply) and reply.code == ErrorCode.UNAVAILABLE, reply
    info = g.dp.pool.info()
    assert (info["objects"], info["in_flight"]) == (0, 0) and g.dp.late_requests == 1


def test_a_default_mode_store_done_after_wait_s_is_committed_it_was_answered_in_time(gpu_registration):
    g = gpu_registration
    g.sync.on_synchronize = lambda: time.sleep(0.15)
    run(g.dp, g.session, protocol.Store("gpu", [b"k0"], [1, 2], 2, event=b"W" * 64, wait_s=0.1))
    assert isinstance(g.replies[0], protocol.StoreReply)
    assert g.dp.pool.info()["objects"] == 1 and g.dp.late_requests == 0


def test_host_waits_poll_until_ready_or_the_deadline_and_sleep_between_polls():
    calls = []
    assert cuda_sync.poll_until(lambda: calls.append(1) or len(calls) >= 3, time.monotonic() + 5)
    assert len(calls) == 3
    t0 = time.monotonic()
    assert cuda_sync.poll_until(lambda: False, t0 + 0.05) is False
    assert 0.05 <= time.monotonic() - t0 < 1


# ---- issue 42: copies cut at pin extents, one driver call per request --------------------------
@pytest.mark.parametrize("batch", [True, False], ids=["batched", "per-piece"])
def test_objects_straddling_pin_extents_store_and_retrieve_with_copies_cut_at_the_edges(gpu_registration, batch):
    """The driver refuses a copy whose host memory is page-locked only in part (the fake checks
    it as the real one does); objects of 3 blocks (3,072 bytes) in 4 KiB extents straddle them."""
    g = gpu_registration
    g.sync.pin_extent, g.sync.copy_batch = 4096, batch
    ids = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    before = {(layer, b): block(g.fake, g.base, layer, b) for layer in range(2) for b in range(BLOCKS)}
    run(g.dp, g.session, protocol.Store("gpu", [b"k0", b"k1", b"k2", b"k3"], ids, 3, event=b"W" * 64))
    reply = g.replies[-1]
    assert isinstance(reply, protocol.StoreReply), reply
    pool = g.dp.pool.tensor.data_ptr()
    assert len(g.fake.host_registered) >= 3          # the objects reach into 3 extents at least
    # 4 chunks of 3 consecutive blocks: one piece per layer each (8) uncut; objects that straddle
    # an edge give one more piece per layer
    assert g.sync.copy_pieces > 8
    hits, lease = g.dp.pool.lookup(g.session.peer.uid, [[b"k1", b"k2"]], "s1", 30)
    assert hits == 2
    run(g.dp, g.session, protocol.Retrieve("gpu", [b"k1", b"k2"], [7, 6, 5, 4, 3, 2], 3, lease,
                                           event=b"X" * 64))
    assert isinstance(g.replies[-1], protocol.RetrieveReply), g.replies[-1]
    for layer in range(2):
        for src, dst in zip([3, 4, 5, 6, 7, 0], [7, 6, 5, 4, 3, 2]):
            assert block(g.fake, g.base, layer, dst) == before[(layer, src)], (layer, src, dst)
    assert g.fake.calls["cuMemcpyBatchAsync" if batch else "cuMemcpyAsync"] == (2 if batch else g.sync.copy_pieces)
    for base, size in g.fake.host_registered:        # every pool-side range lay inside one extent
        assert size == 4096 or base + size == pool + g.dp.pool.capacity


def test_a_copy_across_an_extent_edge_is_what_the_driver_refuses(gpu_registration, monkeypatch):
    """Without the cut, the same STORE reaches the (fake) driver with a copy across an edge, and
    fails as on a GPU ("invalid argument"): what the test above guards against."""
    g = gpu_registration
    g.sync.pin_extent = 4096
    monkeypatch.setattr(g.dp.cuda, "pin", "off")     # the plan is then not cut (nothing would be pinned)
    run(g.dp, g.session, protocol.Store("gpu", [b"k0", b"k1"], [0, 1, 2, 3, 4, 5], 3))
    reply = g.replies[-1]
    assert isinstance(reply, protocol.ErrorReply) and reply.code == ErrorCode.DATA_LOSS
    assert "page-locked only in part" in reply.message


def test_the_copy_settings_are_in_help_environment_and_reach_the_data_plane():
    from lmshm.settings import build_arg_parser, resolve_config

    text = build_arg_parser().format_help()
    assert "--cuda-pin-extent" in text and "--cuda-copy-batch" in text
    none = build_arg_parser().parse_args([])
    c = resolve_config(none, {"LMSHM_CUDA_BATCH": "0", "LMSHM_CUDA_PIN_EXTENT": "64MiB"})
    assert (c.cuda_copy_batch, c.cuda_pin_extent) == (False, 64 << 20)
    assert resolve_config(none, {}).cuda_copy_batch and resolve_config(none, {}).cuda_pin_extent == 256 << 20
    with pytest.raises(Exception, match="cuda-pin-extent.*multiple of 4 KiB"):
        DataPlane(DataPlaneConfig(copy_threads=1, cuda_pin_extent=5000), registry=Registry(), pool=Pool(1 << 20),
                  reply=lambda *a: None)


# ---- isolated mode across reconnects and mixed modes (issue 42 §4) ----------------------------

def test_a_flag_token_gets_a_reply_after_the_copies_and_no_event_from_a_server_not_started_isolated(isolated):
    """An isolated worker cannot open an interprocess event (no shared /dev/shm) and orders its
    work by the reply: a server started without --isolated-ipc must answer its flag tokens so."""
    g = isolated
    g.dp.cuda._isolated = False
    _set_word(g, 5, 41)
    seen = []
    g.sync.on_synchronize = lambda: seen.append((len(g.replies), g.dp.pool.info()["objects"]))
    run(g.dp, g.session, protocol.Store("gpu", [b"k0"], [1, 2], 2, event=flag_token(5, 41, "flags-1")))
    (reply,) = g.replies
    assert isinstance(reply, protocol.StoreReply) and reply.event == b"", reply
    assert seen == [(0, 0)] and len(g.dp.cuda.events) == 0           # answered after the copies completed
    hits, lease = g.dp.pool.lookup(g.session.peer.uid, [[b"k0"]], "s1", 30)
    _set_word(g, 6, 42)
    run(g.dp, g.session, protocol.Retrieve("gpu", [b"k0"], [5, 6], 2, lease, event=flag_token(6, 42, "flags-1")))
    assert isinstance(g.replies[-1], protocol.RetrieveReply) and g.replies[-1].event == b""
    assert g.dp.pool.info()["pinned"] == 0 and len(g.dp.cuda.events) == 0


class FakeClient:
    """A FAKE of ``MPClient``'s registration calls (what ``WorkerCudaSync`` uses of it)."""

    def __init__(self, server_id: str = "server-1") -> None:
        self.server_id = server_id
        self.registered: list[str] = []
        self.unregistered: list[str] = []

    def register_kv_caches(self, kv, instance_id, *, model_name=""):
        assert list(kv) == [FLAG_LAYER] and model_name == FLAG_LAYER
        self.registered.append(instance_id)
        return instance_id

    def unregister_kv_caches(self, instance_id):
        self.unregistered.append(instance_id)
        return False


def _worker_sync(fake_driver, client, monkeypatch):
    """An isolated ``WorkerCudaSync`` whose page lives in the fake driver's memory (no GPU)."""
    page_ptr = fake_driver.malloc(SLOTS * 8)
    page = SimpleNamespace(data_ptr=lambda: page_ptr)
    sync = cuda_sync.WorkerCudaSync(0, client=client, isolated=True)
    sync._torch = SimpleNamespace(int64=torch.int64, zeros=lambda *a, **k: page,
                                  cuda=SimpleNamespace(synchronize=lambda device=None: None,
                                                       current_stream=lambda device=None: SimpleNamespace(
                                                           cuda_stream=fake_driver.stream_create(0))))
    return sync, page_ptr


def test_the_flag_page_is_registered_again_after_a_server_restart_and_with_a_new_client(fake_driver, monkeypatch):
    """The page was registered once: after a server restart the tokens named a page the new
    server did not know, and every CUDA request answered INVALID_ARG for good."""
    first = FakeClient()
    current = [first]
    sync, page_ptr = _worker_sync(fake_driver, lambda: current[0], monkeypatch)
    ids = [parse_flag_token(sync.ready()[1])[2] for _ in range(3)]
    assert len(set(ids)) == 1 and first.registered == ids[:1]               # once while the server is the same
    first.server_id = "server-2"                                             # it restarted
    _, token = sync.ready()
    slot, seq, iid = parse_flag_token(token)
    assert first.registered == [ids[0], iid] and iid != ids[0] and first.unregistered == [ids[0]]
    assert fake_driver.read_u64(page_ptr + 8 * slot) == seq == 4              # the same page, its count goes on
    second = current[0] = FakeClient("server-2")                             # another client (a new link)
    iid2 = parse_flag_token(sync.ready()[1])[2]
    assert second.registered == [iid2] and iid2 not in (ids[0], iid)
    sync.close()
    assert second.unregistered == [iid2]


def test_an_isolated_worker_refuses_an_interprocess_event_in_a_reply(fake_driver):
    sync = cuda_sync.WorkerCudaSync(0, client=FakeClient(), isolated=True)
    sync.wait(b"")                                                           # isolated replies carry none
    with pytest.raises(cuda_sync.CudaSyncError, match="interprocess CUDA event"):
        sync.wait(b"E" * 64)


def test_isolated_mode_is_refused_on_a_device_without_64bit_stream_memory_operations(fake_driver, monkeypatch):
    fake_driver.stream_mem_ops = False
    client = FakeClient()
    sync, _ = _worker_sync(fake_driver, client, monkeypatch)
    with pytest.raises(cuda_sync.CudaSyncError, match="64-bit stream memory operations.*without isolated mode"):
        sync.ready()
    assert client.registered == []


def test_a_flag_token_is_not_refused_by_the_in_flight_limit_its_own_request_fills(isolated):
    """The running request counts in the session's in-flight jobs: checking its flag page
    against the limit refused it at the limit, as an unusable flag page (INVALID_ARG)."""
    g = isolated
    g.dp.checks.config = dataclasses.replace(g.dp.config, max_inflight_per_session=1)
    _set_word(g, 3, 3)
    g.dp.store(g.session, protocol.Store("gpu", [b"k0"], [1, 2], 2, event=flag_token(3, 3, "flags-1")), (b"id", b"rid"))
    deadline = time.monotonic() + 5
    while not g.replies and time.monotonic() < deadline:
        time.sleep(0.01)
    (reply,) = g.replies
    assert isinstance(reply, protocol.StoreReply) and reply.results == [protocol.StoreResult.STORED], reply


def test_reply_events_are_capped_in_the_whole_process_oldest_completed_first_never_a_running_one():
    """Interprocess events are scarce (PyTorch reports about 22,000 as a practical limit): the
    per-session cap alone let many sessions keep 4,096 each, 30 s long."""
    keeper = EventKeeper(min_age_s=30, cap=100, done=lambda ev: ev.finished, total_cap=8)
    running = _Ev(False)
    keeper.keep("a", running, now=0)
    olds = [_Ev(True) for _ in range(4)]
    for i, ev in enumerate(olds):
        keeper.keep("b" if i % 2 else "c", ev, now=1 + i)
    for i in range(3):
        keeper.keep(f"s{i}", _Ev(True), now=10 + i)
    assert len(keeper) == 8 and keeper.dropped_early == 0
    keeper.keep("d", _Ev(False), now=20)          # 9 > 8: down to 7, the oldest completed first
    assert len(keeper) == 7 and keeper.dropped_early == 2 and keeper.room() is True
    left = [ev for q in keeper._by_session.values() for _, ev in q]
    assert running in left and olds[0] not in left and olds[1] not in left and olds[2] in left
    busy = EventKeeper(min_age_s=30, cap=100, done=lambda ev: ev.finished, total_cap=2)
    busy.keep("a", _Ev(False), now=0)
    busy.keep("b", _Ev(False), now=1)
    assert busy.room() is False and len(busy) == 2 and busy.dropped_early == 0   # running: never dropped


def test_when_every_kept_event_is_still_running_a_default_mode_request_is_refused_with_nothing_queued(gpu_registration):
    g = gpu_registration
    g.dp.cuda.events = EventKeeper(total_cap=1, done=g.sync.done)
    g.sync.hold_events = True                      # the first STORE's copies keep running
    g.dp.cuda.timeout_s = 0.05
    run(g.dp, g.session, protocol.Store("gpu", [b"k0"], [1, 2], 2, event=b"W" * 64))
    assert isinstance(g.replies[0], protocol.StoreReply)
    g.sync.log.clear()
    run(g.dp, g.session, protocol.Store("gpu", [b"k1"], [3, 4], 2, event=b"W" * 64))
    reply = g.replies[-1]
    assert isinstance(reply, protocol.ErrorReply) and reply.code == ErrorCode.UNAVAILABLE, reply
    assert "interprocess CUDA events" in reply.message and "retry" in reply.message
    assert g.sync.log == [] and len(g.dp.cuda.events) == 1
    g.sync.complete_all()
    g.dp.tick()
    run(g.dp, g.session, protocol.Store("gpu", [b"k1"], [3, 4], 2, event=b"W" * 64))
    assert isinstance(g.replies[-1], protocol.StoreReply)   # a completed one made room
