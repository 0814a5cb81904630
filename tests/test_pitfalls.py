"""PITFALLS.md items 1-20: each a behaviour the reference emulator got wrong."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register, registry, store
from workflows_app.models import HistoryRecord, InboxEvent, Instance, Status, StepRecord

pytestmark = pytest.mark.django_db(transaction=True)
calls: Counter[str] = Counter()
START = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


@pytest.fixture(autouse=True)
def _reset_calls():
    calls.clear()


def test_2_a_retry_backoff_ending_does_not_unpause(registered):
    @register("p2")
    class P2(WorkflowEntrypoint):
        async def run(self, event, step):
            def fails_once():
                calls["attempt"] += 1
                if calls["attempt"] == 1:
                    raise RuntimeError("first")
                return "ok"

            return await step.do("s", fails_once, retries={"limit": 2, "delay": "1 minute"})

    with testing.fake_clock(START) as clock:
        inst = get_workflow("p2").create()
        testing.run_until_idle()
        inst.pause()
        clock.advance("10 minutes")
        assert testing.run_until_idle() == 0
        assert inst.status().status == "paused"
        inst.resume()
        testing.run_until_idle()
    assert inst.status().output == "ok"


def test_3_queued_instances_start_at_worker_start_when_capacity_appears(registered):
    @register("p3", limits={"max_concurrent_instances": 1})
    class P3(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("w", type="go")

    get_workflow("p3").create()
    second = get_workflow("p3").create()
    assert second.status().status == "queued"
    registry.unregister("p3")

    @register("p3", limits={"max_concurrent_instances": 2})  # a deploy raises the limit
    class P3b(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("w", type="go")

    from django.conf import settings

    settings.WFDASH["STRICT_VERSIONS"] = False
    try:
        testing.run_until_idle()  # a worker starts: the queue is re-checked
    finally:
        settings.WFDASH["STRICT_VERSIONS"] = True
    assert second.status().status == "waiting"


def test_4_parallel_waits_on_one_type_and_parallel_sleeps_each_get_their_own(registered):
    @register("p4")
    class P4(WorkflowEntrypoint):
        async def run(self, event, step):
            a, b = await asyncio.gather(
                step.wait_for_event("first", type="vote"),
                step.wait_for_event("second", type="vote"),
            )
            await asyncio.gather(step.sleep("short", "1 minute"), step.sleep("long", "2 minutes"))
            return sorted([a.payload, b.payload])

    with testing.fake_clock(START) as clock:
        inst = get_workflow("p4").create()
        testing.run_until_idle()
        inst.send_event("vote", "yes")
        testing.run_until_idle()
        assert [p.name for p in inst.pending_events()] == ["second"]
        inst.send_event("vote", "no")
        testing.run_until_idle()
        clock.advance("1 minute")
        testing.run_until_idle()
        assert {s.name: s.status for s in inst.steps()}["short"] == "complete"
        assert inst.status().status == "waiting"
        clock.advance("1 minute")
        testing.run_until_idle()
    assert inst.status().output == ["no", "yes"]


def test_5_restart_from_step_uses_start_order_even_within_one_millisecond(registered):
    @register("p5")
    class P5(WorkflowEntrypoint):
        async def run(self, event, step):
            out = []
            for name in ["z", "y", "x", "w"]:
                out.append(await step.do(name, lambda n=name: calls.update([n]) or calls[n]))
            return out

    with testing.fake_clock(START):  # the clock never moves: every step has the same timestamps
        inst = get_workflow("p5").create()
        testing.run_until_idle()
        inst.restart(from_step="y")
        testing.run_until_idle()
    assert inst.status().output == [1, 2, 2, 2]


def test_6_deadlines_survive_a_restart_of_the_engine(registered):
    @register("p6")
    class P6(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.sleep("nap", "1 hour")
            with contextlib.suppress(Exception):
                await step.wait_for_event("w", type="go", timeout="1 hour")
            return "done"

    with testing.fake_clock(START) as clock:
        inst = get_workflow("p6").create()
        testing.run_until_idle()  # worker 1 parks it
        clock.advance("59 minutes")
        assert testing.run_until_idle() == 0  # worker 2 (a fresh one) finds it not due
        clock.advance("1 minute")
        testing.run_until_idle()
        (wait,) = inst.pending_events()
        assert wait.timeout_at == START + timedelta(hours=2)
        clock.advance("1 hour")
        testing.run_until_idle()
    assert inst.status().output == "done"


def test_7_paused_and_queued_instances_survive_a_restart(registered):
    @register("p7", limits={"max_concurrent_instances": 1})
    class P7(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("w", type="go")
            return "ok"

    a, b = get_workflow("p7").create(), get_workflow("p7").create()
    testing.run_until_idle()
    a.pause()
    testing.run_until_idle()
    assert (a.status().status, b.status().status) == ("paused", "queued")
    a.resume()
    a.send_event("go")
    testing.run_until_idle()
    b.send_event("go")
    testing.run_until_idle()
    assert (a.status().output, b.status().output) == ("ok", "ok")


def test_8_events_are_stored_and_consumed_in_the_same_transaction_as_the_checkpoint(registered):
    @register("p8")
    class P8(WorkflowEntrypoint):
        async def run(self, event, step):
            got = await step.wait_for_event("w", type="go")
            return got.payload

    with testing.fake_clock(START):
        inst = get_workflow("p8").create()
        testing.run_until_idle()
        inst.send_event("go", {"n": 1})
        (stored,) = InboxEvent.objects.filter(instance=inst.row())
        assert stored.consumed_at is None
        testing.run_until_idle()
    stored.refresh_from_db()
    step = StepRecord.objects.get(instance=inst.row(), name="w")
    assert stored.consumed_by == "w" and stored.consumed_at == step.completed_at


def test_9_an_attempt_count_beyond_a_lowered_limit_fails_with_the_real_last_error(registered):
    @register("p9")
    class P9(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do("s", lambda: "never runs", retries={"limit": 1})

    inst = get_workflow("p9").create()
    StepRecord.objects.create(
        instance=inst.row(),
        name="s",
        kind="do",
        seq=1,
        status="running",
        attempts=3,
        last_error_name="TimeoutError",
        last_error_message="upstream hung",
        started_at=START,
    )
    testing.run_until_idle()
    assert inst.status().error == {"name": "TimeoutError", "message": "upstream hung"}


def test_12_zero_delay_and_zero_timeout_mean_zero(registered):
    @register("p12")
    class P12(WorkflowEntrypoint):
        async def run(self, event, step):
            def fails_twice():
                calls["n"] += 1
                if calls["n"] < 3:
                    raise RuntimeError("again")
                return calls["n"]

            n = await step.do("retry", fails_twice, retries={"limit": 5, "delay": 0})

            async def takes_a_moment():
                await asyncio.sleep(0.01)

            try:
                await step.do("zero", takes_a_moment, timeout=0, retries={"limit": 0})
            except Exception as exc:
                return [n, type(exc).__name__, str(exc)]

    with testing.fake_clock(START):
        inst = get_workflow("p12").create()
        assert testing.run_until_idle() == 1  # no parking for a zero delay: one run did it all
    n, _name, message = inst.status().output
    assert n == 3
    assert "timed out after 0 ms" in message


def test_14_sizes_are_bytes_of_encoded_json_and_quote_the_configured_limit(registered):
    @register("p14", limits={"max_step_output_bytes": 50})
    class P14(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("accents", lambda: "é" * 24)  # 50 bytes of JSON with its quotes: fits
            await step.do("more", lambda: "é" * 25)  # 52 bytes: too large

    inst = get_workflow("p14").create()
    testing.run_until_idle()
    assert (
        inst.status().error["message"]
        == 'output of step "more" is 52 bytes of JSON; max_step_output_bytes is 50'
    )


def test_16_step_kinds_do_not_collide_by_prefix(registered):
    @register("p16")
    class P16(WorkflowEntrypoint):
        async def run(self, event, step):
            a = await step.do("sleep:x", lambda: "a step")
            await step.sleep("x", 0)
            return a

    inst = get_workflow("p16").create()
    testing.run_until_idle()
    assert inst.status().output == "a step"
    assert {(s.name, s.kind) for s in inst.steps()} == {("sleep:x", "do"), ("x", "sleep")}


def test_17_and_19_retention_prunes_every_row_of_an_instance_and_the_id_can_be_reused(registered):
    @register("p17", limits={"max_retention": "1 day"})
    class P17(WorkflowEntrypoint):
        async def run(self, event, step):
            got = await step.wait_for_event("w", type="go")
            return await step.do("s", lambda: got.payload)

    with testing.fake_clock(START) as clock:
        wf = get_workflow("p17")
        inst = wf.create(id="reused")
        keep = wf.create(id="kept", retention=0)
        short = wf.create(id="short", retention="1 hour")
        testing.run_until_idle()
        for i in (inst, keep, short):
            i.send_event("go", i.id)
        testing.run_until_idle()
        pk = inst.row().pk
        clock.advance("2 hours")
        assert store.prune() == 1  # only "short"
        clock.advance("1 day")
        assert store.prune() == 1  # "reused"; "kept" has retention 0: forever
        assert not Instance.objects.filter(pk=pk).exists()
        for model in (StepRecord, InboxEvent, HistoryRecord):
            assert not model.objects.filter(instance_id=pk).exists()
        again = wf.create(id="reused")
        testing.run_until_idle()
        assert again.status().status == "waiting"  # no old checkpoint leaks into the new one
        assert again.steps()[0].name == "w" and again.steps()[0].status == "waiting"


def test_18_sleeping_and_waiting_show_waiting_and_every_status_string_exists():
    assert set(Status.values) == {
        "queued",
        "running",
        "paused",
        "waiting",
        "waitingForPause",
        "compensating",
        "complete",
        "errored",
        "terminated",
        "unknown",
    }


def test_20_one_clock_for_timestamps_events_and_history(registered):
    @register("p20")
    class P20(WorkflowEntrypoint):
        async def run(self, event, step):
            got = await step.wait_for_event("w", type="go")
            return [event.timestamp.isoformat(), got.timestamp.isoformat()]

    with testing.fake_clock(START) as clock:
        inst = get_workflow("p20").create()
        testing.run_until_idle()
        clock.advance("5 minutes")
        inst.send_event("go")
        testing.run_until_idle()
    assert inst.status().output == [START.isoformat(), (START + timedelta(minutes=5)).isoformat()]
    assert {h.created_at for h in inst.history()} <= {START, START + timedelta(minutes=5)}
