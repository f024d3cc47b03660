"""Prometheus metrics of one ``lmshm.Server`` (``GET /metrics`` on the HTTP endpoint).

Each server has its own ``CollectorRegistry``, so several servers in one process (tests, an
application with two) never mix their figures. Two kinds of series:
- events, counted as they happen: requests by endpoint, type and code with a latency
  histogram, and session reclaims with theirs;
- state, read from the registry, the mapping table and the data plane at scrape time (a
  collector, so a scrape costs one pass over the registrations and nothing in between; the
  pool's figures are counters it keeps, so the pool's size costs a scrape nothing). An
  endpoint adds gauges of its own state with ``add_gauge`` (ZeroMQ: ``lmshm_sessions``).

Label values are bounded: endpoints, request types and codes are fixed sets; no series is
keyed by a name a peer chose.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest

from lmshm.platform.base.mappings import MAPPINGS

_LATENCY_BUCKETS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0)
# PoolInfo fields: which are running totals (counters) and which are levels (gauges).
_POOL_COUNTERS = ("hits", "misses", "stored", "store_skipped", "evictions", "evicted_bytes", "retrieved", "failed",
                  "pins_capped", "cuda_quarantined", "cuda_events_dropped", "late",
                  "cuda_copy_calls", "cuda_copy_pieces")
_POOL_GAUGES = ("capacity", "used", "objects", "in_flight", "pinned", "leases", "max_objects", "metadata_bytes",
                "pinned_bytes", "lease_pins", "uids", "cuda_pinned_bytes")

# TierInfo fields (one series per tier, labelled by its name: "disk", "remote").
_TIER_COUNTERS = ("hits", "misses", "promotions", "puts", "drops", "errors", "timeouts", "corrupt", "evictions",
                  "read_bytes", "written_bytes", "reads", "writes", "read_seconds", "write_seconds",
                  "direct_writes", "not_admitted", "probed")
_TIER_GAUGES = ("capacity", "used", "objects", "queue_depth", "queue_limit", "scanned", "scan_done")


class Metrics:
    """``registry``: the core's ``Registry``; ``pool_info``: returns the data plane's ``PoolInfo``."""

    def __init__(self, registry: Any, pool_info: Callable[[], Any],
                 tenants: Optional[Callable[[], list]] = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("lmshm_requests", "Requests answered, by endpoint, request type and result code",
                                ("endpoint", "request", "code"), registry=self.registry)
        self.latency = Histogram("lmshm_request_seconds", "Time from a request's arrival to its answer",
                                 ("endpoint", "request"), buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.reclaims = Counter("lmshm_reclaims", "Sessions whose registrations were reclaimed, by reason",
                                ("reason",), registry=self.registry)
        self.reclaim_latency = Histogram("lmshm_reclaim_seconds", "Time to release what an ended session held",
                                         buckets=_LATENCY_BUCKETS, registry=self.registry)
        self._state = _StateCollector(registry, pool_info, tenants)
        self.registry.register(self._state)

    def add_gauge(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        """A gauge read at scrape time: state an endpoint keeps (``read`` runs on the scraping
        thread, so it must be safe there)."""
        self._state.gauges.append((name, documentation, read))

    def observe(self, endpoint: str, request: str, code: str, seconds: float) -> None:
        self.requests.labels(endpoint, request, code).inc()
        self.latency.labels(endpoint, request).observe(seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector:
    """Gauges (and the data plane's running totals) read when Prometheus scrapes."""

    def __init__(self, registry: Any, pool_info: Callable[[], Any],
                 tenants: Optional[Callable[[], list]] = None) -> None:
        self._registry, self._pool_info, self._tenants = registry, pool_info, tenants
        self.gauges: list[tuple[str, str, Callable[[], float]]] = []

    def describe(self) -> list[Any]:
        return []  # collected lazily: the registry must not call collect() at registration

    def collect(self) -> Iterator[Any]:

        regs = GaugeMetricFamily("lmshm_registrations", "Live registrations, by kind (kv, system, cuda)",
                                 labels=("kind",))
        nbytes = GaugeMetricFamily("lmshm_registered_bytes", "Bytes the live registrations map, by kind",
                                   labels=("kind",))
        counts = {"kv": 0, "system": 0, "cuda": 0}
        sizes = dict.fromkeys(counts, 0)
        for r in self._registry.registrations():
            counts[r.kind] = counts.get(r.kind, 0) + 1
            sizes[r.kind] = sizes.get(r.kind, 0) + r.nbytes
        for kind in counts:
            regs.add_metric((kind,), counts[kind])
            nbytes.add_metric((kind,), sizes[kind])
        yield regs
        yield nbytes
        maps = GaugeMetricFamily("lmshm_mappings", "Live entries of the server's mapping table, by kind",
                                 labels=("kind",))
        by_kind: dict[str, int] = {}
        for key in MAPPINGS.keys():
            kind = key[0] if isinstance(key, tuple) and key and isinstance(key[0], str) else "other"
            by_kind[kind] = by_kind.get(kind, 0) + 1
        for kind, n in sorted(by_kind.items()):
            maps.add_metric((kind,), n)
        yield maps
        yield GaugeMetricFamily("lmshm_draining", "Unregistered registrations still held by a view or a copy",
                                value=self._registry.draining)
        for name, documentation, read in list(self.gauges):
            yield GaugeMetricFamily(name, documentation, value=read())
        pool = self._pool_info()
        for name in _POOL_GAUGES:
            yield GaugeMetricFamily(f"lmshm_pool_{name}", f"Data plane: {name.replace('_', ' ')}",
                                    value=getattr(pool, name))
        for name in _POOL_COUNTERS:
            yield CounterMetricFamily(f"lmshm_pool_{name}", f"Data plane: {name.replace('_', ' ')} so far",
                                      value=getattr(pool, name))
        path = getattr(pool, "cuda_copy_path", "")
        if path:   # which way CUDA copies reach the driver (1 for the path in use)
            paths = GaugeMetricFamily("lmshm_pool_cuda_copy_path", "Data plane: how CUDA copies are queued "
                                      "(batch: one cuMemcpyBatchAsync per request; per-piece)", labels=("path",))
            for name in ("batch", "per-piece"):
                paths.add_metric((name,), int(name in path.split("/")))
            yield paths
        if self._tenants is not None:
            # uids are the kernel's, not names a peer chose; the 32 largest at most
            used = GaugeMetricFamily("lmshm_pool_uid_used_bytes", "Pool bytes charged to a uid (the 32 largest)",
                                     labels=("uid",))
            objects = GaugeMetricFamily("lmshm_pool_uid_objects", "Pool objects of a uid (the 32 largest)",
                                        labels=("uid",))
            for uid, nbytes, n in self._tenants():
                used.add_metric((str(uid),), nbytes)
                objects.add_metric((str(uid),), n)
            yield used
            yield objects
        tiers = getattr(pool, "tiers", [])
        for name in _TIER_GAUGES:
            family = GaugeMetricFamily(f"lmshm_tier_{name}", f"Tier below the pool: {name.replace('_', ' ')}",
                                       labels=("tier",))
            for t in tiers:
                family.add_metric((t.name,), getattr(t, name))
            yield family
        for name in _TIER_COUNTERS:
            family = CounterMetricFamily(f"lmshm_tier_{name}", f"Tier below the pool: {name.replace('_', ' ')} so far",
                                         labels=("tier",))
            for t in tiers:
                family.add_metric((t.name,), getattr(t, name))
            yield family
