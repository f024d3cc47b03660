"""Register/unregister throughput of lmshm-server with concurrent workers on CPU. A script, not a test.

    .venv/bin/python bench/throughput.py [--workers 8,32] [--seconds 5] [--layout one|per-layer]
                                         [--warmup 5] [--no-heartbeat] [--isolated-ipc]
                                         [--server-log-level WARNING]

Starts lmshm-server as a subprocess (tcp://127.0.0.1, a free port, its fd socket in a temporary
directory), then, for each worker count, spawns that many worker processes. Each worker opens an
``MPClient(url)`` (heartbeat on, as an engine would use it, unless ``--no-heartbeat``), allocates
32 layers of [2, 16, 16, 8, 64] fp16 (512 KiB each), by default as views of one
``empty_shared((32, 2, 16, 16, 8, 64))`` pool, with ``--layout per-layer`` one ``empty_shared``
segment per layer, runs ``--warmup`` cycles, and waits at a start barrier. All workers then run
the same ``--seconds`` window (a common CLOCK_MONOTONIC start and end), each doing as many cycles
of ``iid = client.register_kv_caches(layers, f"w{k}-{n}"); client.unregister_kv_caches(iid)`` as
it can, one after the other, timing every cycle. Per worker count, one line: total cycles/s over
all workers (cycles started in the window / window length), the median and p99 cycle latency over
every cycle of every worker, the median register and unregister halves, the fewest and most cycles
a single worker did (fairness), and where the CPU went during the window: the server's and the
workers' CPU time per cycle (/proc/PID/stat), the whole machine's busy CPUs and the part of it
that was neither (other processes: a busy machine shows here, and lowers every figure).
``--isolated-ipc`` runs server and workers in isolated mode (memfd pools, an fd per registration);
``--server-log-level INFO`` makes the server log every registration, as it does by default.
The workers close their clients and must exit 0; the server gets SIGTERM at the end and must exit
0; /dev/shm is listed before and after, and any new lmshm entry made by one of this run's
processes is reported as a leak.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import selectors
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import parse_args
from _server import BenchServer

SHAPE = (2, 16, 16, 8, 64)
NUM_LAYERS = 32
READY_TIMEOUT_S = 150.0


# ---- worker -------------------------------------------------------------------------------


def worker_main(url: str, k: int, layout: str, warmup: int, heartbeat: bool) -> int:
    """One worker: ready line after warm-up, then 'go START END' on stdin, then one JSON line."""
    import torch

    import lmshm

    client = lmshm.MPClient(url, heartbeat=heartbeat)
    try:
        if layout == "one":
            pool = lmshm.empty_shared((NUM_LAYERS, *SHAPE), torch.float16)
            layers = {f"model.layers.{i}.attn": pool[i] for i in range(NUM_LAYERS)}
        else:
            layers = {f"model.layers.{i}.attn": lmshm.empty_shared(SHAPE, torch.float16)
                      for i in range(NUM_LAYERS)}
        n = 0
        for _ in range(warmup):
            iid = client.register_kv_caches(layers, f"w{k}-{n}")
            client.unregister_kv_caches(iid)
            n += 1
        print("ready", flush=True)
        line = sys.stdin.readline().split()
        if not line or line[0] != "go":
            return 3
        start, end = float(line[1]), float(line[2])
        while time.monotonic() < start:
            time.sleep(min(0.01, max(0.0, start - time.monotonic())))
        reg_us: list[float] = []
        unreg_us: list[float] = []
        clock = time.perf_counter
        while time.monotonic() < end:
            t0 = clock()
            iid = client.register_kv_caches(layers, f"w{k}-{n}")
            t1 = clock()
            client.unregister_kv_caches(iid)
            t2 = clock()
            reg_us.append((t1 - t0) * 1e6)
            unreg_us.append((t2 - t1) * 1e6)
            n += 1
        left = client.registered() if hasattr(client, "registered") else []
    finally:
        client.close()
    print(json.dumps({"worker": k, "cycles": len(reg_us), "reg_us": [round(x, 1) for x in reg_us],
                      "unreg_us": [round(x, 1) for x in unreg_us], "left_registered": len(left)}), flush=True)
    return 0


# ---- driver -------------------------------------------------------------------------------


def _shm_entries() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("lmshm")}
    except FileNotFoundError:
        return set()


def _entry_pid(name: str) -> int | None:
    """The creating pid in a segment name ``lmshm-<pid in hex>-<random>``, if it has that form."""
    parts = name.split("-")
    try:
        return int(parts[1], 16) if len(parts) >= 3 else None
    except ValueError:
        return None


def _percentile(sorted_samples: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_samples:
        return float("nan")
    rank = max(1, min(len(sorted_samples), math.ceil(q / 100 * len(sorted_samples))))
    return sorted_samples[rank - 1]


def _read_lines(procs: list[subprocess.Popen], expect: int, timeout_s: float, what: str) -> list[str]:
    """One stdout line from each process, within ``timeout_s`` in all."""
    sel = selectors.DefaultSelector()
    for i, p in enumerate(procs):
        sel.register(p.stdout, selectors.EVENT_READ, i)
    out: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < expect:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{expect - len(out)} of {expect} workers gave no {what} line "
                                   f"within {timeout_s:.0f} s")
            for key, _ in sel.select(left):
                i = key.data
                line = procs[i].stdout.readline()
                sel.unregister(procs[i].stdout)
                if not line:
                    raise RuntimeError(f"worker {i} exited (rc {procs[i].wait()}) before its {what} line")
                out[i] = line.strip()
    finally:
        sel.close()
    return [out[i] for i in range(len(procs))]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_busy_s() -> float:
    """Non-idle CPU seconds of the whole machine so far (all CPUs)."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return (sum(vals[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def run_round(url: str, server_pid: int, workers: int, args: argparse.Namespace, our_pids: set[int]) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--_worker", url, "{k}", args.layout,
           str(args.warmup), "1" if args.heartbeat else "0"]
    env = dict(os.environ, LMSHM_ISOLATED_IPC="1" if args.isolated_ipc else "0")
    procs: list[subprocess.Popen] = []
    try:
        t_spawn = time.monotonic()
        for k in range(workers):
            procs.append(subprocess.Popen([c.replace("{k}", str(k)) for c in cmd], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, bufsize=1, env=env))
            our_pids.add(procs[-1].pid)
        ready = _read_lines(procs, workers, READY_TIMEOUT_S, "ready")
        if any(r != "ready" for r in ready):
            raise RuntimeError(f"unexpected worker lines: {[r for r in ready if r != 'ready'][:3]}")
        startup = time.monotonic() - t_spawn
        start = time.monotonic() + 0.25
        end = start + args.seconds
        for p in procs:
            p.stdin.write(f"go {start!r} {end!r}\n")
            p.stdin.flush()
        time.sleep(max(0.0, start - time.monotonic()))
        srv0, busy0 = _cpu_s(server_pid), _machine_busy_s()
        wrk0 = sum(_cpu_s(p.pid) for p in procs)
        time.sleep(max(0.0, end - time.monotonic()))
        srv1, busy1 = _cpu_s(server_pid), _machine_busy_s()
        wrk1 = sum(_cpu_s(p.pid) for p in procs)
        results = [json.loads(line) for line in _read_lines(procs, workers, args.seconds + 60, "result")]
        rcs = [p.wait(30) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            for f in (p.stdin, p.stdout):
                try:
                    f.close()
                except OSError:
                    pass
    cycles = [r["cycles"] for r in results]
    cyc = sorted(a + b for r in results for a, b in zip(r["reg_us"], r["unreg_us"]))
    reg = [x for r in results for x in r["reg_us"]]
    unreg = [x for r in results for x in r["unreg_us"]]
    return {
        "workers": workers, "startup_s": startup, "total": sum(cycles), "rate": sum(cycles) / args.seconds,
        "median_us": statistics.median(cyc) if cyc else float("nan"), "p99_us": _percentile(cyc, 99),
        "reg_median_us": statistics.median(reg) if reg else float("nan"),
        "unreg_median_us": statistics.median(unreg) if unreg else float("nan"),
        "min_worker": min(cycles), "max_worker": max(cycles),
        "server_cpu": (srv1 - srv0) / args.seconds, "machine_cpu": (busy1 - busy0) / args.seconds,
        "server_us_per_cycle": (srv1 - srv0) * 1e6 / max(1, sum(cycles)),
        "worker_us_per_cycle": (wrk1 - wrk0) * 1e6 / max(1, sum(cycles)),
        "other_cpu": ((busy1 - busy0) - (srv1 - srv0) - (wrk1 - wrk0)) / args.seconds,
        "bad_rcs": [rc for rc in rcs if rc != 0], "left": sum(r["left_registered"] for r in results),
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--_worker":
        url, k, layout, warmup, hb = sys.argv[2:7]
        return worker_main(url, int(k), layout, int(warmup), hb == "1")

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", default="8,32", help="comma-separated worker counts (default 8,32)")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured window per worker count (default 5)")
    ap.add_argument("--layout", choices=("one", "per-layer"), default="one",
                    help="one: 32 views of one empty_shared pool (default); per-layer: 32 segments")
    ap.add_argument("--warmup", type=int, default=5, help="cycles per worker before the barrier (default 5)")
    ap.add_argument("--isolated-ipc", action="store_true",
                    help="server --isolated-ipc and LMSHM_ISOLATED_IPC=1 in the workers: memfd pools, fds over the "
                         "fd socket at every registration (default off)")
    ap.add_argument("--server-log-level", default="WARNING",
                    help="lmshm-server --log-level (default WARNING; INFO logs every registration)")
    ap.add_argument("--heartbeat", action=argparse.BooleanOptionalAction, default=True,
                    help="MPClient heartbeat thread in the workers (default on, as MPClient(url))")
    args = parse_args(ap, smoke={"workers": "1", "seconds": 0.5, "warmup": 1})
    counts = [int(w) for w in args.workers.split(",") if w.strip()]

    import torch
    import zmq

    shm_before = _shm_entries()
    server = BenchServer("--isolated-ipc" if args.isolated_ipc else "--no-isolated-ipc",
                         log_level=args.server_log_level)
    rows = []
    server_rc = None
    our_pids = {os.getpid(), server.pid}
    try:
        url = server.url
        print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, pyzmq {zmq.__version__} "
              f"(libzmq {zmq.zmq_version()}), {os.cpu_count()} CPUs; server at {url}")
        layout = "views of one empty_shared pool" if args.layout == "one" else "one empty_shared segment per layer"
        print(f"{NUM_LAYERS} layers of {list(SHAPE)} fp16, {layout}; heartbeat {'on' if args.heartbeat else 'off'}; "
              f"isolated_ipc {'on' if args.isolated_ipc else 'off'}; server log level {args.server_log_level}; "
              f"{args.seconds:g} s window per worker count, {args.warmup} warm-up cycles per worker")
        print("cycle = register_kv_caches + unregister_kv_caches; latencies over every cycle of every worker;\n"
              "CPU columns over the window: server and workers from /proc/PID/stat (us of CPU per cycle), "
              "machine = all CPUs busy (/proc/stat), others = machine - server - workers\n")
        print(f"{'workers':>7}  {'cycles/s':>8}  {'cycles':>6}  {'median us':>9}  {'p99 us':>7}  "
              f"{'reg med us':>10}  {'unreg med us':>12}  {'per worker min..max':>19}  {'server CPU':>10}  "
              f"{'server us/cycle':>15}  {'workers us/cycle':>16}  {'machine CPU':>11}  {'others CPU':>10}")
        for w in counts:
            r = run_round(url, server.pid, w, args, our_pids)
            rows.append(r)
            print(f"{w:>7}  {r['rate']:>8.0f}  {r['total']:>6}  {r['median_us']:>9.0f}  {r['p99_us']:>7.0f}  "
                  f"{r['reg_median_us']:>10.0f}  {r['unreg_median_us']:>12.0f}  "
                  f"{r['min_worker']:>9}..{r['max_worker']:<8}  {r['server_cpu']:>10.0%}  "
                  f"{r['server_us_per_cycle']:>15.0f}  {r['worker_us_per_cycle']:>16.0f}  {r['machine_cpu']:>11.0%}  "
                  f"{r['other_cpu']:>10.0%}", flush=True)
            if r["bad_rcs"]:
                print(f"WARNING: {len(r['bad_rcs'])} of {w} workers exited non-zero: {r['bad_rcs']}")
            if r["left"]:
                print(f"WARNING: {r['left']} registrations still listed by clients at close")
    finally:
        server_rc = server.stop()
    print("\nworker start-up (spawn to all ready): "
          + ", ".join(f"{r['workers']} workers {r['startup_s']:.1f} s" for r in rows))
    ok = True
    if server_rc != 0:
        print(f"WARNING: lmshm-server exited with status {server_rc} after SIGTERM")
        ok = False
    new = sorted(_shm_entries() - shm_before)
    # Other processes on the machine (a test run) may create and remove lmshm segments meanwhile,
    # some under names of their own (lmshm_test_...): only names created by this run's pids count
    # as leaks here.
    leaked = [n for n in new if _entry_pid(n) in our_pids]
    foreign = len(new) - len(leaked)
    if foreign:
        print(f"note: {foreign} new /dev/shm/lmshm* entries are not this run's (ignored)")
    if leaked:
        print(f"WARNING: {len(leaked)} lmshm entries left in /dev/shm: {', '.join(leaked[:5])}"
              f"{' ...' if len(leaked) > 5 else ''}")
        ok = False
    else:
        print(f"lmshm-server exited {server_rc}; nothing left in /dev/shm")
    return 0 if ok and all(not r["bad_rcs"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
