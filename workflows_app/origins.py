"""The WebSocket origin check: a socket is admitted only from the page's own origin.

Channels' AllowedHostsOriginValidator compares host names only, so a page served on
another port or scheme of the same host (another app, a dev server) could open the live
feed with the operator's cookies. Here the Origin header must equal the socket's own
origin (scheme, host and port, as the Host header and the connection say) or be listed
in CSRF_TRUSTED_ORIGINS, as Django's CSRF check demands of a form POST.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from channels.security.websocket import WebsocketDenier
from django.conf import settings
from django.http.request import split_domain_port, validate_host

DEFAULT_PORTS = {"http": 80, "https": 443}

Origin = tuple[str, str, int]


def parse_origin(text: str) -> Origin | None:
    """(scheme, host, port) of an http(s) origin, the port made explicit; None if malformed."""
    try:
        parts = urlsplit(text.strip())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname:
        return None
    return parts.scheme, parts.hostname.lower(), port or DEFAULT_PORTS[parts.scheme]


def own_scheme(scope: dict[str, Any], headers: dict[str, str]) -> str:
    """http or https: the connection's own, or the trusted proxy header's (SECURE_PROXY_SSL_HEADER)."""
    proxy = getattr(settings, "SECURE_PROXY_SSL_HEADER", None)
    if proxy:
        name, secure_value = proxy
        forwarded = headers.get(name.removeprefix("HTTP_").replace("_", "-").lower())
        if forwarded is not None:
            return "https" if forwarded.split(",")[0].strip() == secure_value else "http"
    return "https" if scope.get("scheme") in ("wss", "https") else "http"


def trusted(origin: Origin) -> bool:
    """Listed in CSRF_TRUSTED_ORIGINS (a leading "*." there admits subdomains, as in Django)."""
    for entry in settings.CSRF_TRUSTED_ORIGINS:
        scheme, _, netloc = entry.partition("://")
        wildcard = netloc.startswith("*.")
        listed = parse_origin(f"{scheme}://{netloc[2:] if wildcard else netloc}")
        if listed is None or listed[0] != origin[0] or listed[2] != origin[2]:
            continue
        if origin[1] == listed[1] or (wildcard and origin[1].endswith("." + listed[1])):
            return True
    return False


def origin_allowed(scope: dict[str, Any]) -> bool:
    headers = {k.decode("latin1").lower(): v.decode("latin1") for k, v in scope.get("headers", [])}
    origin = parse_origin(headers.get("origin", ""))
    host = headers.get("host", "")
    domain, _ = split_domain_port(host)
    if origin is None or not domain or not validate_host(domain, settings.ALLOWED_HOSTS):
        return False
    return origin == parse_origin(f"{own_scheme(scope, headers)}://{host}") or trusted(origin)


class SameOriginValidator:
    """ASGI middleware: refuses a WebSocket handshake whose Origin is not the socket's own."""

    def __init__(self, application: Any) -> None:
        self.application = application

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        if scope["type"] == "websocket" and not origin_allowed(scope):
            return await WebsocketDenier()(scope, receive, send)
        return await self.application(scope, receive, send)
