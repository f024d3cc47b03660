"""The data plane in this process: a real ``Core`` (its pool's memory, its copier threads), a
worker's KV cache in a named segment registered as the server registers it, and no server.

Each test drives ``DataPlane.store/retrieve/lookup/release`` with a session as an endpoint
passes it, and reads the answers that the queued jobs send through ``reply``.
"""

from __future__ import annotations

import gc
import os
import threading
from dataclasses import dataclass

import pytest
import torch

from lmshm.core.config import CoreConfig
from lmshm.core.dataplane import QUEUED, DataPlaneError
from lmshm.core.errors import ErrorCode, ServerError
from lmshm.core.pool import Reservation
from lmshm.core.service import Core
from lmshm.platform.base.ipc_wrapper import DeviceIPCWrapper
from lmshm.platform.base.peer import Peer, local_peer
from lmshm.platform.cpu import empty_shared
from lmshm.platform.kv_wrap import wrap_kv_caches
from lmshm.wire.protocol import (
    ErrorReply,
    LayerGroup,
    Lookup,
    LookupReply,
    Release,
    Retrieve,
    RetrieveReply,
    Store,
    StoreReply,
)

LAYERS, BLOCKS, BLOCK_SHAPE = 2, 8, (16, 8)     # float16: 256 bytes a block of a layer
BLOCK_BYTES = 16 * 8 * 2
WAIT_S = 10.0


@dataclass
class Session:
    """A verified session as the ZeroMQ endpoint hands it to the data plane."""

    id: str
    peer: Peer
    ended: bool = False


class Answers:
    """What the core's ``reply`` callback received, by request id."""

    def __init__(self) -> None:
        self._got: dict[bytes, object] = {}
        self._cond = threading.Condition()
        self._next = 0

    def reply(self, identity: bytes, request_id: bytes, answer: object) -> None:
        with self._cond:
            self._got[request_id] = answer
            self._cond.notify_all()

    def new_id(self) -> bytes:
        self._next += 1
        return b"r%d" % self._next

    def wait(self, request_id: bytes, timeout: float = WAIT_S) -> object:
        with self._cond:
            assert self._cond.wait_for(lambda: request_id in self._got, timeout), f"no answer to {request_id!r}"
            return self._got.pop(request_id)

    def pending(self, request_id: bytes) -> bool:
        with self._cond:
            return request_id not in self._got


class Plane:
    """A core, a worker's registered KV cache, and helpers to ask the data plane."""

    def __init__(self, **config) -> None:
        self.answers = Answers()
        self.core = Core(CoreConfig(capacity=config.pop("capacity", 1 << 20), **config), reply=self.answers.reply)
        self.dp = self.core.dataplane
        self.session = Session("s1", local_peer("s1"))
        self.cache = empty_shared((LAYERS, BLOCKS, *BLOCK_SHAPE), torch.float16, kind="shm")
        for layer in range(LAYERS):
            for b in range(BLOCKS):
                self.block(layer, b).fill_(16 * layer + b + 1)
        self.producers = wrap_kv_caches({f"l{i}": self.cache[i] for i in range(LAYERS)})
        self.register(self.session, "kv")

    def register(self, session: Session, instance_id: str) -> None:
        """As the server does with a REGISTER: the wrappers as decoded from the wire, mapped."""
        groups = [LayerGroup(DeviceIPCWrapper.Deserialize(w.Serialize()), [f"l{i}"], [w.storage_offset])
                  for i, w in enumerate(self.producers)]
        self.core.registry.register(peer=session.peer, instance_id=instance_id, model_name="m", world_size=1,
                                    worker_rank=0, groups=groups)

    def block(self, layer: int, b: int) -> torch.Tensor:
        return self.cache[layer, b].view(torch.int16)

    def blocks(self, ids) -> list[bytes]:
        return [bytes(self.block(layer, b).numpy().tobytes()) for layer in range(LAYERS) for b in ids]

    def ask(self, method, req, session: Session | None = None):
        """Call ``method`` as the endpoint does; a queued request's answer is waited for."""
        rid = self.answers.new_id()
        if method == "release":
            return self.dp.release(session or self.session, req)
        answer = getattr(self.dp, method)(session or self.session, req, (b"client", rid))
        return self.answers.wait(rid) if answer is QUEUED else answer

    def hold_copier(self, session: Session | None = None) -> threading.Event:
        """Occupy the session's FIFO on the copier threads until the returned event is set."""
        go = threading.Event()
        self.dp.copier.submit((session or self.session).id, lambda: go.wait(WAIT_S), lambda: None)
        return go

    def close(self) -> None:
        self.core.shutdown()
        for w in self.producers:
            w.close()
        self.producers = []
        self.cache = None
        gc.collect()


@pytest.fixture
def plane():
    made: list[Plane] = []

    def make(**config) -> Plane:
        made.append(Plane(**config))
        return made[-1]

    yield make
    for p in made:
        p.close()


def test_a_stored_chunk_is_found_and_retrieved_byte_for_byte_into_other_blocks(plane):
    p = plane()
    sent = p.blocks([1, 2])
    reply = p.ask("store", Store("kv", [b"k0"], [1, 2], 2))
    assert isinstance(reply, StoreReply), reply
    assert reply.results == [Reservation.STORED] and reply.nbytes == 2 * LAYERS * BLOCK_BYTES
    found = p.ask("lookup", Lookup([[b"k0", b"k1"]]))
    assert isinstance(found, LookupReply) and found.hits == 1 and found.lease
    untouched = p.blocks([0, 3, 4, 7])
    assert p.blocks([5, 6]) != sent
    reply = p.ask("retrieve", Retrieve("kv", [b"k0"], [5, 6], 2, found.lease))
    assert isinstance(reply, RetrieveReply) and reply.nbytes == 2 * LAYERS * BLOCK_BYTES, reply
    assert p.blocks([5, 6]) == sent
    assert p.blocks([0, 3, 4, 7]) == untouched
    assert p.core.registry.get("kv").holds == 0
    assert p.dp.pool.info()["pinned"] == 0


def test_a_second_store_of_a_key_is_skipped_and_the_first_bytes_stay(plane):
    p = plane()
    first = p.blocks([0, 1])
    assert p.ask("store", Store("kv", [b"k0"], [0, 1], 2)).results == [Reservation.STORED]
    reply = p.ask("store", Store("kv", [b"k0"], [3, 4], 2))
    assert reply.results != [Reservation.STORED] and reply.nbytes == 0
    lease = p.ask("lookup", Lookup([[b"k0"]])).lease
    p.ask("retrieve", Retrieve("kv", [b"k0"], [6, 7], 2, lease))
    assert p.blocks([6, 7]) == first


def test_a_lease_pins_its_chunks_until_it_is_released_or_retrieved(plane):
    p = plane()
    p.ask("store", Store("kv", [b"k0", b"k1"], [0, 1], 1))
    found = p.ask("lookup", Lookup([[b"k0", b"k1"]]))
    assert found.hits == 2
    info = p.dp.pool.info()
    assert info["leases"] == 1 and info["pinned"] == 2
    assert p.ask("release", Release(found.lease)).released
    info = p.dp.pool.info()
    assert info["leases"] == 0 and info["pinned"] == 0
    found = p.ask("lookup", Lookup([[b"k0", b"k1"]]))
    assert isinstance(p.ask("retrieve", Retrieve("kv", [b"k0", b"k1"], [5, 6], 1, found.lease)), RetrieveReply)
    info = p.dp.pool.info()
    assert info["leases"] == 0 and info["pinned"] == 0


def test_a_lease_of_another_uid_is_not_released(plane):
    p = plane()
    p.ask("store", Store("kv", [b"k0"], [0], 1))
    lease = p.ask("lookup", Lookup([[b"k0"]])).lease
    stranger = Session("s2", Peer("s2", pid=os.getpid(), uid=os.geteuid() + 1, gid=0, ns_pid=0, pid_ns=0))
    assert not p.ask("release", Release(lease), stranger).released
    assert p.dp.pool.info()["leases"] == 1


def test_leases_are_capped_per_session_and_per_uid(plane):
    p = plane(max_leases_per_session=2, max_leases_per_uid=3)
    p.ask("store", Store("kv", [b"k0"], [0], 1))
    for _ in range(2):
        assert p.ask("lookup", Lookup([[b"k0"]])).hits == 1
    with pytest.raises(DataPlaneError, match="--max-leases-per-session") as refused:
        p.ask("lookup", Lookup([[b"k0"]]))
    assert refused.value.code == ErrorCode.UNAVAILABLE
    other = Session("s2", local_peer("s2"))          # the same uid
    assert p.ask("lookup", Lookup([[b"k0"]]), other).hits == 1
    with pytest.raises(DataPlaneError, match="--max-leases-per-uid"):
        p.ask("lookup", Lookup([[b"k0"]]), other)


def test_requests_in_flight_are_capped_per_session_and_answered_in_order(plane):
    p = plane(max_inflight_per_session=3)
    go = p.hold_copier()
    rids = []
    for key, ids in ((b"k0", [0]), (b"k1", [1])):
        rid = p.answers.new_id()
        assert p.dp.store(p.session, Store("kv", [key], ids, 1), (b"client", rid)) is QUEUED
        rids.append(rid)
    with pytest.raises(DataPlaneError, match="--max-inflight-per-session") as refused:
        p.dp.store(p.session, Store("kv", [b"k2"], [2], 1), (b"client", b"over"))
    assert refused.value.code == ErrorCode.UNAVAILABLE
    other = Session("s2", local_peer("s2"))
    p.register(other, "kv2")
    assert isinstance(p.ask("store", Store("kv2", [b"k9"], [3], 1), other), StoreReply)   # not held up
    assert all(p.answers.pending(rid) for rid in rids)
    go.set()
    assert [p.answers.wait(rid).results for rid in rids] == [[Reservation.STORED]] * 2
    assert p.core.registry.get("kv").holds == 0


def test_a_session_that_ends_with_requests_in_flight_copies_nothing_and_lets_go(plane):
    p = plane()
    p.ask("store", Store("kv", [b"k0"], [0], 1))
    lease = p.ask("lookup", Lookup([[b"k0"]])).lease
    go = p.hold_copier()
    store, retrieve = p.answers.new_id(), p.answers.new_id()
    p.dp.store(p.session, Store("kv", [b"k1"], [1], 1), (b"client", store))
    p.dp.retrieve(p.session, Retrieve("kv", [b"k0"], [5], 1, lease), (b"client", retrieve))
    before = p.blocks([5])
    assert p.core.registry.get("kv").holds == 2       # each queued job holds the registration
    p.session.ended = True
    p.dp.session_ended(p.session.id)
    assert p.dp.pool.info()["leases"] == 0            # the session's leases end with it
    go.set()
    for rid, what in ((store, "STORE"), (retrieve, "RETRIEVE")):
        answer = p.answers.wait(rid)
        assert isinstance(answer, ErrorReply) and answer.code in (ErrorCode.UNAVAILABLE, ErrorCode.NOT_FOUND)
        assert answer.message.startswith(what), answer
    assert p.blocks([5]) == before
    info = p.dp.pool.info()
    assert info["objects"] == 1 and info["pinned"] == 0 and info["in_flight"] == 0
    assert p.core.registry.get("kv").holds == 0


def test_a_shutdown_answers_queued_copies_and_lets_their_registrations_go(plane):
    p = plane()
    go = p.hold_copier()
    rid = p.answers.new_id()
    p.dp.store(p.session, Store("kv", [b"k0"], [0], 1), (b"client", rid))
    reg = p.core.registry.get("kv")
    stopping = threading.Thread(target=p.dp.shutdown)
    stopping.start()
    go.set()
    answer = p.answers.wait(rid)
    stopping.join(WAIT_S)
    assert isinstance(answer, ErrorReply) and answer.code == ErrorCode.UNAVAILABLE
    assert "shutting down" in answer.message
    assert reg.holds == 0


@pytest.mark.parametrize("method, req, code, words", [
    ("store", Store("nope", [b"k0"], [0], 1), ErrorCode.NOT_FOUND, "nope"),
    ("store", Store("kv", [b"k0"], [0, 1, 2], 2), ErrorCode.INVALID_ARG, "need 2 block ids"),
    ("store", Store("kv", [b"k0"], [BLOCKS], 1), ErrorCode.INVALID_ARG, "out of range"),
    ("retrieve", Retrieve("kv", [b"k0", b"k1"], [0], 1), ErrorCode.INVALID_ARG, "need 2 block ids"),
    ("lookup", Lookup([[b"k0"], [b"k0", b"k1"]]), ErrorCode.INVALID_ARG, "same number of keys"),
])
def test_a_bad_request_is_refused_on_the_loop_with_its_code(plane, method, req, code, words):
    p = plane()
    with pytest.raises(ServerError, match=words) as refused:
        p.ask(method, req)
    assert refused.value.code == code
    assert p.core.registry.get("kv").holds == 0 and p.dp.copier.idle()


def test_an_instance_of_another_session_is_refused(plane):
    p = plane()
    stranger = Session("s2", local_peer("s2"))
    with pytest.raises(DataPlaneError, match="belongs to another session") as refused:
        p.ask("store", Store("kv", [b"k0"], [0], 1), stranger)
    assert refused.value.code == ErrorCode.PERMISSION_DENIED


def test_a_retrieve_of_a_chunk_not_stored_is_answered_not_found_and_writes_nothing(plane):
    p = plane()
    before = p.blocks([4])
    answer = p.ask("retrieve", Retrieve("kv", [b"absent"], [4], 1))
    assert isinstance(answer, ErrorReply) and answer.code == ErrorCode.NOT_FOUND
    assert "no block was written" in answer.message
    assert p.blocks([4]) == before


def test_a_retrieve_into_another_chunk_size_is_refused_as_another_layout(plane):
    p = plane()
    p.ask("store", Store("kv", [b"k0"], [0, 1], 2))
    lease = p.ask("lookup", Lookup([[b"k0"]])).lease
    answer = p.ask("retrieve", Retrieve("kv", [b"k0"], [4], 1, lease))
    assert isinstance(answer, ErrorReply) and answer.code == ErrorCode.LAYOUT
    assert p.dp.pool.info()["pinned"] == 0


def test_a_core_without_a_pool_refuses_copies_and_finds_nothing(plane):
    p = plane(capacity=0)
    with pytest.raises(DataPlaneError, match="no pool") as refused:
        p.ask("store", Store("kv", [b"k0"], [0], 1))
    assert refused.value.code == ErrorCode.UNAVAILABLE
    assert p.ask("lookup", Lookup([[b"k0"]])).hits == 0


def test_a_store_past_its_senders_wait_is_refused_as_late_and_stores_nothing(plane):
    p = plane()
    go = p.hold_copier()
    rid = p.answers.new_id()
    p.dp.store(p.session, Store("kv", [b"k0"], [0], 1, wait_s=0.05), (b"client", rid))
    threading.Event().wait(0.2)
    go.set()
    answer = p.answers.wait(rid)
    assert isinstance(answer, ErrorReply) and "waited past its sender's timeout" in answer.message
    assert p.dp.late_requests == 1 and p.dp.pool.info()["objects"] == 0


# ---- Issue 43 attack round: a queued request is answered once, whatever its job does ----------


class _Promotion:
    def release(self) -> None:
        pass


class _Tiers:
    """Stands in for the tier stack: ``promote`` is the test's."""

    timeout_s = 1.0

    def __init__(self, promote) -> None:
        self.promote = promote

    def close(self) -> bool:
        return True


def _with_tiers(p: Plane, promote) -> None:
    from lmshm.core.dataplane.executor import OrderedExecutor

    p.dp.tiers = _Tiers(promote)
    p.dp.promoter = OrderedExecutor(1, "lmshm-promote-test")


def test_a_copy_job_that_raises_is_answered_internal_and_lets_its_registration_go(plane, monkeypatch):
    p = plane()

    def boom(job):
        raise RuntimeError("a bug in the copy")

    monkeypatch.setattr(p.dp.host, "run", boom)
    answer = p.ask("store", Store("kv", [b"k0"], [0], 1))
    assert isinstance(answer, ErrorReply) and answer.code == ErrorCode.INTERNAL, answer
    assert answer.message.startswith("STORE failed in the server: RuntimeError: a bug in the copy")
    assert p.core.registry.get("kv").holds == 0
    monkeypatch.undo()
    assert isinstance(p.ask("store", Store("kv", [b"k0"], [0], 1)), StoreReply)   # the session's FIFO goes on


def test_a_promoting_lookup_whose_tier_raises_is_answered_internal(plane):
    p = plane()

    def boom(uid, keys, deadline):
        raise OSError("the tier broke")

    _with_tiers(p, boom)
    answer = p.ask("lookup", Lookup([[b"k0"]]))
    assert isinstance(answer, ErrorReply) and answer.code == ErrorCode.INTERNAL, answer
    assert "LOOKUP failed in the server: OSError" in answer.message
    assert p.dp.pool.info()["leases"] == 0


def test_a_session_that_ends_while_its_lookup_promotes_keeps_no_lease(plane):
    p = plane()
    assert p.ask("store", Store("kv", [b"k0"], [0], 1)).results == [Reservation.STORED]

    def session_ends(uid, keys, deadline):      # the worker exits while the tier is read
        p.session.ended = True
        p.dp.session_ended(p.session.id)
        return _Promotion()

    _with_tiers(p, session_ends)
    answer = p.ask("lookup", Lookup([[b"k0", b"only-below"]]))      # k0 in the pool: a lease would pin it
    assert isinstance(answer, ErrorReply) and answer.code == ErrorCode.UNAVAILABLE, answer
    info = p.dp.pool.info()
    assert info["leases"] == 0 and info["pinned"] == 0


def test_a_store_whose_adverts_cannot_be_queued_is_refused_and_lets_its_registration_go(plane, monkeypatch):
    from lmshm.wire.protocol import Advert, pack_adverts

    p = plane()
    assert p.dp.kv.enabled

    def broken(*args, **kw):
        raise RuntimeError("the KV event index broke")

    monkeypatch.setattr(p.dp.kv, "describe", broken)
    adverts = pack_adverts([Advert(b"c0", 0, 16, [1])])
    with pytest.raises(RuntimeError, match="index broke"):     # the endpoint answers it INTERNAL
        p.dp.store(p.session, Store("kv", [b"k0"], [0], 1, adverts=adverts), (b"client", b"r"))
    assert p.core.registry.get("kv").holds == 0 and p.dp.copier.idle()
