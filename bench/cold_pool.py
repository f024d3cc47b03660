"""The first STOREs into a cold pool: what each way of getting its pages ready costs them.

    .venv/bin/python bench/cold_pool.py [--runs 3] [--capacity-gib 4] [--gib 1] [--request-mib 256]
        [--start-gap-ms 0] [--idle-ms 0] [--options nothing thp prefault ahead-256 ahead-256-4k ...]

Each option runs in a fresh process (a fresh mapping is cold), one after the other, the options
taking turns going first, round after round (``--runs``), with ``--settle-s`` between them: this
VM's balloon reports freed memory back to the host after about two seconds, so each process
meets memory as cold as a server that just started here. In each process:

- a warm memcpy: ``ctypes.memmove`` of one request between two touched buffers, the median of 3
  (the reference every ratio is taken against: the median over all processes);
- ``Pool(capacity, ...)`` with the option's settings; "ready" is how long the constructor took
  (when the first request could be served);
- ``--start-gap-ms`` later, ``--gib`` GiB of STORE-like requests of ``--request-mib`` each, back
  to back or ``--idle-ms`` apart (an engine's compute between STOREs): per request, one
  ``reserve`` per chunk of ``--chunk-mib``, each chunk copied by two threads (halves, ctypes
  ``memmove``, which drops the GIL: the server's two copy threads), then ``commit``; timed from
  the first reserve to the last commit;
- "warm STORE": the same copies again into the objects just stored (their pages are there now);
- the pool mapping's RSS (``/proc/self/smaps``) right after the requests, and once its
  background thread has finished or gone idle ("settled"): the memory the option committed.

Options: ``nothing`` (4 KiB pages, nothing ahead), ``thp`` (``MADV_HUGEPAGE`` only),
``prefault`` (huge pages, the whole pool populated in the background from the start),
``ahead-N`` (huge pages, ``populate_ahead`` N MiB past the allocator's frontier) and
``ahead-N-4k`` (the same without huge pages). Prints medians over the runs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import parse_args

DEFAULT_OPTIONS = ["nothing", "thp", "prefault", "ahead-64", "ahead-256", "ahead-512", "ahead-256-4k"]


def settings(option: str) -> dict:
    if option == "nothing":
        return dict(huge_pages=False)
    if option == "thp":
        return dict(huge_pages=True)
    if option == "prefault":
        return dict(huge_pages=True, prefault=True)
    parts = option.split("-")
    if parts[0] == "ahead" and len(parts) in (2, 3) and parts[1].isdigit() and parts[2:] in ([], ["4k"]):
        return dict(huge_pages=parts[2:] != ["4k"], populate_ahead=int(parts[1]) << 20)
    raise SystemExit(f"unknown option {option!r}: nothing, thp, prefault, ahead-MIB or ahead-MIB-4k")


def pool_rss(addr: int) -> int:
    """Bytes of the mapping at ``addr`` that are resident."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                inside = int(head.split("-")[0], 16) == addr
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    return 0


def child(args: argparse.Namespace) -> None:
    import torch

    from lmshm.core.pool import Pool, Reservation
    from lmshm.core.pool import memory as pool_memory

    if args.step_mib:
        pool_memory.POPULATE_STEP = args.step_mib << 20

    request, chunk = args.request_mib << 20, args.chunk_mib << 20
    src = torch.ones(request, dtype=torch.uint8)
    dst = torch.zeros(request, dtype=torch.uint8)
    memcpy = []
    for _ in range(3):
        t0 = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), request)
        memcpy.append(time.perf_counter() - t0)
    del dst
    copier = concurrent.futures.ThreadPoolExecutor(2)
    half = chunk // 2

    def copy(objs: list) -> None:
        jobs = []
        for obj in objs:
            base = pool.view(obj).data_ptr()
            for at in (0, half):
                jobs.append(copier.submit(ctypes.memmove, base + at, src.data_ptr() + at, min(half, chunk - at)))
        for job in jobs:
            job.result()

    t0 = time.perf_counter()
    pool = Pool(args.capacity_gib << 30, **settings(args.child))
    pool.expect_stores()            # what the server does at the first KV registration
    ready = time.perf_counter() - t0
    time.sleep(args.start_gap_ms / 1e3)
    times, stored = [], []
    for r in range(int(args.gib * 2**30) // request):
        t0 = time.perf_counter()
        objs = []
        for c in range(request // chunk):
            outcome, obj = pool.reserve(0, f"r{r}c{c}".encode(), chunk, b"L", 1)
            assert outcome == Reservation.STORED
            objs.append(obj)
        copy(objs)
        pool.commit(objs)
        times.append(time.perf_counter() - t0)
        stored.append(objs)
        time.sleep(args.idle_ms / 1e3)
    rss = pool_rss(pool.memory.addr)
    warm = []
    for objs in stored:
        t0 = time.perf_counter()
        copy(objs)
        warm.append(time.perf_counter() - t0)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:          # settled: the background thread done or idle
        if pool.memory.prefaulter is not None and pool.memory.prefaulter.is_alive():
            pass
        elif (ahead := pool.memory.ahead) is not None and ahead.thread.is_alive() and ahead.done < ahead.want:
            pass
        else:
            break
        time.sleep(0.05)
    print(json.dumps(dict(memcpy=statistics.median(memcpy), ready=ready, times=times, warm=statistics.median(warm),
                          rss=rss, rss_settled=pool_rss(pool.memory.addr), prefault_done=pool.memory.prefaulted)))
    pool.release()
    copier.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="rounds; every option runs once per round (default 3)")
    ap.add_argument("--capacity-gib", type=int, default=4, help="the pool's capacity (default 4)")
    ap.add_argument("--gib", type=float, default=1, help="GiB stored, the first requests (default 1)")
    ap.add_argument("--request-mib", type=int, default=256, help="bytes per request (default 256)")
    ap.add_argument("--chunk-mib", type=int, default=32, help="bytes per chunk, one pool object (default 32)")
    ap.add_argument("--start-gap-ms", type=float, default=0, help="from the pool's start to the first request")
    ap.add_argument("--idle-ms", type=float, default=0, help="between requests (default 0: back to back)")
    ap.add_argument("--settle-s", type=float, default=4, help="between processes (default 4)")
    ap.add_argument("--step-mib", type=int, default=0, help="populate_ahead's step (default: the pool's POPULATE_STEP)")
    ap.add_argument("--options", nargs="+", default=DEFAULT_OPTIONS)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = parse_args(ap, smoke={"runs": 1, "capacity_gib": 1, "gib": 1 / 16, "request_mib": 32, "chunk_mib": 8,
                                 "settle_s": 0, "options": ["nothing", "ahead-64"]})
    if args.child:
        child(args)
        return 0
    for option in args.options:
        settings(option)
    results: dict[str, list[dict]] = {o: [] for o in args.options}
    load0 = os.getloadavg()
    for run in range(args.runs):
        turn = args.options[run % len(args.options):] + args.options[:run % len(args.options)]
        for option in turn:
            time.sleep(args.settle_s)
            out = subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", option],
                                 capture_output=True, text=True, check=True).stdout
            results[option].append(json.loads(out.strip().splitlines()[-1]))
    load1 = os.getloadavg()
    memcpy = statistics.median(r["memcpy"] for rs in results.values() for r in rs)
    request = args.request_mib << 20
    n = int(args.gib * 2**30) // request
    print(f"pool {args.capacity_gib} GiB, the first {args.gib:g} GiB stored in {n} requests of {args.request_mib} MiB "
          f"({args.chunk_mib} MiB chunks, 2 copy threads), first request {args.start_gap_ms:g} ms after start, "
          f"{args.idle_ms:g} ms between requests; medians of {args.runs} runs; {os.cpu_count()} CPUs, load average "
          f"{load0[0]:.2f} before, {load1[0]:.2f} after")
    print(f"warm memcpy of one request: {memcpy * 1e3:.1f} ms, {request / memcpy / 1e9:.2f} GB/s")
    head = (f"{'option':<14} {'ready ms':>8} {'1st req ms':>10} {'x memcpy':>8} {'req med ms':>10} "
            f"{'first GiB GB/s':>14} {'x memcpy':>8} {'warm STORE':>10} {'RSS after MiB':>13} {'RSS settled':>11}  "
            f"each request ms")
    print(head)
    for option, rs in results.items():
        def med(f):
            return statistics.median(f(r) for r in rs)
        first = med(lambda r: r["times"][0])
        total = med(lambda r: sum(r["times"]))
        warm = med(lambda r: r["warm"])
        print(f"{option:<14} {med(lambda r: r['ready']) * 1e3:>8.1f} {first * 1e3:>10.1f} {memcpy / first:>8.2f} "
              f"{med(lambda r: statistics.median(r['times'])) * 1e3:>10.1f} {n * request / total / 1e9:>14.2f} "
              f"{n * memcpy / total:>8.2f} {warm * 1e3:>10.1f} {med(lambda r: r['rss']) / 2**20:>13.0f} "
              f"{med(lambda r: r['rss_settled']) / 2**20:>11.0f}  "
              + " / ".join(f"{statistics.median(r['times'][i] for r in rs) * 1e3:.0f}" for i in range(n)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
