"""The end of a sleep or a wait is checkpointed behind the run: the step after it starts at
once, every later write waits for that checkpoint, and a refused one stops the run."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, faults, register
from workflows_app.models import HistoryRecord, InboxEvent, Span, StepRecord

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


def test_a_sleep_that_came_due_while_parked_is_ended_by_the_claim_that_wakes_it(registered):
    # A herd of timers: the claim that wakes the instance checkpoints the sleep's end and
    # writes its sleep.completed record; the run reports it (span, live update) and
    # writes nothing for it.
    @register("claim-sleeper")
    class SleepThenStep(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.sleep("nap", "1 second")

            def after():
                nap = StepRecord.objects.get(instance__instance_id=event.instance_id, name="nap")
                wait_status_seen.append(nap.status)
                return "woke"

            return await step.do("after", after)

    with testing.fake_clock() as clock:
        inst = get_workflow("claim-sleeper").create(id="claimed-sleeper")
        testing.run_until_idle()
        assert inst.status().status == "waiting"
        clock.advance("1 second")
        # Held back 1 s, a checkpoint of the sleep written by the run would not have landed
        # when the step after it looks: the claim's has.
        faults.configure("before_checkpoint=sleep:1@1")
        testing.run_until_idle()
    assert inst.status().output == "woke"
    assert wait_status_seen == ["complete"]  # ended before the step after it ran
    records = list(
        HistoryRecord.objects.filter(instance__instance_id=inst.id)
        .order_by("sequence")
        .values_list("sequence", "type")
    )
    assert [seq for seq, _ in records] == list(range(1, len(records) + 1))
    types = [t for _, t in records]
    second_run = len(types) - types[::-1].index("run.started") - 1
    assert types[second_run : second_run + 3] == ["run.started", "sleep.completed", "step.started"]
    assert types.count("sleep.completed") == 1
    nap = StepRecord.objects.get(instance__instance_id=inst.id, name="nap")
    assert nap.status == "complete" and nap.completed_at is not None
    assert Span.objects.filter(trace_id=inst.row().trace_id, name="sleep nap").count() == 1
    assert inst.row().unproductive_claims == 0


def test_a_sleep_that_comes_due_within_a_run_is_checkpointed_behind_the_step_after_it(
    registered,
):
    seen: list[object] = []

    @register("behind-sleeper")
    class StepSleepStep(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("first", lambda: 1)
            await step.sleep_until("nap", event.payload["at"])

            def after():
                seen.append(
                    StepRecord.objects.filter(instance__instance_id=event.instance_id, name="nap")
                    .values_list("status", flat=True)
                    .first()
                )
                return "woke"

            return await step.do("after", after)

    # Due when the run reaches it: no park, and its checkpoint goes behind the step after it.
    with testing.fake_clock():
        inst = get_workflow("behind-sleeper").create(
            id="sleeper",
            params={"at": 946684800000},  # 2000-01-01: long past
        )
        faults.configure("before_checkpoint=sleep:2@2")
        testing.run_until_idle()
    assert inst.status().output == "woke"
    assert seen == [None]  # the step ran before the sleep's row was written
    types = history(inst.id)
    last_step_started = len(types) - 1 - types[::-1].index("step.started")
    assert types.index("sleep.started") < types.index("sleep.completed") < last_step_started
    assert types[-1] == "instance.completed"


def test_no_step_starts_before_the_checkpoint_of_the_step_before_it_has_landed(registered):
    # Any step after a step, in the same branch or in another one started after it,
    # sees that step's checkpoint stored.
    seen: list[tuple[str, str]] = []

    def stored(instance_id: str, name: str) -> str:
        row = StepRecord.objects.filter(instance__instance_id=instance_id, name=name).first()
        return row.status if row is not None else "absent"

    @register("ordered-branches")
    class StepsInBranches(WorkflowEntrypoint):
        async def run(self, event, step):
            first_done = asyncio.Event()

            async def one():
                await step.do("a", lambda: "a")
                first_done.set()
                await asyncio.sleep(0)  # an await outside any step between the two
                return await step.do(
                    "b", lambda: seen.append(("b", stored(event.instance_id, "a")))
                )

            async def other():
                await first_done.wait()
                return await step.do(
                    "c", lambda: seen.append(("c", stored(event.instance_id, "a")))
                )

            await asyncio.gather(one(), other())
            return "ok"

    inst = get_workflow("ordered-branches").create(id="ordered-branches")
    testing.run_until_idle()
    assert inst.status().status == "complete"
    assert sorted(seen) == [("b", "complete"), ("c", "complete")]


def test_a_claim_ends_no_sleep_of_a_version_its_worker_cannot_run(registered):
    """A worker without the instance's version parks it with a reason; its claim must not
    end the sleep, or the worker that runs it later replays a finished sleep and its span
    is never made. The worker that has the version ends it and reports it once."""
    from workflows_app.engine import registry

    def define(version: int) -> None:
        @register("versioned-sleeper", version=version)
        class Sleeper(WorkflowEntrypoint):
            async def run(self, event, step):
                await step.sleep("nap", "1 second")
                return f"v{version}"

    define(1)
    with testing.fake_clock() as clock:
        inst = get_workflow("versioned-sleeper").create()
        testing.run_until_idle()
        registry.unregister("versioned-sleeper", 1)
        define(2)
        clock.advance("11 seconds")  # the nap's end, and the grace a worker with v1 has
        testing.run_until_idle()
        status = inst.status()
        assert status.status == "waiting" and "not registered" in status.waiting_reason
        nap = StepRecord.objects.get(instance__instance_id=inst.id, name="nap")
        assert nap.status == "waiting"
        assert not HistoryRecord.objects.filter(
            instance__instance_id=inst.id, type="sleep.completed"
        ).exists()
        define(1)  # a deploy brings version 1 back
        testing.run_until_idle()
    assert inst.status().output == "v1"
    types = list(
        HistoryRecord.objects.filter(instance__instance_id=inst.id).values_list("type", flat=True)
    )
    assert types.count("sleep.completed") == 1
    assert Span.objects.filter(trace_id=inst.row().trace_id, name="sleep nap").count() == 1
