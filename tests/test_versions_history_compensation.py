"""Versions, idempotency, actors, history, typed events, compensation, result()."""

from __future__ import annotations

import json
import threading
from collections import Counter

import pytest
from django.conf import settings

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register, registry, store
from workflows_app.engine.errors import (
    ResultTimeout,
    VersionConflict,
    WorkflowFailed,
    WorkflowTerminated,
)
from workflows_app.engine.worker import sync_catalog
from workflows_app.models import Instance, StepRecord, WorkflowVersion

pytestmark = pytest.mark.django_db(transaction=True)
calls: Counter[str] = Counter()


@pytest.fixture(autouse=True)
def _reset_calls():
    calls.clear()


def define_v1():
    @register("versioned", version=1)
    class V1(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("w", type="go")
            return await step.do("which", lambda: "v1 code")


def define_v2():
    @register("versioned", version=2)
    class V2(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("w", type="go")
            return await step.do("which", lambda: "v2 code")


def test_instances_keep_replaying_on_the_version_they_started_with(registered):
    define_v1()
    old = get_workflow("versioned").create()
    testing.run_until_idle()
    define_v2()
    new = get_workflow("versioned").create()
    pinned = get_workflow("versioned").create(version=1)
    testing.run_until_idle()
    for inst in (old, new, pinned):
        inst.send_event("go")
    testing.run_until_idle()
    assert [i.status().output for i in (old, new, pinned)] == ["v1 code", "v2 code", "v1 code"]
    assert set(
        WorkflowVersion.objects.filter(name="versioned").values_list("version", flat=True)
    ) == {1, 2}


def test_an_instance_whose_version_is_gone_waits_with_a_reason_then_continues(registered):
    define_v1()
    with testing.fake_clock() as clock:
        inst = get_workflow("versioned").create()
        testing.run_until_idle()
        registry.unregister("versioned", 1)
        define_v2()
        inst.send_event("go")
        testing.run_until_idle()  # a worker with version 1 has the grace to take it first
        assert inst.row().lease_token is None and not inst.status().waiting_reason
        clock.advance(store.leases.FOREIGN_VERSION_GRACE)
        testing.run_until_idle()
    status = inst.status()
    assert status.status == "waiting"
    assert "version 1" in status.waiting_reason and "not registered" in status.waiting_reason
    assert (
        StepRecord.objects.filter(instance=inst.row(), name="which").count() == 0
    )  # never ran v2 code
    define_v1()  # a deploy brings version 1 back
    testing.run_until_idle()
    assert inst.status().output == "v1 code"


def deploy_changed_code_under_version_1():
    """Version 1 is in the catalog; then a deploy registers other code under version 1."""
    define_v1()
    sync_catalog()
    registry.unregister("versioned")

    @register("versioned", version=1)
    class Changed(WorkflowEntrypoint):
        async def run(self, event, step):
            return "different code, same version"


def test_registering_changed_code_under_an_existing_version_is_refused(registered):
    deploy_changed_code_under_version_1()
    with pytest.raises(VersionConflict, match=r"'versioned' version 1 .*bump the version"):
        sync_catalog()
    settings.WFDASH["STRICT_VERSIONS"] = False
    try:
        sync_catalog()  # a setting relaxes it (for DEBUG)
    finally:
        settings.WFDASH["STRICT_VERSIONS"] = True


def test_registering_other_code_under_a_version_registered_in_this_process_is_refused(
    registered, settings
):
    define_v1()
    with pytest.raises(VersionConflict, match=r"'versioned' version 1 is already registered .*V1"):

        @register("versioned", version=1)
        class Other(WorkflowEntrypoint):
            async def run(self, event, step):
                return "other code, same version"

    assert registry.get_definition("versioned", 1).cls.__qualname__.endswith("V1")
    define_v1()  # the same source again (a module reloaded) is fine
    settings.WFDASH = {**settings.WFDASH, "STRICT_VERSIONS": False}

    @register("versioned", version=1)
    class Relaxed(WorkflowEntrypoint):
        async def run(self, event, step):
            return "other code, same version"

    assert registry.get_definition("versioned", 1).cls is Relaxed


def test_runserver_refuses_to_serve_when_a_version_s_code_changed(registered, settings):
    from django.core.management import CommandError, call_command

    deploy_changed_code_under_version_1()
    settings.WFDASH = {**settings.WFDASH, "EMBEDDED_WORKER": True}
    with pytest.raises(CommandError, match=r"'versioned' version 1 .*bump the version"):
        call_command("runserver", "--noreload", "127.0.0.1:0")


def test_concurrent_creates_with_one_idempotency_key_give_one_instance(registered):
    define_v1()
    wf = get_workflow("versioned")
    results, errors = [], []
    barrier = threading.Barrier(4)

    def create():
        from django.db import connection

        try:
            barrier.wait()
            results.append(wf.create(idempotency_key="order-42").id)
        except Exception as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=create) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(set(results)) == 1
    assert Instance.objects.filter(workflow="versioned", idempotency_key="order-42").count() == 1
    assert wf.create(idempotency_key="order-42").id == results[0]


def test_an_idempotency_key_is_scoped_to_its_workflow_version(registered):
    define_v1()
    first = get_workflow("versioned").create(idempotency_key="order-7")
    define_v2()
    wf = get_workflow("versioned")
    under_v2 = wf.create(idempotency_key="order-7")  # the newest version: a new instance
    assert under_v2.id != first.id
    assert (first.row().version, under_v2.row().version) == (1, 2)
    assert wf.create(idempotency_key="order-7", version=1).id == first.id
    assert wf.create(idempotency_key="order-7").id == under_v2.id
    assert Instance.objects.filter(workflow="versioned", idempotency_key="order-7").count() == 2


def test_history_records_every_kind_of_event_with_actors(registered):
    @register("audited")
    class Audited(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("one", lambda: 1)
            await step.sleep("nap", "1 hour")
            await step.wait_for_event("w", type="go")
            return "ok"

    inst = get_workflow("audited").create(actor="alice")
    testing.run_until_idle()
    inst.pause(actor="bob")
    inst.resume(actor="carol")
    inst.skip_sleep(actor="dave")
    testing.run_until_idle()
    inst.send_event("go", {"x": 1}, actor="erin")
    testing.run_until_idle()
    history = inst.history()
    types = [h.type for h in history]
    for expected in [
        "instance.created",
        "run.started",
        "step.started",
        "step.completed",
        "sleep.started",
        "instance.paused",
        "instance.resumed",
        "sleep.skipped",
        "sleep.completed",
        "event.waiting",
        "event.sent",
        "event.received",
        "instance.completed",
    ]:
        assert expected in types, expected
    actors = {h.type: h.actor for h in history if h.actor}
    assert actors == {
        "instance.created": "alice",
        "instance.paused": "bob",
        "instance.resumed": "carol",
        "sleep.skipped": "dave",
        "event.sent": "erin",
    }
    assert [h.sequence for h in history] == list(range(1, len(history) + 1))


def test_the_history_of_a_delivered_event_holds_its_payload_direct_or_buffered(registered):
    @register("receiver", limits={"max_event_payload_bytes": 100_000})
    class Receiver(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("first", type="direct")
            await step.wait_for_event("second", type="buffered")
            await step.wait_for_event("third", type="large")

    inst = get_workflow("receiver").create()
    testing.run_until_idle()
    inst.send_event("direct", {"approved": True, "by": "ana"})  # the wait is parked for it
    inst.send_event("buffered", [1, 2, 3])  # sent before its wait starts
    big = {"blob": "z" * 50_000}
    inst.send_event("large", big)
    testing.run_until_idle()
    assert inst.status().status == "complete"
    received = {h.data["step"]: h.data for h in inst.history() if h.type == "event.received"}
    assert received["first"]["payload"] == {"approved": True, "by": "ana"}
    assert received["second"]["payload"] == [1, 2, 3]
    # A large payload is not copied whole into the history: its size and its start are.
    large = received["third"]
    assert "payload" not in large
    assert large["payload_bytes"] == len(json.dumps(big, separators=(",", ":")))
    assert large["payload_preview"].startswith('{"blob":"zzz') and large[
        "payload_preview"
    ].endswith("…")
    assert len(large["payload_preview"]) < 20_000


def test_pending_events_list_waits_with_their_schema(registered):
    schema = {"type": "object", "required": ["ok"]}

    @register("pending")
    class Pending(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("approval", type="approve", timeout="2 hours", schema=schema)

    inst = get_workflow("pending").create()
    testing.run_until_idle()
    (pending,) = inst.pending_events()
    assert (pending.name, pending.type, pending.schema) == ("approval", "approve", schema)
    assert pending.timeout_at is not None


def typed_approval():
    """A workflow whose one wait takes only `approve` events with an `ok` field."""

    @register("typed-approval")
    class TypedApproval(WorkflowEntrypoint):
        async def run(self, event, step):
            got = await step.wait_for_event(
                "approval",
                type="approve",
                timeout="2 hours",
                schema={"type": "object", "required": ["ok"]},
            )
            return got.payload

    return get_workflow("typed-approval")


def test_a_typed_wait_takes_the_oldest_buffered_event_matching_its_schema(registered):
    inst = typed_approval().create()
    inst.send_event("approve", {"nope": 1})  # sent before the wait: buffered unvalidated
    inst.send_event("approve", {"ok": True, "n": 2})
    testing.run_until_idle()
    assert inst.status().output == {"ok": True, "n": 2}
    inbox = {
        json.dumps(e.payload, sort_keys=True): e.consumed_by
        for e in inst.row().events.order_by("id")
    }
    assert inbox == {'{"nope": 1}': "", '{"n": 2, "ok": true}': "approval"}


def test_a_buffered_event_refused_by_a_typed_wait_does_not_wake_the_instance_again(registered):
    inst = typed_approval().create()
    inst.send_event("approve", {"nope": 1})  # buffered before the wait; the wait passes it over
    assert testing.run_until_idle() == 1  # parked once, not claimed again and again
    row = inst.row()
    (wait,) = inst.steps()
    assert row.status == "waiting" and row.wake_at == wait.wake_at  # due at the wait's timeout
    inst.send_event("approve", {"ok": True})
    testing.run_until_idle()
    assert inst.status().output == {"ok": True}


def saga():
    @register("saga")
    class Saga(WorkflowEntrypoint):
        async def run(self, event, step):
            for name in ["reserve", "charge", "ship"]:

                def undo(output, name=name):
                    calls[f"undo {name}"] += 1
                    if (
                        name == "charge"
                        and calls["undo charge"] == 1
                        and event.payload == "crash-once"
                    ):
                        raise ConnectionError("refund API down")
                    return f"undid {output}"

                await step.do(name, lambda n=name: n, compensate=undo)
            await step.wait_for_event("w", type="go")
            return "shipped"

    return get_workflow("saga")


def test_cancel_with_compensation_undoes_completed_steps_newest_first(registered):
    inst = saga().create()
    testing.run_until_idle()
    assert inst.cancel(compensate=True) == "compensating"
    assert inst.status().status == "compensating"
    testing.run_until_idle()
    assert inst.status().status == "terminated"
    comp = [s for s in inst.steps() if s.kind == "compensate"]
    assert [s.name for s in comp] == ["ship", "charge", "reserve"]
    assert [s.label for s in comp] == ["compensate:ship", "compensate:charge", "compensate:reserve"]
    assert [s.output for s in comp] == ["undid ship", "undid charge", "undid reserve"]
    types = [h.type for h in inst.history()]
    assert "compensation.started" in types
    assert types[-2:] == ["compensation.completed", "instance.cancelled"]


def test_a_failure_during_compensation_resumes_it_and_each_compensation_runs_once(registered):
    inst = saga().create(params="crash-once")
    with testing.fake_clock() as clock:
        testing.run_until_idle()
        inst.cancel(compensate=True)
        testing.run_until_idle()  # undo ship ok, undo charge fails and waits for its retry
        assert inst.status().status == "compensating"
        clock.advance("1 hour")
        testing.run_until_idle()
    assert inst.status().status == "terminated"
    assert calls == {"undo ship": 1, "undo charge": 2, "undo reserve": 1}


def test_cancel_without_compensation_just_terminates(registered):
    inst = saga().create()
    testing.run_until_idle()
    assert inst.cancel(compensate=False) == "terminated"
    testing.run_until_idle()
    assert calls == {}
    assert "instance.cancelled" in [h.type for h in inst.history()]


def test_result_returns_the_output_or_raises(registered):
    @register("results")
    class Results(WorkflowEntrypoint):
        async def run(self, event, step):
            if event.payload == "fail":
                raise ValueError("bad input")
            await step.wait_for_event("w", type="go")
            return {"done": True}

    wf = get_workflow("results")
    ok, failing, terminated = wf.create(), wf.create(params="fail"), wf.create()
    testing.run_until_idle()
    with pytest.raises(ResultTimeout):
        ok.result(timeout=0.05)
    ok.send_event("go")
    terminated.terminate()
    testing.run_until_idle()
    assert ok.result(timeout=1) == {"done": True}
    with pytest.raises(WorkflowFailed, match="bad input"):
        failing.result(timeout=1)
    with pytest.raises(WorkflowTerminated):
        terminated.result(timeout=1)


def test_result_wakes_when_the_engine_finishes_the_instance(registered):
    @register("awaited")
    class Awaited(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("w", type="go")
            return "finished"

    inst = get_workflow("awaited").create()
    testing.run_until_idle()
    inst.send_event("go")
    engine = threading.Thread(target=testing.run_until_idle)
    engine.start()
    assert inst.result(timeout=10) == "finished"
    engine.join()


def test_compensate_on_failure_unwinds_then_errors_with_the_original_error(registered):
    @register("unwinder")
    class Unwinder(WorkflowEntrypoint):
        compensate_on_failure = True

        async def run(self, event, step):
            await step.do(
                "book hotel",
                lambda: "hotel-1",
                compensate=lambda out: calls.update([f"cancel {out}"]),
            )
            await step.do("book flight", lambda: 1 / 0, retries={"limit": 0})

    inst = get_workflow("unwinder").create()
    testing.run_until_idle()
    assert inst.status().status == "errored"
    assert inst.status().error["name"] == "ZeroDivisionError"
    assert calls == {"cancel hotel-1": 1}
    kinds = [h.type for h in inst.history()]
    assert (
        kinds.index("compensation.started")
        < kinds.index("compensation.completed")
        < kinds.index("instance.errored")
    )
    started = next(h for h in inst.history() if h.type == "compensation.started")
    assert started.data == {
        "reason": "failure",
        "error": {"name": "ZeroDivisionError", "message": "division by zero"},
    }


def test_a_failure_unwinding_across_runs_shows_compensating_and_starts_compensation_once(
    registered,
):
    @register("slow-unwinder")
    class SlowUnwinder(WorkflowEntrypoint):
        compensate_on_failure = True

        async def run(self, event, step):
            await step.do("book hotel", lambda: "hotel-1", compensate=cancel_after_a_retry)
            await step.do("book flight", lambda: 1 / 0, retries={"limit": 0})

    def cancel_after_a_retry(out):
        calls.update(["cancel attempt"])
        if calls["cancel attempt"] == 1:
            raise RuntimeError("hotel API down")
        return f"cancelled {out}"

    with testing.fake_clock() as clock:
        inst = get_workflow("slow-unwinder").create()
        testing.run_until_idle()
        assert inst.status().status == "compensating"  # parked on the compensation's retry
        clock.advance("1 hour")
        testing.run_until_idle()
    assert inst.status().status == "errored" and inst.status().error["name"] == "ZeroDivisionError"
    kinds = [h.type for h in inst.history()]
    assert kinds.count("compensation.started") == 1 and kinds.count("compensation.completed") == 1
    assert calls["cancel attempt"] == 2
