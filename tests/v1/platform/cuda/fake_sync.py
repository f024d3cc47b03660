"""FakeCudaSync -- a FAKE of ``lmshm.core.cuda_sync.TorchCudaSync`` for CPU-only logic tests.

Same methods; copies run at once on the (host) tensors the fake driver hands out, events are
small objects that complete at once unless the test holds them (``hold_events``), host waits
on the worker's token block until it is signalled, the deadline, or ``stop()`` (as the real
ones do; flag words are read from the simulated memory), and every call is logged in order,
so a test can check *what the data plane asks the GPU to do, and when* (pin, then wait on the
host for the worker's token before any copy, reply before or after the server's wait, commit
or unpin only after it). It proves nothing about CUDA itself; the same requests run on a GPU in
``test_cuda_server_e2e.py`` and ``test_cuda_dataplane_gpu.py`` (``scripts/gpu-check``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from lmshm.core.cuda_sync import PIN_EXTENT, CudaSyncError, extents, submit_copies
from lmshm.platform.cuda.driver import get_driver


class FakeEvent:
    def __init__(self, n: int, done: bool) -> None:
        self.n, self.complete = n, done
        self.tag: Optional[str] = None      # a worker's event: the handle's first byte

    def __repr__(self) -> str:
        return f"event{self.n}"


class FakeCudaSync:
    def __init__(self, read_word: Optional[Callable[[int], int]] = None, *, pin_extent: int = PIN_EXTENT,
                 copy_batch: bool = True) -> None:
        self.log: list[str] = []
        self.pin_extent = pin_extent
        self.copy_batch = copy_batch
        self._paths: dict[int, str] = {}
        self._streams: dict[Any, int] = {}      # the fake driver's stream for each of ours
        self._pinned: set[int] = set()
        self.copy_calls = self.copy_pieces = 0
        self._events = 0
        self.on_synchronize: Optional[Callable[[], None]] = None
        self.hold_events = False            # new events stay incomplete until complete_all()
        self.made: list[FakeEvent] = []
        self.read_word = read_word          # reads a simulated 8-byte word (flag waits)
        self.on_host_wait: Optional[Callable[[], None]] = None   # runs as a host wait on a worker's token starts
        self.pins: list[tuple[int, int]] = []
        self.dropped: list[Any] = []
        self.worker_pending = False         # the worker's events are not signalled (yet)
        self.worker_events: list[FakeEvent] = []

    def stream(self, device: int, session: Any = None) -> str:
        self.log.append(f"stream:{device}")
        return f"stream{device}-{session}"

    def drop_session(self, session: Any) -> None:
        self.dropped.append(session)

    def open_ipc_event(self, handle: bytes, device: int) -> Any:
        if len(handle) != 64:
            raise CudaSyncError(f"cannot open the worker's CUDA event: a handle is 64 bytes, got {len(handle)}")
        ev = FakeEvent(0, not self.worker_pending)
        ev.tag = handle[:1].decode()
        self.worker_events.append(ev)
        return ev

    def wait_word(self, page: Any, slot: int, seq: int, deadline: float,
                  stop: Optional[Callable[[], bool]] = None) -> bool:
        """As the real one: True once the word reaches ``seq``; False at ``deadline`` or once
        ``stop()`` is true (it blocks until then, polling the simulated word)."""
        self.log.append(f"host-wait-flag:{seq}")
        if self.on_host_wait is not None:
            self.on_host_wait()
        return self._until(lambda: self.read_word is None or self.read_word(page.data_ptr() + 8 * slot) >= seq,
                           deadline, stop)

    @staticmethod
    def _until(ready: Callable[[], bool], deadline: float, stop: Optional[Callable[[], bool]]) -> bool:
        while not ready():
            if time.monotonic() >= deadline or (stop is not None and stop()):
                return False
            time.sleep(0.001)
        return True

    def record(self, stream: Any, device: int, interprocess: bool = True) -> tuple[Any, bytes]:
        self._events += 1
        self.log.append(f"record:{self._events}")
        ev = FakeEvent(self._events, not self.hold_events)
        self.made.append(ev)
        return ev, (bytes([self._events]) * 64 if interprocess else b"")

    def complete_all(self) -> None:
        self.hold_events = False
        for ev in self.made:
            ev.complete = True

    def done(self, event: Any) -> bool:
        return event.complete

    def wait(self, event: Any, deadline: float, stop: Optional[Callable[[], bool]] = None) -> bool:
        if getattr(event, "tag", None) is not None:     # the worker's event, waited on from the host
            self.log.append(f"host-wait:{event.tag}")
            if self.on_host_wait is not None:
                self.on_host_wait()
            return self._until(lambda: event.complete, deadline, stop)   # blocks, as the real one
        if self.on_synchronize is not None:
            self.on_synchronize()
        self.log.append(f"sync:{event}" if event.complete else f"timeout:{event}")
        return event.complete

    def pin(self, pool: Any, offset: int = 0, nbytes: int = -1) -> None:
        """Registers the extents touched with the fake driver (``host_registered``), as
        ``TorchCudaSync.pin`` page-locks them."""
        self.pins.append((offset, nbytes))
        self.log.append("pin")
        drv, size = get_driver(), pool.numel()
        for i in extents(offset, nbytes if nbytes >= 0 else size, size, self.pin_extent):
            if i not in self._pinned and hasattr(drv, "host_registered"):
                self._pinned.add(i)
                drv.host_registered.append((pool.data_ptr() + i * self.pin_extent,
                                            min(self.pin_extent, size - i * self.pin_extent)))

    def submit(self, plan: Any, stream: Any, device: int) -> None:
        """The real ``submit_copies`` against the installed (fake) driver, on a fake-driver
        stream of its own per stream of this fake's; logs one "copy" per driver call."""
        drv = get_driver()
        handle = self._streams.get(stream)
        if handle is None:
            handle = self._streams[stream] = drv.stream_create(device)
        path = self._paths.setdefault(device, "batch" if self.copy_batch and drv.has_memcpy_batch(device)
                                      else "per-piece")
        calls = submit_copies(drv, plan, handle, device, path == "batch")
        self.copy_calls += calls
        self.copy_pieces += len(plan)
        self.log.extend(["copy"] * calls)
