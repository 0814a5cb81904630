"""Child workflows (SPEC §8): step.invoke and step.start, parking, failure, cascade, links."""

from __future__ import annotations

from collections import Counter

import pytest

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import ChildWorkflowFailed, WorkflowEntrypoint, register
from workflows_app.engine.errors import NonRetryableError
from workflows_app.models import Instance, Span, StepRecord

pytestmark = pytest.mark.django_db(transaction=True)

created_children: Counter[str] = Counter()


@pytest.fixture(autouse=True)
def _flows(registered):
    created_children.clear()

    @register("ship")
    class Ship(WorkflowEntrypoint):
        async def run(self, event, step):
            if event.payload.get("wait"):
                await step.wait_for_event("dispatched", type="dispatched", timeout="1 day")
            if event.payload.get("fail"):
                await step.do(
                    "refuse",
                    lambda: (_ for _ in ()).throw(NonRetryableError("no stock", "OutOfStock")),
                )
            return {"shipped": event.payload["order"]}

    @register("order")
    class Order(WorkflowEntrypoint):
        async def run(self, event, step):
            before = await step.do("before", lambda: "ok")
            try:
                shipped = await step.invoke("ship", "ship", params=event.payload)
            except ChildWorkflowFailed as exc:
                return {"failed": [exc.error_name, exc.message], "child": exc.instance_id}
            audit = await step.start("audit", "ship", params={"order": 0})
            return {"before": before, "shipped": shipped, "audit": audit}


def test_invoke_starts_one_child_parks_the_parent_and_returns_the_child_output():
    parent = get_workflow("order").create(id="o1", params={"order": 42, "wait": True})
    testing.run_until_idle()
    row = parent.row()
    assert row.status == "waiting" and row.lease_token is None  # parked: no worker holds it
    assert row.wake_at is None
    (child,) = parent.children()
    assert child.id == "o1:ship" and child.status().status == "waiting"
    assert child.parent().id == "o1"
    # A replay of the parent (a pause and resume make it run again) starts no second child.
    parent.pause()
    parent.resume()
    assert testing.run_until_idle() >= 1
    assert parent.row().status == "waiting"
    assert Instance.objects.filter(workflow="ship").count() == 1
    child.send_event("dispatched")
    testing.run_until_idle()  # the child completes, which makes the parent due; both run
    out = parent.status().output
    assert out["shipped"] == {"shipped": 42} and out["before"] == "ok"
    assert out["audit"] == "o1:audit"
    assert {c.id for c in parent.children()} == {"o1:ship", "o1:audit"}
    types = [h.type for h in parent.history()]
    assert types.count("child.started") == 2 and "child.completed" in types
    assert child.history()[0].data["parent"]["step"] == "ship"
    steps = {s.name: s.kind for s in StepRecord.objects.filter(instance_id=row.pk)}
    assert steps["ship"] == "invoke" and steps["audit"] == "startChild"


def test_a_child_that_errors_raises_child_workflow_failed_with_its_error_not_retried():
    parent = get_workflow("order").create(id="o2", params={"order": 7, "fail": True})
    testing.run_until_idle()
    testing.run_until_idle()
    assert parent.status().output == {
        "failed": ["OutOfStock", "no stock"],
        "child": "o2:ship",
    }
    record = StepRecord.objects.get(instance__instance_id="o2", name="ship")
    assert (record.status, record.attempts) == ("failed", 1)
    # Run again from scratch: the step finds the child it started, which failed.
    parent.restart()
    testing.run_until_idle()
    assert parent.status().output["failed"] == ["OutOfStock", "no stock"]
    assert Instance.objects.filter(workflow="ship").count() == 1


def test_a_terminated_child_fails_the_invoke_and_a_terminated_parent_ends_its_children():
    first = get_workflow("order").create(id="o3", params={"order": 1, "wait": True})
    testing.run_until_idle()
    (child,) = first.children()
    assert child.terminate() is True
    testing.run_until_idle()
    assert first.status().output["failed"] == ["WorkflowTerminated", "the child was terminated"]

    second = get_workflow("order").create(id="o4", params={"order": 2, "wait": True})
    testing.run_until_idle()
    (child,) = second.children()
    assert second.terminate() is True
    assert child.status().status == "terminated"
    assert "child.terminated" in [h.type for h in second.history()]
    assert "parent order/o4 ended" in child.history()[-1].data["reason"]


def test_cancelling_a_parent_terminates_its_unfinished_children():
    parent = get_workflow("order").create(id="o5", params={"order": 3, "wait": True})
    testing.run_until_idle()
    (child,) = parent.children()
    parent.cancel(compensate=True)
    testing.run_until_idle()
    assert parent.status().status == "terminated"
    assert child.status().status == "terminated"


def test_a_child_finishing_wakes_the_parent_in_the_same_transaction():
    parent = get_workflow("order").create(id="o6", params={"order": 5, "wait": True})
    testing.run_until_idle()
    (child,) = parent.children()
    child.send_event("dispatched")
    # Run only the child: its finish must leave the parent due (wake_at set, step due).
    from workflows_app.engine import store

    store.control.on_promoted = None  # no hints: only the rows can say it
    try:
        from workflows_app.engine.worker import Worker

        async def run_child_only():
            worker = Worker(worker_id="child-only")
            await worker.start()
            try:
                await worker.claim_and_start()
                await __import__("asyncio").gather(*worker.tasks.values())
            finally:
                await worker.stop(grace_seconds=0)

        __import__("asyncio").run(run_child_only())
    finally:
        from workflows_app import live

        store.control.on_promoted = live.instances_promoted
    assert child.status().status == "complete"
    row = parent.row()
    assert row.wake_at is not None and row.status == "waiting"
    assert StepRecord.objects.get(instance_id=row.pk, name="ship").wake_at is not None
    testing.run_until_idle()
    assert parent.status().status == "complete"


def test_the_child_trace_links_to_the_parent_span():
    parent = get_workflow("order").create(id="o7", params={"order": 9})
    testing.run_until_idle()
    testing.run_until_idle()
    assert parent.status().status == "complete"
    child = get_workflow("ship").get("o7:ship").row()
    parent_row = parent.row()
    assert child.parent_span.startswith(parent_row.trace_id + ":")
    child_span = Span.objects.filter(trace_id=child.trace_id, name="workflow ship").first()
    assert child_span is not None
    assert any(link["trace_id"] == parent_row.trace_id for link in child_span.links)


def test_the_parent_trace_leads_to_each_child_it_started():
    parent = get_workflow("order").create(id="o8", params={"order": 3})
    testing.run_until_idle()
    testing.run_until_idle()
    assert parent.status().status == "complete"
    children = {c.id: c.row() for c in parent.children()}
    assert set(children) == {"o8:ship", "o8:audit"}
    parent_spans = Span.objects.filter(trace_id=parent.row().trace_id)
    # The invoke and start spans name their child and its trace.
    for step_span, child_id in (("invoke ship", "o8:ship"), ("start audit", "o8:audit")):
        span = parent_spans.get(name=step_span)
        assert span.attributes["workflow.child.instance_id"] == child_id
        assert span.attributes["workflow.child.trace_id"] == children[child_id].trace_id
    # The parent's run spans link to each child's creation span, in the child's trace.
    links = [link for s in parent_spans.filter(name="workflow order") for link in s.links]
    linked = {
        link["attributes"]["workflow.child.instance_id"]: link
        for link in links
        if link["attributes"].get("workflow.link") == "child"
    }
    assert set(linked) == set(children)
    for child_id, link in linked.items():
        created = Span.objects.get(trace_id=children[child_id].trace_id, name="create ship")
        assert (link["trace_id"], link["span_id"]) == (created.trace_id, created.span_id)


def test_given_ids_and_bad_step_names_make_valid_deterministic_child_ids():
    @register("named-children")
    class Named(WorkflowEntrypoint):
        async def run(self, event, step):
            a = await step.start("ship it!", "ship", params={"order": 1})
            b = await step.start("explicit", "ship", params={"order": 2}, id="chosen-id")
            return [a, b]

    parent = get_workflow("named-children").create(id="n1")
    testing.run_until_idle()
    a, b = parent.status().output
    assert (a, b) == ("n1:ship-it-", "chosen-id")
    assert {c.id for c in parent.children()} == {a, b}


def test_a_child_s_fallback_id_holds_to_the_child_workflow_s_max_instance_id_length():
    """A child's fallback id ("child-<32 hex>", 38 characters) was stored whatever its
    workflow's max_instance_id_length: under a limit of 20 a child got a 38-character id,
    where a tick's made-up id is held to the limit. Now the step fails with LimitExceeded,
    for a readable id too long and for one taken alike; a readable id that fits is kept."""

    @register("short-child", limits={"max_instance_id_length": 20})
    class ShortChild(WorkflowEntrypoint):
        async def run(self, event, step):
            return "done"

    @register("starts-short-child")
    class StartsShortChild(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.start("go", "short-child")

    fits = get_workflow("starts-short-child").create(id="p1")  # "p1:go" fits
    too_long = get_workflow("starts-short-child").create(id="a-parent-id-of-20-ch")
    get_workflow("short-child").create(id="p2:go")  # taken: p2's child falls back
    taken = get_workflow("starts-short-child").create(id="p2")
    testing.run_until_idle()
    assert fits.status().output == "p1:go"
    for parent in (too_long, taken):
        error = parent.status().error
        assert parent.status().status == "errored", parent.id
        assert error["name"] == "LimitExceeded"
        assert "child of step 'go': max_instance_id_length is 20, got 38" in error["message"]
    ids = Instance.objects.filter(workflow="short-child").values_list("instance_id", flat=True)
    assert sorted(ids) == ["p1:go", "p2:go"]


def test_an_uncaught_child_failure_errors_the_parent_and_a_replay_raises_it_from_the_checkpoint():
    @register("strict-order")
    class StrictOrder(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.invoke("ship", "ship", params={"order": 1, "fail": True})

    @register("patient-order")
    class PatientOrder(WorkflowEntrypoint):
        async def run(self, event, step):
            try:
                await step.invoke("ship", "ship", params={"order": 2, "fail": True})
            except ChildWorkflowFailed as exc:
                first = [exc.workflow, exc.instance_id, exc.error_name, exc.message]
            await step.wait_for_event("again", type="again", timeout="1 hour")
            return first

    strict = get_workflow("strict-order").create(id="s1")
    patient = get_workflow("patient-order").create(id="p1")
    testing.run_until_idle()
    error = strict.status().error
    assert error["name"] == "ChildWorkflowFailed"
    assert "child ship/s1:ship failed: OutOfStock: no stock" in error["message"]
    assert patient.status().status == "waiting"
    patient.send_event("again")  # the replay meets the failed invoke's checkpoint
    testing.run_until_idle()
    assert patient.status().output == ["ship", "p1:ship", "OutOfStock", "no stock"]
    assert Instance.objects.filter(workflow="ship").count() == 2


def test_run_until_idle_claims_the_parent_a_child_woke_while_a_claim_was_out():
    """A run that ends while run_until_idle's claim is out makes its parent due after the
    claim looked: the claim finds nothing and no run is left, yet the parent is due. Made
    exact: a bystander's end brings a claim while the child runs, and the child is let end,
    and its task awaited, before that claim answers."""
    import asyncio
    import threading

    WAIT_S = 60  # each wait ends at its event; CI's three legs on two cores overran 10 s once

    from workflows_app.engine.worker import Worker
    from workflows_app.live import EngineHooks

    child_running, child_may_end = threading.Event(), threading.Event()
    bystander_may_end = threading.Event()

    def pack() -> str:
        child_running.set()
        child_may_end.wait(WAIT_S)
        return "packed"

    @register("slow-ship")
    class SlowShip(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do("pack", pack)

    @register("waits-for-its-child")
    class WaitsForItsChild(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.invoke("ship", "slow-ship")

    @register("bystander")
    class Bystander(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do("wait", lambda: bystander_may_end.wait(WAIT_S))

    class ChildEndsWhileTheClaimIsOut(Worker):
        async def maintain_once(self, force: bool = False) -> bool:
            did = await super().maintain_once(force)
            if set(self.tasks) - first_pks and not bystander_may_end.is_set():
                # The child was claimed. Its step running, the bystander may end: its end
                # brings a claim, whether it comes while admit_stranded_once is out or while
                # run_until_idle waits for both.
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, child_running.wait, WAIT_S)
                bystander_may_end.set()
            return did

        async def claim_and_start(self) -> int:
            running = list(self.tasks.values())
            started = await super().claim_and_start()
            if not started and child_running.is_set() and not child_may_end.is_set():
                child_may_end.set()  # the child ends after the claim looked, before it answers
                await asyncio.wait(running)
            return started

    async def run_until_idle() -> int:
        worker = ChildEndsWhileTheClaimIsOut(worker_id="testing", hooks=EngineHooks())
        await worker.start()
        try:
            return await worker.run_until_idle(timeout=WAIT_S)
        finally:
            await worker.stop(grace_seconds=0)

    parent = get_workflow("waits-for-its-child").create(id="w1")
    bystander = get_workflow("bystander").create(id="b1")
    first_pks = {parent.row().pk, bystander.row().pk}
    asyncio.run(run_until_idle())
    assert child_may_end.is_set()  # a claim was out while the child ended
    assert bystander.status().status == "complete"
    assert parent.status().status == "complete"
    assert parent.status().output == "packed"


@pytest.mark.parametrize("ends_in", ["claim_and_start", "maintain_once", "admit_stranded_once"])
def test_run_until_idle_claims_at_once_what_a_run_ending_mid_pass_made_due(ends_in):
    """A run that ends while run_until_idle's claim, maintain_once or admit_stranded_once
    is out, another run still going, may leave due what that claim did not see (here the
    child its parent started before parking; a parent a child's end woke): it is claimed
    at once, not once the other run ends. Made exact: the parent's task is awaited inside
    `ends_in`; the bystander's step waits for the child's claim and says whether it came
    (run_until_idle waited for the bystander's end: False after WAIT_S)."""
    import asyncio
    import threading

    WAIT_S = 60  # each wait ends at its event (the bystander's, if the claim never comes)

    from workflows_app.engine.worker import Worker
    from workflows_app.live import EngineHooks

    parent_may_go, child_claimed = threading.Event(), threading.Event()

    @register("quick-ship")
    class QuickShip(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do("pack", lambda: "packed")

    @register("waits-for-its-child")
    class WaitsForItsChild(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("gate", lambda: parent_may_go.wait(WAIT_S))  # let go in `ends_in`
            return await step.invoke("ship", "quick-ship")

    @register("bystander")
    class Bystander(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do("wait", lambda: child_claimed.wait(WAIT_S))

    class ParentEndsMidPass(Worker):
        parent_ended = False

        async def parent_ends(self) -> None:
            if not self.parent_ended and parent_pk in self.tasks:
                self.parent_ended = True
                parent_may_go.set()
                await asyncio.wait([self.tasks[parent_pk]])

        async def claim_and_start(self) -> int:
            started = await super().claim_and_start()
            if set(self.tasks) - first_pks:
                child_claimed.set()
            if ends_in == "claim_and_start":
                await self.parent_ends()  # after the claim looked, before it answers
            return started

        async def maintain_once(self, force: bool = False) -> bool:
            if ends_in == "maintain_once":
                await self.parent_ends()
            return await super().maintain_once(force)

        async def admit_stranded_once(self, force: bool = False) -> int:
            if ends_in == "admit_stranded_once":
                await self.parent_ends()
            return await super().admit_stranded_once(force)

    async def run_until_idle() -> bool:
        worker = ParentEndsMidPass(worker_id="testing", hooks=EngineHooks())
        await worker.start()
        try:
            await worker.run_until_idle(timeout=WAIT_S * 2)
            return worker.parent_ended
        finally:
            await worker.stop(grace_seconds=0)

    parent = get_workflow("waits-for-its-child").create(id="w1")
    bystander = get_workflow("bystander").create(id="b1")
    parent_pk = parent.row().pk
    first_pks = {parent_pk, bystander.row().pk}
    assert asyncio.run(run_until_idle())  # the parent ended inside `ends_in`
    claimed_in_time = bystander.status().output
    assert claimed_in_time is True, "the child was claimed only once the bystander ended"
    assert parent.status().status == "complete"
    assert parent.status().output == "packed"


def test_a_parent_that_ended_while_its_step_ran_starts_no_orphan_child():
    from workflows_app.engine import store
    from workflows_app.engine.errors import InvalidTransition
    from workflows_app.engine.store import NewInstance

    parent = get_workflow("order").create(id="ended", params={"order": 1, "wait": True})
    parent.terminate()
    ship = get_workflow("ship").definition()
    item = NewInstance("ended:ship", "{}", parent_pk=parent.row().pk, parent_step="ship")
    with pytest.raises(InvalidTransition, match="terminated: it starts no child"):
        store.start_child("ship", ship.version, ship.limits(), item, "fallback", "test")
    assert not Instance.objects.filter(workflow="ship").exists()


def test_wf_status_names_the_parent_and_the_children():
    from io import StringIO

    from django.core.management import call_command

    parent = get_workflow("order").create(id="cli-p", params={"order": 4, "wait": True})
    testing.run_until_idle()
    out = StringIO()
    call_command("wf", "status", "cli-p", stdout=out)
    assert "child:    ship/cli-p:ship waiting (step 'ship')" in out.getvalue()
    out = StringIO()
    call_command("wf", "status", "cli-p:ship", stdout=out)
    assert "parent:   order/cli-p (step 'ship')" in out.getvalue()
    assert parent.children()[0].id == "cli-p:ship"


def test_a_serving_worker_resumes_the_parent_as_soon_as_its_child_ends():
    """The child's end makes its parent due without a hint: the worker that ran the child
    looks for work at once (its next look would otherwise be an hour away)."""
    import asyncio

    from tests.polling import wait_until
    from tests.test_worker_operations import LoopThread, new_worker

    loop_thread = LoopThread()
    worker = new_worker(poll_seconds=3600)
    stop = asyncio.Event()
    serving = loop_thread.spawn(worker.serve(stop))
    try:
        parent = get_workflow("order").create(id="o9", params={"order": 9, "wait": True})
        wait_until(lambda: parent.children(), 20, "the child to start")
        (child,) = parent.children()
        wait_until(lambda: parent.row().lease_token is None, 20, "the parent to park")
        wait_until(lambda: child.status().status == "waiting", 20, "the child to park")
        child.send_event("dispatched")  # the child ends in a run of its own
        wait_until(lambda: parent.status().status == "complete", 20, "the parent to complete")
        assert parent.status().output["shipped"] == {"shipped": 9}
    finally:
        loop_thread.loop.call_soon_threadsafe(stop.set)
        serving.result(30)
        loop_thread.close()
