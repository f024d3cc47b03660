"""Isolated mode: CPU memory travels as memfd file descriptors over the fd side channel."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest
from harness import wait_for

from lmshm.transport.client import query_status

ISOLATED = {"LMSHM_ISOLATED_IPC": "1"}


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_isolated_worker_registers_memfd_and_the_server_reads_its_bytes(start_server, start_worker):
    server = start_server("--isolated-ipc", "--reap-timeout", "5")
    fds_idle = _open_fds(server.proc.pid)
    worker = start_worker(server.url, env=ISOLATED)
    iid = worker.ok("register", layers=6, layout="per-layer")["instance_id"]
    [row] = query_status(server.url).registrations
    assert row.kinds == ["cpu-memfd"] and row.num_layers == 6
    worker.ok("fill", instance_id=iid, layer="model.layers.5.attn", bytes=[5, 4, 3, 2, 1])
    assert worker.ok("peek", instance_id=iid, layer="model.layers.5.attn")["bytes"][:5] == [5, 4, 3, 2, 1]

    worker.kill()
    wait_for(lambda: not query_status(server.url).registrations, 2, 0.01, "reclaim")
    # Every received fd and the link were closed with the session (mappings too: none left).
    wait_for(lambda: _open_fds(server.proc.pid) <= fds_idle, 2, 0.02, "the server's fds to be closed")
    assert query_status(server.url).mappings == 0


def _unshare_works() -> str:
    if os.geteuid() != 0:
        return "needs root to mount a private /dev/shm in a new mount namespace"
    if shutil.which("unshare") is None:
        return "the unshare command is not installed"
    probe = subprocess.run(["unshare", "--mount", "--ipc", "--fork", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /dev/shm && test -z \"$(ls /dev/shm)\""],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"unshare --mount --ipc is not permitted here: {probe.stderr.strip()[:200]}"
    return ""


def test_isolated_worker_in_its_own_mount_and_ipc_namespace_works_end_to_end(start_server, start_worker):
    reason = _unshare_works()
    if reason:
        pytest.skip(reason)
    server = start_server("--isolated-ipc", "--reap-timeout", "5")
    # The worker gets a private /dev/shm (a fresh tmpfs) and its own System V IPC namespace:
    # it shares no shared-memory name with the server, only the fd socket's path.
    prefix = ["unshare", "--mount", "--ipc", "--fork", "sh", "-c",
              'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$0" "$@"']
    worker = start_worker(server.url, env=ISOLATED, prefix=prefix)
    iid = worker.ok("register", layers=4, layout="one")["instance_id"]
    worker.ok("fill", instance_id=iid, layer="model.layers.2.attn", bytes=[0xAB, 0xCD])
    assert worker.ok("peek", instance_id=iid, layer="model.layers.2.attn")["bytes"][:2] == [0xAB, 0xCD]
    [row] = query_status(server.url).registrations
    assert row.kinds == ["cpu-memfd"]
    t0 = time.monotonic()
    worker.kill()
    wait_for(lambda: not query_status(server.url).registrations, 2, 0.01, "reclaim")
    assert time.monotonic() - t0 < 1.0


def test_named_shm_worker_in_a_private_dev_shm_is_refused_with_the_reason(start_server, start_worker):
    reason = _unshare_works()
    if reason:
        pytest.skip(reason)
    server = start_server("--reap-timeout", "5")
    prefix = ["unshare", "--mount", "--ipc", "--fork", "sh", "-c",
              'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$0" "$@"']
    worker = start_worker(server.url, prefix=prefix, env={"LMSHM_CPU_SEGMENTS": "shm"})
    reply = worker.call("register", layers=2)
    assert reply["error"] == "InvalidArgument" and "does not exist" in reply["message"]
    assert "isolated mode" in reply["message"] and "memfd" in reply["message"]
    assert query_status(server.url).registrations == []
