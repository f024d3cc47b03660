"""Issue 15's pool findings (4-7) against a real lmshm-server: a verified attacker (``RawSession``,
this process) against the server's memory, its STATUS and its pool, while honest workers (their
own processes; one under another admitted uid where the test runs as root) store and retrieve.

Every test ends with an honest worker storing and retrieving, and with the server's fds,
sessions, registrations and pool levels (in flight, pinned, leases) back where they started,
and its RSS too, apart from the objects the pool keeps (``Baseline.check``). The pool logic
itself is tested in tests/v1/core/test_pool_limits.py.
"""

from __future__ import annotations

import os
import shutil
import statistics
import threading
import time

import pytest
from harness import (
    OwnSegments,
    RawSession,
    assert_back_to,
    server_counts,
    server_rss_kb,
    shm_wrapper,
    wait_for,
)

from lmshm.transport.client import query_status
from lmshm.wire import codec, protocol

NOBODY = 65534
KEYS = protocol.MAX_KEYS        # 65,536: the most one request may name
LEVELS = ("in_flight", "pinned", "leases", "pinned_bytes", "lease_pins")


@pytest.fixture
def own_segment():
    segments = OwnSegments()
    yield segments
    segments.unlink_all()


def pool_levels(url: str) -> dict:
    p = query_status(url).pool
    return {name: getattr(p, name, 0) for name in LEVELS}


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def tiny_blocks(session: RawSession, own_segment, iid: str, size: int = 4096) -> None:
    """Register a layer of ``size`` 1-byte blocks: every chunk of one block is a 1-byte object."""
    wrapper = shm_wrapper(own_segment(size).name, size, dtype="uint8")
    assert isinstance(session.register(iid, wrapper), protocol.RegisterReply)


def store_tiny(session: RawSession, iid: str, keys: list[bytes]) -> protocol.StoreReply:
    reply = session.request(protocol.Store(iid, keys, [0] * len(keys), 1), timeout_s=120)
    assert isinstance(reply, protocol.StoreReply), reply
    return reply


class Baseline:
    """The server's counters before the attack. Taken after one reply larger than 64 KiB: pyzmq
    sends those without copying, through a thread and a ZeroMQ context it starts once (7 fds),
    which must not count as the attack's."""

    def __init__(self, server, own_segment) -> None:
        self.server = server
        with RawSession(server.url, timeout_s=60) as s:
            tiny_blocks(s, own_segment, "warm-up")
            store_tiny(s, "warm-up", [key(0)] * KEYS)          # 1 object, 65,535 times PRESENT
            s.unregister("warm-up")
        self.counts = wait_for(lambda: (c := server_counts(server.url))["sessions"] == 0 and c, 10, 0.05,
                               "the warm-up session to end")
        self.levels = pool_levels(server.url)
        self.used = query_status(server.url).pool.used

    def check(self) -> None:
        """fds, sessions, registrations and mappings back (``assert_back_to``); the pool's levels
        back; the RSS back within ``RSS_SLACK_KB`` plus what the pool now holds more than before
        (stored objects stay, as a cache's do, charged against --capacity)."""
        assert self.server.alive, self.server.log()[-4000:]
        kept_kb = max(0, query_status(self.server.url).pool.used - self.used) // 1024
        assert_back_to(self.server.url, {**self.counts, "rss_kb": self.counts["rss_kb"] + kept_kb}, fd_slack=1,
                       timeout_s=10)
        wait_for(lambda: pool_levels(self.server.url) == self.levels, 10, 0.05,
                 f"the pool's levels to return to {self.levels}")


def honest_round_trip(start_worker, server, *prefix: str) -> dict:
    """An honest worker registers, stores two chunks, finds them and retrieves them into other
    blocks: the bytes must match. Returns its STORE's results; the worker exits."""
    w = start_worker(server.url, prefix=list(prefix) or None)
    iid = w.ok("register_kv")["instance_id"]
    w.ok("fill_blocks", instance_id=iid, blocks=[0, 1], seed=int.from_bytes(os.urandom(2), "big"))
    want = w.ok("digest_blocks", instance_id=iid, blocks=[0, 1])["digests"]
    keys = [os.urandom(16).hex() for _ in range(2)]
    stored = w.ok("store", instance_id=iid, keys=keys, blocks=[0, 1], chunk_blocks=1)
    if stored["results"] == [protocol.StoreResult.STORED] * 2:
        found = w.ok("lookup", keys=[keys])
        assert found["hits"] == 2, found
        w.ok("retrieve", instance_id=iid, keys=keys, blocks=[5, 6], chunk_blocks=1, lease=found["lease"])
        assert w.ok("digest_blocks", instance_id=iid, blocks=[5, 6])["digests"] == want
    w.ok("unregister", instance_id=iid)
    w.exit()
    return stored


# ---- 4: a lease holds each object once ---------------------------------------------------


def test_a_lookup_naming_one_key_65536_times_pins_it_once(start_server, start_worker, own_segment):
    server = start_server()
    base = Baseline(server, own_segment)
    pid = query_status(server.url).server_pid
    with RawSession(server.url, timeout_s=60) as s:
        tiny_blocks(s, own_segment, "bomb")
        k = key(1)
        store_tiny(s, "bomb", [k])
        bomb = codec.encode(protocol.Lookup([[k] * KEYS]))
        for _ in range(8):   # the allocator's arenas for decoding a 2 MiB request, made once
            s.request(protocol.Release(s.request_raw(bomb, 60).lease))
        rss = server_rss_kb(pid)
        for _ in range(100):
            reply = s.request_raw(bomb, 60)
            assert reply.hits == KEYS and reply.lease
        grown_kb = server_rss_kb(pid) - rss
        # what remains is the allocator's high-water mark for decoding one such request (~6 MiB)
        assert grown_kb < 16 * 1024, f"100 leases of one object grew the server by {grown_kb} KiB"  # was 55 MiB
        p = query_status(server.url).pool
        assert p.leases == 100 and p.pinned == 1 and getattr(p, "lease_pins", None) == 100
        s.unregister("bomb")
    # the session's end ends its leases
    assert honest_round_trip(start_worker, server)["results"] == [protocol.StoreResult.STORED] * 2
    base.check()


# ---- 5: every object's whole cost counts against --capacity -----------------------------


def test_tiny_objects_cannot_grow_the_server_past_its_capacity(start_server, start_worker, own_segment):
    capacity = 8 << 20
    server = start_server("--capacity", str(capacity))
    base = Baseline(server, own_segment)
    pid = query_status(server.url).server_pid
    rss = server_rss_kb(pid)
    with RawSession(server.url, timeout_s=60) as s:
        tiny_blocks(s, own_segment, "tiny")
        for r in range(2):                                    # 131,072 objects of 1 byte
            store_tiny(s, "tiny", [key(r * KEYS + i) for i in range(KEYS)])
        grown = (server_rss_kb(pid) - rss) * 1024
        # the pool's bytes and its bookkeeping within --capacity, plus what decoding a request takes
        assert grown < capacity + (16 << 20), f"8 MiB of pool grew the server by {grown >> 20} MiB"  # was 72 MiB
        from lmshm.core.pool import ALIGN, OBJECT_COST

        p = query_status(server.url).pool
        assert p.objects == capacity // (ALIGN + OBJECT_COST) and p.in_flight == 0
        assert p.used == p.objects * (ALIGN + OBJECT_COST) <= capacity       # `used` tells the truth
        assert p.metadata_bytes == p.objects * OBJECT_COST and p.evictions == 2 * KEYS - p.objects
        s.unregister("tiny")
    assert honest_round_trip(start_worker, server)["results"] == [protocol.StoreResult.STORED] * 2
    base.check()


# ---- 6: no request costs time in proportion to the pool ---------------------------------


def _status_ms(url: str, n: int = 15) -> float:
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        query_status(url)
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def _pings_under_a_status_flood(url: str, session: RawSession, seconds: float = 1.5) -> list[float]:
    """A peer without a session keeps 8 STATUS requests queued; a verified session PINGs."""
    import zmq

    stop = threading.Event()

    def flood() -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(url)
        body, outstanding, n = codec.encode(protocol.Status()), 0, 0
        try:
            while not stop.is_set():
                while outstanding < 8:
                    n += 1
                    sock.send_multipart([n.to_bytes(8, "big"), body])
                    outstanding += 1
                if sock.poll(50):
                    sock.recv_multipart()
                    outstanding -= 1
        finally:
            sock.close(0)
            ctx.term()

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    time.sleep(0.2)
    pings = []
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            assert isinstance(session.request(protocol.Ping(), timeout_s=30), protocol.Pong)
            pings.append((time.perf_counter() - t0) * 1000)
    finally:
        stop.set()
        thread.join(10)
    return pings


def test_status_costs_the_same_at_200k_objects_as_at_none(start_server, start_worker, own_segment):
    server = start_server("--capacity", "256MiB")
    base = Baseline(server, own_segment)
    empty_ms = _status_ms(server.url)
    with RawSession(server.url, timeout_s=60) as s:
        tiny_blocks(s, own_segment, "many")
        for r in range(3):                                    # 196,608 objects
            store_tiny(s, "many", [key(r * KEYS + i) for i in range(KEYS)])
        assert query_status(server.url).pool.objects == 3 * KEYS
        full_ms = _status_ms(server.url)
        assert full_ms < empty_ms + 10, f"STATUS took {full_ms:.1f} ms at 196,608 objects, {empty_ms:.1f} ms at none"
        pings = _pings_under_a_status_flood(server.url, s)
        assert statistics.median(pings) < 25, f"PING under a STATUS flood: median {statistics.median(pings):.1f} ms"
        s.unregister("many")
    assert honest_round_trip(start_worker, server)["results"] == [protocol.StoreResult.STORED] * 2
    base.check()


# ---- 7: one uid cannot pin the pool away from the others ---------------------------------


def _as_nobody(server) -> list[str]:
    """A command prefix that runs a worker as uid nobody, and opens the fd socket to it (the
    server admits it with --allow-uid); [] where this test cannot switch uids."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return []
    os.chmod(os.path.dirname(server.fd_socket), 0o711)
    os.chmod(server.fd_socket, 0o666)
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


def test_one_uid_pinning_all_it_can_leaves_other_sessions_and_uids_room(start_server, start_worker, own_segment):
    capacity = 128 << 10
    server = start_server("--capacity", str(capacity), "--allow-uid", str(NOBODY))
    base = Baseline(server, own_segment)
    nobody = _as_nobody(server)
    with RawSession(server.url, timeout_s=60) as attacker:
        tiny_blocks(attacker, own_segment, "hog")
        store_tiny(attacker, "hog", [key(i) for i in range(4096)])          # fills the pool
        held = query_status(server.url).pool.objects
        survivors = [key(i) for i in range(4096 - held, 4096)]              # LRU kept the newest
        for _ in range(3):                                                   # pin, again and again
            reply = attacker.request(protocol.Lookup([survivors]))
            assert isinstance(reply, protocol.LookupReply) and reply.hits > 0
        # another session of the attacker's uid still stores (its LOOKUPs share that uid's pin cap)
        w = start_worker(server.url)
        iid = w.ok("register_kv")["instance_id"]
        keys = [os.urandom(16).hex() for _ in range(2)]
        assert w.ok("store", instance_id=iid, keys=keys, blocks=[0, 1], chunk_blocks=1)["results"] == [0, 0]
        w.ok("unregister", instance_id=iid)
        w.exit()
        p = query_status(server.url).pool
        assert p.pinned_bytes <= capacity // 2 and p.pins_capped > 0
        # and a worker of another admitted uid stores and retrieves
        if nobody:
            assert honest_round_trip(start_worker, server, *nobody)["results"] == [protocol.StoreResult.STORED] * 2
        # the biggest tenant's unpinned objects are the ones a STORE evicts
        w = start_worker(server.url, prefix=nobody or None)
        iid = w.ok("register_kv")["instance_id"]
        mine = [os.urandom(16).hex() for _ in range(4)]
        owner = next(r.owner_uid for r in query_status(server.url).registrations if r.instance_id == iid)
        assert owner == (NOBODY if nobody else os.geteuid())
        assert w.ok("store", instance_id=iid, keys=mine, blocks=[0, 1, 2, 3], chunk_blocks=1)["results"] == [0] * 4
        store_tiny(attacker, "hog", [key(10_000 + i) for i in range(1024)])  # the attacker stores on
        if nobody:   # another uid: the attacker, holding the most, evicted only its own objects
            assert w.ok("lookup", keys=[mine])["hits"] == 4
        w.ok("unregister", instance_id=iid)
        w.exit()
        attacker.unregister("hog")
    assert honest_round_trip(start_worker, server)["results"] == [protocol.StoreResult.STORED] * 2
    base.check()
