"""Suite-wide guards: nothing lmshm creates may outlive the test suite. And the wait for the
side environments (.venv-vllm, .venv-sglang) that scripts/test builds while the first tests run."""

from __future__ import annotations

import os
import time

import pytest

SHM_DIR = "/dev/shm"


def lmshm_segments() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith("lmshm-")}
    except FileNotFoundError:
        return set()


def _is_segment(path: str) -> bool:
    """Whether a mapped file or an fd's target is one of lmshm's segments: a named one in
    /dev/shm, or a memfd. Only the segment's own name counts, never a directory above it: a
    clone (and its venvs) may live in a folder whose name starts with "lmshm-"."""
    name = path.rsplit("/", 1)[-1]
    return (path.startswith(SHM_DIR + "/") or path.startswith("/memfd:")) and (
        name.startswith("lmshm-") or name.startswith("memfd:lmshm-"))


def lmshm_mappings() -> list[str]:
    """This process's mappings of lmshm segments (named shm or memfd)."""
    with open("/proc/self/maps") as f:
        paths = [line.split(None, 5)[-1].strip() for line in f if len(line.split(None, 5)) == 6]
    return [p for p in paths if _is_segment(p.removesuffix(" (deleted)"))]


def lmshm_fds() -> list[str]:
    """This process's open fds that point at lmshm segments."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if _is_segment(target.removesuffix(" (deleted)")):
            out.append(f"{fd} -> {target}")
    return out


@pytest.fixture(scope="session", autouse=True)
def nothing_outlives_the_suite():
    before = lmshm_segments()
    yield
    import gc

    gc.collect()
    leaked = lmshm_segments() - before
    assert not leaked, f"lmshm segments left in {SHM_DIR} after the suite: {sorted(leaked)}"
    assert not lmshm_mappings(), f"lmshm segments still mapped by the test process: {lmshm_mappings()}"
    assert not lmshm_fds(), f"fds of lmshm segments still open in the test process: {lmshm_fds()}"


# scripts/test starts both pytest groups once .venv is ready, while it still builds .venv-vllm
# and .venv-sglang (about a minute more), and says so with LMSHM_SIDE_ENVS, a path: it creates
# PATH.ready when both are built, PATH.failed when one is not. The tests that run in those
# environments (marked vllm or sglang) go last in their group, and wait for it.
SIDE_ENVS = os.environ.get("LMSHM_SIDE_ENVS", "")
SIDE_ENVS_WAIT_S = 1200


def _in_side_env(item: pytest.Item) -> bool:
    return item.get_closest_marker("vllm") is not None or item.get_closest_marker("sglang") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if SIDE_ENVS:
        items.sort(key=_in_side_env)        # stable: the order within each part is kept


def pytest_runtest_setup(item: pytest.Item) -> None:
    if not SIDE_ENVS or not _in_side_env(item):
        return
    deadline = time.monotonic() + SIDE_ENVS_WAIT_S
    while not os.path.exists(SIDE_ENVS + ".ready"):
        if os.path.exists(SIDE_ENVS + ".failed"):
            pytest.fail("building .venv-vllm or .venv-sglang failed: scripts/test says which")
        if time.monotonic() > deadline:
            pytest.fail(f".venv-vllm and .venv-sglang were not built within {SIDE_ENVS_WAIT_S} s")
        time.sleep(0.5)
