"""Export of spans over OTLP next to their storage: the export sampler and a tracer
provider the project installed itself. Each test failed on the code it was written
against (see its docstring); the spans come from real processes through the real SDK
and a local OTLP/HTTP receiver."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

from tests import fleet_workflows  # noqa: F401  (registers the workflows the workers run)
from tests.otlp import RUN_EXPORTED_WORKFLOW, otlp_receiver, run_project_script
from tests.polling import wait_until
from workflows_app.client import get_workflow
from workflows_app.models import Instance, Span

pytestmark = pytest.mark.django_db(transaction=True)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def otlp() -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """(endpoint URL, the spans received so far)."""
    with otlp_receiver() as receiving:
        yield receiving


TRACED_FLEET_SPANS = Counter({"workflow traced-fleet": 1, "step first": 1, "step second": 1})
TRACED_FLEET_SPANS["project work"] = 2


@pytest.mark.parametrize(("sampler", "ratio"), [("always_off", ""), ("traceidratio", "0.5")])
def test_the_export_sampler_chooses_the_exported_traces_and_every_trace_is_stored(
    workers, otlp, sampler, ratio
):
    """OTEL_TRACES_SAMPLER decided what was stored as well as what was exported: its
    dropped spans were never recorded (workflows_app/tracing.py configure(): the SDK's
    provider reads it), so at 10 % nine instances in ten had no trace on the dashboard.
    A worker sampling its export: every instance's whole trace (the engine's spans and
    those the step's own code made) is stored, and exactly the traces the sampler chose
    (by trace id) are exported, each whole."""
    url, exported = otlp
    count = 30
    rows = [get_workflow("traced-fleet").create(id=f"s{n}").row() for n in range(count)]
    traces = {row.trace_id for row in rows}
    (worker,) = workers(
        1,
        OTEL_TRACES_SAMPLER=sampler,
        OTEL_TRACES_SAMPLER_ARG=ratio,
        OTEL_EXPORTER_OTLP_ENDPOINT=url,
        OTEL_BSP_SCHEDULE_DELAY="50",
    )
    wait_until(
        lambda: (
            Instance.objects.filter(workflow="traced-fleet", status="complete").count() == count
        ),
        60,
        "every instance to complete",
    )
    run_spans = Span.objects.filter(trace_id__in=traces).exclude(name__startswith="create ")
    wait_until(
        lambda: run_spans.count() == count * TRACED_FLEET_SPANS.total(),
        30,
        "every instance's spans to be stored",
    )
    assert worker.terminate() == 0  # its provider's shutdown at exit flushes the export

    stored: dict[str, Counter[str]] = {trace_id: Counter() for trace_id in traces}
    for trace_id, name in run_spans.values_list("trace_id", "name"):
        stored[trace_id][name] += 1
    assert all(names == TRACED_FLEET_SPANS for names in stored.values()), stored

    decide = TraceIdRatioBased(float(ratio or 0))
    chosen = {t for t in traces if decide.should_sample(None, int(t, 16), "").decision.is_sampled()}
    if sampler == "traceidratio":
        assert 0 < len(chosen) < count  # both kinds (each all alike once in 2**29 runs)
    sent: dict[str, Counter[str]] = {}
    for trace_id, name in exported:
        sent.setdefault(trace_id, Counter())[name] += 1
    assert set(sent) == chosen
    assert all(names == TRACED_FLEET_SPANS for names in sent.values()), sent


PROJECT_PROVIDER_SCRIPT = (
    """
import os
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

# The project's own provider, installed before Django starts (as Sentry's SDK does).
project = TracerProvider()
own = InMemorySpanExporter()
project.add_span_processor(SimpleSpanProcessor(own))
if os.environ.get("PROJECT_EXPORTS_OTLP") == "1":  # as opentelemetry-instrument sets up
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    project.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
trace.set_tracer_provider(project)
"""
    + RUN_EXPORTED_WORKFLOW
    + """
from workflows_app.models import Span
assert trace.get_tracer_provider() is project
names = {"create exported", "workflow exported", "step only step"}
assert names <= {span.name for span in own.get_finished_spans()}
assert names <= set(Span.objects.values_list("name", flat=True))
project.shutdown()  # flushes the batch exporters
"""
)


@pytest.mark.parametrize("project_exports_otlp", [False, True])
def test_spans_are_exported_once_over_otlp_when_the_project_installed_its_own_provider(
    otlp, tmp_path, project_exports_otlp
):
    """configure() added the OTLP exporter to a provider of its own, then used the
    project's SDK provider instead (workflows_app/tracing.py, configure()): with
    OTEL_EXPORTER_OTLP_ENDPOINT set, nothing was exported. Now the exporter goes to the
    provider in use, unless that one exports over OTLP already: each span is sent once.
    The project's own processors and the store get the spans as well."""
    url, exported = otlp
    result = run_project_script(
        PROJECT_PROVIDER_SCRIPT,
        tmp_path / "project-provider.sqlite3",
        OTEL_EXPORTER_OTLP_ENDPOINT=url,
        PROJECT_EXPORTS_OTLP="1" if project_exports_otlp else "0",
    )
    assert result.returncode == 0, result.stderr
    names = Counter(name for _, name in exported)
    assert names == {"create exported": 1, "workflow exported": 1, "step only step": 1}


TRACING_OFF_SCRIPT = (
    """
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

project = TracerProvider()  # the project's own, installed before Django starts
own = InMemorySpanExporter()
project.add_span_processor(SimpleSpanProcessor(own))
trace.set_tracer_provider(project)
"""
    + RUN_EXPORTED_WORKFLOW
    + """
from workflows_app.models import Span
with trace.get_tracer("project").start_as_current_span("project work"):
    pass
print("project got:", sorted(span.name for span in own.get_finished_spans()))
print("stored:", Span.objects.count())
"""
)


def test_tracing_switched_off_makes_no_spans_in_a_provider_the_project_installed(tmp_path):
    """WFDASH_TRACING=0 ("turns spans off") only left wfdash's set-up out: the engine's
    spans still went through the global provider, so a project with a provider of its own
    (Sentry's SDK, opentelemetry-instrument) recorded and exported a `workflow`, a `step`
    and a `create` span of every instance. Now the engine makes none; the project's own
    spans are untouched."""
    result = run_project_script(
        TRACING_OFF_SCRIPT, tmp_path / "tracing-off.sqlite3", WFDASH_TRACING="0"
    )
    assert result.returncode == 0, result.stderr
    assert "project got: ['project work']" in result.stdout, result.stdout
    assert "stored: 0" in result.stdout


def test_the_exit_waits_a_bounded_time_for_a_collector_that_never_answers(tmp_path):
    """With the collector down, the process's exit (after a SIGTERM's drain too) waited
    out the SDK's shutdown: each exporter's last export retried until its timeout
    (OTEL_EXPORTER_OTLP_TIMEOUT, 10 s by default), metrics then traces: 11-15 s, here
    with a 30 s timeout over a minute. Each now gets tracing.EXIT_EXPORT_SECONDS (2 s),
    saying so in one line."""
    import socket
    import time

    silent = socket.socket()  # accepts connections (the kernel's backlog), answers nothing
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    try:
        result = run_project_script(
            RUN_EXPORTED_WORKFLOW + "print('done at', __import__('time').time(), flush=True)\n",
            tmp_path / "silent-collector.sqlite3",
            timeout=180,
            OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{silent.getsockname()[1]}",
            OTEL_EXPORTER_OTLP_TIMEOUT="30",
        )
        exited = time.time()
    finally:
        silent.close()
    assert result.returncode == 0, result.stderr
    done = float(result.stdout.split("done at ")[1].split()[0])
    assert exited - done < 15, (exited - done, result.stderr[-2000:])
    assert result.stderr.count("OTLP export at exit unfinished after 2 s") == 2, result.stderr
