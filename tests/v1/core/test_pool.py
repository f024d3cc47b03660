"""The pool's bookkeeping in one process: allocation, eviction order, pins, leases, uids.
(The copies and the requests are tested end to end in tests/v1/server/test_dataplane.py.)"""

from __future__ import annotations

import pytest

from lmshm.core.dataplane import BlockLayout, LayoutError
from lmshm.core.pool import ALIGN, KEY, OBJECT_COST, OFFSET, Pool, Reservation, cost_of, parse_size
from lmshm.core.pool.extents import Extents

ONE = cost_of(ALIGN)   # what an object of 64 bytes is charged: its extent and its bookkeeping


def stored(pool: Pool, uid: int, key: bytes, n: int = ALIGN):
    outcome, obj = pool.reserve(uid, key, n, b"L", 1)
    assert outcome == Reservation.STORED
    pool.commit([obj])
    return obj


def test_sizes_parse_in_binary_units_and_refuse_nonsense():
    assert parse_size("4GiB") == 4 << 30 and parse_size("512m") == 512 << 20 and parse_size("0") == 0
    assert parse_size("1.5G") == 3 << 29 and parse_size(4096) == 4096
    for bad in ("-1", "lots", "4XB", "nan"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_freed_space_is_merged_and_reused():
    pool = Pool(4 * ONE)
    objs = [stored(pool, 0, bytes([i])) for i in range(4)]
    outcome, new = pool.reserve(0, b"x", ALIGN, b"L", 1)                    # evicts the LRU one
    assert outcome == Reservation.STORED and pool.evictions == 1 and new[0] == objs[0][0]
    extents = Extents(0)
    for start in (0, 128, 64):              # the third fills the gap: one extent remains
        extents.give(start, 64)
    assert len(extents) == 1 and extents.take(192) == 0 and extents.take(64) is None
    extents.give(1024, 256)
    extents.give(0, 128)
    assert extents.take(128) == 0           # best fit: the 128-byte extent, not the larger one
    assert extents.take(192) == 1024 and extents.take(64) == 1216 and len(extents) == 0


def test_head_room_stays_free_before_every_object_and_is_charged_and_returned():
    room = 200                                      # rounded up to a multiple of ALIGN: 256
    per = cost_of(1000, 256)
    pool = Pool(3 * per, head_room=room)
    assert pool.head_room == 256 and per == 1280 + OBJECT_COST
    objs = [stored(pool, 0, bytes([i]), 1000) for i in range(3)]
    starts = sorted(o[OFFSET] for o in objs)
    assert starts == [256, 256 + 1280, 256 + 2 * 1280] and pool.used == 3 * per
    for o in objs:                                  # room and payload of one never overlap another's
        pool.bytes.view[o[OFFSET] - 256:o[OFFSET] + 1000] = bytes([o[KEY][0] + 1]) * 1256
    for o in objs:
        assert bytes(pool.bytes.view[o[OFFSET]:o[OFFSET] + 1000]) == bytes([o[KEY][0] + 1]) * 1000
    outcome, new = pool.reserve(0, b"x", 1000, b"L", 1)     # evicts the oldest; its extent is reused
    assert outcome == Reservation.STORED and new[OFFSET] == objs[0][OFFSET] and pool.used == 3 * per
    pool.abort([new])
    assert pool.used == 2 * per
    outcome, big = pool.reserve(0, b"y", 1280 + 1000, b"L", 1)   # evicts the next: two extents, merged
    assert outcome == Reservation.STORED and big[OFFSET] == 256 and pool.evictions == 2
    assert pool.used == per + cost_of(2280, 256)
    pool.release()


def test_a_pool_aligned_for_direct_io_starts_every_object_on_a_page():
    pool = Pool(1 << 20, align=4096, head_room=224)
    assert pool.align == 4096 and pool.head_room == 4096       # the room keeps objects on pages too
    objs = [stored(pool, 0, bytes([i]), n) for i, n in enumerate((100, 8192, 5000, 64))]
    assert all(o[OFFSET] % 4096 == 0 for o in objs) and pool.bytes.addr % 4096 == 0
    assert pool.used == sum(cost_of(n, 4096, 4096) for n in (100, 8192, 5000, 64))
    pool.release()


def test_a_batch_never_evicts_a_smaller_tenant_that_per_chunk_commits_would_have_spared():
    pool = Pool(6 * ONE)
    theirs = [stored(pool, 2, bytes([100 + i])) for i in range(2)]          # uid 2: two objects
    mine = [stored(pool, 1, bytes([i])) for i in range(2)]                  # uid 1: two, then a batch
    batch = [pool.reserve(1, bytes([10 + i]), ALIGN, b"L", 1, batch=i > 0)[1] for i in range(2)]
    assert all(batch) and pool.used == 6 * ONE
    # uid 1 (4 objects) holds more than uid 2: its own oldest goes, not uid 2's
    outcome, third = pool.reserve(1, bytes([12]), ALIGN, b"L", 1, batch=True)
    assert outcome == Reservation.STORED and not pool.all_visible(1, [[mine[0][KEY]]])
    outcome, fourth = pool.reserve(1, bytes([13]), ALIGN, b"L", 1, batch=True)
    assert outcome == Reservation.STORED and not pool.all_visible(1, [[mine[1][KEY]]])
    # now uid 1's only objects are in flight: a batch gets NO_SPACE (not counted), uid 2 keeps its own
    skipped = pool.store_skipped
    assert pool.reserve(1, bytes([14]), ALIGN, b"L", 1, batch=True) == (Reservation.NO_SPACE, None)
    assert pool.store_skipped == skipped and pool.all_visible(2, [[o[KEY] for o in theirs]])
    pool.commit(batch + [third, fourth])              # committed, uid 1's own become evictable
    outcome, _ = pool.reserve(1, bytes([14]), ALIGN, b"L", 1)
    assert outcome == Reservation.STORED and not pool.all_visible(1, [[bytes([10])]])
    assert pool.all_visible(2, [[o[KEY] for o in theirs]])
    pool.release()


def test_objects_are_visible_only_once_committed_and_only_to_their_uid():
    pool = Pool(8 * ONE)
    outcome, obj = pool.reserve(1000, b"k", ALIGN, b"L", 1)
    assert pool.lookup(1000, [[b"k"]], "s", 10) == (0, b"")         # in flight: invisible
    assert pool.reserve(1000, b"k", ALIGN, b"L", 1)[0] == Reservation.PRESENT
    pool.commit([obj])
    hits, lease = pool.lookup(1000, [[b"k"]], "s", 10)
    assert hits == 1 and lease
    assert pool.lookup(2000, [[b"k"]], "t", 10) == (0, b"")         # another uid sees nothing
    assert pool.pin_for_copy(2000, [b"k"])[0] == []
    assert pool.release_lease(lease, 2000) is False                 # nor can it end the lease
    assert pool.release_lease(lease, 1000) is True


def test_pinned_objects_are_never_evicted_and_leases_end():
    pool = Pool(2 * ONE)
    stored(pool, 0, b"a")
    stored(pool, 0, b"b")
    _, lease = pool.lookup(0, [[b"a", b"b"]], "s", 0.0)
    assert pool.reserve(0, b"c", ALIGN, b"L", 1) == (Reservation.NO_SPACE, None)
    assert pool.expire() == 1                                        # ttl 0: ends at the next tick
    assert pool.reserve(0, b"c", ALIGN, b"L", 1)[0] == Reservation.STORED
    _, lease = pool.lookup(0, [[b"b"]], "s2", 30)
    assert pool.release_session("s2") == 1 and pool.info()["pinned"] == 0


def test_a_retrieve_takes_over_its_leases_pins():
    pool = Pool(4 * ONE)
    stored(pool, 0, b"a")
    stored(pool, 0, b"b")
    _, lease = pool.lookup(0, [[b"a", b"b"]], "s", 30)
    objs, missing = pool.pin_for_copy(0, [b"a"], lease)
    assert missing is None and len(objs) == 1 and pool.pinned == 2 and pool.lease_pins == 1
    pool.unpin(objs, retrieved=True)
    assert pool.info()["leases"] == 1                               # b is still pinned by it
    objs, _ = pool.pin_for_copy(0, [b"b"], lease)
    pool.unpin(objs, retrieved=True)
    assert pool.info()["leases"] == 0 and pool.info()["pinned"] == 0 and pool.retrieved == 2


def test_a_lookup_refreshes_its_objects_so_eviction_takes_the_least_recently_used():
    pool = Pool(2 * ONE)
    stored(pool, 0, b"a")
    stored(pool, 0, b"b")
    _, lease = pool.lookup(0, [[b"a"]], "s", 30)
    pool.release_lease(lease, 0)
    stored(pool, 0, b"c")                                            # evicts b: a was used since
    assert [pool.lookup(0, [[k]], "t", 30)[0] for k in (b"a", b"b", b"c")] == [1, 0, 1]


def test_eviction_steps_over_pinned_objects_and_they_return_after_their_last_pin():
    """A pin does not move an object out of the LRU; eviction sets aside the pinned ones it meets
    at the head, and the last pin's end puts such an object back at the recent end."""
    pool = Pool(3 * ONE)
    for k in (b"a", b"b", b"c"):
        stored(pool, 0, k)
    _, old = pool.lookup(0, [[b"a"]], "s", 30)                       # LRU: b c a
    _, young = pool.lookup(0, [[b"b", b"c"]], "s", 30)               # LRU: a b c, all pinned
    assert pool.reserve(0, b"x", ALIGN, b"L", 1) == (Reservation.NO_SPACE, None)
    pool.release_lease(young, 0)                                     # b, c unpinned where they are
    stored(pool, 0, b"d")                                            # a (pinned) set aside; b evicted
    assert pool.evictions == 1 and pool.pinned == 1 and pool.pinned_bytes == ONE
    pool.release_lease(old, 0)                                       # a back at the recent end: c d a
    assert (pool.pinned, pool.pinned_bytes, pool.lease_pins) == (0, 0, 0)
    stored(pool, 0, b"e")                                            # evicts c
    stored(pool, 0, b"f")                                            # evicts d
    present = [k for k in (b"a", b"b", b"c", b"d", b"e", b"f") if pool.pin_for_copy(0, [k])[0]]
    assert present == [b"a", b"e", b"f"] and pool.evictions == 3
    assert pool.used == 3 * ONE and pool.objects == 3


def test_a_lookup_over_ranks_counts_the_leading_chunks_every_rank_has_and_pins_each_object_once():
    pool = Pool(16 * ONE)
    for k in (b"a", b"b", b"c", b"d", b"e", b"s"):
        stored(pool, 0, k)
    hits, lease = pool.lookup(0, [[b"a", b"b", b"c"], [b"d", b"e", b"f"], [b"s", b"s", b"s"]], "r", 30)
    assert hits == 2 and pool.lease_pins == 5 and pool.pinned == 5          # a b d e s; f is missing
    assert pool.lookup(0, [[b"a", b"b"], [b"x", b"e"]], "r", 30) == (0, b"")   # rank 1 misses chunk 0
    _, again = pool.lookup(0, [[b"b", b"c"], [b"e", b"b"]], "r", 30)       # b pinned twice, by two leases
    assert pool.lease_pins == 8 and pool.pinned == 6 and pool.pinned_bytes == 6 * ONE
    pool.release_lease(lease, 0)
    assert pool.pinned == 3 and pool.lease_pins == 3                         # b c e still held by the second
    pool.release_lease(again, 0)
    assert (pool.pinned, pool.lease_pins, pool.pinned_bytes) == (0, 0, 0)
    assert pool.hits == 4 and pool.misses == 2


def test_layouts_the_data_plane_cannot_move_are_named():
    import torch

    with pytest.raises(LayoutError, match="separate byte runs"):
        BlockLayout.of(["l"], [torch.zeros(8, 4, 16).transpose(0, 2)])
    with pytest.raises(LayoutError, match="overlap"):
        BlockLayout.of(["l"], [torch.zeros(64).as_strided((8, 16), (4, 1))])
    with pytest.raises(LayoutError, match="same number of blocks"):
        BlockLayout.of(["a", "b"], [torch.zeros(8, 4), torch.zeros(9, 4)])
    ok = BlockLayout.of(["a"], [torch.zeros(8, 2, 4).transpose(0, 1).contiguous().transpose(0, 1)])
    assert ok.block_bytes == 2 * 4 * 4 and len(ok.digest) == 16


def test_a_copy_through_a_file_truncated_under_it_fails_instead_of_killing_the_process():
    """The SIGBUS race: the owner truncates its segment after the server's check. Copies of named
    shm go through the file (preadv/pwritev), so this process gets an error, not a signal."""
    import dataclasses
    import os

    import torch

    from lmshm.core.dataplane import FileSide, gather, scatter
    from lmshm.platform.cpu import empty_shared, segment_of

    t = empty_shared((8, 4096), torch.uint8, kind="shm")
    t.fill_(7)
    seg = segment_of(t)
    layout = BlockLayout.of(["l"], [t])
    st = os.stat(seg.path)
    start = t.untyped_storage().data_ptr()
    plan = dataclasses.replace(layout.layers[0], file=FileSide(seg.path, (st.st_dev, st.st_ino),
                                                                layout.layers[0].base - start))
    layout = dataclasses.replace(layout, layers=(plan,))
    pool = Pool(1 << 20)
    _, obj = pool.reserve(0, b"k", layout.chunk_bytes(2), layout.digest, 2)
    gather(layout, [3, 4], pool.view(obj), 2, pool.bytes)
    assert bool((pool.view(obj) == 7).all())
    os.truncate(seg.path, 4096)                      # from here on, touching t's pages would SIGBUS
    with pytest.raises(OSError, match="truncated during the copy"):
        gather(layout, [3, 4], pool.view(obj), 2, pool.bytes)
    scatter(layout, [5, 6], pool.view(obj), 2, pool.bytes)   # writes the file again: no signal either
    assert os.stat(seg.path).st_size == 7 * 4096
    pool.abort([obj])
    del t


def test_a_tenant_that_pins_all_it_may_cannot_fill_the_rest_with_one_batch():
    # Before: a uid pinning its half of the pool and then reserving a big STORE as one batch held
    # the other half in flight, and another tenant's STORE found NO_SPACE meanwhile (the
    # sustained-attack test's honest tenant got [NO_SPACE, NO_SPACE] once in a clean-clone run).
    chunk = 64 << 10
    pool = Pool(1 << 20, max_pinned_fraction_per_uid=0.5)
    try:
        keys = [b"p%d" % i for i in range(6)]
        for k in keys:
            stored(pool, 1, k, chunk)
        hits, _ = pool.lookup(1, [keys], "hog", 30)                   # pins what it may: about half
        assert hits >= 5
        batch = []
        for i in range(8):                                            # one STORE's chunks, as one batch
            outcome, obj = pool.reserve(1, b"b%d" % i, chunk, b"L", 1, batch=bool(batch))
            if outcome != Reservation.STORED:
                break
            batch.append(obj)
        assert outcome == Reservation.NO_SPACE and len(batch) == 1   # past its share: commit first
        assert stored(pool, 2, b"honest", chunk)                      # the other tenant finds room
        pool.commit(batch)
    finally:
        pool.release()


def test_the_callbacks_given_to_the_pool_hear_every_object_that_comes_and_goes():
    told: list = []
    batches: list = []
    pool = Pool(2 * ONE, on_resident=lambda uid, k, present: told.append((uid, k, present)))
    batched = Pool(2 * ONE, on_resident=lambda uid, k, present: told.append((uid, k, present)),
                   on_committed=lambda pairs: batches.append(list(pairs)))
    try:
        stored(pool, 7, b"a")
        stored(pool, 7, b"b")
        stored(pool, 7, b"c")                                          # its reservation evicts a
        assert told == [(7, b"a", True), (7, b"b", True), (7, b"a", False), (7, b"c", True)]
        told.clear()
        objs = [batched.reserve(3, k, ALIGN, b"L", 1)[1] for k in (b"x", b"y")]
        batched.commit(objs)
        assert batches == [[(3, b"x"), (3, b"y")]] and told == []    # one call for the commit
        stored(batched, 3, b"z")                                       # evicts x: told one by one
        assert told == [(3, b"x", False)] and batches[-1] == [(3, b"z")]
    finally:
        pool.release()
        batched.release()
