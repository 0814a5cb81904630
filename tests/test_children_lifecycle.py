"""Child workflows' lifecycle around their parent (SPEC §8): a parent's end, a cancel's
compensations, deleting a child its parent still waits for."""

from __future__ import annotations

import asyncio
import threading

import pytest

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, clock, register, store
from workflows_app.engine.errors import InvalidTransition, NonRetryableError
from workflows_app.engine.worker import Worker
from workflows_app.live import EngineHooks
from workflows_app.models import Instance

pytestmark = pytest.mark.django_db(transaction=True)

address = {"bad": True}  # what post-and-check's check step finds
undone: list[str] = []  # the compensations that ran, in order


@pytest.fixture(autouse=True)
def _flows(registered):
    address["bad"] = True
    undone.clear()

    @register("leg")
    class Leg(WorkflowEntrypoint):
        """Books a leg (undone by its compensation), then the next leg as its child, or
        waits at the last one."""

        async def run(self, event, step):
            n = event.payload["n"]
            await step.do("book", lambda: f"leg {n}", compensate=undone.append)
            if n == 1:
                return await step.wait_for_event("go", type="go", timeout="1 day")
            return await step.invoke("next", "leg", params={"n": n - 1})

    @register("trip")
    class Trip(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("pay", lambda: "payment", compensate=undone.append)
            return await step.invoke("legs", "leg", params={"n": 2})

    @register("parcel")
    class Parcel(WorkflowEntrypoint):
        async def run(self, event, step):
            params = event.payload or {}
            if params.get("wait"):
                await step.wait_for_event("go", type="go", timeout="1 day")
            return {"parcel": params.get("n")}

    @register("post")
    class Post(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.invoke("send", "parcel", params={"wait": True, "n": 7})

    def refuse():
        raise NonRetryableError("no address", "BadAddress")

    @register("post-and-check")
    class PostAndCheck(WorkflowEntrypoint):
        """Starts a child, then invokes one and, beside it, a step that fails while the
        invoked child still runs. A bad address is refused once the check's answer (an
        event) comes: by then the invoke waits, its checkpoint written (the run parked),
        whatever the machine's load; a step failing at once raced the invoke's creation
        of its child, and under load the parent's end could come first (no child)."""

        async def run(self, event, step):
            await step.start("notify", "parcel", params={"wait": True, "n": 2})

            async def check():
                if address["bad"]:
                    await step.wait_for_event("answer", type="checked", timeout="1 day")
                    await step.do("check", refuse)

            sent, _ = await asyncio.gather(
                step.invoke("send", "parcel", params={"wait": True, "n": 1}), check()
            )
            return sent

    @register("post-or-timeout")
    class PostOrTimeout(WorkflowEntrypoint):
        """Invokes a child, but returns after a second if it has not finished by then."""

        async def run(self, event, step):
            sent = asyncio.ensure_future(step.invoke("send", "parcel", params={"wait": True}))
            timer = asyncio.ensure_future(step.sleep("give up", "1 second"))
            await asyncio.wait([sent, timer], return_when=asyncio.FIRST_COMPLETED)
            return sent.result() if sent.done() else "gave up"

    @register("post-and-forget")
    class PostAndForget(WorkflowEntrypoint):
        """Starts a child and does not wait for it (step.start)."""

        async def run(self, event, step):
            await step.start("notify", "parcel", params={"wait": True, "n": 2})
            if (event.payload or {}).get("fail"):
                await step.do("check", refuse)
            return "posted"


def test_a_finished_child_its_parent_still_waits_for_cannot_be_deleted():
    """The parent (paused here) has not taken the child's output: deleting the child made
    the parent fail with ChildWorkflowFailed (InstanceNotFound) when it ran on. The delete
    is refused naming the parent, as retention keeps such a child; once the parent has
    taken the output, the child deletes."""
    parent = get_workflow("post").create(id="p1")
    testing.run_until_idle()
    (child,) = parent.children()
    parent.pause()
    child.send_event("go")
    testing.run_until_idle()
    assert child.status().status == "complete" and parent.status().status == "paused"
    with pytest.raises(InvalidTransition, match=r"post/p1 .*step \"send\" waits for it"):
        child.delete()
    with pytest.raises(InvalidTransition, match="post/p1"):  # all or none
        get_workflow("parcel").delete_batch([child.id])
    assert child.status().status == "complete"
    parent.resume()
    testing.run_until_idle()
    assert parent.status().output == {"parcel": 7}
    child.delete()
    assert parent.children() == []


def test_a_parent_that_errors_while_its_invoke_waits_terminates_that_child():
    """A gathered branch failed while step.invoke waited: the parent errored and its child
    ran on, waiting for ever for an event with nobody to take its output (Temporal's
    default parent-close policy terminates it). It ends with its parent now, recorded on
    both; a restart of the parent revives it, and the invoke then takes its output. The
    child of its step.start runs on (detached)."""
    parent = get_workflow("post-and-check").create(id="pc1")
    testing.run_until_idle()
    assert parent.status().status == "waiting"
    assert [c.status().status for c in parent.children()] == ["waiting", "waiting"]
    parent.send_event("checked")
    testing.run_until_idle()
    assert parent.status().error["name"] == "BadAddress"
    started, child = parent.children()
    assert (started.id, started.status().status) == ("pc1:notify", "waiting")
    assert child.status().status == "terminated"
    assert "parent post-and-check/pc1 ended" in child.history()[-1].data["reason"]
    assert [h.type for h in parent.history()][-2:] == ["instance.errored", "child.terminated"]
    address["bad"] = False  # fixed, as a restart's operator would have it
    parent.restart()
    testing.run_until_idle()
    assert child.status().status == "waiting" and parent.status().status == "waiting"
    child.send_event("go")
    testing.run_until_idle()
    assert parent.status().output == {"parcel": 1}


def test_a_parent_that_ends_before_its_invoke_creates_the_child_leaves_no_orphan(monkeypatch):
    """Under load a gathered branch failing at once can end the parent before step.invoke's
    creation of its child takes the parent's lock (the database thread making it was
    slower): the creation is refused, the parent having ended, so no child waits for ever
    with nobody to take its output; a restart creates it for the invoke. The creation is
    held here until the parent's end has committed (two database threads, also on
    SQLite), so the run ends in that order every time."""
    ended, created = threading.Event(), threading.Event()
    refused: list[str] = []
    start_child, finish = store.start_child, store.finish

    def start_child_after_the_end(*args, **kwargs):
        try:
            assert ended.wait(20), "the parent never ended"
            return start_child(*args, **kwargs)
        except InvalidTransition as exc:
            refused.append(str(exc))
            raise
        finally:
            created.set()

    def finish_then_tell(*args, **kwargs):
        try:
            return finish(*args, **kwargs)
        finally:
            ended.set()

    monkeypatch.setattr(store, "start_child", start_child_after_the_end)
    monkeypatch.setattr(store, "finish", finish_then_tell)

    @register("invoke-or-refuse-at-once")
    class InvokeOrRefuseAtOnce(WorkflowEntrypoint):
        async def run(self, event, step):
            async def check():
                if address["bad"]:
                    raise NonRetryableError("no address", "BadAddress")
                return "checked"

            invoked = step.invoke("send", "parcel", params={"wait": True, "n": 4})
            return await asyncio.gather(invoked, check())

    async def run_until_idle_with_two_database_threads() -> None:
        worker = Worker(worker_id="testing", db_threads=2, hooks=EngineHooks())
        await worker.start()
        try:
            await worker.run_until_idle()
        finally:
            await worker.stop(grace_seconds=0)

    parent = get_workflow("invoke-or-refuse-at-once").create(id="ir1")
    asyncio.run(run_until_idle_with_two_database_threads())
    assert parent.status().error["name"] == "BadAddress"
    assert created.wait(20), "the invoke never asked for its child"
    assert len(refused) == 1 and "it starts no child" in refused[0]
    assert parent.children() == []
    assert "child.terminated" not in [h.type for h in parent.history()]
    monkeypatch.setattr(store, "start_child", start_child)
    monkeypatch.setattr(store, "finish", finish)
    address["bad"] = False
    parent.restart()
    testing.run_until_idle()
    (child,) = parent.children()
    assert (child.status().status, parent.status().status) == ("waiting", "waiting")
    child.send_event("go")
    testing.run_until_idle()
    assert parent.status().output == [{"parcel": 4}, "checked"]


def test_a_parent_that_completes_without_awaiting_its_invoke_terminates_that_child():
    parent = get_workflow("post-or-timeout").create(id="pt1")
    with testing.fake_clock() as fake:
        testing.run_until_idle()
        (child,) = parent.children()
        assert child.status().status == "waiting"
        fake.advance("2 seconds")
        testing.run_until_idle()
    assert parent.status().output == "gave up"
    assert child.status().status == "terminated"


def test_step_start_children_outlive_a_parent_that_completes_or_errors():
    """step.start is "start, don't wait": its child is detached, and runs on whatever
    becomes of the parent on its own (only a terminate or cancel of the parent ends it)."""
    done = get_workflow("post-and-forget").create(id="pf1")
    failed = get_workflow("post-and-forget").create(id="pf2", params={"fail": True})
    testing.run_until_idle()
    assert done.status().output == "posted" and failed.status().status == "errored"
    for parent in (done, failed):
        (child,) = parent.children()
        assert child.status().status == "waiting"
        child.send_event("go")
    testing.run_until_idle()
    assert [c.status().output for c in (*done.children(), *failed.children())] == [
        {"parcel": 2},
        {"parcel": 2},
    ]


def test_a_poison_parent_errored_by_its_worker_terminates_the_child_it_waits_for():
    """The worker errors an instance whose runs keep killing their worker (PoisonInstance)
    without running it: a step.invoke it waited in ends with it, as at any other end."""
    parent = get_workflow("post").create(id="pp1")
    testing.run_until_idle()
    (child,) = parent.children()
    Instance.objects.filter(pk=parent.row().pk).update(
        unproductive_claims=3, status="running", wake_at=clock.now()
    )
    testing.run_until_idle()
    assert parent.status().error["name"] == "PoisonInstance"
    assert child.status().status == "terminated"


def test_cancelling_a_parent_with_compensation_runs_its_childrens_compensations():
    """cancel(compensate=True) undoes the parent's completed steps; its children were only
    terminated, their booked legs left in force. Each unfinished child (and theirs) is now
    cancelled the same way: it compensates, then ends terminated; a restart of the parent
    revives them as after a terminate. cancel(compensate=False) still only terminates."""
    trip = get_workflow("trip").create(id="t1")
    testing.run_until_idle()
    (leg,) = trip.children()
    (last,) = leg.children()
    assert last.status().status == "waiting"
    assert trip.cancel(compensate=True) == "compensating"
    assert leg.status().status == "compensating" and last.status().status == "compensating"
    assert "child.cancelled" in [h.type for h in trip.history()]
    testing.run_until_idle()
    assert sorted(undone) == ["leg 1", "leg 2", "payment"]
    for inst in (trip, leg, last):
        assert inst.status().status == "terminated"
        assert [h.type for h in inst.history()][-2:] == [
            "compensation.completed",
            "instance.cancelled",
        ]
    assert any(h.data.get("cancelled") == "parent trip/t1 cancelled" for h in leg.history())

    trip.restart()
    testing.run_until_idle()
    assert last.status().status == "waiting" and trip.status().status == "waiting"
    undone.clear()
    trip.cancel(compensate=False)
    assert last.status().status == "terminated" and leg.status().status == "terminated"
    testing.run_until_idle()
    assert undone == []


def test_a_parent_moved_to_a_version_that_invokes_another_workflow_fails_clearly(registered):
    """restart(version=N) drops the parent's checkpoints; its replay finds the child its
    step started by the step's name. A new version whose step of that name invokes another
    workflow took that child's output as the new workflow's (silently the wrong one): it
    now fails, naming both workflows, as a changed step's kind does."""
    parent = get_workflow("post").create(id="pv1")
    testing.run_until_idle()

    @register("parcel-tracked")
    class Tracked(WorkflowEntrypoint):
        async def run(self, event, step):
            return {"tracked": True}

    @register("post", version=2)
    class PostV2(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.invoke("send", "parcel-tracked", params={"n": 7})

    parent.restart(version=2)
    testing.run_until_idle()
    status = parent.status()
    assert status.status == "errored", status
    assert status.error["name"] == "NonDeterminismError"
    assert 'step "send" started pv1:send, a child of workflow "parcel"' in status.error["message"]
    assert '"parcel-tracked"' in status.error["message"]
    # The child the old step invoked ends with the parent: nothing will take its output.
    (child,) = parent.children()
    assert child.status().status == "terminated"


@pytest.mark.parametrize(
    ("asks", "expected"),
    [
        ({"version": 2}, "version 2"),  # the step now pins the child's new version
        ({"id": "parcel-77"}, "id 'parcel-77'"),  # the step now names its child
    ],
)
def test_a_restarted_parent_whose_step_asks_for_another_child_fails_clearly(
    registered, asks, expected
):
    """A replay found the child its step started by the step's name and compared only the
    workflow: a parent restarted on code whose step pins another version of the child's
    workflow, or gives it another id, took the old child's output as the new one's
    (silently the wrong child). It now fails with NonDeterminismError naming what the
    step asks for, as for another workflow; the same code restarted still finds its
    child (an unpinned step takes it on whatever version it started)."""

    @register("parcel", version=2)
    class ParcelV2(WorkflowEntrypoint):
        async def run(self, event, step):
            return {"parcel": "v2"}

    @register("mail", version=1)
    class MailV1(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.invoke("send", "parcel", params={"n": 7}, version=1)

    parent = get_workflow("mail").create(id="mail-1", version=1)
    testing.run_until_idle()
    assert parent.status().output == {"parcel": 7}
    parent.restart()  # the same code: the same child, its output taken again
    testing.run_until_idle()
    assert parent.status().output == {"parcel": 7}
    (child,) = parent.children()

    @register("mail", version=2)
    class MailV2(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.invoke("send", "parcel", params={"n": 7}, **asks)

    parent.restart(version=2)
    testing.run_until_idle()
    status = parent.status()
    assert status.status == "errored", status
    assert status.error["name"] == "NonDeterminismError"
    message = status.error["message"]
    assert f'step "send" started {child.id}, a child of workflow "parcel" version 1' in message
    assert f"now asks it for {expected}" in message
    assert [c.id for c in parent.children()] == [child.id]  # no second child


def test_a_cancel_whose_compensation_fails_for_good_ends_the_instance_errored(registered):
    """README: a compensation that fails for good ends the instance errored with its own
    error. After cancel(compensate=True) that end was refused by the fence meant for
    other ends while the cancel is pending (compensate_on_cancel), so the instance stayed
    compensating and was run again at once, for ever (a run every few milliseconds). A
    child its parent's cancel sets compensating meets it as well."""

    def undo_payment(output):
        raise NonRetryableError("refunds are closed", "RefundRefused")

    @register("strict-pay")
    class StrictPay(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("pay", lambda: "payment", compensate=undo_payment)
            return await step.wait_for_event("go", type="go", timeout="1 day")

    inst = get_workflow("strict-pay").create(id="sp1")
    testing.run_until_idle()
    assert inst.cancel(compensate=True) == "compensating"
    testing.run_until_idle()
    status = inst.status()
    assert (status.status, status.error["name"]) == ("errored", "RefundRefused")
    assert inst.row().compensate_on_cancel is False
    assert [h.type for h in inst.history()].count("run.started") == 2


def test_a_parent_whose_compensation_fails_leaves_its_childs_compensations_running(registered):
    """cancel(compensate=True) set parent and child compensating; the parent's own
    compensation failed for good, so the parent ended errored while the step.invoke it
    replayed still waited: that end must not cut the child's compensations short."""
    attempts: list[str] = []

    def undo_leg(output):
        attempts.append(output)
        if len(attempts) == 1:
            raise RuntimeError("the airline is down")  # retried after 10 s, on the engine clock

    def undo_payment(output):
        raise NonRetryableError("refunds are closed", "RefundRefused")

    @register("slow-leg")
    class SlowLeg(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("book", lambda: "leg", compensate=undo_leg)
            return await step.wait_for_event("go", type="go", timeout="1 day")

    @register("strict-trip")
    class StrictTrip(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("pay", lambda: "payment", compensate=undo_payment)
            return await step.invoke("leg", "slow-leg")

    trip = get_workflow("strict-trip").create(id="st1")
    with testing.fake_clock() as fake:
        testing.run_until_idle()
        (leg,) = trip.children()
        trip.cancel(compensate=True)
        testing.run_until_idle()
        assert trip.status().error["name"] == "RefundRefused"
        assert leg.status().status == "compensating" and attempts == ["leg"]
        fake.advance("1 minute")
        testing.run_until_idle()
    assert attempts == ["leg", "leg"]
    assert [h.type for h in leg.history()][-2:] == ["compensation.completed", "instance.cancelled"]


def test_a_child_whose_invoke_was_cut_short_before_its_checkpoint_ends_with_its_parent(
    monkeypatch,
):
    """step.invoke had created its child (committed) but not yet written its waiting
    checkpoint when a gathered branch failed and ended the run: the end looked only at the
    checkpoints for a waiting invoke, found none, and left the child waiting for ever for
    an event with nobody to take its output. The invoke's answer is held here until its
    branch has been stopped, so the run ends inside that gap every time."""
    created, stopped = threading.Event(), threading.Event()
    original = store.start_child

    def start_child_then_hold(*args, **kwargs):
        answer = original(*args, **kwargs)
        created.set()
        assert stopped.wait(20), "the invoke's branch was never stopped"
        return answer

    monkeypatch.setattr(store, "start_child", start_child_then_hold)

    @register("invoke-and-refuse")
    class InvokeAndRefuse(WorkflowEntrypoint):
        async def run(self, event, step):
            async def send():
                try:
                    return await step.invoke("send", "parcel", params={"wait": True, "n": 3})
                except asyncio.CancelledError:
                    stopped.set()
                    raise

            async def check():
                loop = asyncio.get_running_loop()
                assert await loop.run_in_executor(None, created.wait, 20)
                if address["bad"]:
                    raise NonRetryableError("no address", "BadAddress")
                return "checked"

            return await asyncio.gather(send(), check())

    parent = get_workflow("invoke-and-refuse").create(id="ic1")
    testing.run_until_idle()
    assert parent.status().error["name"] == "BadAddress"
    (child,) = parent.children()
    assert child.status().status == "terminated", child.status()
    assert "parent invoke-and-refuse/ic1 ended" in child.history()[-1].data["reason"]
    # A restart revives it though its step has no checkpoint: the replay's invoke finds it.
    monkeypatch.setattr(store, "start_child", original)
    address["bad"] = False
    parent.restart()
    testing.run_until_idle()
    assert (child.status().status, parent.status().status) == ("waiting", "waiting")
    child.send_event("go")
    testing.run_until_idle()
    assert parent.status().output == [{"parcel": 3}, "checked"]


def test_a_start_child_created_before_its_checkpoint_outlives_its_parent_end(monkeypatch):
    """step.start had created its child (committed) but its branch was stopped before its
    checkpoint was written, when a gathered branch failed while a step.invoke waited: the
    end spared only the children of checkpointed step.start steps, and terminated this
    one with the invoke's, though "start, don't wait" outlives the parent. The start's
    answer is held here until its branch has been stopped (the invoke's child created
    too), so the run ends inside that gap every time, with one database thread or four."""
    created = {"send": threading.Event(), "notify": threading.Event()}
    stopped = threading.Event()
    original = store.start_child

    def start_child_then_hold(workflow, version, limits, item, *args, **kwargs):
        answer = original(workflow, version, limits, item, *args, **kwargs)
        created[item.parent_step].set()
        if item.parent_step == "notify":
            assert stopped.wait(20), "the start's branch was never stopped"
        return answer

    monkeypatch.setattr(store, "start_child", start_child_then_hold)

    @register("invoke-start-and-refuse")
    class InvokeStartAndRefuse(WorkflowEntrypoint):
        async def run(self, event, step):
            async def notify():
                try:
                    return await step.start("notify", "parcel", params={"wait": True, "n": 2})
                except asyncio.CancelledError:
                    stopped.set()
                    raise

            async def check():
                loop = asyncio.get_running_loop()
                for made in created.values():
                    assert await loop.run_in_executor(None, made.wait, 20)
                if address["bad"]:
                    raise NonRetryableError("no address", "BadAddress")
                return "checked"

            sent = step.invoke("send", "parcel", params={"wait": True, "n": 1})
            return await asyncio.gather(sent, notify(), check())

    parent = get_workflow("invoke-start-and-refuse").create(id="is1")
    testing.run_until_idle()
    assert parent.status().error["name"] == "BadAddress"
    children = {child.id: child for child in parent.children()}
    assert children["is1:send"].status().status == "terminated"
    assert children["is1:notify"].status().status == "waiting", children["is1:notify"].history()
    terminated = [h.data["id"] for h in parent.history() if h.type == "child.terminated"]
    assert terminated == ["is1:send"]
    # A restart's replay of the start finds that child: it starts no second one.
    monkeypatch.setattr(store, "start_child", original)
    address["bad"] = False
    parent.restart()
    testing.run_until_idle()
    assert sorted(child.id for child in parent.children()) == ["is1:notify", "is1:send"]
    assert parent.status().status == "waiting"
    children["is1:notify"].send_event("go")
    children["is1:send"].send_event("go")
    testing.run_until_idle()
    assert parent.status().output == [{"parcel": 1}, "is1:notify", "checked"]


@pytest.fixture
def start_child_crashed_run(registered, monkeypatch):
    """A parent whose first run created the child of its step.start and was cut short
    before that step's checkpoint: the fault point refuses the checkpoint (every try: the
    run is stopped and released, as when its worker dies there). Its next run (the same
    pass) comes to the start only after a gathered invoke and check, the order its code
    takes after the first run, as timing may have it: it parks with the invoke waiting
    and the check waiting for its answer, the start's child running, no checkpoint of it.
    Returns the parent."""
    from workflows_app.engine import faults, runner

    monkeypatch.setattr(runner, "WRITE_RETRY_DELAYS", (0.01, 0.01))  # three tries, then stop
    runs: list[int] = []

    @register("start-then-check")
    class StartThenCheck(WorkflowEntrypoint):
        async def run(self, event, step):
            runs.append(len(runs) + 1)  # this run's number

            async def notify():
                return await step.start("notify", "parcel", params={"wait": True, "n": 2})

            if len(runs) == 1:  # the first run starts the child first
                await notify()

            async def check():
                if address["bad"]:
                    await step.wait_for_event("answer", type="checked", timeout="1 day")
                    await step.do("check", refuse)
                return "checked"

            sent, checked = await asyncio.gather(
                step.invoke("send", "parcel", params={"wait": True, "n": 1}), check()
            )
            return [sent, checked, await notify()]

    def refuse():
        raise NonRetryableError("no address", "BadAddress")

    parent = get_workflow("start-then-check").create(id="sc1")
    faults.configure("before_checkpoint=raise@1-3")  # the start's checkpoint, its 3 tries
    try:
        testing.run_until_idle()
    finally:
        faults.configure("")
    assert runs == [1, 2]
    assert parent.status().status == "waiting"
    children = {child.id: child for child in parent.children()}
    assert {i: c.status().status for i, c in children.items()} == {
        "sc1:notify": "waiting",
        "sc1:send": "waiting",
    }
    assert {s.name: s.kind for s in parent.steps()} == {"send": "invoke", "answer": "waitForEvent"}
    return parent


@pytest.mark.parametrize(
    ("end", "error"), [("errored", "BadAddress"), ("poison", "PoisonInstance")]
)
def test_a_start_child_an_earlier_run_created_outlives_its_parent_end(
    start_child_crashed_run, end, error
):
    """The step.start's child was created by an earlier run that was cut short before
    the start's checkpoint. The run that ends the parent (a gathered check refused while
    the invoke waits, or the worker's PoisonInstance end) never came to the start: the
    end knew a step.start by its checkpoint or by the starts the ending run began, found
    neither, and terminated that child with the invoke's, though "start, don't wait"
    outlives the parent. The child's row now says a step.start created it."""
    parent = start_child_crashed_run
    children = {child.id: child for child in parent.children()}
    if end == "errored":
        parent.send_event("checked")
    else:
        Instance.objects.filter(pk=parent.row().pk).update(
            unproductive_claims=3, status="running", wake_at=clock.now()
        )
    testing.run_until_idle()
    assert parent.status().error["name"] == error
    assert children["sc1:send"].status().status == "terminated"
    assert children["sc1:notify"].status().status == "waiting"
    terminated = [h.data["id"] for h in parent.history() if h.type == "child.terminated"]
    assert terminated == ["sc1:send"]
    # A restart revives the invoke's child; the replay's start finds its child: no second.
    address["bad"] = False
    parent.restart()
    testing.run_until_idle()
    assert parent.status().status == "waiting"
    children["sc1:send"].send_event("go")
    testing.run_until_idle()
    assert sorted(child.id for child in parent.children()) == ["sc1:notify", "sc1:send"]
    assert parent.status().output == [{"parcel": 1}, "checked", "sc1:notify"]
    assert children["sc1:notify"].status().status == "waiting"


def test_children_made_before_0028_are_told_apart_by_their_steps_checkpoints():
    """A child made before migration 0028 (or by a worker of the release before it) has
    no kind on its row (NULL): the parent's end spares it when its step has a START_CHILD
    checkpoint, and terminates it as an awaited one otherwise, as before 0028."""
    parent = get_workflow("post-and-check").create(id="pc0")
    testing.run_until_idle()
    assert parent.status().status == "waiting"
    Instance.objects.filter(parent_id=parent.row().pk).update(detached=None)
    parent.send_event("checked")
    testing.run_until_idle()
    assert parent.status().error["name"] == "BadAddress"
    started, child = parent.children()
    assert (started.id, started.status().status) == ("pc0:notify", "waiting")
    assert child.status().status == "terminated"


def test_a_child_found_by_a_replay_takes_the_kind_of_the_step_that_finds_it(registered):
    """A replay's step.start or step.invoke finds the child its step made by the step's
    name. One made before 0028 (NULL) takes the kind of the step that finds it; so does
    one a restart on a new version finds by the name of a step of the other kind, which
    now awaits it (or no longer does): a later end of the parent terminates or spares it
    as that step's."""
    parent = get_workflow("post-and-forget").create(id="pk1")
    testing.run_until_idle()
    (child,) = parent.children()
    assert child.row().detached is True
    Instance.objects.filter(pk=child.row().pk).update(detached=None)  # as made before 0028
    parent.restart()
    testing.run_until_idle()
    assert (parent.status().output, child.row().detached) == ("posted", True)

    @register("post-and-forget", version=2)
    class AwaitsItNow(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.invoke("notify", "parcel", params={"wait": True, "n": 2})

    parent.restart(version=2)
    testing.run_until_idle()
    assert (parent.status().status, child.row().detached) == ("waiting", False)
    assert [c.id for c in parent.children()] == ["pk1:notify"]
