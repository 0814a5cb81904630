"""Read models for the dashboard: the queries behind its pages and its sockets.

Views and consumers share these, so a page and the snapshot its socket sends on connect
always agree. Every function issues a fixed number of queries, whatever the row count.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from functools import cached_property, partial
from typing import Any, TypedDict

from django.db.models import Count, Max, Min, Q, QuerySet
from django.urls import NoReverseMatch, reverse
from django.utils import timezone

from .client import decode_cursor, encode_cursor
from .codec import ENVELOPE_START, shown_text
from .engine import clock, lifecycle, store
from .engine.registry import all_definitions
from .models import (
    ErrorRecord,
    HistoryRecord,
    InboxEvent,
    Instance,
    Schedule,
    Span,
    Status,
    StepKind,
    StepRecord,
    StepStatus,
    WorkflowVersion,
)

PAGE_SIZE = 50
# The list's free-text search (?q=, a substring no index serves) reads at most this many
# instances a page, newest first among those the other filters leave; Older / Newer go on
# from where it stopped. Unbounded, a rare term read the whole table for every page and
# live refresh (1M instances: 1.0-1.2 s here, 4-6 s with bigger params).
SEARCH_SCAN = 100_000
CHART_MINUTES = 60  # the overview chart and "last hour" figures cover this window
CHART_BUCKET_MINUTES = 5
CHART_HEIGHT = 30  # SVG user units; the chart's viewBox is 100 x CHART_HEIGHT
LARGE_OUTPUT_CHARS = 160  # step outputs longer than this start collapsed
HISTORY_ON_PAGE = 500  # newest history records on an instance page (the rest: API, `wf history`)
# A year-long instance has tens of thousands of steps and spans: the page shows the newest
# ones (and every open step), as it does history; the rest: `wf status`, the API, the admin.
STEPS_ON_PAGE = 200
SPANS_ON_PAGE = 500
CHILDREN_ON_PAGE = 100  # a fan-out has thousands; the rest: the API's …/children

# Which actions apply to which status; the detail page shows a button only when it applies.
LIVE_STATUSES = tuple(s for s in Status.values if s in lifecycle.LIVE)


# --- overview -----------------------------------------------------------------------------


def chart_peak(completed: list[int], errored: list[int]) -> int:
    """The count a full-height bar stands for: the y-axis's top label."""
    return max([*completed, *errored, 1])


TIME_AXIS_PARTS = 4  # x-axis labels at the window's start, quarters, and now


def time_axis(window_minutes: int) -> list[dict[str, Any]]:
    """x-axis labels of a chart of the last `window_minutes`, oldest first: "−60 min",
    "−45 min", …, "now", each with its position in percent of the width."""
    labels = []
    for i in range(TIME_AXIS_PARTS + 1):
        ago = round(window_minutes * (TIME_AXIS_PARTS - i) / TIME_AXIS_PARTS)
        if ago == 0:
            text = "now"
        elif ago >= 120 and ago % 60 == 0:
            text = f"−{ago // 60} h"
        else:
            text = f"−{ago} min"
        labels.append({"left": round(100 * i / TIME_AXIS_PARTS, 2), "label": text})
    return labels


def bar_chart(
    completed: list[int], errored: list[int], window_minutes: int, bucket_minutes: int
) -> list[dict[str, Any]]:
    """Bars for an inline SVG (viewBox 100 x CHART_HEIGHT): a completed and an errored bar
    per bucket, oldest first, heights relative to the busiest bucket."""
    peak = chart_peak(completed, errored)
    slot = 100 / len(completed)
    bars = []
    for i, (c, e) in enumerate(zip(completed, errored, strict=True)):
        hc, he = round(c / peak * CHART_HEIGHT, 2), round(e / peak * CHART_HEIGHT, 2)
        bars.append(
            {
                "completed": c,
                "errored": e,
                "minutes_ago": window_minutes - i * bucket_minutes,
                "w": round(slot * 0.4, 2),
                "x_ok": round(i * slot + slot * 0.1, 2),
                "x_err": round(i * slot + slot * 0.5, 2),
                "h_ok": hc,
                "y_ok": round(CHART_HEIGHT - hc, 2),
                "h_err": he,
                "y_err": round(CHART_HEIGHT - he, 2),
            }
        )
    return bars


class WorkflowSummaryJSON(TypedDict):
    name: str
    versions: list[int]
    counts: dict[str, int]
    total: int
    last_hour: int
    finished_last_hour: int
    errored_last_hour: int
    error_rate: float | None
    chart: list[dict[str, Any]]
    chart_peak: int


@dataclass
class WorkflowSummary:
    name: str
    versions: list[int] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    last_hour: int = 0
    completed_series: list[int] = field(
        default_factory=lambda: [0] * (CHART_MINUTES // CHART_BUCKET_MINUTES)
    )
    errored_series: list[int] = field(
        default_factory=lambda: [0] * (CHART_MINUTES // CHART_BUCKET_MINUTES)
    )

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def finished_last_hour(self) -> int:
        return sum(self.completed_series) + sum(self.errored_series)

    @property
    def errored_last_hour(self) -> int:
        return sum(self.errored_series)

    @property
    def error_rate(self) -> float | None:
        return self.errored_last_hour / self.finished_last_hour if self.finished_last_hour else None

    @property
    def status_counts(self) -> list[tuple[str, int]]:
        """Counts in the order of the Status enum, so badges never jump around."""
        return [(s, self.counts[s]) for s in Status.values if self.counts.get(s)]

    def chart(self) -> list[dict[str, Any]]:
        return bar_chart(
            self.completed_series, self.errored_series, CHART_MINUTES, CHART_BUCKET_MINUTES
        )

    @property
    def chart_peak(self) -> int:
        return chart_peak(self.completed_series, self.errored_series)

    @property
    def time_axis(self) -> list[dict[str, Any]]:
        return time_axis(CHART_MINUTES)

    def as_json(self) -> WorkflowSummaryJSON:
        return {
            "name": self.name,
            "versions": self.versions,
            "counts": self.counts,
            "total": self.total,
            "last_hour": self.last_hour,
            "finished_last_hour": self.finished_last_hour,
            "errored_last_hour": self.errored_last_hour,
            "error_rate": self.error_rate,
            "chart": self.chart(),
            "chart_peak": self.chart_peak,
        }


def workflow_summaries(
    only: str | None = None, now: datetime | None = None, among: Collection[str] | None = None
) -> list[WorkflowSummary]:
    """One summary per workflow (registered, or with instances): three queries in all.
    `only` one workflow; `among` those of a set (the live overview's changed workflows,
    read together rather than three queries each)."""
    now = now or timezone.now()
    since = now - timedelta(minutes=CHART_MINUTES)
    wanted: set[str] | None = None
    if only is not None or among is not None:
        wanted = set(among or ()) | ({only} if only is not None else set())
    instances = Instance.objects.all()
    if wanted is not None:
        instances = instances.filter(workflow__in=sorted(wanted))
    summaries: dict[str, WorkflowSummary] = {}

    def summary(name: str) -> WorkflowSummary:
        return summaries.setdefault(name, WorkflowSummary(name))

    versions: dict[str, set[int]] = {}
    for d in all_definitions():
        versions.setdefault(d.name, set()).add(d.version)
    catalog = WorkflowVersion.objects.values_list("name", "version")
    for name, version in catalog if wanted is None else catalog.filter(name__in=sorted(wanted)):
        versions.setdefault(name, set()).add(version)
    for name, vs in versions.items():
        if wanted is None or name in wanted:
            summary(name).versions = sorted(vs, reverse=True)
    for row in instances.values("workflow", "status").annotate(n=Count("id")).order_by():
        summary(row["workflow"]).counts[row["status"]] = row["n"]
    # One pass over the last hour: runs created, and one conditional COUNT per (bucket,
    # outcome) on finished_at (plain comparisons: a per-row date truncation would call a
    # Python function per row on SQLite). Neither column is indexed: this is a scan.
    buckets = CHART_MINUTES // CHART_BUCKET_MINUTES
    edges = [since + timedelta(minutes=CHART_BUCKET_MINUTES * i) for i in range(buckets)] + [
        now + timedelta(days=1)
    ]
    aggregates = {
        f"{outcome}_{i}": Count(
            "id", filter=Q(status=outcome, finished_at__gte=edges[i], finished_at__lt=edges[i + 1])
        )
        for outcome in (Status.COMPLETE, Status.ERRORED)
        for i in range(buckets)
    }
    recent = instances.filter(Q(created_at__gte=since) | Q(finished_at__gte=since))
    for row in (
        recent.values("workflow")
        .annotate(last_hour=Count("id", filter=Q(created_at__gte=since)), **aggregates)
        .order_by()
    ):
        s = summary(row["workflow"])
        s.last_hour = row["last_hour"]
        s.completed_series = [row[f"{Status.COMPLETE}_{i}"] for i in range(buckets)]
        s.errored_series = [row[f"{Status.ERRORED}_{i}"] for i in range(buckets)]
    return [summaries[name] for name in sorted(summaries)]


# --- instance list ------------------------------------------------------------------------


@dataclass(frozen=True)
class ListFilters:
    workflow: str = ""
    status: str = ""
    version: int | None = None
    created_from: datetime | None = None
    created_to: datetime | None = None
    q: str = ""
    attributes: tuple[tuple[str, Any], ...] = ()  # exact matches

    def apply(self, query: QuerySet[Instance]) -> QuerySet[Instance]:
        if self.workflow:
            query = query.filter(workflow=self.workflow)
        if self.status:
            query = query.filter(status=self.status)
        if self.version is not None:
            query = query.filter(version=self.version)
        if self.created_from is not None:
            query = query.filter(created_at__gte=self.created_from)
        if self.created_to is not None:
            query = query.filter(created_at__lt=self.created_to)
        if self.q:
            query = query.filter(search_text(self.q))
        return store.filter_attributes(query, dict(self.attributes))

    def as_json(self) -> dict[str, Any]:
        """What a bulk job records of the filter it was started from."""
        shown: dict[str, Any] = {
            "workflow": self.workflow,
            "status": self.status,
            "version": self.version,
            "created_from": self.created_from.isoformat() if self.created_from else None,
            "created_to": self.created_to.isoformat() if self.created_to else None,
            "q": self.q,
            "attributes": dict(self.attributes),
        }
        return {k: v for k, v in shown.items() if v not in ("", None, {})}


def search_text(q: str) -> Q:
    """The list's free-text search: an id or idempotency key, or a case-insensitive
    substring of the params, the output or the error (name and message).

    The JSON columns are searched as the text they are stored as (compact JSON), so
    `"plan":"pro"` matches a key and its value. A substring cannot use an index: this
    scans the rows the other filters leave (store.contains_any_case: alike on both
    databases). Values sealed by the payload codec (and sensitive outputs) are left out:
    their stored text is an envelope, and matching on it would say something about the data.
    """
    sealed = ENVELOPE_START
    return (
        named_exactly(q)
        | Q(instance_id__startswith=q)
        | (store.contains_any_case("params_json", q) & ~Q(params_json__startswith=sealed))
        | (store.contains_any_case("output_json", q) & ~Q(output_json__startswith=sealed))
        | store.contains_any_case("error_name", q)
        | store.contains_any_case("error_message", q)
    )


def named_exactly(q: str) -> Q:
    """The search's matches an index finds: the id or idempotency key itself."""
    return Q(instance_id=q) | Q(idempotency_key=q)


# The columns a list row shows; loading only these keeps a page cheap at any table size.
ROW_FIELDS = (
    "id",
    "workflow",
    "instance_id",
    "version",
    "status",
    "created_at",
    "updated_at",
    "finished_at",
    "error_name",
    "idempotency_key",
    "waiting_reason",
)


@dataclass(frozen=True)
class Page:
    rows: list[Any]
    older: str | None  # cursor of the next (older) page
    newer: str | None  # cursor of the previous (newer) page
    # "older" / "newer": the search read its SEARCH_SCAN instances before it had a page;
    # more may match past them, which the cursor of that direction goes on to read.
    search_stopped: str = ""


def _keyset_page(
    query: Any,
    after: str | None,
    before: str | None,
    limit: int,
    order: Callable[..., Any],
) -> Page:
    """Keyset pagination on the primary key, newest first: no OFFSET, no COUNT(*).

    `after` pages to older rows (id < cursor); `before` to newer ones (id > cursor).
    Both directions fetch one extra row to know whether another page exists.
    `order(query, newest_first=...)` orders the query by id.
    """
    if before:
        rows = list(
            order(query.filter(id__gt=decode_cursor(before)), newest_first=False)[: limit + 1]
        )
        more_newer = len(rows) > limit
        rows = rows[:limit][::-1]
        return Page(
            rows,
            encode_cursor(rows[-1].pk) if rows else None,
            encode_cursor(rows[0].pk) if rows and more_newer else None,
        )
    if after:
        query = query.filter(id__lt=decode_cursor(after))
    rows = list(order(query)[: limit + 1])
    more_older = len(rows) > limit
    rows = rows[:limit]
    return Page(
        rows,
        encode_cursor(rows[-1].pk) if rows and more_older else None,
        encode_cursor(rows[0].pk) if rows and after else None,
    )


def instance_page(
    filters: ListFilters,
    after: str | None = None,
    before: str | None = None,
    limit: int = PAGE_SIZE,
) -> Page:
    """The instance list's page: keyset-paginated, newest first (see _keyset_page)."""
    query = filters.apply(Instance.objects.only(*ROW_FIELDS))
    sorted_range = not filters.attributes and store.reads_created_range(
        filters.created_to, filters.created_from
    )
    order = partial(store.order_by_id, sorted_range=sorted_range)
    if filters.q:
        return _search_page(filters, after, before, limit, order)
    return _keyset_page(query, after, before, limit, order)


def _scan_edge(
    query: Any, order: Callable[..., Any], q: str, newest_first: bool = True
) -> int | None:
    """Where a search page stops reading: the id of the last of the first SEARCH_SCAN
    instances of query in page order (read from the index the order walks), None when
    no instance lies past it. Past it, to the next instance of that id or idempotency key
    (an index finds it): an exact id is found however old, reading as far as it (as
    every search read before)."""
    first = order(query, newest_first=newest_first)[:SEARCH_SCAN]
    edge = first.aggregate(edge=Min("id") if newest_first else Max("id"))["edge"]
    past = "id__lt" if newest_first else "id__gt"
    if edge is None or not query.filter(**{past: edge}).exists():
        return None
    beyond = query.filter(named_exactly(q), **{past: edge})
    named = order(beyond, newest_first=newest_first).values_list("id", flat=True).first()
    return edge if named is None else named


def _search_page(
    filters: ListFilters,
    after: str | None,
    before: str | None,
    limit: int,
    order: Callable[..., Any],
) -> Page:
    """A page of the free-text search: _keyset_page's, matched among at most SEARCH_SCAN
    instances from the cursor on (the other filters' rows, in page order). A page that
    stops there short of `limit` rows (even of none) gives the cursor of the edge it
    reached, so the next page in that direction searches on from it."""
    base = replace(filters, q="").apply(Instance.objects.only(*ROW_FIELDS))
    matches = search_text(filters.q)
    if before:
        start = decode_cursor(before)
        window = base.filter(id__gt=start)
        edge = _scan_edge(window, order, filters.q, newest_first=False)
        scanned = window if edge is None else window.filter(id__lte=edge)
        rows = list(order(scanned.filter(matches), newest_first=False)[: limit + 1])
        more_newer = len(rows) > limit
        rows = rows[:limit][::-1]
        stopped = edge is not None and not more_newer
        newer = encode_cursor(rows[0].pk) if more_newer else None
        return Page(
            rows,
            encode_cursor(rows[-1].pk if rows else start + 1),
            encode_cursor(edge) if stopped else newer,
            "newer" if stopped else "",
        )
    start = decode_cursor(after) if after else None
    window = base if start is None else base.filter(id__lt=start)
    edge = _scan_edge(window, order, filters.q)
    scanned = window if edge is None else window.filter(id__gte=edge)
    rows = list(order(scanned.filter(matches))[: limit + 1])
    more_older = len(rows) > limit
    rows = rows[:limit]
    stopped = edge is not None and not more_older
    older = encode_cursor(rows[-1].pk) if more_older else None
    newer = None
    if start is not None and (rows or start > 1):
        newer = encode_cursor(rows[0].pk if rows else start - 1)
    return Page(rows, encode_cursor(edge) if stopped else older, newer, "older" if stopped else "")


def _by_id(query: Any, newest_first: bool = True) -> Any:
    return query.order_by("-id" if newest_first else "id")


def count_matching(filters: ListFilters) -> int:
    """How many instances the filters match: "apply to all N matching" on the list."""
    return filters.apply(Instance.objects.all()).count()


def rows_newer_than(filters: ListFilters, pk: int, limit: int = PAGE_SIZE) -> list[Instance]:
    """Instances created after the newest row a live page shows, for prepending; a search
    reads the newest SEARCH_SCAN of them at most, as its page does."""
    query = filters.apply(Instance.objects.only(*ROW_FIELDS)).filter(id__gt=pk)
    if filters.q:
        unsearched = replace(filters, q="").apply(Instance.objects.filter(id__gt=pk))
        edge = _scan_edge(unsearched, _by_id, filters.q)
        if edge is not None:
            query = query.filter(id__gte=edge)
    return list(store.order_by_id(query)[:limit])


# --- instance detail ----------------------------------------------------------------------


def instance_url(instance: Instance) -> str:
    """The page of an instance: /workflows/<name>/<id>/, or by primary key when the
    workflow's name cannot be a path segment (it may contain a slash)."""
    try:
        return reverse("workflows:instance", args=[instance.workflow, instance.instance_id])
    except NoReverseMatch:
        return reverse("workflows:instance-by-pk", args=[instance.pk])


def find_instance_pk(workflow: str, instance_id: str) -> int | None:
    return (
        Instance.objects.filter(workflow=workflow, instance_id=instance_id)
        .values_list("id", flat=True)
        .first()
    )


RECENT_ON_WORKFLOW_PAGE = 20


@dataclass
class WorkflowPage:
    summary: WorkflowSummary
    catalog: list[WorkflowVersion]
    registered_versions: set[int]
    recent: list[Instance]
    schedules: list[ScheduleRow] = field(default_factory=list)


def workflow_page(name: str) -> WorkflowPage | None:
    """A workflow's versions, counts by status and newest instances; None if unknown."""
    [summary] = workflow_summaries(only=name) or [WorkflowSummary(name)]
    if not summary.versions and not summary.counts:
        return None
    catalog = list(WorkflowVersion.objects.filter(name=name).order_by("-version"))
    registered = {d.version for d in all_definitions() if d.name == name}
    recent = list(
        Instance.objects.only(*ROW_FIELDS)
        .filter(workflow=name)
        .order_by("-id")[:RECENT_ON_WORKFLOW_PAGE]
    )
    return WorkflowPage(summary, catalog, registered, recent, schedule_rows(workflow=name))


# --- schedules ----------------------------------------------------------------------------

RECENT_ON_SCHEDULE_PAGE = 20


@dataclass
class ScheduleRow:
    schedule: Schedule
    last_instance: Instance | None  # None when it started none yet, or it was deleted


def schedule_rows(workflow: str | None = None) -> list[ScheduleRow]:
    """Schedules by name, each with the instance it started last: two queries."""
    rows = list(
        Schedule.objects.all() if workflow is None else Schedule.objects.filter(workflow=workflow)
    )
    wanted = Q(pk__in=[])
    for row in rows:
        if row.last_instance_id:
            wanted |= Q(workflow=row.workflow, instance_id=row.last_instance_id)
    last = {
        (i.workflow, i.instance_id): i
        for i in (Instance.objects.only(*ROW_FIELDS).filter(wanted) if rows else [])
    }
    return [ScheduleRow(r, last.get((r.workflow, r.last_instance_id))) for r in rows]


@dataclass
class SchedulePage:
    row: ScheduleRow
    next_runs: list[datetime]
    recent: list[Instance]

    @property
    def params_pretty(self) -> str:
        """Its params as stored params are shown: decoded by the payload codec (the stored
        text is the codec's envelope), a message where they cannot be decoded."""
        return pretty_json(self.row.schedule.params_json)


def schedule_page(name: str) -> SchedulePage | None:
    """A schedule, its next fire times and the instances it started, newest first."""
    from .scheduling import upcoming

    schedule = Schedule.objects.filter(name=name).first()
    if schedule is None:
        return None
    recent = list(
        store.schedules.started_instances(name, schedule.workflow, schedule.started_above_pk).only(
            *ROW_FIELDS
        )[:RECENT_ON_SCHEDULE_PAGE]
    )
    last = next((i for i in recent if i.instance_id == schedule.last_instance_id), None)
    # Not through a ScheduleHandle: it decodes the params, which fails (CodecError) for
    # params written with a codec this process does not have.
    next_runs = upcoming(schedule.cron, schedule.timezone, schedule.paused, 5)
    return SchedulePage(ScheduleRow(schedule, last), next_runs, recent)


def pretty_json(text: str | None) -> str:
    """Indented JSON for <pre> blocks (the template escapes it)."""
    text = shown_text(text)  # decoded by the payload codec; REDACTED if sensitive
    if text is None:
        return ""
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False, sort_keys=False)
    except ValueError:
        return text


@dataclass
class WaterfallSpan:
    span: Span
    depth: int
    left: float  # percent of the trace's duration
    width: float
    events: list[dict[str, Any]]  # each with "left" (percent within the bar) and "name"

    @property
    def is_error(self) -> bool:
        return self.span.status_code == "ERROR"

    @property
    def in_flight(self) -> bool:
        """Drawn from an open step (see in_flight_spans), not a stored span."""
        return self.span.pk is None and "wfdash.in_flight" in self._attributes

    @property
    def cut_short(self) -> bool:
        """Drawn from a step its instance's end cut short (see cut_short_spans)."""
        return self.span.pk is None and "wfdash.cut_short" in self._attributes

    @property
    def _attributes(self) -> dict[str, Any]:
        return self.span.attributes if isinstance(self.span.attributes, dict) else {}

    @property
    def is_wait(self) -> bool:
        """A sleep, an event wait, a child's run or a retry wait: time spent parked. The
        page compresses stretches where only such spans are open, as it does idle gaps."""
        attributes = self.span.attributes if isinstance(self.span.attributes, dict) else {}
        if attributes.get("wfdash.in_flight") in (StepStatus.WAITING, StepStatus.RETRYING):
            return True
        return attributes.get("workflow.step.type") in WAIT_KINDS

    @property
    def start_ms(self) -> int:
        return int(self.span.start_time.timestamp() * 1000)

    @property
    def end_ms(self) -> int:
        return int(self.span.end_time.timestamp() * 1000)

    @property
    def attributes_json(self) -> str:
        return json.dumps(self.span.attributes, indent=2, ensure_ascii=False, default=str)

    @property
    def events_json(self) -> str:
        return json.dumps(self.span.events, indent=2, ensure_ascii=False, default=str)


IN_FLIGHT = (StepStatus.RUNNING, StepStatus.WAITING, StepStatus.RETRYING)
WAIT_KINDS = (StepKind.SLEEP, StepKind.SLEEP_UNTIL, StepKind.WAIT_FOR_EVENT, StepKind.INVOKE)


def in_flight_spans(instance: Instance, steps: list[StepRecord], now: datetime) -> list[Span]:
    """The spans of steps still open — a running step, a sleep, an event wait, a retry
    wait — ending now: the engine stores a span only when it ends (a sleep can last a
    year), so without these a waiting instance's trace is nearly empty. Unsaved rows; the
    page grows them until the stored span replaces them."""
    return [
        _step_span(
            instance,
            r,
            f"open-{r.pk}",
            max(now, r.started_at),
            {
                "wfdash.in_flight": r.status,
                "step.attempts": r.attempts,
                **({"step.wake_at": r.wake_at.isoformat()} if r.wake_at else {}),
            },
        )
        for r in steps
        if r.status in IN_FLIGHT
    ]


def cut_short_spans(instance: Instance, steps: list[StepRecord]) -> list[Span]:
    """The spans of sleeps, event waits and child invocations that the instance's end
    (terminate, cancel) cut short: the engine never ends their spans, so the trace drew
    nothing where the instance spent its time waiting. Each ends when the instance did."""
    return [
        _step_span(
            instance,
            r,
            f"cut-{r.pk}",
            max(r.completed_at or r.started_at, r.started_at),
            {"wfdash.cut_short": True, "wfdash.ended_by": instance.status},
        )
        for r in steps
        if r.kind in WAIT_KINDS and r.last_error_name == STEP_CUT_SHORT
    ]


def _step_span(
    instance: Instance, r: StepRecord, span_id: str, end: datetime, attributes: dict[str, Any]
) -> Span:
    """An unsaved span drawn from a step row, named as the engine names the step's span."""
    return Span(
        instance_id=instance.pk,
        trace_id=instance.trace_id,
        span_id=span_id,
        name=f"step {r.label}"
        if r.kind in (StepKind.DO, StepKind.COMPENSATE)
        else f"{r.kind} {r.name}",
        kind="INTERNAL",
        start_time=r.started_at,
        end_time=end,
        status_code="UNSET",
        attributes={"workflow.step.type": r.kind, **attributes},
    )


def waterfall(spans: list[Span]) -> tuple[list[WaterfallSpan], float]:
    """Spans in tree order (children under their parent, siblings by start), with bar geometry."""
    if not spans:
        return [], 0.0
    start = min(s.start_time for s in spans)
    end = max(s.end_time for s in spans)
    total = max((end - start).total_seconds(), 1e-6)
    ids = {s.span_id for s in spans}
    children: dict[str, list[Span]] = {}
    for s in spans:
        parent = s.parent_span_id if s.parent_span_id in ids else ""
        children.setdefault(parent, []).append(s)
    out: list[WaterfallSpan] = []

    def visit(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda x: x.start_time):
            duration = max((s.end_time - s.start_time).total_seconds(), 0.0)
            marks = []
            for event in s.events if isinstance(s.events, list) else []:
                at = _event_time(event)
                offset = (
                    ((at - s.start_time).total_seconds() / duration * 100)
                    if at and duration
                    else 0.0
                )
                marks.append(
                    {
                        "left": round(min(max(offset, 0.0), 100.0), 2),
                        "name": str(event.get("name", "")),
                        "at_ms": int(at.timestamp() * 1000) if at else None,
                    }
                )
            out.append(
                WaterfallSpan(
                    s,
                    depth,
                    round((s.start_time - start).total_seconds() / total * 100, 3),
                    max(round(duration / total * 100, 3), 0.3),
                    marks,
                )
            )
            if s.span_id != parent:
                visit(s.span_id, depth + 1)

    visit("", 0)
    return out, total * 1000


def _event_time(event: Any) -> datetime | None:
    if not isinstance(event, dict):
        return None
    value = event.get("timestamp") or event.get("time")
    if isinstance(value, (int, float)):  # OTel nanoseconds since the epoch
        return datetime.fromtimestamp(value / 1e9, tz=UTC)
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            return None
        return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
    return None


# The engine closes a step that never finished with this error when its instance ends
# (terminated, cancelled): the step did not fail, it was cut short.
STEP_CUT_SHORT = "InstanceFinished"


@dataclass
class AttemptView:
    """One attempt of a step, read from its span: each attempt runs in a span of its own."""

    number: int
    span_id: str
    started_at: datetime
    duration_ms: float
    error_name: str = ""
    error_message: str = ""
    error_stack: str = ""

    @property
    def failed(self) -> bool:
        return bool(self.error_name or self.error_message)


RETRY_ERROR_EVENT = "step.retry_error"


def step_attempts(spans: list[Span]) -> dict[str, list[AttemptView]]:
    """Step label → its attempts, oldest first, from the stored `step <label>` spans: the
    duration is the span's, the error its `step.retry_error` event's (else its status)."""
    by_step: dict[str, list[Span]] = {}
    for span in spans:
        attributes = span.attributes if isinstance(span.attributes, dict) else {}
        label = attributes.get("workflow.step.name")
        if span.name == f"step {label}":
            by_step.setdefault(label, []).append(span)
    attempts: dict[str, list[AttemptView]] = {}
    for label, step_spans in by_step.items():
        rows = []
        for number, span in enumerate(sorted(step_spans, key=lambda s: s.start_time), start=1):
            failure = next(
                (
                    e.get("attributes") or {}
                    for e in reversed(span.events if isinstance(span.events, list) else [])
                    if isinstance(e, dict) and e.get("name") == RETRY_ERROR_EVENT
                ),
                None,
            )
            attempt = AttemptView(
                number,
                span.span_id,
                span.start_time,
                max((span.end_time - span.start_time).total_seconds() * 1000, 0.0),
            )
            if failure is not None:
                attempt.number = int(failure.get("step.attempt") or number)
                attempt.error_name = str(failure.get("error.name", ""))
                attempt.error_message = str(failure.get("error.message", ""))
                attempt.error_stack = str(failure.get("error.stack", ""))
            elif span.status_code == "ERROR":
                attempt.error_name, attempt.error_message = "Error", span.status_message
            rows.append(attempt)
        attempts[label] = rows
    return attempts


@dataclass
class StepView:
    """A step row as an operator reads it: the engine's bookkeeping turned into words."""

    record: StepRecord
    child: Instance | None = None  # the child workflow a step.invoke / step.start started
    attempts: list[AttemptView] = field(default_factory=list)  # from its spans, oldest first

    @property
    def shows_attempts(self) -> bool:
        """Worth unfolding: more than one attempt, or one that failed."""
        return len(self.attempts) > 1 or any(a.failed for a in self.attempts)

    @property
    def was_cut_short(self) -> bool:
        """The instance finished (terminate, cancel) while this step was still open."""
        return (
            self.record.status == StepStatus.FAILED
            and self.record.last_error_name == STEP_CUT_SHORT
        )

    @property
    def display_status(self) -> str:
        return "cancelled" if self.was_cut_short else self.record.status

    @property
    def failed_for_good_at_once(self) -> bool:
        """Failed by a NonRetryableError: no retry was ever scheduled, whatever the limit."""
        if self.record.status != StepStatus.FAILED or self.was_cut_short:
            return False
        try:
            marker = json.loads(self.record.output_json or "{}")
        except ValueError:
            return False
        return isinstance(marker, dict) and marker.get("nonretryable") is True

    @property
    def attempts_label(self) -> str:
        r = self.record
        if r.kind in (StepKind.SLEEP, StepKind.SLEEP_UNTIL, StepKind.WAIT_FOR_EVENT):
            return "—"  # a sleep or a wait has no attempts to count
        if self.failed_for_good_at_once:
            return f"{r.attempts} (not retryable)"
        return f"{r.attempts}/{r.max_attempts}"

    @property
    def has_output(self) -> bool:
        """Only a completed step has an output: a failed one stores an engine marker there."""
        return self.record.status == StepStatus.COMPLETE and self.record.output_json is not None

    @cached_property
    def output_pretty(self) -> str:
        return pretty_json(self.record.output_json)

    @property
    def output_is_large(self) -> bool:
        return (
            len(self.output_pretty) > LARGE_OUTPUT_CHARS
            or "\n" in self.output_pretty.strip()[:LARGE_OUTPUT_CHARS]
        )


@dataclass
class WaitReason:
    text: str
    at: datetime | None
    at_label: str = ""


@dataclass
class PendingEventView:
    step: str
    type: str
    timeout_at: datetime | None
    schema: str


@dataclass
class InstanceDetail:
    instance: Instance
    steps: list[StepView]
    history: list[HistoryRecord]
    pending: list[PendingEventView]
    spans: list[WaterfallSpan]
    trace_ms: float
    errors: list[ErrorRecord]
    inbox: list[InboxEvent]
    parent: Instance | None = None
    children: list[Instance] = field(default_factory=list)
    now_ms: int = 0  # when it was read: the page grows in-flight spans from there
    # How many there are when the page shows only some (the newest, see STEPS_ON_PAGE):
    steps_total: int = 0
    spans_total: int = 0
    # Completed steps a cancel would compensate, newest first (all of them, also those
    # not shown); None: read from the steps shown, which are then all the steps.
    compensable: list[str] | None = None
    children_total: int = 0
    # Whether the schedule now named as the instance's `schedule` is the one that started
    # it: its page is linked only then (a schedule made again under the name lists none
    # of the deleted one's instances).
    schedule_linked: bool = False

    @property
    def params_pretty(self) -> str:
        return pretty_json(self.instance.params_json)

    @property
    def no_output_text(self) -> str:
        """What the Output panel says when there is none."""
        status = self.instance.status
        if status == Status.ERRORED:
            return "none: the instance errored"
        if status == Status.TERMINATED:
            return "none: the instance was terminated"
        if status == Status.COMPLETE:
            return "none"
        return "no output yet"

    @property
    def waiting_on(self) -> list[WaitReason]:
        """Why a waiting instance waits: the engine's reason, else what its open steps say."""
        if (
            self.instance.status == Status.QUEUED
        ):  # flow control says why (limit, key, rate, debounce)
            return [
                WaitReason(f"queued: {self.instance.waiting_reason or 'waiting for a place'}", None)
            ]
        if self.instance.status not in (Status.WAITING, Status.PAUSED, Status.WAITING_FOR_PAUSE):
            return []
        if self.instance.waiting_reason:
            return [WaitReason(self.instance.waiting_reason, None)]
        reasons = []
        for s in self.steps:
            r = s.record
            if r.status == StepStatus.WAITING and r.kind == StepKind.INVOKE:
                child = s.child.instance_id if s.child else "?"
                reasons.append(WaitReason(f"waiting for child “{child}” ({r.name})", None))
            elif r.status == StepStatus.WAITING and r.kind == StepKind.WAIT_FOR_EVENT:
                reasons.append(
                    WaitReason(
                        f"waiting for event “{r.event_type}” ({r.name})", r.wake_at, "times out"
                    )
                )
            elif r.status == StepStatus.WAITING:
                reasons.append(WaitReason(f"sleeping in “{r.name}”", r.wake_at, "until"))
            elif r.status == StepStatus.RETRYING:
                reasons.append(
                    WaitReason(
                        f"retrying “{r.name}” (attempt {r.attempts + 1} of {r.max_attempts})",
                        r.wake_at,
                        "at",
                    )
                )
        return reasons

    @property
    def output_pretty(self) -> str:
        return pretty_json(self.instance.output_json)

    @property
    def is_live(self) -> bool:
        return self.instance.status in LIVE_STATUSES

    @property
    def can_pause(self) -> bool:
        return lifecycle.can(lifecycle.PAUSE, self.instance.status)

    @property
    def can_resume(self) -> bool:
        return lifecycle.can(lifecycle.RESUME, self.instance.status)

    @property
    def can_skip_sleep(self) -> bool:
        return any(
            s.record.kind in (StepKind.SLEEP, StepKind.SLEEP_UNTIL)
            and s.record.status == StepStatus.WAITING
            for s in self.steps
        )

    def schema_for(self, event_type: str | None) -> str:
        """The pretty schema a payload of that type must match (else the first wait's)."""
        for p in self.pending:
            if p.type == event_type:
                return p.schema
        return self.pending[0].schema if self.pending and not event_type else ""

    @property
    def spans_cut(self) -> bool:
        """The waterfall draws only the newest of the instance's spans (SPANS_ON_PAGE)."""
        return self.spans_total > SPANS_ON_PAGE

    @property
    def compensable_steps(self) -> list[str]:
        """Completed steps whose compensation a cancel would run, newest first."""
        if self.compensable is not None:
            return self.compensable
        return [
            s.record.name
            for s in reversed(self.steps)
            if s.record.has_compensation and s.record.status == StepStatus.COMPLETE
        ]

    @property
    def restartable_steps(self) -> list[str]:
        return [s.record.name for s in self.steps if s.record.kind != StepKind.COMPENSATE]

    @property
    def other_versions(self) -> list[int]:
        """The registered versions of its workflow besides its own, newest first: a restart
        may move it to one (the fix of a version that fails)."""
        own, name = self.instance.version, self.instance.workflow
        return sorted(
            (d.version for d in all_definitions() if d.name == name and d.version != own),
            reverse=True,
        )


def instance_detail(pk: int) -> InstanceDetail:
    """Everything the detail page shows: one query per table."""
    instance = Instance.objects.get(pk=pk)
    step_rows, steps_total, compensable = _shown_steps(pk)
    steps = [StepView(s) for s in step_rows]
    pending = [
        PendingEventView(
            s.record.name,
            s.record.event_type,
            s.record.wake_at,
            pretty_json(s.record.event_schema_json),
        )
        for s in steps
        if s.record.kind == StepKind.WAIT_FOR_EVENT and s.record.status == StepStatus.WAITING
    ]
    history = list(
        HistoryRecord.objects.filter(instance_id=pk).order_by("-sequence")[:HISTORY_ON_PAGE]
    )
    stored, spans_total = _shown_spans(pk)
    now = clock.now()
    records = [s.record for s in steps]
    drawn = in_flight_spans(instance, records, now) + cut_short_spans(instance, records)
    spans, trace_ms = waterfall(stored + drawn)
    errors = list(ErrorRecord.objects.filter(instance_id=pk).order_by("-id")[:20])
    inbox = list(InboxEvent.objects.filter(instance_id=pk).order_by("-id")[:50])
    parent = Instance.objects.filter(pk=instance.parent_id).first() if instance.parent_id else None
    # Looked up whatever the steps: a restart drops the steps that started the children,
    # not the children (its replay finds them again). The newest CHILDREN_ON_PAGE, and
    # those of the steps shown (one look-up by (parent, parent_step), its index).
    children, children_total = _shown_children(pk)
    starting = {
        s.record.name for s in steps if s.record.kind in (StepKind.INVOKE, StepKind.START_CHILD)
    }
    by_step = {c.parent_step: c for c in children if c.parent_step in starting}
    if starting - set(by_step):
        by_step.update(
            (c.parent_step, c)
            for c in Instance.objects.filter(parent_id=pk, parent_step__in=starting - set(by_step))
        )
    attempts = step_attempts(stored)
    for s in steps:
        if s.record.kind in (StepKind.DO, StepKind.COMPENSATE):
            s.attempts = attempts.get(s.record.label, [])
    for s in steps:
        if s.record.kind in (StepKind.INVOKE, StepKind.START_CHILD):
            s.child = by_step.get(s.record.name)
    return InstanceDetail(
        instance,
        steps,
        history,
        pending,
        spans,
        trace_ms,
        errors,
        inbox,
        parent,
        children,
        int(now.timestamp() * 1000),
        steps_total,
        spans_total,
        compensable,
        children_total,
        store.schedules.schedule_that_started(instance) is not None,
    )


def _shown_steps(pk: int) -> tuple[list[StepRecord], int, list[str] | None]:
    """The steps the page shows, in start order: every one, or for a big instance the
    newest STEPS_ON_PAGE and every older one still open (a running step, a sleep, a wait,
    a retry) or cut short by the instance's end (the trace draws those); how many there
    are; and, for a big instance, the names of the completed steps a cancel would
    compensate, newest first (None: the page reads them from the steps shown)."""
    rows = StepRecord.objects.filter(instance_id=pk)
    newest = list(rows.order_by("-seq")[: STEPS_ON_PAGE + 1])
    if len(newest) <= STEPS_ON_PAGE:
        return newest[::-1], len(newest), None
    newest = newest[:STEPS_ON_PAGE]
    older = rows.filter(seq__lt=newest[-1].seq).filter(
        Q(status__in=IN_FLIGHT) | Q(kind__in=WAIT_KINDS, last_error_name=STEP_CUT_SHORT)
    )
    compensable = rows.filter(
        kind=StepKind.DO, status=StepStatus.COMPLETE, has_compensation=True
    ).order_by("-seq")
    return (
        [*older.order_by("seq"), *newest[::-1]],
        rows.count(),
        list(compensable.values_list("name", flat=True)),
    )


def _shown_children(pk: int) -> tuple[list[Instance], int]:
    """The newest CHILDREN_ON_PAGE children, oldest first, and how many there are."""
    rows = Instance.objects.filter(parent_id=pk)
    newest = list(rows.order_by("-id")[: CHILDREN_ON_PAGE + 1])
    if len(newest) <= CHILDREN_ON_PAGE:
        return newest[::-1], len(newest)
    return newest[:CHILDREN_ON_PAGE][::-1], rows.count()


def _shown_spans(pk: int) -> tuple[list[Span], int]:
    """The stored spans the waterfall draws, by start: every one, or for a big instance
    the newest SPANS_ON_PAGE and the spans they are children of; and how many there are."""
    rows = Span.objects.filter(instance_id=pk)
    newest = list(rows.order_by("-start_time")[: SPANS_ON_PAGE + 1])
    if len(newest) <= SPANS_ON_PAGE:
        return newest[::-1], len(newest)
    newest = newest[:SPANS_ON_PAGE]
    ids = {s.span_id for s in newest}
    parents = {s.parent_span_id for s in newest if s.parent_span_id} - ids
    if parents:
        newest += rows.filter(span_id__in=parents)
    return sorted(newest, key=lambda s: s.start_time), rows.count()


class InstanceSummaryJSON(TypedDict):
    pk: int
    id: str
    workflow: str
    version: int
    status: str
    updated_at: str
    finished_at: str | None
    error: str


def instance_summary(row: Instance) -> InstanceSummaryJSON:
    """The JSON a socket sends when an instance changes."""
    return {
        "pk": row.pk,
        "id": row.instance_id,
        "workflow": row.workflow,
        "version": row.version,
        "status": row.status,
        "updated_at": row.updated_at.isoformat(),
        "finished_at": row.finished_at.isoformat() if row.finished_at else None,
        "error": row.error_name,
    }


def error_page(
    workflow: str = "",
    after: str | None = None,
    before: str | None = None,
    limit: int = PAGE_SIZE,
) -> Page:
    """ErrorRecord newest first, keyset-paginated both ways like the instance list."""
    query = ErrorRecord.objects.select_related("instance").only(
        "id",
        "workflow",
        "source",
        "step_name",
        "attempt",
        "name",
        "message",
        "trace_id",
        "span_id",
        "created_at",
        "instance__id",
        "instance__instance_id",
        "instance__workflow",
    )
    if workflow:
        query = query.filter(workflow=workflow)
    return _keyset_page(query, after, before, limit, _by_id)


def workflow_names() -> list[str]:
    """Registered workflows plus any seen in the catalog (old versions may have instances)."""
    names = {d.name for d in all_definitions()}
    names.update(WorkflowVersion.objects.values_list("name", flat=True).distinct())
    return sorted(names)
