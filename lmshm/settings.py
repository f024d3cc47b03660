"""``lmshm-server`` settings: one table, three layers, one validator.

Every setting is a field of ``ServerConfig`` (a msgspec Struct whose ``Meta`` constraints are the
rules) and a row of ``SETTINGS`` (its command-line flag, environment variable and TOML key).
``ServerConfig`` extends the core's own ``CoreConfig`` (``lmshm.core.config``: the pool, copies,
leases, regions, the sweep) with what the endpoints read, so the core takes it as it is.
Layers, lowest first: the field's default, the ``--config`` TOML file (top-level keys or a
``[lmshm-server]`` table), the environment, the command line. Strings from the environment are
converted by ``msgspec.convert(strict=False)`` -- the same library and constraint language as
the wire protocol -- so there is no hand-written coercion, and a bad value's error names the
setting in all three spellings.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Annotated, Any, Mapping, Optional

import msgspec

from lmshm.core.config import CoreConfig, Count, Ids, Positive
from lmshm.platform import ipc_policy
from lmshm.transport import mq

#: How the KV event stream names its topics (--kv-events-topic; the publisher reads it too).
TOPIC_MODES = ("node", "engine")


def check_endpoint(endpoint: str) -> str:
    """``endpoint`` if it is ``tcp://HOST:PORT``, ``ipc://PATH`` or ``inproc://NAME``, else ``ValueError``."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest:
        raise ValueError(f"{endpoint!r}: expected tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    if scheme == "tcp":
        host, sep, port = rest.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ValueError(f"{endpoint!r}: expected tcp://HOST:PORT with a port from 0 to 65535 "
                             "(HOST * binds every interface)")
    return endpoint


class ServerConfig(CoreConfig, kw_only=True, forbid_unknown_fields=True):
    """Every setting of ``lmshm-server``: the core's (``CoreConfig``: ``allowed_uids``,
    ``max_name_bytes``, ``max_regions``, ``sweep_interval_s`` and the data plane's) and these."""

    url: str = mq.DEFAULT_URL
    isolated_ipc: bool = False
    reap_timeout_s: Positive = 10.0
    fd_socket: str = ""                    # "" = derived from the endpoint (fdchannel.default_path)
    log_level: str = "INFO"
    # who may do what (allowed_uids, besides the server's own uid and root, is the core's)
    allowed_gids: Ids = []
    admin_uids: Ids = []                   # may PEEK and unregister any registration
    # limits
    max_message_bytes: Annotated[int, msgspec.Meta(ge=1024, le=1 << 31)] = mq.DEFAULT_MAX_MESSAGE_BYTES
    receive_queue: Count = 1000
    max_sessions: Count = 1024
    max_sessions_per_uid: Count = 256
    max_registrations_per_session: Count = 64
    max_layers_per_session: Count = 65536
    max_fds_per_session: Count = 1024
    auth_timeout_s: Positive = 5.0
    max_pending_auth: Count = 64
    # lmshm's own transport (lmshm/transport/mq.py): loop time for peers without a verified session
    unverified_share: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.25
    # Triton-compatible endpoints (lmshm.endpoints): off unless a port is given; 0 = a free port
    http_port: Optional[Annotated[int, msgspec.Meta(ge=0, le=65535)]] = None
    http_host: str = "127.0.0.1"
    grpc_port: Optional[Annotated[int, msgspec.Meta(ge=0, le=65535)]] = None
    grpc_host: str = "127.0.0.1"
    http_max_body_bytes: Annotated[int, msgspec.Meta(ge=256, le=1 << 30)] = 64 << 10
    grpc_max_message_bytes: Annotated[int, msgspec.Meta(ge=256, le=1 << 30)] = 64 << 10
    http_restricted_api: str = ""          # "HEADER=VALUE": required on the shared-memory routes
    http_allow_hosts: list[str] = []       # Host names answered besides addresses and localhost; "*": any
    grpc_restricted_api: str = ""
    endpoint_threads: Annotated[int, msgspec.Meta(ge=1, le=256)] = 4
    http_max_connections: Count = 256
    # Triton endpoints' deadlines and connection budget (lmshm/endpoints; docs/triton.md)
    http_idle_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 5.0
    http_request_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 5.0
    grpc_max_connections: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 64
    grpc_idle_timeout_s: Annotated[float, msgspec.Meta(ge=0.1, le=3600)] = 10.0
    grpc_request_timeout_s: Annotated[float, msgspec.Meta(ge=0.1, le=3600)] = 5.0
    # the KV event stream for routers (lmshm/endpoints/kv_stream/publisher.py), in vLLM's format; "" = off
    kv_events: str = ""
    kv_events_replay: str = ""             # a ROUTER for replay requests; "" = no replay
    kv_events_connect: bool = False        # connect --kv-events' tcp:// endpoint (a subscriber binds)
    kv_events_curve_secret: str = ""       # the stream's CURVE server certificate (zmq.auth format)
    kv_events_curve_clients: str = ""      # a directory of client certificates admitted (ZAP)
    kv_events_replay_batches: Count = 10000
    kv_events_replay_bytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)] = 64 << 20
    kv_events_hwm: Count = 10000           # batches queued for one subscriber; more are dropped for it
    kv_events_subscriber_bytes: Annotated[int, msgspec.Meta(ge=1 << 20, le=1 << 40)] = 64 << 20
    kv_events_topic: str = "node"          # node: kv@node:<name>@<model>; engine: kv@<pod>@<model>
    kv_events_node: Annotated[str, msgspec.Meta(max_length=255)] = ""   # "" = the host name

    @property
    def heartbeat_interval_s(self) -> float:
        return min(5.0, max(0.05, self.reap_timeout_s / 4))


@dataclass(frozen=True)
class Setting:
    field: str        # ServerConfig field ("" for host/port, folded into url)
    flag: str
    env: str
    toml: str
    help: str
    metavar: str = ""
    kind: str = "value"  # value | bool | list | size


SETTINGS: tuple[Setting, ...] = (
    Setting("url", "--url", "LMSHM_URL", "url", f"endpoint, tcp://HOST:PORT or ipc://PATH (default {mq.DEFAULT_URL})", "URL"),
    Setting("", "--host", "LMSHM_HOST", "host", "TCP host when --url is not given (default 127.0.0.1)", "HOST"),
    Setting("", "--port", "LMSHM_PORT", "port", "TCP port when --url is not given; 0 picks a free one (default 5555)", "N"),
    Setting("isolated_ipc", "--isolated-ipc", ipc_policy.ISOLATED_IPC_ENV, "isolated_ipc",
            "workers share neither /dev/shm nor an IPC namespace: CPU memory arrives as memfd fds (default off); "
            "workers must use the same setting", kind="bool"),
    Setting("reap_timeout_s", "--reap-timeout", "LMSHM_REAP_TIMEOUT", "reap_timeout",
            "reclaim a session the server cannot watch (no pidfd) after this many silent seconds (default 10); "
            "a pid-watched worker is reclaimed when its process exits, never for being slow", "SECONDS"),
    Setting("fd_socket", "--fd-socket", "LMSHM_FD_SOCKET", "fd_socket",
            "Unix socket where workers prove who they are and send fds (default: beside an ipc:// endpoint, "
            "else $TMPDIR/lmshm-<uid>/HOST-PORT.fds in a mode-0700 directory)", "PATH"),
    Setting("log_level", "--log-level", "LMSHM_LOG_LEVEL", "log_level", "DEBUG, INFO, WARNING or ERROR (default INFO)", "LEVEL"),
    Setting("allowed_uids", "--allow-uid", "LMSHM_ALLOW_UIDS", "allow_uids",
            "also admit workers running as this uid (repeatable; env: comma-separated). By default only the "
            "server's own uid and root may connect", "UID", "list"),
    Setting("allowed_gids", "--allow-gid", "LMSHM_ALLOW_GIDS", "allow_gids",
            "also admit workers in this group, primary or supplementary (repeatable)", "GID", "list"),
    Setting("admin_uids", "--admin-uid", "LMSHM_ADMIN_UIDS", "admin_uids",
            "workers of this uid may peek at and unregister any registration (repeatable; default: only "
            "the owning session may)", "UID", "list"),
    Setting("max_message_bytes", "--max-message-bytes", "LMSHM_MAX_MESSAGE_BYTES", "max_message_bytes",
            f"largest request accepted (default {mq.DEFAULT_MAX_MESSAGE_BYTES})", "N"),
    Setting("receive_queue", "--receive-queue", "LMSHM_RECEIVE_QUEUE", "receive_queue",
            "replies that may wait for a peer that does not read them; more are dropped (as libzmq's ZMQ_SNDHWM; "
            "default 1000). A peer's requests are read only as fast as the server takes them", "N"),
    Setting("max_sessions", "--max-sessions", "LMSHM_MAX_SESSIONS", "max_sessions",
            "sessions in total (default 1024; also capped by the open-file limit)", "N"),
    Setting("max_sessions_per_uid", "--max-sessions-per-uid", "LMSHM_MAX_SESSIONS_PER_UID", "max_sessions_per_uid",
            "verified sessions per worker uid (default 256)", "N"),
    Setting("max_registrations_per_session", "--max-registrations-per-session", "LMSHM_MAX_REGISTRATIONS",
            "max_registrations_per_session", "registrations one session may hold (default 64)", "N"),
    Setting("max_layers_per_session", "--max-layers-per-session", "LMSHM_MAX_LAYERS", "max_layers_per_session",
            "layers over all of one session's registrations (default 65536)", "N"),
    Setting("max_fds_per_session", "--max-fds-per-session", "LMSHM_MAX_FDS_PER_SESSION", "max_fds_per_session",
            "file descriptors one session may have waiting to be mapped (default 1024)", "N"),
    Setting("max_name_bytes", "--max-name-bytes", "LMSHM_MAX_NAME_BYTES", "max_name_bytes",
            "longest instance id, model, client or layer name, in UTF-8 bytes (default 256)", "N"),
    Setting("auth_timeout_s", "--auth-timeout", "LMSHM_AUTH_TIMEOUT", "auth_timeout",
            "seconds a new fd-channel connection, or a session, has to prove its identity (default 5)", "SECONDS"),
    Setting("max_pending_auth", "--max-pending-auth", "LMSHM_MAX_PENDING_AUTH", "max_pending_auth",
            "unverified sessions, and fd-channel connections that have sent nothing yet, held at once; past it "
            "the oldest gives way (default 64; for fd-channel connections at most 1/32 of the open-file limit)",
            "N"),
    Setting("sweep_interval_s", "--sweep-interval", "LMSHM_SWEEP_INTERVAL", "sweep_interval",
            "seconds between sweeps of /dev/shm names left by dead workers of the server's uid (default 10; "
            "0 = only at start)", "SECONDS"),
    Setting("unverified_share", "--unverified-share", "LMSHM_UNVERIFIED_SHARE", "unverified_share",
            "fraction of the server loop's time that requests of peers without a verified session (HELLO, PING, "
            "STATUS before the fd channel proved who they are) may use while verified workers send requests; they "
            "get the rest when none do. They wait their turn, least-served connection first, 2 per connection; more "
            "are answered UNAVAILABLE at once. The fd channel is served at least every 10 ms either way (default "
            "0.25; 1 = no limit)", "FRACTION"),
    Setting("capacity", "--capacity", "LMSHM_CAPACITY", "capacity",
            "bytes of the server's KV pool, e.g. 4GiB or 512MiB (default 2GiB; reserved at start, memory is used "
            "only as blocks are stored; 0 turns the data plane off)", "SIZE", "size"),
    Setting("copy_threads", "--copy-threads", "LMSHM_COPY_THREADS", "copy_threads",
            "threads that run STORE and RETRIEVE copies (default 2)", "N"),
    Setting("copy_through_mapping", "--copy-through-mapping", "LMSHM_COPY_THROUGH_MAPPING", "copy_through_mapping",
            "copy named-shm blocks with memmove through the server's mapping instead of preadv/pwritev through the "
            "file: up to 2x faster, but a worker that truncates its own segment during a copy can then crash the "
            "server (SIGBUS). Only for workers you trust. Sealed memfds (the default CPU kind) are always copied "
            "through the mapping, safely (default off)", kind="bool"),
    Setting("pool_huge_pages", "--pool-huge-pages", "LMSHM_POOL_HUGE_PAGES", "pool_huge_pages",
            "ask for transparent huge pages for the pool (madvise): a first STORE into untouched pool memory "
            "faults once per 2 MiB instead of once per 4 KiB (default on)", kind="bool"),
    Setting("prefault_pool", "--prefault-pool", "LMSHM_PREFAULT_POOL", "prefault_pool",
            "fault the whole pool in at start, on a background thread, so that no STORE waits for fresh pages; the "
            "pool then uses all of --capacity in memory from the start (default off: memory is used as blocks are "
            "stored)", kind="bool"),
    Setting("pool_populate_ahead", "--pool-populate-ahead", "LMSHM_POOL_POPULATE_AHEAD", "pool_populate_ahead",
            "keep this much of the pool populated past the most it ever held, on a background thread from the "
            "start, so that the first STOREs (and STOREs into memory the pool never used) find their pages there "
            "instead of waiting for the kernel to fault them in; the pool uses at most this much memory more than "
            "it ever held (default 256MiB; 0 = off; Linux >= 5.14, else nothing is populated)", "SIZE", "size"),
    Setting("cuda_pin", "--cuda-pin", "LMSHM_CUDA_PIN", "cuda_pin",
            "how the pool is page-locked for CUDA copies: lazy (in 256 MiB extents, as copies first use them; the "
            "default), start (all of it when the server starts: every page is then resident and locked), or off "
            "(never: the driver stages each copy, slower)", "MODE"),
    Setting("cuda_pin_extent", "--cuda-pin-extent", "LMSHM_CUDA_PIN_EXTENT", "cuda_pin_extent",
            "the pool is page-locked in extents of this size (a multiple of 4KiB; default 256MiB); a CUDA copy "
            "that would cross an extent's edge is cut in two there (the driver refuses a copy whose host memory "
            "is page-locked only in part)", "SIZE", "size"),
    Setting("cuda_copy_batch", "--cuda-copy-batch", "LMSHM_CUDA_BATCH", "cuda_copy_batch",
            "queue each CUDA STORE/RETRIEVE's copies with one cuMemcpyBatchAsync (CUDA 12.8+ drivers; older "
            "ones, and --cuda-pin off, copy piece by piece whatever this says); off: one cuMemcpyAsync per "
            "piece. lmshm status says "
            "which path runs (default on)", kind="bool"),
    Setting("cuda_timeout_s", "--cuda-timeout", "LMSHM_CUDA_TIMEOUT", "cuda_timeout",
            "longest a CUDA STORE/RETRIEVE's copies may take, waiting for the worker's ordering signal "
            "included, in seconds (the signal is waited for on the server's host before any copy is queued: one "
            "not given in time, or by a worker that died, fails the request with nothing queued); past it the "
            "request fails and the pool bytes it touched stay out of use until the GPU is done with them "
            "(default 30)", "SECONDS"),
    Setting("lease_ttl_s", "--lease-ttl", "LMSHM_LEASE_TTL", "lease_ttl",
            "longest a LOOKUP keeps its hits pinned, in seconds (default 30)", "SECONDS"),
    Setting("max_inflight_per_session", "--max-inflight-per-session", "LMSHM_MAX_INFLIGHT",
            "max_inflight_per_session", "STORE/RETRIEVE requests one session may have queued (default 256)", "N"),
    Setting("max_leases_per_session", "--max-leases-per-session", "LMSHM_MAX_LEASES", "max_leases_per_session",
            "LOOKUP leases one session may hold at once (default 4096)", "N"),
    Setting("max_objects", "--max-objects", "LMSHM_MAX_OBJECTS", "max_objects",
            "objects (stored chunks) the pool holds at most; more evict as a full pool does (default 262144: 2GiB of "
            "8KiB chunks; raise it for large pools of small chunks, at the price of longer rare stalls, see "
            "docs/design/dataplane.md; 0 = only --capacity bounds them). Each object is charged its bytes rounded "
            "up to 64 plus 640 bytes of bookkeeping against --capacity", "N"),
    Setting("max_pinned_fraction_per_uid", "--max-pinned-fraction-per-uid", "LMSHM_MAX_PINNED_FRACTION_PER_UID",
            "max_pinned_fraction_per_uid",
            "share of the pool one uid's pinned (looked-up) objects may take: this fraction of what the other uids "
            "leave unpinned (alone: of the whole pool). A LOOKUP past it pins only the leading chunks that fit, so "
            "the uids together never pin the whole pool and a STORE can always evict (default 0.5)",
            "FRACTION"),
    Setting("max_pins_per_uid", "--max-pins-per-uid", "LMSHM_MAX_PINS_PER_UID", "max_pins_per_uid",
            "object pins one uid's leases hold at once, over all its sessions (a lease pins each object once; "
            "default 1048576, about 8 bytes each)", "N"),
    Setting("max_leases_per_uid", "--max-leases-per-uid", "LMSHM_MAX_LEASES_PER_UID", "max_leases_per_uid",
            "LOOKUP leases one uid may hold at once, over all its sessions (default 16384)", "N"),
    Setting("disk", "--disk", "LMSHM_DISK", "disk",
            "keep chunks in this directory too, below the pool: STOREs are written through in the background, a "
            "LOOKUP reads back what the pool lost, and what was stored before a restart is found after it. One file "
            "per chunk, checked on read (docs/design/tiers.md). The directory must be the server's own, not "
            "writable by others, one server each (default: no disk tier)", "DIR"),
    Setting("disk_capacity", "--disk-capacity", "LMSHM_DISK_CAPACITY", "disk_capacity",
            "bytes the disk tier may use, e.g. 100GiB (required with --disk); least recently used chunks are "
            "deleted past 95%% of it, down to 90%%", "SIZE", "size"),
    Setting("disk_queue", "--disk-queue", "LMSHM_DISK_QUEUE", "disk_queue",
            "stored chunks waiting to be written to disk (each stays pinned in the pool until written); more are "
            "not written, and counted as drops (default 256)", "N"),
    Setting("disk_timeout_s", "--disk-timeout", "LMSHM_DISK_TIMEOUT", "disk_timeout",
            "longest a LOOKUP waits for chunks read back from disk, in seconds; what is not read by then is a "
            "miss (default 0.5)", "SECONDS"),
    Setting("disk_checksum", "--disk-checksum", "LMSHM_DISK_CHECKSUM", "disk_checksum",
            "checksum of each chunk file: auto (xxh3-128 if the xxhash package is installed, else CRC-32), xxh3, "
            "blake2b or crc32; any of them is read back (default auto)", "NAME"),
    Setting("disk_admit", "--disk-admit", "LMSHM_DISK_ADMIT", "disk_admit",
            "which stored chunks are written to disk: first (every one, the default) or second (a chunk only "
            "the second time it is stored into the pool, that is, once it was lost from the pool and computed "
            "again: one-off prompts then cost the disk no writes; the last 1M-2M chunks stored are remembered)",
            "WHEN"),
    Setting("remote", "--remote", "LMSHM_REMOTE", "remote",
            "keep chunks in a Valkey/Redis server too, shared with other hosts: redis://HOST[:PORT][/DB], "
            "rediss://... (TLS), or a cluster as redis+cluster://HOST:PORT[,HOST:PORT...] (rediss+cluster:// with "
            "TLS). STOREs are written through in the background; a LOOKUP reads back what the pool and the disk "
            "lack. No password in the URL: LMSHM_REMOTE_USERNAME, LMSHM_REMOTE_PASSWORD or "
            "--remote-password-file (default: no remote tier)", "URL"),
    Setting("remote_prefix", "--remote-prefix", "LMSHM_REMOTE_PREFIX", "remote_prefix",
            "first part of every remote key, one per deployment (default lmshm:)", "PREFIX"),
    Setting("remote_ttl_s", "--remote-ttl", "LMSHM_REMOTE_TTL", "remote_ttl",
            "expire remote values after this many seconds (default 0: never; the server's maxmemory policy "
            "evicts, and should be an allkeys-* one)", "SECONDS"),
    Setting("remote_timeout_s", "--remote-timeout", "LMSHM_REMOTE_TIMEOUT", "remote_timeout",
            "longest any remote call may take, in seconds: a slow or dead remote is a miss by then, and after 3 "
            "failures in a row it is skipped for a back-off of 1 s doubling to 30 s (default 0.5)", "SECONDS"),
    Setting("remote_queue", "--remote-queue", "LMSHM_REMOTE_QUEUE", "remote_queue",
            "stored chunks waiting to be written to the remote (each stays pinned in the pool until written); "
            "more are not written, and counted as drops (default 256)", "N"),
    Setting("remote_secret_file", "--remote-secret-file", "LMSHM_REMOTE_SECRET_FILE", "remote_secret_file",
            "a file (the server's own, mode 600, at least 16 bytes; e.g. head -c 32 /dev/urandom > FILE) with a "
            "secret shared by the servers of one deployment: every remote value carries a MAC under it (see "
            "--remote-mac), checked before a byte is served, and a value without a valid one is a miss. Required "
            "with --remote, unless --remote-insecure-unsigned", "PATH"),
    Setting("remote_mac", "--remote-mac", "LMSHM_REMOTE_MAC", "remote_mac",
            "the MAC this server signs remote values with: aes-gmac (AES-GMAC under a key of each value's own, "
            "derived from the secret; about 4x keyed BLAKE3's speed, the default) or blake3 (keyed BLAKE3, what "
            "lmshm before 2026-12-04 reads: use it until every server of the deployment is upgraded). Values "
            "signed either way are read", "NAME"),
    Setting("remote_insecure_unsigned", "--remote-insecure-unsigned", "LMSHM_REMOTE_INSECURE_UNSIGNED",
            "remote_insecure_unsigned",
            "use --remote without --remote-secret-file: values carry only a checksum, against accidents, so anyone "
            "who can write to the remote can feed every server's engines KV of their choosing (logged as a "
            "WARNING at start; default off: --remote without a secret is refused)", kind="bool"),
    Setting("remote_password_file", "--remote-password-file", "LMSHM_REMOTE_PASSWORD_FILE", "remote_password_file",
            "a file (mode 600) holding the remote's password, instead of LMSHM_REMOTE_PASSWORD", "PATH"),
    Setting("remote_ca_file", "--remote-ca-file", "LMSHM_REMOTE_CA_FILE", "remote_ca_file",
            "for a rediss:// remote: a PEM file of the certificate authorities to trust for its server "
            "certificate, instead of the system's trust store (default: the system's)", "PATH"),
    Setting("http_port", "--http-port", "LMSHM_HTTP_PORT", "http_port",
            "serve Triton's HTTP/REST health, metadata and shared-memory routes and Prometheus /metrics on this "
            "port (default off; 0 picks a free port)", "N"),
    Setting("http_host", "--http-host", "LMSHM_HTTP_HOST", "http_host",
            "address the HTTP endpoint binds (default 127.0.0.1; anyone who reaches it can register regions "
            "of the server's uid, see --http-restricted-api)", "HOST"),
    Setting("grpc_port", "--grpc-port", "LMSHM_GRPC_PORT", "grpc_port",
            "serve Triton's gRPC health, metadata and shared-memory RPCs on this port (default off; 0 picks a "
            "free port)", "N"),
    Setting("grpc_host", "--grpc-host", "LMSHM_GRPC_HOST", "grpc_host", "address the gRPC endpoint binds (default "
            "127.0.0.1)", "HOST"),
    Setting("http_max_body_bytes", "--http-max-body-bytes", "LMSHM_HTTP_MAX_BODY_BYTES", "http_max_body_bytes",
            "largest HTTP request body accepted; a larger one is answered 400 (default 65536; the largest KV "
            "lookup, a million token ids, needs 9437184: docs/kv-lookup.md; other routes take 65536 at most)",
            "N"),
    Setting("grpc_max_message_bytes", "--grpc-max-message-bytes", "LMSHM_GRPC_MAX_MESSAGE_BYTES",
            "grpc_max_message_bytes", "largest gRPC request accepted (default 65536)", "N"),
    Setting("http_allow_hosts", "--http-allow-host", "LMSHM_HTTP_ALLOW_HOSTS", "http_allow_hosts",
            "also answer HTTP requests whose Host header is this name (repeatable; env: comma-separated; * = any "
            "name). By default the endpoint answers a Host that is an IP address, localhost or the --http-host "
            "name, and refuses others with 421: a web page that reaches the port by DNS rebinding names its own "
            "host. List the names clients use for a server bound to 0.0.0.0 or behind a DNS name",
            "NAME", "list"),
    Setting("http_restricted_api", "--http-restricted-api", "LMSHM_HTTP_RESTRICTED_API", "http_restricted_api",
            "HEADER=VALUE (also shared-memory:HEADER=VALUE, Triton's spelling): the HTTP shared-memory routes "
            "answer 403 unless the request carries that header with that value (default: unrestricted)",
            "HEADER=VALUE"),
    Setting("grpc_restricted_api", "--grpc-restricted-api", "LMSHM_GRPC_RESTRICTED_API", "grpc_restricted_api",
            "HEADER=VALUE: the gRPC shared-memory RPCs need metadata triton-grpc-protocol-HEADER with that value, as "
            "Triton's --grpc-restricted-protocol does; without it they answer UNAVAILABLE (default: unrestricted)",
            "HEADER=VALUE"),
    Setting("http_max_connections", "--http-max-connections", "LMSHM_HTTP_MAX_CONNECTIONS", "http_max_connections",
            "HTTP connections open at once, and so the HTTP endpoint's fd budget (default 256, at most 1/8 of the "
            "open-file limit). When full, a new connection makes the oldest one without a request in progress close; "
            "if every one has a request in progress, the new one is closed", "N"),
    Setting("http_idle_timeout_s", "--http-idle-timeout", "LMSHM_HTTP_IDLE_TIMEOUT", "http_idle_timeout",
            "seconds an HTTP connection may stay open without sending a request (new, or kept alive after a "
            "response) before the server closes it (default 5)", "SECONDS"),
    Setting("http_request_timeout_s", "--http-request-timeout", "LMSHM_HTTP_REQUEST_TIMEOUT", "http_request_timeout",
            "seconds from the first byte of an HTTP request until its headers and body have all arrived; a slower "
            "request gets 408 or its connection closed (default 5)", "SECONDS"),
    Setting("grpc_max_connections", "--grpc-max-connections", "LMSHM_GRPC_MAX_CONNECTIONS", "grpc_max_connections",
            "gRPC connections open at once, and so the gRPC endpoint's fd budget (default 64, at most 1/8 of the "
            "open-file limit); more are closed as soon as they are accepted. Each connection may carry 4 calls at "
            "once", "N"),
    Setting("grpc_idle_timeout_s", "--grpc-idle-timeout", "LMSHM_GRPC_IDLE_TIMEOUT", "grpc_idle_timeout",
            "seconds a gRPC connection may stay open with no call in progress before the server closes it (GOAWAY; "
            "clients reconnect on their next call) (default 10)", "SECONDS"),
    Setting("grpc_request_timeout_s", "--grpc-request-timeout", "LMSHM_GRPC_REQUEST_TIMEOUT", "grpc_request_timeout",
            "seconds a new gRPC connection has to send the HTTP/2 preface and SETTINGS, and a call to send its "
            "request message, before the server closes or cancels it (default 5)", "SECONDS"),
    Setting("kv_events_index", "--kv-events-index", "LMSHM_KV_EVENTS_INDEX", "kv_events_index",
            "advertised chunks (STOREs that carry adverts: the engine's block hashes) the KV event index keeps, "
            "to tell routers which tier can serve each one, and 2 KiB of index per chunk (at least 64 MiB; each "
            "chunk charged what it costs to its uid); past either, the least recently stored chunk of the uid "
            "holding the most is forgotten, with a BlockRemoved, and counted (default 262144; "
            "0 = no KV events at all: neither KV_EVENTS reads nor --kv-events)", "N"),
    Setting("kv_events_buffer", "--kv-events-buffer", "LMSHM_KV_EVENTS_BUFFER", "kv_events_buffer",
            "KV event records the event log keeps for its readers (the connectors' KV_EVENTS reads and "
            "--kv-events), and 1 KiB of events per record (at least 64 MiB); a reader further behind loses "
            "the oldest, and is told so (default 65536)", "N"),
    Setting("kv_events", "--kv-events", "LMSHM_KV_EVENTS", "kv_events",
            "publish KV events (BlockStored, BlockRemoved, AllBlocksCleared: what the pool, the disk and the "
            "remote can serve of the chunks engines advertised) on a ZMQ PUB socket, in vLLM's format: frames "
            "[topic, seq as 8 bytes big-endian, msgpack KVEventBatch], seq from 0 and one counter over all "
            "topics (a subscriber of one topic sees it jump). tcp://HOST:PORT binds HOST only (127.0.0.1: "
            "loopback; *, :: or 0.0.0.0: every interface), ipc://PATH and inproc://NAME bind; with "
            "--kv-events-connect, tcp://HOST:PORT connects to a subscriber that binds. A bound endpoint takes "
            "at most 64 connections, and drops a subscriber that sends more than 4 KiB (subscriptions): "
            "expose it only to routers. Medium and locality: pool CPU/LOCAL, disk STORAGE/LOCAL, remote "
            "STORAGE/REMOTE (default off)", "URL"),
    Setting("kv_events_connect", "--kv-events-connect", "LMSHM_KV_EVENTS_CONNECT", "kv_events_connect",
            "connect --kv-events' tcp:// endpoint instead of binding it, for a subscriber that binds (vLLM "
            "connects to any host but *, ::; lmshm binds unless told so)", kind="bool"),
    Setting("kv_events_replay", "--kv-events-replay", "LMSHM_KV_EVENTS_REPLAY", "kv_events_replay",
            "bind a ROUTER socket here for replays, as vLLM's: a request [empty frame, start seq as 8 bytes "
            "big-endian] is answered [empty frame, topic, seq, payload] per buffered batch from start on, then "
            "the end marker [empty frame, empty topic, -1 as 8 bytes, empty payload]. A start not published yet, "
            "or a malformed request, gets the end marker alone; a start older than the buffer, everything from "
            "its oldest (default off; needs --kv-events)", "URL"),
    Setting("kv_events_curve_secret", "--kv-events-curve-secret", "LMSHM_KV_EVENTS_CURVE_SECRET",
            "kv_events_curve_secret", "encrypt the --kv-events stream and its replay with ZeroMQ CURVE: the "
            "server's certificate with its secret key (zmq.auth.create_certificates' .key_secret file); "
            "subscribers need its public key. Alone it admits any client key (encryption only): add "
            "--kv-events-curve-clients to admit only known subscribers (default off)", "FILE"),
    Setting("kv_events_curve_clients", "--kv-events-curve-clients", "LMSHM_KV_EVENTS_CURVE_CLIENTS",
            "kv_events_curve_clients", "a directory of client certificates (public keys): only those clients "
            "may subscribe or request replays (ZAP; needs --kv-events-curve-secret)", "DIR"),
    Setting("kv_events_replay_batches", "--kv-events-replay-batches", "LMSHM_KV_EVENTS_REPLAY_BATCHES",
            "kv_events_replay_batches", "batches kept for replay at most (default 10000)", "N"),
    Setting("kv_events_replay_bytes", "--kv-events-replay-bytes", "LMSHM_KV_EVENTS_REPLAY_BYTES",
            "kv_events_replay_bytes", "bytes of batches kept for replay at most (default 64MiB)", "SIZE", "size"),
    Setting("kv_events_hwm", "--kv-events-hwm", "LMSHM_KV_EVENTS_HWM", "kv_events_hwm",
            "batches queued for one subscriber that does not keep up (ZMQ SNDHWM); past it that subscriber "
            "misses batches (counted in lmshm_kv_events_dropped) and the others still get them (default 10000; "
            "lowered to --kv-events-subscriber-bytes over 512 KiB, 128 by default: about 2.5 s of a busy "
            "topic, one batch every 20 ms)", "N"),
    Setting("kv_events_subscriber_bytes", "--kv-events-subscriber-bytes", "LMSHM_KV_EVENTS_SUBSCRIBER_BYTES",
            "kv_events_subscriber_bytes", "bytes of batches queued for one subscriber at most: --kv-events-hwm is "
            "lowered to this over 512 KiB, the largest batch (default 64MiB: 128 batches)", "SIZE", "size"),
    Setting("kv_events_topic", "--kv-events-topic", "LMSHM_KV_EVENTS_TOPIC", "kv_events_topic",
            "node (default): every event on kv@node:NAME@MODEL, one pseudo-pod for this server (llm-d's node: "
            "pods); engine: on kv@POD@MODEL of every engine (STORE's pod) that advertised into the chunk's "
            "uid and namespace, so routers credit engines they can route to (events of a namespace no engine "
            "named go on the node topic). AllBlocksCleared goes only on node topics: the stream's first batch "
            "is one on kv@node:NAME@ (no model is known at start), and in node mode each node topic's first "
            "batch of a run starts with one, so a restart clears what the last run advertised", "MODE"),
    Setting("kv_events_node", "--kv-events-node", "LMSHM_KV_EVENTS_NODE", "kv_events_node",
            "NAME in the node topics kv@node:NAME@MODEL (default: the host name)", "NAME"),
    Setting("max_regions", "--max-regions", "LMSHM_MAX_REGIONS", "max_regions",
            "system and CUDA shared-memory regions registered at once, over HTTP, gRPC and in-process (default "
            "4096; each is one mapping)", "N"),
    Setting("endpoint_threads", "--endpoint-threads", "LMSHM_ENDPOINT_THREADS", "endpoint_threads",
            "gRPC calls handled at once (default 4); a call still waiting for its request message does not take "
            "one", "N"),
)
_BY_TOML = {s.toml: s for s in SETTINGS}
_BY_FIELD = {s.field: s for s in SETTINGS if s.field}
_BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


class ConfigError(ValueError):
    pass


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmshm-server",
        description="Map inference workers' KV caches with zero copies and keep a registry of them; with "
                    "--http-port/--grpc-port, also serve Triton's shared-memory extension (HTTP/REST and gRPC) and "
                    "Prometheus /metrics. "
                    "Every option also reads an environment variable and a key of the --config TOML file "
                    "(shown in brackets); the command line wins over the environment, which wins over the file.")
    for s in SETTINGS:
        where = f"[{s.env}, {s.toml}]"
        dest = s.toml
        if s.kind == "bool":
            p.add_argument(s.flag, dest=dest, action=argparse.BooleanOptionalAction, default=None,
                           help=f"{s.help} {where}")
        elif s.kind == "list":
            p.add_argument(s.flag, dest=dest, action="append", metavar=s.metavar, default=None,
                           help=f"{s.help} {where}")
        else:
            p.add_argument(s.flag, dest=dest, metavar=s.metavar, default=None, help=f"{s.help} {where}")
    p.add_argument("--config", metavar="FILE", help="TOML file with any of the keys above [LMSHM_CONFIG]")
    return p


def _load_toml(path: str) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    data = data.get("lmshm-server", data)
    unknown = sorted(set(data) - set(_BY_TOML))
    if unknown:
        raise ConfigError(f"config file {path}: unknown key(s) {', '.join(unknown)}; known: {', '.join(_BY_TOML)}")
    return data


def _from_text(s: Setting, raw: Any) -> Any:
    """A value from the environment or the command line (text) in the shape msgspec converts."""
    if isinstance(raw, str):
        if s.kind == "bool":
            return _BOOL_WORDS.get(raw.strip().lower(), raw)
        if s.kind == "list":
            return [v.strip() for v in raw.split(",") if v.strip()]
    if s.kind == "size" and isinstance(raw, (str, int)) and not isinstance(raw, bool):
        from lmshm.core.pool import parse_size  # lazy: the pool imports torch; `lmshm status` reads these settings

        try:
            return parse_size(raw)
        except ValueError as exc:
            raise ConfigError(f"bad setting {_describe(s)}: {exc}") from None
    if s.kind == "list" and isinstance(raw, list):
        return [v for item in raw for v in (_from_text(s, item) if isinstance(item, str) else [item])]
    return raw


def _describe(s: Setting) -> str:
    return f"{s.flag} ({s.env}, or --config key {s.toml!r})"


def resolve_config(args: argparse.Namespace, environ: Optional[Mapping[str, str]] = None) -> ServerConfig:
    env = os.environ if environ is None else environ
    config_path = args.config or env.get("LMSHM_CONFIG")
    layers: dict[str, Any] = dict(_load_toml(config_path)) if config_path else {}
    for key, value in list(layers.items()):
        if _BY_TOML[key].kind == "size":
            layers[key] = _from_text(_BY_TOML[key], value)
    for s in SETTINGS:
        if env.get(s.env, "") != "":
            layers[s.toml] = _from_text(s, env[s.env])
        cli = getattr(args, s.toml, None)
        if cli is not None:
            layers[s.toml] = _from_text(s, cli)
    if "url" not in layers and ("host" in layers or "port" in layers):
        port = layers.get("port", 5555)
        if isinstance(port, bool) or not str(port).isdigit():
            raise ConfigError(f"bad setting {_describe(_BY_TOML['port'])}: expected an integer, got {port!r}")
        layers["url"] = f"tcp://{layers.get('host', '127.0.0.1')}:{int(port)}"
    fields = {_BY_TOML[k].field: v for k, v in layers.items() if _BY_TOML[k].field}
    try:
        config = msgspec.convert(fields, ServerConfig, strict=False)
    except msgspec.ValidationError as exc:
        text = str(exc)
        field = text.rsplit("at `$.", 1)[-1].split("`", 1)[0].split("[", 1)[0] if "at `$." in text else ""
        where = _describe(_BY_FIELD[field]) if field in _BY_FIELD else "a setting"
        raise ConfigError(f"bad setting {where}: {text.split(' - at ', 1)[0]}, got {fields.get(field)!r}") from None
    for s in (_BY_FIELD["http_restricted_api"], _BY_FIELD["grpc_restricted_api"]):
        value = getattr(config, s.field)
        if value:
            try:
                parse_restriction(value)
            except ValueError as exc:
                raise ConfigError(f"bad setting {_describe(s)}: {exc}") from None
    _check_kv_events(config)
    if config.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ConfigError(f"--log-level {config.log_level!r}: use DEBUG, INFO, WARNING or ERROR")
    mq.check_url(config.url)
    return config


def _check_kv_events(config: ServerConfig) -> None:
    for field in ("kv_events", "kv_events_replay"):
        value = getattr(config, field)
        if value:
            try:
                check_endpoint(value)
            except ValueError as exc:
                raise ConfigError(f"bad setting {_describe(_BY_FIELD[field])}: {exc}") from None
    if config.kv_events_replay and not config.kv_events:
        raise ConfigError(f"{_describe(_BY_FIELD['kv_events_replay'])} replays the --kv-events stream: set "
                          "--kv-events too")
    if config.kv_events and not config.kv_events_index:
        raise ConfigError("--kv-events publishes what the KV event index holds, and --kv-events-index 0 turns "
                          "the index off: give it a size (default 262144) or leave --kv-events out")
    if config.kv_events_topic not in TOPIC_MODES:
        raise ConfigError(f"bad setting {_describe(_BY_FIELD['kv_events_topic'])}: {config.kv_events_topic!r}; "
                          "use node or engine")
    if "@" in config.kv_events_node or any(c.isspace() for c in config.kv_events_node):
        raise ConfigError(f"bad setting {_describe(_BY_FIELD['kv_events_node'])}: {config.kv_events_node!r}; a "
                          "topic is kv@node:NAME@MODEL, so NAME has no '@' and no spaces")
    if config.kv_events_curve_clients and not config.kv_events_curve_secret:
        raise ConfigError(f"{_describe(_BY_FIELD['kv_events_curve_clients'])} admits client keys to a CURVE "
                          "stream: set --kv-events-curve-secret too")


def parse_restriction(value: str) -> tuple[str, str]:
    """``HEADER=VALUE`` (or ``shared-memory:HEADER=VALUE``) as (lower-case header, value)."""
    spec = value.strip()
    if ":" in spec.split("=", 1)[0]:
        api, spec = spec.split(":", 1)
        if api.strip() != "shared-memory":
            raise ValueError(f"{value!r}: lmshm restricts only the 'shared-memory' API, got {api.strip()!r}")
    header, sep, expected = spec.partition("=")
    header = header.strip().lower()
    if not sep or not header or not expected or not all(c.isalnum() or c in "-_" for c in header):
        raise ValueError(f"{value!r}: expected HEADER=VALUE, e.g. admin-key=s3cret (header: letters, digits, - and _)")
    return header, expected
