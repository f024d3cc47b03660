"""LmshmConnector serves exactly the right KV, on a real vLLM 0.32.0 (CPU build): request identity
(cache salt) in the keys, per-request control, vLLM's own metrics, a silent server.

Separate engine processes, one lmshm-server per test (see ``vllm_harness.py``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from harness import ServerProcess
from vllm_harness import CHUNK, VLLM_PYTHON, Engine, _env, prompts

from lmshm.transport.client import query_status

pytestmark = pytest.mark.vllm


def _cached(results: list[dict]) -> list[int]:
    return [r["cached"] for r in results]


def _full_hit(prompt: list[int]) -> int:
    return min(len(prompt) // CHUNK * CHUNK, len(prompt) - 1)


def test_a_cache_salt_isolates_tenants_in_both_directions(model, server, tmp):
    p = prompts()
    long, other = p["long"], p["other"]

    def salted(tokens: list[int], salt: str) -> dict:
        return {"tokens": tokens, "cache_salt": salt} if salt else {"tokens": tokens}

    a = Engine(model, server.url, tmp, [salted(long, "alice"), salted(other, "bob")], name="A").results()[0]
    assert _cached(a) == [0, 0]
    b = Engine(model, server.url, tmp, [
        salted(long, "bob"),      # alice's prompt, as bob: nothing of alice's
        salted(other, "alice"),   # bob's prompt, as alice: nothing of bob's
        salted(long, ""),         # no salt: nothing of a salted request
        salted(long, "alice"),    # alice again, in another engine: her own KV
        salted(other, "bob"),     # bob again: his own
    ], name="B").results()[0]
    assert _cached(b) == [0, 0, 0, _full_hit(long), _full_hit(other)]
    assert b[3]["output"] == a[0]["output"] and b[4]["output"] == a[1]["output"]
    assert b[0]["output"] == a[0]["output"]       # computed, not loaded: the same answer
    assert query_status(server.url).pool.failed == 0


def test_per_request_switches_and_prompt_logprobs(model, server, tmp):
    p = prompts()
    long, other = p["long"], p["other"]
    e = Engine(model, server.url, tmp, [
        long,                                                               # stored
        {"tokens": long, "prompt_logprobs": 1},                             # vLLM needs the prompt computed
        {"tokens": long, "kv_transfer_params": {"lmshm": {"load": False}}},
        long,                                                               # loads
        {"tokens": other, "kv_transfer_params": {"lmshm": {"store": False}}},
        other,                                                              # so this computes, and stores
        other,                                                              # and this loads
        {"tokens": other, "kv_transfer_params": {"lmshm": "nonsense"}},    # ignored with a warning
    ], name="E").results(warnings=True)[0]
    assert _cached(e) == [0, 0, 0, _full_hit(long), 0, 0, _full_hit(other), _full_hit(other)]
    assert len({tuple(r["output"]) for r in e[:4]}) == 1 and len({tuple(r["output"]) for r in e[4:]}) == 1
    log = (tmp / "E.log").read_text()
    assert "kv_transfer_params['lmshm'] must be a dict" in log


def test_vllm_logs_and_exports_the_connector_metrics(model, server, tmp):
    p = prompts()
    e = Engine(model, server.url, tmp, [p["long"], p["long"]], name="M", extra=("--metrics",))
    results = e.results()[0]
    assert _cached(results) == [0, _full_hit(p["long"])]
    metrics = e.report()["metrics"]
    chunks = len(p["long"]) // CHUNK
    assert metrics["vllm:lmshm_lookups"] >= 2
    assert metrics["vllm:lmshm_hit_tokens"] == _full_hit(p["long"])
    assert metrics["vllm:lmshm_stored_chunks"] == chunks and metrics["vllm:lmshm_loaded_chunks"] == chunks
    assert metrics["vllm:lmshm_stored_bytes"] == metrics["vllm:lmshm_loaded_bytes"] > 0
    assert metrics["vllm:lmshm_failed_loads"] == 0 and metrics["vllm:lmshm_dropped_stores"] == 0
    assert metrics["vllm:lmshm_lookup_seconds"] >= 2 and metrics["vllm:lmshm_load_seconds"] >= 1
    # vLLM's own view of external hits, attributed to host memory
    assert metrics.get("vllm:external_prefix_cache_hits", 0) >= _full_hit(p["long"]), metrics
    log = (tmp / "M.log").read_text()
    assert "KV Transfer metrics:" in log and "stored_chunks=" in log, log[-3000:]


def test_a_silent_server_never_hangs_the_engine(model, tmp, sockets):
    """The server is SIGSTOPped (alive, accepting, never answering) between two batches: the
    engine goes on, every request recomputes, and each costs at most the connector's timeouts."""
    p = prompts()
    batch = [p["long"], p["other"]]
    server = ServerProcess(sockets, "--capacity", "256MiB")
    engine = Engine(model, server.url, tmp, batch, batch, batch, name="S",
                    extra=("--extra", "lmshm.timeout_s=1.0", "--extra", "lmshm.lookup_timeout_s=0.5"))
    try:
        engine.wait_ready(1)                        # batch 0 computed and stored
        engine.go(1)
        engine.wait_ready(2)                        # batch 1 loaded
        os.kill(server.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        engine.go(2)                                # batch 2: the server says nothing
        out = engine.results(timeout_s=120, warnings=True)
        stalled = time.monotonic() - t0
        first, loaded, silent = out
        assert _cached(first) == [0, 0] and _cached(loaded) == [_full_hit(t) for t in batch]
        assert _cached(silent) == [0, 0]
        assert [r["output"] for r in silent] == [r["output"] for r in first]
        # each request costs at most a LOOKUP timeout (0.5 s) over computing it; the engine's
        # exit at most a store timeout (1 s) per store in flight, bounded by lmshm.shutdown_timeout_s
        worst = max(r["seconds"] for r in first)
        assert max(r["seconds"] for r in silent) < worst + 2.0, (silent, first)
        assert stalled < 60, stalled
    finally:
        if server.alive:
            os.kill(server.proc.pid, signal.SIGCONT)
        if engine.proc.poll() is None:
            engine.proc.kill()
            engine.proc.wait()
        if server.alive:
            assert server.stop() == 0, server.log()


def test_a_non_cryptographic_block_hash_is_refused_at_start(model, tmp):
    code = ("import sys\n"
            "from vllm import LLM\n"
            "from vllm.config import KVTransferConfig\n"
            "try:\n"
            "    LLM(model=sys.argv[1], skip_tokenizer_init=True, enforce_eager=True, block_size=32,\n"
            "        prefix_caching_hash_algo='xxhash', enable_prefix_caching=False,\n"
            "        kv_transfer_config=KVTransferConfig(kv_connector='LmshmConnector',\n"
            "            kv_connector_module_path='lmshm.integrations.vllm', kv_role='kv_both',\n"
            "            kv_connector_extra_config={'lmshm.url': 'tcp://127.0.0.1:9'}))\n"
            "except Exception as exc:\n"
            "    print('REFUSED:', exc)\n")
    r = subprocess.run([str(VLLM_PYTHON), "-c", code, model], capture_output=True, text=True, timeout=300,
                       env=_env(str(tmp)))
    out = r.stdout + r.stderr
    assert "prefix_caching_hash_algo='xxhash'" in out and "sha256" in out, out[-3000:]
