"""Test harness for the service tests: an ``lmshm-server`` subprocess and worker subprocesses.

``ServerProcess`` runs ``python -m lmshm.multiprocess.server`` on a free port (or an ipc://
path) and reads the URL from its ready line. ``WorkerProcess`` runs ``worker.py`` beside this
file, which owns an ``MPClient`` and obeys one JSON command per stdin line (register, fill,
unregister, ...), answering one JSON line each. Every helper is bounded in time.

Fixtures built on these live in conftest.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).parent
WORKER = HERE / "worker.py"
READY = re.compile(r"listening on (\S+) \(fd socket (\S+),")
SHM_DIR = "/dev/shm"


def lmshm_segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("lmshm-")}


def _readline(stream, timeout_s: float, what: str) -> str:
    ready, _, _ = select.select([stream], [], [], timeout_s)
    if not ready:
        raise TimeoutError(f"{what} said nothing within {timeout_s} s")
    line = stream.readline()
    if not line:
        raise EOFError(f"{what} closed its output")
    return line


class ServerProcess:
    def __init__(self, tmp: Path, *args: str, url: Optional[str] = None, fd_socket: Optional[str] = None,
                 env: Optional[dict] = None) -> None:
        self.tmp = tmp
        self.log_path = tmp / f"server-{time.monotonic_ns()}.log"
        self.fd_socket = fd_socket or str(tmp / "fds.sock")
        cmd = [sys.executable, "-m", "lmshm.multiprocess.server", "--url", url or "tcp://127.0.0.1:0",
               "--fd-socket", self.fd_socket, "--log-level", "DEBUG", *args]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env={**os.environ, **(env or {})})
        try:
            line = _readline(self.proc.stdout, 30, "lmshm-server")
        except (TimeoutError, EOFError):
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"lmshm-server did not start:\n{self.log()}")
        m = READY.search(line)
        assert m, line
        self.url = m.group(1)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"lmshm-server ignored signal {sig}:\n{self.log()}")
        self.proc.stdout.close()
        self._log.close()
        return rc

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


class WorkerProcess:
    def __init__(self, url: str, *args: str, env: Optional[dict] = None, prefix: Optional[list[str]] = None) -> None:
        cmd = [*(prefix or []), sys.executable, str(WORKER), "--url", url, *args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self.hello = self._reply(60)
        self.pid = self.hello.get("pid")

    def _reply(self, timeout_s: float) -> dict:
        try:
            line = _readline(self.proc.stdout, timeout_s, "worker")
        except (TimeoutError, EOFError) as exc:
            err = ""
            if self.proc.poll() is not None:
                err = self.proc.stderr.read()
            raise RuntimeError(f"{exc}; worker stderr:\n{err}") from None
        return json.loads(line)

    def call(self, op: str, timeout_s: float = 60, **kw: Any) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._reply(timeout_s)

    def ok(self, op: str, **kw: Any) -> dict:
        reply = self.call(op, **kw)
        assert reply.get("ok"), reply
        return reply

    def exit(self, timeout_s: float = 20) -> int:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass
        try:
            return self.proc.wait(timeout_s)
        finally:
            self._close_pipes()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._close_pipes()

    def _close_pipes(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                stream.close()
            except (OSError, BrokenPipeError):
                pass


def wait_for(predicate, timeout_s: float, interval_s: float = 0.01, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


@contextlib.contextmanager
def scratch_dir():
    """A short directory under /tmp (Unix socket paths are limited to 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="lmshm-t-", dir="/tmp"))
    try:
        yield path
    finally:
        leftovers = [p.name for p in path.iterdir() if p.suffix in (".sock", ".ipc", ".fds")]
        for p in path.iterdir():
            p.unlink()
        path.rmdir()
    assert not leftovers, f"socket files left behind: {leftovers}"



def raw_exchange(url: str, frames: list[bytes], timeout_s: float = 5.0) -> Optional[list[bytes]]:
    """Send ``frames`` from a bare DEALER (no lmshm client logic); the reply frames, or None."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(url)
        sock.send_multipart(frames)
        if not sock.poll(int(timeout_s * 1000)):
            return None
        return sock.recv_multipart()
    finally:
        sock.close(0)
        ctx.term()


def raw_reply(url: str, body: bytes, request_id: bytes = b"\x00" * 7 + b"\x01", timeout_s: float = 5.0):
    """Send one well-framed request body; decode the reply struct."""
    from lmshm.multiprocess import codec

    frames = raw_exchange(url, [request_id, body], timeout_s)
    assert frames is not None, f"no reply from {url}"
    assert frames[0] == request_id and len(frames) == 2, frames
    return codec.decode_reply(frames[1])


# ---- hostile payloads: pickles that would run code if a decoder trusted them -------------


class RunsACommand:
    """Unpickling this runs ``os.system(command)`` -- unless the decoder refuses it."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class Evals:
    """Unpickling this runs ``eval(source)`` -- unless the decoder refuses it."""

    def __init__(self, source: str) -> None:
        self.source = source

    def __reduce__(self):
        return (eval, (self.source,))
