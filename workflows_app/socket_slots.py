"""How many dashboard sockets one user may hold open at once: WFDASH["MAX_SOCKETS_PER_USER"].

Each socket costs a consumer, a channel, two group memberships and a place in its hub's
stream, and one staff session could open thousands. A socket takes a slot of its user's
at connect (after the session is known, before anything else is joined or read) and
gives it back at disconnect; past the cap it is closed with CLOSE_TOO_MANY_SOCKETS.

Over Redis the count holds across processes: a user's slots are a sorted set (each
socket's channel, scored by when its lease ends, in Redis's clock) taken in one script
call, renewed by the socket's periodic access re-check and dropped at disconnect; the
slots of a process that died lapse after LEASE_SECONDS. With the in-memory layer (one
serving process), or while Redis cannot be reached, the count is this process's own.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from . import live
from .engine.errors import shown
from .setting_ranges import SETTING_RANGES

log = logging.getLogger("workflows_app.socket_slots")

DEFAULT_MAX_SOCKETS_PER_USER = 100
# Far past any real page count (the checks hold settings to the same range, E005):
# 10**400 was taken, then float() of it (the connect bucket) raised OverflowError at
# every socket a user opened.
SOCKETS_PER_USER = SETTING_RANGES["MAX_SOCKETS_PER_USER"]
# A slot in Redis lasts this long unless renewed; sockets renew theirs at every periodic
# access re-check (access.RECHECK_SECONDS), so only a dead process's slots lapse.
LEASE_SECONDS = 120
SLOTS_KEY = "wfdash.sockets.user."
# Connects one user may start in this process: CONNECTS_BURST at once, CONNECTS_PER_SECOND
# after that. Each costs an access check and a snapshot read on the thread synchronous
# views wait for; a client opening and closing sockets in a loop stayed under the cap
# of open sockets while reading snapshots without end. Pages reconnecting after a
# restart (one or two a tab) and a user clicking through pages stay well inside it. The
# burst is at least the cap of open sockets: a user may open all of theirs at once.
CONNECTS_BURST = 100
CONNECTS_PER_SECOND = 2.0
MAX_CONNECT_BUCKETS = 10_000  # users remembered; full buckets are forgotten past it
monotonic = time.monotonic  # tests control it

# KEYS[1]: a user's slots; ARGV: the channel, the cap (0: renew, whatever the count), the
# lease in ms. Drops lapsed slots, then takes or renews this one: 1, or 0 if over the cap.
TAKE_SLOT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local cap = tonumber(ARGV[2])
if cap > 0 and not redis.call('ZSCORE', KEYS[1], ARGV[1])
        and redis.call('ZCARD', KEYS[1]) >= cap then
    return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""


def max_sockets_per_user() -> int:
    value = getattr(settings, "WFDASH", {}).get(
        "MAX_SOCKETS_PER_USER", DEFAULT_MAX_SOCKETS_PER_USER
    )
    if not SOCKETS_PER_USER.admits(value):
        raise ImproperlyConfigured(
            f'WFDASH["MAX_SOCKETS_PER_USER"] must be {SOCKETS_PER_USER.describe()}; '
            f"got {shown(value)}"
        )
    return value


# user pk -> (connects the user may still start, as of when)
_connects: dict[Any, tuple[float, float]] = {}


def connect_burst() -> int:
    return max(CONNECTS_BURST, max_sockets_per_user())


def forget_connects() -> None:
    """Forget every user's recent connects (tests: user pks repeat from one test to the next)."""
    _connects.clear()


def connect_allowed(user_pk: Any) -> bool:
    """Take one of the user's connects (a token bucket per user, per process)."""
    burst = float(connect_burst())
    now = monotonic()
    left, at = _connects.get(user_pk, (burst, now))
    left = min(burst, left + max(0.0, now - at) * CONNECTS_PER_SECOND)
    if len(_connects) > MAX_CONNECT_BUCKETS:
        full = [
            pk for pk, (n, t) in _connects.items() if n + (now - t) * CONNECTS_PER_SECOND >= burst
        ]
        for pk in full:
            del _connects[pk]
    allowed = left >= 1
    _connects[user_pk] = (left - 1 if allowed else left, now)
    return allowed


# user pk -> this process's open sockets of theirs (weak: a consumer that died without
# its disconnect does not hold a slot for the life of the process)
_here: dict[Any, weakref.WeakSet[Any]] = {}


def _store(layer: Any, user_pk: Any) -> tuple[Any, str] | None:
    """The Redis connection and key of the user's slots; None for a layer without Redis."""
    if layer is None or live.is_in_process(layer) or not hasattr(layer, "connection"):
        return None
    name = f"{SLOTS_KEY}{user_pk}"
    return layer.connection(
        layer.consistent_hash(name)
    ), f"{getattr(layer, 'prefix', 'asgi')}:{name}"


async def take(layer: Any, user_pk: Any, socket: Any) -> bool:
    """Take a slot of the user's for the socket (its channel_name names it in Redis);
    False if they hold the cap's worth already."""
    cap = max_sockets_per_user()
    here = _here.setdefault(user_pk, weakref.WeakSet())
    allowed = len(here) < cap
    store = _store(layer, user_pk)
    if store is not None:
        redis, key = store
        try:
            allowed = bool(
                await redis.eval(TAKE_SLOT, 1, key, socket.channel_name, cap, LEASE_SECONDS * 1000)
            )
        except Exception:
            log.warning("could not count the user's sockets in Redis; counting this process's")
    if allowed:
        here.add(socket)
    elif not here:
        del _here[user_pk]
    return allowed


async def renew(layer: Any, user_pk: Any, socket: Any) -> None:
    """Keep the socket's slot in Redis from lapsing (a failure is retried next time)."""
    store = _store(layer, user_pk)
    if store is not None:
        redis, key = store
        try:
            await redis.eval(TAKE_SLOT, 1, key, socket.channel_name, 0, LEASE_SECONDS * 1000)
        except Exception:
            log.debug("could not renew a socket's slot", exc_info=True)


async def release(layer: Any, user_pk: Any, socket: Any) -> None:
    """Give the socket's slot back (in Redis, if it cannot be reached, it lapses)."""
    here = _here.get(user_pk)
    if here is not None:
        here.discard(socket)
        if not here:
            del _here[user_pk]
    store = _store(layer, user_pk)
    if store is not None:
        redis, key = store
        try:
            await redis.zrem(key, socket.channel_name)
        except Exception:
            log.debug("could not give a socket's slot back", exc_info=True)


def held_here(user_pk: Any) -> int:
    """The user's sockets open in this process (tests, and the docs' figures)."""
    return len(_here.get(user_pk, ()))
