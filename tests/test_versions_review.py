"""Review: versioning, history, replay determinism, restart and child workflows.

Each test is a bug a user hits on the current code; its docstring says what goes wrong and
where. Real engine and database, the fake clock, run_until_idle.
"""

from __future__ import annotations

import pytest

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import ChildWorkflowFailed, WorkflowEntrypoint, register
from workflows_app.engine.errors import NonDeterminismError, NonRetryableError

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def lax_versions(settings, registered):
    settings.WFDASH = {**settings.WFDASH, "STRICT_VERSIONS": False}


def define_ship_and_order() -> None:
    @register("rv-ship")
    class Ship(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("dispatched", type="dispatched", timeout="1 day")
            return {"shipped": event.payload["order"]}

    @register("rv-order")
    class Order(WorkflowEntrypoint):
        async def run(self, event, step):
            try:
                shipped = await step.invoke("ship", "rv-ship", params=event.payload)
            except ChildWorkflowFailed as exc:
                return {"failed": exc.error_name}
            return {"shipped": shipped}


# --- 1. a child's output under a payload codec ---------------------------------------------


def test_invoke_returns_the_child_output_not_its_sealed_envelope_under_a_payload_codec(
    registered, settings
):
    """With WFDASH["PAYLOAD_CODEC"] set, a child's output_json is stored sealed
    ({"$codec": "..."}). Step._child_finished (workflows_app/engine/step.py:790-795) copies
    that text into the invoke checkpoint and returns json.loads(record.output_json): the
    first run of the parent gets the envelope dict, not the child's output (a replay gets
    the real value through StepRecord.output, so the value also changes between runs)."""
    settings.WFDASH = {**settings.WFDASH, "PAYLOAD_CODEC": "tests.codecs.FernetCodec"}
    got: list[object] = []

    @register("rv-enc-child")
    class Child(WorkflowEntrypoint):
        async def run(self, event, step):
            return {"n": 42}

    @register("rv-enc-parent")
    class Parent(WorkflowEntrypoint):
        async def run(self, event, step):
            out = await step.invoke("kid", "rv-enc-child")
            got.append(out)
            return out

    parent = get_workflow("rv-enc-parent").create(id="enc")
    testing.run_until_idle()
    testing.run_until_idle()
    assert parent.status().status == "complete"
    assert got == [{"n": 42}], got  # got [{"$codec": "gAAAA..."}]
    assert parent.status().output == {"n": 42}


# --- 2. restart of a parent whose terminate ended its children -------------------------------


def test_restarting_a_terminated_parent_does_not_reuse_the_child_its_terminate_killed(
    registered,
):
    """terminate(parent) terminates the unfinished child (store/control.py:1022
    _terminate_children). restart(parent) (store/control.py:1045) drops the parent's
    checkpoints but leaves the child terminated; the replayed step.invoke finds it again
    (store/control.py:533-537, _existing looks the child up by parent step whatever its
    status) and raises ChildWorkflowFailed("WorkflowTerminated") at once. A restart of a
    terminated parent can therefore never succeed: the operator who restarts it expects the
    flow (its child included) to run again."""
    define_ship_and_order()
    parent = get_workflow("rv-order").create(id="p1", params={"order": 7})
    testing.run_until_idle()
    (child,) = parent.children()
    assert parent.terminate() is True
    assert child.status().status == "terminated"

    parent.restart()
    testing.run_until_idle()
    # Currently: parent complete with {"failed": "WorkflowTerminated"}, child still terminated.
    assert parent.status().status == "waiting", parent.status()
    (child,) = parent.children()
    assert child.status().status == "waiting"
    child.send_event("dispatched")
    testing.run_until_idle()
    assert parent.status().output == {"shipped": {"shipped": 7}}


def test_restarting_a_terminated_parent_revives_a_started_child_its_terminate_killed(
    registered,
):
    """The same for step.start (store/control.py:533-537): the replay returns the id of the
    child the parent's own terminate ended, the parent carries on and completes, and the
    child's work silently never happens."""

    @register("rv-audit")
    class Audit(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("go", type="go", timeout="1 day")
            return "audited"

    @register("rv-auditor")
    class Auditor(WorkflowEntrypoint):
        async def run(self, event, step):
            child_id = await step.start("audit", "rv-audit")
            await step.wait_for_event("done", type="done", timeout="1 day")
            return child_id

    parent = get_workflow("rv-auditor").create(id="a1")
    testing.run_until_idle()
    (child,) = parent.children()
    parent.terminate()
    assert child.status().status == "terminated"
    parent.restart()
    testing.run_until_idle()
    assert parent.status().status == "waiting"
    # Currently the child stays terminated while the restarted parent runs on.
    assert child.status().status == "waiting", child.status()


# --- 3. a stale wake time on a parent's invoke step ------------------------------------------

FAIL_CHILD = {"on": True}


def test_a_parent_does_not_spin_after_its_failed_child_was_restarted(registered):
    """A child's end sets wake_at=now on the parent's waiting invoke step
    (store/records.py:197 wake_parent). The parent is paused, so it does not run then.
    The operator restarts the child (it runs again and waits). When the parent resumes,
    Step.invoke (engine/step.py:692-694) sees the child live and blocks, but nothing clears
    the step's wake_at, and park reads the instance's wake time from it
    (store/runs.py:855 park, :962 PARK_SQL: MIN(wake_at) of waiting steps): the parent parks due
    at once, is claimed, replays and parks again, over and over, until the child ends."""

    @register("rv-flaky")
    class Flaky(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("go", type="go", timeout="1 day")

            def work():
                if FAIL_CHILD["on"]:
                    raise NonRetryableError("boom", "Boom")
                return "ok"

            return await step.do("work", work)

    @register("rv-waiter")
    class Waiter(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.invoke("kid", "rv-flaky")

    FAIL_CHILD["on"] = True
    with testing.fake_clock():
        parent = get_workflow("rv-waiter").create(id="w1")
        testing.run_until_idle()
        (child,) = parent.children()
        parent.pause()
        child.send_event("go")
        testing.run_until_idle()
        assert child.status().status == "errored"
        assert parent.status().status == "paused"
        FAIL_CHILD["on"] = False
        child.restart()
        testing.run_until_idle()
        assert child.status().status == "waiting"
        parent.resume()
        runs_before = parent.row().run_count
        try:
            testing.run_until_idle(timeout=3)
            idle = True
        except TimeoutError:  # the parent never stopped being runnable
            idle = False
        row = parent.row()
        # Currently: never idle, wake_at stays at "now", hundreds of runs of the parent.
        spun = row.run_count - runs_before
        assert idle and row.wake_at is None and spun <= 2, (idle, row.wake_at, spun)
        assert row.status == "waiting"
        child.send_event("go")
        testing.run_until_idle()
        assert parent.status().output == "ok"


# --- 4. replay: a removed last step ----------------------------------------------------------


def test_removing_the_step_an_instance_is_parked_at_fails_it_with_non_determinism(
    lax_versions,
):
    """README ("Replay notices a changed workflow ... a renamed, added, removed or
    reordered step is caught"). Removing the *last* steps is not: v1 did "charge", then
    parked at the wait "approval"; the new code returns right after "charge". Replay asks
    for no step after "charge", so Run._check_determinism (engine/runner.py:583) is
    never called for it, and Run._conclude (engine/runner.py:392) completes the instance
    without noticing the checkpoint "approval" that followed "charge" was never asked for:
    the waiting instance silently completes, skipping the approval it was parked at."""

    @register("rv-removed")
    class V1(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("charge", lambda: "charged")
            await step.wait_for_event("approval", type="approve", timeout="1 day")
            return await step.do("ship", lambda: "shipped")

    inst = get_workflow("rv-removed").create(id="r1")
    testing.run_until_idle()
    assert inst.status().status == "waiting"

    @register("rv-removed")
    class Changed(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do("charge", lambda: "charged")

    inst.send_event("approve")  # makes it run again on the changed code
    testing.run_until_idle()
    status = inst.status()
    # Currently: complete with output "charged".
    assert status.status == "errored", status
    assert status.error["name"] == NonDeterminismError.__name__
    assert "approval" in status.error["message"]


def test_lax_versions_say_in_one_line_what_they_replaced(lax_versions, caplog):
    """WFDASH_STRICT_VERSIONS=0 replaced a stored version's code with the code a deploy
    brought, and a registration's in this process, without a word: the unfinished
    instances of that version replayed on other code, and nothing in the log said so.
    Each replacement now logs one warning naming the workflow, the version and the hashes."""
    import logging

    from workflows_app.engine.worker import sync_catalog
    from workflows_app.models import WorkflowVersion

    @register("rv-lax")
    class First(WorkflowEntrypoint):
        async def run(self, event, step):
            return 1

    sync_catalog()
    WorkflowVersion.objects.filter(name="rv-lax").update(source_hash="0" * 64)
    with caplog.at_level(logging.WARNING, logger="workflows_app.engine"):
        sync_catalog()  # a deploy's code against the stored row: replaced, said so
        sync_catalog()  # the same code again: nothing more to say

        @register("rv-lax")
        class Second(WorkflowEntrypoint):
            async def run(self, event, step):
                return 2

    said = [r.getMessage() for r in caplog.records if "rv-lax" in r.getMessage()]
    assert len(said) == 2, said
    assert said[0].startswith(
        """WFDASH["STRICT_VERSIONS"] is off: workflow 'rv-lax' version 1 now runs this code"""
    ), said[0]
    assert "stored 000000000000" in said[0] and "\n" not in said[0]
    assert "registered again in this process" in said[1] and "Second replaces" in said[1]
    assert WorkflowVersion.objects.get(name="rv-lax").source_hash != "0" * 64
