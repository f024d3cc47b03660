"""The connector's statistics in vLLM's own: its logged stats and its Prometheus metrics.

``LmshmConnectorStats`` sums the counters of the scheduler and every worker (``adapter.stats``)
as vLLM aggregates them across ranks, and keeps a bounded number of latency samples (seconds);
``LmshmPromMetrics`` turns them into ``vllm:lmshm_*`` counters and histograms, one series per
engine. Both are None-safe: a vLLM without these hooks gets no stats, and the engine runs on.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
except ImportError:  # pragma: no cover
    KVConnectorStats = KVConnectorPromMetrics = None  # type: ignore[misc,assignment]


_COUNTERS = ("lookups", "hit_tokens", "loaded_chunks", "loaded_bytes", "stored_chunks", "stored_bytes",
             "failed_loads", "dropped_stores", "cuda_errors")
_TIMINGS = ("lookup_s", "load_s", "store_s")
_MAX_SAMPLES = 10_000


@dataclass
class LmshmConnectorStats(KVConnectorStats if KVConnectorStats is not None else object):  # type: ignore[misc]
    """Counters (summed over ranks and the scheduler) and latency samples (seconds)."""

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in _COUNTERS:
            self.data.setdefault(name, 0)
        for name in _TIMINGS:
            self.data.setdefault(name, [])

    def reset(self) -> None:
        self.data = {}
        self.__post_init__()

    def aggregate(self, other: Any) -> "LmshmConnectorStats":
        theirs = getattr(other, "data", {}) or {}
        for name in _COUNTERS:
            self.data[name] += int(theirs.get(name, 0))
        for name in _TIMINGS:
            room = _MAX_SAMPLES - len(self.data[name])
            self.data[name].extend(list(theirs.get(name, []))[:max(0, room)])
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {name: self.data[name] for name in _COUNTERS}
        for name in _TIMINGS:
            samples = self.data[name]
            out[f"{name[:-2]}_p50_ms"] = round(statistics.median(samples) * 1e3, 3) if samples else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in _COUNTERS) and not any(self.data[n] for n in _TIMINGS)


if KVConnectorPromMetrics is not None:

    class LmshmPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc,valid-type]
        """``vllm:lmshm_*`` counters and latency histograms, one series per engine."""

        _HELP = {
            "lookups": "LOOKUPs the scheduler sent to lmshm-server",
            "hit_tokens": "prompt tokens lmshm-server offered to supply",
            "loaded_chunks": "chunks loaded from lmshm-server (every rank)",
            "loaded_bytes": "KV bytes loaded from lmshm-server (every rank)",
            "stored_chunks": "chunks stored in lmshm-server (every rank)",
            "stored_bytes": "KV bytes stored in lmshm-server (every rank)",
            "failed_loads": "loads that failed and were recomputed",
            "dropped_stores": "STOREs dropped (server unreachable, timed out, or shut down first)",
            "cuda_errors": "CUDA ordering steps that failed in the worker (each a recomputed load or dropped store)",
        }

        def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                     per_engine_labelvalues: dict[int, list[object]]) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self._counters: dict[str, dict[int, Any]] = {}
            self._histograms: dict[str, dict[int, Any]] = {}
            for name in _COUNTERS:
                metric = self._counter_cls(name=f"vllm:lmshm_{name}", documentation=self._HELP[name],
                                           labelnames=labelnames)
                self._counters[name] = {i: metric.labels(*v) for i, v in per_engine_labelvalues.items()}
            buckets = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
            for name in _TIMINGS:
                metric = self._histogram_cls(name=f"vllm:lmshm_{name[:-2]}_seconds",
                                             documentation=f"lmshm {name[:-2]} latency (seconds)",
                                             buckets=buckets, labelnames=labelnames)
                self._histograms[name] = {i: metric.labels(*v) for i, v in per_engine_labelvalues.items()}

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            for name in _COUNTERS:
                value = int(transfer_stats_data.get(name, 0))
                if value and engine_idx in self._counters[name]:
                    self._counters[name][engine_idx].inc(value)
            for name in _TIMINGS:
                hist = self._histograms[name].get(engine_idx)
                for sample in transfer_stats_data.get(name, []) if hist is not None else ():
                    hist.observe(float(sample))


def prom_metrics(vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> Any:
    """``LmshmPromMetrics`` for vLLM, or None where this vLLM has no connector metrics."""
    if KVConnectorPromMetrics is None:
        return None
    return LmshmPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
