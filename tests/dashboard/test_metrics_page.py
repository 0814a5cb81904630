"""The dashboard's metrics page: throughput, failure rate, p50/p95 per workflow and step."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.dashboard_metrics import metrics_page, percentile
from workflows_app.engine import NonRetryableError, WorkflowEntrypoint, current_step, register

from .helpers import make_user

pytestmark = pytest.mark.django_db(transaction=True)
ODD_STEP = "<b>odd</b> step"


@pytest.fixture
def measured(registered: list[str]) -> Any:
    """One instance that completes after a step retried for a minute, one that errors."""

    @register("metric-page")
    class MetricPage(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            def flaky() -> str:
                if current_step().attempt == 1:
                    raise ConnectionError("first try fails")
                return "ok"

            if event.payload.get("fail"):

                def boom() -> None:
                    raise NonRetryableError("no")

                await step.do(ODD_STEP, boom)
            await step.do("flaky", flaky, retries={"limit": 1, "delay": "1 minute"})
            return "done"

    with testing.fake_clock(timezone.now()) as clock:
        get_workflow("metric-page").create(id="ok", params={})
        get_workflow("metric-page").create(id="bad", params={"fail": True})
        testing.run_until_idle()
        clock.advance("1 minute")
        testing.run_until_idle()
        yield clock.now()


def test_the_page_counts_throughput_failures_and_percentiles_per_workflow_and_step(measured):
    (w,) = metrics_page("hour", now=measured).workflows
    assert (w.name, w.started, w.completed, w.errored, w.finished) == ("metric-page", 2, 1, 1, 2)
    assert w.failure_rate == 0.5
    assert w.throughput_per_hour == 2
    assert sum(w.completed_series) == 1 and sum(w.errored_series) == 1
    assert len(w.completed_series) == 12  # 5-minute buckets
    assert (w.durations.p50, w.durations.p95) == (0.0, 60_000.0)
    flaky, odd = w.steps["flaky"], w.steps[ODD_STEP]
    assert (flaky.finished, flaky.failed, flaky.durations.p95) == (1, 0, 60_000.0)
    assert (odd.finished, odd.failed, odd.failure_rate) == (1, 1, 1.0)

    (day,) = metrics_page("day", now=measured + timedelta(hours=2)).workflows
    assert (day.finished, len(day.completed_series)) == (2, 24)
    assert metrics_page("hour", now=measured + timedelta(hours=2)).workflows == []


def test_the_page_draws_its_charts_and_escapes_names(measured, django_assert_max_num_queries):
    client = Client()
    client.force_login(make_user("metrics-viewer", "view_instance"))
    with django_assert_max_num_queries(8):  # session, user, permissions, four metric queries
        response = client.get("/stats/?window=hour")
    html = response.content.decode()
    assert response.status_code == 200
    assert 'data-workflow="metric-page"' in html
    assert html.count("<g data-bucket=") == 12
    assert 'data-row="flaky"' in html and 'data-row="(whole instance)"' in html
    assert "&lt;b&gt;odd&lt;/b&gt; step" in html and ODD_STEP not in html
    assert 'aria-current="page">Metrics</a>' in html
    day = client.get("/stats/?window=day").content.decode()
    assert day.count("<g data-bucket=") == 24 and "last day" in day


def test_the_page_needs_a_staff_user_who_may_view():
    assert Client().get("/stats/").status_code == 302  # to the login page
    client = Client()
    client.force_login(make_user("no-view"))
    assert client.get("/stats/").status_code == 403


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([], 0.5, None),
        ([5.0], 0.95, 5.0),
        ([1.0, 2.0, 3.0, 4.0], 0.5, 2.0),
        ([1.0, 2.0], 0.95, 2.0),
    ],
)
def test_percentile_is_nearest_rank(values, q, expected):
    assert percentile(values, q) == expected


def test_a_workflow_of_many_steps_draws_its_slowest_and_folds_its_step_table(registered):
    # 30 steps, step i taking i ms: the chart draws the whole instance and the 12 slowest
    # steps (slowest first), not 30 bars; the table of every step starts folded.
    from workflows_app.dashboard_metrics import MAX_DURATION_BARS
    from workflows_app.engine import clock as engine_clock

    @register("many-steps")
    class ManySteps(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            for i in range(30):

                def work(i: int = i) -> int:
                    engine_clock.get_clock().advance(i)  # type: ignore[union-attr]
                    return i

                await step.do(f"s{i:02d}", work)

    with testing.fake_clock(timezone.now()):
        get_workflow("many-steps").create(id="many", params={})
        testing.run_until_idle()
        (w,) = metrics_page("hour").workflows
        drawn = [bar["label"] for bar in w.duration_bars]
        assert drawn == ["(whole instance)"] + [f"s{i:02d}" for i in range(29, 17, -1)]
        assert len(drawn) == MAX_DURATION_BARS + 1 and w.steps_not_drawn == 18

        client = Client()
        client.force_login(make_user("metrics-many", "view_instance"))
        html = client.get("/stats/").content.decode()
    assert html.count('class="duration-row"') == MAX_DURATION_BARS + 1
    assert 'data-field="steps-not-drawn">18<' in html
    assert html.count("<tr data-step=") == 30  # every step is in the table …
    assert '<details class="step-table"><summary>' in html  # … folded


def test_a_workflow_of_few_steps_shows_its_step_table_open(measured):
    client = Client()
    client.force_login(make_user("metrics-few", "view_instance"))
    html = client.get("/stats/?window=hour").content.decode()
    assert '<details class="step-table" open>' in html
    assert "more in the table" not in html


def test_a_loop_naming_a_step_per_iteration_lists_the_steps_that_ran_most(registered, monkeypatch):
    # Every step name had a row: a loop naming its steps f"s{i}" in one instance of 50,000
    # steps made the page 6.8 MB and 16 s.
    from workflows_app import dashboard_metrics

    monkeypatch.setattr(dashboard_metrics, "MAX_STEP_ROWS", 3, raising=False)

    @register("loop-names")
    class LoopNames(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            await step.do("common", lambda: 1)
            for i in range(event.payload["n"]):
                await step.do(f"s{i}", lambda: 1)

    with testing.fake_clock(timezone.now()):
        get_workflow("loop-names").create(id="a", params={"n": 10})
        get_workflow("loop-names").create(id="b", params={"n": 1})
        testing.run_until_idle()
        (w,) = metrics_page("hour").workflows
        assert [(s.name, s.finished) for s in w.step_list] == [
            ("common", 2),
            ("s0", 2),
            ("s1", 1),
        ]
        assert w.steps_total == 11
        client = Client()
        client.force_login(make_user("metrics-loop", "view_instance"))
        html = client.get("/stats/").content.decode()
    assert html.count("<tr data-step=") == 3
    assert (
        'The 3 steps that ran most <span class="muted" data-field="steps-listed">(of 11 step names)'
        in html
    )


def test_the_page_reads_each_workflows_top_steps_not_a_row_per_step_name(registered, monkeypatch):
    """A step named per instance (f"charge {order}") is a step name per instance: the
    page read one row per name of the window into Python to keep MAX_STEP_ROWS of them
    (a day of 100 instances a minute: 144,000 rows, 6 s and 175 MB on PostgreSQL). Now the
    database ranks them and each of the page's queries returns a bounded number of rows:
    here at most MAX_STEP_ROWS names, MAX_SAMPLES + 1 durations."""
    from django.db import connection

    from workflows_app import dashboard_metrics

    monkeypatch.setattr(dashboard_metrics, "MAX_STEP_ROWS", 3)
    monkeypatch.setattr(dashboard_metrics, "MAX_SAMPLES", 3)

    @register("per-order")
    class PerOrder(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            await step.do("common", lambda: 1)
            await step.do(f"charge {event.instance_id}", lambda: 1)

    statements: list[tuple[str, Any]] = []

    def capture(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        statements.append((sql, params))
        return execute(sql, params, many, context)

    with testing.fake_clock(timezone.now()):
        for n in range(12):
            get_workflow("per-order").create(id=f"order-{n}")
        testing.run_until_idle()
        with connection.execute_wrapper(capture):
            (w,) = metrics_page("hour").workflows
    assert w.steps_total == 13 and w.steps["common"].finished == 12
    assert [s.finished for s in w.steps.values()] == [12, 1, 1]
    returned = []
    with connection.cursor() as cursor:
        for sql, params in statements:
            cursor.execute(sql, params)
            returned.append(len(cursor.fetchall()))
    assert max(returned) <= 4, list(zip(returned, (sql[:120] for sql, _ in statements)))
