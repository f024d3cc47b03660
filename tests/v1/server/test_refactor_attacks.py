"""Issue 43's attack round: a hostile tenant against the refactored request-to-reply path.

Since issue 43 the data plane queues its own copies and answers through a reply callback; the
ZeroMQ endpoint keeps each queued request's arrival (``_deferred_t0``) until its answer comes
back, and observes the request-latency metric then. These tests send what an honest client
never does (many queued requests under one request id; a session that vanishes with copies and
leases queued) and check that every request is answered and counted once, that the in-flight
table (``lmshm_zmq_requests_queued``) drains, and that nothing is left behind in the pool.
"""

from __future__ import annotations

import re
import urllib.request

from attacks import free_port
from harness import (
    OwnSegments,
    RawSession,
    assert_back_to,
    server_counts,
    shm_wrapper,
    wait_for,
)

from lmshm.transport.client import query_status
from lmshm.wire import codec, protocol

SEGMENT_BYTES = 1 << 20          # float16 elements, block_dim 0: 524,288 one-element blocks


def _metrics(port: int) -> dict[str, float]:
    """The samples of ``/metrics`` this file reads: ``name{labels}`` -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(lmshm_[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def _zmq_count(samples: dict[str, float], family: str, request: str) -> float:
    """Sum of a family's zmq samples for ``request`` over every code."""
    return sum(v for k, v in samples.items()
               if k.startswith(family + "{") and 'endpoint="zmq"' in k and f'request="{request}"' in k)


def _registered(session: RawSession, segments: OwnSegments, iid: str) -> None:
    reply = session.register(iid, shm_wrapper(segments(SEGMENT_BYTES).name, SEGMENT_BYTES))
    assert isinstance(reply, protocol.RegisterReply), reply


def test_queued_requests_under_one_request_id_are_each_answered_and_counted_once(start_server):
    """A peer may reuse a request id while a copy under it is queued: each request is still
    answered, and observed once in ``lmshm_requests_total`` and the latency histogram (before
    the fix, later ones overwrote the earlier one's arrival and all but one went uncounted)."""
    port = free_port()
    server = start_server("--http-port", str(port), "--capacity", "64MiB")
    segments = OwnSegments()
    n = 64
    try:
        with RawSession(server.url, timeout_s=30) as s:
            _registered(s, segments, "dup-rid")
            before = _metrics(port)
            rid = b"\x00" * 7 + b"\x2a"
            for i in range(n):      # all sent before one reply is read, all under one id
                req = (protocol.Store("dup-rid", [b"k%d" % i], [i * 16 + b for b in range(16)], 16) if i % 2 else
                       protocol.Retrieve("dup-rid", [b"absent%d" % i], list(range(16)), 16))
                s.sock.send_multipart([rid, codec.encode(req)])
            replies = []
            for _ in range(n):
                assert s.sock.poll(30_000), f"only {len(replies)} of {n} requests were answered"
                frames = s.sock.recv_multipart()
                assert frames[0] == rid
                replies.append(codec.decode_reply(frames[1]))
            assert sum(isinstance(r, protocol.StoreReply) for r in replies) == n // 2
            assert sum(isinstance(r, protocol.ErrorReply) and r.code == protocol.ErrorCode.NOT_FOUND
                       for r in replies) == n // 2
            after = _metrics(port)
            for request in ("Store", "Retrieve"):
                assert _zmq_count(after, "lmshm_requests_total", request) - \
                    _zmq_count(before, "lmshm_requests_total", request) == n // 2, request
                assert _zmq_count(after, "lmshm_request_seconds_count", request) - \
                    _zmq_count(before, "lmshm_request_seconds_count", request) == n // 2, request
            assert after["lmshm_zmq_requests_queued"] == 0
            s.unregister("dup-rid")
    finally:
        segments.unlink_all()


def test_a_session_that_vanishes_with_copies_and_leases_queued_leaves_nothing_behind(start_server):
    """A verified session floods STORE, RETRIEVE and LOOKUP, makes sure the server took every
    one (a PING after them is answered in order), then closes its link and socket without
    reading a reply. Every queued request is still answered (to nobody) and counted, the
    in-flight table drains, and the pool keeps no pin, lease or half-copied object."""
    port = free_port()
    server = start_server("--http-port", str(port), "--capacity", "64MiB", "--max-inflight-per-session", "256")
    segments = OwnSegments()
    base = server_counts(server.url)
    before = _metrics(port)
    n = 240
    try:
        s = RawSession(server.url, timeout_s=30)
        _registered(s, segments, "vanish")
        assert isinstance(s.request(protocol.Store("vanish", [b"hot"], list(range(16)), 16)), protocol.StoreReply)
        sent = {"Store": 1, "Retrieve": 0, "Lookup": 0}
        for i in range(n):
            kind = ("Store", "Retrieve", "Lookup")[i % 3]
            req = (protocol.Store("vanish", [b"v%d" % i], [(i * 64 + b) % 65536 for b in range(64)], 64)
                   if kind == "Store" else
                   protocol.Retrieve("vanish", [b"hot"], [(i * 16 + b) % 65536 for b in range(16)], 16)
                   if kind == "Retrieve" else protocol.Lookup([[b"hot"]]))
            s.sock.send_multipart([(1000 + i).to_bytes(8, "big"), codec.encode(req)])
            sent[kind] += 1
        s.sock.send_multipart([(999).to_bytes(8, "big"), codec.encode(protocol.Ping())])
        while True:          # the PING's answer: every request before it was dispatched
            assert s.sock.poll(30_000), "the server did not answer the PING after the flood"
            frames = s.sock.recv_multipart()
            if frames[0] == (999).to_bytes(8, "big"):
                break
        s.close()            # link and socket gone, the replies still queued or in flight unread

        def drained() -> bool:
            now = _metrics(port)
            pool = query_status(server.url).pool
            return (now["lmshm_zmq_requests_queued"] == 0 and pool.in_flight == 0 and pool.pinned == 0
                    and pool.leases == 0 and now["lmshm_sessions"] == base["sessions"])

        wait_for(drained, 20, 0.05, "the vanished session's requests to be answered and its pins to go")
        after = _metrics(port)
        for request, count in sent.items():
            assert _zmq_count(after, "lmshm_requests_total", request) - \
                _zmq_count(before, "lmshm_requests_total", request) == count, (request, after)
        assert_back_to(server.url, base, fd_slack=2)
        assert server.alive
    finally:
        segments.unlink_all()
