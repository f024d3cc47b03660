"""The registry (lmshm/core/registry.py) in one process: real shared-memory segments and
memfds made by lmshm's CPU wrappers, decoded as the server decodes them, real threads, no
server. The rules are docs/design/service.md's "Registry rules".

The producer and the consumer are one process here, which the CPU wrappers allow; the same
rules across processes and sockets are covered by tests/v1/server/test_service.py and
test_reclaim.py.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading

import pytest
import torch

from lmshm.core import regions
from lmshm.core.errors import ErrorCode
from lmshm.core.registry import (
    REGION_OWNER,
    InstanceExists,
    InstanceNotFound,
    InvalidRegistration,
    NotPermitted,
    RegionLimit,
    Registry,
)
from lmshm.platform.base.fds import FD_INBOX
from lmshm.platform.base.ipc_wrapper import DeviceIPCWrapper
from lmshm.platform.base.mappings import MAPPINGS
from lmshm.platform.base.peer import local_peer
from lmshm.platform.cpu import CpuShmIPCWrapper, empty_shared
from lmshm.platform.kv_wrap import wrap_kv_caches
from lmshm.platform.shm_names import segment_name
from lmshm.wire.protocol import LayerGroup


@pytest.fixture
def kv():
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


def test_registration_maps_every_layer_onto_the_producers_bytes(kv):
    layers, producers = kv
    reg = Registry()
    r, refreshed = register(reg, consumer_layers(producers))
    assert not refreshed and len(reg) == 1
    layers["layer2"].fill_(3.5)
    assert torch.all(r.tensor("layer2") == 3.5)
    assert r.nbytes == sum(t.numel() * 2 for t in layers.values())
    reg.release_all()


def test_a_layer_that_cannot_be_mapped_releases_the_earlier_layers_and_is_named(kv):
    _, producers = kv
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


def test_a_different_registration_under_a_live_id_already_exists(kv):
    _, producers = kv
    reg = Registry()
    register(reg, consumer_layers(producers))
    with pytest.raises(InstanceExists, match="'inst' is already registered") as exc:
        register(reg, consumer_layers(producers)[:3])
    assert exc.value.code == ErrorCode.ALREADY_EXISTS
    with pytest.raises(InstanceExists):  # identical content, but another owner
        register(reg, consumer_layers(producers), owner="B")
    reg.release_all()


def test_identical_registration_from_the_same_owner_is_an_idempotent_refresh(kv):
    _, producers = kv
    reg = Registry()
    first, _ = register(reg, consumer_layers(producers))
    opens = MAPPINGS.opens_total
    again = consumer_layers(producers)
    second, refreshed = register(reg, again)
    assert refreshed and second is first
    assert MAPPINGS.opens_total == opens  # nothing mapped twice
    assert all(w.closed for _, w in again)
    reg.release_all()


def test_unknown_id_is_not_found(kv):
    reg = Registry()
    with pytest.raises(InstanceNotFound) as exc:
        reg.unregister("nope")
    assert exc.value.code == ErrorCode.NOT_FOUND


def test_a_segment_that_does_not_carry_the_peers_pid_is_refused_before_mapping(kv):
    _, producers = kv
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


def test_unregister_while_held_is_deferred_until_the_holder_leaves(kv):
    layers, producers = kv
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


def test_every_registration_is_released_exactly_once(kv):
    _, producers = kv
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
    cache = empty_shared((2, 64), torch.float16, kind="shm")
    producers = wrap_kv_caches({"a": cache[0], "b": cache[1]})
    path = f"/dev/shm/{producers[0].segment}"
    reg = Registry()
    register(reg, [(n, DeviceIPCWrapper.Deserialize(w.Serialize())) for n, w in zip("ab", producers)])
    assert reg.release_owner("A", orphaned=True) == ["inst"]
    assert not os.path.exists(path)  # what a SIGKILLed producer could not unlink
    for w in producers:
        w.close()


def test_bad_requests_are_refused_before_anything_is_mapped(kv):
    _, producers = kv
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


def test_a_group_maps_its_segment_once_and_serves_every_layer(kv):
    layers, producers = kv
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


def test_a_group_offset_outside_the_segment_is_refused_naming_the_layer(kv):
    layers, producers = kv
    wrapper = DeviceIPCWrapper.Deserialize(producers[0].Serialize())
    too_far = producers[-1].storage_offset + producers[1].storage_offset  # one layer past the end
    group = LayerGroup(wrapper, ["l0", "l1", "l2"], [0, producers[1].storage_offset, too_far])
    reg = Registry()
    with pytest.raises(InvalidRegistration, match=r"layer 2 \('l2', cpu-shm\) at storage offset \d+ does not fit"):
        reg.register(peer=local_peer("A"), instance_id="g", model_name="m", world_size=1,
                     worker_rank=0, groups=[group])
    assert wrapper.closed and len(reg) == 0


def test_block_dim_is_part_of_a_registration_and_must_name_a_dimension(kv):
    _, producers = kv
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


# ---- memfds: what a session sent is its own -------------------------------------------------
def test_a_memfd_is_mapped_only_from_the_fds_its_own_session_sent():
    cache = empty_shared((4, 16), torch.float32, kind="memfd")
    (producer,) = wrap_kv_caches({"l0": cache})
    (token, fd), = producer.export_fds().items()
    reg = Registry()
    try:
        def consumer() -> LayerGroup:
            w = DeviceIPCWrapper.Deserialize(producer.Serialize())
            return LayerGroup(w, ["l0"], [w.storage_offset])

        FD_INBOX.put(token, os.dup(fd), session="B")              # sent on B's fd channel
        group = consumer()
        with pytest.raises(InvalidRegistration, match=r"layer 0 \('l0', cpu-memfd\) could not be mapped"):
            reg.register(peer=local_peer("A"), instance_id="m", model_name="m", world_size=1, worker_rank=0,
                         groups=[group])
        assert len(reg) == 0 and group.wrapper.closed
        assert FD_INBOX.count("B") == 1                           # A's refusal left B's fd alone

        FD_INBOX.put(token, os.dup(fd), session="A")
        r, _ = reg.register(peer=local_peer("A"), instance_id="m", model_name="m", world_size=1, worker_rank=0,
                            groups=[consumer()])
        assert FD_INBOX.count("A") == 0                           # taken by the mapping
        cache.fill_(2.5)
        assert torch.all(r.tensor("l0") == 2.5)                   # the producer's bytes
        r.tensor("l0")[1].fill_(-1.0)
        assert torch.all(cache[1] == -1.0)                           # and back
    finally:
        FD_INBOX.close_session("B")
        FD_INBOX.close_session("A")
        reg.release_all()
        producer.close()


# ---- two owners ---------------------------------------------------------------------------
def test_a_second_owner_can_neither_take_over_nor_reclaim_the_first_owners_registration(kv):
    layers, producers = kv
    reg = Registry()
    mine, _ = register(reg, consumer_layers(producers), owner="A", iid="inst")
    register(reg, consumer_layers(producers)[:1], owner="B", iid="other")
    with pytest.raises(InstanceExists, match=f"owner pid {os.getpid()}"):     # identical, but not B's to refresh
        register(reg, consumer_layers(producers), owner="B", iid="inst")
    assert reg.get("inst") is mine and mine.owner == "A"
    assert (mine.owner_pid, mine.owner_uid) == (os.getpid(), os.geteuid())     # what the endpoint checks
    assert reg.count_owned("B", "inst") == (1, 1, False)
    assert reg.release_owner("B", orphaned=True) == ["other"]                  # B's end reclaims B's only
    assert reg.count_owned("B") == (0, 0, False) and reg.count_owned("A", "inst") == (1, 4, True)
    layers["layer3"].fill_(6.0)
    assert not mine.released and torch.all(mine.tensor("layer3") == 6.0)      # still mapped for A
    assert reg.release_owner(REGION_OWNER, orphaned=True) == []                # nobody reclaims the regions
    reg.release_all()


def test_a_name_being_mapped_for_one_owner_is_refused_to_another_meanwhile(kv):
    _, producers = kv
    mapping, go = threading.Event(), threading.Event()

    class Slow(CpuShmIPCWrapper):
        def to_tensor(self) -> torch.Tensor:
            mapping.set()
            go.wait(10)
            return super().to_tensor()

    reg = Registry()
    baseline = len(MAPPINGS)
    first = [(n, Slow(**w.__getstate__())) for n, w in consumer_layers(producers)]
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(r=register(reg, first, owner="A", iid="same")[0]))
    thread.start()
    try:
        assert mapping.wait(10)                                   # A's layers are being mapped
        second = consumer_layers(producers)
        with pytest.raises(InstanceExists, match="being registered right now"):
            register(reg, second, owner="B", iid="same")
        assert all(w.closed for _, w in second) and len(reg) == 0
    finally:
        go.set()
        thread.join()
    r = out["r"]
    assert r.owner == "A" and reg.get("same") is r and not any(w.closed for _, w in first)
    reg.release_all()
    assert r.released and len(MAPPINGS) == baseline


# ---- what the per-session caps read ---------------------------------------------------------
def test_an_owners_counts_follow_its_registrations_at_once_even_while_one_drains(kv):
    layers, producers = kv
    reg = Registry()
    assert reg.count_owned("A", "one") == (0, 0, False)
    one, _ = register(reg, consumer_layers(producers), iid="one")
    two, _ = register(reg, consumer_layers(producers)[:2], iid="two")
    assert reg.count_owned("A", "one") == (2, 6, True)
    nbytes = sum(t.numel() * t.element_size() for t in layers.values())
    assert reg.owners() == [(one, 2, 6, nbytes + two.nbytes)]
    assert reg.page(0, 10) == ([one, two], 2) and reg.page(1, 10) == ([two], 2)
    with reg.hold("one"):
        assert reg.unregister("one") is True                      # deferred: still mapped
        assert reg.count_owned("A", "one") == (1, 2, False)       # but counted out at once
        assert reg.owners() == [(two, 1, 2, two.nbytes)] and reg.draining == 1
        assert not one.released
    assert one.released and reg.draining == 0
    reg.release_owner("A", orphaned=False)
    assert reg.count_owned("A") == (0, 0, False) and reg.owners() == [] and len(reg) == 0


# ---- releasing exactly once ------------------------------------------------------------------
def test_unregister_reclaim_and_shutdown_racing_close_every_wrapper_once(kv):
    _, producers = kv
    closes: list[int] = []

    class Counting(CpuShmIPCWrapper):
        def close(self) -> None:
            closes.append(id(self))                                # every call: a release closes once
            super().close()

    reg = Registry()
    baseline = len(MAPPINGS)
    regs = [register(reg, [(n, Counting(**w.__getstate__())) for n, w in consumer_layers(producers)],
                     iid=f"r{i}")[0] for i in range(8)]
    held = reg.acquire("r0")                                       # one of them in a data operation
    start = threading.Barrier(10)

    def unregister(iid: str) -> None:
        start.wait()
        with contextlib.suppress(InstanceNotFound):
            reg.unregister(iid)

    def reclaim() -> None:
        start.wait()
        reg.release_owner("A", orphaned=False)

    def shutdown() -> None:
        start.wait()
        reg.release_all()

    threads = [threading.Thread(target=unregister, args=(f"r{i}",)) for i in range(8)]
    threads += [threading.Thread(target=reclaim), threading.Thread(target=shutdown)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reg.let_go(held)
    reg.release_all()
    assert all(r.released for r in regs) and len(reg) == 0 and reg.draining == 0
    assert sorted(closes) == sorted(id(w) for r in regs for w in r.wrappers)    # each once, none twice
    assert len(MAPPINGS) == baseline


# ---- regions: the same namespace, their own limit ---------------------------------------------
@pytest.fixture
def shm_object():
    """A client's POSIX shared-memory object of 8 KiB (not an lmshm segment)."""
    name = f"test-region-{os.getpid()}"
    path = f"/dev/shm/{name}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 8192)
    os.close(fd)
    yield "/" + name
    os.unlink(path)


def test_the_region_limit_counts_a_region_still_being_opened_and_a_failed_open_frees_its_name(kv, shm_object):
    _, producers = kv
    reg = Registry()
    register(reg, consumer_layers(producers)[:1], iid="kv")
    opening, go = threading.Event(), threading.Event()
    out: dict = {}

    def open_slowly():
        opening.set()
        go.wait(10)
        return regions.open_system(shm_object, shm_object[1:], 0, 4096, ())

    def add() -> None:
        out["reg"] = reg.add_region("r1", "system", open_slowly, max_regions=1)

    thread = threading.Thread(target=add)
    thread.start()
    assert opening.wait(10)
    with pytest.raises(RegionLimit, match="holds 1 regions"):                  # r1 is not live yet
        reg.add_region("r2", "system", lambda: pytest.fail("opened past the limit"), max_regions=1)
    with pytest.raises(InstanceExists, match="being registered right now"):
        reg.add_region("r1", "system", lambda: pytest.fail("opened twice"), max_regions=2)
    with pytest.raises(InstanceExists, match="KV-cache registration"):         # one namespace
        reg.add_region("kv", "system", lambda: pytest.fail("shadowed a KV registration"))
    go.set()
    thread.join()
    region = out["reg"]
    assert region.owner == REGION_OWNER and reg.region("r1", "system") is region
    with pytest.raises(InstanceNotFound, match="is a KV-cache registration, not a system"):
        reg.region("kv", "system")

    def refuse():
        raise OSError("cannot open")

    with pytest.raises(OSError):
        reg.add_region("r3", "system", refuse, max_regions=2)
    assert reg.add_region("r3", "system", lambda: regions.open_system(shm_object, shm_object[1:], 0, 8192, ()),
                          max_regions=2).nbytes == 8192                        # the name is free again
    assert reg.unregister_region("kv", "system") is False                      # not a region: left alone
    assert reg.unregister_regions("system") == 2 and len(reg) == 1
    assert region.released and region.region.tensor is None
    reg.release_all()
