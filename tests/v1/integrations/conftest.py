import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# The server tests' process helpers (tests/v1/server) (ServerProcess, scratch_dir, wait_for).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from harness import ServerProcess, scratch_dir
from vllm_harness import build_model


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> str:
    """A tiny random Llama (vllm_harness.build_model), built once per session."""
    return build_model(tmp_path_factory.mktemp("tiny-llama") / "model")


@pytest.fixture(scope="session")
def hybrid_model(tmp_path_factory) -> str:
    """A tiny random Gemma-3-style model: three sliding-window layers and one full-attention layer."""
    return build_model(tmp_path_factory.mktemp("tiny-gemma3") / "model", hybrid=True)


@pytest.fixture
def sockets():
    """The server's socket files: scratch_dir checks that it removes them."""
    with scratch_dir() as path:
        yield path


def _vllm_cpu_shm() -> set[Path]:
    return set(Path("/dev/shm").glob("vllm_dist_*-cpushm*"))


@pytest.fixture
def tmp():
    """The engines' files and TMPDIR (short: vLLM puts Unix sockets there).

    vLLM's CPU tensor-parallel communicator (its C++ shm manager, cpu_communicator.py) never
    unlinks its /dev/shm segments, even when the engine exits cleanly: the ones our engines
    created are removed here, so that nothing we started outlives the test."""
    before = _vllm_cpu_shm()
    path = Path(tempfile.mkdtemp(prefix="lmshm-v-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
    for leftover in _vllm_cpu_shm() - before:
        leftover.unlink(missing_ok=True)


@pytest.fixture
def server(sockets):
    s = ServerProcess(sockets, "--capacity", "256MiB", "--reap-timeout", "5")
    yield s
    if s.alive:
        assert s.stop() == 0, s.log()
