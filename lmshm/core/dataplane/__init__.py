"""The data plane: blocks between workers' KV caches and the pool, in rooms of one job each.

- ``requests.py``: ``DataPlane``, the requests (STORE/RETRIEVE/LOOKUP/RELEASE); it queues its
  own jobs and answers them through ``reply``.
- ``checks.py``: what a request must pass on the loop, before a byte moves.
- ``host.py`` and ``cuda.py``: the copies of CPU and CUDA registrations (``cuda.py``: one
  object for both directions; ``core/cuda_sync.py``: the ordering rules it follows).
- ``executor.py``: the copier threads; ``layout.py``: where blocks lie and the pieces to copy;
  ``jobs.py``: the types the rooms share; ``config.py``: ``DataPlaneConfig``.

The trap: the pool's bytes are handed back only once no copy can still touch them (a held
registration, a pinned object, a quarantined CUDA copy); docs/design/dataplane.md explains.
"""

from lmshm.core.dataplane.checks import SENDER_MARGIN_S, DataPlaneError
from lmshm.core.dataplane.config import DataPlaneConfig
from lmshm.core.dataplane.executor import OrderedExecutor
from lmshm.core.dataplane.host import copy_chunks, copy_parallelism, gather, open_checked, scatter
from lmshm.core.dataplane.jobs import QUEUED, Answer, Queued, Reply, ReplyTo, Session
from lmshm.core.dataplane.layout import (
    MAX_RUNS,
    BlockLayout,
    CopyPlan,
    FileSide,
    LayoutError,
    check_movable,
    pieces,
    plan_cuda_copies,
)
from lmshm.core.dataplane.requests import PROMOTE_THREADS, DataPlane

__all__ = [
    "MAX_RUNS", "PROMOTE_THREADS", "QUEUED", "Answer", "SENDER_MARGIN_S", "BlockLayout", "CopyPlan", "DataPlane",
    "DataPlaneConfig", "DataPlaneError", "FileSide", "LayoutError", "OrderedExecutor", "Queued", "Reply", "ReplyTo",
    "Session", "check_movable", "copy_chunks", "copy_parallelism", "gather", "open_checked", "pieces",
    "plan_cuda_copies", "scatter",
]
