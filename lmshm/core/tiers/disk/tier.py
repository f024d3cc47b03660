"""The local-disk tier (``--disk DIR --disk-capacity SIZE``): one file per chunk, an index in memory.

Files are ``DIR/<uid>/<hex[0:2]>/<hex[2:4]>/<hex>`` (``hex``: the chunk key), in the format of
``format.py``, reached only through the checked directory fds of ``dirs.py``. This module owns
what is where: the index (uid -> key -> size, layout, readers; each uid in LRU order, under one
lock), the capacity (``used`` <= ``capacity``, evicting from ``HIGH_WATERMARK`` down to
``LOW_WATERMARK``, fairly across uids, never a file being read), and the index rebuild at start
(the ``lmshm-disk-scan`` thread; a key asked for before the scan reaches it is probed on its own).
A read that fails any check is a miss, and its file is deleted. docs/design/tiers.md tells the
whole design and its measurements.

The one trap: the fds of ``DIR/<uid>`` and ``DIR/<uid>/<xx>`` are cached, and a cached fd closed
while another thread still uses it lets the kernel hand its number to an unrelated open; so a
cached fd is never evicted, and all are closed only once the tier is closed and no operation is
in flight (``_busy``).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
import threading
import time
from collections import OrderedDict
from typing import Callable, Optional, Sequence

import msgspec

from lmshm.core.logs import Throttle
from lmshm.core.tiers.base import ChunkMeta, SeenOnce, Tier
from lmshm.core.tiers.disk.dirs import (
    DIR_FLAGS,
    ChunkDirs,
    Unsafe,
    load_key,
    lock_directory,
    open_checked_directory,
    open_subdir,
    unlink,
)
from lmshm.core.tiers.disk.format import (
    HEADER_BYTES,
    PAGE,
    READ_FLAGS,
    SIGNED_HEAD_BYTES,
    BadFile,
    decode_header,
    direct_ok,
    file_bytes,
    read_file,
    write_file,
)
from lmshm.core.tiers.integrity import checksum_algorithm
from lmshm.platform import openat2
from lmshm.wire.protocol import TierInfo

logger = logging.getLogger("lmshm.tiers.disk")

HIGH_WATERMARK = 0.95
LOW_WATERMARK = 0.90
ADMIT = ("first", "second")     # --disk-admit: write a chunk on its first store, or its second
ADMIT_REMEMBER = 1 << 20        # --disk-admit second: chunks stored once that are remembered (SeenOnce)
SCAN_WAIT_S = 0.25              # DiskTier() waits this long for the scan (a small index is whole at once)


class _Entry:
    __slots__ = ("size", "meta", "readers")

    def __init__(self, size: int, meta: ChunkMeta) -> None:
        self.size, self.meta, self.readers = size, meta, 0


class DiskTier(Tier):
    """See the module docstring."""

    name = "disk"
    align = PAGE        # the pool starts objects on pages, so chunks are written with O_DIRECT

    def __init__(self, directory: str, capacity: int, *, checksum: str = "auto", admit: str = "first",
                 scan_wait_s: float = SCAN_WAIT_S) -> None:
        """Opens (and checks) the directory, then rebuilds the index on a background thread;
        returns when the scan is done or after ``scan_wait_s``, whichever comes first."""
        super().__init__()
        if admit not in ADMIT:
            raise ValueError(f"--disk-admit {admit!r}: use one of {', '.join(ADMIT)}")
        #: --disk-admit second: the chunks stored once lately, whose next store is written
        self._stored_once = SeenOnce(ADMIT_REMEMBER) if admit == "second" else None
        if capacity < file_bytes(1):
            raise ValueError(f"--disk-capacity {capacity} is too small: a chunk file takes at least "
                             f"{file_bytes(1)} bytes")
        self.directory = os.path.realpath(directory)
        self.capacity = capacity
        self.algorithm = checksum_algorithm(checksum)
        self._lock = threading.Lock()
        #: uid -> key -> entry, each uid least recently used first; bytes indexed per uid
        self._index: dict[int, OrderedDict[bytes, _Entry]] = {}
        self._uid_bytes: dict[int, int] = {}
        self._objects = 0
        self._writing: set[tuple[int, bytes]] = set()
        self._put_while_scanning: set[tuple[int, bytes]] = set()   # the scan leaves these keys to put
        self.used = 0
        self.direct = True          # O_DIRECT writes where the chunk allows (direct_ok); off if refused
        self.direct_reads = True    # O_DIRECT reads into the pool object where it allows (direct_ok); off if refused
        # a chunk file opened by one openat2 below DIR/<uid>/<xx> (None: not available here)
        self._open_below = openat2.opener(READ_FLAGS)
        self._open_below_direct = openat2.opener(READ_FLAGS | os.O_DIRECT) if self._open_below else None
        self._busy = 0              # operations (and the scan) using the directory fds
        self._closed = False
        self._fds_open = True
        self._tmp_prefix = f".tmp-{os.getpid()}-{secrets.token_hex(4)}-"   # the scan spares ours only
        self.scanned = 0            # files the scan has looked at
        self.probed = 0             # files a LOOKUP found before the scan reached them (``_probe``)
        self._scan_done = threading.Event()
        # one throttle per kind of warning, so that one kind never hides another
        self._warn_read = Throttle(logger)      # a chunk file that cannot be read
        self._warn_write = Throttle(logger)     # a write that failed
        self._warn_unsafe = Throttle(logger)    # a directory the scan will not enter
        dir_fd = open_checked_directory(self.directory)
        try:
            self._lockfd = lock_directory(dir_fd, self.directory)
            try:
                self._mac_key = load_key(dir_fd, self.directory)
            except BaseException:
                os.close(self._lockfd)
                raise
        except BaseException:
            os.close(dir_fd)
            raise
        #: DIR's fd and the cached fds of DIR/<uid> and DIR/<uid>/<xx>: open until closed and idle
        self._dirs = ChunkDirs(self.directory, dir_fd)
        self._busy = 1
        self._scan_thread = threading.Thread(target=self._scan, name="lmshm-disk-scan", daemon=True)
        self._scan_thread.start()
        self._scan_done.wait(scan_wait_s)

    # ---- the directory ----------------------------------------------------------------
    def path_of(self, uid: int, key: bytes) -> str:
        """Where the chunk's file is (for messages and tests: the tier itself opens it from fds)."""
        h = key.hex()
        return os.path.join(self.directory, str(uid), h[0:2], h[2:4] or "00", h)

    def _leave(self) -> None:
        """An operation that used the directory fds is done (the last one after close: closes them)."""
        with self._lock:
            self._busy -= 1
            last = self._closed and self._busy == 0
        if last:
            self._release_fds()

    def _release_fds(self) -> None:
        with self._lock:
            if not self._fds_open:
                return
            self._fds_open = False
        self._dirs.close()
        os.close(self._lockfd)      # the lock last

    def _unlink_chunks(self, victims: list[tuple[int, bytes]]) -> None:
        for uid, key in victims:
            h = key.hex()
            try:
                leaf = self._dirs.leaf(uid, h, False)
            except OSError:
                continue
            try:
                unlink(h, leaf)
            finally:
                os.close(leaf)

    # ---- the scan (a background thread from start) --------------------------------------
    def _scan(self) -> None:
        """Index the files' headers while the tier serves; remove temp files of earlier runs and
        bad files (format 1 included). Stops at the next file once the tier is closed."""
        started = time.monotonic()
        self._removed = self._bad = 0
        try:
            top = os.open(".", DIR_FLAGS, dir_fd=self._dirs.fd)
            try:
                for uid_name, ufd in self._subdirs(top, self.directory, lambda n: n.isdigit() and str(int(n)) == n):
                    for xx, xfd in self._subdirs(ufd, os.path.join(self.directory, uid_name)):
                        for yy, yfd in self._subdirs(xfd, os.path.join(self.directory, uid_name, xx)):
                            with os.scandir(yfd) as it:
                                names = [e.name for e in it if not e.is_dir(follow_symlinks=False)]
                            for name in names:
                                if self._closed:
                                    return
                                self._scan_file(int(uid_name), xx, yy, yfd, name)
                                self.scanned += 1
            finally:
                os.close(top)
        except Exception:                      # never fatal: what was not indexed is a miss
            logger.exception("lmshm: disk tier: the index rebuild of %s stopped", self.directory)
        finally:
            with self._lock:
                self._scan_done.set()
                self._put_while_scanning.clear()
                closed = self._closed
                chunks, used = self._objects, self.used
            if not closed:
                logger.info("lmshm: disk tier %s: %d chunk(s), %d of %d bytes, index rebuilt from %d file(s) in "
                            "%.1f s%s", self.directory, chunks, used, self.capacity, self.scanned,
                            time.monotonic() - started, f"; removed {self._removed} temp and {self._bad} bad "
                            "file(s)" if self._removed or self._bad else "")
            self._leave()

    def _subdirs(self, parent: int, where: str, wanted: Callable[[str], bool] = lambda n: True):
        """``(name, fd)`` of each directory in ``parent`` (an fd), its fd closed when the loop
        moves on; links and directories that are not ours are skipped (logged)."""
        with os.scandir(parent) as it:
            names = [e.name for e in it if e.is_dir(follow_symlinks=False) and wanted(e.name)]
        for name in names:
            if self._closed:
                return
            try:
                fd = open_subdir(parent, name, False, os.path.join(where, name))
            except Unsafe as exc:
                self._warn_unsafe.warning("lmshm: disk tier: %s; its files are not used", exc.strerror)
                continue
            except OSError:
                continue
            try:
                yield name, fd
            finally:
                os.close(fd)

    def _known(self, uid: int, key: bytes) -> bool:
        """Whether the index has, or a put since start is writing or wrote, ``(uid, key)``: the
        scan must then leave its file alone (under the lock)."""
        od = self._index.get(uid)
        return (od is not None and key in od) or (uid, key) in self._writing or (uid, key) in self._put_while_scanning

    def _scan_file(self, uid: int, xx: str, yy: str, leaf: int, name: str) -> None:
        if name.startswith(".tmp-"):
            if not name.startswith(self._tmp_prefix):      # an earlier run's: never renamed
                self._removed += unlink(name, leaf)
            return
        try:
            key = bytes.fromhex(name)
        except ValueError:
            key = None
        if key is None or key.hex() != name or name[0:2] != xx or (name[2:4] or "00") != yy:
            with self._lock:
                if unlink(name, leaf):        # misplaced: no key names it
                    self._bad += 1
                    self.stats.add(corrupt=1)
            return
        self._index_file(uid, key, leaf, recent=False)

    def _index_file(self, uid: int, key: bytes, leaf: int, recent: bool) -> Optional[_Entry]:
        """Check the header of the file of ``(uid, key)`` in ``leaf`` and index it (unless a put
        or the other of the scan and a probe did first): as the most recently used file if
        ``recent`` (a LOOKUP asked for it), else as older than anything since start. A bad file
        is removed (counted); a missing one is None. Returns the index's entry of the key."""
        name = key.hex()
        try:
            fd = os.open(name, READ_FLAGS, dir_fd=leaf)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise BadFile("not a regular file")
                fuid, fkey, meta, _, _ = decode_header(os.pread(fd, SIGNED_HEAD_BYTES, 0), self._mac_key)
            finally:
                os.close(fd)
            if fuid != uid or fkey != key or st.st_size != HEADER_BYTES + meta.nbytes:
                raise BadFile("misplaced or truncated")
        except (BadFile, OSError):
            with self._lock:                   # a put may have written the key meanwhile: its file stays
                if not self._known(uid, key):
                    if unlink(name, leaf):
                        self._bad += 1
                        self.stats.add(corrupt=1)
            return None
        entry = _Entry(file_bytes(meta.nbytes), meta)
        with self._lock:
            if self._closed:
                return None
            if self._known(uid, key):
                od = self._index.get(uid)
                return None if od is None else od.get(key)
            od = self._index.setdefault(uid, OrderedDict())
            od[key] = entry
            if not recent:
                od.move_to_end(key, last=False)    # older than anything written or read since start
            self._count(uid, entry.size)
            victims = self._make_room(0) if self.used > self.capacity * HIGH_WATERMARK else []
            if od.get(key) is not entry:
                entry = None                   # evicted at once to make room
            self.probed += recent
        self._unlink_chunks(victims)
        return entry

    def _probe(self, uid: int, key: bytes) -> Optional[_Entry]:
        """While the index rebuild runs: the file of ``(uid, key)``, if there is one the scan has
        not reached yet, checked and indexed now (a LOOKUP right after a restart must not miss
        what is on disk: the scan of many files takes seconds to minutes). None if there is none."""
        with self._lock:
            if self._closed:
                return None
            self._busy += 1
        try:
            h = key.hex()
            try:
                leaf = self._dirs.leaf(uid, h, False)
            except OSError:
                return None
            try:
                return self._index_file(uid, key, leaf, recent=True)
            finally:
                os.close(leaf)
        finally:
            self._leave()

    def wait_scan(self, timeout_s: Optional[float] = None) -> bool:
        """Wait until the index rebuild has ended; whether it has."""
        return self._scan_done.wait(timeout_s)

    # ---- the index (under the lock) ---------------------------------------------------
    def _count(self, uid: int, size: int) -> None:
        self.used += size
        self._uid_bytes[uid] = self._uid_bytes.get(uid, 0) + size
        self._objects += 1

    def _drop(self, uid: int, key: bytes) -> _Entry:
        od = self._index[uid]
        entry = od.pop(key)
        self.used -= entry.size
        self._objects -= 1
        self._uid_bytes[uid] -= entry.size
        if not od:
            del self._index[uid], self._uid_bytes[uid]
        self._gone(uid, key)
        return entry

    def _make_room(self, size: int) -> list[tuple[int, bytes]]:
        """Evict until ``size`` more fits under the low watermark (called when it would pass
        the high one), as the pool does: each time the least recently used idle file of the uid
        that holds the most bytes; returns the ``(uid, key)`` evicted, for the caller to unlink."""
        chosen: list[tuple[int, bytes]] = []
        goal = min(self.capacity * LOW_WATERMARK, self.capacity - size)
        busy: set[int] = set()                 # uids whose every file has a read in progress
        while self.used + size > goal:
            uid = max((u for u in self._uid_bytes if u not in busy), key=self._uid_bytes.__getitem__, default=None)
            if uid is None:
                break
            key = next((k for k, e in self._index[uid].items() if not e.readers), None)
            if key is None:
                busy.add(uid)                  # a file with a read in progress is never evicted
                continue
            self._drop(uid, key)
            chosen.append((uid, key))
        self.stats.add(evictions=len(chosen))
        return chosen

    def contains(self, uid: int, keys: Sequence[bytes]) -> int:
        i = 0
        while True:
            with self._lock:                   # the indexed run in one go; a probe only at its end
                od = self._index.get(uid)
                if od is not None:
                    while i < len(keys) and keys[i] in od:
                        i += 1
                if i == len(keys):
                    return i
                scanning = not self._scan_done.is_set()
            if not scanning or self._probe(uid, keys[i]) is None:
                return i
            i += 1

    def _lookup(self, uid: int, key: bytes, touch: bool) -> Optional[_Entry]:
        """The index's entry of ``(uid, key)`` (most recently used now if ``touch``); while the
        index rebuild runs, a key it lacks is probed on disk (``_probe``)."""
        with self._lock:
            od = self._index.get(uid)
            entry = None if od is None else od.get(key)
            if entry is not None:
                if touch:
                    od.move_to_end(key)
                return entry
            scanning = not self._scan_done.is_set()
        return self._probe(uid, key) if scanning else None

    def announce(self, uid: int, keys: Sequence[bytes]) -> None:
        with self._lock:
            od = self._index.get(uid)
            if od is not None and self.held is not None:
                for key in keys:
                    if key in od:
                        self._held(uid, key)

    def head(self, uid: int, key: bytes) -> Optional[ChunkMeta]:
        entry = self._lookup(uid, key, touch=True)
        return None if entry is None else entry.meta

    def usage(self) -> tuple[int, int, int]:
        with self._lock:
            return self.capacity, self.used, self._objects

    def held_by(self, uid: int) -> tuple[int, list[bytes]]:
        """``(bytes, keys least recently used first)`` the tier holds for ``uid``."""
        with self._lock:
            return self._uid_bytes.get(uid, 0), list(self._index.get(uid, ()))

    def info(self, queue_depth: int = 0, queue_limit: int = 0) -> TierInfo:
        return msgspec.structs.replace(super().info(queue_depth, queue_limit), scanned=self.scanned,
                                       scan_done=self._scan_done.is_set(), probed=self.probed)

    # ---- reads and writes ---------------------------------------------------------------
    def admit(self, uid: int, key: bytes) -> bool:
        if self._stored_once is None or self._stored_once.check_and_add(b"%d:" % uid + key):
            return True
        self.stats.add(not_admitted=1)
        return False

    def get_into(self, uid: int, key: bytes, meta: ChunkMeta, dest: memoryview,
                 framed: Optional[memoryview] = None) -> bool:
        with self._lock:
            od = self._index.get(uid)
            entry = None if od is None else od.get(key)
            if self._closed or entry is None or entry.meta != meta or len(dest) != meta.nbytes:
                return False
            entry.readers += 1
            od.move_to_end(key)
            self._busy += 1
        h = key.hex()
        started = time.monotonic()
        leaf = None
        try:
            direct = self.direct_reads and direct_ok(dest)
            fd = self._open_below_xx(uid, h, direct)
            if fd is not None:
                try:
                    read_file(h, uid, key, meta, dest, mac_key=self._mac_key, fd=fd, direct=direct)
                except OSError as exc:
                    if not direct or exc.errno != errno.EINVAL:
                        raise
                    fd = None               # O_DIRECT refused at the read: _read_in turns it off
            if fd is None:
                leaf = self._dirs.leaf(uid, h, False)
                self._read_in(leaf, h, uid, key, meta, dest, direct)
        except BadFile as exc:
            logger.warning("lmshm: disk tier: %s is damaged (%s); deleted it, a miss", self.path_of(uid, key), exc)
            self._forget(uid, key, entry)
            if leaf is None:
                try:
                    leaf = self._dirs.leaf(uid, h, False)
                except OSError:
                    pass
            if leaf is not None:
                unlink(h, leaf)
            self.stats.add(corrupt=1)
            return False
        except OSError as exc:
            gone = exc.errno == errno.ENOENT and not isinstance(exc, Unsafe)
            if not gone:
                self._warn_read.warning("lmshm: disk tier: cannot read %s (%s); a miss", self.path_of(uid, key), exc)
            self._forget(uid, key, entry)
            if not gone and leaf is not None:
                unlink(h, leaf)              # a file left but not counted could pass the capacity
            self.stats.add(errors=0 if gone else 1)
            return False
        finally:
            if leaf is not None:
                os.close(leaf)
            with self._lock:
                entry.readers -= 1
            self._leave()
        self.stats.timed_read(time.monotonic() - started, meta.nbytes)
        return True

    def _open_below_xx(self, uid: int, h: str, direct: bool) -> Optional[int]:
        """The chunk file ``<yy>/<h>`` opened for reading below the cached fd of
        ``DIR/<uid>/<xx>`` by one ``openat2`` that follows no link (``platform.openat2``); None
        where that is not available or refused anything but a missing file (then the step by
        step path, ``_leaf``, says what is wrong, and checks and fixes the leaf directory)."""
        open_below = self._open_below_direct if direct else self._open_below
        if open_below is None:
            return None
        xfd, own_x = self._dirs.xx(uid, h, False)
        try:
            return open_below(xfd, f"{h[2:4] or '00'}/{h}")
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                raise
            return None
        finally:
            if own_x:
                os.close(xfd)

    def _read_in(self, leaf: int, h: str, uid: int, key: bytes, meta: ChunkMeta, dest: memoryview,
                 direct: bool) -> None:
        """``read_file`` of the chunk in the directory ``leaf``; a file system that refuses
        ``O_DIRECT`` turns direct reads off for good and is read through the page cache."""
        try:
            read_file(h, uid, key, meta, dest, mac_key=self._mac_key, dir_fd=leaf, direct=direct)
        except OSError as exc:
            if not direct or exc.errno != errno.EINVAL:
                raise
            self.direct_reads = False       # this file system has no direct I/O: buffered from now on
            logger.info("lmshm: disk tier: %s refuses O_DIRECT reads (%s); reading through the page cache",
                        self.directory, exc)
            read_file(h, uid, key, meta, dest, mac_key=self._mac_key, dir_fd=leaf)

    def _forget(self, uid: int, key: bytes, entry: _Entry) -> None:
        with self._lock:
            od = self._index.get(uid)
            if od is not None and od.get(key) is entry:
                self._drop(uid, key)

    def put(self, uid: int, key: bytes, meta: ChunkMeta, data: memoryview,
            framed: Optional[memoryview] = None) -> bool:
        k = (uid, key)
        size = file_bytes(meta.nbytes)
        with self._lock:
            od = self._index.get(uid)
            if self._closed or (od is not None and key in od) or k in self._writing:
                if od is not None and key in od and not self._closed:
                    self._held(uid, key)
                return False                  # held already (or being written): not a drop
            victims = self._make_room(size) if self.used + size > self.capacity * HIGH_WATERMARK else []
            fits = self.used + size <= self.capacity
            if fits:
                self.used += size             # reserved before the write, so writes never overrun
                self._writing.add(k)
                if not self._scan_done.is_set():
                    self._put_while_scanning.add(k)     # the scan leaves this key's file to us
            self._busy += 1
        h = key.hex()
        leaf = None
        try:
            self._unlink_chunks(victims)
            if not fits:
                self.stats.add(drops=1)
                return False
            started = time.monotonic()
            try:
                leaf = self._dirs.leaf(uid, h, True)
                direct = self.direct and direct_ok(data)
                try:
                    write_file(h, uid, key, meta, self.algorithm, data, direct=direct, mac_key=self._mac_key,
                               dir_fd=leaf, tmp_prefix=self._tmp_prefix)
                except OSError as exc:
                    if not direct or exc.errno != errno.EINVAL:
                        raise
                    self.direct = False         # this file system has no direct I/O: buffered from now on
                    logger.info("lmshm: disk tier: %s refuses O_DIRECT (%s); writing through the page cache",
                                self.directory, exc)
                    write_file(h, uid, key, meta, self.algorithm, data, mac_key=self._mac_key, dir_fd=leaf,
                               tmp_prefix=self._tmp_prefix)
                self.stats.add(**({"direct_writes": 1} if direct and self.direct else {}))
            except OSError as exc:
                if leaf is not None:
                    unlink(h, leaf)            # an older file of the key the scan has not counted
                with self._lock:
                    self._writing.discard(k)
                    self.used -= size
                self.stats.add(drops=1, errors=0 if exc.errno in (errno.ENOSPC, errno.EDQUOT) else 1)
                self._warn_write.warning("lmshm: disk tier: a write to %s failed (%s); the chunk stays in the "
                                         "pool only", self.path_of(uid, key), exc)
                return False
            with self._lock:
                self._writing.discard(k)
                self.used -= size
                self._index.setdefault(uid, OrderedDict())[key] = _Entry(size, meta)
                self._count(uid, size)
                self._held(uid, key)
        finally:
            if leaf is not None:
                os.close(leaf)
            self._leave()
        self.stats.add(puts=1)
        self.stats.timed_write(time.monotonic() - started, meta.nbytes)
        return True

    def close(self) -> None:
        """Stops the scan (at its next file) and, once no read or write is in flight, closes
        the directory fds and releases ``DIR/.lock``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle = self._busy == 0
        if threading.current_thread() is not self._scan_thread:
            self._scan_thread.join(timeout=5.0)
        if idle:
            self._release_fds()

