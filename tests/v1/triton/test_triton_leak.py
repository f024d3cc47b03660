"""Triton's leak test, against lmshm: register/unregister cycles over each client, with the
server's RSS and fd count flat (at most 2 % growth after a warm-up), its mappings as they were.
30,000 cycles per client by default (about a minute here; 100,000 took four, a fifth of CI);
``LMSHM_LEAK_CYCLES=100000`` runs Triton's own count. A leaked fd or mapping shows in the first
cycle; what 30,000 cycles can miss is a leak under about 200 bytes a cycle (2 % of the RSS).

The HTTP and the gRPC client run their cycles at the same time, each on its own thread against
the one server: the same cycles per protocol in about half the time, and the server
also shows that interleaved requests of both endpoints leave nothing behind."""

from __future__ import annotations

import os
import threading
import time

from triton_harness import Triton

CYCLES = int(os.environ.get("LMSHM_LEAK_CYCLES", "30000"))
WARMUP = 5000
MAX_GROWTH = 0.02
PROTOCOLS = ("http", "grpc")


def test_register_unregister_cycles_per_protocol_leave_rss_fds_and_mappings_flat(app, shm):
    key, _ = shm(1 << 16)
    clients = {p: Triton(p, app) for p in PROTOCOLS}
    elapsed: dict[str, float] = {}
    errors: list[BaseException] = []
    warm = threading.Barrier(len(PROTOCOLS) + 1)
    go = threading.Barrier(len(PROTOCOLS) + 1)

    def cycles(protocol: str) -> None:
        client = clients[protocol].client
        register, unregister = client.register_system_shared_memory, client.unregister_system_shared_memory
        name = f"leak-{protocol}"
        try:
            for _ in range(WARMUP):
                register(name, key, 4096, offset=4096)
                unregister(name)
        except BaseException as exc:
            errors.append(exc)
        try:
            warm.wait(600)
            go.wait(600)
        except threading.BrokenBarrierError:     # the test thread gave up: it reports why
            return
        started = time.monotonic()
        try:
            if not errors:
                for _ in range(CYCLES):
                    register(name, key, 4096, offset=4096)
                    unregister(name)
        except BaseException as exc:
            errors.append(exc)
        elapsed[protocol] = time.monotonic() - started

    threads = [threading.Thread(target=cycles, args=(p,), name=f"leak-{p}") for p in PROTOCOLS]
    try:
        for t in threads:
            t.start()
        warm.wait(600)
        rss0, fds0, mappings0 = app.rss_kb(), app.fd_count(), app.ok("status")["mappings"]
        go.wait(60)
        for t in threads:
            t.join()
        assert not errors, errors
        rss1, fds1, status = app.rss_kb(), app.fd_count(), app.ok("status")
    except BaseException:
        warm.abort()
        go.abort()
        raise
    finally:
        for c in clients.values():
            c.close()
    for p in PROTOCOLS:
        print(f"{p}: {CYCLES} cycles in {elapsed[p]:.1f} s ({elapsed[p] / CYCLES * 1e6:.0f} us each), "
              f"beside the other protocol's")
    print(f"RSS {rss0} -> {rss1} kB, fds {fds0} -> {fds1}")
    assert rss1 <= rss0 * (1 + MAX_GROWTH), (rss0, rss1)
    assert fds1 <= fds0 * (1 + MAX_GROWTH), (fds0, fds1)
    assert status["mappings"] == mappings0 and status["draining"] == 0
    assert not [r for r in status["registrations"] if r[1] == "system"]
