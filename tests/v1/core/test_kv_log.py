"""The KV event log in process (``lmshm.core.kv_events.log``): its bounds, who reads what, and
what a reader is told it lost. The index that feeds it: ``test_kv_index.py``; end to end through
a server: ``tests/v1/server/test_kv_events.py`` and ``test_kv_events_tenants.py``."""

from __future__ import annotations

from typing import Any, Optional

import msgspec
import pytest

from lmshm.core.kv_events import (
    BOTH,
    NODE,
    OWNER,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventLog,
    KvIndex,
    event_bytes,
    packed_tokens,
)
from lmshm.core.kv_events.log import PackedStored
from lmshm.wire.protocol import Advert

A, B = 1000, 1001
SPACE = b"S"
BIG = BlockRemoved(list(range(8000)), "CPU", 0, "LOCAL")        # about 272 KB of event_bytes each


def clears(log: EventLog, uid: int, n: int = 1, scope: int = BOTH, space: bytes = SPACE) -> None:
    """Append ``n`` ``AllBlocksCleared`` records of ``uid`` (the cheapest record there is)."""
    log.extend([(uid, space, "m", AllBlocksCleared(), "", scope) for _ in range(n)])


def bigs(log: EventLog, uid: int, n: int, space: bytes = SPACE) -> None:
    log.extend([(uid, space, "m", BIG, "") for _ in range(n)])


def test_the_event_log_trims_its_oldest_and_reports_the_loss_to_a_reader_behind():
    log = EventLog(records=16)
    for i in range(40):
        log.append(1, SPACE, "m", None, f"p{i}")
    records, cursor, lost = log.read(3, 100)
    assert lost and records[0].n == 25 and cursor == 40
    assert log.read(40, 100) == ([], 40, False)
    assert log.read(1 << 40, 100) == ([], 40, False)
    assert log.trimmed == 24
    # a batch at once (how the index appends a drained batch's records): numbered in order,
    # trimmed to the capacity in one go
    log.extend([(2, SPACE, "m", None, f"q{i}") for i in range(20)])
    records, cursor, lost = log.read(40, 100)
    assert lost and cursor == 60 and log.trimmed == 44 and log.oldest == 45
    assert [(r.n, r.uid, r.pod) for r in records] == [(45 + i, 2, f"q{i + 4}") for i in range(16)]


def test_a_read_of_one_uid_visits_only_its_own_records(monkeypatch):
    log = EventLog(records=1 << 16)
    clears(log, B, 50_000)
    clears(log, A, 3)

    def scanned(*_: Any) -> Any:
        raise AssertionError("a uid's read walked the ring")
    monkeypatch.setattr(EventLog, "_scan", scanned)
    records, cursor, lost = log.read(-1, 100, uid=A, spaces=[SPACE])
    assert [r.n for r in records] == [50_001, 50_002, 50_003] and cursor == 50_003 and not lost
    assert log.read(cursor, 100, uid=A, spaces=[SPACE]) == ([], 50_003, False)
    assert log.read(-1, 100, uid=7, spaces=[SPACE]) == ([], 50_003, False)
    records, cursor, _ = log.read(50_001, 1, uid=A)                 # a limit: the cursor stops at it
    assert [r.n for r in records] == [50_002] and cursor == 50_002


@pytest.mark.parametrize("scope", [BOTH, OWNER, NODE])
def test_a_uid_read_never_gets_node_only_records(scope):
    log = EventLog(records=64)
    clears(log, A, scope=scope)
    got, _, _ = log.read(-1, 10, uid=A, spaces=[SPACE])
    assert len(got) == (0 if scope == NODE else 1)


def test_another_uids_flood_of_records_never_tells_a_reader_it_lost_its_own():
    log = EventLog(records=64)
    clears(log, A)
    records, cursor, lost = log.read(-1, 10, uid=A, spaces=[SPACE])
    assert len(records) == 1 and not lost
    clears(log, B, 1000)                                     # B's flood
    clears(log, A)
    records, cursor2, lost = log.read(cursor, 10, uid=A, spaces=[SPACE])
    assert [r.n for r in records] == [1002] and not lost
    clears(log, A, 100)                                      # A's own, trimmed
    assert log.read(cursor2, 10, uid=A, spaces=[SPACE])[2]
    assert log.read(cursor2, 10)[2]                          # the node stream: the ring's own loss


def test_another_uids_flood_of_records_never_trims_a_readers_own_unread_records():
    """B's records push A's *unread* ones off the shared ring (by count, or cheaper by bytes:
    about 160 BlockStored of the wire's largest adverts fill a 64 MiB ring): A's read said
    ``lost`` (its connector then sends a BlockRemoved for every block it advertised). A uid's
    records now stay readable by its own feed until its own records pass its bound."""
    log = EventLog(records=64, max_bytes=1 << 20)
    clears(log, A)
    _, cursor, _ = log.read(-1, 10, uid=A, spaces=[SPACE])
    a_new = BlockRemoved([1, 2], "CPU", 0, "LOCAL")
    log.extend([(A, SPACE, "m", a_new, "")])                     # A's, not read yet (A is idle)
    clears(log, B, 1000)                                         # by count
    records, cursor2, lost = log.read(cursor, 10, uid=A, spaces=[SPACE])
    assert [r.event for r in records] == [a_new] and not lost
    log.extend([(A, SPACE, "m", a_new, "")])
    bigs(log, B, 10, space=b"other")                             # by bytes
    records, _, lost = log.read(cursor2, 10, uid=A)
    assert [r.event for r in records] == [a_new] and not lost
    assert log.read(cursor2, 10)[2]                          # the node stream: the ring's own loss
    assert len(log._runs[B]) <= 64 // 4 + len(log._ring)       # past the ring, B keeps its own bound only


def test_the_log_is_bounded_in_bytes_and_keeps_tokens_packed():
    kv = KvIndex(records=1 << 16, log_bytes=4 << 20)
    for i in range(40):
        advert = Advert(b"big-%d" % i, 0, 64, [(i << 20) + j for j in range(1024)], None, list(range(1024 * 64)))
        kv.describe(B, SPACE, "m", "", 0, 1, [b"big-%d" % i], [advert])
        kv.note(B, b"big-%d" % i, "pool", True)
    kv.drain()
    assert kv.log.bytes <= 4 << 20 and kv.log.trimmed > 0
    records, _, _ = kv.log.read(-1, 1 << 20)
    stored = [r for r in records if type(r.ev) is PackedStored]
    assert stored and isinstance(stored[-1].ev.tokens, bytes)         # packed until read
    assert list(stored[-1].event.token_ids) == list(range(1024 * 64))


def test_records_the_node_stream_has_not_read_stay_up_to_twice_the_bounds_until_it_stops_reading():
    log = EventLog(records=64, max_bytes=1 << 20)
    log.read(-1, 10, node=True)                              # the publisher, caught up
    bigs(log, B, 6)                                          # 1.6 MiB, none of it read
    assert log.trimmed == 0 and log.node_unread == log.bytes > 1 << 20
    log.read(-1, 4, node=True)                               # it reads the first 4
    assert log.node_unread == 2 * event_bytes(BIG)
    bigs(log, B, 2)                                          # past twice the bound: the read ones go
    assert log.trimmed == 4 and log.bytes > 1 << 20
    log.release_node()                                       # it stopped: the ring's own bounds again
    clears(log, A)
    assert log.trimmed == 5 and log.bytes <= 1 << 20 and not log.lagging(B)


def test_before_read_runs_before_every_read_with_what_it_may_apply():
    applied: list[Optional[int]] = []
    log = EventLog(records=64, before_read=applied.append)
    clears(log, A, 3)
    log.read(-1, 10, apply=50)
    log.read(-1, 10, uid=A)
    log.read(-1, 10, node=True)
    assert applied == [50, None, None]


def test_a_bounded_read_returns_at_least_one_record_and_its_cursor_stops_where_it_stopped():
    log = EventLog(records=64, max_bytes=64 << 20)
    bigs(log, A, 3)
    for uid in (None, A):
        records, cursor, _ = log.read(-1, 10, uid=uid, max_bytes=1)
        assert [r.n for r in records] == [1] and cursor == 1
        records, cursor, _ = log.read(-1, 10, uid=uid, max_bytes=2 * event_bytes(BIG))
        assert [r.n for r in records] == [1, 2] and cursor == 2


def stored_event(tokens: list[int], lora: Optional[str] = None) -> BlockStored:
    return BlockStored([1 << 40, b"\xff" * 32], None, tokens, len(tokens) // 2, None, "CPU", lora, [["salt"], None],
                       0, None, None, "LOCAL")


@pytest.mark.parametrize("lora", [None, "adapter-\U0001F600" * 100])
def test_event_bytes_is_at_least_what_an_event_encodes_to_packed_or_not(lora):
    tokens = [(1 << 31) - 1, -(1 << 31)] * 2048          # 5 bytes each encoded: the most an int32 takes
    event = stored_event(tokens, lora)
    packed = PackedStored(tuple(event.block_hashes), None, packed_tokens(tokens), event.block_size, lora,
                          (("salt",), None), 0, "CPU", "LOCAL")
    assert msgspec.msgpack.encode(packed.build()) == msgspec.msgpack.encode(event)
    for ev in (event, packed, BlockRemoved(event.block_hashes, "CPU", 0, "LOCAL"), AllBlocksCleared()):
        built = ev.build() if isinstance(ev, PackedStored) else ev
        assert event_bytes(ev) >= len(msgspec.msgpack.encode(built)), type(ev).__name__
