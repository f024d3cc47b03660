"""The status page on lmshm-server's HTTP endpoint (``GET /status``, ``/status.json``).

A real server with a disk tier and ``--http-port`` takes STOREs and LOOKUPs from an MPClient;
``/status.json`` must show what ``lmshm status --json`` shows at the same moment, the chart
library must come from the installed ``plotly`` package, and a real headless Chromium
(Playwright driving Debian's ``chromium``, scripts/test installs both) must load the page with
nothing from the network, show the same figures, and add chart points as traffic runs."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from attacks import free_port
from harness import ServerProcess

from lmshm.endpoints.status_page import PAGE_POLICY, plotly_js_path
from lmshm.transport.client import MPClient

CHROMIUM = "/usr/bin/chromium"
BLOCKS = 64
#: Figures that move by themselves between two reads of a quiet server.
MOVING = ("uptime_s", "open_fds")


class Traffic:
    """An MPClient with one KV registration that stores new chunks and looks them up."""

    def __init__(self, url: str) -> None:
        self.kv = torch.zeros(BLOCKS, 4, 64)
        self.client = MPClient(url, client_name="status-page-test")
        self.iid = self.client.register_kv_caches({"l0": self.kv}, "w0", model_name="tiny-model")
        self.n = 0

    def store(self, count: int) -> None:
        keys = [(self.n + i).to_bytes(4, "big") + bytes(28) for i in range(count)]
        self.n += count
        self.client.store(self.iid, keys, [i % BLOCKS for i in range(count)], 1)
        self.client.lookup([keys + [b"m" * 32]])       # all found, then one miss

    def close(self) -> None:
        self.client.close()
        del self.kv
        gc.collect()


@contextlib.contextmanager
def serving(tmp_path: Path) -> Iterator[tuple[ServerProcess, str, Traffic]]:
    port = free_port()
    server = ServerProcess(tmp_path, "--capacity", "64MiB", "--disk", str(tmp_path / "disk"), "--disk-capacity",
                           "64MiB", "--http-port", str(port))
    traffic = None
    try:
        traffic = Traffic(server.url)
        yield server, f"http://127.0.0.1:{port}", traffic
    finally:
        if traffic is not None:
            traffic.close()
        assert server.stop() == 0, server.log()


def _get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read()


def _json(base: str) -> dict:
    status, kind, body = _get(f"{base}/status.json")
    assert status == 200 and kind.startswith("application/json"), (status, body[:300])
    return json.loads(body)


def _cli(url: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "lmshm.cli", "status", "--url", url, "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _steady(status: dict) -> dict:
    """``status`` without the figures that move on a quiet server (and registrations' ages)."""
    s = {k: v for k, v in status.items() if k not in MOVING}
    s["registrations"] = [{k: v for k, v in r.items() if k != "age_s"} for r in status["registrations"]]
    return s


def _quiet(base: str) -> dict:
    """Wait until the disk tier's write-throughs are done and two reads agree."""
    deadline = time.monotonic() + 20
    last = None
    while time.monotonic() < deadline:
        now = _steady(_json(base)["status"])
        tiers = now["pool"]["tiers"]
        if now == last and all(t["queue_depth"] == 0 for t in tiers):
            return now
        last = now
        time.sleep(0.2)
    raise AssertionError(f"the server's figures did not settle: {last}")


def test_status_json_shows_what_lmshm_status_json_shows_and_the_page_and_chart_library_are_served(tmp_path):
    with serving(tmp_path) as (server, base, traffic):
        traffic.store(8)
        _get(f"{base}/no-such-route")                   # one error for the page's error table
        steady = _quiet(base)
        cli = _cli(server.url)
        after = _json(base)
        assert _steady(cli) == steady == _steady(after["status"])
        pool = after["status"]["pool"]
        assert pool["stored"] == 8 and pool["hits"] == 8 and pool["misses"] == 1
        disk = next(t for t in pool["tiers"] if t["name"] == "disk")
        assert disk["puts"] == 8 and disk["written_bytes"] > 0
        assert [r["instance_id"] for r in after["status"]["registrations"]] == ["w0"]
        assert after["tenants"] == [{"uid": os.getuid(), "used": pool["used"], "objects": 8}]
        assert {"endpoint": "http", "request": "unknown", "code": "NOT_FOUND", "count": 1} in after["errors"]

        status, kind, page = _get(f"{base}/status")
        assert status == 200 and kind.startswith("text/html")
        assert b'<script src="/status/plotly.min.js"></script>' in page
        assert b"http://" not in page and b"https://" not in page     # no CDN, no other host

        status, kind, js = _get(f"{base}/status/plotly.min.js")
        assert status == 200 and kind.startswith("application/javascript")
        installed = plotly_js_path()
        assert "site-packages" in str(installed) or "dist-packages" in str(installed)
        assert js == installed.read_bytes() and len(js) > 1_000_000

        status, _, body = _get(f"{base}/status.json?limit=x")
        assert status == 400 and "whole number" in json.loads(body)["error"]


def _browser() -> Any:
    """Playwright's sync API, or a skip saying what is missing (scripts/test installs both)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        pytest.skip(f"the Python package playwright is not installed ({exc}); scripts/bootstrap installs it "
                    "(pip install -e '.[test]')")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no {CHROMIUM}: scripts/test installs Debian's chromium (apt-get install -y chromium) when "
                    "it runs as root with apt-get; it could not here")
    return sync_playwright


#: Records every Content-Security-Policy refusal on the page: ``[directive, blocked URI]``.
VIOLATIONS = ("window.lmshmViolations = []; document.addEventListener('securitypolicyviolation', "
              "e => window.lmshmViolations.push([e.violatedDirective, e.blockedURI]));")


def _cells(page: Any, ids: list[str]) -> dict[str, int]:
    return page.evaluate("ids => Object.fromEntries(ids.map(id => [id, Number(document.getElementById(id)"
                         ".dataset.raw)]))", ids)


def test_the_page_in_a_real_browser_loads_nothing_from_the_network_shows_lmshm_status_figures_and_charts_grow(
        tmp_path):
    sync_playwright = _browser()
    with serving(tmp_path) as (server, base, traffic), sync_playwright() as p:
        traffic.store(4)
        _quiet(base)
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            elsewhere: list[str] = []
            errors: list[str] = []

            def route(r: Any) -> None:
                if r.request.url.startswith(base + "/"):
                    r.continue_()
                else:
                    elsewhere.append(r.request.url)
                    r.abort()

            page.route("**/*", route)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.add_init_script(VIOLATIONS)
            response = page.goto(f"{base}/status")
            assert response is not None and response.headers["content-security-policy"] == PAGE_POLICY
            page.wait_for_function("() => window.Plotly && window.lmshmStatus.polls >= 2", timeout=20_000)
            cli = _cli(server.url)
            polls = page.evaluate("window.lmshmStatus.polls")
            page.wait_for_function(f"() => window.lmshmStatus.polls > {polls}", timeout=10_000)   # a poll after the CLI

            pool = cli["pool"]
            disk = next(t for t in pool["tiers"] if t["name"] == "disk")
            shown = _cells(page, ["pool-capacity", "pool-used", "pool-objects", "pool-hits", "pool-misses",
                                  "pool-chunks_in", "pool-chunks_out", "pool-evictions", "disk-capacity", "disk-used",
                                  "disk-objects", "disk-chunks_in", "disk-bytes_in", "disk-bytes_out",
                                  "disk-corrupt", f"uid-{os.getuid()}-used"])
            assert shown == {"pool-capacity": pool["capacity"], "pool-used": pool["used"],
                             "pool-objects": pool["objects"], "pool-hits": pool["hits"],
                             "pool-misses": pool["misses"], "pool-chunks_in": pool["stored"],
                             "pool-chunks_out": pool["retrieved"], "pool-evictions": pool["evictions"],
                             "disk-capacity": disk["capacity"], "disk-used": disk["used"],
                             "disk-objects": disk["objects"], "disk-chunks_in": disk["puts"],
                             "disk-bytes_in": disk["written_bytes"], "disk-bytes_out": disk["read_bytes"],
                             "disk-corrupt": disk["corrupt"], f"uid-{os.getuid()}-used": pool["used"]}
            assert page.inner_text("#pool-rate") == f"{100 * pool['hits'] / (pool['hits'] + pool['misses']):.1f} %"
            assert page.inner_text("#pool-capacity") == "64.0 MiB"
            assert page.inner_text("#remote-none") == "not configured"       # no remote tier
            rows = page.eval_on_selector_all("#registrations tbody tr", "rows => rows.map(r => r.innerText)")
            assert len(rows) == 1 and "w0" in rows[0] and "tiny-model" in rows[0]
            assert page.inner_text("#summary").count(f"{cli['sessions']} session(s)") == 1

            points = page.evaluate("document.getElementById('chart-chunks').data[0].x.length")
            traffic.store(16)
            stored = pool["stored"] + 16
            page.wait_for_function(
                f"() => Number(document.getElementById('pool-chunks_in').dataset.raw) === {stored} && "
                f"document.getElementById('chart-chunks').data[0].y.some(v => v > 0) && "
                f"document.getElementById('chart-chunks').data[0].x.length > {points}", timeout=15_000)
            rate = page.evaluate("document.getElementById('chart-rate').data[0].y")
            assert any(v is not None and 0 < v <= 100 for v in rate), rate
            assert _cli(server.url)["pool"]["stored"] == stored
            assert not errors, errors
            # Under the page's policy (issue 41) only plotly.js's map styles, which the page does not use, are refused.
            refused = page.evaluate("() => window.lmshmViolations")
            assert all(v[0] == "style-src-elem" for v in refused), refused
            assert _json(base)["errors"] == []      # the page asked for nothing it lacks (no favicon 404)
        finally:
            browser.close()
        assert not elsewhere, f"the page asked for something not on the server: {elsewhere}"
