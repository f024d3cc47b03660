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


@pytest.fixture(scope="session", autouse=True)
def no_segment_outlives_the_suite():
    before = lmshm_segments()
    yield
    import gc

    gc.collect()
    leaked = lmshm_segments() - before
    assert not leaked, f"lmshm segments left in {SHM_DIR} after the suite: {sorted(leaked)}"
