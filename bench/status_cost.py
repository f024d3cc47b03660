"""What one ``lmshm status`` costs: wall time and peak memory of the whole process.

Starts an ``lmshm-server`` on a free port, then runs ``python -m lmshm.cli status --url URL``
N times, each as a fresh process, and a bare ``python -c pass`` as many times for reference.
Wall time is measured from spawn to exit; memory is the child's max RSS from ``os.wait4``.
The server is stopped with SIGTERM at the end.

    python bench/status_cost.py [-n 20] [--python PYTHON]

Measure another checkout by putting it first on the path (children inherit PYTHONPATH):

    cd /path/to/other && PYTHONPATH=$PWD /path/to/python /path/to/bench/status_cost.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import parse_args
from _server import BenchServer


def run_once(cmd: list[str]) -> tuple[float, float]:
    """(wall ms, max RSS MB) of one run of ``cmd``, which must exit 0."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall_ms = (time.perf_counter() - t0) * 1000
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited with {proc.returncode}")
    return wall_ms, usage.ru_maxrss / 1024  # ru_maxrss is in KiB on Linux


def report(label: str, runs: list[tuple[float, float]]) -> str:
    walls = [w for w, _ in runs]
    rss = [r for _, r in runs]
    return (f"{label:<16} wall ms: median {statistics.median(walls):7.1f}  min {min(walls):7.1f}  "
            f"max {max(walls):7.1f}   max RSS MB: median {statistics.median(rss):6.1f}  max {max(rss):6.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=20, help="runs of each command (default 20)")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the children")
    args = parse_args(parser, smoke={"n": 2})

    import lmshm  # say which checkout is measured; the children resolve it the same way

    with BenchServer(python=args.python, quiet=True) as server:
        status_cmd = [args.python, "-m", "lmshm.cli", "status", "--url", server.url]
        bare_cmd = [args.python, "-c", "pass"]
        run_once(status_cmd)  # warm the page cache and the server once, unmeasured
        status_runs, bare_runs = [], []
        for _ in range(args.n):  # interleaved, so both see the same machine load
            status_runs.append(run_once(status_cmd))
            bare_runs.append(run_once(bare_cmd))

    print(f"lmshm from {os.path.dirname(lmshm.__file__)}, {args.n} runs each, python {sys.version.split()[0]}")
    print(report("lmshm status", status_runs))
    print(report("python -c pass", bare_runs))


if __name__ == "__main__":
    main()
