"""The engine-neutral adapter without an engine: keys, chunk math, the scheduler and worker
halves, and the TRT-LLM pool, against a real lmshm-server process. The "engines" here are this
test process; their KV lives in real shared memory the server maps."""

from __future__ import annotations

import gc
import time

import pytest
import torch
from harness import ServerProcess, scratch_dir, wait_for

from lmshm.integrations.adapter import (
    Group,
    Link,
    LinkConfig,
    Namespace,
    SchedulerSide,
    WorkerSide,
    chunk_keys,
    chunk_keys_from_hashes,
)
from lmshm.integrations.trtllm import TrtllmKVPool
from lmshm.transport.client import query_status

BLOCK = 16


@pytest.fixture
def server():
    with scratch_dir() as tmp:
        s = ServerProcess(tmp, "--capacity", "64MiB")
        yield s
        assert s.stop() == 0, s.log()


def test_keys_chain_over_chunks_and_separate_namespaces():
    ns = Namespace("m", "float16", "L", world_size=2, rank=0, chunk_tokens=4).digest
    toks = list(range(13))
    keys = chunk_keys(ns, toks, 4)
    assert len(keys) == 3 and all(len(k) == 32 for k in keys)                   # whole chunks only
    assert chunk_keys(ns, toks[:8], 4) == keys[:2]                               # a prefix keeps its keys
    changed = chunk_keys(ns, [99] + toks[1:], 4)
    assert all(a != b for a, b in zip(changed, keys))                            # chained: one token changes all
    others = [Namespace("m2", "float16", "L", 2, 0, 4), Namespace("m", "bfloat16", "L", 2, 0, 4),
              Namespace("m", "float16", "L2", 2, 0, 4), Namespace("m", "float16", "L", 2, 1, 4),
              Namespace("m", "float16", "L", 1, 0, 4), Namespace("m", "float16", "L", 2, 0, 4, salt="s")]
    assert len({chunk_keys(o.digest, toks, 4)[0] for o in others} | {keys[0]}) == len(others) + 1


def test_a_link_to_no_server_never_stalls():
    link = Link(LinkConfig(url="tcp://127.0.0.1:9", timeout_s=0.5, retry_s=30))
    t0 = time.perf_counter()
    for _ in range(100):
        assert link.lookup([[b"k" * 32]]) == (0, b"")
        assert link.store([b"k" * 32], [0], 1) is None
        assert link.retrieve([b"k" * 32], [0], 1) is None
    assert time.perf_counter() - t0 < 0.5
    link.close()


def test_a_links_warnings_are_rate_limited_per_kind_and_count_what_they_left_out(caplog):
    link = Link(LinkConfig(url="tcp://127.0.0.1:9", warn_every_s=30), connect_now=False)
    with caplog.at_level("WARNING", logger="lmshm.connector"):
        for _ in range(3):
            link.warn("store", "STORE failed: %s", "boom")
        link.warn("lookup", "LOOKUP failed: %s", "boom")     # another kind: not hidden by the stores
    assert [r.getMessage() for r in caplog.records] == ["lmshm: STORE failed: boom", "lmshm: LOOKUP failed: boom"]
    assert link._warnings["store"].left_out == 2 and link._warnings["lookup"].left_out == 0
    link.close()


def test_waiting_for_a_link_to_no_server_ends_when_its_connection_attempt_fails():
    link = Link(LinkConfig(url="tcp://127.0.0.1:9", timeout_s=0.5, retry_s=30))
    t0 = time.perf_counter()
    assert link.wait_connected(30) is False
    assert time.perf_counter() - t0 < 5          # the attempt's own timeout, not the 30 s asked
    link.close()


def test_a_scheduler_side_link_is_connected_when_wait_connected_returns(server):
    link = Link(LinkConfig(url=server.url, timeout_s=5))
    assert link.wait_connected(30) and link.client() is not None
    link.close()


class Engine:
    """Both halves of a connector, and a KV cache of 4 layers [blocks, 2, BLOCK, 8]."""

    groups = [Group()]

    def __init__(self, url: str, name: str) -> None:
        self.kv = {f"layer.{i}": torch.zeros(32, 2, BLOCK, 8) for i in range(4)}
        ns = Namespace("tiny", "float32", f"{len(self.groups)} group(s) of [2,16,8]")
        self.slink = Link(LinkConfig(url=url, client_name=f"{name}-sched"))
        self.wlink = Link(LinkConfig(url=url, client_name=f"{name}-worker"))
        names, per = list(self.kv), len(self.kv) // len(self.groups)
        self.wlink.register_groups([{n: self.kv[n] for n in names[g * per:(g + 1) * per]}
                                    for g in range(len(self.groups))], instance_id=name)
        assert self.slink.wait_connected(10) and self.wlink.wait_connected(10)
        self.sched = SchedulerSide(self.slink, ns, chunk_tokens=BLOCK, block_size=BLOCK, groups=self.groups,
                                   null_block=0)
        self.worker = WorkerSide(self.wlink)

    def prefill(self, req_id: str, tokens: list[int], block_ids: list[int]) -> None:
        """The request's whole prompt is computed in one step, and its STOREs are sent."""
        self.sched.matched_tokens(req_id, tokens, 0)
        plan = self.sched.plan()
        self.sched.scheduled(req_id, block_ids=[block_ids], replace_blocks=True, computed_after_step=len(tokens),
                             tokens=tokens, plan=plan)
        self.worker.save(plan)

    def blocks(self, ids):
        return torch.stack([t[ids] for t in self.kv.values()])

    def close(self) -> None:
        self.slink.close()
        self.wlink.close()
        self.kv.clear()


def test_one_engine_stores_and_another_loads_whole_chunks(server):
    a, b = Engine(server.url, "A"), Engine(server.url, "B")
    try:
        tokens = list(range(1000, 1100))                   # 6 whole chunks and 4 tokens
        a_blocks = list(range(3, 10))
        for t in a.kv.values():
            t[a_blocks] = torch.randn(7, 2, BLOCK, 8)
        assert a.sched.matched_tokens("r1", tokens, 0) == 0
        a.sched.allocated("r1", [a_blocks], 0)
        plan = a.sched.plan()
        a.sched.scheduled("r1", block_ids=[a_blocks], replace_blocks=True, computed_after_step=100, plan=plan)
        assert [len(s.keys[0][0]) for s in plan.stores] == [6] and plan.stores[0].block_ids == [a_blocks[:6]]
        a.worker.save(plan)
        assert a.sched.finished("r1") is True              # blocks stay until the store is done
        wait_for(lambda: a.worker.finished({"r1"}) == {"r1"}, 10, what="the store to finish")
        assert a.worker.stored_chunks == 6

        assert b.sched.matched_tokens("x", tokens, 0) == 96
        assert b.sched.matched_tokens("full", tokens[:96], 0) == 95  # a full hit leaves one token
        b.sched.finished("full")
        b_blocks = list(range(20, 27))
        b.sched.allocated("x", [b_blocks], 96)
        plan = b.sched.plan()
        b.sched.take_loads(plan)
        b.sched.scheduled("x", block_ids=[b_blocks], replace_blocks=True, computed_after_step=100, plan=plan)
        assert plan.stores == []                           # what was loaded is not stored again
        b.worker.load(plan)
        assert b.worker.take_load_errors() == set() and b.worker.loaded_chunks == 6
        assert torch.equal(b.blocks(b_blocks[:6]), a.blocks(a_blocks[:6]))
        assert b.sched.finished("x") is False
        pool = query_status(server.url).pool
        assert (pool.leases, pool.pinned) == (0, 0)
    finally:
        a.close()
        b.close()
        gc.collect()


def test_a_failed_load_reports_its_blocks(server):
    a = Engine(server.url, "A")
    try:
        tokens = list(range(64))
        a.prefill("r", tokens, [0, 1, 2, 3])
        a.worker.wait_for_stores()
        assert a.sched.matched_tokens("again", tokens, 0) == 63
        a.sched.allocated("again", [[8, 9, 10, 11]], 63)
        plan = a.sched.plan()
        a.sched.take_loads(plan)
        plan.loads[0].block_ids[0][-1] = 32                   # out of range: the server refuses the RETRIEVE
        a.worker.load(plan)
        assert a.worker.take_load_errors() == {8, 9, 10, 32} and a.worker.failed_loads == 1
        assert a.worker.take_load_errors() == set()
    finally:
        a.close()
        gc.collect()


def test_trtllm_pool_stores_and_loads_through_the_same_adapter(server):
    shape = (16, 2, 2, BLOCK, 2, 8)                        # [blocks, layers, K/V, tokens, heads, dim]
    pa, pb = torch.zeros(shape), torch.zeros(shape)
    a = TrtllmKVPool(pa, model="tiny", tokens_per_block=BLOCK, url=server.url)
    b = TrtllmKVPool(pb, model="tiny", tokens_per_block=BLOCK, url=server.url)
    try:
        a.register("trt-a")
        b.register("trt-b")
        assert a.link.wait_connected(10) and b.link.wait_connected(10)
        (ra, rb) = sorted(query_status(server.url).registrations, key=lambda r: r.instance_id)
        assert (ra.num_layers, ra.instance_id, rb.instance_id) == (1, "trt-a", "trt-b")
        tokens = list(range(50))
        pa[[1, 2, 3]] = torch.randn(3, *shape[1:])
        assert b.lookup(tokens) == (0, b"")
        assert a.store(tokens, [1, 2, 3, 4]) == 3
        matched, lease = b.lookup(tokens)
        assert matched == 48 and lease
        assert b.load(tokens, matched, [9, 10, 11, 12], lease)
        assert torch.equal(pb[[9, 10, 11]], pa[[1, 2, 3]])
        assert not b.load(list(range(500, 550)), 48, [9, 10, 11], b"")  # not stored: a clean failure
    finally:
        a.close()
        b.close()
        del pa, pb
        gc.collect()


def test_a_preempted_request_waits_for_its_stores_and_starts_over(server):
    a = Engine(server.url, "A")
    try:
        tokens = list(range(64))
        a.prefill("r", tokens, [0, 1, 2, 3])
        plan = a.sched.plan()
        a.sched.preempted("r", plan)
        assert plan.preempted == ["r"]
        a.worker.wait_for_stores(plan.preempted)          # what handle_preemptions does
        assert a.worker.stored_chunks == 4
        assert all(st.pending.done() and st.settled for st in a.worker._stores["r"])
        plan = a.sched.plan()                              # resumed: new blocks, stored again (PRESENT)
        a.sched.scheduled("r", block_ids=[[8, 9, 10, 11]], replace_blocks=True, computed_after_step=64, plan=plan)
        assert plan.stores[0].block_ids == [[8, 9, 10, 11]]
    finally:
        a.close()
        gc.collect()


def test_unawaited_releases_leave_nothing_behind_in_the_client(server):
    a = Engine(server.url, "A")
    try:
        tokens = list(range(32))
        a.prefill("r", tokens, [0, 1])
        a.worker.wait_for_stores()
        for _ in range(200):
            hits, lease = a.slink.lookup([chunk_keys(a.sched.namespaces[0][0], tokens, BLOCK)])
            assert hits == 2
            a.slink.release(lease)
        dealer = a.slink.client()._dealer
        a.slink.lookup([[b"x" * 32]])          # one more round trip: the releases' replies have come
        assert not dealer._replies and not dealer._pending
        wait_for(lambda: query_status(server.url).pool.leases == 0, 5, what="the leases to end")
    finally:
        a.close()
        gc.collect()


# ---- request identity in keys -------------------------------------------------------------


def test_a_salt_or_another_block_hash_shares_no_key():
    ns = Namespace("m", "float16", "L", chunk_tokens=4).digest
    toks = list(range(16))
    plain = chunk_keys(ns, toks, 4)
    alice, bob = chunk_keys(ns, toks, 4, b"alice"), chunk_keys(ns, toks, 4, b"bob")
    assert chunk_keys(ns, toks, 4, b"") == plain
    assert not set(plain) & set(alice) and not set(alice) & set(bob)          # nothing in common, any chunk
    assert chunk_keys(ns, toks[:8], 4, b"alice") == alice[:2]

    hashes = [bytes([i]) * 32 for i in range(8)]                                # an engine's chained block hashes
    keys = chunk_keys_from_hashes(ns, hashes, 2)                                # 2 blocks per chunk
    assert len(keys) == 4 and chunk_keys_from_hashes(ns, hashes[:5], 2) == keys[:2]
    other_last = hashes[:3] + [b"\xff" * 32] + hashes[4:]                       # chunk 1's last block differs
    assert chunk_keys_from_hashes(ns, other_last, 2)[0] == keys[0]
    assert not set(chunk_keys_from_hashes(ns, other_last, 2)[1:]) & set(keys)
    other_ns = Namespace("m", "float16", "L", chunk_tokens=4, group=1).digest   # another KV cache group
    assert not set(chunk_keys_from_hashes(other_ns, hashes, 2)) & set(keys)


def _hashes(tokens: list[int], salt: str, block: int = BLOCK) -> list[bytes]:
    """Chained block hashes the way an engine makes them: the salt is in the first block."""
    import hashlib

    out, prev = [], salt.encode()
    for b in range(len(tokens) // block):
        prev = hashlib.sha256(prev + repr(tokens[b * block:(b + 1) * block]).encode()).digest()
        out.append(prev)
    return out


def test_requests_with_other_block_hashes_get_nothing_and_switches_are_per_request(server):
    a, b = Engine(server.url, "A"), Engine(server.url, "B")
    try:
        tokens = list(range(64))
        for t in a.kv.values():
            t[[0, 1, 2, 3]] = torch.randn(4, 2, BLOCK, 8)
        a.sched.matched_tokens("alice-1", tokens, 0, hashes=_hashes(tokens, "alice"))
        plan = a.sched.plan()
        a.sched.scheduled("alice-1", block_ids=[[0, 1, 2, 3]], replace_blocks=True, computed_after_step=64, plan=plan)
        a.worker.save(plan)
        a.worker.wait_for_stores()
        assert a.worker.stored_chunks == 4
        lookups = query_status(server.url).pool.hits
        assert b.sched.matched_tokens("bob", tokens, 0, hashes=_hashes(tokens, "bob")) == 0
        assert b.sched.matched_tokens("nobody", tokens, 0, hashes=_hashes(tokens, "")) == 0
        assert b.sched.matched_tokens("by-tokens", tokens, 0) == 0               # token-id keys differ too
        assert b.sched.matched_tokens("alice-2", tokens, 0, hashes=_hashes(tokens, "alice")) == 63
        b.sched.finished("alice-2")
        # load=False: not even a LOOKUP is sent; store=False: nothing is planned
        before = query_status(server.url).pool
        assert b.sched.matched_tokens("no-load", tokens, 0, hashes=_hashes(tokens, "alice"), load=False) == 0
        assert query_status(server.url).pool.misses == before.misses and query_status(server.url).pool.hits == \
            before.hits
        b.sched.matched_tokens("no-store", list(range(500, 564)), 0, hashes=_hashes(list(range(500, 564)), "x"),
                               store=False)
        plan = b.sched.plan()
        b.sched.scheduled("no-store", block_ids=[[4, 5, 6, 7]], replace_blocks=True, computed_after_step=64,
                          plan=plan)
        assert plan.stores == [] and b.sched.finished("no-store") is False
        assert lookups <= query_status(server.url).pool.hits
        for req in ("alice-1", "bob", "nobody", "by-tokens", "no-load"):
            a.sched.finished(req)
            b.sched.finished(req)
        wait_for(lambda: query_status(server.url).pool.leases == 0, 5, what="the leases to end")
    finally:
        a.close()
        b.close()
        gc.collect()


def test_trtllm_requests_with_other_salts_share_nothing(server):
    shape = (16, 2, 2, BLOCK, 2, 8)
    pa, pb = torch.randn(shape), torch.zeros(shape)
    a = TrtllmKVPool(pa, model="tiny", tokens_per_block=BLOCK, url=server.url)
    b = TrtllmKVPool(pb, model="tiny", tokens_per_block=BLOCK, url=server.url)
    try:
        a.register("trt-a")
        b.register("trt-b")
        assert a.link.wait_connected(10) and b.link.wait_connected(10)
        tokens = list(range(50))
        assert a.store(tokens, [1, 2, 3], salt="alice") == 3
        assert b.lookup(tokens, salt="bob") == (0, b"") and b.lookup(tokens) == (0, b"")
        matched, lease = b.lookup(tokens, salt="alice")
        assert matched == 48
        assert b.load(tokens, matched, [9, 10, 11], lease, salt="alice")
        assert torch.equal(pb[[9, 10, 11]], pa[[1, 2, 3]])
    finally:
        a.close()
        b.close()
        del pa, pb
        gc.collect()


# ---- hybrid models: a full-attention group and a sliding-window group ---------------------


class HybridEngine(Engine):
    """Two KV cache groups with their own block tables: layers 0-1 full attention, 2-3 a
    sliding window of two blocks. Block 0 is the engine's null block."""

    groups = [Group(), Group(window=2 * BLOCK)]


def test_a_hybrid_model_loads_full_groups_whole_and_windows_only_where_blocks_are(server):
    a, b = HybridEngine(server.url, "HA"), HybridEngine(server.url, "HB")
    try:
        assert len(a.wlink.instance_ids) == 2
        tokens = list(range(100))                          # 6 whole chunks
        full, window = list(range(1, 8)), list(range(10, 17))
        for name, t in a.kv.items():
            t[full if name in ("layer.0", "layer.1") else window] = torch.randn(7, 2, BLOCK, 8)
        hashes = _hashes(tokens, "")
        a.sched.matched_tokens("r", tokens, 0, hashes=hashes)
        plan = a.sched.plan()
        a.sched.scheduled("r", block_ids=[full, window], replace_blocks=True, computed_after_step=100, plan=plan)
        assert plan.wait_stores                             # window blocks may be freed next step
        a.worker.save(plan)
        assert all(st.settled for st in a.worker._stores["r"])   # save() waited
        assert a.worker.stored_chunks == 12                  # 6 chunks x 2 groups

        assert b.sched.matched_tokens("x", tokens, 0, hashes=hashes) == 96
        # the engine keeps only the window's blocks: the first four are its null block
        b_full, b_window = list(range(20, 27)), [0, 0, 0, 0, 28, 29, 30]
        b.sched.allocated("x", [b_full, b_window], 96)
        plan = b.sched.plan()
        b.sched.take_loads(plan)
        (load,) = plan.loads
        assert load.block_ids == [b_full[:6], [28, 29]] and [len(k) for k in load.keys[0]] == [6, 2]
        b.worker.load(plan)
        assert b.worker.take_load_errors() == set() and b.worker.loaded_chunks == 8
        for name in ("layer.0", "layer.1"):
            assert torch.equal(b.kv[name][b_full[:6]], a.kv[name][full[:6]])
        for name in ("layer.2", "layer.3"):
            assert torch.equal(b.kv[name][[28, 29]], a.kv[name][window[4:6]])
            assert not b.kv[name][0].any()                 # the null block was never written
        assert query_status(server.url).pool.leases == 1   # the window's unused chunks are still pinned...
        b.sched.step_done()                                # ...until the step ends
        wait_for(lambda: query_status(server.url).pool.leases == 0, 5, what="the lease to end")
        assert query_status(server.url).pool.pinned == 0
    finally:
        a.close()
        b.close()
        gc.collect()


def test_a_window_model_needs_one_block_per_chunk():
    with pytest.raises(ValueError, match="must equal the block size"):
        SchedulerSide(Link(LinkConfig(url="tcp://127.0.0.1:9"), connect_now=False), Namespace("m", "f", "L"),
                      chunk_tokens=2 * BLOCK, block_size=BLOCK, groups=[Group(), Group(window=64)])
    with pytest.raises(ValueError, match="positive multiple"):
        SchedulerSide(Link(LinkConfig(url="tcp://127.0.0.1:9"), connect_now=False), Namespace("m", "f", "L"),
                      chunk_tokens=24, block_size=BLOCK)


class FakeWorkerCudaSync:
    """A FAKE of ``lmshm.core.cuda_sync.WorkerCudaSync`` (its two methods), over a CPU
    registration: it records which reply events the worker waited on, and fails on demand. The
    real one runs on a GPU in tests/v1/platform/cuda/test_cuda_dataplane_gpu.py."""

    device = 0

    def __init__(self) -> None:
        self.waited: list[bytes] = []
        self.fail_ready = self.fail_wait = False

    def ready(self):
        if self.fail_ready:
            raise RuntimeError("cudaEventRecord failed (injected)")
        return object(), b""

    def wait(self, handle: bytes) -> None:
        if self.fail_wait:
            raise RuntimeError("cudaIpcOpenEventHandle failed (injected)")
        self.waited.append(handle)


def test_store_replies_are_settled_at_the_next_step_not_when_the_request_finishes(server):
    a = Engine(server.url, "A")
    a.worker.cuda = FakeWorkerCudaSync()
    try:
        a.prefill("r", list(range(64)), [0, 1, 2, 3])
        pending = [st.pending for st in a.worker._stores["r"]]
        wait_for(lambda: all(p.done() for p in pending), 10, what="the STORE replies")
        assert a.worker.cuda.waited == []
        a.worker.save(a.sched.plan())                   # the next step, with nothing to store
        assert len(a.worker.cuda.waited) == len(pending) and all(st.settled for st in a.worker._stores["r"])
        assert a.worker.stored_chunks == 4              # settled before the request ever finished
    finally:
        a.close()
        gc.collect()


def test_no_cuda_error_leaves_the_worker_side(server):
    a = Engine(server.url, "A")
    fake = a.worker.cuda = FakeWorkerCudaSync()
    try:
        tokens = list(range(64))
        fake.fail_ready = True
        a.prefill("r0", tokens, [0, 1, 2, 3])           # no ordering token: the stores are dropped
        assert a.worker.stats.cuda_errors == 1 and a.worker.stats.dropped_stores == 4
        assert "r0" not in a.worker._stores or a.worker._stores["r0"] == []
        fake.fail_ready = False
        a.prefill("r1", tokens, [0, 1, 2, 3])
        a.worker.wait_for_stores()
        assert a.sched.matched_tokens("again", tokens, 0) == 63
        a.sched.allocated("again", [[8, 9, 10, 11]], 63)
        plan = a.sched.plan()
        a.sched.take_loads(plan)
        fake.fail_wait = True                           # the server's event cannot be waited on
        a.worker.load(plan)
        assert a.worker.take_load_errors() == {8, 9, 10, 11} and a.worker.failed_loads == 1
        assert a.worker.stats.cuda_errors == 2
    finally:
        a.close()
        gc.collect()


def _describe(tokens):
    """KV events: what chunk ``c`` is to a pretend engine (its block hash is the chunk's tokens)."""
    def describe(c):
        return (BLOCK, [bytes(tokens[c * BLOCK:c * BLOCK + 8])], bytes(tokens[(c - 1) * BLOCK:(c - 1) * BLOCK + 8])
                if c else None, tokens[c * BLOCK:(c + 1) * BLOCK], None, None)
    return describe


def _collect(feed, done, what):
    got = []
    wait_for(lambda: got.extend(feed.take()) or done(got), 10, what=what)
    return got


def test_an_event_feed_credits_every_engine_and_forgets_all_it_advertised_when_the_server_restarts():
    from lmshm.integrations.adapter import EventFeed

    with scratch_dir() as tmp:
        first = ServerProcess(tmp, "--capacity", "64MiB")
        a, b = Engine(first.url, "A"), Engine(first.url, "B")
        try:
            tokens = list(range(1, 65))
            a.sched.matched_tokens("r", tokens, 0, describe=_describe(tokens))
            a.prefill("r", tokens, [0, 1, 2, 3])
            wait_for(lambda: a.worker.finished({"r"}) == {"r"}, 10, what="the stores")
            hashes = [bytes(tokens[c * BLOCK:c * BLOCK + 8]) for c in range(4)]
            feeds = [EventFeed(a.slink, [a.sched.space]), EventFeed(b.slink, [b.sched.space])]
            for feed in feeds:     # B stored nothing: it is credited with what A stored, in order
                got = _collect(feed, lambda g: len(g) >= 4, "the BlockStored events")
                assert [type(e).__name__ for e in got] == ["BlockStored"] * 4
                assert [e.block_hashes for e in got] == [[h] for h in hashes]
                assert [e.parent_block_hash for e in got] == [None, *hashes[:3]]
                assert all(e.medium == "CPU" and e.locality == "LOCAL" and e.token_ids == tokens[i * BLOCK:(i + 1) * BLOCK]
                           for i, e in enumerate(got))
            other = EventFeed(a.slink, [b"another namespace"])
            time.sleep(0.2)
            assert other.take() == [] and (time.sleep(0.2) or other.take()) == []
            assert first.stop() == 0, first.log()
            second = ServerProcess(tmp, "--capacity", "64MiB", url=first.url)
            try:
                for feed in feeds:   # the new server holds none of it: removed, never AllBlocksCleared
                    got = _collect(feed, lambda g: g, "the removals after the restart")
                    assert [type(e).__name__ for e in got] == ["BlockRemoved"]
                    assert sorted(got[0].block_hashes) == sorted(hashes) and got[0].medium == "CPU"
                    assert feed.resets == 1
            finally:
                a.close()
                b.close()
                assert second.stop() == 0, second.log()
        finally:
            a.close()
            b.close()
            if first.alive:
                first.stop()
            gc.collect()
