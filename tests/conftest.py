"""Suite-wide guards: nothing lmshm creates may outlive the test suite."""

from __future__ import annotations

import os

import pytest

SHM_DIR = "/dev/shm"


def lmshm_segments() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith("lmshm-")}
    except FileNotFoundError:
        return set()


def lmshm_mappings() -> list[str]:
    """This process's mappings of lmshm segments (named shm or memfd)."""
    with open("/proc/self/maps") as f:
        return [line.split(None, 5)[-1].strip() for line in f if "lmshm-" in line]


def lmshm_fds() -> list[str]:
    """This process's open fds that point at lmshm segments."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "lmshm-" in target:
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
