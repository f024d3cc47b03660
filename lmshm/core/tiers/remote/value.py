"""The remote tier's value format: one value per chunk, a header then the payload, and its MAC.

The header (``_HEAD``, little-endian) names the chunk (uid, key, layout digest, blocks, length)
and says how the value is checked: with a secret, by a MAC over header and payload (AES-GMAC
under a key of the value's own, ``_gmac``, or keyed BLAKE3, ``_mac``; each key derived from the
secret under its own context); unsigned (``--remote-insecure-unsigned``), by a payload checksum
(``integrity.CHECKSUMS``) and a CRC-32 of the header, against accidents only. ``check_value``
passes only a value of this version for exactly ``(uid, key)`` whose MAC (or checksum)
matches; ``Streamed`` takes that MAC while the value arrives, for ``check_value`` to compare.

Who owns what: this module owns the bytes and the keys derived from the secret; the tier owns
where a value is read into and what a refused one costs.

The one trap: with a secret an unsigned value is refused, whatever its checksum says: anyone
who can write to the remote can write a valid checksum. docs/design/tiers.md has the figures.
"""

from __future__ import annotations

import functools
import hmac
import os
import struct
import zlib
from typing import Any, Callable, Optional

from lmshm.core.tiers.base import ChunkMeta
from lmshm.core.tiers.integrity import CHECKSUM_STREAMS, CHECKSUMS, MAX_KEY, MAX_LAYOUT

MAGIC = b"LMSHMRV\0"
VERSION = 3                 # 1: HMAC-SHA256, a MULTI write; 2: no header CRC. Their values are misses now
MAC_NONE, MAC_BLAKE3, MAC_GMAC = 0, 2, 3    # 1 was HMAC-SHA256 (version 1)
MAC_CONTEXT = "lmshm remote tier 2026-12 value MAC (keyed BLAKE3)"
GMAC_CONTEXT = "lmshm remote tier 2026-12 per-value AES-GMAC key"
#: --remote-mac: what a writer signs with; a reader with the secret accepts either
MACS = {"aes-gmac": MAC_GMAC, "blake3": MAC_BLAKE3}
GMAC_MAX = (1 << 31) - 1        # the cryptography package's AEAD input limit: larger values take BLAKE3
_GMAC_IV = bytes(12)            # the per-value key is used once, so the IV may be fixed
#: magic, version, checksum algorithm, MAC algorithm, uid, blocks, payload length, key length,
#: layout length, key, layout digest, checksum (with AES-GMAC: the value's random nonce; with
#: BLAKE3: zeros); then the MAC (without a secret, the header's CRC-32 in its place).
_HEAD = struct.Struct("<8sHBBIIQBBxx64s64s32s")
_MAC_BYTES = 32
_HEAD_CRC = struct.Struct("<I")     # without a secret: a CRC-32 of the header in the MAC's place
HEADER_BYTES = _HEAD.size + _MAC_BYTES
MAC_THREADS_FROM = 2 << 20      # payload bytes from which the MAC runs on BLAKE3's threads


class BadValue(Exception):
    """A value that is not an lmshm chunk of this key, or is damaged or forged."""


class OtherVersion(BadValue):
    """An lmshm value of another format version (an older lmshm wrote it): a plain miss."""


@functools.lru_cache(maxsize=8)
def mac_key(secret: bytes) -> bytes:
    """The 32-byte BLAKE3 key for ``secret`` (BLAKE3's key derivation, under ``MAC_CONTEXT``)."""
    return _blake3()(secret, derive_key_context=MAC_CONTEXT).digest()


@functools.lru_cache(maxsize=8)
def gmac_key(secret: bytes) -> bytes:
    """The 32-byte BLAKE3 key from which each AES-GMAC value's own key is derived (BLAKE3's
    key derivation under ``GMAC_CONTEXT``: not the BLAKE3 MAC's key)."""
    return _blake3()(secret, derive_key_context=GMAC_CONTEXT).digest()


def _gmac(secret: bytes, head: memoryview | bytes, payload: memoryview) -> bytes:
    """AES-GMAC over ``payload`` under a key of its own: keyed BLAKE3 of the header (uid, key,
    lengths, layout and the value's random nonce), so a header that differs in any byte gives
    another, unknown key, and no key signs two payloads. Then GMAC (AES-256-GCM with no
    plaintext, the payload as associated data; a fixed IV, the key being used once) is a
    one-time MAC: 16 bytes, then 16 zeros. 18-23 GB/s on one core here against keyed BLAKE3's
    5-6 (``bench/remote_readback.py``; docs/design/tiers.md)."""
    vkey = _blake3()(head, key=gmac_key(secret)).digest()
    return _aesgcm()(vkey).encrypt(_GMAC_IV, b"", payload).ljust(_MAC_BYTES, b"\0")


def _mac(secret: bytes, head: memoryview | bytes, payload: memoryview) -> bytes:
    b3 = _blake3()
    # BLAKE3 hashes a large input on several threads (its own pool, the GIL released): 4.6 ->
    # 8 GB/s at 4 MiB on 2 cores (bench/remote_tier.py); below a MiB the threads cost more
    mac = b3(head, key=mac_key(secret), max_threads=b3.AUTO if len(payload) >= MAC_THREADS_FROM else 1)
    mac.update(payload)
    return mac.digest()


def encode_header(uid: int, key: bytes, meta: ChunkMeta, algorithm: int, secret: Optional[bytes],
                  payload: memoryview, mac: int = MAC_GMAC) -> bytes:
    """The value's header for ``payload``: its checksum, or (with a secret) the MAC over both
    (``mac``: ``MAC_GMAC`` or ``MAC_BLAKE3``; no checksum: the MAC covers the payload)."""
    if secret is None:
        head = _HEAD.pack(MAGIC, VERSION, algorithm, MAC_NONE, uid, meta.blocks, meta.nbytes, len(key),
                          len(meta.layout), key, meta.layout, CHECKSUMS[algorithm][1](payload))
        return head + _HEAD_CRC.pack(zlib.crc32(head)).ljust(_MAC_BYTES, b"\0")
    if mac == MAC_GMAC and len(payload) <= GMAC_MAX:
        head = _HEAD.pack(MAGIC, VERSION, 0, MAC_GMAC, uid, meta.blocks, meta.nbytes, len(key),
                          len(meta.layout), key, meta.layout, os.urandom(32))
        return head + _gmac(secret, head, payload)
    head = _HEAD.pack(MAGIC, VERSION, 0, MAC_BLAKE3, uid, meta.blocks, meta.nbytes, len(key),
                      len(meta.layout), key, meta.layout, bytes(32))
    return head + _mac(secret, head, payload)


def decode_header(raw: bytes, uid: int, key: bytes) -> tuple[ChunkMeta, int, int, bytes, bytes]:
    """``(meta, checksum algorithm, MAC algorithm, checksum, mac)``; ``BadValue`` unless it is a
    header of this version for exactly ``(uid, key)``."""
    if len(raw) < HEADER_BYTES:
        raise BadValue("short value")
    magic, version, algo, mac_algo, vuid, blocks, nbytes, klen, llen, vkey, layout, digest = \
        _HEAD.unpack_from(raw, 0)
    if magic != MAGIC:
        raise BadValue("not an lmshm chunk value")
    if version != VERSION:
        raise OtherVersion(f"an lmshm value of format version {version}, not {VERSION}")
    if mac_algo == MAC_NONE and _HEAD_CRC.unpack_from(raw, _HEAD.size)[0] != zlib.crc32(memoryview(raw)[:_HEAD.size]):
        raise BadValue("bad header CRC")    # with a MAC, the MAC covers the header
    if not 0 < klen <= MAX_KEY or llen > MAX_LAYOUT or vuid != uid or vkey[:klen] != key:
        raise BadValue("the header names another chunk")
    if mac_algo == MAC_NONE and algo not in CHECKSUMS or mac_algo not in (MAC_NONE, MAC_BLAKE3, MAC_GMAC):
        raise BadValue("unknown checksum or MAC algorithm")
    return ChunkMeta(nbytes, layout[:llen], blocks), algo, mac_algo, digest, raw[_HEAD.size:HEADER_BYTES]


def _kind(secret: Optional[bytes], algo: int, mac_algo: int, nbytes: int) -> int:
    """What checks a value with these header fields: ``MAC_GMAC`` or ``MAC_BLAKE3`` (with a
    secret), ``MAC_NONE`` (its checksum, ``algo``; without one); ``BadValue`` for a value that
    cannot pass (unsigned where a MAC is required, signed and no secret to check it)."""
    if secret is not None:
        if mac_algo == MAC_GMAC and nbytes <= GMAC_MAX:
            return MAC_GMAC
        if mac_algo == MAC_BLAKE3:
            return MAC_BLAKE3
        raise BadValue("an unsigned value where a MAC is required")
    if mac_algo != MAC_NONE:
        raise BadValue("a signed value and no secret to check it")
    return MAC_NONE


def check_value(value: bytes | memoryview, uid: int, key: bytes, secret: Optional[bytes],
                taken: Optional[bytes] = None) -> tuple[ChunkMeta, memoryview]:
    """The chunk's meta and payload in ``value``, checked; ``BadValue`` on any doubt. With a secret
    only a value with a valid MAC passes (an unsigned one is refused: it could be anyone's).
    ``taken``: the payload's MAC or checksum as ``Streamed`` took it while the value arrived
    (computed here if None)."""
    meta, algo, mac_algo, digest, mac = decode_header(value, uid, key)
    if len(value) != HEADER_BYTES + meta.nbytes:
        raise BadValue(f"{len(value)} bytes where the header says {HEADER_BYTES + meta.nbytes}")
    view = memoryview(value)
    payload = view[HEADER_BYTES:]
    kind = _kind(secret, algo, mac_algo, len(payload))
    if kind == MAC_GMAC:
        want = taken if taken is not None else _gmac(secret, view[:_HEAD.size], payload)
    elif kind == MAC_BLAKE3:
        want = taken if taken is not None else _mac(secret, view[:_HEAD.size], payload)
    else:
        want = taken if taken is not None else CHECKSUMS[algo][1](payload)
        mac = digest
    if not hmac.compare_digest(want.ljust(len(mac), b"\0"), mac):
        raise BadValue("bad checksum" if kind == MAC_NONE else "bad MAC")
    return meta, payload


class Streamed:
    """A value's MAC or checksum taken as it is received (``resp.Connection.reply_into``'s
    ``progress``), each piece while it is still in the CPU's cache: the value's header (its
    first bytes) says which, as ``check_value`` decides; ``taken`` is then what
    ``check_value`` would compute over the payload, or None (the header did not say, or the
    value did not arrive whole), and ``check_value`` decides on the value alone. It only reads
    the buffer: nothing here is trusted until ``check_value`` has compared it."""

    __slots__ = ("buf", "secret", "done", "update", "final", "result")

    def __init__(self, buf: memoryview, secret: Optional[bytes]) -> None:
        self.buf, self.secret = buf, secret
        self.done = 0                       # payload bytes up to here are taken (0: not started)
        self.update: Optional[Callable[[memoryview], Any]] = None
        self.final: Optional[Callable[[], bytes]] = None
        self.result: Optional[bytes] = None

    def __call__(self, filled: int) -> None:
        if self.update is None:
            if self.done or filled < HEADER_BYTES:
                return
            self.done = HEADER_BYTES
            try:
                self._start()
            except (BadValue, ValueError, struct.error):
                pass
            if self.update is None:
                return                      # check_value will say what is wrong
        if filled > self.done:
            self.update(self.buf[self.done:filled])
            self.done = filled

    def _start(self) -> None:
        _, _, algo, mac_algo, _, _, nbytes, *_ = _HEAD.unpack_from(self.buf, 0)
        if nbytes != len(self.buf) - HEADER_BYTES:
            return
        kind = _kind(self.secret, algo, mac_algo, nbytes)
        head = self.buf[:_HEAD.size]
        if kind == MAC_GMAC:
            enc = _gcm()(_blake3()(head, key=gmac_key(self.secret)).digest())
            self.update, self.final = enc.authenticate_additional_data, lambda: (enc.finalize(), enc.tag)[1]
        elif kind == MAC_BLAKE3:
            mac = _blake3()(head, key=mac_key(self.secret))
            self.update, self.final = mac.update, mac.digest
        elif algo in CHECKSUM_STREAMS:
            self.update, self.final = CHECKSUM_STREAMS[algo]()

    @property
    def taken(self) -> Optional[bytes]:
        if self.final is None or self.done != len(self.buf):
            return None
        if self.result is None:
            self.result = self.final()
        return self.result


def require_crypto(secret: Optional[bytes], mac: int) -> None:
    """Fail now, at start, with how to install it, if signing with ``mac`` needs a package that
    is not installed (``blake3`` for any secret; ``cryptography`` too for AES-GMAC)."""
    if secret is not None:
        mac_key(secret)
        if mac == MAC_GMAC:
            _aesgcm()


def _blake3() -> Any:
    """The keyed BLAKE3 of the ``blake3`` package (the ``remote`` extra), needed with a secret."""
    try:
        from blake3 import blake3
    except ImportError:
        raise ImportError("--remote-secret-file needs the blake3 package (keyed BLAKE3 MACs): "
                          "pip install 'lmshm[remote]'") from None
    return blake3


def _gcm() -> Callable[[bytes], Any]:
    """An AES-256-GCM encryptor under a key with ``_GMAC_IV``, fed the payload as associated
    data piece by piece (``Streamed``): its tag is ``_gmac``'s MAC."""
    try:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    except ImportError:
        _aesgcm()                           # the same message
        raise
    return lambda key: Cipher(algorithms.AES(key), modes.GCM(_GMAC_IV)).encryptor()


def _aesgcm() -> Any:
    """AES-GCM of the ``cryptography`` package (the ``remote`` extra), for AES-GMAC values."""
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        raise ImportError("--remote-secret-file with --remote-mac aes-gmac (the default) needs the cryptography "
                          "package: pip install 'lmshm[remote]', or --remote-mac blake3") from None
    return AESGCM
