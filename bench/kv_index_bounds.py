"""What the KV event index costs a server, against what peers send it (issue 41, round 4, §3).

    .venv/bin/python bench/kv_index_bounds.py [--control-tree /tmp/before-index] [--adverts 240]
                                              [--flood 10] [--chunks 200000] [--readers 4]

Runs the same four measurements against this tree's ``lmshm-server`` and, with
``--control-tree DIR`` (a checkout of the commit before, e.g. ``git worktree add
/tmp/before-index 2b48e12``), against that tree's, one after the other on this machine, and
prints them side by side:

- ``rss``: the server's RSS growth while one client STOREs ``--adverts`` chunks, each with the
  wire's largest advert (1,024 block hashes, 65,536 packed tokens, about 27 KiB of extra keys),
  against the bytes of adverts sent;
- ``flood``: PING round trips (another client, every 2 ms) while a client sends ``--flood``
  STOREs of 65,536 one-block adverts each that store nothing (answered UNAVAILABLE: their
  sender stopped waiting); p50, p99 and the longest;
- ``readers``: with ``--chunks`` chunks indexed (the log full), PING round trips while
  ``--readers`` clients read KV_EVENTS from the log's start in a namespace with no events;
- ``get``: ``GET /v1/kv/lookup`` with ``--chunks`` chunks indexed; median of 20.

Each measurement's clients are separate processes (fork). The machine is shared: run twice.
``--parts rss --rss-args '--kv-events-index 16384' --adverts 600`` shows the byte bound: the
index there holds 64 MiB (the log 64 MiB), whatever is sent.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request
from typing import Any, Callable

import msgspec
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import free_port, parse_args, rss
from _server import BenchServer

from lmshm.transport.client import MPClient
from lmshm.wire import protocol

SPACE = b"bench"


def forked(work: Callable[[], Any]) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            work()
        except BaseException:
            code = 1
        os._exit(code)
    return pid


def client(url: str, blocks: int = 16, width: int = 64) -> tuple[MPClient, str, Any]:
    c = MPClient(url, client_name="kv-bench", timeout_s=120)
    kv = torch.zeros(blocks, width)
    iid = c.register_kv_caches({"l0": kv}, f"w{os.getpid()}", model_name="m")
    return c, iid, kv


def largest_advert(i: int) -> protocol.Advert:
    """The wire's largest: a LoRA's name on each of its 1,024 blocks (vLLM's extra keys), so
    every block has a token key too (the index's most expensive kind)."""
    lora = "adapter-%020d" % i
    extra = msgspec.msgpack.encode([[lora]] * 1024)                 # ~27 KiB
    tokens = (bytes(range(256)) * 1024)[:4 * 65536]
    return protocol.Advert(b"big-%d" % i, 0, 64, [(i << 20) + j for j in range(1024)], None, [],
                           lora_name=lora, extra_keys=extra, tokens=tokens)


def pings(url: str, seconds: float, out: str) -> int:
    def work() -> None:
        c = MPClient(url, client_name="kv-bench-ping", timeout_s=30)
        got = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            got.append(c.ping())
            time.sleep(0.002)
        c.close()
        with open(out, "w") as f:
            json.dump(got, f)
    return forked(work)


def summary(samples: list[float]) -> str:
    if not samples:
        return "no samples"
    s = sorted(samples)
    p = lambda q: s[min(len(s) - 1, int(q * len(s)))] * 1e3
    return f"p50 {p(0.5):.2f} ms, p99 {p(0.99):.1f} ms, max {s[-1] * 1e3:.1f} ms ({len(s)} pings)"


def measure(python_path: str, args: argparse.Namespace) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": python_path}
    out: dict[str, str] = {}
    tmp = f"/tmp/kv-bench-{os.getpid()}.json"
    # ---- rss: the largest adverts ----
    with BenchServer("--capacity", "256MiB", "--pool-populate-ahead", "0", *args.rss_args.split(), env=env,
                     cwd=python_path, quiet=True) as server:      # no pool pages touched ahead: the index alone
        c, iid, kv = client(server.url)
        c.store(iid, [b"warm"], [0], 1, adverts=[largest_advert(99999)], space=SPACE, pod="p")
        c.ping()
        time.sleep(0.5)
        before, sent = rss(server.pid), 0
        for i in range(args.adverts):
            a = largest_advert(i)
            sent += len(protocol.pack_adverts([a]))
            c.store(iid, [b"k-%d" % i], [i % 16], 1, adverts=[a], space=SPACE, pod="p")
        c.kv_events([SPACE], -1, 1)       # a reader: the index applies its queue
        time.sleep(1.0)
        grown = rss(server.pid) - before
        out["rss"] = (f"+{grown / 2**20:.0f} MiB for {sent / 2**20:.1f} MiB of adverts "
                      f"({grown / max(sent, 1):.1f}x)")
        c.close()
    if args.parts == "rss":
        return out
    # ---- flood: one STORE, 65,536 adverts, stores nothing ----
    n = args.flood_adverts
    floods = [(protocol.pack_adverts([protocol.Advert(b"f%d-%d" % (s, i), 0, 4, [(s << 20) | i], None, [1, 2, 3, 4])
                                      for i in range(n)]), [b"f%d-%08d" % (s, i) for i in range(n)])
              for s in range(args.flood)]        # built before the clock starts (the client's own CPU)
    with BenchServer("--capacity", "256MiB", env=env, cwd=python_path, quiet=True) as server:
        def flood() -> None:
            c, iid, kv = client(server.url)
            msgs = [protocol.Store(iid, keys, [i % 16 for i in range(n)], 1, b"", wait_s=1e-6, adverts=adverts,
                                   space=SPACE, pod="p") for adverts, keys in floods]
            time.sleep(1.0)                     # the pings start meanwhile
            for msg in msgs:
                try:
                    c.submit(msg, 60).result()
                except Exception:
                    pass
            c.close()
        flood_pid = forked(flood)
        time.sleep(0.5)
        ping_pid = pings(server.url, args.seconds, tmp)
        os.waitpid(flood_pid, 0)
        os.waitpid(ping_pid, 0)
        with open(tmp) as f:
            out["flood"] = summary(json.load(f))
    # ---- readers and GET: --chunks chunks indexed ----
    port = free_port()
    with BenchServer("--capacity", "1GiB", "--max-objects", str(args.chunks + 1000), "--http-port", str(port),
                     env=env, cwd=python_path, quiet=True) as server:
        c, iid, kv = client(server.url, blocks=4096, width=16)
        step = 4096
        for s in range(0, args.chunks, step):
            n = min(step, args.chunks - s)
            adverts = [protocol.Advert(b"c-%d" % (s + i), 0, 4, [s + i + 1], s + i if s + i else None, [1, 2, 3, 4])
                       for i in range(n)]
            c.store(iid, [b"c-%08d" % (s + i) for i in range(n)], list(range(n)), 1, adverts=adverts,
                    space=SPACE, pod="p")
        c.kv_events([SPACE], -1, 1)
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            body = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/kv/lookup", timeout=60).read())
            times.append(time.perf_counter() - t0)
        out["get"] = f"median {statistics.median(times) * 1e3:.2f} ms ({body['chunks']} chunks)"
        ping_pid = pings(server.url, args.seconds, tmp)

        def reader() -> None:
            r = MPClient(server.url, client_name="kv-bench-reader", timeout_s=60)
            end = time.monotonic() + args.seconds
            while time.monotonic() < end:
                r.kv_events([b"empty"], -1, 1024)
            r.close()
        readers = [forked(reader) for _ in range(args.readers)]
        for pid in readers:
            os.waitpid(pid, 0)
        os.waitpid(ping_pid, 0)
        with open(tmp) as f:
            out["readers"] = summary(json.load(f))
        c.close()
    os.unlink(tmp)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--control-tree", default="", metavar="DIR", help="a checkout to compare with (before)")
    ap.add_argument("--adverts", type=int, default=240, help="largest adverts STOREd for the rss figure")
    ap.add_argument("--flood", type=int, default=10, help="STOREs of 65,536 adverts for the flood figure")
    ap.add_argument("--flood-adverts", type=int, default=1 << 16, help="adverts per STORE of the flood (default 65,536)")
    ap.add_argument("--chunks", type=int, default=200_000, help="chunks indexed for the readers and get figures")
    ap.add_argument("--readers", type=int, default=4, help="KV_EVENTS readers from the log's start")
    ap.add_argument("--seconds", type=float, default=6.0, help="how long PINGs and readers run")
    ap.add_argument("--parts", choices=("all", "rss"), default="all")
    ap.add_argument("--rss-args", default="", help="more server flags for the rss part "
                    "(e.g. '--kv-events-index 16384': a 64 MiB index, to see the bound)")
    args = parse_args(ap, smoke={"adverts": 4, "flood": 1, "flood_adverts": 1024, "chunks": 2000, "readers": 1, "seconds": 0.3})
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = [("after", here)] + ([("before", args.control_tree)] if args.control_tree else [])
    results = {name: measure(tree, args) for name, tree in trees}
    for what in ("rss",) if args.parts == "rss" else ("rss", "flood", "readers", "get"):
        for name, _ in trees:
            print(f"{what:8} {name:7} {results[name][what]}")


if __name__ == "__main__":
    main()
