"""The core: the cache server as a library, with no endpoint -- ``Core``.

``Core`` builds and owns everything that outlives a request: the registry (KV-cache
registrations and Triton-style regions, one namespace), the pool, the tiers below it, the KV
event index, the data plane (``core/dataplane/``), the metrics, and the clock that runs lease
expiry and the orphan sweep whichever endpoints run, or none. Endpoints (``lmshm.multiprocess``,
``lmshm.endpoints``) call it and keep no registry state; ``lmshm.Server`` composes them. Where
the core must call up it takes a callback at construction: ``reply``, through which a queued
data-plane job answers the request that queued it.

Lifecycle: ``Core(config, reply=...)``, ``start()``, ``shutdown()`` (idempotent). Every refusal
is a ``ServerError`` with an ``ErrorCode``; every public method is safe from any thread. The
trap: a ``View``'s tensor keeps its bytes mapped after an unregister, until the view closes and
the tensor is gone; regions are the client's objects, never created or unlinked here.
docs/design/dataplane.md ("The core") has the full account.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import weakref
from typing import Any, Optional

from lmshm.core import regions
from lmshm.core.clock import Clock
from lmshm.core.config import CoreConfig
from lmshm.core.dataplane import Answer, DataPlane, DataPlaneConfig, Reply
from lmshm.core.errors import ErrorCode, ServerError
from lmshm.core.kv_events import KvIndex
from lmshm.core.metrics import Metrics
from lmshm.core.pool import Pool
from lmshm.core.registry import Registration, Registry
from lmshm.core.tiers.base import Tier
from lmshm.core.tiers.stack import TierStack
from lmshm.platform.shm_orphans import sweep_orphans
from lmshm.quoting import quote
from lmshm.wire.protocol import PoolInfo

logger = logging.getLogger("lmshm.server")

REGION_KINDS = ("system", "cuda")
#: How often the clock ends expired LOOKUP leases (a lease lives at most this much past its TTL).
LEASE_TICK_S = 0.05


class View:
    """Bytes of a registration, as a tensor, held open until ``close()``.

    ``tensor`` aliases the registered memory (no copy). While the view is open its
    registration cannot be released: an unregister is deferred until the last view closes.
    """

    def __init__(self, registry: Registry, reg: Registration, tensor: Any) -> None:
        self.name = reg.instance_id
        self.kind = reg.kind
        self.tensor = tensor
        self._finalizer = weakref.finalize(self, registry.let_go, reg)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Let the registration go (idempotent). The tensor stays valid while you hold it."""
        self._finalizer()

    def __enter__(self) -> "View":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"View({self.name!r}, {self.kind}, {tuple(self.tensor.shape)}, {state})"


class Core:
    """The lmshm cache server without endpoints. See the module documentation."""

    def __init__(self, config: Optional[CoreConfig] = None, *, reply: Optional[Reply] = None) -> None:
        self.config = config if config is not None else CoreConfig()
        self.server_id = secrets.token_hex(8)
        self.started = time.monotonic()
        self.registry = Registry()
        # KV events (core/kv_events): the log starts with AllBlocksCleared, so a reader learns
        # that what this server advertised before it (re)started is gone
        self.kv_index = KvIndex(max_chunks=self.config.kv_events_index, records=self.config.kv_events_buffer)
        self.kv_index.log.epoch = self.server_id
        self.kv_index.cleared()
        self.metrics = Metrics(self.registry, self.pool_info, tenants=lambda: self.dataplane.pool.tenant_usage())
        self.clock = Clock()
        self._lock = threading.Lock()
        self._stopped = False
        c = self.config
        tiers = self._open_tiers(c)
        try:
            self.dataplane = self._data_plane(c, reply, tiers)
        except BaseException:
            for tier in tiers:
                tier.close()
            raise

    def _data_plane(self, c: CoreConfig, reply: Optional[Reply], tiers: list[Tier]) -> DataPlane:
        """Build the pool and the tier stack, wire them to the KV event index, and hand them to
        the data plane."""
        kv = self.kv_index
        pool = Pool(c.capacity, max_objects=c.max_objects, max_pinned_fraction_per_uid=c.max_pinned_fraction_per_uid,
                    max_pins_per_uid=c.max_pins_per_uid, huge_pages=c.pool_huge_pages, prefault=c.prefault_pool,
                    populate_ahead=c.pool_populate_ahead, head_room=max((t.head_room for t in tiers), default=0),
                    align=max((t.align for t in tiers), default=0),
                    on_resident=kv.recorder("pool") if kv.enabled else None,
                    on_committed=kv.batch_recorder("pool") if kv.enabled else None)
        try:
            if kv.enabled:
                for t in tiers:
                    t.report_to(kv.recorder(t.name))
            stack = None
            if tiers:
                stack = TierStack(pool, tiers, queue_limit=[c.disk_queue if t.name == "disk" else c.remote_queue
                                                            for t in tiers],
                                  timeout_s=max(c.disk_timeout_s if c.disk else 0.0,
                                                c.remote_timeout_s if c.remote else 0.0))
            return DataPlane(DataPlaneConfig.of(c), registry=self.registry, pool=pool, tiers=stack, kv_index=kv,
                             reply=reply if reply is not None else _unanswered)
        except BaseException:
            pool.release()
            raise

    @classmethod
    def _open_tiers(cls, c: CoreConfig) -> list[Tier]:
        """The tiers below the pool that the settings ask for, top first (docs/design/tiers.md)."""
        tiers = [] if not c.disk else [cls._open_disk(c)]
        if c.remote:
            try:
                tiers.append(cls._open_remote(c))
            except BaseException:
                for tier in tiers:
                    tier.close()
                raise
        return tiers

    @staticmethod
    def _open_disk(c: CoreConfig) -> Tier:
        if not c.capacity:
            raise ServerError(ErrorCode.INVALID_ARG, "--disk needs a pool: it was given with --capacity 0")
        if not c.disk_capacity:
            raise ServerError(ErrorCode.INVALID_ARG, f"--disk {quote(c.disk, 80)} needs --disk-capacity SIZE "
                                                     "(e.g. 100GiB): the most the tier may use on that disk")
        from lmshm.core.tiers.disk import DiskTier  # lazy: a server without --disk loads no tier code

        try:
            return DiskTier(c.disk, c.disk_capacity, checksum=c.disk_checksum, admit=c.disk_admit)
        except (OSError, ValueError, ImportError) as exc:
            raise ServerError(ErrorCode.INVALID_ARG, f"cannot open the disk tier: {exc}") from None

    @staticmethod
    def _open_remote(c: CoreConfig) -> Tier:
        """The remote tier; its credentials come from the environment or files, never settings."""
        if not c.capacity:
            raise ServerError(ErrorCode.INVALID_ARG, "--remote needs a pool: it was given with --capacity 0")
        # lazy: a server without --remote loads no client library
        from lmshm.core.tiers.remote import MIN_SECRET_BYTES, RemoteTier, read_ca_file, read_secret_file

        try:
            secret = read_secret_file(c.remote_secret_file, "--remote-secret-file", MIN_SECRET_BYTES) \
                if c.remote_secret_file else None
            password = os.environ.get("LMSHM_REMOTE_PASSWORD", "")
            if c.remote_password_file:
                password = read_secret_file(c.remote_password_file, "--remote-password-file").decode()
            ca = read_ca_file(c.remote_ca_file) if c.remote_ca_file else None
            return RemoteTier(c.remote, prefix=c.remote_prefix, ttl_s=c.remote_ttl_s, timeout_s=c.remote_timeout_s,
                              secret=secret, username=os.environ.get("LMSHM_REMOTE_USERNAME", ""),
                              password=password, checksum=c.disk_checksum, ca_pem=ca,
                              insecure_unsigned=c.remote_insecure_unsigned, mac=c.remote_mac)
        except (OSError, ValueError, ImportError, UnicodeDecodeError) as exc:
            raise ServerError(ErrorCode.INVALID_ARG, f"cannot open the remote tier: {exc}") from None

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> "Core":
        """Sweep orphaned segment names once, then start the clock (idempotent)."""
        with self._lock:
            if self._stopped:
                raise ServerError(ErrorCode.UNAVAILABLE, "this lmshm core was shut down; create a new one")
            if self.clock.running:
                return self
            self.sweep()
            self.clock.every(LEASE_TICK_S, self.dataplane.tick, name="lease expiry")
            if self.config.sweep_interval_s > 0:
                self.clock.every(self.config.sweep_interval_s, self.sweep, name="orphan sweep")
            self.clock.start()
        return self

    @property
    def stopped(self) -> bool:
        return self._stopped

    def shutdown(self) -> int:
        """Stop the clock, answer queued copies UNAVAILABLE (running ones finish), release every
        registration and region. Returns how many were released; 0 when already shut down."""
        with self._lock:
            if self._stopped:
                return 0
            self._stopped = True
            self.clock.stop()
            self.dataplane.shutdown()
            released = self.registry.release_all()
        logger.debug("lmshm: the core is shut down; released %d registration(s)", released)
        return released

    def sweep(self) -> None:
        """Remove /dev/shm names of dead workers of this uid (``lmshm gc`` does the same)."""
        try:
            result = sweep_orphans()
        except OSError as exc:
            logger.warning("lmshm: orphan sweep failed: %s", exc)
            return
        if result.removed:
            logger.info("lmshm: removed %d orphaned segment name(s) of dead workers: %s", len(result.removed),
                        ", ".join(result.removed[:8]) + (" ..." if len(result.removed) > 8 else ""))

    # ---- state ----------------------------------------------------------------------------
    def pool_info(self) -> PoolInfo:
        return self.dataplane.info()

    def metrics_text(self) -> bytes:
        """The Prometheus exposition text (what ``GET /metrics`` serves)."""
        return self.metrics.text()

    # ---- registrations ------------------------------------------------------------------
    def registrations(self, kind: Optional[str] = None) -> list[Registration]:
        """Live registrations (KV caches and regions), oldest first; only ``kind`` if given."""
        regs = sorted(self.registry.registrations(), key=lambda r: r.created)
        return [r for r in regs if kind is None or r.kind == kind]

    def unregister(self, instance_id: str) -> bool:
        """Unregister a KV-cache registration, whoever owns it (the application is the
        operator). Returns True if the release waits for open views or copies."""
        reg = self.registry.get(instance_id)
        if reg.kind != "kv":
            raise ServerError(ErrorCode.NOT_FOUND, f"{quote(instance_id, 80)} is a {reg.describe_kind()}; "
                                                   "unregister it with unregister_region()")
        return self.registry.unregister(instance_id)

    def layer_view(self, instance_id: str, layer_name: str) -> View:
        """A worker's KV-cache layer as a tensor (the same memory, no copy), held open."""
        reg = self.registry.acquire(instance_id)
        try:
            found = reg.layer(layer_name) if reg.kind == "kv" else None
            if found is None:
                raise ServerError(ErrorCode.NOT_FOUND, f"{quote(instance_id, 80)} has no layer {quote(layer_name, 80)}")
            return View(self.registry, reg, found[0])
        except BaseException:
            self.registry.let_go(reg)
            raise

    # ---- regions (Triton's shared-memory extension) -----------------------------------
    def _check_region_name(self, name: Any) -> str:
        if not isinstance(name, str):
            raise ServerError(ErrorCode.INVALID_ARG, f"a region name must be a string, got {type(name).__name__}")
        limit = self.config.max_name_bytes
        if len(name.encode("utf-8", "surrogatepass")) > limit:
            raise ServerError(ErrorCode.INVALID_ARG, f"region name {quote(name, 40)} is longer than {limit} bytes "
                                                     "(lmshm-server --max-name-bytes)")
        return name

    def register_system_region(self, name: str, key: str, byte_size: int, offset: int = 0, *,
                               client: str = "in-process") -> Registration:
        """Map ``byte_size`` bytes at ``offset`` of the POSIX shm object ``key`` as ``name``."""
        self._check_region_name(name)
        file_name = regions.validate_system(key, offset, byte_size)
        allowed = tuple(self.config.allowed_uids)
        reg = self.registry.add_region(
            name, "system", lambda: regions.open_system(key, file_name, offset, byte_size, allowed), client_name=client,
            max_regions=self.config.max_regions)
        logger.debug("lmshm: registered system region %s (%s, %d bytes at %d)", quote(name, 60), quote(key, 60),
                     byte_size, offset)
        return reg

    def register_cuda_region(self, name: str, raw_handle: bytes, device_id: int, byte_size: int, *,
                             client: str = "in-process") -> Registration:
        """Open a client's ``cudaIpcMemHandle_t`` (64 bytes) on ``device_id`` as ``name``."""
        self._check_region_name(name)
        regions.validate_cuda(raw_handle, device_id, byte_size)
        reg = self.registry.add_region(
            name, "cuda", lambda: regions.open_cuda(bytes(raw_handle), device_id, byte_size), client_name=client,
            max_regions=self.config.max_regions)
        logger.debug("lmshm: registered CUDA region %s (device %d, %d bytes)", quote(name, 60), device_id, byte_size)
        return reg

    def region_status(self, kind: str, name: str = "") -> list[Registration]:
        """The regions of ``kind`` ("system" or "cuda"), or just ``name`` (NOT_FOUND if it is
        not a region of that kind; the message names the kind it has)."""
        self._check_kind(kind)
        if name:
            return [self.registry.region(self._check_region_name(name), kind)]
        return sorted(self.registry.regions(kind), key=lambda r: r.instance_id)  # Triton lists by name

    def unregister_region(self, kind: str, name: str = "") -> int:
        """Unregister region ``name`` of ``kind``, or every region of ``kind`` if ``name`` is
        empty. An unknown name, or a name of another kind, is not an error (Triton's rule).
        Returns how many regions left the namespace."""
        self._check_kind(kind)
        if name:
            return int(self.registry.unregister_region(self._check_region_name(name), kind))
        return self.registry.unregister_regions(kind)

    def region_view(self, name: str, offset: int = 0, byte_size: Optional[int] = None) -> View:
        """``byte_size`` bytes (default: to the end) at ``offset`` of region ``name`` as a
        uint8 tensor over the same memory, bounds- and overflow-checked; held open."""
        reg = self.registry.acquire(self._check_region_name(name))
        try:
            if reg.region is None:
                raise ServerError(ErrorCode.NOT_FOUND, f"{quote(name, 80)} is a {reg.describe_kind()}, not a region; "
                                                       "use layer_view()")
            size = reg.region.byte_size
            if byte_size is None:
                byte_size = size - offset if type(offset) is int else 0
            tensor = regions.view_of(reg.bases[0], size, offset, byte_size, f"region {quote(name, 80)}")
            return View(self.registry, reg, tensor)
        except BaseException:
            self.registry.let_go(reg)
            raise

    @staticmethod
    def _check_kind(kind: str) -> None:
        if kind not in REGION_KINDS:
            raise ServerError(ErrorCode.INVALID_ARG, f"region kind must be one of {', '.join(REGION_KINDS)}, "
                                                     f"got {quote(kind, 20)}")


def _unanswered(identity: bytes, request_id: bytes, reply: Answer) -> None:
    logger.warning("lmshm: a copy finished, but no endpoint was composed to send its reply")
