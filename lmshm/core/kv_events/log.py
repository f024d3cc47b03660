"""The event log: a bounded ring of ``Record``s that readers follow with their own cursor.

The index (``KvIndex``) appends; three kinds of reader read: the node stream's publisher (every
record, ``read(..., node=True)``), a connector's ``KV_EVENTS`` (its uid's and spaces' records,
``NODE`` ones left out) and the replay. Each record says whose it is (``uid``, ``space``) and
who it is for (``scope``). Besides the ring, each uid's records and each (uid, space)'s are kept
in order (``_Run``), so a uid's read costs what it returns, and another tenant's flood never
trims a reader's own records (they stay, up to a quarter of the bounds, ``RUN_SHARE``).

Bounded in records and in bytes (``event_bytes``); records the publisher has not read stay up
to twice the bounds, and a uid with much of that backlog is not advertised (``lagging``).

The one trap: the locks are taken in one order, the index's and then the log's (the index
appends a drained batch under its own lock). So ``before_read`` (the index's ``drain``) runs
before a read takes the log's lock, and nothing under the log's lock may call into the index.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import threading
from collections import OrderedDict, deque
from typing import Any, Callable, Iterable, Optional

import msgspec

from lmshm.core.kv_events.adverts import text_bytes
from lmshm.core.kv_events.format import BlockRemoved, BlockStored, KvEvent, token_tuple

#: ``Record.scope``: who a record is for. ``BOTH``: the owner's feed (KV_EVENTS of its uid and
#: space, its engines' topics) and the node's (the publisher's node topics). ``OWNER``: the
#: owner's only (its chunk left a tier, but another chunk advertising those blocks in the same
#: model and group is still servable from it: the node still holds them). ``NODE``: the node's
#: only (the part of an ``OWNER`` removal whose blocks no other chunk still serves).
BOTH, OWNER, NODE = 0, 1, 2


class PackedStored(msgspec.Struct, gc=False):
    """A ``BlockStored`` kept packed: its chunk's own hashes, tokens (4 bytes a token) and extra
    keys, shared with the index while the chunk is indexed, never its token keys or maps (what a
    record keeps alive is what ``event_bytes`` charges it); the event is built when a reader
    asks for it (``Record.event``)."""

    hashes: tuple
    parent: Any
    tokens: bytes
    block_size: int
    lora: Optional[str]
    extra: Optional[tuple]
    group: int
    medium: str
    locality: str
    xheld: int = 0          # what ``extra`` holds decoded (``_held_bytes``): what event_bytes charges for it

    def build(self) -> BlockStored:
        # tuples, not lists (they encode alike): a tuple of ints or bytes leaves the cyclic
        # GC's care at its first collection, where a list stays
        return BlockStored(self.hashes, self.parent, token_tuple(self.tokens), self.block_size, None, self.medium,
                           self.lora, self.extra, self.group, None, None, self.locality)


class Record(msgspec.Struct, frozen=True, gc=False):
    """One entry of the event log: an event (or an engine seen for the first time: ``pod``),
    whose it is (``uid``, ``space``, ``model``) and who it is for (``scope``: ``BOTH``,
    ``OWNER`` or ``NODE``, see above). ``pod`` with ``ev`` None: an engine attached to
    (uid, space), or with ``detach`` left it (its uid had ``MAX_PODS_PER_UID`` newer ones, or
    the namespace has no chunk left). Readers of the owner's feed (``EventLog.read`` with a
    ``uid``) never get ``NODE`` records; the node stream must skip ``OWNER`` records on node
    topics (and may use them, not ``NODE`` ones, on a uid's engine topics). ``event`` builds a
    ``BlockStored`` from its packed form on each call (``ev``); ``size``: what ``event_bytes``
    says the event encodes to, what the log's byte bound counts."""

    n: int                   # position in the log, from 1
    uid: int
    space: bytes
    model: str
    ev: Any                  # a KvEvent, a PackedStored, or None (attach records)
    pod: str = ""            # attach records: an engine that advertises into (uid, space)
    scope: int = BOTH
    size: int = 0
    detach: bool = False     # with ``pod``: that engine is gone from (uid, space) (its topic may go)

    @property
    def event(self) -> Optional[KvEvent]:
        ev = self.ev
        return ev.build() if type(ev) is PackedStored else ev


class _Run:
    """One reader key's records (a uid's, or a uid's in one space), oldest first, from ``head``
    on (the ones before it left the ring): a read finds its start by bisection."""

    __slots__ = ("records", "head", "bytes")

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.head = 0
        self.bytes = 0          # the sizes of its records from head on

    def drop_first(self) -> None:
        self.bytes -= self.records[self.head].size
        self.head += 1
        if self.head >= 64 and self.head * 2 >= len(self.records):
            del self.records[:self.head]
            self.head = 0

    def __len__(self) -> int:
        return len(self.records) - self.head

    def after(self, n: int) -> int:
        return bisect.bisect_right(self.records, n, lo=self.head, key=_record_n)


def _record_n(r: Record) -> int:
    return r.n


class EventLog:
    """A bounded ring of ``Record``s (``records`` of them and ``max_bytes`` of events, as
    ``event_bytes`` counts them, at most); readers keep their own cursor (``n`` of the last
    read). ``before_read`` (given by the ``KvIndex`` that owns the log) runs before each read: the
    index applies what it has queued, so a reader sees every STORE answered before it.

    Besides the ring, each uid's records and each (uid, space)'s are kept in order (``_Run``):
    a reader of its own uid's spaces finds where to start by bisection and visits only its own
    records, so a read costs what it returns, not the ring's length."""

    def __init__(self, records: int = 65536, max_bytes: Optional[int] = None, *,
                 before_read: Optional[Callable[[Optional[int]], Any]] = None) -> None:
        self.capacity = max(16, records)
        self.max_bytes = max_bytes if max_bytes is not None else max(LOG_BYTES, LOG_BYTES_PER_RECORD * self.capacity)
        self._ring: deque[Record] = deque()
        self._runs: dict[Any, _Run] = {}        # uid -> its run, (uid, space) -> its run
        # uid -> n of its newest record trimmed (per uid, not per space: a tenant makes spaces,
        # never uids; MAX_GONE kept, then the floor)
        self._gone: OrderedDict[Any, int] = OrderedDict()
        self._gone_floor = 0
        # each uid's records stay readable by its own feed, past the ring, while they are at
        # most a quarter of its bounds (``_trim_run``)
        self.run_records = max(16, self.capacity // RUN_SHARE)
        self.run_bytes = self.max_bytes // RUN_SHARE
        self._owners: set[int] = set()         # uids whose runs extend touched (under the lock)
        self._lock = threading.Lock()
        self._next = 1
        self.bytes = 0            # event_bytes of the records in the ring
        self.trimmed = 0          # records dropped from the ring's old end
        self.epoch = ""           # set by the owner: a new value means the log started over
        self.before_read = before_read
        # the node stream's reader (``read(..., node=True)``: the publisher): n of its cursor,
        # and the bytes of records after it, in all and per uid. Records it has not read stay
        # past the bounds, up to twice them; a uid with more than an eighth of the ring unread
        # while it lags a quarter gets no new adverts applied (``lagging``)
        self.node_at: Optional[int] = None
        self.node_unread = 0
        self._unread: dict[int, int] = {}

    def append(self, uid: int, space: bytes, model: str, event: Optional[KvEvent], pod: str = "") -> None:
        self.extend(((uid, space, model, event, pod),))

    def extend(self, entries: Iterable[tuple]) -> None:
        """Append ``(uid, space, model, event, pod[, scope[, detach]])`` tuples in order
        (``event`` a ``KvEvent``, a ``PackedStored`` or None), under one hold of the lock."""
        with self._lock:
            ring, runs, n = self._ring, self._runs, self._next
            owners = self._owners
            for entry in entries:
                uid, space, model, ev, pod = entry[:5]
                scope = entry[5] if len(entry) > 5 else BOTH
                size = event_bytes(ev)
                r = Record(n, uid, space, model, ev, pod, scope, size, len(entry) > 6 and entry[6])
                ring.append(r)
                self.bytes += size
                if self.node_at is not None:
                    self.node_unread += size
                    self._unread[uid] = self._unread.get(uid, 0) + size
                n += 1
                if scope != NODE and uid >= 0:          # the owner's feed: what KV_EVENTS reads
                    for k in (uid, (uid, space)):
                        run = runs.get(k)
                        if run is None:
                            run = runs[k] = _Run()
                        run.records.append(r)
                        run.bytes += size
                    owners.add(uid)
            self._next = n
            over = 0
            node_at = self.node_at
            while len(ring) > 1 and (len(ring) > self.capacity or self.bytes > self.max_bytes) and (
                    node_at is None or ring[0].n <= node_at
                    or len(ring) > 2 * self.capacity or self.bytes > 2 * self.max_bytes):
                r = ring.popleft()
                self.bytes -= r.size
                if node_at is not None and r.n > node_at:
                    self._read_by_node(r)
                if r.scope != NODE and r.uid >= 0:
                    owners.add(r.uid)
                over += 1
            self.trimmed += over
            for uid in owners:
                self._trim_run(uid)
            owners.clear()

    def _read_by_node(self, r: Record) -> None:
        self.node_unread -= r.size
        left = self._unread.get(r.uid, 0) - r.size
        if left > 0:
            self._unread[r.uid] = left
        else:
            self._unread.pop(r.uid, None)

    def lagging(self, uid: int) -> bool:
        """The node stream's reader is behind by more than a quarter of the ring's bytes, and
        more than an eighth of them are ``uid``'s: its new adverts are not applied (a tenant
        that produces events faster than the publisher sends them would otherwise push
        unsent records off the ring, and the node topics would start over with
        AllBlocksCleared for every tenant)."""
        return self.node_unread > self.max_bytes >> 2 and self._unread.get(uid, 0) > self.max_bytes >> 3

    def _trim_run(self, uid: int) -> None:
        """Drop ``uid``'s oldest records that left the ring while its run is past the uid's own
        bound (``run_records``, ``run_bytes``): a uid's records leave its feed only by its own
        records' doing, never another tenant's flood of the shared ring."""
        runs = self._runs
        run = runs.get(uid)
        if run is None:
            return
        first = self._ring[0].n if self._ring else self._next
        records = run.records
        dropped = 0
        while len(run) and records[run.head].n < first and (
                len(run) > self.run_records or run.bytes > self.run_bytes):
            r = records[run.head]
            run.drop_first()
            k = (uid, r.space)
            space_run = runs[k]
            space_run.drop_first()              # its head too: a space's run is a part of the uid's, in order
            if not len(space_run):
                del runs[k]
            dropped = r.n
        if not len(run):
            del runs[uid]
        if dropped:
            gone = self._gone
            gone[uid] = dropped
            gone.move_to_end(uid)
            while len(gone) > MAX_GONE:
                _, n = gone.popitem(last=False)
                self._gone_floor = max(self._gone_floor, n)

    @property
    def last(self) -> int:
        return self._next - 1

    @property
    def oldest(self) -> int:
        with self._lock:
            return self._ring[0].n if self._ring else self._next

    def read(self, after: int, limit: int, uid: Optional[int] = None, spaces: Optional[Iterable[bytes]] = None,
             max_bytes: int = 1 << 62, apply: Optional[int] = None, node: bool = False
             ) -> tuple[list[Record], int, bool]:
        """``(records, cursor, lost)``: up to ``limit`` records after ``after`` (of ``uid`` and
        ``spaces``, if given: the owner's feed, ``NODE`` records left out), the cursor to read
        from next, and whether records the reader had not read were dropped from the ring
        (``after`` below the oldest one kept; for a uid's read, one of *its uid's* records, which
        its feed keeps past the ring up to a quarter of it: another tenant's flood of records
        never makes a reader of its own feed start over). ``after`` -1: from the oldest kept,
        nothing lost. ``node``: this is the node stream's reader (the publisher): records after
        its cursor stay past the bounds, up to twice them (``lagging``).
        ``max_bytes`` bounds the events' encoded size (roughly; at least one record is
        returned). ``apply``: how much of the index's queue ``before_read`` applies first (None:
        all; ``KvIndex.drain``)."""
        if self.before_read is not None:
            self.before_read(apply)
        with self._lock:
            ring = self._ring
            first = ring[0].n if ring else self._next
            if after < 0:
                after = first - 1
            lost = after + 1 < first
            if uid is None:
                out = self._scan(after, first, limit, max_bytes, lost)
                if node:
                    self._node_read(out[1])
                return out
            keys = [uid] if spaces is None else [(uid, s) for s in dict.fromkeys(spaces)]
            if lost:
                lost = after < max(self._gone_floor, self._gone.get(uid, 0))
            parts = []
            for k in keys:
                run = self._runs.get(k)
                if run is not None:
                    i = run.after(after)
                    if i < len(run.records):
                        parts.append(itertools.islice(run.records, i, None))
            source = parts[0] if len(parts) == 1 else heapq.merge(*parts, key=_record_n)
            out: list[Record] = []
            size = 0
            cursor = self._next - 1                 # all read, unless a bound stops it first
            for r in source:
                size += r.size
                if out and size > max_bytes:
                    cursor = out[-1].n
                    break
                out.append(r)
                if len(out) >= limit:
                    cursor = r.n
                    break
            return out, cursor, lost

    def release_node(self) -> None:
        """The node stream's reader stopped: the ring keeps its own bounds again."""
        with self._lock:
            self.node_at = None
            self.node_unread, self._unread = 0, {}

    def _node_read(self, cursor: int) -> None:
        """The node stream's reader read up to ``cursor``: the records it passed are read."""
        at = self.node_at
        self.node_at = cursor
        if at is None:                  # its first read: what it has not read yet, counted
            self.node_unread, self._unread = 0, {}
            for r in self._ring:
                if r.n > cursor:
                    self.node_unread += r.size
                    self._unread[r.uid] = self._unread.get(r.uid, 0) + r.size
            return
        ring = self._ring
        if not ring:
            return
        for i in range(max(0, at + 1 - ring[0].n), len(ring)):
            r = ring[i]
            if r.n > cursor:
                break
            self._read_by_node(r)

    def _scan(self, after: int, first: int, limit: int, max_bytes: int, lost: bool) -> tuple[list[Record], int, bool]:
        ring = self._ring
        out: list[Record] = []
        size = 0
        cursor = max(after, first - 1)
        for i in range(max(0, after + 1 - first), len(ring)):
            r = ring[i]
            cursor = r.n
            size += r.size
            if out and size > max_bytes:
                cursor = r.n - 1
                break
            out.append(r)
            if len(out) >= limit:
                break
        return out, min(cursor, self._next - 1), lost


def event_bytes(event: Any) -> int:
    """About how many bytes ``event`` (a ``KvEvent`` or its packed ``PackedStored`` form) encodes to
    (a bound for replies, buffers and the log)."""
    # a LoRA name counts as the string it is kept as (up to 16 KiB; its encoding is no more
    # than that, but for 3-byte characters)
    if type(event) is PackedStored:
        return 160 + 34 * len(event.hashes) + (5 * len(event.tokens) >> 2) \
            + max(64 * len(event.extra or ()), event.xheld) + text_bytes(event.lora)
    if isinstance(event, BlockStored):
        return 160 + 34 * len(event.block_hashes) + 5 * len(event.token_ids) + 64 * len(event.extra_keys or ()) \
            + text_bytes(event.lora_name)
    if isinstance(event, BlockRemoved):
        return 80 + 34 * len(event.block_hashes)
    return 32


#: A uid's records that left the ring stay in its own feed (``EventLog._trim_run``) while they
#: are at most 1/RUN_SHARE of the ring's records and bytes: another tenant's flood of the ring
#: never trims a reader's own unread records; the log holds at most the ring and, per uid that
#: has records, a quarter of it besides.
RUN_SHARE = 4
#: Uids whose newest trimmed record the log remembers (to tell a reader it lost one of its
#: uid's); a reader whose uid was forgotten is told it lost some if it is behind the newest
#: record forgotten so.
MAX_GONE = 1 << 16
#: The log's byte bound (``EventLog.max_bytes``): 1 KiB per record it may hold, at least 64 MiB
#: (a count alone would let a ring of the largest adverts' events hold gigabytes).
LOG_BYTES_PER_RECORD = 1024
LOG_BYTES = 64 << 20
