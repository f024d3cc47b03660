"""The remote tier (``--remote URL``): chunks in a Valkey/Redis server or cluster, shared by hosts.

One value per chunk (``value.py``'s format), under ``--remote-prefix`` + the uid (8 hex digits)
+ ``:`` + the chunk key in hex, written by one ``SET`` (a reader sees the old value or the whole
new one) straight from the pool, the header in the room the pool keeps before the object
(``head_room``). Writes, usage and a cluster's seeds go through glide (``valkey-glide-sync``);
reads go over the tier's own RESP connections (``resp.py``, one per reader thread and node),
straight into the reserved pool object, checked there before the promotion commits it. A value
that fails its check is a counted miss, left in place. Every call is bounded by
``--remote-timeout``; failures feed a ``Breaker`` per slot group (``slots.py``), and warnings go
through one ``Throttle`` per kind of line. The server's ``maxmemory`` policy is the only
eviction authority. docs/design/tiers.md tells the design and its measurements.

The one trap: a reader must never receive more than the header said; ``resp`` compares a
``GET`` reply's length with the slot's before a byte arrives (glide's ``get(key, buffer=...)``
receives it all first, so a planted huge value would make the reader allocate it).
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from typing import Any, Optional, Sequence

from lmshm.core.logs import Throttle
from lmshm.core.tiers.base import ChunkMeta, Tier
from lmshm.core.tiers.integrity import checksum_algorithm
from lmshm.core.tiers.remote import resp
from lmshm.core.tiers.remote.breaker import BREAKER_FAILURES, Breaker
from lmshm.core.tiers.remote.slots import Node, SlotMap, slot_group
from lmshm.core.tiers.remote.target import BOTH, NO_SECRET, UNSIGNED_WARNING, parse_url
from lmshm.core.tiers.remote.value import (
    HEADER_BYTES,
    MACS,
    BadValue,
    OtherVersion,
    Streamed,
    check_value,
    decode_header,
    encode_header,
    require_crypto,
)

logger = logging.getLogger("lmshm.tiers.remote")

USAGE_REFRESH_S = 10.0
KEEP_READ_BUFFER = 64 << 20     # a reader thread keeps its read buffer up to this size
#: the kinds of warning, each with its own throttle: a failed call (by its command), the breaker
#: opening, a refused value, and the two about the server's memory policy
WARNINGS = ("GET", "GETRANGE", "SET", "breaker", "corrupt", "unbounded", "policy")


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
        require_crypto(secret, self.mac)    # fails now, at start, if blake3 or cryptography is missing
        self.username = username or self.target.username
        self.password = password
        self.algorithm = checksum_algorithm(checksum)
        self.breaker = Breaker()
        self._warn = {kind: Throttle(logger) for kind in WARNINGS}
        self._lock = threading.Lock()      # guards the client's creation and replacement
        self._local = threading.local()    # each writer thread's staging buffer
        self._client: Any = None
        self._glide = _import_glide()
        self._tls = resp.tls_context(ca_pem) if self.target.tls else None
        self._reads = threading.local()    # each reader thread's connections, by node
        self._conns: set[resp.Connection] = set()     # every reader connection open, for close
        self.slots = SlotMap(self.target.nodes, self._ask_slots)    # a cluster's slot map
        self._usage = (0, 0, 0)
        self._usage_at = 0.0
        self._closed = False
        if secret is None:
            logger.warning(UNSIGNED_WARNING, self.target.describe())

    # ---- keys and the client ------------------------------------------------------------
    def remote_key(self, uid: int, key: bytes) -> bytes:
        return self.prefix + b"%08x:" % uid + key.hex().encode()

    def _group(self, rkey: bytes) -> int:
        return slot_group(rkey) if self.target.cluster else 0

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

    def _stream(self, buf: Optional[memoryview]) -> Optional[Streamed]:
        """A ``Streamed`` for a value read into ``buf`` in more than one piece (``resp.PIECE``);
        None for a shorter one: it is still in the cache when it has all arrived."""
        return Streamed(buf, self.secret) if buf is not None and len(buf) > resp.PIECE else None

    def _checked(self, uid: int, key: bytes, rkey: bytes, meta: ChunkMeta, buf: memoryview, dest: memoryview,
                 copy: bool, t0: float, stream: Optional[Streamed] = None) -> bool:
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
    def _get(self, rkey: bytes, buf: memoryview, stream: Optional[Streamed] = None) -> bool:
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

    def _node(self, rkey: bytes) -> Node:
        """The node that serves ``rkey``: the server, or its slot's primary in the cluster."""
        return self.slots.node(rkey) if self.target.cluster else self.target.nodes[0]

    def _moved(self, moved: tuple[int, str, int], asked: Node) -> Node:
        """Where a ``MOVED`` or ``ASK`` says a slot is: noted in the map, which is re-read."""
        return self.slots.moved(moved, asked)

    def _ask_slots(self, node: Node) -> Optional[dict[int, Node]]:
        """``CLUSTER SLOTS`` of ``node`` (for ``SlotMap``), or None if it did not answer."""
        try:
            return resp.slot_map(self._conn(node).call((b"CLUSTER", b"SLOTS")))
        except (OSError, resp.ProtocolError, resp.ErrorReply, _Skip) as exc:
            logger.debug("lmshm: CLUSTER SLOTS on %s:%d failed: %s", node[0], node[1], exc)
            return None

    def _conn(self, node: Node) -> resp.Connection:
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
            self._warn["breaker"].warning("lmshm: the remote tier %s failed %d times in a row (%s: %.200s); "
                               "skipping it for a while", self.target.describe(), BREAKER_FAILURES,
                               type(exc).__name__, str(exc))
        else:
            self._warn[op].warning("lmshm: remote %s on %s failed (%s: %.200s): a miss", op,
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
        self._warn["corrupt"].warning("lmshm: remote value %r refused (%s): a miss, never served", rkey[:80], exc)

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
            self._warn["unbounded"].warning("lmshm: the remote %s has no maxmemory and --remote-ttl is 0: it will "
                               "grow without bound; set maxmemory with an allkeys-lru policy (the eviction "
                               "authority), or --remote-ttl", self.target.describe())
        elif policy and not policy.startswith("allkeys-"):
            self._warn["policy"].warning("lmshm: the remote %s evicts with maxmemory-policy %s: lmshm's keys have no "
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


def _import_glide() -> Any:
    """The client library, imported only when a remote is configured."""
    try:
        import glide_sync
        from glide_sync import Logger, LogLevel
    except ImportError:
        raise ImportError("--remote needs the valkey-glide-sync package: pip install 'lmshm[remote]'") from None
    Logger.set_logger_config(LogLevel.OFF)      # failures are counted and logged here, rate-limited
    return glide_sync
