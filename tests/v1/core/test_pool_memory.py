"""The pool's memory (lmshm/core/pool/memory.py) in one process: huge pages, the pre-fault and
populate-ahead, each seen in /proc/self/smaps of the real mapping."""

from __future__ import annotations

import pytest

from lmshm.core.pool import OFFSET, Pool, Reservation


def stored(pool: Pool, uid: int, key: bytes, n: int):
    outcome, obj = pool.reserve(uid, key, n, b"L", 1)
    assert outcome == Reservation.STORED
    pool.commit([obj])
    return obj


def _smaps_entry(addr: int) -> dict[str, str]:
    """This process's /proc/self/smaps lines for the mapping that starts at ``addr``."""
    found: dict[str, str] = {}
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                inside = int(head.split("-")[0], 16) == addr
            elif inside:
                key, _, value = line.partition(":")
                found[key] = value.strip()
    return found


def test_the_pool_asks_for_transparent_huge_pages_unless_told_not_to():
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        if "[never]" in f.read():
            pytest.skip("transparent huge pages are off on this machine")
    huge, small = Pool(8 << 20), Pool(8 << 20, huge_pages=False)
    try:
        assert huge.memory.huge_pages and not small.memory.huge_pages
        assert "hg" in _smaps_entry(huge.memory.addr)["VmFlags"].split()           # VM_HUGEPAGE: madvise took
        assert "hg" not in _smaps_entry(small.memory.addr)["VmFlags"].split()
    finally:
        huge.release()
        small.release()


def test_a_prefaulted_pool_becomes_resident_and_keeps_what_a_store_wrote_meanwhile():
    import time

    pool = Pool(256 << 20, prefault=True)
    try:
        _, obj = pool.reserve(0, b"early", 1 << 20, b"L", 1)        # a STORE racing the pre-fault
        view = pool.view(obj)
        view.fill_(0x5A)
        deadline = time.monotonic() + 60
        while pool.memory.prefaulted < pool.capacity and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.memory.prefaulted == pool.capacity
        rss_kib = int(_smaps_entry(pool.memory.addr)["Rss"].split()[0])
        assert rss_kib * 1024 >= pool.capacity                      # every page is there now
        assert int(view.sum()) == 0x5A * (1 << 20)                  # and the early bytes are intact
        pool.abort([obj])
    finally:
        pool.release()


def test_release_stops_a_prefault_that_is_still_running():
    pool = Pool(4 << 30, prefault=True)                              # far more than it can fault at once
    pool.release()                                                   # joins the thread between steps
    assert pool.memory.prefaulted < pool.capacity and not pool.memory.prefaulter.is_alive()


def _rss(pool: Pool) -> int:
    return int(_smaps_entry(pool.memory.addr).get("Rss", "0 kB").split()[0]) * 1024


def _until(done, timeout_s: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_populate_ahead_keeps_a_window_past_the_frontier_populated_and_stops_at_capacity():
    import time

    mib = 1 << 20
    pool = Pool(64 * mib, populate_ahead=16 * mib)
    try:
        time.sleep(0.2)
        assert pool.memory.populated == 0 and _rss(pool) == 0                # nothing before the first STORE
        _, a = pool.reserve(0, b"a", 20 * mib, b"L", 1)               # the frontier moves to 20 MiB
        _until(lambda: pool.memory.populated >= 36 * mib)
        time.sleep(0.2)                                              # it stops at the window
        assert pool.memory.populated == 36 * mib                             # 16 MiB past the frontier, no more
        assert 16 * mib <= _rss(pool) <= 18 * mib                     # [0, 20) MiB is the STORE's to fault
        pool.view(a).fill_(7)
        pool.commit([a])
        _, b = pool.reserve(0, b"b", 40 * mib, b"L", 1)               # past capacity - window: up to capacity
        _until(lambda: not pool.memory.ahead.thread.is_alive())
        assert pool.memory.populated == pool.capacity and _rss(pool) <= pool.capacity
        assert int(pool.view(a).sum()) == 7 * 20 * mib                # populating kept what was written
        pool.abort([b])
    finally:
        pool.release()


def test_a_registration_starts_populate_ahead_before_the_first_store():
    import time

    mib = 1 << 20
    pool = Pool(64 * mib, populate_ahead=16 * mib)
    try:
        time.sleep(0.2)
        assert pool.memory.populated == 0 and _rss(pool) == 0                # a server that never stores: nothing
        pool.expect_stores()                                          # what a KV registration calls
        _until(lambda: pool.memory.populated >= 16 * mib)
        time.sleep(0.2)
        assert pool.memory.populated == 16 * mib and 16 * mib <= _rss(pool) <= 18 * mib
    finally:
        pool.release()


def test_release_stops_populate_ahead_and_a_dropped_pool_is_unmapped():
    import gc

    pool = Pool(1 << 30, populate_ahead=1 << 30)                      # far more than it populates at once
    addr = pool.memory.addr
    pool.release()                                                    # joins the thread between steps
    assert pool.memory.populated < pool.capacity and not pool.memory.ahead.thread.is_alive()
    assert _smaps_entry(addr) == {}                                   # unmapped
    dropped = Pool(1 << 30, populate_ahead=1 << 30)
    thread, addr = dropped.memory.ahead.thread, dropped.memory.addr
    del dropped
    gc.collect()
    thread.join(10)
    assert not thread.is_alive() and _smaps_entry(addr) == {}


def test_a_pool_without_populate_ahead_touches_no_page_until_a_store_does():
    import threading
    import time

    pool = Pool(64 << 20)
    try:
        _, obj = pool.reserve(0, b"a", 8 << 20, b"L", 1)
        time.sleep(0.1)
        assert pool.memory.ahead is None and pool.memory.populated == 0 and _rss(pool) == 0
        assert not any(t.name == "lmshm-pool-populate" for t in threading.enumerate())
        pool.abort([obj])
    finally:
        pool.release()


def test_populate_ahead_gives_up_quietly_where_the_kernel_lacks_populate_write(monkeypatch, caplog):
    import logging

    import lmshm.core.pool.memory as memory_module

    monkeypatch.setattr(memory_module, "_MADV_POPULATE_WRITE", 0x7FFF)   # an advice no kernel knows: EINVAL
    with caplog.at_level(logging.INFO, logger="lmshm.core.pool.memory"):
        pool = Pool(64 << 20, populate_ahead=16 << 20)
        try:
            assert stored(pool, 0, b"still stores", 1 << 20)[OFFSET] == 0      # the first STORE starts it
            pool.memory.ahead.thread.join(10)
            assert not pool.memory.ahead.thread.is_alive() and pool.memory.ahead.populated == 0
            assert _rss(pool) <= 2 << 20                                # the STORE's own page(s) only
        finally:
            pool.release()
    assert [r.levelname for r in caplog.records if "populated ahead" in r.getMessage()] == ["INFO"]
