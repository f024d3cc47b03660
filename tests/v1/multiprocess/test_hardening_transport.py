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
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import pytest

from lmshm.multiprocess import codec, protocol

from harness import (  # noqa: F401 - the fixture replaces conftest's for this module
    OUR_PIDS,
    OwnSegments,
    PrefixedServerProcess,
    RawSession,
    ServerProcess,
    assert_an_honest_worker_registers,
    assert_back_to,
    narrow_segment_guard as no_segment_outlives_a_test,
    proc_fd_count,
    server_counts,
    shm_wrapper,
    wait_for,
)

NOFILE_1024 = ["prlimit", "--nofile=1024:1024"]


def _hello_body() -> bytes:
    return codec.encode(protocol.Hello(protocol_version=protocol.PROTOCOL_VERSION, isolated_ipc=False))


def _need_fds(n: int) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n and hard >= n:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if max(soft, hard) < n:
        pytest.skip(f"the test process needs ~{n} fds; its limit is {hard}")


@contextlib.contextmanager
def busy_host(n: int = 2):
    """``n`` CPU-bound helper processes, killed (by pid) at the end."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(10)


@contextlib.contextmanager
def helper(script: str, *args: str):
    """A helper process running ``script`` (an attacker loop); killed at the end unless done."""
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()


#: An honest worker: imports torch, says "ready", and on "go" connects with MPClient (HELLO and
#: the fd channel), registers a CPU cache, unregisters it and reports how long each step took.
HONEST_WORKER = r"""
import json, sys, time
url, timeout = sys.argv[1], float(sys.argv[2])
import torch
from lmshm.multiprocess.client import MPClient
from lmshm.platform.cpu import empty_shared
print(json.dumps({"ready": True}), flush=True)
sys.stdin.readline()
t0 = time.monotonic()
try:
    client = MPClient(url, timeout_s=timeout, heartbeat=False)
    t1 = time.monotonic()
    iid = client.register_kv_caches({"l0": empty_shared((4, 64), torch.float16)}, "honest")
    t2 = time.monotonic()
    client.unregister_kv_caches(iid)
    client.close()
    print(json.dumps({"ok": True, "verified_s": t1 - t0, "registered_s": t2 - t0}), flush=True)
except Exception as exc:
    print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500], "after_s": time.monotonic() - t0}),
          flush=True)
"""


_WORKERS: list["HonestWorker"] = []


@pytest.fixture(autouse=True)
def no_worker_outlives_a_test():
    yield
    while _WORKERS:
        _WORKERS.pop().kill()


class HonestWorker:
    """A spawned worker process (``HONEST_WORKER``), started ahead so that torch's import is
    not timed; ``run()`` lets it connect and register and returns its report."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HONEST_WORKER, url, str(timeout_s)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        OUR_PIDS.add(self.proc.pid)
        _WORKERS.append(self)
        self.timeout_s = timeout_s
        self._ready = False

    def ready(self) -> "HonestWorker":
        """Wait until torch is imported and the worker waits for ``go``."""
        if not self._ready:
            line = self.proc.stdout.readline()
            assert line and json.loads(line)["ready"], self.proc.stderr.read()
            self._ready = True
        return self

    def go(self) -> None:
        self.ready()
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def run(self) -> dict:
        self.go()
        return self.report()

    def report(self) -> dict:
        line = self.proc.stdout.readline()
        self.proc.wait(30)
        err = "" if line else self.proc.stderr.read()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            stream.close()
        assert line, f"the honest worker said nothing:\n{err}"
        return json.loads(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(OSError):
                stream.close()


def _start(server: ServerProcess) -> tuple[dict, HonestWorker]:
    """The start of every test: an honest worker process (started now, so that its imports
    overlap the test) and the server's counters once it has served a registration."""
    assert_an_honest_worker_registers(server.url)  # the server's lazy imports and caches are in
    worker = HonestWorker(server.url)
    counts: dict = {}
    wait_for(lambda: counts.update(server_counts(server.url)) or counts["sessions"] == 0, 10, 0.05,
             "the warm-up session to end")
    return counts, worker


def _ends_well(server: ServerProcess, before: dict, worker: HonestWorker, *, timeout_s: float = 20) -> dict:
    """The end of every test: the server lives, its fds and RSS come back, and the honest
    worker process registers."""
    assert server.alive, f"lmshm-server exited {server.proc.returncode}:\n{server.log()[-3000:]}"
    after = assert_back_to(server.url, before, fd_slack=2, timeout_s=timeout_s)
    report = worker.run()
    assert report["ok"], report
    assert_an_honest_worker_registers(server.url)
    assert server.alive
    return after


@pytest.fixture
def tmp_dir():
    from harness import scratch_dir

    with scratch_dir() as path:
        yield path


def _stop(server: ServerProcess) -> None:
    if server.alive:
        rc = server.stop()
        assert rc == 0, f"lmshm-server exited {rc}:\n{server.log()[-3000:]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- finding 1: a gRPC connection flood, then a worker over ipc:// -------------------------------


def test_a_grpc_connection_flood_cannot_make_the_ipc_listener_abort_the_server(tmp_dir):
    # Before: 1,100 idle HTTP/2 connections took the server's fds to the limit, and the next
    # ipc:// connection made libzmq abort (src/ipc_listener.cpp:297, exit -6). Now the loop
    # accepts ipc connections itself, only while fds are free; the rest wait in the backlog.
    _need_fds(3000)
    import zmq

    port = _free_port()
    server = PrefixedServerProcess(tmp_dir, "--grpc-port", str(port), "--auth-timeout", "2",
                                   prefix=NOFILE_1024, url=f"ipc://{tmp_dir}/s.ipc")
    try:
        before, closing = _start(server)
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
                d.send_multipart([b"\x00" * 8, _hello_body()])
                dealers.append(d)
            time.sleep(2)
            assert server.alive, f"lmshm-server exited {server.proc.returncode}:\n{server.log()[-3000:]}"
        finally:
            for d in dealers:
                d.close(0)
            ctx.term()
            for s in flood:
                s.close()
        _ends_well(server, before, closing)
    finally:
        _stop(server)


# ---- finding 2: 2,000 HELLOs at once over ipc:// on a busy host ----------------------------------


def test_2000_hellos_at_once_over_ipc_on_a_busy_host_cannot_abort_the_server(tmp_dir):
    # Before: the accept gate closed only after libzmq's I/O thread had accepted a burst, and
    # with two CPU-bound processes running the server aborted 3 times out of 3.
    _need_fds(6000)
    import zmq

    server = PrefixedServerProcess(tmp_dir, "--auth-timeout", "2", prefix=NOFILE_1024, url=f"ipc://{tmp_dir}/s.ipc")
    try:
        before, closing = _start(server)
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
                    sock.send_multipart([b"\x00" * 8, _hello_body()], zmq.NOBLOCK)
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
        _ends_well(server, before, closing, timeout_s=30)
    finally:
        _stop(server)


# ---- finding 6: requests from peers without a verified session ------------------------------------

#: Peers without a session that keep ``depth`` STATUS requests in flight each, until killed.
STATUS_FLOOD = r"""
import sys, time, zmq
url, peers, depth = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
from lmshm.multiprocess import codec, protocol
body = codec.encode(protocol.Status())
ctx = zmq.Context()
socks = []
for _ in range(peers):
    s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0); s.connect(url); socks.append(s)
    for _ in range(depth):
        s.send_multipart([b"\0" * 8, body])
poller = zmq.Poller()
for s in socks:
    poller.register(s, zmq.POLLIN)
print("flooding", flush=True)
sent = 0
while True:
    for s, _ in poller.poll(1000):
        while s.poll(0):
            s.recv_multipart()
            s.send_multipart([b"\0" * 8, body])
            sent += 1
"""


def test_a_status_flood_without_a_session_cannot_delay_verified_sessions_or_the_fd_channel(tmp_dir):
    # STATUS is made expensive here by 2,000 registrations (~30-100 ms each). Before: the fd
    # channel was served only after 64 requests, so a new worker waited seconds to verify,
    # and a verified PING waited behind one STATUS of every flooding peer. Now those peers
    # share a quarter of the loop's time, the least-served first, and the fd channel is served
    # every 10 ms of requests.
    server = ServerProcess(tmp_dir, "--max-registrations-per-session", "2000", "--log-level", "INFO")
    segments = OwnSegments(4096)
    try:
        before, closing = _start(server)
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
        _ends_well(server, before, closing)
    finally:
        segments.unlink_all()
        _stop(server)


# ---- finding 8: a flood of unauthenticated fd-channel connections ---------------------------------

#: Keeps ``count`` connections to the fd socket open that never authenticate: every one the
#: server closes is opened again at once.
FD_CHANNEL_FLOOD = r"""
import select, socket, sys, time
path, count = sys.argv[1], int(sys.argv[2])
socks = {}
opened = 0
print("flooding", flush=True)
while True:
    while len(socks) < count:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.setblocking(False)
        try:
            s.connect(path)
        except OSError:
            s.close()
            break
        socks[s.fileno()] = s
        opened += 1
    p = select.poll()
    for fd in socks:
        p.register(fd, select.POLLIN)
    for fd, _ in p.poll(20):
        socks.pop(fd).close()
"""


def test_a_flood_of_unauthenticated_fd_channel_connections_cannot_lock_a_new_worker_out(tmp_dir):
    # Before: 1,100 connections to the fd socket that never authenticate filled the 64 pending
    # slots and the backlog, and a new worker failed at once ("out of connections" or a reset)
    # for as long as the flood was renewed. Now the oldest unauthenticated connection gives
    # way to a newcomer, and the worker retries a full backlog.
    _need_fds(3000)
    server = ServerProcess(tmp_dir, "--auth-timeout", "5")
    try:
        before, closing = _start(server)
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
        _ends_well(server, before, closing)
    finally:
        _stop(server)


# ---- finding 9: lockouts while a flood is held ----------------------------------------------------

#: 2,000 ZeroMQ peers that keep saying HELLO (each every ~0.5 s) and never verify.
HELLO_FLOOD = r"""
import random, sys, time, zmq
url, peers = sys.argv[1], int(sys.argv[2])
from lmshm.multiprocess import codec, protocol
body = codec.encode(protocol.Hello(protocol_version=protocol.PROTOCOL_VERSION, isolated_ipc=False))
ctx = zmq.Context()
ctx.set(zmq.MAX_SOCKETS, peers + 64)
socks = []
for _ in range(peers):
    s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0); s.setsockopt(zmq.SNDHWM, 4); s.connect(url)
    socks.append(s)
print("flooding", flush=True)
due = [time.monotonic() + random.random() * 0.5 for _ in socks]
while True:
    now = time.monotonic()
    for i, s in enumerate(socks):
        while s.poll(0):
            s.recv_multipart()
        if now >= due[i]:
            try:
                s.send_multipart([b"\0" * 8, body], zmq.NOBLOCK)
            except zmq.Again:
                pass
            due[i] = now + 0.5
    time.sleep(0.01)
"""


def test_an_honest_worker_gets_in_while_2000_peers_keep_saying_hello_over_tcp(tmp_dir):
    # Before: the HELLO flood displaced the worker's session before it could prove its
    # identity, and the worker failed ("unknown session token"). Now a displaced session is
    # parked and its token still verifies; HELLOs of peers without a session share a quarter of
    # the loop, the least-served first; connections without a verified session are shed when
    # fds run low. Measured below: how long the worker waits.
    _need_fds(6000)
    server = PrefixedServerProcess(tmp_dir, "--auth-timeout", "2", prefix=NOFILE_1024)
    try:
        before, closing = _start(server)
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
        _ends_well(server, before, closing, timeout_s=30)
    finally:
        _stop(server)


def test_300_sessions_of_the_servers_uid_hold_a_worker_only_while_they_are_held(tmp_dir):
    # The per-uid cap (256 verified sessions) is the documented residual: a process of the
    # server's own uid can hold every slot of that uid for as long as it likes. Before, a new
    # worker of that uid failed at once; now it keeps asking until its timeout, so it gets in
    # as soon as a slot frees.
    _need_fds(3000)
    server = ServerProcess(tmp_dir, "--auth-timeout", "2")
    try:
        before, closing = _start(server)
        held, refused = [], 0
        blocked, waiting = HonestWorker(server.url, timeout_s=1.0), HonestWorker(server.url, timeout_s=10)
        try:
            for _ in range(300):
                try:
                    held.append(RawSession(server.url, timeout_s=10))
                except Exception as exc:  # noqa: BLE001 - the fd channel's refusal
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
        _ends_well(server, before, closing)
    finally:
        _stop(server)


# ---- the server's own ZMTP listener ---------------------------------------------------------------


def test_the_servers_zmtp_listener_reads_bytes_split_anywhere_and_answers_libzmq_peers(tmp_dir):
    # The server speaks ZMTP itself (libzmq never accepts for it): a peer's bytes may arrive in
    # any split, long frames go straight into place, DEALER and REQ peers get their replies.
    import select

    import zmq

    from lmshm.multiprocess import zmtp

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
