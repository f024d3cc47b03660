"""File identity: which object a path or fd names, and removing a path only while it names ours.

Identity is ``(st_dev, st_ino)``: unique among live files (sockets included), so a path or fd
number that came to name another object since we looked is told apart. ``unlink_if_same``
removes a path only if it still names the object we made, and never follows a symlink. The
trap: compare identities right before acting; a name checked earlier may name another file by
now. Torch-free: the fd channel, the ZeroMQ listener and the event publisher use it.
"""

from __future__ import annotations

import os
from typing import Optional

FileId = tuple[int, int]


def file_id(st: os.stat_result) -> FileId:
    return (st.st_dev, st.st_ino)


def fd_id(fd: int) -> Optional[FileId]:
    """The identity of what ``fd`` refers to, or None if it is not open."""
    try:
        return file_id(os.fstat(fd))
    except OSError:
        return None


def unlink_if_same(path: str, expected: FileId) -> bool:
    """Remove ``path`` only if it still names ``expected`` (never follows a symlink). Returns
    True if it was removed."""
    try:
        if file_id(os.lstat(path)) != expected:
            return False
        os.unlink(path)
        return True
    except OSError:
        return False
