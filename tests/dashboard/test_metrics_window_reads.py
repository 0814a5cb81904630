"""The metrics page joins its window's steps to the instances of its window, not to every
instance, and shows what its joins to every instance showed: each figure of the page is
compared here with the same figure worked out in Python from every row, on both databases
(the plans at scale are in tests/test_big_table_plans.py)."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from workflows_app import dashboard_metrics
from workflows_app.dashboard import STEP_CUT_SHORT
from workflows_app.models import LIVE_STATUSES, Instance, StepRecord

pytestmark = pytest.mark.django_db(transaction=True)

NOW = datetime(2026, 1, 1, 12, tzinfo=UTC)
STATUSES = ["complete", "errored", "terminated", "complete", "waiting", "running", "paused"]


def fill() -> None:
    """40 instances of three workflows over 27 hours, every outcome, with steps that ended
    in the window and before it; a waiting instance three days old whose steps ran in the
    last hour."""
    for n in range(40):
        status = STATUSES[n % len(STATUSES)]
        created = NOW - timedelta(minutes=41 * n, seconds=n)
        finished = (
            None if status in LIVE_STATUSES else created + timedelta(minutes=n % 9, seconds=7)
        )
        row = Instance.objects.create(
            workflow=("alpha", "beta", "gamma")[n % 3],
            instance_id=f"i-{n}",
            version=1,
            status=status,
            created_at=created,
            updated_at=created,
            started_at=created + timedelta(seconds=3),
            finished_at=finished,
        )
        last = {"errored": ("failed", "ValueError"), "terminated": ("failed", STEP_CUT_SHORT)}
        steps = [("validate", "do", "complete", ""), (f"ship {n % 4}", "do", "complete", "")]
        steps.append(("charge", "do", *last.get(status, ("complete", ""))))
        steps.append(("charge", "compensate", "complete", ""))
        for seq, (name, kind, step_status, error) in enumerate(steps, start=1):
            started = created + timedelta(seconds=3 + 40 * seq)
            done = None if status in LIVE_STATUSES and seq == 3 else started + timedelta(seconds=n)
            step(row, name, kind, seq, step_status, error, started, done)
    old = Instance.objects.create(
        workflow="gamma",
        instance_id="old-waiting",
        version=1,
        status="waiting",
        created_at=NOW - timedelta(days=3),
        updated_at=NOW,
        started_at=NOW - timedelta(days=3),
    )
    for seq in (1, 2):
        started = NOW - timedelta(minutes=30 * seq, seconds=11)
        step(
            old, f"remind {seq}", "do", seq, "complete", "", started, started + timedelta(minutes=2)
        )


def step(row: Instance, name: str, kind: str, seq: int, status: str, error: str, started, done):
    StepRecord.objects.create(
        instance=row,
        name=name,
        kind=kind,
        seq=seq,
        status=status,
        last_error_name=error,
        started_at=started,
        completed_at=done,
    )


def worked_out(key: str) -> dict[str, Any]:
    """The page's figures from every instance and step row, in Python."""
    window = dashboard_metrics.WINDOWS[key]
    since = NOW - timedelta(minutes=window.minutes)
    buckets = window.minutes // window.bucket_minutes
    instances = {i.pk: i for i in Instance.objects.all()}
    page: dict[str, dict[str, Any]] = {}

    def of(name: str) -> dict[str, Any]:
        blank = {"started": 0, "terminated": 0, "durations": [], "steps": {}, "names": 0}
        blank |= {"complete": [0] * buckets, "errored": [0] * buckets}
        return page.setdefault(name, blank)

    ended = []
    for i in instances.values():
        ran = i.created_at >= since
        done = i.finished_at is not None and i.finished_at >= since
        if ran or done:
            of(i.workflow)["started"] += ran
        if done and i.status == "terminated":
            of(i.workflow)["terminated"] += 1
        if done and i.status in ("complete", "errored"):
            bucket = min(
                int((i.finished_at - since) / timedelta(minutes=window.bucket_minutes)), buckets - 1
            )
            of(i.workflow)[i.status][bucket] += 1
            ended.append(i)
    ended.sort(key=lambda i: i.finished_at, reverse=True)
    for i in ended[: dashboard_metrics.MAX_SAMPLES]:
        of(i.workflow)["durations"].append(
            dashboard_metrics.duration_ms(i.started_at, i.finished_at)
        )
    counted = [
        s
        for s in StepRecord.objects.filter(kind="do", completed_at__isnull=False)
        if s.completed_at >= since
        and not (s.status == "failed" and s.last_error_name == STEP_CUT_SHORT)
    ]
    finished = Counter((instances[s.instance_id].workflow, s.name) for s in counted)
    failed = Counter(
        (instances[s.instance_id].workflow, s.name) for s in counted if s.status == "failed"
    )
    for name in {w for w, _ in finished}:
        names = sorted(((-n, step) for (w, step), n in finished.items() if w == name))
        of(name)["names"] = len(names)
        for minus_n, step_name in names[: dashboard_metrics.MAX_STEP_ROWS]:
            of(name)["steps"][step_name] = [-minus_n, failed[(name, step_name)], []]
    counted.sort(key=lambda s: s.completed_at, reverse=True)
    for s in counted[: dashboard_metrics.MAX_SAMPLES]:
        listed = of(instances[s.instance_id].workflow)["steps"].get(s.name)
        if listed is not None:
            listed[2].append(dashboard_metrics.duration_ms(s.started_at, s.completed_at))
    return {
        "workflows": {name: page[name] for name in sorted(page)},
        "sampled": (
            len(ended) > dashboard_metrics.MAX_SAMPLES,
            len(counted) > dashboard_metrics.MAX_SAMPLES,
        ),
    }


def shown(key: str) -> dict[str, Any]:
    page = dashboard_metrics.metrics_page(key, now=NOW)
    workflows = {
        w.name: {
            "started": w.started,
            "terminated": w.terminated,
            "durations": w.durations.samples,
            "steps": {
                s.name: [s.finished, s.failed, s.durations.samples] for s in w.steps.values()
            },
            "names": w.steps_total,
            "complete": w.completed_series,
            "errored": w.errored_series,
        }
        for w in page.workflows
    }
    return {"workflows": workflows, "sampled": (page.sampled_instances, page.sampled_steps)}


def assert_shown_as_worked_out(key: str) -> None:
    page, expected = shown(key), worked_out(key)
    assert list(page["workflows"]) == list(expected["workflows"])
    for name, figures in expected["workflows"].items():
        for step_figures in figures["steps"].values():
            step_figures[2].sort()
        for step_figures in page["workflows"][name]["steps"].values():
            step_figures[2].sort()
        assert sorted(page["workflows"][name].pop("durations")) == sorted(figures.pop("durations"))
        assert page["workflows"][name] == figures, name
    assert page["sampled"] == expected["sampled"]


@pytest.mark.parametrize("key", ["hour", "day"])
@pytest.mark.parametrize("bounds", [(200, 10_000), (2, 3)])
def test_the_page_shows_what_its_reads_over_every_instance_showed(key, bounds, monkeypatch):
    # The step counts and durations join each step to its instance among those of the
    # window (finished in it, or not finished): the same figures as the join to every
    # instance, whatever MAX_STEP_ROWS and MAX_SAMPLES cut.
    monkeypatch.setattr(dashboard_metrics, "MAX_STEP_ROWS", bounds[0])
    monkeypatch.setattr(dashboard_metrics, "MAX_SAMPLES", bounds[1])
    fill()
    with CaptureQueriesContext(connection) as queries:
        dashboard_metrics.metrics_page(key, now=NOW)
    assert len(queries.captured_queries) == 4, [q["sql"] for q in queries.captured_queries]
    assert_shown_as_worked_out(key)
    assert "gamma" in shown(key)["workflows"]  # the old waiting instance's steps


@pytest.mark.parametrize("key", ["hour", "day"])
def test_a_step_that_ended_after_its_instance_had_ended_before_the_window_is_counted(key):
    # Clocks of two hosts apart: a step's end stored after its instance's, which ended
    # before the window. Its instance is not among those the window holds: the page ranks
    # the steps again over every instance rather than leave the step without a workflow.
    fill()
    row = Instance.objects.create(
        workflow="delta",
        instance_id="skewed",
        version=1,
        status="complete",
        created_at=NOW - timedelta(days=2),
        updated_at=NOW - timedelta(days=2),
        started_at=NOW - timedelta(days=2),
        finished_at=NOW - timedelta(days=2),
    )
    late = NOW - timedelta(minutes=5)
    step(row, "late", "do", 1, "complete", "", late - timedelta(seconds=9), late)
    with CaptureQueriesContext(connection) as queries:
        page = dashboard_metrics.metrics_page(key, now=NOW)
    assert len(queries.captured_queries) == 5  # the ranking read again, over every instance
    [delta] = [w for w in page.workflows if w.name == "delta"]
    assert (delta.started, delta.finished, delta.steps["late"].finished) == (0, 0, 1)
    assert None not in [w.name for w in page.workflows]
    assert_shown_as_worked_out(key)


def test_the_instances_of_a_day_are_counted_once_a_group_not_once_a_bucket():
    # One conditional COUNT per bucket and outcome was 48 FILTERs evaluated on every
    # instance of a day: half of the read at 1M instances (480 -> 200 ms, loaded machine).
    # Each instance now falls in one bucket and is counted once (the figures are compared
    # with those worked out from every row above).
    fill()
    with CaptureQueriesContext(connection) as queries:
        dashboard_metrics.metrics_page("day", now=NOW)
    [counts] = [q["sql"] for q in queries.captured_queries if "created_at" in q["sql"]]
    assert counts.upper().count("COUNT(") == 2, counts
    assert_shown_as_worked_out("day")
