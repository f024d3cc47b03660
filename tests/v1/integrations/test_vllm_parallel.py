"""LmshmConnector on the configurations users run beyond one rank of a Llama: tensor parallel 2
and a hybrid (sliding-window + full attention) model, on a real vLLM 0.32.0 (CPU build).

TP=2 engines take about a minute to start on these 2-core machines, so each engine here serves
several batches, with a meaning for each (see ``vllm_harness.Engine``).
"""

from __future__ import annotations

import pytest
from vllm_harness import CHUNK, Engine, prompts

from lmshm.transport.client import query_status

pytestmark = pytest.mark.vllm

NO_LOAD = {"kv_transfer_params": {"lmshm": {"load": False}}}


def _full_hit(prompt: list[int]) -> int:
    return min(len(prompt) // CHUNK * CHUNK, len(prompt) - 1)


def test_tensor_parallel_2_reuses_across_engines_and_never_serves_one_ranks_kv_alone(model, server, tmp):
    p = prompts()
    long = p["long"]
    # Engine A (TP=2): computes and stores from both ranks; then, with rank 1's loads failing and
    # rank 0's succeeding, the same prompt must be recomputed and answer the same.
    a = Engine(model, server.url, tmp, [long], [long], name="A", tp=2, extra=("--fail-loads-rank", "1"))
    a.wait_ready(1)
    status = query_status(server.url)
    ranks = sorted(r.worker_rank for r in status.registrations)
    assert ranks == [0, 1] and {r.world_size for r in status.registrations} == {2}
    stored = status.pool.stored
    assert stored == 2 * (len(long) // CHUNK)          # every chunk, once per rank
    retrieved = status.pool.retrieved
    a.go(1)
    first, failed = a.results(warnings=True)
    assert first[0]["cached"] == 0
    assert failed[0]["output"] == first[0]["output"]   # recomputed, not served with rank 1's KV missing
    assert query_status(server.url).pool.retrieved > retrieved   # rank 0 did load its half
    assert query_status(server.url).pool.leases == 0

    # Engine B (TP=2): reuses A's prefix; a request with loads off is the control in the same engine.
    b = Engine(model, server.url, tmp, [{"tokens": long, **NO_LOAD}, long, p["shares_400"]], name="B", tp=2)
    control, reused, shared = b.results()[0]
    assert control["cached"] == 0 and control["output"] == first[0]["output"]
    assert reused["cached"] == _full_hit(long) >= 0.8 * len(long)
    assert reused["output"] == control["output"]
    assert shared["cached"] == 400 // CHUNK * CHUNK

    # Engine C (TP=1, same model and prompt): TP=2 chunks are another layout and world size.
    c = Engine(model, server.url, tmp, [long], name="C").results()[0]
    assert c[0]["cached"] == 0 and c[0]["output"] == first[0]["output"]
    assert query_status(server.url).pool.failed == 0


def test_a_hybrid_model_keeps_vllms_hybrid_manager_and_reuses_its_prefix(hybrid_model, server, tmp):
    p = prompts()
    long = p["long"]                                   # 700 tokens: far past the 128-token window
    a = Engine(hybrid_model, server.url, tmp, [long], name="HA")
    first = a.results()[0][0]
    assert a.report()["hybrid_kv_cache_manager"] is True
    assert first["cached"] == 0
    b = Engine(hybrid_model, server.url, tmp, [{"tokens": long, **NO_LOAD}, long], name="HB")
    control, reused = b.results()[0]
    assert b.report()["hybrid_kv_cache_manager"] is True
    assert control["cached"] == 0 and control["output"] == first["output"]
    assert reused["cached"] == _full_hit(long) >= 0.8 * len(long)
    assert reused["output"] == first["output"]
    pool = query_status(server.url).pool
    assert pool.failed == 0 and pool.leases == 0 and pool.pinned == 0
