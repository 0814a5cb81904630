"""The checkpoint of a step the workflow ends right after is written with the instance's
end (one statement on PostgreSQL, one transaction on SQLite), never losing the step: a
refused end writes the checkpoint on its own, then ends; no step runs twice."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import pytest

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, faults, register, store
from workflows_app.models import HistoryRecord, StepRecord

pytestmark = pytest.mark.django_db(transaction=True)

calls: Counter[str] = Counter()


@pytest.fixture(autouse=True)
def _reset():
    calls.clear()
    yield
    faults.configure("")


def counted(name: str, value: object):
    def fn():
        calls[name] += 1
        return value

    return fn


def history(instance_id: str) -> list[tuple[int, str]]:
    return list(
        HistoryRecord.objects.filter(instance__instance_id=instance_id)
        .order_by("sequence")
        .values_list("sequence", "type")
    )


@pytest.fixture
def two_steps(registered):
    @register("two-steps-then-end")
    class TwoSteps(WorkflowEntrypoint):
        async def run(self, event, step):
            a = await step.do("a", counted("a", 1))
            b = await step.do("b", counted("b", 2))
            return a + b

    return get_workflow("two-steps-then-end")


def test_the_last_step_lands_with_the_end_in_order(two_steps):
    inst = two_steps.create(id="held")
    testing.run_until_idle()
    assert inst.status().output == 3
    assert calls == {"a": 1, "b": 1}
    b = StepRecord.objects.get(instance__instance_id=inst.id, name="b")
    assert (b.status, b.output, b.attempts, b.after) == ("complete", 2, 1, "a")
    records = history(inst.id)
    assert [seq for seq, _ in records] == list(range(1, len(records) + 1))
    types = [t for _, t in records]
    assert types[-3:] == ["step.started", "step.completed", "instance.completed"]
    assert inst.row().step_seq == b.seq


def test_a_refused_end_writes_the_held_checkpoint_alone_then_ends_without_running_it_again(
    two_steps,
):
    # The second checkpoint is step b's, held and sent with the end: the database refuses
    # it (a dropped connection). The run writes b's checkpoint again on its own, then ends.
    faults.configure("before_checkpoint=raise@2")
    inst = two_steps.create(id="refused-end")
    testing.run_until_idle()
    assert inst.status().output == 3
    assert calls == {"a": 1, "b": 1}
    types = [t for _, t in history(inst.id)]
    assert types.count("run.started") == 1
    assert types.count("step.completed") == 2
    assert types[-1] == "instance.completed"


def test_an_error_after_the_last_step_ends_the_instance_with_the_step_stored(registered):
    @register("step-then-raise")
    class StepThenRaise(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("work", counted("work", "done"))
            raise ValueError("after the last step")

    inst = get_workflow("step-then-raise").create(id="raises")
    testing.run_until_idle()
    status = inst.status()
    assert status.status == "errored" and "after the last step" in status.error["message"]
    work = StepRecord.objects.get(instance__instance_id=inst.id, name="work")
    assert (work.status, work.output) == ("complete", "done")
    types = [t for _, t in history(inst.id)]
    assert types[-2:] == ["step.completed", "instance.errored"]


def test_a_step_held_while_the_workflow_awaits_something_else_is_written_meanwhile(
    registered, monkeypatch
):
    # After the step the workflow waits on something of its own (no step, no end in
    # sight): the held checkpoint is written behind at the loop's next turn, not kept
    # for the end. The workflow waits for that write (10 s: only a failure waits so long).
    written = threading.Event()
    original = store.write_steps

    def write_steps(writes):
        results = original(writes)
        if any(isinstance(w, store.StepWrite) and w.step.name == "first" for w in writes):
            written.set()
        return results

    monkeypatch.setattr(store, "write_steps", write_steps)

    @register("step-then-own-await")
    class StepThenOwnAwait(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("first", counted("first", 1))
            return await asyncio.to_thread(written.wait, 10)

    inst = get_workflow("step-then-own-await").create(id="own-await")
    testing.run_until_idle()
    assert inst.status().output is True
    assert calls == {"first": 1}
    assert StepRecord.objects.get(instance__instance_id=inst.id, name="first").status == "complete"
