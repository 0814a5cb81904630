"""Changes made by another process (`manage.py wf ...`) reach open dashboard sockets of
this one within a second: through the history tail alone (in-memory layer: nothing else
can carry them), and through Redis alone (the tail held back: the command must send its
queued messages before it exits)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.layers import channel_layers

import tests.fleet_workflows  # noqa: F401  (registers fleet-waiter)
from tests.dashboard.test_consumers import connect, receive_change, receive_until, staff_cookie
from tests.test_fleet import needs_redis, redis_url
from tests.workers import ROOT, database_url
from wfdash.settings import redis_channel_layer
from workflows_app.client import get_workflow

pytestmark = pytest.mark.django_db(transaction=True)

WITHIN_SECONDS = 1.0  # issue 17: from the command's exit to the open page
COMMAND_TIMEOUT = 60.0  # a Django start-up on a busy 2-core box


@pytest.fixture(params=["tail", pytest.param("redis", marks=needs_redis)])
def path(request, settings, monkeypatch) -> Iterator[str]:
    """`tail`: the in-memory layer, which cannot reach this process from the command;
    `redis`: the Redis layer: instance pages hear the command's messages, lists and the
    overview follow the history tail (fanout.FAST_TAIL_SECONDS)."""
    if request.param == "redis":
        settings.CHANNEL_LAYERS = {"default": redis_channel_layer(redis_url)}
    else:
        settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    channel_layers.backends.clear()
    yield request.param
    channel_layers.backends.clear()


async def wf(path: str, *args: str) -> float:
    """Run `manage.py wf ...` in a new process; returns when it exited (monotonic)."""
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "DJANGO_SETTINGS_MODULE": "wfdash.settings",
        "WFDASH_DEMO": "0",
    }
    env.pop("REDIS_URL", None)
    if path == "redis":
        env["REDIS_URL"] = redis_url
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "manage.py",
        "wf",
        *args,
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), COMMAND_TIMEOUT)
    assert process.returncode == 0, (out + err).decode()
    return time.monotonic()


async def created(instance_id: str) -> int:
    inst = await get_workflow("fleet-waiter").acreate(id=instance_id)
    return (await database_sync_to_async(inst.row)()).pk


async def within(deadline: float, wait: Any) -> Any:
    return await asyncio.wait_for(wait, max(0.0, deadline - time.monotonic()))


async def status_on_detail(communicator: Any, status: str) -> dict[str, Any]:
    while True:
        message = await receive_until(communicator, "instance.status")
        if message["instance"]["status"] == status:
            return message


async def status_in_list(communicator: Any, pk: int, status: str) -> dict[str, Any]:
    while True:
        change = await receive_change(communicator, pk=pk)
        if change["instance"]["status"] == status:
            return change


async def test_a_pause_from_another_process_reaches_the_open_instance_page_and_list(path):
    pk = await created(f"x-pause-{path}")
    cookie = await staff_cookie()
    detail, connected = await connect(f"/ws/instances/{pk}/", cookie)
    assert connected
    listing, connected = await connect("/ws/instances/", cookie)
    assert connected
    await receive_until(detail, "snapshot")
    await receive_until(listing, "snapshot")
    exited = await wf(path, "pause", f"x-pause-{path}", "--workflow", "fleet-waiter")
    deadline = exited + WITHIN_SECONDS
    await within(deadline, status_on_detail(detail, "paused"))
    await within(deadline, status_in_list(listing, pk, "paused"))
    await detail.disconnect()
    await listing.disconnect()


async def test_a_terminate_from_another_process_reaches_the_overview(path):
    await created(f"x-term-{path}")
    overview, connected = await connect("/ws/overview/", await staff_cookie())
    assert connected
    await receive_until(overview, "snapshot")
    exited = await wf(path, "terminate", f"x-term-{path}", "--workflow", "fleet-waiter")

    async def terminated() -> None:
        while True:
            summary = (await receive_until(overview, "workflow.summary"))["workflow"]
            if summary["name"] == "fleet-waiter" and summary["counts"].get("terminated"):
                return

    await within(exited + WITHIN_SECONDS, terminated())
    await overview.disconnect()


async def test_an_event_sent_from_another_process_reaches_the_open_instance_page(path):
    pk = await created(f"x-event-{path}")
    detail, connected = await connect(f"/ws/instances/{pk}/", await staff_cookie())
    assert connected
    await receive_until(detail, "snapshot")
    exited = await wf(
        path,
        "send-event",
        f"x-event-{path}",
        "go",
        "--payload",
        '{"n": 1}',
        "--workflow",
        "fleet-waiter",
    )

    async def told() -> dict[str, Any]:
        while True:
            message = await detail.receive_json_from(timeout=WITHIN_SECONDS * 2)
            if message["type"] in ("instance.status", "history.appended"):
                return message

    await within(exited + WITHIN_SECONDS, told())
    await detail.disconnect()
