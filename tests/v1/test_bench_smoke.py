"""Every bench/*.py script runs its ``--smoke`` (bench/_common.py): a few seconds with tiny sizes
through the same code paths, so a refactor cannot break a benchmark silently.

Scripts are found by glob: a new script without ``--smoke`` fails here. Each runs as a
subprocess from the repository root with this checkout first on PYTHONPATH, and must exit 0
and print a table (lines with figures). A script that cannot run on this machine (no GPU, no
vLLM environment) prints ``skipped: <why>`` and exits 77; that becomes a pytest skip with its
reason, never a pass. The scripts run two at a time (the machine has 2 cores), started when
the first test of this module asks, so the module takes about half the sum of their times.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (ROOT / "bench").glob("*.py") if not p.name.startswith("_"))
SKIPPED = 77           # bench/_common.py's SKIPPED
TIMEOUT_S = 120
FIGURE = re.compile(r"\d")


def _run(name: str) -> tuple[subprocess.CompletedProcess, float, float]:
    """``bench/NAME --smoke``: what it printed, and its wall and CPU seconds (its children's too)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, str(ROOT / "bench" / name), "--smoke"]
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL, text=True,
                                start_new_session=True)
        timer = threading.Timer(TIMEOUT_S, lambda: os.killpg(proc.pid, signal.SIGKILL))
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - started
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if wall >= TIMEOUT_S:
        stderr += f"\n(killed after {TIMEOUT_S} s)"
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), wall, usage.ru_utime + usage.ru_stime


@pytest.fixture(scope="module")
def smoke_runs():
    """name -> the future of its ``--smoke`` run; all started at once on 2 threads."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = {name: pool.submit(_run, name) for name in SCRIPTS}
        yield runs
        for f in runs.values():
            f.cancel()


def test_every_bench_script_is_found():
    assert len(SCRIPTS) >= 30, SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_bench_script_smoke_run_prints_its_table(name, smoke_runs):
    done, wall, cpu = smoke_runs[name].result()
    print(f"{name} --smoke: {wall:.1f} s, {cpu:.1f} s of CPU")
    said = f"{name} --smoke exited {done.returncode} after {wall:.1f} s\n--- stdout\n{done.stdout[-4000:]}\n--- stderr\n" \
           f"{done.stderr[-4000:]}"
    if done.returncode == SKIPPED:
        reason = next((line for line in done.stdout.splitlines() if line.startswith("skipped: ")), "")
        assert reason, f"exit status {SKIPPED} without a 'skipped: <why>' line\n{said}"
        pytest.skip(f"{name}: {reason}")
    assert done.returncode == 0, said
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) >= 2 and any(FIGURE.search(line) for line in lines), f"no table printed\n{said}"
