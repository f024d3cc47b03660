"""CPU wrappers across real processes: named POSIX shm and memfd over SCM_RIGHTS.

Most tests here hand wrappers to a spawned consumer by name, without an fd channel, so they
make named segments (``cpu_segments = "shm"``); the memfd tests say ``kind="memfd"``. The
default kind (memfd) and its seals are tested in test_memfd_seals.py.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import socket

import pytest
import torch

from lmshm.platform import ipc_policy
from lmshm.platform.base.fds import FD_INBOX
from lmshm.platform.base.ipc_wrapper import DeviceIPCWrapper
from lmshm.platform.base.mappings import MAPPINGS
from lmshm.platform.cpu import CpuFdIPCWrapper, CpuShmIPCWrapper, empty_shared, move_to_shared, segment_of
from lmshm.platform.cpu import segments as seg_mod
from lmshm.platform.kv_wrap import KVCacheWrapError, wrap_kv_caches

CTX = mp.get_context("spawn")
LAYERS = 32
KV_SHAPE = (2, 64, 16, 8, 64)  # [k/v, blocks, block_size, heads, head_dim]


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("lmshm-")}


@pytest.fixture(autouse=True)
def named_segments():
    ipc_policy.set_cpu_segments("shm")
    yield
    ipc_policy.set_cpu_segments(None)


@pytest.fixture
def no_new_segments():
    before = _segments()
    yield
    gc.collect()
    assert _segments() - before == set(), "a test left lmshm segments in /dev/shm"


# ---- consumer processes (module level so that spawn can import them) -------------------------

def _consumer_kv(conn) -> None:
    payloads = conn.recv()
    wrappers = [DeviceIPCWrapper.Deserialize(p) for p in payloads]
    tensors = [w.to_tensor() for w in wrappers]
    report = {
        "layouts": [(tuple(t.shape), tuple(t.stride()), str(t.dtype)) for t in tensors],
        "first_values": [t.flatten()[0].item() for t in tensors],
        "all_equal": [bool(torch.all(t == t.flatten()[0])) for t in tensors],
        "mappings": len(MAPPINGS),
        "opens": MAPPINGS.opens_total,
    }
    for i, t in enumerate(tensors):  # write back, for the producer to see
        t[1, 5, 3, 2, 1] = -(i + 1)
    conn.send(report)
    assert conn.recv() == "check-again"
    conn.send([t[0, 1, 2, 3, 4].item() for t in tensors])
    # Close the wrappers first: the tensors must still be readable afterwards.
    for w in wrappers:
        w.close()
    conn.send(float(sum(t.float().sum().item() for t in tensors)))
    conn.close()


def _consumer_fd(path: str) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 8)
    wrapper = DeviceIPCWrapper.Deserialize(msg)
    try:
        wrapper.to_tensor()
        sock.sendall(b"ERR mapped without an fd")
        return
    except LookupError:
        pass
    FD_INBOX.put(wrapper.segment, fds[0], session=None)
    t = wrapper.to_tensor()
    ok = bool(torch.all(t == 7))
    t.fill_(11)
    wrapper.close()
    FD_INBOX.close_session(None)
    sock.sendall(b"OK" if ok else b"ERR wrong contents")
    sock.close()


def _exit_normally_with_a_segment(q) -> None:
    pool = empty_shared((1024,), torch.float32)
    q.put(segment_of(pool).name)
    globals()["_keep"] = pool  # alive until interpreter exit


# ---- tests -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kv_cache_is_shared_both_ways_with_a_spawned_process(dtype, no_new_segments):
    kv = {f"model.layers.{i}.self_attn": torch.full(KV_SHAPE, float(i % 7 + 1), dtype=dtype)
          for i in range(LAYERS)}
    wrappers = wrap_kv_caches(kv)
    assert [type(w) for w in wrappers] == [CpuShmIPCWrapper] * LAYERS
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_consumer_kv, args=(child,))
    proc.start()
    try:
        parent.send([w.Serialize() for w in wrappers])
        report = parent.recv()
        assert report["layouts"] == [(KV_SHAPE, tuple(torch.empty(KV_SHAPE).stride()), str(dtype))] * LAYERS
        assert report["first_values"] == [float(i % 7 + 1) for i in range(LAYERS)]
        assert all(report["all_equal"])
        assert report["mappings"] == LAYERS and report["opens"] == LAYERS  # one segment per layer
        # The consumer's writes are visible through the worker's own tensors.
        assert [kv[n][1, 5, 3, 2, 1].item() for n in kv] == [-(i + 1) for i in range(LAYERS)]
        # And the worker's later writes are visible to the consumer.
        for i, t in enumerate(kv.values()):
            t[0, 1, 2, 3, 4] = 100 + i
        parent.send("check-again")
        assert parent.recv() == [100 + i for i in range(LAYERS)]
        assert parent.recv() > 0  # tensors still readable after the consumer closed its wrappers
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        for w in wrappers:
            w.close()
    del kv, wrappers


def test_nhd_views_of_one_shared_pool_share_one_segment_without_copying(no_new_segments):
    layers = 8
    pool = empty_shared((layers, 2, 64, 8, 16, 64), torch.bfloat16)  # HND storage
    pool.copy_(torch.arange(layers, dtype=torch.bfloat16).view(layers, 1, 1, 1, 1, 1).expand_as(pool))
    kv = {f"layer.{i}": pool[i].permute(0, 1, 3, 2, 4) for i in range(layers)}  # NHD views
    ptrs = [t.data_ptr() for t in kv.values()]
    wrappers = wrap_kv_caches(kv)
    assert [t.data_ptr() for t in kv.values()] == ptrs, "a tensor already in a segment must not move"
    assert len({w.segment for w in wrappers}) == 1
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_consumer_kv, args=(child,))
    proc.start()
    try:
        parent.send([w.Serialize() for w in wrappers])
        report = parent.recv()
        assert report["layouts"] == [(tuple(t.shape), tuple(t.stride()), "torch.bfloat16") for t in kv.values()]
        assert report["first_values"] == [float(i) for i in range(layers)]
        assert report["mappings"] == 1 and report["opens"] == 1
        parent.send("check-again")
        parent.recv()
        parent.recv()
        proc.join(30)
        assert proc.exitcode == 0
        # Index [1, 5, 3, 2, 1] of the NHD view, written by the consumer, lands in the pool.
        assert [pool[i, 1, 5, 2, 3, 1].item() for i in range(layers)] == [-(i + 1) for i in range(layers)]
    finally:
        if proc.is_alive():
            proc.kill()
        for w in wrappers:
            w.close()
    del pool, kv, wrappers


def test_views_of_one_private_storage_migrate_once_into_one_segment(no_new_segments):
    big = torch.arange(4 * 100, dtype=torch.float32).view(4, 100)
    kv = {f"l{i}": big[i] for i in range(4)}
    wrappers = wrap_kv_caches(kv)
    assert len({w.segment for w in wrappers}) == 1
    seg = segment_of(kv["l0"])
    assert seg is not None and seg.size == big.untyped_storage().nbytes()
    assert all(segment_of(t) is seg for t in kv.values()), "every wrapped view is re-pointed"
    assert segment_of(big) is None, "views not passed in keep the private storage (documented)"
    assert torch.equal(torch.stack(list(kv.values())), big)
    for w in wrappers:
        w.close()
    del kv, wrappers, seg


def test_move_to_shared_repoints_every_given_view_now_and_a_later_wrap_copies_nothing(no_new_segments):
    big = torch.arange(3 * 2 * 50, dtype=torch.float32).view(3, 2, 50)
    layers = {f"l{i}": big[:, i] for i in range(2)}        # gapped views, as block-outermost KV layouts give
    want = big.clone()
    (seg,) = move_to_shared(layers.values())
    assert all(segment_of(t) is seg for t in layers.values()) and segment_of(big) is None
    assert torch.equal(torch.stack(list(layers.values()), 1), want)
    assert move_to_shared(layers.values()) == []            # already shared: nothing moves
    whole = torch.empty(0).set_(layers["l0"].untyped_storage(), 0, (3, 2, 50))
    (w,) = wrap_kv_caches({"pool": whole})                 # the storage is in a segment: no migration
    assert w.segment == seg.name and segment_of(whole) is seg
    w.close()
    del layers, whole, w, seg


def test_memfd_wrapper_travels_with_its_fd_over_a_unix_socket(tmp_path, no_new_segments):
    pool = empty_shared((16, 32), torch.float16, isolated=True)
    pool.fill_(7)
    before = _segments()
    wrapper = CpuFdIPCWrapper.wrap(pool)
    assert _segments() == before, "a memfd has no name in /dev/shm"
    path = str(tmp_path / "fd.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    proc = CTX.Process(target=_consumer_fd, args=(path,))
    proc.start()
    try:
        conn, _ = srv.accept()
        ((token, fd),) = wrapper.export_fds().items()
        assert token == wrapper.segment
        socket.send_fds(conn, [wrapper.Serialize()], [fd])
        conn.settimeout(30)
        assert conn.recv(100) == b"OK"
        proc.join(30)
        assert proc.exitcode == 0
        assert bool(torch.all(pool == 11)), "the consumer's writes reach the producer"
        conn.close()
    finally:
        srv.close()
        if proc.is_alive():
            proc.kill()
        wrapper.close()


def test_rollback_releases_every_segment_the_batch_created(no_new_segments):
    before = _segments()
    kv = {
        "model.layers.0": torch.ones(4, 8),
        "model.layers.1": torch.ones(4, 8),
        "model.layers.2": torch.ones(4, 16)[:, ::2],  # not dense: cannot be shared
        "model.layers.3": torch.ones(4, 8),
    }
    with pytest.raises(KVCacheWrapError) as info:
        wrap_kv_caches(kv)
    assert info.value.layer_index == 2 and info.value.layer_name == "model.layers.2"
    assert "layer 2 ('model.layers.2')" in str(info.value) and "stride=(16, 2)" in str(info.value)
    assert _segments() == before, "no segment of the failed batch may stay in /dev/shm"
    assert float(kv["model.layers.0"].sum()) == 32.0, "migrated tensors keep working"
    # The released segments are not reused: wrapping again makes fresh ones.
    (w,) = wrap_kv_caches({"again": kv["model.layers.0"]})
    assert w.segment in _segments()
    w.close()
    del kv, w


def test_mixed_ranks_are_refused_up_front_with_ranks_and_layer_names(no_new_segments):
    before = _segments()
    kv = {"a.0": torch.ones(2, 3), "a.1": torch.ones(2, 3), "b.0": torch.ones(2, 3, 4)}
    with pytest.raises(ValueError, match=r"rank 2: 2 layer\(s\), e.g. 'a.0', 'a.1'; rank 3: 1 layer\(s\), e.g. 'b.0'"):
        wrap_kv_caches(kv)
    assert _segments() == before


@pytest.mark.parametrize("bad,match", [({}, "empty"), ({"x": [1, 2]}, "expected a torch.Tensor"), ([1], "dict")])
def test_bad_batches_give_clear_errors(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        wrap_kv_caches(bad)


def test_consumer_checks_bounds_and_identity_of_the_segment(no_new_segments):
    pool = empty_shared((64,), torch.float32)
    w = CpuShmIPCWrapper.wrap(pool)
    state = w.__getstate__()
    too_far = CpuShmIPCWrapper(**{**state, "storage_offset": 10})
    with pytest.raises(ValueError, match="does not fit its segment"):
        too_far.to_tensor()
    huge = CpuShmIPCWrapper(**{**state, "shape": (1 << 40,), "stride": (1,), "segment_bytes": 1 << 42})
    with pytest.raises(ValueError, match="has 256 bytes, the wrapper says"):
        huge.to_tensor()
    gone = CpuShmIPCWrapper(**{**state, "segment": "lmshm-0-deadbeef"})
    with pytest.raises(FileNotFoundError, match="does not exist.*isolated mode"):
        gone.to_tensor()
    assert len(MAPPINGS) == 0, "failed opens leave nothing mapped"
    w.close()
    del pool, w


def test_mapping_outlives_close_while_a_tensor_uses_it(no_new_segments):
    pool = empty_shared((1000,), torch.float64)
    pool.fill_(3)
    w = CpuShmIPCWrapper.wrap(pool)
    consumer = CpuShmIPCWrapper.Deserialize(w.Serialize())
    t = consumer.to_tensor()
    again = CpuShmIPCWrapper.Deserialize(w.Serialize())
    t2 = again.to_tensor()
    assert MAPPINGS.refcount(("cpu-shm", None, w.segment)) == 2
    consumer.close()
    again.close()
    assert MAPPINGS.refcount(("cpu-shm", None, w.segment)) == 0
    w.close()
    del pool
    gc.collect()
    assert w.segment not in _segments(), "the producer freed its pool: the name is gone"
    assert float(t.sum()) == 3000.0 and float(t2.sum()) == 3000.0  # still mapped, no crash
    del t, t2


def test_too_small_dev_shm_is_a_clear_error_at_wrap_time(no_new_segments):
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    with pytest.raises(OSError, match=r"cannot reserve .* of shared memory in /dev/shm; /dev/shm has .* free"):
        empty_shared((free * 4 + (1 << 30),), torch.uint8)


def test_a_forked_child_never_unlinks_its_parents_segments(no_new_segments):
    pool = empty_shared((128,), torch.int32)
    name = segment_of(pool).name
    pid = os.fork()
    if pid == 0:  # child: run what normal exit would run, then drop the pool
        try:
            seg_mod._unlink_all_at_exit()
            globals().pop("pool", None)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert name in _segments()
    del pool
    gc.collect()
    assert name not in _segments()


def test_segments_are_unlinked_when_the_owner_exits_normally(no_new_segments):
    q = CTX.Queue()
    proc = CTX.Process(target=_exit_normally_with_a_segment, args=(q,))
    proc.start()
    name = q.get(timeout=60)
    proc.join(30)
    assert proc.exitcode == 0
    assert name not in _segments()


def test_segment_files_are_private_to_the_owner(no_new_segments):
    pool = empty_shared((8,), torch.float32)
    mode = os.stat(os.path.join("/dev/shm", segment_of(pool).name)).st_mode & 0o777
    assert mode == 0o600
    del pool


def test_unsealed_memfd_is_refused(no_new_segments):
    fd = os.memfd_create("not-lmshm")
    os.ftruncate(fd, 64)
    os.posix_fallocate(fd, 0, 64)
    token = "lmshm-1-0123abcd"
    FD_INBOX.put(token, fd, session=None)
    w = CpuFdIPCWrapper(dtype="float32", shape=(16,), stride=(1,), storage_offset=0, device="cpu",
                        segment=token, segment_bytes=64, byte_offset=0)
    try:
        with pytest.raises(PermissionError, match="not sealed"):
            w.to_tensor()
    finally:
        assert FD_INBOX.close_session(None) == 0  # the refused fd was taken and closed, not kept


def test_a_segment_whose_name_was_removed_by_someone_else_is_rewrapped_into_a_fresh_one(no_new_segments):
    pool = empty_shared((4, 16), torch.float32)
    pool.fill_(2.5)
    first = CpuShmIPCWrapper.wrap(pool)
    server_side = CpuShmIPCWrapper.Deserialize(first.Serialize())
    server_side.to_tensor()
    server_side.close()
    server_side.release_orphaned()  # what the server does when it believes the producer died
    assert first.segment not in _segments()
    second = CpuShmIPCWrapper.wrap(pool)
    assert second.segment != first.segment and second.segment in _segments()
    consumer = CpuShmIPCWrapper.Deserialize(second.Serialize())
    assert float(consumer.to_tensor().sum()) == 2.5 * 64, "the data moved with the pool"
    pool[0, 0] = 7
    assert consumer.to_tensor()[0, 0].item() == 7, "the caller's tensor was re-pointed"
    for w in (consumer, second, first):
        w.close()
    del pool
