"""The Grafana dashboard in docs/grafana names only metrics a real lmshm-server exports.

A server with a disk tier takes STOREs and LOOKUPs, so every series the dashboard uses
(per-tier counters, the latency histogram, per-uid usage) exists; then every metric name in
every panel's query must appear in its ``/metrics``."""

from __future__ import annotations

import gc
import json
import re
import urllib.request
from pathlib import Path

import torch
from attacks import free_port
from harness import ServerProcess

from lmshm.transport.client import MPClient

DASHBOARD = Path(__file__).resolve().parents[3] / "docs" / "grafana" / "lmshm-dashboard.json"


def _names(dashboard: dict) -> set[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs.append(next(v["query"] for v in dashboard["templating"]["list"] if v["name"] == "instance"))
    return {m for e in exprs for m in re.findall(r"\blmshm_[a-z0-9_]+", e)}


def test_every_metric_the_dashboard_queries_is_exported(tmp_path):
    dashboard = json.loads(DASHBOARD.read_text())
    assert {p["type"] for p in dashboard["panels"]} <= {"timeseries", "stat"}
    port = free_port()
    server = ServerProcess(tmp_path, "--capacity", "64MiB", "--disk", str(tmp_path / "disk"), "--disk-capacity",
                           "64MiB", "--http-port", str(port))
    try:
        client = MPClient(server.url)
        kv = torch.zeros(16, 4, 64)
        iid = client.register_kv_caches({"l0": kv}, "w0", model_name="m")
        keys = [bytes([i]) * 32 for i in range(4)]
        client.store(iid, keys, list(range(4)), 1)
        client.lookup([keys + [b"x" * 32]])
        client.close()
        del kv
        gc.collect()
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        assert server.stop() == 0, server.log()
    exported = set(re.findall(r"^(lmshm_[a-z0-9_]+)", text, re.M))
    for name, _kind in re.findall(r"^# TYPE (lmshm_[a-z0-9_]+) (\w+)", text, re.M):   # families with no series yet
        exported |= {name, f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    missing = sorted(n for n in _names(dashboard) if n not in exported)
    assert not missing, f"the dashboard queries metrics lmshm-server does not export: {missing}"
    assert re.search(r'^lmshm_pool_uid_used_bytes\{uid="\d+"\} [1-9]', text, re.M), "no per-uid usage"
