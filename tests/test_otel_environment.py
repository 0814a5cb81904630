"""The standard OTEL_* variables, as OpenTelemetry documents them, for wfdash's own tracer
and meter providers: a real process exporting to a local OTLP/HTTP receiver."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tests.otlp import RUN_EXPORTED_WORKFLOW, run_project_script, serving

SCRIPT = (
    RUN_EXPORTED_WORKFLOW
    + """
from opentelemetry import metrics, trace
from workflows_app.models import Span
print("stored spans:", Span.objects.count())
trace.get_tracer_provider().shutdown()
metrics.get_meter_provider().shutdown()
"""
)


class _Receiver(BaseHTTPRequestHandler):
    """Records (path, service.name of each resource) of what it is sent."""

    received: ClassVar[list[tuple[str, str]]] = []

    def do_POST(self) -> None:
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
            ExportMetricsServiceRequest,
        )
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/v1/traces":
            request: Any = ExportTraceServiceRequest()
            request.ParseFromString(body)
            resources = [r.resource for r in request.resource_spans]
        else:
            request = ExportMetricsServiceRequest()
            request.ParseFromString(body)
            resources = [r.resource for r in request.resource_metrics]
        for resource in resources:
            names = [a.value.string_value for a in resource.attributes if a.key == "service.name"]
            self.received.append((self.path, names[0] if names else ""))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def receiver() -> Iterator[tuple[str, list[tuple[str, str]]]]:
    received: list[tuple[str, str]] = []
    with serving(type("Receiver", (_Receiver,), {"received": received})) as url:
        yield url, received


def run_exporting(tmp_path: Path, with_errors: bool = False, **variables: str) -> Any:
    """(what the receiver got: path and service name, the process's output[, its
    standard error])."""
    with receiver() as (url, received):
        result = run_project_script(
            SCRIPT,
            tmp_path / "otel-env.sqlite3",
            timeout=90,
            OTEL_EXPORTER_OTLP_ENDPOINT=url,
            **variables,
        )
        assert result.returncode == 0, result.stderr
        if with_errors:
            return list(received), result.stdout, result.stderr
        return list(received), result.stdout


@pytest.mark.parametrize(
    ("variables", "service"),
    [
        ({}, "wfdash"),
        ({"OTEL_SERVICE_NAME": "billing"}, "billing"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=orders,deployment.environment=prod"}, "orders"),
    ],
)
def test_the_service_is_named_as_the_environment_says(tmp_path, variables, service):
    """A default service.name "wfdash" was passed to Resource.create, which lets what it
    is given override the environment's: OTEL_RESOURCE_ATTRIBUTES=service.name=orders
    exported spans and metrics as the service "wfdash". "wfdash" is the default only
    when neither variable names the service."""
    received, _ = run_exporting(tmp_path, **variables)
    assert {path for path, _ in received} == {"/v1/traces", "/v1/metrics"}
    assert {name for _, name in received} == {service}


@pytest.mark.parametrize(
    ("variables", "exported"),
    [
        ({"OTEL_METRICS_EXPORTER": "none"}, {"/v1/traces"}),
        ({"OTEL_TRACES_EXPORTER": "none"}, {"/v1/metrics"}),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"}, set()),
        ({"OTEL_TRACES_EXPORTER": "console,otlp"}, {"/v1/traces", "/v1/metrics"}),
        ({"OTEL_METRICS_EXPORTER": "prometheus"}, {"/v1/traces"}),
    ],
)
def test_a_signal_whose_exporter_is_none_is_not_exported(tmp_path, variables, exported):
    """OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER=none is how OpenTelemetry says to
    export one signal and not the other to one OTEL_EXPORTER_OTLP_ENDPOINT (Jaeger takes
    traces only). wfdash read the endpoint alone and exported both: every minute's metrics
    export to Jaeger failed and was logged. The spans are stored for the dashboard
    whatever is exported."""
    received, output, errors = run_exporting(tmp_path, with_errors=True, **variables)
    assert {path for path, _ in received} == exported
    assert "stored spans: 3" in output
    # Only an exporter wfdash does not provide is worth a word (console); Prometheus text
    # is what /metrics serves.
    assert ("wfdash exports over OTLP only" in errors) == ("console" in str(variables))


@pytest.mark.parametrize(
    ("variables", "exported"),
    [
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, set()),
        ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}, {"/v1/metrics"}),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, {"/v1/traces", "/v1/metrics"}),
    ],
)
def test_a_grpc_protocol_is_one_clear_error_not_http_sent_to_a_grpc_port(
    tmp_path, variables, exported
):
    """wfdash's exporters are OTLP/HTTP. With OTEL_EXPORTER_OTLP_PROTOCOL=grpc (the
    endpoint then a collector's gRPC port, 4317) they posted HTTP there anyway, and every
    batch failed with a connection error naming neither the variable nor the fix. Now
    that signal is not exported and one error at start-up says what to change."""
    received, _, errors = run_exporting(tmp_path, with_errors=True, **variables)
    assert {path for path, _ in received} == exported
    for signal in ("traces", "metrics"):
        told = f"wfdash exports {signal} over OTLP/HTTP only" in errors
        assert told == (f"/v1/{signal}" not in exported), errors[-2000:]
