"""Flow control under everyday operations: found in a review of admission (SPEC §8)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register
from workflows_app.models import Instance

pytestmark = pytest.mark.django_db(transaction=True)


def statuses(insts) -> list[str]:
    return [i.status().status for i in insts]


def register_gated_version(name: str, version: int, **limits) -> None:
    """A workflow version that holds its place until it gets a "go" event."""

    @register(name, version=version, limits=limits)
    class Gated(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("go", type="go", timeout="1 day")
            return version


def test_a_rollout_that_adds_a_limit_holds_the_old_version_s_instances_to_it(registered):
    """v1 ran without flow control; v2 adds max_concurrent_instances=1. The queue is the
    workflow's (every version's instances hold places), so its admission follows the
    workflow's current limits: a worker's start must not admit v2's queue under v1's
    "no limit", a create of v1 must not skip it, and v1's end must start the next."""
    register_gated_version("rollout", 1)
    wf = get_workflow("rollout")
    old = wf.create(id="old", version=1)
    register_gated_version("rollout", 2, max_concurrent_instances=1)
    new = wf.create(id="new")
    assert statuses([old, new]) == ["running", "queued"]
    testing.run_until_idle()  # a worker starts: the queue stays behind the one place
    assert statuses([old, new]) == ["waiting", "queued"]
    pinned = wf.create(id="pinned", version=1)  # an explicit old version queues too
    assert pinned.status().status == "queued"
    old.send_event("go")
    testing.run_until_idle()  # v1's end frees the place: the next in line starts at once
    assert statuses([old, new, pinned]) == ["complete", "waiting", "queued"]


def test_a_debounced_create_behind_a_full_queue_keeps_its_debounce(registered):
    """A debounced instance created while the queue is full is not reached by the
    admission pass: it must keep its "not before", not take the full queue's reason (whose
    admit_at is none), or it starts as soon as a place frees, before its debounce ends."""
    register_gated_version("debounce-full", 1, max_concurrent_instances=1)
    wf = get_workflow("debounce-full")
    with testing.fake_clock() as clock:
        holder = wf.create(id="holder")
        waiting = wf.create(id="waiting")
        late = wf.create(id="late", debounce_key="k", debounce="10 seconds")
        assert statuses([holder, waiting, late]) == ["running", "queued", "queued"]
        assert late.status().waiting_reason.startswith("debounced until ")
        assert late.row().admit_at == clock.now() + timedelta(seconds=10)
        testing.run_until_idle()
        holder.send_event("go")
        testing.run_until_idle()
        waiting.send_event("go")
        testing.run_until_idle()  # the place is free, but the debounce has 10 s to go
        assert statuses([holder, waiting, late]) == ["complete", "complete", "queued"]
        clock.advance("10 seconds")
        testing.run_until_idle()
        assert late.status().status == "waiting"


def test_a_debounce_after_a_rollout_runs_the_pending_instance_on_the_new_version(registered):
    """An instance debounced before a deploy has not started: a create of the new version
    with its key gives it the new version's params, so it must run the new version's code
    (the one the create asked for), not the old code on params shaped for the new one."""

    def register_echo(version: int) -> None:
        @register("debounce-rollout", version=version)
        class Echo(WorkflowEntrypoint):
            async def run(self, event, step):
                return {"version": version, "params": event.payload}

    register_echo(1)
    wf = get_workflow("debounce-rollout")
    with testing.fake_clock() as clock:
        first = wf.create(params={"old": 1}, debounce_key="k", debounce="5 seconds")
        register_echo(2)
        again = wf.create(params={"new": 2}, debounce_key="k", debounce="5 seconds")
        assert (again.id, again.created) == (first.id, False)
        assert again.row().version == 2
        clock.advance("5 seconds")
        testing.run_until_idle()
        assert first.status().output == {"version": 2, "params": {"new": 2}}


def test_a_debounce_that_ends_behind_a_thousand_pending_ones_starts(registered):
    """Debounce per user is the everyday use: many instances wait for their debounce at
    once. One whose debounce ended behind a thousand still pending ones (more than an
    admission pass reads) must start, not be told that max_concurrent_instances (there
    is none) is reached and never be looked at again."""
    from workflows_app.engine.store import control

    @register("debounce-many")
    class Quick(WorkflowEntrypoint):
        async def run(self, event, step):
            return event.payload

    wf = get_workflow("debounce-many")
    with testing.fake_clock() as clock:
        for batch in range(control.ADMISSION_SCAN // 100):
            wf.create_batch(
                [
                    {"debounce_key": f"user-{batch}-{n}", "debounce": "1 hour", "params": n}
                    for n in range(100)
                ]
            )
        late = wf.create(params="late", debounce_key="late", debounce="1 second")
        clock.advance("2 seconds")
        testing.run_until_idle()
        assert late.status().status == "complete", late.status().waiting_reason


def test_max_concurrent_instances_refuses_a_boolean_as_its_sibling_limits_do():
    """True is an int to Python: it passed as a bound of one ("max_concurrent_instances
    (True) reached"), where max_concurrent_per_key and rate_limit refuse it."""
    from workflows_app.engine.errors import InvalidInput
    from workflows_app.engine.limits import Limits

    for bad in (True, False):
        with pytest.raises(InvalidInput, match="max_concurrent_instances must be a positive"):
            Limits.build({"max_concurrent_instances": bad})
    assert Limits.build({"max_concurrent_instances": 3}).max_concurrent_instances == 3


def test_an_instance_beyond_the_admission_scan_is_not_told_a_limit_the_workflow_lacks(registered):
    """A rate-limited workflow with a backlog longer than one admission pass reads: the
    instances past it wait for their turn, not for max_concurrent_instances, which this
    workflow does not have (the reason read "max_concurrent_instances (None) reached")."""
    from workflows_app.engine.store import control

    register_gated_version("rated-backlog", 1, rate_limit={"limit": 1, "period": "1 hour"})
    wf = get_workflow("rated-backlog")
    with testing.fake_clock():
        for _ in range(control.ADMISSION_SCAN // 100 + 1):
            wf.create_batch([{"params": n} for n in range(100)])
        tail = wf.create(id="tail")
        reason = tail.status().waiting_reason
        assert tail.status().status == "queued"
        assert "max_concurrent_instances" not in reason, reason
        assert reason, "a queued instance says why it waits"


def test_a_long_concurrency_key_of_odd_characters_queues_with_a_reason_that_fits(registered):
    """A key of 200 zero-width spaces is accepted (1-200 characters), but the reason its
    instances wait quoted it whole, by repr(): 1,245 characters, past the 500 of the
    waiting_reason column. PostgreSQL refused the admission's write: the create failed
    with a DataError (a 500 at the API) whenever the key's places were all taken."""
    register_gated_version("odd-key", 1, max_concurrent_per_key=1)
    wf = get_workflow("odd-key")
    key = "\u200b" * 200
    first = wf.create(id="first", concurrency_key=key)
    second = wf.create(id="second", concurrency_key=key)
    assert statuses([first, second]) == ["running", "queued"]
    reason = second.status().waiting_reason
    assert reason.startswith("max_concurrent_per_key (1) reached for key '\\u200b")
    assert len(reason) <= Instance._meta.get_field("waiting_reason").max_length
    testing.run_until_idle()
    first.send_event("go")
    testing.run_until_idle()
    assert statuses([first, second]) == ["complete", "waiting"]


def test_a_debounce_merge_takes_the_concurrency_key_of_the_newest_create(registered):
    """The pending instance takes the newest create's params (and attributes, priority,
    version): its concurrency key too. Kept, the instance ran the params of a create for
    key B under key A, beside another instance of B, past max_concurrent_per_key=1."""
    register_gated_version("debounce-key-moves", 1, max_concurrent_per_key=1)
    wf = get_workflow("debounce-key-moves")
    with testing.fake_clock() as clock:
        busy = wf.create(id="busy", concurrency_key="B")
        pending = wf.create(id="pending", concurrency_key="A", debounce_key="d", debounce="1 s")
        merged = wf.create(
            params={"for": "B"}, concurrency_key="B", debounce_key="d", debounce="1 s"
        )
        assert (merged.id, merged.created) == (pending.id, False)
        assert merged.row().concurrency_key == "B"
        assert merged.history()[-1].data["concurrency_key"] == "B"
        clock.advance("2 seconds")
        testing.run_until_idle()
        assert statuses([busy, merged]) == ["waiting", "queued"]
        assert merged.status().waiting_reason == "max_concurrent_per_key (1) reached for key 'B'"
        busy.send_event("go")
        testing.run_until_idle()
        assert statuses([busy, merged]) == ["complete", "waiting"]


def test_a_debounce_merge_takes_the_retention_of_the_newest_create(registered):
    """A create merged into a pending instance asked for its retention: the instance
    that ran its params kept the first create's (none here: kept for ever)."""
    register_gated_version("debounce-retention", 1)
    wf = get_workflow("debounce-retention")
    with testing.fake_clock() as clock:
        pending = wf.create(id="pending", debounce_key="d", debounce="1 s")
        merged = wf.create(debounce_key="d", debounce="1 s", retention={"success": "7 days"})
        assert (merged.id, merged.created) == (pending.id, False)
        clock.advance("2 seconds")
        testing.run_until_idle()
        merged.send_event("go")
        testing.run_until_idle()
        row = merged.row()
        assert row.status == "complete"
        assert row.expires_at == row.finished_at + timedelta(days=7)
