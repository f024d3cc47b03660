"""Fixtures for the Triton-protocol tests (helpers in triton_harness.py): one application that
embeds ``lmshm.Server`` per module, stock tritonclient clients over HTTP and gRPC, and
shared-memory objects made by ``tritonclient.utils.shared_memory``.

Every test leaves the server as it found it: no region registered, nothing draining, and the
test's shm objects removed (by the test process, which created them: the server never does).
"""

from __future__ import annotations

import os
import secrets
from typing import Any

import pytest
from triton_harness import EmbeddedApp, Triton


@pytest.fixture(scope="module")
def app():
    app = EmbeddedApp()
    yield app
    assert app.stop() == 0, app.log()


@pytest.fixture(params=["http", "grpc"])
def client(request, app):
    c = Triton(request.param, app)
    yield c
    try:
        c.unregister()
        c.unregister_cuda()
    finally:
        c.close()
    status = app.ok("status")
    assert status["draining"] == 0 and not [r for r in status["registrations"] if r[1] != "kv"], status


@pytest.fixture
def shm():
    """``shm(byte_size)`` -> (key, handle): a region object made with tritonclient's own helper;
    destroyed (unlinked by its creator, this process) at teardown."""
    import tritonclient.utils.shared_memory as shared_memory

    made: list[Any] = []

    def make(byte_size: int = 1 << 16) -> tuple[str, Any]:
        key = f"/lmshm_test_{secrets.token_hex(6)}"
        handle = shared_memory.create_shared_memory_region(key.lstrip("/"), key, byte_size)
        made.append((key, handle))
        return key, handle

    yield make
    for key, handle in made:
        shared_memory.destroy_shared_memory_region(handle)
        assert not os.path.exists(f"/dev/shm/{key.lstrip('/')}")
