"""Triton's leak test, against lmshm: 100,000 register/unregister cycles over each client,
with the server's RSS and fd count flat (at most 2 % growth after a warm-up)."""

from __future__ import annotations

import os
import time

import pytest
from triton_harness import Triton

CYCLES = int(os.environ.get("LMSHM_LEAK_CYCLES", "100000"))
WARMUP = 5000
MAX_GROWTH = 0.02


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_100k_register_unregister_cycles_leave_rss_and_fds_flat(app, shm, protocol):
    key, _ = shm(1 << 16)
    c = Triton(protocol, app)
    register, unregister = c.client.register_system_shared_memory, c.client.unregister_system_shared_memory
    try:
        for _ in range(WARMUP):
            register("leak", key, 4096, offset=4096)
            unregister("leak")
        rss0, fds0, mappings0 = app.rss_kb(), app.fd_count(), app.ok("status")["mappings"]
        started = time.monotonic()
        for i in range(CYCLES):
            register("leak", key, 4096, offset=4096)
            unregister("leak")
        elapsed = time.monotonic() - started
        rss1, fds1, status = app.rss_kb(), app.fd_count(), app.ok("status")
    finally:
        c.close()
    print(f"{protocol}: {CYCLES} cycles in {elapsed:.1f} s ({elapsed / CYCLES * 1e6:.0f} us each); "
          f"RSS {rss0} -> {rss1} kB, fds {fds0} -> {fds1}")
    assert rss1 <= rss0 * (1 + MAX_GROWTH), (rss0, rss1)
    assert fds1 <= fds0 * (1 + MAX_GROWTH), (fds0, fds1)
    assert status["mappings"] == mappings0 and status["draining"] == 0
    assert not [r for r in status["registrations"] if r[1] == "system"]
