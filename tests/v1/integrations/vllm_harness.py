"""Helpers of the real-vLLM tests: engine processes in .venv-vllm, tiny models built on the spot.

The engines run ``tools/vllm_engine.py`` in ``.venv-vllm`` (``scripts/bootstrap-vllm``;
``scripts/test`` makes it), with vLLM's own prefix caching off, so every cached token came through
lmshm. The fixtures (``conftest.py``): ``model`` (a tiny random Llama), ``hybrid_model`` (a tiny
Gemma-3-style model with sliding-window and full-attention layers), ``server``, ``tmp``, ``sockets``.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest
from harness import ServerProcess, lmshm_segments, wait_for

import lmshm
from lmshm.transport.client import query_status

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = Path(os.environ.get("LMSHM_VLLM_VENV", ROOT / ".venv-vllm")) / "bin" / "python"
ENGINE = [str(ROOT / "tools" / "vllm_engine.py")]
#: lmshm's own source directory, as a traceback names its frames: the engine's venv holds lmshm
#: editable, so its frames are here. Only this may not appear in an engine's log; a bare
#: "/lmshm/" would also match every path of a clone named lmshm (its .venv-vllm included).
LMSHM_FRAMES = f'File "{Path(lmshm.__file__).resolve().parent}/'

CHUNK = 32

def build_model(path: Path, hybrid: bool = False) -> str:
    """A tiny random model in ``path`` (see ``vllm_engine build``); skips or fails without .venv-vllm."""
    if not VLLM_PYTHON.exists():
        if os.environ.get("LMSHM_SKIP_VLLM") == "1":
            pytest.skip("LMSHM_SKIP_VLLM=1: the real-vLLM tests are off")
        pytest.fail(f"{VLLM_PYTHON} is missing: run scripts/bootstrap-vllm (scripts/test does), "
                    "or set LMSHM_SKIP_VLLM=1 to skip the real-engine tests")
    subprocess.run([str(VLLM_PYTHON), *ENGINE, "build", str(path), *(["--hybrid"] if hybrid else [])], check=True,
                   timeout=300, env=_env(str(path.parent)), capture_output=True)
    return str(path)


def _env(tmpdir: str, multiprocess: bool = False, tp: int = 1) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TMPDIR": tmpdir,
           "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0"}
    if tp > 1:  # one core per rank; vLLM's "auto" binding asserts on a single-NUMA 2-core machine
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % (os.cpu_count() or 1)) for r in range(tp))
    env["PYTHONPATH"] = str(ROOT)    # the engines run this checkout's lmshm, whatever .venv-vllm installed
    return env


def prompts() -> dict[str, list[int]]:
    r = random.Random(7)
    p1 = [r.randrange(1, 500) for _ in range(700)]
    return {"long": p1,
            "shares_400": p1[:400] + [r.randrange(1, 500) for _ in range(300)],  # a 400-token common prefix
            "other": [r.randrange(1, 500) for _ in range(250)]}


class Engine:
    """One engine process serving batches of prompts (see tools/vllm_engine.py)."""

    def __init__(self, model: str, url: str, tmp: Path, *batches: list, name: str = "engine",
                 multiprocess: bool = False, extra: tuple[str, ...] = (), tp: int = 1) -> None:
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
             "--chunk-tokens", str(CHUNK), "--tp", str(tp), *extra],
            stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, env=_env(str(tmp), multiprocess, tp))

    def log(self) -> str:
        return self.log_path.read_text()[-6000:]

    def wait_ready(self, i: int, timeout_s: float = 300) -> None:
        wait_for(lambda: (self.sync / f"ready-{i}").exists() or self.proc.poll() is not None, timeout_s,
                 what=f"{self.name} to finish batch {i - 1}")
        assert self.proc.poll() is None, f"{self.name} exited {self.proc.returncode}:\n{self.log()}"

    def go(self, i: int) -> None:
        (self.sync / f"go-{i}").touch()

    def results(self, timeout_s: float = 600, *, warnings: bool = False) -> list[list[dict]]:
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
        assert LMSHM_FRAMES not in log, self.log()
        assert warnings or "lmshm: " not in log.replace("lmshm: connected", ""), self.log()
        return json.loads(self.out.read_text())["batches"]

    def report(self) -> dict:
        """The whole OUT file: batches, metrics, whether vLLM's hybrid KV cache manager was on."""
        return json.loads(self.out.read_text())


def run(model: str, url: str, tmp: Path, batch: list[list[int]], **kw) -> list[dict]:
    return Engine(model, url, tmp, batch, **kw).results()[0]


def assert_torn_down(server: ServerProcess, before: set[str]) -> None:
    wait_for(lambda: not query_status(server.url).registrations, 15, what="the engines' registrations to go")
    wait_for(lambda: not (lmshm_segments() - before), 15, what="the engines' segments to go")
