"""The lmshm wire protocol, version 3.8: every request, every reply, their codes and fields.

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

Two files, one spec: what the core itself takes and returns -- the table of codes
(``MsgType``), the wire's hard caps, ``LayerGroup``, the data plane's requests and replies,
``PoolInfo`` and ``ErrorReply`` -- is declared in
``lmshm/core/messages.py`` (the core imports nothing of ``multiprocess``) and re-exported here
under the same names. This file adds the session and registration messages and the unions.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec

from lmshm.core.errors import ErrorCode  # noqa: F401 - part of the protocol's vocabulary
from lmshm.core.messages import (  # noqa: F401 - re-exported: the wire carries the core's messages as they are
    LEASE_BYTES,
    MAX_BLOCK_DIM,
    MAX_BLOCK_IDS,
    MAX_GROUPS,
    MAX_KEY_BYTES,
    MAX_KEYS,
    MAX_LAYERS,
    MAX_TEXT,
    MAX_WORLD,
    Advert,
    BlockIds,
    ChunkBlocks,
    ErrorReply,
    Event,
    Key,
    Keys,
    KvEvents,
    KvEventsReply,
    LayerGroup,
    Lease,
    Lookup,
    LookupReply,
    Message,
    MsgType,
    PoolInfo,
    Release,
    ReleaseReply,
    Retrieve,
    RetrieveReply,
    Store,
    StoreReply,
    StoreResult,
    Text,
    TierInfo,
    WireWrapper,
    advert_count,
    pack_adverts,
    unpack_adverts,
)

#: ``(PROTOCOL_VERSION, PROTOCOL_MINOR)``. The major is bumped whenever a message changes
#: incompatibly; the minor when fields or messages are added that older peers can ignore. HELLO
#: refuses another major, and a client whose minor is newer than the server's.
PROTOCOL_VERSION = 3
PROTOCOL_MINOR = 8

PEEK_MAX_BYTES = 4096
STATUS_PAGE = 1000       # registrations one STATUS reply lists at most


# ---- requests ---------------------------------------------------------------------------


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


# ---- replies ----------------------------------------------------------------------------


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
