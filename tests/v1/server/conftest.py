"""Fixtures for the service tests: servers, workers and the leak guards.

Guards: every test must leave no ``lmshm-`` entry in /dev/shm, no fd-socket or ipc socket
file, and no process it started. The process helpers are in harness.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from harness import SHM_DIR, ServerProcess, WorkerProcess, exit_all, lmshm_segments, scratch_dir, serving


@pytest.fixture
def tmp() -> Path:
    with scratch_dir() as path:
        yield path


def _stop_cleanly(server: ServerProcess) -> None:
    if server.alive:
        rc = server.stop()
        assert rc == 0, f"lmshm-server exited {rc}:\n{server.log()}"


@pytest.fixture(scope="module")
def shared_server():
    """One server for a whole module, for tests that leave it as they found it."""
    with serving("--reap-timeout", "5") as server:
        yield server


@pytest.fixture
def start_server(tmp):
    """Start servers; at teardown each must stop on SIGTERM with exit status 0."""
    servers: list[ServerProcess] = []

    def start(*args: str, **kw: Any) -> ServerProcess:
        server = ServerProcess(tmp, *args, **kw)
        servers.append(server)
        return server

    yield start
    for server in servers:
        _stop_cleanly(server)


@pytest.fixture
def server(start_server) -> ServerProcess:
    return start_server("--reap-timeout", "5")


@pytest.fixture
def start_worker(start_server):
    """Start workers; at teardown they exit side by side, before the servers stop (a worker
    leaving a stopped server waits out its timeouts)."""
    workers: list[WorkerProcess] = []

    def start(url: str, *args: str, **kw: Any) -> WorkerProcess:
        worker = WorkerProcess(url, *args, **kw)
        workers.append(worker)
        return worker

    yield start
    exit_all(workers)


@pytest.fixture(autouse=True)
def no_segment_outlives_a_test():
    before = lmshm_segments()
    yield
    deadline = time.monotonic() + 5  # a worker that just exited may still be unlinking
    while (leaked := lmshm_segments() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not leaked, f"lmshm segments left in {SHM_DIR}: {sorted(leaked)}"
