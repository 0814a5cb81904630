"""Review: compensation (saga), cancel(compensate=True), parallel branches and failures
during them. Each test fails on the code it was written against for the reason its
docstring names (file:line as of 8def060)."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import pytest

from tests.engine_thread import run_engine_in_background
from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import NonRetryableError, WorkflowEntrypoint, register, store
from workflows_app.engine.worker import Worker
from workflows_app.models import StepRecord

pytestmark = pytest.mark.django_db(transaction=True)

calls: Counter[str] = Counter()


@pytest.fixture(autouse=True)
def _reset_calls():
    calls.clear()


# --- 1. a sibling branch that completes while a failure's compensations run ---------------


def test_a_branch_that_completes_while_a_failure_is_compensated_is_compensated_or_cancelled(
    registered,
):
    """compensate_on_failure with asyncio.gather: branch "check stock" fails, so run()
    raises while its sibling "charge" is still running (gather does not cancel it).
    Run._conclude (runner.py:428-443) unwinds at once without stopping the sibling, and
    _run_compensations (runner.py:341-350) takes the list of completed steps once, when it
    starts. The sibling completes during the compensations, its checkpoint lands
    (complete, has_compensation) before the end, and it is never compensated: the
    instance ends errored with a charge nobody refunds. Fixed if the sibling is either
    cancelled before the compensations start (charged == 0) or compensated (refund == 1)."""

    @register("rvc-gather-fail")
    class GatherFail(WorkflowEntrypoint):
        compensate_on_failure = True

        async def run(self, event, step):
            go, sibling_over = asyncio.Event(), asyncio.Event()

            async def undo_reserve(out):
                calls["undo reserve"] += 1
                go.set()  # the sibling's call may go on now ...
                await sibling_over.wait()  # ... and has returned (or was cancelled)
                return "unreserved"

            async def charge():
                try:
                    await go.wait()
                except asyncio.CancelledError:
                    sibling_over.set()
                    raise
                calls["charged"] += 1
                sibling_over.set()
                return "charge-1"

            async def check_stock():
                raise NonRetryableError("out of stock")

            await step.do("reserve", lambda: "r-1", compensate=undo_reserve)
            await asyncio.gather(
                step.do("charge", charge, compensate=lambda out: calls.update(["refund"])),
                step.do("check stock", check_stock),
            )
            return "done"

    inst = get_workflow("rvc-gather-fail").create()
    testing.run_until_idle()
    assert inst.status().status == "errored"
    assert inst.status().error["message"] == "out of stock"
    assert calls["undo reserve"] == 1
    charge = StepRecord.objects.filter(instance=inst.row(), name="charge", kind="do").first()
    assert calls["charged"] == calls["refund"], (
        f"charge ran {calls['charged']}x (checkpoint {charge and charge.status}), "
        f"refunded {calls['refund']}x"
    )


# --- 2. the replay of a failure being compensated goes on with the other branches ---------


def test_the_replay_of_a_failure_being_compensated_starts_no_new_step(registered):
    """compensate_on_failure: a failure whose compensation waits for a retry parks the
    instance `compensating`; its next run replays run() to fail the same way and collect
    the compensations ("replays fail the same way", runner.py:440). Run.compensating is
    only set for cancel(compensate=True) (runner.py:224), so Activity (runner.py:118) lets
    new work start in that replay: a sibling branch whose sleep came due meanwhile goes
    on to its next step, and "charge" runs for the first time *after* the instance failed,
    while its saga is being rolled back. Nothing compensates it either (the list of
    completed steps was taken before it finished, or it lands after the end)."""

    def undo_reserve(out):
        calls["undo reserve"] += 1
        if calls["undo reserve"] == 1:
            raise ConnectionError("inventory API down")
        return "unreserved"

    def charge():
        calls["charged"] += 1
        return "charge-1"

    @register("rvc-replay-unwind")
    class ReplayUnwind(WorkflowEntrypoint):
        compensate_on_failure = True

        async def run(self, event, step):
            async def pay():
                await step.sleep("cool-off", "10 minutes")
                await step.do("charge", charge, compensate=lambda out: calls.update(["refund"]))

            async def check():
                await step.do("check stock", lambda: 1 / 0, retries={"limit": 0})

            await step.do("reserve", lambda: "r-1", compensate=undo_reserve)
            await asyncio.gather(pay(), check())

    with testing.fake_clock() as clock:
        inst = get_workflow("rvc-replay-unwind").create()
        testing.run_until_idle()
        assert inst.status().status == "compensating"  # undo reserve waits for its retry
        assert calls == {"undo reserve": 1}
        clock.advance("1 hour")  # the retry and the sibling's sleep are both due
        testing.run_until_idle()
    assert inst.status().status == "errored"
    assert inst.status().error["name"] == "ZeroDivisionError"
    assert calls["undo reserve"] == 2
    assert calls["charged"] == 0, (
        f"a step of the failed instance ran during its compensation: {dict(calls)}"
    )


# --- 3. restart(from_step) of a compensated instance replays the steps it undid -----------


def saga_workflow(name: str):
    @register(name)
    class Saga(WorkflowEntrypoint):
        async def run(self, event, step):
            for stage in ["reserve", "charge", "ship"]:

                def do(stage=stage):
                    calls[stage] += 1
                    return f"{stage}-{calls[stage]}"

                def undo(out, stage=stage):
                    calls[f"undo {stage}"] += 1
                    return f"undid {out}"

                await step.do(stage, do, compensate=undo)
            await step.wait_for_event("delivered", type="delivered")
            return "done"

    return get_workflow(name)


def test_restart_from_a_step_after_a_compensated_cancel_redoes_the_undone_steps(registered):
    """cancel(compensate=True) undid reserve, charge and ship. restart(from_step="ship")
    (store/control.py:1048-1062) drops the checkpoints from "ship" on (the compensation
    records too: they were numbered after every step) but keeps the checkpoints of
    "reserve" and "charge", whose effects the compensations undid. The replay returns
    them from their checkpoints without running them: the instance goes on (ships, and
    completes) with its stock released and its card refunded. A restart must redo a step
    it finds compensated (or refuse from_step on a compensated instance)."""
    inst = saga_workflow("rvc-restart").create()
    testing.run_until_idle()
    assert inst.cancel(compensate=True) == "compensating"
    testing.run_until_idle()
    assert inst.status().status == "terminated"
    assert calls == {
        "reserve": 1,
        "charge": 1,
        "ship": 1,
        "undo ship": 1,
        "undo charge": 1,
        "undo reserve": 1,
    }
    inst.restart(from_step="ship")
    testing.run_until_idle()
    inst.send_event("delivered")
    testing.run_until_idle()
    assert inst.status().status == "complete"
    # Each effect is in force: done once more than undone.
    in_force = {s: calls[s] - calls[f"undo {s}"] for s in ("reserve", "charge", "ship")}
    assert in_force == {"reserve": 1, "charge": 1, "ship": 1}, dict(calls)


# --- 4. a second cancel(compensate=True) aborts the compensations already running ---------


def test_a_second_cancel_does_not_run_a_compensation_again_while_it_runs(registered):
    """cancel(compensate=True) on an instance already `compensating` is accepted
    (lifecycle.py:45, every live status) and store.cancel (store/control.py:1354-1366)
    clears the lease of the run doing the compensations, appends a second
    compensation.started, and client.cancel hints "cancel" (client.py:757), which aborts
    that run (worker.py:585). A sync compensation in its thread goes on, its checkpoint is
    refused, and the next run runs the same compensation again: a double-clicked "cancel
    with compensation" (or a bulk cancel) refunds twice."""
    entered, release = threading.Event(), threading.Event()

    @register("rvc-double-cancel")
    class DoubleCancel(WorkflowEntrypoint):
        async def run(self, event, step):
            def refund(out):
                calls["refund"] += 1
                entered.set()
                release.wait(20)
                return "refunded"

            await step.do("charge", lambda: "charge-1", compensate=refund)
            await step.wait_for_event("delivered", type="delivered")

    inst = get_workflow("rvc-double-cancel").create()
    testing.run_until_idle()
    assert inst.cancel(compensate=True) == "compensating"
    thread, box = run_engine_in_background()
    try:
        assert entered.wait(10)
        second = inst.cancel(compensate=True)
    finally:
        release.set()
        thread.join(40)
    assert not thread.is_alive() and "error" not in box, box
    assert second == "compensating"
    assert inst.status().status == "terminated"
    kinds = [h.type for h in inst.history()]
    assert calls["refund"] == 1, (dict(calls), kinds)
    assert kinds.count("compensation.started") == 1, kinds


# --- 5. testing.mock_step of a step replaces its compensation as well ----------------------


def test_mock_step_of_a_step_does_not_replace_its_compensation(registered):
    """testing.mock_step(instance, "charge", result=...) is looked up by (instance, step
    name) in Run.attempt (runner.py:785, overrides.step_callable), and a compensation
    attempt is named after the step it undoes (runner.py:360-367): the mock answers for
    the compensation too. A user test that mocks the payment call and cancels to check
    the refund sees the compensation "complete" with the mocked charge as its output,
    and the real refund is never called."""
    wf = saga_workflow("rvc-mocked")
    inst = wf.create(id="mocked-1")
    testing.mock_step("mocked-1", "charge", result="mock-charge")
    testing.run_until_idle()
    assert calls["charge"] == 0  # mocked
    inst.cancel(compensate=True)
    testing.run_until_idle()
    assert inst.status().status == "terminated"
    comp = StepRecord.objects.get(instance=inst.row(), name="charge", kind="compensate")
    assert calls["undo charge"] == 1, (dict(calls), comp.output)
    assert comp.output == "undid mock-charge"


# --- 6. cancel(compensate=True) while a sync step runs: its effect is never undone --------


def test_cancel_with_compensation_during_a_sync_step_compensates_its_effect(registered):
    """The async twin is test_control_races' ...stops_the_running_step_or_compensates_it:
    the abort cancels an async step. A sync step cannot be cancelled: store.cancel
    (store/control.py:1357-1363) clears the run's lease and the "cancel" hint aborts the
    run (worker.py:585), which abandons the thread (runner.py:813). The instance is
    claimed again at once (the lease is gone, whatever Worker._execute does not release,
    worker.py:913), the replay blocks at the un-checkpointed step and compensates only
    what was checkpointed, and ends `terminated`; then the thread's charge lands, its
    result discarded: charged, never refunded. The README's own example (charge_card,
    a sync callable with compensate=refund) hits this whenever a cancel comes mid-charge.
    Fixed: the cancel lets the steps in flight finish and checkpoint (blocking new
    work, Run.start_compensating), then compensates them."""
    started, release, over = threading.Event(), threading.Event(), threading.Event()

    def charge(ctx):
        started.set()
        release.wait(20)  # a payment API call: it does not look at ctx.cancelled
        calls["charged"] += 1
        over.set()
        return "charge-1"

    @register("rvc-cancel-sync")
    class CancelSync(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do(
                "reserve", lambda: "r-1", compensate=lambda o: calls.update(["unreserve"])
            )
            await step.do("charge", charge, compensate=lambda o: calls.update(["refund"]))
            return "done"

    inst = get_workflow("rvc-cancel-sync").create()
    thread, box = run_engine_in_background()
    try:
        assert started.wait(10)
        assert inst.cancel(compensate=True) == "compensating"
    finally:
        release.set()  # the charge goes through after the cancel
        thread.join(40)
    assert over.wait(10)
    assert not thread.is_alive() and "error" not in box, box
    testing.run_until_idle()
    assert inst.status().status == "terminated"
    assert calls == Counter(charged=1, refund=1, unreserve=1), dict(calls)


# --- the races of a cancel that lets the run holding the lease compensate -------------------


@pytest.fixture
def no_compensate_hint(monkeypatch):
    """Workers never hear a "compensate" hint (a lost hint, or one that comes late): the
    run learns of the cancel from the database alone."""
    real = Worker.hint

    def hint(self, kind, pk=None):
        if kind != "compensate":
            real(self, kind, pk)

    monkeypatch.setattr(Worker, "hint", hint)


def test_a_cancel_before_the_run_s_end_is_compensated_by_that_run(registered, no_compensate_hint):
    """The last step cancels its own instance (as a cancel landing between the step and
    the end would): the end, which carries that step's checkpoint, is refused for the
    pending cancel, the checkpoint is written after all, and the run unwinds: the
    step's effect is undone with the others."""

    def charge():
        calls["charged"] += 1
        get_workflow("rvc-end-race").get("end-race").cancel(compensate=True)
        return "c-1"

    @register("rvc-end-race")
    class EndRace(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do(
                "reserve", lambda: "r-1", compensate=lambda o: calls.update(["unreserve"])
            )
            await step.do("charge", charge, compensate=lambda o: calls.update(["refund"]))
            return "done"

    inst = get_workflow("rvc-end-race").create(id="end-race")
    testing.run_until_idle()
    assert inst.status().status == "terminated"
    assert calls == Counter(charged=1, refund=1, unreserve=1), dict(calls)


def test_a_cancel_before_the_run_parks_makes_the_instance_due_at_once(
    registered, no_compensate_hint, monkeypatch
):
    """A cancel that lands after the run's last checkpoint, as it parks for an hour's
    sleep: the park keeps the lease's owner honest (no wake time an hour away for an
    instance that is compensating); the instance is due at once and compensated."""
    real_park = store.park
    cancelled = []

    def park_after_a_cancel(*args, **kwargs):
        if not cancelled:
            cancelled.append(get_workflow("rvc-park-race").get("park-race").cancel(compensate=True))
        return real_park(*args, **kwargs)

    monkeypatch.setattr(store, "park", park_after_a_cancel)

    @register("rvc-park-race")
    class ParkRace(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do(
                "reserve", lambda: "r-1", compensate=lambda o: calls.update(["unreserve"])
            )
            await step.sleep("nap", "1 hour")
            return "done"

    with testing.fake_clock():
        inst = get_workflow("rvc-park-race").create(id="park-race")
        testing.run_until_idle()
        assert cancelled == ["compensating"]
        assert inst.status().status == "terminated"
    assert calls == Counter(unreserve=1), dict(calls)
