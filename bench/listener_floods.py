"""What raw-ZMTP attacks on lmshm-server's ZeroMQ listener cost it, and its honest peers.

    .venv/bin/python bench/listener_floods.py [--checkout DIR] [--connections 64] [--seconds 4]

Each part starts a fresh ``lmshm-server --url tcp://127.0.0.1:0 --log-level INFO
--auth-timeout 30 --capacity 0`` (no connection is idle-dropped while it is measured, and no
pool's pages move its RSS) and attacks it from
this process with hand-made ZMTP (``tests/v1/server/attacks.py``: ``RawZmtp``):

- ``long-header``: ``--connections`` connections without a session, and one verified session,
  each send the 9-byte header of a frame of 16 MiB - 64 bytes and one byte of it. Printed: the
  server's RSS growth per connection;
- ``pong``: a verified session sends PING commands for ``--seconds`` and never reads a PONG.
  Printed: MiB sent, RSS growth, and MB/s of growth;
- ``tiny``: a peer without a session, then a verified one, each send 512 KiB of empty 2-byte
  messages and never read a reply. Printed: the log's bytes and lines per MiB sent;
- ``burst``: a verified session sends 4 MiB of empty messages at once, never reading.

During every part an honest peer sends a PING every 20 ms, each on a new connection; printed:
the median and the longest wait for its PONG. ``--checkout DIR`` runs the server from another
checkout's ``lmshm`` (e.g. ``git archive HEAD~1 | tar -x -C DIR``), to compare with the code
before a change; the server runs in a scratch directory, so the repository's own ``lmshm`` on
the current directory cannot shadow it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "v1" / "server"))

from attacks import DEALER_GREETING, RawZmtp, zmtp_frame, zmtp_ping
from harness import raw_reply, server_rss_kb

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import parse_args, raise_nofile
from _server import terminate

from lmshm.wire import codec, protocol

LIMIT = 16 << 20
READY = re.compile(r"listening on (\S+).*fd channel (\S+)")


class Server:
    def __init__(self, checkout: Path, scratch: Path) -> None:
        self.log_path = scratch / f"server-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "lmshm.server", "--url", "tcp://127.0.0.1:0", "--fd-socket",
               str(scratch / f"fds-{time.monotonic_ns()}.sock"), "--log-level", "INFO", "--auth-timeout", "30", "--capacity", "0"]
        self.proc = subprocess.Popen(cmd, cwd=scratch, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env={**os.environ, "PYTHONPATH": str(checkout)})
        line = self.proc.stdout.readline()
        m = re.search(r"(tcp://\S+)", line)
        if not m:
            self.stop()
            raise RuntimeError(f"lmshm-server did not start: {line!r}\n{self.log_path.read_text()}")
        self.url = m.group(1).rstrip(",;")

    def rss_kb(self) -> int:
        return server_rss_kb(self.proc.pid)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        terminate(self.proc, 20)
        self.proc.stdout.close()
        self._log.close()


class HonestPings:
    """A PING every 20 ms on a new connection each, on a thread, while the attack runs."""

    def __init__(self, url: str) -> None:
        self.url, self.took, self.failed = url, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                assert isinstance(raw_reply(self.url, codec.encode(protocol.Ping()), timeout_s=10), protocol.Pong)
                self.took.append(time.monotonic() - t)
            except AssertionError:
                self.failed += 1
            self._stop.wait(0.02)

    def done(self) -> str:
        self._stop.set()
        self._thread.join(30)
        if not self.took:
            return f"honest PINGs: none answered ({self.failed} lost)"
        return (f"honest PINGs: median {statistics.median(self.took) * 1000:.1f} ms, max {max(self.took) * 1000:.1f} "
                f"ms over {len(self.took)}" + (f", {self.failed} LOST" if self.failed else ""))


def send_all(peer: RawZmtp, data: bytes, seconds: float) -> int:
    """Send ``data`` without reading, for at most ``seconds``; the bytes sent."""
    peer.sock.setblocking(False)
    view, sent, deadline = memoryview(data), 0, time.monotonic() + seconds
    while view and time.monotonic() < deadline:
        try:
            n = peer.sock.send(view)
        except BlockingIOError:
            time.sleep(0.002)
            continue
        sent += n
        view = view[n:]
    return sent


def long_header(server: Server, args: argparse.Namespace) -> str:
    rss0 = server.rss_kb()
    peers = [RawZmtp(server.url) for _ in range(args.connections)] + [RawZmtp(server.url).verify()]
    for i, peer in enumerate(peers):
        attack = zmtp_frame(i.to_bytes(8, "big"), more=True) + zmtp_frame(b"x", size=LIMIT - 64)
        peer.send(attack)
    time.sleep(1.0)
    grown = server.rss_kb() - rss0
    for peer in peers:
        peer.close()
    return (f"{len(peers)} connections, {len(DEALER_GREETING) + len(attack)} bytes sent each: server RSS "
            f"+{grown / 1024:.1f} MiB, "
            f"{grown / len(peers):.0f} KiB per connection")


def pong(server: Server, args: argparse.Namespace) -> str:
    peer = RawZmtp(server.url).verify()
    rss0 = server.rss_kb()
    pings = zmtp_ping() * 4096
    peer.sock.setblocking(False)
    sent, view, deadline = 0, memoryview(pings), time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        try:
            n = peer.sock.send(view)
        except BlockingIOError:
            time.sleep(0.002)
            continue
        sent += n
        view = view[n:] or memoryview(pings)
    grown = server.rss_kb() - rss0
    peer.close()
    return (f"{sent / 2**20:.1f} MiB of PINGs in {args.seconds:g} s: server RSS +{grown / 1024:.1f} MiB "
            f"({grown / 1024 * 1.048576 / args.seconds:.1f} MB/s)")


def tiny(server: Server, args: argparse.Namespace) -> str:
    log0 = len(server.log().encode())
    lines0 = len(server.log().splitlines())
    sent = 0
    peers = [RawZmtp(server.url), RawZmtp(server.url).verify()]
    for peer in peers:
        sent += send_all(peer, b"\x00\x00" * (256 << 10), 30)
    time.sleep(1.0)
    text = server.log()
    mib = sent / 2**20
    for peer in peers:
        peer.close()
    return (f"{mib:.2f} MiB of empty messages: {(len(text.encode()) - log0) / mib / 1024:.1f} KiB of log and "
            f"{(len(text.splitlines()) - lines0) / mib:.0f} lines per MiB sent")


def burst(server: Server, args: argparse.Namespace) -> str:
    peer = RawZmtp(server.url).verify()
    sent = send_all(peer, b"\x00\x00" * (2 << 20), 30)
    time.sleep(1.0)
    peer.close()
    return f"{sent / 2**20:.1f} MiB of empty messages at once from a verified session"


PARTS = {"long-header": long_header, "pong": pong, "tiny": tiny, "burst": burst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--checkout", type=Path, default=ROOT, help="run the server from this checkout's lmshm")
    parser.add_argument("--connections", type=int, default=64, help="connections of the long-header part")
    parser.add_argument("--seconds", type=float, default=4.0, help="how long the pong part sends")
    parser.add_argument("--only", default="", help="comma-separated parts: " + ", ".join(PARTS))
    parser.add_argument("--one-server", action="store_true", help=argparse.SUPPRESS)
    args = parse_args(parser, smoke={"connections": 4, "seconds": 0.3, "one_server": True})
    raise_nofile(4096)
    parts = [p for p in args.only.split(",") if p] or list(PARTS)
    scratch = Path(tempfile.mkdtemp(prefix="listener-floods."))
    print(f"server from {args.checkout}")
    shared = Server(args.checkout.resolve(), scratch) if args.one_server else None
    try:
        for name in parts:
            server = shared or Server(args.checkout.resolve(), scratch)
            try:
                raw_reply(server.url, codec.encode(protocol.Ping()))
                pings = HonestPings(server.url)
                result = PARTS[name](server, args)
                alive = server.proc.poll() is None
                print(f"{name:12s} {result}; {pings.done()}{'' if alive else '; THE SERVER DIED'}", flush=True)
            finally:
                if server is not shared:
                    server.stop()
    finally:
        if shared is not None:
            shared.stop()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
