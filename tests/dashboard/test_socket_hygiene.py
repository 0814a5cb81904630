"""What a dashboard socket leaves behind and holds: group memberships of refused or failed
connects on the real Redis layer, the per-user cap on open sockets, and what hostile or
unlucky clients do (real database and channel layer; the Redis ones skip locally
without Redis and fail with CI=true)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.layers import channel_layers, get_channel_layer
from django.db import DatabaseError, connection
from django.test import Client

from tests.dashboard.test_consumers import connect
from tests.test_fleet import needs_redis, redis_url
from wfdash.settings import redis_channel_layer
from workflows_app import live

from .helpers import make_user

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def redis_layer(settings: Any) -> Iterator[Any]:
    settings.CHANNEL_LAYERS = {"default": redis_channel_layer(redis_url)}
    channel_layers.backends.clear()
    yield get_channel_layer()
    channel_layers.backends.clear()


def login(username: str, *perms: str, staff: bool = True) -> tuple[int, str, bytes]:
    """A new user's pk, session key and session cookie."""
    user = make_user(username, *perms, staff=staff)
    client = Client()
    client.force_login(user)
    key = client.cookies["sessionid"].value
    return user.pk, key, f"sessionid={key}".encode()


async def members(layer: Any, group: str) -> set[bytes]:
    """The channels joined to a group, as channels_redis keeps them in Redis."""
    key = layer._group_key(group)
    return set(await layer.connection(layer.consistent_hash(group)).zrange(key, 0, -1))


def rename_table(name: str, to: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {name} RENAME TO {to}")


@needs_redis
@pytest.mark.parametrize("how", ["refused", "access check fails", "snapshot read fails"])
async def test_a_refused_or_failed_connect_leaves_no_group_membership_in_redis(redis_layer, how):
    """connect joins the user's and the session's groups before it checks access. A
    connect that raised (the database down) gets no disconnect, so channels_redis kept
    both memberships for its group_expiry, a day; a refused one waited for the server's
    disconnect to drop them."""
    from workflows_app.models import BulkJob

    staff = how != "refused"
    pk, key, cookie = await database_sync_to_async(login)("joiner", "view_instance", staff=staff)
    groups = [live.user_group(pk), live.session_group(key)]
    before = {group: await members(redis_layer, group) for group in groups}
    path, table = {
        "refused": ("/ws/overview/", None),
        # The user's permissions cannot be read: may_view raises.
        "access check fails": ("/ws/overview/", "auth_user_user_permissions"),
        # The bulk job's row cannot be read: the snapshot raises.
        "snapshot read fails": ("/ws/bulk-jobs/1/", BulkJob._meta.db_table),
    }[how]
    if table:
        await database_sync_to_async(rename_table)(table, f"{table}_away")
    try:
        if table:
            with pytest.raises(DatabaseError):
                await connect(path, cookie)
        else:
            _, connected = await connect(path, cookie)
            assert not connected
    finally:
        if table:
            await database_sync_to_async(rename_table)(f"{table}_away", table)
    for group in groups:
        assert await members(redis_layer, group) == before[group], group


async def test_a_failed_connect_leaves_nothing_on_the_in_memory_layer_either(settings):
    """The same on the in-memory layer (the default without Redis): its groups expire too."""
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "wfdash.memory_layer.InMemoryChannelLayer"}}
    channel_layers.backends.clear()
    try:
        layer = get_channel_layer()
        pk, key, cookie = await database_sync_to_async(login)("joiner-mem", "view_instance")
        await database_sync_to_async(rename_table)(
            "auth_user_user_permissions", "auth_user_user_permissions_away"
        )
        try:
            with pytest.raises(DatabaseError):
                await connect("/ws/overview/", cookie)
        finally:
            await database_sync_to_async(rename_table)(
                "auth_user_user_permissions_away", "auth_user_user_permissions"
            )
        assert not layer.groups.get(live.user_group(pk))
        assert not layer.groups.get(live.session_group(key))
    finally:
        channel_layers.backends.clear()


# --- the per-user cap on open sockets ---------------------------------------------------


async def refused_for_too_many(communicator: Any) -> str:
    """The error frame a socket past the cap gets before its close (4429): its text."""
    error = await communicator.receive_json_from(timeout=5)
    assert error["type"] == "error"
    closed = await communicator.receive_output(timeout=5)
    assert closed["type"] == "websocket.close" and closed["code"] == 4429, closed
    assert closed["reason"] == "at most 2 sockets per user"
    return error["error"]


@pytest.fixture
def cap_of_two(settings: Any) -> None:
    settings.WFDASH = {**settings.WFDASH, "MAX_SOCKETS_PER_USER": 2}


async def test_a_user_past_the_cap_of_open_sockets_is_closed_with_4429_and_told_why(cap_of_two):
    """One staff session could open thousands of sockets, each with its consumer, channel,
    group memberships and place in the hub. Past WFDASH["MAX_SOCKETS_PER_USER"] a socket
    is closed with 4429 and an error frame; another user is not affected, and a slot
    given back (a page closed) is free again."""
    _, _, cookie = await database_sync_to_async(login)("many", "view_instance")
    _, _, other_cookie = await database_sync_to_async(login)("other", "view_instance")
    first, ok1 = await connect("/ws/overview/", cookie)
    second, ok2 = await connect("/ws/instances/", cookie)
    assert ok1 and ok2
    third, accepted = await connect("/ws/overview/", cookie)
    assert accepted  # only to say why: a refused handshake gives the page no code
    assert "too many dashboard sockets open for this user: at most 2" in (
        await refused_for_too_many(third)
    )
    theirs, ok = await connect("/ws/overview/", other_cookie)
    assert ok and (await theirs.receive_json_from(timeout=5))["type"] == "snapshot"
    await first.disconnect(timeout=5)
    again, ok = await connect("/ws/overview/", cookie)
    assert ok and (await again.receive_json_from(timeout=5))["type"] == "snapshot"
    for communicator in (second, theirs, again):
        await communicator.disconnect(timeout=5)


async def test_a_refused_or_failed_connect_gives_its_slot_back(cap_of_two):
    """A socket refused for its page (an unknown instance) or failing on the database
    does not keep counting against its user."""
    pk, _, cookie = await database_sync_to_async(login)("unlucky", "view_instance")
    for _ in range(3):
        _, connected = await connect("/ws/instances/999999999/", cookie)
        assert not connected
    await database_sync_to_async(rename_table)(
        "auth_user_user_permissions", "auth_user_user_permissions_away"
    )
    try:
        for _ in range(2):
            with pytest.raises(DatabaseError):
                await connect("/ws/overview/", cookie)
    finally:
        await database_sync_to_async(rename_table)(
            "auth_user_user_permissions_away", "auth_user_user_permissions"
        )
    from workflows_app import socket_slots

    assert socket_slots.held_here(pk) == 0
    sockets = [await connect("/ws/overview/", cookie) for _ in range(2)]
    assert all(ok for _, ok in sockets)
    for communicator, _ in sockets:
        await communicator.disconnect(timeout=5)
    assert socket_slots.held_here(pk) == 0


@needs_redis
async def test_over_redis_the_cap_counts_the_users_sockets_in_every_process(
    redis_layer, cap_of_two
):
    """Another process's sockets (their slots in Redis, as its own connects take them)
    count against the cap here; a slot that process gives back, or that lapses (the
    process died), is free again."""
    from workflows_app import socket_slots

    pk, _, cookie = await database_sync_to_async(login)("spread", "view_instance")
    redis, key = socket_slots._store(redis_layer, pk)
    await redis.delete(key)  # a user pk of an earlier run of the test database

    # Another process's socket, its slot taken as that process's connect takes it.
    assert await redis.eval(socket_slots.TAKE_SLOT, 1, key, "specific.other-process!a", 2, 120_000)
    mine, ok = await connect("/ws/overview/", cookie)
    assert ok and (await mine.receive_json_from(timeout=5))["type"] == "snapshot"
    assert socket_slots.held_here(pk) == 1  # this process alone is under the cap
    past, accepted = await connect("/ws/overview/", cookie)
    assert accepted
    await refused_for_too_many(past)
    await redis.zrem(key, "specific.other-process!a")  # that page closed
    await redis.zadd(key, {"specific.dead-process!b": 0})  # a dead process's: lapsed
    more, ok = await connect("/ws/overview/", cookie)
    assert ok and (await more.receive_json_from(timeout=5))["type"] == "snapshot"
    assert await redis.zcard(key) == 2
    await mine.disconnect(timeout=5)
    await more.disconnect(timeout=5)
    assert await redis.zcard(key) == 0


# --- what a client's user and session do while it is connected ------------------------


async def close_code(communicator: Any, timeout: float = 5) -> int:
    """Read what the socket sends until it closes: its close code."""
    async with asyncio.timeout(timeout):
        while True:
            output = await communicator.receive_output(timeout=timeout)
            if output["type"] == "websocket.close":
                return output["code"]


@pytest.mark.parametrize("change", ["loses staff", "deleted", "loses view_instance"])
async def test_a_rights_change_made_in_a_transaction_closes_the_socket_once_it_commits(
    monkeypatch, change
):
    """The admin saves a user and their permissions in one transaction, and a delete or
    an m2m edit always is one: the signals fire before the commit. Published at once,
    the socket's re-check (its own connection: another thread, or another process)
    read the old rights and kept the socket open until its periodic re-check (25-30 s)."""
    import threading

    from django.contrib.auth.models import Permission, User
    from django.db import connections, transaction

    from workflows_app import access

    pk, _, cookie = await database_sync_to_async(login)("demoted", "view_instance")
    communicator, connected = await connect("/ws/instances/", cookie)
    assert connected
    assert (await communicator.receive_json_from(timeout=5))["type"] == "snapshot"
    checked = threading.Event()
    real = access.session_may_view

    def spied(*args: Any) -> bool:
        try:
            return real(*args)
        finally:
            checked.set()

    monkeypatch.setattr(access, "session_may_view", spied)

    def in_a_transaction() -> None:
        try:
            with transaction.atomic():
                user = User.objects.get(pk=pk)
                if change == "loses staff":
                    user.is_staff = False
                    user.save()
                elif change == "deleted":
                    user.delete()
                else:
                    user.user_permissions.remove(Permission.objects.get(codename="view_instance"))
                # Held open until the socket has re-checked, as a slower request would
                # be: told at once, it does so in milliseconds (once told after the
                # commit, it never does before it, and this waits its 3 s out).
                checked.wait(3)
        finally:
            connections.close_all()  # this thread's own connection ends with it

    await asyncio.to_thread(in_a_transaction)
    assert await close_code(communicator) == 4403


async def test_a_user_opening_sockets_in_a_loop_is_refused_past_the_connect_rate(
    monkeypatch, cap_of_two
):
    """Each connect reads an access check and a snapshot on the thread synchronous views
    wait for. A client that opened and closed sockets in a loop stayed under the cap of
    open sockets and had the server read snapshots without end; past CONNECTS_BURST at
    once (then CONNECTS_PER_SECOND) a connect is closed with 4429 before any read."""
    from workflows_app import socket_slots

    now = [0.0]  # the buckets' clock, stopped: nothing refills unless it moves
    monkeypatch.setattr(socket_slots, "monotonic", lambda: now[0])
    monkeypatch.setattr(socket_slots, "CONNECTS_BURST", 3)  # (at least the cap: 2)
    _, _, cookie = await database_sync_to_async(login)("looper", "view_instance")
    _, _, other_cookie = await database_sync_to_async(login)("calm", "view_instance")
    for _ in range(3):
        communicator, connected = await connect("/ws/overview/", cookie)
        assert connected
        assert (await communicator.receive_json_from(timeout=5))["type"] == "snapshot"
        await communicator.disconnect(timeout=5)
    past, accepted = await connect("/ws/overview/", cookie)
    assert accepted
    error = await past.receive_json_from(timeout=5)
    assert error["type"] == "error"
    assert error["error"].startswith("too many dashboard sockets opened by this user: 3 at once")
    assert await close_code(past) == 4429
    theirs, connected = await connect("/ws/overview/", other_cookie)  # another user's own
    assert connected and (await theirs.receive_json_from(timeout=5))["type"] == "snapshot"
    await theirs.disconnect(timeout=5)
    now[0] += 1 / socket_slots.CONNECTS_PER_SECOND  # one connect's worth refilled
    again, connected = await connect("/ws/overview/", cookie)
    assert connected and (await again.receive_json_from(timeout=5))["type"] == "snapshot"
    await again.disconnect(timeout=5)


@needs_redis
async def test_a_socket_open_past_the_layers_group_expiry_still_hears_its_logout(
    redis_layer, monkeypatch
):
    """channels_redis drops a group membership group_expiry (a day) after it was added.
    A socket never joined its session's and user's groups again, so one open longer (a
    wall display) no longer heard its logout or its user's rights change at once. It
    now joins them again every consumers.REJOIN_SECONDS."""
    import time

    from workflows_app import access, consumers, fanout

    now = [0.0]  # the sockets' clock
    monkeypatch.setattr(consumers.DashboardConsumer, "monotonic", staticmethod(lambda: now[0]))
    monkeypatch.setattr(access, "RECHECK_SECONDS", 0.2)  # the round that renews
    monkeypatch.setattr(fanout, "ACCESS_SHARED_SECONDS", 0.1)
    _, key, cookie = await database_sync_to_async(login)("wall", "view_instance")
    group = live.session_group(key)
    communicator, connected = await connect("/ws/overview/", cookie)
    assert connected
    assert (await communicator.receive_json_from(timeout=5))["type"] == "snapshot"
    try:
        (channel,) = await members(redis_layer, group)
        group_key = redis_layer._group_key(group)
        redis = redis_layer.connection(redis_layer.consistent_hash(group))
        # A day and a minute later, as channels_redis sees the membership:
        aged = time.time() - redis_layer.group_expiry - 60
        await redis.zadd(group_key, {channel: aged})
        now[0] += consumers.REJOIN_SECONDS  # an hour on, as the socket sees it
        async with asyncio.timeout(5):  # its next periodic round, 0.1 s away
            while (await redis.zscore(group_key, channel) or 0) <= aged:
                await asyncio.sleep(0.05)
        # The logout's message (sent as the logout sends it; the session itself stays
        # valid, so only the message can close the socket).
        await redis_layer.group_send(group, {"type": "wf.logout"})
        assert await close_code(communicator) == 4403
    finally:
        await communicator.disconnect(timeout=5)
