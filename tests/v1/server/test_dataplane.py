"""The data plane end to end: a real lmshm-server, workers in their own processes, real shared
memory. Blocks are copied from one worker's registered KV into the server's pool and from there
into another worker's blocks; every check compares the bytes the workers see."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from harness import wait_for

from lmshm.core.pool import OBJECT_COST
from lmshm.transport.client import query_status
from lmshm.wire.protocol import ErrorCode, StoreResult

BLOCK_BYTES = 2 * 16 * 8 * 4           # one block of one layer: [2, 16, 8] float32
CHUNK_BYTES = 2 * BLOCK_BYTES          # two layers, one block per chunk
CHUNK_COST = CHUNK_BYTES + OBJECT_COST  # what one chunk counts against --capacity
NAMED = {"LMSHM_CPU_SEGMENTS": "shm"}   # workers that register named segments (the default is memfd)


def key(i: int, rank: int = 0) -> str:
    return bytes([rank, i]).hex() * 8   # 16 bytes


def kv_worker(start_worker, server, **kw):
    w = start_worker(server.url)
    iid = w.ok("register_kv", **kw)["instance_id"]
    return w, iid


def pool(w) -> dict:
    return w.ok("pool")["pool"]


@pytest.mark.parametrize("mode", ["through-files", "through-mapping"])
def test_blocks_stored_by_one_worker_are_retrieved_by_another(start_worker, start_server, mode):
    server = start_server(*(["--copy-through-mapping"] if mode == "through-mapping" else []))
    a, ia = kv_worker(start_worker, server)
    b, ib = kv_worker(start_worker, server)
    a.ok("fill_blocks", instance_id=ia, blocks=[2, 3, 4, 5], seed=1)
    b.ok("fill_blocks", instance_id=ib, blocks=list(range(16)), seed=2)
    want = a.ok("digest_blocks", instance_id=ia, blocks=[2, 3, 4, 5])["digests"]

    stored = a.ok("store", instance_id=ia, keys=[key(0), key(1)], blocks=[2, 3, 4, 5], chunk_blocks=2)
    assert stored["results"] == [StoreResult.STORED] * 2 and stored["nbytes"] == 2 * 2 * CHUNK_BYTES

    found = b.ok("lookup", keys=[[key(0), key(1), key(2)]])
    assert found["hits"] == 2 and found["lease"] and found["ttl_s"] > 0
    assert pool(b)["pinned"] == 2 and pool(b)["leases"] == 1
    untouched = b.ok("digest_blocks", instance_id=ib, blocks=[0, 1, 6, 11])["digests"]
    got = b.ok("retrieve", instance_id=ib, keys=[key(0), key(1)], blocks=[7, 8, 9, 10], chunk_blocks=2,
               lease=found["lease"])
    assert got == {"ok": True, "chunks": 2, "nbytes": 2 * 2 * CHUNK_BYTES}
    assert b.ok("digest_blocks", instance_id=ib, blocks=[7, 8, 9, 10])["digests"] == want
    assert b.ok("digest_blocks", instance_id=ib, blocks=[0, 1, 6, 11])["digests"] == untouched
    p = pool(b)
    assert (p["pinned"], p["leases"], p["objects"], p["in_flight"]) == (0, 0, 2, 0)  # RETRIEVE ended the lease
    assert (p["stored"], p["retrieved"], p["hits"], p["misses"]) == (2, 2, 2, 1)


def test_blocks_of_several_byte_runs_round_trip(start_worker, server):
    """K and V of a block in two places ([2, blocks, ...] per layer): two runs per block."""
    a, ia = kv_worker(start_worker, server, layout="kv-split")
    a.ok("fill_blocks", instance_id=ia, blocks=list(range(16)), seed=4)
    a.ok("store", instance_id=ia, keys=[key(0), key(1)], blocks=[3, 9, 4, 1], chunk_blocks=2)
    before = a.ok("digest_blocks", instance_id=ia, blocks=[3, 9, 4, 1])["digests"]
    a.ok("fill_blocks", instance_id=ia, blocks=list(range(16)), seed=5)
    others = a.ok("digest_blocks", instance_id=ia, blocks=[0, 2, 5, 6, 7, 8])["digests"]
    a.ok("retrieve", instance_id=ia, keys=[key(0), key(1)], blocks=[10, 12, 11, 15], chunk_blocks=2)
    assert a.ok("digest_blocks", instance_id=ia, blocks=[10, 12, 11, 15])["digests"] == before
    assert a.ok("digest_blocks", instance_id=ia, blocks=[0, 2, 5, 6, 7, 8])["digests"] == others


@pytest.mark.parametrize("what", ["truncated", "punched"])
def test_a_worker_that_shrinks_its_named_segment_cannot_stop_the_server(start_worker, server, what):
    a = start_worker(server.url, env=NAMED)
    ia = a.ok("register_kv")["instance_id"]
    a.ok("store", instance_id=ia, keys=[key(0)], blocks=[0], chunk_blocks=1)
    assert a.ok("damage_segment", instance_id=ia, how=what)["refused"] is None   # a name cannot be sealed
    for op, kw in (("store", dict(keys=[key(1)], blocks=[1])), ("retrieve", dict(keys=[key(0)], blocks=[2]))):
        r = a.call(op, instance_id=ia, chunk_blocks=1, **kw)
        assert not r["ok"] and r["code"] in (ErrorCode.DATA_LOSS, ErrorCode.UNAVAILABLE), r
        assert ("truncated" if what == "truncated" else "holes") in r["message"], r
    assert server.alive
    b, ib = kv_worker(start_worker, server)
    assert b.ok("store", instance_id=ib, keys=[key(7)], blocks=[0], chunk_blocks=1)["results"] == [0]


@pytest.mark.parametrize("what", ["truncated", "zero", "grown"])
def test_a_sealed_memfd_cannot_be_resized_so_copies_go_on(start_worker, server, what):
    a, ia = kv_worker(start_worker, server)             # the default: a sealed memfd
    a.ok("fill_blocks", instance_id=ia, blocks=[0, 1], seed=3)
    a.ok("store", instance_id=ia, keys=[key(0)], blocks=[0], chunk_blocks=1)
    assert a.ok("damage_segment", instance_id=ia, how=what)["refused"] == "EPERM"
    assert a.ok("store", instance_id=ia, keys=[key(1)], blocks=[1], chunk_blocks=1)["results"] == [StoreResult.STORED]
    a.ok("retrieve", instance_id=ia, keys=[key(0), key(1)], blocks=[5, 6], chunk_blocks=1)
    d = a.ok("digest_blocks", instance_id=ia, blocks=[0, 5, 1, 6])["digests"]
    assert d[0] == d[1] and d[2] == d[3]


def test_a_hole_punched_in_a_sealed_memfd_is_refused_before_the_copy(start_worker, server):
    a, ia = kv_worker(start_worker, server)
    a.ok("store", instance_id=ia, keys=[key(0)], blocks=[0], chunk_blocks=1)
    assert a.ok("damage_segment", instance_id=ia, how="punched")["refused"] is None   # seals do not stop a punch
    for op, kw in (("store", dict(keys=[key(1)], blocks=[1])), ("retrieve", dict(keys=[key(0)], blocks=[2]))):
        r = a.call(op, instance_id=ia, chunk_blocks=1, **kw)
        assert not r["ok"] and r["code"] == ErrorCode.DATA_LOSS and "holes" in r["message"], r
    assert server.alive


@pytest.mark.parametrize("how", ["punch", "shrink"])
def test_a_worker_damaging_its_memfd_while_the_server_copies_gets_answers_not_a_crash(start_worker, server, how):
    """A thread of the worker punches holes in its memfd (up to 1 MiB at a random place, written
    again 0-2 ms later, every 0-3 ms; or tries to truncate it to 0) while the worker sends STOREs
    of new keys and RETRIEVEs,
    4 MiB each. The server checks for holes before each copy, but a punch can land during one:
    the mapped fast path touches those pages while they vanish, and a punched page refaults (as
    zeros), never SIGBUS. Every request is answered: copied, or refused for the holes."""
    a, ia = kv_worker(start_worker, server, layers=4, blocks=64, shape=[16, 16, 64])  # 64 KiB per block and layer
    keys = [key(i) for i in range(4)]
    a.ok("store", instance_id=ia, keys=keys, blocks=list(range(16)), chunk_blocks=4)
    r = a.ok("damage_while_copying", instance_id=ia, how=how, keys=keys, blocks=list(range(16)),
             into=list(range(32, 48)), chunk_blocks=4, rounds=25)
    assert r["attempts"] > 0
    answered = sum(r["outcomes"].values())
    assert answered == 50, r
    allowed = {"store ok", "retrieve ok", "store DATA_LOSS: holes", "retrieve DATA_LOSS: holes"}
    assert set(r["outcomes"]) <= allowed, r
    if how == "shrink":
        assert r["refusals"] == ["EPERM"] and set(r["outcomes"]) == {"store ok", "retrieve ok"}, r
    else:
        assert r["outcomes"].get("store ok", 0) + r["outcomes"].get("retrieve ok", 0) > 0, r  # copies did run
    assert server.alive
    b, ib = kv_worker(start_worker, server)
    assert b.ok("store", instance_id=ib, keys=[key(9)], blocks=[0], chunk_blocks=1)["results"] == [StoreResult.STORED]


def test_a_worker_that_closes_its_memfds_and_dies_mid_store_is_reclaimed_and_the_server_copies_on(
        start_worker, start_server):
    server = start_server("--reap-timeout", "5")
    a, ia = kv_worker(start_worker, server, layers=8, blocks=64, shape=[16, 16, 64])   # 32 MiB
    assert a.ok("store_and_die", instance_id=ia, keys=[key(i) for i in range(16)], blocks=list(range(64)),
                chunk_blocks=4)["dying"]
    a.proc.wait(10)
    wait_for(lambda: not any(r.instance_id == ia for r in query_status(server.url).registrations), 10, 0.02,
             "the dead worker's reclaim")
    wait_for(lambda: query_status(server.url).pool.in_flight == 0, 10, 0.02, "the STORE to end")
    status = query_status(server.url)
    assert status.mappings == 0 and status.sessions == 0 and server.alive
    b, ib = kv_worker(start_worker, server)
    assert b.ok("store", instance_id=ib, keys=[key(9)], blocks=[0], chunk_blocks=1)["results"] == [StoreResult.STORED]


def test_a_stored_key_is_skipped_and_reported(start_worker, server):
    a, ia = kv_worker(start_worker, server)
    a.ok("fill_blocks", instance_id=ia, blocks=[0, 1], seed=1)
    assert a.ok("store", instance_id=ia, keys=[key(0)], blocks=[0], chunk_blocks=1)["results"] == [StoreResult.STORED]
    again = a.ok("store", instance_id=ia, keys=[key(0), key(1)], blocks=[1, 1], chunk_blocks=1)
    assert again["results"] == [StoreResult.PRESENT, StoreResult.STORED] and again["nbytes"] == CHUNK_BYTES
    # PRESENT kept the first bytes: block 0's, not block 1's
    a.ok("retrieve", instance_id=ia, keys=[key(0)], blocks=[5], chunk_blocks=1)
    d = a.ok("digest_blocks", instance_id=ia, blocks=[0, 5])["digests"]
    assert d[0] == d[1]


def test_a_full_pool_evicts_in_lru_order_and_counts(start_worker, start_server):
    server = start_server("--capacity", str(4 * CHUNK_COST), "--max-pinned-fraction-per-uid", "1")
    a, ia = kv_worker(start_worker, server)
    a.ok("fill_blocks", instance_id=ia, blocks=list(range(6)), seed=3)
    assert a.ok("store", instance_id=ia, keys=[key(i) for i in range(4)], blocks=[0, 1, 2, 3],
                chunk_blocks=1)["results"] == [StoreResult.STORED] * 4
    lease = a.ok("lookup", keys=[[key(0)]])["lease"]       # key 0 becomes the most recently used
    assert a.ok("release", lease=lease)["released"] is True
    assert a.ok("release", lease=lease)["released"] is False
    assert a.ok("store", instance_id=ia, keys=[key(4)], blocks=[4], chunk_blocks=1)["results"] == [StoreResult.STORED]
    hits = {i: a.ok("lookup", keys=[[key(i)]])["hits"] for i in range(5)}
    assert hits == {0: 1, 1: 0, 2: 1, 3: 1, 4: 1}             # key 1 was the least recently used
    p = pool(a)
    assert p["evictions"] == 1 and p["evicted_bytes"] == CHUNK_BYTES and p["used"] == 4 * CHUNK_COST


def test_a_store_of_more_chunks_than_the_pool_holds_stores_each_and_keeps_the_last(start_worker, start_server):
    server = start_server("--capacity", str(2 * CHUNK_COST), "--max-pinned-fraction-per-uid", "1")
    a, ia = kv_worker(start_worker, server)
    a.ok("fill_blocks", instance_id=ia, blocks=list(range(5)), seed=4)
    want = a.ok("digest_blocks", instance_id=ia, blocks=[3, 4])["digests"]
    r = a.ok("store", instance_id=ia, keys=[key(i) for i in range(5)], blocks=list(range(5)), chunk_blocks=1)
    assert r["results"] == [StoreResult.STORED] * 5 and r["nbytes"] == 5 * CHUNK_BYTES
    p = pool(a)
    assert p["objects"] == 2 and p["evictions"] == 3 and p["store_skipped"] == 0 and p["in_flight"] == 0
    found = a.ok("lookup", keys=[[key(3), key(4)]])
    assert found["hits"] == 2
    a.ok("retrieve", instance_id=ia, keys=[key(3), key(4)], blocks=[8, 9], chunk_blocks=1, lease=found["lease"])
    assert a.ok("digest_blocks", instance_id=ia, blocks=[8, 9])["digests"] == want


def test_when_nothing_can_be_evicted_a_store_is_skipped_not_failed(start_worker, start_server):
    server = start_server("--capacity", str(2 * CHUNK_COST), "--max-pinned-fraction-per-uid", "1")
    a, ia = kv_worker(start_worker, server)
    a.ok("store", instance_id=ia, keys=[key(0), key(1)], blocks=[0, 1], chunk_blocks=1)
    lease = a.ok("lookup", keys=[[key(0), key(1)]])["lease"]          # both pinned
    t0 = time.monotonic()
    r = a.ok("store", instance_id=ia, keys=[key(2)], blocks=[2], chunk_blocks=1)
    assert r["results"] == [StoreResult.NO_SPACE] and r["nbytes"] == 0 and time.monotonic() - t0 < 2
    big = a.ok("store", instance_id=ia, keys=[key(9)], blocks=[0, 1, 2], chunk_blocks=3)  # larger than the pool
    assert big["results"] == [StoreResult.NO_SPACE]
    assert pool(a)["store_skipped"] == 2
    a.ok("release", lease=lease)
    assert a.ok("store", instance_id=ia, keys=[key(2)], blocks=[2], chunk_blocks=1)["results"] == [StoreResult.STORED]


def test_a_lease_ends_at_its_ttl_and_with_its_session(start_worker, server):
    a, ia = kv_worker(start_worker, server)
    a.ok("store", instance_id=ia, keys=[key(0)], blocks=[0], chunk_blocks=1)
    assert a.ok("lookup", keys=[[key(0)]], ttl_s=0.3)["ttl_s"] == pytest.approx(0.3)
    assert pool(a)["leases"] == 1
    wait_for(lambda: pool(a)["leases"] == 0 and pool(a)["pinned"] == 0, 5, what="the lease to expire")
    b = start_worker(server.url)
    b.ok("lookup", keys=[[key(0)]])
    assert pool(a)["leases"] == 1
    b.kill()
    wait_for(lambda: pool(a)["leases"] == 0 and pool(a)["pinned"] == 0, 10, what="the dead worker's lease to end")


def test_a_killed_worker_leaves_nothing_in_flight(start_worker, server):
    a, ia = kv_worker(start_worker, server, blocks=64, shape=[4, 64, 64])
    keys = [key(i) for i in range(64)]
    a.proc.stdin.write('{"op": "store", "pipelined": true, "instance_id": "%s", "keys": %s, "blocks": %s, '
                       '"chunk_blocks": 1}\n' % (ia, str(keys).replace("'", '"'), list(range(64))))
    a.proc.stdin.flush()
    time.sleep(0.05)
    a.kill()
    b = start_worker(server.url)
    wait_for(lambda: not b.ok("pool")["pool"]["in_flight"] and server_registrations(server) == 0, 10,
             what="the dead worker's copies and registration to be reclaimed")
    p = pool(b)
    assert p["objects"] * (2 * 4 * 64 * 64 * 4 + OBJECT_COST) == p["used"] and p["pinned"] == 0  # whole chunks only
    _, ib = kv_worker(start_worker, server, blocks=64, shape=[4, 64, 64])       # and the server still works
    assert b.ok("lookup", keys=[[key(0)]])["hits"] in (0, 1)


def server_registrations(server) -> int:
    from lmshm.transport.client import query_status

    return len(query_status(server.url).registrations)


def test_requests_are_checked_before_anything_is_copied(start_worker, server):
    a, ia = kv_worker(start_worker, server)
    b, ib = kv_worker(start_worker, server)
    b.ok("fill_blocks", instance_id=ib, blocks=list(range(16)), seed=5)
    before = b.ok("digest_blocks", instance_id=ib, blocks=list(range(16)))["digests"]
    a.ok("store", instance_id=ia, keys=[key(0)], blocks=[0], chunk_blocks=1)

    def refused(w, op, code, **kw):
        r = w.call(op, **kw)
        assert not r["ok"] and r["code"] == code, r
        return r["message"]

    assert "belongs to another session" in refused(
        a, "retrieve", ErrorCode.PERMISSION_DENIED, instance_id=ib, keys=[key(0)], blocks=[0], chunk_blocks=1)
    assert "belongs to another session" in refused(
        a, "store", ErrorCode.PERMISSION_DENIED, instance_id=ib, keys=[key(5)], blocks=[0], chunk_blocks=1)
    assert "need 2 block ids" in refused(
        b, "store", ErrorCode.INVALID_ARG, instance_id=ib, keys=[key(5)], blocks=[0], chunk_blocks=2)
    assert "block id 16 is out of range" in refused(
        b, "retrieve", ErrorCode.INVALID_ARG, instance_id=ib, keys=[key(0)], blocks=[16], chunk_blocks=1)
    assert "not stored" in refused(
        b, "retrieve", ErrorCode.NOT_FOUND, instance_id=ib, keys=[key(0), key(7)], blocks=[3, 4], chunk_blocks=1)
    refused(b, "store", ErrorCode.INVALID_ARG, instance_id=ib, keys=["ab" * 65], blocks=[0], chunk_blocks=1)
    assert "same number of keys" in refused(b, "lookup", ErrorCode.INVALID_ARG, keys=[[key(0)], []])
    refused(b, "store", ErrorCode.NOT_FOUND, instance_id="nobody-registered-this", keys=[key(5)], blocks=[0],
            chunk_blocks=1)
    # another layout: same bytes per block, other shape -> never served into it
    c, ic = kv_worker(start_worker, server, shape=[16, 2, 8])
    assert "another layout" in refused(
        c, "retrieve", ErrorCode.LAYOUT, instance_id=ic, keys=[key(0)], blocks=[0], chunk_blocks=1)
    # a layout whose blocks are scattered across the last dim cannot be moved in a few runs
    d, i_d = kv_worker(start_worker, server, transpose=True)
    message = refused(d, "store", ErrorCode.LAYOUT, instance_id=i_d, keys=[key(6)], blocks=[0], chunk_blocks=1)
    assert "separate byte runs" in message and "stride" in message
    assert b.ok("digest_blocks", instance_id=ib, blocks=list(range(16)))["digests"] == before
    assert pool(b)["pinned"] == 0


def test_lookup_counts_a_chunk_only_if_every_rank_has_it(start_worker, server):
    a, ia = kv_worker(start_worker, server)
    a.ok("store", instance_id=ia, keys=[key(0, 0), key(1, 0), key(2, 0)], blocks=[0, 1, 2], chunk_blocks=1)
    a.ok("store", instance_id=ia, keys=[key(0, 1)], blocks=[0], chunk_blocks=1)
    assert a.ok("lookup", keys=[[key(i, 0) for i in range(3)], [key(i, 1) for i in range(3)]])["hits"] == 1
    assert a.ok("lookup", keys=[[key(i, 0) for i in range(3)]])["hits"] == 3
    assert a.ok("lookup", keys=[[key(5, 0), key(1, 0)]])["hits"] == 0  # leading chunks only


def test_a_clients_store_and_retrieve_apply_in_order(start_worker, server):
    a, ia = kv_worker(start_worker, server)
    a.ok("fill_blocks", instance_id=ia, blocks=[0, 1], seed=7)
    r = a.ok("store_then_retrieve", instance_id=ia, keys=[key(0)], blocks=[0, 1], into=[8, 9], chunk_blocks=2)
    assert r["stored"] == [StoreResult.STORED] and r["chunks"] == 1
    d = a.ok("digest_blocks", instance_id=ia, blocks=[0, 1, 8, 9])["digests"]
    assert d[:2] == d[2:]
    results = a.ok("store", pipelined=True, instance_id=ia, keys=[key(i) for i in range(1, 40)],
                   blocks=[i % 16 for i in range(1, 40)], chunk_blocks=1)["results"]
    assert results == [StoreResult.STORED] * 39


def test_copies_run_off_the_request_loop(start_worker, start_server):
    server = start_server("--capacity", "1GiB")
    a, ia = kv_worker(start_worker, server, layers=4, blocks=64, shape=[8, 64, 128])  # 256 KiB blocks, 64 MiB
    r = a.ok("ping_during_store", instance_id=ia, keys=[key(i) for i in range(16)],
             blocks=list(range(64)), chunk_blocks=4)
    pings = sorted(r["pings"])
    assert len(pings) >= 3, f"only {len(pings)} PINGs were answered while 64 MiB were stored"
    assert pings[len(pings) // 2] < 0.05, pings


def test_a_server_without_a_pool_says_so(start_worker, start_server):
    server = start_server("--capacity", "0")
    a, ia = kv_worker(start_worker, server)
    r = a.call("store", instance_id=ia, keys=[key(0)], blocks=[0], chunk_blocks=1)
    assert r["code"] == ErrorCode.UNAVAILABLE and "--capacity 0" in r["message"]
    assert a.ok("lookup", keys=[[key(0)]])["hits"] == 0


def test_status_shows_the_pool(start_worker, server):
    a, ia = kv_worker(start_worker, server)
    a.ok("store", instance_id=ia, keys=[key(0)], blocks=[0], chunk_blocks=1)
    out = subprocess.run([sys.executable, "-m", "lmshm.cli", "status", "--url", server.url],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    used = f"{(CHUNK_BYTES + OBJECT_COST) / 1024:.1f} KiB of 2.0 GiB used ({OBJECT_COST} B of it bookkeeping)"
    assert "pool:" in out.stdout and "1 object" in out.stdout and used in out.stdout, out.stdout


def test_by_default_a_registration_makes_the_server_populate_its_pool_ahead_and_no_more(start_worker, start_server):
    # The server's default --pool-populate-ahead (256 MiB): nothing before a KV cache is
    # registered (a server that never stores costs no memory), then the first 256 MiB of the
    # pool, so that the first STOREs find their pages (docs/benchmarks.md, "Cold pool pages").
    from harness import server_rss_kb

    server = start_server("--capacity", "1GiB", env={"LMSHM_POOL_POPULATE_AHEAD": "256MiB"})
    time.sleep(1.0)
    idle_kb = server_rss_kb(server.proc.pid)
    w, _ = kv_worker(start_worker, server)
    wait_for(lambda: server_rss_kb(server.proc.pid) - idle_kb >= 250 * 1024, 30, 0.05,
             "the pool's first 256 MiB to be populated")
    time.sleep(0.5)
    assert server_rss_kb(server.proc.pid) - idle_kb < 300 * 1024      # the window, not the capacity


BIG = dict(layers=2, blocks=80, shape=[1024, 1024])    # a block of a layer is 4 MiB: 80 chunks, 640 MiB


@pytest.mark.parametrize("what", ["store", "retrieve"])
def test_a_copy_queued_past_its_senders_timeout_never_runs(start_worker, start_server, what):
    """A worker stops waiting for a reply after its timeout; then it may reuse the blocks (a
    STORE) or compute them itself (a RETRIEVE). A copy that reaches the front of the server's
    queue later must not run: a STORE would store whatever the blocks hold by then under the old
    key, and a RETRIEVE would overwrite what the worker computed. Here one STORE of 640 MiB is
    queued ahead, and the second request's 20 ms timeout passes while it waits."""
    server = start_server("--capacity", "1GiB")
    a, ia = kv_worker(start_worker, server, **BIG)
    a.ok("fill_blocks", instance_id=ia, blocks=[0, 1], seed=3)
    if what == "retrieve":
        assert a.ok("store", instance_id=ia, keys=[key(200)], blocks=[0], chunk_blocks=1)["results"] == [0]
        a.ok("fill_blocks", instance_id=ia, blocks=[5], seed=4)
    before = a.ok("digest_blocks", instance_id=ia, blocks=[5])["digests"]
    out = a.ok("late_behind_big", instance_id=ia, what=what, big_keys=[key(i) for i in range(64)],
               big_blocks=list(range(10, 74)), keys=[key(200 if what == "retrieve" else 201)],
               blocks=[5] if what == "retrieve" else [1], give_up_s=0.02)
    assert out["big"] == [StoreResult.STORED] * 64, out
    assert not out["second"].startswith("answered"), out          # the worker gave up first
    wait_for(lambda: query_status(server.url).pool.late >= 1, 10, what="the late request to be refused")
    if what == "store":
        assert a.ok("lookup", keys=[[key(201)]])["hits"] == 0     # not stored from blocks it may reuse
    else:
        assert a.ok("digest_blocks", instance_id=ia, blocks=[5])["digests"] == before   # not overwritten
        p = pool(a)
        assert (p["pinned"], p["leases"]) == (0, 0)
