"""The largest KV lookups in a loop: what they cost an honest worker's PING, and the server's memory.

    .venv/bin/python bench/lookup_floods.py [--seconds 10] [--clients 4] [--checkout DIR]
                                            [--max-body BYTES] [--burst 48]

One ``lmshm-server --url ipc://... --http-port 0 --capacity 64MiB --http-max-body-bytes BYTES``
(default 16 MiB, the size docs/kv-lookup.md recommended before issue 41) per checkout: this one,
and ``--checkout DIR`` (e.g. ``git worktree add /tmp/before <commit>``) when given, one after the
other on the same machine. Against each:

- ``idle``: an ``MPClient`` PINGs in a loop for ``--seconds``: the round trip's p50, p99, max;
- ``loop``: the same while ``--clients`` HTTP clients (keep-alive) send the largest real lookup in
  a loop: a million token ids of a 128,256-token vocabulary (Llama 3's), 7.1 MiB of JSON,
  ``block_size`` 16. Reported: PING p50/p99/max, lookups answered 200 and 503 per second;
- ``burst``: ``--burst`` lookups of that body at once, each on its own connection: the growth of
  the server's peak RSS (``VmHWM``) and how they were answered.

The clients, the PINGs and the server share the machine's cores: every figure includes all three.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import http.client
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))

from _common import parse_args
from _server import terminate

from lmshm.transport.client import MPClient

VOCAB = 128256
TOKENS = 1 << 20


class Server:
    def __init__(self, checkout: Optional[str], max_body: int) -> None:
        self.dir = tempfile.mkdtemp(prefix="lmshm-lookups-")
        env = dict(os.environ, PYTHONPATH=checkout or REPO, LMSHM_POOL_POPULATE_AHEAD="0")
        cmd = [sys.executable, "-m", "lmshm.server", "--url", f"ipc://{self.dir}/s.ipc", "--fd-socket",
               f"{self.dir}/s.fds", "--http-port", "0", "--capacity", "64MiB", "--http-max-body-bytes",
               str(max_body), "--log-level", "WARNING"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                                     cwd=self.dir)
        line = self.proc.stdout.readline()
        self.url = line.split("listening on ", 1)[1].split()[0]
        self.http_port = int(line.split("HTTP on ", 1)[1].split(":", 1)[1].split(",")[0].split()[0])

    def peak_rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024

    def stop(self) -> None:
        terminate(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


def body() -> bytes:
    rng = random.Random(41)
    return json.dumps({"token_ids": [rng.randrange(VOCAB) for _ in range(TOKENS)], "block_size": 16}).encode()


def pings(url: str, seconds: float) -> list[float]:
    client = MPClient(url, client_name="bench-ping", timeout_s=30)
    try:
        out, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            out.append(client.ping())
            time.sleep(0.002)
        return out
    finally:
        client.close()


def post(conn: Optional[http.client.HTTPConnection], port: int, data: bytes
         ) -> tuple[Any, Optional[http.client.HTTPConnection]]:
    conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/kv/lookup", body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        if r.getheader("Connection", "").lower() == "close":
            conn.close()
            conn = None
        return r.status, conn
    except OSError as exc:
        conn.close()
        return type(exc).__name__, None


def loop(port: int, data: bytes, stop: threading.Event, counts: collections.Counter) -> None:
    conn = None
    while not stop.is_set():
        status, conn = post(conn, port, data)
        counts[status] += 1
        if status == 503:
            time.sleep(1.0)          # Retry-After, as a router would
    if conn is not None:
        conn.close()


def ms(values: list[float], q: float) -> float:
    values = sorted(values)
    return 1000 * values[min(len(values) - 1, int(q * len(values)))]


def run(checkout: Optional[str], args: argparse.Namespace, data: bytes) -> dict[str, str]:
    server = Server(checkout, args.max_body)
    try:
        idle = pings(server.url, args.seconds)
        stop, counts = threading.Event(), collections.Counter()
        clients = [threading.Thread(target=loop, args=(server.http_port, data, stop, counts))
                   for _ in range(args.clients)]
        for t in clients:
            t.start()
        time.sleep(1.0)
        started = time.monotonic()
        busy = pings(server.url, args.seconds)
        took = time.monotonic() - started
        stop.set()
        for t in clients:
            t.join()
        before = server.peak_rss_mib()
        with concurrent.futures.ThreadPoolExecutor(args.burst) as pool:
            burst = collections.Counter(s for s, _ in pool.map(lambda _: post(None, server.http_port, data),
                                                               range(args.burst)))
        return {"idle PING p50/p99/max ms": f"{ms(idle, .5):.2f} / {ms(idle, .99):.2f} / {ms(idle, 1):.1f}",
                "PING p50/p99/max ms, lookups looping": f"{ms(busy, .5):.2f} / {ms(busy, .99):.1f} / {ms(busy, 1):.1f}",
                "lookups/s 200 (503)": f"{counts[200] / took:.1f} ({counts[503] / took:.1f})",
                f"burst of {args.burst}: peak RSS growth MiB": f"{server.peak_rss_mib() - before:.0f}",
                f"burst of {args.burst}: answers": ", ".join(f"{k}: {v}" for k, v in sorted(burst.items(), key=str))}
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--burst", type=int, default=48)
    p.add_argument("--max-body", type=int, default=16 << 20)
    p.add_argument("--checkout", default=None, help="also run the server from this checkout (PYTHONPATH)")
    args = parse_args(p, smoke={"seconds": 0.3, "clients": 1, "burst": 2})
    data = body()
    print(f"lookup body {len(data) / 2**20:.1f} MiB ({TOKENS} token ids), --http-max-body-bytes {args.max_body}, "
          f"{args.clients} clients, {args.seconds:g} s, {os.cpu_count()} CPUs")
    results = {"this checkout": run(None, args, data)}
    if args.checkout:
        results[args.checkout] = run(args.checkout, args, data)
    names = list(results)
    rows = list(results[names[0]])
    width = max(map(len, rows))
    print(f"{'':{width}}  " + "  ".join(f"{n:>28}" for n in names))
    for row in rows:
        print(f"{row:{width}}  " + "  ".join(f"{results[n][row]:>28}" for n in names))


if __name__ == "__main__":
    main()
