"""Replay of gathered branches: a branch's step that was asked for and never checkpointed
(stopped when a sibling failed, lost with a crashed worker) while a sibling's step after
the same step was, is the workflow's own code, not a change under the instance."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from django.conf import settings

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register, registry
from workflows_app.models import StepRecord


def replay_changed_code_after(clock, span: str) -> None:
    """Advance the clock and run what comes due with code changed under the same version
    (STRICT_VERSIONS off, as a deploy without a version bump)."""
    settings.WFDASH["STRICT_VERSIONS"] = False
    try:
        clock.advance(span)
        testing.run_until_idle()
    finally:
        settings.WFDASH["STRICT_VERSIONS"] = True


pytestmark = pytest.mark.django_db(transaction=True)

calls: Counter[str] = Counter()


@pytest.fixture(autouse=True)
def _reset_calls():
    calls.clear()


def undo_reserve(out):
    calls["undo reserve"] += 1
    if calls["undo reserve"] == 1:
        raise ConnectionError("inventory API down")  # the unwinding parks for its retry
    return "unreserved"


def test_a_branch_stopped_before_its_checkpoint_replays_beside_its_failed_sibling(registered):
    """compensate_on_failure: "check" fails for good while "pay" is still in its step, so
    the run stops "pay" (no checkpoint of "pay") and unwinds; the unwinding parks for a
    retry. Its replay asks for "pay" after "reserve" first (the first gathered branch),
    where "check", a sibling's step, was checkpointed: it was refused as a changed
    workflow (NonDeterminismError) instead of failing again the same way. Under load the
    same came from a sleep's checkpoint refused by the database and stopped in its retry."""

    def pay(ctx):
        calls["pay"] += 1
        ctx.wait_cancelled(30)  # still running when its sibling fails; told to stop
        return "paid"

    @register("sibling-stopped")
    class SiblingStopped(WorkflowEntrypoint):
        compensate_on_failure = True

        async def run(self, event, step):
            await step.do("reserve", lambda: "r-1", compensate=undo_reserve)
            await asyncio.gather(
                step.do("pay", pay),
                step.do("check", lambda: 1 / 0, retries={"limit": 0}),
            )

    with testing.fake_clock() as clock:
        inst = get_workflow("sibling-stopped").create()
        testing.run_until_idle()
        assert inst.status().status == "compensating"
        names = set(StepRecord.objects.filter(instance__instance_id=inst.id, kind="do"))
        assert {r.name for r in names} == {"reserve", "check"}  # "pay" was stopped
        clock.advance("1 hour")
        testing.run_until_idle()
    status = inst.status()
    assert status.status == "errored", status
    assert status.error["name"] == "ZeroDivisionError", status.error
    assert calls == {"pay": 1, "undo reserve": 2}


def test_a_branch_whose_step_was_not_checkpointed_goes_on_after_its_sibling_s(registered):
    """The same without a failure: the replay reaches "a" (new) before the sibling's
    checkpointed "b"; "a" starts once "b" is asked for, and the instance completes."""

    @register("sibling-later")
    class V1(WorkflowEntrypoint):
        async def run(self, event, step):
            async def first():
                # Awaits something else than a step, for good: "a" is not reached before
                # the run parks.
                await asyncio.get_running_loop().create_future()
                return await step.do("a", lambda: calls.update(["a"]) or "a")

            async def second():
                await step.sleep("b", "1 hour")
                return "b"

            return await asyncio.gather(first(), second())

    with testing.fake_clock() as clock:
        inst = get_workflow("sibling-later").create()
        testing.run_until_idle()
        assert inst.status().status == "waiting"
        assert calls == {}
        registry.unregister("sibling-later")

        @register("sibling-later")
        class V1Replayed(WorkflowEntrypoint):
            async def run(self, event, step):
                async def first():  # reaches its step at once this time
                    return await step.do("a", lambda: calls.update(["a"]) or "a")

                async def second():
                    await step.sleep("b", "1 hour")
                    return "b"

                return await asyncio.gather(first(), second())

        replay_changed_code_after(clock, "1 hour")
    status = inst.status()
    assert (status.status, status.output) == ("complete", ["a", "b"]), status
    assert calls == {"a": 1}


def test_a_step_that_replaces_a_checkpointed_one_still_fails_before_it_runs(registered):
    """A new step after a step another checkpoint followed, and no branch asks for that
    checkpoint: the code changed. It fails with a NonDeterminismError, without running."""

    @register("replaced")
    class V1(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("first", lambda: 1)
            await step.sleep("nap", "1 hour")

    with testing.fake_clock() as clock:
        inst = get_workflow("replaced").create()
        testing.run_until_idle()
        registry.unregister("replaced")

        @register("replaced")
        class V2(WorkflowEntrypoint):
            async def run(self, event, step):
                await step.do("first", lambda: 1)
                await asyncio.gather(
                    step.do("new", lambda: calls.update(["new"])),
                    step.do("other", lambda: calls.update(["other"])),
                )

        replay_changed_code_after(clock, "1 hour")
    status = inst.status()
    assert status.status == "errored"
    assert status.error["name"] == "NonDeterminismError", status.error
    assert '"nap"' in status.error["message"]
    assert calls == {}
