"""rate_limit counts starts, not the instances that are still there (SPEC §8: "starts at
most `limit` instances per period"): deleting or pruning an instance that started in the
window gives no start back, and a restart that starts an instance again is a start."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connections

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register, store
from workflows_app.models import Instance, RateLimitStart

pytestmark = pytest.mark.django_db(transaction=True)


def statuses(insts) -> list[str]:
    return [i.status().status for i in insts]


def register_gated(name: str, **limits) -> None:
    """A workflow that holds its place until it gets a "go" event."""

    @register(name, limits=limits)
    class Gated(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("go", type="go", timeout="1 day")
            return "done"


def finish(insts) -> None:
    testing.run_until_idle()
    for inst in insts:
        inst.send_event("go")
    testing.run_until_idle()
    assert statuses(insts) == ["complete"] * len(insts)


def test_deleting_instances_that_started_in_the_window_gives_no_start_back(registered):
    register_gated("rated-delete", rate_limit={"limit": 2, "period": "1 hour"})
    wf = get_workflow("rated-delete")
    with testing.fake_clock() as clock:
        first = [wf.create(id="a"), wf.create(id="b")]
        finish(first)
        clock.advance("1 minute")
        wf.delete_batch(["a", "b"])
        later = [wf.create(id="c"), wf.create(id="d")]
        assert statuses(later) == ["queued", "queued"]
        assert later[0].status().waiting_reason.startswith("rate_limit (2 per 1 hour) reached")
        testing.run_until_idle()
        assert statuses(later) == ["queued", "queued"]
        clock.advance("59 minutes")  # the window of the deleted ones' starts ends
        testing.run_until_idle()
        assert statuses(later) == ["waiting", "waiting"]


def test_pruning_instances_that_started_in_the_window_gives_no_start_back(registered):
    register_gated("rated-prune", rate_limit={"limit": 2, "period": "1 hour"})
    wf = get_workflow("rated-prune")
    with testing.fake_clock() as clock:
        first = [wf.create(id=f"p{n}", retention="1 second") for n in range(2)]
        finish(first)
        clock.advance("10 seconds")
        assert store.prune() == 2
        late = wf.create(id="late")
        assert late.status().status == "queued"
        clock.advance("1 hour")
        testing.run_until_idle()
        assert late.status().status == "waiting"


def test_restarting_a_finished_instance_is_a_start(registered):
    """Its earlier start stays counted too: the restart used to set started_at anew, so
    the count of instance rows saw one start where there were two."""
    register_gated("rated-restart", rate_limit={"limit": 2, "period": "1 hour"})
    wf = get_workflow("rated-restart")
    with testing.fake_clock() as clock:
        once = wf.create(id="once")
        finish([once])
        clock.advance("1 minute")
        assert once.restart() == "running"  # the second start of the hour
        other = wf.create(id="other")
        assert other.status().status == "queued"
        finish([once])
        assert once.restart() == "queued"  # a third start must wait for the window too
        assert other.status().status == "queued"
        clock.advance("59 minutes")  # the first start leaves the window: one place
        testing.run_until_idle()
        assert statuses([once, other]) == ["waiting", "queued"]


def test_the_start_log_keeps_only_the_window_and_only_for_rate_limited_workflows(registered):
    register_gated("rated-log", rate_limit={"limit": 3, "period": "10 seconds"})
    register_gated("unrated-log", max_concurrent_instances=5)
    rated, unrated = get_workflow("rated-log"), get_workflow("unrated-log")
    with testing.fake_clock() as clock:
        for n in range(5):
            rated.create(id=f"r{n}")
            unrated.create(id=f"u{n}")
            clock.advance("11 seconds")
        # Each admission dropped the starts its window no longer holds: only the last is left.
        logged = list(RateLimitStart.objects.values_list("workflow", "started_at"))
        assert logged == [("rated-log", clock.now() - timedelta(seconds=11))]


def test_creates_racing_in_several_connections_start_limit_and_log_each_start_once(registered):
    """Several sessions admit at once (a fleet's creates): the admission lock of the
    workflow serialises their count and their log rows, so exactly `limit` start."""
    register_gated("rated-race", rate_limit={"limit": 5, "period": "1 hour"})
    wf = get_workflow("rated-race")
    sessions, each = 4, 6
    ready = threading.Barrier(sessions)
    errors: list[BaseException] = []

    def create(session: int) -> None:
        try:
            ready.wait(30)
            for n in range(each):
                wf.create(id=f"s{session}-{n}")
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    with testing.fake_clock():  # one instant: every start is in the window
        threads = [threading.Thread(target=create, args=(s,)) for s in range(sessions)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors, errors
        rows = Instance.objects.filter(workflow="rated-race")
        assert rows.count() == sessions * each
        assert rows.filter(status="running").count() == 5
        assert RateLimitStart.objects.filter(workflow="rated-race").count() == 5


def test_restarting_a_live_instance_is_a_start_and_waits_for_the_window(registered):
    """A live instance's restart kept its place and ran again at once, counted nowhere:
    restarts of waiting instances started any number per period."""
    register_gated("rated-live-restart", rate_limit={"limit": 2, "period": "1 hour"})
    wf = get_workflow("rated-live-restart")
    with testing.fake_clock() as clock:
        live = wf.create(id="live")
        testing.run_until_idle()
        assert live.status().status == "waiting"
        assert live.restart() == "running"  # the second start of the hour
        assert RateLimitStart.objects.filter(workflow="rated-live-restart").count() == 2
        testing.run_until_idle()
        assert live.restart() == "queued"  # a third start waits for the window
        status = live.status()
        assert status.status == "queued"
        assert status.waiting_reason.startswith("rate_limit (2 per 1 hour) reached")
        other = wf.create(id="other")
        assert other.status().status == "queued"
        clock.advance("1 hour")  # both starts leave the window
        testing.run_until_idle()
        assert statuses([live, other]) == ["waiting", "waiting"]
        finish([live, other])


def test_starts_from_before_the_log_existed_count_in_the_first_window(registered):
    """An upgrade to the start log found it empty: the instances that started in the
    window before it counted for nothing, and `limit` more started at once."""
    register_gated("rated-upgrade", rate_limit={"limit": 2, "period": "1 hour"})
    wf = get_workflow("rated-upgrade")
    with testing.fake_clock() as clock:
        before = [wf.create(id="a"), wf.create(id="b")]
        testing.run_until_idle()
        RateLimitStart.objects.all().delete()  # as they were before the log existed
        clock.advance("30 minutes")
        after = wf.create(id="c")
        status = after.status()
        assert status.status == "queued"
        assert status.waiting_reason.startswith("rate_limit (2 per 1 hour) reached")
        clock.advance("30 minutes")  # a and b leave the window
        testing.run_until_idle()
        assert after.status().status == "waiting"
        finish([*before, after])


def test_an_empty_start_log_is_seeded_once_and_counts_no_start_outside_the_window(registered):
    register_gated("rated-seed", rate_limit={"limit": 1, "period": "1 minute"})
    wf = get_workflow("rated-seed")
    with testing.fake_clock() as clock:
        old = wf.create(id="old")
        finish([old])
        RateLimitStart.objects.all().delete()
        clock.advance("2 minutes")  # its start is out of the window: nothing holds back
        new = wf.create(id="new")
        testing.run_until_idle()
        assert new.status().status == "waiting"
        # Only the new start is left once admission dropped what the window does not hold.
        assert list(RateLimitStart.objects.values_list("started_at", flat=True)) == [clock.now()]
        finish([new])
