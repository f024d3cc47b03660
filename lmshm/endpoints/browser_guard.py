"""What a web page may make the HTTP endpoint do: nothing but read this server's own status page.

The endpoint serves programs (tritonclient, routers, Prometheus) and one page, ``/status``. A
browser that shows some other site still sends requests to a loopback or private port when that
site's page asks, so every request passes these checks (``problem``) before its body is read:

1. **Host** (DNS rebinding): a page served as ``http://evil.test:P``, with the name resolving to
   this server, is same-origin with it, so the browser lets it read every answer. The ``Host``
   header names what the browser thinks it reached; it must be an IP address (an address cannot
   be rebound: a page of that origin would be served by that address itself), ``localhost``, the
   name ``--http-host`` binds, or a name of ``--http-allow-host`` (``*``: any). Else 421. A
   request without ``Host`` (HTTP/1.0) comes from no browser and passes. The port is not checked,
   so port forwards and proxies keep working.
2. **Origin** (CSRF): browsers send ``Origin`` with every POST (forms, ``fetch`` in any mode,
   ``sendBeacon``; ``null`` from sandboxed frames and ``data:`` pages) and every CORS request;
   programs send none. A request that carries one must come from this server's own pages
   (``http://`` or ``https://`` and exactly its ``Host``). Else 403, preflights (``OPTIONS``)
   included: the endpoint never grants a CORS allowance.
3. **Content-Type**: a POST whose type is one of the three a page may send without a preflight
   (``text/plain``, ``application/x-www-form-urlencoded``, ``multipart/form-data``) is 415.
   ``application/json`` passes, and so do tritonclient's own: none (its gevent client) and
   ``application/octet-stream`` (its asyncio client).
4. Every answer carries ``SECURITY_HEADERS``: nothing may frame it, sniff it into a script, or
   embed it from another origin; the status page sets a script and style policy of its own.
   aiohttp's own answers (a 400 for a request it cannot parse) too (``http._SecuredHandler``):
   one without the policy let any page tell the endpoint's port from a closed one.

The easy thing to get wrong: a POST with *no* Content-Type is a "simple" request too (``fetch``
of a Blob or an ArrayBuffer, ``sendBeacon``), so rule 3 lets it pass for tritonclient's sake and
only rule 2 stops it: never trust a request for lacking a Content-Type, nor exempt a route from
the Origin rule.
"""

from __future__ import annotations

import ipaddress
from typing import Callable, Iterable, Optional

from lmshm.quoting import quote

#: Content-Types a page may POST cross-origin without asking first (the Fetch standard's
#: CORS-safelisted request-header values): a POST of one of them is refused.
SIMPLE_TYPES = frozenset({"text/plain", "application/x-www-form-urlencoded", "multipart/form-data"})
#: Host names browsers resolve to loopback themselves, never by DNS: no page can rebind them.
LOOPBACK_NAMES = frozenset({"localhost"})
#: ``--http-allow-host *``: answer any Host (turns the rebinding check off: only behind a proxy
#: that checks Host itself).
ANY_HOST = "*"
#: On every answer. ``Cross-Origin-Resource-Policy``: no other origin may embed an answer
#: (``<script src=/status.json>``, ``<img>``), so no page reads it through a side channel.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Resource-Policy": "same-origin",
}


def _name(host: str) -> str:
    """``host`` of a Host header without its port and brackets, lower case, no final dot."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[1:end] if end > 0 else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class BrowserGuard:
    """The checks above for one endpoint: ``bind_host`` is ``--http-host``, ``allowed`` the
    names of ``--http-allow-host``."""

    def __init__(self, bind_host: str, allowed: Iterable[str]) -> None:
        names = {_name(a) for a in allowed if a.strip()}
        self.any_host = ANY_HOST in names
        self.names = frozenset(LOOPBACK_NAMES | names | ({_name(bind_host)} if bind_host else set()))

    def host_ok(self, host: Optional[str]) -> bool:
        if host is None or self.any_host:
            return True
        name = _name(host)
        return name in self.names or _is_address(name)

    def problem(self, method: str, get: Callable[[str], Optional[str]]) -> Optional[tuple[int, str]]:
        """``(status, message)`` for a request to refuse, or None; ``get`` reads its headers."""
        host = get("Host")
        if not self.host_ok(host):
            return 421, (f"the Host header names {quote(_name(host or ''), 80)}, which is not this server's address "
                         "(a web page may be reaching it by DNS rebinding): connect by IP address or localhost, or "
                         f"start lmshm-server with --http-allow-host {quote(_name(host or ''), 80)}")
        origin = get("Origin")
        if origin is not None and origin.strip().lower() not in {f"http://{host}".lower(), f"https://{host}".lower()}:
            return 403, (f"requests from web pages of other origins are refused (Origin {quote(origin, 80)}): this "
                         "endpoint serves programs, which send no Origin header, and its own /status page")
        if method == "POST":
            kind = (get("Content-Type") or "").split(";", 1)[0].strip().lower()
            if kind in SIMPLE_TYPES:
                return 415, (f"a POST of Content-Type {quote(kind, 60)} is refused: any web page may send one; send "
                             "Content-Type: application/json")
        return None
