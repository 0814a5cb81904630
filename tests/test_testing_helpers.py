"""workflows_app.testing: the helpers users of wfdash write their workflow tests with."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register
from workflows_app.engine.errors import EventTimeout, InstanceNotFound

pytestmark = pytest.mark.django_db(transaction=True)

REPO = Path(__file__).resolve().parent.parent
calls: Counter[str] = Counter()


@pytest.fixture(autouse=True)
def _reset_calls():
    calls.clear()


def history_types(inst) -> list[str]:
    return [h.type for h in inst.history()]


def test_mock_step_fails_n_times_through_the_retry_loop_then_returns_its_result(registered):
    @register("mocked-charge")
    class MockedCharge(WorkflowEntrypoint):
        async def run(self, event, step):
            def charge():
                calls["charge"] += 1
                return {"real": True}

            return await step.do("charge card", charge, retries={"limit": 5, "delay": 0})

    with_result = get_workflow("mocked-charge").create()
    testing.mock_step(
        with_result.id, "charge card", error=ConnectionError("down"), times=2, result={"mocked": 1}
    )
    real_after = get_workflow("mocked-charge").create()
    testing.mock_step(real_after.id, "charge card", error=ConnectionError("down"), times=2)
    testing.run_until_idle()

    # Two failures, then the mocked result; the real callable never ran for this instance.
    assert with_result.status().status == "complete"
    assert with_result.status().output == {"mocked": 1}
    (record,) = with_result.steps()
    assert record.attempts == 3
    assert record.last_error_name == "ConnectionError"
    failures = [h.data for h in with_result.history() if h.type == "step.failed"]
    assert [(f["attempt"], f["error"]) for f in failures] == [
        (1, {"name": "ConnectionError", "message": "down"}),
        (2, {"name": "ConnectionError", "message": "down"}),
    ]
    # Without result=, the third attempt calls the real callable.
    assert real_after.status().output == {"real": True}
    assert real_after.steps()[0].attempts == 3
    assert calls == {"charge": 1}


def test_mock_step_without_a_result_calls_through_to_a_callable_taking_the_context(registered):
    @register("mocked-ctx")
    class MockedCtx(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do(
                "ctx step", lambda ctx: f"attempt {ctx.attempt}", retries={"limit": 3, "delay": 0}
            )

    inst = get_workflow("mocked-ctx").create()
    testing.mock_step(inst.id, "ctx step", error=ConnectionError("down"), times=1)
    testing.run_until_idle()
    assert inst.status().output == "attempt 2"


def test_force_event_timeout_times_out_only_the_next_wait(registered):
    @register("wait-twice")
    class WaitTwice(WorkflowEntrypoint):
        async def run(self, event, step):
            try:
                await step.wait_for_event("first", type="go", timeout="1 hour")
            except EventTimeout:
                calls["timed out"] += 1
            got = await step.wait_for_event("second", type="go", timeout="1 hour")
            return got.payload

    inst = get_workflow("wait-twice").create()
    testing.force_event_timeout(inst.id, "go")
    testing.run_until_idle()
    assert calls == {"timed out": 1} and inst.status().status == "waiting"  # the second wait parks
    inst.send_event("go", {"n": 2})
    testing.run_until_idle()
    assert inst.status().output == {"n": 2}


def test_disable_sleeps_lets_a_long_sleep_end_in_one_run_for_that_instance_only(registered):
    @register("long-nap")
    class LongNap(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.sleep("nap", "30 days")
            return "awake"

    skipped = get_workflow("long-nap").create()
    kept = get_workflow("long-nap").create()
    testing.disable_sleeps(skipped.id)
    testing.run_until_idle()  # real clock: without the helper, 30 days stay 30 days
    assert skipped.status().status == "complete"
    assert skipped.status().output == "awake"
    assert "sleep.completed" in history_types(skipped)
    assert kept.status().status == "waiting"
    assert "sleep.completed" not in history_types(kept)


def test_disable_sleeps_for_every_instance_also_ends_a_sleep_already_parked(registered):
    @register("parked-nap")
    class ParkedNap(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.sleep("nap", "30 days")
            return "awake"

    inst = get_workflow("parked-nap").create()
    testing.run_until_idle()
    assert inst.status().status == "waiting"  # parked on the sleep
    testing.disable_sleeps()
    assert testing.run_until_idle() == 1
    assert inst.status().status == "complete"
    assert inst.status().output == "awake"


def test_mock_event_delivers_its_payload_to_a_parked_wait(registered):
    @register("awaits-approval")
    class AwaitsApproval(WorkflowEntrypoint):
        async def run(self, event, step):
            got = await step.wait_for_event("approve", type="approval", timeout="1 hour")
            return {"type": got.type, "payload": got.payload}

    inst = get_workflow("awaits-approval").create()
    testing.run_until_idle()
    assert inst.status().status == "waiting"
    testing.mock_event(inst.id, "approval", {"ok": True, "by": "ada"})
    testing.run_until_idle()
    assert inst.status().status == "complete"
    assert inst.status().output == {"type": "approval", "payload": {"ok": True, "by": "ada"}}
    (sent,) = [h for h in inst.history() if h.type == "event.sent"]
    assert sent.actor == "testing"
    with pytest.raises(InstanceNotFound, match="no-such-instance"):
        testing.mock_event("no-such-instance", "approval")


def test_force_event_timeout_times_a_wait_out_with_event_timeout(registered):
    @register("times-out")
    class TimesOut(WorkflowEntrypoint):
        async def run(self, event, step):
            try:
                await step.wait_for_event("approve", type="approval", timeout="1 hour")
            except EventTimeout as exc:
                return f"{type(exc).__name__}: {exc}"
            return "an event came"

    parked = get_workflow("times-out").create()
    testing.run_until_idle()
    assert parked.status().status == "waiting"  # the real timeout is an hour away
    testing.force_event_timeout(parked.id, "approval")
    assert testing.run_until_idle() == 1
    assert parked.status().status == "complete"
    assert parked.status().output.startswith("EventTimeout: ")
    assert "approval" in parked.status().output
    assert "event.timeout" in history_types(parked)

    # Forced before the wait is reached: the wait times out in the first run.
    @register("times-out-uncaught")
    class TimesOutUncaught(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("approve", type="approval", timeout="1 hour")

    early = get_workflow("times-out-uncaught").create()
    testing.force_event_timeout(early.id, "approval")
    testing.run_until_idle()
    assert early.status().status == "errored"
    assert early.status().error["name"] == "EventTimeout"


def test_force_event_timeout_that_raised_for_an_unknown_id_forces_nothing(registered):
    @register("awaits-order")
    class AwaitsOrder(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("approve", type="approval", timeout="1 hour")

    with pytest.raises(InstanceNotFound, match="order-7"):
        testing.force_event_timeout("order-7", "approval")  # not created yet
    inst = get_workflow("awaits-order").create(id="order-7")
    testing.run_until_idle()
    assert inst.status().status == "waiting"  # the refused call did not time this wait out


def test_wait_for_status_runs_the_engine_until_the_status_including_real_timers(registered):
    @register("short-nap")
    class ShortNap(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("before", lambda: "x")
            await step.sleep("short", "200 ms")
            return "done"

    @register("waits")
    class Waits(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("approve", type="approval", timeout="1 hour")

    napper = get_workflow("short-nap").create()
    assert napper.status().status == "running"  # admitted, but nothing runs it but the helper
    # Not only final statuses; the first of several that is reached is returned.
    assert testing.wait_for_status(napper, "errored", "complete") == "complete"
    assert napper.status().output == "done"

    waiter = get_workflow("waits").create()
    assert testing.wait_for_status(waiter, "waiting") == "waiting"


def test_wait_for_status_raises_naming_the_status_it_did_not_reach(registered):
    @register("never-done")
    class NeverDone(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("approve", type="approval", timeout="1 hour")

    inst = get_workflow("never-done").create()
    with pytest.raises(AssertionError, match=r"is 'waiting', not \('complete',\) after 0.3 s"):
        testing.wait_for_status(inst, "complete", timeout=0.3)

    inst.terminate()  # its timer, an hour away, would count as something due
    paused = get_workflow("never-done").create()
    paused.pause()
    with pytest.raises(
        AssertionError, match=r"is 'paused', not \('complete',\), and nothing is due"
    ):
        testing.wait_for_status(paused, "complete", timeout=5)


def test_wait_for_status_refuses_a_status_that_does_not_exist_at_once(registered):
    @register("soon-done")
    class SoonDone(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.sleep("nap", "5 seconds")  # a real timer due within the timeout
            return "done"

    inst = get_workflow("soon-done").create()
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"unknown status\(es\) \['completed'\]; statuses are"):
        testing.wait_for_status(inst, "complete", "completed", timeout=10)
    with pytest.raises(ValueError, match=r"unknown status\(es\) \[\]"):
        testing.wait_for_status(inst)
    assert time.monotonic() - started < 1  # not after waiting for the nap
    assert inst.status().status == "running"  # nothing ran


def test_wait_for_status_under_a_fake_clock_fails_at_once_on_a_timer_it_cannot_reach(registered):
    @register("naps-an-hour")
    class NapsAnHour(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.sleep("nap", "1 hour")
            return "awake"

    inst = get_workflow("naps-an-hour").create()
    started = time.monotonic()
    with testing.fake_clock() as clock:
        with pytest.raises(
            AssertionError,
            match=r"is 'waiting', not \('complete',\); the next timer is due at .* on the "
            r"fake clock, which moves only with clock.advance\(\)",
        ):
            testing.wait_for_status(inst, "complete", timeout=5)
        assert time.monotonic() - started < 4  # not after sleeping out the timeout
        clock.advance("1 hour")
        assert testing.wait_for_status(inst, "complete", timeout=5) == "complete"


def test_wait_for_status_raises_naming_the_status_when_a_step_is_still_running(registered):
    gate = threading.Event()

    @register("slow-step")
    class SlowStep(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do("slow", lambda: gate.wait(30))

    inst = get_workflow("slow-step").create()
    try:
        with pytest.raises(AssertionError, match=r"is 'running', not \('complete',\) after 0.3 s"):
            testing.wait_for_status(inst, "complete", timeout=0.3)
    finally:
        gate.set()  # lets the abandoned step thread end


def test_run_until_idle_times_out_naming_the_instances_and_steps_still_running(registered):
    gate = threading.Event()

    @register("blocks-in-a-thread")
    class BlocksInAThread(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("quick", lambda: 1)
            return await step.do("slow sync", lambda: gate.wait(30))

    @register("awaits-forever")
    class AwaitsForever(WorkflowEntrypoint):
        async def run(self, event, step):
            async def forever():
                await asyncio.sleep(30)

            return await step.do("slow async", forever)

    get_workflow("blocks-in-a-thread").create(id="stuck-1")
    get_workflow("awaits-forever").create(id="stuck-2")
    try:
        with pytest.raises(TimeoutError) as raised:
            testing.run_until_idle(timeout=0.5)
    finally:
        gate.set()  # lets the abandoned step thread end
    assert str(raised.value) == (
        "run_until_idle: not idle after 0.5 s; still running: "
        "awaits-forever 'stuck-2' in step 'slow async'; "
        "blocks-in-a-thread 'stuck-1' in step 'slow sync'"
    )


@pytest.mark.django_db(transaction=False)
def test_run_until_idle_inside_the_tests_transaction_says_to_use_a_transactional_test(
    registered,
):
    """Under plain django_db the instance is uncommitted: the engine would see nothing."""

    @register("in-a-transaction")
    class InATransaction(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do("work", lambda: "done")

    inst = get_workflow("in-a-transaction").create()
    with pytest.raises(RuntimeError, match=r"inside a transaction on database 'default'"):
        testing.run_until_idle()
    with pytest.raises(RuntimeError, match=r"django_db\(transaction=True\)"):
        testing.wait_for_status(inst, "complete")
    assert inst.status().status == "running"


async def test_the_sync_helpers_called_from_an_async_test_name_what_to_await(registered):
    @register("from-async")
    class FromAsync(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do("work", lambda: "done")

    inst = await get_workflow("from-async").acreate()
    with pytest.raises(RuntimeError, match=r"use await testing\.arun_until_idle\(\)$"):
        testing.run_until_idle()
    with pytest.raises(RuntimeError, match=r"wait_for_status is sync .* use await testing"):
        testing.wait_for_status(inst, "complete")
    assert await testing.arun_until_idle() == 1
    assert (await inst.astatus()).output == "done"


def test_step_result_returns_a_completed_steps_output_and_does_not_wait(registered):
    @register("two-steps")
    class TwoSteps(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("first", lambda: {"n": 1, "items": [1, None, "x"]})
            await step.wait_for_event("approve", type="approval", timeout="1 hour")
            await step.do("last", lambda: "end")

    inst = get_workflow("two-steps").create()
    # Not run yet: step_result reports what is checkpointed now, it does not run the engine.
    with pytest.raises(AssertionError, match=r"has no completed step 'first'"):
        testing.step_result(inst, "first")
    testing.run_until_idle()
    assert testing.step_result(inst, "first") == {"n": 1, "items": [1, None, "x"]}
    with pytest.raises(
        AssertionError, match=rf"instance '{inst.id}' has no completed step 'approve'"
    ):
        testing.step_result(inst, "approve")  # still waiting
    with pytest.raises(AssertionError, match=r"has no completed step 'no such step'"):
        testing.step_result(inst, "no such step")


def test_step_result_of_a_failed_or_unknown_step_says_why_there_is_no_result(registered):
    @register("charge-fails")
    class ChargeFails(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("reserve", lambda: "ok")
            await step.do("charge card", lambda: 1 / 0, retries={"limit": 1, "delay": 0})

    inst = get_workflow("charge-fails").create()
    testing.run_until_idle()
    assert inst.status().status == "errored"
    with pytest.raises(AssertionError) as failed:
        testing.step_result(inst, "charge card")
    assert str(failed.value) == (
        f"instance {inst.id!r} has no completed step 'charge card': it is 'failed' after "
        "2 attempt(s), last error ZeroDivisionError: division by zero"
    )
    with pytest.raises(AssertionError) as unknown:
        testing.step_result(inst, "charge")
    assert str(unknown.value) == (
        f"instance {inst.id!r} has no completed step 'charge': no step has that name; "
        "its steps: ['reserve', 'charge card']"
    )


def test_reset_forgets_mocks_disabled_sleeps_and_forced_timeouts(registered):
    @register("all-kinds")
    class AllKinds(WorkflowEntrypoint):
        async def run(self, event, step):
            value = await step.do("work", lambda: "real")
            await step.sleep("nap", "1 hour")
            got = await step.wait_for_event("approve", type="approval", timeout="1 hour")
            return {"value": value, "payload": got.payload}

    inst = get_workflow("all-kinds").create()
    testing.mock_step(inst.id, "work", result="mocked")
    testing.disable_sleeps()
    testing.disable_sleeps(inst.id)
    testing.force_event_timeout(inst.id, "approval")
    testing.reset()

    with testing.fake_clock() as clock:
        testing.run_until_idle()
        assert testing.step_result(inst, "work") == "real"  # the mock is gone
        assert inst.status().status == "waiting"  # the sleep is a real one again
        clock.advance("1 hour")
        testing.run_until_idle()
        assert inst.status().status == "waiting"  # the wait parks: no forced timeout
        assert [p.name for p in inst.pending_events()] == ["approve"]
        inst.send_event("approval", "yes")
        testing.run_until_idle()
    assert inst.status().output == {"value": "real", "payload": "yes"}


def test_the_readme_example_test_passes(registered):
    import workflows_app.demo  # noqa: F401  (registers order-approval when WFDASH_DEMO is off)

    # From README.md, "Testing your workflows", unchanged but for this comment.
    inst = get_workflow("order-approval").create(params={"amount": 30})
    with testing.fake_clock() as clock:  # the engine's clock: timers, timestamps, history
        testing.run_until_idle()  # runs until nothing is runnable now; returns runs made
        assert inst.status().status == "waiting"
        inst.send_event("approval", {"ok": True})
        testing.run_until_idle()  # …now it sleeps "cool-off" for 10 seconds
        clock.advance("10 seconds")
        testing.run_until_idle()
    assert inst.status().status == "complete"
    assert testing.step_result(inst, "ship order")["tracking"].startswith("TRK-")


def test_the_pytest_plugin_forgets_one_tests_mocks_before_the_next(tmp_path):
    """A user's suite has no conftest resetting the helpers: installing wfdash's plugin
    (entry point pytest11) is what keeps a mock keyed by a reused instance id, or a
    disable_sleeps() for every instance, from reaching later tests."""
    from importlib.metadata import entry_points

    # Installed (the README's test command installs wfdash first): pytest loads it itself.
    installed = {e.name: e.value for e in entry_points(group="pytest11")}
    assert installed.get("wfdash") == "workflows_app.pytest_plugin"

    (tmp_path / "test_users_suite.py").write_text(
        "from workflows_app import testing\n"
        "from workflows_app.engine.overrides import overrides\n"
        "\n"
        "def test_one_mocks_a_step_of_order_1():\n"
        "    testing.mock_step('order-1', 'charge card', result={'mocked': True})\n"
        "\n"
        "def test_two_finds_no_mock_left():\n"
        "    assert not overrides.step_mocks\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "DJANGO_SETTINGS_MODULE": "wfdash.settings"}
    suite = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert suite.returncode == 0, suite.stdout + suite.stderr
    assert "2 passed" in suite.stdout
