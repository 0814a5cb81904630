"""The end of a sleep or a wait is checkpointed behind the run: the step after it starts at
once, every later write waits for that checkpoint, and a refused one stops the run."""

from __future__ import annotations

from collections import Counter

import pytest

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, faults, register
from workflows_app.models import HistoryRecord, InboxEvent, StepRecord

pytestmark = pytest.mark.django_db(transaction=True)

calls: Counter[str] = Counter()
wait_status_seen: list[str] = []


@pytest.fixture(autouse=True)
def _reset():
    calls.clear()
    wait_status_seen.clear()
    yield
    faults.configure("")


@pytest.fixture
def waiter(registered):
    @register("behind-waiter")
    class WaitThenStep(WorkflowEntrypoint):
        async def run(self, event, step):
            got = await step.wait_for_event("approval", type="go")

            def after():
                calls["after"] += 1
                wait = StepRecord.objects.get(
                    instance__instance_id=event.instance_id, name="approval"
                )
                wait_status_seen.append(wait.status)
                return got.payload["n"]

            return await step.do("after", after)

    inst = get_workflow("behind-waiter").create(id="behind")
    testing.run_until_idle()
    assert inst.status().status == "waiting"
    return inst


def history(instance_id: str) -> list[str]:
    return list(
        HistoryRecord.objects.filter(instance__instance_id=instance_id)
        .order_by("sequence")
        .values_list("type", flat=True)
    )


def test_the_step_after_a_wait_starts_while_the_wait_is_checkpointed_and_lands_after_it(waiter):
    # The wait's checkpoint (the run's first) is held for 2 s inside its transaction: the
    # step after the wait has run meanwhile, and its own checkpoint waited for the wait's.
    faults.configure("before_checkpoint=sleep:2@1")
    waiter.send_event("go", {"n": 7})
    testing.run_until_idle()
    assert waiter.status().output == 7
    assert wait_status_seen == ["waiting"]  # the step ran before the wait's row changed
    assert calls["after"] == 1
    types = history(waiter.id)
    assert types.index("event.received") < types.index("step.started")
    assert types[-1] == "instance.completed"
    assert InboxEvent.objects.get(instance__instance_id=waiter.id).consumed_at is not None


def test_a_wait_whose_checkpoint_is_refused_stops_the_run_and_the_next_delivers_the_event_once(
    waiter, monkeypatch
):
    from workflows_app.engine import runner

    monkeypatch.setattr(runner, "WRITE_RETRY_DELAYS", (0.01, 0.01))  # two retries, then give up
    # Every try of the wait's checkpoint fails: the step after it ran (at least once, as
    # after any crash mid-step), but nothing of that run is stored; the next run replays
    # the wait, takes the same event and completes.
    faults.configure("before_checkpoint=raise@1-3")
    waiter.send_event("go", {"n": 3})
    testing.run_until_idle()
    assert waiter.status().output == 3
    assert 1 <= calls["after"] <= 2
    types = history(waiter.id)
    assert types.count("event.received") == 1
    assert types.count("step.completed") == 1
    assert types.count("run.started") == 3  # the first run, the cut one, the one that ended
    sequences = list(
        HistoryRecord.objects.filter(instance__instance_id=waiter.id).values_list(
            "sequence", flat=True
        )
    )
    assert sorted(sequences) == list(range(1, len(sequences) + 1))
    event = InboxEvent.objects.get(instance__instance_id=waiter.id)
    assert event.consumed_at is not None
    wait = StepRecord.objects.get(instance__instance_id=waiter.id, name="approval")
    assert (wait.status, wait.output["payload"]) == ("complete", {"n": 3})


def test_a_sleep_that_ended_is_checkpointed_behind_the_step_after_it(registered):
    @register("behind-sleeper")
    class SleepThenStep(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.sleep("nap", "1 second")

            def after():
                nap = StepRecord.objects.get(instance__instance_id=event.instance_id, name="nap")
                wait_status_seen.append(nap.status)
                return "woke"

            return await step.do("after", after)

    with testing.fake_clock() as clock:
        inst = get_workflow("behind-sleeper").create(id="sleeper")
        testing.run_until_idle()
        assert inst.status().status == "waiting"
        clock.advance("1 second")
        faults.configure("before_checkpoint=sleep:2@1")
        testing.run_until_idle()
    assert inst.status().output == "woke"
    assert wait_status_seen == ["waiting"]
    types = history(inst.id)
    assert types.index("sleep.completed") < types.index("step.started")
