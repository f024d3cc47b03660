"""Hardening of lmshm's own transport (issue 15, findings 1, 2, 6, 8 and 9): floods of
connections and requests that used to abort lmshm-server or lock workers out.

Each test runs a real ``lmshm-server`` (under ``prlimit --nofile=1024`` where the fd limit is
the point), attacks it with real sockets -- from this process or from helper processes -- on a
host made busy by CPU-bound helper processes where the issue says so, and ends with an honest
worker process registering, the server alive, and its fds and RSS back near where they started.

Timing bounds are generous: the suite shares two cores with other work. Each states what it
was on the code before this change.
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import time

import pytest
from attacks import (  # noqa: F401 - no_worker_outlives_a_test and tmp_dir are fixtures
    FD_CHANNEL_FLOOD,
    HELLO_FLOOD,
    NOFILE_1024,
    STATUS_FLOOD,
    HonestWorker,
    busy_host,
    ends_well,
    free_port,
    hello_body,
    helper,
    need_fds,
    no_worker_outlives_a_test,
    stop_server,
    tmp_dir,
    warm_up,
)
from harness import (
    OwnSegments,
    PrefixedServerProcess,
    RawSession,
    ServerProcess,
    proc_fd_count,
    shm_wrapper,
)

from lmshm.wire import codec, protocol

# ---- finding 1: a gRPC connection flood, then a worker over ipc:// -------------------------------


def test_a_grpc_connection_flood_cannot_make_the_ipc_listener_abort_the_server(tmp_dir):
    # Before: 1,100 idle HTTP/2 connections took the server's fds to the limit, and the next
    # ipc:// connection made libzmq abort (src/ipc_listener.cpp:297, exit -6). Now the loop
    # accepts ipc connections itself, only while fds are free; the rest wait in the backlog.
    need_fds(3000)
    import zmq

    port = free_port()
    server = PrefixedServerProcess(tmp_dir, "--grpc-port", str(port), "--auth-timeout", "2",
                                   prefix=NOFILE_1024, url=f"ipc://{tmp_dir}/s.ipc")
    try:
        before, closing = warm_up(server)
        flood = []
        ctx = zmq.Context()
        dealers = []
        try:
            for _ in range(1100):
                s = socket.socket()
                s.setblocking(False)
                try:
                    s.connect(("127.0.0.1", port))
                except BlockingIOError:
                    pass
                flood.append(s)
            time.sleep(0.5)
            for s in flood:
                with contextlib.suppress(OSError):
                    s.send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            # Wait for the flood to take what it can of the server's fds.
            last, stable_since = 0, time.monotonic()
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                n = proc_fd_count(server.proc.pid)
                if n != last:
                    last, stable_since = n, time.monotonic()
                elif time.monotonic() - stable_since > 1.0:
                    break
                time.sleep(0.1)
            print(f"\nserver fds with the gRPC flood held: {last} of 1024")
            # Workers connect over ipc:// while the flood holds the fds.
            for _ in range(20):
                d = ctx.socket(zmq.DEALER)
                d.setsockopt(zmq.LINGER, 0)
                d.connect(server.url)
                d.send_multipart([b"\x00" * 8, hello_body()])
                dealers.append(d)
            time.sleep(2)
            assert server.alive, f"lmshm-server exited {server.proc.returncode}:\n{server.log()[-3000:]}"
        finally:
            for d in dealers:
                d.close(0)
            ctx.term()
            for s in flood:
                s.close()
        ends_well(server, before, closing)
    finally:
        stop_server(server)


# ---- finding 2: 2,000 HELLOs at once over ipc:// on a busy host ----------------------------------


@pytest.mark.alone
def test_2000_hellos_at_once_over_ipc_on_a_busy_host_cannot_abort_the_server(tmp_dir):
    # Before: the accept gate closed only after libzmq's I/O thread had accepted a burst, and
    # with two CPU-bound processes running the server aborted 3 times out of 3.
    need_fds(6000)
    import zmq

    server = PrefixedServerProcess(tmp_dir, "--auth-timeout", "2", prefix=NOFILE_1024, url=f"ipc://{tmp_dir}/s.ipc")
    try:
        before, closing = warm_up(server)
        outcome = {"session": 0, "refused": 0, "no answer": 0}
        with busy_host(2):
            ctx = zmq.Context()
            ctx.set(zmq.MAX_SOCKETS, 4096)
            socks = []
            try:
                for _ in range(2000):
                    sock = ctx.socket(zmq.DEALER)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.connect(server.url)
                    socks.append(sock)
                for sock in socks:
                    sock.send_multipart([b"\x00" * 8, hello_body()], zmq.NOBLOCK)
                poller = zmq.Poller()
                for sock in socks:
                    poller.register(sock, zmq.POLLIN)
                # Held for 12 s: past --auth-timeout and the 5 s idle timeout the server drops
                # these connections, and 2,000 DEALERs reconnect at once -- the burst that made
                # libzmq's I/O thread outrun the old accept gate.
                waiting, deadline, most_fds = set(socks), time.monotonic() + 12, 0
                while time.monotonic() < deadline and server.alive:
                    for sock, _ in poller.poll(100):
                        reply = codec.decode_reply(sock.recv_multipart()[1])
                        poller.unregister(sock)
                        waiting.discard(sock)
                        outcome["session" if isinstance(reply, protocol.HelloReply) else "refused"] += 1
                    with contextlib.suppress(OSError):
                        most_fds = max(most_fds, proc_fd_count(server.proc.pid))
                outcome["no answer"] = len(waiting)
                assert server.alive, f"lmshm-server exited {server.proc.returncode}:\n{server.log()[-3000:]}"
            finally:
                for sock in socks:
                    sock.close(0)
                ctx.term()
        print(f"\n2,000 HELLOs at once over ipc:// against a 1,024-fd server on a busy host: {outcome}; "
              f"at most {most_fds} fds open")
        assert outcome["session"] >= 1
        # ZeroMQ connections are accepted only while 128 fds are free (a few more come and go with the
        # loop's own work); before, libzmq accepted up to the limit and aborted there.
        assert most_fds <= 1024 - 96
        ends_well(server, before, closing, timeout_s=30)
    finally:
        stop_server(server)


# ---- finding 6: requests from peers without a verified session ------------------------------------



def test_a_status_flood_without_a_session_cannot_delay_verified_sessions_or_the_fd_channel(tmp_dir):
    # STATUS is made expensive here by 2,000 registrations (~30-100 ms each). Before: the fd
    # channel was served only after 64 requests, so a new worker waited seconds to verify,
    # and a verified PING waited behind one STATUS of every flooding peer. Now those peers
    # share a quarter of the loop's time, the least-served first, and the fd channel is served
    # every 10 ms of requests.
    server = ServerProcess(tmp_dir, "--max-registrations-per-session", "2000", "--log-level", "INFO")
    segments = OwnSegments(4096)
    try:
        before, closing = warm_up(server)
        seg = segments()
        wrapper = shm_wrapper(seg.name, 4096)
        n = 2000
        with RawSession(server.url, timeout_s=60) as owner, RawSession(server.url) as verified:
            for i in range(n):  # pipelined: everything sent before a reply is read
                owner.sock.send_multipart([i.to_bytes(8, "big"), codec.encode(protocol.RegisterKVCache(
                    instance_id=f"r{i}", model_name="m", world_size=1, worker_rank=0,
                    groups=[protocol.LayerGroup(wrapper, ["l0"], [0])]))])
            for _ in range(n):
                assert owner.sock.poll(60_000)
                assert isinstance(codec.decode_reply(owner.sock.recv_multipart()[1]), protocol.RegisterReply)
            t = time.monotonic()
            owner.request(protocol.Status(), timeout_s=30)
            status_s = time.monotonic() - t
            with helper(STATUS_FLOOD, server.url, "20", "4") as flood:
                assert flood.stdout.readline().strip() == "flooding", flood.stderr.read()
                time.sleep(1.0)
                pings = []
                for _ in range(30):
                    t = time.monotonic()
                    assert isinstance(verified.request(protocol.Ping(), timeout_s=30), protocol.Pong)
                    pings.append(time.monotonic() - t)
                    time.sleep(0.05)
                joins = []
                for _ in range(3):  # new workers: HELLO, then the fd channel
                    t = time.monotonic()
                    with RawSession(server.url, timeout_s=30):
                        joins.append(time.monotonic() - t)
                assert flood.poll() is None, flood.stderr.read()
            pings.sort()
            p50, p99 = statistics.median(pings), pings[int(0.99 * (len(pings) - 1))]
            print(f"\none STATUS alone: {status_s * 1000:.0f} ms; under a STATUS flood of 20 peers without a "
                  f"session: verified PING p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, max "
                  f"{pings[-1] * 1000:.1f} ms; a new worker's HELLO and fd-channel proof took "
                  f"{', '.join(f'{j:.2f}' for j in joins)} s")
            # Before: PING p99 ~1.0 s, max ~1.6 s here.
            assert p99 < max(0.5, 4 * status_s), pings
            assert max(joins) < max(2.0, 10 * status_s), joins
            for i in range(n):
                owner.sock.send_multipart([i.to_bytes(8, "big"), codec.encode(protocol.UnregisterKVCache(f"r{i}"))])
            for _ in range(n):
                assert owner.sock.poll(60_000)
                owner.sock.recv_multipart()
        ends_well(server, before, closing)
    finally:
        segments.unlink_all()
        stop_server(server)


# ---- finding 8: a flood of unauthenticated fd-channel connections ---------------------------------



def test_a_flood_of_unauthenticated_fd_channel_connections_cannot_lock_a_new_worker_out(tmp_dir):
    # Before: 1,100 connections to the fd socket that never authenticate filled the 64 pending
    # slots and the backlog, and a new worker failed at once ("out of connections" or a reset)
    # for as long as the flood was renewed. Now the oldest unauthenticated connection gives
    # way to a newcomer, and the worker retries a full backlog.
    need_fds(3000)
    server = ServerProcess(tmp_dir, "--auth-timeout", "5")
    try:
        before, closing = warm_up(server)
        worker = HonestWorker(server.url, timeout_s=10).ready()
        try:
            with helper(FD_CHANNEL_FLOOD, server.fd_socket, "1100") as flood:
                assert flood.stdout.readline().strip() == "flooding", flood.stderr.read()
                time.sleep(2.0)
                report = worker.run()
                assert flood.poll() is None, flood.stderr.read()
        finally:
            worker.kill()
        print(f"\nan honest worker during a flood of 1,100 unauthenticated fd-channel connections: {report}")
        assert report["ok"], report
        assert report["registered_s"] < 8.0, report   # before: failed within ~0.1 s
        assert "displaced" in server.log() or report["verified_s"] < 1.0
        ends_well(server, before, closing)
    finally:
        stop_server(server)


# ---- finding 9: lockouts while a flood is held ----------------------------------------------------



@pytest.mark.alone
def test_an_honest_worker_gets_in_while_2000_peers_keep_saying_hello_over_tcp(tmp_dir):
    # Before: the HELLO flood displaced the worker's session before it could prove its
    # identity, and the worker failed ("unknown session token"). Now a displaced session is
    # parked and its token still verifies; HELLOs of peers without a session share a quarter of
    # the loop, the least-served first; connections without a verified session are shed when
    # fds run low. Measured below: how long the worker waits.
    need_fds(6000)
    server = PrefixedServerProcess(tmp_dir, "--auth-timeout", "2", prefix=NOFILE_1024)
    try:
        before, closing = warm_up(server)
        workers = [HonestWorker(server.url, timeout_s=10) for _ in range(2)]  # torch imports in parallel
        for worker in workers:
            worker.ready()
        reports = []
        try:
            with busy_host(2), helper(HELLO_FLOOD, server.url, "2000") as flood:
                assert flood.stdout.readline().strip() == "flooding", flood.stderr.read()
                time.sleep(1.0)
                for worker in workers:
                    reports.append(worker.run())
                assert flood.poll() is None, flood.stderr.read()
                assert server.alive
        finally:
            for worker in workers:
                worker.kill()
        print(f"\nhonest workers while 2,000 peers keep saying HELLO over tcp:// (1,024-fd server, busy host): "
              f"{reports}")
        assert all(r["ok"] for r in reports), reports
        assert max(r["registered_s"] for r in reports) < 10.0, reports
        ends_well(server, before, closing, timeout_s=30)
    finally:
        stop_server(server)


def test_300_sessions_of_the_servers_uid_hold_a_worker_only_while_they_are_held(tmp_dir):
    # The per-uid cap (256 verified sessions) is the documented residual: a process of the
    # server's own uid can hold every slot of that uid for as long as it likes. Before, a new
    # worker of that uid failed at once; now it keeps asking until its timeout, so it gets in
    # as soon as a slot frees.
    need_fds(3000)
    server = ServerProcess(tmp_dir, "--auth-timeout", "2")
    try:
        before, closing = warm_up(server)
        held, refused = [], 0
        blocked, waiting = HonestWorker(server.url, timeout_s=1.0), HonestWorker(server.url, timeout_s=10)
        try:
            for _ in range(300):
                try:
                    held.append(RawSession(server.url, timeout_s=10))
                except Exception as exc:
                    assert "--max-sessions-per-uid" in str(exc), exc
                    refused += 1
            assert len(held) == 256 and refused == 44, (len(held), refused)
            report = blocked.run()
            assert not report["ok"] and "--max-sessions-per-uid" in report["error"], report
            print(f"\nwith 256 sessions of its uid held, a worker gives up after {report['after_s']:.2f} s "
                  f"(its timeout: 1 s): {report['error'][:160]}")
            waiting.go()
            time.sleep(1.0)
            t = time.monotonic()
            for s in held[:16]:
                s.close()
            report = waiting.report()
            freed_to_registered = time.monotonic() - t
            print(f"a worker that started while the slots were held registered {freed_to_registered:.2f} s after "
                  f"16 of them were freed: {report}")
            assert report["ok"] and report["registered_s"] > 0.9, report  # before: failed at once
            assert freed_to_registered < 3.0
        finally:
            for s in held:
                s.close()
        ends_well(server, before, closing)
    finally:
        stop_server(server)


# ---- the server's own ZMTP listener ---------------------------------------------------------------


def test_the_servers_zmtp_listener_reads_bytes_split_anywhere_and_answers_libzmq_peers(tmp_dir):
    # The server speaks ZMTP itself (libzmq never accepts for it): a peer's bytes may arrive in
    # any split, long frames go into a buffer that grows as they arrive, DEALER and REQ peers get
    # their replies.
    import select

    import zmq

    from lmshm.transport import zmtp

    listener_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener_sock.bind(str(tmp_dir / "z.ipc"))
    listener_sock.listen(8)
    poller = select.poll()

    def set_poll(fd: int, flags: int) -> None:
        if flags:
            poller.register(fd, (select.POLLIN if flags & zmtp.READABLE else 0)
                            | (select.POLLOUT if flags & zmtp.WRITABLE else 0))
        else:
            with contextlib.suppress(KeyError):
                poller.unregister(fd)

    listener = zmtp.ZmtpListener(listener_sock, max_message_bytes=8 << 20, send_queue=16,
                                 headroom=lambda: 100, set_poll=set_poll)
    got: list[tuple[bytes, list]] = []

    def spin(until, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not until() and time.monotonic() < deadline:
            for fd, ev in poller.poll(20):
                if fd == listener.listen_fd:
                    listener.on_listener()
                else:
                    listener.on_event(fd, (zmtp.WRITABLE if ev & select.POLLOUT else 0)
                                      | (zmtp.READABLE if ev & ~select.POLLOUT else 0))
            listener.pump()
            while (msg := listener.next_message()) is not None:
                identity, frames, problem = msg
                assert problem is None
                got.append((identity, frames))
                listener.send(identity, frames)  # echo
        assert until(), f"timed out; got {[(i, [len(f) for f in fr]) for i, fr in got]}"

    ctx = zmq.Context()
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # A hand-made DEALER, one byte at a time: greeting, READY, a two-frame message.
        raw.connect(str(tmp_dir / "z.ipc"))
        ready = b"\x05READY" + b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
        wire = (b"\xff" + b"\0" * 8 + b"\x7f\x03\x01" + b"NULL".ljust(20, b"\0") + b"\0" * 32
                + bytes((0x04, len(ready))) + ready + b"\x01\x08abcdefgh" + b"\x00\x03xyz")
        for i in range(len(wire)):
            raw.send(wire[i:i + 1])
            spin(lambda: True, 0)
        spin(lambda: len(got) == 1)
        assert got[0][1] == [b"abcdefgh", b"xyz"]
        # libzmq peers: a DEALER with a long frame (received in place), and a REQ.
        dealer, req = ctx.socket(zmq.DEALER), ctx.socket(zmq.REQ)
        for s in (dealer, req):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"ipc://{tmp_dir}/z.ipc")
        long = os.urandom(3 << 20)
        dealer.send_multipart([b"12345678", long])
        req.send(b"a request")
        spin(lambda: len(got) == 3 and dealer.poll(0) and req.poll(0))  # the replies are written as it spins
        assert dealer.recv_multipart() == [b"12345678", long]
        assert req.recv() == b"a request"
        assert len({identity for identity, _ in got}) == 3  # a routing id per connection
    finally:
        raw.close()
        ctx.destroy(0)
        listener.close_all()
        os.unlink(tmp_dir / "z.ipc")
