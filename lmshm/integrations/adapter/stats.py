"""The connector's counters: ``SchedulerStats`` and ``WorkerStats``.

Each side counts into its own object and the engine takes the counts (``take``) when it
reports its stats (vLLM's ``get_kv_connector_stats``), which resets them. Latency samples are
seconds, bounded in number, so a stats reader that never comes cannot grow them without end.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SchedulerStats:
    """The scheduler's counters since they were last taken (``take``)."""

    lookups: int = 0
    hit_tokens: int = 0
    lookup_s: list[float] = field(default_factory=list)

    def lookup(self, seconds: float) -> None:
        self.lookups += 1
        if len(self.lookup_s) < 10_000:
            self.lookup_s.append(seconds)

    def take(self) -> dict[str, Any]:
        out = {"lookups": self.lookups, "hit_tokens": self.hit_tokens, "lookup_s": self.lookup_s}
        self.lookups, self.hit_tokens, self.lookup_s = 0, 0, []
        return out


@dataclass
class WorkerStats:
    """One worker's counters since they were last taken (``take``)."""

    loaded_chunks: int = 0
    loaded_bytes: int = 0
    stored_chunks: int = 0
    stored_bytes: int = 0
    failed_loads: int = 0
    dropped_stores: int = 0
    cuda_errors: int = 0        # an ordering step failed in the worker: a miss or a dropped store
    load_s: list[float] = field(default_factory=list)
    store_s: list[float] = field(default_factory=list)

    def take(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            setattr(self, f.name, [] if f.name.endswith("_s") else 0)
        return out
