"""The local-disk tier (``--disk DIR --disk-capacity SIZE``): one file per chunk, checked on read.

Files: ``DIR/<uid>/<hex[0:2]>/<hex[2:4]>/<hex>``, ``hex`` being the chunk key in hex. Each file is
a 4096-byte header, then the payload (the pool object's bytes) at offset 4096. The header
(``_HEAD``, little-endian): magic ``LMSHMKV\\0``, format version, checksum algorithm, uid, blocks
per chunk, payload length, the key, the layout digest, the payload's checksum, and a CRC-32 of
all of that. A read checks every field against what the index and the request expect, then the
payload's checksum; any mismatch is a miss, and the file is deleted.

Writes go to ``.tmp-<pid>-<random>`` in the final directory, then ``rename`` over the final
name: a reader sees the old file or the whole new one, never a part. Nothing is fsynced: after
a power loss a renamed file may hold zeros, which its checksum turns into a miss.

The index (key -> size, layout, readers) lives in memory under one lock, in LRU order; it is
rebuilt at start by reading every file's header, oldest modification first, and stale temp
files are removed. ``used`` counts every file as its header plus its payload rounded up to 4 KiB
(and writes in progress, reserved before they start), and stays <= ``capacity``: a write that
would pass ``HIGH_WATERMARK`` of it first evicts least recently used files down to
``LOW_WATERMARK``, skipping files with a read in progress; a write that still does not fit is
dropped. One server per directory: ``DIR/.lock`` is held with ``flock`` while the tier is open,
so a second server on the same directory is refused at start (its index would not see the first
one's writes, and the two together could pass the capacity).

Writes use ``O_DIRECT`` where the chunk lies on whole pages (``direct_ok``): a server with a
disk tier aligns its pool objects to 4 KiB (``DiskTier.align``), and KV chunks are whole pages
long, so the file is written from the pool object itself, past the page cache, as ``dd
oflag=direct`` writes (a buffered write copies into the page cache first: 0.74x ``dd`` here,
against 0.97-1.0x direct; docs/benchmarks.md). Any other chunk, or a file system that refuses
``O_DIRECT`` (``EINVAL``: the tier then stays buffered), is written through the page cache.
Reads are buffered: the kernel's readahead made them as fast as ``O_DIRECT`` reads or faster,
without a bounce buffer. ``bench/disk_tier.py`` measures all of them against ``dd``.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import importlib.util
import logging
import mmap
import os
import secrets
import stat
import struct
import threading
import time
import zlib
from collections import OrderedDict
from typing import Callable, Optional, Sequence

import numpy as np

from lmshm.core.tiers.base import ChunkMeta, SeenOnce, Tier

logger = logging.getLogger("lmshm.tiers.disk")

MAGIC = b"LMSHMKV\0"
VERSION = 1
HEADER_BYTES = 4096
PAGE = 4096
HIGH_WATERMARK = 0.95
LOW_WATERMARK = 0.90
ADMIT = ("first", "second")     # --disk-admit: write a chunk on its first store, or its second
ADMIT_REMEMBER = 1 << 20        # --disk-admit second: chunks stored once that are remembered (SeenOnce)
MAX_KEY = 64
MAX_LAYOUT = 64
#: magic, version, checksum algorithm, uid, blocks, payload length, key length, layout length,
#: key, layout digest, checksum; followed by a CRC-32 of these bytes.
_HEAD = struct.Struct("<8sHBxIIQBBxx64s64s32s")
_CRC = struct.Struct("<I")


def _xxh3(data: memoryview) -> bytes:
    import xxhash

    return xxhash.xxh3_128_digest(data)


def _blake2b(data: memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


def _crc32(data: memoryview) -> bytes:
    return _CRC.pack(zlib.crc32(data))


#: checksum algorithms by their number in the header; a reader checks with whichever one the file
#: names, so files written under one ``--disk-checksum`` stay readable under another.
CHECKSUMS: dict[int, tuple[str, Callable[[memoryview], bytes]]] = {1: ("blake2b", _blake2b), 2: ("xxh3", _xxh3),
                                                                    3: ("crc32", _crc32)}
_BY_NAME = {name: number for number, (name, _) in CHECKSUMS.items()}


def checksum_algorithm(name: str) -> int:
    """``"auto"`` -> xxh3-128 if the ``xxhash`` package is installed, else CRC-32 (zlib): the
    fastest here (docs/benchmarks.md); ``"blake2b"``, ``"xxh3"`` or ``"crc32"`` by name."""
    have_xxhash = importlib.util.find_spec("xxhash") is not None
    if name == "auto":
        return _BY_NAME["xxh3" if have_xxhash else "crc32"]
    if name not in _BY_NAME:
        raise ValueError(f"unknown disk checksum {name!r}: use auto, xxh3, blake2b or crc32")
    if name == "xxh3" and not have_xxhash:
        raise ValueError("--disk-checksum xxh3 needs the xxhash package (pip install xxhash; lmshm depends on it)")
    return _BY_NAME[name]


def file_bytes(nbytes: int) -> int:
    """What a chunk of ``nbytes`` costs on disk: the header and the payload in whole pages."""
    return HEADER_BYTES + -(-nbytes // PAGE) * PAGE


def encode_header(uid: int, key: bytes, meta: ChunkMeta, algorithm: int, payload: memoryview) -> bytes:
    digest = CHECKSUMS[algorithm][1](payload)
    head = _HEAD.pack(MAGIC, VERSION, algorithm, uid, meta.blocks, meta.nbytes, len(key), len(meta.layout),
                      key, meta.layout, digest)
    return (head + _CRC.pack(zlib.crc32(head))).ljust(HEADER_BYTES, b"\0")


class BadFile(Exception):
    """A chunk file that is not what its name says, or is damaged."""


def decode_header(raw: bytes) -> tuple[int, bytes, ChunkMeta, int, bytes]:
    """``(uid, key, meta, algorithm, checksum)`` of a header; ``BadFile`` if it is not one."""
    if len(raw) < _HEAD.size + _CRC.size:
        raise BadFile("short header")
    head = raw[:_HEAD.size]
    if _CRC.unpack_from(raw, _HEAD.size)[0] != zlib.crc32(head):
        raise BadFile("header checksum mismatch")
    magic, version, algo, uid, blocks, nbytes, klen, llen, key, layout, digest = _HEAD.unpack(head)
    if magic != MAGIC or version != VERSION:
        raise BadFile(f"not an lmshm chunk file of version {VERSION}")
    if algo not in CHECKSUMS or not 0 < klen <= MAX_KEY or llen > MAX_LAYOUT:
        raise BadFile("header fields out of range")
    return uid, key[:klen], ChunkMeta(nbytes, layout[:llen], blocks), algo, digest


def direct_ok(payload: memoryview) -> bool:
    """Whether ``payload`` can be written with ``O_DIRECT`` as it lies: its address and length
    whole pages (what every Linux file system's direct I/O accepts)."""
    n = payload.nbytes
    return n > 0 and n % PAGE == 0 and np.frombuffer(payload, dtype=np.uint8).ctypes.data % PAGE == 0


_aligned = threading.local()


def _header_page(header: bytes) -> memoryview:
    """``header`` (``HEADER_BYTES``) in this thread's page-aligned buffer, for a direct write."""
    page = getattr(_aligned, "page", None)
    if page is None:
        page = _aligned.page = mmap.mmap(-1, HEADER_BYTES)      # anonymous mappings are page-aligned
    page[:] = header
    return memoryview(page)


def write_file(path: str, uid: int, key: bytes, meta: ChunkMeta, algorithm: int, payload: memoryview,
               direct: bool = False) -> None:
    """Write a chunk file at ``path`` through a unique temp file and ``rename`` (raises OSError).
    ``direct``: with ``O_DIRECT``, from ``payload`` where it lies (``direct_ok`` must hold); an
    ``EINVAL`` from the file system (no direct I/O there) raises."""
    directory = os.path.dirname(path)
    tmp = os.path.join(directory, f".tmp-{os.getpid()}-{secrets.token_hex(8)}")
    header = encode_header(uid, key, meta, algorithm, payload)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_DIRECT if direct else 0)
    fd = os.open(tmp, flags, 0o600)
    try:
        try:
            pieces = [_header_page(header) if direct else memoryview(header), payload]
            offset, total = 0, HEADER_BYTES + len(payload)
            while offset < total:
                n = os.pwritev(fd, pieces, offset)
                if n <= 0:
                    raise OSError(errno.EIO, "short write")
                offset += n
                pieces = _advance(pieces, n)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _advance(pieces: list[memoryview], n: int) -> list[memoryview]:
    out = []
    for p in pieces:
        if n >= len(p):
            n -= len(p)
            continue
        out.append(p[n:])
        n = 0
    return out


def read_file(path: str, uid: int, key: bytes, meta: Optional[ChunkMeta], dest: memoryview) -> None:
    """Fill ``dest`` with the payload of the chunk file at ``path`` after checking that it is the
    chunk ``(uid, key)`` of ``meta`` (any, if None) and of ``len(dest)`` bytes; ``BadFile`` if it
    is not, or is damaged; OSError if it cannot be read."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)   # a FIFO must not block
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BadFile("not a regular file")
        raw = os.pread(fd, HEADER_BYTES, 0)
        fuid, fkey, fmeta, algo, digest = decode_header(raw)
        if fuid != uid or fkey != key or (meta is not None and fmeta != meta) or fmeta.nbytes != len(dest):
            raise BadFile("the header names another chunk")
        if os.fstat(fd).st_size != HEADER_BYTES + fmeta.nbytes:
            raise BadFile("the file's length does not match its header")
        done = 0
        while done < len(dest):
            n = os.preadv(fd, [dest[done:]], HEADER_BYTES + done)
            if n <= 0:
                raise BadFile("the file ended early")
            done += n
    finally:
        os.close(fd)
    try:
        mine = CHECKSUMS[algo][1](dest)
    except ImportError:
        raise BadFile(f"written with the {CHECKSUMS[algo][0]} checksum, which needs the xxhash package") from None
    if mine.ljust(32, b"\0") != digest:
        raise BadFile("payload checksum mismatch")


class _Entry:
    __slots__ = ("size", "meta", "readers")

    def __init__(self, size: int, meta: ChunkMeta) -> None:
        self.size, self.meta, self.readers = size, meta, 0


class DiskTier(Tier):
    """See the module docstring."""

    name = "disk"
    align = PAGE        # the pool starts objects on pages, so chunks are written with O_DIRECT

    def __init__(self, directory: str, capacity: int, *, checksum: str = "auto", admit: str = "first") -> None:
        super().__init__()
        if admit not in ADMIT:
            raise ValueError(f"--disk-admit {admit!r}: use one of {', '.join(ADMIT)}")
        #: --disk-admit second: the chunks stored once lately, whose next store is written
        self._stored_once = SeenOnce(ADMIT_REMEMBER) if admit == "second" else None
        if capacity < file_bytes(1):
            raise ValueError(f"--disk-capacity {capacity} is too small: a chunk file takes at least "
                             f"{file_bytes(1)} bytes")
        self.directory = os.path.abspath(directory)
        self.capacity = capacity
        self.algorithm = checksum_algorithm(checksum)
        self._lock = threading.Lock()
        self._index: OrderedDict[tuple[int, bytes], _Entry] = OrderedDict()   # least recently used first
        self._writing: set[tuple[int, bytes]] = set()
        self.used = 0
        self.direct = True          # O_DIRECT writes where the chunk allows (direct_ok); off if refused
        self._lockfd = self._open_directory()
        self._closed = False
        try:
            self._scan()
        except BaseException:
            os.close(self._lockfd)
            raise

    # ---- the directory ----------------------------------------------------------------
    def _open_directory(self) -> int:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        st = os.stat(self.directory, follow_symlinks=False)
        if not os.path.isdir(self.directory) or os.path.islink(self.directory):
            raise OSError(errno.ENOTDIR, f"--disk {self.directory} is not a directory")
        if st.st_uid != os.geteuid():
            raise PermissionError(errno.EPERM, f"--disk {self.directory} belongs to uid {st.st_uid}, not to this "
                                               f"server's uid {os.geteuid()}; give the server a directory of its own")
        if st.st_mode & 0o022:
            raise PermissionError(errno.EPERM, f"--disk {self.directory} is writable by others (mode "
                                               f"{st.st_mode & 0o777:o}); chmod go-w it: another user could plant "
                                               "chunk files")
        fd = os.open(os.path.join(self.directory, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OSError(errno.EBUSY, f"--disk {self.directory} is in use by another lmshm-server (it holds "
                                       f"{self.directory}/.lock); give each server its own directory") from None
        return fd

    def path_of(self, uid: int, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self.directory, str(uid), h[0:2], h[2:4] or "00", h)

    def _scan(self) -> None:
        """Rebuild the index from the files' headers, oldest first; remove temp and bad files."""
        found: list[tuple[float, tuple[int, bytes], _Entry]] = []
        removed = bad = 0
        for uid_name in os.listdir(self.directory):
            top = os.path.join(self.directory, uid_name)
            if not uid_name.isdigit() or not os.path.isdir(top) or os.path.islink(top):
                continue
            for root, dirs, files in os.walk(top):
                dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]
                for name in files:
                    path = os.path.join(root, name)
                    if name.startswith(".tmp-"):
                        removed += _unlink(path)
                        continue
                    try:
                        key = bytes.fromhex(name)
                        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
                        try:
                            st = os.fstat(fd)
                            if not stat.S_ISREG(st.st_mode):
                                raise BadFile("not a regular file")
                            uid, fkey, meta, _, _ = decode_header(os.pread(fd, HEADER_BYTES, 0))
                        finally:
                            os.close(fd)
                        if (uid != int(uid_name) or fkey != key or path != self.path_of(uid, key)
                                or st.st_size != HEADER_BYTES + meta.nbytes):
                            raise BadFile("misplaced or truncated")
                    except (ValueError, BadFile, OSError):
                        bad += _unlink(path)
                        continue
                    found.append((st.st_mtime, (uid, key), _Entry(file_bytes(meta.nbytes), meta)))
        found.sort(key=lambda x: x[0])
        for _, k, entry in found:
            self._index[k] = entry
            self.used += entry.size
        victims = self._make_room(0) if self.used > self.capacity else []
        for path in victims:
            _unlink(path)
        self.stats.add(corrupt=bad)
        logger.info("lmshm: disk tier %s: %d chunk(s), %d of %d bytes%s", self.directory, len(self._index), self.used,
                    self.capacity, f"; removed {removed} temp and {bad} bad file(s)" if removed or bad else "")

    # ---- the index (under the lock) ---------------------------------------------------
    def _make_room(self, size: int) -> list[str]:
        """Evict least recently used idle files until ``size`` more fits under the low
        watermark (called when it would pass the high one); returns the paths to unlink."""
        chosen: list[tuple[int, bytes]] = []
        freed = 0
        goal = min(self.capacity * LOW_WATERMARK, self.capacity - size)
        for k, entry in self._index.items():         # from the least recently used; stops when enough
            if self.used - freed + size <= goal:
                break
            if entry.readers:
                continue                     # a file with a read in progress is never evicted
            chosen.append(k)
            freed += entry.size
        for k in chosen:
            del self._index[k]
        self.used -= freed
        self.stats.add(evictions=len(chosen))
        return [self.path_of(*k) for k in chosen]

    def contains(self, uid: int, keys: Sequence[bytes]) -> int:
        with self._lock:
            for i, key in enumerate(keys):
                if (uid, key) not in self._index:
                    return i
            return len(keys)

    def head(self, uid: int, key: bytes) -> Optional[ChunkMeta]:
        with self._lock:
            entry = self._index.get((uid, key))
            if entry is None:
                return None
            self._index.move_to_end((uid, key))
            return entry.meta

    def usage(self) -> tuple[int, int, int]:
        with self._lock:
            return self.capacity, self.used, len(self._index)

    # ---- reads and writes ---------------------------------------------------------------
    def admit(self, uid: int, key: bytes) -> bool:
        if self._stored_once is None or self._stored_once.check_and_add(b"%d:" % uid + key):
            return True
        self.stats.add(not_admitted=1)
        return False

    def get_into(self, uid: int, key: bytes, meta: ChunkMeta, dest: memoryview,
                 framed: Optional[memoryview] = None) -> bool:
        k = (uid, key)
        with self._lock:
            entry = self._index.get(k)
            if entry is None or entry.meta != meta or len(dest) != meta.nbytes:
                return False
            entry.readers += 1
            self._index.move_to_end(k)
        path = self.path_of(uid, key)
        started = time.monotonic()
        try:
            read_file(path, uid, key, meta, dest)
        except BadFile as exc:
            logger.warning("lmshm: disk tier: %s is damaged (%s); deleted it, a miss", path, exc)
            self._forget(k, entry, delete=True)
            self.stats.add(corrupt=1)
            return False
        except OSError as exc:
            gone = exc.errno == errno.ENOENT
            if not gone:
                _warn_rate_limited(f"lmshm: disk tier: cannot read {path} ({exc}); deleted it, a miss")
            self._forget(k, entry, delete=not gone)   # a file left but not counted could pass the capacity
            self.stats.add(errors=0 if gone else 1)
            return False
        finally:
            with self._lock:
                entry.readers -= 1
        self.stats.timed_read(time.monotonic() - started, meta.nbytes)
        return True

    def _forget(self, k: tuple[int, bytes], entry: _Entry, *, delete: bool) -> None:
        with self._lock:
            if self._index.get(k) is entry:
                del self._index[k]
                self.used -= entry.size
        if delete:
            _unlink(self.path_of(*k))

    def put(self, uid: int, key: bytes, meta: ChunkMeta, data: memoryview,
            framed: Optional[memoryview] = None) -> bool:
        k = (uid, key)
        size = file_bytes(meta.nbytes)
        with self._lock:
            if self._closed or k in self._index or k in self._writing:
                return False                  # held already (or being written): not a drop
            victims = self._make_room(size) if self.used + size > self.capacity * HIGH_WATERMARK else []
            fits = self.used + size <= self.capacity
            if fits:
                self.used += size             # reserved before the write, so writes never overrun
                self._writing.add(k)
        for path in victims:
            _unlink(path)
        if not fits:
            self.stats.add(drops=1)
            return False
        path = self.path_of(uid, key)
        started = time.monotonic()
        try:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            direct = self.direct and direct_ok(data)
            try:
                write_file(path, uid, key, meta, self.algorithm, data, direct=direct)
            except OSError as exc:
                if not direct or exc.errno != errno.EINVAL:
                    raise
                self.direct = False         # this file system has no direct I/O: buffered from now on
                logger.info("lmshm: disk tier: %s refuses O_DIRECT (%s); writing through the page cache",
                            self.directory, exc)
                write_file(path, uid, key, meta, self.algorithm, data)
            self.stats.add(**({"direct_writes": 1} if direct and self.direct else {}))
        except OSError as exc:
            with self._lock:
                self._writing.discard(k)
                self.used -= size
            self.stats.add(drops=1, errors=0 if exc.errno in (errno.ENOSPC, errno.EDQUOT) else 1)
            _warn_rate_limited(f"lmshm: disk tier: a write to {self.directory} failed ({exc}); the chunk stays "
                               "in the pool only")
            return False
        with self._lock:
            self._writing.discard(k)
            self._index[k] = _Entry(size, meta)
        self.stats.add(puts=1)
        self.stats.timed_write(time.monotonic() - started, meta.nbytes)
        return True

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        os.close(self._lockfd)


def _unlink(path: str) -> int:
    try:
        os.unlink(path)
        return 1
    except OSError:
        return 0


_last_warning = [0.0]


def _warn_rate_limited(message: str, every_s: float = 10.0) -> None:
    now = time.monotonic()
    if now - _last_warning[0] >= every_s:
        _last_warning[0] = now
        logger.warning(message)
