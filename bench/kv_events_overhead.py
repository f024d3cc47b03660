"""What KV events cost STORE and LOOKUP: the same requests with events on and off, side by side.

    .venv/bin/python bench/kv_events_overhead.py [--sessions 6] [--rounds 12] [--stores 12] [--lookups 30]
                                                 [--no-reader] [--on-index N] [--no-adverts] [--list-tokens]
                                                 [--threads] [--sizes "64 KiB,2 MiB"] [--pace-ms MS]
                                                 [--interleave] [--reader-every-ms 50]

Three lmshm-servers with the same flags (``--capacity``, default 256 MiB, so that STOREs evict
from the first round on, and every eviction is a ``BlockRemoved``) except one: *on* keeps the
KV event index (``--kv-events-index`` at its default), *off* and *off-2* have
``--kv-events-index 0``. *off-2* against *off* is an A/A control: what two identical servers
differ by on this machine, the noise floor of the on/off ratio. This process is the
engine's worker: per chunk size, a KV cache of L layers x [blocks, H heads, 32
tokens, 128] float16 registered with each server, one 32-token block per chunk (vLLM's block
and lmshm's chunk), so a chunk is L x H x 16 KiB:

- 64 KiB: 2 layers x 2 heads (a tiny model); 256 KiB: 8 x 2; 2 MiB: 32 x 4 (a 1-3B model).

Timed from the client, request to reply:

- STORE of one 16-chunk request (512 tokens, vLLM's prefill of one request), fresh keys each
  time. *on* sends an ``Advert`` per chunk, as ``LmshmConnector`` does with events on: a 32-byte
  block hash, the parent's, the 32 token ids (packed, protocol 3.8; ``--list-tokens``: a list,
  as a 3.7 client sends them), no LoRA, no extra keys. *off* sends none.
- LOOKUP of the 16 keys of the request just stored (all hits, a lease), then RELEASE (not timed).

With ``--reader`` (the default) a separate process reads the *on* server's events with
KV_EVENTS every 50 ms, as each engine's connector does (``EventFeed.every_s``;
``--reader-every-ms``; the runs in docs/benchmarks.md before 2026-12-05 read every 20 ms).

Rounds rotate (and reverse) the order of the servers and rotate the chunk sizes; each round's
median is taken per (size, server, request). Identical servers differ by more than 2 % on a
busy 2-vCPU machine, and by how much depends on the run (where the scheduler put them): so a
run is several *sessions*, each with three fresh servers; a session's figure is its median
over rounds, and the table shows the median over sessions and the min-max of the sessions'
ratios. *Server CPU* is the CPU time of the server's threads (``/proc/PID/task/*/schedstat``)
per request, over the same blocks; ``--threads`` also splits a STORE's into the request loop's
and the other threads' (copier, copy splitter, pool populate, clock). Work a server defers to
when it is idle happens while the client talks to the other servers, outside those blocks: the
second table adds the loop's CPU from the end of a server's block to the start of its next (and
0.5 s after the last) to the STOREs' and LOOKUPs' own, per STORE ("all told").

``--control-on --control-tree DIR`` makes the third server a second *on* server run from another
checkout: its column is then this tree against that one, in the same run.

``--interleave`` takes the three servers' requests in turn, one request each (the order
rotating), instead of one server's block of ``--stores`` after another's: with ``--pace-ms``,
each server's requests meet the same moments of the machine, and the deferred work falls
inside the blocks.

``--pace-ms MS`` sleeps MS before each timed request, as an engine computes a step between two
of its requests (a decode step of a small model is 10-30 ms): the server is idle between
requests, as next to an engine, and the index applies its queue then. Back to back (the
default) the server is saturated, and everything it defers is paid by the next request or,
on these two vCPUs, by the other servers.

Splitting what *on* costs: ``--on-index 0 --no-reader`` sends the adverts to a server that
indexes nothing (their wire and decoding cost); ``--no-adverts --no-reader``, the index with
nothing to index; ``--no-reader``, the index without the reader; the default less that, the
reader's own cost (KV_EVENTS on the loop).

"""

from __future__ import annotations

import argparse
import gc
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import parse_args
from _server import BenchServer

from lmshm.transport.client import MPClient
from lmshm.wire import protocol

TOKENS, DIM = 32, 128
CHUNKS = 16                 # chunks per STORE: one 512-token prefill
SPACE = b"bench-kv-events"
CASES = {"64 KiB": (2, 2), "256 KiB": (8, 2), "2 MiB": (32, 4)}     # (layers, heads)

READER = r"""
import sys, time
from lmshm.transport.client import MPClient
c = MPClient(sys.argv[1], client_name="bench-kv-events-reader")
cursor, n = -1, 0
print("ready", flush=True)
while True:
    r = c.kv_events([sys.argv[2].encode()], after=cursor, limit=4096)
    cursor, n = r.cursor, n + len(r.events)
    time.sleep(float(sys.argv[3]))
"""


class Side:
    """One server's worker: a client and a KV cache per chunk size."""

    def __init__(self, url: str, adverts: bool, list_tokens: bool = False) -> None:
        self.client = MPClient(url, client_name="bench-kv-events", timeout_s=60)
        self.adverts = adverts
        self.list_tokens = list_tokens
        self.iids: dict[str, str] = {}
        self.kv: dict[str, dict] = {}
        self.last: dict[str, list[bytes]] = {}
        for name, (layers, heads) in CASES.items():
            self.kv[name] = {f"layer.{i}": torch.randn(CHUNKS, heads, TOKENS, DIM).half() for i in range(layers)}
            self.iids[name] = self.client.register_kv_caches(self.kv[name], model_name="bench", world_size=1, rank=0)
        self._n = 0
        self._parent: bytes | None = None

    def store(self, case: str) -> float:
        keys = [os.urandom(16) for _ in range(CHUNKS)]
        adverts = None
        if self.adverts:
            adverts = []
            parent = self._parent
            for k in keys:
                h = os.urandom(32)
                tokens = list(range(self._n, self._n + TOKENS))
                if self.list_tokens:     # a 3.7 client's adverts
                    adverts.append(protocol.Advert(k, 0, TOKENS, [h], parent, tokens, None, None))
                else:                    # as LmshmConnector sends them: packed (its describer packs them)
                    from lmshm.integrations.adapter import packed_tokens  # 3.8 (--list-tokens runs on 3.7)

                    adverts.append(protocol.Advert(k, 0, TOKENS, [h], parent, [], None, None, packed_tokens(tokens)))
                parent, self._n = h, self._n + TOKENS
            self._parent = parent
        t0 = time.perf_counter()
        r = self.client.store(self.iids[case], keys, list(range(CHUNKS)), 1, adverts=adverts, space=SPACE,
                              pod="bench")
        dt = time.perf_counter() - t0
        if list(r.results) != [protocol.StoreResult.STORED] * CHUNKS:
            raise RuntimeError(f"STORE results {list(r.results)}")
        self.last[case] = keys
        return dt

    def lookup(self, case: str) -> float:
        keys = self.last[case]
        t0 = time.perf_counter()
        r = self.client.lookup([keys])
        dt = time.perf_counter() - t0
        if r.hits != CHUNKS:
            raise RuntimeError(f"LOOKUP found {r.hits} of {CHUNKS}")
        self.client.release(r.lease)
        return dt

    def close(self) -> None:
        self.client.close()
        self.kv.clear()


MODES = ("on", "off", "off-2")


def thread_ns(pid: int) -> dict[str, int]:
    """CPU time the process's threads have run, in ns, per kind of thread: ``loop`` (the main
    thread, which runs the request loop), the others by their OS name up to a digit or ``_``
    (``other threads``: Python names its threads only for itself, the OS sees ``python``), from
    ``/proc/PID/task/*/schedstat``."""
    out: dict[str, int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            if int(tid) == pid:
                name = "loop"            # the main thread runs the request loop
            else:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = re.split(r"[_0-9]", f.read().strip(), maxsplit=1)[0].rstrip("-") or "?"
                name = "other threads" if name == "python" else name
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[name] = out.get(name, 0) + int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass       # a thread that ended meanwhile
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_seconds(port: int) -> dict[str, tuple[float, int]]:
    """``request -> (seconds, count)`` of the server's ZeroMQ requests so far, arrival to answer
    (``lmshm_request_seconds`` on its /metrics)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, list] = {}
    for m in re.finditer(r'^lmshm_request_seconds_(sum|count)\{endpoint="zmq",request="(\w+)"\} (\S+)$', text, re.M):
        acc = out.setdefault(m.group(2), [0.0, 0])
        if m.group(1) == "sum":
            acc[0] = float(m.group(3))
        else:
            acc[1] = int(float(m.group(3)))
    return {k: (v[0], v[1]) for k, v in out.items()}


def cpu_ns(pid: int) -> int:
    """CPU time the process's threads have run, in ns."""
    return sum(thread_ns(pid).values())


def run(args: argparse.Namespace) -> dict:
    flags = ["--capacity", args.capacity]
    off = ["--kv-events-index", "0"]
    on = [] if args.on_index is None else ["--kv-events-index", str(args.on_index)]
    pace = args.pace_ms / 1e3

    def paced(request: Any, case: str) -> float:
        """``request(case)``'s time, ``--pace-ms`` after the last request ended (an engine step)."""
        if pace:
            time.sleep(pace)
        return request(case)
    ports = {m: free_port() for m in MODES} if args.server_time else {}

    def http(mode: str) -> list[str]:
        return ["--http-port", str(ports[mode]), "--http-host", "127.0.0.1"] if ports else []
    control = [*on, *args.control_args.split()] if args.control_on else off
    with BenchServer(*flags, *on, *http("on"), quiet=True) as on_server, \
            BenchServer(*flags, *off, *http("off"), quiet=True) as off_server, \
            BenchServer(*flags, *control, *http("off-2"), quiet=True, cwd=args.control_tree or None) as control_server:
        readers = []
        for server in ([on_server] + ([control_server] if args.control_on else [])) if args.reader else []:
            readers.append(subprocess.Popen([sys.executable, "-c", READER, server.url, SPACE.decode(),
                                             str(args.reader_every_ms / 1e3)], stdout=subprocess.PIPE, text=True))
            assert readers[-1].stdout.readline().strip() == "ready"
        sides = {"on": Side(on_server.url, args.adverts, args.list_tokens), "off": Side(off_server.url, False),
                 "off-2": Side(control_server.url, args.adverts and args.control_on, args.list_tokens)}
        pids = {"on": on_server.pid, "off": off_server.pid, "off-2": control_server.pid}
        cpu: dict[tuple[str, str, str], list[int]] = {}     # [ns, requests] of the server, per block
        served: dict[tuple[str, str, str], list[float]] = {}  # the server's own mean time, per block
        threads: dict[tuple[str, str, str], list[int]] = {}  # (size, server, thread kind): [ns, STOREs]
        try:
            for side in sides.values():         # warm-up: fill the pools, so rounds evict
                for _ in range(3):
                    for case in CASES:
                        for _ in range(args.stores):
                            side.store(case)
                        side.lookup(case)
            per_round: dict[tuple[str, str, str], list[float]] = {}
            cases = list(CASES)
            # per server: the block that ended last, and its loop's CPU then
            last: dict[str, tuple[str, int]] = {m: ("", thread_ns(pids[m])["loop"]) for m in MODES}

            def after(mode: str, now: int) -> None:
                """The loop's CPU since the server's last block ended (work it deferred to when idle,
                KV_EVENTS), to that block. Only the loop: the pool's populate thread works then too."""
                case, then = last[mode]
                if case:
                    acc = cpu.setdefault((case, mode, "after"), [0, 0])
                    acc[0] += now - then
                    acc[1] += args.stores
            def interleaved(i: int, case: str) -> None:
                """One size's block with the servers' requests taken in turn, one each (the order
                rotating), so that each server's requests meet the same moments of the machine."""
                t0 = {m: thread_ns(pids[m]) for m in MODES}
                for m in MODES:
                    after(m, t0[m]["loop"])
                s0 = {m: server_seconds(ports[m]) for m in MODES} if ports else {}
                times: dict[tuple[str, str], list[float]] = {}
                marks = []
                for what, n in (("store", args.stores), ("lookup", args.lookups)):
                    for j in range(n):
                        k = (i + j) % 3
                        for m in MODES[k:] + MODES[:k]:
                            times.setdefault((m, what), []).append(paced(getattr(sides[m], what), case))
                    marks.append({m: thread_ns(pids[m]) for m in MODES})
                for m in MODES:
                    if ports:
                        s1 = server_seconds(ports[m])
                        for what, name in (("store", "Store"), ("lookup", "Lookup")):
                            (a0, n0), (a1, n1) = s0[m].get(name, (0.0, 0)), s1.get(name, (0.0, 0))
                            if n1 > n0:
                                served.setdefault((case, m, what), []).append((a1 - a0) / (n1 - n0))
                    t1, t2 = marks
                    for name, ns in t1[m].items():
                        acc = threads.setdefault((case, m, name), [0, 0])
                        acc[0] += ns - t0[m].get(name, 0)
                        acc[1] += args.stores
                    c0, c1, c2 = (sum(x[m].values()) for x in (t0, t1, t2))
                    for what, ns, n in (("store", c1 - c0, args.stores), ("lookup", c2 - c1, args.lookups)):
                        acc = cpu.setdefault((case, m, what), [0, 0])
                        acc[0] += ns
                        acc[1] += n
                        per_round.setdefault((case, m, what), []).append(statistics.median(times[(m, what)]))
                    last[m] = (case, t2[m]["loop"])

            for i in range(args.rounds):
                order = list(MODES[i % 3:] + MODES[:i % 3])
                if i // 3 % 2:
                    order.reverse()
                rot = cases[i % len(cases):] + cases[:i % len(cases)]
                for case in rot:
                    if args.interleave:
                        interleaved(i, case)
                        continue
                    for mode in order:
                        side = sides[mode]
                        t0 = thread_ns(pids[mode])
                        c0 = sum(t0.values())
                        after(mode, t0["loop"])
                        stores = [paced(side.store, case) for _ in range(args.stores)]
                        t1 = thread_ns(pids[mode])
                        c1 = sum(t1.values())
                        for name, ns in t1.items():
                            acc = threads.setdefault((case, mode, name), [0, 0])
                            acc[0] += ns - t0.get(name, 0)
                            acc[1] += args.stores
                        lookups = [paced(side.lookup, case) for _ in range(args.lookups)]
                        t2 = thread_ns(pids[mode])
                        c2 = sum(t2.values())
                        for what, ns, n in (("store", c1 - c0, args.stores), ("lookup", c2 - c1, args.lookups)):
                            acc = cpu.setdefault((case, mode, what), [0, 0])
                            acc[0] += ns
                            acc[1] += n
                        last[mode] = (case, t2["loop"])
                        per_round.setdefault((case, mode, "store"), []).append(statistics.median(stores))
                        per_round.setdefault((case, mode, "lookup"), []).append(statistics.median(lookups))
            time.sleep(0.5)                          # what the servers still had to do
            for mode in MODES:
                after(mode, thread_ns(pids[mode])["loop"])
            evictions = {m: s.client.status().pool.evictions for m, s in sides.items()}
        finally:
            for side in sides.values():
                side.close()
            for reader in readers:
                reader.kill()
                reader.wait()
            gc.collect()
    return {"per_round": per_round, "evictions": evictions, "cpu": cpu, "threads": threads, "served": served}


def table(sessions: list[dict]) -> str:
    """Per (size, request): the median over sessions of each session's median over rounds, and
    the ratios per session (their median, and min-max over the sessions)."""
    lines = ["| chunk | request | off | on | **on/off** (min-max over sessions) | off-2/off: A/A control (min-max) "
             "| server CPU off | server CPU on | **CPU on/off** | CPU off-2/off |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    cpu_all = ["", "Server CPU per STORE all told: the STOREs' own, the LOOKUPs' after them, and the loop's after "
               "the block (work deferred to when it is idle, KV_EVENTS; while the client talks to the other "
               "servers), per STORE:", "",
               "| chunk | off | on | loop after the block: off | on | **all told on/off** | off-2/off |",
               "|---|---|---|---|---|---|---|"]
    for case in CASES:
        for what in ("store", "lookup"):
            med = {m: [statistics.median(r["per_round"][(case, m, what)]) for r in sessions] for m in MODES}
            r_on = [a / b for a, b in zip(med["on"], med["off"])]
            r_aa = [a / b for a, b in zip(med["off-2"], med["off"])]
            m_off, m_on = statistics.median(med["off"]), statistics.median(med["on"])
            unit, scale = ("ms", 1e3) if what == "store" else ("µs", 1e6)
            per = {m: [r["cpu"][(case, m, what)][0] / r["cpu"][(case, m, what)][1] / 1e3 for r in sessions]
                   for m in MODES}                                     # µs of server CPU per request
            c_on, c_off, c_aa = (statistics.median(per[m]) for m in MODES)
            cr_on = statistics.median(a / b for a, b in zip(per["on"], per["off"]))
            cr_aa = statistics.median(a / b for a, b in zip(per["off-2"], per["off"]))
            lines.append(f"| {case} | {what.upper()} x{CHUNKS} | {m_off * scale:.3f} {unit} "
                         f"| {m_on * scale:.3f} {unit} "
                         f"| **{statistics.median(r_on):.3f}** ({min(r_on):.2f}-{max(r_on):.2f}) "
                         f"| {statistics.median(r_aa):.3f} ({min(r_aa):.2f}-{max(r_aa):.2f}) "
                         f"| {c_off:.0f} µs | {c_on:.0f} µs | **{cr_on:.3f}** | {cr_aa:.3f} |")
        total = {m: [sum(r["cpu"].get((case, m, w), [0, 1])[0] for w in ("store", "lookup", "after"))
                     / r["cpu"][(case, m, "store")][1] / 1e3 for r in sessions] for m in MODES}
        later = {m: statistics.median(r["cpu"].get((case, m, "after"), [0, 1])[0]
                                      / r["cpu"][(case, m, "store")][1] / 1e3 for r in sessions) for m in MODES}
        t_on = statistics.median(a / b for a, b in zip(total["on"], total["off"]))
        t_aa = statistics.median(a / b for a, b in zip(total["off-2"], total["off"]))
        cpu_all.append(f"| {case} | {statistics.median(total['off']):.0f} µs | {statistics.median(total['on']):.0f} µs "
                       f"| {later['off']:.0f} µs | {later['on']:.0f} µs | **{t_on:.3f}** | {t_aa:.3f} |")
    return "\n".join(lines + cpu_all)


def served_table(sessions: list[dict]) -> str:
    """The servers' own time per request (arrival to answer, their /metrics), per session the
    median over blocks of the block's mean; on/off and off-2/off per session, their median."""
    lines = ["| chunk | request | off (server's own) | on | **on/off** (min-max over sessions) | off-2/off |",
             "|---|---|---|---|---|---|"]
    for case in CASES:
        for what in ("store", "lookup"):
            med = {m: [statistics.median(r["served"][(case, m, what)]) for r in sessions] for m in MODES}
            r_on = [a / b for a, b in zip(med["on"], med["off"])]
            r_aa = [a / b for a, b in zip(med["off-2"], med["off"])]
            lines.append(f"| {case} | {what.upper()} x{CHUNKS} | {statistics.median(med['off']) * 1e6:.0f} µs "
                         f"| {statistics.median(med['on']) * 1e6:.0f} µs | **{statistics.median(r_on):.3f}** "
                         f"({min(r_on):.2f}-{max(r_on):.2f}) | {statistics.median(r_aa):.3f} |")
    return "\n".join(lines)


def thread_table(sessions: list[dict]) -> str:
    """Server CPU per STORE by kind of thread, median over sessions, on against off."""
    names = sorted({k[2] for r in sessions for k in r["threads"]})
    lines = ["| chunk | thread | CPU per STORE off | on | on - off |", "|---|---|---|---|---|"]
    for case in CASES:
        for name in names:
            per = {m: statistics.median(r["threads"].get((case, m, name), [0, 1])[0]
                                        / r["threads"].get((case, m, name), [0, 1])[1] / 1e3 for r in sessions)
                   for m in ("on", "off")}
            if per["on"] < 1 and per["off"] < 1:
                continue
            lines.append(f"| {case} | {name} | {per['off']:.0f} µs | {per['on']:.0f} µs "
                         f"| {per['on'] - per['off']:+.0f} µs |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=6, help="fresh servers each time (default 6)")
    ap.add_argument("--rounds", type=int, default=12, help="rounds per session (default 12)")
    ap.add_argument("--stores", type=int, default=12, help="STOREs per size, server and round")
    ap.add_argument("--lookups", type=int, default=30, help="LOOKUPs per size, server and round")
    ap.add_argument("--capacity", default="256MiB")
    ap.add_argument("--reader", action=argparse.BooleanOptionalAction, default=True,
                    help="a process reading the on server's KV_EVENTS every 20 ms (default on)")
    ap.add_argument("--on-index", type=int, default=None, metavar="N",
                    help="the on server's --kv-events-index (default: its default; 0: adverts sent to a server "
                         "that indexes nothing, their wire and decoding cost alone)")
    ap.add_argument("--adverts", action=argparse.BooleanOptionalAction, default=True,
                    help="the on server's STOREs carry adverts (default on; off: the index's cost without any)")
    ap.add_argument("--list-tokens", action="store_true",
                    help="adverts carry their token ids as a list of ints (a 3.7 client), not packed")
    ap.add_argument("--pace-ms", type=float, default=0.0, metavar="MS",
                    help="sleep MS before each timed request, as an engine computes a step between two "
                         "(default 0: back to back, the server saturated)")
    ap.add_argument("--interleave", action="store_true",
                    help="take the servers' requests in turn, one each, rather than in blocks of --stores "
                         "(with --pace-ms: every server's requests see the same moments of a noisy machine)")
    ap.add_argument("--reader-every-ms", type=float, default=50.0, metavar="MS",
                    help="the reader's KV_EVENTS interval (default 50: LmshmConnector's, EventFeed.every_s)")
    ap.add_argument("--server-time", action="store_true",
                    help="with --interleave: also each server's own time per request, arrival to answer "
                         "(its /metrics, served on a loopback --http-port)")
    ap.add_argument("--control-on", action="store_true",
                    help="make the third server a second *on* server (adverts, the index) with --control-args "
                         "added: its column is then an A/B against *on*, not an A/A control")
    ap.add_argument("--control-tree", default="", metavar="DIR",
                    help="run the third server from another lmshm checkout (with --control-on: the same "
                         "events, an A/B of two trees in one run; `git archive` of the commit before, say)")
    ap.add_argument("--control-args", default="", metavar="ARGS",
                    help="with --control-on: extra lmshm-server arguments of the third server "
                         "(e.g. \"--kv-events-hold 0\")")
    ap.add_argument("--threads", action="store_true", help="also print server CPU per STORE by kind of thread")
    ap.add_argument("--sizes", default=",".join(CASES), help="chunk sizes to run (default all: %(default)s)")
    args = parse_args(ap, smoke={"sessions": 1, "rounds": 1, "stores": 2, "lookups": 2, "sizes": "64 KiB", "threads": True})
    if args.on_index == 0:
        args.reader = False         # such a server answers no KV_EVENTS
    for name in list(CASES):
        if name not in args.sizes.split(","):
            del CASES[name]
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    sessions = [run(args) for _ in range(args.sessions)]
    adverts = (", adverts" + (" with a list of token ids" if args.list_tokens else "")) if args.adverts else \
        ", no adverts"
    what = ("index" if args.on_index is None else f"--kv-events-index {args.on_index}") + adverts + \
        (f", a KV_EVENTS reader every {args.reader_every_ms:g} ms" if args.reader else "") + \
        (", requests interleaved" if args.interleave else "")
    print(f"# KV events on ({what}) against off "
          f"(--kv-events-index 0, no adverts) and a second off server (A/A control); {args.sessions} sessions of "
          f"fresh servers x {args.rounds} rounds of {args.stores} STOREs and {args.lookups} LOOKUPs per size and "
          f"server; {CHUNKS} chunks a request; --capacity {args.capacity}"
          + (f"; {args.pace_ms:g} ms before each request" if args.pace_ms else "; back to back"))
    print(f"# load average {load:.2f} before, {os.getloadavg()[0]:.2f} after; {time.monotonic() - t0:.0f} s; "
          f"pool evictions per server in the last session {sessions[-1]['evictions']}")
    print(table(sessions))
    if args.server_time and args.interleave:
        print()
        print(served_table(sessions))
    if args.threads:
        print()
        print(thread_table(sessions))


if __name__ == "__main__":
    main()
