"""Issue 15's sustained attack: every flood at once, for a bounded time, on a busy host, while
an honest worker of another tenant registers, stores, looks up and retrieves, and an honest
HTTP client asks whether the server lives.

The attackers are their own processes:
- gRPC: 300 connections that send the HTTP/2 preface and nothing more, reopened when closed;
- HTTP: 300 connections that send half a request and trickle a header line now and then,
  reopened when closed;
- ZeroMQ: 1,000 peers that keep saying HELLO and never verify;
- 20 peers without a session that keep 4 STATUS requests in flight each;
- the fd channel: 1,100 connections that never authenticate, reopened when closed;
- a verified tenant (the server's own uid) that fills the pool with small objects and keeps
  pinning all it can with LOOKUPs.
Two more processes spin on the CPU. The server runs with 1,024 fds.

The test reports the honest worker's p50/p99 per operation and asserts bounds several times
what this 2-core machine measured under that load (see docs/design/security.md), so that it
fails on a lockout or a hang, not on noise. It ends as every hardening test does: the server
alive, its fds, sessions and mappings back, and a new honest worker registering.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import pytest
from attacks import (  # noqa: F401 - no_worker_outlives_a_test and tmp_dir are fixtures
    FD_CHANNEL_FLOOD,
    HELLO_FLOOD,
    NOFILE_1024,
    STATUS_FLOOD,
    busy_host,
    ends_well,
    free_port,
    helper,
    need_fds,
    no_worker_outlives_a_test,
    stop_server,
    tmp_dir,
    warm_up,
)
from harness import OUR_PIDS, PrefixedServerProcess

NOBODY = 65534
ATTACK_S = 20.0

#: Keeps ``count`` TCP connections to ``port`` open, each having sent ``first`` (and, every
#: ``every`` seconds, ``again``); every connection the server closes is opened again at once.
REOPENING_FLOOD = r"""
import select, socket, sys, time
port, count, first, again, every = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].encode(), sys.argv[4].encode(), float(sys.argv[5])
socks, opened, last = {}, 0, time.monotonic()
print("flooding", flush=True)
while True:
    while len(socks) < count:
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        except OSError:
            s.close()
            break
        socks[s.fileno()] = [s, False]
        opened += 1
    p = select.poll()
    for fd, (s, sent) in socks.items():
        p.register(fd, select.POLLIN | (0 if sent else select.POLLOUT))
    for fd, ev in p.poll(50):
        s, sent = socks[fd]
        if ev & (select.POLLIN | select.POLLERR | select.POLLHUP):
            try:
                if s.recv(4096):
                    continue
            except BlockingIOError:
                continue
            except OSError:
                pass
            socks.pop(fd)
            s.close()
        elif ev & select.POLLOUT and not sent:
            try:
                s.send(first)
                socks[fd][1] = True
            except OSError:
                socks.pop(fd)
                s.close()
    if again and time.monotonic() - last > every:
        last = time.monotonic()
        for s, sent in list(socks.values()):
            if sent:
                try:
                    s.send(again)
                except OSError:
                    pass
"""

#: A verified tenant: registers 4,096 blocks of 256 bytes, then keeps storing new chunks of one
#: block and pinning everything it stored with LOOKUPs (10 s leases), until killed.
PIN_HOG = r"""
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))   # exit through atexit: its segment is unlinked
import torch
from lmshm.transport.client import MPClient
from lmshm.platform.cpu import empty_shared
client = MPClient(sys.argv[1], timeout_s=30)
cache = empty_shared((4096, 256), torch.uint8)
iid = client.register_kv_caches({"l0": cache}, "hog")
print("flooding", flush=True)
round_ = 0
while True:
    keys = [os.urandom(16) for _ in range(4096)]
    client.store(iid, keys, list(range(4096)), 1)
    for _ in range(20):
        client.lookup([keys], ttl_s=10.0)
    round_ += 1
"""

#: The honest worker: connects, then until ``seconds`` have passed registers and unregisters a
#: second cache, stores two chunks, looks them up and retrieves them into other blocks, checking
#: every byte. Prints the seconds each operation took, or the first error.
HONEST_TENANT = r"""
import json, os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))   # exit through atexit: its segment is unlinked
url, seconds = sys.argv[1], float(sys.argv[2])
import torch
from lmshm.transport.client import MPClient
from lmshm.platform.cpu import empty_shared
cache = empty_shared((16, 4096), torch.uint8)
print(json.dumps({"ready": True}), flush=True)
sys.stdin.readline()
took = {"connect": [], "register": [], "unregister": [], "store": [], "lookup": [], "retrieve": []}
def timed(name, fn, *args, **kw):
    t = time.monotonic()
    out = fn(*args, **kw)
    took[name].append(time.monotonic() - t)
    return out
rounds, error = 0, None
try:
    client = timed("connect", MPClient, url, timeout_s=30)
    iid = client.register_kv_caches({"l0": cache}, "honest")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        other = timed("register", client.register_kv_caches, {"l0": empty_shared((2, 64), torch.uint8)}, "honest-2")
        timed("unregister", client.unregister_kv_caches, other)
        cache[0:2] = torch.randint(0, 256, (2, 4096), dtype=torch.uint8)
        keys = [os.urandom(16), os.urandom(16)]
        stored = timed("store", client.store, iid, keys, [0, 1], 1)
        assert list(stored.results) == [0, 0], stored
        found = timed("lookup", client.lookup, [keys])
        assert found.hits == 2, found
        timed("retrieve", client.retrieve, iid, keys, [8, 9], 1, found.lease)
        client.release(found.lease)
        assert torch.equal(cache[8:10], cache[0:2]), "retrieved bytes differ"
        rounds += 1
    client.unregister_kv_caches(iid)
    client.close()
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"[:500]
print(json.dumps({"rounds": rounds, "error": error, "took": took}), flush=True)
"""


def _as_nobody(tmp_dir, server) -> list[str]:
    """A prefix that runs the honest worker as uid nobody (another tenant, admitted with
    --allow-uid), with the server's sockets opened to it; [] where this test cannot switch uids."""
    if os.geteuid() != 0 or not os.path.exists("/usr/bin/setpriv"):
        return []
    os.chmod(tmp_dir, 0o711)
    for path in (server.fd_socket, server.url.removeprefix("ipc://")):
        os.chmod(path, 0o666)
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


class HttpProbe(threading.Thread):
    """Asks ``GET /v2/health/live`` on a new connection every 0.2 s; keeps each answer's time."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port, self.times, self.failures = port, [], []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            t = time.monotonic()
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
            try:
                conn.request("GET", "/v2/health/live")
                status = conn.getresponse().status
                if status != 200:
                    self.failures.append(f"HTTP {status}")
                else:
                    self.times.append(time.monotonic() - t)
            except OSError as exc:
                self.failures.append(f"{type(exc).__name__}: {exc}")
            finally:
                conn.close()
            self.done.wait(0.2)


def _summary(times: list[float]) -> str:
    if not times:
        return "none"
    ordered = sorted(times)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return f"n={len(times)} p50 {statistics.median(times) * 1000:.0f} ms p99 {p99 * 1000:.0f} ms max {ordered[-1] * 1000:.0f} ms"


@pytest.mark.alone
def test_every_flood_at_once_on_a_busy_host_leaves_an_honest_tenant_served(tmp_dir):
    need_fds(6000)
    grpc_port, http_port = free_port(), free_port()
    server = PrefixedServerProcess(
        tmp_dir, "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--auth-timeout", "2",
        "--capacity", str(4 << 20), "--allow-uid", str(NOBODY), "--log-level", "INFO",
        prefix=NOFILE_1024, url=f"ipc://{tmp_dir}/s.ipc")
    try:
        before, closing = warm_up(server)
        nobody = _as_nobody(tmp_dir, server)
        honest = subprocess.Popen([*nobody, sys.executable, "-c", HONEST_TENANT, server.url, str(ATTACK_S)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        OUR_PIDS.add(honest.pid)
        probe = HttpProbe(http_port)
        try:
            assert json.loads(honest.stdout.readline())["ready"], honest.stderr.read()
            with contextlib.ExitStack() as attacks:
                attackers = {
                    "grpc": (REOPENING_FLOOD, str(grpc_port), "300", "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "", "0"),
                    "http": (REOPENING_FLOOD, str(http_port), "300", "GET /v2 HTTP/1.1\r\nHost: x\r\n", "X-Slow: 1\r\n",
                             "1.0"),
                    "hello": (HELLO_FLOOD, server.url, "1000"),
                    "status": (STATUS_FLOOD, server.url, "20", "4"),
                    "fd-channel": (FD_CHANNEL_FLOOD, server.fd_socket, "1100"),
                    "pins": (PIN_HOG, server.url),
                }
                # LMSHM_TEST_ATTACKS=hello,fd-channel runs only those (to study one combination).
                chosen = os.environ.get("LMSHM_TEST_ATTACKS", ",".join(attackers)).split(",")
                floods = [attacks.enter_context(helper(*attackers[name])) for name in chosen]
                for flood in floods:
                    assert flood.stdout.readline().strip() == "flooding", (flood.stderr.read(), server.log()[-6000:])
                attacks.enter_context(busy_host(2))
                time.sleep(1.0)
                started = time.monotonic()
                probe.start()
                honest.stdin.write("go\n")
                honest.stdin.flush()
                line = honest.stdout.readline()
                elapsed = time.monotonic() - started
                probe.done.set()
                probe.join(15)
                for flood in floods:
                    assert flood.poll() is None, f"an attacker stopped: {flood.stderr.read()[-2000:]}"
                assert server.alive, f"lmshm-server exited {server.proc.returncode}:\n{server.log()[-3000:]}"
        finally:
            probe.done.set()
            if honest.poll() is None:
                honest.terminate()
                try:
                    honest.wait(10)
                except subprocess.TimeoutExpired:
                    honest.kill()
            honest.wait(10)
            err = honest.stderr.read()
            for stream in (honest.stdin, honest.stdout, honest.stderr):
                stream.close()
        assert line, f"the honest worker said nothing:\n{err}"
        report = json.loads(line)
        took = report["took"]
        print(f"\n{ATTACK_S:.0f} s of every flood at once, busy host, 1,024-fd server; honest tenant"
              f"{' (uid nobody)' if nobody else ''}: {report['rounds']} rounds in {elapsed:.1f} s")
        for name, times in took.items():
            print(f"  {name:10s} {_summary(times)}")
        print(f"  http live  {_summary(probe.times)}; failures {len(probe.failures)}: {probe.failures[:3]}")
        assert report["error"] is None, (report["error"], server.log()[-8000:])
        assert report["rounds"] >= 5, report
        assert took["connect"][0] < 30.0, took["connect"]
        for name in ("register", "unregister", "store", "lookup", "retrieve"):
            ordered = sorted(took[name])
            assert ordered[int(0.99 * (len(ordered) - 1))] < 3.0, (name, _summary(took[name]))
            assert ordered[-1] < 10.0, (name, _summary(took[name]))
        # HTTP under a flood that reopens connections as they give way: most honest requests are
        # served (measured: 1-3 of 26-32 reset on a loaded host; the residual in security.md).
        assert probe.times and len(probe.failures) <= len(probe.times) // 2, probe.failures
        ends_well(server, before, closing, timeout_s=30)
    finally:
        stop_server(server)
