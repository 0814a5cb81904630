"""The metrics the engine records, through the OpenTelemetry API only (like spans.py).

workflows_app.metrics installs the SDK's MeterProvider (Prometheus at /metrics, OTLP when
configured); until then, and in projects without it, these calls cost a no-op. They are
counted in the process that runs the instance: in a fleet each worker exports its own
(OTLP), while /metrics adds fleet-wide numbers read from the database at scrape time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from datetime import datetime
from functools import cache
from typing import Any

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

# Seconds: from sub-millisecond no-op steps to the 30-minute step timeout, and queue
# waits and event latencies up to a day.
DURATION_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    1800.0,
    3600.0,
    86400.0,
)


class _Tally:
    """Counts kept in the process, read by an observable counter when metrics are
    collected (a scrape, an OTLP export): an increment under a lock instead of the SDK's
    add(), whose attribute cleaning, hashing and aggregation cost 6 µs per call, twice per
    instance in a herd of timers. Cumulative since the process started, as the SDK's
    counters were."""

    def __init__(self, *keys: str) -> None:
        self.keys = keys
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, ...], int] = {}

    def add(self, *values: str) -> None:
        with self._lock:
            self._counts[values] = self._counts.get(values, 0) + 1

    def observe(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            counts = list(self._counts.items())
        for values, count in counts:
            yield Observation(count, dict(zip(self.keys, values)))


_started = _Tally("workflow")
_finished = _Tally("workflow", "status")


_enabled = True


def set_enabled(enabled: bool) -> None:
    """Switch the engine's instruments on or off (WFDASH["METRICS"]): off, they are
    no-ops, rather than instruments of a meter provider the project installed."""
    global _enabled
    _enabled = enabled
    _instruments.cache_clear()


@cache
def _instruments() -> dict[str, Any]:
    if not _enabled:
        meter: metrics.Meter = metrics.NoOpMeter("wfdash.engine")
    else:
        meter = metrics.get_meter("wfdash.engine")
    meter.create_observable_counter(
        "wfdash.instances.started",
        callbacks=[_started.observe],
        unit="{instance}",
        description="instances that began running",
    )
    meter.create_observable_counter(
        "wfdash.instances.finished",
        callbacks=[_finished.observe],
        unit="{instance}",
        description="instances that ended, by status (complete, errored, terminated)",
    )
    return {
        "step_duration": meter.create_histogram(
            "wfdash.step.duration",
            unit="s",
            description="one attempt of a step's callable, by outcome (ok, error)",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        ),
        "queue_wait": meter.create_histogram(
            "wfdash.queue.wait",
            unit="s",
            description="from create() to the instance's admission (0 unless it was queued)",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        ),
        "event_latency": meter.create_histogram(
            "wfdash.event.latency",
            unit="s",
            description="from send_event to the wait_for_event that received it",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        ),
    }


def instance_started(workflow: str, created_at: datetime, started_at: datetime | None) -> None:
    instruments = _instruments()
    _started.add(workflow)
    if started_at is not None:
        waited = max(0.0, (started_at - created_at).total_seconds())
        instruments["queue_wait"].record(waited, {"workflow": workflow})


def instance_restarted(workflow: str) -> None:
    """A finished instance runs again: a start of its own, as its end is counted again
    (no queue wait: no create began it). A live one's restart is not: it never ended."""
    _instruments()
    _started.add(workflow)


def instance_finished(workflow: str, status: str) -> None:
    _instruments()  # the counters exist once anything is counted
    _finished.add(workflow, str(status))


# Step names are unique per run, so loops make them (`item 0`, `item 1`, …), and an event
# type may be built from the instance (`paid-{order}`): past this many names (types) of
# one workflow in this process, the rest share the label OTHER_LABEL rather than fill the
# SDK's 2,000 series per instrument (the overflow takes every new series of every
# workflow, and its one series has no workflow label). Past MAX_LABELS_TOTAL names of all
# workflows, a workflow gets its first MIN_LABELS only: ten workflows that each looped
# used their 100 names twice over (outcome ok and error), and every step of an eleventh
# went to the overflow. The step histogram then holds at most
# 2 x (MAX_LABELS_TOTAL + (MIN_LABELS + 1) a workflow) series: under the SDK's 2,000 up
# to 50 workflows that all loop.
MAX_LABELS = 100
MAX_LABELS_TOTAL = 800
MIN_LABELS = 10
OTHER_LABEL = "(other)"


class _Labels:
    """The label values of one attribute (step names, event types) given out so far."""

    def __init__(self) -> None:
        self.by_workflow: dict[str, set[str]] = {}
        self.total = 0


_step_labels = _Labels()
_event_type_labels = _Labels()
_labels_lock = threading.Lock()


def _capped_label(seen: _Labels, workflow: str, value: str) -> str:
    known = seen.by_workflow.get(workflow)
    if known is not None and value in known:
        return value
    with _labels_lock:
        known = seen.by_workflow.setdefault(workflow, set())
        if value in known:
            return value
        n = len(known)
        if n < MAX_LABELS and (n < MIN_LABELS or seen.total < MAX_LABELS_TOTAL):
            known.add(value)
            seen.total += 1
            return value
    return OTHER_LABEL


def step_attempted(workflow: str, step: str, seconds: float, ok: bool) -> None:
    _instruments()["step_duration"].record(
        seconds,
        {
            "workflow": workflow,
            "step": _capped_label(_step_labels, workflow, step),
            "outcome": "ok" if ok else "error",
        },
    )


def event_received(workflow: str, event_type: str, sent_at: datetime, now: datetime) -> None:
    _instruments()["event_latency"].record(
        max(0.0, (now - sent_at).total_seconds()),
        {"workflow": workflow, "type": _capped_label(_event_type_labels, workflow, event_type)},
    )


class timed_attempt:
    """Record the duration of the attempt inside, ok or error (not when it is cancelled:
    a terminate or a lost lease is no outcome of the step). A class, not a generator
    context manager: it wraps every attempt of every step."""

    __slots__ = ("began", "step", "workflow")

    def __init__(self, workflow: str, step: str) -> None:
        self.workflow = workflow
        self.step = step
        self.began = time.perf_counter()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None or issubclass(kind, Exception):
            seconds = time.perf_counter() - self.began
            step_attempted(self.workflow, self.step, seconds, ok=kind is None)
