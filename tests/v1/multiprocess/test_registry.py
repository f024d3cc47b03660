"""Registry rules (design.md section 4) on real shared-memory segments.

The producer and the consumer are one process here, which the CPU wrappers allow; the same
rules across processes and sockets are covered by test_service.py and test_reclaim.py.
"""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch

from lmshm.core.registry import (
    InstanceExists,
    InstanceNotFound,
    InvalidRegistration,
    NotPermitted,
    Registry,
)
from lmshm.platform.base.ipc_wrapper import DeviceIPCWrapper
from lmshm.platform.base.mappings import MAPPINGS
from lmshm.platform.base.peer import local_peer
from lmshm.platform.cpu import CpuShmIPCWrapper, empty_shared
from lmshm.platform.kv_wrap import wrap_kv_caches
from lmshm.platform.shm_names import segment_name
from lmshm.wire.protocol import ErrorCode, LayerGroup


@pytest.fixture
def pool():
    """Producer side: 4 layers in one named segment (no fd channel here), plus their producer
    wrappers."""
    big = empty_shared((4, 2, 8, 16), torch.float16, kind="shm")
    layers = {f"layer{i}": big[i] for i in range(4)}
    producers = wrap_kv_caches(layers)
    held = [layers, producers]
    yield held
    for w in producers:
        w.close()
    held.clear()  # pytest keeps the fixture value until teardown ends: let go of the tensors
    del big, layers, producers
    gc.collect()


def consumer_layers(producers) -> list[tuple[str, DeviceIPCWrapper]]:
    """What the server decodes from the wire: fresh wrappers, nothing mapped yet."""
    return [(f"layer{i}", DeviceIPCWrapper.Deserialize(w.Serialize())) for i, w in enumerate(producers)]


def as_groups(layers) -> list[LayerGroup]:
    """One single-layer group per (name, wrapper), as a client sends unrelated wrappers."""
    return [LayerGroup(w, [name], [w.storage_offset]) for name, w in layers]


def register(reg: Registry, layers, owner="A", iid="inst"):
    return reg.register(peer=local_peer(owner), instance_id=iid, model_name="m",
                        world_size=1, worker_rank=0, groups=as_groups(layers))


def test_registration_maps_every_layer_onto_the_producers_bytes(pool):
    layers, producers = pool
    reg = Registry()
    r, refreshed = register(reg, consumer_layers(producers))
    assert not refreshed and len(reg) == 1
    layers["layer2"].fill_(3.5)
    assert torch.all(r.tensor("layer2") == 3.5)
    assert r.nbytes == sum(t.numel() * 2 for t in layers.values())
    reg.release_all()


def test_a_layer_that_cannot_be_mapped_releases_the_earlier_layers_and_is_named(pool):
    _, producers = pool
    reg = Registry()
    good = consumer_layers(producers)[:2]
    missing = CpuShmIPCWrapper(dtype="float16", shape=(4,), stride=(1,), storage_offset=0, device="cpu",
                               segment=segment_name(), segment_bytes=4096, byte_offset=0)
    mappings_before = len(MAPPINGS)
    with pytest.raises(InvalidRegistration, match=r"layer 2 \('bad'.*does not exist") as exc:
        register(reg, good + [("bad", missing)])
    assert exc.value.code == ErrorCode.INVALID_ARG
    assert len(reg) == 0 and len(MAPPINGS) == mappings_before
    assert all(w.closed for _, w in good)


def test_a_different_registration_under_a_live_id_already_exists(pool):
    _, producers = pool
    reg = Registry()
    register(reg, consumer_layers(producers))
    with pytest.raises(InstanceExists, match="'inst' is already registered") as exc:
        register(reg, consumer_layers(producers)[:3])
    assert exc.value.code == ErrorCode.ALREADY_EXISTS
    with pytest.raises(InstanceExists):  # identical content, but another owner
        register(reg, consumer_layers(producers), owner="B")
    reg.release_all()


def test_identical_registration_from_the_same_owner_is_an_idempotent_refresh(pool):
    _, producers = pool
    reg = Registry()
    first, _ = register(reg, consumer_layers(producers))
    opens = MAPPINGS.opens_total
    again = consumer_layers(producers)
    second, refreshed = register(reg, again)
    assert refreshed and second is first
    assert MAPPINGS.opens_total == opens  # nothing mapped twice
    assert all(w.closed for _, w in again)
    reg.release_all()


def test_unknown_id_is_not_found(pool):
    reg = Registry()
    with pytest.raises(InstanceNotFound) as exc:
        reg.unregister("nope")
    assert exc.value.code == ErrorCode.NOT_FOUND


def test_a_segment_that_does_not_carry_the_peers_pid_is_refused_before_mapping(pool):
    _, producers = pool
    reg = Registry()
    stranger = local_peer("A")
    stranger = type(stranger)(session="A", pid=stranger.pid, uid=stranger.uid, gid=stranger.gid,
                              ns_pid=stranger.ns_pid + 1, pid_ns=stranger.pid_ns)
    opens = MAPPINGS.opens_total
    with pytest.raises(NotPermitted, match="was made by pid") as exc:
        reg.register(peer=stranger, instance_id="x", model_name="m", world_size=1, worker_rank=0,
                     groups=as_groups(consumer_layers(producers)))
    assert exc.value.code == ErrorCode.PERMISSION_DENIED
    assert MAPPINGS.opens_total == opens and len(reg) == 0


def test_unregister_while_held_is_deferred_until_the_holder_leaves(pool):
    layers, producers = pool
    reg = Registry()
    r, _ = register(reg, consumer_layers(producers))
    with reg.hold("inst") as held:
        assert reg.unregister("inst") is True
        assert len(reg) == 0 and reg.draining == 1
        layers["layer0"].fill_(1.25)
        assert torch.all(held.tensor("layer0") == 1.25)  # still mapped
        assert not any(w.closed for w in r.wrappers)
        with pytest.raises(InstanceNotFound):
            reg.hold("inst").__enter__()
    assert r.released and reg.draining == 0
    assert all(w.closed for w in r.wrappers) and not r.bases and not r.views


def test_every_registration_is_released_exactly_once(pool):
    _, producers = pool
    closes: list[str] = []

    class Counting(CpuShmIPCWrapper):
        def close(self) -> None:
            if not self.closed:
                closes.append(self.segment)
            super().close()

    layers = [(n, Counting(**w.__getstate__())) for n, w in consumer_layers(producers)]
    reg = Registry()
    r, _ = register(reg, layers)
    threads = [threading.Thread(target=lambda: reg.release_owner("A", orphaned=False)) for _ in range(4)]
    with reg.hold("inst"):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        reg.release_all()
    reg.release_all()
    assert len(closes) == len(layers) and r.released


def test_reclaiming_a_dead_owner_releases_orphaned_segment_names():
    pool = empty_shared((2, 64), torch.float16, kind="shm")
    producers = wrap_kv_caches({"a": pool[0], "b": pool[1]})
    path = f"/dev/shm/{producers[0].segment}"
    reg = Registry()
    register(reg, [(n, DeviceIPCWrapper.Deserialize(w.Serialize())) for n, w in zip("ab", producers)])
    assert reg.release_owner("A", orphaned=True) == ["inst"]
    assert not os.path.exists(path)  # what a SIGKILLed producer could not unlink
    for w in producers:
        w.close()


def test_bad_requests_are_refused_before_anything_is_mapped(pool):
    _, producers = pool
    reg = Registry()
    opens = MAPPINGS.opens_total
    for kwargs, match in [
        (dict(instance_id=""), "instance id"),
        (dict(instance_id="__lmshm.internal"), "reserved for the server"),
        (dict(world_size=2, worker_rank=2), "worker_rank 2"),
        (dict(groups=[]), "at least one layer"),
        (dict(groups=as_groups(consumer_layers(producers)[:1] * 2)), "appears twice"),
        (dict(groups=[LayerGroup(producers[0], ["a", "b"], [0])]), "2 names and 1 storage offsets"),
    ]:
        args = dict(peer=local_peer("A"), instance_id="x", model_name="m", world_size=1, worker_rank=0,
                    groups=as_groups(consumer_layers(producers)))
        args.update(kwargs)
        with pytest.raises(InvalidRegistration, match=match):
            reg.register(**args)
    assert MAPPINGS.opens_total == opens


def test_a_group_maps_its_segment_once_and_serves_every_layer(pool):
    layers, producers = pool
    # What the client sends for the 4 views of one pool: one wrapper, four names and offsets.
    group = LayerGroup(DeviceIPCWrapper.Deserialize(producers[0].Serialize()), list(layers),
                       [w.storage_offset for w in producers])
    opens = MAPPINGS.opens_total
    reg = Registry()
    r, _ = reg.register(peer=local_peer("A"), instance_id="g", model_name="m", world_size=1,
                        worker_rank=0, groups=[group])
    assert MAPPINGS.opens_total == opens + 1 and r.num_layers == 4
    assert r.nbytes == sum(t.numel() * t.element_size() for t in layers.values())
    for i, (name, t) in enumerate(layers.items()):
        t.fill_(i + 0.5)
        server_side = r.tensor(name)
        assert server_side.shape == t.shape and server_side.stride() == t.stride()
        assert torch.all(server_side == i + 0.5), f"layer {name} must alias the producer's bytes"
    assert r.tensor("no-such-layer") is None
    reg.unregister("g")
    assert r.tensor("layer0") is None and not r.views


def test_a_group_offset_outside_the_segment_is_refused_naming_the_layer(pool):
    layers, producers = pool
    wrapper = DeviceIPCWrapper.Deserialize(producers[0].Serialize())
    too_far = producers[-1].storage_offset + producers[1].storage_offset  # one layer past the end
    group = LayerGroup(wrapper, ["l0", "l1", "l2"], [0, producers[1].storage_offset, too_far])
    reg = Registry()
    with pytest.raises(InvalidRegistration, match=r"layer 2 \('l2', cpu-shm\) at storage offset \d+ does not fit"):
        reg.register(peer=local_peer("A"), instance_id="g", model_name="m", world_size=1,
                     worker_rank=0, groups=[group])
    assert wrapper.closed and len(reg) == 0


def test_block_dim_is_part_of_a_registration_and_must_name_a_dimension(pool):
    _, producers = pool
    reg = Registry()

    def register_with(block_dim, iid="inst"):
        return reg.register(peer=local_peer("A"), instance_id=iid, model_name="m", world_size=1, worker_rank=0,
                            groups=as_groups(consumer_layers(producers)), block_dim=block_dim)

    with pytest.raises(InvalidRegistration, match=r"block_dim 3 is not a dimension of layer 'layer0' "
                                                  r"\(shape \(2, 8, 16\), 3 dims\)") as exc:
        register_with(3)
    assert exc.value.code == ErrorCode.INVALID_ARG and len(reg) == 0
    r, refreshed = register_with(2)
    assert r.block_dim == 2 and not refreshed
    assert register_with(2)[1] is True                       # the same content: a refresh
    with pytest.raises(InstanceExists):                       # another block dim: other content
        register_with(1)
    reg.release_all()
