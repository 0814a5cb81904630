"""Operator control: pause, resume, terminate, restart, queueing under a concurrency limit."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from tests.engine_thread import run_engine_in_background
from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register
from workflows_app.engine.errors import InvalidInput, InvalidTransition
from workflows_app.models import StepRecord

pytestmark = pytest.mark.django_db(transaction=True)

calls: Counter[str] = Counter()


@pytest.fixture(autouse=True)
def _reset_calls():
    calls.clear()


class Gate:
    """A step body that signals it started, then waits until the test opens the gate."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, result="gated"):
        def body():
            calls["gated"] += 1
            self.started.set()
            assert self.release.wait(10), "the test never opened the gate"
            return result

        return body


def test_pause_while_a_step_runs_is_waiting_for_pause_then_paused_at_the_boundary(registered):
    gate = Gate()

    @register("pausable")
    class Pausable(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("slow", gate())
            await step.do("next", lambda: calls.update(["next"]))
            return "done"

    inst = get_workflow("pausable").create()
    thread, _ = run_engine_in_background(timeout=20)
    assert gate.started.wait(10)
    assert inst.pause() == "waitingForPause"
    assert inst.status().status == "waitingForPause"
    gate.release.set()
    thread.join(20)
    assert inst.status().status == "paused"
    assert [s.name for s in inst.steps()] == ["slow"]  # the running step finished and was kept
    assert calls["next"] == 0
    inst.resume()
    testing.run_until_idle()
    assert inst.status().output == "done"
    assert calls == {"gated": 1, "next": 1}


def test_resume_before_the_boundary_cancels_a_pending_pause(registered):
    gate = Gate()

    @register("pause-undone")
    class PauseUndone(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("slow", gate())
            await step.do("next", lambda: calls.update(["next"]))
            return "done"

    inst = get_workflow("pause-undone").create()
    thread, _ = run_engine_in_background(timeout=20)
    assert gate.started.wait(10)
    assert inst.pause() == "waitingForPause"
    assert inst.resume() == "running"  # changed one's mind while the step still runs
    gate.release.set()
    thread.join(20)
    assert inst.status().status == "complete", inst.status()
    assert calls == {"gated": 1, "next": 1}
    kinds = [h.type for h in inst.history()]
    assert "instance.resumed" in kinds and "instance.paused" not in kinds


def test_pause_holds_against_events_and_due_timers(registered):
    @register("holder")
    class Holder(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.sleep("nap", "1 minute")
            got = await step.wait_for_event("go", type="go")
            return got.payload

    inst = get_workflow("holder").create()
    with testing.fake_clock() as clock:
        testing.run_until_idle()
        assert inst.pause() == "paused"
        clock.advance("1 hour")  # the sleep is long over
        inst.send_event("go", 1)  # an event arrives
        assert testing.run_until_idle() == 0
        assert inst.status().status == "paused"
        inst.resume()
        testing.run_until_idle()
    assert inst.status().output == 1


def test_terminate_stops_a_running_step_and_nothing_runs_after_it(registered):
    gate = Gate()

    @register("terminable")
    class Terminable(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("slow", gate())
            await step.do("after", lambda: calls.update(["after"]))

    inst = get_workflow("terminable").create()
    thread, _ = run_engine_in_background(timeout=20)
    assert gate.started.wait(10)
    assert inst.terminate() is True
    gate.release.set()
    thread.join(20)
    assert inst.status().status == "terminated"
    assert inst.status().error is None  # a terminated instance is not an error
    assert calls["after"] == 0
    assert StepRecord.objects.filter(instance=inst.row(), status="complete").count() == 0
    assert inst.terminate() is False  # reports that nothing was terminated


def test_terminate_a_parked_instance(registered):
    @register("parked")
    class Parked(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.sleep("nap", "1 day")
            calls["after"] += 1

    inst = get_workflow("parked").create()
    testing.run_until_idle()
    assert inst.terminate() is True
    assert testing.run_until_idle() == 0
    assert inst.status().status == "terminated"
    with pytest.raises(InvalidTransition):
        inst.send_event("anything")


def test_restart_reruns_everything_and_restart_from_step_only_that_step_and_later(registered):
    @register("restartable")
    class Restartable(WorkflowEntrypoint):
        async def run(self, event, step):
            a = await step.do("a", lambda: calls.update(["a"]) or calls["a"])
            b = await step.do("b", lambda: calls.update(["b"]) or calls["b"])
            c = await step.do("c", lambda: calls.update(["c"]) or calls["c"])
            return [a, b, c]

    inst = get_workflow("restartable").create()
    testing.run_until_idle()
    assert inst.status().output == [1, 1, 1]
    inst.restart(from_step="b")
    testing.run_until_idle()
    assert inst.status().output == [1, 2, 2]
    inst.restart()
    testing.run_until_idle()
    assert inst.status().output == [2, 3, 3]
    with pytest.raises(InvalidInput, match="no step named 'zzz'"):
        inst.restart(from_step="zzz")


def test_restart_of_a_running_instance_is_not_touched_by_the_old_run(registered):
    gate = Gate()

    @register("restart-running")
    class RestartRunning(WorkflowEntrypoint):
        async def run(self, event, step):
            first = await step.do("first", gate("old") if calls["gated"] == 0 else (lambda: "new"))
            return first

    inst = get_workflow("restart-running").create()
    thread, _ = run_engine_in_background(timeout=20)
    assert gate.started.wait(10)
    inst.restart()
    gate.release.set()  # the old run's step now finishes: its checkpoint must be refused
    thread.join(20)
    testing.run_until_idle()
    assert inst.status().output == "new"
    assert [s.output for s in inst.steps()] == ["new"]
    # A terminate after the restart stops the restarted run.
    inst.restart()
    assert inst.terminate() is True
    testing.run_until_idle()
    assert inst.status().status == "terminated"


def test_max_concurrent_instances_queues_the_surplus_and_starts_it_in_creation_order(registered):
    @register("limited", limits={"max_concurrent_instances": 2})
    class Limited(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("go", type="go")
            return event.instance_id

    wf = get_workflow("limited")
    insts = [wf.create(id=f"i{n}") for n in range(5)]
    assert [i.status().status for i in insts] == [
        "running",
        "running",
        "queued",
        "queued",
        "queued",
    ]
    testing.run_until_idle()
    assert [i.status().status for i in insts] == [
        "waiting",
        "waiting",
        "queued",
        "queued",
        "queued",
    ]
    insts[3].send_event("go")  # buffered: it neither starts a queued instance nor jumps the queue
    assert insts[3].status().status == "queued"
    insts[0].send_event("go")
    testing.run_until_idle()
    assert [i.status().status for i in insts] == [
        "complete",
        "waiting",
        "waiting",
        "queued",
        "queued",
    ]
    insts[1].terminate()  # terminate frees a place too
    testing.run_until_idle()
    assert [i.status().status for i in insts][
        3
    ] == "complete"  # its buffered event was waiting for it
    assert insts[4].status().status == "waiting"


def test_paused_instances_hold_their_place_under_the_limit(registered):
    @register("limited-pause", limits={"max_concurrent_instances": 1})
    class LimitedPause(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("go", type="go")

    wf = get_workflow("limited-pause")
    first, second = wf.create(), wf.create()
    testing.run_until_idle()
    first.pause()
    testing.run_until_idle()
    assert second.status().status == "queued"
    first.resume()
    first.send_event("go")
    testing.run_until_idle()
    assert first.status().status == "complete"
    assert second.status().status == "waiting"


def test_a_queued_instance_paused_then_resumed_goes_back_to_the_queue_not_past_it(registered):
    @register("limited-queue-pause", limits={"max_concurrent_instances": 1})
    class LimitedQueuePause(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("go", type="go")

    wf = get_workflow("limited-queue-pause")
    first, second, third = wf.create(id="first"), wf.create(id="second"), wf.create(id="third")
    testing.run_until_idle()
    assert second.pause() == "paused"
    assert second.resume() == "queued"  # the place is taken: it waits its turn
    testing.run_until_idle()
    assert [i.status().status for i in (first, second, third)] == ["waiting", "queued", "queued"]
    third.pause()  # paused while queued: it holds no place either
    first.send_event("go")
    testing.run_until_idle()
    assert [i.status().status for i in (first, second, third)] == ["complete", "waiting", "paused"]
    second.send_event("go")
    testing.run_until_idle()
    assert third.status().status == "paused"
    assert third.resume() == "running"  # a free place: admitted at once
    testing.run_until_idle()
    assert third.status().status == "waiting"


def test_a_restart_rechecks_the_limit(registered):
    @register("limited-restart", limits={"max_concurrent_instances": 1})
    class LimitedRestart(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("go", type="go")

    wf = get_workflow("limited-restart")
    first = wf.create()
    testing.run_until_idle()
    first.send_event("go")
    testing.run_until_idle()
    second = wf.create()
    testing.run_until_idle()
    assert second.status().status == "waiting"
    assert first.restart() == "queued"  # the place is taken by the second one
    second.terminate()
    testing.run_until_idle()
    assert first.status().status == "waiting"


def test_resume_and_pause_refuse_statuses_they_do_not_apply_to(registered):
    @register("quick")
    class Quick(WorkflowEntrypoint):
        async def run(self, event, step):
            return 1

    inst = get_workflow("quick").create()
    testing.run_until_idle()
    with pytest.raises(InvalidTransition, match="complete"):
        inst.pause()
    with pytest.raises(InvalidTransition, match="not paused"):
        inst.resume()
    with pytest.raises(InvalidTransition, match="not sleeping"):
        inst.skip_sleep()
