"""Attackers and the honest worker that the transport hardening tests
(test_hardening_transport.py) and the sustained-attack test (test_sustained_attack.py) share:
attack loops run as their own processes (scripts below, started with ``helper``), CPU hogs
(``busy_host``), and a worker process that times its own registration.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Optional

import pytest
from harness import (
    OUR_PIDS,
    ServerProcess,
    assert_an_honest_worker_registers,
    assert_back_to,
    server_counts,
    wait_for,
)

from lmshm.wire import codec, protocol

NOFILE_1024 = ["prlimit", "--nofile=1024:1024"]


def hello_body() -> bytes:
    return codec.encode(protocol.Hello(protocol_version=protocol.PROTOCOL_VERSION, isolated_ipc=False))


def need_fds(n: int) -> None:
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
from lmshm.transport.client import MPClient
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


def warm_up(server: ServerProcess) -> tuple[dict, HonestWorker]:
    """The start of every test: an honest worker process (started now, so that its imports
    overlap the test) and the server's counters once it has served a registration."""
    assert_an_honest_worker_registers(server.url)  # the server's lazy imports and caches are in
    worker = HonestWorker(server.url)
    counts: dict = {}
    wait_for(lambda: counts.update(server_counts(server.url)) or counts["sessions"] == 0, 10, 0.05,
             "the warm-up session to end")
    return counts, worker


def ends_well(server: ServerProcess, before: dict, worker: HonestWorker, *, timeout_s: float = 20) -> dict:
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


def stop_server(server: ServerProcess) -> None:
    if server.alive:
        rc = server.stop()
        assert rc == 0, f"lmshm-server exited {rc}:\n{server.log()[-3000:]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



#: Peers without a session that keep ``depth`` STATUS requests in flight each, until killed.
STATUS_FLOOD = r"""
import sys, time, zmq
url, peers, depth = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
from lmshm.wire import codec, protocol
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

#: 2,000 ZeroMQ peers that keep saying HELLO (each every ~0.5 s) and never verify.
HELLO_FLOOD = r"""
import random, sys, time, zmq
url, peers = sys.argv[1], int(sys.argv[2])
from lmshm.wire import codec, protocol
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


# ---- a ZMTP 3.1 peer by hand: it sends what libzmq would never send, and reads only when asked ----

DEALER_GREETING = (b"\xff" + b"\0" * 8 + b"\x7f\x03\x01" + b"NULL".ljust(20, b"\0") + b"\0" * 32
                   + b"\x04\x1c\x05READY\x0bSocket-Type\x00\x00\x00\x06DEALER")


def zmtp_frame(body: bytes, *, more: bool = False, command: bool = False, size: Optional[int] = None) -> bytes:
    """A frame: its header (``size`` may claim a length other than the body's) and ``body``."""
    size = len(body) if size is None else size
    flags = (0x01 if more else 0) | (0x04 if command else 0)
    head = bytes((flags, size)) if size <= 255 else bytes((flags | 0x02,)) + size.to_bytes(8, "big")
    return head + body


def zmtp_ping() -> bytes:
    return zmtp_frame(b"\x04PING" + b"\x00\x64" + b"c" * 16, command=True)


class RawZmtp:
    """One connection to the server's ZeroMQ endpoint (``tcp://`` or ``ipc://``) that speaks
    ZMTP by hand: it sends bytes as given and reads only in ``request`` and ``closed``."""

    def __init__(self, url: str, *, handshake: bool = True) -> None:
        if url.startswith("tcp://"):
            host, _, port = url[len("tcp://"):].rpartition(":")
            self.sock = socket.create_connection((host.strip("[]"), int(port)), timeout=10)
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(10)
            self.sock.connect(url[len("ipc://"):])
        self._buf = bytearray()
        self._greeted = False
        self.link = None
        if handshake:
            self.sock.sendall(DEALER_GREETING)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self, n: int, deadline: float) -> None:
        while len(self._buf) < n:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            data = self.sock.recv(1 << 16)
            if not data:
                raise EOFError("the server closed the connection")
            self._buf += data

    def recv_message(self, timeout_s: float = 10.0) -> list[bytes]:
        """The next message's frames (the server's greeting and commands are skipped)."""
        deadline = time.monotonic() + timeout_s
        if not self._greeted:
            self._fill(64, deadline)
            del self._buf[:64]
            self._greeted = True
        frames: list[bytes] = []
        while True:
            self._fill(2, deadline)
            flags = self._buf[0]
            if flags & 0x02:
                self._fill(9, deadline)
                size, head = int.from_bytes(self._buf[1:9], "big"), 9
            else:
                size, head = self._buf[1], 2
            self._fill(head + size, deadline)
            body = bytes(self._buf[head:head + size])
            del self._buf[:head + size]
            if flags & 0x04:
                continue
            frames.append(body)
            if not flags & 0x01:
                return frames

    def request(self, msg: Any, rid: bytes = b"\x00" * 7 + b"\x01", timeout_s: float = 10.0) -> Any:
        self.send(zmtp_frame(rid, more=True) + zmtp_frame(codec.encode(msg)))
        while True:
            frames = self.recv_message(timeout_s)
            if frames[0] == rid:
                return codec.decode_reply(frames[1])

    def verify(self) -> "RawZmtp":
        """HELLO, then this process's proof on the fd channel: the connection's session is verified."""
        from lmshm.transport.fdchannel import ExpectedServer, FdChannelClient

        hello = self.request(protocol.Hello(protocol_version=protocol.PROTOCOL_VERSION, isolated_ipc=False))
        assert isinstance(hello, protocol.HelloReply), hello
        self.link = FdChannelClient(hello.fd_socket, hello.session_token, timeout_s=10,
                                    expected=ExpectedServer(pid=hello.server_pid, uid=hello.server_uid,
                                                            pid_ns=hello.server_pid_ns))
        return self

    def closed(self, timeout_s: float = 5.0) -> bool:
        """Whether the server closes the connection within ``timeout_s`` (what it sent is read and dropped)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                if not self.sock.recv(1 << 16):
                    return True
            except socket.timeout:
                return False
            except OSError:
                return True
        return False

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None
        self.sock.close()
