"""Review of events and waits, and the channel layers that carry wake-ups.

Each test failed on the code reviewed (806d0fa) for the reason its docstring gives."""

from __future__ import annotations

import asyncio

import pytest

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, current_step, register
from workflows_app.models import StepRecord

pytestmark = pytest.mark.django_db(transaction=True)


def send_b_then_a_once_b_waits() -> str:
    """A step of "two-types": once the other branch's wait for "b" looked and parked its
    record, send "b" and then "a" to this instance (so "a" gets the higher id)."""
    from tests.polling import wait_until

    ctx = current_step()
    assert ctx is not None
    wait_until(
        lambda: StepRecord.objects.filter(
            instance__instance_id=ctx.instance_id, name="wait b", status="waiting"
        ).exists(),
        30,
        "the wait for b's record",
    )
    inst = get_workflow("two-types").get(ctx.instance_id)
    inst.send_event("b", {"n": "b"})
    inst.send_event("a", {"n": "a"})
    return "sent"


def test_an_event_that_came_during_the_run_is_not_lost_when_a_later_read_of_another_type_saw_a_newer_id(
    registered,
):
    """runner.py:200/1116 keeps ONE `events_seen` for the whole run: the newest event id
    read of ANY type. park (store/runs.py:924 and PARK_SQL's `id > %(seen)s`,
    store/runs.py:1000) treats every awaited event with an id at or below it as seen. Here
    the wait for "b" looked (nothing), then "b" (id n) and "a" (id n+1) were sent during
    the run; the wait for "a" read its inbox and set events_seen = n+1; the park then
    decides "b" (id n) was seen and passed over, and parks the instance until the wait's
    timeout (1 hour), although its event is there: a lost wake-up. Send_event's own
    wake-up (wake_at = now) was written while the run held the instance and the park
    overwrites it."""

    @register("two-types")
    class TwoTypes(WorkflowEntrypoint):
        async def run(self, event, step):
            async def wait_b():
                return (await step.wait_for_event("wait b", type="b", timeout="1 hour")).payload

            async def send_then_wait_a():
                await step.do("send", send_b_then_a_once_b_waits)
                return (await step.wait_for_event("wait a", type="a", timeout="1 hour")).payload

            return await asyncio.gather(wait_b(), send_then_wait_a())

    inst = get_workflow("two-types").create()
    testing.run_until_idle()
    row = inst.row()
    assert inst.status().status == "complete", (row.status, row.wake_at, inst.pending_events())
    assert inst.status().output == [{"n": "b"}, {"n": "a"}]


def test_parallel_typed_waits_of_one_type_each_take_the_event_their_own_schema_accepts(registered):
    """send_event's long way (engine/store/control.py:1195-1210) validates a payload against
    the schema of the OLDEST typed wait of that type only (`.order_by("seq").first()`).
    With two parallel waits on one type, each with its own schema, an event meant for the
    second wait is refused with EventPayloadInvalid although a pending wait accepts it
    (PITFALLS 4: parallel waits on one type each get their own delivery; SPEC: refused
    only when it fails the waiting step's schema)."""

    @register("two-typed")
    class TwoTyped(WorkflowEntrypoint):
        async def run(self, event, step):
            small = step.wait_for_event(
                "small",
                type="order",
                timeout="1 hour",
                schema={"type": "object", "properties": {"n": {"maximum": 5}}, "required": ["n"]},
            )
            big = step.wait_for_event(
                "big",
                type="order",
                timeout="1 hour",
                schema={"type": "object", "properties": {"n": {"minimum": 10}}, "required": ["n"]},
            )
            got = await asyncio.gather(small, big)
            return [g.payload for g in got]

    inst = get_workflow("two-typed").create()
    testing.run_until_idle()
    assert {p.name for p in inst.pending_events()} == {"small", "big"}
    inst.send_event("order", {"n": 20})  # for "big": refused today, naming "small"'s schema
    inst.send_event("order", {"n": 1})
    testing.run_until_idle()
    assert inst.status().output == [{"n": 1}, {"n": 20}]


def test_an_untyped_wait_beside_a_typed_wait_of_one_type_takes_any_payload(registered):
    """The same query (engine/store/control.py:1197-1209) ignores untyped waits
    (`event_schema_json__isnull=False`): when an untyped and a typed wait of one type are
    pending together, a payload the untyped wait would take is refused because the typed
    one would not."""

    @register("mixed-typed")
    class MixedTyped(WorkflowEntrypoint):
        async def run(self, event, step):
            anything = step.wait_for_event("anything", type="note", timeout="1 hour")
            typed = step.wait_for_event(
                "typed",
                type="note",
                timeout="1 hour",
                schema={"type": "object", "required": ["ok"]},
            )
            got = await asyncio.gather(anything, typed)
            return [g.payload for g in got]

    inst = get_workflow("mixed-typed").create()
    testing.run_until_idle()
    inst.send_event("note", "free text")  # refused today: "typed"'s schema rejects it
    inst.send_event("note", {"ok": True})
    testing.run_until_idle()
    assert inst.status().output == ["free text", {"ok": True}]


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"$ref": "#/$defs/missing"}, "#/$defs/missing"),
        ({"properties": {"n": {"$ref": "other.json"}}}, "other.json"),  # never fetched
    ],
)
def test_a_wait_whose_schema_reference_does_not_resolve_fails_with_a_wfdash_error(
    registered, schema, named
):
    """check_schema checks a schema's form, not where its $ref leads: an event buffered
    before such a wait made the payload check raise jsonschema's private
    _WrappedReferencingError, and the instance errored under that name. A reference that
    does not resolve inside the schema (another document is never fetched) is refused when
    the wait is declared, as InvalidInput naming it."""

    @register("dangling-ref-engine")
    class DanglingRef(WorkflowEntrypoint):
        async def run(self, event, step):
            return (await step.wait_for_event("approval", type="go", schema=schema)).payload

    inst = get_workflow("dangling-ref-engine").create()
    inst.send_event("go", {"n": 1})  # buffered: no wait yet
    testing.run_until_idle()
    status = inst.status()
    assert status.status == "errored", status
    assert status.error["name"] == "InvalidInput", status.error
    assert "does not resolve" in status.error["message"], status.error
    assert named in status.error["message"], status.error


def test_a_schema_reference_to_another_document_is_never_fetched(registered):
    """jsonschema's default registry fetched a $ref's http(s) document at each payload's
    check: synchronously in the worker's event loop or the request sending the event, from
    any address the schema named. References now resolve within the schema and the
    meta-schemas only: the wait is refused where it is declared, a stored schema of an
    earlier release refuses the event, and no request leaves."""
    import http.server
    import json
    import threading

    from workflows_app.engine import errors
    from workflows_app.models import StepRecord

    fetched: list[str] = []

    class Document(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            fetched.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"type": "object"}')

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Document)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    remote = {"$ref": f"http://127.0.0.1:{server.server_address[1]}/payload.json"}
    try:

        @register("remote-ref")
        class RemoteRef(WorkflowEntrypoint):
            async def run(self, event, step):
                schema = event.payload["schema"]
                return (await step.wait_for_event("approval", type="go", schema=schema)).payload

        declared = get_workflow("remote-ref").create(params={"schema": remote})
        testing.run_until_idle()
        status = declared.status()
        assert (status.status, status.error["name"]) == ("errored", "InvalidInput"), status
        assert "never fetched" in status.error["message"], status.error

        stored = get_workflow("remote-ref").create(params={"schema": {"type": "object"}})
        testing.run_until_idle()
        StepRecord.objects.filter(instance__instance_id=stored.id, name="approval").update(
            event_schema_json=json.dumps(remote)
        )
        with pytest.raises(errors.EventPayloadInvalid, match="does not resolve"):
            stored.send_event("go", {"ok": True})
        assert stored.status().status == "waiting"
        # Meta-schemas still resolve (they ship with jsonschema): a payload that is a schema.
        meta_schema = {"$ref": "https://json-schema.org/draft/2020-12/schema"}
        meta = get_workflow("remote-ref").create(params={"schema": meta_schema})
        testing.run_until_idle()
        assert meta.status().status == "waiting"
        with pytest.raises(errors.EventPayloadInvalid, match="does not match"):
            meta.send_event("go", {"type": 5})
        meta.send_event("go", {"type": "object"})
        testing.run_until_idle()
        assert meta.status().output == {"type": "object"}
    finally:
        server.shutdown()
        server.server_close()
    assert fetched == []


# --- hints over the Redis channel layer (PostgreSQL with WAKE_NOTIFY off, or SQLite) ----

from channels.layers import channel_layers, get_channel_layer  # noqa: E402

from tests.test_fleet import needs_redis, redis_url  # noqa: E402
from wfdash.settings import redis_channel_layer  # noqa: E402


@pytest.fixture
def redis_workers_channel(settings):
    """The Redis layer, and a private channel joined to the workers' group the way
    `runworker workflows` joins it (management/commands/runworker.py:107-109)."""
    from workflows_app import live

    settings.CHANNEL_LAYERS = {"default": redis_channel_layer(redis_url)}
    settings.WFDASH = {**getattr(settings, "WFDASH", {}), "WAKE_NOTIFY": False}
    channel_layers.backends.clear()
    layer = get_channel_layer()
    channel = asyncio.run(layer.new_channel())
    asyncio.run(live.join_workers_group(channel))
    yield layer, channel
    asyncio.run(layer.group_discard(live.WORKERS_GROUP, channel))
    channel_layers.backends.clear()


def first_message_before_sentinel(layer, channel) -> dict:
    """Everything the Sender holds is sent (flush); then a sentinel goes straight to the
    channel: whatever the worker would have heard comes before it."""
    from workflows_app import live

    assert live.flush()

    async def receive() -> dict:
        await layer.send(channel, {"type": "wf.sentinel"})
        return await asyncio.wait_for(layer.receive(channel), 5)

    return asyncio.run(receive())


@needs_redis
def test_a_restart_hint_over_redis_reaches_the_worker_running_the_old_run(
    registered, redis_workers_channel
):
    """live.py:283 lists "restart" among WAKE_KINDS, so the Sender folds it (live.py:
    _coalesce, PendingHints.put) into an anonymous {"kind": "wake", "pk": None} sent to
    the `workflows` engine channel, which ONE process receives. The worker running the
    instance never hears "restart", so Worker._on_hint (engine/worker.py:585) never calls
    run.abort("restart"): the old run's step goes on (an async step is not cancelled)
    while the restart made the instance due and another worker starts the new run, the
    very overlap PITFALLS 1 forbids; the old run only stops at its next fenced write.
    Only with hints over Redis (SQLite, or PostgreSQL with WAKE_NOTIFY off)."""
    layer, channel = redis_workers_channel

    @register("restartable")
    class Restartable(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do("one", lambda: 1)

    inst = get_workflow("restartable").create()
    testing.run_until_idle()
    inst.restart()
    pk = inst.row().pk
    message = first_message_before_sentinel(layer, channel)
    assert message == {"type": "wf.hint", "kind": "restart", "pk": pk}, message


def test_a_typed_wait_judges_the_payload_it_will_receive_not_the_python_object_sent(registered):
    """client.py:757-769 validates the Python object passed to send_event, while what is
    stored and delivered is its JSON (encode_json at client.py:749): a tuple is stored as
    an array, but jsonschema's "array" is only a list, so `{"items": (1, 2)}` is refused
    by a pending wait whose schema wants an array, though sent a moment earlier (before
    the wait existed) the same payload is buffered and delivered as [1, 2]."""

    @register("tuple-typed")
    class TupleTyped(WorkflowEntrypoint):
        async def run(self, event, step):
            got = await step.wait_for_event(
                "items",
                type="items",
                timeout="1 hour",
                schema={"type": "object", "properties": {"items": {"type": "array"}}},
            )
            return got.payload

    inst = get_workflow("tuple-typed").create()
    testing.run_until_idle()
    assert inst.pending_events()
    inst.send_event("items", {"items": (1, 2)})  # EventPayloadInvalid today
    testing.run_until_idle()
    assert inst.status().output == {"items": [1, 2]}


def test_a_wait_whose_schema_reference_does_not_resolve_refuses_an_event_clearly(registered):
    """A wait parked by an earlier release, whose stored schema's $ref does not resolve
    (declared now, such a wait is refused: the test above). send_event's validation raised
    jsonschema's _WrappedReferencingError, no WorkflowError: the API answered 500
    InternalError, the dashboard's form a server error, a bulk send_event logged a
    traceback. It is refused as a payload that no payload can pass, and nothing stored."""
    import json

    from django.test import Client

    from workflows_app import tokens
    from workflows_app.engine import errors
    from workflows_app.models import HistoryRecord, InboxEvent, StepRecord

    @register("dangling-ref")
    class DanglingRef(WorkflowEntrypoint):
        async def run(self, event, step):
            received = await step.wait_for_event("approval", type="go", schema={"type": "object"})
            return received.payload

    inst = get_workflow("dangling-ref").create(id="dangling")
    testing.run_until_idle()
    assert inst.status().status == "waiting"
    StepRecord.objects.filter(instance__instance_id="dangling", name="approval").update(
        event_schema_json=json.dumps({"$ref": "other.json"})
    )
    history = HistoryRecord.objects.count()
    with pytest.raises(errors.EventPayloadInvalid, match="does not resolve"):
        inst.send_event("go", {"ok": True})
    _, secret = tokens.issue("dangling-ref-test")
    response = Client().post(
        "/api/workflows/dangling-ref/instances/dangling/events/go",
        json.dumps({"ok": True}),
        content_type="application/json",
        headers={"Authorization": f"Bearer {secret}"},
    )
    assert response.status_code == 400, response.content
    assert response.json()["errors"][0]["code"] == "EventPayloadInvalid"
    assert not InboxEvent.objects.exists()
    assert HistoryRecord.objects.count() == history
    assert inst.status().status == "waiting"
