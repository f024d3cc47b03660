"""The payload checksums both tiers' formats use, and the header fields both formats carry.

``CHECKSUMS`` numbers each algorithm by the number a disk file or a remote value stores in its
header; ``CHECKSUM_STREAMS`` takes the same digest piece by piece (a remote value is checked
while it arrives). A number, once written to disk or to a remote, keeps its meaning forever:
add algorithms, never renumber one.

Who owns what: this module owns the table and ``checksum_algorithm`` (``--disk-checksum``, and
the remote's unsigned mode). Each format owns its own MAC (``disk/format.py``: keyed BLAKE2b
of the header; ``remote/value.py``: AES-GMAC or keyed BLAKE3), because a MAC's key, context and
place are part of that format's bytes.

The one trap: a reader checks with the algorithm the header names, not the configured one, so
data written under one setting stays readable under another; ``xxh3`` needs the optional
``xxhash`` package, and its absence at read time is an ``ImportError`` the caller turns into a miss.
"""

from __future__ import annotations

import hashlib
import importlib.util
import struct
import zlib
from typing import Any, Callable

MAX_KEY = 64            # bytes of a chunk key in either format's header
MAX_LAYOUT = 64         # bytes of a layout digest in either format's header

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

