"""Summarise the per-STORE phase stamps that store-phases.patch writes (a throwaway measurement).

    git apply docs/design/experiments/store-phases.patch
    mkdir -p /tmp/trace && LMSHM_TRACE_DIR=/tmp/trace PYTHONPATH=$PWD .venv/bin/python \
        bench/kv_events_overhead.py --sessions 4 --rounds 8 --lookups 2 --pace-ms 10 --interleave \
        --server-time --sizes "256 KiB"
    python3 docs/design/experiments/store-phases-summary.py /tmp/trace
    git checkout lmshm/core/dataplane.py

The patch applies to main from 020c750 on, where a STORE's adverts are queued on the request
loop before the job is handed over: its "advertise" phase is then empty, and their cost is in
"queue". (The patch as it was, against 52ece5a, is in git history.)

Each server process wrote one line per STORE: advertised (1.0 or 0.0), then monotonic stamps:
the copy job made (the request decoded and checked, on the loop), the job started (on a
copier thread), the adverts queued, the copy job done, the reply handed to the loop, and within
the copy: reserved, copied, committed. The bench starts three servers per session (on, off, a
second off), so the files are taken three at a time in pid order. Prints each session's median
per phase, on / mean of the two offs, in µs, and the median over sessions of on minus off.
"""

from __future__ import annotations

import glob
import os
import statistics
import sys

PHASES = ("queue", "advertise", "reserve", "copy", "commit", "tail", "reply", "total")
WARMUP = 5      # each server's first STOREs (connections, first-touch pages)


def phases(path: str) -> tuple[bool, dict[str, float]]:
    """``(advertised, median µs per phase)`` of one server's file."""
    with open(path) as f:
        rows = [list(map(float, line.split())) for line in f]
    out: dict[str, list[float]] = {p: [] for p in PHASES}
    for _, made, start, told, job_done, replied, reserved, copied, committed in (r[:9] for r in rows[WARMUP:]):
        for name, took in zip(PHASES, (start - made, told - start, reserved - told, copied - reserved,
                                        committed - copied, job_done - committed, replied - job_done,
                                        replied - made)):
            out[name].append(took)
    return rows[0][0] == 1.0, {p: statistics.median(v) * 1e6 for p, v in out.items()}


def main() -> None:
    directory = sys.argv[1] if len(sys.argv) > 1 else "/tmp/trace"
    files = sorted(glob.glob(os.path.join(directory, "*.txt")), key=lambda f: int(os.path.basename(f)[:-4]))
    diffs: dict[str, list[float]] = {p: [] for p in PHASES}
    for s in range(0, len(files) - 2, 3):
        on, off = [], []
        for f in files[s:s + 3]:
            advertised, med = phases(f)
            (on if advertised else off).append(med)
        line = []
        for p in PHASES:
            base = statistics.mean(m[p] for m in off)
            diffs[p].append(on[0][p] - base)
            line.append(f"{p} {on[0][p]:.0f}/{base:.0f}")
        print("session: " + ", ".join(line))
    print("median of on - off, µs: " + ", ".join(f"{p} {statistics.median(v):+.1f}" for p, v in diffs.items()))


if __name__ == "__main__":
    main()
