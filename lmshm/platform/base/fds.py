"""Process-wide inbox of file descriptors received out of band, scoped by the session that sent them.

For fd-based wrappers (memfd, the default CPU kind; CUDA VMM) the wire carries a *token* where a
name would be, and the fd travels over a Unix socket with SCM_RIGHTS. Whoever receives one files
it with ``FD_INBOX.put(token, fd, session)``; the wrapper's consumer side takes it with
``FD_INBOX.take(token, session)`` when it maps the object and closes it once the mapping exists
(mmap and the CUDA driver keep their own reference), so no fd outlives the step that needed it.

The inbox owns every fd in it until it is taken; ``discard`` and ``close_session`` close the
rest, so every fd is closed exactly once. ``session=None`` is the unscoped, in-process scope.
The trap: a token filed by one session is invisible to every other one (``take`` answers "not
received", as for a token nobody sent), so a peer that learns another session's token (from
/proc/<server>/fd) cannot map that session's memory. Never look a token up without its session.
"""

from __future__ import annotations

import os
import threading
from typing import Hashable, Iterable


class FdInbox:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: dict[tuple[Hashable, str], int] = {}

    def put(self, token: str, fd: int, session: Hashable = None) -> bool:
        """Take ownership of ``fd`` under ``(session, token)``. Returns False (and closes ``fd``)
        if that session already filed this token: the first fd stands."""
        with self._lock:
            if (session, token) not in self._fds:
                self._fds[(session, token)] = fd
                return True
        os.close(fd)
        return False

    def take(self, token: str, session: Hashable = None) -> int:
        """Remove and return the fd ``session`` filed under ``token``; the caller must close it."""
        with self._lock:
            fd = self._fds.pop((session, token), None)
        if fd is None:
            raise LookupError(
                f"no file descriptor was received for token {token[:80]!r}; the worker must send it "
                "over the fd side channel before registering"
            )
        return fd

    def discard(self, tokens: Iterable[str], session: Hashable = None) -> int:
        """Close the fds ``session`` filed under ``tokens`` (those still here); return how many."""
        with self._lock:
            fds = [self._fds.pop((session, t)) for t in tokens if (session, t) in self._fds]
        for fd in fds:
            os.close(fd)
        return len(fds)

    def close_session(self, session: Hashable) -> int:
        """Close every fd ``session`` filed; return how many."""
        with self._lock:
            keys = [k for k in self._fds if k[0] == session]
            fds = [self._fds.pop(k) for k in keys]
        for fd in fds:
            os.close(fd)
        return len(fds)

    def count(self, session: Hashable = None) -> int:
        with self._lock:
            return sum(1 for k in self._fds if k[0] == session)

    def __len__(self) -> int:
        with self._lock:
            return len(self._fds)


FD_INBOX = FdInbox()
