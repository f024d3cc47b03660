"""An ``lmshm-server`` subprocess for the benchmark scripts: start it, read its URL, stop it.

    with BenchServer("--isolated-ipc") as server:
        ... server.url, server.pid ...
    server.returncode   # its exit status after SIGTERM (0 when it released everything)

The fd socket lives in a fresh temporary directory, removed at stop. ``python`` lets a script
run the server of another checkout (``bench/status_cost.py`` compares two).
"""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Optional

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
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.returncode = self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.returncode = self.proc.wait()
            self.proc.stdout.close()
            shutil.rmtree(self.dir, ignore_errors=True)
        return self.returncode

    def __enter__(self) -> "BenchServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
