"""End-to-end: real headless Chromium against `manage.py runserver` (daphne + embedded engine).

Skipped locally when Chromium (WFDASH_CHROMIUM, default /usr/bin/chromium) or Playwright is
missing; with CI=true a missing browser fails the run instead.
Every wait is a Playwright wait on a DOM condition, never a sleep.
"""

from __future__ import annotations

import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

CHROMIUM = os.environ.get("WFDASH_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts"
SERVER_START_TIMEOUT = 30.0  # seconds
UI_TIMEOUT_MS = 15_000
XSS = "<script>alert(1)</script>"


def _missing() -> str | None:
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} is missing (apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install 'wfdash[test]')"
    return None


_reason = _missing()
if _reason and os.environ.get("CI") == "true":
    raise RuntimeError(f"browser tests cannot run in CI: {_reason}")
# The pages' server runs on a SQLite file of its own and without Redis whatever the leg's
# database, so on the PostgreSQL leg (CI's longest) these tests would repeat the SQLite
# leg's runs exactly.
SQLITE_LEG_ONLY = pytest.mark.skipif(
    connection.vendor != "sqlite", reason="the server runs on SQLite; the SQLite leg runs it"
)
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""), SQLITE_LEG_ONLY]

if _reason is None:
    from playwright.sync_api import Browser, Page, expect, sync_playwright

    expect.set_options(timeout=UI_TIMEOUT_MS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LiveServer:
    """A runserver subprocess on a temp SQLite database; restartable on the same port."""

    env: dict[str, str]
    port: int
    log: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def manage(self, *args: str) -> str:
        return subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=self.env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout

    def start(self) -> None:
        with self.log.open("ab") as log:  # the child keeps its own copy of the descriptor
            self.process = subprocess.Popen(
                [sys.executable, "manage.py", "runserver", "--noreload", f"127.0.0.1:{self.port}"],
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while True:  # bounded readiness poll of a subprocess (no DOM to wait on yet)
            try:
                urllib.request.urlopen(f"{self.url}/admin/login/", timeout=1).close()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"runserver did not start; see {self.log}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("browser")
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{tmp / 'db.sqlite3'}",
        "DJANGO_DEBUG": "1",
        "WFDASH_DEMO": "1",
        "REDIS_URL": "",
        "WFDASH_EMBEDDED_WORKER": "1",
        "PYTHONUNBUFFERED": "1",
    }
    live = LiveServer(env, free_port(), tmp / "server.log")
    live.manage(  # one Django start-up for both
        "shell",
        "-c",
        "from django.core.management import call_command; "
        "call_command('migrate', interactive=False, verbosity=0); "
        "from django.contrib.auth.models import User; "
        "User.objects.create_superuser('admin', 'admin@example.com', 'admin')",
    )
    live.start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser, server: LiveServer) -> Iterator[Page]:
    context = browser.new_context(base_url=server.url, viewport={"width": 1360, "height": 900})
    context.set_default_timeout(UI_TIMEOUT_MS)
    page = context.new_page()
    refused: list[str] = []  # anything the page's Content-Security-Policy blocked
    page.on(
        "console", lambda m: refused.append(m.text) if "Content Security Policy" in m.text else None
    )
    page.goto("/admin/login/?next=/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", "admin")
    page.click("input[type=submit]")
    expect(page.locator("body")).to_have_attribute("data-socket", "connected")
    yield page
    context.close()
    assert refused == [], f"the dashboard broke its own Content-Security-Policy: {refused[:3]}"


def create_from_form(page: Page, workflow: str, instance_id: str, params: str) -> None:
    page.goto("/instances/")
    page.get_by_text("New instance").click()
    page.select_option("#id_workflow", workflow)
    page.fill("#id_id", instance_id)
    page.fill("#id_params", params)
    page.get_by_role("button", name="Create").click()
    expect(page.locator("h1.mono")).to_have_text(instance_id)
    expect(page.locator("body")).to_have_attribute("data-socket", "connected")


def mark_page(page: Page) -> None:
    """A flag that a reload would wipe: asserting it later proves the update was live."""
    page.evaluate("window.__noReload = true")


def assert_not_reloaded(page: Page) -> None:
    assert page.evaluate("window.__noReload === true"), "the page reloaded"


def badge(page: Page) -> Any:
    return page.locator('[data-section="head"] .badge[data-status]')


def test_create_wait_for_event_send_it_and_complete(page: Page) -> None:
    create_from_form(page, "order-approval", "e2e-approval", '{"amount": 7}')
    mark_page(page)
    expect(badge(page)).to_have_attribute("data-status", "waiting")
    expect(page.locator('[data-step="charge card"] .badge')).to_have_attribute(
        "data-status", "complete"
    )
    assert_not_reloaded(page)

    fill_event_form(page, "approval", '{"ok": true, "by": "e2e"}')
    page.get_by_role("button", name="Send event", exact=True).click()
    expect(page.locator(".msg.success")).to_contain_text("Sent event")
    mark_page(page)
    page.get_by_role(
        "button", name="Skip sleep", exact=True
    ).click()  # appears live once the cool-off starts
    mark_page(page)
    expect(badge(page)).to_have_attribute("data-status", "complete")
    expect(page.locator('[data-section="io"]')).to_contain_text("TRK-")
    assert_not_reloaded(page)


def test_the_create_form_flags_invalid_json_before_submitting(page: Page) -> None:
    page.goto("/instances/")
    page.get_by_text("New instance").click()
    page.fill("#id_params", '{"amount": ')
    expect(page.locator('[data-error-for="params"]')).to_contain_text("Not valid JSON")
    expect(page.locator("#id_params")).to_have_attribute("aria-invalid", "true")
    page.get_by_role("button", name="Create").click()
    expect(page).to_have_url(re.compile(r"/instances/$"))  # the form was not submitted
    page.fill("#id_params", '{"amount": 3}')
    expect(page.locator('[data-error-for="params"]')).to_have_text("")


def test_pause_and_terminate_from_the_buttons(page: Page) -> None:
    create_from_form(page, "trial-reminder", "e2e-trial", '{"trial": "14 days"}')
    expect(badge(page)).to_have_attribute("data-status", "waiting")
    page.get_by_role("button", name="Pause", exact=True).click()
    expect(badge(page)).to_have_attribute("data-status", "paused")
    expect(page.get_by_role("button", name="Resume", exact=True)).to_be_visible()
    expect(page.get_by_role("button", name="Pause", exact=True)).to_have_count(0)
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Terminate", exact=True).click()
    expect(badge(page)).to_have_attribute("data-status", "terminated")
    expect(page.get_by_role("button", name="Cancel", exact=True)).to_have_count(0)
    history = page.locator('[data-section="history"]')
    expect(history).to_contain_text("instance.terminated")
    expect(history).to_contain_text("by admin")


def fill_event_form(page: Page, event_type: str, payload: str) -> None:
    """Fill the send-event form once its section shows the wait for that type. Until then a
    live update replaces the section (its datalist, the expected schema): under load one
    came between Playwright's fill and the click, the fill went to the replaced form, and
    an empty payload was posted."""
    section = page.locator('[data-section="send-event"]')
    expect(section.locator(f'datalist option[value="{event_type}"]')).to_be_attached()
    page.fill("#ev-type", event_type)
    page.fill("#ev-payload", payload)
    expect(page.locator("#ev-payload")).to_have_value(payload)


def test_the_xss_payload_renders_as_text(page: Page) -> None:
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    create_from_form(page, "trial-reminder", "e2e-xss", f'{{"email": "{XSS}", "trial": "14 days"}}')
    page.fill("#ev-type", "note")
    page.fill("#ev-payload", f'{{"text": "{XSS}"}}')
    page.get_by_role("button", name="Send event", exact=True).click()
    expect(page.locator('[data-section="inbox"]')).to_contain_text(XSS)
    expect(page.locator('[data-section="io"] pre').first).to_contain_text(XSS)
    expect(
        page.locator('[data-step="load user"] code, [data-step="load user"] pre').first
    ).to_contain_text(XSS)
    assert page.locator("script:not([src])").count() == 0
    assert dialogs == []


def test_the_list_updates_live_and_measures_latency(page: Page, server: LiveServer) -> None:
    create_from_form(page, "trial-reminder", "e2e-latency", '{"trial": "14 days"}')
    expect(badge(page)).to_have_attribute("data-status", "waiting")
    page.goto("/instances/?workflow=trial-reminder")
    expect(page.locator("body")).to_have_attribute("data-socket", "connected")
    mark_page(page)
    row_badge = page.locator('tr[data-instance-id="e2e-latency"] .badge')
    expect(row_badge).to_have_attribute("data-status", "waiting")
    pk = page.locator('tr[data-instance-id="e2e-latency"]').get_attribute("data-pk")
    samples: list[float] = []
    for _ in range(20):
        # In the page: POST the pause, and time until the socket's update reaches the badge.
        # The clock starts before the request, so this bounds "DB commit → DOM" from above.
        elapsed = page.evaluate(
            """async ({pk}) => {
                const badge = document.querySelector(`tr[data-pk="${pk}"] .badge`);
                const token = document.querySelector('[name=csrfmiddlewaretoken]').value;
                const changed = new Promise((resolve) => {
                  const observer = new MutationObserver(() => {
                    if (badge.dataset.status === "paused") { observer.disconnect(); resolve(performance.now()); }
                  });
                  observer.observe(badge, { attributes: true });
                });
                const start = performance.now();
                await fetch(`/instances/${pk}/pause/`, { method: "POST", redirect: "manual",
                  headers: { "X-CSRFToken": token }, credentials: "same-origin" });
                return (await changed) - start;
            }""",
            {"pk": pk},
        )
        samples.append(float(elapsed))
        page.evaluate(
            """async ({pk}) => {
                const token = document.querySelector('[name=csrfmiddlewaretoken]').value;
                await fetch(`/instances/${pk}/resume/`, { method: "POST", redirect: "manual",
                  headers: { "X-CSRFToken": token }, credentials: "same-origin" });
            }""",
            {"pk": pk},
        )
        expect(row_badge).to_have_attribute("data-status", "waiting")  # the engine parks it again
    assert_not_reloaded(page)
    median = statistics.median(samples)
    print(
        f"\nlive latency, pause POST → list badge (20 samples): median {median:.1f} ms, "
        f"min {min(samples):.1f} ms, max {max(samples):.1f} ms"
    )
    assert median < 1000

    # A new instance created elsewhere appears at the top of the list without a reload.
    other = page.context.new_page()
    create_from_form(other, "trial-reminder", "e2e-appears", '{"trial": "14 days"}')
    other.close()
    expect(page.locator("tbody[data-rows] tr").first).to_have_attribute(
        "data-instance-id", "e2e-appears"
    )
    assert_not_reloaded(page)


def test_the_overview_counts_move_live(page: Page) -> None:
    page.goto("/")
    expect(page.locator("body")).to_have_attribute("data-socket", "connected")
    mark_page(page)
    total = page.locator('article[data-workflow="trial-reminder"] [data-field="total"]')
    before = int(total.text_content() or "0")
    other = page.context.new_page()
    create_from_form(other, "trial-reminder", "e2e-overview", '{"trial": "14 days"}')
    other.close()
    expect(total).to_have_text(str(before + 1))
    expect(
        page.locator('article[data-workflow="trial-reminder"] .badge[data-status="waiting"]')
    ).to_be_visible()
    assert_not_reloaded(page)


def test_a_pause_by_a_manage_py_command_in_another_process_reaches_open_pages(
    page: Page, server: LiveServer
) -> None:
    """Nothing carries the command's change to the server (in-memory channel layer): the
    server's history tail finds it, and both open pages show it within a second."""
    create_from_form(page, "trial-reminder", "e2e-command", '{"trial": "14 days"}')
    expect(badge(page)).to_have_attribute("data-status", "waiting")
    mark_page(page)
    listing = page.context.new_page()
    listing.goto("/instances/?workflow=trial-reminder")
    expect(listing.locator("body")).to_have_attribute("data-socket", "connected")
    mark_page(listing)
    row_badge = listing.locator('tr[data-instance-id="e2e-command"] .badge')
    expect(row_badge).to_have_attribute("data-status", "waiting")
    server.manage("wf", "pause", "e2e-command", "--workflow", "trial-reminder")
    exited = time.monotonic()
    expect(badge(page)).to_have_attribute("data-status", "paused", timeout=1000)
    expect(row_badge).to_have_attribute("data-status", "paused", timeout=1000)
    print(f"\nmanage.py wf pause → both open pages: {(time.monotonic() - exited) * 1000:.0f} ms")
    server.manage("wf", "resume", "e2e-command", "--workflow", "trial-reminder")
    expect(badge(page)).to_have_attribute("data-status", "waiting")
    expect(row_badge).to_have_attribute("data-status", "waiting")
    assert_not_reloaded(page)
    assert_not_reloaded(listing)
    listing.close()


def test_a_list_page_that_lost_a_live_message_notices_and_resyncs(
    page: Page, server: LiveServer
) -> None:
    server.manage(
        "wf", "start", "trial-reminder", "--id", "e2e-gap", "--params", '{"trial": "14 days"}'
    )
    dropped: list[str] = []

    def lose_the_first_batch(ws: Any) -> None:
        upstream = ws.connect_to_server()

        def from_server(message: str | bytes) -> None:
            # The batch that tells of the pause: an earlier one (the start's, late under
            # load) may arrive after the page's snapshot and be one the page skips anyway.
            if (
                not dropped
                and isinstance(message, str)
                and '"instance.batch"' in message
                and '"paused"' in message
            ):
                dropped.append(message)  # lost on the way, as a flaky proxy would
            else:
                ws.send(message)

        upstream.on_message(from_server)
        ws.on_message(lambda message: upstream.send(message))

    page.route_web_socket(re.compile(r"/ws/instances/$"), lose_the_first_batch)
    page.goto("/instances/?workflow=trial-reminder")
    expect(page.locator("body")).to_have_attribute("data-socket", "connected")
    mark_page(page)
    row_badge = page.locator('tr[data-instance-id="e2e-gap"] .badge')
    expect(row_badge).to_have_attribute("data-status", "waiting")
    server.manage("wf", "pause", "e2e-gap", "--workflow", "trial-reminder")
    expect(row_badge).to_have_attribute("data-status", "paused")  # by the resync's snapshot
    assert dropped, "no update was sent to drop"
    assert page.locator("body").get_attribute("data-resyncs") == "1"
    assert_not_reloaded(page)


def test_a_list_page_sent_a_resync_for_a_message_too_large_asks_for_its_rows(
    page: Page, server: LiveServer
) -> None:
    """A batch past fanout.MAX_FRAME_BYTES (a herd's) comes as a `resync` message of the
    same number: no number is skipped, so the page must ask for its rows on the message
    itself (the batch telling of the pause is replaced by one here)."""
    server.manage(
        "wf", "start", "trial-reminder", "--id", "e2e-big", "--params", '{"trial": "14 days"}'
    )
    replaced: list[str] = []

    def replace_the_pause_batch(ws: Any) -> None:
        upstream = ws.connect_to_server()

        def from_server(message: str | bytes) -> None:
            if (
                not replaced
                and isinstance(message, str)
                and '"instance.batch"' in message
                and '"paused"' in message
            ):
                replaced.append(message)
                seq = json.loads(message)["seq"]
                message = json.dumps(
                    {"type": "resync", "reason": "too large for one frame", "seq": seq}
                )
            ws.send(message)

        upstream.on_message(from_server)
        ws.on_message(lambda message: upstream.send(message))

    page.route_web_socket(re.compile(r"/ws/instances/$"), replace_the_pause_batch)
    page.goto("/instances/?workflow=trial-reminder")
    expect(page.locator("body")).to_have_attribute("data-socket", "connected")
    mark_page(page)
    row_badge = page.locator('tr[data-instance-id="e2e-big"] .badge')
    expect(row_badge).to_have_attribute("data-status", "waiting")
    server.manage("wf", "pause", "e2e-big", "--workflow", "trial-reminder")
    expect(row_badge).to_have_attribute("data-status", "paused")  # by the resync's snapshot
    assert replaced, "no update was sent to replace"
    assert page.locator("body").get_attribute("data-resyncs") == "1"
    assert_not_reloaded(page)


def test_an_in_flight_sleep_span_grows_without_a_reload_then_settles(
    page: Page, server: LiveServer
) -> None:
    create_from_form(page, "trial-reminder", "e2e-trace", '{"trial": "14 days"}')
    expect(badge(page)).to_have_attribute("data-status", "waiting")
    mark_page(page)
    sleeping = page.locator("li.span-open", has_text="sleep trial period")
    expect(sleeping).to_have_count(1)
    duration = sleeping.locator("[data-duration]")
    first = duration.text_content()
    expect(duration).not_to_have_text(first or "")  # it grows, from the server's clock
    grown = duration.text_content()
    expect(duration).not_to_have_text(grown or "")
    server.manage("wf", "skip-sleep", "e2e-trace", "--workflow", "trial-reminder")
    # Settled, live: the stored span replaces the drawn one.
    expect(page.locator("li.span:not(.span-open)", has_text="sleep trial period")).to_have_count(1)
    expect(page.locator("li.span-open", has_text="sleep trial period")).to_have_count(0)
    expect(badge(page)).to_have_attribute("data-status", "complete")
    assert_not_reloaded(page)


def test_the_socket_reconnects_after_a_server_restart(page: Page, server: LiveServer) -> None:
    page.goto("/instances/")
    expect(page.locator("body")).to_have_attribute("data-socket", "connected")
    mark_page(page)
    server.stop()
    expect(page.locator("body")).to_have_attribute("data-socket", "disconnected")
    server.start()
    expect(page.locator("body")).to_have_attribute("data-socket", "connected", timeout=30_000)
    assert_not_reloaded(page)


def test_a_page_signed_out_elsewhere_stops_reconnecting(page: Page) -> None:
    """A logout in another tab closes the page's socket (4403); every reconnect would be
    refused, so the page says so instead of retrying for ever."""
    page.goto("/instances/")
    expect(page.locator("body")).to_have_attribute("data-socket", "connected")
    other = page.context.new_page()
    other.goto("/admin/")
    other.locator("#logout-form button").click()
    expect(page.locator("body")).to_have_attribute("data-socket", "refused")
    expect(page.locator(".live-label")).to_have_text("signed out: reload the page")
    other.close()


def start_waiting_bulk_job(server: LiveServer, batch: str) -> int:
    """Three new instances tagged batch=<batch> and a bulk terminate of them, made by
    another process; returns the job's id."""
    script = (
        "from workflows_app.client import get_workflow\n"
        "wf = get_workflow('trial-reminder')\n"
        "for n in range(3):\n"
        f"    wf.create({{'trial': '14 days'}}, id=f'e2e-{batch}-{{n}}',"
        f" attributes={{'batch': '{batch}'}})\n"
        f"print(wf.bulk('terminate', attributes={{'batch': '{batch}'}}, actor='e2e').id)"
    )
    return int(server.manage("shell", "-c", script).split()[-1])


def apply_batch(server: LiveServer, job_id: int) -> None:
    """Two instances of the job, terminated by another process (as a worker would)."""
    server.manage("shell", "-c", f"from workflows_app import bulk; bulk.process_batch({job_id}, 2)")


def test_the_bulk_progress_bar_follows_its_job_over_the_socket(
    page: Page, server: LiveServer
) -> None:
    """Batches applied by another process reach the bar over the WebSocket, and the page
    never reads the job's JSON (its polling fallback) while the socket is up."""
    server.stop()
    server.env["WFDASH_EMBEDDED_WORKER"] = "0"  # the job waits for the batches applied below
    try:
        server.start()
        job_id = start_waiting_bulk_job(server, "ws")
        polled: list[str] = []
        page.on("request", lambda r: polled.append(r.url) if "/bulk-jobs/" in r.url else None)
        page.goto(f"/instances/?job={job_id}")
        panel = page.locator("[data-bulk-job-url]")
        expect(panel).to_have_attribute("data-socket", "connected")
        summary = page.locator("[data-bulk-summary]")
        expect(summary).to_contain_text("0 of 3 processed")
        mark_page(page)
        apply_batch(server, job_id)
        expect(summary).to_contain_text("2 of 3 processed: 2 applied")
        expect(page.locator("[data-bulk-progress]")).to_have_attribute("value", "2")
        apply_batch(server, job_id)
        expect(summary).to_contain_text("3 of 3 processed: 3 applied, 0 skipped, 0 failed — done")
        expect(panel).to_have_attribute("data-done", "1")
        assert_not_reloaded(page)
        assert polled == [], polled

        # Without the socket (refused here), the bar polls the job's JSON instead.
        job_id = start_waiting_bulk_job(server, "poll")
        page.route_web_socket(re.compile(r"/ws/bulk-jobs/"), lambda ws: ws.close())
        page.goto(f"/instances/?job={job_id}")
        expect(panel).to_have_attribute("data-socket", "disconnected")
        expect(summary).to_contain_text("0 of 3 processed")
        apply_batch(server, job_id)
        expect(summary).to_contain_text("2 of 3 processed: 2 applied")
        assert any(f"/bulk-jobs/{job_id}/" in url for url in polled), polled
    finally:
        server.stop()
        server.env["WFDASH_EMBEDDED_WORKER"] = "1"
        server.start()


def trace_span(page: Page, name: str) -> Any:
    """The waterfall rows (li.span) of the detail page's trace named exactly `name`."""
    return page.locator('[data-section="trace"] ol.waterfall > li.span').filter(
        has=page.locator(".span-name", has_text=re.compile(rf"^{re.escape(name)}$"))
    )


def test_screenshots_of_overview_list_and_detail(page: Page) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    # extract fails its first attempt (ConnectionError), is retried after 1 s, then succeeds.
    create_from_form(page, "data-pipeline", "e2e-pipeline", '{"rows": 12, "flaky_attempts": 1}')
    mark_page(page)
    expect(badge(page)).to_have_attribute("data-status", "complete", timeout=30_000)

    # The engine's own spans: stored by its worker and pushed to the open page (no reload).
    # Two runs (the retry parked the instance), each a root `workflow` span over its steps.
    spans = page.locator('[data-section="trace"] ol.waterfall > li.span')
    expect(spans).to_have_count(8)
    expect(trace_span(page, "create data-pipeline")).to_have_count(1)
    runs = trace_span(page, "workflow data-pipeline")
    expect(runs).to_have_count(2)
    for run in (runs.nth(0), runs.nth(1)):
        expect(run).to_have_attribute("style", re.compile(r"--depth: 0\b"))
    extract = trace_span(page, "step extract")
    expect(extract).to_have_count(2)  # the failed attempt's run and the retry's run
    for name in ("sum evens", "sum odds", "load"):
        expect(trace_span(page, f"step {name}")).to_have_count(1)
    for step in spans.filter(has=page.locator(".span-name", has_text=re.compile(r"^step "))).all():
        expect(step).to_have_attribute("style", re.compile(r"--depth: 1\b"))
    # The retry succeeded: nothing in the trace is styled as an error.
    expect(page.locator('[data-section="trace"] li.span-error')).to_have_count(0)

    # The failed attempt is an event on the first run's `step extract` span: a marker on its
    # bar, and the Errors panel links to that very span.
    marker = extract.locator('.span-event[title="step.retry_error"]')
    expect(marker).to_have_count(1)
    failed = extract.filter(has=page.locator('.span-event[title="step.retry_error"]'))
    error_link = page.locator('[data-section="errors"] a[href^="#span-"]')
    expect(error_link).to_have_count(1)
    expect(failed).to_have_attribute("id", (error_link.get_attribute("href") or "#")[1:])
    failed.locator(".span-row").click()
    expect(failed.locator(".span-row")).to_have_attribute("aria-expanded", "true")
    detail = failed.locator(".span-detail")
    expect(detail).to_be_visible()
    expect(detail).to_contain_text("step.retry_error")
    expect(detail).to_contain_text("upstream API timed out (attempt 1)")
    expect(detail).to_contain_text('"workflow.step.name": "extract"')
    first_run = (runs.nth(0).get_attribute("id") or "").removeprefix("span-")
    expect(detail).to_contain_text(f"parent {first_run}")  # nested under the first run's span
    assert_not_reloaded(page)
    page.screenshot(path=ARTIFACTS / "detail.png", full_page=True)

    page.goto("/instances/")
    expect(page.locator("body")).to_have_attribute("data-socket", "connected")
    page.screenshot(path=ARTIFACTS / "list.png", full_page=True)
    page.goto("/")
    expect(page.locator("body")).to_have_attribute("data-socket", "connected")
    page.screenshot(path=ARTIFACTS / "overview.png", full_page=True)
    page.emulate_media(color_scheme="dark")
    page.screenshot(path=ARTIFACTS / "overview-dark.png", full_page=True)
    for name in ("overview", "list", "detail"):
        assert (ARTIFACTS / f"{name}.png").stat().st_size > 10_000


def test_the_trace_marks_a_failed_step_and_its_run_as_errors(page: Page) -> None:
    # validate raises a NonRetryableError: the step and the instance fail for good.
    create_from_form(page, "data-pipeline", "e2e-corrupt", '{"corrupt": true, "flaky_attempts": 0}')
    expect(badge(page)).to_have_attribute("data-status", "errored", timeout=30_000)
    expect(page.locator('[data-section="trace"] ol.waterfall > li.span')).to_have_count(4)
    expect(trace_span(page, "create data-pipeline")).not_to_have_class(
        re.compile(r"\bspan-error\b")
    )
    expect(trace_span(page, "step extract")).not_to_have_class(re.compile(r"\bspan-error\b"))
    run = trace_span(page, "workflow data-pipeline")
    expect(run).to_have_class("span span-error")
    validate = trace_span(page, "step validate")
    expect(validate).to_have_class("span span-error")
    expect(validate).to_have_attribute("style", re.compile(r"--depth: 1\b"))
    expect(validate.locator('.span-event[title="exception"]')).to_have_count(1)
    validate.locator(".span-row").click()
    detail = validate.locator(".span-detail")
    expect(detail).to_be_visible()
    expect(detail).to_contain_text("status ERROR")
    expect(detail).to_contain_text("input contains corrupt rows")
    # A finished instance's Run group holds one line of text: it is as tall as its
    # neighbour, not stretched by the hint's 12rem flex basis (a column's basis is height).
    run_group = page.locator('[aria-labelledby="actions-run"]').bounding_box()
    restart_group = page.locator('[aria-labelledby="actions-restart"]').bounding_box()
    assert run_group is not None and restart_group is not None
    assert run_group["height"] <= restart_group["height"] + 1, (run_group, restart_group)


def test_a_refused_payload_stays_in_the_form_beside_its_error(page: Page) -> None:
    create_from_form(page, "order-approval", "e2e-refused", '{"amount": 5}')
    expect(badge(page)).to_have_attribute("data-status", "waiting")
    fill_event_form(page, "approval", '{"ok": "yes"}')
    page.get_by_role("button", name="Send event", exact=True).click()
    error = page.locator('[data-section="send-event"] [data-error-for="payload"]')
    expect(error).to_contain_text("does not match the schema")
    expect(page.locator("#ev-payload")).to_have_value('{"ok": "yes"}')
    expect(page.locator("#ev-payload")).to_have_attribute("aria-invalid", "true")
    expect(page.locator('[data-section="send-event"] .expected-payload pre')).to_contain_text(
        '"required"'
    )
    expect(page.locator(".msg.error")).to_have_count(0)  # not at the top of the page
    # A live update of the page (the instance pauses) leaves the corrected input alone.
    expect(page.locator("body")).to_have_attribute("data-socket", "connected")
    page.fill("#ev-payload", '{"ok": tru')
    page.evaluate(
        """async () => {
            const token = document.querySelector('[name=csrfmiddlewaretoken]').value;
            await fetch(`/instances/${document.body.dataset.pk}/pause/`, { method: "POST",
              redirect: "manual", headers: { "X-CSRFToken": token }, credentials: "same-origin" });
        }"""
    )
    expect(badge(page)).to_have_attribute("data-status", "paused")
    expect(page.locator('[data-section="actions"]')).to_contain_text("Resume")  # refreshed live
    expect(page.locator("#ev-payload")).to_have_value('{"ok": tru')


NARROW = {"width": 390, "height": 844}  # a phone


def test_a_390px_wide_page_does_not_scroll_sideways(page: Page) -> None:
    create_from_form(
        page,
        "data-pipeline",
        "e2e-narrow-with-a-long-identifier-0001",
        '{"corrupt": true, "flaky_attempts": 0}',
    )
    expect(badge(page)).to_have_attribute("data-status", "errored", timeout=30_000)
    detail = page.url
    page.set_viewport_size(NARROW)
    for url in ("/", "/instances/", detail, "/errors/", "/workflows/data-pipeline/"):
        page.goto(url)
        expect(page.locator("main")).to_be_visible()
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= NARROW["width"], f"{url} is {width} px wide at 390 px"
    page.goto("/instances/")
    page.get_by_text("New instance").click()
    assert page.evaluate("document.documentElement.scrollWidth") <= NARROW["width"]


def test_the_bulk_buttons_wait_for_a_ticked_row(page: Page) -> None:
    create_from_form(page, "trial-reminder", "e2e-tick", '{"trial": "14 days"}')
    expect(badge(page)).to_have_attribute("data-status", "waiting")
    page.goto("/instances/?q=e2e-tick")
    buttons = [page.get_by_role("button", name=f"{a} selected") for a in ("Pause", "Terminate")]
    for button in buttons:  # nothing ticked: a click could only be refused
        expect(button).to_be_disabled()
        assert float(button.evaluate("b => getComputedStyle(b).opacity")) < 1  # and looks it
    page.get_by_label("select e2e-tick").check()
    expect(page.locator("[data-selected-count]")).to_have_text("1")
    for button in buttons:
        expect(button).to_be_enabled()
    expect(buttons[1]).to_have_attribute(
        "data-confirm", "Terminate the 1 selected instance? This cannot be reversed."
    )
    page.get_by_label("select e2e-tick").uncheck()
    for button in buttons:
        expect(button).to_be_disabled()


def test_attribute_filter_and_bulk_terminate_with_a_live_progress_bar(page: Page) -> None:
    """Issue 16: create with attributes, filter the list by them, apply to all matching."""
    for name, tier in (("gold-0", "gold"), ("gold-1", "gold"), ("gold-2", "gold"), ("tin", "tin")):
        page.goto("/instances/")
        page.get_by_text("New instance").click()
        page.select_option("#id_workflow", "trial-reminder")
        page.fill("#id_id", f"e2e-bulk-{name}")
        page.fill("#id_params", '{"trial": "14 days"}')
        page.fill("#id_attributes", f"batch=e2e-bulk tier={tier}")
        page.get_by_role("button", name="Create").click()
        expect(badge(page)).to_have_attribute("data-status", "waiting")

    page.goto("/instances/")
    page.fill("#id_attrs", "batch=e2e-bulk tier=gold")
    page.get_by_role("button", name="Filter", exact=True).click()
    rows = page.locator("tr[data-instance-id]")
    expect(rows).to_have_count(3)
    expect(page.locator('tr[data-instance-id="e2e-bulk-tin"]')).to_have_count(0)

    page.get_by_text("Apply to all matching…").click()
    expect(page.locator("[data-matching]")).to_have_text("3")  # counted when opened
    page.select_option("#id_action", "terminate")
    asked: list[str] = []
    page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.accept()))
    page.get_by_role("button", name="Apply to all 3 matching").click()
    panel = page.locator("[data-bulk-job-url]")
    expect(panel).to_contain_text("Bulk terminate")
    # The confirmation named what it was about to do, not "this action".
    assert asked == [
        "Terminate all 3 matching instances? It runs in the background. This cannot be reversed."
    ]
    rendered_done = panel.get_attribute("data-done") == "1"
    mark_page(page)
    expect(page.locator("[data-bulk-summary]")).to_contain_text(
        "3 of 3 processed: 3 applied, 0 skipped, 0 failed — done"
    )
    expect(page.locator("[data-bulk-progress]")).to_have_attribute("value", "3")
    if not rendered_done:  # the bar moved without a reload
        assert_not_reloaded(page)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=ARTIFACTS / "bulk-progress.png", full_page=True)
    for n in range(3):
        expect(page.locator(f'tr[data-instance-id="e2e-bulk-gold-{n}"] .badge')).to_have_attribute(
            "data-status", "terminated"
        )
    page.goto("/instances/?attrs=batch%3De2e-bulk+tier%3Dtin")
    expect(page.locator('tr[data-instance-id="e2e-bulk-tin"] .badge')).to_have_attribute(
        "data-status", "waiting"
    )


# Counts the page's WebSocket constructions (performance.now() of each; their number on <html>).
COUNT_SOCKETS = """
window.__sockets = [];
window.__closes = [];
const RealWebSocket = window.WebSocket;
window.WebSocket = function (...args) {
  window.__sockets.push(performance.now());
  document.documentElement.dataset.sockets = String(window.__sockets.length);
  const socket = new RealWebSocket(...args);
  socket.addEventListener("close", (ev) => window.__closes.push([performance.now(), ev.code]));
  return socket;
};
window.WebSocket.prototype = RealWebSocket.prototype;
"""


def test_a_page_past_the_users_socket_cap_retries_slowly_and_gets_in_once_one_closes(
    browser: Browser, server: LiveServer
) -> None:
    """Past WFDASH_MAX_SOCKETS_PER_USER a socket is accepted, told why and closed with
    4429. The page reset its backoff when a socket opened, so such a page reconnected
    every 250 ms for as long as the user's other pages stayed open; its backoff now
    resets only once a snapshot arrives, and a 4429 waits the longest backoff (8 s)."""
    capped = LiveServer(
        {**server.env, "WFDASH_MAX_SOCKETS_PER_USER": "1", "WFDASH_EMBEDDED_WORKER": "0"},
        free_port(),
        server.log.with_name("capped-server.log"),
    )
    capped.start()
    context = browser.new_context(base_url=capped.url)
    context.set_default_timeout(UI_TIMEOUT_MS)
    try:
        first = context.new_page()
        first.goto("/admin/login/?next=/instances/")
        first.fill("#id_username", "admin")
        first.fill("#id_password", "admin")
        first.locator("input[type=submit]").click()
        expect(first.locator("body")).to_have_attribute("data-socket", "connected")
        second = context.new_page()
        second.add_init_script(COUNT_SOCKETS)
        second.goto("/instances/")
        expect(second.locator(".live-label")).to_have_text("too many pages open: retrying")
        # The socket opened after the first 4429 (a socket that failed for another reason
        # before it, say under a loaded CI machine, retries at the shortest backoff).
        retried = second.wait_for_function(
            """() => {
              const refused = window.__closes.find(([, code]) => code === 4429);
              const next = refused && window.__sockets.find((t) => t > refused[0]);
              return next === undefined ? null : [refused[0], next];
            }""",
            timeout=30_000,
        ).json_value()
        record = second.evaluate("({opened: window.__sockets, closed: window.__closes})")
        assert retried[1] - retried[0] >= 0.75 * 8000 - 5, record  # not a 250 ms storm
        first.close()  # a slot frees up: the next retry gets in
        expect(second.locator("body")).to_have_attribute("data-socket", "connected", timeout=30_000)
    finally:
        context.close()
        capped.stop()
