"""LmshmConnector on a real vLLM 0.32.0 (CPU build), in separate engine processes.

The engines run in ``.venv-vllm`` (``scripts/bootstrap-vllm``; ``scripts/test`` makes it), with a
tiny random Llama built on the spot and vLLM's own prefix caching off, so every cached token
came through lmshm. One lmshm-server per test, in the project's venv.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from harness import ServerProcess, lmshm_segments, scratch_dir, wait_for
from lmshm.multiprocess.client import query_status

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = Path(os.environ.get("LMSHM_VLLM_VENV", ROOT / ".venv-vllm")) / "bin" / "python"
# Run as a module: as a script, its directory would shadow the vllm package with lmshm's vllm.py.
ENGINE = ["-m", "lmshm.integrations.vllm_engine"]
CHUNK = 32

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    if not VLLM_PYTHON.exists():
        if os.environ.get("LMSHM_SKIP_VLLM") == "1":
            pytest.skip("LMSHM_SKIP_VLLM=1: the real-vLLM tests are off")
        pytest.fail(f"{VLLM_PYTHON} is missing: run scripts/bootstrap-vllm (scripts/test does), "
                    "or set LMSHM_SKIP_VLLM=1 to skip the real-engine tests")
    path = tmp_path_factory.mktemp("tiny-llama") / "model"
    subprocess.run([str(VLLM_PYTHON), *ENGINE, "build", str(path)], check=True, timeout=300,
                   env=_env(str(path.parent)), capture_output=True)
    return str(path)


def _env(tmpdir: str, multiprocess: bool = False) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TMPDIR": tmpdir,
           "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0"}
    env.pop("PYTHONPATH", None)
    return env


def prompts() -> dict[str, list[int]]:
    r = random.Random(7)
    p1 = [r.randrange(1, 500) for _ in range(700)]
    return {"long": p1,
            "shares_400": p1[:400] + [r.randrange(1, 500) for _ in range(300)],  # a 400-token common prefix
            "other": [r.randrange(1, 500) for _ in range(250)]}


class Engine:
    """One engine process serving batches of prompts (see lmshm/integrations/vllm_engine.py)."""

    def __init__(self, model: str, url: str, tmp: Path, *batches: list[list[int]], name: str = "engine",
                 multiprocess: bool = False, extra: tuple[str, ...] = ()) -> None:
        self.tmp, self.name = tmp, name
        self.sync = tmp / f"{name}-sync"
        self.sync.mkdir()
        files = []
        for i, batch in enumerate(batches):
            f = tmp / f"{name}-batch{i}.json"
            f.write_text(json.dumps(batch))
            files += ["--batch", str(f)]
        self.out = tmp / f"{name}-out.json"
        self.log_path = tmp / f"{name}.log"
        self.proc = subprocess.Popen(
            [str(VLLM_PYTHON), *ENGINE, "serve", model, url, str(self.out), *files, "--sync", str(self.sync),
             "--chunk-tokens", str(CHUNK), *extra],
            stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, env=_env(str(tmp), multiprocess))

    def log(self) -> str:
        return self.log_path.read_text()[-6000:]

    def wait_ready(self, i: int, timeout_s: float = 300) -> None:
        wait_for(lambda: (self.sync / f"ready-{i}").exists() or self.proc.poll() is not None, timeout_s,
                 what=f"{self.name} to finish batch {i - 1}")
        assert self.proc.poll() is None, f"{self.name} exited {self.proc.returncode}:\n{self.log()}"

    def go(self, i: int) -> None:
        (self.sync / f"go-{i}").touch()

    def results(self, timeout_s: float = 400, *, warnings: bool = False) -> list[list[dict]]:
        """Every batch's results. ``warnings``: lmshm may warn (its server went away)."""
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.name} did not finish in {timeout_s} s:\n{self.log()}") from None
        assert rc == 0, f"{self.name} exited {rc}:\n{self.log()}"
        log = self.log_path.read_text()
        # vLLM logs a harmless traceback of its chat-template warmup (no tokenizer); none may pass lmshm
        assert "/lmshm/" not in log, self.log()
        assert warnings or "lmshm: " not in log.replace("lmshm: connected", ""), self.log()
        return json.loads(self.out.read_text())


def run(model: str, url: str, tmp: Path, batch: list[list[int]], **kw) -> list[dict]:
    return Engine(model, url, tmp, batch, **kw).results()[0]


@pytest.fixture
def sockets():
    """The server's socket files: scratch_dir checks that it removes them."""
    with scratch_dir() as path:
        yield path


@pytest.fixture
def tmp():
    """The engines' files and TMPDIR (short: vLLM puts Unix sockets there)."""
    path = Path(tempfile.mkdtemp(prefix="lmshm-v-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def server(sockets):
    s = ServerProcess(sockets, "--capacity", "256MiB", "--reap-timeout", "5")
    yield s
    if s.alive:
        assert s.stop() == 0, s.log()


def assert_torn_down(server: ServerProcess, before: set[str]) -> None:
    wait_for(lambda: not query_status(server.url).registrations, 15, what="the engines' registrations to go")
    wait_for(lambda: not (lmshm_segments() - before), 15, what="the engines' segments to go")


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


def test_corrupted_loaded_kv_changes_the_output(model, server, tmp):
    """The control: the same hits, but the loaded blocks overwritten with noise in the engine."""
    p = prompts()
    batch = [p["long"], p["other"]]
    a = run(model, server.url, tmp, batch, name="A")
    c = run(model, server.url, tmp, batch, name="C", extra=("--corrupt",))
    assert all(r["cached"] >= 0.8 * r["prompt"] for r in c), c
    for ra, rc in zip(a, c):
        assert ra["output"] != rc["output"], "outputs unchanged although every loaded block was noise"


def test_a_failed_load_is_recomputed_never_served_wrong(model, server, tmp):
    """Every RETRIEVE fails in engine F: vLLM must recompute those blocks (kv_load_failure_policy
    "recompute", which the connector sets) and answer exactly as engine A did."""
    p = prompts()
    batch = [p["long"], p["other"]]
    a = run(model, server.url, tmp, batch, name="A")
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
