"""The remote tier (``--remote URL``): chunks in a Valkey/Redis server or cluster, shared by hosts.

One value per chunk, in one key, written by one ``SET`` (atomic: a reader sees the old value or
the whole new one, never a torn one) straight from the pool (the header written into the room
the pool keeps before the object; ``put``): a fixed header (``_HEAD``, little-endian: magic ``LMSHMRV\\0``,
format version, checksum algorithm, MAC algorithm, uid, blocks per chunk, payload length, the
key, the layout digest, the payload's checksum, and the MAC, or without a secret a CRC-32 of the
header in its place), then the payload. The key is
``--remote-prefix`` + the uid (8 hex digits) + ``:`` + the chunk key in hex; the chunk key already
names model, layout, rank, world size and salt (docs/design/dataplane.md).

Integrity: a secret (``--remote-secret-file``) is required. Anyone who can write to the Valkey
can write a value with a valid header and checksum, and a server without a secret would serve
it as a hit: wrong KV, fed to every engine. So ``RemoteTier`` refuses to be made without one
(``NO_SECRET`` says how to make one), unless ``--remote-insecure-unsigned`` says, explicitly,
to trust whoever can write to the remote (one WARNING at start); both at once are refused. Unsigned
(that opt-out), the payload carries a checksum (xxh3-128 or CRC-32, as the disk tier's
``auto``), against accidents only. With a secret, a MAC covers the header (uid and key
included, so a valid value moved to another key fails) and the payload, and no checksum is
computed: a writer without the secret cannot make a value any reader accepts. The MAC is
``--remote-mac``'s: AES-GMAC (the default, ``_gmac``: a key of the value's own, keyed BLAKE3 of
its header, which holds a random nonce, then GMAC of the payload under it) or keyed BLAKE3
(``_mac``; the only one before 2026-12-04), each under a key derived from the secret by BLAKE3's
key derivation with its own context; a reader with the secret accepts either. Where a value is read, signed or
not: straight into the reserved pool object and the room the pool keeps before it (a
promotion's ``framed``), and checked there (MAC or checksum), as the disk tier checks its reads
in the slot: a reserved object is in the server's own memory, invisible until the promotion
commits it after the check, and one that fails is freed, so no unchecked byte is ever served.
A read without that room (``get_into`` with no ``framed``) goes into the reader thread's own
buffer and is copied into the slot once it checks. Reads go over the tier's own RESP
connections (``resp.py``, one per reader thread and node), not through glide: a ``GET`` reply
is received straight into that buffer, one copy from the kernel; a promotion's run of chunks is
asked for by ``GET``s sent at once (``get_run_into``), and headers by pipelined bounded
``GETRANGE``s, one round trip per node. Writes, usage and the connection to a cluster's seeds
stay with glide. A value that fails
(wrong length, bad header, checksum or MAC) is a miss, counted (``corrupt``), and left in place:
it may be another server's newer write, and the next write-through of that chunk overwrites it.
A value of another format version (version 1 carried HMAC-SHA256, version 2 no header CRC) is a
plain miss, uncounted.
The server's ``maxmemory`` policy is the only eviction authority; ``--remote-ttl`` optionally
expires values too.

The easy thing to get wrong: a reader must never receive more than the header said. A
``GET`` reply's length comes first (``$N``); ``resp`` compares it with the slot's size before a
byte of the value arrives, and a value of another length is refused (counted ``corrupt``) and
its connection closed, unread. A client library that receives a whole reply before it looks at
its size (glide's ``get(key, buffer=...)`` does) would let a planted huge value make the reader
allocate it.

Every call is bounded by ``--remote-timeout`` (glide's request and connect timeouts; for a
read, its connect and each reply).
Failures (timeouts, refused connections) feed a circuit breaker per hash slot group (one for a
standalone server): after ``BREAKER_FAILURES`` in a row it skips the remote for a back-off (1 s,
doubling to 30 s) and then lets one probe through; warnings are rate-limited. The client is
created lazily and re-created by the probes, so a server that starts with the remote down still
starts, and finds the remote when it comes up.

The client for writes is ``valkey-glide-sync`` (chosen by ``bench/remote_tier.py``;
docs/design/tiers.md), imported only when a remote is configured; reads are ``resp.py``'s
(``bench/remote_readback.py``).
"""

from __future__ import annotations

import binascii
import functools
import hmac
import logging
import mmap
import os
import stat
import struct
import threading
import time
import urllib.parse
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from lmshm.core.tiers import resp
from lmshm.core.tiers.base import ChunkMeta, Tier
from lmshm.core.tiers.disk import CHECKSUM_STREAMS, CHECKSUMS, MAX_KEY, MAX_LAYOUT, checksum_algorithm

logger = logging.getLogger("lmshm.tiers.remote")

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
BREAKER_FAILURES = 3
BACKOFF_S, MAX_BACKOFF_S = 1.0, 30.0
SLOTS = 16384
SLOT_GROUPS = 64            # cluster breakers: one per 256 slots
MIN_SECRET_BYTES = 16
MAX_CA_BYTES = 1 << 20
MAC_THREADS_FROM = 2 << 20      # payload bytes from which the MAC runs on BLAKE3's threads
USAGE_REFRESH_S = 10.0
KEEP_READ_BUFFER = 64 << 20     # a reader thread keeps its read buffer up to this size
SLOTS_REFRESH_S = 1.0          # a cluster's slot map is re-read at most this often

SECRET_HOWTO = ("(umask 077; mkdir -p /etc/lmshm; head -c 32 /dev/urandom > /etc/lmshm/remote.key); "
                "chmod 600 /etc/lmshm/remote.key")
#: RemoteTier without a secret or the opt-out: how to make a secret (read_secret_file's rules)
NO_SECRET = ("--remote {url} needs a secret shared by the servers that use it: without one, anyone who can "
             "write to the remote can make every server serve engines KV of their choosing (a forged value with "
             "a valid header and checksum is a hit). Make one, owned by the server's user, mode 600, at least "
             f"{MIN_SECRET_BYTES} bytes: {SECRET_HOWTO}, copy that file to every server of the deployment, and "
             "give each --remote-secret-file /etc/lmshm/remote.key (LMSHM_REMOTE_SECRET_FILE). To trust anyone "
             "who can write to the remote instead, say so: --remote-insecure-unsigned "
             "(LMSHM_REMOTE_INSECURE_UNSIGNED=1)")
BOTH = ("--remote-secret-file and --remote-insecure-unsigned contradict each other: with a secret every value "
        "is signed and checked; drop --remote-insecure-unsigned")
#: logged once at start with --remote-insecure-unsigned
UNSIGNED_WARNING = ("lmshm: the remote tier %s is unsigned (--remote-insecure-unsigned): anyone who can write to "
                    "that Valkey/Redis can feed engines wrong KV, which this server serves as hits. Give every "
                    "server the same --remote-secret-file to sign and check every value")

ACCEPTED = ("redis://HOST[:PORT][/DB], rediss://HOST[:PORT][/DB] (TLS), "
            "redis+cluster://HOST:PORT[,HOST:PORT...] or rediss+cluster://... (a cluster, by its seed nodes)")


class BadValue(Exception):
    """A value that is not an lmshm chunk of this key, or is damaged or forged."""


class OtherVersion(BadValue):
    """An lmshm value of another format version (an older lmshm wrote it): a plain miss."""


@dataclass(frozen=True)
class RemoteTarget:
    """What ``--remote URL`` names: the nodes, TLS, cluster or standalone, the database."""

    nodes: tuple[tuple[str, int], ...]
    tls: bool
    cluster: bool
    db: int = 0
    username: str = ""

    def describe(self) -> str:
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        return f"{scheme}://" + ",".join(f"{h}:{p}" for h, p in self.nodes)


def parse_url(url: str) -> RemoteTarget:
    """``--remote URL`` -> a ``RemoteTarget``; ``ValueError`` naming the accepted forms otherwise.
    A password in the URL is refused: it would show in ``ps`` and in logs."""
    scheme, sep, rest = url.partition("://")
    forms = {"redis": (False, False), "rediss": (True, False), "redis+cluster": (False, True),
             "rediss+cluster": (True, True)}
    if not sep or scheme.lower() not in forms:
        raise ValueError(f"--remote {url[:80]!r} is not a URL lmshm accepts; use {ACCEPTED}")
    tls, cluster = forms[scheme.lower()]
    if any(c in rest for c in "?#"):
        raise ValueError(f"--remote {url[:80]!r}: query strings and fragments are not accepted; use {ACCEPTED}")
    username = ""
    if "@" in rest:
        userinfo, _, rest = rest.rpartition("@")
        if ":" in userinfo:
            raise ValueError("--remote must not carry a password (it would show in ps and logs): put it in "
                             "LMSHM_REMOTE_PASSWORD or in a file named by --remote-password-file, and the user "
                             "name in LMSHM_REMOTE_USERNAME")
        username = urllib.parse.unquote(userinfo)
    hostports, _, path = rest.partition("/")
    db = 0
    if path:
        if cluster or not path.isdigit():
            raise ValueError(f"--remote {url[:80]!r}: only a standalone server takes a database number "
                             f"(/0../15); use {ACCEPTED}")
        db = int(path)
    nodes = []
    for hp in hostports.split(","):
        host, port = hp, "6379"
        if hp.startswith("["):                          # [v6 address]:port
            host, _, after = hp[1:].partition("]")
            port = after[1:] if after.startswith(":") else "6379"
        elif ":" in hp:
            host, _, port = hp.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--remote {url[:80]!r}: {hp[:60]!r} is not HOST:PORT; use {ACCEPTED}")
        nodes.append((host, int(port)))
    if len(nodes) > 1 and not cluster:
        raise ValueError(f"--remote {url[:80]!r}: several nodes make a cluster; write it as "
                         f"redis+cluster://HOST:PORT,HOST:PORT (accepted: {ACCEPTED})")
    return RemoteTarget(tuple(nodes), tls, cluster, db, username)


def read_secret_file(path: str, what: str, min_bytes: int = 1) -> bytes:
    """A secret from a file the server's uid owns and nobody else may read (a trailing newline
    is dropped); ``ValueError`` with what to do otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise ValueError(f"cannot open {what} {path!r}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{what} {path!r} is not a regular file")
        if st.st_uid not in (os.geteuid(), 0):
            raise ValueError(f"{what} {path!r} belongs to uid {st.st_uid}, who could change it; it must be the "
                             f"server's (uid {os.geteuid()}) or root's: chown it")
        if st.st_mode & 0o077:
            raise ValueError(f"{what} {path!r} is readable by group or others (mode {st.st_mode & 0o777:o}); "
                             f"chmod 600 it")
        data = os.read(fd, 1 << 16).rstrip(b"\r\n")
    finally:
        os.close(fd)
    if len(data) < min_bytes:
        raise ValueError(f"{what} {path!r} holds {len(data)} bytes; it needs at least {min_bytes} "
                         f"(e.g. head -c 32 /dev/urandom > FILE)")
    return data


def read_ca_file(path: str) -> bytes:
    """The PEM certificates of ``--remote-ca-file`` (public: any mode will do); ``ValueError``
    unless the file holds at least one certificate."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CA_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot read --remote-ca-file {path!r}: {exc.strerror}") from None
    if len(data) > MAX_CA_BYTES or b"-----BEGIN CERTIFICATE-----" not in data:
        raise ValueError(f"--remote-ca-file {path!r} is not a PEM file of certificates "
                         f"(-----BEGIN CERTIFICATE----- ..., at most {MAX_CA_BYTES >> 20} MiB)")
    return data


def key_slot(key: bytes) -> int:
    """The cluster hash slot of ``key``: CRC16 (XMODEM) of the key, or of its ``{hash tag}``."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1:end]
    return binascii.crc_hqx(key, 0) % SLOTS


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
    ``taken``: the payload's MAC or checksum as ``_Streamed`` took it while the value arrived
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


class _Streamed:
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


class Breaker:
    """Consecutive failures per group; after ``BREAKER_FAILURES`` the group is skipped for a
    back-off (doubling up to ``MAX_BACKOFF_S``), then one call probes it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failures: dict[int, int] = {}
        self._open_until: dict[int, float] = {}
        self._backoff: dict[int, float] = {}

    def allow(self, group: int) -> bool:
        with self._lock:
            until = self._open_until.get(group)
            if until is None:
                return True
            if time.monotonic() < until:
                return False
            # half open: let this call probe; others wait for its outcome for one more back-off
            self._open_until[group] = time.monotonic() + self._backoff[group]
            return True

    def success(self, group: int) -> None:
        with self._lock:
            self._failures.pop(group, None)
            self._open_until.pop(group, None)
            self._backoff.pop(group, None)

    def failure(self, group: int) -> bool:
        """Count one; True when this failure opened (or re-opened) the breaker."""
        with self._lock:
            n = self._failures.get(group, 0) + 1
            self._failures[group] = n
            if n < BREAKER_FAILURES:
                return False
            backoff = min(MAX_BACKOFF_S, self._backoff.get(group, BACKOFF_S / 2) * 2)
            self._backoff[group] = backoff
            self._open_until[group] = time.monotonic() + backoff
            return True

    def open_groups(self) -> int:
        now = time.monotonic()
        with self._lock:
            return sum(until > now for until in self._open_until.values())


class _Warnings:
    """At most one log line per kind every ``every_s`` seconds, with how many were suppressed."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warn(self, kind: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -1e9) < self.every_s:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return
            self._last[kind] = now
            suppressed = self._suppressed.pop(kind, 0)
        logger.warning(message + (f" ({suppressed} more like this not logged)" if suppressed else ""), *args)


class _Skip(Exception):
    """The breaker is open, or no client could be made: a miss or a drop, without a call."""


class RemoteTier(Tier):
    name = "remote"
    head_room = HEADER_BYTES
    batched_heads = True

    def __init__(self, url: str, *, prefix: str = "lmshm:", ttl_s: float = 0.0, timeout_s: float = 0.5,
                 secret: Optional[bytes] = None, username: str = "", password: str = "",
                 checksum: str = "auto", ca_pem: Optional[bytes] = None, insecure_unsigned: bool = False,
                 mac: str = "aes-gmac") -> None:
        """``secret`` (the MAC's) is required, unless ``insecure_unsigned`` says to trust whoever
        can write to the remote (a WARNING is logged); ``ValueError`` otherwise, and for both.
        ``mac`` (one of ``MACS``) is what this tier signs with; it reads either."""
        super().__init__()
        self.target = parse_url(url)
        if secret is None and not insecure_unsigned:
            raise ValueError(NO_SECRET.format(url=self.target.describe()))
        if secret is not None and insecure_unsigned:
            raise ValueError(BOTH)
        if ca_pem is not None and not self.target.tls:
            raise ValueError("--remote-ca-file is for a TLS remote: write the URL as rediss:// "
                             "(or rediss+cluster://)")
        self.ca_pem = ca_pem
        if len(prefix.encode()) > 256:
            raise ValueError("--remote-prefix is longer than 256 bytes")
        self.prefix = prefix.encode()
        self.ttl_ms = int(ttl_s * 1000)
        self.timeout_s = timeout_s
        self.secret = secret
        if mac not in MACS:
            raise ValueError(f"--remote-mac {mac!r}: say one of {', '.join(MACS)}")
        self.mac = MACS[mac]
        if secret is not None:
            mac_key(secret)                 # fails now, at start, if blake3 is not installed
            if self.mac == MAC_GMAC:
                _aesgcm()                   # and cryptography
        self.username = username or self.target.username
        self.password = password
        self.algorithm = checksum_algorithm(checksum)
        self.breaker = Breaker()
        self.warnings = _Warnings()
        self._lock = threading.Lock()      # guards the client's creation and replacement
        self._local = threading.local()    # each writer thread's staging buffer
        self._client: Any = None
        self._glide = _import_glide()
        self._tls = resp.tls_context(ca_pem) if self.target.tls else None
        self._reads = threading.local()    # each reader thread's connections, by node
        self._conns: set[resp.Connection] = set()     # every reader connection open, for close
        self._slots: Optional[dict[int, tuple[str, int]]] = None    # a cluster's slot map
        self._slots_at = 0.0
        self._slots_lock = threading.Lock()
        self._usage = (0, 0, 0)
        self._usage_at = 0.0
        self._closed = False
        if secret is None:
            logger.warning(UNSIGNED_WARNING, self.target.describe())

    # ---- keys and the client ------------------------------------------------------------
    def remote_key(self, uid: int, key: bytes) -> bytes:
        return self.prefix + b"%08x:" % uid + key.hex().encode()

    def _group(self, rkey: bytes) -> int:
        return key_slot(rkey) * SLOT_GROUPS // SLOTS if self.target.cluster else 0

    def _connect(self) -> Any:
        g = self._glide
        addresses = [g.NodeAddress(h, p) for h, p in self.target.nodes]
        credentials = g.ServerCredentials(password=self.password, username=self.username or None) \
            if self.password else None
        timeout_ms = max(1, int(self.timeout_s * 1000))
        backoff = g.BackoffStrategy(num_of_retries=5, factor=100, exponent_base=2)
        tls = g.TlsAdvancedConfiguration(root_pem_cacerts=self.ca_pem) if self.ca_pem else None
        if self.target.cluster:
            config = g.GlideClusterClientConfiguration(
                addresses, use_tls=self.target.tls, credentials=credentials, request_timeout=timeout_ms,
                reconnect_strategy=backoff,
                advanced_config=g.AdvancedGlideClusterClientConfiguration(connection_timeout=timeout_ms,
                                                                          tls_config=tls))
            return g.GlideClusterClient.create(config)
        config = g.GlideClientConfiguration(
            addresses, use_tls=self.target.tls, credentials=credentials, request_timeout=timeout_ms,
            database_id=self.target.db or None, reconnect_strategy=backoff,
            advanced_config=g.AdvancedGlideClientConfiguration(connection_timeout=timeout_ms, tls_config=tls))
        return g.GlideClient.create(config)

    def _get_client(self, wait: bool = True) -> Any:
        """glide's client (writes; reads go over ``resp``), made by the first call that needs
        one. A write (on a writer thread, in the background) waits up to the timeout for another
        thread's connection in progress; without ``wait``, a call that finds one does not."""
        client = self._client
        if client is not None:
            return client
        if not self._lock.acquire(timeout=self.timeout_s) if wait else not self._lock.acquire(blocking=False):
            raise _Skip
        try:
            if self._closed:
                raise _Skip
            if self._client is None:
                self._client = self._connect()
            return self._client
        finally:
            self._lock.release()

    def _call(self, rkey: bytes, op: str, fn: Any, wait: bool = False) -> Any:
        """Run ``fn(client)`` for ``rkey`` through the breaker; ``_Skip`` after a counted failure."""
        group = self._group(rkey)
        if not self.breaker.allow(group):
            raise _Skip
        # _Skip is raised after the handler, never inside it: an exception raised there would carry
        # glide's, whose traceback holds glide's frame and in it the cffi view of the buffer
        # being read into. Kept in a reference cycle (a range read's outcome is), such a view can
        # outlive its memoryview when the GC breaks the cycle: a segfault, seen in the tests.
        failed = False
        try:
            result = fn(self._get_client(wait))
        except (_Skip, BadValue):           # BadValue: the call worked, the value is unsound
            raise
        except Exception as exc:
            failed = True
            self._failed(group, op, exc)
            if isinstance(exc, self._glide.ClosingError):
                self._drop_client()
        if failed:
            raise _Skip
        self.breaker.success(group)
        return result

    def _drop_client(self, wait: bool = False) -> None:
        """Forget a broken client (the next call makes a new one). Without ``wait``, a thread
        that finds another one connecting leaves it be, rather than wait past its own bound."""
        if not self._lock.acquire(blocking=wait):
            return
        try:
            client, self._client = self._client, None
        finally:
            self._lock.release()
        if client is not None:
            try:
                client.close()
            except Exception:
                pass

    # ---- the interface ------------------------------------------------------------------
    def contains(self, uid: int, keys: Sequence[bytes]) -> int:
        n = 0
        for meta in self.heads(uid, keys):
            if meta is None:
                break
            n += 1
        return n

    def head(self, uid: int, key: bytes) -> Optional[ChunkMeta]:
        return self.heads(uid, [key])[0]

    def heads(self, uid: int, keys: Sequence[bytes]) -> list[Optional[ChunkMeta]]:
        """The headers of ``keys``: pipelined bounded ``GETRANGE``s, one round trip per node
        (``_head_replies``), each bounded by the timeout. In a cluster a node down costs the
        misses of its own slots only."""
        rkeys = [self.remote_key(uid, k) for k in keys]
        return [self._meta(rkey, raw, uid, key) for rkey, raw, key in zip(rkeys, self._head_replies(rkeys), keys)]

    def _meta(self, rkey: bytes, raw: Optional[bytes], uid: int, key: bytes) -> Optional[ChunkMeta]:
        if not raw:
            if raw is not None:
                self._gone(uid, key)        # the remote answered: expired or evicted (KV events)
            return None
        try:
            return decode_header(raw, uid, key)[0]
        except OtherVersion:
            return None
        except BadValue as exc:
            self._refused(rkey, exc)
            return None

    def get_into(self, uid: int, key: bytes, meta: ChunkMeta, dest: memoryview,
                 framed: Optional[memoryview] = None) -> bool:
        """The value read by one ``GET`` straight into a buffer (``resp``: its length is
        checked before a byte of it is received): into ``framed`` (the reserved, still
        invisible pool object and the room before it) and checked there (MAC or checksum), as
        the disk tier checks its reads; without ``framed`` into this thread's read buffer, and
        only a value that checks is copied into the slot."""
        rkey = self.remote_key(uid, key)
        t0 = time.monotonic()
        buf = self._value_buffer(meta, dest, framed)
        if buf is None:
            return False
        stream = self._stream(buf)
        try:
            found = self._get(rkey, buf, stream)
        except _Skip:
            return False
        except BadValue as exc:
            return self._unsound(uid, key, rkey, exc)
        if not found:                       # expired or evicted since head: a plain miss
            self._gone(uid, key)
            return False
        return self._checked(uid, key, rkey, meta, buf, dest, buf is not framed, t0, stream)

    def get_run_into(self, uid: int, jobs: Sequence[tuple[bytes, ChunkMeta, memoryview, Optional[memoryview]]]) -> int:
        """A run of chunks (a promotion's reader task) read by ``GET``s sent at once, one round
        trip for the run: each value checked (and, read without its room, copied) as it arrives, while
        the server sends the next. Up to the first that fails; then the connection, with the
        rest of the run's replies unread, is closed. A run a cluster spreads over several nodes
        is read chunk by chunk."""
        rkeys = [self.remote_key(uid, key) for key, _, _, _ in jobs]
        node = self._node(rkeys[0]) if rkeys else None
        groups = {self._group(r) for r in rkeys}
        if len(jobs) < 2 or any(self._node(r) != node for r in rkeys[1:]) or \
                not all(self.breaker.allow(g) for g in groups):
            return super().get_run_into(uid, jobs)
        group = self._group(rkeys[0])
        try:
            conn = self._conn(node)
            conn.request_gets(rkeys)
        except (OSError, _Skip) as exc:
            if not isinstance(exc, _Skip):
                self._failed(group, "GET", exc)
            return 0
        for i, (key, meta, dest, framed) in enumerate(jobs):
            t0 = time.monotonic()
            buf = self._value_buffer(meta, dest, framed)
            ok = False
            try:
                stream = self._stream(buf)
                if buf is not None and conn.reply_into(buf, stream):
                    ok = self._checked(uid, key, rkeys[i], meta, buf, dest, buf is not framed, t0, stream)
                elif buf is not None:
                    self._gone(uid, key)
            except resp.WrongLength as exc:
                self._unsound(uid, key, rkeys[i], BadValue(f"{exc.nbytes} bytes where the header says {len(buf or b'')}"))
            except resp.ErrorReply as exc:          # MOVED (a reshard), WRONGTYPE, NOAUTH...: a miss
                if not str(exc).startswith(("MOVED", "ASK", "WRONGTYPE")):
                    self._failed(group, "GET", exc)
                elif exc.moved is not None:
                    self._moved(exc.moved, node)
            except (OSError, resp.ProtocolError) as exc:
                self._failed(group, "GET", exc)
                return i
            if not ok:
                conn.close()
                return i
        for g in groups:
            self.breaker.success(g)
        return len(jobs)

    def _unsound(self, uid: int, key: bytes, rkey: bytes, exc: BadValue) -> bool:
        """A value read that is not a sound chunk of its key: refused (counted) and no longer
        held here (KV events); a miss (False)."""
        self._refused(rkey, exc)
        self._gone(uid, key)
        return False

    def _value_buffer(self, meta: ChunkMeta, dest: memoryview, framed: Optional[memoryview]) -> Optional[memoryview]:
        """Where a value is read: ``framed`` (the slot and its room) when it has the value's
        size, else this thread's read buffer; None when ``dest`` is not the chunk's size."""
        if len(dest) != meta.nbytes:
            return None
        size = HEADER_BYTES + meta.nbytes
        if framed is not None and len(framed) == size:
            return framed
        return self._read_buffer(size)

    def _stream(self, buf: Optional[memoryview]) -> Optional[_Streamed]:
        """A ``_Streamed`` for a value read into ``buf`` in more than one piece (``resp.PIECE``);
        None for a shorter one: it is still in the cache when it has all arrived."""
        return _Streamed(buf, self.secret) if buf is not None and len(buf) > resp.PIECE else None

    def _checked(self, uid: int, key: bytes, rkey: bytes, meta: ChunkMeta, buf: memoryview, dest: memoryview,
                 copy: bool, t0: float, stream: Optional[_Streamed] = None) -> bool:
        """The value read into ``buf`` checked (and with ``copy``, read elsewhere than into the
        slot, copied there): True, or a miss (counted and refused when unsound). ``stream``:
        what took its MAC or checksum as it arrived."""
        try:
            got, payload = check_value(buf, uid, key, self.secret, stream.taken if stream is not None else None)
            if got != meta:
                raise BadValue("the value changed since it was looked up")
        except OtherVersion:
            return False
        except BadValue as exc:
            return self._unsound(uid, key, rkey, exc)
        if copy:
            dest[:] = payload
        self.stats.timed_read(time.monotonic() - t0, meta.nbytes)
        return True

    # ---- reads: RESP on the tier's own connections (resp.py) ------------------------------
    def _get(self, rkey: bytes, buf: memoryview, stream: Optional[_Streamed] = None) -> bool:
        """``rkey``'s value in ``buf``: True, False when it is missing (or not a string);
        ``BadValue`` when it is of another length, ``_Skip`` after a counted failure. A cluster's
        ``MOVED`` is followed once."""
        group = self._group(rkey)
        if not self.breaker.allow(group):
            raise _Skip
        node = self._node(rkey)
        for attempt in range(2):
            try:
                n = self._conn(node).get_into(rkey, buf, stream)
            except resp.WrongLength as exc:
                self.breaker.success(group)
                raise BadValue(f"{exc.nbytes} bytes where the header says {len(buf)}") from None
            except resp.ErrorReply as exc:
                moved = exc.moved if self.target.cluster else None
                if moved is not None and attempt == 0:
                    node = self._moved(moved, node)
                    continue
                if str(exc).startswith("WRONGTYPE"):     # someone else's key: a miss
                    self.breaker.success(group)
                    return False
                self._failed(group, "GET", exc)
                raise _Skip from None
            except _Skip:
                raise
            except (OSError, resp.ProtocolError) as exc:
                self._failed(group, "GET", exc)
                raise _Skip from None
            self.breaker.success(group)
            return n > 0
        self._failed(group, "GET", resp.ProtocolError("redirected twice"))
        raise _Skip

    def _head_replies(self, rkeys: Sequence[bytes]) -> list[Optional[bytes]]:
        """The first ``HEADER_BYTES`` of each key's value, pipelined: one round trip per node
        asked. None where it was not learnt (a failure, counted; a breaker open; an error reply),
        ``b""`` where the key is missing. A key ``MOVED`` is asked again once, at its new node."""
        out: list[Optional[bytes]] = [None] * len(rkeys)
        todo = list(range(len(rkeys)))
        for attempt in range(2):
            by_node: dict[tuple[str, int], list[int]] = {}
            for i in todo:
                if self.breaker.allow(self._group(rkeys[i])):
                    by_node.setdefault(self._node(rkeys[i]), []).append(i)
            todo = []
            for node, idx in by_node.items():
                groups = {self._group(rkeys[i]) for i in idx}
                try:
                    replies = self._conn(node).pipeline(
                        [(b"GETRANGE", rkeys[i], b"0", b"%d" % (HEADER_BYTES - 1)) for i in idx], HEADER_BYTES)
                except (OSError, resp.ProtocolError, _Skip) as exc:
                    if not isinstance(exc, _Skip):
                        for g in groups:
                            self._failed(g, "GETRANGE", exc)
                    continue
                failed: dict[int, resp.ErrorReply] = {}     # NOAUTH, LOADING...: the call failed
                for i, r in zip(idx, replies):
                    if isinstance(r, bytes):
                        out[i] = r
                    elif not isinstance(r, resp.ErrorReply) or str(r).startswith("WRONGTYPE"):
                        pass                # not a string (someone else's key): a miss
                    elif r.moved is not None and self.target.cluster and attempt == 0:
                        self._moved(r.moved, node)
                        todo.append(i)
                    else:
                        failed.setdefault(self._group(rkeys[i]), r)
                for g in groups:
                    if g in failed:
                        self._failed(g, "GETRANGE", failed[g])
                    else:
                        self.breaker.success(g)
            if not todo:
                break
        return out

    def _node(self, rkey: bytes) -> tuple[str, int]:
        """The node that serves ``rkey``: the server, or its slot's primary in the cluster's
        slot map (read on first use; a seed node until then, which redirects)."""
        if not self.target.cluster:
            return self.target.nodes[0]
        if self._slots is None:
            self._load_slots()
        return (self._slots or {}).get(key_slot(rkey), self.target.nodes[0])

    def _load_slots(self) -> None:
        """The cluster's slot map from the first node that answers ``CLUSTER SLOTS``; at most
        one thread at a time, and at most every ``SLOTS_REFRESH_S`` (others go on with the map
        they have)."""
        if time.monotonic() - self._slots_at < SLOTS_REFRESH_S or not self._slots_lock.acquire(blocking=False):
            return
        try:
            self._slots_at = time.monotonic()
            known = list(dict.fromkeys(list(self.target.nodes) + sorted(set((self._slots or {}).values()))))
            for node in known:
                try:
                    slots = resp.slot_map(self._conn(node).call((b"CLUSTER", b"SLOTS")))
                except (OSError, resp.ProtocolError, resp.ErrorReply, _Skip) as exc:
                    logger.debug("lmshm: CLUSTER SLOTS on %s:%d failed: %s", node[0], node[1], exc)
                    continue
                self._slots = {s: (h or node[0], p) for s, (h, p) in slots.items()}
                return
        finally:
            self._slots_lock.release()

    def _moved(self, moved: tuple[int, str, int], asked: tuple[str, int]) -> tuple[str, int]:
        """Where a ``MOVED`` or ``ASK`` says a slot is: noted in the map, which is re-read."""
        slot, host, port = moved
        node = (host or asked[0], port)
        slots = dict(self._slots or {})
        slots[slot] = node
        self._slots = slots
        self._load_slots()
        return node

    def _conn(self, node: tuple[str, int]) -> resp.Connection:
        """This thread's connection to ``node``, opened when it has none or its last one
        closed (after any failure)."""
        conns = getattr(self._reads, "conns", None)
        if conns is None:
            conns = self._reads.conns = {}
        conn = conns.get(node)
        if conn is not None and not conn.closed:
            return conn
        if self._closed:
            raise _Skip
        conn = resp.Connection(node[0], node[1], timeout_s=self.timeout_s, tls=self._tls,
                               username=self.username, password=self.password, db=self.target.db)
        with self._lock:
            self._conns = {c for c in self._conns if not c.closed}
            self._conns.add(conn)
            closed = self._closed
        if closed:
            conn.close()
            raise _Skip
        conns[node] = conn
        return conn

    def _failed(self, group: int, op: str, exc: BaseException) -> None:
        """A failed call: counted, fed to ``group``'s breaker, warned about (rate-limited)."""
        timed_out = isinstance(exc, (TimeoutError, self._glide.TimeoutError)) or "timed out" in str(exc)
        self.stats.add(**({"timeouts": 1} if timed_out else {"errors": 1}))
        if self.breaker.failure(group):
            self.warnings.warn("breaker", "lmshm: the remote tier %s failed %d times in a row (%s: %.200s); "
                               "skipping it for a while", self.target.describe(), BREAKER_FAILURES,
                               type(exc).__name__, str(exc))
        else:
            self.warnings.warn(op, "lmshm: remote %s on %s failed (%s: %.200s): a miss", op,
                               self.target.describe(), type(exc).__name__, str(exc))

    def _read_buffer(self, nbytes: int) -> memoryview:
        """``nbytes`` of this thread's read buffer: kept for the next read up to ``KEEP_READ_BUFFER``
        (a header that claims a huge chunk cannot make a reader keep its size), new above it."""
        if nbytes > KEEP_READ_BUFFER:
            return memoryview(bytearray(nbytes))
        buf = getattr(self._local, "read", None)
        if buf is None or len(buf) < nbytes:
            # a mapping with huge pages asked for, as the pool's: the kernel's copy into it, the
            # check over it and the copy out of it each take a TLB miss per 2 MiB, not per 4 KiB
            buf = mmap.mmap(-1, max(nbytes, 1 << 21))
            if hasattr(mmap, "MADV_HUGEPAGE"):
                buf.madvise(mmap.MADV_HUGEPAGE)
            self._local.read = buf      # the old one is unmapped when its last view is gone
        return memoryview(buf)[:nbytes]

    def _refused(self, rkey: bytes, exc: BadValue) -> None:
        """A value that is not a sound chunk of its key: counted (``corrupt``), warned about
        (rate-limited), a miss; left in place (the next write-through of the chunk replaces it)."""
        self.stats.add(corrupt=1)
        self.warnings.warn("corrupt", "lmshm: remote value %r refused (%s): a miss, never served", rkey[:80], exc)

    def put(self, uid: int, key: bytes, meta: ChunkMeta, data: memoryview,
            framed: Optional[memoryview] = None) -> bool:
        """One ``SET`` of header and payload (atomic: a reader sees the old value or the whole new
        one), sent by glide from one buffer without a copy of its own. In the server the pool
        keeps ``HEADER_BYTES`` free before every chunk (``head_room``): the header is written
        there and the value is ``framed``, the chunk not copied at all. Without ``framed``
        (a pool without the room), header and payload are copied once into this thread's
        staging buffer. Either beats ``MULTI``/``SET`` header/``APPEND`` payload, whose
        ``APPEND`` the server copies, and joining into a new object, whose fresh pages fault
        (bench/remote_tier.py)."""
        rkey = self.remote_key(uid, key)
        t0 = time.monotonic()
        if framed is not None and len(framed) == HEADER_BYTES + len(data):
            value = framed
        else:
            value = self._staging(HEADER_BYTES + len(data))
            value[HEADER_BYTES:] = data
        value[:HEADER_BYTES] = encode_header(uid, key, meta, self.algorithm, self.secret, value[HEADER_BYTES:],
                                             self.mac)
        g = self._glide
        expiry = g.ExpirySet(g.ExpiryType.MILLSEC, self.ttl_ms) if self.ttl_ms else None
        try:
            self._call(rkey, "SET", lambda client: client.set(rkey, value, expiry=expiry), wait=True)
        except _Skip:
            self.stats.add(drops=1)
            return False
        self.stats.timed_write(time.monotonic() - t0, len(data))
        self.stats.add(puts=1)
        self._held(uid, key)
        self._refresh_usage()
        return True

    def _staging(self, nbytes: int) -> memoryview:
        """``nbytes`` of this thread's staging buffer (grown when a larger chunk comes; the stack
        writes with two threads per tier, so at most two chunks' worth stay allocated)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._local.buf = bytearray(nbytes)
        return memoryview(buf)[:nbytes]

    def usage(self) -> tuple[int, int, int]:
        """``(maxmemory, used_memory, keys)`` of the server, summed over a cluster's primaries, as
        last read (at most every ``USAGE_REFRESH_S``, by a writer thread, never by the caller:
        STATUS runs on the loop). Whole servers: other users' keys and memory count too. A
        cluster's capacity is 0 (unknown) unless every primary has a ``maxmemory``."""
        return self._usage

    def _refresh_usage(self) -> None:
        if time.monotonic() - self._usage_at < USAGE_REFRESH_S:
            return
        self._usage_at = time.monotonic()
        client = self._client
        if client is None:
            return
        try:        # outside the breaker and the counters: an ACL may deny INFO, and that is no failure
            if self.target.cluster:
                primaries = self._glide.AllPrimaries()
                infos = client.custom_command(["INFO", "memory"], route=primaries)
                keys = client.custom_command(["DBSIZE"], route=primaries)
            else:
                infos, keys = {"": client.custom_command(["INFO", "memory"])}, client.custom_command(["DBSIZE"])
            nodes = [dict(line.split(":", 1) for line in _text(info).splitlines() if ":" in line)
                     for info in (infos.values() if isinstance(infos, dict) else [infos])]
            limits = [int(f.get("maxmemory", 0)) for f in nodes]
            self._usage = (sum(limits) if all(limits) else 0, sum(int(f.get("used_memory", 0)) for f in nodes),
                           sum(int(k) for k in keys.values()) if isinstance(keys, dict) else int(keys))
        except Exception as exc:
            logger.debug("lmshm: cannot read the remote's usage: %s", exc)
            return
        fields = nodes[0] if nodes else {}
        policy = fields.get("maxmemory_policy", "").strip()
        if not self._usage[0] and not self.ttl_ms:
            self.warnings.warn("unbounded", "lmshm: the remote %s has no maxmemory and --remote-ttl is 0: it will "
                               "grow without bound; set maxmemory with an allkeys-lru policy (the eviction "
                               "authority), or --remote-ttl", self.target.describe())
        elif policy and not policy.startswith("allkeys-"):
            self.warnings.warn("policy", "lmshm: the remote %s evicts with maxmemory-policy %s: lmshm's keys have no "
                               "TTL unless --remote-ttl is set, so use an allkeys-* policy (allkeys-lru)",
                               self.target.describe(), policy)

    def close(self) -> None:
        """Closes the client and every reader connection (a read in progress on one fails: a
        miss)."""
        with self._lock:                    # waits for a connection in progress (at most its timeout)
            self._closed = True
            conns, self._conns = self._conns, set()
        for conn in conns:
            conn.close()
        self._drop_client(wait=True)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, (bytes, bytearray)) else str(value)


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
    data piece by piece (``_Streamed``): its tag is ``_gmac``'s MAC."""
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


def _import_glide() -> Any:
    """The client library, imported only when a remote is configured."""
    try:
        import glide_sync
        from glide_sync import Logger, LogLevel
    except ImportError:
        raise ImportError("--remote needs the valkey-glide-sync package: pip install 'lmshm[remote]'") from None
    Logger.set_logger_config(LogLevel.OFF)      # failures are counted and logged here, rate-limited
    return glide_sync
