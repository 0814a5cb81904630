"""OpenTelemetry set-up: the tracer provider, the processor that stores spans in the
database for the dashboard, and OTLP export when OTEL_EXPORTER_OTLP_ENDPOINT is set
(and OTEL_TRACES_EXPORTER, default otlp, does not say "none").
The export sampler (OTEL_TRACES_SAMPLER) decides what is exported, not what is stored:
an instance's spans the sampler drops are still recorded, as not sampled.

Spans end on the engine's event loop, where the ORM must not run; the processor only
queues them, and the engine flushes the queue from its database thread after runs and
when idle. Where no engine runs (a web process of a fleet), the client flushes the
`create` spans it makes itself.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import DEFAULT_ON, Decision, Sampler, SamplingResult
from opentelemetry.trace import get_current_span

from .engine import spans as engine_spans
from .engine.limits import storable_text

log = logging.getLogger("workflows_app.tracing")

MAX_QUEUED_SPANS = 100_000  # beyond this, spans are dropped (and counted) rather than grow memory

# How long a process's exit waits for its last OTLP export, of traces and of metrics each.
# The SDK's shutdown waited out each exporter's retries (OTEL_EXPORTER_OTLP_TIMEOUT, 10 s),
# one signal after the other: 11-15 s after a SIGTERM's drain with the collector down.
EXIT_EXPORT_SECONDS = 2.0


LOOKUP_INSTANCES = 500  # keys per look-up of the instances still there (SQLite: 32,766 parameters)

SPAN_COLUMNS = (
    "instance_id, trace_id, span_id, parent_span_id, name, kind, start_time, end_time, "
    "status_code, status_message, attributes, events, links"
)


# A span's start and end go to PostgreSQL as integer microseconds since the epoch: their
# ISO text cost 2.6 µs each to make, half of a row's cost (the server parses it too).
# Whole seconds and the rest apart: an interval times a number goes through a double.
_MICROS_TO_TIME = (
    "(TIMESTAMPTZ 'epoch' + {0} / 1000000 * INTERVAL '1 second'"
    " + {0} %% 1000000 * INTERVAL '1 microsecond')"
)


# nanoseconds // 1000, called with no Python frame (two span times a row, a herd's rows).
_micros = (1000).__rfloordiv__


@functools.cache
def _span_sql() -> tuple[str, str, str]:
    """(PostgreSQL's INSERT, SQLite's look-up of the instances still there, SQLite's
    INSERT of one row) for stored spans. Each span comes with its instance's key (the
    trace id generator knows it): no index of the instances' trace ids is read, nor
    written by each insert and indexed update of an instance row. The key is taken only
    if that row still has the span's trace: a create rolled back after its span was
    queued may have left its key to the next instance (SQLite hands a rolled-back id out
    again)."""
    from .models import Instance, Span

    table, instances = Span._meta.db_table, Instance._meta.db_table
    # The batch is one JSON parameter (encoded in C, parsed by the server): psycopg dumps
    # a list parameter element by element in Python, which cost 15 % of the engine's
    # database threads in a herd of timers.
    postgres = (
        f"INSERT INTO {table} ({SPAN_COLUMNS}) SELECT "
        f"(SELECT id FROM {instances} WHERE id = r.i AND trace_id = r.t), r.t, r.s, r.p, "
        f"r.n, r.k, {_MICROS_TO_TIME.format('r.st')}, {_MICROS_TO_TIME.format('r.e')}, "
        "r.c, r.m, r.a, r.ev, r.l "
        "FROM json_to_recordset(CAST(%s AS json)) AS r(i bigint, t text, s text, p text, "
        "n text, k text, st bigint, e bigint, c text, m text, a jsonb, ev jsonb, l jsonb) "
        "RETURNING span_id, instance_id"
    )
    # SQLite: one statement of one row, run for the whole batch (executemany), after one
    # look-up of the batch's instances; a VALUES list of the batch's length was a
    # statement of new text for each batch size (parsed, and its %s converted, anew):
    # 28 against 10 µs a row (docs/performance.md, twelfth round).
    lookup = f"SELECT id, trace_id FROM {instances} WHERE id IN "
    row = f"INSERT INTO {table} ({SPAN_COLUMNS}) VALUES ({', '.join(['%s'] * 13)})"
    return postgres, lookup, row


class StoredSpan(NamedTuple):
    instance_id: int | None
    trace_id: str
    span_id: str
    name: str
    status_code: str


MAX_KNOWN_TRACES = 100_000


class InstanceTraceIds(IdGenerator):
    """Root spans of a run take the instance's trace id: one trace per instance.

    It remembers (boundedly) which trace ids belong to instances, and which instance's
    each is, so the database keeps the spans of workflow instances and not every span
    the project's own code makes, and stores each with its instance's key.
    """

    def __init__(self, fallback: IdGenerator | None = None) -> None:
        self.known: OrderedDict[int, int] = OrderedDict()  # trace id -> instance pk
        self._lock = threading.Lock()
        self.fallback = fallback or RandomIdGenerator()

    @property
    def fallback(self) -> IdGenerator:
        """The generator of every span id and of the trace ids of no instance."""
        return self._fallback

    @fallback.setter
    def fallback(self, generator: IdGenerator) -> None:
        self._fallback = generator
        # Span ids straight from it: the tracer asks once a span (three an instance in a
        # herd of timers), with no call of this class in between.
        self.generate_span_id = generator.generate_span_id  # type: ignore[method-assign]

    def generate_span_id(self) -> int:
        return self._fallback.generate_span_id()

    def generate_trace_id(self) -> int:
        forced = engine_spans.forced_trace.get()
        if not forced:
            return self._fallback.generate_trace_id()
        trace_id, instance_pk = forced
        with self._lock:
            self.known[trace_id] = instance_pk
            self.known.move_to_end(trace_id)
            if len(self.known) > MAX_KNOWN_TRACES:
                self.known.popitem(last=False)
        return trace_id

    def instance_of(self, trace_id: int) -> int | None:
        """The key of the instance whose trace this is (None: not an instance's trace),
        kept among the recent traces: a span of it ended, so a long run's trace is not
        forgotten while its spans still come. (Kept at each span's end rather than at its
        start: the processor then needs no on_start, three calls a span in a herd.)"""
        known = self.known
        instance_pk = known.get(trace_id)
        if instance_pk is not None:
            with self._lock:
                if trace_id in known:
                    known.move_to_end(trace_id)
        return instance_pk


class RecordInstanceTraces(Sampler):
    """The configured sampler's decision, except that a span of an instance's trace it
    drops is recorded all the same, not sampled: the store keeps every span of every
    instance (the dashboard shows each instance's trace), while exporters, which take
    only sampled spans, still export what the sampler chose. The sampler decides by
    trace id or by the parent, so a trace is exported whole or not at all; the project's
    own traces it drops stay unrecorded."""

    def __init__(self, sampler: Sampler, trace_ids: InstanceTraceIds) -> None:
        self.sampler = sampler
        self._known = trace_ids.known
        # The SDK's default (OTEL_TRACES_SAMPLER unset or parentbased_always_on): its
        # decision is the parent's sampled flag, or sampled for a root span. Taken here
        # from the parent's span context, not through ParentBased, its static sampler and
        # a second read of the parent for its trace state: 17 Python calls a span down to
        # 6, three spans an instance in a herd of timers.
        self._parent_based_on = sampler is DEFAULT_ON

    def should_sample(
        self,
        parent_context: Any,
        trace_id: int,
        name: str,
        kind: Any = None,
        attributes: Any = None,
        links: Any = None,
        trace_state: Any = None,
    ) -> SamplingResult:
        if self._parent_based_on:
            parent = get_current_span(parent_context).get_span_context()
            if parent is None or not parent.is_valid:
                return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes, None)
            if parent.trace_flags.sampled:
                return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes, parent.trace_state)
            if trace_id in self._known:
                return SamplingResult(Decision.RECORD_ONLY, attributes, parent.trace_state)
            return SamplingResult(Decision.DROP, None, parent.trace_state)
        result = self.sampler.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )
        if result.decision is Decision.DROP and trace_id in self._known:
            return SamplingResult(Decision.RECORD_ONLY, attributes, result.trace_state)
        return result

    def get_description(self) -> str:
        return f"RecordInstanceTraces{{{self.sampler.get_description()}}}"


def _iso_time(nanoseconds: int) -> str:
    return engine_spans.instant(nanoseconds).isoformat()


def _attributes(attributes: Any) -> dict[str, Any]:
    """An SDK span's, event's or link's attributes as a plain dict. The SDK cleaned them
    on the way in, and its mapping copies to a dict in C; read key by key it cost a
    tenth of a stored row. Values JSON has no type for are _json's to encode."""
    if not attributes:
        return {}
    copied = attributes.copy() if hasattr(attributes, "copy") else attributes
    return copied if type(copied) is dict else dict(copied)


def _json_fallback(value: Any) -> Any:
    """What JSON cannot say of an attribute value: bytes as text (invalid UTF-8 replaced),
    anything else as its str()."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


# A cleaned attribute value is a str, bool, int, float, None, bytes, or a sequence or a
# mapping of those. Prebuilt: json.dumps with options builds an encoder per call.
_ENCODE = json.JSONEncoder(default=_json_fallback, allow_nan=False).encode
_ENCODE_COMPACT = json.JSONEncoder(
    separators=(",", ":"), default=_json_fallback, allow_nan=False
).encode


def _json(value: Any, encode: Any = _ENCODE) -> str:
    """JSON text of span data that both databases store: a NaN or an infinity (no JSON
    number) and a NUL character (PostgreSQL's text and jsonb take none) are written as
    text; one such value must not lose the spans stored with it."""
    try:
        text = encode(value)
    except ValueError:
        return encode(_storable(value))
    # A NUL, or a surrogate escape (a lone one has no UTF-8; a pair is cleaned as one
    # character): written again from cleaned values.
    return encode(_storable(value)) if "\\u0000" in text or "\\ud" in text else text


def _fast_json(value: Any) -> str:
    """_json's text (compact) by orjson, about a fifth of its time (batch_json). A text
    holding null (orjson's NaN or infinity), or a NUL, is written again by _json, which
    cleans them; a value orjson refuses (an int past 64 bits, a lone surrogate) too."""
    from .engine.store.dialect import batch_json  # the store needs Django's apps ready

    text = batch_json(value, _json_fallback)
    if text is None or "null" in text or "\\u0000" in text:
        return _json(value, _ENCODE_COMPACT)
    return text


def _storable(value: Any) -> Any:
    """value with its text as both databases store text: no NUL, no lone surrogate (an
    exception's message may hold one, as an undecodable file name does)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, (bytes, bytearray)):
        return _storable(_json_fallback(value))
    if isinstance(value, dict):
        return {storable_text(str(k)): _storable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_storable(v) for v in value]
    return value


class DatabaseSpanProcessor(SpanProcessor):
    """Queues finished spans; flush() writes them in one bulk insert."""

    def __init__(self, trace_ids: InstanceTraceIds) -> None:
        self._queue: list[tuple[ReadableSpan, int]] = []  # each with its instance's key
        self._lock = threading.Lock()
        self.trace_ids = trace_ids
        self.dropped = 0

    def on_end(self, span: ReadableSpan) -> None:
        instance_pk = self.trace_ids.instance_of(span.context.trace_id)
        if instance_pk is None:
            return  # not a workflow instance's span: exported, if at all, by the project's own set-up
        with self._lock:
            if len(self._queue) >= MAX_QUEUED_SPANS:
                self.dropped += 1
                return
            self._queue.append((span, instance_pk))

    def pending(self) -> int:
        return len(self._queue)

    def flush(self) -> list[StoredSpan]:
        """Store the queued spans in one transaction (call where the ORM may run)."""
        from django.db import DatabaseError, InterfaceError, OperationalError

        with self._lock:
            batch, self._queue = self._queue, []
        if not batch:
            return []
        try:
            return self._store(batch)
        except (OperationalError, InterfaceError):
            self._requeue(batch)  # the database was away; nothing was stored: again next time
            raise
        except DatabaseError:
            self.dropped += len(batch)  # would fail again (an instance deleted meanwhile, bad data)
            raise
        except Exception:
            self.dropped += len(batch)  # a row no driver takes: counted, not silently gone
            raise

    def _store(self, batch: list[tuple[ReadableSpan, int]]) -> list[StoredSpan]:
        from django.db import connection, transaction

        from .engine.store.dialect import (
            ns_time_adapter,
            sql_cursor,
            statement_cursor,
        )

        postgres = connection.vendor == "postgresql"
        # (instance key, trace id, span id, parent, name, kind, start, end, status, message,
        # attributes, events, links) of each span, in order; on SQLite the last three as
        # JSON text.
        when = _micros if postgres else ns_time_adapter(connection)
        rows = [self._row(span, pk, postgres, when) for span, pk in batch]
        insert, lookup, insert_one = _span_sql()
        if postgres:
            # Each row looks its instance up by key inside the INSERT (NULL if it was
            # deleted meanwhile, or the key is another trace's) and RETURNING says which it
            # found. One statement of one shape whatever the batch: prepared once per
            # connection, its text never rebuilt nor parsed again.
            keys = ("i", "t", "s", "p", "n", "k", "st", "e", "c", "m", "a", "ev", "l")
            spans = [dict(zip(keys, row)) for row in rows]
            with statement_cursor() as cursor:
                cursor.execute(insert, [_fast_json(spans)])
                by_span: dict[str, int | None] = dict(cursor.fetchall())
            return [StoredSpan(by_span.get(r[2]), r[1], r[2], r[4], r[8]) for r in rows]
        # SQLite: the transaction is IMMEDIATE (settings), so no instance the look-up found
        # can go before the rows naming it are written (a deferred one that lost the race
        # fails as busy: the batch is queued again, nothing half-stored).
        there: set[tuple[int, str]] = set()  # (key, trace id) of the instances still there
        pks = list(dict.fromkeys(row[0] for row in rows))
        with transaction.atomic(), sql_cursor() as cursor:
            for start in range(0, len(pks), LOOKUP_INSTANCES):
                chunk = pks[start : start + LOOKUP_INSTANCES]
                cursor.execute(lookup + f"({', '.join(['%s'] * len(chunk))})", chunk)
                there.update(cursor.fetchall())
            rows = [(row[0] if row[:2] in there else None, *row[1:]) for row in rows]
            cursor.executemany(insert_one, rows)
        return [StoredSpan(r[0], r[1], r[2], r[4], r[8]) for r in rows]

    @staticmethod
    def _row(span: ReadableSpan, instance_pk: int, postgres: bool, when: Any) -> tuple[Any, ...]:
        # Most spans have no events, no links and no status message: those are not walked
        # nor encoded (a herd instance's three spans made a tenth of its calls here).
        attributes = _attributes(span.attributes)
        events: Any = span.events
        if events:
            events = [
                {
                    "name": e.name,
                    "time": _iso_time(e.timestamp),
                    "attributes": _attributes(e.attributes),
                }
                for e in events
            ]
        links: Any = span.links
        if links:
            links = [
                {
                    "trace_id": format(link.context.trace_id, "032x"),
                    "span_id": format(link.context.span_id, "016x"),
                    "attributes": _attributes(link.attributes),
                }
                for link in links
            ]
        context, parent, status = span.context, span.parent, span.status
        message = status.description
        return (
            instance_pk,
            format(context.trace_id, "032x"),
            format(context.span_id, "016x"),
            format(parent.span_id, "016x") if parent else "",
            storable_text(span.name[:300]),
            span.kind._name_,  # Enum's documented attribute; .name is two Python calls
            when(span.start_time or 0),
            when(span.end_time or 0),
            status.status_code._name_,
            storable_text(message) if message else "",
            *(
                (attributes, events or [], links or [])
                if postgres
                else (
                    _fast_json(attributes),
                    _fast_json(events) if events else "[]",
                    _fast_json(links) if links else "[]",
                )
            ),
        )

    def _requeue(self, batch: list[tuple[ReadableSpan, int]]) -> None:
        with self._lock:
            room = max(0, MAX_QUEUED_SPANS - len(self._queue))
            self.dropped += max(0, len(batch) - room)
            self._queue[:0] = batch[:room]

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def within_exit_bound(shutdown: Callable[..., Any]) -> None:
    """Run an SDK shutdown (an exporter's, at the process's exit) with EXIT_EXPORT_SECONDS
    as its own timeout: it joins its export thread (a daemon) that long, then tells the
    exporter to stop retrying, and the exit goes on. (No thread of ours: Python 3.12 and
    later refuse to start one in an atexit callback.) An export blocked on a collector
    that accepts and never answers ends only at its own timeout, or with the process."""
    started = time.monotonic()
    shutdown(timeout_millis=EXIT_EXPORT_SECONDS * 1000)
    if time.monotonic() - started >= EXIT_EXPORT_SECONDS * 0.95:
        log.warning(
            "OTLP export at exit unfinished after %.0f s (the collector is down?): "
            "exiting without it",
            EXIT_EXPORT_SECONDS,
        )


class ExitBoundedSpanProcessor(BatchSpanProcessor):
    """The OTLP batch processor, its shutdown (the provider's at exit) bounded. The
    SDK's BatchSpanProcessor.shutdown takes no timeout (its batch processor waits 30 s);
    the batch processor's own shutdown does, so it is called with ours."""

    def shutdown(self) -> None:
        batch = getattr(self, "_batch_processor", None)
        if batch is None:  # an SDK that keeps it elsewhere: its own (unbounded) way
            super().shutdown()
        else:
            within_exit_bound(batch.shutdown)


_provider: TracerProvider | None = None
_store: DatabaseSpanProcessor | None = None
_configure_lock = threading.Lock()


def configure() -> TracerProvider:
    """Set up the global tracer provider once per process, since the engine's spans go
    through the global one: wfdash's own, or the SDK provider the project installed
    before (Sentry's SDK, its own set-up). The store, and the OTLP exporter when an
    endpoint is set, are added to that provider: on a provider of ours that went unused,
    the exporter exported nothing."""
    global _provider, _store
    with _configure_lock:
        if _provider is not None:
            return _provider
        trace_ids = InstanceTraceIds()
        _store = DatabaseSpanProcessor(trace_ids)
        current = trace.get_tracer_provider()
        if isinstance(current, TracerProvider):
            # Our trace ids in front of its generator (tracers made from now on use them).
            trace_ids.fallback = current.id_generator
            current.id_generator = trace_ids
            provider = current
        else:
            provider = TracerProvider(
                resource=resource(),
                id_generator=trace_ids,
            )
        # Its sampler (OTEL_TRACES_SAMPLER's, or the project's) still decides what is
        # exported; instances' spans are recorded whatever it decides.
        provider.sampler = RecordInstanceTraces(provider.sampler, trace_ids)
        provider.add_span_processor(_store)
        if exports_otlp("traces") and not _exports_over_otlp(provider):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(ExitBoundedSpanProcessor(OTLPSpanExporter()))
        if provider is not current:
            trace.set_tracer_provider(provider)
        _provider = provider
        engine_spans.set_enabled(True)
        return provider


def resource() -> Resource:
    """The resource of wfdash's own providers: what OpenTelemetry reads from the
    environment (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES and the detectors), with
    service.name "wfdash" only when neither variable names the service. Passed to
    Resource.create, a default overrode the environment's: a fleet that named its
    service in OTEL_RESOURCE_ATTRIBUTES (service.name=orders) exported as "wfdash"."""
    named = OTELResourceDetector().detect().attributes.get(SERVICE_NAME)
    return Resource.create({} if named else {SERVICE_NAME: "wfdash"})


def exports_otlp(signal: str) -> bool:
    """Whether wfdash adds an OTLP/HTTP exporter of `signal` ("traces", "metrics"): an
    endpoint is set (OTEL_EXPORTER_OTLP_ENDPOINT or its signal's own), and the signal's
    exporter variable (OTEL_TRACES_EXPORTER, OTEL_METRICS_EXPORTER: a comma-separated
    list, "otlp" when unset) names otlp. "none" is OpenTelemetry's documented way to
    export one signal and not the other from one endpoint (Jaeger takes traces only: the
    metrics' exports failed there every minute). Another exporter named (console,
    zipkin) is the project's to install; wfdash says so once. So is a gRPC exporter: with
    OTEL_EXPORTER_OTLP_PROTOCOL (or its signal's own) grpc, the endpoint is a gRPC port,
    where every OTLP/HTTP export failed with a connection error that named neither; now
    one error says what to change, and nothing is sent there."""
    upper = signal.upper()
    if not (
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get(f"OTEL_EXPORTER_OTLP_{upper}_ENDPOINT")
    ):
        return False
    variable = f"OTEL_{upper}_EXPORTER"
    names = {n.strip().lower() for n in os.environ.get(variable, "otlp").split(",")} - {""}
    # prometheus: what /metrics (and a worker's metrics port) serve already.
    others = names - {"otlp", "none", *(("prometheus",) if signal == "metrics" else ())}
    if others:
        log.warning(
            "%s names %s: wfdash exports over OTLP only (add that exporter to a provider "
            "of your own)",
            variable,
            ", ".join(sorted(others)),
        )
    if "otlp" not in names:
        return False
    protocol_variable = next(
        (
            name
            for name in (f"OTEL_EXPORTER_OTLP_{upper}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
            if os.environ.get(name, "").strip()
        ),
        None,
    )
    if protocol_variable and os.environ[protocol_variable].strip().lower() == "grpc":
        log.error(
            "%s=grpc: wfdash exports %s over OTLP/HTTP only, so it exports none; set it to "
            "http/protobuf with the collector's OTLP/HTTP endpoint (port 4318), or export "
            "over gRPC from a provider of your own",
            protocol_variable,
            signal,
        )
        return False
    return True


def _exports_over_otlp(provider: TracerProvider) -> bool:
    """Whether one of the provider's span processors exports with an OTLP exporter already
    (opentelemetry-instrument's set-up does, from the same variables): a second one
    would send every span twice. The SDK has no public list of processors: read its
    own, and if that is not there, assume none."""
    processors = getattr(getattr(provider, "_active_span_processor", None), "_span_processors", ())
    return any(
        type(getattr(processor, "span_exporter", None)).__module__.startswith(
            "opentelemetry.exporter.otlp"
        )
        for processor in processors
    )


def flush_spans() -> list[Any]:
    """Write queued spans to the database; called from the engine's database thread."""
    if _store is None:
        return []
    return _store.flush()


def add_processor(processor: SpanProcessor) -> None:
    """Add a span processor (e.g. an in-memory exporter in tests) to wfdash's provider."""
    configure().add_span_processor(processor)
