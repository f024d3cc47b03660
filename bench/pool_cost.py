"""What the pool's bookkeeping costs lmshm-server: RSS per object and per lease, STATUS time.

    .venv/bin/python bench/pool_cost.py [--objects 1000000] [--checkpoints 100000] [--capacity 2GiB]
                                        [--max-objects 1048576] [--json FILE]
    .venv/bin/python bench/pool_cost.py --churn 262144

One ``lmshm-server`` (``--capacity``), one client in this process that registers a KV cache of
1-byte blocks (one uint8 layer) and STOREs tiny chunks, 65,536 keys of 32 bytes per STORE (the
engine's keys are BLAKE2b-256), until the pool holds ``--objects`` objects. At the start and at
each checkpoint it reads:

- the server's RSS (``VmRSS``); the cost per object is the RSS growth over the objects added;
- STATUS round trips (sessionless, a fresh DEALER as ``lmshm status`` does): min and median of 20;
- honest PINGs of a verified session while a sessionless peer floods STATUS for 2 s: p50, max.

At the end, leases: 4,000 LOOKUPs of one key each (the per-lease cost), then 64 LOOKUPs that
each name one stored key 65,536 times (issue 15's lease bomb: the growth in all; where a lease
holds each object once this is the allocator's high-water mark for decoding one 2 MiB request,
and it stays there for 400 leases as for 64); and 64 verified sessions (idle MPClients, measured
first). The other figures are the RSS growth divided by the count.

``--churn N`` measures instead, in this process, the pool alone: ``Pool.reserve`` + ``commit``
of 1-byte chunks into a pool that holds N of them, N to fill it and 2N more that each evict one,
each timed (median, and the stalls: the dicts' resizes and GC passes grow with N).

Compare checkouts by putting one first on the path (the server runs with this interpreter and
inherits PYTHONPATH)::

    PYTHONPATH=/path/to/other .venv/bin/python bench/pool_cost.py --objects 100000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))

from _common import parse_args
from _server import BenchServer

KEYS_PER_STORE = 65536


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def status_ms(url: str, n: int = 20) -> tuple[float, float]:
    from lmshm.transport.client import query_status

    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        query_status(url)
        times.append((time.perf_counter() - t0) * 1000)
    return min(times), statistics.median(times)


def pings_under_status_flood(url: str, client, seconds: float = 2.0) -> tuple[float, float, int]:
    """PINGs of a verified session while a sessionless DEALER keeps 8 STATUS requests queued."""
    import zmq

    from lmshm.wire import codec, protocol

    stop = threading.Event()
    sent = [0]

    def flood() -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(url)
        body = codec.encode(protocol.Status())
        outstanding = 0
        try:
            while not stop.is_set():
                while outstanding < 8:
                    sock.send_multipart([sent[0].to_bytes(8, "big"), body])
                    sent[0] += 1
                    outstanding += 1
                if sock.poll(50):
                    sock.recv_multipart()
                    outstanding -= 1
        finally:
            sock.close(0)
            ctx.term()

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    time.sleep(0.2)
    pings = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pings.append(client.ping() * 1000)
    stop.set()
    thread.join(10)
    return statistics.median(pings), max(pings), sent[0]


def churn(n: int) -> dict:
    from lmshm.core.pool import Pool, cost_of

    pool = Pool(n * cost_of(1), max_objects=n)
    times = []
    for i in range(3 * n):
        t0 = time.perf_counter()
        _, obj = pool.reserve(1000, i.to_bytes(32, "big"), 1, b"L" * 16, 1)
        pool.commit([obj])
        times.append(time.perf_counter() - t0)
    steady = sorted(times[n:])
    out = {"objects": n, "fill_worst_ms": round(max(times[:n]) * 1e3, 1),
           "churn_median_us": round(steady[len(steady) // 2] * 1e6, 1), "churn_worst_ms": round(steady[-1] * 1e3, 1),
           "churn_over_50ms": sum(1 for t in steady if t > 0.05), "churn_stores": len(steady)}
    print(json.dumps(out))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=1_000_000)
    ap.add_argument("--checkpoints", default="100000", help="comma-separated object counts to measure at")
    ap.add_argument("--capacity", default="2GiB")
    ap.add_argument("--max-objects", help="pass --max-objects to the server (a server that knows it)")
    ap.add_argument("--churn", type=int, help="time the pool alone, in this process, at this many objects")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--flood-s", type=float, default=2.0, help="seconds of PINGs under each STATUS flood (default 2)")
    args = parse_args(ap, smoke={"objects": 2000, "checkpoints": "1000", "capacity": "64MiB", "flood_s": 0.2})
    if args.churn:
        out = churn(args.churn)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return

    import torch

    import lmshm
    from lmshm.platform.cpu import empty_shared
    from lmshm.transport.client import MPClient

    checkpoints = sorted({int(c) for c in args.checkpoints.split(",") if c} | {args.objects})
    out: dict = {"lmshm": os.path.dirname(lmshm.__file__), "capacity": args.capacity, "points": []}
    print(f"lmshm from {out['lmshm']}; --capacity {args.capacity}")
    extra = ["--max-objects", args.max_objects] if args.max_objects else []
    with BenchServer("--capacity", args.capacity, *extra, quiet=True) as server, \
            MPClient(server.url, fd_socket=server.fd_socket, heartbeat_interval_s=1.0, timeout_s=120) as client:
        kv = {"layer.0": empty_shared((16, 1), torch.uint8)}
        iid = client.register_kv_caches(kv, "pool-cost")
        time.sleep(0.5)

        def point(objects_asked: int) -> dict:
            pool = client.status().pool
            smin, smed = status_ms(server.url)
            p50, pmax, flood = pings_under_status_flood(server.url, client, args.flood_s)
            p = {"objects_asked": objects_asked, "objects": pool.objects, "used": pool.used,
                 "rss_kb": rss_kb(server.pid), "status_ms_min": round(smin, 2), "status_ms_median": round(smed, 2),
                 "ping_under_status_flood_ms_p50": round(p50, 2), "ping_under_status_flood_ms_max": round(pmax, 2),
                 "status_flood_requests": flood}
            print(json.dumps(p))
            out["points"].append(p)
            return p

        start = point(0)
        # sessions: 64 more verified clients, each with its own connection and fd-channel link,
        # measured first, on a server that has stored nothing yet
        before = rss_kb(server.pid)
        others = [MPClient(server.url, fd_socket=server.fd_socket, heartbeat_interval_s=5.0) for _ in range(64)]
        time.sleep(1.0)
        per_session = (rss_kb(server.pid) - before) * 1024 / len(others)
        for other in others:
            other.close()
        out["session_bytes"] = round(per_session)
        print(f"a verified session (idle): +{per_session:.0f} B RSS each")
        made = 0
        t0 = time.perf_counter()
        for target in checkpoints:
            while made < target:
                n = min(KEYS_PER_STORE, target - made)
                keys = [(made + i).to_bytes(32, "big") for i in range(n)]
                reply = client.store(iid, keys, [0] * n, 1)
                made += n
                skipped = sum(1 for r in reply.results if r != 0)
                if skipped:
                    print(f"  {skipped} of {n} chunks not stored (results other than STORED)")
            p = point(made)
            grown = p["rss_kb"] - start["rss_kb"]
            print(f"  {made} objects stored in {time.perf_counter() - t0:.1f} s; RSS +{grown / 1024:.1f} MiB, "
                  f"{grown * 1024 / max(1, p['objects']):.0f} B per visible object; used {p['used']} B")

        # leases: 4,000 of one key each (the per-lease cost), then one key listed 65,536 times, 64
        # times over (after 8 such LOOKUPs released again, so that the allocator's arenas for
        # decoding a 2 MiB request are already there and only what the leases hold shows)
        last = (made - 1).to_bytes(32, "big")
        before = rss_kb(server.pid)
        leases = [client.lookup([[last]], 30.0).lease for _ in range(4000)]
        per_lease = (rss_kb(server.pid) - before) * 1024 / len(leases)
        for lease in leases:
            client.release(lease)
        for _ in range(8):
            client.release(client.lookup([[last] * KEYS_PER_STORE], 30.0).lease)
        before = rss_kb(server.pid)
        leases = [client.lookup([[last] * KEYS_PER_STORE], 30.0).lease for _ in range(64)]
        bomb = (rss_kb(server.pid) - before) * 1024
        for lease in leases:
            client.release(lease)
        out["leases_of_one_key_65536_times_64_in_all_bytes"] = round(bomb)
        out["lease_of_one_key_bytes"] = round(per_lease)
        print(f"a lease of one key: +{per_lease:.0f} B RSS each; 64 leases naming one key 65,536 times: "
              f"+{bomb / 2**20:.1f} MiB RSS in all")
        client.unregister_kv_caches(iid)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
