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
