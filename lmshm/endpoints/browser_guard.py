"""What a web page may make the HTTP endpoint do: nothing but read this server's own status page.

A browser showing another site still sends requests to a loopback or private port when that
site asks, so every request passes ``BrowserGuard.problem`` before its body is read:
1. **Host** (DNS rebinding) must be an IP address, ``localhost``, the ``--http-host`` name or an
   ``--http-allow-host`` name (421 otherwise); a request without one comes from no browser.
2. **Origin** (CSRF): a request that carries one must come from this server's own pages (403
   otherwise, preflights included: the endpoint never grants a CORS allowance).
3. **Content-Type**: a POST of a type a page may send without a preflight is 415.
4. Every answer carries ``SECURITY_HEADERS`` (no framing, no sniffing, no cross-origin embedding).

The trap: a POST with *no* Content-Type is a "simple" request too (``fetch`` of a Blob,
``sendBeacon``); rule 3 lets it pass for tritonclient's sake, and only rule 2 stops it. Never
trust a request for lacking a Content-Type, nor exempt a route from the Origin rule.
docs/triton.md ("Web pages") and docs/design/security.md have the details.
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
