"""What hostile peers of the KV event stream (``--kv-events``, ``--kv-events-replay``) cost
lmshm-server: RSS growth and open fds, for this checkout and, side by side, another.

    .venv/bin/python bench/kv_stream_floods.py [--before DIR] [--parts subs,peers,replay,stuck,idle]

``--before DIR`` runs the same attacks on a server from another checkout's ``lmshm`` (e.g.
``git worktree add /tmp/before-stream <commit>``), one server of each at a time, from a
scratch directory so that neither imports the other's code. Each part starts a fresh
``lmshm-server --capacity 64MiB --max-objects 4 --kv-events-buffer 1024 --kv-events tcp://*:P
--kv-events-replay tcp://127.0.0.1:Q`` (``*``: the code before bound no other TCP host; the
pool and the log kept small, so that what the STOREs themselves leave does not hide the
attack's cost) and an ``MPClient`` in this process that stores adverts (1,024 engine blocks a
chunk, 64 chunks a STORE: ~300 KiB of events):

- ``none``: the STOREs of ``subs`` and of ``stuck`` without an attack (a subscriber that
  reads): what they cost alone;
- ``subs``: 3 SUB peers send 8,000 distinct 1,000-byte subscriptions each (24 MB) while 30
  STOREs go out (the PUB takes subscriptions in as it sends). Printed: RSS growth, and after the
  peers closed;
- ``peers``: 100 SUB peers each send 3 distinct 1,000-byte subscriptions (under the per-peer
  cap); the same STOREs. Printed: RSS growth, connections kept;
- ``replay``: 48 STOREs (~28 MiB of batches buffered), then 16 DEALERs ask for a replay from 0
  and never read. Printed: RSS growth;
- ``stuck``: one SUB that never reads (RCVHWM 1, 4 KiB socket buffer) while 180 STOREs go out
  at the default --kv-events-hwm. Printed: MiB published, RSS growth;
- ``idle``: 1,100 idle TCP connections to the replay port. Printed: the server's open fds
  before and with them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from _common import free_port, open_fds, parse_args, raise_nofile, rss
from _server import BenchServer

SCALE = 1.0     # --smoke: counts and waits scaled down (at least 1 of each)


def _n(count: int) -> int:
    return max(1, round(count * SCALE))


def _wait(seconds: float) -> None:
    time.sleep(seconds * SCALE)


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return next((float(line.split()[1]) for line in text.splitlines() if line.split()[:1] == [name]), -1.0)


class Target:
    """A server from ``checkout`` with the stream on loopback, and an engine storing adverts."""

    def __init__(self, checkout: Path, *args: str) -> None:
        self.scratch = tempfile.mkdtemp(prefix="lmshm-kvflood-")
        self.pub_port, self.replay_port, self.http = free_port(), free_port(), free_port()
        self.server = BenchServer("--capacity", "64MiB", "--max-objects", "4", "--kv-events-buffer", "1024",
                                  "--kv-events", f"tcp://*:{self.pub_port}",
                                  "--kv-events-replay", f"tcp://127.0.0.1:{self.replay_port}",
                                  "--http-port", str(self.http), *args, quiet=True, cwd=self.scratch,
                                  env={**os.environ, "PYTHONPATH": str(checkout), "LMSHM_POOL_POPULATE_AHEAD": "0"})
        import torch

        from lmshm.transport.client import MPClient

        self.client = MPClient(self.server.url)
        self.kv = torch.zeros(64, 4, 64)
        self.iid = self.client.register_kv_caches({"l0": self.kv}, "bench", model_name="m")
        self.k = 0
        self.store(_n(40))      # warm up: the pool's pages, the log's ring, the allocator
        _wait(0.5)

    def rss(self) -> int:
        return rss(self.server.pid)

    def store(self, n: int = 1) -> None:
        from lmshm.wire import protocol

        for _ in range(n):
            k, self.k = self.k, self.k + 1
            first = [(1 << 40) + ((k * 64 + i) << 10) for i in range(64)]
            adverts = [protocol.Advert(k.to_bytes(4, "big") + bytes([i]) * 28, 0, 16,
                                       list(range(first[i], first[i] + 1024))) for i in range(64)]
            self.client.store(self.iid, [a.chunk for a in adverts], list(range(64)), 1, adverts=adverts,
                              space=b"S", pod="p")

    def paced(self) -> int:
        """The 30 STOREs of subs and peers, 0.1 s apart; the server's RSS growth over them."""
        before = self.rss()
        for _ in range(_n(30)):
            self.store()
            _wait(0.1)
        return self.rss() - before

    def burst(self, sub: zmq.Socket) -> tuple[int, float]:
        """``sub`` subscribes to everything; 20 STOREs settle, then the 180 of stuck: the
        server's RSS growth and the bytes published over those."""
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.store(_n(20))
        _wait(0.5)
        before, sent = self.rss(), _metric(self.http, "lmshm_kv_events_published_bytes")
        self.store(_n(180))
        _wait(0.5)
        return self.rss() - before, _metric(self.http, "lmshm_kv_events_published_bytes") - sent

    def close(self) -> None:
        self.client.close()
        self.server.stop()
        shutil.rmtree(self.scratch, ignore_errors=True)


def _socket(kind: int, *, stuck: bool = False) -> zmq.Socket:
    """A socket that closes at once; ``stuck``: one that holds 1 message and 4 KiB, never read."""
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if stuck:
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, 4096)
    return sock


def _sub(port: int, *, stuck: bool = False) -> zmq.Socket:
    sock = _socket(zmq.SUB, stuck=stuck)
    sock.setsockopt(zmq.SNDHWM, 0)      # every subscription goes out
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def part_none(t: Target) -> str:
    grown = t.paced()
    s = _sub(t.pub_port)
    read, _ = t.burst(s)
    s.close()
    return f"+{grown / 2**20:.0f} MiB for the 30 STOREs of subs/peers alone; +{read / 2**20:.0f} " \
           f"MiB for stuck's 180 with a subscriber that reads"


def part_subs(t: Target) -> str:
    before = t.rss()
    peers = []
    for _ in range(3):
        s = _sub(t.pub_port)
        for i in range(_n(8000)):
            s.setsockopt(zmq.SUBSCRIBE, i.to_bytes(4, "big") * 250)
        peers.append(s)
    t.paced()
    grown = t.rss() - before
    for s in peers:
        s.close()
    t.store()
    _wait(1)
    return f"+{grown / 2**20:.0f} MiB under 24 MB of subscriptions; +{(t.rss() - before) / 2**20:.0f} MiB " \
           f"after the peers left"


def part_peers(t: Target) -> str:
    before = t.rss()
    peers = []
    for p in range(_n(100)):
        s = _sub(t.pub_port)
        for i in range(3):
            s.setsockopt(zmq.SUBSCRIBE, (p * 3 + i).to_bytes(4, "big") * 250)
        peers.append(s)
    t.paced()
    grown, fds = t.rss() - before, _metric(t.http, "lmshm_kv_events_connections")
    for s in peers:
        s.close()
    return f"+{grown / 2**20:.1f} MiB with 100 peers of 3 KB each; connections counted (refused ones until libzmq closes them): " \
           f"{'n/a' if fds < 0 else int(fds)}"


def part_replay(t: Target) -> str:
    t.store(_n(48))
    _wait(1)
    buffered = _metric(t.http, "lmshm_kv_events_published_bytes")
    before = t.rss()
    stuck = []
    for _ in range(16):
        s = _socket(zmq.DEALER, stuck=True)
        s.connect(f"tcp://127.0.0.1:{t.replay_port}")
        s.send_multipart([b"", (0).to_bytes(8, "big")])
        stuck.append(s)
    _wait(3)
    grown = t.rss() - before
    for s in stuck:
        s.close()
    return f"+{grown / 2**20:.0f} MiB with 16 requesters that never read ({buffered / 2**20:.0f} MiB buffered)"


def part_stuck(t: Target) -> str:
    s = _sub(t.pub_port, stuck=True)
    grown, sent = t.burst(s)
    s.close()
    return f"+{grown / 2**20:.0f} MiB while {sent / 2**20:.0f} MiB went out to a subscriber that never reads"


def part_idle(t: Target) -> str:
    base = open_fds(t.server.pid)
    held = []
    for _ in range(_n(1100)):
        c = socket.socket()
        c.setblocking(False)
        try:
            c.connect(("127.0.0.1", t.replay_port))
        except BlockingIOError:
            pass
        held.append(c)
    _wait(2)
    fds = open_fds(t.server.pid)
    for c in held:
        c.close()
    return f"{base} fds open before, {fds} with 1,100 idle connections to the replay port"


PARTS = {"none": part_none, "subs": part_subs, "peers": part_peers, "replay": part_replay, "stuck": part_stuck, "idle": part_idle}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="also run every part on a server from this checkout")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--scale", type=float, default=1.0, help=argparse.SUPPRESS)
    parser.add_argument("--one-server", action="store_true", help=argparse.SUPPRESS)
    # smoke: every part, with a twentieth of the counts and waits, all on one server
    args = parse_args(parser, smoke={"scale": 0.05, "one_server": True})
    global SCALE
    SCALE = args.scale
    raise_nofile(4096)
    trees = [("this", ROOT)] + ([("before", args.before.resolve())] if args.before else [])
    shared = {label: Target(tree) for label, tree in trees} if args.one_server else {}
    try:
        for name in args.parts.split(","):
            for label, tree in trees:
                t = shared.get(label) or Target(tree)
                try:
                    print(f"{name:7s} {label:7s} {PARTS[name](t)}", flush=True)
                finally:
                    if t is not shared.get(label):
                        t.close()
    finally:
        for t in shared.values():
            t.close()


if __name__ == "__main__":
    main()
