"""The KV event index's own semantics, in process (real threads, no server): what one uid's
adverts may do to another's entries, and what the index and the log cost (issue 41, round 4).
End to end, through a real server and two uids: ``tests/v1/multiprocess/test_kv_events_tenants.py``."""

from __future__ import annotations

import threading
from typing import Any, Optional

import msgspec
import pytest

from lmshm.core import kv_events
from lmshm.core.kv_events import BOTH, NODE, OWNER, EventLog, KvIndex, chunk_cost
from lmshm.wire.protocol import Advert, pack_adverts, unpack_adverts

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


def node_view(kv: KvIndex) -> list[tuple]:
    """What the node stream sends: ``(type, first hash)`` of every record not owner-only."""
    records, _, _ = kv.log.read(-1, 1 << 20)
    return [(type(r.event).__name__, r.event.block_hashes[0]) for r in records
            if r.event is not None and r.scope != OWNER and hasattr(r.event, "block_hashes")]


def own_feed(kv: KvIndex, uid: int) -> list[tuple]:
    records, _, _ = kv.log.read(-1, 1 << 20, uid=uid, spaces=[SPACE])
    return [(type(r.event).__name__, r.event.block_hashes[0]) for r in records if r.event is not None]


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
    kv._pruned_at = -1e9
    assert kv.prune(older_than_s=0.0) == 1                  # B's advert pruned
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
    assert kv.chunks <= 4096 and not [e for e in own_feed(kv, A) if e[0] == "BlockRemoved"]
    assert kv.unresident_dropped + kv.unindexed >= 4 * (1 << 14) - 4096


def test_a_full_index_forgets_from_the_uid_holding_the_most_and_its_adverts_never_evict_a_smaller_one():
    kv = KvIndex(max_chunks=64)
    store(kv, A, range(8))
    store(kv, B, range(100, 300))           # B alone overfills the index: B's oldest go
    assert found(kv, 8) == (16, 16)
    assert kv.chunks == 64 and kv.unindexed == 200 - 56
    assert not [e for e in own_feed(kv, A) if e[0] == "BlockRemoved"]


def test_unresident_adverts_are_bounded_per_uid(monkeypatch):
    monkeypatch.setattr(kv_events, "MAX_UNRESIDENT", 100)
    kv = KvIndex()
    store(kv, A, range(150), resident=False)
    store(kv, B, range(10), resident=False)
    assert len(kv) == 110 and kv.unresident_dropped == 50
    kv.batch_recorder("pool")([(A, key(A, c)) for c in range(150)])    # only the newest 100 are known
    assert kv.leading(hashes(49), ["pool"])["pool"] == 0 and kv.leading(hashes(50), ["pool"])["pool"] == 2


# ---- §3: bounded by bytes and work ---------------------------------------------------------


def big_advert(i: int, blocks: int = 1024, block_size: int = 64, extra: int = 0) -> Advert:
    return Advert(b"big-%d" % i, 0, block_size, [(i << 20) + j for j in range(blocks)], None,
                  list(range(blocks * block_size)), extra_keys=msgspec.msgpack.encode([["x" * extra]] * blocks)
                  if extra else None)


def test_the_index_is_bounded_in_bytes_and_charges_each_chunk_to_its_uid():
    one = chunk_cost(1024, 4 * 65536, 0)
    kv = KvIndex(max_chunks=1 << 18, max_bytes=8 * one)
    for i in range(20):
        kv.describe(B, SPACE, "m", "", 0, 1, [b"big-%d" % i], [big_advert(i)])
        kv.note(B, b"big-%d" % i, "pool", True)
    kv.drain()
    assert kv.bytes <= 8 * one and kv.chunks == 8 and kv.unindexed == 12
    assert kv._shares[B].bytes == kv.bytes


def test_the_log_is_bounded_in_bytes_and_keeps_tokens_packed():
    kv = KvIndex(records=1 << 16, log_bytes=4 << 20)
    for i in range(40):
        kv.describe(B, SPACE, "m", "", 0, 1, [b"big-%d" % i], [big_advert(i)])
        kv.note(B, b"big-%d" % i, "pool", True)
    kv.drain()
    assert kv.log.bytes <= 4 << 20 and kv.log.trimmed > 0
    records, _, _ = kv.log.read(-1, 1 << 20)
    stored = [r for r in records if r.ev is not None and type(r.ev).__name__ == "_Stored"]
    assert stored and isinstance(stored[-1].ev.tokens, bytes)         # packed until read
    assert list(stored[-1].event.token_ids) == list(range(1024 * 64))


def test_one_store_of_many_adverts_is_applied_in_bounded_steps():
    kv = KvIndex()
    kv.unpack_adverts = unpack_adverts
    n = 4096
    adverts = [Advert(b"c%d" % i, 0, BLOCK, [i + 1], None, list(range(BLOCK))) for i in range(n)]
    kv.describe(A, SPACE, "m", "", 0, 1, [b"k%d" % i for i in range(n)], pack_adverts(adverts), "t", n)
    steps = 0
    while kv.queued:
        done = kv.drain(32)
        assert 0 < done <= 32 + 1
        steps += 1
    assert steps >= n // 33 and kv.chunks == n


def test_a_read_of_one_uid_visits_only_its_own_records(monkeypatch):
    log = EventLog(records=1 << 16)
    log.extend([(B, SPACE, "m", kv_events.AllBlocksCleared(), "") for _ in range(50_000)])
    log.extend([(A, SPACE, "m", kv_events.AllBlocksCleared(), "") for _ in range(3)])

    def scanned(*_: Any) -> Any:
        raise AssertionError("a uid's read walked the ring")
    monkeypatch.setattr(EventLog, "_scan", scanned)
    records, cursor, lost = log.read(-1, 100, uid=A, spaces=[SPACE])
    assert [r.n for r in records] == [50_001, 50_002, 50_003] and cursor == 50_003 and not lost
    assert log.read(cursor, 100, uid=A, spaces=[SPACE]) == ([], 50_003, False)
    assert log.read(-1, 100, uid=7, spaces=[SPACE]) == ([], 50_003, False)
    records, cursor, _ = log.read(50_001, 1, uid=A)                 # a limit: the cursor stops at it
    assert [r.n for r in records] == [50_002] and cursor == 50_002


def test_block_sizes_and_the_chunk_count_are_counters():
    kv = KvIndex()
    store(kv, A, range(3))
    kv.describe(A, SPACE, "m", "", 0, 1, [b"x"], [Advert(b"x", 0, 16, [5], None, list(range(16)))])
    kv.drain()
    assert sorted(kv.block_sizes()) == [BLOCK, 16] and kv.chunks == 4
    kv.note(A, key(A, 0), "pool", False)
    kv.drain()
    kv._pruned_at = -1e9
    kv.prune(older_than_s=0.0)
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
    assert kv.bytes == sum(s.bytes for s in kv._shares.values()) == sum(c.cost for c in kv._by_id.values())
    for cur in kv._by_hash.values():
        for c in (cur.values() if isinstance(cur, dict) else (cur,)):
            assert kv._by_id.get(c.ident) is c and c.posted


@pytest.mark.parametrize("scope", [BOTH, OWNER, NODE])
def test_a_uid_read_never_gets_node_only_records(scope):
    log = EventLog(records=64)
    log.extend([(A, SPACE, "m", kv_events.AllBlocksCleared(), "", scope)])
    got, _, _ = log.read(-1, 10, uid=A, spaces=[SPACE])
    assert len(got) == (0 if scope == NODE else 1)


def pods_of(kv: KvIndex) -> list[tuple]:
    records, _, _ = kv.log.read(-1, 1 << 20)
    return [("detach" if r.detach else "attach", r.uid, r.pod) for r in records if r.ev is None and r.pod]


def test_engines_are_kept_per_uid_and_detached_when_pushed_out_or_their_namespace_empties(monkeypatch):
    monkeypatch.setattr(kv_events, "MAX_PODS_PER_UID", 2)
    kv = KvIndex()
    kv.describe(A, SPACE, "m", "a0", 0, 1, [key(A, 0)], [advert(0)])
    for i in range(4):                                       # B's engines push out B's own, never A's
        kv.describe(B, SPACE, "m", f"b{i}", 0, 1, [key(B, i)], [advert(i)])
    kv.drain()
    assert pods_of(kv) == [("attach", A, "a0"), ("attach", B, "b0"), ("attach", B, "b1"), ("attach", B, "b2"),
                           ("detach", B, "b0"), ("attach", B, "b3"), ("detach", B, "b1")]
    kv._pruned_at = -1e9
    kv.prune(older_than_s=0.0)                               # every chunk goes: the namespaces empty
    assert pods_of(kv)[7:] == [("detach", A, "a0"), ("detach", B, "b2"), ("detach", B, "b3")]
    assert not kv._pods and not kv._space_chunks


def test_another_uids_flood_of_records_never_tells_a_reader_it_lost_its_own():
    log = EventLog(records=64)
    log.extend([(A, SPACE, "m", kv_events.AllBlocksCleared(), "")])
    records, cursor, lost = log.read(-1, 10, uid=A, spaces=[SPACE])
    assert len(records) == 1 and not lost
    log.extend([(B, SPACE, "m", kv_events.AllBlocksCleared(), "") for _ in range(1000)])     # B's flood
    log.extend([(A, SPACE, "m", kv_events.AllBlocksCleared(), "")])
    records, cursor2, lost = log.read(cursor, 10, uid=A, spaces=[SPACE])
    assert [r.n for r in records] == [1002] and not lost
    log.extend([(A, SPACE, "m", kv_events.AllBlocksCleared(), "") for _ in range(100)])     # A's own, trimmed
    assert log.read(cursor2, 10, uid=A, spaces=[SPACE])[2]
    assert log.read(cursor2, 10)[2]                          # the node stream: the ring's own loss


def test_a_uids_queued_adverts_are_bounded_and_another_uids_still_queue(monkeypatch):
    monkeypatch.setattr(kv_events, "MAX_QUEUED_ADVERTS", 1000)
    kv = KvIndex()
    for s in range(10):             # B floods faster than anything applies: 10 x 400 adverts
        kv.describe(B, SPACE, "m", "", 0, 1, [b"b%d-%d" % (s, i) for i in range(400)],
                    [advert(i, chunk=b"b%d-%d" % (s, i)) for i in range(400)])
    assert kv.queue_refused >= 1 and kv._queued_by_uid.get(B, (0, 0))[0] <= 1000
    store(kv, A, range(4))          # A's adverts are queued and applied all the same
    assert found(kv) == (8, 8) and kv.queue_refused == kv.refused
    assert kv._queued_by_uid == {} and kv._queued_adverts == 0


# ---- round 4, fresh attack: a hostile tenant against the KV index ---------------------------


def test_another_uids_flood_of_records_never_trims_a_readers_own_unread_records():
    """B's records push A's *unread* ones off the shared ring (by count, or cheaper by bytes:
    about 160 BlockStored of the wire's largest adverts fill a 64 MiB ring): A's read said
    ``lost`` (its connector then sends a BlockRemoved for every block it advertised). A uid's
    records now stay readable by its own feed until its own records pass its bound."""
    log = EventLog(records=64, max_bytes=1 << 20)
    log.extend([(A, SPACE, "m", kv_events.AllBlocksCleared(), "")])
    _, cursor, _ = log.read(-1, 10, uid=A, spaces=[SPACE])
    a_new = kv_events.BlockRemoved([1, 2], "CPU", 0, "LOCAL")
    log.extend([(A, SPACE, "m", a_new, "")])                     # A's, not read yet (A is idle)
    log.extend([(B, SPACE, "m", kv_events.AllBlocksCleared(), "") for _ in range(1000)])     # by count
    records, cursor2, lost = log.read(cursor, 10, uid=A, spaces=[SPACE])
    assert [r.event for r in records] == [a_new] and not lost
    big = kv_events.BlockRemoved(list(range(8000)), "CPU", 0, "LOCAL")      # about 272 KB each
    log.extend([(A, SPACE, "m", a_new, "")])
    log.extend([(B, b"other", "m", big, "") for _ in range(10)])           # by bytes
    records, _, lost = log.read(cursor2, 10, uid=A)
    assert [r.event for r in records] == [a_new] and not lost
    assert log.read(cursor2, 10)[2]                          # the node stream: the ring's own loss
    assert len(log._runs[B]) <= 64 // 4 + len(log._ring)       # past the ring, B keeps its own bound only


@pytest.mark.parametrize("lora", ["x" * 4096, "\U0001F600" * 4096])
def test_a_long_lora_name_is_charged_to_the_index_and_the_log(lora):
    """A LoRA name may be 4,096 characters (``MAX_TEXT``), one string per advert as decoded,
    kept by the chunk and by its BlockStored record: neither ``chunk_cost`` nor ``event_bytes``
    counted it, so one-block chunks held 3x (ASCII) to 10x (4-byte characters) what the index's
    and the log's byte bounds were charged (round 4, fresh attack)."""
    import gc
    import tracemalloc
    n = 500
    kv = KvIndex()
    kv.unpack_adverts = unpack_adverts
    raw = [pack_adverts([Advert(b"c%d" % i, 0, BLOCK, [i], None, list(range(BLOCK)), lora_name=lora)])
           for i in range(n)]
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(n):
            kv.describe(B, SPACE, "m", "", 0, 1, [b"k%d" % i], raw[i], count=1)
            kv.note(B, b"k%d" % i, "pool", True)
        kv.drain()
        raw.clear()
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert kv.chunks == n and used <= kv.bytes + kv.log.bytes, (used / n, (kv.bytes + kv.log.bytes) / n)


def test_extra_keys_are_charged_what_they_hold_decoded():
    """Extra keys of many small distinct values (each block 15 one-item lists of a distinct
    int: 61 bytes encoded, about 1.3 KB decoded) held about 3x what ``chunk_cost`` (twice the
    encoded size) and ``event_bytes`` (64 bytes a block) charged (round 4, fresh attack)."""
    import gc
    import tracemalloc
    n = 30

    def extra(i: int) -> bytes:
        return msgspec.msgpack.encode([[[300 + b * 15 + j] for j in range(15)] for b in range(1024)])
    kv = KvIndex()
    kv.unpack_adverts = unpack_adverts
    raw = [pack_adverts([Advert(b"c%d" % i, 0, 1, [i * 1024 + j for j in range(1024)], None, list(range(1024)),
                                extra_keys=extra(i))]) for i in range(n)]
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(n):
            kv.describe(B, SPACE, "m", "", 0, 1, [b"k%d" % i], raw[i], count=1)
            kv.note(B, b"k%d" % i, "pool", True)
        kv.drain()
        raw.clear()
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert kv.chunks == n and kv.refused == 0
    assert used <= kv.bytes + kv.log.bytes, (used / n, (kv.bytes + kv.log.bytes) / n)


def test_records_the_node_stream_has_not_read_stay_and_a_uid_with_much_of_the_backlog_is_not_advertised():
    """Round 4, fresh attack: B's events, produced faster than the publisher sends them, pushed
    unsent records off the ring, and the node topics started over with AllBlocksCleared."""
    kv = KvIndex(records=64, log_bytes=1 << 20)
    log = kv.log
    log.read(-1, 10, node=True)                         # the publisher, caught up
    big = kv_events.BlockRemoved(list(range(8000)), "CPU", 0, "LOCAL")      # about 272 KB each
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
