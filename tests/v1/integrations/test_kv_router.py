"""The reference KV-aware router (examples/kv_router.py): its routing decisions from KV-event
batches built with ``lmshm.core.kv_events.encode_batch`` (map-tagged events, vLLM >= PR #42892)
or by hand in the older array form, and over a real ZMQ PUB socket. No engine: the router's
view of a real engine's stream is what ``bench/kv_routing.py`` waits on before each request."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import msgspec
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from kv_router import Router

from lmshm.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch

BS = 4
P = list(range(100, 124))          # 6 blocks
Q = list(range(200, 224))


def stored(hashes, parent, tokens, medium="CPU", block_size=BS, **kw) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens),
                       block_size=block_size, lora_id=None, medium=medium, lora_name=None, **kw)


def chain(prefix: str, tokens: list[int], blocks: int, first: int = 0, medium: str = "CPU") -> BlockStored:
    """One event for blocks ``first .. first + blocks`` of ``tokens``, hashed ``prefix + index``
    (an engine's hashes are opaque to the router: any value, chained by parent)."""
    hashes = [f"{prefix}{i}" for i in range(first, first + blocks)]
    parent = f"{prefix}{first - 1}" if first else None
    return stored(hashes, parent, tokens[first * BS:(first + blocks) * BS], medium)


class Feed:
    """Batches for one host, numbered in order."""

    def __init__(self, router: Router, host: str) -> None:
        self.router, self.host, self.seq = router, host, 0

    def send(self, *events, payload: bytes | None = None) -> None:
        self.router.apply(self.host, self.seq, payload if payload is not None else encode_batch(list(events)))
        self.seq += 1


def router_ab():
    r = Router(BS, ["a", "b"])
    return r, Feed(r, "a"), Feed(r, "b")


def test_a_request_goes_to_the_host_with_the_longest_cached_prefix():
    r, a, b = router_ab()
    a.send(chain("pa", P, 2), chain("pa", P, 3, first=2))     # a: 5 blocks of P, in two events
    b.send(chain("pb", P, 2), chain("qb", Q, 6))             # b: 2 blocks of P, all of Q
    assert r.match(P + [1, 2, 3]) == {"a": 5, "b": 2}
    assert r.route(P + [1, 2, 3]) == ("a", 5)
    assert r.route(Q) == ("b", 6)
    # same tokens in another order are another prefix: nobody holds it
    assert r.match(P[4:8] + P[:4]) == {"a": 0, "b": 0}
    # the chain is by tokens, not by the engines' hashes: a and b agree on P's first blocks
    assert r.match(P[:8]) == {"a": 2, "b": 2}


def test_ties_go_to_the_host_given_fewer_requests_then_in_turn():
    r, a, b = router_ab()
    assert [r.route([9] * 8)[0] for _ in range(4)] == ["a", "b", "a", "b"]
    a.send(chain("pa", P, 6))
    assert r.route(P)[0] == "a" and r.route(P)[0] == "a"        # a: 4 routed, b: 2
    assert r.route(Q)[0] == "b"                                   # a tie (0 blocks): fewer requests
    assert [r.round_robin() for _ in range(3)] == ["a", "b", "a"]


def test_a_removed_block_ends_the_prefix_there_and_only_its_last_medium_removes_it():
    r, a, b = router_ab()
    a.send(chain("pa", P, 6), chain("pa", P, 6, medium="STORAGE"))
    b.send(chain("pb", P, 3))
    a.send(BlockRemoved(block_hashes=["pa1"], medium="CPU"))
    assert r.match(P)["a"] == 6                                   # still on a's disk
    a.send(BlockRemoved(block_hashes=["pa1"], medium="STORAGE"))
    assert r.match(P) == {"a": 1, "b": 3}
    assert r.route(P) == ("b", 3)
    assert r.held("a") == 5
    # a block stored while its parent is gone still chains (the parent's digest stays known),
    # and counts once the parent comes back
    a.send(BlockRemoved(block_hashes=["pa2"], medium="CPU"), BlockRemoved(block_hashes=["pa2"], medium="STORAGE"))
    a.send(chain("pa", P, 1, first=2))
    assert r.match(P)["a"] == 1 and r.stats["orphans"] == 0
    a.send(chain("pa", P, 1, first=1))
    assert r.match(P)["a"] == 6


def test_all_blocks_cleared_forgets_that_host_only():
    r, a, b = router_ab()
    a.send(chain("pa", P, 6))
    b.send(chain("pb", P, 2))
    a.send(AllBlocksCleared())
    assert r.match(P) == {"a": 0, "b": 2} and r.held("a") == 0
    assert r.stats["clears"] == 1


def test_a_sequence_gap_or_a_restarted_publisher_forgets_the_host():
    r, a, b = router_ab()
    a.send(chain("pa", P, 6))
    a.seq += 1                                                    # batch 1 never arrived
    a.send(chain("qa", Q, 2))
    assert r.match(P)["a"] == 0 and r.match(Q)["a"] == 2         # what came after the gap counts
    assert r.stats["gaps"] == 1
    a.seq = 0                                                     # the publisher restarted
    a.send(chain("pa", P, 1))
    assert r.match(Q)["a"] == 0 and r.match(P)["a"] == 1
    assert r.stats["gaps"] == 2


def test_blocks_with_unknown_parents_or_another_block_size_are_skipped():
    r, a, _ = router_ab()
    a.send(chain("pa", P, 2, first=2))                            # its parent pa1 was never seen
    assert r.match(P)["a"] == 0 and r.stats["orphans"] == 1
    a.send(stored(["x0"], None, P[:8], block_size=8))
    assert r.match(P)["a"] == 0 and r.stats["skipped"] == 1
    # extra keys (a LoRA, a cache salt) make another prefix: a plain request does not match it
    a.send(stored(["s0", "s1"], None, P[:8], extra_keys=[["salt"], None]))
    assert r.match(P)["a"] == 0


def test_array_form_events_and_bytes_or_int_hashes_route_alike():
    r, a, b = router_ab()
    h = [bytes([i]) * 32 for i in range(6)]
    # vLLM before PR #42892: each event a positional array whose first item is its tag
    old = msgspec.msgpack.encode([time.time(), [
        ["BlockStored", h[:3], None, P[:12], BS, None, "CPU", None],
        ["BlockStored", h[3:], h[2], P[12:], BS, None, "CPU", None],
        ["BlockRemoved", [h[5]], "CPU"],
    ]])
    a.send(payload=old)
    b.send(stored([2**63 + 5, -7], None, P[:8]), stored([11], -7, P[8:12]))
    assert r.match(P) == {"a": 5, "b": 3}
    assert r.stats["bad"] == 0
    a.send(payload=b"\xc1 not msgpack")
    assert r.stats["bad"] == 1 and r.match(P)["a"] == 5


def test_the_router_follows_each_hosts_zmq_stream():
    with tempfile.TemporaryDirectory(prefix="lmshm-kvr-t-") as d:
        ctx = zmq.Context()
        pubs = {}
        for name in ("a", "b"):
            pubs[name] = ctx.socket(zmq.PUB)
            pubs[name].setsockopt(zmq.LINGER, 0)
            pubs[name].bind(f"ipc://{d}/{name}")
        r = Router(BS, {name: f"ipc://{d}/{name}" for name in pubs})
        try:
            # the SUB may join late (ZMQ drops what a PUB sends before): resend batch 0 until seen
            deadline = time.monotonic() + 5
            while r.match(P)["b"] < 6 and time.monotonic() < deadline:
                pubs["b"].send_multipart([b"kv@host-b@tiny", (0).to_bytes(8, "big"), encode_batch([chain("pb", P, 6)])])
                time.sleep(0.02)
            pubs["b"].send_multipart([b"kv@host-b@tiny", (1).to_bytes(8, "big"),
                                      encode_batch([BlockRemoved(block_hashes=["pb4"], medium="CPU")])])
            deadline = time.monotonic() + 5
            while r.match(P)["b"] != 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert r.match(P) == {"a": 0, "b": 4}           # credited to the stream that carried it
            assert r.route(P) == ("b", 4)
        finally:
            r.close()
            for sock in pubs.values():
                sock.close()
            ctx.term()
