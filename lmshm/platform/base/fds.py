"""Process-wide inbox of file descriptors received out of band.

In isolated mode the wire carries a *token* where a name would be, and the file descriptor
itself travels over a Unix socket with SCM_RIGHTS (the server's fd side channel, or any
socket in a test). Whoever receives an fd files it here with ``FD_INBOX.put(token, fd,
session)``; a wrapper's ``to_tensor()`` looks its token up with ``FD_INBOX.get(token)``.

The inbox owns every fd in it: ``discard(token)`` and ``close_session(session)`` close them,
so an fd is closed exactly once, when the session that delivered it ends. A mapping made
from an fd does not need the fd afterwards (mmap keeps its own reference).
"""

from __future__ import annotations

import os
import threading
from typing import Hashable


class FdInbox:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: dict[str, tuple[int, Hashable]] = {}

    def put(self, token: str, fd: int, session: Hashable = None) -> None:
        """Take ownership of ``fd`` under ``token``. A token already present is refused."""
        with self._lock:
            if token in self._fds:
                os.close(fd)
                raise ValueError(f"fd token {token!r} was already received")
            self._fds[token] = (fd, session)

    def get(self, token: str) -> int:
        """The fd filed under ``token`` (still owned by the inbox)."""
        with self._lock:
            entry = self._fds.get(token)
        if entry is None:
            raise LookupError(
                f"no file descriptor was received for token {token!r}; in isolated mode the "
                "worker must send it over the fd side channel before registering"
            )
        return entry[0]

    def session_of(self, token: str) -> Hashable:
        with self._lock:
            entry = self._fds.get(token)
        return None if entry is None else entry[1]

    def discard(self, token: str) -> None:
        with self._lock:
            entry = self._fds.pop(token, None)
        if entry is not None:
            os.close(entry[0])

    def close_session(self, session: Hashable) -> int:
        """Close every fd delivered by ``session``; return how many."""
        with self._lock:
            tokens = [t for t, (_, s) in self._fds.items() if s == session]
            fds = [self._fds.pop(t)[0] for t in tokens]
        for fd in fds:
            os.close(fd)
        return len(fds)

    def tokens(self) -> list[str]:
        with self._lock:
            return list(self._fds)

    def __len__(self) -> int:
        with self._lock:
            return len(self._fds)


FD_INBOX = FdInbox()
