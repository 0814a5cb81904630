"""OpenTelemetry metrics: the SDK's MeterProvider, served in Prometheus text at /metrics
and exported over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT (or ..._METRICS_ENDPOINT) is set
and OTEL_METRICS_EXPORTER (default otlp) does not say "none".

The engine records its instruments through the API (engine/meters.py) in the process
that runs each instance. In a fleet that is a worker, not the web process that serves
/metrics, so a scrape also reads fleet-wide gauges from the database: unfinished
instances by workflow and status (and their sum by status, the backlog) and those that
finished in the last hour; never the whole history, which only grows. Those callbacks query only during a scrape, in its request thread; the OTLP
exporter's background thread gets nothing from them (each worker would report the same
fleet-wide numbers, and its thread would hold a database connection).
"""

from __future__ import annotations

import atexit
import contextvars
import os
import threading
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from django.db import connection
from django.db.models import Count, QuerySet
from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from . import tracing
from .engine import clock, lifecycle
from .models import LIVE_STATUSES_SQL, Instance

__all__ = ["CONTENT_TYPE_LATEST", "configure", "scrape", "serve_process_metrics"]

# Counts read once per scrape, shared by the gauges that need them; None outside a scrape.
_scrape_counts: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "wfdash_scrape_counts", default=None
)
_provider: MeterProvider | None = None
_registry: CollectorRegistry | None = None
_lock = threading.Lock()


def otlp_configured() -> bool:
    return tracing.exports_otlp("metrics")


def configure(extra_readers: Iterable[MetricReader] = ()) -> MeterProvider:
    """Install wfdash's meter provider as the global one (once per process).

    If the project installed an SDK MeterProvider first, the engine's instruments go to
    that one (its readers decide where they are exported); /metrics then serves the
    database gauges only.
    """
    global _provider, _registry
    with _lock:
        if _provider is not None:
            return _provider
        from opentelemetry.exporter.prometheus import PrometheusMetricReader

        _registry = CollectorRegistry(auto_describe=True)
        readers: list[MetricReader] = [PrometheusMetricReader(registry=_registry)]
        otlp = otlp_configured()
        if otlp:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        readers.extend(extra_readers)
        provider = MeterProvider(
            metric_readers=readers,
            exemplar_filter=_exemplar_filter(otlp),
            resource=tracing.resource(),
            shutdown_on_exit=False,  # at exit within tracing's bound instead (below)
        )
        atexit.register(tracing.within_exit_bound, provider.shutdown)
        if not isinstance(metrics.get_meter_provider(), MeterProvider):
            metrics.set_meter_provider(provider)
        meter = provider.get_meter("wfdash.database")
        meter.create_observable_gauge(
            "wfdash.instances",
            callbacks=[_observe_instances],
            unit="{instance}",
            description="unfinished instances in the database by workflow and status (fleet-wide)",
        )
        meter.create_observable_gauge(
            "wfdash.backlog",
            callbacks=[_observe_backlog],
            unit="{instance}",
            description="unfinished instances by status, all workflows (fleet-wide)",
        )
        meter.create_observable_gauge(
            "wfdash.instances.finished.last_hour",
            callbacks=[_observe_finished_last_hour],
            unit="{instance}",
            description="instances that finished in the last hour, by workflow and status",
        )
        _provider = provider
        return provider


def _exemplar_filter(otlp: bool | None = None) -> Any:
    """No exemplars unless something exports them: Prometheus text carries none, while
    sampling one (reading the current span, offering it to a reservoir) was a fifth of
    each step-duration record. OTLP keeps the SDK's default (trace-based);
    OTEL_METRICS_EXEMPLAR_FILTER, when set, decides."""
    if otlp is None:
        otlp = otlp_configured()
    if otlp or os.environ.get("OTEL_METRICS_EXEMPLAR_FILTER"):
        return None  # the SDK reads the variable, trace_based by default
    return AlwaysOffExemplarFilter()


def serve_process_metrics(port: int, addr: str) -> Any:
    """This process's instruments over HTTP for Prometheus, in a thread of their own (a
    worker's runs, steps and latencies; the database gauges stay with the web's /metrics).
    Returns the server (its shutdown() stops it)."""
    configure()
    assert _registry is not None
    server, _ = start_http_server(port, addr=addr, registry=_registry)
    return server


def scrape() -> bytes:
    """The Prometheus text of every wfdash metric, the database gauges read now."""
    configure()
    assert _registry is not None
    token = _scrape_counts.set({})
    try:
        # Read before the callbacks do: the SDK logs and drops a callback's error, and a
        # scrape without its database gauges looked like a healthy target whose backlog
        # vanished. A DatabaseError raised here is the caller's (a 503 at /metrics).
        _by_workflow_and_status()
        _finished_last_hour()
        return generate_latest(_registry)
    finally:
        _scrape_counts.reset(token)


def _counts(key: str, query: Any) -> list[dict[str, Any]] | None:
    cache = _scrape_counts.get()
    if cache is None:
        return None
    if key not in cache:
        cache[key] = list(query())
    return cache[key]


def live_counts() -> QuerySet[Instance]:
    """Unfinished instances only, through their partial index: counting the finished ones
    too read the whole table at every scrape (1.1 s at 3 million rows on PostgreSQL). The
    statuses are spelled as the index's condition: SQLite uses it for literals only.
    COUNT(*), not COUNT(id): the index holds (workflow, status), so PostgreSQL counts
    from it alone; counting ids read each row from the table too (at 100,000 unfinished
    instances 330-420 ms a scrape, 28-40 ms from the index)."""
    return (
        Instance.objects.extra(where=[LIVE_STATUSES_SQL])
        .order_by()
        .values("workflow", "status")
        .annotate(n=Count("*"))
    )


def _by_workflow_and_status() -> list[dict[str, Any]] | None:
    return _counts("live", live_counts)


def _observe_instances(options: CallbackOptions) -> Iterable[Observation]:
    for row in _by_workflow_and_status() or ():
        yield Observation(row["n"], {"workflow": row["workflow"], "status": row["status"]})


def _observe_backlog(options: CallbackOptions) -> Iterable[Observation]:
    rows = _by_workflow_and_status()
    if rows is None:
        return
    backlog = dict.fromkeys(sorted(lifecycle.LIVE), 0)
    for row in rows:
        if row["status"] in backlog:
            backlog[row["status"]] += row["n"]
    for status, n in backlog.items():
        yield Observation(n, {"status": status})


def _finished_last_hour() -> list[dict[str, Any]] | None:
    return _counts(
        "last_hour",
        lambda: (
            _finished_since(clock.now() - timedelta(hours=1))
            .order_by()
            .values("workflow", "status")
            .annotate(n=Count("id"))
        ),
    )


def _observe_finished_last_hour(options: CallbackOptions) -> Iterable[Observation]:
    for row in _finished_last_hour() or ():
        yield Observation(row["n"], {"workflow": row["workflow"], "status": row["status"]})


def _finished_since(since: datetime) -> QuerySet[Instance]:
    """The finished_at index's range. SQLite plans without statistics and would rather
    walk the whole (workflow, status) index, which gives the GROUP BY its order for free;
    unlikely() tells it the range is narrow."""
    if connection.vendor != "sqlite":
        return Instance.objects.filter(finished_at__gte=since)
    return Instance.objects.extra(
        where=["unlikely(finished_at >= %s)"],
        params=[connection.ops.adapt_datetimefield_value(since)],
    )
