"""The core's clock (``lmshm/core/clock.py``), and the core's timed work running on it with no
endpoint at all: lease expiry and the orphan sweep in a process that never imports ZeroMQ."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

import pytest

from lmshm.core.clock import Clock

SHM = "/dev/shm"


def _until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


@pytest.fixture
def clock():
    c = Clock("test-clock")
    yield c
    c.stop()
    assert not c.running


def test_a_periodic_job_runs_again_and_again_on_the_clock_thread(clock):
    threads: list[str] = []
    clock.every(0.01, lambda: threads.append(threading.current_thread().name), name="tick")
    clock.start()
    assert _until(lambda: len(threads) >= 5)
    assert set(threads) == {"test-clock"}


def test_a_one_shot_job_runs_once_after_its_delay(clock):
    ran: list[float] = []
    t0 = time.monotonic()
    clock.after(0.1, lambda: ran.append(time.monotonic() - t0), name="once")
    clock.start()
    assert _until(lambda: ran)
    time.sleep(0.2)
    assert len(ran) == 1 and ran[0] >= 0.1


def test_a_job_that_raises_is_logged_keeps_its_schedule_and_does_not_stop_the_others(clock, caplog):
    failures, others = [], []

    def broken():
        failures.append(1)
        raise RuntimeError("boom")

    clock.every(0.01, broken, name="broken job")
    clock.every(0.01, lambda: others.append(1), name="healthy job")
    with caplog.at_level(logging.ERROR, logger="lmshm.clock"):
        clock.start()
        assert _until(lambda: len(failures) >= 3 and len(others) >= 3)
    assert "the broken job job failed" in caplog.text and "RuntimeError: boom" in caplog.text


def test_a_cancelled_timer_never_runs_again(clock):
    runs: list[int] = []
    timer = clock.every(0.01, lambda: runs.append(1), name="cancelled")
    clock.start()
    assert _until(lambda: runs)
    timer.cancel()
    time.sleep(0.03)  # a run that had started when cancel() came may still finish
    seen = len(runs)
    time.sleep(0.1)
    assert len(runs) == seen and "cancelled" in repr(timer)


def test_stop_waits_for_the_running_job_and_nothing_runs_after_it():
    clock = Clock("test-clock")
    started, finished, runs = threading.Event(), threading.Event(), []

    def slow():
        runs.append(1)
        started.set()
        time.sleep(0.2)
        finished.set()

    clock.every(0.01, slow, name="slow")
    clock.start()
    assert started.wait(5)
    clock.stop()
    assert finished.is_set(), "stop() returned while the job was still running"
    count = len(runs)
    time.sleep(0.1)
    assert len(runs) == count and not clock.running
    with pytest.raises(RuntimeError, match="was stopped"):
        clock.after(0, lambda: None, name="late")


def test_an_interval_must_be_positive(clock):
    with pytest.raises(ValueError, match="interval must be positive"):
        clock.every(0, lambda: None, name="busy loop")


# ---- the core's timed work, with no endpoint -------------------------------------------------

_ORPHAN = """
import sys, torch
from lmshm import empty_shared
from lmshm.platform.cpu import segment_of
t = empty_shared((1024,), torch.float16, kind="shm")   # a name, for the orphan sweep
print(segment_of(t).name, flush=True)
sys.stdin.read()
"""

_CORE_ALONE = r"""
import json, os, sys, threading, time, types
from lmshm.core.config import CoreConfig
from lmshm.wire.protocol import Lookup
from lmshm.core.pool import Reservation
from lmshm.core.service import Core

def gone(name, timeout_s):
    deadline = time.monotonic() + timeout_s
    while os.path.exists(f"/dev/shm/{name}") and time.monotonic() < deadline:
        time.sleep(0.01)
    return not os.path.exists(f"/dev/shm/{name}")

out = {}
core = Core(CoreConfig(capacity=1 << 20, lease_ttl_s=0.3, sweep_interval_s=0.2)).start()
out["threads"] = sorted(t.name for t in threading.enumerate())
out["swept_at_start"] = gone(sys.argv[1], 0)
print("started", flush=True)
later = sys.stdin.readline().strip()            # an orphan made after the start
out["swept_later"] = gone(later, 5)

uid = os.geteuid()
session = types.SimpleNamespace(id=1, peer=types.SimpleNamespace(uid=uid))
outcome, obj = core.dataplane.pool.reserve(uid, b"key", 64, b"L", 1)
assert outcome == Reservation.STORED
core.dataplane.pool.commit([obj])
reply = core.dataplane.lookup(session, Lookup([[b"key"]], ttl_s=0.3), (b"id", b"rid"))
out["hits"], out["leases_held"] = reply.hits, core.pool_info().leases
t0 = time.monotonic()
while core.pool_info().leases and time.monotonic() - t0 < 5:
    time.sleep(0.01)
out["lease_ended_after_s"] = round(time.monotonic() - t0, 3)
out["leases_left"] = core.pool_info().leases
out["loaded"] = sorted(m for m in sys.modules if m == "zmq" or m.startswith(
    ("zmq.", "lmshm.transport", "lmshm.settings", "lmshm.endpoints", "lmshm.integrations", "lmshm.server")))
out["released"] = core.shutdown()
out["threads_after"] = sorted(t.name for t in threading.enumerate())
print(json.dumps(out), flush=True)
"""


def _orphan() -> str:
    """A segment whose creator was SIGKILLed before anyone registered it."""
    proc = subprocess.Popen([sys.executable, "-c", _ORPHAN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        name = proc.stdout.readline().strip()
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stdin.close()
    assert name and os.path.exists(os.path.join(SHM, name))
    return name


def test_the_core_alone_expires_leases_and_sweeps_orphans_without_any_endpoint():
    first = _orphan()
    core = subprocess.Popen([sys.executable, "-c", _CORE_ALONE, first], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert core.stdout.readline().strip() == "started", core.stderr.read()
        later = _orphan()
        out, err = core.communicate(later + "\n", timeout=60)
    finally:
        if core.poll() is None:
            core.kill()
            core.wait()
    assert core.returncode == 0, err
    result = json.loads(out)
    assert result["loaded"] == [], "the core imported what sits above it"
    assert "lmshm-clock" in result["threads"]
    assert result["swept_at_start"] and result["swept_later"], result
    assert (result["hits"], result["leases_held"]) == (1, 1)
    assert result["leases_left"] == 0 and result["lease_ended_after_s"] < 2.0, result
    assert result["threads_after"] == ["MainThread"], "shutdown() left a thread behind"
    for name in (first, later):
        assert not os.path.exists(os.path.join(SHM, name))
