"""FakeCudaSync -- a FAKE of ``lmshm.core.cuda_sync.TorchCudaSync`` for CPU-only logic tests.

Same methods; copies run at once on the (host) tensors the fake driver hands out, events are
counters, and every call is logged in order, so a test can check *what the data plane asks the
GPU to do, and when* (wait on the worker's event before any copy, reply before the server
waits, commit or unpin only after it). It proves nothing about CUDA itself; the same requests
run on a GPU in ``test_cuda_server_e2e.py`` (``scripts/gpu-check``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from lmshm.core.cuda_sync import CudaSyncError


class FakeCudaSync:
    def __init__(self) -> None:
        self.log: list[str] = []
        self._events = 0
        self.on_synchronize: Optional[Callable[[], None]] = None

    def stream(self, device: int) -> str:
        self.log.append(f"stream:{device}")
        return f"stream{device}"

    def wait_ipc_event(self, stream: Any, handle: bytes, device: int) -> None:
        if len(handle) != 64:
            raise CudaSyncError(f"cannot open the worker's CUDA event: a handle is 64 bytes, got {len(handle)}")
        self.log.append(f"wait:{handle[:1].decode()}")

    def copy(self, dst: Any, src: Any, stream: Any) -> None:
        dst.copy_(src)
        self.log.append("copy")

    def record(self, stream: Any, device: int) -> tuple[Any, bytes]:
        self._events += 1
        self.log.append(f"record:{self._events}")
        return f"event{self._events}", bytes([self._events]) * 64

    def synchronize(self, event: Any) -> None:
        if self.on_synchronize is not None:
            self.on_synchronize()
        self.log.append(f"sync:{event}")

    def pin(self, tensor: Any) -> None:
        self.log.append("pin")
