"""A hostile web page against lmshm-server's HTTP endpoint, in a real headless Chromium (issue 41).

A real server (``--http-port``, ``--max-regions 64``) holds a live system shared-memory region
that tritonclient registered. A page of another origin, served by a real HTTP server on another
loopback port, tries everything a page can do without the user's help: forms (text/plain and
urlencoded), ``fetch`` in no-cors mode (text/plain, and bodies with no Content-Type), a CORS
``fetch`` of JSON (preflighted), ``sendBeacon``, a ``<script>`` tag that embeds ``/status.json``
and an ``<iframe>`` of ``/status``. A second page, served as ``http://evil.test:P`` with the name
resolving to the server (Chromium's ``--host-resolver-rules``, the situation DNS rebinding makes),
reads and writes as a same-origin page. The server must do nothing they ask: the live region
stays, no region of theirs appears, an honest register still succeeds, and the rebound page
reads nothing (421). tritonclient itself keeps working (``tests/v1/triton``)."""

from __future__ import annotations

import contextlib
import http.client
import json
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

from attacks import free_port
from harness import ServerProcess
from test_status_web_page import CHROMIUM, _browser

#: Chromium's Local Network Access checks stop a page that did not come from a loopback address
#: from reaching one, unless the user allows it when asked; this page's first answer is made up
#: (not from an address at all), so they are turned off: the server must hold without them, as
#: it must for browsers that lack them and users who click "Allow".
NO_LOCAL_NETWORK_CHECKS = "--disable-features=LocalNetworkAccessChecks,BlockInsecurePrivateNetworkRequests"
#: As many attempts to register as the server holds regions: before issue 41 they filled it.
MAX_REGIONS = 64

ATTACK_PAGE = r"""<!doctype html><html><body>
<iframe name="sink"></iframe>
<form id="plain" method="POST" enctype="text/plain" target="sink"
      action="__BASE__/v2/systemsharedmemory/region/evil-form/register">
<input name='{"key": "__KEY__", "byte_size": 64, "x": "' value='"}'></form>
<form id="urlenc" method="POST" target="sink" action="__BASE__/v2/systemsharedmemory/region/live/unregister">
<input name="a" value="b"></form>
<script>
"use strict";
const BASE = "__BASE__", KEY = "__KEY__";
const body = name => JSON.stringify({key: KEY, byte_size: 64});
window.results = {};
async function attack() {
  const tries = [];
  for (let i = 0; i < __N__; i++) {
    tries.push(fetch(`${BASE}/v2/systemsharedmemory/region/evil${i}/register`,
                     {method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"}, body: body()}));
  }
  // No Content-Type at all: a typed array or a Blob without a type.
  tries.push(fetch(`${BASE}/v2/systemsharedmemory/region/evil-raw/register`,
                   {method: "POST", mode: "no-cors", body: new TextEncoder().encode(body())}));
  tries.push(fetch(`${BASE}/v2/systemsharedmemory/region/evil-blob/register`,
                   {method: "POST", mode: "no-cors", body: new Blob([body()])}));
  tries.push(fetch(`${BASE}/v2/systemsharedmemory/region/live/unregister`, {method: "POST", mode: "no-cors"}));
  tries.push(fetch(`${BASE}/v2/systemsharedmemory/unregister`,
                   {method: "POST", mode: "no-cors", referrerPolicy: "no-referrer"}));
  // A CORS request with JSON: the browser asks first (OPTIONS), and must not be let through.
  tries.push(fetch(`${BASE}/v2/systemsharedmemory/region/evil-cors/register`,
                   {method: "POST", headers: {"Content-Type": "application/json"}, body: body()})
             .then(r => "read " + r.status, e => "refused"));
  // Through the attacker's own server: a 307 makes the browser repeat the POST to lmshm.
  tries.push(fetch(`/go?${encodeURIComponent(BASE + "/v2/systemsharedmemory/region/evil-redirect/register")}`,
                   {method: "POST", headers: {"Content-Type": "text/plain"}, body: body()}));
  tries.push(fetch(`/go?${encodeURIComponent(BASE + "/v2/systemsharedmemory/unregister")}`,
                   {method: "POST", mode: "no-cors", body: new Blob([body()])}));
  // From a sandboxed frame (an opaque origin): a form with no Content-Type restriction it can dodge.
  await new Promise(done => {
    const f = document.createElement("iframe");
    f.sandbox = "allow-scripts allow-forms";
    f.srcdoc = `<form method=POST enctype=multipart/form-data action="${BASE}/v2/systemsharedmemory/unregister">` +
               `<input name=a value=b></form><script>document.forms[0].submit()<\/script>`;
    f.onload = () => setTimeout(done, 3000);     // it submits as it loads (the answer is refused a frame)
    document.body.append(f);
  });
  const settled = await Promise.allSettled(tries);
  results.cors = settled[__N__ + 4].value;
  results.beacons = [
    navigator.sendBeacon(`${BASE}/v2/systemsharedmemory/region/evil-beacon/register`, new TextEncoder().encode(body())),
    navigator.sendBeacon(`${BASE}/v2/systemsharedmemory/region/evil-beacon2/register`, body()),
    navigator.sendBeacon(`${BASE}/v2/systemsharedmemory/region/live/unregister`)];
  for (const id of ["plain", "urlenc"]) {
    await new Promise(done => {
      const sink = document.querySelector("iframe[name=sink]");
      sink.onload = done;
      document.getElementById(id).submit();
      setTimeout(done, 5000);
    });
  }
  results.script = await new Promise(done => {
    const s = document.createElement("script");
    s.onload = () => done("load");
    s.onerror = () => done("error");
    s.src = `${BASE}/status.json`;
    document.body.append(s);
  });
  results.done = true;
}
attack();
</script>
<iframe id="framed" src="__BASE__/status"></iframe>
</body></html>
"""

REBOUND_PAGE = r"""<!doctype html><html><body><script>
"use strict";
window.results = {};
async function probe(name, path, init) {
  try {
    const r = await fetch(path, init);
    results[name] = [r.status, await r.text()];
  } catch (e) {
    results[name] = ["failed", String(e)];
  }
}
(async () => {
  await probe("status", "/status.json");
  await probe("metrics", "/metrics");
  await probe("lookup", "/v1/kv/lookup", {method: "POST", headers: {"Content-Type": "application/json"},
                                           body: JSON.stringify({block_hashes: [1, 2, 3]})});
  await probe("register", "/v2/systemsharedmemory/region/rebound/register",
              {method: "POST", headers: {"Content-Type": "application/json"},
               body: JSON.stringify({key: "__KEY__", byte_size: 64})});
  await probe("unregister", "/v2/systemsharedmemory/region/live/unregister", {method: "POST"});
  results.done = true;
})();
</script></body></html>
"""


@contextlib.contextmanager
def serving(tmp_path: Path, *args: str) -> Iterator[tuple[ServerProcess, int, Any, dict[str, str]]]:
    """A server (and ``args``) with a live region (registered by tritonclient), and two shm objects of this uid:
    ``live``'s and one an attacker would like to register."""
    import tritonclient.http as triton_http
    import tritonclient.utils.shared_memory as shared_memory

    port = free_port()
    server = ServerProcess(tmp_path, "--http-port", str(port), "--max-regions", str(MAX_REGIONS), *args)
    keys = {what: f"/lmshm_test_{what}_{secrets.token_hex(4)}" for what in ("live", "attacker", "honest")}
    handles = [shared_memory.create_shared_memory_region(k.lstrip("/"), k, 4096) for k in keys.values()]
    client = triton_http.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        client.register_system_shared_memory("live", keys["live"], 4096)
        yield server, port, client, keys
    finally:
        client.close()
        for h in handles:
            shared_memory.destroy_shared_memory_region(h)
        assert server.stop() == 0, server.log()


#: The attacker's web server: its files, and ``POST /go?URL`` answered 307 to URL (the browser
#: repeats the POST there, body and all, with ``Origin: null``).
SITE = r"""
import functools, http.server, sys, urllib.parse
class Handler(http.server.SimpleHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(307)
        self.send_header("Location", urllib.parse.unquote(self.path.split("?", 1)[1]))
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
handler = functools.partial(Handler, directory=sys.argv[2])
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), handler).serve_forever()
"""


@contextlib.contextmanager
def site(tmp_path: Path, html: str) -> Iterator[str]:
    """A real web server on another loopback port serving ``html`` as its index page."""
    root = tmp_path / f"site-{secrets.token_hex(3)}"
    root.mkdir()
    (root / "index.html").write_text(html)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SITE, str(port), str(root)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/"
    finally:
        proc.terminate()
        proc.wait(10)


def _regions(client: Any) -> list[str]:
    return sorted(r["name"] for r in client.get_system_shared_memory_status())


def _refused(port: int) -> int:
    """Requests the endpoint answered PERMISSION_DENIED (``lmshm_requests_total``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("lmshm_requests_total{") and 'endpoint="http"' in line
                   and 'code="PERMISSION_DENIED"' in line))


def test_a_page_of_another_origin_can_neither_unregister_nor_register_regions_nor_embed_or_frame_answers(tmp_path):
    sync_playwright = _browser()
    with serving(tmp_path) as (server, port, client, keys), sync_playwright() as p:
        base = f"http://127.0.0.1:{port}"
        html = (ATTACK_PAGE.replace("__BASE__", base).replace("__KEY__", keys["attacker"])
                .replace("__N__", str(MAX_REGIONS)))
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            with site(tmp_path, html) as url:
                page = browser.new_page()
                page.goto(url)
                page.wait_for_function("() => window.results && window.results.done", timeout=30_000)
                results = page.evaluate("() => window.results")
                framed = page.frame_locator("#framed").locator("body").inner_text(timeout=5000)
                frame_urls = [f.url for f in page.frames]
        finally:
            browser.close()
        time.sleep(0.5)                      # beacons are sent after the page has gone on
        assert _regions(client) == ["live"], results
        assert results["cors"] == "refused" and results["script"] == "error", results
        assert "lmshm-server" not in framed and f"{base}/status" not in frame_urls, (framed, frame_urls)
        # every attempt reached the server and was refused there, not lost on the way
        assert _refused(port) >= MAX_REGIONS + 4 + 3 + 2 + 2 + 1, server.log()[-2000:]
        client.register_system_shared_memory("honest", keys["honest"], 4096)      # no 503: room was kept
        assert _regions(client) == ["honest", "live"]
        client.unregister_system_shared_memory("honest")


def test_a_page_that_reaches_the_server_under_its_own_name_reads_and_changes_nothing(tmp_path):
    """DNS rebinding: the page is served as ``http://evil.test:P/`` and the name then resolves to
    the server, so its requests are same-origin, with ``Host: evil.test:P``."""
    sync_playwright = _browser()
    with serving(tmp_path) as (server, port, client, keys), sync_playwright() as p:
        evil = f"http://evil.test:{port}"
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--host-resolver-rules=MAP evil.test 127.0.0.1", NO_LOCAL_NETWORK_CHECKS])
        try:
            page = browser.new_page()
            # The first answer for evil.test came from the attacker's own address; every later one
            # reaches lmshm-server (the browser's resolver maps the name to it).
            page.route(f"{evil}/", lambda r: r.fulfill(status=200, content_type="text/html",
                                                     body=REBOUND_PAGE.replace("__KEY__", keys["attacker"])))
            page.goto(f"{evil}/")
            page.wait_for_function("() => window.results && window.results.done", timeout=30_000)
            results = page.evaluate("() => window.results")
        finally:
            browser.close()
        for what in ("status", "metrics", "lookup", "register", "unregister"):
            status, text = results[what]
            assert status == 421, (what, results[what])
            assert "--http-allow-host" in json.loads(text)["error"], text
        assert _regions(client) == ["live"]


def _raw(port: int, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, Any, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for k, v in {**headers, "Content-Length": str(len(body))}.items():
            conn.putheader(k, v)
        conn.endheaders(body)
        r = conn.getresponse()
        return r.status, r.headers, r.read()
    finally:
        conn.close()


def test_programs_keep_working_and_only_hosts_the_operator_named_are_answered(tmp_path):
    """tritonclient's asyncio client (``application/octet-stream``) and gevent client (no
    Content-Type: ``serving``) register and unregister; a name given with ``--http-allow-host``
    is answered, any other name 421 (addresses and localhost always); a preflight gets no CORS
    allowance; every answer carries the security headers."""
    import asyncio

    import tritonclient.http.aio as triton_aio

    with serving(tmp_path, "--http-allow-host", "gpu-host-7") as (server, port, client, keys):
        async def aio() -> list[str]:
            c = triton_aio.InferenceServerClient(f"127.0.0.1:{port}")
            try:
                await c.register_system_shared_memory("aio", keys["honest"], 4096)
                names = sorted(r["name"] for r in await c.get_system_shared_memory_status())
                await c.unregister_system_shared_memory("aio")
                return names
            finally:
                await c.close()

        assert asyncio.run(aio()) == ["aio", "live"]
        for host in ("gpu-host-7", f"GPU-HOST-7:{port}", f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}",
                     "10.1.2.3:8000"):
            status, headers, _ = _raw(port, "GET", "/v2/health/live", {"Host": host})
            assert status == 200, host
            assert headers["X-Frame-Options"] == "DENY" and headers["X-Content-Type-Options"] == "nosniff"
        for host in (f"evil.test:{port}", "gpu-host-7.evil.test", "localhost.evil.test", "evil.localhost"):
            status, headers, body = _raw(port, "GET", "/status.json", {"Host": host})
            assert status == 421 and "--http-allow-host" in json.loads(body)["error"], (host, status, body)
            assert headers["Content-Security-Policy"].startswith("default-src 'none'")
        status, headers, _ = _raw(port, "OPTIONS", "/v2/systemsharedmemory/unregister",
                                  {"Host": f"127.0.0.1:{port}", "Origin": "http://127.0.0.1:1",
                                   "Access-Control-Request-Method": "POST",
                                   "Access-Control-Request-Headers": "content-type"})
        assert status == 403 and not any(h.lower().startswith("access-control-") for h in headers), headers
        status, _, body = _raw(port, "POST", "/v2/systemsharedmemory/region/live/unregister",
                               {"Host": f"127.0.0.1:{port}", "Content-Type": "text/plain;charset=UTF-8"}, b"{}")
        assert status == 415 and "application/json" in json.loads(body)["error"], body
        assert _regions(client) == ["live"]
    help_text = subprocess.run([sys.executable, "-m", "lmshm.server", "--help"], capture_output=True, text=True,
                               timeout=60).stdout
    assert "--http-allow-host" in help_text and "LMSHM_HTTP_ALLOW_HOSTS" in help_text


#: Round 4, fresh attack: a page asks, without reading any answer, whether an HTTP server listens
#: on a port: ``fetch(..., {mode: "no-cors"})`` resolves where an answer may be embedded and fails
#: where ``Cross-Origin-Resource-Policy`` forbids it or nothing listens.
SCAN_PAGE = r"""<!doctype html><html><body><script>
"use strict";
const probe = url => fetch(url, {mode: "no-cors", cache: "no-store"}).then(() => "resolved", () => "failed");
const LONG = "/" + "a".repeat(9000);        // a request line over aiohttp's 8190 bytes
(async () => {
  window.results = {
    lmshm: await probe("__BASE__/status.json"), lmshm_long: await probe("__BASE__" + LONG),
    closed: await probe("__CLOSED__/status.json"), closed_long: await probe("__CLOSED__" + LONG),
  };
})();
</script></body></html>
"""


def _raw_bytes(port: int, request: bytes) -> bytes:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_a_page_cannot_tell_the_endpoint_from_a_closed_port_and_aiohttps_own_answers_carry_the_headers(tmp_path):
    """aiohttp answers a request it cannot parse (a request line over 8190 bytes, a malformed
    header) 400 by itself, before the middleware and ``on_response_prepare``: without the
    security headers. A page's no-cors ``fetch`` of a 9,000-byte URL resolved on lmshm-server's
    port (nothing forbade embedding that answer) and failed on a closed one, so any page learned
    where the endpoint listens, which every other answer (``Cross-Origin-Resource-Policy``) hides."""
    sync_playwright = _browser()
    port, closed = free_port(), free_port()
    server = ServerProcess(tmp_path, "--http-port", str(port))
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                html = (SCAN_PAGE.replace("__BASE__", f"http://127.0.0.1:{port}")
                        .replace("__CLOSED__", f"http://127.0.0.1:{closed}"))
                with site(tmp_path, html) as url:
                    page = browser.new_page()
                    page.goto(url)
                    page.wait_for_function("() => window.results", timeout=30_000)
                    results = page.evaluate("() => window.results")
            finally:
                browser.close()
        assert results == {"lmshm": "failed", "lmshm_long": "failed", "closed": "failed",
                           "closed_long": "failed"}, results
        for request in (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
                        b"GET /status.json HTTP/1.1\r\nHost: 127.0.0.1\r\nX: " + b"a" * 9000 + b"\r\n\r\n",
                        b"GET /status.json HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header\r\n\r\n"):
            answer = _raw_bytes(port, request)
            head = answer.split(b"\r\n\r\n", 1)[0].decode().lower()
            assert head.startswith("http/1.0 400") or head.startswith("http/1.1 400"), answer[:200]
            for header in ("cross-origin-resource-policy: same-origin", "x-content-type-options: nosniff",
                           "x-frame-options: deny", "content-security-policy: default-src 'none'"):
                assert header in head, (header, answer[:600])
        assert json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v2", timeout=10).read())["name"] == "lmshm"
    finally:
        assert server.stop() == 0, server.log()
