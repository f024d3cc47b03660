"""The disk tier's directory, trusted only as far as it is checked: the checked walk, the key, the lock.

At start every ancestor of DIR must belong to root or this uid and be writable by no one else
unless sticky (as sshd checks the path to its keys), and DIR must be ours and not
group/other-writable (``open_checked_directory``). DIR is then held open as an fd, and every
path below it is reached from an fd, one component at a time, with ``O_NOFOLLOW|O_DIRECTORY``
(``open_subdir``): a DIR renamed or replaced after start, or a link planted below it, is never
followed. Directories are made 0700 exactly (``mkdir``, then ``fchmod``: the umask never decides
it); one that is not ours, not a directory or a link is ``Unsafe``, never used.

``DIR/.key`` holds the deployment's MAC key (``load_key``: 32 random bytes, 0600, made at the
first start); ``DIR/.lock`` is held with ``flock`` while a tier is open (``lock_directory``), so
a second server on the same directory is refused at start.

The one trap: every fd returned here is the caller's to close, and a cached one (``ChunkDirs``)
must not be closed while another thread may still use its number.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import resource
import secrets
import stat
import threading
from typing import Optional

from lmshm.core.logs import Throttle
from lmshm.core.tiers.disk.format import READ_FLAGS

logger = logging.getLogger("lmshm.tiers.disk")

KEY_FILE = ".key"               # the deployment's MAC key, in DIR
KEY_BYTES = 32
LOCK_FILE = ".lock"
DIR_MODE = 0o700                # every directory the tier makes, exactly
MAX_CACHED_DIRS = 4096          # DIR/<uid> and DIR/<uid>/<xx> fds held open (at most 1/8 of RLIMIT_NOFILE)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: "had mode N; set it to 700": one line per 10 s however many directories are fixed
_mode_fixed = Throttle(logger)


class Unsafe(OSError):
    """A path below DIR that the tier will not use: a link, not a directory, or not ours."""


def open_subdir(parent: int, name: str, create: bool, where: str) -> int:
    """An fd of the directory ``name`` in ``parent`` (``where``: its path, for messages), made
    0700 if ``create`` and missing. It must be a directory of ours (not a link): ``Unsafe`` if
    not. Any other mode is set to 0700 (so the umask never decides it)."""
    made = False
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        if not create:
            raise
        try:
            os.mkdir(name, DIR_MODE, dir_fd=parent)
            made = True
        except FileExistsError:
            pass
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise Unsafe(exc.errno, f"{where} is a link or not a directory; remove it") from None
            raise
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise Unsafe(exc.errno, f"{where} is a link or not a directory; remove it") from None
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise Unsafe(errno.EPERM, f"{where} belongs to uid {st.st_uid}, not to this server's uid "
                                      f"{os.geteuid()}; remove it")
        if stat.S_IMODE(st.st_mode) != DIR_MODE:
            os.fchmod(fd, DIR_MODE)
            if not made:
                _mode_fixed.warning("lmshm: disk tier: %s had mode %o; set it to %o", where, stat.S_IMODE(st.st_mode),
                                    DIR_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_checked_directory(directory: str) -> int:
    """An fd of ``directory`` (an absolute path without links; made 0700, with any missing
    parents, each 0700), after checking the path to it from ``/``: every ancestor must belong to
    root or this uid and be writable by no one else unless it is sticky (``/tmp``); the
    directory must be ours and not group/other-writable. Each component is opened from its
    parent's fd with ``O_NOFOLLOW``, so what was checked is what is held. An existing directory
    keeps its mode (it may be one the admin chose). Raises OSError that says what to fix."""
    euid = os.geteuid()
    fd = os.open("/", DIR_FLAGS)
    where = "/"
    try:
        for part in [p for p in directory.split("/") if p]:
            st = os.fstat(fd)
            mode = stat.S_IMODE(st.st_mode)
            if st.st_uid not in (0, euid) or (mode & 0o022 and not mode & stat.S_ISVTX):
                who = f"belongs to uid {st.st_uid}" if st.st_uid not in (0, euid) else \
                    f"is writable by {'others' if mode & 0o002 else 'its group'} (mode {mode:o}, not sticky)"
                raise PermissionError(
                    errno.EPERM, f"--disk {directory}: its ancestor {where} {who}, so another user could rename "
                                 f"{directory} away and put one of theirs in its place; make {where} owned by root "
                                 f"or uid {euid} and chmod go-w it (or chmod +t, as /tmp is), or put the disk tier "
                                 "in a directory whose every parent is")
            path = os.path.join(where, part)
            made = False
            try:
                try:
                    nfd = os.open(part, DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    try:
                        os.mkdir(part, DIR_MODE, dir_fd=fd)
                        made = True
                    except FileExistsError:
                        pass
                    nfd = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise OSError(errno.ENOTDIR, f"--disk {directory}: {path} is not a directory (or is a symbolic "
                                                 "link that appeared after the path was resolved)") from None
                raise
            os.close(fd)
            fd, where = nfd, path
            if made:
                os.fchmod(fd, DIR_MODE)             # exactly, whatever the umask
        st = os.fstat(fd)
        if st.st_uid != euid:
            raise PermissionError(errno.EPERM, f"--disk {directory} belongs to uid {st.st_uid}, not to this "
                                               f"server's uid {euid}; give the server a directory of its own")
        if st.st_mode & 0o022:
            raise PermissionError(errno.EPERM, f"--disk {directory} is writable by others (mode "
                                               f"{st.st_mode & 0o777:o}); chmod go-w it: another user could plant "
                                               "chunk files")
        return fd
    except BaseException:
        os.close(fd)
        raise


def load_key(dir_fd: int, directory: str) -> bytes:
    """The deployment's MAC key, ``DIR/.key``: made at the first start (32 random bytes, 0600,
    through a temp file made with ``O_EXCL``, then renamed: the caller holds ``DIR/.lock``).
    A key file that is not a regular file of ours, of mode 0600 and 32 bytes, is refused."""
    try:
        fd = os.open(KEY_FILE, READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        key = secrets.token_bytes(KEY_BYTES)
        tmp = f"{KEY_FILE}.tmp-{secrets.token_hex(8)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            try:
                os.fchmod(fd, 0o600)
                if os.write(fd, key) != KEY_BYTES:
                    raise OSError(errno.EIO, f"short write of {directory}/{KEY_FILE}")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, KEY_FILE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            unlink(tmp, dir_fd)
            raise
        logger.info("lmshm: disk tier: made the key %s/%s", directory, KEY_FILE)
        return key
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PermissionError(errno.EPERM, f"{directory}/{KEY_FILE} is a symbolic link; remove it (a new key "
                                               "is made at the next start, and files of the old one are dropped)"
                                  ) from None
        raise
    try:
        st = os.fstat(fd)
        problem = ("not a regular file" if not stat.S_ISREG(st.st_mode) else
                   f"owned by uid {st.st_uid}, not {os.geteuid()}" if st.st_uid != os.geteuid() else
                   f"of mode {stat.S_IMODE(st.st_mode):o}, not 600" if stat.S_IMODE(st.st_mode) != 0o600 else
                   f"{st.st_size} bytes, not {KEY_BYTES}" if st.st_size != KEY_BYTES else "")
        if problem:
            raise PermissionError(errno.EPERM, f"the disk tier's key {directory}/{KEY_FILE} is {problem}; remove it "
                                               "(a new key is made at the next start, and files of the old one are "
                                               "dropped)")
        key = os.pread(fd, KEY_BYTES, 0)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:
        raise PermissionError(errno.EPERM, f"the disk tier's key {directory}/{KEY_FILE} is short; remove it")
    return key


def lock_directory(dir_fd: int, directory: str) -> int:
    """An fd of ``DIR/.lock`` holding an exclusive ``flock`` (the caller closes it to release it);
    ``OSError`` (``EBUSY``) naming the directory when another server holds it."""
    where = os.path.join(directory, LOCK_FILE)
    try:
        fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600,
                     dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PermissionError(errno.EPERM, f"{where} is a symbolic link; remove it") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise PermissionError(errno.EPERM, f"{where} is not a regular file of uid {os.geteuid()}; remove it")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OSError(errno.EBUSY, f"--disk {directory} is in use by another lmshm-server (it holds "
                                   f"{where}); give each server its own directory") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


class ChunkDirs:
    """DIR's fd and the directories below it, each reached from its parent's fd by ``open_subdir``.

    ``leaf(uid, h, create)`` is the chunk's directory ``DIR/<uid>/<xx>/<yy>``. The fds of
    ``DIR/<uid>`` and ``DIR/<uid>/<xx>`` are cached (the first ``max_cached``; opening three
    directories was most of a small read's time). The trap: a cached fd closed while another
    thread still uses it lets the kernel hand its number to an unrelated open; so a cached fd is
    never evicted, and ``close`` must be called only once no operation is in flight.
    """

    def __init__(self, directory: str, dir_fd: int, max_cached: Optional[int] = None) -> None:
        self.directory, self.fd = directory, dir_fd
        if max_cached is None:
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            max_cached = MAX_CACHED_DIRS if soft == resource.RLIM_INFINITY else min(MAX_CACHED_DIRS, soft // 8)
        self._max_cached = max_cached
        self._lock = threading.Lock()
        self._cached: dict[tuple, int] = {}

    def _cached_dir(self, path: tuple, parent: int, name: str, create: bool) -> tuple[int, bool]:
        """``(fd of the directory name in parent, whether the caller closes it)``, checked by
        ``open_subdir``; ``path`` (``(uid,)`` or ``(uid, xx)``) names it in the cache."""
        with self._lock:
            fd = self._cached.get(path)
        if fd is not None:
            return fd, False
        fd = open_subdir(parent, name, create, os.path.join(self.directory, *map(str, path)))
        with self._lock:
            have = self._cached.get(path)
            if have is None and len(self._cached) < self._max_cached:
                self._cached[path] = fd
                return fd, False
        if have is not None:
            os.close(fd)
            return have, False
        return fd, True

    def xx(self, uid: int, h: str, create: bool) -> tuple[int, bool]:
        """``(fd of DIR/<uid>/<xx>, whether the caller closes it)``, from the cache."""
        ufd, own_u = self._cached_dir((uid,), self.fd, str(uid), create)
        try:
            return self._cached_dir((uid, h[0:2]), ufd, h[0:2], create)
        finally:
            if own_u:
                os.close(ufd)

    def leaf(self, uid: int, h: str, create: bool) -> int:
        """An fd (the caller's to close) of the chunk's directory ``DIR/<uid>/<xx>/<yy>``,
        reached from DIR's fd without following anything; raises OSError (``Unsafe``)."""
        xfd, own_x = self.xx(uid, h, create)
        try:
            yy = h[2:4] or "00"
            return open_subdir(xfd, yy, create, os.path.join(self.directory, str(uid), h[0:2], yy))
        finally:
            if own_x:
                os.close(xfd)

    def close(self) -> None:
        """Close every cached fd and DIR's (once: no operation may be in flight)."""
        with self._lock:
            fds, self._cached = list(self._cached.values()), {}
        for fd in fds + [self.fd]:
            os.close(fd)


def unlink(name: str, dir_fd: Optional[int]) -> int:
    """Remove ``name`` in the directory ``dir_fd`` (none: nothing); 1 if it was removed."""
    if dir_fd is None:
        return 0
    try:
        os.unlink(name, dir_fd=dir_fd)
        return 1
    except OSError:
        return 0
