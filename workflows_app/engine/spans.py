"""The spans the engine emits, through the OpenTelemetry API only.

One trace per instance: every run's `workflow <name>` span is a root span whose trace id
is the instance's stored trace id (the id generator in workflows_app.tracing reads
`forced_trace`, and remembers which instance the trace is of). Sleeps and event waits
can last a year, across many runs and processes, so their spans are created when they
end, with the stored start time.
"""

from __future__ import annotations

import contextvars
import secrets
import time
import traceback
from datetime import UTC, datetime, timedelta
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from . import clock
from .errors import safe_str
from .limits import shortened_message, shortened_stack, storable_text

# Read by the tracer provider's id generator: the trace id of the span about to start, and
# the primary key of the instance whose trace it is (span storage needs no look-up by it).
forced_trace: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "wfdash_trace", default=None
)


def _forced(trace_id_hex: str, instance_pk: int) -> tuple[int, int] | None:
    trace_id = int(trace_id_hex, 16) if trace_id_hex else 0
    return (trace_id, instance_pk) if trace_id else None  # 0 is no trace id: a random one


_tracer: trace.Tracer | None = None
_enabled = True


def tracer() -> trace.Tracer:
    """The engine's tracer (a no-op one while spans are off). The spans a herd instance
    makes read `_tracer or tracer()`: the module's tracer, once made, with no call."""
    global _tracer
    if not _enabled:
        return trace.NoOpTracer()
    if _tracer is None:
        _tracer = trace.get_tracer("wfdash.engine")
    return _tracer


def set_enabled(enabled: bool) -> None:
    """Switch the engine's spans on or off (the bench measures both in one run)."""
    global _enabled, _tracer
    _enabled = enabled
    _tracer = None


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
ONE_MICROSECOND = timedelta(microseconds=1)


def ns(instant: datetime) -> int:
    """An aware datetime as OpenTelemetry's integer nanoseconds, exactly (through a float
    timestamp a microsecond could be lost)."""
    return (instant - EPOCH) // timedelta(microseconds=1) * 1000


def now_ns() -> int:
    """The engine's clock (the host's corrected by its offset from the database's) as
    OpenTelemetry's nanoseconds: every span of a trace is timed by it, as the sleeps and
    waits that start in one run and end in another must be. The real clock's in a third
    of the time (the SDK's own reading, corrected): three spans an instance in a herd."""
    current = clock.get_clock()
    if type(current) is clock.RealClock:
        return time.time_ns() + current.offset // ONE_MICROSECOND * 1000
    return ns(current.now())


def instant(nanoseconds: int | None) -> datetime:
    """ns() undone: OpenTelemetry's integer nanoseconds as an aware UTC datetime, to the
    microsecond below (exactly: through a float the last digit could round up)."""
    return EPOCH + timedelta(microseconds=(nanoseconds or 0) // 1000)


def new_trace_id(now: datetime) -> str:
    """An instance's trace id: the milliseconds of its creation (12 hex digits), then 80
    random bits. Ordered by creation, an index of trace ids takes new entries at its end,
    not on a random page of it: PostgreSQL wrote 11.0-11.5 kB of WAL per one-step
    instance with 300,000 stored, 7.6-7.7 kB with these, while the instance table had
    such an index (migration 0015 dropped it; a trace store's or a project's own index
    still gains). The random part is what trace tools read: the W3C random flag wants
    the rightmost 7 bytes random, ratio samplers the low 64 bits."""
    return f"{ns(now) // 1_000_000:012x}{secrets.token_hex(10)}"


def span_ids(span: Span | None) -> tuple[str, str]:
    """(trace id, span id) as hex, or empty strings for a non-recording span."""
    if span is None:
        return "", ""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return "", ""
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")


def start_workflow_span(
    trace_id_hex: str, instance_pk: int, name: str, attributes: dict[str, Any], linked: str = ""
) -> Span:
    """linked: "<trace id>:<span id>" of the span that caused this instance (a child's
    parent): its own trace stays one per instance, with a link to the parent's."""
    token = forced_trace.set(_forced(trace_id_hex, instance_pk))
    try:
        return (_tracer or tracer()).start_span(
            f"workflow {name}",
            context=otel_context.Context(),
            kind=SpanKind.SERVER,
            attributes=attributes,
            links=span_links(linked) if linked else (),
            start_time=now_ns(),
        )
    finally:
        forced_trace.reset(token)


def span_links(linked: str, role: str = "parent") -> list[trace.Link]:
    """A link to the span named "<trace id>:<span id>", or none; role says what the linked
    span is to this one (a child's run links its "parent", a parent's step its "child")."""
    trace_hex, _, span_hex = linked.partition(":")
    if not trace_hex or not span_hex:
        return []
    context = trace.SpanContext(
        int(trace_hex, 16),
        int(span_hex, 16),
        is_remote=True,
        trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED),
    )
    return [trace.Link(context, {"workflow.link": role})]


def link_child(span: Span | None, linked: str, instance_id: str) -> None:
    """Link a parent's span to its child's creation span ("<trace id>:<span id>"), so a
    trace viewer leads from the parent to the child as the child's run leads back."""
    if span is None or not span.is_recording():
        return
    for link in span_links(linked, "child"):
        span.add_link(link.context, {**link.attributes, "workflow.child.instance_id": instance_id})


class child_span:
    """A span under `parent`, current for the block (user spans in the step nest under it);
    the block's errors are the engine's to record. A class, not start_as_current_span: its
    three nested generator context managers were a sixth of a step span's cost."""

    __slots__ = ("span", "token")

    def __init__(self, parent: Span | None, name: str, attributes: dict[str, Any]) -> None:
        self.span = (_tracer or tracer()).start_span(
            name,
            context=trace.set_span_in_context(parent) if parent is not None else None,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
            start_time=now_ns(),
        )

    def __enter__(self) -> Span:
        self.token = otel_context.attach(trace.set_span_in_context(self.span))
        return self.span

    def __exit__(self, *exc_info: object) -> None:
        otel_context.detach(self.token)
        self.span.end(end_time=now_ns())


def open_span(parent: Span | None, name: str, start: datetime, attributes: dict[str, Any]) -> Span:
    """A span that started in an earlier run (a sleep, an event wait), to end with end_span."""
    ctx = trace.set_span_in_context(parent) if parent is not None else None
    return tracer().start_span(name, context=ctx, attributes=attributes, start_time=ns(start))


def end_span(span: Span, start: datetime, end: datetime) -> None:
    span.end(end_time=ns(max(start, end)))


def finished_span(
    parent: Span | None,
    name: str,
    start: datetime,
    end: datetime,
    attributes: dict[str, Any],
    error: BaseException | None = None,
    links: list[trace.Link] | None = None,
) -> None:
    """A span that started in an earlier run (a sleep, an event wait), ended now."""
    ctx = trace.set_span_in_context(parent) if parent is not None else None
    span = (_tracer or tracer()).start_span(
        name, context=ctx, attributes=attributes, start_time=ns(start), links=links
    )
    if error is not None:
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, str(error)))
    span.end(end_time=ns(max(start, end)))


def record_failed_attempt(
    span: Span | None, attempt: int, max_retries: int, name: str, message: str, stack: str
) -> None:
    if span is None:
        return
    span.add_event(
        "step.retry_error",
        {
            "step.attempt": attempt,
            "step.max_retries": max_retries,
            "error.name": name,
            "error.message": message,
            "error.stack": stack,
        },
        timestamp=now_ns(),
    )


def mark_error(span: Span | None, exc: BaseException | None, message: str = "") -> None:
    if span is None:
        return
    if exc is not None:
        # Its message and stack shortened as the error's record is (a message holding a
        # whole response is not stored again whole in the span), and storable_text: a lone
        # surrogate (an undecodable file name) has no UTF-8, and the OTLP exporter's
        # protobuf encoding of the batch holding it raised, losing every span of it.
        shown = {
            "exception.message": storable_text(shortened_message(safe_str(exc))),
            "exception.stacktrace": storable_text(
                shortened_stack("".join(traceback.format_exception(exc)))
            ),
        }
        try:
            span.record_exception(exc, attributes=shown, timestamp=now_ns())
        except Exception:  # its str() raises: the step's failure is recorded all the same
            span.add_event("exception", {"exception.type": type(exc).__name__, **shown})
    if not message and exc is not None:
        message = safe_str(exc)
    span.set_status(Status(StatusCode.ERROR, storable_text(shortened_message(message))))


def creation_span(
    trace_id_hex: str, instance_pk: int, name: str, instance_id: str, actor: str = ""
) -> str:
    """`create <name>` in the instance's trace, linked to the caller's span (a request);
    returns "<trace id>:<span id>" of it, for a parent's step to link to its child."""
    caller = trace.get_current_span().get_span_context()
    links = [trace.Link(caller)] if caller.is_valid else []
    token = forced_trace.set(_forced(trace_id_hex, instance_pk))
    try:
        span = tracer().start_span(
            f"create {name}",
            context=otel_context.Context(),
            kind=SpanKind.PRODUCER,
            links=links,
            start_time=now_ns(),
            attributes={
                "workflow.name": name,
                "workflow.instance_id": instance_id,
                "workflow.actor": actor,
            },
        )
    finally:
        forced_trace.reset(token)
    span.end(end_time=now_ns())
    trace_hex, span_hex = span_ids(span)
    return f"{trace_hex}:{span_hex}" if span_hex else ""
