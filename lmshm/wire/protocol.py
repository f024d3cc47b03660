"""The lmshm wire protocol, version 3.8: every request and reply, its code, fields and limits.

A request travels as ``[request_id, body]`` on a ZeroMQ DEALER to the server's ROUTER; its one
reply comes back with the same ``request_id``: the matching ``*Reply``, or ``ErrorReply`` with
an ``ErrorCode``. ``body`` is one msgpack map (``codec.py``) whose ``"type"`` is a ``MsgType``.
Codes are explicit and never change meaning: requests 1..99, replies 101..199.

Limits live next to the fields (msgspec ``Meta``) and bound what decoding may build; the
server's configurable limits are tighter and checked after decoding. The core takes and returns
these structs as they are, so this package imports nothing of ``core`` (the layering test).

One file, over 600 lines on purpose: it is the spec, read top to bottom. Sessions, identity,
the data plane's rules and the version history: docs/design/wire-protocol.md. The trap: a
field added to a reply breaks older clients (they refuse unknown fields); add a minor version.
"""

from __future__ import annotations

import sys
from enum import IntEnum
from typing import TYPE_CHECKING, Annotated, Optional, Union

import msgspec

from lmshm.wire.vllm_events import AllBlocksCleared, BlockRemoved, BlockStored

if TYPE_CHECKING:
    from lmshm.platform.base.ipc_wrapper import DeviceIPCWrapper as WireWrapper
else:

    class _AnyWrapperType(type):
        def __instancecheck__(cls, obj: object) -> bool:
            # No wrapper exists unless the wrapper module was imported: never import it here.
            module = sys.modules.get("lmshm.platform.base.ipc_wrapper")
            return module is not None and isinstance(obj, module.DeviceIPCWrapper)

    class WireWrapper(metaclass=_AnyWrapperType):
        """The type msgspec sees for ``LayerGroup.wrapper``: any lmshm IPC wrapper.

        A stand-in for ``DeviceIPCWrapper`` (which type checkers see), so that the protocol,
        and ``lmshm status`` with it, never imports the wrapper machinery and torch:
        ``isinstance(w, WireWrapper)`` is ``isinstance(w, DeviceIPCWrapper)``, looked up lazily.
        ``codec``'s ``dec_hook`` accepts a wrapper there (ext code 1, decoded by ``safe_loads``)
        and refuses any other value.
        """

        __slots__ = ()


#: ``(PROTOCOL_VERSION, PROTOCOL_MINOR)``. The major is bumped whenever a message changes
#: incompatibly; the minor when fields or messages are added that older peers can ignore. HELLO
#: refuses another major, and a client whose minor is newer than the server's.
PROTOCOL_VERSION = 3
PROTOCOL_MINOR = 8

PEEK_MAX_BYTES = 4096
STATUS_PAGE = 1000       # registrations one STATUS reply lists at most


#: Hard caps of the wire (the server's settings may be tighter).
MAX_TEXT = 4096          # characters of any name or free-text field
MAX_LAYERS = 65536       # layers of one registration
MAX_GROUPS = 65536       # wrapper groups of one registration
MAX_KEY_BYTES = 64       # one chunk key
MAX_KEYS = 65536         # chunk keys of one STORE, RETRIEVE or LOOKUP (all ranks together)
MAX_BLOCK_IDS = 1 << 20  # block ids of one STORE or RETRIEVE
MAX_WORLD = 1024         # ranks of one LOOKUP
LEASE_BYTES = 16
MAX_BLOCK_DIM = 15       # the highest block_dim a registration may name

Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]


class MsgType(IntEnum):
    """The ``type`` tag of every message body. Explicit and stable: never renumber."""

    HELLO = 1
    REGISTER_KV_CACHE = 2
    UNREGISTER_KV_CACHE = 3
    STATUS = 4
    PING = 5
    PEEK = 6
    STORE = 7
    LOOKUP = 8
    RETRIEVE = 9
    RELEASE = 10
    KV_EVENTS = 11               # 3.7

    HELLO_REPLY = 101
    REGISTER_REPLY = 102
    UNREGISTER_REPLY = 103
    STATUS_REPLY = 104
    PONG = 105
    PEEK_REPLY = 106
    STORE_REPLY = 107
    LOOKUP_REPLY = 108
    RETRIEVE_REPLY = 109
    RELEASE_REPLY = 110
    STATUS_PAGE_REPLY = 111      # 3.4
    KV_EVENTS_REPLY = 112        # 3.7
    ERROR = 199


class ErrorCode(IntEnum):
    """Why a request failed. Explicit and stable: never renumber."""

    INVALID_ARG = 1        # malformed frame, undecodable body, bad field, unmappable layer
    ALREADY_EXISTS = 2     # a different registration already lives under this instance id
    NOT_FOUND = 3          # no such instance id (or layer, or region of that kind)
    UNAVAILABLE = 4        # no session (send HELLO), a limit reached, or shutting down
    UNSUPPORTED = 5        # protocol or API version, or isolated_ipc disagreement, unknown request
    PERMISSION_DENIED = 6  # identity not verified, not the owner, memory the peer does not own
    INTERNAL = 7           # a server bug: the handler raised
    LAYOUT = 8             # the registration's layout cannot be moved, or differs from the stored object's
    DATA_LOSS = 9          # a copy failed (memory truncated under the server); nothing was made visible


class Message(msgspec.Struct, frozen=True, tag_field="type", forbid_unknown_fields=True):
    """Base of every message: a msgpack map whose ``"type"`` field holds its ``MsgType``."""


# ---- what a registration is made of -------------------------------------------------------


class LayerGroup(msgspec.Struct, frozen=True, array_like=True):
    """Consecutive KV-cache layers that one wrapper reaches (ext code 1).

    Layer ``i`` of the group is named ``names[i]`` and is ``wrapper`` with its
    ``storage_offset`` replaced by ``storage_offsets[i]`` (elements): same memory object,
    dtype, shape and stride -- typically the per-layer views of one KV pool, so a
    128-layer pool travels as one wrapper and two lists. Only kinds whose wrapper is
    ``groupable`` may carry more than one layer; any other group has exactly one layer, at
    the wrapper's own storage offset.
    """

    wrapper: WireWrapper     # a DeviceIPCWrapper (see WireWrapper)
    names: Annotated[list[Text], msgspec.Meta(max_length=MAX_LAYERS)]
    storage_offsets: Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=1 << 48)]],
                               msgspec.Meta(max_length=MAX_LAYERS)]


# ---- the data plane's requests --------------------------------------------------------


Key = Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_KEY_BYTES)]
Keys = Annotated[list[Key], msgspec.Meta(max_length=MAX_KEYS)]
BlockIds = Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=1 << 48)]], msgspec.Meta(max_length=MAX_BLOCK_IDS)]
ChunkBlocks = Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
Lease = Annotated[bytes, msgspec.Meta(max_length=LEASE_BYTES)]
#: The worker's ordering token for a copy on a CUDA registration (dataplane.md): a
#: cudaIpcEventHandle (64 bytes), an isolated-mode flag token (``cuda_sync.flag_token``), or empty.
Event = Annotated[bytes, msgspec.Meta(max_length=64)]
WaitS = Annotated[float, msgspec.Meta(ge=0, le=3600)]

#: 3.7, KV events (docs/design/kv-events.md): what a stored chunk is to its engine.
MAX_ADVERT_BLOCKS = 1024      # engine blocks of one chunk
MAX_ADVERT_TOKENS = 1 << 16   # tokens of one chunk
MAX_SPACES = 16               # namespaces one KV_EVENTS reads
BlockHash = Union[int,   # msgpack bounds it: int64 or uint64
                  Annotated[bytes, msgspec.Meta(max_length=64)]]
#: an Advert's extra keys: vLLM's per-block list (LoRA name, (mm id, offset) pairs, cache salt,
#: prompt-embeds digests), msgpack-encoded; the server checks it (kv_events.check_extra_keys)
ExtraKeys = Optional[Annotated[bytes, msgspec.Meta(max_length=1 << 16)]]
Space = Annotated[bytes, msgspec.Meta(max_length=MAX_KEY_BYTES)]


class Advert(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """3.7: one STORE chunk as its engine knows it, for the server's KV events. The fields are
    vLLM's ``BlockStored`` fields for the engine blocks the chunk is made of."""

    chunk: Key               # the chunk's identity, the same on every rank (the connector: rank 0's key)
    group: Annotated[int, msgspec.Meta(ge=0, le=MAX_GROUPS)]   # the engine's KV cache group (group_idx)
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    block_hashes: Annotated[list[BlockHash], msgspec.Meta(min_length=1, max_length=MAX_ADVERT_BLOCKS)]
    parent_block_hash: Optional[BlockHash] = None
    token_ids: Annotated[list[Annotated[int, msgspec.Meta(ge=-(1 << 31), le=(1 << 31) - 1)]],
                         msgspec.Meta(max_length=MAX_ADVERT_TOKENS)] = []
    lora_name: Optional[Text] = None
    extra_keys: ExtraKeys = None
    # 3.8: the token ids packed, little-endian int32, 4 bytes a token (then token_ids is empty):
    # decoded as one bytes object instead of a list of ints (docs/design/kv-events.md)
    tokens: Annotated[bytes, msgspec.Meta(max_length=4 * MAX_ADVERT_TOKENS)] = b""


class Store(Message, tag=int(MsgType.STORE)):
    """Copy whole chunks of blocks from a registration the caller owns into the server's pool.

    Chunk ``i`` is stored under ``keys[i]`` from the blocks
    ``block_ids[i * chunk_blocks:(i + 1) * chunk_blocks]``, of every layer, in registration
    order. A chunk becomes visible to LOOKUP only once its copy has completed.
    """

    instance_id: Text
    keys: Keys
    block_ids: BlockIds
    chunk_blocks: ChunkBlocks
    event: Event = b""       # CUDA: the worker's event recorded after the blocks were written
    # 3.6: how long the sender waits for the reply, in seconds (0: unknown). Past it the
    # sender may reuse the blocks, so the server commits nothing it copied later than that.
    wait_s: WaitS = 0.0
    # 3.7, KV events: one Advert per key (or none: nothing is advertised), the engine's
    # namespace (the same for every rank: KV_EVENTS reads by it) and its pod name for topics.
    # The adverts stay encoded (a msgpack array of Advert, ``pack_adverts``; the same bytes as
    # the list): the server reads their count on the request's path (``advert_count``) and
    # decodes them off it, when the KV event index applies its queue (``unpack_adverts``), so
    # an advert that does not decode refuses that STORE's adverts (counted), never the STORE
    adverts: msgspec.Raw = msgspec.Raw(b"\x90")    # an empty array (an empty Raw encodes as nothing)
    space: Space = b""
    pod: Annotated[str, msgspec.Meta(max_length=256)] = ""


_advert_encoder = msgspec.msgpack.Encoder()
_advert_decoder = msgspec.msgpack.Decoder(Annotated[list[Advert], msgspec.Meta(max_length=MAX_KEYS)])


def pack_adverts(adverts: Optional[list[Advert]]) -> msgspec.Raw:
    """``Store.adverts`` for a list of ``Advert`` (none: an empty array)."""
    return msgspec.Raw(_advert_encoder.encode(list(adverts) if adverts else []))


def advert_count(adverts: msgspec.Raw) -> int:
    """How many adverts ``Store.adverts`` holds, from its msgpack array header alone, or
    ``ValueError`` when it is not an array of at most ``MAX_KEYS``."""
    head = memoryview(adverts)
    if not len(head):
        return 0
    tag = head[0]
    if 0x90 <= tag <= 0x9F:
        n = tag & 0x0F
    elif tag == 0xDC and len(head) >= 3:
        n = int.from_bytes(head[1:3], "big")
    elif tag == 0xDD and len(head) >= 5:
        n = int.from_bytes(head[1:5], "big")
    else:
        raise ValueError("adverts must be an array of Advert")
    if n > MAX_KEYS:
        raise ValueError(f"{n} adverts; at most {MAX_KEYS}")
    return n


def unpack_adverts(adverts: msgspec.Raw) -> list[Advert]:
    """The ``Advert``s of ``Store.adverts``; ``msgspec.DecodeError`` (a ``ValidationError``
    among them) when they are not well formed."""
    return _advert_decoder.decode(adverts)


class Lookup(Message, tag=int(MsgType.LOOKUP)):
    """How many leading chunks are stored for every rank; pin them under a lease.

    ``keys[r]`` are rank ``r``'s chunk keys, in prompt order; every rank lists the same number.
    A chunk counts only if all ranks have it. ``ttl_s`` (capped by the server) bounds the pin.
    """

    keys: Annotated[list[Keys], msgspec.Meta(min_length=1, max_length=MAX_WORLD)]
    ttl_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 0.0   # 0 = the server's default


class Retrieve(Message, tag=int(MsgType.RETRIEVE)):
    """Copy stored chunks into blocks of a registration the caller owns. All or nothing.

    ``lease``, if given, is the LOOKUP lease that pinned these keys; its pins of them end with
    this request, whatever its outcome.
    """

    instance_id: Text
    keys: Keys
    block_ids: BlockIds
    chunk_blocks: ChunkBlocks
    lease: Lease = b""
    event: Event = b""       # CUDA: the worker's event recorded after it last used the blocks
    # 3.6: how long the sender waits for the reply (0: unknown). Past it the sender computes
    # the blocks itself, so the server starts no copy into them that late.
    wait_s: WaitS = 0.0


class Release(Message, tag=int(MsgType.RELEASE)):
    """End a LOOKUP lease before its TTL (unknown or expired leases are not an error)."""

    lease: Lease


class KvEvents(Message, tag=int(MsgType.KV_EVENTS)):
    """3.7: the KV events of the caller's uid in ``spaces`` after position ``after`` of the
    server's event log (-1: from the oldest it keeps). Needs a verified session."""

    spaces: Annotated[list[Space], msgspec.Meta(min_length=1, max_length=MAX_SPACES)]
    after: Annotated[int, msgspec.Meta(ge=-1, le=1 << 62)] = -1
    limit: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1024


# ---- the data plane's replies, the pool's status, errors -------------------------------------


class StoreResult(IntEnum):
    """What STORE did with one chunk."""

    STORED = 0        # copied now
    PRESENT = 1       # already stored (or being stored by an earlier request): skipped
    NO_SPACE = 2      # the pool is full of pinned or in-flight objects: skipped, not an error


class StoreReply(Message, tag=int(MsgType.STORE_REPLY)):
    results: list[int]       # one StoreResult per key
    nbytes: int              # bytes copied (CUDA: queued; done once ``event`` has completed)
    event: bytes = b""       # CUDA: the server's event; wait on it before reusing the blocks


class LookupReply(Message, tag=int(MsgType.LOOKUP_REPLY)):
    hits: int                # leading chunks present for every rank
    lease: bytes             # pins those chunks (all ranks); empty when hits == 0
    ttl_s: float             # the lease ends this many seconds from now, at the latest


class RetrieveReply(Message, tag=int(MsgType.RETRIEVE_REPLY)):
    chunks: int
    nbytes: int
    event: bytes = b""       # CUDA: the server's event; wait on it before reading the blocks


class ReleaseReply(Message, tag=int(MsgType.RELEASE_REPLY)):
    released: bool           # False: the lease had already ended


class KvEventsReply(Message, tag=int(MsgType.KV_EVENTS_REPLY)):
    epoch: str               # the server's id: a new one means it restarted and holds nothing advertised before
    cursor: int              # pass as ``after`` next time
    lost: bool               # events after ``after`` were dropped from the log before this read
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]   # vLLM's KV events, oldest first


class TierInfo(msgspec.Struct, frozen=True):
    """3.5: one storage tier below the pool (docs/design/tiers.md), as STATUS shows it."""

    name: str                # "disk" or "remote"
    capacity: int = 0        # bytes the tier may use (remote: the server's maxmemory; 0 = unknown or none)
    used: int = 0            # bytes it uses now (disk: files in whole 4 KiB pages; remote: the server's used_memory)
    objects: int = 0         # chunks it holds
    hits: int = 0            # chunks LOOKUP found here (not in the pool)
    misses: int = 0          # chunks LOOKUP looked for here and did not find, or could not read in time
    promotions: int = 0      # chunks read back into the pool
    puts: int = 0            # chunks written through
    drops: int = 0           # writes not made: queue full, tier full, write failed, already held
    errors: int = 0          # failed reads and writes (I/O errors; remote: failed calls)
    timeouts: int = 0        # promotions not finished within the LOOKUP's bound (remote: calls timed out too)
    corrupt: int = 0         # chunks whose header, checksum or MAC did not match: missed (disk: deleted)
    evictions: int = 0       # chunks the tier dropped to stay within its capacity
    read_bytes: int = 0
    written_bytes: int = 0
    reads: int = 0
    writes: int = 0
    direct_writes: int = 0   # disk: chunks written with O_DIRECT, from the pool object past the page cache
    not_admitted: int = 0    # disk with --disk-admit second: stores not written, the chunk's first
    scanned: int = 0         # disk: files the index rebuild at start has looked at so far
    scan_done: bool = True   # disk: that rebuild has ended (until then, a chunk not reached yet is probed on disk)
    read_seconds: float = 0.0    # total time of the reads (mean latency = read_seconds / reads)
    write_seconds: float = 0.0
    queue_depth: int = 0     # write-throughs waiting
    queue_limit: int = 0
    probed: int = 0          # disk: chunks a LOOKUP found on disk before the index rebuild reached them


class PoolInfo(msgspec.Struct, frozen=True):
    capacity: int            # bytes; 0 = no data plane
    used: int                # bytes charged for objects, stored and in flight: extents and bookkeeping
    objects: int             # visible objects
    in_flight: int           # objects whose copy has not completed
    pinned: int              # objects pinned by leases or copies
    leases: int
    hits: int                # chunks LOOKUP found
    misses: int              # LOOKUPs that found fewer chunks than they asked for
    stored: int              # chunks stored
    store_skipped: int       # chunks skipped for lack of space
    evictions: int
    evicted_bytes: int
    retrieved: int           # chunks copied into workers
    failed: int              # STOREs and RETRIEVEs that failed
    # 3.3: what counts against the capacity and the per-uid caps (docs/design/dataplane.md)
    max_objects: int = 0     # the object cap (lmshm-server --max-objects); 0 = none
    metadata_bytes: int = 0  # the part of ``used`` charged for bookkeeping (objects x its cost per object)
    pinned_bytes: int = 0    # bytes charged for the pinned objects
    lease_pins: int = 0      # pins the leases hold (each lease pins each of its objects once)
    pins_capped: int = 0     # chunks LOOKUP found but did not pin: a per-uid cap
    uids: int = 0            # uids holding objects or leases
    # CUDA (docs/design/dataplane.md): pool bytes page-locked; requests whose copies outlived
    # --cuda-timeout (their bytes held until the GPU was done); server events let go early
    cuda_pinned_bytes: int = 0
    cuda_quarantined: int = 0
    cuda_events_dropped: int = 0
    # 3.6: STOREs and RETRIEVEs whose copy would have run (or completed) after their sender
    # stopped waiting (wait_s): refused, or not committed
    late: int = 0
    # how CUDA copies reach the driver: "batch" (one cuMemcpyBatchAsync per request), "per-piece"
    # (one cuMemcpyAsync per piece), "" before the first CUDA copy; driver calls that queued
    # copies, and the contiguous pieces they copied
    cuda_copy_path: str = ""
    cuda_copy_calls: int = 0
    cuda_copy_pieces: int = 0
    tiers: list[TierInfo] = []   # 3.5: the tiers below the pool, top first (none without --disk)


class ErrorReply(Message, tag=int(MsgType.ERROR)):
    code: int                # an ErrorCode
    message: str             # at most a few hundred characters; peer data in it is quoted and cut


# ---- session, registration and status requests -----------------------------------------


class Hello(Message, tag=int(MsgType.HELLO)):
    """Open (or resume) a session. Must precede REGISTER, UNREGISTER and PEEK.

    Carries no identity: the worker proves its pid and uid afterwards on the fd channel. A HELLO
    that does not decode (a field this version does not know) is read once more as
    ``HelloVersion``, so a newer client is told its version is the problem.
    """

    protocol_version: Annotated[int, msgspec.Meta(ge=0, le=1 << 31)]
    isolated_ipc: bool       # the worker's policy; must equal the server's
    client_name: Text = ""   # free text for status tables and logs
    resume_token: Annotated[str, msgspec.Meta(max_length=128)] = ""  # a session_token held before
    protocol_minor: Annotated[int, msgspec.Meta(ge=0, le=1 << 31)] = 0   # 3.0 clients send none


class HelloVersion(msgspec.Struct):
    """Only the version fields of a HELLO, whatever else it carries (see ``Hello``)."""

    type: int
    protocol_version: int = 0
    protocol_minor: int = 0


class RegisterKVCache(Message, tag=int(MsgType.REGISTER_KV_CACHE)):
    """Map every layer now, all or nothing, and keep them under ``instance_id``."""

    instance_id: Text        # 1..max_name_bytes printable characters, chosen by the worker
    model_name: Text
    world_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    worker_rank: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]   # < world_size
    groups: Annotated[list[LayerGroup], msgspec.Meta(max_length=MAX_GROUPS)]  # engine order; names unique
    # 3.2: the dim of every layer's shape (as the worker sees it) whose index is the block id;
    # below every layer's number of dims. The data plane moves blocks along it.
    block_dim: Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_DIM)] = 0


class UnregisterKVCache(Message, tag=int(MsgType.UNREGISTER_KV_CACHE)):
    """Release ``instance_id``. Deferred while a data operation still holds it. Owner only."""

    instance_id: Text


class Status(Message, tag=int(MsgType.STATUS), omit_defaults=True):
    """Describe the server and a page of its registrations, oldest first. Needs no session.

    A reply lists at most ``STATUS_PAGE`` registrations, so its size is bounded however many
    are live. 3.4: ``offset`` and ``limit`` choose the page, and a client that sends ``minor``
    (its protocol minor, 4) gets a ``StatusPageReply``: also the total, its page's offset and a
    line per owner. A 3.3 client sends none of them (defaults are not encoded: ``Status()`` is
    the same bytes as before) and gets a ``StatusReply``, the first page. A 3.3 server refuses
    the fields (unknown field): the client then asks again without them.
    """

    offset: Annotated[int, msgspec.Meta(ge=0, le=1 << 32)] = 0
    limit: Annotated[int, msgspec.Meta(ge=0, le=STATUS_PAGE)] = STATUS_PAGE
    minor: Annotated[int, msgspec.Meta(ge=0, le=1 << 31)] = 0


class Ping(Message, tag=int(MsgType.PING)):
    """Empty round trip; also the client's heartbeat. Needs no session."""


class Peek(Message, tag=int(MsgType.PEEK)):
    """Read bytes of a registered layer *through the server's own mapping*. Owner only.

    A diagnostic: it proves zero copy (the worker writes, the server reads the same memory)
    and lets an operator check that a mapping is alive. ``length`` is capped at 4096 bytes.
    """

    instance_id: Text
    layer_name: Text
    offset: Annotated[int, msgspec.Meta(ge=0, le=1 << 62)] = 0      # bytes from the layer's first element
    length: Annotated[int, msgspec.Meta(ge=0, le=PEEK_MAX_BYTES)] = 64


Request = Union[Hello, RegisterKVCache, UnregisterKVCache, Status, Ping, Peek, Store, Lookup, Retrieve, Release,
                KvEvents]

#: Requests that are answered without a session.
SESSIONLESS = (Status, Ping)


# ---- session, registration and status replies -------------------------------------------


class HelloReply(Message, tag=int(MsgType.HELLO_REPLY)):
    protocol_version: int
    server_id: str           # random per server start: a new value means the server restarted
    server_pid: int          # as the server sees itself
    server_uid: int          # the fd socket's listener must run as this uid
    server_pid_ns: int       # inode of the server's PID namespace: same as the worker's -> compare pids
    session_id: int
    session_token: str       # present it on the fd channel to prove identity; resumes the session
    resumed: bool            # True: resume_token matched, earlier registrations are still there
    verified: bool           # True: this session's identity is already proven (a resumed session)
    fd_socket: str           # path of the fd side channel
    isolated_ipc: bool
    heartbeat_interval_s: float  # seconds between the client's PINGs
    reap_timeout_s: float        # silence after which an unwatched session is reclaimed
    auth_timeout_s: float        # the session must prove its identity within this
    max_message_bytes: int       # the largest request body the server accepts
    protocol_minor: int = 0


class RegisterReply(Message, tag=int(MsgType.REGISTER_REPLY)):
    instance_id: str
    num_layers: int
    nbytes: int              # total bytes of all layers' elements
    refreshed: bool          # True: an identical registration from this session already existed


class UnregisterReply(Message, tag=int(MsgType.UNREGISTER_REPLY)):
    instance_id: str
    deferred: bool           # True: released when the last data operation lets go


class RegistrationInfo(msgspec.Struct, frozen=True):
    instance_id: str
    owner_session: int
    owner_pid: int           # kernel-verified, in the server's PID namespace
    owner_uid: int
    client_name: str
    model_name: str
    world_size: int
    worker_rank: int
    num_layers: int
    nbytes: int
    kinds: list[str]         # wrapper kinds, e.g. ["cpu-shm"]
    devices: list[str]       # device identities, e.g. ["cpu"] or GPU UUIDs
    age_s: float             # seconds since registration
    # 3.1: regions registered through the HTTP/gRPC endpoints or the in-process API
    kind: str = "kv"         # "kv" (a worker's KV cache), "system" or "cuda" (a region)
    key: str = ""            # a system region's shm key
    offset: int = 0          # a system region's offset in its object
    device_id: int = -1      # a CUDA region's device
    block_dim: int = 0       # 3.2: a KV registration's block dimension


class OwnerSummary(msgspec.Struct, frozen=True):
    """3.4: what one owner holds. An owner is a session (``kind`` "kv"), or "regions": every
    region registered over HTTP, gRPC or in-process, whoever registered it."""

    kind: str
    owner_session: int       # 0 for the regions
    owner_pid: int           # of the session's worker (kernel-verified); 0 for the regions
    owner_uid: int           # -1 for the regions
    client_name: str         # the session's (the regions: the oldest region's)
    registrations: int
    layers: int
    nbytes: int


class StatusReply(Message, tag=int(MsgType.STATUS_REPLY)):
    server_id: str
    server_pid: int
    protocol_version: int
    isolated_ipc: bool
    uptime_s: float
    sessions: int
    mappings: int            # live entries in the server's mapping table
    draining: int            # unregistered but still held by a data operation
    open_fds: int            # file descriptors the server process has open now
    fd_limit: int            # its RLIMIT_NOFILE
    inbox_fds: int           # received fds not mapped yet
    registrations: list[RegistrationInfo]   # 3.4: the first STATUS_PAGE (a 3.3 server: every one)
    pool: PoolInfo
    protocol_minor: int = 0


class StatusPageReply(StatusReply, tag=int(MsgType.STATUS_PAGE_REPLY)):
    """3.4: STATUS's reply to a client that sent ``Status.minor`` >= 4 (a 3.3 client gets
    ``StatusReply``: it refuses unknown fields). ``registrations`` is the page asked for."""

    registrations_total: int = 0     # live registrations in all
    offset: int = 0                  # the place of ``registrations[0]`` among them, oldest first
    owners: list[OwnerSummary] = []  # one line per owner: at most one per session, and the regions


class Pong(Message, tag=int(MsgType.PONG)):
    server_id: str
    session_known: bool      # False: this connection has no session (server restarted?)


class PeekReply(Message, tag=int(MsgType.PEEK_REPLY)):
    data: bytes


Reply = Union[HelloReply, RegisterReply, UnregisterReply, StatusReply, StatusPageReply, Pong, PeekReply, StoreReply,
              LookupReply, RetrieveReply, ReleaseReply, KvEventsReply, ErrorReply]
