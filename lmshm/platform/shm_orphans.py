"""Orphan sweep: remove ``lmshm-*`` names in /dev/shm whose creator is dead. No torch, no sockets.

A worker SIGKILLed between creating a segment and registering it leaves a name no server knows.
``sweep_orphans()`` unlinks a name only if it parses exactly (``shm_names``), is a regular file
(lstat: symlinks are never followed) owned by the sweeping uid, was made in *this* process's PID
namespace, its pid is dead, and it is still the same inode right before the unlink. Anything
else is never touched. Unlinking never invalidates a mapping: whoever maps the memory keeps it.

The trap: a pid means nothing outside its PID namespace (a live worker in a container sharing
/dev/shm has a pid that is dead, or someone else's, here), so such names are left to a sweeper
in that namespace; and a reused pid counts as alive, so its name waits until that one dies too.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from dataclasses import dataclass, field
from typing import Any

from lmshm.platform import shm_names
from lmshm.platform.shm_names import (
    SEGMENT_PREFIX,
    own_pid_namespace,
    parse_segment_name,
)

logger = logging.getLogger(__name__)

#: Why a ``lmshm-*`` entry was kept. Entries not starting with ``lmshm-`` are not counted.
SKIP_REASONS = (
    "bad-name",        # starts with lmshm- but is not exactly the format (never touched)
    "not-regular",     # a symlink, directory, fifo, ... (never followed)
    "other-owner",     # owned by another uid
    "other-pid-ns",    # made in another PID namespace, or the creator's namespace is unknown
    "owner-alive",     # the creating pid exists (possibly a reused pid: kept, conservatively)
    "too-young",       # modified less than min_age_s ago
    "vanished",        # gone before we could remove it (someone else did)
    "changed",         # another inode under the name when re-checked before the unlink
    "permission",      # EACCES / EPERM
    "error",           # any other OSError
)


@dataclass
class SweepResult:
    """What one sweep did. ``removed``: names unlinked (with ``dry_run``: that would be)."""

    shm_dir: str
    dry_run: bool
    pid_ns: int  # the sweeper's PID namespace inode (0: unknown, nothing is removed)
    removed: list[str] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)  # reason (SKIP_REASONS) -> count

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())

    def as_dict(self) -> dict[str, Any]:
        return {"shm_dir": self.shm_dir, "dry_run": self.dry_run, "pid_ns": self.pid_ns,
                "removed": list(self.removed), "skipped": dict(sorted(self.skipped.items())),
                "skipped_total": self.skipped_total}

    def _skip(self, name: str, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        logger.debug("lmshm: orphan sweep keeps %s (%s)", name, reason)


def _proc_is_ours() -> bool:
    """Whether /proc is mounted for our PID namespace, so /proc/<pid> means our pid."""
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


def pid_alive(pid: int, *, use_proc: bool | None = None) -> bool:
    """Whether ``pid`` (in our PID namespace) may be alive. Errs on the side of alive.

    Dead only if /proc (when it is our namespace's) has no ``/proc/<pid>`` *and*
    ``kill(pid, 0)`` fails with ESRCH. Zombies and threads count as alive.
    """
    if pid <= 0:
        return True  # never kill(0 / -1, ...): those address groups; not a name we parse
    if use_proc is None:
        use_proc = _proc_is_ours()
    if use_proc:
        try:
            os.lstat(f"/proc/{pid}")
            return True
        except FileNotFoundError:
            pass
        except OSError:
            return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        return True  # EPERM: it exists, someone else's
    return True


def _errno_reason(exc: OSError) -> str:
    if exc.errno == errno.ENOENT:
        return "vanished"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission"
    return "error"


def sweep_orphans(
    shm_dir: str | None = None,
    *,
    uid: int | None = None,
    dry_run: bool = False,
    min_age_s: float = 0.0,
) -> SweepResult:
    """Remove the orphaned lmshm names in ``shm_dir`` (default ``shm_names.shm_dir()``).

    See the module docstring for exactly what is removed. ``uid``: whose names (default the
    effective uid). ``dry_run``: decide, report in ``removed``, unlink nothing.
    ``min_age_s``: also keep names modified less than that many seconds ago. The default is
    0 because no grace is needed for correctness: a name is created by a live process (O_EXCL)
    and is only removed once that pid is gone, so a live creator's fresh name is never at risk.

    Never raises for a single entry (races, EACCES: skipped and counted); raises OSError only
    when the directory itself cannot be opened or listed.
    """
    directory = shm_dir if shm_dir is not None else shm_names.shm_dir()
    uid = os.geteuid() if uid is None else uid
    own_ns = own_pid_namespace()
    result = SweepResult(shm_dir=directory, dry_run=dry_run, pid_ns=own_ns)
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        names = sorted(n for n in os.listdir(dfd) if n.startswith(SEGMENT_PREFIX))
        use_proc = _proc_is_ours()
        now = time.time()
        for name in names:
            reason = _examine(dfd, name, uid, own_ns, use_proc, now, min_age_s, dry_run, result)
            if reason is not None:
                result._skip(name, reason)
    finally:
        os.close(dfd)
    return result


def _examine(dfd: int, name: str, uid: int, own_ns: int, use_proc: bool, now: float,
             min_age_s: float, dry_run: bool, result: SweepResult) -> str | None:
    """Decide on one entry; remove it if it is an orphan. Returns the skip reason, or None."""
    owner = parse_segment_name(name)
    if owner is None:
        return "bad-name"
    try:
        st = os.lstat(name, dir_fd=dfd)
    except OSError as exc:
        return _errno_reason(exc)
    if not stat.S_ISREG(st.st_mode):
        return "not-regular"
    if st.st_uid != uid:
        return "other-owner"
    if own_ns == 0 or owner.pid_ns != own_ns:
        return "other-pid-ns"
    if pid_alive(owner.pid, use_proc=use_proc):
        return "owner-alive"
    if min_age_s > 0 and now - st.st_mtime < min_age_s:
        return "too-young"
    if dry_run:
        result.removed.append(name)
        return None
    try:
        again = os.lstat(name, dir_fd=dfd)
    except OSError as exc:
        return _errno_reason(exc)
    if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(again.st_mode) \
            or again.st_uid != uid:
        return "changed"
    try:
        os.unlink(name, dir_fd=dfd)
    except OSError as exc:
        return _errno_reason(exc)
    logger.info("lmshm: removed orphaned shared memory %s (creator pid %d is gone)",
                os.path.join(result.shm_dir, name), owner.pid)
    result.removed.append(name)
    return None


__all__ = ["SKIP_REASONS", "SweepResult", "pid_alive", "sweep_orphans"]
