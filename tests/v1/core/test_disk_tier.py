"""The disk tier and the tier stack without an endpoint: real files in a temp directory, real
processes for concurrent writers. (End to end, through a real lmshm-server and workers:
tests/v1/server/test_tiers.py.)"""

from __future__ import annotations

import errno
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from lmshm.core.pool import KEY as OBJ_KEY
from lmshm.core.pool import NBYTES, OFFSET, Pool, Reservation
from lmshm.core.tiers.base import ChunkMeta
from lmshm.core.tiers.disk import DiskTier
from lmshm.core.tiers.disk.format import HEADER_BYTES, BadFile, file_bytes, read_file, write_file
from lmshm.core.tiers.stack import TierStack

KEY = bytes(range(32))       # a MAC key for the file functions used without a tier

META = ChunkMeta(10_000, b"L" * 16, 2)


_CYCLE = bytes(range(251)) * 2


def payload(seed: int, n: int = META.nbytes) -> bytes:
    """``n`` bytes that differ for every seed (a rotation of 0..250)."""
    start = seed * 7 % 251
    return (_CYCLE[start:start + 251] * (n // 251 + 1))[:n]


@pytest.fixture
def disk_dir(tmp_path: Path) -> Path:
    d = tmp_path / "disk"
    d.mkdir(mode=0o700)
    return d


def test_a_chunk_round_trips_and_another_uid_never_sees_it(disk_dir):
    tier = DiskTier(str(disk_dir), 1 << 20)
    try:
        assert tier.put(7, b"k0", META, memoryview(payload(1)))
        dest = bytearray(META.nbytes)
        assert tier.get_into(7, b"k0", META, memoryview(dest)) and bytes(dest) == payload(1)
        assert tier.contains(7, [b"k0", b"k1"]) == 1 and tier.contains(8, [b"k0"]) == 0
        assert not tier.get_into(8, b"k0", META, memoryview(dest))
        assert tier.head(7, b"k0") == META and tier.head(8, b"k0") is None
        s = tier.stats.snapshot()
        assert s["puts"] == 1 and s["reads"] == 1 and s["read_bytes"] == META.nbytes
    finally:
        tier.close()


def test_a_restart_rebuilds_the_index_and_removes_temp_files(disk_dir):
    tier = DiskTier(str(disk_dir), 1 << 20)
    for i in range(5):
        tier.put(0, bytes([i]) * 16, META, memoryview(payload(i)))
    used = tier.usage()
    tier.close()
    stale = Path(tier.path_of(0, bytes([0]) * 16)).parent / ".tmp-1-dead"
    stale.write_bytes(b"half a chunk")
    again = DiskTier(str(disk_dir), 1 << 20)
    try:
        assert again.wait_scan(10)
        assert again.usage() == used and not stale.exists()
        dest = bytearray(META.nbytes)
        assert again.get_into(0, bytes([3]) * 16, META, memoryview(dest)) and bytes(dest) == payload(3)
    finally:
        again.close()


@pytest.mark.parametrize("damage", ["flip-payload", "truncate", "flip-header", "other-key"])
def test_a_damaged_file_is_a_miss_and_is_deleted(disk_dir, damage):
    tier = DiskTier(str(disk_dir), 1 << 20)
    try:
        tier.put(0, b"good", META, memoryview(payload(1)))
        tier.put(0, b"else", META, memoryview(payload(2)))
        path = Path(tier.path_of(0, b"good"))
        raw = bytearray(path.read_bytes())
        if damage == "flip-payload":
            raw[HEADER_BYTES + 5000] ^= 1
        elif damage == "truncate":
            raw = raw[:HEADER_BYTES + 100]
        elif damage == "flip-header":
            raw[20] ^= 1
        else:
            raw = bytearray(Path(tier.path_of(0, b"else")).read_bytes())
        path.write_bytes(raw)
        dest = bytearray(META.nbytes)
        assert not tier.get_into(0, b"good", META, memoryview(dest))
        assert not path.exists() and tier.contains(0, [b"good"]) == 0
        assert tier.stats.snapshot()["corrupt"] == 1
        assert tier.get_into(0, b"else", META, memoryview(dest)) and bytes(dest) == payload(2)
    finally:
        tier.close()


def test_usage_stays_within_capacity_under_churn_and_pending_reads_are_not_evicted(disk_dir):
    capacity = 10 * file_bytes(META.nbytes)
    tier = DiskTier(str(disk_dir), capacity)
    try:
        tier.put(0, b"kept", META, memoryview(payload(0)))
        with tier._lock:
            tier._index[0][b"kept"].readers += 1         # as a read in progress holds it
        for i in range(30 * 3):                          # 3x overfill, three times over
            tier.put(0, i.to_bytes(4, "big"), META, memoryview(payload(i)))
            assert tier.usage()[1] <= capacity
        on_disk = sum(f.stat().st_size for f in disk_dir.rglob("*") if f.is_file() and f.name not in (".lock", ".key"))
        assert on_disk <= capacity and tier.stats.snapshot()["evictions"] > 0
        assert tier.contains(0, [b"kept"]) == 1
    finally:
        tier.close()


def test_a_second_server_cannot_open_the_same_directory(disk_dir):
    tier = DiskTier(str(disk_dir), 1 << 20)
    try:
        with pytest.raises(OSError, match="in use by another lmshm-server"):
            DiskTier(str(disk_dir), 1 << 20)
    finally:
        tier.close()


def test_a_directory_others_may_write_is_refused(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by others"):
        DiskTier(str(d), 1 << 20)


def test_a_failing_write_is_dropped_and_counted_never_raised(disk_dir):
    tier = DiskTier(str(disk_dir), 1 << 20)
    try:
        blocker = disk_dir / "0"
        blocker.write_bytes(b"")       # a file where the uid's directory must go: every write fails
        assert not tier.put(0, b"k", META, memoryview(payload(1)))
        s = tier.stats.snapshot()
        assert s["drops"] == 1 and tier.usage()[1] == 0 and tier.contains(0, [b"k"]) == 0
    finally:
        tier.close()


def _writer(path: str, seed: int, until: float) -> None:
    data = memoryview(payload(seed, 1 << 20))
    meta = ChunkMeta(1 << 20, b"L" * 16, 1)
    while time.monotonic() < until:
        write_file(path, 0, b"same", meta, 3, data, mac_key=KEY)


def test_concurrent_writers_of_one_key_never_leave_a_partial_file(disk_dir):
    path = str(disk_dir / "same")
    meta = ChunkMeta(1 << 20, b"L" * 16, 1)
    write_file(path, 0, b"same", meta, 3, memoryview(payload(1, 1 << 20)), mac_key=KEY)
    ctx = multiprocessing.get_context("spawn")
    until = time.monotonic() + 3
    procs = [ctx.Process(target=_writer, args=(path, seed, until)) for seed in (1, 2)]
    for p in procs:
        p.start()
    wanted = {payload(1, 1 << 20), payload(2, 1 << 20)}
    reads = 0
    dest = bytearray(1 << 20)
    while any(p.is_alive() for p in procs):
        read_file(path, 0, b"same", meta, memoryview(dest), mac_key=KEY)   # BadFile here would be a torn file
        assert bytes(dest) in wanted
        reads += 1
    for p in procs:
        p.join()
        assert p.exitcode == 0
    assert reads > 10
    assert [n for n in os.listdir(disk_dir) if n.startswith(".tmp-")] == []


def test_a_file_of_another_chunk_is_refused_by_read_file(disk_dir):
    path = str(disk_dir / "x")
    write_file(path, 0, b"a", META, 1, memoryview(payload(1)), mac_key=KEY)
    with pytest.raises(BadFile):
        read_file(path, 0, b"b", META, memoryview(bytearray(META.nbytes)), mac_key=KEY)
    with pytest.raises(BadFile):
        read_file(path, 1, b"a", META, memoryview(bytearray(META.nbytes)), mac_key=KEY)
    with pytest.raises(BadFile, match="MAC"):          # another deployment's key
        read_file(path, 0, b"a", META, memoryview(bytearray(META.nbytes)), mac_key=bytes(32))


# ---- the stack: write-through and promotion against a real pool ---------------------------

def stored(pool: Pool, uid: int, key: bytes, data: bytes) -> tuple:
    outcome, obj = pool.reserve(uid, key, len(data), META.layout, META.blocks)
    assert outcome == Reservation.STORED
    pool.bytes.view[obj[OFFSET]:obj[OFFSET] + obj[NBYTES]] = data
    pool.commit([obj])
    return obj


def wait_for(cond, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_write_through_then_promotion_brings_evicted_chunks_back_pinned(disk_dir):
    pool = Pool(4 * (META.nbytes + 1024), max_pinned_fraction_per_uid=1.0)
    tier = DiskTier(str(disk_dir), 1 << 20)
    stack = TierStack(pool, [tier], queue_limit=16, timeout_s=2.0)
    try:
        for i in range(3):                                 # written through one by one (queue: half the pool)
            stack.write_through([stored(pool, 5, bytes([i]) * 8, payload(i))])
            wait_for(lambda: tier.usage()[2] == i + 1)
        wait_for(lambda: pool.pinned == 0)                 # write-through pins end once written
        for i in range(3, 7):                              # the first three are evicted from the pool
            stored(pool, 5, bytes([i]) * 8, payload(i))
        assert pool.hold(5, bytes([0]) * 8) is None
        keys = [[bytes([i]) * 8 for i in range(3)] + [b"missing!"]]
        held = stack.promote(5, keys, time.monotonic() + 2)
        assert len(held.held) == 3 and pool.pinned == 3
        hits, lease = pool.lookup(5, keys, "s", 10)
        held.release()
        assert hits == 3 and pool.pinned == 3              # now pinned by the lease alone
        for i in range(3):
            obj = pool.hold(5, bytes([i]) * 8)
            assert bytes(pool.bytes.view[obj[OFFSET]:obj[OFFSET] + obj[NBYTES]]) == payload(i)
            pool.unpin([obj], retrieved=False)
        assert stack.promote(6, keys, time.monotonic() + 2).held == []    # another uid: nothing
        info = stack.info()[0]
        assert info.promotions == 3 and info.puts == 3 and info.objects == 3
    finally:
        stack.close()
        pool.release()


def test_a_damaged_chunk_in_a_long_promotion_ends_the_prefix_there_and_leaks_no_reservation(disk_dir):
    """Reader tasks promote runs of consecutive chunks (READ_GROUP_CHUNKS): a bad chunk in the
    middle of a run ends the LOOKUP's prefix at it; the run's later chunks are never served by
    this LOOKUP, and every reservation is committed or aborted."""
    pool = Pool(128 * (META.nbytes + 4096), max_pinned_fraction_per_uid=1.0)
    tier = DiskTier(str(disk_dir), 1 << 30)
    stack = TierStack(pool, [tier], queue_limit=4, timeout_s=5.0, readers=2)
    keys = [b"run-%03d" % i for i in range(80)]
    try:
        for i, k in enumerate(keys):
            assert tier.put(3, k, META, memoryview(payload(i)))
        bad = Path(tier.path_of(3, keys[37]))
        raw = bytearray(bad.read_bytes())
        raw[HEADER_BYTES + 5] ^= 1                        # the payload: its checksum no longer matches
        bad.write_bytes(bytes(raw))
        held = stack.promote(3, [keys], time.monotonic() + 5)
        assert [obj[OBJ_KEY] for obj in held.held] == keys[:37]
        for i, obj in enumerate(held.held):
            assert bytes(pool.bytes.view[obj[OFFSET]:obj[OFFSET] + obj[NBYTES]]) == payload(i)
        held.release()
        wait_for(lambda: pool.in_flight == 0)            # runs read after the bad one: committed or aborted
        assert pool.pinned == 0 and not bad.exists() and tier.stats.snapshot()["corrupt"] == 1
        assert pool.hold(3, keys[37]) is None
    finally:
        stack.close()
        pool.release()


def test_a_full_queue_drops_write_throughs_and_counts_them(disk_dir):
    pool = Pool(1 << 20)
    tier = DiskTier(str(disk_dir), 1 << 20)
    stack = TierStack(pool, [tier], queue_limit=1, timeout_s=1.0)
    gate = __import__("threading").Event()
    real_put = tier.put
    tier.put = lambda *a: gate.wait(5) and real_put(*a)      # a slow disk: the writer is stuck
    try:
        objs = [stored(pool, 0, bytes([i]) * 8, payload(i, 100)) for i in range(5)]
        stack.write_through(objs)
        assert tier.stats.snapshot()["drops"] >= 2            # at most one in each of 2 writers, one queued
        gate.set()
        wait_for(lambda: pool.pinned == 0)
    finally:
        gate.set()
        stack.close()
        pool.release()


def test_a_slow_tier_makes_promotion_a_miss_within_its_deadline(disk_dir):
    pool = Pool(1 << 20, max_pinned_fraction_per_uid=1.0)
    tier = DiskTier(str(disk_dir), 1 << 20)
    tier.put(0, b"k" * 8, META, memoryview(payload(1)))
    stack = TierStack(pool, [tier], queue_limit=4, timeout_s=0.2)
    gate = __import__("threading").Event()
    real_get = tier.get_into
    tier.get_into = lambda *a: gate.wait(5) and real_get(*a)
    try:
        t0 = time.monotonic()
        held = stack.promote(0, [[b"k" * 8]], t0 + 0.2)
        assert time.monotonic() - t0 < 1.0 and held.held == []
        assert stack.info()[0].timeouts == 1
        gate.set()                                          # the late read completes: committed then
        wait_for(lambda: pool.objects == 1)
    finally:
        gate.set()
        stack.close()
        pool.release()


def test_write_through_never_pins_more_than_half_the_pool(disk_dir):
    pool = Pool(1 << 20)
    tier = DiskTier(str(disk_dir), 8 << 20)
    stack = TierStack(pool, [tier], queue_limit=100, timeout_s=1.0)
    gate = __import__("threading").Event()
    real_put = tier.put
    tier.put = lambda *a: gate.wait(5) and real_put(*a)
    try:
        objs = [stored(pool, 0, bytes([i]) * 8, payload(i, 100_000)) for i in range(8)]
        stack.write_through(objs)
        assert pool.pinned_bytes <= pool.capacity // 2 + 8 * 1024
        assert tier.stats.snapshot()["drops"] == 3            # 5 x 100 kB fit in 512 KiB
        gate.set()
        wait_for(lambda: pool.pinned == 0 and tier.usage()[2] == 5)
    finally:
        gate.set()
        stack.close()
        pool.release()


def test_metrics_show_each_tier_by_name():
    from lmshm.core.metrics import Metrics
    from lmshm.core.registry import Registry
    from lmshm.wire.protocol import PoolInfo, TierInfo

    tier = TierInfo("disk", capacity=1 << 30, used=8192, objects=1, promotions=3, drops=2, queue_depth=4)
    pool = PoolInfo(1 << 30, 4096, 1, 0, 0, 0, 3, 1, 1, 0, 0, 0, 2, 0, tiers=[tier])
    text = Metrics(Registry(), lambda: pool).text().decode()
    for line in ('lmshm_tier_promotions_total{tier="disk"} 3.0', 'lmshm_tier_drops_total{tier="disk"} 2.0',
                 'lmshm_tier_queue_depth{tier="disk"} 4.0', 'lmshm_tier_capacity{tier="disk"} 1.073741824e+09'):
        assert line in text, line


def test_a_fifo_in_place_of_a_chunk_file_is_a_miss_and_never_blocks(disk_dir):
    tier = DiskTier(str(disk_dir), 1 << 20)
    try:
        tier.put(0, b"k", META, memoryview(payload(1)))
        path = tier.path_of(0, b"k")
        os.unlink(path)
        os.mkfifo(path)                                    # opening it for reading would wait for a writer
        t0 = time.monotonic()
        assert not tier.get_into(0, b"k", META, memoryview(bytearray(META.nbytes)))
        assert time.monotonic() - t0 < 1 and not os.path.exists(path)
        os.mkfifo(path)
    finally:
        tier.close()
    again = DiskTier(str(disk_dir), 1 << 20)               # the scan does not block on it either
    try:
        assert again.wait_scan(10)
        assert again.contains(0, [b"k"]) == 0 and not os.path.exists(path)
    finally:
        again.close()


def test_shutdown_with_a_stuck_read_reports_it_and_keeps_the_pool_mapped(disk_dir):
    pool = Pool(1 << 20, max_pinned_fraction_per_uid=1.0)
    tier = DiskTier(str(disk_dir), 1 << 20)
    tier.put(0, b"k" * 8, META, memoryview(payload(1)))
    stack = TierStack(pool, [tier], queue_limit=4, timeout_s=0.1)
    gate = __import__("threading").Event()
    real_get = tier.get_into
    tier.get_into = lambda *a: gate.wait(10) and real_get(*a)
    try:
        stack.promote(0, [[b"k" * 8]], time.monotonic() + 0.1)
        t0 = time.monotonic()
        assert stack.close(timeout_s=0.3) is False and time.monotonic() - t0 < 2
    finally:
        gate.set()
        wait_for(lambda: stack._reading == 0)
        tier.close()
        pool.release()


def test_a_chunk_on_whole_pages_is_written_direct_and_others_through_the_page_cache(disk_dir, monkeypatch):
    import mmap
    tier = DiskTier(str(disk_dir), 1 << 22)
    try:
        aligned = mmap.mmap(-1, 3 * 4096)                  # page-aligned, whole pages
        aligned[:] = os.urandom(3 * 4096)
        meta3 = ChunkMeta(3 * 4096, META.layout, 1)
        opened = []
        real_open = os.open
        monkeypatch.setattr(os, "open", lambda path, flags, *a, **kw: (flags & os.O_CREAT and opened.append(flags))
                            or real_open(path, flags, *a, **kw))     # the files made, not the directories
        assert tier.put(0, b"page", meta3, memoryview(aligned))
        unaligned = memoryview(bytearray(4096 + 64))[64:]  # whole pages long, not on a page
        assert tier.put(0, b"off", ChunkMeta(4096, META.layout, 1), unaligned)
        assert [bool(f & os.O_DIRECT) for f in opened] == [True, False]
        assert tier.stats.snapshot()["direct_writes"] == 1
        dest = bytearray(3 * 4096)
        assert tier.get_into(0, b"page", meta3, memoryview(dest)) and dest == aligned[:]
        # a file system that refuses O_DIRECT (simulated: open raises EINVAL for it): written
        # through the page cache, and never tried direct again
        opened.clear()

        def no_direct(path, flags, *a, **kw):
            if flags & os.O_CREAT:
                opened.append(flags)
            if flags & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_open(path, flags, *a, **kw)
        monkeypatch.setattr(os, "open", no_direct)
        for k in (b"p2", b"p3"):
            assert tier.put(0, k, meta3, memoryview(aligned))
        assert [bool(f & os.O_DIRECT) for f in opened] == [True, False, False] and not tier.direct
        s = tier.stats.snapshot()
        assert s["direct_writes"] == 1 and s["drops"] == 0 and s["puts"] == 4
        dest = bytearray(3 * 4096)
        assert tier.get_into(0, b"p3", meta3, memoryview(dest)) and dest == aligned[:]
    finally:
        tier.close()


@pytest.mark.parametrize("opener", ["openat2", "step by step"])
@pytest.mark.parametrize("damage", ["none", "flip-payload", "truncate", "other-key"])
def test_a_read_into_whole_pages_is_direct_and_checked_there(disk_dir, monkeypatch, damage, opener):
    """Reads open the chunk file by one ``openat2`` below the cached ``<uid>/<xx>`` fd where the
    kernel has it (``platform.openat2``), else by ``os.open`` in its checked leaf directory."""
    import mmap
    tier = DiskTier(str(disk_dir), 1 << 22)
    if opener == "step by step":
        tier._open_below = tier._open_below_direct = None
    else:
        assert tier._open_below_direct is not None, "openat2 is refused on this machine"
    try:
        meta3 = ChunkMeta(3 * 4096, META.layout, 1)
        for k, seed in ((b"page", 1), (b"else", 2)):
            assert tier.put(0, k, meta3, memoryview(payload(seed, meta3.nbytes)))
        path = Path(tier.path_of(0, b"page"))
        raw = bytearray(path.read_bytes())
        if damage == "flip-payload":
            raw[HEADER_BYTES + 5000] ^= 1
        elif damage == "truncate":
            raw = raw[:HEADER_BYTES + 4096]
        elif damage == "other-key":
            raw = bytearray(Path(tier.path_of(0, b"else")).read_bytes())
        path.write_bytes(raw)
        opened = []
        real_open = os.open
        monkeypatch.setattr(os, "open", lambda p, flags, *a, **kw: (p == path.name and opened.append(flags))
                            or real_open(p, flags, *a, **kw))
        for name in ("_open_below", "_open_below_direct"):
            real = getattr(tier, name)
            if real is not None:
                flags = os.O_DIRECT if name == "_open_below_direct" else 0
                setattr(tier, name, lambda fd, rel, real=real, flags=flags: (
                    rel.endswith("/" + path.name) and opened.append(flags)) or real(fd, rel))
        dest = mmap.mmap(-1, meta3.nbytes)                 # page-aligned, as a pool object with a disk tier
        assert tier.get_into(0, b"page", meta3, memoryview(dest)) == (damage == "none")
        assert [bool(f & os.O_DIRECT) for f in opened] == [True]
        if damage == "none":
            assert dest[:] == payload(1, meta3.nbytes)
        else:
            assert not path.exists() and tier.stats.snapshot()["corrupt"] == 1
        # a file system that refuses O_DIRECT: read through the page cache, never direct again
        monkeypatch.setattr(os, "open", lambda p, flags, *a, **kw: (_ for _ in ()).throw(
            OSError(errno.EINVAL, "Invalid argument")) if flags & os.O_DIRECT else real_open(p, flags, *a, **kw))
        if tier._open_below_direct is not None:
            def refused(fd, rel):
                raise OSError(errno.EINVAL, "Invalid argument")
            tier._open_below_direct = refused
        dest[:] = bytes(meta3.nbytes)
        assert tier.get_into(0, b"else", meta3, memoryview(dest)) and dest[:] == payload(2, meta3.nbytes)
        assert not tier.direct_reads and tier.contains(0, [b"else"]) == 1
    finally:
        tier.close()


def test_seen_once_remembers_the_last_items_in_bounded_memory_and_forgets_older_ones():
    from lmshm.core.tiers.base import SeenOnce
    seen = SeenOnce(1000)
    seen._key = bytes(16)       # a fixed key: the false-positive counts below are the same every run
    assert len(seen._new) + len(seen._old) < 4 * 1000        # about 1.2 bytes an item, two filters
    first = [b"first-%d" % i for i in range(1000)]
    assert sum(seen.check_and_add(x) for x in first) <= 20   # new (up to 1 % false positives, and slack)
    assert all(seen.check_and_add(x) for x in first)         # seen once: True
    later = [b"later-%d" % i for i in range(999)]            # fewer new items than it remembers
    assert sum(seen.check_and_add(x) for x in later) <= 20
    assert all(seen.check_and_add(x) for x in first)         # still remembered (the older filter)
    for i in range(1001):                                    # more than it remembers
        seen.check_and_add(b"newer-%d" % i)
    assert sum(seen.check_and_add(x) for x in first) <= 20   # forgotten: bounded memory


def test_two_different_disk_warnings_in_the_same_ten_seconds_are_both_logged(disk_dir, caplog):
    """Each kind of warning has its own throttle: a failed read does not hide a failed write
    that follows it (one global timestamp for every message did, for 10 s); a second failed
    read in that time is left out and counted, and the next such line says how many."""
    tier = DiskTier(str(disk_dir), 1 << 20)
    try:
        first, second, third = (bytes.fromhex("abcd") + bytes([i]) * 14 for i in range(3))
        assert tier.put(0, first, META, memoryview(payload(1)))
        assert tier.put(0, third, META, memoryview(payload(3)))
        leaf = disk_dir / "0" / "ab" / "cd"
        os.rename(leaf, disk_dir / "moved")
        leaf.symlink_to(disk_dir / "moved")       # never followed: reads and writes there fail
        dest = bytearray(META.nbytes)
        with caplog.at_level("WARNING", logger="lmshm.tiers.disk"):
            assert not tier.get_into(0, first, META, memoryview(dest))
            assert not tier.put(0, second, META, memoryview(payload(2)))
            assert not tier.get_into(0, third, META, memoryview(dest))
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 2, said
        assert "cannot read" in said[0] and "a write to" in said[1]
        assert tier._warn_read.left_out == 1
    finally:
        tier.close()
