"""A restarted server gets the workers' caches back without the workers doing anything."""

from __future__ import annotations

from harness import wait_for

from lmshm.transport.client import query_status


def test_server_restart_is_followed_by_automatic_reregistration(start_server, start_worker):
    first = start_server("--reap-timeout", "5")
    worker = start_worker(first.url, "--heartbeat", "0.1")
    iid = worker.ok("register", instance_id="survivor", layers=4, layout="one")["instance_id"]
    worker.ok("fill", instance_id=iid, layer="model.layers.3.attn", bytes=[7, 7, 7])
    assert first.stop() == 0
    assert "released 1 registration(s)" in first.log()

    second = start_server("--reap-timeout", "5", url=first.url)  # same endpoint, new server
    status = wait_for(lambda: (s := query_status(second.url)).registrations and s, 10, 0.05,
                      "the worker to re-register")
    [row] = status.registrations
    assert (row.instance_id, row.owner_pid, row.num_layers) == ("survivor", worker.pid, 4)
    # The new server maps the very memory the worker wrote before the restart.
    assert worker.ok("peek", instance_id=iid, layer="model.layers.3.attn")["bytes"][:3] == [7, 7, 7]
    assert worker.ok("registered")["reregistrations"] >= 1
    worker.ok("unregister", instance_id=iid)
    assert query_status(second.url).registrations == []
