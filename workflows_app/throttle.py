"""Throttling of guessed credentials: wrong API tokens here, admin logins through django-axes.

After API_FAILURE_LIMIT wrong bearer tokens from one client address within
API_LOCKOUT_SECONDS, that address gets 429 with Retry-After for API_LOCKOUT_SECONDS,
whatever token it sends, so guessing cannot go on. Counts live in Django's cache (by
default each web process's own memory: behind N processes a client gets N times the
attempts; point CACHES at Redis to share them). Logins lock out in the database (axes).
"""

from __future__ import annotations

import math
import time
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.http import HttpRequest, HttpResponse

DEFAULT_API_FAILURE_LIMIT = 20
DEFAULT_API_LOCKOUT_SECONDS = 300


def _setting(name: str, default: int) -> int:
    return int(getattr(settings, "WFDASH", {}).get(name, default))


def client_address(request: HttpRequest) -> str:
    return request.META.get("REMOTE_ADDR") or "unknown"


def _keys(request: HttpRequest) -> tuple[str, str]:
    address = client_address(request)
    return f"wfdash:api-failures:{address}", f"wfdash:api-locked:{address}"


def api_retry_after(request: HttpRequest) -> int | None:
    """Seconds this client must wait before the API looks at its tokens again; None if not locked."""
    until = cache.get(_keys(request)[1])
    if until is None:
        return None
    remaining = until - time.time()
    return math.ceil(remaining) if remaining > 0 else None


def record_api_failure(request: HttpRequest) -> None:
    """One more wrong token from this client; at the limit, lock it out."""
    count_key, lock_key = _keys(request)
    window = _setting("API_LOCKOUT_SECONDS", DEFAULT_API_LOCKOUT_SECONDS)
    cache.add(count_key, 0, timeout=window)
    try:
        failures = cache.incr(count_key)
    except ValueError:  # expired between add and incr
        cache.set(count_key, failures := 1, timeout=window)
    if failures >= _setting("API_FAILURE_LIMIT", DEFAULT_API_FAILURE_LIMIT):
        cache.set(lock_key, time.time() + window, timeout=window)
        cache.delete(count_key)


def login_locked_out(
    request: HttpRequest, response: Any = None, credentials: Any = None
) -> HttpResponse:
    """django-axes' answer to a locked-out login: 429 with Retry-After, not a 403 page."""
    seconds = int(settings.AXES_COOLOFF_TIME.total_seconds())
    locked = HttpResponse(
        f"Too many failed logins from this address: try again in {seconds} seconds.",
        status=429,
        content_type="text/plain; charset=utf-8",
    )
    locked["Retry-After"] = str(seconds)
    return locked
