"""Connection floods on the Triton endpoints: what they cost the server and its honest clients.

    .venv/bin/python bench/endpoint_floods.py [--nofile 1024] [--seconds 10] [--checkout DIR] [--cost ROUNDS]
                                              [--only NAME[,NAME...]]

Each scenario starts a fresh ``lmshm-server --url ipc://... --http-port 0 --grpc-port 0
--capacity 0`` with the open-file limit ``--nofile`` (soft and hard) and default settings,
attacks one port from this process with raw sockets, and meanwhile runs one honest stock
``tritonclient`` (health + register + status + unregister of a 4 KiB region per round, a new
client each round). Reported per scenario: the server's fds before and at the worst moment, the
honest rounds that succeeded, their p50 and max seconds, the longest stretch without a success
(the lockout), whether an ``MPClient`` still registers over ``ipc://`` during the attack, and
whether the server survived.

- ``grpc-preface``: 1,100 connections send the HTTP/2 preface and then nothing, and are held;
- ``grpc-stall``: 4 connections open 4 calls each (HEADERS, never the message), held;
- ``grpc-renew``: connections with the preface, re-opened as fast as this process can for
  ``--seconds`` (the attacker keeps the cap full);
- ``http-slowloris``: 300 connections with half a request and 256 silent ones, held;
- ``http-renew``: half-request connections opened as fast as this process can for ``--seconds``.

``--checkout DIR`` runs the server from another checkout's ``lmshm`` (PYTHONPATH=DIR), e.g. the
code before a change, to compare. The attacker and the honest client share the machine's cores
with the server: every figure includes all three.

``--cost ROUNDS`` measures instead what the endpoints cost an honest client with no attack:
one server from this checkout and one from ``--checkout``, both running, and ``ROUNDS`` rounds
of 100 register + unregister cycles per server and protocol, the order reversed every round;
the median us per cycle of each, and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import select
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional

import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import shared_memory as triton_shm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import parse_args
from _server import terminate

READY = re.compile(r"listening on (\S+) \(fd socket (\S+), HTTP on [^:\s]+:(\d+), gRPC on [^:\s]+:(\d+),"
                   r".* pid (\d+)\)")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HALF_REQUEST = b"GET /v2 HTTP/1.1\r\nHost: x\r\n"


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def stalled_calls(n: int) -> bytes:
    """The preface, SETTINGS, and ``n`` calls to ServerLive whose message never comes."""
    def literal(name: str, value: str) -> bytes:
        return b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()

    block = b"".join(literal(k, v) for k, v in (
        (":method", "POST"), (":scheme", "http"), (":path", "/inference.GRPCInferenceService/ServerLive"),
        (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers")))
    return PREFACE + frame(0x4, 0, 0) + b"".join(frame(0x1, 0x4, 2 * i + 1, block) for i in range(n))


class Server:
    def __init__(self, nofile: int, checkout: Optional[str]) -> None:
        self.dir = tempfile.mkdtemp(prefix="lmshm-floods-")
        env = dict(os.environ, PYTHONPATH=checkout or REPO)
        # lmshm-server's module: lmshm.server since issue 16, lmshm.endpoints.zmq.endpoint in older checkouts
        module = "lmshm.server" if os.path.exists(os.path.join(checkout or REPO, "lmshm", "server.py")) \
            else "lmshm.endpoints.zmq.endpoint"
        cmd = [sys.executable, "-m", module, "--url", f"ipc://{self.dir}/s.ipc",
               "--fd-socket", f"{self.dir}/s.fds", "--http-port", "0", "--grpc-port", "0", "--capacity", "0",
               "--log-level", "WARNING"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                                     cwd=self.dir, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                                                         (nofile, nofile)))
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        m = READY.search(self.proc.stdout.readline() if ready else "")
        if not m:
            self.stop()
            raise RuntimeError("lmshm-server did not start")
        self.url, self.pid = m.group(1), int(m.group(5))
        self.http_port, self.grpc_port = int(m.group(3)), int(m.group(4))

    def fds(self) -> int:
        try:
            return len(os.listdir(f"/proc/{self.pid}/fd"))
        except OSError:
            return -1

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> Optional[int]:
        returncode = terminate(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)
        return returncode


def connect(port: int, first: bytes) -> Optional[socket.socket]:
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=2)
    except OSError:
        return None
    try:
        s.sendall(first)
    except OSError:
        pass
    return s


def honest_round(protocol: str, server: Server, key: str, name: str) -> None:
    if protocol == "http":
        c: Any = triton_http.InferenceServerClient(f"127.0.0.1:{server.http_port}", connection_timeout=5,
                                                   network_timeout=5)
        kw: dict = {}
    else:
        c = triton_grpc.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        kw = {"client_timeout": 5}
    try:
        assert c.is_server_live(**kw)
        c.register_system_shared_memory(name, key, 64, **kw)
        c.get_system_shared_memory_status(name, **kw)
        c.unregister_system_shared_memory(name, **kw)
    finally:
        c.close()


def why(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    for word in ("reset", "refused", "timed out", "Deadline", "UNAVAILABLE", "already", "CANCELLED", "closed"):
        if word.lower() in text.lower():
            return word.lower()
    return type(exc).__name__


def ipc_worker_registers(url: str, checkout: Optional[str]) -> str:
    """An MPClient registers and unregisters a KV cache over ipc://, in a subprocess (it may hang)."""
    code = ("import lmshm, torch\n"
            "p = lmshm.empty_shared((2, 64), dtype=torch.float16)\n"
            f"with lmshm.MPClient({url!r}, heartbeat=False) as w:\n"
            "    w.register_kv_caches({'l0': p[0]}, model_name='m', world_size=1, rank=0, instance_id='kv')\n"
            "    w.unregister_kv_caches('kv')\n")
    try:
        env = dict(os.environ, PYTHONPATH=checkout or REPO)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=env,
                              cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired:
        return "timed out"
    if done.returncode == 0:
        return "yes"
    return f"no ({done.stderr.strip().splitlines()[-1].split(':')[0][-40:] if done.stderr else done.returncode})"


def run(name: str, protocol: str, attack: Callable[[Server, threading.Event, threading.Event, list], None],
        args: argparse.Namespace, key: str) -> dict:
    server = Server(args.nofile, args.checkout)
    before = server.fds()
    stop, in_place, socks, worst = threading.Event(), threading.Event(), [], [before]
    attacker = threading.Thread(target=attack, args=(server, stop, in_place, socks), daemon=True)
    attacker.start()
    in_place.wait(60)
    started_attack = time.monotonic()

    def watch() -> None:
        while not stop.is_set():
            worst[0] = max(worst[0], server.fds())
            time.sleep(0.05)

    ipc: list[str] = []
    helpers = [threading.Thread(target=watch, daemon=True),
               threading.Thread(target=lambda: ipc.append(ipc_worker_registers(server.url, args.checkout)),
                                daemon=True)]
    for t in helpers:
        t.start()
    took, ok, tries, gap, last_ok = [], 0, 0, 0.0, started_attack
    failures: dict[str, int] = {}
    end = started_attack + args.seconds
    while time.monotonic() < end and server.alive():
        tries += 1
        started = time.monotonic()
        try:
            honest_round(protocol, server, key, f"honest-{tries}")
        except Exception as exc:
            failures[why(exc)] = failures.get(why(exc), 0) + 1
        else:
            ok += 1
            took.append(time.monotonic() - started)
            gap, last_ok = max(gap, started - last_ok), time.monotonic()
        time.sleep(0.1)
    gap = max(gap, time.monotonic() - last_ok)
    helpers[1].join(40)
    stop.set()
    attacker.join(10)
    helpers[0].join(1)
    for s in socks:
        s.close()
    alive = server.alive()
    rc = server.stop()
    return {"name": name, "fds": f"{before} -> {worst[0]}", "ok": f"{ok}/{tries}",
            "p50": f"{statistics.median(took):.3f}" if took else "-", "max": f"{max(took):.3f}" if took else "-",
            "lockout": f"{gap:.1f}", "ipc": ipc[0] if ipc else "hung", "server": "alive" if alive else f"exited {rc}",
            "failures": ", ".join(f"{n} {w}" for w, n in sorted(failures.items(), key=lambda x: -x[1])) or "-"}


Attack = Callable[[Server, threading.Event, threading.Event, list], None]


def hold(*floods: tuple[Callable[[Server], int], bytes, int]) -> Attack:
    """Open each flood's connections, hold them until the scenario ends."""
    def attack(server: Server, stop: threading.Event, in_place: threading.Event, socks: list) -> None:
        for port_of, first, n in floods:
            for _ in range(n):
                s = connect(port_of(server), first)
                if s is None:
                    break
                socks.append(s)
        in_place.set()
    return attack


def renew(port_of: Callable[[Server], int], first: bytes, n: int) -> Attack:
    """Keep ``n`` connections open: replace each one the server closes, as fast as possible."""
    def attack(server: Server, stop: threading.Event, in_place: threading.Event, socks: list) -> None:
        live: dict[int, socket.socket] = {}
        poller = select.poll()
        while not stop.is_set():
            while len(live) < n and not stop.is_set():
                s = connect(port_of(server), first)
                if s is None:
                    break
                live[s.fileno()] = s
                poller.register(s, select.POLLIN)
            in_place.set()
            for fd, _ in poller.poll(10):
                s = live[fd]
                try:
                    gone = s.recv(65536, socket.MSG_DONTWAIT) == b""
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                if gone:
                    poller.unregister(s)
                    del live[fd]
                    s.close()
        socks.extend(live.values())
    return attack


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nofile", type=int, default=1024)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--checkout", default=None, help="run the server from this checkout (PYTHONPATH)")
    p.add_argument("--only", default="", help="comma-separated scenario names")
    p.add_argument("--cost", type=int, default=0, metavar="ROUNDS",
                   help="no attack: the cost of a register + unregister cycle, this checkout against --checkout")
    # smoke: one held and one renewed flood, one per protocol
    args = parse_args(p, smoke={"seconds": 0.5, "only": "grpc-stall,http-renew"})
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192) if hard != resource.RLIM_INFINITY else 8192, hard))

    grpc_port, http_port = (lambda s: s.grpc_port), (lambda s: s.http_port)
    scenarios = [
        ("grpc-preface", "grpc", hold((grpc_port, PREFACE, 1100))),
        ("grpc-stall", "grpc", hold((grpc_port, stalled_calls(4), 4))),
        ("grpc-renew", "grpc", renew(grpc_port, PREFACE, 1100)),
        ("http-slowloris", "http", hold((http_port, HALF_REQUEST, 300), (http_port, b"", 256))),
        ("http-renew", "http", renew(http_port, HALF_REQUEST, 600)),
    ]
    only = set(filter(None, args.only.split(",")))
    key = f"/lmshm_floods_{os.getpid()}"
    handle = triton_shm.create_shared_memory_region(key.lstrip("/"), key, 4096)
    rows = []
    if args.cost:
        try:
            return cost(args, key)
        finally:
            triton_shm.destroy_shared_memory_region(handle)
    try:
        for name, protocol, attack in scenarios:
            if not only or name in only:
                rows.append(run(name, protocol, attack, args, key))
                print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    finally:
        triton_shm.destroy_shared_memory_region(handle)
    cols = ("name", "fds", "ok", "p50", "max", "lockout", "ipc", "server", "failures")
    heads = ("scenario", "server fds", "honest ok", "p50 s", "max s", "lockout s", "ipc worker", "server",
             "failed rounds")
    widths = [max(len(h), *(len(str(r[c])) for r in rows)) for c, h in zip(cols, heads)]
    print(f"\nnofile {args.nofile}, {args.seconds:g} s of honest rounds per scenario"
          f"{', server from ' + args.checkout if args.checkout else ''}")
    print("  ".join(h.ljust(w) for h, w in zip(heads, widths)))
    for r in rows:
        print("  ".join(str(r[c]).ljust(w) for c, w in zip(cols, widths)))
    return 0


def cost(args: argparse.Namespace, key: str) -> int:
    servers = {"this": Server(args.nofile, None), "checkout": Server(args.nofile, args.checkout)}
    try:
        clients = {}
        for which, server in servers.items():
            clients[which, "HTTP"] = triton_http.InferenceServerClient(f"127.0.0.1:{server.http_port}")
            clients[which, "gRPC"] = triton_grpc.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        us: dict[tuple[str, str], list[float]] = {k: [] for k in clients}
        for r in range(args.cost):
            for k in (list(clients) if r % 2 == 0 else list(reversed(list(clients)))):
                c = clients[k]
                started = time.perf_counter()
                for _ in range(100):
                    c.register_system_shared_memory("cost", key, 1024)
                    c.unregister_system_shared_memory("cost")
                us[k].append((time.perf_counter() - started) / 100 * 1e6)
        for c in clients.values():
            c.close()
    finally:
        for server in servers.values():
            server.stop()
    print(f"register + unregister, us per cycle, median of {args.cost} rounds (this checkout vs {args.checkout})")
    for protocol in ("HTTP", "gRPC"):
        this, other = us["this", protocol], us["checkout", protocol]
        ratio = statistics.median(a / b for a, b in zip(this, other))
        print(f"{protocol}: this {statistics.median(this):.0f}, --checkout {statistics.median(other):.0f}, "
              f"per-round ratio {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
