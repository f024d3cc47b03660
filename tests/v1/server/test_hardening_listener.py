"""Hardening round 3, the ZeroMQ listener (issue 25, items 1-3): raw ZMTP from peers that lie
about lengths, never read, or send floods of tiny messages, against a real lmshm-server.

- a long frame's header no longer buys its length in server memory: what a connection holds
  grows with the bytes it sent, and connections without a verified session share one budget;
- everything queued for a peer (PONGs too) counts against one bound, past which its
  connection is not read;
- lines a peer causes are rate-limited, and one read cannot make more work than a few
  milliseconds' worth, so honest peers are still answered.
"""

from __future__ import annotations

import threading
import time

from attacks import (
    RawZmtp,
    ends_well,
    need_fds,
    stop_server,
    tmp_dir,  # noqa: F401 - a fixture
    warm_up,
    zmtp_frame,
    zmtp_ping,
)
from harness import RSS_SLACK_KB, ServerProcess, raw_reply, server_rss_kb

from lmshm.wire import codec, protocol

LIMIT = 16 << 20     # the default --max-message-bytes


def _rss_kb(server: ServerProcess) -> int:
    return server_rss_kb(server.proc.pid)


def _honest_pings(url: str, n: int, pause_s: float = 0.02) -> list[float]:
    """``n`` PINGs from a fresh connection each; the seconds each took."""
    took = []
    for _ in range(n):
        t = time.monotonic()
        assert isinstance(raw_reply(url, codec.encode(protocol.Ping()), timeout_s=10), protocol.Pong)
        took.append(time.monotonic() - t)
        time.sleep(pause_s)
    return took


def test_a_long_frames_header_costs_the_server_only_the_bytes_sent(tmp_dir):
    # Before: the 9-byte header of a 16 MiB frame plus one byte made the server allocate the
    # 16 MiB (zero-filled): 32 connections over tcp added 512 MiB of RSS for about 3.5 KB sent.
    # A READY command of 16 MiB before the handshake did the same as its bytes came.
    need_fds(512)
    server = ServerProcess(tmp_dir, "--log-level", "INFO")
    peers: list[RawZmtp] = []
    try:
        before, worker = warm_up(server)
        rss0 = _rss_kb(server)
        for _ in range(32):                                  # without a session: thrown away as it comes
            peer = RawZmtp(server.url)
            peer.send(zmtp_frame(b"\x00" * 8, more=True) + zmtp_frame(b"x", size=LIMIT - 64))
            peers.append(peer)
        verified = RawZmtp(server.url).verify()               # a verified session: kept, as it arrives
        peers.append(verified)
        verified.send(zmtp_frame(b"\x00" * 7 + b"\x02", more=True) + zmtp_frame(b"x", size=LIMIT - 64))
        commands = []
        for _ in range(8):                                   # a READY command claiming 16 MiB
            peer = RawZmtp(server.url, handshake=False)
            peer.send(DEALER_GREETING_ONLY + zmtp_frame(b"\x05READY", command=True, size=LIMIT - 64))
            commands.append(peer)
        for peer in commands:
            assert peer.closed(), "a command longer than any ZMTP command needs is a protocol error"
        time.sleep(0.5)
        grown_kb = _rss_kb(server) - rss0
        print(f"\n41 connections that claimed 16 MiB frames and sent ~1 byte of each: server RSS +{grown_kb} KiB")
        assert grown_kb < 16 * 1024, f"the server's RSS grew by {grown_kb} KiB for ~4 KB sent"
        # The verified session's frame still arrives whole, and is answered (not a request: INVALID_ARG).
        rest = 2 << 20
        verified.send(b"y" * rest)
        assert _rss_kb(server) - rss0 < 16 * 1024 + 3 * rest // 1024   # it grows with what came
        verified.send(b"y" * (LIMIT - 64 - 1 - rest))
        reply = codec.decode_reply(verified.recv_message(30)[1])
        assert reply.code == protocol.ErrorCode.INVALID_ARG, reply
        # And the ones without a session get their answer too, once their frame is in.
        peers[0].send(b"z" * (LIMIT - 64 - 1))
        reply = codec.decode_reply(peers[0].recv_message(30)[1])
        assert reply.code == protocol.ErrorCode.INVALID_ARG and "without a verified session" in reply.message, reply
        for peer in peers + commands:
            peer.close()
        ends_well(server, before, worker)
    finally:
        for peer in peers:
            peer.close()
        stop_server(server)


DEALER_GREETING_ONLY = b"\xff" + b"\0" * 8 + b"\x7f\x03\x01" + b"NULL".ljust(20, b"\0") + b"\0" * 32


def test_connections_without_a_session_share_one_budget_for_the_bytes_they_hold(tmp_dir):
    # Each of 400 connections holds 60,000 bytes of a frame it never finishes (under the 64 KiB
    # a peer without a session may send): 24 MB in all. Before: all of it was held until the
    # idle timeout. Now they share 16 MiB: the ones that hold the most are closed.
    need_fds(1024)
    # --auth-timeout 30: connections without a session are idle-dropped only after 30 s.
    server = ServerProcess(tmp_dir, "--log-level", "INFO", "--auth-timeout", "30")
    peers: list[RawZmtp] = []
    try:
        before, worker = warm_up(server)
        rss0 = _rss_kb(server)
        for _ in range(400):
            peer = RawZmtp(server.url)
            peer.send(zmtp_frame(b"\x00" * 8, more=True) + zmtp_frame(b"h" * 60_000, size=65_000))
            peers.append(peer)
        time.sleep(0.5)
        grown_kb = _rss_kb(server) - rss0
        closed = sum(peer.closed(0.01) for peer in peers)
        print(f"\n400 connections holding 60,000 bytes each: {closed} closed by the server, RSS +{grown_kb} KiB")
        assert closed >= (400 * 60_000 - (16 << 20)) // 60_000, closed
        assert max(_honest_pings(server.url, 5)) < 5.0
        for peer in peers:
            peer.close()
        ends_well(server, before, worker)
    finally:
        for peer in peers:
            peer.close()
        stop_server(server)


def test_pings_from_a_verified_peer_that_never_reads_cannot_grow_the_server(tmp_dir):
    # Before: every PING's PONG was queued, without bound: RSS grew ~50 MB/s for as long as the
    # peer sent, and stayed (a verified session is never idle-dropped). Now past 256 KiB of
    # output waiting for it the connection is not read, so its PINGs wait in the kernel.
    server = ServerProcess(tmp_dir, "--log-level", "INFO")
    peer = None
    try:
        before, worker = warm_up(server)
        peer = RawZmtp(server.url).verify()
        rss0 = _rss_kb(server)
        pings = zmtp_ping() * 4096
        peer.sock.setblocking(False)
        sent, view, deadline = 0, memoryview(pings), time.monotonic() + 4.0
        while time.monotonic() < deadline:
            try:
                n = peer.sock.send(view)
            except BlockingIOError:
                time.sleep(0.01)
                continue
            sent += n
            view = view[n:] or memoryview(pings)        # whole commands only, one after another
        grown_kb = _rss_kb(server) - rss0
        print(f"\nPINGs for 4 s without reading a PONG: {sent >> 20} MiB sent, server RSS +{grown_kb} KiB")
        assert grown_kb < RSS_SLACK_KB, f"RSS grew by {grown_kb} KiB"
        assert max(_honest_pings(server.url, 5)) < 5.0
        peer.close()
        ends_well(server, before, worker)
    finally:
        if peer is not None:
            peer.close()
        stop_server(server)


def _log_lines(server: ServerProcess, *needles: str) -> int:
    return sum(any(n in line for n in needles) for line in server.log().splitlines())


def test_a_flood_of_tiny_malformed_messages_writes_a_few_log_lines_and_honest_pings_are_answered(tmp_dir):
    # 2-byte empty messages, never read: before, one WARNING for each ("refused a message") and
    # one for each reply that found the queue full ("could not reply"): 512 KiB sent wrote
    # ~258,000 lines. And one read turned 4 MiB into 2 million messages at once: an honest
    # PING waited up to 1.2 s behind them.
    server = ServerProcess(tmp_dir, "--log-level", "INFO")
    peers: list[RawZmtp] = []
    try:
        before, worker = warm_up(server)
        lines0 = _log_lines(server, "refused a message", "could not reply")
        flood = b"\x00\x00" * (256 << 10)                    # 512 KiB: 262,144 empty messages
        took: list[float] = []
        pinger = threading.Thread(target=lambda: took.extend(_honest_pings(server.url, 40, 0.05)))
        pinger.start()
        for verify in (False, True):                         # without a session, then with one
            peer = RawZmtp(server.url)
            if verify:
                peer.verify()
            peers.append(peer)
            peer.sock.setblocking(False)
            view, deadline = memoryview(flood), time.monotonic() + 20
            while view and time.monotonic() < deadline:
                try:
                    view = view[peer.sock.send(view):]
                except BlockingIOError:
                    time.sleep(0.005)
        pinger.join(60)
        time.sleep(1.0)
        lines = _log_lines(server, "refused a message", "could not reply") - lines0
        log_bytes = len(server.log().encode())
        print(f"\n1 MiB of empty messages from two peers that never read: {lines} log lines about them "
              f"({log_bytes} bytes of log in all); honest PINGs meanwhile: max {max(took) * 1000:.1f} ms, "
              f"median {sorted(took)[len(took) // 2] * 1000:.1f} ms")
        assert lines <= 20, f"{lines} lines"
        assert len(took) == 40 and max(took) < 2.0, took
        for peer in peers:
            peer.close()
        ends_well(server, before, worker)
    finally:
        for peer in peers:
            peer.close()
        stop_server(server)
