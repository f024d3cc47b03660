"""The disk tier's file format and its I/O: one chunk file, written whole or not at all, checked on read.

A file is a 4096-byte header, then the payload (the pool object's bytes) at offset 4096. The
header (``_HEAD``, little-endian) names the chunk (uid, key, layout digest, blocks, length) and
its payload's checksum (``integrity.CHECKSUMS``), then a keyed BLAKE2b-256 MAC of all that under
the deployment's key (``dirs.load_key``). ``read_file`` trusts nothing it read until the MAC,
every field and the payload's checksum match: anything else is ``BadFile`` (a miss).

Writes go to a unique temp file, then ``rename`` over the final name: a reader sees the old file
or the whole new one. Nothing is fsynced (a file left holding zeros fails its checksum).
``O_DIRECT`` is used where the buffer lies on whole pages (``direct_ok``); reads with it take
header and payload in one ``preadv`` straight into the destination.

The one trap: with ``O_DIRECT`` the destination is filled before it is checked, so a caller
must keep it invisible (a reserved pool object) until ``read_file`` returns without raising.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import hmac
import mmap
import os
import secrets
import stat
import struct
import threading
from typing import Optional

import numpy as np

from lmshm.core.tiers.base import ChunkMeta
from lmshm.core.tiers.integrity import CHECKSUMS, MAX_KEY, MAX_LAYOUT

MAGIC = b"LMSHMKV\0"
VERSION = 2                     # 2: a keyed MAC over the header (1: a CRC-32; removed at scan)
HEADER_BYTES = 4096
PAGE = 4096
#: magic, version, checksum algorithm, uid, blocks, payload length, key length, layout length,
#: key, layout digest, checksum; followed by a keyed BLAKE2b-256 MAC of these bytes.
_HEAD = struct.Struct("<8sHBxIIQBBxx64s64s32s")
MAC_BYTES = 32
_MAC_PERSON = b"lmshm-disk-v2"
#: the header and its MAC: what the index rebuild reads of each file
SIGNED_HEAD_BYTES = _HEAD.size + MAC_BYTES
READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK     # a FIFO must not block


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


def decode_header(raw: bytes, mac_key: bytes) -> tuple[int, bytes, ChunkMeta, int, bytes]:
    """``(uid, key, meta, algorithm, checksum)`` of a header made under ``mac_key``; ``BadFile``
    if it is not one."""
    if len(raw) < SIGNED_HEAD_BYTES:
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
        fd = os.open(name, READ_FLAGS | (os.O_DIRECT if direct else 0), dir_fd=dir_fd)
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

