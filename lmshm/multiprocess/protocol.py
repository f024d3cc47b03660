"""The lmshm wire protocol, version 1: every request, every reply, their codes and fields.

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
"""

from __future__ import annotations

import os
from enum import IntEnum
from typing import Annotated, Union

import msgspec

from lmshm.platform.base.ipc_wrapper import DeviceIPCWrapper

#: Bumped whenever a message changes incompatibly. HELLO refuses a different version.
PROTOCOL_VERSION = 1


class MsgType(IntEnum):
    """The ``type`` tag of every message body. Explicit and stable: never renumber."""

    HELLO = 1
    REGISTER_KV_CACHE = 2
    UNREGISTER_KV_CACHE = 3
    STATUS = 4
    PING = 5
    PEEK = 6

    HELLO_REPLY = 101
    REGISTER_REPLY = 102
    UNREGISTER_REPLY = 103
    STATUS_REPLY = 104
    PONG = 105
    PEEK_REPLY = 106
    ERROR = 199


class ErrorCode(IntEnum):
    """Why a request failed. Explicit and stable: never renumber."""

    INVALID_ARG = 1        # malformed frame, undecodable body, bad field, unmappable layer
    ALREADY_EXISTS = 2     # a different registration already lives under this instance id
    NOT_FOUND = 3          # no such instance id (or layer)
    UNAVAILABLE = 4        # no session for this connection (send HELLO), or shutting down
    UNSUPPORTED = 5        # protocol version or isolated_ipc disagreement, unknown request
    PERMISSION_DENIED = 6  # not the owner of the registration; wrong uid on the fd channel
    INTERNAL = 7           # a server bug: the handler raised


class _Message(msgspec.Struct, frozen=True, tag_field="type", forbid_unknown_fields=True):
    pass


# ---- requests ---------------------------------------------------------------------------


class Hello(_Message, tag=int(MsgType.HELLO)):
    """Open (or resume) a session. Must precede REGISTER, UNREGISTER and PEEK."""

    protocol_version: int
    pid: int                 # the worker's pid, as the worker sees it
    boot_id: str             # /proc/sys/kernel/random/boot_id: same value means same host
    pid_namespace: str       # readlink /proc/self/ns/pid, e.g. "pid:[4026531836]"
    isolated_ipc: bool       # the worker's policy; must equal the server's
    client_name: str = ""    # free text for status tables and logs
    resume_token: str = ""   # the session_token of a session this client held before


def host_identity() -> tuple[str, str]:
    """The ``(boot_id, pid_namespace)`` a HELLO carries; equal on both sides = same pid space."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = ""
    return boot_id, pid_ns


class LayerGroup(msgspec.Struct, frozen=True, array_like=True):
    """Consecutive KV-cache layers that one wrapper reaches (ext code 1).

    Layer ``i`` of the group is named ``names[i]`` and is ``wrapper`` with its
    ``storage_offset`` replaced by ``storage_offsets[i]`` (elements): same memory object,
    dtype, shape and stride -- typically the per-layer views of one KV pool, so a
    128-layer pool travels as one wrapper and two lists. Only kinds whose wrapper is
    ``groupable`` may carry more than one layer; any other group has exactly one layer, at
    the wrapper's own storage offset.
    """

    wrapper: DeviceIPCWrapper
    names: list[str]
    storage_offsets: list[Annotated[int, msgspec.Meta(ge=0)]]


class RegisterKVCache(_Message, tag=int(MsgType.REGISTER_KV_CACHE)):
    """Map every layer now, all or nothing, and keep them under ``instance_id``."""

    instance_id: str         # 1..256 printable characters, chosen by the worker
    model_name: str
    world_size: int          # >= 1
    worker_rank: int         # 0 <= worker_rank < world_size
    groups: list[LayerGroup]  # layers in the engine's order, runs grouped; names unique


class UnregisterKVCache(_Message, tag=int(MsgType.UNREGISTER_KV_CACHE)):
    """Release ``instance_id``. Deferred while a data operation still holds it."""

    instance_id: str


class Status(_Message, tag=int(MsgType.STATUS)):
    """Describe the server and every registration. Needs no session."""


class Ping(_Message, tag=int(MsgType.PING)):
    """Empty round trip; also the client's heartbeat. Needs no session."""


class Peek(_Message, tag=int(MsgType.PEEK)):
    """Read bytes of a registered layer *through the server's own mapping*.

    A diagnostic: it proves zero copy (the worker writes, the server reads the same memory)
    and lets an operator check that a mapping is alive. ``length`` is capped at 4096 bytes.
    """

    instance_id: str
    layer_name: str
    offset: int = 0          # bytes from the first element of the layer
    length: int = 64         # bytes, 0..4096


Request = Union[Hello, RegisterKVCache, UnregisterKVCache, Status, Ping, Peek]

#: Requests that are answered without a session.
SESSIONLESS = (Status, Ping)

PEEK_MAX_BYTES = 4096


# ---- replies ----------------------------------------------------------------------------


class HelloReply(_Message, tag=int(MsgType.HELLO_REPLY)):
    protocol_version: int
    server_id: str           # random per server start: a new value means the server restarted
    server_pid: int
    session_id: int
    session_token: str       # authenticates the fd channel; resumes the session after a reset
    resumed: bool            # True: resume_token matched, earlier registrations are still there
    fd_socket: str           # path of the fd side channel ("" if the server runs none)
    isolated_ipc: bool
    heartbeat_interval_s: float  # seconds between the client's PINGs
    reap_timeout_s: float        # seconds of silence after which the server reclaims a session
    max_message_bytes: int       # the largest request body the server accepts
    pid_watched: bool            # True: the server watches the worker pid (pidfd)


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
    owner_pid: int
    client_name: str
    model_name: str
    world_size: int
    worker_rank: int
    num_layers: int
    nbytes: int
    kinds: list[str]         # wrapper kinds, e.g. ["cpu-shm"]
    devices: list[str]       # device identities, e.g. ["cpu"] or GPU UUIDs
    age_s: float             # seconds since registration


class StatusReply(_Message, tag=int(MsgType.STATUS_REPLY)):
    server_id: str
    server_pid: int
    protocol_version: int
    isolated_ipc: bool
    uptime_s: float
    sessions: int
    mappings: int            # live entries in the server's mapping table
    draining: int            # unregistered but still held by a data operation
    registrations: list[RegistrationInfo]


class Pong(_Message, tag=int(MsgType.PONG)):
    server_id: str
    session_known: bool      # False: this connection has no session (server restarted?)


class PeekReply(_Message, tag=int(MsgType.PEEK_REPLY)):
    data: bytes


class ErrorReply(_Message, tag=int(MsgType.ERROR)):
    code: int                # an ErrorCode
    message: str


Reply = Union[HelloReply, RegisterReply, UnregisterReply, StatusReply, Pong, PeekReply, ErrorReply]
