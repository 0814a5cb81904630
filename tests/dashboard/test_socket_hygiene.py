"""What a dashboard socket leaves behind and holds: group memberships of refused or failed
connects on the real Redis layer, the per-user cap on open sockets, and what hostile or
unlucky clients do (real database and channel layer; the Redis ones skip locally
without Redis and fail with CI=true)."""

from __future__ import annotations

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
