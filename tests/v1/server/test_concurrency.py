"""Eight workers registering and unregistering at once: a consistent registry, no leak."""

from __future__ import annotations

import concurrent.futures

from harness import wait_for

from lmshm.transport.client import query_status

WORKERS = 8


def test_eight_workers_register_and_unregister_concurrently_without_leaks(start_server, start_worker):
    server = start_server("--reap-timeout", "5")
    with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
        workers = list(pool.map(lambda k: start_worker(server.url, "--name", f"w{k}"), range(WORKERS)))
        # Bounded in count and in time; half the workers use one segment per layer.
        loops = list(pool.map(
            lambda kw: kw[1].ok("loop", prefix=f"w{kw[0]}", iterations=40, seconds=4.0, layers=8,
                                layout="one" if kw[0] % 2 else "per-layer"),
            enumerate(workers)))
        finals = list(pool.map(lambda kw: kw[1].ok("register", instance_id=f"final-{kw[0]}", layers=3),
                               enumerate(workers)))
    assert all(r["iterations"] > 0 for r in loops), loops

    status = query_status(server.url)
    assert sorted(r.instance_id for r in status.registrations) == sorted(f["instance_id"] for f in finals)
    assert {r.instance_id: r.owner_pid for r in status.registrations} == {
        f"final-{k}": w.pid for k, w in enumerate(workers)}
    assert status.sessions == WORKERS and status.mappings == WORKERS * 3 and status.draining == 0

    for w in workers:
        assert w.exit() == 0
    status = wait_for(lambda: (s := query_status(server.url)).sessions == 0 and s, 5, 0.02, "sessions to end")
    assert status.registrations == [] and status.mappings == 0
