"""Reclaim: a dead, disconnected or silent worker's registrations are released, promptly."""

from __future__ import annotations

import time

import pytest
from harness import lmshm_segments, raw_exchange, serving, wait_for

from lmshm.transport.client import query_status
from lmshm.wire import codec, protocol


@pytest.fixture(scope="module")
def fast_reap_server():
    """Sessions silent for 0.5 s are reaped; workers beat every 0.1 s."""
    with serving("--reap-timeout", "0.5", "--auth-timeout", "0.5") as server:
        yield server


def _reclaim_seconds(server, worker, iid: str) -> float:
    t0 = time.monotonic()
    worker.kill()  # SIGKILL
    wait_for(lambda: all(r.instance_id != iid for r in query_status(server.url).registrations),
             5, 0.005, f"{iid} to be reclaimed")
    return time.monotonic() - t0


@pytest.mark.parametrize("segments", ["memfd", "shm"])
@pytest.mark.parametrize("layout", ["one", "per-layer"])
def test_killed_worker_is_reclaimed_within_one_second_with_nothing_left_in_dev_shm(
        fast_reap_server, start_worker, layout, segments):
    worker = start_worker(fast_reap_server.url, env={"LMSHM_CPU_SEGMENTS": segments})
    reg = worker.ok("register", layers=8, layout=layout)
    # named segments are files the server must unlink for the dead worker; memfds have no name
    assert set(reg["segments"]) <= lmshm_segments() if segments == "shm" else not set(reg["segments"]) & lmshm_segments()
    elapsed = _reclaim_seconds(fast_reap_server, worker, reg["instance_id"])
    assert elapsed < 1.0, f"reclaimed after {elapsed:.3f} s"
    assert not set(reg["segments"]) & lmshm_segments(), "the dead worker's segments are still in /dev/shm"
    status = query_status(fast_reap_server.url)
    assert status.mappings == 0 and status.sessions == 0
    assert f"reclaimed '{reg['instance_id']}'" in fast_reap_server.log()


def test_a_session_that_never_proves_its_identity_is_dropped(fast_reap_server):
    # A bare HELLO and no fd-channel link: the session can never register; it goes after
    # --auth-timeout (0.5 s here).
    hello = codec.encode(protocol.Hello(protocol_version=protocol.PROTOCOL_VERSION, isolated_ipc=False))
    assert raw_exchange(fast_reap_server.url, [b"\x00" * 8, hello]) is not None
    assert query_status(fast_reap_server.url).sessions == 1
    t0 = time.monotonic()
    wait_for(lambda: query_status(fast_reap_server.url).sessions == 0, 3, 0.02, "the unverified session to go")
    assert 0.3 < time.monotonic() - t0 < 1.5
    assert "identity not proven on the fd channel within 0.5 s" in fast_reap_server.log()


def test_a_pid_watched_worker_is_never_reaped_for_being_silent(fast_reap_server, start_worker):
    # No heartbeat at all, three reap timeouts: the pidfd says it lives, so it stays.
    worker = start_worker(fast_reap_server.url, "--heartbeat", "1000")
    iid = worker.ok("register", layers=2)["instance_id"]
    time.sleep(1.6)
    assert [r.instance_id for r in query_status(fast_reap_server.url).registrations] == [iid]
    worker.ok("unregister", instance_id=iid)


def test_client_close_releases_its_registrations(fast_reap_server, start_worker):
    worker = start_worker(fast_reap_server.url)
    worker.ok("register", layers=2)
    worker.ok("register", layers=2)
    assert len(query_status(fast_reap_server.url).registrations) == 2
    worker.ok("close")
    status = query_status(fast_reap_server.url)
    assert status.registrations == [] and status.mappings == 0
