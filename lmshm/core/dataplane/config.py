"""The data plane's settings: ``DataPlaneConfig``, read from ``CoreConfig`` by ``of``.

A frozen dataclass of what the requests, the copier threads and the CUDA copies read. The
pool's and the tiers' own settings are not here: ``Core`` builds the ``Pool`` and the
``TierStack`` from ``CoreConfig`` and hands them over. The trap: ``of`` is the only place a
``CoreConfig`` field turns into a data-plane setting; a new setting that the data plane reads
goes into both this class and ``of``, or the server's flag silently does nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmshm.core.config import CoreConfig
from lmshm.core.cuda_sync import PIN_EXTENT


@dataclass(frozen=True)
class DataPlaneConfig:
    copy_threads: int = 2                   # copier threads (--copy-threads)
    lease_ttl_s: float = 30.0               # the longest a LOOKUP's lease lives
    max_inflight_per_session: int = 256     # STORE/RETRIEVEs queued or running, per session
    max_leases_per_session: int = 4096
    max_leases_per_uid: int = 1 << 30       # over all of a uid's sessions
    through_files: bool = True              # named shm: preadv/pwritev (SIGBUS-safe), else memmove
    cuda_pin: str = "lazy"                  # how the pool is page-locked: cuda_sync.PIN_MODES
    cuda_pin_extent: int = PIN_EXTENT       # the extents it is page-locked in
    cuda_copy_batch: bool = True            # one cuMemcpyBatchAsync per request where the driver has it
    cuda_timeout_s: float = 30.0            # a CUDA request's copies must complete within this

    @classmethod
    def of(cls, c: CoreConfig) -> "DataPlaneConfig":
        """The data plane's part of the core's settings."""
        return cls(copy_threads=c.copy_threads, lease_ttl_s=c.lease_ttl_s,
                   max_inflight_per_session=c.max_inflight_per_session,
                   max_leases_per_session=c.max_leases_per_session, max_leases_per_uid=c.max_leases_per_uid,
                   through_files=not c.copy_through_mapping, cuda_pin=c.cuda_pin,
                   cuda_pin_extent=c.cuda_pin_extent, cuda_copy_batch=c.cuda_copy_batch,
                   cuda_timeout_s=c.cuda_timeout_s)
