"""Metrics: OpenTelemetry instruments in Prometheus text at /metrics (token or staff),
fleet-wide gauges from the database, and OTLP export when the endpoint is set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from tests.dashboard.helpers import make_user
from tests.otlp import run_project_script
from workflows_app import testing, tokens
from workflows_app.client import get_workflow
from workflows_app.engine import NonRetryableError, WorkflowEntrypoint, register
from workflows_app.models import Instance

pytestmark = pytest.mark.django_db(transaction=True)


def scrape(client: Client | None = None, **headers: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    if client is None:
        _, secret = tokens.issue(f"scraper-{len(tokens.ApiToken.objects.all())}", scope="read")
        client, headers = Client(), {"HTTP_AUTHORIZATION": f"Bearer {secret}"}
    response = client.get("/metrics", **headers)
    assert response.status_code == 200, response.content[:300]
    assert response["Content-Type"].startswith("text/plain; version=")
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def sample(samples: dict, name: str, **labels: str) -> float:
    """A sample's value (0 when absent); labels the test does not name are ignored."""
    return sum(
        value
        for (n, lbls), value in samples.items()
        if n == name and labels.items() <= dict(lbls).items()
    )


@pytest.fixture
def shop(registered: list[str]) -> Any:
    @register("metric-shop")
    class MetricShop(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            await step.do("reserve", lambda: "ok")
            if event.payload.get("fail"):

                def refuse() -> None:
                    raise NonRetryableError("out of stock")

                await step.do("charge", refuse)
            await step.wait_for_event("shipped", type="shipped")
            return "done"

    return get_workflow("metric-shop")


def test_metrics_count_instances_steps_events_and_read_the_backlog_from_the_database(shop):
    before = scrape()
    with testing.fake_clock() as clock:
        ok = shop.create(id="m-ok", params={})
        shop.create(id="m-fail", params={"fail": True})
        waiting = shop.create(id="m-wait", params={})
        testing.run_until_idle()
        clock.advance("2 seconds")
        ok.send_event("shipped", {})
        testing.run_until_idle()
        after = scrape()

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    wf = {"workflow": "metric-shop"}
    assert delta("wfdash_instances_started_total", **wf) == 3
    assert delta("wfdash_instances_finished_total", **wf, status="complete") == 1
    assert delta("wfdash_instances_finished_total", **wf, status="errored") == 1
    assert delta("wfdash_step_duration_seconds_count", **wf, step="reserve", outcome="ok") == 3
    assert delta("wfdash_step_duration_seconds_count", **wf, step="charge", outcome="error") == 1
    assert delta("wfdash_queue_wait_seconds_count", **wf) == 3
    # The event was sent 2 s (engine clock) after the wait began, and received at once.
    assert delta("wfdash_event_latency_seconds_count", **wf, type="shipped") == 1
    assert delta("wfdash_event_latency_seconds_bucket", **wf, type="shipped", le="0.001") == 1

    # Fleet-wide gauges: read from the database at the scrape, whatever process ran them;
    # the unfinished instances (the finished ones are the counters' and the last hour's).
    assert sample(after, "wfdash_instances", **wf, status="waiting") == 1
    assert sample(after, "wfdash_instances", **wf, status="complete") == 0
    assert sample(after, "wfdash_instances_finished_last_hour", **wf, status="errored") == 1
    backlog_waiting = Instance.objects.filter(status="waiting").count()
    assert sample(after, "wfdash_backlog", status="waiting") == backlog_waiting >= 1
    assert sample(after, "wfdash_backlog", status="queued") == 0

    waiting.terminate()
    final = scrape()
    assert (
        sample(final, "wfdash_instances_finished_total", **wf, status="terminated")
        - sample(before, "wfdash_instances_finished_total", **wf, status="terminated")
        == 1
    )
    assert sample(final, "wfdash_backlog", status="waiting") == backlog_waiting - 1


def test_metrics_need_a_token_for_every_workflow_or_a_staff_session_that_may_view():
    client = Client()
    response = client.get("/metrics")
    assert response.status_code == 401 and response.json()["errors"][0]["code"] == "Unauthorized"
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wf_wrong").status_code == 401
    _, narrow = tokens.issue("narrow-metrics", scope="read", workflows=["one"])
    refused = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {narrow}")
    assert refused.status_code == 403 and "every workflow" in refused.json()["errors"][0]["message"]
    user = make_user("metrics-nobody")  # staff, without view_instance
    _, user_token = tokens.issue("user-metrics", "metrics-nobody", scope="read")
    assert client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {user_token}").status_code == 403
    client.force_login(user)
    assert client.get("/metrics").status_code == 401

    viewer = Client()
    viewer.force_login(make_user("metrics-viewer", "view_instance"))
    assert "wfdash_backlog" in {name for name, _ in scrape(viewer)}
    _, writer = tokens.issue("metrics-writer")
    posted = Client().post("/metrics", HTTP_AUTHORIZATION=f"Bearer {writer}")
    assert posted.status_code == 405 and posted["Allow"] == "GET, HEAD"


def test_metrics_switched_off_are_not_served(settings):
    """WFDASH["METRICS"] = False left the meter provider out at start-up, but /metrics
    still served every metric, its first scrape installing the provider (the engine's
    instruments then counted in that process). Now it is a 404 naming the setting, after
    the same authentication (no token, no answer about the set-up either)."""
    settings.WFDASH = {**settings.WFDASH, "METRICS": False}
    _, secret = tokens.issue("scraper-off", scope="read")
    response = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert response.status_code == 404, response.content[:200]
    error = response.json()["errors"][0]
    assert error["code"] == "MetricsOff" and 'WFDASH["METRICS"]' in error["message"]
    assert b"wfdash_" not in response.content
    assert Client().get("/metrics").status_code == 401


EXPORT_SCRIPT = """
import django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from opentelemetry import metrics
from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register

@register("metered")
class Metered(WorkflowEntrypoint):
    async def run(self, event, step):
        return await step.do("only step", lambda: 42)

inst = get_workflow("metered").create()
testing.run_until_idle()
assert inst.status().output == 42
metrics.get_meter_provider().shutdown()  # exports what was recorded
"""


class _OtlpMetricsReceiver(BaseHTTPRequestHandler):
    received: ClassVar[dict[str, set[str]]] = {}

    def do_POST(self) -> None:
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
            ExportMetricsServiceRequest,
        )

        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/v1/metrics":
            request = ExportMetricsServiceRequest()
            request.ParseFromString(body)
            for resource_metrics in request.resource_metrics:
                for scope_metrics in resource_metrics.scope_metrics:
                    for metric in scope_metrics.metrics:
                        self.received.setdefault(metric.name, set()).add(scope_metrics.scope.name)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_metrics_are_exported_over_otlp_http_when_the_endpoint_is_set(tmp_path: Path):
    server = HTTPServer(("127.0.0.1", 0), _OtlpMetricsReceiver)
    _OtlpMetricsReceiver.received = {}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "wfdash.settings",
            "DATABASE_URL": f"sqlite:///{tmp_path / 'otlp.sqlite3'}",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}",
            "WFDASH_DEMO": "0",
        }
        env.pop("REDIS_URL", None)
        result = subprocess.run(
            [sys.executable, "-c", EXPORT_SCRIPT],
            env=env,
            cwd=Path(__file__).parent.parent,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
    finally:
        server.shutdown()
        server.server_close()
    received = _OtlpMetricsReceiver.received
    for name in ("wfdash.instances.started", "wfdash.instances.finished", "wfdash.step.duration"):
        assert received.get(name) == {"wfdash.engine"}, (name, received)
    # The database gauges are /metrics' alone: the exporter's thread does not query.
    assert "wfdash.backlog" not in received


def test_a_worker_process_serves_its_own_runs_and_steps_on_its_metrics_port(workers):
    """In a fleet the runs happen in `runworker` processes: each serves its own
    instruments for Prometheus (WFDASH_METRICS_PORT), loopback-bound unless told otherwise."""
    import socket
    import urllib.request

    from tests import fleet_workflows
    from tests.polling import wait_until

    fleet_workflows.ensure_ledger()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workers(1, WFDASH_METRICS_PORT=str(port))
    inst = get_workflow("rel-race").create(id="metered")
    wait_until(lambda: inst.status().status == "complete", 30, "the worker to run it")

    def served() -> dict[tuple[str, tuple], float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    # Counted when the run ends, which the status shows a moment before the counter moves.
    wait_until(
        lambda: sample(served(), "wfdash_instances_finished_total", workflow="rel-race") == 1,
        10,
        "the worker's counter of finished runs",
    )
    samples = served()
    assert sample(samples, "wfdash_instances_started_total", workflow="rel-race") == 1
    assert sample(samples, "wfdash_step_duration_seconds_count", workflow="rel-race") == 3
    # The fleet-wide database gauges are the web process's /metrics, not each worker's.
    assert sample(samples, "wfdash_instances", workflow="rel-race") == 0


def test_exemplars_are_sampled_only_where_an_exporter_carries_them(monkeypatch):
    """Prometheus text has no exemplars: sampling them cost a fifth of every step's
    duration record. OTLP keeps the SDK's trace-based default; the variable decides."""
    from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter

    from workflows_app.metrics import _exemplar_filter

    for name in (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
        "OTEL_METRICS_EXEMPLAR_FILTER",
    ):
        monkeypatch.delenv(name, raising=False)
    assert isinstance(_exemplar_filter(), AlwaysOffExemplarFilter)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    assert _exemplar_filter() is None
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    monkeypatch.setenv("OTEL_METRICS_EXEMPLAR_FILTER", "always_on")
    assert _exemplar_filter() is None


def rows_each_query_reads(sql: str) -> str | int:
    """What a scrape's statement reads of the instance table: PostgreSQL's row count
    (EXPLAIN ANALYZE, index scans preferred as on a big table), SQLite's plan."""
    from django.db import connection, transaction

    with transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "sqlite":
            cursor.execute("EXPLAIN QUERY PLAN " + sql)
            return " | ".join(str(row[-1]) for row in cursor.fetchall())
        cursor.execute("SET LOCAL enable_seqscan = off")  # a tiny table: as on a big one
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql)
        plan = cursor.fetchone()[0]
    plan = plan[0]["Plan"] if isinstance(plan, list) else json.loads(plan)[0]["Plan"]

    def read(node: dict) -> int:
        here = 0
        if node.get("Relation Name") == Instance._meta.db_table:
            here = node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
        return here + sum(read(child) for child in node.get("Plans", ()))

    return read(plan)


def test_a_scrape_reads_the_unfinished_and_recent_instances_not_the_whole_history(shop):
    """Prometheus scrapes every 15 s: counting every instance ever kept by status was a
    scan of the whole table (1.1 s at 3 million rows on PostgreSQL), growing with the
    history rather than with the work in flight."""
    from datetime import timedelta

    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    for n in range(40):
        shop.create(id=f"old-{n}", params={"fail": n % 4 == 0})
    testing.run_until_idle()
    for n in range(40):  # these 40 wait for "shipped": they end now
        shop.get(f"old-{n}").terminate()
    Instance.objects.filter(workflow="metric-shop").update(
        finished_at=timezone.now() - timedelta(hours=2)
    )
    for n in range(3):
        shop.create(id=f"live-{n}", params={})
    testing.run_until_idle()
    with CaptureQueriesContext(connection) as queries:
        samples = scrape()
    assert sample(samples, "wfdash_instances", workflow="metric-shop", status="waiting") == 3
    assert sample(samples, "wfdash_backlog", status="waiting") == 3

    table = Instance._meta.db_table
    reads = [rows_each_query_reads(q["sql"]) for q in queries if table in q["sql"]]
    assert reads, queries.captured_queries
    for read in reads:
        if connection.vendor == "sqlite":
            # A partial index of the unfinished rows, or a range of the finished_at index.
            steps = [s for s in str(read).split(" | ") if table in s]
            assert all("instance_live" in s or "instance_finished (" in s for s in steps), read
        else:
            assert read <= 3, read


def test_a_scrape_the_database_fails_is_a_503_not_a_healthy_target_without_its_gauges(shop):
    """The SDK logs and drops a failing gauge callback: the scrape answered 200 without
    the fleet-wide gauges, a backlog that vanished rather than an outage Prometheus sees
    (`up` 0). Here the instance table is gone (a migration half applied)."""
    from django.db import connection

    shop.create(id="before-the-outage", params={})
    testing.run_until_idle()
    _, secret = tokens.issue("outage-scraper", scope="read")
    table = Instance._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {table} RENAME TO {table}_away")
    try:
        response = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {secret}")
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {table}_away RENAME TO {table}")
    assert response.status_code == 503, response.content[:300]
    assert response.json()["errors"][0]["code"] == "DatabaseUnavailable"
    assert response["Retry-After"]
    assert "no-store" in response["Cache-Control"]
    assert sample(scrape(), "wfdash_backlog", status="waiting") == 1  # and back after it


def test_event_types_made_per_instance_share_one_label_past_a_workflows_first_ones(
    registered, monkeypatch
):
    """A type built from the instance (`paid-{order}`) was a new series of the latency
    histogram per instance, until the SDK's 2,000 overflowed and took every workflow's
    new series; step names were capped already."""
    from workflows_app.engine import meters

    monkeypatch.setattr(meters, "MAX_LABELS", 3)

    @register("metric-paid")
    class Paid(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            await step.wait_for_event("paid", type=f"paid-{event.payload['order']}")

    paid = get_workflow("metric-paid")
    for n in range(5):
        paid.create(id=f"order-{n}", params={"order": n})
    testing.run_until_idle()
    for n in range(5):  # one at a time: the first three types recorded are 0, 1 and 2
        paid.get(f"order-{n}").send_event(f"paid-{n}", {})
        testing.run_until_idle()
    counts = {
        dict(labels)["type"]: value
        for (name, labels), value in scrape().items()
        if name == "wfdash_event_latency_seconds_count" and ("workflow", "metric-paid") in labels
    }
    assert counts == {"paid-0": 1, "paid-1": 1, "paid-2": 1, meters.OTHER_LABEL: 2}


def test_a_step_whose_result_cannot_be_stored_is_an_attempt_that_failed(registered):
    """The step fails for good (StepOutputError) when its callable's result is no JSON;
    the attempt was counted with outcome "ok" because the encoding came after the timer."""
    before = scrape()

    @register("metric-unstorable")
    class Unstorable(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            await step.do("make a set", lambda: {1, 2})

    inst = get_workflow("metric-unstorable").create(id="unstorable")
    testing.run_until_idle()
    assert inst.status().status == "errored"
    after = scrape()
    name, wf = "wfdash_step_duration_seconds_count", {"workflow": "metric-unstorable"}
    assert sample(after, name, **wf, outcome="error") - sample(before, name, **wf) == 1
    assert sample(after, name, **wf, outcome="ok") == 0


def test_a_restarted_instance_is_counted_as_started_again_as_it_is_as_finished(shop):
    """A restart of a finished instance counted its second end but not its second start:
    started − finished went below zero. A live instance's restart counts neither (its
    first run never ended)."""
    before = scrape()
    done = shop.create(id="m-again", params={})
    live = shop.create(id="m-live", params={})
    testing.run_until_idle()
    done.send_event("shipped", {})
    testing.run_until_idle()
    assert done.status().status == "complete"
    done.restart()
    live.restart()
    testing.run_until_idle()
    done.send_event("shipped", {})
    live.send_event("shipped", {})
    testing.run_until_idle()
    assert done.status().status == live.status().status == "complete"
    after = scrape()

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    wf = {"workflow": "metric-shop"}
    assert delta("wfdash_instances_finished_total", **wf, status="complete") == 3
    assert delta("wfdash_instances_started_total", **wf) == 3
    assert delta("wfdash_queue_wait_seconds_count", **wf) == 2  # a restart has no create


LOOPING_WORKFLOWS_SCRIPT = """
import django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from workflows_app import metrics, testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register

attempts = {}

def flaky(name):
    def attempt():
        attempts[name] = attempts.get(name, 0) + 1
        if attempts[name] == 1:
            raise RuntimeError("first attempt fails")
        return 1
    return attempt

for w in range(10):
    @register(f"loop-{w}", limits={"max_steps_per_workflow": 200})
    class Loop(WorkflowEntrypoint):
        async def run(self, event, step):
            for i in range(100):
                name = f"{event.instance_id} item {i}"
                await step.do(name, flaky(name), retries={"limit": 1, "delay": 0})

@register("steady")
class Steady(WorkflowEntrypoint):
    async def run(self, event, step):
        return await step.do("pay", lambda: 1)

for w in range(10):
    get_workflow(f"loop-{w}").create(id=f"run-{w}")
testing.run_until_idle(timeout=300)
get_workflow("steady").create(id="steady")
testing.run_until_idle()
print(metrics.scrape().decode())
"""


def test_ten_looping_workflows_do_not_push_an_eleventh_out_of_the_step_histogram(tmp_path):
    """Each workflow's step names were capped at 100 labels, but not all workflows':
    ten workflows that each loop, their steps ok and failed, made 10 x 100 x 2 = 2,000
    series, the SDK's limit, and every step of an eleventh workflow went into the one
    `otel_metric_overflow` series, without its workflow or step label. Now the names of all
    workflows are capped too (meters.MAX_LABELS_TOTAL): past it a workflow keeps its first
    10 names, and its later ones share its own `(other)` label. A process of its own: the SDK's series outlive a test."""
    result = run_project_script(LOOPING_WORKFLOWS_SCRIPT, tmp_path / "labels.sqlite3", timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(result.stdout)
        for s in family.samples
    }
    overflow = sample(samples, "wfdash_step_duration_seconds_count", otel_metric_overflow="true")
    assert (
        sample(samples, "wfdash_step_duration_seconds_count", workflow="steady", step="pay") == 1
    ), f"{overflow:.0f} attempts went into the overflow series"
    assert overflow == 0
    # Every attempt is counted, under its workflow: 100 ok and 100 failed each.
    for w in range(10):
        assert sample(samples, "wfdash_step_duration_seconds_count", workflow=f"loop-{w}") == 200
    steps = {
        dict(labels).get("step") for (name, labels) in samples if name.startswith("wfdash_step")
    }
    # 800 names of all workflows, and past them the first 10 of any workflow with fewer.
    assert 800 <= len(steps - {"pay", "(other)"}) <= 800 + 10 * 10


METRICS_OFF_SCRIPT = """
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

reader = InMemoryMetricReader()
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))  # the project's own

import wfdash.settings
wfdash.settings.WFDASH["METRICS"] = False
import django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register

@register("unmetered")
class Unmetered(WorkflowEntrypoint):
    async def run(self, event, step):
        return await step.do("only step", lambda: 42)

inst = get_workflow("unmetered").create()
testing.run_until_idle()
assert inst.status().output == 42
metrics.get_meter("project").create_counter("project.work").add(1)
data = reader.get_metrics_data()
names = sorted(
    m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
)
print("project got:", names)
"""


def test_metrics_switched_off_record_nothing_in_a_provider_the_project_installed(tmp_path):
    """WFDASH["METRICS"] = False only left wfdash's meter provider out: the engine's
    instruments went on through the global provider, so a project with a provider of its
    own exported wfdash's started/finished counters and step durations all the same. Now
    the engine's instruments are no-ops; the project's own are untouched."""
    result = run_project_script(METRICS_OFF_SCRIPT, tmp_path / "metrics-off.sqlite3", timeout=60)
    assert result.returncode == 0, result.stderr
    assert "project got: ['project.work']" in result.stdout, result.stdout
