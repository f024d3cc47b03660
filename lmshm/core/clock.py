"""The core's clock: timed work on one thread that the core owns, whatever endpoints run.

``Clock.every(interval_s, job)`` runs ``job`` every ``interval_s`` seconds and ``after(delay_s,
job)`` once; both return a ``Timer`` whose ``cancel()`` stops it. The core schedules lease
expiry and the orphan sweep here (``service.py``), and the tiers their background work.

Guarantees: jobs run one at a time on the clock's thread (``lmshm-clock``), never on an
endpoint's loop; an interval runs from the end of one run to the start of the next, so a slow
job delays its own next run and never piles up; a job that raises is logged and keeps its
schedule; ``stop()`` waits for the running job, and nothing runs once it has returned.
The trap: a job runs on another thread than the requests that touch the same state, so it
must take that state's own lock, and it must be short: every other job waits behind it. Long
work (a copy, a transfer to a tier) belongs on a thread of its own, which a job may wake.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from typing import Callable, Optional

logger = logging.getLogger("lmshm.clock")


class Timer:
    """One scheduled job; ``cancel()`` (any thread, idempotent) makes sure it does not run again."""

    __slots__ = ("name", "job", "interval_s", "cancelled")

    def __init__(self, name: str, job: Callable[[], object], interval_s: Optional[float]) -> None:
        self.name, self.job, self.interval_s = name, job, interval_s
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def __repr__(self) -> str:
        every = f"every {self.interval_s:g} s" if self.interval_s is not None else "once"
        return f"Timer({self.name!r}, {every}{', cancelled' if self.cancelled else ''})"


class Clock:
    """A heap of timers and the one thread that runs them (see the module documentation)."""

    def __init__(self, name: str = "lmshm-clock") -> None:
        self.name = name
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Timer]] = []
        self._order = itertools.count()     # ties run in the order they were scheduled
        self._thread: Optional[threading.Thread] = None
        self._stopped = False

    def every(self, interval_s: float, job: Callable[[], object], *, name: str,
              first_in: Optional[float] = None) -> Timer:
        """Run ``job`` every ``interval_s`` seconds, the first time after ``first_in`` (default:
        one interval)."""
        if not interval_s > 0:
            raise ValueError(f"timer {name!r}: the interval must be positive, got {interval_s!r}")
        timer = Timer(name, job, interval_s)
        self._push(time.monotonic() + (interval_s if first_in is None else first_in), timer)
        return timer

    def after(self, delay_s: float, job: Callable[[], object], *, name: str) -> Timer:
        """Run ``job`` once, ``delay_s`` seconds from now."""
        timer = Timer(name, job, None)
        self._push(time.monotonic() + max(0.0, delay_s), timer)
        return timer

    def _push(self, when: float, timer: Timer) -> None:
        with self._cond:
            if self._stopped:
                raise RuntimeError(f"the clock {self.name!r} was stopped; timer {timer.name!r} would never run")
            heapq.heappush(self._heap, (when, next(self._order), timer))
            self._cond.notify()

    def start(self) -> "Clock":
        """Start the thread (idempotent). Timers scheduled before run from here on."""
        with self._cond:
            if self._stopped:
                raise RuntimeError(f"the clock {self.name!r} was stopped; make a new one")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Cancel every timer and wait for a job that is running (idempotent; any thread but
        the clock's own, where it only cancels)."""
        with self._cond:
            self._stopped = True
            for _, _, timer in self._heap:
                timer.cancel()
            self._heap.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
            if thread.is_alive():
                logger.error("lmshm: the %s thread did not stop within %g s", self.name, timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped:
                    if self._heap and self._heap[0][2].cancelled:
                        heapq.heappop(self._heap)
                        continue
                    wait = self._heap[0][0] - time.monotonic() if self._heap else None
                    if wait is not None and wait <= 0:
                        break
                    self._cond.wait(wait)
                if self._stopped:
                    return
                _, _, timer = heapq.heappop(self._heap)
            try:
                timer.job()
            except Exception:
                logger.exception("lmshm: the %s job failed; it keeps its schedule", timer.name)
            if timer.interval_s is not None:
                with self._cond:
                    if not self._stopped and not timer.cancelled:
                        heapq.heappush(self._heap, (time.monotonic() + timer.interval_s, next(self._order), timer))
