"""The CUDA ordering leg of the data plane: streams, interprocess events, async copies.

A STORE or RETRIEVE on a CUDA registration is ordered against the worker's own GPU work by
events, never by host-side waits in the worker:

- the worker records a fresh interprocess event on its stream after the work that wrote (STORE)
  or last used (RETRIEVE) the blocks, sends its IPC handle with the request, and keeps the event
  alive until the reply;
- the server makes its own stream wait on that event, queues the copies on that stream
  (device-to-host into the pinned pool, or host-to-device out of it), records a fresh
  interprocess event, and answers with its handle; the worker's stream waits on it before it
  touches the blocks again. The server keeps each event alive for a while after its reply
  (``EVENT_KEEP``), so the worker can open it;
- the server itself waits for its event before a stored chunk becomes visible (STORE) or a
  pinned chunk is let go (RETRIEVE).

``TorchCudaSync`` does this with ``torch.cuda``; the logic tests inject a fake with the same
methods (``tests/v1/platform/cuda/fake_sync.py``). **Unverified on a GPU so far.**
"""

from __future__ import annotations

import collections
import threading
from typing import Any

#: Server events kept alive per session after their reply (the worker opens them on receipt).
EVENT_KEEP = 256
IPC_EVENT_HANDLE_BYTES = 64


class CudaSyncError(RuntimeError):
    """A CUDA ordering step failed (bad event handle, driver error)."""


class TorchCudaSync:
    """The real gateway: one server stream per device, events through ``torch.cuda``."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._streams: dict[int, Any] = {}
        self._pinned: set[int] = set()
        self._lock = threading.Lock()

    def stream(self, device: int) -> Any:
        with self._lock:
            s = self._streams.get(device)
            if s is None:
                s = self._streams[device] = self._torch.cuda.Stream(device=device)
            return s

    def wait_ipc_event(self, stream: Any, handle: bytes, device: int) -> None:
        try:
            ev = self._torch.cuda.Event.from_ipc_handle(device, handle)
        except Exception as exc:  # noqa: BLE001 - a peer's bytes
            raise CudaSyncError(f"cannot open the worker's CUDA event: {exc}") from None
        stream.wait_event(ev)

    def copy(self, dst: Any, src: Any, stream: Any) -> None:
        with self._torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def record(self, stream: Any, device: int) -> tuple[Any, bytes]:
        ev = self._torch.cuda.Event(interprocess=True, blocking=False)
        ev.record(stream)
        return ev, bytes(ev.ipc_handle())

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def pin(self, tensor: Any) -> None:
        """Page-lock the pool (``cudaHostRegister``) once, so async copies are real DMA."""
        ptr, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        with self._lock:
            if ptr in self._pinned or not size:
                return
            rc = self._torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
            if int(rc) != 0:
                raise CudaSyncError(f"cudaHostRegister of the pool ({size} bytes) failed: error {int(rc)}")
            self._pinned.add(ptr)

    def unpin_all(self, tensors: list) -> None:
        with self._lock:
            for t in tensors:
                if t.data_ptr() in self._pinned:
                    self._torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
                    self._pinned.discard(t.data_ptr())


class WorkerCudaSync:
    """The worker's half: record an interprocess event for a request, wait on the server's."""

    def __init__(self, device: int) -> None:
        import torch

        self._torch = torch
        self.device = device

    def ready(self) -> tuple[Any, bytes]:
        """An event recorded now on the current stream (keep it until the reply) and its handle."""
        ev = self._torch.cuda.Event(interprocess=True, blocking=False)
        ev.record(self._torch.cuda.current_stream(self.device))
        return ev, bytes(ev.ipc_handle())

    def wait(self, handle: bytes) -> None:
        """Make the current stream wait for the server's event (no host-side wait)."""
        if handle:
            ev = self._torch.cuda.Event.from_ipc_handle(self.device, handle)
            self._torch.cuda.current_stream(self.device).wait_event(ev)


class EventKeeper:
    """The server's recent events per session, kept alive until the worker can have opened them."""

    def __init__(self, keep: int = EVENT_KEEP) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._by_session: dict[Any, collections.deque] = {}

    def keep(self, session: Any, event: Any) -> None:
        with self._lock:
            q = self._by_session.setdefault(session, collections.deque(maxlen=self._keep))
            q.append(event)

    def drop(self, session: Any) -> None:
        with self._lock:
            self._by_session.pop(session, None)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._by_session.values())
