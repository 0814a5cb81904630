"""Subscriptions: inst.subscribe(cursor) / asubscribe yield history from the cursor, then
live records as they are written, and end after a finished instance's last record."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from asgiref.testing import ApplicationCommunicator
from django.core.handlers.asgi import ASGIHandler
from django.db import connection, transaction
from django.test import AsyncClient, Client

from tests.dashboard.helpers import make_user
from tests.test_api import check_against_openapi
from workflows_app import api, live, surfaces, testing, tokens
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register, store
from workflows_app.engine.errors import InvalidInput
from workflows_app.engine.store.subscriptions import history_listener
from workflows_app.models import HistorySubscriber

pytestmark = pytest.mark.django_db(transaction=True)
SIGNAL_TIMEOUT = 20  # seconds: a bound on waiting for a completion signal, not a sleep


@pytest.fixture
def approval(registered: list[str]) -> Any:
    @register("sub-approval")
    class SubApproval(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            await step.do("prepare", lambda: "ready")
            got = await step.wait_for_event("approval", type="approve")
            return {"ok": got.payload}

    return get_workflow("sub-approval")


class Collector(threading.Thread):
    """Iterates a subscription in its own thread, as a caller blocked on it would."""

    def __init__(self, subscription: Any, until: int) -> None:
        super().__init__(daemon=True)
        self.subscription = subscription
        self.until = until  # signal once this many records have arrived
        self.records: list[Any] = []
        self.reached = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for record in self.subscription:
                self.records.append(record)
                if len(self.records) >= self.until:
                    self.reached.set()
        except BaseException as exc:  # shown by the test
            self.error = exc
        finally:
            self.reached.set()
            from django.db import connections

            connections.close_all()


def test_subscribe_yields_history_then_live_records_and_ends_when_the_instance_finishes(
    approval,
):
    inst = approval.create(id="s1")
    testing.run_until_idle()  # prepared, now waiting for the event
    before = len(inst.history())
    collector = Collector(inst.subscribe(cursor=0), until=before)
    collector.start()
    assert collector.reached.wait(SIGNAL_TIMEOUT)
    assert [r.sequence for r in collector.records] == list(range(1, before + 1))
    assert collector.is_alive()  # the instance is waiting: the subscription waits too

    inst.send_event("approve", {"by": "ann"})
    testing.run_until_idle()
    collector.join(SIGNAL_TIMEOUT)
    assert not collector.is_alive() and collector.error is None
    history = inst.history()
    assert [(r.sequence, r.type, r.data) for r in collector.records] == [
        (h.sequence, h.type, h.data) for h in history
    ]
    assert collector.records[-1].type == "instance.completed"
    assert HistorySubscriber.objects.count() == 0  # the row (PostgreSQL) went with it


def test_a_cursor_skips_what_was_seen_and_a_finished_instance_ends_at_once(approval):
    inst = approval.create(id="s2")
    testing.run_until_idle()
    inst.send_event("approve", True)
    testing.run_until_idle()
    history = inst.history()
    assert [r.sequence for r in inst.subscribe(cursor=3)] == [h.sequence for h in history[3:]]
    assert list(inst.subscribe(cursor=history[-1].sequence)) == []


def test_a_caller_that_stops_early_leaves_nothing_behind(approval):
    inst = approval.create(id="s3")
    testing.run_until_idle()
    subscription = inst.subscribe()
    first = next(subscription)
    assert first.sequence == 1
    subscription.close()
    assert HistorySubscriber.objects.count() == 0
    assert len(live.result_waiters) == 0


@pytest.mark.parametrize("cursor", [-1, "3", 1.5, True, 2**63])
def test_a_bad_cursor_is_refused(approval, cursor):
    inst = approval.create(id="s4")
    with pytest.raises(InvalidInput, match="cursor must be a history sequence"):
        next(inst.subscribe(cursor=cursor))


async def test_asubscribe_waits_without_a_thread_and_wakes_on_new_records(approval):
    inst = await sync_to_async(approval.create)(id="s5")
    await sync_to_async(testing.run_until_idle)()
    before = len(await inst.ahistory())
    seen: list[Any] = []
    subscription = inst.asubscribe(cursor=0)
    async for record in subscription:
        seen.append(record)
        if len(seen) == before:
            # Caught up: the next record comes from an event sent now, while it waits.
            await sync_to_async(inst.send_event)("approve", "yes")
            await sync_to_async(testing.run_until_idle)()
    assert [r.sequence for r in seen] == [h.sequence for h in await inst.ahistory()]
    assert seen[-1].type == "instance.completed"


@pytest.mark.skipif(
    connection.vendor != "postgresql", reason="NOTIFY is PostgreSQL's; SQLite subscribers poll"
)
def test_postgresql_notifies_history_of_watched_instances_only(approval):
    watched = approval.create(id="watched").row()
    unwatched = approval.create(id="unwatched").row()
    HistorySubscriber.objects.create(instance_id=watched.pk, expires_at="2100-01-01T00:00:00Z")
    heard: list[int] = []
    arrived = threading.Event()

    def wake(pk: int) -> None:
        heard.append(pk)
        arrived.set()

    try:
        assert history_listener.ensure_started(wake)
        for row in (unwatched, watched):  # committed in this order, heard in this order
            with transaction.atomic():
                store.append_history(row.pk, [store.History("test.note", {"n": 1})])
        assert arrived.wait(SIGNAL_TIMEOUT)
        assert heard == [watched.pk]
    finally:
        history_listener.ensure_started(live.result_waiters.wake)


@pytest.mark.skipif(
    connection.vendor != "postgresql", reason="NOTIFY is PostgreSQL's; SQLite subscribers poll"
)
def test_a_subscriber_whose_row_was_cleared_registers_again(approval):
    """A subscription whose row expired (its caller slow to take the next record, or busy
    past the TTL) and was deleted by another subscriber's open() kept "refreshing" a row
    that no longer existed: the trigger never notified it again, and each record waited
    for the next poll."""
    from workflows_app.engine.store.subscriptions import HistoryFollower

    row = approval.create(id="slow").row()
    follower = HistoryFollower(row.pk, 0)
    follower.open()
    HistorySubscriber.objects.all().delete()  # what an open() does to expired rows
    follower.refreshed_at = 0.0  # the refresh is due
    follower.keep_alive()
    assert HistorySubscriber.objects.filter(instance_id=row.pk).count() == 1
    heard: list[int] = []
    arrived = threading.Event()

    def wake(pk: int) -> None:
        heard.append(pk)
        arrived.set()

    try:
        assert history_listener.ensure_started(wake)
        with transaction.atomic():
            store.append_history(row.pk, [store.History("test.note", {"n": 1})])
        assert arrived.wait(SIGNAL_TIMEOUT) and heard == [row.pk]
    finally:
        history_listener.ensure_started(live.result_waiters.wake)
        follower.close()
    assert not HistorySubscriber.objects.exists()
    # The instance gone: nothing to register again, and no error.
    other = approval.create(id="gone").row()
    gone = HistoryFollower(other.pk, 0)
    gone.open()
    store.delete_rows([other.pk])
    gone.refreshed_at = 0.0
    gone.keep_alive()
    assert gone.subscriber is None and not HistorySubscriber.objects.exists()


# --- Server-Sent Events -----------------------------------------------------------------


def sse_url(instance_id: str, workflow: str = "sub-approval") -> str:
    return f"/api/workflows/{workflow}/instances/{instance_id}/subscribe"


def sse_events(chunk: bytes) -> list[dict[str, Any]]:
    """The SSE events of a chunk: {"id", "event", "data"} or {"comment"} each."""
    events: list[dict[str, Any]] = []
    for block in chunk.decode().split("\n\n"):
        event: dict[str, Any] = {}
        for line in filter(None, block.split("\n")):
            field, _, value = line.partition(":")
            event.setdefault(field or "comment", value.strip())
        if event:
            events.append(event)
    return events


async def read_events(response: Any, until: Any) -> list[dict[str, Any]]:
    """SSE events of the response until until(events)."""
    events: list[dict[str, Any]] = []
    async for chunk in response.streaming_content:
        events += sse_events(chunk)
        if until(events):
            break
    return events


def records_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**json.loads(e["data"]), "event_id": int(e["id"])} for e in events if "id" in e]


async def test_sse_streams_history_then_live_records_then_an_end_event(approval):
    inst = await sync_to_async(approval.create)(id="e1")
    await sync_to_async(testing.run_until_idle)()
    before = len(await inst.ahistory())
    _, secret = await sync_to_async(tokens.issue)("sse-reader", scope="read")
    response = await AsyncClient().get(sse_url("e1"), headers={"Authorization": f"Bearer {secret}"})
    assert response.status_code == 200
    assert response["Content-Type"] == "text/event-stream"
    assert "no-cache" in response["Cache-Control"]
    events = await read_events(response, lambda ev: len(records_of(ev)) == before)
    await sync_to_async(inst.send_event)("approve", "yes")
    await sync_to_async(testing.run_until_idle)()
    events += await read_events(response, lambda ev: any(e.get("event") == "end" for e in ev))
    history = [surfaces.history_json(h) for h in await inst.ahistory()]
    streamed = records_of(events)
    assert [r.pop("event_id") for r in streamed] == [h["sequence"] for h in history]
    assert streamed == json.loads(json.dumps(history))
    assert events[0].get("retry") == str(api.SSE_RETRY_MS)
    assert events[-1]["event"] == "end"


async def test_sse_resumes_after_last_event_id_and_sends_heartbeats(approval, monkeypatch):
    inst = await sync_to_async(approval.create)(id="e2")
    await sync_to_async(testing.run_until_idle)()
    _, secret = await sync_to_async(tokens.issue)("sse-resume", scope="read")
    monkeypatch.setattr(api, "SSE_HEARTBEAT_SECONDS", 0.01)
    response = await AsyncClient().get(
        sse_url("e2") + "?cursor=1",
        # Last-Event-ID wins over ?cursor=: an EventSource reconnecting
        headers={"Authorization": f"Bearer {secret}", "Last-Event-ID": "2"},
    )
    expected = [h.sequence for h in (await inst.ahistory())[2:]]
    events = await read_events(
        response,
        # caught up, then waiting: a heartbeat after the last record
        lambda ev: len(records_of(ev)) == len(expected) and ev[-1].get("comment") == "heartbeat",
    )
    assert [r["sequence"] for r in records_of(events)] == expected
    assert any(e.get("comment") == "heartbeat" for e in events)


async def open_asgi_stream(
    instance_id: str, token: str, until: Callable[[bytes], bool]
) -> tuple[ApplicationCommunicator, bytes]:
    """A history stream through Django's real ASGI handler, as a server runs it: the
    communicator and the body read until until(body)."""
    scope = {
        "type": "http",
        "method": "GET",
        "path": sse_url(instance_id),
        "query_string": b"",
        "headers": [(b"authorization", f"Bearer {token}".encode()), (b"host", b"testserver")],
    }
    app = ApplicationCommunicator(ASGIHandler(), scope)
    await app.send_input({"type": "http.request", "body": b"", "more_body": False})
    assert (await app.receive_output(SIGNAL_TIMEOUT))["status"] == 200
    body = b""
    while not until(body):
        body += (await app.receive_output(SIGNAL_TIMEOUT))["body"]
    return app, body


async def leave(app: ApplicationCommunicator) -> None:
    """The client goes away; the stream ends."""
    await app.send_input({"type": "http.disconnect"})
    await app.wait(SIGNAL_TIMEOUT)


async def test_a_client_that_disconnects_leaves_no_subscription_behind(approval):
    """Through Django's real ASGI handler: a disconnect cancels the stream while it waits."""
    await sync_to_async(approval.create)(id="e5")
    await sync_to_async(testing.run_until_idle)()
    _, secret = await sync_to_async(tokens.issue)("sse-leaver", scope="read")
    app, _ = await open_asgi_stream(
        "e5", secret, lambda body: b"instance.created" in body and b"event.waiting" in body
    )
    assert len(live.result_waiters) == 1  # caught up and waiting
    await leave(app)
    assert len(live.result_waiters) == 0
    assert await HistorySubscriber.objects.acount() == 0


async def test_a_client_holds_at_most_the_cap_of_history_streams_open(approval, settings):
    """Each stream holds a history listener and a slot of the event loop: one token could
    open them without end. Past WFDASH["MAX_SOCKETS_PER_USER"] open streams in the
    process, a client's next stream ends at once, naming the cap; another client's does
    not, and a client that goes away gives its place back (through Django's real ASGI
    handler, as a server runs it)."""
    settings.WFDASH = {**settings.WFDASH, "MAX_SOCKETS_PER_USER": 2}
    await sync_to_async(approval.create)(id="e6")
    await sync_to_async(testing.run_until_idle)()
    _, secret = await sync_to_async(tokens.issue)("sse-many", scope="read")
    _, other = await sync_to_async(tokens.issue)("sse-other", scope="read")

    async def open_stream(token: str) -> tuple[ApplicationCommunicator, bytes]:
        return await open_asgi_stream(
            "e6", token, lambda body: b"instance.created" in body or b"event: end" in body
        )

    first, _ = await open_stream(secret)
    second, _ = await open_stream(secret)
    third, body = await open_stream(secret)
    assert b"instance.created" not in body
    assert b"too many history streams open (2, WFDASH_MAX_SOCKETS_PER_USER)" in body
    await third.wait(SIGNAL_TIMEOUT)  # it ended on its own
    elsewhere, body = await open_stream(other)
    assert b"instance.created" in body
    await leave(first)
    again, body = await open_stream(secret)
    assert b"instance.created" in body
    for app in (second, elsewhere, again):
        await leave(app)
    assert not api._open_streams


async def test_sse_takes_a_staff_session_that_may_view(approval):
    await sync_to_async(approval.create)(id="e3")
    await sync_to_async(testing.run_until_idle)()
    client = AsyncClient()
    viewer = await sync_to_async(make_user)("sse-viewer", "view_instance")
    await client.aforce_login(viewer)
    response = await client.get(sse_url("e3"))
    assert response.status_code == 200
    events = await read_events(response, lambda ev: len(records_of(ev)) >= 1)
    assert records_of(events)[0]["sequence"] == 1
    await response.streaming_content.aclose()


@pytest.mark.parametrize(
    ("case", "status", "code"),
    [
        ("no token", 401, "Unauthorized"),
        ("staff without view_instance", 401, "Unauthorized"),
        ("token of another workflow", 403, "Forbidden"),
        ("unknown instance", 404, "InstanceNotFound"),
        ("bad Last-Event-ID", 400, "InvalidInput"),
        ("bad cursor", 400, "InvalidInput"),
        ("unknown query parameter", 400, "InvalidInput"),
        ("POST", 405, "MethodNotAllowed"),
    ],
)
def test_sse_refusals_are_json_errors_the_document_describes(approval, case, status, code):
    approval.create(id="e4")
    _, secret = tokens.issue("sse-ok", scope="read")
    _, narrow = tokens.issue("sse-narrow", scope="read", workflows=["elsewhere"])
    client = Client()
    auth = {"HTTP_AUTHORIZATION": f"Bearer {secret}"}
    url = sse_url("e4")
    if case == "no token":
        response = client.get(url)
    elif case == "staff without view_instance":
        client.force_login(make_user("sse-staff"))
        response = client.get(url)
    elif case == "token of another workflow":
        response = client.get(url, HTTP_AUTHORIZATION=f"Bearer {narrow}")
    elif case == "unknown instance":
        response = client.get(sse_url("nope"), **auth)
    elif case == "bad Last-Event-ID":
        response = client.get(url, HTTP_LAST_EVENT_ID="-1", **auth)
    elif case == "bad cursor":
        response = client.get(url + "?cursor=" + "9" * 25, **auth)
    elif case == "unknown query parameter":
        response = client.get(url + "?since=3", **auth)
    else:
        _, writer = tokens.issue("sse-writer")
        response = client.post(url, HTTP_AUTHORIZATION=f"Bearer {writer}")
    assert response.status_code == status
    assert response.json()["errors"][0]["code"] == code
    check_against_openapi(response.request["REQUEST_METHOD"], url, response)


@pytest.mark.parametrize("cap", [10**400, 100_001, 0, True])
def test_a_socket_cap_past_what_a_float_holds_is_refused_naming_it(settings, cap):
    """WFDASH["MAX_SOCKETS_PER_USER"] = 10**400 was taken: float() of it (each user's
    connect bucket) then raised OverflowError at every socket a user opened."""
    from django.core.exceptions import ImproperlyConfigured

    from workflows_app import socket_slots

    settings.WFDASH = {**settings.WFDASH, "MAX_SOCKETS_PER_USER": cap}
    with pytest.raises(ImproperlyConfigured, match=r"must be a whole number from 1 to 100000"):
        socket_slots.connect_allowed("someone")
