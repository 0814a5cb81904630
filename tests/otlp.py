"""A local OTLP/HTTP trace endpoint for the export tests: what reaches it, span by span."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A subprocess's script (after its own set-up): Django on the DATABASE_URL it is given, one
# instance of a one-step workflow run to its end; then the caller's checks and flush.
RUN_EXPORTED_WORKFLOW = """
import django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register

@register("exported")
class Exported(WorkflowEntrypoint):
    async def run(self, event, step):
        return await step.do("only step", lambda: 42)

inst = get_workflow("exported").create()
testing.run_until_idle()
assert inst.status().output == 42
"""
EXPORTED_SPANS = {"create exported", "workflow exported", "step only step"}


def run_project_script(
    script: str, database: Path, timeout: float = 60, **variables: str
) -> subprocess.CompletedProcess[str]:
    """Run `script` in a Python of its own, as a project on wfdash's settings: on the
    SQLite file `database` (a migrated one when it does not exist yet), without Redis, and
    with none of this process's OTEL_* variables (only those in `variables`):
    OpenTelemetry's set-up happens once a process."""
    if not database.exists():
        shutil.copyfile(_migrated_template(), database)
    return subprocess.run(
        [sys.executable, "-c", script],
        env=_project_env(database, variables),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _project_env(database: Path, variables: dict[str, str]) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}
    env.pop("REDIS_URL", None)
    env.update(
        DJANGO_SETTINGS_MODULE="wfdash.settings",
        DATABASE_URL=f"sqlite:///{database}",
        WFDASH_DEMO="0",
        **variables,
    )
    return env


_templates: list[Path] = []


def _migrated_template() -> Path:
    """A SQLite file migrated once per test process, copied for each script: the scripts
    still call migrate (then a no-op), but a migrate from nothing cost each of them about
    1.2 s of CPU, twice their run (17 scripts a leg)."""
    if not _templates:
        folder = Path(tempfile.mkdtemp(prefix="wfdash-migrated-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        template = folder / "migrated.sqlite3"
        subprocess.run(
            [sys.executable, "-c", MIGRATE],
            env=_project_env(template, {}),
            cwd=ROOT,
            check=True,
            capture_output=True,
            timeout=120,
        )
        _templates.append(template)
    return _templates[0]


# Migrates, then leaves one file (no -wal beside it) to copy.
MIGRATE = """
import django
django.setup()
from django.core.management import call_command
from django.db import connection
call_command("migrate", verbosity=0)
with connection.cursor() as cursor:
    cursor.execute("PRAGMA journal_mode=DELETE")
"""


class OtlpReceiver(BaseHTTPRequestHandler):
    """Appends (trace id, span name) of each span it is sent to its class's `spans`."""

    spans: list[tuple[str, str]]

    def do_POST(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path != "/v1/traces":
            # The process's metrics go to the same OTEL_EXPORTER_OTLP_ENDPOINT (/v1/metrics):
            # taken and dropped. Parsed as traces they failed, the connection closed and the
            # metrics exporter retried with back-off at the process's exit, for ~7 s a test.
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()
            return
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend((span.trace_id.hex(), span.name) for span in scope_spans.spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """The URL of a local HTTP server answering with `handler` while the block runs."""
    server = HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def otlp_receiver() -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """(endpoint URL, the spans received so far) while the block runs."""
    received: list[tuple[str, str]] = []
    with serving(type("Receiver", (OtlpReceiver,), {"spans": received})) as url:
        yield url, received
