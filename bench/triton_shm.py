"""Triton shared-memory endpoints against lmshm's own ZeroMQ protocol, and /metrics scrapes.

    .venv/bin/python bench/triton_shm.py [--rounds 30] [--cycles 200] [--scrapes 50] [--regions 1000]

Starts one ``lmshm-server --port 0 --http-port 0 --grpc-port 0 --capacity 0`` and measures, in
one run, against that server:

- one register + unregister cycle of a 64 KiB system shared-memory region (one POSIX shm object
  made once with ``tritonclient.utils.shared_memory``), with the stock ``tritonclient`` over
  HTTP and over gRPC, and lmshm's own cycle over ZeroMQ: ``MPClient.register_kv_caches`` +
  ``unregister_kv_caches`` of a one-layer 64 KiB CPU KV cache (``empty_shared``). The three
  run interleaved: ``--rounds`` rounds of ``--cycles`` cycles per protocol, the order rotating
  every round, so that the machine's noise falls on all three alike. Per protocol: the median
  over rounds of the mean us per cycle, p10 and p90 over all single cycles, and the ratios to
  ZeroMQ, both of the medians and the median of the per-round ratios;
- ``GET /metrics`` (``http.client``, one keep-alive connection): median of ``--scrapes``
  scrapes and the response size, with no region and with ``--regions`` regions registered
  over HTTP (names over the same object, each at its own offset), alternating in five rounds:
  scrapes, register them all, scrapes, one unregister-all.

Before SIGTERM it prints the server's registrations, open fds and mappings of the object; then
the server must exit 0, and /dev/shm must hold nothing this run made (else the exit status is
1). Client and server share the machine's cores: every figure includes both sides.
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib.metadata import version

import torch
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import shared_memory as triton_shm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import parse_args

from lmshm import MPClient, empty_shared
from lmshm.transport.client import query_status

REGION_BYTES = 64 << 10
KV_SHAPE = (2, 16, 16, 64)  # float16: 64 KiB, one layer
READY = re.compile(r"listening on (\S+) \(fd socket (\S+), HTTP on ([^:\s]+):(\d+), gRPC on ([^:\s]+):(\d+),"
                   r".* pid (\d+)\)")
PROTOCOLS = ("HTTP", "gRPC", "ZeroMQ")
SCRAPE_ROUNDS = 5


def start_server(workdir: str, timeout_s: float = 60.0) -> tuple[subprocess.Popen, re.Match]:
    """``lmshm-server`` (the console script's module, with this interpreter) on free ports."""
    cmd = [sys.executable, "-m", "lmshm.server", "--port", "0", "--http-port", "0",
           "--grpc-port", "0", "--capacity", "0", "--fd-socket", os.path.join(workdir, "fds.sock"),
           "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    m = READY.search(line)
    if not m:
        proc.kill()
        raise RuntimeError(f"lmshm-server did not start: {line!r} (exit status {proc.wait()})")
    return proc, m


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
        print("lmshm-server did not stop within 30 s of SIGTERM; killed")
    proc.stdout.close()
    return rc


def shm_names() -> set[str]:
    return set(os.listdir("/dev/shm"))


def server_holds(pid: int, key: str) -> tuple[int, int]:
    """The server's open fds, and its mappings of the object ``key``."""
    with open(f"/proc/{pid}/maps") as f:
        maps = sum(1 for line in f if line.rstrip().endswith(f"/dev/shm{key}"))
    return len(os.listdir(f"/proc/{pid}/fd")), maps


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def run_rounds(cycles: dict[str, Callable[[], None]], rounds: int, n: int) -> tuple[dict, dict]:
    """Per protocol: the mean seconds per cycle of each round, and every single cycle."""
    means: dict[str, list[float]] = {p: [] for p in cycles}
    singles: dict[str, list[float]] = {p: [] for p in cycles}
    names = list(cycles)
    for r in range(rounds):
        k = r % len(names)
        order = names[k:] + names[:k]
        if (r // len(names)) % 2:
            order.reverse()  # every protocol goes first, and last, as often as the others
        for proto in order:
            cycle = cycles[proto]
            start = t_prev = time.perf_counter()
            for _ in range(n):
                cycle()
                t = time.perf_counter()
                singles[proto].append(t - t_prev)
                t_prev = t
            means[proto].append((t_prev - start) / n)
    return means, singles


def scrape(conn: http.client.HTTPConnection, n: int) -> tuple[list[float], int]:
    """``n`` timed GETs of /metrics on a keep-alive connection; the times and the last size."""
    times, size = [], 0
    for _ in range(n):
        t0 = time.perf_counter()
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        body = resp.read()
        times.append(time.perf_counter() - t0)
        if resp.status != 200:
            raise RuntimeError(f"GET /metrics answered {resp.status}: {body[:200]!r}")
        size = len(body)
    return times, size


def bench_metrics(http_c: triton_http.InferenceServerClient, conn: http.client.HTTPConnection, key: str,
                  regions: int, scrapes: int) -> dict:
    """Scrapes with no region and with ``regions`` regions, alternating in SCRAPE_ROUNDS rounds:
    scrape, register them all over HTTP, scrape, one unregister-all."""
    out = {"empty": [], "full": [], "register": [], "unregister": [], "listed": [], "left": []}
    assert http_c.get_system_shared_memory_status() == []  # every scrape then carries the same series
    scrape(conn, 3)  # warm up the connection and the collectors
    per_round = -(-scrapes // SCRAPE_ROUNDS)
    step = REGION_BYTES // regions
    for _ in range(SCRAPE_ROUNDS):
        times, out["empty_size"] = scrape(conn, per_round)
        out["empty"] += times
        t0 = time.perf_counter()
        for i in range(regions):
            http_c.register_system_shared_memory(f"bench-region-{i:05d}", key, REGION_BYTES - i * step, i * step)
        out["register"].append(time.perf_counter() - t0)
        out["listed"].append(len(http_c.get_system_shared_memory_status()))
        times, out["full_size"] = scrape(conn, per_round)
        out["full"] += times
        t0 = time.perf_counter()
        http_c.unregister_system_shared_memory()
        out["unregister"].append(time.perf_counter() - t0)
        out["left"].append(len(http_c.get_system_shared_memory_status()))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30,
                    help="rounds of the register/unregister comparison; each runs every protocol once (default 30)")
    ap.add_argument("--cycles", type=int, default=200,
                    help="register + unregister cycles per protocol per round (default 200)")
    ap.add_argument("--scrapes", type=int, default=50,
                    help="GET /metrics with and without the regions, each (default 50)")
    ap.add_argument("--regions", type=int, default=1000,
                    help="regions registered over HTTP for the scrapes with regions (default 1000)")
    args = parse_args(ap, smoke={"rounds": 1, "cycles": 5, "scrapes": 2, "regions": 10})
    if args.regions > REGION_BYTES:
        ap.error(f"--regions is at most {REGION_BYTES} (one byte each of the {REGION_BYTES >> 10} KiB object)")

    before = shm_names()
    workdir = tempfile.mkdtemp(prefix="lmshm-bench-")
    key = f"/triton-bench-{os.getpid()}"
    proc, m = start_server(workdir)
    url, http_addr, grpc_addr = m.group(1), f"{m.group(3)}:{m.group(4)}", f"{m.group(5)}:{m.group(6)}"
    server_pid = int(m.group(7))
    region = None
    try:
        region = triton_shm.create_shared_memory_region("bench", key, REGION_BYTES)
        print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, tritonclient {version('tritonclient')}, "
              f"grpcio {version('grpcio')}, aiohttp {version('aiohttp')}, pyzmq {version('pyzmq')}, "
              f"{os.cpu_count()} CPUs")
        print(f"lmshm-server pid {server_pid}: ZeroMQ {url}, HTTP {http_addr}, gRPC {grpc_addr}, --capacity 0")
        http_c = triton_http.InferenceServerClient(http_addr)
        grpc_c = triton_grpc.InferenceServerClient(grpc_addr)
        kv = {"model.layers.0.attn": empty_shared(KV_SHAPE, torch.float16)}
        with MPClient(url, heartbeat=False) as zmq_c:
            def http_cycle() -> None:
                http_c.register_system_shared_memory("bench-http", key, REGION_BYTES)
                http_c.unregister_system_shared_memory("bench-http")

            def grpc_cycle() -> None:
                grpc_c.register_system_shared_memory("bench-grpc", key, REGION_BYTES)
                grpc_c.unregister_system_shared_memory("bench-grpc")

            def zmq_cycle() -> None:
                zmq_c.unregister_kv_caches(zmq_c.register_kv_caches(kv, "bench-zmq", model_name="bench"))

            cycles = dict(zip(PROTOCOLS, (http_cycle, grpc_cycle, zmq_cycle)))
            # warm up: connections, code paths, the server's caches (3 x 20 unless a smoke run asks fewer)
            run_rounds(cycles, min(3, args.rounds), min(20, args.cycles))
            fds_before, _ = server_holds(server_pid, key)
            t0 = time.perf_counter()
            means, singles = run_rounds(cycles, args.rounds, args.cycles)
            elapsed = time.perf_counter() - t0

            print(f"\nregister + unregister of a {REGION_BYTES >> 10} KiB region (HTTP, gRPC: tritonclient "
                  f"system shm) or a one-layer {REGION_BYTES >> 10} KiB KV cache (ZeroMQ: MPClient);\n"
                  f"{args.rounds} rounds x {args.cycles} cycles per protocol, order rotating, {elapsed:.1f} s")
            print(f"{'protocol':<8} {'median us/cycle':>15} {'p10 us':>8} {'p90 us':>8} {'x ZeroMQ':>9} "
                  f"{'x ZeroMQ per round':>19}")
            zmq_med = statistics.median(means["ZeroMQ"])
            for proto in PROTOCOLS:
                med = statistics.median(means[proto])
                per_round = statistics.median(a / b for a, b in zip(means[proto], means["ZeroMQ"]))
                print(f"{proto:<8} {med * 1e6:>15.0f} {pct(singles[proto], 0.1) * 1e6:>8.0f} "
                      f"{pct(singles[proto], 0.9) * 1e6:>8.0f} {med / zmq_med:>9.2f} {per_round:>19.2f}")
            print("median: over rounds, of each round's mean; p10/p90: over all single cycles; x ZeroMQ per round: "
                  "median over rounds of that round's ratio")

            conn = http.client.HTTPConnection(m.group(3), int(m.group(4)), timeout=30)
            try:
                mx = bench_metrics(http_c, conn, key, args.regions, args.scrapes)
            finally:
                conn.close()
            n = len(mx["empty"])
            print(f"\nGET /metrics (http.client, one keep-alive connection): {n} scrapes each, in {SCRAPE_ROUNDS} "
                  f"rounds alternating with and without the regions")
            print(f"{'regions':>7} {'median us':>10} {'p10 us':>8} {'p90 us':>8} {'bytes':>7}")
            rows = ((0, mx["empty"], mx["empty_size"]), (max(mx["listed"]), mx["full"], mx["full_size"]))
            for count, xs, size in rows:
                print(f"{count:>7} {statistics.median(xs) * 1e6:>10.0f} {pct(xs, 0.1) * 1e6:>8.0f} "
                      f"{pct(xs, 0.9) * 1e6:>8.0f} {size:>7}")
            reg_s = statistics.median(mx["register"])
            print(f"registering {args.regions} regions over HTTP: median {reg_s:.2f} s "
                  f"({reg_s / args.regions * 1e6:.0f} us each); one unregister-all: median "
                  f"{statistics.median(mx['unregister']) * 1e3:.1f} ms; regions listed after registering: "
                  f"{sorted(set(mx['listed']))}, after unregister-all: {sorted(set(mx['left']))}")
            registrations = len(query_status(url).registrations)
            fds_after, maps_after = server_holds(server_pid, key)
        kv.clear()  # frees the KV cache's segment before the /dev/shm check
        print(f"before SIGTERM the server lists {registrations} registrations, has {fds_after} fds open "
              f"({fds_before} after the warm-up) and {maps_after} mappings of {key}")
    finally:
        if region is not None:
            triton_shm.destroy_shared_memory_region(region)
        rc = stop_server(proc)
        shutil.rmtree(workdir, ignore_errors=True)

    ours = re.compile(rf"^(triton-bench-{os.getpid()}|lmshm-({os.getpid():x}|{server_pid:x})-.*)$")
    new = sorted(shm_names() - before)
    leaked = [n for n in new if ours.match(n)]
    print(f"lmshm-server exit status after SIGTERM: {rc}; /dev/shm entries this run left: {leaked or 'none'}"
          + (f" (other new entries, not this run's: {len(new) - len(leaked)})" if len(new) > len(leaked) else ""))
    return 0 if rc == 0 and not leaked else 1


if __name__ == "__main__":
    sys.exit(main())
