"""Live updates published by a worker process reach a dashboard socket in this process
through Redis (the fleet set-up: daphne and `runworker workflows` are separate processes)."""

from __future__ import annotations

import pytest
from channels.db import database_sync_to_async
from channels.layers import channel_layers

from tests.dashboard.test_consumers import connect, receive_until, staff_cookie
from tests.test_fleet import needs_redis, redis_url
from wfdash.settings import redis_channel_layer
from workflows_app.client import get_workflow

pytestmark = pytest.mark.django_db(transaction=True)

WORKER_BOOT_SECONDS = 60


@needs_redis
async def test_steps_run_by_a_worker_process_are_streamed_to_a_dashboard_socket(workers, settings):
    settings.CHANNEL_LAYERS = {"default": redis_channel_layer(redis_url)}
    channel_layers.backends.clear()
    try:
        inst = await get_workflow("fleet-waiter").acreate(id="live-1")
        pk = (await database_sync_to_async(inst.row)()).pk
        communicator, connected = await connect(f"/ws/instances/{pk}/", await staff_cookie())
        assert connected
        assert (await receive_until(communicator, "snapshot"))["instance"]["status"] == "running"
        (worker,) = workers(1, REDIS_URL=redis_url, WFDASH_POLL_SECONDS="60")
        # The first message waits for the worker process to boot (slow on a busy box).
        written = await receive_until(communicator, "step.written", timeout=WORKER_BOOT_SECONDS)
        assert written["step"]["name"] == "wait" and written["step"]["kind"] == "waitForEvent"
        await inst.asend_event("go", {"n": 1})
        after = None
        while after is None:
            message = await receive_until(communicator, "step.written")
            if message["step"]["name"] == "after" and message["step"]["status"] == "complete":
                after = message
        assert after["step"]["attempts"] == 1
        await communicator.disconnect()
        assert worker.process.poll() is None  # the worker is alive and did the work
    finally:
        channel_layers.backends.clear()
