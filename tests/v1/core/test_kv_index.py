"""The KV event index's own semantics, in process (real threads, no server): what one uid's
adverts may do to another's entries, and what the index costs (issue 41, round 4). The log it
feeds: ``test_kv_log.py``; the format: ``test_kv_format.py``. End to end, through a real server
and two uids: ``tests/v1/server/test_kv_events_tenants.py``."""

from __future__ import annotations

import gc
import threading
import tracemalloc
from typing import Any, Optional

import msgspec
import pytest

from lmshm.core.kv_events import NODE, OWNER, BlockRemoved, KvIndex, chunk_cost
from lmshm.core.kv_events import index as index_module
from lmshm.core.kv_events import maps as maps_module
from lmshm.wire.protocol import Advert, pack_adverts

A, B = 1000, 1001
SPACE = b"S"
BLOCK = 4


def hashes(c: int, n: int = 2) -> list[int]:
    return [10_000 * (c + 1) + j for j in range(n)]


def tokens(c: int, n: int = 2) -> list[int]:
    return list(range(100 * c, 100 * c + n * BLOCK))


def advert(c: int, *, hs: Optional[list] = None, toks: Optional[list] = None, parent: Any = "chain",
           chunk: Optional[bytes] = None, **kw: Any) -> Advert:
    hs = hs if hs is not None else hashes(c)
    if parent == "chain":
        parent = hashes(c - 1)[-1] if c else None
    return Advert(chunk=chunk or b"chunk-%d" % c, group=0, block_size=BLOCK, block_hashes=hs,
                  parent_block_hash=parent, token_ids=toks if toks is not None else tokens(c, len(hs)), **kw)


def key(uid: int, c: int) -> bytes:
    return b"k-%d-%d" % (uid, c)


def store(kv: KvIndex, uid: int, chunks: range, adverts: Optional[list] = None, *, resident: bool = True,
          model: str = "m") -> None:
    """What a STORE of ``chunks`` by ``uid`` tells the index: its adverts, then (if it stored
    anything) the pool's commit."""
    adverts = adverts if adverts is not None else [advert(c) for c in chunks]
    kv.describe(uid, SPACE, model, "", 0, 1, [key(uid, c) for c in chunks], adverts)
    if resident:
        kv.batch_recorder("pool")([(uid, key(uid, c)) for c in chunks])


def prompt_hashes(n: int) -> list[int]:
    return [h for c in range(n) for h in hashes(c)]


def prompt_tokens(n: int) -> list[int]:
    return [t for c in range(n) for t in tokens(c)]


def found(kv: KvIndex, n: int = 4) -> tuple[int, int]:
    """``(leading pool blocks by hashes, by tokens)`` of uid A's ``n``-chunk prompt."""
    by_hash = kv.leading(prompt_hashes(n), ["pool"])["pool"]
    best = max((kv.leading(chain, ["pool"])["pool"] for chain in kv.chains_of_tokens(prompt_tokens(n), BLOCK)),
               default=0)
    return by_hash, best


def summary(records: list) -> list[tuple]:
    """``(type, first hash)`` of each record's event that names blocks."""
    return [(type(r.event).__name__, r.event.block_hashes[0]) for r in records if hasattr(r.event, "block_hashes")]


def node_view(kv: KvIndex) -> list[tuple]:
    """What the node stream sends: every record not owner-only."""
    records, _, _ = kv.log.read(-1, 1 << 20)
    return summary([r for r in records if r.scope != OWNER])


def own_feed(kv: KvIndex, uid: int) -> list[tuple]:
    """What ``uid``'s own feed (``KV_EVENTS``) reads."""
    records, _, _ = kv.log.read(-1, 1 << 20, uid=uid, spaces=[SPACE])
    return summary(records)


def removals(feed: list[tuple]) -> list[tuple]:
    return [e for e in feed if e[0] == "BlockRemoved"]


def prune_all(kv: KvIndex) -> int:
    """Forget every advert not resident yet, now (``prune`` runs at most every 10 s)."""
    kv._pruned_at = -1e9
    return kv.prune(older_than_s=0.0)


# ---- §2: one tenant cannot rewrite what routers believe about another ---------------------


def test_an_advert_that_stores_nothing_hides_nothing_of_another_uids_prompt():
    kv = KvIndex()
    store(kv, A, range(4))
    assert found(kv) == (8, 8)
    # B advertises A's first chunk (its first hash, another second) and stores nothing
    store(kv, B, range(1), [advert(0, hs=[hashes(0)[0], 666])], resident=False)
    assert found(kv) == (8, 8)
    store(kv, A, range(4))                                  # A stores it again (present): still all of it
    assert found(kv) == (8, 8)
    assert prune_all(kv) == 1                               # B's advert pruned
    assert found(kv) == (8, 8) and kv.chunks == 4


def test_a_resident_chunk_of_another_uid_with_the_same_hashes_adds_to_a_lookup_and_takes_nothing_away():
    kv = KvIndex()
    store(kv, A, range(4))
    # B stores for real a chunk with A's first hash, its own second, and A's tokens
    store(kv, B, range(1), [advert(0, hs=[hashes(0)[0], 666])])
    assert found(kv) == (8, 8)
    kv.note(B, key(B, 0), "pool", False)                    # and loses it
    assert found(kv) == (8, 8)
    assert ("BlockRemoved", hashes(0)[0]) not in own_feed(kv, A)


def test_another_uids_removal_of_the_same_blocks_is_its_own_never_the_nodes_while_a_holds_them():
    kv = KvIndex()
    store(kv, A, range(4))
    store(kv, B, range(1), [advert(0)])                     # B: A's very chunk 0, same model
    kv.note(B, key(B, 0), "pool", False)                    # evicted
    assert ("BlockRemoved", hashes(0)[0]) in own_feed(kv, B)        # B is told its chunk left
    assert ("BlockRemoved", hashes(0)[0]) not in node_view(kv)      # the node still holds A's
    assert ("BlockRemoved", hashes(0)[0]) not in own_feed(kv, A)
    assert found(kv) == (8, 8)
    kv.note(A, key(A, 0), "pool", False)                    # now the last one goes: the node says so
    assert ("BlockRemoved", hashes(0)[0]) in node_view(kv)


def test_a_removal_goes_to_the_node_for_the_blocks_no_other_chunk_still_serves():
    kv = KvIndex()
    store(kv, A, range(1))
    store(kv, B, range(1), [advert(0, hs=[hashes(0)[0], 777])])     # shares A's first block only
    kv.note(A, key(A, 0), "pool", False)
    records, _, _ = kv.log.read(-1, 100)
    removed = [(r.scope, tuple(r.event.block_hashes)) for r in records if type(r.event).__name__ == "BlockRemoved"]
    assert removed == [(OWNER, tuple(hashes(0))), (NODE, (hashes(0)[1],))]
    assert own_feed(kv, A)[-1] == ("BlockRemoved", hashes(0)[0])    # the owner's feed: the whole chunk


def test_a_flood_of_adverts_that_store_nothing_pushes_out_none_of_another_uids_chunks():
    kv = KvIndex(max_chunks=4096)
    store(kv, A, range(16))
    for s in range(4):          # 4 STOREs of 16,384 one-block adverts each, none stored
        n = 1 << 14
        flood = [Advert(b"f%d-%d" % (s, i), 0, BLOCK, [s << 20 | i], None, list(range(BLOCK))) for i in range(n)]
        kv.describe(B, SPACE, "m", "", 0, 1, [b"b%d-%d" % (s, i) for i in range(n)], flood)
    assert found(kv, 16) == (32, 32)
    assert kv.chunks <= 4096 and not removals(own_feed(kv, A))
    assert kv.unresident_dropped + kv.unindexed >= 4 * (1 << 14) - 4096


def test_a_full_index_forgets_from_the_uid_holding_the_most_and_its_adverts_never_evict_a_smaller_one():
    kv = KvIndex(max_chunks=64)
    store(kv, A, range(8))
    store(kv, B, range(100, 300))           # B alone overfills the index: B's oldest go
    assert found(kv, 8) == (16, 16)
    assert kv.chunks == 64 and kv.unindexed == 200 - 56
    assert not removals(own_feed(kv, A))


def test_unresident_adverts_are_bounded_per_uid(monkeypatch):
    monkeypatch.setattr(maps_module, "MAX_UNRESIDENT", 100)
    kv = KvIndex()
    store(kv, A, range(150), resident=False)
    store(kv, B, range(10), resident=False)
    assert len(kv) == 110 and kv.unresident_dropped == 50
    kv.batch_recorder("pool")([(A, key(A, c)) for c in range(150)])    # only the newest 100 are known
    assert kv.leading(hashes(49), ["pool"])["pool"] == 0 and kv.leading(hashes(50), ["pool"])["pool"] == 2


# ---- §3: bounded by bytes and work ---------------------------------------------------------


def big_advert(i: int) -> Advert:
    """The wire's largest advert: 1,024 blocks of 64 tokens."""
    return Advert(b"big-%d" % i, 0, 64, [(i << 20) + j for j in range(1024)], None, list(range(1024 * 64)))


def test_the_index_is_bounded_in_bytes_and_charges_each_chunk_to_its_uid():
    one = chunk_cost(1024, 4 * 65536, 0)
    kv = KvIndex(max_chunks=1 << 18, max_bytes=8 * one)
    for i in range(20):
        kv.describe(B, SPACE, "m", "", 0, 1, [b"big-%d" % i], [big_advert(i)])
        kv.note(B, b"big-%d" % i, "pool", True)
    kv.drain()
    assert kv.bytes <= 8 * one and kv.chunks == 8 and kv.unindexed == 12
    assert kv.maps.shares[B].bytes == kv.bytes


def test_one_store_of_many_adverts_is_applied_in_bounded_steps():
    kv = KvIndex()
    n = 4096
    adverts = [Advert(b"c%d" % i, 0, BLOCK, [i + 1], None, list(range(BLOCK))) for i in range(n)]
    kv.describe(A, SPACE, "m", "", 0, 1, [b"k%d" % i for i in range(n)], pack_adverts(adverts), "t", n)
    steps = 0
    while kv.queued:
        done = kv.drain(32)
        assert 0 < done <= 32 + 1
        steps += 1
    assert steps >= n // 33 and kv.chunks == n


def test_block_sizes_and_the_chunk_count_are_counters():
    kv = KvIndex()
    store(kv, A, range(3))
    kv.describe(A, SPACE, "m", "", 0, 1, [b"x"], [Advert(b"x", 0, 16, [5], None, list(range(16)))])
    kv.drain()
    assert sorted(kv.block_sizes()) == [BLOCK, 16] and kv.chunks == 4
    kv.note(A, key(A, 0), "pool", False)
    kv.drain()
    prune_all(kv)
    assert kv.block_sizes() == [BLOCK] and kv.chunks == 2


def test_readers_and_writers_on_threads_leave_the_maps_consistent():
    kv = KvIndex(max_chunks=2000)
    stop = threading.Event()

    def writer(uid: int) -> None:
        for c in range(3000):
            store(kv, uid, range(c, c + 1), [advert(c % 50, chunk=b"w%d" % c)])
            if c % 3 == 0:
                kv.note(uid, key(uid, c), "pool", False)

    def reader() -> None:
        while not stop.is_set():
            kv.leading(prompt_hashes(4), ["pool"])
            kv.log.read(-1, 100, uid=A, spaces=[SPACE])
    threads = [threading.Thread(target=writer, args=(u,)) for u in (A, B)] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads[:2]:
        t.join()
    stop.set()
    threads[2].join()
    kv.drain()
    assert kv.failed == 0 and kv.chunks <= 2000
    assert kv.bytes == sum(s.bytes for s in kv.maps.shares.values()) == sum(c.cost for c in kv.maps.by_id.values())
    for cur in kv.maps.by_hash.values():
        for c in (cur.values() if isinstance(cur, dict) else (cur,)):
            assert kv.maps.by_id.get(c.ident) is c and c.posted


def pods_of(kv: KvIndex) -> list[tuple]:
    records, _, _ = kv.log.read(-1, 1 << 20)
    return [("detach" if r.detach else "attach", r.uid, r.pod) for r in records if r.ev is None and r.pod]


def test_engines_are_kept_per_uid_and_detached_when_pushed_out_or_their_namespace_empties(monkeypatch):
    monkeypatch.setattr(maps_module, "MAX_PODS_PER_UID", 2)
    kv = KvIndex()
    kv.describe(A, SPACE, "m", "a0", 0, 1, [key(A, 0)], [advert(0)])
    for i in range(4):                                       # B's engines push out B's own, never A's
        kv.describe(B, SPACE, "m", f"b{i}", 0, 1, [key(B, i)], [advert(i)])
    kv.drain()
    assert pods_of(kv) == [("attach", A, "a0"), ("attach", B, "b0"), ("attach", B, "b1"), ("attach", B, "b2"),
                           ("detach", B, "b0"), ("attach", B, "b3"), ("detach", B, "b1")]
    prune_all(kv)                                            # every chunk goes: the namespaces empty
    assert pods_of(kv)[7:] == [("detach", A, "a0"), ("detach", B, "b2"), ("detach", B, "b3")]
    assert not kv.maps.pods and not kv.maps.space_chunks


def test_a_uids_queued_adverts_are_bounded_and_another_uids_still_queue(monkeypatch):
    monkeypatch.setattr(index_module, "MAX_QUEUED_ADVERTS", 1000)
    kv = KvIndex()
    for s in range(10):             # B floods faster than anything applies: 10 x 400 adverts
        kv.describe(B, SPACE, "m", "", 0, 1, [b"b%d-%d" % (s, i) for i in range(400)],
                    [advert(i, chunk=b"b%d-%d" % (s, i)) for i in range(400)])
    assert kv.queue_refused >= 1 and kv._queued_by_uid.get(B, (0, 0))[0] <= 1000
    store(kv, A, range(4))          # A's adverts are queued and applied all the same
    assert found(kv) == (8, 8) and kv.queue_refused == kv.refused
    assert kv._queued_by_uid == {} and kv._queued_adverts == 0


# ---- round 4, fresh attack: a hostile tenant against the KV index ---------------------------


def memory_held(kv: KvIndex, raws: list) -> int:
    """Bytes tracemalloc sees held once ``raws`` (each one STORE's encoded adverts, one advert
    each) are described as B's, reported resident and applied, and ``raws`` are freed."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(len(raws)):
            kv.describe(B, SPACE, "m", "", 0, 1, [b"k%d" % i], raws[i], count=1)
            kv.note(B, b"k%d" % i, "pool", True)
        kv.drain()
        raws.clear()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("lora", ["x" * 4096, "\U0001F600" * 4096])
def test_a_long_lora_name_is_charged_to_the_index_and_the_log(lora):
    """A LoRA name may be 4,096 characters (``MAX_TEXT``), one string per advert as decoded,
    kept by the chunk and by its BlockStored record: neither ``chunk_cost`` nor ``event_bytes``
    counted it, so one-block chunks held 3x (ASCII) to 10x (4-byte characters) what the index's
    and the log's byte bounds were charged (round 4, fresh attack)."""
    n = 500
    kv = KvIndex()
    raw = [pack_adverts([Advert(b"c%d" % i, 0, BLOCK, [i], None, list(range(BLOCK)), lora_name=lora)])
           for i in range(n)]
    used = memory_held(kv, raw)
    assert kv.chunks == n and used <= kv.bytes + kv.log.bytes, (used / n, (kv.bytes + kv.log.bytes) / n)


def test_extra_keys_are_charged_what_they_hold_decoded():
    """Extra keys of many small distinct values (each block 15 one-item lists of a distinct
    int: 61 bytes encoded, about 1.3 KB decoded) held about 3x what ``chunk_cost`` (twice the
    encoded size) and ``event_bytes`` (64 bytes a block) charged (round 4, fresh attack)."""
    n = 30

    def extra(i: int) -> bytes:
        return msgspec.msgpack.encode([[[300 + b * 15 + j] for j in range(15)] for b in range(1024)])
    kv = KvIndex()
    raw = [pack_adverts([Advert(b"c%d" % i, 0, 1, [i * 1024 + j for j in range(1024)], None, list(range(1024)),
                                extra_keys=extra(i))]) for i in range(n)]
    used = memory_held(kv, raw)
    assert kv.chunks == n and kv.refused == 0
    assert used <= kv.bytes + kv.log.bytes, (used / n, (kv.bytes + kv.log.bytes) / n)


def test_records_the_node_stream_has_not_read_stay_and_a_uid_with_much_of_the_backlog_is_not_advertised():
    """Round 4, fresh attack: B's events, produced faster than the publisher sends them, pushed
    unsent records off the ring, and the node topics started over with AllBlocksCleared."""
    kv = KvIndex(records=64, log_bytes=1 << 20)
    log = kv.log
    log.read(-1, 10, node=True)                         # the publisher, caught up
    big = BlockRemoved(list(range(8000)), "CPU", 0, "LOCAL")      # about 272 KB each
    log.extend([(B, SPACE, "m", big, "") for _ in range(6)])                # 1.6 MiB: past the bound
    assert log.trimmed == 0 and log.lagging(B) and not log.lagging(A)
    store(kv, B, range(2))
    assert kv.lag_refused == 1 and len(kv) == 0         # stored, not advertised
    store(kv, A, range(2))
    assert len(kv) == 2                                 # A's are
    records, _, lost = log.read(0, 100, node=True)
    assert not lost and len(records) == 6 + 2 and not log.lagging(B)
    log.extend([(B, SPACE, "m", big, "") for _ in range(10)])               # past twice the bound: trimmed
    assert log.bytes <= 2 << 20 and log.trimmed > 0
