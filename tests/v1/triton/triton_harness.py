"""Helpers of the Triton-protocol tests: ``EmbeddedApp`` (an application process embedding
``lmshm.Server``, ``embedded_app.py``), ``Triton`` (a stock tritonclient client, HTTP or gRPC,
normalised), and ``STATUS`` (the status each protocol answers per lmshm code). The fixtures
built on them are in conftest.py.
"""

from __future__ import annotations

import json
import os
import resource
import select
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

HERE = Path(__file__).parent


class EmbeddedApp:
    """``nofile``: run the application with that open-file limit (soft and hard)."""

    def __init__(self, *, nofile: Optional[int] = None, **settings: Any) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="lmshm-triton-test."))
        settings = {"url": f"ipc://{self.tmp}/s.ipc", "fd_socket": str(self.tmp / "s.fds"), "http_port": 0,
                    "grpc_port": 0, "capacity": 0, "log_level": "WARNING", **settings}
        self.log_path = self.tmp / "app.log"
        self._log = open(self.log_path, "w")
        limit = None if nofile is None else (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)))
        self.proc = subprocess.Popen([sys.executable, str(HERE / "embedded_app.py"), json.dumps(settings)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     preexec_fn=limit)
        hello = self._reply(60)
        assert hello["ok"], hello
        self.pid, self.url = hello["pid"], hello["url"]
        self.http_url = f"127.0.0.1:{hello['http_port']}"
        self.grpc_url = f"127.0.0.1:{hello['grpc_port']}"
        self.http_port, self.grpc_port = hello["http_port"], hello["grpc_port"]

    def _reply(self, timeout_s: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"the embedded app did not answer:\n{self.log()}")
        return json.loads(line)

    def call(self, op: str, **kw: Any) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._reply(60)

    def ok(self, op: str, **kw: Any) -> dict:
        reply = self.call(op, **kw)
        assert reply["ok"], reply
        return reply

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def rss_kb(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

    def fd_count(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.ok("stop")
        rc = self.proc.wait(30)
        self.proc.stdin.close()
        self.proc.stdout.close()
        self._log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        return rc


class Triton:
    """One stock tritonclient client (HTTP or gRPC) with the shared-memory calls normalised:
    status rows as plain dicts with int fields, errors as ``(code, message)``."""

    def __init__(self, protocol: str, app: EmbeddedApp, headers: Optional[dict] = None) -> None:
        self.protocol = protocol
        self.headers = headers
        if protocol == "http":
            import tritonclient.http as client

            self.client = client.InferenceServerClient(app.http_url)
        else:
            import tritonclient.grpc as client

            self.client = client.InferenceServerClient(app.grpc_url)

    def register(self, name: str, key: str, byte_size: int, offset: int = 0) -> None:
        self.client.register_system_shared_memory(name, key, byte_size, offset=offset, headers=self.headers)

    def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        self.client.register_cuda_shared_memory(name, raw_handle, device_id, byte_size, headers=self.headers)

    def _rows(self, raw: Any) -> list[dict]:
        if self.protocol == "grpc":
            raw = [json_row for json_row in raw.get("regions", {}).values()]
        ints = ("offset", "byte_size", "device_id")
        return sorted(({k: int(v) if k in ints else v for k, v in row.items()} | (
            {"offset": int(row.get("offset", 0))} if "key" in row else {}) for row in raw), key=lambda r: r["name"])

    def status(self, name: str = "") -> list[dict]:
        kw = {"as_json": True} if self.protocol == "grpc" else {}
        return self._rows(self.client.get_system_shared_memory_status(name, headers=self.headers, **kw))

    def cuda_status(self, name: str = "") -> list[dict]:
        kw = {"as_json": True} if self.protocol == "grpc" else {}
        return self._rows(self.client.get_cuda_shared_memory_status(name, headers=self.headers, **kw))

    def unregister(self, name: str = "") -> None:
        self.client.unregister_system_shared_memory(name, headers=self.headers)

    def unregister_cuda(self, name: str = "") -> None:
        self.client.unregister_cuda_shared_memory(name, headers=self.headers)

    def error(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> tuple[str, str]:
        """Call ``fn``; it must fail. Returns (status, message): the HTTP status as text
        ("400") or the gRPC code's name ("INVALID_ARGUMENT")."""
        from tritonclient.utils import InferenceServerException

        try:
            fn(*args, **kw)
        except InferenceServerException as exc:
            status = str(exc.status())
            return status.split(".", 1)[1] if status.startswith("StatusCode.") else status, exc.message()
        raise AssertionError(f"{fn.__name__}{args} succeeded; it should have failed")

    def close(self) -> None:
        self.client.close()


#: Expected status per (lmshm code, protocol), as Triton maps its codes.
STATUS = {
    "INVALID_ARG": {"http": "400", "grpc": "INVALID_ARGUMENT"},
    "ALREADY_EXISTS": {"http": "400", "grpc": "ALREADY_EXISTS"},
    "NOT_FOUND": {"http": "404", "grpc": "NOT_FOUND"},
    "PERMISSION_DENIED": {"http": "403", "grpc": "PERMISSION_DENIED"},
    "UNAVAILABLE": {"http": "503", "grpc": "UNAVAILABLE"},
}


