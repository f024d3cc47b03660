"""What the scheduler side hands the worker side for one engine step: ``StepPlan`` and its specs.

The scheduler decides (``SchedulerSide``), every worker executes (``WorkerSide``). A plan
crosses processes (vLLM pickles it into its connector metadata), so it holds plain data only:
keys, block ids, leases, ``Advert`` fields. ``Group`` describes one of the engine's KV cache
groups; its ``window`` changes what both sides may load and store (see its docstring).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Group:
    """One KV cache group of the engine: its layers share a block table.

    ``window``: 0 for full attention; else a sliding window of that many tokens. The engine then
    frees a request's blocks that fall out of the window (vLLM puts its null block in their
    place), so a load skips chunks whose blocks are null, and a store must finish before the
    engine's next step can free its blocks (``WorkerSide.save`` waits for those)."""

    window: int = 0


@dataclass
class LoadSpec:
    req_id: str
    keys: list[list[list[bytes]]]   # [rank][group]: the chunks to load
    block_ids: list[list[int]]      # [group]
    lease: bytes


@dataclass
class StoreSpec:
    req_id: str
    keys: list[list[list[bytes]]]   # [rank][group]: the chunks to store
    block_ids: list[list[int]]      # [group]
    adverts: list[list[tuple]] = field(default_factory=list)   # [group]: per chunk, an Advert's fields (KV events)


@dataclass
class StepPlan:
    """What the worker does in one engine step (crosses processes: plain data only)."""

    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    chunk_blocks: int = 1
    wait_stores: bool = False       # a window group: stores finish within the step
    space: bytes = b""              # KV events: the engine's namespace and pod name (see EventFeed)
    pod: str = ""
