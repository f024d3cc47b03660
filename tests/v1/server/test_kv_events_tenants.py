"""Two uids, one server: nothing uid B advertises may remove, hide or replace what uid A's
resident chunks advertise (issue 41, round 4, §2). A is this process (root); B is a new
interpreter that switches to uid ``nobody`` and talks to the server over its own connection, so the
server sees two kernel-verified uids. Every check reads what a router reads: ``POST
/v1/kv/lookup`` and the ``--kv-events`` node stream (its replay).

The index's semantics in process: ``tests/v1/core/test_kv_index.py``."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import subprocess
import sys
from typing import Any

import msgspec
import pytest
import torch
from attacks import free_port
from harness import wait_for
from test_kv_events_stream import _replay, _rss
from test_kv_lookup_http import BLOCK, Http, advert, chain, chain_tokens, hashes_of, tokens_of

from lmshm.core.kv_events import decode_batch
from lmshm.transport.client import MPClient
from lmshm.wire import protocol

NOBODY = 65534
SPACE = b"namespace-S"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs a second client as uid nobody: needs root")


class Tenant:
    """An MPClient with one CPU KV cache of 16 blocks (``width`` floats a layer row) that STOREs
    chunks with adverts, the keys its own."""

    def __init__(self, url: str, name: str, width: int = 64) -> None:
        self.kv = torch.zeros(16, 4, width)
        self.client = MPClient(url, client_name=f"kv-tenant-{name}", timeout_s=10)
        self.iid = self.client.register_kv_caches({"l0": self.kv}, f"w-{name}", model_name="m")
        self.name = name
        self.url = url

    def keys(self, first: int, n: int) -> list[bytes]:
        return [hashlib.sha256(b"%s-%d" % (self.name.encode(), first + i)).digest() for i in range(n)]

    def store(self, first: int, adverts: list[protocol.Advert]) -> list[int]:
        reply = self.client.store(self.iid, self.keys(first, len(adverts)), [(first + i) % 16 for i in range(len(adverts))],
                                  1, adverts=adverts, space=SPACE, pod="pod-" + self.name)
        return list(reply.results)

    def store_nothing(self, first: int, adverts: list[protocol.Advert]) -> Any:
        """A STORE whose sender stopped waiting before its copy could run (``wait_s`` 1 µs): it
        is answered UNAVAILABLE and stores nothing, but its adverts were queued."""
        msg = protocol.Store(self.iid, self.keys(first, len(adverts)), [(first + i) % 16 for i in range(len(adverts))],
                             1, b"", wait_s=1e-6, adverts=protocol.pack_adverts(adverts), space=SPACE, pod="pod-x")
        try:
            return self.client.submit(msg, 10).result()
        except Exception as exc:
            return repr(exc)

    def close(self) -> None:
        self.client.close()
        del self.kv
        gc.collect()


def as_nobody(url: str, work: str, *args: Any, width: int = 64, timeout_s: float = 120) -> Any:
    """Run ``work(its Tenant, *args)`` (a function of this module, by name) in a new interpreter
    that imports what it needs as root, then switches to uid nobody; its result (JSON).

    A new interpreter, not a fork of this one: a fork of a process with other threads (a
    client's, an earlier test's) can inherit a lock held, and hang."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = ("import json, os, sys; sys.path[:0] = %r; import test_kv_events_tenants as t; "
            "print(json.dumps(t._child(*json.loads(sys.argv[1]))))" % [here, os.path.dirname(here)])
    done = subprocess.run([sys.executable, "-c", code, json.dumps([url, work, width, list(args)])],
                          capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "error" not in out, out
    return out["result"]


def _child(url: str, work: str, width: int, args: list) -> dict:
    try:
        import encodings.idna  # noqa: F401 - urllib's, imported lazily: after setuid it could not be read
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        b = Tenant(url, "b", width)
        try:
            return {"result": globals()[work](b, *args)}
        finally:
            b.close()
    except BaseException as exc:
        return {"error": repr(exc)}


def serve(start_server, *args: str) -> tuple[Any, Http, str]:
    http_port, pub_port, replay_port = free_port(), free_port(), free_port()
    server = start_server("--capacity", "64MiB", "--http-port", str(http_port), "--allow-uid", str(NOBODY),
                          "--kv-events", f"tcp://127.0.0.1:{pub_port}", "--kv-events-replay",
                          f"tcp://127.0.0.1:{replay_port}", *args)
    os.chmod(os.path.dirname(server.fd_socket), 0o711)
    os.chmod(server.fd_socket, 0o666)
    return server, Http(http_port), f"tcp://127.0.0.1:{replay_port}"


def a_prompt(http: Http, n: int = 4) -> tuple[int, int]:
    """``(leading blocks by hashes, by tokens)`` of A's ``n``-chunk prompt (2 blocks a chunk)."""
    return (http.leading(block_hashes=chain(n))[0], http.leading(token_ids=chain_tokens(n), block_size=BLOCK)[0])


def node_removals(replay: str) -> list[int]:
    """Every block hash the node stream has sent a ``BlockRemoved`` for (its replay buffer)."""
    out = []
    for _, _, payload in _replay(replay, [b"", (0).to_bytes(8, "big")]):
        for e in decode_batch(payload)[1]:
            if e["type"] == "BlockRemoved":
                out += list(e["block_hashes"])
    return out


@pytest.fixture
def tenant_a():
    made: list[Tenant] = []

    def make(url: str) -> Tenant:
        made.append(Tenant(url, "a"))
        return made[-1]
    yield make
    for t in made:
        t.close()


def test_a_store_of_another_uid_that_stores_nothing_hides_nothing(start_server, tenant_a):
    server, http, _ = serve(start_server)
    a = tenant_a(server.url)
    assert a.store(0, [advert(c) for c in range(4)]) == [0] * 4
    assert a_prompt(http) == (8, 8)
    # B advertises A's first chunk (A's first hash and tokens, another second hash), stores nothing
    reply = as_nobody(server.url, "_b_store_nothing")
    assert "UNAVAILABLE" in reply or "waited past" in reply, reply
    assert a_prompt(http) == (8, 8)
    assert a.store(0, [advert(c) for c in range(4)]) == [1] * 4           # A stores it again: present
    assert a_prompt(http) == (8, 8)


def test_a_chunk_another_uid_stores_with_the_same_first_hash_hides_nothing_and_its_eviction_removes_nothing(
        start_server, tenant_a):
    server, http, replay = serve(start_server, "--max-objects", "7")
    a = tenant_a(server.url)
    assert a.store(0, [advert(c) for c in range(4)]) == [0] * 4
    first, seen = as_nobody(server.url, "_b_hide_then_fill", http.base, width=1024)
    assert first == [0] and [tuple(s) for s in seen] == [(8, 8)]
    wait_for(lambda: hashes_of(0)[0] in node_removals(replay) or http.leading(block_hashes=[hashes_of(0)[0], 12345])[0] == 0,
             10, 0.05, "B's chunk evicted")
    assert a_prompt(http) == (8, 8)
    assert hashes_of(0)[0] not in node_removals(replay) and 12345 in node_removals(replay)


def test_another_uids_eviction_of_the_same_blocks_sends_the_node_no_removal_while_a_holds_them(
        start_server, tenant_a):
    server, http, replay = serve(start_server, "--max-objects", "7")
    a = tenant_a(server.url)
    assert a.store(0, [advert(c) for c in range(4)]) == [0] * 4
    assert as_nobody(server.url, "_b_copy_then_fill", width=1024) == [[0]] * 4
    wait_for(lambda: a.client.status().pool.evictions >= 1, 10, 0.05, "the pool evicted B's oldest")
    assert http.leading(block_hashes=[778])[0] == 1          # B's oldest (A's chunk 0 again) went, no other
    assert a_prompt(http) == (8, 8)
    assert not set(chain(4)) & set(node_removals(replay))


def test_a_flood_of_stores_that_store_nothing_pushes_none_of_another_uids_chunks_out(start_server, tenant_a):
    server, http, replay = serve(start_server, "--kv-events-index", "4096")
    a = tenant_a(server.url)
    assert a.store(0, [advert(c) for c in range(4)]) == [0] * 4
    as_nobody(server.url, "_b_flood")
    assert a_prompt(http) == (8, 8)
    assert not set(chain(4)) & set(node_removals(replay))
    seen = a.client.kv_events([SPACE], -1)
    assert not [e for e in seen.events if type(e).__name__ == "BlockRemoved"]


def test_engine_topics_are_kept_per_uid_so_another_uids_engines_never_take_a_new_engines_topic(start_server, tenant_a):
    """Issue 41 §4: after 4,096 pod names the publisher's table never freed one, so a new
    engine's events went out on the node topic only. Now each uid keeps its 64 most recently
    seen engines, and another uid's never count."""
    server, http, replay = serve(start_server, "--kv-events-topic", "engine")
    as_nobody(server.url, "_b_many_engines", timeout_s=180)
    a = tenant_a(server.url)
    assert a.store(0, [advert(0)]) == [0]
    wait_for(lambda: http.leading(block_hashes=hashes_of(0))[0] == 2, 10, 0.05, "A's chunk indexed")

    def a_topics() -> set:
        return {bytes(t) for t, _, p in _replay(replay, [b"", (0).to_bytes(8, "big")])
                if any(e.get("block_hashes", [None])[0] == hashes_of(0)[0] for e in decode_batch(p)[1])}
    wait_for(lambda: a_topics(), 10, 0.1, "A's BlockStored on the stream")
    assert a_topics() == {b"kv@pod-a@m"}


def test_another_uids_flood_of_events_never_makes_a_connector_start_over(start_server, tenant_a):
    """A connector told ``lost`` sends its engine's stream a BlockRemoved for every block it
    advertised (docs/design/kv-events.md, "Restarts and gaps"): so another tenant that churns
    the shared ring (its own stores and evictions) could wipe A's blocks from the routers."""
    server, http, _ = serve(start_server, "--kv-events-buffer", "64", "--max-objects", "8")
    a = tenant_a(server.url)
    assert a.store(0, [advert(0)]) == [0]
    wait_for(lambda: a.client.kv_events([SPACE], -1).events, 10, 0.05, "A's BlockStored")
    cursor = a.client.kv_events([SPACE], -1).cursor
    assert as_nobody(server.url, "_b_churn") > cursor + 64
    reply = a.client.kv_events([SPACE], cursor)
    assert not reply.lost and reply.events == []
    assert a_prompt(http, 1) == (2, 2)


def test_another_uids_flood_of_events_never_trims_a_connectors_unread_events(start_server, tenant_a):
    """As above, but A has events it has not read yet (an idle engine reads none): B's churn
    pushed them off the shared ring and A's read said ``lost`` (round 4, fresh attack). A
    uid's records now stay in its own feed until its own records pass its bound."""
    server, http, _ = serve(start_server, "--kv-events-buffer", "64", "--max-objects", "8")
    a = tenant_a(server.url)
    assert a.store(0, [advert(0)]) == [0]
    wait_for(lambda: a.client.kv_events([SPACE], -1).events, 10, 0.05, "A's BlockStored")
    cursor = a.client.kv_events([SPACE], -1).cursor
    assert a.store(1, [advert(1)]) == [0]                  # its BlockStored: not read yet
    assert as_nobody(server.url, "_b_churn") > cursor + 64
    reply = a.client.kv_events([SPACE], cursor)
    assert not reply.lost
    assert [e.block_hashes[0] for e in reply.events if type(e).__name__ == "BlockStored"] == [hashes_of(1)[0]]


def test_another_uid_cannot_publish_on_an_engine_topic_a_uid_holds(start_server, tenant_a):
    """Engine mode: a STORE's ``pod`` names the topic its events go to. B's STOREs naming A's
    engine (``pod-a``) put B's BlockStored, and B's BlockRemoved of any hashes, on
    ``kv@pod-a@m``: a router then credited (or uncredited) A's engine with B's claims (round 4,
    fresh attack). A pod name is now its first uid's while that uid has it attached."""
    server, http, replay = serve(start_server, "--kv-events-topic", "engine")
    a = tenant_a(server.url)
    assert a.store(0, [advert(0)]) == [0]
    wait_for(lambda: http.leading(block_hashes=hashes_of(0))[0] == 2, 10, 0.05, "A's chunk indexed")
    assert as_nobody(server.url, "_b_as_pod", "pod-a") == [0]
    wait_for(lambda: http.leading(block_hashes=[4242, 4243])[0] == 2, 10, 0.05, "B's chunk indexed")

    def topics_of(h: int) -> set:
        return {bytes(t) for t, _, p in _replay(replay, [b"", (0).to_bytes(8, "big")])
                if any(e.get("block_hashes", [None])[0] == h for e in decode_batch(p)[1])}
    wait_for(lambda: topics_of(4242), 10, 0.1, "B's BlockStored on the stream")
    assert b"kv@pod-a@m" not in topics_of(4242)
    assert topics_of(hashes_of(0)[0]) == {b"kv@pod-a@m"}         # A's engine topic is still A's


def test_another_uids_flood_of_large_events_never_makes_the_node_stream_start_over(start_server, tenant_a):
    """B STOREs tiny chunks whose adverts are the wire's largest (65,536 tokens: a 362 KB
    BlockStored each) from two connections, faster than the publisher sends them: the ring
    (64 MiB) dropped records the publisher had not sent (``lost`` 1,494 in 8 s), and each time
    every node topic started over with AllBlocksCleared, wiping A's blocks from the routers
    (round 4, fresh attack). Now records the publisher has not read stay (up to twice the ring's
    bounds), and a uid with much of the backlog gets no new adverts applied."""
    from test_kv_events_stream import _metrics
    server, http, _ = serve(start_server, "--pool-populate-ahead", "0")
    a = tenant_a(server.url)
    assert a.store(0, [advert(0)]) == [0]
    wait_for(lambda: a_prompt(http, 1) == (2, 2), 10, 0.05, "A's chunk indexed")
    stored = as_nobody(server.url, "_b_flood_large", 6.0)
    assert stored > 300                                 # about 110 MiB of events at least
    assert a.store(1, [advert(1)]) == [0]               # A still advertises
    wait_for(lambda: a_prompt(http, 2) == (4, 4), 20, 0.1, "A's second chunk indexed")
    m = _metrics(int(http.base.rsplit(":", 1)[1]))
    assert m["lmshm_kv_events_lost"] == 0, m


# ---- what tenant B does (in its own process, as uid nobody: as_nobody) ---------------------


def _b_store_nothing(b: Tenant) -> str:
    """Advertise A's first chunk (A's first hash and tokens, another second hash); store nothing."""
    return repr(b.store_nothing(0, [advert(0, hashes=[hashes_of(0)[0], 12345], tokens=tokens_of(0))]))


def _b_hide_then_fill(b: Tenant, http_base: str) -> list:
    """Store for real a chunk with A's first hash (another second) and A's tokens; what a lookup
    of A's prompt says then; then fill the pool so that B (16 times A's bytes a chunk) loses it."""
    first = b.store(0, [advert(0, hashes=[hashes_of(0)[0], 12345], tokens=tokens_of(0))])
    http = Http(0)
    http.base = http_base
    seen = [a_prompt(http)]
    for i in range(1, 4):
        b.store(i, [protocol.Advert(b"b-%d" % i, 0, BLOCK, [777 + i], None, list(range(BLOCK)))])
    return [first, seen]


def _b_copy_then_fill(b: Tenant) -> list:
    """Store A's very chunk 0 (same model, as A advertises it), then fill the pool."""
    out = [b.store(0, [advert(0)])]
    for i in range(1, 4):
        out.append(b.store(i, [protocol.Advert(b"b-%d" % i, 0, BLOCK, [777 + i], None, list(range(BLOCK)))]))
    return out


def _b_flood(b: Tenant) -> int:
    """3 STOREs of 16,384 one-block adverts each, answered UNAVAILABLE: nothing stored."""
    n = 1 << 14
    for s in range(3):
        adverts = [protocol.Advert(b"f%d-%d" % (s, i), 0, BLOCK, [(s << 20) | i], None, list(range(BLOCK)))
                   for i in range(n)]
        msg = protocol.Store(b.iid, [hashlib.sha256(b"f%d-%d" % (s, i)).digest() for i in range(n)],
                             [i % 16 for i in range(n)], 1, b"", wait_s=1e-6,
                             adverts=protocol.pack_adverts(adverts), space=SPACE, pod="pod-b")
        try:
            b.client.submit(msg, 30).result()
        except Exception:
            pass
    return n


def _b_many_engines(b: Tenant) -> int:
    """The same chunk (present after the first) 4,200 times, a new engine each time."""
    adverts = [protocol.Advert(b"b-0", 0, BLOCK, [4242], None, list(range(BLOCK)))]
    for i in range(4200):
        b.client.store(b.iid, b.keys(0, 1), [0], 1, adverts=adverts, space=SPACE, pod=f"b-engine-{i}")
    return 4200


def _b_as_pod(b: Tenant, pod: str) -> list:
    """Store a chunk of B's own (hashes 4242, 4243) naming ``pod`` as its engine."""
    ad = protocol.Advert(b"b-pod", 0, BLOCK, [4242, 4243], None, list(range(2 * BLOCK)))
    return list(b.client.store(b.iid, b.keys(0, 1), [0], 1, adverts=[ad], space=SPACE, pod=pod).results)


def _b_flood_large(b: Tenant, seconds: float) -> int:
    """STOREs of 50 one-block chunks with the wire's largest adverts, from two connections, for
    ``seconds``; how many chunks were stored."""
    import threading
    import time
    stop = time.monotonic() + seconds
    done = [0, 0]

    def flood(t: Tenant, k: int) -> None:
        n = 0
        while time.monotonic() < stop:
            ads = [protocol.Advert(b"big-%d-%d" % (k, n + i), 0, 64,
                                   [(k << 40) + ((n + i) << 20) + j for j in range(1024)],
                                   None, [], tokens=bytes(4 * 65536)) for i in range(50)]
            t.client.store(t.iid, t.keys(n, 50), [i % 16 for i in range(50)], 1, adverts=ads, space=SPACE, pod="")
            n += 50
        done[k] = n
    b2 = Tenant(b.url, "b2")
    try:
        th = threading.Thread(target=flood, args=(b2, 1))
        th.start()
        flood(b, 0)
        th.join()
    finally:
        b2.close()
    return sum(done)


def _b_churn(b: Tenant) -> int:
    """100 STOREs into a small pool: each a BlockStored, and soon a BlockRemoved (200 records)."""
    for i in range(100):
        b.store(i, [protocol.Advert(b"b-%d" % i, 0, BLOCK, [9000 + i], None, list(range(BLOCK)))])
    return b.client.kv_events([SPACE], -1).cursor


# ---- bounds (§3): memory grows by the index's bound, not by what is sent ----------------------


def test_the_largest_adverts_grow_the_server_by_the_index_bound_not_by_what_is_sent(start_server, tenant_a):
    """300 of the wire's largest adverts (1,024 hashes, 65,536 tokens, a LoRA name on each block:
    85 MiB sent). Before round 4 the server grew about 12 times that (a GiB); the index is now
    bounded in bytes (``--kv-events-index 16384``: 64 MiB) and so is the log (64 MiB, up to twice
    that while the publisher has not read its records: 128 MiB), so 192 MiB and the allocator's
    slack at most."""
    server, _, _ = serve(start_server, "--pool-populate-ahead", "0", "--kv-events-index", "16384")
    a = tenant_a(server.url)
    lora = "adapter-%020d" % 0
    extra = msgspec.msgpack.encode([[lora]] * 1024)
    tokens = (bytes(range(256)) * 1024)[:4 * 65536]

    def largest(i: int) -> protocol.Advert:
        return protocol.Advert(b"big-%d" % i, 0, 64, [(i << 20) + j for j in range(1024)], None, [],
                               lora_name=lora, extra_keys=extra, tokens=tokens)
    for i in range(20):                                     # warm up: the allocator, the log's ring
        a.store(i, [largest(i)])
    a.client.kv_events([SPACE], -1, 1)
    before = _rss(server.proc.pid)
    for i in range(20, 320):
        a.store(i, [largest(i)])
    a.client.kv_events([SPACE], -1, 1)                      # a reader: the index applied everything
    grown = _rss(server.proc.pid) - before
    assert grown < 240 << 20, f"the server grew {grown / 2**20:.0f} MiB for 85 MiB of adverts"
