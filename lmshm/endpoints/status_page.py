"""A read-only status page on the HTTP endpoint: ``GET /status``, its data ``GET /status.json``.

The page is one HTML document whose script polls ``/status.json`` every ``POLL_MS`` and draws
its charts with plotly.js, served from the pinned ``plotly`` package's own files at
``GET /status/plotly.min.js``: the page loads nothing from anywhere else, and the history lives
in the browser, so the server keeps nothing per viewer. ``/status.json``'s ``status`` is exactly
what ``lmshm status --json`` prints for the same ``offset`` and ``limit``.

Access is that of ``/metrics`` (anyone who reaches the endpoint), but no page of another origin
(``browser_guard``); ``PAGE_POLICY`` lets the page run only its own script and style, and
nothing here changes state. The trap: the pool counts hits in chunks and misses in LOOKUPs, so
its "hit rate" is an approximation; the tiers count both in chunks. docs/status-page.md.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from importlib import resources
from typing import Any, Optional

from aiohttp import web

from lmshm.core.errors import ErrorCode, ServerError
from lmshm.transport.client import status_as_dict
from lmshm.wire.protocol import STATUS_PAGE

#: How often the page asks for ``/status.json`` (milliseconds), and how many points it keeps.
POLL_MS = 1000
HISTORY = 600
#: ``lmshm status``'s default page of registrations.
DEFAULT_LIMIT = 50
#: The request types the metrics count these routes under (``lmshm_requests{request=...}``).
OPERATIONS = {"/status": "StatusPage", "/status.json": "StatusJson", "/status/plotly.min.js": "StatusAsset"}
#: The chart library's file inside the installed ``plotly`` package.
PLOTLY_JS = ("plotly", "package_data", "plotly.min.js")

_asset_lock = threading.Lock()
_asset: Optional[bytes] = None


def plotly_js_path() -> Any:
    """The installed ``plotly.min.js`` (an ``importlib.resources`` path); raises
    ``ModuleNotFoundError`` without the ``plotly`` package."""
    package, *parts = PLOTLY_JS
    path = resources.files(package)
    for part in parts:
        path = path / part
    return path


def _plotly_js() -> bytes:
    global _asset
    with _asset_lock:
        if _asset is None:
            try:
                _asset = plotly_js_path().read_bytes()
            except (ModuleNotFoundError, OSError) as exc:
                raise ServerError(ErrorCode.NOT_FOUND,
                                  f"the status page's chart library is not installed ({exc}): pip install "
                                  "lmshm's dependencies (plotly), or scripts/bootstrap") from None
        return _asset


def tenant_usage(pool: Any, limit: int = 32) -> list[tuple[int, int, int]]:
    """``(uid, bytes charged, visible objects)`` of the ``limit`` uids holding the most: the
    pool's own ``tenant_usage``, what ``/metrics`` exports as ``lmshm_pool_uid_used_bytes``."""
    return [] if pool is None else list(pool.tenant_usage(limit))


def request_errors(metrics: Any) -> list[dict[str, Any]]:
    """Answered requests whose code was not OK: ``{"endpoint", "request", "code", "count"}``."""
    rows = []
    for family in metrics.requests.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels.get("code") != "OK" and sample.value:
                rows.append({"endpoint": sample.labels["endpoint"], "request": sample.labels["request"],
                             "code": sample.labels["code"], "count": int(sample.value)})
    rows.sort(key=lambda r: -r["count"])
    return rows


def snapshot(server: Any, offset: int = 0, limit: int = DEFAULT_LIMIT) -> dict[str, Any]:
    """What ``/status.json`` answers (see the module docstring)."""
    status = server.status_reply(offset=offset, limit=min(limit, STATUS_PAGE))
    pool = getattr(server.dataplane, "pool", None)
    return {"status": status_as_dict(status),
            "tenants": [{"uid": uid, "used": used, "objects": objects}
                        for uid, used, objects in tenant_usage(pool)],
            "errors": request_errors(server.metrics),
            "time": time.time()}


def _count(request: web.Request, name: str, default: int) -> int:
    text = request.query.get(name)
    if text is None:
        return default
    if not text.isdigit() or len(text) > 12:
        raise ServerError(ErrorCode.INVALID_ARG, f"'{name}' must be a whole number >= 0")
    return int(text)


class StatusPage:
    """The three routes; ``add_routes`` puts them on the HTTP endpoint's router."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_get("/status", self.page)
        router.add_get("/status.json", self.data)
        router.add_get("/status/plotly.min.js", self.asset)

    async def page(self, request: web.Request) -> web.Response:
        return web.Response(text=_PAGE, content_type="text/html",
                            headers={"Cache-Control": "no-store", "Content-Security-Policy": PAGE_POLICY})

    async def data(self, request: web.Request) -> web.Response:
        body = snapshot(self.server, _count(request, "offset", 0), _count(request, "limit", DEFAULT_LIMIT))
        return web.Response(text=json.dumps(body), content_type="application/json",
                            headers={"Cache-Control": "no-store"})

    async def asset(self, request: web.Request) -> web.Response:
        return web.Response(body=_plotly_js(), content_type="application/javascript",
                            headers={"Cache-Control": "max-age=3600"})


PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>lmshm-server status</title>
<link rel="icon" href="data:,">
<style>
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .4em 0; }
th, td { border: 1px solid #ccc; padding: .25em .6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.charts { display: flex; flex-wrap: wrap; gap: 1em; }
.chart { width: 480px; height: 280px; }
#problem { color: #a00; }
.muted { color: #888; }
td[colspan] { text-align: center; color: #888; }
</style>
<script src="/status/plotly.min.js"></script>
</head>
<body>
<h1>lmshm-server <span id="server"></span></h1>
<p id="summary"></p>
<p id="problem"></p>
<p id="charts-problem" class="muted"></p>

<h2>Tiers</h2>
<table id="tiers">
<thead><tr><th>tier</th><th>capacity</th><th>used</th><th>objects</th><th>hits</th><th>misses</th>
<th>hit rate</th><th>chunks in</th><th>chunks out</th><th>bytes in</th><th>bytes out</th><th>evictions</th>
<th>corrupt</th></tr></thead>
<tbody></tbody>
</table>
<p class="muted">pool: hits are chunks found, misses LOOKUPs that found fewer than asked; chunks in are
chunks stored, out chunks retrieved (the pool counts no bytes). disk, remote: chunks written through
and promoted back into the pool, and their bytes.</p>

<div class="charts">
<div id="chart-rate" class="chart"></div>
<div id="chart-chunks" class="chart"></div>
<div id="chart-bytes" class="chart"></div>
</div>

<h2>Pool usage by uid</h2>
<table id="tenants"><thead><tr><th>uid</th><th>used</th><th>objects</th></tr></thead><tbody></tbody></table>

<h2>Registered engines</h2>
<p id="registrations-note"></p>
<table id="registrations">
<thead><tr><th>name</th><th>kind</th><th>owner pid</th><th>uid</th><th>client</th><th>model / key</th>
<th>rank</th><th>layers</th><th>block dim</th><th>bytes</th><th>wrappers</th><th>devices</th><th>age</th></tr></thead>
<tbody></tbody>
</table>
<table id="owners">
<thead><tr><th>owner pid</th><th>uid</th><th>session</th><th>client</th><th>registrations</th><th>layers</th>
<th>bytes</th></tr></thead>
<tbody></tbody>
</table>

<h2>Requests answered with an error</h2>
<table id="errors"><thead><tr><th>endpoint</th><th>request</th><th>code</th><th>count</th></tr></thead>
<tbody></tbody></table>

<script>
"use strict";
const POLL_MS = __POLL_MS__, HISTORY = __HISTORY__;
const TIERS = ["pool", "disk", "remote"];
const state = {polls: 0, last: null, points: 0, data: null};
window.lmshmStatus = state;

function human(n) {
  if (n === null || n === undefined) return "\u2014";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = n, i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return i === 0 ? `${v} B` : `${v.toFixed(1)} ${units[i]}`;
}
function count(n) { return n === null || n === undefined ? "\u2014" : n.toLocaleString("en-US"); }
function rate(h, m) { return h + m ? (100 * h / (h + m)).toFixed(1) + " %" : "\u2014"; }
function age(s) {
  if (s < 60) return s.toFixed(1) + "s";
  if (s < 3600) return `${Math.floor(s / 60)}m${String(Math.floor(s % 60)).padStart(2, "0")}s`;
  return `${Math.floor(s / 3600)}h${String(Math.floor(s % 3600 / 60)).padStart(2, "0")}m`;
}
function cell(text, id, raw) {
  const td = document.createElement("td");
  td.textContent = text;
  if (id) td.id = id;
  if (raw !== undefined && raw !== null) td.dataset.raw = String(raw);
  return td;
}
function fill(table, rows) {
  const body = document.querySelector(`#${table} tbody`);
  body.replaceChildren(...rows.map(cells => { const tr = document.createElement("tr"); tr.append(...cells); return tr; }));
}

// One row per tier: what it counts, in the page's columns (null: the tier does not count it).
function tiers(pool) {
  const rows = {pool: {capacity: pool.capacity, used: pool.used, objects: pool.objects, hits: pool.hits,
                       misses: pool.misses, chunks_in: pool.stored, chunks_out: pool.retrieved, bytes_in: null,
                       bytes_out: null, evictions: pool.evictions, corrupt: null}};
  for (const t of pool.tiers || []) {
    rows[t.name] = {capacity: t.capacity, used: t.used, objects: t.objects, hits: t.hits, misses: t.misses,
                    chunks_in: t.puts, chunks_out: t.promotions, bytes_in: t.written_bytes, bytes_out: t.read_bytes,
                    evictions: t.evictions, corrupt: t.corrupt};
  }
  return rows;
}

const charts = {
  "chart-rate": {title: "hit rate (%, per interval)", y: "%"},
  "chart-chunks": {title: "chunks in / out per second", y: "chunks/s"},
  "chart-bytes": {title: "bytes in / out per second (disk, remote)", y: "bytes/s"},
};
function traces(id) {
  if (id === "chart-rate") return TIERS.map(t => ({name: t, key: t}));
  const names = id === "chart-chunks" ? TIERS : TIERS.slice(1);
  return names.flatMap(t => [{name: `${t} in`, key: `${t}:in`}, {name: `${t} out`, key: `${t}:out`}]);
}
function setupCharts() {
  if (!window.Plotly) {
    document.getElementById("charts-problem").textContent = "the chart library (/status/plotly.min.js) did not load: no charts";
    return;
  }
  for (const [id, c] of Object.entries(charts)) {
    Plotly.newPlot(id, traces(id).map(t => ({x: [], y: [], name: t.name, mode: "lines", type: "scatter"})),
                   {title: {text: c.title, font: {size: 13}}, margin: {l: 55, r: 10, t: 35, b: 55},
                    yaxis: {title: {text: c.y}, rangemode: "tozero"}, legend: {orientation: "h"}},
                   {displayModeBar: false, responsive: true});
  }
}
function appendPoints(now, prev, cur, dt) {
  if (!window.Plotly) return;
  const when = new Date(now * 1000);
  const value = {};
  for (const t of TIERS) {
    const a = prev[t], b = cur[t];
    if (!a || !b) continue;
    const dh = b.hits - a.hits, dm = b.misses - a.misses;
    value[t] = dh + dm > 0 ? 100 * dh / (dh + dm) : null;
    value[`${t}:in`] = (b.chunks_in - a.chunks_in) / dt;
    value[`${t}:out`] = (b.chunks_out - a.chunks_out) / dt;
    value[`${t}:in:bytes`] = b.bytes_in === null ? null : (b.bytes_in - a.bytes_in) / dt;
    value[`${t}:out:bytes`] = b.bytes_out === null ? null : (b.bytes_out - a.bytes_out) / dt;
  }
  for (const id of Object.keys(charts)) {
    const keys = traces(id).map(t => id === "chart-bytes" ? `${t.key}:bytes` : t.key);
    const ys = keys.map(k => [k in value ? value[k] : null]);
    Plotly.extendTraces(id, {x: keys.map(() => [when]), y: ys}, keys.map((_, i) => i), HISTORY);
  }
  state.points++;
}

function render(d) {
  const s = d.status, p = s.pool;
  document.getElementById("server").textContent = `pid ${s.server_pid}`;
  document.getElementById("summary").textContent =
    `up ${age(s.uptime_s)}, protocol 3.${s.protocol_minor}, isolated_ipc=${s.isolated_ipc ? "on" : "off"}, ` +
    `${s.sessions} session(s), ${count(s.registrations_total)} registration(s), ${s.mappings} mapping(s), ` +
    `${s.open_fds} open fds of ${s.fd_limit}` + (s.draining ? `, ${s.draining} draining` : "");
  const rows = tiers(p);
  const bytesCols = new Set(["capacity", "used", "bytes_in", "bytes_out"]);
  const cols = ["capacity", "used", "objects", "hits", "misses", "rate", "chunks_in", "chunks_out", "bytes_in",
                "bytes_out", "evictions", "corrupt"];
  fill("tiers", TIERS.map(t => {
    const r = rows[t];
    if (!r) { const none = cell("not configured", `${t}-none`); none.colSpan = cols.length; return [cell(t), none]; }
    return [cell(t), ...cols.map(c => c === "rate" ? cell(rate(r.hits, r.misses), `${t}-rate`)
      : cell(bytesCols.has(c) ? human(r[c]) : count(r[c]), `${t}-${c}`, r[c]))];
  }));
  fill("tenants", d.tenants.map(u => [cell(String(u.uid)), cell(human(u.used), `uid-${u.uid}-used`, u.used),
                                      cell(count(u.objects), `uid-${u.uid}-objects`, u.objects)]));
  fill("registrations", s.registrations.map(r => [
    cell(r.instance_id), cell(r.kind), cell(r.kind === "kv" ? String(r.owner_pid) : "-"),
    cell(r.kind === "kv" ? String(r.owner_uid) : "-"), cell(r.client_name || "-"),
    cell(r.kind === "kv" ? (r.model_name || "-") : r.kind === "system" ? `${r.key} +${r.offset}` : `device ${r.device_id}`),
    cell(r.kind === "kv" ? `${r.worker_rank}/${r.world_size}` : "-"), cell(String(r.num_layers), null, r.num_layers),
    cell(String(r.block_dim)), cell(human(r.nbytes), null, r.nbytes), cell(r.kinds.join(",")),
    cell(r.devices.join(",")), cell(age(r.age_s))]));
  const listed = s.registrations.length, total = s.registrations_total;
  document.getElementById("registrations-note").textContent = total > listed
    ? `${listed} of ${count(total)} listed, oldest first; by owner below` : (total ? "" : "no registrations");
  fill("owners", total > listed ? s.owners.map(o => [
    cell(o.kind === "regions" ? "regions" : String(o.owner_pid)), cell(String(o.owner_uid)),
    cell(String(o.owner_session)), cell(o.client_name || "-"), cell(count(o.registrations)), cell(count(o.layers)),
    cell(human(o.nbytes))]) : []);
  document.getElementById("owners").hidden = !(total > listed);
  fill("errors", d.errors.map(e => [cell(e.endpoint), cell(e.request), cell(e.code), cell(count(e.count))]));
  return rows;
}

async function poll() {
  try {
    const response = await fetch("/status.json", {cache: "no-store"});
    if (!response.ok) throw new Error(`/status.json answered ${response.status}`);
    const d = await response.json();
    const rows = render(d);
    if (state.last) {
      const dt = Math.max(d.time - state.last.time, 1e-3);
      appendPoints(d.time, state.last.rows, rows, dt);
    }
    state.last = {time: d.time, rows};
    state.data = d;
    state.polls++;
    document.getElementById("problem").textContent = "";
  } catch (err) {
    document.getElementById("problem").textContent = `cannot read the server's status: ${err.message}`;
  }
  setTimeout(poll, POLL_MS);
}
setupCharts();
poll();
</script>
</body>
</html>
"""


_PAGE = PAGE.replace("__POLL_MS__", str(POLL_MS)).replace("__HISTORY__", str(HISTORY))


#: An empty inline element's hash: plotly.js adds an empty ``<style>`` and fills it with
#: ``insertRule`` (the CSS object model, which the policy does not govern).
EMPTY = "'sha256-47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU='"


def _digests(tag: str) -> str:
    """CSP sources that allow exactly the page's own inline ``<tag>`` elements, by their SHA-256."""
    bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", _PAGE, re.S)
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in bodies)


#: The page's Content-Security-Policy (every other answer gets ``browser_guard.SECURITY_HEADERS``'),
#: the least it was measured to need in Chromium: scripts from this server (the chart library) and
#: the page's own inline script, by hash; its own inline style, by hash, and plotly.js's empty
#: ``<style>``; ``fetch`` to this server; the ``data:`` favicon. plotly.js's map styles (the page
#: draws no maps) are refused; its style attributes are set through the CSS object model, which no
#: policy governs. No frame may hold the page.
PAGE_POLICY = (f"default-src 'none'; script-src 'self' {_digests('script')}; "
               f"style-src-elem {_digests('style')} {EMPTY}; connect-src 'self'; img-src data:; base-uri 'none'; "
               "form-action 'none'; frame-ancestors 'none'")
