"""The local-disk tier (``--disk DIR --disk-capacity SIZE``): one file per chunk, checked on read.

Files: ``DIR/<uid>/<hex[0:2]>/<hex[2:4]>/<hex>``, ``hex`` being the chunk key in hex. Each file is
a 4096-byte header, then the payload (the pool object's bytes) at offset 4096. The header
(``_HEAD``, little-endian): magic ``LMSHMKV\\0``, format version (2), checksum algorithm, uid,
blocks per chunk, payload length, the key, the layout digest, the payload's checksum, then a
BLAKE2b-256 MAC of all of that under the deployment's key (``DIR/.key``: 32 random bytes, 0600,
made at the first start). A read checks the MAC and every field against what the index and the
request expect, then the payload's checksum; any mismatch is a miss, and the file is deleted.
Files of format 1 (a CRC-32, no MAC) are bad files: the scan removes them.

The path is trusted only as far as it is checked. At start every ancestor of DIR must belong to
root or this uid and be writable by no one else unless sticky (as sshd checks the path to its
keys), and DIR must be ours and not group/other-writable (it is narrowed to 0700). DIR is then
held open as a directory fd, and every path below it is resolved from that fd, one component
at a time, with ``O_NOFOLLOW|O_DIRECTORY``: a DIR renamed or replaced after start, or a symbolic
link planted below it, is never followed. The tier makes every directory 0700 exactly (``mkdir``,
then ``fchmod``: the umask neither widens nor narrows it); an existing one of another mode is
set to 0700 (logged), one that is not ours, not a directory or a link is a miss on read and a
drop on write (an error, logged with its path), never used. The fds of ``DIR/<uid>`` and
``DIR/<uid>/<xx>`` are cached (bounded, ``MAX_CACHED_DIRS``; a 4 KiB read took 28 us, 16 of them
opening three directories). The easy thing to get wrong: a cached fd closed while another
thread still uses it lets the kernel hand its number to an unrelated open; so a cached fd is
never evicted, and all are closed only once the tier is closed and no operation is in flight
(``_busy``).

Writes go to ``.tmp-<pid>-<instance>-<random>`` in the final directory, then ``rename`` over the
final name: a reader sees the old file or the whole new one, never a part. Nothing is fsynced:
after a power loss a renamed file may hold zeros, which its checksum turns into a miss.

The index (uid -> key -> size, layout, readers; each uid in LRU order) lives in memory under one
lock. It is rebuilt by a background thread (``lmshm-disk-scan``) that reads every file's header
while the tier already serves: a key asked for that the scan has not reached yet is probed on
its own (its file's header read and checked, then indexed: ``_probe``), so a LOOKUP right after
a restart finds what is on disk (it missed until the scan got there: seconds for thousands of
files, minutes for millions); files the scan finds count as older than anything written or read
since start, in the order found; stale temp files and bad files are removed. A put during the
scan marks its key, so the scan never counts a file twice nor leaves a rewritten one uncounted.
``used`` counts every indexed file as its header plus its payload rounded up to 4 KiB (and
writes in progress, reserved before they start), and stays <= ``capacity``: a write (or a file
the scan counts) that would pass ``HIGH_WATERMARK`` of it first evicts down to
``LOW_WATERMARK``, fairly as the pool does: the
least recently used file of the uid that holds the most bytes on disk, skipping files with a
read in progress; a write that still does not fit is dropped. Until the scan ends, the files it
has not reached are on disk but not yet in ``used``: the disk may hold that much more than the
capacity (at most what the last run left there). One server per directory: ``DIR/.lock`` is
held with ``flock`` while the tier is open, so a second server on the same directory is refused
at start (its index would not see the first one's writes, and the two together could pass the
capacity).

Writes use ``O_DIRECT`` where the chunk lies on whole pages (``direct_ok``): a server with a
disk tier aligns its pool objects to 4 KiB (``DiskTier.align``), and KV chunks are whole pages
long, so the file is written from the pool object itself, past the page cache, as ``dd
oflag=direct`` writes (a buffered write copies into the page cache first: 0.74x ``dd`` here,
against 0.97-1.0x direct; docs/benchmarks.md). Any other chunk, or a file system that refuses
``O_DIRECT`` (``EINVAL``: the tier then stays buffered), is written through the page cache.
Reads into such a pool object use ``O_DIRECT`` too (``direct_reads``): header and payload in
one ``preadv``, the payload straight into the reserved object, its checksum taken there; the
buffered read copied every byte once more out of the page cache, which made a promotion into
a warm pool half as fast (docs/benchmarks.md, "Promotion speed"). Nothing read counts before
the header and checksum are checked: the object is in flight until then, and aborted on a
mismatch. ``bench/disk_tier.py`` measures all of them against ``dd``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import hmac
import importlib.util
import logging
import mmap
import os
import resource
import secrets
import stat
import struct
import threading
import time
import zlib
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

import msgspec
import numpy as np

from lmshm.core.tiers.base import ChunkMeta, SeenOnce, Tier
from lmshm.platform import openat2
from lmshm.wire.protocol import TierInfo

logger = logging.getLogger("lmshm.tiers.disk")

MAGIC = b"LMSHMKV\0"
VERSION = 2                     # 2: a keyed MAC over the header (1: a CRC-32; removed at scan)
HEADER_BYTES = 4096
PAGE = 4096
HIGH_WATERMARK = 0.95
LOW_WATERMARK = 0.90
ADMIT = ("first", "second")     # --disk-admit: write a chunk on its first store, or its second
ADMIT_REMEMBER = 1 << 20        # --disk-admit second: chunks stored once that are remembered (SeenOnce)
MAX_KEY = 64
MAX_LAYOUT = 64
KEY_FILE = ".key"               # the deployment's MAC key, in DIR
KEY_BYTES = 32
LOCK_FILE = ".lock"
DIR_MODE = 0o700                # every directory the tier makes, exactly
SCAN_WAIT_S = 0.25              # DiskTier() waits this long for the scan (a small index is whole at once)
MAX_CACHED_DIRS = 4096          # DIR/<uid> and DIR/<uid>/<xx> fds held open (at most 1/8 of RLIMIT_NOFILE)
#: magic, version, checksum algorithm, uid, blocks, payload length, key length, layout length,
#: key, layout digest, checksum; followed by a keyed BLAKE2b-256 MAC of these bytes.
_HEAD = struct.Struct("<8sHBxIIQBBxx64s64s32s")
MAC_BYTES = 32
_MAC_PERSON = b"lmshm-disk-v2"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK     # a FIFO must not block


def _xxh3(data: memoryview) -> bytes:
    import xxhash

    return xxhash.xxh3_128_digest(data)


def _blake2b(data: memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


def _crc32(data: memoryview) -> bytes:
    return struct.pack("<I", zlib.crc32(data))


#: checksum algorithms by their number in the header; a reader checks with whichever one the file
#: names, so files written under one ``--disk-checksum`` stay readable under another.
CHECKSUMS: dict[int, tuple[str, Callable[[memoryview], bytes]]] = {1: ("blake2b", _blake2b), 2: ("xxh3", _xxh3),
                                                                    3: ("crc32", _crc32)}
_BY_NAME = {name: number for number, (name, _) in CHECKSUMS.items()}


def _xxh3_stream() -> tuple[Callable[[memoryview], Any], Callable[[], bytes]]:
    import xxhash

    return _hasher(xxhash.xxh3_128())


def _blake2b_stream() -> tuple[Callable[[memoryview], Any], Callable[[], bytes]]:
    return _hasher(hashlib.blake2b(digest_size=32))


def _hasher(h: Any) -> tuple[Callable[[memoryview], Any], Callable[[], bytes]]:
    return h.update, h.digest


def _crc32_stream() -> tuple[Callable[[memoryview], Any], Callable[[], bytes]]:
    crc = 0

    def update(data: memoryview) -> None:
        nonlocal crc
        crc = zlib.crc32(data, crc)
    return update, lambda: struct.pack("<I", crc)


#: each checksum of ``CHECKSUMS`` taken piece by piece: ``(update, digest)``, the same bytes
CHECKSUM_STREAMS: dict[int, Callable[[], tuple[Callable[[memoryview], Any], Callable[[], bytes]]]] = {
    1: _blake2b_stream, 2: _xxh3_stream, 3: _crc32_stream}


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


def _mac(mac_key: bytes, head: bytes) -> bytes:
    return hashlib.blake2b(head, digest_size=MAC_BYTES, key=mac_key, person=_MAC_PERSON).digest()


def encode_header(uid: int, key: bytes, meta: ChunkMeta, algorithm: int, payload: memoryview, *,
                  mac_key: bytes) -> bytes:
    digest = CHECKSUMS[algorithm][1](payload)
    head = _HEAD.pack(MAGIC, VERSION, algorithm, uid, meta.blocks, meta.nbytes, len(key), len(meta.layout),
                      key, meta.layout, digest)
    return (head + _mac(mac_key, head)).ljust(HEADER_BYTES, b"\0")


class BadFile(Exception):
    """A chunk file that is not what its name says, or is damaged, or not made with our key."""


class Unsafe(OSError):
    """A path below DIR that the tier will not use: a link, not a directory, or not ours."""


def decode_header(raw: bytes, mac_key: bytes) -> tuple[int, bytes, ChunkMeta, int, bytes]:
    """``(uid, key, meta, algorithm, checksum)`` of a header made under ``mac_key``; ``BadFile``
    if it is not one."""
    if len(raw) < _HEAD.size + MAC_BYTES:
        raise BadFile("short header")
    head = raw[:_HEAD.size]
    magic, version, algo, uid, blocks, nbytes, klen, llen, key, layout, digest = _HEAD.unpack(head)
    if magic != MAGIC or version != VERSION:
        raise BadFile(f"not an lmshm chunk file of version {VERSION}")
    if not hmac.compare_digest(raw[_HEAD.size:_HEAD.size + MAC_BYTES], _mac(mac_key, head)):
        raise BadFile("header MAC mismatch (damaged, or not written under this directory's key)")
    if algo not in CHECKSUMS or not 0 < klen <= MAX_KEY or llen > MAX_LAYOUT:
        raise BadFile("header fields out of range")
    return uid, key[:klen], ChunkMeta(nbytes, layout[:llen], blocks), algo, digest


def direct_ok(payload: memoryview) -> bool:
    """Whether ``payload`` can be written with ``O_DIRECT`` as it lies: its address and length
    whole pages (what every Linux file system's direct I/O accepts)."""
    n = payload.nbytes
    if n <= 0 or n % PAGE:
        return False
    # a writable view's address through ctypes: 0.2 us, against 1.8 through numpy (per chunk read)
    address = np.frombuffer(payload, dtype=np.uint8).ctypes.data if payload.readonly or not payload.c_contiguous \
        else ctypes.addressof(ctypes.c_char.from_buffer(payload))
    return address % PAGE == 0


_aligned = threading.local()


def _header_page(header: bytes) -> memoryview:
    """``header`` (``HEADER_BYTES``) in this thread's page-aligned buffer, for a direct write."""
    page = getattr(_aligned, "page", None)
    if page is None:
        page = _aligned.page = mmap.mmap(-1, HEADER_BYTES)      # anonymous mappings are page-aligned
    page[:] = header
    return memoryview(page)


def write_file(name: str, uid: int, key: bytes, meta: ChunkMeta, algorithm: int, payload: memoryview,
               direct: bool = False, *, mac_key: bytes, dir_fd: Optional[int] = None,
               tmp_prefix: Optional[str] = None) -> None:
    """Write a chunk file through a unique temp file and ``rename`` (raises OSError): ``name`` in
    the directory ``dir_fd``, or the path ``name`` if None. Nothing is followed: the temp file is
    made with ``O_EXCL|O_NOFOLLOW``. ``direct``: with ``O_DIRECT``, from ``payload`` where it lies
    (``direct_ok`` must hold); an ``EINVAL`` from the file system (no direct I/O there) raises."""
    base = f"{tmp_prefix or f'.tmp-{os.getpid()}-'}{secrets.token_hex(8)}"
    tmp = base if dir_fd is not None else os.path.join(os.path.dirname(name), base)
    header = encode_header(uid, key, meta, algorithm, payload, mac_key=mac_key)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_DIRECT if direct else 0)
    fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
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
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
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


def _read_page() -> memoryview:
    """This thread's page-aligned buffer for a header read with ``O_DIRECT``."""
    page = getattr(_aligned, "read_page", None)
    if page is None:
        page = _aligned.read_page = mmap.mmap(-1, HEADER_BYTES)
    return memoryview(page)


def read_file(name: str, uid: int, key: bytes, meta: Optional[ChunkMeta], dest: memoryview, *,
              mac_key: bytes, dir_fd: Optional[int] = None, direct: bool = False, fd: Optional[int] = None) -> None:
    """Fill ``dest`` with the payload of the chunk file ``name`` (in the directory ``dir_fd``, or
    a path if None; never through a link) after checking that it is the chunk ``(uid, key)`` of
    ``meta`` (any, if None), of ``len(dest)`` bytes, with a header made under ``mac_key``;
    ``BadFile`` if it is not, or is damaged; OSError if it cannot be read. ``direct``: with
    ``O_DIRECT``, straight into ``dest`` (``direct_ok`` must hold), the checksum then taken on
    ``dest`` where it lies; an ``EINVAL`` from the file system (no direct I/O there) raises.
    ``fd``: the file opened already (so, with ``O_DIRECT`` when ``direct``), closed here."""
    if fd is None:
        fd = os.open(name, _READ_FLAGS | (os.O_DIRECT if direct else 0), dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadFile("not a regular file")
        if st.st_uid != os.geteuid():
            raise BadFile(f"a file of uid {st.st_uid}, not of this server's")
        done = 0
        if direct:
            # header and payload in one read, the payload straight into dest: one I/O per chunk
            # (as readahead makes of a buffered read); nothing in dest counts until checked below
            page = _read_page()
            pieces = [page, dest] if st.st_size == HEADER_BYTES + len(dest) else [page]
            total, got = sum(len(p) for p in pieces), 0
            while got < total:
                n = os.preadv(fd, _advance(pieces, got), got)
                if n <= 0:
                    break
                got += n
            raw = bytes(page[:min(got, HEADER_BYTES)])
            done = max(0, got - HEADER_BYTES)
        else:
            raw = os.pread(fd, HEADER_BYTES, 0)
        fuid, fkey, fmeta, algo, digest = decode_header(raw, mac_key)
        if fuid != uid or fkey != key or (meta is not None and fmeta != meta) or fmeta.nbytes != len(dest):
            raise BadFile("the header names another chunk")
        if st.st_size != HEADER_BYTES + fmeta.nbytes:
            raise BadFile("the file's length does not match its header")
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


# ---- directories: checked at start, then reached from fds only ---------------------------

def _open_subdir(parent: int, name: str, create: bool, where: str) -> int:
    """An fd of the directory ``name`` in ``parent`` (``where``: its path, for messages), made
    0700 if ``create`` and missing. It must be a directory of ours (not a link): ``Unsafe`` if
    not. Any other mode is set to 0700 (so the umask never decides it)."""
    made = False
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        if not create:
            raise
        try:
            os.mkdir(name, DIR_MODE, dir_fd=parent)
            made = True
        except FileExistsError:
            pass
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
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
                _warn_rate_limited(f"lmshm: disk tier: {where} had mode {stat.S_IMODE(st.st_mode):o}; set it to "
                                   f"{DIR_MODE:o}")
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
    fd = os.open("/", _DIR_FLAGS)
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
                    nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    try:
                        os.mkdir(part, DIR_MODE, dir_fd=fd)
                        made = True
                    except FileExistsError:
                        pass
                    nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
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
        fd = os.open(KEY_FILE, _READ_FLAGS, dir_fd=dir_fd)
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
            _unlink(tmp, dir_fd)
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
        self._open_below = openat2.opener(_READ_FLAGS)
        self._open_below_direct = openat2.opener(_READ_FLAGS | os.O_DIRECT) if self._open_below else None
        self._dir_fds: dict[tuple, int] = {}    # DIR/<uid>, DIR/<uid>/<xx>: open until closed and idle
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self._max_cached = MAX_CACHED_DIRS if soft == resource.RLIM_INFINITY else min(MAX_CACHED_DIRS, soft // 8)
        self._busy = 0              # operations (and the scan) using the directory fds
        self._closed = False
        self._fds_open = True
        self._tmp_prefix = f".tmp-{os.getpid()}-{secrets.token_hex(4)}-"   # the scan spares ours only
        self.scanned = 0            # files the scan has looked at
        self.probed = 0             # files a LOOKUP found before the scan reached them (``_probe``)
        self._scan_done = threading.Event()
        self._dirfd = open_checked_directory(self.directory)
        try:
            self._lockfd = self._lock_directory()
            try:
                self._mac_key = load_key(self._dirfd, self.directory)
            except BaseException:
                os.close(self._lockfd)
                raise
        except BaseException:
            os.close(self._dirfd)
            raise
        self._busy = 1
        self._scan_thread = threading.Thread(target=self._scan, name="lmshm-disk-scan", daemon=True)
        self._scan_thread.start()
        self._scan_done.wait(scan_wait_s)

    # ---- the directory ----------------------------------------------------------------
    def _lock_directory(self) -> int:
        where = os.path.join(self.directory, LOCK_FILE)
        try:
            fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600,
                         dir_fd=self._dirfd)
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
            raise OSError(errno.EBUSY, f"--disk {self.directory} is in use by another lmshm-server (it holds "
                                       f"{where}); give each server its own directory") from None
        except BaseException:
            os.close(fd)
            raise
        return fd

    def path_of(self, uid: int, key: bytes) -> str:
        """Where the chunk's file is (for messages and tests: the tier itself opens it from fds)."""
        h = key.hex()
        return os.path.join(self.directory, str(uid), h[0:2], h[2:4] or "00", h)

    def _cached_dir(self, path: tuple, parent: int, name: str, create: bool) -> tuple[int, bool]:
        """``(fd of the directory name in parent, whether the caller closes it)``, checked by
        ``_open_subdir``; ``path`` (``(uid,)`` or ``(uid, xx)``) names it in the cache, which
        keeps the first ``_max_cached`` (closed only once the tier is closed and idle)."""
        with self._lock:
            fd = self._dir_fds.get(path)
        if fd is not None:
            return fd, False
        fd = _open_subdir(parent, name, create, os.path.join(self.directory, *map(str, path)))
        with self._lock:
            have = self._dir_fds.get(path)
            if have is None and len(self._dir_fds) < self._max_cached:
                self._dir_fds[path] = fd
                return fd, False
        if have is not None:
            os.close(fd)
            return have, False
        return fd, True

    def _xx_dir(self, uid: int, h: str, create: bool) -> tuple[int, bool]:
        """``(fd of DIR/<uid>/<xx>, whether the caller closes it)``, from the cache."""
        ufd, own_u = self._cached_dir((uid,), self._dirfd, str(uid), create)
        try:
            return self._cached_dir((uid, h[0:2]), ufd, h[0:2], create)
        finally:
            if own_u:
                os.close(ufd)

    def _leaf(self, uid: int, h: str, create: bool) -> int:
        """An fd (the caller's to close) of the chunk's directory ``DIR/<uid>/<xx>/<yy>``,
        reached from DIR's fd without following anything; raises OSError (``Unsafe``)."""
        xfd, own_x = self._xx_dir(uid, h, create)
        try:
            yy = h[2:4] or "00"
            return _open_subdir(xfd, yy, create, os.path.join(self.directory, str(uid), h[0:2], yy))
        finally:
            if own_x:
                os.close(xfd)

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
            fds, self._dir_fds = list(self._dir_fds.values()), {}
        for fd in fds + [self._dirfd, self._lockfd]:      # the lock last
            os.close(fd)

    def _unlink_chunks(self, victims: list[tuple[int, bytes]]) -> None:
        for uid, key in victims:
            h = key.hex()
            try:
                leaf = self._leaf(uid, h, False)
            except OSError:
                continue
            try:
                _unlink(h, leaf)
            finally:
                os.close(leaf)

    # ---- the scan (a background thread from start) --------------------------------------
    def _scan(self) -> None:
        """Index the files' headers while the tier serves; remove temp files of earlier runs and
        bad files (format 1 included). Stops at the next file once the tier is closed."""
        started = time.monotonic()
        self._removed = self._bad = 0
        try:
            top = os.open(".", _DIR_FLAGS, dir_fd=self._dirfd)
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
                fd = _open_subdir(parent, name, False, os.path.join(where, name))
            except Unsafe as exc:
                _warn_rate_limited(f"lmshm: disk tier: {exc.strerror}; its files are not used")
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
                self._removed += _unlink(name, leaf)
            return
        try:
            key = bytes.fromhex(name)
        except ValueError:
            key = None
        if key is None or key.hex() != name or name[0:2] != xx or (name[2:4] or "00") != yy:
            with self._lock:
                if _unlink(name, leaf):        # misplaced: no key names it
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
            fd = os.open(name, _READ_FLAGS, dir_fd=leaf)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise BadFile("not a regular file")
                fuid, fkey, meta, _, _ = decode_header(os.pread(fd, _HEAD.size + MAC_BYTES, 0), self._mac_key)
            finally:
                os.close(fd)
            if fuid != uid or fkey != key or st.st_size != HEADER_BYTES + meta.nbytes:
                raise BadFile("misplaced or truncated")
        except (BadFile, OSError):
            with self._lock:                   # a put may have written the key meanwhile: its file stays
                if not self._known(uid, key):
                    if _unlink(name, leaf):
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
                leaf = self._leaf(uid, h, False)
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
                leaf = self._leaf(uid, h, False)
                self._read_in(leaf, h, uid, key, meta, dest, direct)
        except BadFile as exc:
            logger.warning("lmshm: disk tier: %s is damaged (%s); deleted it, a miss", self.path_of(uid, key), exc)
            self._forget(uid, key, entry)
            if leaf is None:
                try:
                    leaf = self._leaf(uid, h, False)
                except OSError:
                    pass
            if leaf is not None:
                _unlink(h, leaf)
            self.stats.add(corrupt=1)
            return False
        except OSError as exc:
            gone = exc.errno == errno.ENOENT and not isinstance(exc, Unsafe)
            if not gone:
                _warn_rate_limited(f"lmshm: disk tier: cannot read {self.path_of(uid, key)} ({exc}); a miss")
            self._forget(uid, key, entry)
            if not gone and leaf is not None:
                _unlink(h, leaf)              # a file left but not counted could pass the capacity
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
        xfd, own_x = self._xx_dir(uid, h, False)
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
                leaf = self._leaf(uid, h, True)
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
                    _unlink(h, leaf)            # an older file of the key the scan has not counted
                with self._lock:
                    self._writing.discard(k)
                    self.used -= size
                self.stats.add(drops=1, errors=0 if exc.errno in (errno.ENOSPC, errno.EDQUOT) else 1)
                _warn_rate_limited(f"lmshm: disk tier: a write to {self.path_of(uid, key)} failed ({exc}); the chunk "
                                   "stays in the pool only")
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


def _unlink(name: str, dir_fd: Optional[int]) -> int:
    """Remove ``name`` in the directory ``dir_fd`` (none: nothing); 1 if it was removed."""
    if dir_fd is None:
        return 0
    try:
        os.unlink(name, dir_fd=dir_fd)
        return 1
    except OSError:
        return 0


_last_warning = [0.0]


def _warn_rate_limited(message: str, every_s: float = 10.0) -> None:
    now = time.monotonic()
    if now - _last_warning[0] >= every_s:
        _last_warning[0] = now
        logger.warning(message)
