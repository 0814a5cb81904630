"""The Redis channel layer wfdash configures: receives that wait past the blocking pop,
and receives that stop when cancelled (real Redis; skipped locally without one)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from channels.layers import channel_layers, get_channel_layer

from tests.test_fleet import needs_redis, redis_url
from wfdash.settings import redis_channel_layer


@pytest.fixture
def redis_layer(settings):
    settings.CHANNEL_LAYERS = {"default": redis_channel_layer(redis_url)}
    channel_layers.backends.clear()
    yield get_channel_layer()
    channel_layers.backends.clear()


async def watched_group(redis_layer, label: str) -> tuple[str, str]:
    """A channel joined to a fresh instance group, and the sender started and idle."""
    import secrets

    from workflows_app import live

    run = secrets.token_hex(4)
    channel = await redis_layer.new_channel()
    watched = f"wfdash.instance.{label}-{run}"
    await redis_layer.group_add(watched, channel)
    live._background_send(f"wfdash.instance.warm-{run}", {"type": "wf.step", "pk": 0})
    assert await asyncio.get_running_loop().run_in_executor(None, live.flush)
    return channel, watched


async def _until_sentinel(redis_layer, channel: str, group: str) -> list[dict]:
    """What the group received before a sentinel sent now, past every gate (in order)."""
    from workflows_app import live

    live._background_send(group, {"type": "wf.sentinel", "pk": 0})
    assert await asyncio.get_running_loop().run_in_executor(None, live.flush)
    received = []
    while (message := await asyncio.wait_for(redis_layer.receive(channel), 5))[
        "type"
    ] != "wf.sentinel":
        received.append(message)
    return received


@needs_redis
async def test_a_cancelled_receive_stops_and_loses_no_message(redis_layer):
    # redis-py swallows a cancellation landing mid-BZPOPMIN; channels_redis then popped
    # again for ever (a closed socket's consumer never ended). Cancel at many points.
    channel = await redis_layer.new_channel()
    swallowed = 0
    for n in range(400):
        receive = asyncio.ensure_future(redis_layer.receive(channel))
        await asyncio.sleep((n % 30) * 0.0005)
        receive.cancel()
        cancelled_at = time.monotonic()
        done, _ = await asyncio.wait([receive], timeout=redis_layer.brpop_timeout + 5)
        assert done, f"receive #{n} went on after it was cancelled"
        if time.monotonic() - cancelled_at > 0.5:  # the cancel landed mid-pop: the case at issue
            swallowed += 1
            if swallowed == 3:
                break
    await redis_layer.send(channel, {"type": "after.cancels", "n": 1})
    assert await asyncio.wait_for(redis_layer.receive(channel), 5) == {
        "type": "after.cancels",
        "n": 1,
    }


@needs_redis
def test_a_receive_cancelled_while_the_message_before_is_cleaned_leaves_no_lock_to_the_next_loop(
    redis_layer, monkeypatch
):
    """Each message received is cleaned from its backup queue by a task that holds a lock
    of the layer's; a receive cancelled while it waited for that lock (a socket closing
    just after a message) left the lock for good, and the next event loop to wait for it
    failed ("bound to a different event loop"): the process's one layer serves every
    test's loop in turn. The cleaning is held here until the test lets it go."""
    clean = redis_layer._clean_receive_backup
    may_clean: list[asyncio.Event] = []

    async def held_clean(index: int, channel: str) -> None:
        await may_clean[-1].wait()  # a loaded Redis or event loop: the cleaning takes a while
        await clean(index, channel)

    monkeypatch.setattr(redis_layer, "_clean_receive_backup", held_clean)
    locks = redis_layer.receive_clean_locks
    acquire = locks.acquire
    waiting_for_the_cleaning: list[asyncio.Event] = []

    async def noted_acquire(channel: str) -> bool:
        if locks.locked(channel):
            waiting_for_the_cleaning[-1].set()  # set before the acquire below waits
        return await acquire(channel)

    monkeypatch.setattr(locks, "acquire", noted_acquire)

    async def two_messages_in_a_loop(cancel_the_second: bool) -> Any:
        may_clean.append(asyncio.Event())
        waiting_for_the_cleaning.append(asyncio.Event())
        first, second = await redis_layer.new_channel(), await redis_layer.new_channel()
        await redis_layer.send(first, {"type": "one"})
        await redis_layer.send(second, {"type": "two"})
        assert await asyncio.wait_for(redis_layer.receive(first), 5) == {"type": "one"}
        receiving = asyncio.ensure_future(redis_layer.receive(second))
        await asyncio.wait_for(waiting_for_the_cleaning[-1].wait(), 5)
        if cancel_the_second:
            receiving.cancel()  # its socket closes
            with pytest.raises(asyncio.CancelledError):
                await receiving
        may_clean[-1].set()
        if cancel_the_second:  # its message is still in Redis: the next receive takes it
            receiving = asyncio.ensure_future(redis_layer.receive(second))
        try:
            return await asyncio.wait_for(receiving, 5)
        finally:
            await redis_layer.wait_received()

    assert asyncio.run(two_messages_in_a_loop(cancel_the_second=True)) == {"type": "two"}
    # Another loop: its second receive waits for the first's cleaning, as above.
    assert asyncio.run(two_messages_in_a_loop(cancel_the_second=False)) == {"type": "two"}
    assert not locks.wait_counts  # nobody holds or waits for a lock: none is kept


@needs_redis
async def test_an_idle_receive_outlasts_the_blocking_pop(redis_layer):
    # With redis-py 8's default 5 s read timeout, equal to the pop's, this raised TimeoutError.
    channel = await redis_layer.new_channel()

    async def send_later() -> None:
        await asyncio.sleep(redis_layer.brpop_timeout + 1)
        await redis_layer.send(channel, {"type": "late"})

    sender = asyncio.ensure_future(send_later())
    assert await asyncio.wait_for(redis_layer.receive(channel), redis_layer.brpop_timeout + 10) == {
        "type": "late"
    }
    await sender


def test_a_full_engine_channel_is_reported_once_a_minute_not_per_message(settings, caplog):
    """No runworker reads the engine channel: hints pile up until the layer refuses them.
    That is said once, in a line, not as a traceback per hint (a herd sends thousands)."""
    import logging
    import types

    from workflows_app import live

    settings.CHANNEL_LAYERS = {
        "default": {"BACKEND": "channels.layers.InMemoryChannelLayer", "CONFIG": {"capacity": 1}}
    }
    # The sender's send alone, without its thread and loop (which outlive the test).
    sender = types.SimpleNamespace(full_warned_at=-float("inf"))

    async def hint_many() -> None:
        for n in range(5):
            await live.Sender._send(sender, None, {"type": "wf.hint", "kind": "wake", "n": n})

    with caplog.at_level(logging.WARNING, logger="workflows_app.live"):
        asyncio.run(hint_many())
    reports = [r for r in caplog.records if r.name == "workflows_app.live"]
    assert len(reports) == 1, [r.getMessage() for r in reports]
    assert "channel layer full" in reports[0].getMessage() and reports[0].exc_info is None


@needs_redis
async def test_updates_are_sent_only_to_groups_that_a_socket_joined(redis_layer):
    """A busy worker's step updates are mostly for instances no page is open on: those are
    not sent (each group_send costs round trips and a Lua call, even to an empty group),
    while a joined group still gets every message, in order."""
    import secrets

    from workflows_app import live

    loop = asyncio.get_running_loop()
    run = secrets.token_hex(4)
    channel = await redis_layer.new_channel()
    watched = f"wfdash.instance.watched-{run}"
    await redis_layer.group_add(watched, channel)
    live._background_send(f"wfdash.instance.warm-{run}", {"type": "wf.step", "pk": 0})
    assert await loop.run_in_executor(None, live.flush)
    skipped_before = live._sender.skipped
    for n in range(50):
        live._background_send(f"wfdash.instance.nobody-{run}-{n}", {"type": "wf.step", "pk": n})
        if n % 10 == 0:
            live._background_send(watched, {"type": "wf.step", "pk": n})
    assert await loop.run_in_executor(None, live.flush)
    received = [await asyncio.wait_for(redis_layer.receive(channel), 5) for _ in range(5)]
    assert [m["pk"] for m in received] == [0, 10, 20, 30, 40]
    assert live._sender.skipped - skipped_before == 50


@needs_redis
async def test_updates_put_one_at_a_time_are_gathered_into_one_look_up(redis_layer, monkeypatch):
    """A run's updates come a few at a time over a few milliseconds; the sender waits for
    the rest of a burst (GATHER_SECONDS, here long enough to hold the whole test) and asks
    Redis which of their groups anyone joined once, not once per update. A flush does not
    wait for the window."""
    from workflows_app import live

    loop = asyncio.get_running_loop()
    channel, watched = await watched_group(redis_layer, "gathered")
    look_ups: list[list[str | None]] = []
    ask = live.Sender._groups_with_members

    async def counted(self, groups):
        look_ups.append(groups)
        return await ask(self, groups)

    monkeypatch.setattr(live.Sender, "_groups_with_members", counted)
    monkeypatch.setattr(live.Sender, "GATHER_SECONDS", 60.0)
    for n in range(5):
        live._background_send(watched, {"type": "wf.step", "pk": n})
        await asyncio.sleep(0.01)  # each put finds the sender idle, not sending
    started = time.monotonic()
    assert await loop.run_in_executor(None, live.flush, 10)
    assert time.monotonic() - started < 10
    assert look_ups == [[watched]]
    received = [await asyncio.wait_for(redis_layer.receive(channel), 5) for _ in range(5)]
    assert [m["pk"] for m in received] == [0, 1, 2, 3, 4]


@needs_redis
async def test_a_hint_ends_the_gathering_of_updates_at_once(redis_layer, monkeypatch):
    """Hints wake workers: one never waits behind dashboard updates that are gathering."""
    from workflows_app import live

    channel, watched = await watched_group(redis_layer, "hurried")
    monkeypatch.setattr(live.Sender, "GATHER_SECONDS", 60.0)
    live._background_send(watched, {"type": "wf.step", "pk": 1})
    live._background_send(live.WORKERS_GROUP, {"type": "wf.hint", "kind": "wake", "pk": None})
    # No flush: only the hint can end the 60-second gathering within these 10 seconds.
    assert (await asyncio.wait_for(redis_layer.receive(channel), 10))["pk"] == 1


@needs_redis
@pytest.mark.django_db(transaction=True)
async def test_a_flush_tells_an_instance_s_page_once_of_its_stored_spans(redis_layer):
    """A woken timer stores three spans in one flush; its page reads its whole detail on
    any of them, so the page's group gets one span message, not three."""
    from asgiref.sync import sync_to_async
    from channels.db import database_sync_to_async

    from workflows_app import live
    from workflows_app.engine import WorkflowEntrypoint, register
    from workflows_app.engine import spans as engine_spans

    @register("span-messages")
    class SpanMessages(WorkflowEntrypoint):
        async def run(self, event, step):
            return "ok"

    from workflows_app.client import get_workflow

    row = await sync_to_async(lambda: get_workflow("span-messages").create(id="sm").row())()
    channel = await redis_layer.new_channel()
    group = live.instance_group(row.pk)
    await redis_layer.group_add(group, channel)
    await live.mark_pages_open(redis_layer)  # as the page's hub would
    # In a thread that gives its database connection back after the call, as the
    # engine's database thread does: the loop's executor's thread ended holding it, open
    # until the garbage collector found it (the test database could not be dropped).
    flush = database_sync_to_async(live.EngineHooks().flush)
    await flush()  # spans queued before
    await _until_sentinel(redis_layer, channel, group)
    root = engine_spans.start_workflow_span(row.trace_id, row.pk, "span-messages", {})
    engine_spans.finished_span(
        root, "sleep nap", engine_spans.instant(0), engine_spans.instant(0), {}
    )
    with engine_spans.child_span(root, "step s", {}):
        pass
    root.end()
    await flush()
    received = await _until_sentinel(redis_layer, channel, group)
    assert [m["type"] for m in received] == ["wf.span"]
    assert received[0]["name"] == "workflow span-messages"  # the flush's last of that instance


@needs_redis
async def test_page_messages_are_not_built_while_no_page_is_open_in_any_process(
    redis_layer, monkeypatch
):
    """Hubs keep a key in Redis while they serve a socket. Where a look found none, the
    engine's page messages are not built or sent; a page opening is heard at once in its
    own process, and an absence seen is trusted only for PAGES_TRUST_SECONDS."""
    import secrets

    from workflows_app import live

    pk = 10**9 + secrets.randbelow(10**9)
    channel = await redis_layer.new_channel()
    group = live.instance_group(pk)
    await redis_layer.group_add(group, channel)
    redis, key = live._pages_store(redis_layer)
    await redis.delete(key)
    await live.look_for_pages(redis_layer)
    assert live.no_page_open()
    hooks = live.EngineHooks()
    hooks.run_finished(pk, "complete")
    live.instance_changed("event", pk)
    assert await _until_sentinel(redis_layer, channel, group) == []

    made, age = await live.mark_pages_open(redis_layer)
    assert age == 0  # it was absent: made now
    assert not live.no_page_open() and await redis.exists(key)
    hooks.run_finished(pk, "complete")
    assert [m["kind"] for m in await _until_sentinel(redis_layer, channel, group)] == ["complete"]
    made_again, age = await live.mark_pages_open(redis_layer)
    assert made_again == made and 0 <= age < 5  # open since then

    await redis.delete(key)
    await live.look_for_pages(redis_layer)
    assert live.no_page_open()
    monkeypatch.setattr(live, "PAGES_TRUST_SECONDS", 0.0)  # the look is out of date
    assert not live.no_page_open()
    hooks.run_finished(pk, "errored")
    assert [m["kind"] for m in await _until_sentinel(redis_layer, channel, group)] == ["errored"]


@needs_redis
@pytest.mark.django_db(transaction=True)
async def test_a_hub_that_finds_no_page_open_sends_its_sockets_their_snapshots_again(
    redis_layer, monkeypatch
):
    """Processes that saw no page open may have dropped messages for up to
    PAGES_TRUST_SECONDS after a hub set the key: the hub resends its sockets their
    snapshots once that time has passed."""
    from workflows_app import fanout, live

    monkeypatch.setattr(live, "PAGES_TRUST_SECONDS", 0.05)
    monkeypatch.setattr(fanout, "PAGES_RESYNC_MARGIN_SECONDS", 0.0)
    redis, key = live._pages_store(redis_layer)
    await redis.delete(key)

    class Page:
        def __init__(self) -> None:
            self.resynced = asyncio.Event()

        async def deliver(self, seq: int, text: str) -> None:
            pass

        async def resync(self) -> None:
            self.resynced.set()

    page = Page()
    hub = fanout.hub()
    await hub.subscribe(page, fanout.instance_stream(1))
    try:
        assert await redis.exists(key)
        await asyncio.wait_for(page.resynced.wait(), 10)
    finally:
        await hub.unsubscribe(page, fanout.instance_stream(1))

    # Pages open elsewhere for a minute: nothing was dropped, no snapshot is resent.
    (seconds, micros) = await redis.time()
    await redis.set(key, seconds * 1000 + micros // 1000 - 60_000, ex=15)
    later = Page()
    await hub.subscribe(later, fanout.instance_stream(2))
    try:
        assert hub.resyncing is None or hub.resyncing.done()
        assert await redis.ttl(key) > 10  # renewed

        # Redis lost the key and another process's hub made it again, seconds before this
        # hub's next mark: a key this hub has not seen, older than the trust, still
        # means messages were dropped, and its pages are resynced.
        await redis.delete(key)
        (seconds, micros) = await redis.time()
        await redis.set(key, seconds * 1000 + micros // 1000 - 4_000, ex=15)
        await hub.keep_pages_open()
        await asyncio.wait_for(later.resynced.wait(), 10)
    finally:
        await hub.unsubscribe(later, fanout.instance_stream(2))


@needs_redis
@pytest.mark.django_db(transaction=True)
async def test_a_dashboard_opened_and_closed_many_times_leaves_no_buffers_behind(
    redis_layer, monkeypatch
):
    """channels_redis buffers each message popped for a process-local channel until a
    receive on that channel takes it. A socket closing as its user's `wf.access` arrived
    left that message buffered, and a receive cancelled mid-pop left its empty buffer,
    for the life of the process: about one buffer per three sockets ever opened."""
    from asgiref.sync import sync_to_async
    from django.contrib.auth.models import User
    from django.test import Client

    from tests.dashboard.helpers import make_user
    from tests.dashboard.test_consumers import connect, receive_until

    def login() -> bytes:
        client = Client()
        client.force_login(User.objects.get(username="opener"))
        return f"sessionid={client.cookies['sessionid'].value}".encode()

    now = [0.0]
    monkeypatch.setattr(redis_layer, "monotonic", lambda: now[0], raising=False)
    await sync_to_async(make_user)("opener", "view_instance")
    cookie = await sync_to_async(login)()
    kept, connected = await connect("/ws/overview/", cookie)  # the hub stays, receiving
    assert connected
    await receive_until(kept, "snapshot")
    for _ in range(30):
        page, connected = await connect("/ws/instances/", cookie)
        assert connected
        await receive_until(page, "snapshot")
        # A login or an edit of the user: each of their sockets re-checks (wf.access).
        await sync_to_async(lambda: User.objects.get(username="opener").save())()
        await page.disconnect()

    # At most the few that got a message as they closed, kept until `expiry` has passed,
    # and the two with a receive waiting (the kept socket's and its hub's).
    assert len(redis_layer.receive_buffer) <= 2 + 30
    now[0] += redis_layer.expiry + 60
    await sync_to_async(lambda: User.objects.get(username="opener").save())()
    async with asyncio.timeout(10):  # the kept socket's next receive sweeps
        while len(redis_layer.receive_buffer) > 2:
            await asyncio.sleep(0.05)
    assert set(redis_layer.unreceived_since) <= set(redis_layer.receive_buffer)
    await kept.disconnect()
