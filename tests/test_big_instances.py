"""Instances that grow big over their life (a year-long loop of steps, sleeps and events):
what every surface shows of them stays bounded, and a step costs what it costs a small one."""

from __future__ import annotations

import asyncio
import json
import re
import time
from io import StringIO
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db.models import signals
from django.test import Client
from django.urls import reverse

from workflows_app import admin as admin_module
from workflows_app import api, dashboard, testing, tokens
from workflows_app.client import InstanceHandle, get_workflow
from workflows_app.engine import WorkflowEntrypoint, register
from workflows_app.management.commands import wf as wf_command
from workflows_app.models import HistoryRecord, Instance, Span, StepRecord

pytestmark = pytest.mark.django_db(transaction=True)

LOOP = "big-loop"
BESIDE = "big-beside"  # the loop beside an event wait started first
FAN = "big-fan"  # starts as many children as it is asked to
CHILD = "big-child"


@pytest.fixture(autouse=True)
def loop(registered: list[str]) -> None:
    @register(LOOP, limits={"max_steps_per_workflow": 10_000})
    class Loop(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            for i in range(event.payload["steps"]):
                await step.do(f"s{i}", lambda: {"ok": 1})
            await step.wait_for_event("ev", type="go", timeout="10 days")
            for i in range(event.payload.get("then", 0)):
                await step.do(f"t{i}", lambda: {"ok": 1})
            return "done"

    @register(BESIDE, limits={"max_steps_per_workflow": 10_000})
    class Beside(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            async def loop() -> None:
                for i in range(event.payload["steps"]):
                    await step.do(f"s{i}", lambda: {"ok": 1}, compensate=lambda out: None)

            await asyncio.gather(step.wait_for_event("early", type="go", timeout="10 days"), loop())
            return "done"

    @register(FAN, limits={"max_steps_per_workflow": 10_000})
    class Fan(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            for i in range(event.payload["children"]):
                await step.start(f"c{i}", CHILD, id=f"child-{i}")
            return "done"

    @register(CHILD)
    class Child(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            return "ok"


def grown(steps: int, then: int = 0, instance_id: str = "big-1") -> InstanceHandle:
    """An instance parked on its event wait after `steps` completed steps."""
    handle = get_workflow(LOOP).create(id=instance_id, params={"steps": steps, "then": then})
    testing.run_until_idle()
    assert handle.status().status == "waiting", handle.status()
    return handle


@pytest.fixture
def admin_client() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("boss", password="pw"))
    return client


def cells(page: str, field: str) -> list[str]:
    return re.findall(rf'<td class="field-{field}">\s*<p>([^<]*)</p>', page)


# --- the admin's instance page -----------------------------------------------------------


def test_the_admin_instance_page_shows_the_newest_steps_and_history_and_links_to_all(
    admin_client, monkeypatch
):
    monkeypatch.setattr(admin_module, "INLINE_ROWS", 5, raising=False)
    row = grown(12).row()
    page = admin_client.get(reverse("admin:workflows_app_instance_change", args=[row.pk]))
    assert page.status_code == 200
    text = page.content.decode()
    # the newest five of 13 steps (12 + the wait), oldest first
    assert cells(text, "name") == ["s8", "s9", "s10", "s11", "ev"]
    assert cells(text, "sequence") == ["23", "24", "25", "26", "27"]  # of 27 history records
    steps = reverse("admin:workflows_app_steprecord_changelist") + f"?instance__id__exact={row.pk}"
    history = reverse("admin:workflows_app_historyrecord_changelist")
    assert f'Step records (the newest 5 of 13: <a href="{steps}">all step records</a>)' in text
    assert f'the newest 5 of 27: <a href="{history}?instance__id__exact={row.pk}">' in text
    everything = admin_client.get(steps)
    assert everything.status_code == 200 and "13 step records" in everything.content.decode()


def test_the_admin_instance_page_of_a_small_instance_shows_every_row(admin_client):
    row = grown(3).row()
    text = admin_client.get(reverse("admin:workflows_app_instance_change", args=[row.pk]))
    text = text.content.decode()
    assert cells(text, "name") == ["s0", "s1", "s2", "ev"]
    assert "the newest" not in text


# --- the dashboard's instance page ---------------------------------------------------------


def step_names(page: str) -> list[str]:
    return re.findall(r'<tr data-step="([^"]*)"', page)


def span_names(page: str) -> list[str]:
    return re.findall(r'<span class="span-name" dir="auto">([^<]*)</span>', page)


def test_the_dashboard_shows_the_newest_steps_and_spans_and_every_open_step(
    admin_client, monkeypatch
):
    monkeypatch.setattr(dashboard, "STEPS_ON_PAGE", 5, raising=False)
    monkeypatch.setattr(dashboard, "SPANS_ON_PAGE", 6, raising=False)
    handle = get_workflow(BESIDE).create(id="beside-1", params={"steps": 12})
    testing.run_until_idle()
    assert handle.status().status == "waiting"
    for url in (
        reverse("workflows:instance", args=[BESIDE, "beside-1"]),
        reverse("workflows:instance-live", args=[handle.row().pk]),
    ):
        page = admin_client.get(url).content.decode()
        # the wait started first is still open: shown, with the newest five steps
        assert step_names(page) == ["early", "s7", "s8", "s9", "s10", "s11"]
        assert "The newest 6 of 13 steps" in page
        assert "waiting for event “go” (early)" in page  # why it waits, from the open step
        assert re.search(r"<td>early</td><td class=\"mono\">go</td>", page)  # pending events
        # the newest six stored spans, the run they belong to, and the open wait drawn
        names = span_names(page)
        assert names == [
            f"workflow {BESIDE}",
            *(f"step s{i}" for i in range(6, 12)),
            "waitForEvent early",
        ]
        assert "The newest spans of 14" in page
        # a cancel would compensate every completed step, not only those shown
        assert "“s11”, “s10”" in page and "and 2 more, newest first" in page


def test_the_dashboard_shows_every_step_and_span_of_a_small_instance(admin_client):
    handle = grown(3)
    page = admin_client.get(reverse("workflows:instance", args=[LOOP, handle.id])).content.decode()
    assert step_names(page) == ["s0", "s1", "s2", "ev"]
    assert "The newest" not in page
    assert span_names(page) == [
        f"create {LOOP}",
        f"workflow {LOOP}",
        "step s0",
        "step s1",
        "step s2",
        "waitForEvent ev",
    ]


def test_deleting_an_instance_in_the_admin_counts_its_rows_instead_of_listing_them(admin_client):
    handle = grown(12)
    handle.terminate()
    url = reverse("admin:workflows_app_instance_delete", args=[handle.row().pk])
    history = HistoryRecord.objects.count()
    page = admin_client.get(url).content.decode()
    assert "<li>13 step records</li>" in page and f"<li>{history} history records</li>" in page
    assert "s11" not in page  # no line per step (nor per history record or span)
    assert re.search(r"<li>Step records: 13</li>", page)
    assert admin_client.post(url, {"post": "yes"}).status_code == 302
    assert not StepRecord.objects.exists() and not HistoryRecord.objects.exists()
    assert not Span.objects.exists() and not Instance.objects.exists()


# --- the engine: a step of a big instance costs what it costs a small one -----------------


def statements_to_resume(steps: int, then: int) -> int:
    handle = grown(steps, then, instance_id=f"big-{steps}-{then}")
    handle.send_event("go")
    with testing.QueryCounter() as counter:
        testing.run_until_idle()
    assert handle.status().status == "complete", handle.status()
    return counter.count


def test_a_resume_and_its_new_steps_take_as_many_statements_however_many_steps_came_before():
    small = statements_to_resume(0, 20)
    big = statements_to_resume(400, 20)
    # loading the checkpoints is one read whatever their number; replaying them reads and
    # writes nothing; each new step writes what it writes in a small instance
    assert big == small
    assert statements_to_resume(400, 40) - big == statements_to_resume(0, 40) - small


# --- the JSON API's instance --------------------------------------------------------------


@pytest.fixture
def api_get() -> Any:
    _, secret = tokens.issue("reader", scope="read")
    client = Client()

    def get(path: str) -> Any:
        response = client.get(
            f"/api/workflows/{path}", headers={"Authorization": f"Bearer {secret}"}
        )
        assert response.status_code == 200, response.content[:300]
        return response.json()

    return get


def test_the_api_instance_shows_the_newest_steps_and_every_open_one_and_pages_the_rest(
    api_get, monkeypatch
):
    # One response held every step: 12 MB at 50,000 steps.
    monkeypatch.setattr(api, "STEPS_IN_INSTANCE", 5, raising=False)
    monkeypatch.setattr(api, "STEPS_PAGE", 4, raising=False)
    handle = get_workflow(BESIDE).create(id="beside-1", params={"steps": 12})
    testing.run_until_idle()
    shown = api_get(f"{BESIDE}/instances/beside-1")["result"]
    # the wait started first is still open: shown, with the newest five steps
    assert [s["name"] for s in shown["steps"]] == ["early", "s7", "s8", "s9", "s10", "s11"]
    assert shown["steps_total"] == 13
    names, cursor = [], "0"
    while cursor is not None:
        page = api_get(f"{BESIDE}/instances/beside-1/steps?cursor={cursor}")
        assert len(page["result"]) <= 4 and page["result_info"]["per_page"] == 4
        names += [s["name"] for s in page["result"]]
        cursor = page["result_info"]["cursor"]
    assert names == [s.name for s in handle.steps()] and len(names) == 13
    assert [s["name"] for s in api_get(f"{BESIDE}/instances/beside-1/steps?limit=2")["result"]] == [
        "early",
        "s0",
    ]


def test_the_api_instance_of_a_small_instance_shows_every_step(api_get):
    handle = grown(3)
    shown = api_get(f"{LOOP}/instances/{handle.id}")["result"]
    assert [s["name"] for s in shown["steps"]] == ["s0", "s1", "s2", "ev"]
    assert shown["steps_total"] == 4 and shown["children"] == [] and shown["children_total"] == 0


def fanned(children: int) -> InstanceHandle:
    handle = get_workflow(FAN).create(id="fan-1", params={"children": children})
    testing.run_until_idle()
    assert handle.status().status == "complete", handle.status()
    return handle


def test_the_api_instance_shows_the_newest_children_and_pages_them_all(api_get, monkeypatch):
    monkeypatch.setattr(api, "CHILDREN_IN_INSTANCE", 3, raising=False)
    monkeypatch.setattr(api, "CHILDREN_PAGE", 4, raising=False)
    fanned(7)
    shown = api_get(f"{FAN}/instances/fan-1")["result"]
    assert [c["id"] for c in shown["children"]] == ["child-4", "child-5", "child-6"]
    assert shown["children_total"] == 7
    ids, cursor = [], "0"
    while cursor is not None:
        page = api_get(f"{FAN}/instances/fan-1/children?cursor={cursor}")
        assert len(page["result"]) <= 4
        ids += [c["id"] for c in page["result"]]
        cursor = page["result_info"]["cursor"]
    assert ids == [f"child-{i}" for i in range(7)]


# --- wf watch ------------------------------------------------------------------------------


def test_wf_watch_reads_only_what_is_new_at_each_poll(monkeypatch):
    """Each poll read the whole history and every step: 150,000 rows a poll (every half
    second) at 50,000 steps."""
    handle = grown(300, then=2)
    read: list[str] = []

    def count(sender: Any, **kwargs: Any) -> None:
        read.append(sender.__name__)

    real_sleep = time.sleep
    polls = []

    def between_polls(seconds: float) -> None:
        if seconds != wf_command.POLL_SECONDS:
            return real_sleep(seconds)
        polls.append(len(read))
        if len(polls) == 1:  # after the first poll: the instance moves on
            handle.send_event("go")
            testing.run_until_idle()
            signals.post_init.connect(count, sender=StepRecord)
            signals.post_init.connect(count, sender=HistoryRecord)

    monkeypatch.setattr(wf_command.time, "sleep", between_polls)
    out = StringIO()
    try:
        call_command("wf", "watch", handle.id, stdout=out, stderr=StringIO())
    finally:
        signals.post_init.disconnect(count, sender=StepRecord)
        signals.post_init.disconnect(count, sender=HistoryRecord)
    lines = out.getvalue().splitlines()
    assert sum("step 's299' (do) complete" in line for line in lines) == 1
    assert sum("step 'ev' (waitForEvent) waiting" in line for line in lines) == 1
    assert sum("step 'ev' (waitForEvent) complete" in line for line in lines) == 1
    assert "step 't1' (do) complete" in lines[-2] and lines[-1].startswith("finished: complete")
    history = [int(n) for n in re.findall(r"#(\d+)", out.getvalue())]
    assert history == sorted(set(history)) == list(range(1, len(history) + 1))
    # the second poll read the wait (open at the first), the two new steps and the history
    # after the wait: not the 300 steps and 600 records before
    assert read.count("StepRecord") == 3
    assert read.count("HistoryRecord") < 20


def test_the_dashboard_shows_the_newest_children_and_the_child_of_each_step_shown(
    admin_client, monkeypatch
):
    # Every child was read and listed: an instance with 10,000 children took 5.8 s and 2 MB.
    monkeypatch.setattr(dashboard, "CHILDREN_ON_PAGE", 3, raising=False)
    handle = fanned(7)
    for url in (
        reverse("workflows:instance", args=[FAN, "fan-1"]),
        reverse("workflows:instance-live", args=[handle.row().pk]),
    ):
        page = admin_client.get(url).content.decode()
        children = page[page.index('data-section="children"') : page.index('data-section="steps"')]
        assert re.findall(r">big-child/(child-\d)</a>", children) == [
            "child-4",
            "child-5",
            "child-6",
        ]
        assert "The newest 3 of 7 children" in children
        # every start step shown still links the child it started
        assert all(f"/{CHILD}/child-{i}" in page for i in range(7))


def test_wf_status_shows_the_newest_children_and_how_many_there_are(monkeypatch):
    # It printed a line per child: 10,000 lines, 0.63 MB and 5-7 s for a fan-out of 10,000.
    monkeypatch.setattr(wf_command, "STATUS_CHILDREN", 3, raising=False)
    fanned(7)
    out = StringIO()
    call_command("wf", "status", "fan-1", stdout=out, stderr=StringIO())
    text = out.getvalue()
    assert re.findall(r"^child:\s+big-child/(child-\d)", text, re.M) == [
        "child-4",
        "child-5",
        "child-6",
    ]
    assert "children: 7, the newest 3 below; the API's …/children lists them all" in text
    out = StringIO()
    call_command("wf", "status", "fan-1", "--json", stdout=out, stderr=StringIO())
    data = json.loads(out.getvalue())
    assert [c["id"] for c in data["children"]] == ["child-4", "child-5", "child-6"]
    assert data["children_total"] == 7
