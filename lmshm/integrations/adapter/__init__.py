"""The engine-neutral half of every lmshm connector: keys, the link, and the two sides.

Nothing here imports an engine. A connector (``vllm/``, ``trtllm.py``, ``sglang.py``)
translates its engine's objects into these calls, one module per job:

- ``keys``: ``Namespace`` and the chained chunk keys (``chunk_keys``, ``chunk_keys_from_hashes``);
- ``link``: ``Link``, the one connection to lmshm-server, which never stalls the engine;
- ``plan``: ``StepPlan``, what the scheduler hands the workers each step;
- ``scheduler``: ``SchedulerSide`` (LOOKUP, which chunks to load and to store);
- ``worker``: ``WorkerSide`` (RETRIEVE before the forward pass, STORE after it);
- ``events``: ``EventFeed``, the server's KV events for the engine's own stream;
- ``stats``: the counters each side reports.

The names below are the package's API (the README's ``lmshm.integrations.adapter.chunk_keys``).
"""

from lmshm.integrations.adapter.events import EventFeed
from lmshm.integrations.adapter.keys import (
    KEY_BYTES,
    Namespace,
    chunk_block_ids,
    chunk_keys,
    chunk_keys_from_hashes,
)
from lmshm.integrations.adapter.link import Link, LinkConfig, packed_tokens
from lmshm.integrations.adapter.plan import Group, LoadSpec, StepPlan, StoreSpec
from lmshm.integrations.adapter.scheduler import SchedulerSide
from lmshm.integrations.adapter.stats import SchedulerStats, WorkerStats
from lmshm.integrations.adapter.worker import CudaOrdering, WorkerSide

__all__ = [
    "KEY_BYTES", "CudaOrdering", "EventFeed", "Group", "Link", "LinkConfig", "LoadSpec", "Namespace",
    "SchedulerSide", "SchedulerStats", "StepPlan", "StoreSpec", "WorkerSide", "WorkerStats",
    "chunk_block_ids", "chunk_keys", "chunk_keys_from_hashes", "packed_tokens",
]
