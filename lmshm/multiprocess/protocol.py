"""The lmshm wire protocol, version 3.3: every request, every reply, their codes and fields.

A conversation is a ZeroMQ DEALER (worker) talking to the server's ROUTER. Each request
travels as two frames, ``[request_id, body]``; the reply to it comes back as
``[request_id, body]`` with the same 8-byte ``request_id``, so a client can drop a late
reply to a request it already gave up on. ``body`` is one msgpack map (see ``codec.py``)
whose ``"type"`` field holds the message code below.

**Every request gets exactly one reply**: the matching ``*Reply`` struct, or ``ErrorReply``
with an ``ErrorCode`` and a human-readable message. A handler that raises produces an
``INTERNAL`` error reply, never silence.

Codes are explicit integers and never change meaning; a new message takes a new code.
Requests use 1..99, replies 101..199. ``HELLO`` must come first on a connection, except for
``PING`` and ``STATUS``, which need no session (so ``lmshm status`` can ask without one).

Identity is never taken from a message: HELLO opens a session and hands out its secret token;
the worker proves who it is by presenting the token on the fd channel (``fdchannel.py``), where
the kernel reports its pid and uid. REGISTER, UNREGISTER and PEEK need that verified identity.

The data plane (STORE, LOOKUP, RETRIEVE, RELEASE) moves KV blocks between a worker's registered
memory and the server's pool. KV bytes never travel in these messages: only keys (opaque bytes
the engine computes, see ``lmshm.integrations.adapter``) and block ids. Each needs a verified
session; STORE and RETRIEVE only for an instance the caller owns; objects are visible only to
sessions of the uid that stored them. A client's STOREs and RETRIEVEs are applied in the order
it sent them, off the request loop; their replies may overtake other replies (match them by
request id).

Limits live next to the fields (msgspec ``Meta``): they bound what decoding may build. The
server's configurable limits (names, counts) are tighter and checked after decoding.
"""

from __future__ import annotations

import sys
from enum import IntEnum
from typing import TYPE_CHECKING, Annotated, Union

import msgspec

from lmshm.core.errors import ErrorCode  # noqa: F401 - part of the protocol's vocabulary

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
PROTOCOL_MINOR = 3

#: Hard caps of the wire (the server's settings may be tighter).
MAX_TEXT = 4096          # characters of any name or free-text field
MAX_LAYERS = 65536       # layers of one registration
MAX_GROUPS = 65536       # wrapper groups of one registration
PEEK_MAX_BYTES = 4096
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
    ERROR = 199


class _Message(msgspec.Struct, frozen=True, tag_field="type", forbid_unknown_fields=True):
    pass


# ---- requests ---------------------------------------------------------------------------


class Hello(_Message, tag=int(MsgType.HELLO)):
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


class RegisterKVCache(_Message, tag=int(MsgType.REGISTER_KV_CACHE)):
    """Map every layer now, all or nothing, and keep them under ``instance_id``."""

    instance_id: Text        # 1..max_name_bytes printable characters, chosen by the worker
    model_name: Text
    world_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    worker_rank: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]   # < world_size
    groups: Annotated[list[LayerGroup], msgspec.Meta(max_length=MAX_GROUPS)]  # engine order; names unique
    # 3.2: the dim of every layer's shape (as the worker sees it) whose index is the block id;
    # below every layer's number of dims. The data plane moves blocks along it.
    block_dim: Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_DIM)] = 0


class UnregisterKVCache(_Message, tag=int(MsgType.UNREGISTER_KV_CACHE)):
    """Release ``instance_id``. Deferred while a data operation still holds it. Owner only."""

    instance_id: Text


class Status(_Message, tag=int(MsgType.STATUS)):
    """Describe the server and every registration. Needs no session."""


class Ping(_Message, tag=int(MsgType.PING)):
    """Empty round trip; also the client's heartbeat. Needs no session."""


class Peek(_Message, tag=int(MsgType.PEEK)):
    """Read bytes of a registered layer *through the server's own mapping*. Owner only.

    A diagnostic: it proves zero copy (the worker writes, the server reads the same memory)
    and lets an operator check that a mapping is alive. ``length`` is capped at 4096 bytes.
    """

    instance_id: Text
    layer_name: Text
    offset: Annotated[int, msgspec.Meta(ge=0, le=1 << 62)] = 0      # bytes from the layer's first element
    length: Annotated[int, msgspec.Meta(ge=0, le=PEEK_MAX_BYTES)] = 64


Key = Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_KEY_BYTES)]
Keys = Annotated[list[Key], msgspec.Meta(max_length=MAX_KEYS)]
BlockIds = Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=1 << 48)]], msgspec.Meta(max_length=MAX_BLOCK_IDS)]
ChunkBlocks = Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
Lease = Annotated[bytes, msgspec.Meta(max_length=LEASE_BYTES)]
#: A cudaIpcEventHandle (64 bytes), or empty: orders a copy on a CUDA registration (dataplane.md).
Event = Annotated[bytes, msgspec.Meta(max_length=64)]


class Store(_Message, tag=int(MsgType.STORE)):
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


class Lookup(_Message, tag=int(MsgType.LOOKUP)):
    """How many leading chunks are stored for every rank; pin them under a lease.

    ``keys[r]`` are rank ``r``'s chunk keys, in prompt order; every rank lists the same number.
    A chunk counts only if all ranks have it. ``ttl_s`` (capped by the server) bounds the pin.
    """

    keys: Annotated[list[Keys], msgspec.Meta(min_length=1, max_length=MAX_WORLD)]
    ttl_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 0.0   # 0 = the server's default


class Retrieve(_Message, tag=int(MsgType.RETRIEVE)):
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


class Release(_Message, tag=int(MsgType.RELEASE)):
    """End a LOOKUP lease before its TTL (unknown or expired leases are not an error)."""

    lease: Lease


Request = Union[Hello, RegisterKVCache, UnregisterKVCache, Status, Ping, Peek, Store, Lookup, Retrieve, Release]

#: Requests that are answered without a session.
SESSIONLESS = (Status, Ping)


# ---- replies ----------------------------------------------------------------------------


class HelloReply(_Message, tag=int(MsgType.HELLO_REPLY)):
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


class RegisterReply(_Message, tag=int(MsgType.REGISTER_REPLY)):
    instance_id: str
    num_layers: int
    nbytes: int              # total bytes of all layers' elements
    refreshed: bool          # True: an identical registration from this session already existed


class UnregisterReply(_Message, tag=int(MsgType.UNREGISTER_REPLY)):
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


class StatusReply(_Message, tag=int(MsgType.STATUS_REPLY)):
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
    registrations: list[RegistrationInfo]
    pool: PoolInfo
    protocol_minor: int = 0


class Pong(_Message, tag=int(MsgType.PONG)):
    server_id: str
    session_known: bool      # False: this connection has no session (server restarted?)


class PeekReply(_Message, tag=int(MsgType.PEEK_REPLY)):
    data: bytes


class StoreResult(IntEnum):
    """What STORE did with one chunk."""

    STORED = 0        # copied now
    PRESENT = 1       # already stored (or being stored by an earlier request): skipped
    NO_SPACE = 2      # the pool is full of pinned or in-flight objects: skipped, not an error


class StoreReply(_Message, tag=int(MsgType.STORE_REPLY)):
    results: list[int]       # one StoreResult per key
    nbytes: int              # bytes copied (CUDA: queued; done once ``event`` has completed)
    event: bytes = b""       # CUDA: the server's event; wait on it before reusing the blocks


class LookupReply(_Message, tag=int(MsgType.LOOKUP_REPLY)):
    hits: int                # leading chunks present for every rank
    lease: bytes             # pins those chunks (all ranks); empty when hits == 0
    ttl_s: float             # the lease ends this many seconds from now, at the latest


class RetrieveReply(_Message, tag=int(MsgType.RETRIEVE_REPLY)):
    chunks: int
    nbytes: int
    event: bytes = b""       # CUDA: the server's event; wait on it before reading the blocks


class ReleaseReply(_Message, tag=int(MsgType.RELEASE_REPLY)):
    released: bool           # False: the lease had already ended


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


class ErrorReply(_Message, tag=int(MsgType.ERROR)):
    code: int                # an ErrorCode
    message: str             # at most a few hundred characters; peer data in it is quoted and cut


Reply = Union[HelloReply, RegisterReply, UnregisterReply, StatusReply, Pong, PeekReply, StoreReply, LookupReply,
              RetrieveReply, ReleaseReply, ErrorReply]
