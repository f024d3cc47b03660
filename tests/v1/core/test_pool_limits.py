"""The pool's limits, in one process: what an object costs, what a lease holds, what a tenant (uid)
may pin, and that no pool operation takes time in proportion to the objects it holds.

One test per finding of issue 15 (4-7); the same attacks run against a real server in
tests/v1/server/test_hardening_pool.py.
"""

from __future__ import annotations

import gc
import time
import tracemalloc

from lmshm.core.pool import ALIGN, OBJECT_COST, Pool, Reservation, cost_of
from lmshm.core.pool.extents import Extents

LAYOUT = b"L" * 16
ONE = cost_of(ALIGN)          # a 64-byte object: its extent and its bookkeeping


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")         # the engine's keys are BLAKE2b-256


def store(pool: Pool, uid: int, k: bytes, n: int = ALIGN) -> int:
    outcome, obj = pool.reserve(uid, k, n, LAYOUT, 1)
    if obj is not None:
        pool.commit([obj])
    return outcome


def present(pool: Pool, uid: int, k: bytes) -> bool:
    hits, lease = pool.lookup(uid, [[k]], "probe", 30)
    if lease:
        pool.release_lease(lease, uid)
    return hits == 1


def fastest_ms(fn, runs: int = 5) -> float:
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1000


# ---- 4: a lease holds each object once ---------------------------------------------------


def test_a_lease_holds_each_object_once_however_often_a_lookup_names_it():
    pool = Pool(16 * ONE)
    store(pool, 7, b"k")
    hits, lease = pool.lookup(7, [[b"k"] * 65536], "s", 30)
    assert hits == 65536                                       # the answer is unchanged: every chunk is there
    assert len(pool._leases[lease].objects) == 1 and pool.lease_pins == 1 and pool.pinned == 1
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        more = [pool.lookup(7, [[b"k"] * 65536], "s", 30) for _ in range(2)]
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 16 * 1024, f"2 leases of one object took {grown} bytes"     # was 2 x 512 KiB
    _, wide = pool.lookup(7, [[b"k"]] * 1024, "s", 30)       # 1,024 ranks naming one object: one pin
    assert pool.lease_pins == 4 and len(more) == 2
    assert pool.release_session("s") == 4
    assert (pool.pinned, pool.lease_pins, pool.pinned_bytes, pool.info()["leases"]) == (0, 0, 0, 0)


# ---- 5: every object's whole cost counts against the capacity ---------------------------


def test_every_object_is_charged_its_extent_and_its_bookkeeping_and_used_says_so():
    pool = Pool(64 * 1024)
    for i in range(1000):
        store(pool, 1, key(i), n=1)                           # 1-byte chunks, 1,000 of them
    fits = 64 * 1024 // cost_of(1)
    assert cost_of(1) == ALIGN + OBJECT_COST
    assert pool.objects == fits and pool.evictions == 1000 - fits
    info = pool.info()
    assert info["used"] == fits * (ALIGN + OBJECT_COST) <= pool.capacity
    assert info["metadata_bytes"] == fits * OBJECT_COST
    capped = Pool(1 << 20, max_objects=10)                    # --max-objects
    for i in range(25):
        store(capped, 1, key(i), n=1)
    assert capped.objects == 10 and capped.evictions == 15 and capped.info()["max_objects"] == 10


def test_the_bookkeeping_charged_per_object_covers_what_it_takes():
    """OBJECT_COST is measured: an object's record, key and LRU entry, plus one free extent beside
    it (the worst fragmentation leaves one per object). bench/pool_cost.py measures the server's
    RSS per object the same way."""
    n = 50_000
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        pool = Pool(n * cost_of(1) * 2)
        for i in range(n):
            store(pool, 1000, key(i), n=1)
        per_object = (tracemalloc.get_traced_memory()[0] - before) / n
        before = tracemalloc.get_traced_memory()[0]
        holes = Extents(0)
        for i in range(n):
            holes.give(i * 4096 + ALIGN, ALIGN * (1 + i % 7))     # disjoint: none merges
        per_hole = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    assert per_object + per_hole <= OBJECT_COST, (per_object, per_hole)


# ---- 6: no pool operation walks the objects ---------------------------------------------


def test_no_pool_operation_takes_time_in_proportion_to_the_objects():
    n = 200_000
    pool = Pool(n * ONE, max_pinned_fraction_per_uid=1.0)     # full: every store below evicts
    for i in range(n):
        store(pool, 1, key(i))
    for i in range(0, n // 2, 4096):                          # the LRU's oldest half pinned by leases
        pool.lookup(1, [[key(j) for j in range(i, min(i + 4096, n // 2))]], ("s", i), 30)
    assert pool.pinned == n // 2
    fresh = iter(range(n, 2 * n))
    cases = {
        "info": pool.info,
        "lookup+release": lambda: pool.release_lease(pool.lookup(1, [[key(n - 1)]], "t", 30)[1], 1),
        "store that evicts": lambda: store(pool, 1, key(next(fresh))),
        "expire (none due)": pool.expire,
        "leases_of": lambda: pool.leases_of("t"),
        "end a session's lease": lambda: (pool.lookup(1, [[key(n - 2)]], "u", 30), pool.release_session("u")),
    }
    slow = {name: ms for name, ms in ((name, fastest_ms(fn)) for name, fn in cases.items()) if ms > 2.0}
    assert not slow, f"at {n} objects these took milliseconds (fastest of 5): {slow}"
    assert pool.evictions >= 5 and pool.pinned == n // 2


# ---- 7: a tenant cannot pin the pool away from the others -------------------------------


def test_one_uid_cannot_pin_more_than_its_share_and_a_store_evicts_the_biggest_tenant():
    pool = Pool(100 * ONE, max_pinned_fraction_per_uid=0.5)
    attacker, other = 1000, 2000
    for i in range(100):
        assert store(pool, attacker, key(i)) == Reservation.STORED
    for _ in range(20):                                       # LOOKUPs within the TTL, again and again
        hits, _ = pool.lookup(attacker, [[key(i) for i in range(100)]], "attacker", 30)
        assert hits <= 50
    assert pool.pinned_bytes <= pool.capacity // 2 and pool.pins_capped > 0
    # another uid, and another session of the attacker's uid, can always store
    for i in range(30):
        assert store(pool, other, key(1000 + i)) == Reservation.STORED
    assert store(pool, attacker, key(5000)) == Reservation.STORED
    # the victims were the biggest tenant's unpinned objects, never the smaller tenant's
    assert all(present(pool, other, key(1000 + i)) for i in range(30))
    # unpinned, the two share the pool: each STORE evicts from whichever holds more
    pool.release_session("attacker")
    for i in range(60):
        assert store(pool, other, key(2000 + i)) == Reservation.STORED
    used = {uid: t.used for uid, t in pool._tenants.items()}
    assert abs(used[attacker] - used[other]) <= 2 * ONE, used
    # uids pinning all they can leave part of the pool unpinned: each may pin 0.5 of what the others leave
    shared = Pool(90 * ONE, max_pinned_fraction_per_uid=0.5)
    for uid in (1, 2):
        for i in range(45):
            store(shared, uid, key(i))
    for _ in range(3):
        for uid in (1, 2):
            shared.lookup(uid, [[key(i) for i in range(45)]], uid, 30)
    assert shared.pinned_bytes <= 68 * ONE                     # half, then half of the rest: a quarter stays
    assert store(shared, 3, key(0)) == Reservation.STORED              # a third uid still stores
    # pins are capped in objects too: a uid's leases hold at most max_pins_per_uid
    few = Pool(100 * ONE, max_pins_per_uid=10)
    for i in range(20):
        store(few, 1, key(i))
    assert few.lookup(1, [[key(i) for i in range(20)]], "s", 30)[0] == 10
    assert few.lookup(1, [[key(0)]], "s", 30)[0] == 0 and few.lease_pins == 10 and few.pins_capped == 11


def test_the_pool_settings_are_in_the_help_with_their_defaults():
    from lmshm.settings import ServerConfig, build_arg_parser

    text = " ".join(build_arg_parser().format_help().split())
    c = ServerConfig()
    for flag, default in (("--max-objects", c.max_objects), ("--max-pinned-fraction-per-uid",
                                                              c.max_pinned_fraction_per_uid),
                          ("--max-pins-per-uid", c.max_pins_per_uid), ("--max-leases-per-uid", c.max_leases_per_uid)):
        assert flag in text and f"default {default}" in text, flag
    assert f"plus {OBJECT_COST} bytes of bookkeeping" in text
