"""LmshmConnector on a real vLLM 0.32.0 (CPU build), in separate engine processes.

The engines run in ``.venv-vllm`` (``scripts/bootstrap-vllm``; ``scripts/test`` makes it), with a
tiny random Llama built on the spot and vLLM's own prefix caching off, so every cached token
came through lmshm. One lmshm-server per test, in the project's venv.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest
from harness import ServerProcess, lmshm_segments, scratch_dir, wait_for
from vllm_harness import CHUNK, Engine, assert_torn_down, prompts, run

from lmshm.transport.client import query_status

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("multiprocess", [False, True], ids=["single-process", "multiprocess"])
def test_a_second_engine_reuses_the_first_engines_kv(model, server, tmp, multiprocess):
    before = lmshm_segments()
    p = prompts()
    batch = [p["long"], p["shares_400"], p["other"]]
    a = run(model, server.url, tmp, batch, name="A", multiprocess=multiprocess)
    # engine A computed everything itself, except the common prefix it had just stored
    assert [r["cached"] for r in a] == [0, 400 // CHUNK * CHUNK, 0]
    b = run(model, server.url, tmp, batch, name="B", multiprocess=multiprocess)
    assert [r["output"] for r in b] == [r["output"] for r in a]
    for r in b:
        assert r["cached"] >= 0.8 * r["prompt"], b
        assert r["cached"] == min(r["prompt"] // CHUNK * CHUNK, r["prompt"] - 1)
    pool = query_status(server.url).pool
    assert pool.retrieved > 0 and pool.failed == 0 and pool.leases == 0 and pool.pinned == 0
    assert_torn_down(server, before)


@pytest.fixture(scope="module")
def stored_by_a(model):
    """One server holding what engine A stored of ``[long, other]``, with A's results: the
    corrupted-load and failed-load tests both read it (each checks only its own engine's
    effect, so their order does not matter), instead of each running A on a server of its own."""
    p = prompts()
    batch = [p["long"], p["other"]]
    with scratch_dir() as sockets:
        tmp = Path(tempfile.mkdtemp(prefix="lmshm-v-", dir="/tmp"))
        server = ServerProcess(sockets, "--capacity", "256MiB", "--reap-timeout", "5")
        try:
            yield server, batch, run(model, server.url, tmp, batch, name="A")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if server.alive:
                assert server.stop() == 0, server.log()


def test_corrupted_loaded_kv_changes_the_output(model, stored_by_a, tmp):
    """The control: the same hits, but the loaded blocks overwritten with noise in the engine."""
    server, batch, a = stored_by_a
    c = run(model, server.url, tmp, batch, name="C", extra=("--corrupt",))
    assert all(r["cached"] >= 0.8 * r["prompt"] for r in c), c
    for ra, rc in zip(a, c):
        assert ra["output"] != rc["output"], "outputs unchanged although every loaded block was noise"


def test_a_failed_load_is_recomputed_never_served_wrong(model, stored_by_a, tmp):
    """Every RETRIEVE fails in engine F: vLLM must recompute those blocks (kv_load_failure_policy
    "recompute", which the connector sets) and answer exactly as engine A did."""
    server, batch, a = stored_by_a
    before = query_status(server.url).pool
    f = Engine(model, server.url, tmp, batch, name="F", extra=("--fail-loads",)).results(warnings=True)[0]
    assert query_status(server.url).pool.hits >= before.hits + 2 * 6  # F was offered the loads...
    assert [r["output"] for r in f] == [r["output"] for r in a]        # ...failed them, and recomputed
    assert query_status(server.url).pool.retrieved == before.retrieved  # nothing was copied in
    assert query_status(server.url).pool.leases == 0


def test_a_restart_serves_nothing_stale_and_a_down_server_never_stalls_the_engine(model, tmp, sockets):
    before = lmshm_segments()
    p = prompts()
    batch = [p["long"], p["other"]]
    servers = [ServerProcess(sockets, "--capacity", "256MiB")]
    url = servers[0].url
    engine = Engine(model, url, tmp, batch, batch, batch, batch, name="E")
    try:
        engine.wait_ready(1)                      # batch 0: computed and stored
        assert query_status(url).pool.stored > 0
        engine.go(1)                              # batch 1: served from lmshm
        engine.wait_ready(2)
        assert servers[0].stop() == 0, servers[0].log()
        engine.go(2)                              # batch 2: the server is down
        engine.wait_ready(3)
        servers.append(ServerProcess(sockets, "--capacity", "256MiB", url=url))
        wait_for(lambda: query_status(url).registrations and query_status(url).sessions >= 2, 30,
                 what="the engine's worker to register again and its scheduler to reconnect")
        time.sleep(2.5)                           # lmshm.retry_s: the connector's back-off after failures
        engine.go(3)                              # batch 3: a new, empty server
        out = engine.results(warnings=True)
        first, from_lmshm, down, restarted = out
        assert [r["cached"] for r in first] == [0, 0]
        assert all(r["cached"] >= 0.8 * r["prompt"] for r in from_lmshm)
        assert [r["cached"] for r in down] == [0, 0] and [r["cached"] for r in restarted] == [0, 0]
        for results in (from_lmshm, down, restarted):
            assert [r["output"] for r in results] == [r["output"] for r in first]
        # no stall: with the server gone a prompt costs about what computing it costs
        worst_down = max(r["seconds"] for r in down)
        assert worst_down < max(r["seconds"] for r in first) + 3.0, (down, first)
        assert query_status(url).pool.stored > 0     # the engine stores into the new server again
        assert_torn_down(servers[-1], before)
    finally:
        if engine.proc.poll() is None:
            engine.proc.kill()
            engine.proc.wait()
        for server in servers:
            if server.alive:
                assert server.stop() == 0, server.log()
