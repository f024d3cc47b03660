"""The settings the core reads: ``CoreConfig``.

A msgspec Struct whose ``Meta`` constraints are the rules, as the wire's messages are. The
command line's ``ServerConfig`` (``lmshm.settings``) extends it with what the
endpoints read (addresses, sessions, transport limits, HTTP and gRPC), and its ``SETTINGS`` table
gives every field, these included, a flag, an environment variable and a TOML key. So the core
takes any ``CoreConfig`` -- a ``ServerConfig`` too -- and never imports what sits above it.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

Positive = Annotated[float, msgspec.Meta(gt=0)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
Count = Annotated[int, msgspec.Meta(ge=1, le=1 << 30)]
Ids = list[Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 1)]]


class CoreConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # who may do what: a system region's object must belong to the server's uid, root, or these
    allowed_uids: Ids = []
    # names and regions (lmshm/core/service.py)
    max_name_bytes: Annotated[int, msgspec.Meta(ge=16, le=4096)] = 256
    max_regions: Count = 4096
    # the clock (lmshm/core/clock.py): seconds between orphan sweeps; 0 = only at start
    sweep_interval_s: NonNegative = 10.0
    # the data plane
    capacity: Annotated[int, msgspec.Meta(ge=0, le=1 << 50)] = 2 << 30   # bytes; 0 = no pool
    copy_threads: Annotated[int, msgspec.Meta(ge=1, le=256)] = 2
    copy_through_mapping: bool = False     # named shm: memmove through the mapping, not SIGBUS-safe
    pool_huge_pages: bool = True           # MADV_HUGEPAGE on the pool
    prefault_pool: bool = False            # fault the whole pool in at start, on a background thread
    # bytes kept populated past the highest pool offset ever used, on a background thread; 0 = off
    pool_populate_ahead: Annotated[int, msgspec.Meta(ge=0, le=1 << 50)] = 256 << 20
    # CUDA copies: how the pool is page-locked (lazy: in extents as used; start; off), and how
    # long a CUDA request's copies may take before it fails (its bytes are held until done)
    cuda_pin: str = "lazy"
    # the extents it is pinned in (the driver refuses a copy across a pinned extent's edge: copies
    # are cut there), and whether a request's copies go in one cuMemcpyBatchAsync (CUDA 12.8+)
    cuda_pin_extent: Annotated[int, msgspec.Meta(ge=4096, le=1 << 40, multiple_of=4096)] = 256 << 20
    cuda_copy_batch: bool = True
    cuda_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 30.0
    lease_ttl_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 30.0
    max_inflight_per_session: Count = 256
    max_leases_per_session: Count = 4096
    # the pool's accounting and per-tenant (uid) caps (lmshm/core/pool/; docs/design/dataplane.md)
    max_objects: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)] = 1 << 18   # 0 = only --capacity bounds them
    max_pinned_fraction_per_uid: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.5
    max_pins_per_uid: Count = 1 << 20
    max_leases_per_uid: Count = 16384
    # KV events for routers (lmshm/core/kv_events/; docs/design/kv-events.md): advertised chunks
    # the index keeps (0 = no KV events), and records the event log keeps for its readers
    kv_events_index: Annotated[int, msgspec.Meta(ge=0, le=1 << 26)] = 1 << 18
    kv_events_buffer: Annotated[int, msgspec.Meta(ge=16, le=1 << 24)] = 1 << 16
    # the local-disk tier below the pool (lmshm/core/tiers/disk.py; docs/design/tiers.md)
    disk: str = ""                                                       # a directory; "" = no disk tier
    disk_capacity: Annotated[int, msgspec.Meta(ge=0, le=1 << 60)] = 0    # bytes; required with disk
    disk_queue: Count = 256            # chunks waiting to be written through; more are dropped (counted)
    disk_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=60)] = 0.5   # longest a LOOKUP waits for promotions
    disk_checksum: str = "auto"        # auto (xxh3 if installed, else crc32), xxh3, blake2b, crc32
    disk_admit: str = "first"          # first: every stored chunk; second: a chunk's second store only
    # the remote tier below the disk (lmshm/core/tiers/remote.py; docs/design/tiers.md). Credentials
    # are never settings: LMSHM_REMOTE_USERNAME / LMSHM_REMOTE_PASSWORD or remote_password_file
    remote: str = ""                   # redis://, rediss://, redis+cluster://; "" = no remote tier
    remote_prefix: Annotated[str, msgspec.Meta(max_length=256)] = "lmshm:"   # first part of every key
    remote_ttl_s: Annotated[float, msgspec.Meta(ge=0, le=1 << 31)] = 0.0     # 0 = no TTL (maxmemory evicts)
    remote_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=60)] = 0.5     # every remote call, at most
    remote_queue: Count = 256          # chunks waiting to be written to the remote; more are dropped (counted)
    remote_secret_file: str = ""       # the key of the MAC over every value; required with remote
    remote_mac: str = "aes-gmac"       # what this server signs with (remote.MACS); values of either are read
    remote_insecure_unsigned: bool = False  # no secret: serve whatever a checksum vouches for (forgeable)
    remote_password_file: str = ""     # the remote's password (AUTH), instead of LMSHM_REMOTE_PASSWORD
    remote_ca_file: str = ""           # rediss://: PEM certificates to trust instead of the system's
