"""Log lines a peer can cause, at a bounded rate: ``Throttle``.

A hostile peer that sends a million malformed messages must not write a million lines: the log
would fill the disk, and formatting the lines would take the loop's time from honest peers. So
every line whose cause is a peer's bytes (a refused message, a reply it does not read, a
connection it broke) goes through a ``Throttle``: at most one line per ``every_s`` for that kind
of event, and the next line that is written says how many were left out meanwhile, so that a
reader of the log still sees the count. Counters in STATUS and ``/metrics`` keep exact figures.

One ``Throttle`` per kind of line (one per call site), not per peer: a flood from a thousand
connections is still one line per interval. Cheap when it drops a line (a clock read and a
compare), so it may sit on paths that run per message.
"""

from __future__ import annotations

import logging
import threading
import time


class Throttle:
    """``throttle.warning(msg, *args)`` logs through ``logger`` at most once per ``every_s``."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self.logger = logger
        self.every_s = every_s
        self.left_out = 0         # lines not written since the last one that was
        self.total = 0            # every call, written or not
        self._next = 0.0
        self._lock = threading.Lock()

    def log(self, level: int, msg: str, *args: object, exc_info: bool = False) -> bool:
        """Log the line now if the interval has passed (True), else count it (False)."""
        now = time.monotonic()
        with self._lock:
            self.total += 1
            if now < self._next:
                self.left_out += 1
                return False
            self._next = now + self.every_s
            left_out, self.left_out = self.left_out, 0
        if left_out:
            msg += " (and %d more like this since the last such line; logged at most every %g s)"
            args = (*args, left_out, self.every_s)
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True

    def warning(self, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, msg, *args)

    def info(self, msg: str, *args: object) -> bool:
        return self.log(logging.INFO, msg, *args)

    def exception(self, msg: str, *args: object) -> bool:
        return self.log(logging.ERROR, msg, *args, exc_info=True)
