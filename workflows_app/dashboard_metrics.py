"""The dashboard's metrics page: throughput, failure rate and p50/p95 durations per
workflow and per step over the last hour or day, computed from instance and step rows.

Counts are exact (conditional COUNTs over rows that finished in the window, found
through the finished_at / completed_at indexes). Percentiles come from the most recent
MAX_SAMPLES finished rows of the window, so a busy day costs one bounded read, not one
of every row; the page says when it sampled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import connection
from django.db.models import Case, Count, FilteredRelation, IntegerField, Q, QuerySet, When
from django.utils import timezone

from .dashboard import CHART_HEIGHT, STEP_CUT_SHORT, bar_chart, chart_peak, time_axis
from .models import LIVE_STATUSES, Instance, Status, StepKind, StepRecord, StepStatus

MAX_SAMPLES = 10_000  # rows read for the percentiles of one window (instances; steps)
MAX_DURATION_BARS = 12  # steps drawn in a workflow's duration chart, the slowest by p95
STEP_TABLE_OPEN = 25  # a longer per-step table starts folded
# Step names a workflow's table lists, those that ran most: a loop naming its steps
# f"s{i}" has one per iteration, 50,000 for one big instance (16 s and 6.8 MB of page).
MAX_STEP_ROWS = 200


@dataclass(frozen=True)
class Window:
    key: str
    label: str
    minutes: int
    bucket_minutes: int


WINDOWS = {
    "hour": Window("hour", "last hour", 60, 5),
    "day": Window("day", "last day", 24 * 60, 60),
}


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list (None when empty)."""
    if not sorted_values:
        return None
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


@dataclass
class Durations:
    """p50 / p95 of a sample of durations in milliseconds."""

    samples: list[float] = field(default_factory=list)

    @property
    def p50(self) -> float | None:
        return percentile(sorted(self.samples), 0.50)

    @property
    def p95(self) -> float | None:
        return percentile(sorted(self.samples), 0.95)


@dataclass
class StepMetrics:
    name: str
    finished: int = 0
    failed: int = 0
    durations: Durations = field(default_factory=Durations)

    @property
    def failure_rate(self) -> float | None:
        return self.failed / self.finished if self.finished else None


@dataclass
class WorkflowMetrics:
    name: str
    started: int = 0
    completed: int = 0
    errored: int = 0
    terminated: int = 0
    completed_series: list[int] = field(default_factory=list)
    errored_series: list[int] = field(default_factory=list)
    durations: Durations = field(default_factory=Durations)
    steps: dict[str, StepMetrics] = field(default_factory=dict)
    steps_total: int = 0  # step names that ran in the window (`steps` has MAX_STEP_ROWS)
    window: Window = WINDOWS["hour"]

    @property
    def finished(self) -> int:
        return self.completed + self.errored + self.terminated

    @property
    def failure_rate(self) -> float | None:
        """Errored among those that ran to an end (terminated ones were stopped)."""
        ended = self.completed + self.errored
        return self.errored / ended if ended else None

    @property
    def throughput_per_hour(self) -> float:
        return self.finished * 60 / self.window.minutes

    @property
    def chart(self) -> list[dict[str, Any]]:
        return bar_chart(
            self.completed_series,
            self.errored_series,
            self.window.minutes,
            self.window.bucket_minutes,
        )

    @property
    def chart_peak(self) -> int:
        return chart_peak(self.completed_series, self.errored_series)

    @property
    def time_axis(self) -> list[dict[str, Any]]:
        return time_axis(self.window.minutes)

    @property
    def step_list(self) -> list[StepMetrics]:
        return sorted(self.steps.values(), key=lambda s: s.name)

    @property
    def slowest_steps(self) -> list[StepMetrics]:
        """The steps with a duration, slowest p95 first (then by name); at most
        MAX_DURATION_BARS, so a workflow of 200 steps draws a chart, not a page of bars."""
        timed = [s for s in self.steps.values() if s.durations.p95 is not None]
        timed.sort(key=lambda s: (-(s.durations.p95 or 0), s.name))
        return timed[:MAX_DURATION_BARS]

    @property
    def steps_not_drawn(self) -> int:
        """Steps with a duration left out of the chart (they are in the table)."""
        timed = sum(1 for s in self.steps.values() if s.durations.p95 is not None)
        return max(timed - MAX_DURATION_BARS, 0)

    @property
    def duration_bars(self) -> list[dict[str, Any]]:
        """p50 and p95 bars of the workflow and of its slowest steps, widths relative to the
        longest."""
        rows = [("(whole instance)", self.durations)] + [
            (s.name, s.durations) for s in self.slowest_steps
        ]
        longest = max([d.p95 or 0 for _, d in rows] + [1e-9])
        bars = []
        for i, (label, d) in enumerate(rows):
            if d.p95 is None:
                continue
            bars.append(
                {
                    "label": label,
                    "p50": d.p50,
                    "p95": d.p95,
                    "w50": round((d.p50 or 0) / longest * 100, 2),
                    "w95": round(d.p95 / longest * 100, 2),
                    "row": i,
                }
            )
        return bars


@dataclass
class MetricsPage:
    window: Window
    workflows: list[WorkflowMetrics]
    sampled_instances: bool
    sampled_steps: bool
    chart_height: int = CHART_HEIGHT


def duration_ms(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return max(0.0, (end - start).total_seconds() * 1000)


def metrics_page(window_key: str, now: datetime | None = None) -> MetricsPage:
    """Four queries: instance counts per bucket, instance durations, step counts, step
    durations; each bounded to the window by an indexed timestamp (a fifth when a step
    outlived its instance, see below)."""
    window = WINDOWS.get(window_key, WINDOWS["hour"])
    now = now or timezone.now()
    since = now - timedelta(minutes=window.minutes)
    buckets = window.minutes // window.bucket_minutes
    edges = [since + timedelta(minutes=window.bucket_minutes * i) for i in range(buckets)]
    edges.append(now + timedelta(days=1))  # the last bucket takes anything up to now
    workflows: dict[str, WorkflowMetrics] = {}

    def workflow(name: str) -> WorkflowMetrics:
        if name not in workflows:
            workflows[name] = WorkflowMetrics(
                name, completed_series=[0] * buckets, errored_series=[0] * buckets, window=window
            )
        return workflows[name]

    # The bucket each instance ended in (None: not ended in the window; `buckets`: after
    # the last, ended past now + 1 day), and one count per workflow, status and bucket: a
    # conditional COUNT per bucket and outcome was 48 FILTERs on every row of a day, half
    # of the read at 1M instances (480 -> 200 ms on a loaded machine).
    ended_in = Case(
        When(Q(finished_at__isnull=True) | Q(finished_at__lt=since), then=None),
        *(When(finished_at__lt=edges[i + 1], then=i) for i in range(buckets)),
        default=buckets,
        output_field=IntegerField(),
    )
    recent = Instance.objects.filter(Q(created_at__gte=since) | Q(finished_at__gte=since))
    for row in (
        recent.annotate(ended_in=ended_in)
        .values("workflow", "status", "ended_in")
        .annotate(started=Count("id", filter=Q(created_at__gte=since)), ended=Count("id"))
        .order_by()
    ):
        w = workflow(row["workflow"])
        w.started += row["started"]
        bucket, ended = row["ended_in"], row["ended"]
        if bucket is None:
            continue
        if row["status"] == Status.TERMINATED:
            w.terminated += ended
        elif bucket < buckets and row["status"] == Status.COMPLETE:
            w.completed_series[bucket] += ended
        elif bucket < buckets and row["status"] == Status.ERRORED:
            w.errored_series[bucket] += ended
    for w in workflows.values():
        w.completed = sum(w.completed_series)
        w.errored = sum(w.errored_series)

    finished = list(
        Instance.objects.filter(
            finished_at__gte=since, status__in=(Status.COMPLETE, Status.ERRORED)
        )
        .order_by("-finished_at")
        .values_list("workflow", "started_at", "finished_at")[: MAX_SAMPLES + 1]
    )
    for name, started_at, finished_at in finished[:MAX_SAMPLES]:
        ms = duration_ms(started_at, finished_at)
        if ms is not None:
            workflow(name).durations.samples.append(ms)

    # A step its instance's end cut short (terminate, cancel) neither finished nor failed.
    steps = StepRecord.objects.filter(completed_at__gte=since, kind=StepKind.DO).exclude(
        status=StepStatus.FAILED, last_error_name=STEP_CUT_SHORT
    )
    # Each workflow's MAX_STEP_ROWS names that ran most, ranked in the database with the
    # number of its names: a step named per instance (f"charge {order}") made one row per
    # instance of the window, all read into Python to keep 200 (144,000 rows, 6 s and
    # 175 MB for a day of 100 instances a minute on PostgreSQL).
    #
    # The ranking and the durations join each step to its instance among those the window
    # can hold (finished in it, or not finished: instance_finished and instance_live), not
    # among all of them: the join read every instance of the table (1M instances: the
    # ranking of a day 600 ms, the durations of an hour 440 ms). A step that completed in
    # the window after its instance had ended before it (the clocks of two hosts apart)
    # finds none there: then both read every instance, as before.
    ranked = _ranked_steps(steps, among_the_window_of=since)
    if any(name is None for name, *_ in ranked):
        ranked, workflow_of_step = _ranked_steps(steps), "instance__workflow"
    else:
        in_window = Q(instance__finished_at__gte=since) | Q(instance__status__in=LIVE_STATUSES)
        steps = steps.annotate(window_instance=FilteredRelation("instance", condition=in_window))
        workflow_of_step = "window_instance__workflow"
    for name, step, n, failed, names in ranked:
        w = workflow(name)
        w.steps_total = names
        w.steps[step] = StepMetrics(step, n, failed)
    for w in workflows.values():
        w.steps = dict(sorted(w.steps.items(), key=lambda kv: (-kv[1].finished, kv[0])))
    step_rows = list(
        steps.order_by("-completed_at").values_list(
            workflow_of_step, "name", "started_at", "completed_at"
        )[: MAX_SAMPLES + 1]
    )
    for name, step, started_at, completed_at in step_rows[:MAX_SAMPLES]:
        ms = duration_ms(started_at, completed_at)
        metrics = workflow(name).steps.get(step)
        if ms is not None and metrics is not None:
            metrics.durations.samples.append(ms)

    return MetricsPage(
        window,
        [workflows[name] for name in sorted(workflows)],
        sampled_instances=len(finished) > MAX_SAMPLES,
        sampled_steps=len(step_rows) > MAX_SAMPLES,
    )


def _ranked_steps(
    steps: QuerySet[StepRecord], among_the_window_of: datetime | None = None
) -> list[tuple[Any, ...]]:
    """(workflow, step name, finished, failed, names of the workflow) of each workflow's
    MAX_STEP_ROWS step names that ran most. Given a window's start, the steps' instances
    are looked for only among those finished since or not finished (a LEFT JOIN, which
    the ORM makes an inner one on a non-null key): a step of another comes back under the
    workflow None."""
    window_steps, params = (
        steps.order_by().values("instance_id", "name", "status").query.sql_with_params()
    )
    among, among_params = "", []
    if among_the_window_of is not None:
        marks = ", ".join(["%s"] * len(LIVE_STATUSES))
        among = f" AND (i.finished_at >= %s OR i.status IN ({marks}))"
        since = connection.ops.adapt_datetimefield_value(among_the_window_of)
        among_params = [since, *LIVE_STATUSES]
    instances = connection.ops.quote_name(Instance._meta.db_table)
    sql = f"""
        SELECT workflow, name, n, failed, names FROM (
            SELECT workflow, name, n, failed,
                ROW_NUMBER() OVER (PARTITION BY workflow ORDER BY n DESC, name) AS step_rank,
                COUNT(*) OVER (PARTITION BY workflow) AS names
            FROM (
                SELECT i.workflow AS workflow, s.name AS name, COUNT(*) AS n,
                    COUNT(CASE WHEN s.status = %s THEN 1 END) AS failed
                FROM ({window_steps}) s
                LEFT JOIN {instances} i ON i.id = s.instance_id{among}
                GROUP BY i.workflow, s.name
            ) grouped
        ) ranked
        WHERE step_rank <= %s"""
    with connection.cursor() as cursor:
        cursor.execute(sql, [StepStatus.FAILED, *params, *among_params, MAX_STEP_ROWS])
        return cursor.fetchall()
