"""The copier threads: ``OrderedExecutor``, jobs in order per key, never on the request loop.

The data plane keys jobs by session, so a client's STOREs and RETRIEVEs apply in the order it
sent them, while different sessions' copies run side by side on up to ``threads`` threads. A
job's ``cancel`` runs instead of it once the executor shuts down, so every queued request is
answered. The trap: ``pending`` and ``idle`` are hints read without waiting for running jobs;
admission checks (``--max-inflight-per-session``) may be off by the job that is finishing.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from typing import Callable, Hashable

logger = logging.getLogger("lmshm.dataplane")


class OrderedExecutor:
    """Jobs run on ``threads`` worker threads; jobs of one key run one at a time, in order.

    The workers are this class's own, started with the first job and blocked on a
    ``queue.SimpleQueue`` of keys that have jobs, not a ``ThreadPoolExecutor``: its ``submit``
    (a future, a work item, a Python semaphore) cost the request loop about 24 µs a job here
    against 5 for a ``SimpleQueue.put``, and its worker ran more Python (holding the GIL the
    loop waits for to send the reply) after each job (docs/benchmarks.md, "Hand-overs")."""

    def __init__(self, threads: int, name: str = "lmshm-copy") -> None:
        self._size = max(1, threads)
        self._name = name
        self._workers: list[threading.Thread] = []
        self._ready: queue.SimpleQueue[Hashable | None] = queue.SimpleQueue()   # keys whose jobs wait
        self._lock = threading.Lock()
        self._queues: dict[Hashable, collections.deque] = {}
        self._closed = False

    def submit(self, key: Hashable, job: Callable[[], None], cancel: Callable[[], None]) -> None:
        """Queue ``job`` behind ``key``'s earlier jobs. ``cancel`` runs instead if the executor
        shuts down first."""
        with self._lock:
            refused = self._closed
            if not refused:
                queue_ = self._queues.get(key)
                if queue_ is None:
                    queue_ = self._queues[key] = collections.deque()
                    if len(self._workers) < self._size:
                        self._start_worker()
                    self._ready.put(key)    # under the lock: never behind shutdown's stop marks
                queue_.append((job, cancel))
        if refused:
            cancel()

    def _start_worker(self) -> None:
        """One more worker (under ``_lock``): the first jobs start them, up to ``threads``."""
        worker = threading.Thread(target=self._work, name=f"{self._name}_{len(self._workers)}", daemon=True)
        self._workers.append(worker)
        worker.start()

    def pending(self, key: Hashable) -> int:
        with self._lock:
            queue_ = self._queues.get(key)
            return len(queue_) if queue_ is not None else 0

    def idle(self) -> bool:
        """No job is queued or running (a hint: one may be submitted right after)."""
        return not self._queues

    def _work(self) -> None:
        while True:
            key = self._ready.get()
            if key is None:             # shutdown: each worker takes one, after the keys before it
                return
            self._drain(key)

    def _drain(self, key: Hashable) -> None:
        while True:
            with self._lock:
                queue_ = self._queues[key]
                if not queue_:
                    del self._queues[key]
                    return
                job, cancel = queue_[0]
                closed = self._closed
            try:
                (cancel if closed else job)()
            except Exception:
                logger.exception("lmshm: a copy job failed")
            with self._lock:
                queue_.popleft()

    def shutdown(self) -> None:
        """Cancel queued jobs, wait for running ones."""
        with self._lock:
            self._closed = True
            workers = list(self._workers)
        for _ in workers:
            self._ready.put(None)
        for worker in workers:
            if worker is not threading.current_thread():
                worker.join()
