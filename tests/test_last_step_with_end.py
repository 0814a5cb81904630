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


def test_a_group_of_ends_is_written_together_each_fenced_by_its_own_lease(registered):
    """write_steps with several ends (the group commit): each end lands or is refused on its
    own lease; a held step, an error record and the history go with their end. On
    PostgreSQL the ends are one statement."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from workflows_app.engine import registry, retention
    from workflows_app.engine.step import new_step_record
    from workflows_app.engine.store import FinishWrite, History, StepWrite
    from workflows_app.models import ErrorRecord, StepKind

    @register("group-ends")
    class GroupEnds(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do("only", counted("only", 1))

    handles = [get_workflow("group-ends").create(id=f"end-{n}") for n in range(5)]
    pks = [h.row().pk for h in handles]
    leases = {pk: token for pk, token, _ in store.claim_and_load("group", 10, 30).runs}
    assert set(leases) == set(pks)
    limits = registry.find_definition("group-ends", 1).limits()
    held = new_step_record("only", StepKind.DO, "complete", 1)
    held.output_json, held.attempts, held.after = "1", 1, ""
    held_history = [History("step.started", {"step": "only"}), History("step.completed", {})]
    checkpoint = new_step_record("only", StepKind.DO, "complete", 1)
    checkpoint.output_json, checkpoint.attempts, checkpoint.after = "4", 1, ""
    writes = [
        FinishWrite(
            pks[0],
            leases[pks[0]],
            "complete",
            limits,
            "1",
            history=[History("instance.completed")],
            step=StepWrite(pks[0], leases[pks[0]], held, held_history, progress=True),
        ),
        FinishWrite(pks[1], leases[pks[1]], "complete", limits, '"plain"'),
        FinishWrite(
            pks[2],
            leases[pks[2]],
            "errored",
            limits,
            error=("Boom", "it broke", ""),
            history=[History("instance.errored", {"error": {"name": "Boom"}})],
            error_record={"workflow": "group-ends", "source": "workflow.instance", "name": "Boom"},
        ),
        FinishWrite(pks[3], "not-its-lease", "complete", limits, '"never"'),
        # A checkpoint in the same group: the group locks every row in instance order.
        StepWrite(pks[4], leases[pks[4]], checkpoint, [History("step.completed", {})]),
    ]
    with CaptureQueriesContext(connection) as queries:
        assert store.write_steps(writes) == [True, True, True, False, "running"]
    statements = [q["sql"] for q in queries.captured_queries]
    if connection.vendor == "postgresql":
        assert sum(sql.startswith("WITH r AS MATERIALIZED") for sql in statements) == 1
    else:  # SQLite: one fenced UPDATE ends them all, and one INSERT writes their history
        assert sum("finished_at" in sql and "json_each" in sql for sql in statements) == 1
        assert sum("INSERT INTO workflows_app_historyrecord" in sql for sql in statements) == 2
    rows = {h.id: h.row() for h in handles}
    assert [rows[f"end-{n}"].status for n in range(4)] == [
        "complete",
        "complete",
        "errored",
        "running",
    ]
    assert rows["end-0"].output == 1 and rows["end-1"].output == "plain"
    assert rows["end-3"].lease_token == leases[pks[3]]  # refused: still its run's
    assert all(rows[f"end-{n}"].lease_token is None for n in range(3))
    for n, status in enumerate(["complete", "complete", "errored"]):  # as a lone end sets it
        kept_for = retention.retention_ms(status, None, None, limits)
        assert (rows[f"end-{n}"].expires_at is not None) == (kept_for > 0)
    assert rows["end-0"].step_seq == 1 and rows["end-0"].unproductive_claims == 0
    only = StepRecord.objects.get(instance_id=pks[0], name="only")
    assert (only.status, only.output, only.attempts) == ("complete", 1, 1)
    assert [t for _, t in history("end-0")] == [
        "instance.created",
        "run.started",
        "step.started",
        "step.completed",
        "instance.completed",
    ]
    assert [t for _, t in history("end-2")] == [
        "instance.created",
        "run.started",
        "instance.errored",
    ]
    assert [t for _, t in history("end-3")] == ["instance.created", "run.started"]
    assert StepRecord.objects.get(instance_id=pks[4], name="only").output == 4
    assert [t for _, t in history("end-4")] == ["instance.created", "run.started", "step.completed"]
    for n in range(5):
        sequences = [seq for seq, _ in history(f"end-{n}")]
        assert sequences == list(range(1, len(sequences) + 1))
    error = ErrorRecord.objects.get(instance_id=pks[2])
    assert (error.name, error.source, error.workflow) == ("Boom", "workflow.instance", "group-ends")
    assert not ErrorRecord.objects.filter(instance_id__in=[pks[0], pks[1], pks[3]]).exists()
