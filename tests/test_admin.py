"""The Django admin: every model's pages, the instance actions and their permission, tokens."""

from __future__ import annotations

import hashlib
import html
import json
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.contrib.staticfiles import finders
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from tests.surface_flows import (
    APPROVAL,
    COMPENSATIONS,
    SIMPLE,
    register_flows,
    snapshot,
    waiting_approval,
)
from workflows_app import admin as admin_module
from workflows_app import testing, tokens
from workflows_app.client import get_workflow, schedules
from workflows_app.models import (
    ApiToken,
    BulkJob,
    ErrorRecord,
    HistoryRecord,
    InboxEvent,
    Instance,
    Schedule,
    Span,
    StepRecord,
    WorkflowVersion,
)

pytestmark = pytest.mark.django_db(transaction=True)

MODELS = [
    Instance,
    StepRecord,
    HistoryRecord,
    InboxEvent,
    Span,
    ErrorRecord,
    WorkflowVersion,
    ApiToken,
    BulkJob,
]
XSS = "<script>alert('x')</script>"


@pytest.fixture(autouse=True)
def flows(registered: list[str]) -> None:
    register_flows()
    COMPENSATIONS.clear()


@pytest.fixture
def admin_client() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("boss", password="pw"))
    return client


def staff_client(name: str, *codenames: str) -> Client:
    user = User.objects.create_user(name, is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    client = Client()
    client.force_login(user)
    return client


def changelist(model: type) -> str:
    return reverse(f"admin:workflows_app_{model._meta.model_name}_changelist")


def change(obj: object) -> str:
    return reverse(f"admin:workflows_app_{obj._meta.model_name}_change", args=[obj.pk])


def act(client: Client, action: str, *rows: Instance) -> list[str]:
    """Run an admin action on instances; returns the messages it showed."""
    response = client.post(
        changelist(Instance),
        {"action": action, "_selected_action": [r.pk for r in rows]},
        follow=True,
    )
    assert response.status_code == 200
    return [str(m) for m in response.context["messages"]]


def some_of_everything() -> Instance:
    """One row of every model, with user data that must come out escaped."""
    handle = get_workflow(APPROVAL).create(params={"note": XSS}, id="o-1")
    testing.run_until_idle()
    handle.send_event("other", {"html": XSS})
    row = handle.row()
    now = timezone.now()
    Span.objects.create(
        instance=row,
        trace_id=row.trace_id,
        span_id="a" * 16,
        name=f"step {XSS}",
        kind="INTERNAL",
        start_time=now,
        end_time=now + timedelta(milliseconds=5),
        attributes={"x": XSS},
    )
    ErrorRecord.objects.create(
        instance=row,
        workflow=APPROVAL,
        source="workflow.step",
        step_name="charge",
        attempt=1,
        name="ValueError",
        message=XSS,
        created_at=now,
    )
    ApiToken.objects.create(name="svc", token_hash="0" * 64, prefix="wf_abcde", created_at=now)
    get_workflow(APPROVAL).bulk("send_event", event_type="note", payload={"html": XSS}, actor=XSS)
    return row


# --- pages ------------------------------------------------------------------------------


def test_every_model_has_a_list_and_a_detail_page_that_escape_user_data(admin_client):
    some_of_everything()
    for model in MODELS:
        assert model.objects.exists(), model
        response = admin_client.get(changelist(model))
        assert response.status_code == 200, model
        assert XSS not in response.content.decode(), model
        detail = admin_client.get(change(model.objects.first()))
        assert detail.status_code == 200, model
        assert XSS not in detail.content.decode(), model


def list_queries(client: Client, url: str) -> int:
    with CaptureQueriesContext(connection) as queries:
        assert client.get(url).status_code == 200
    return len(queries.captured_queries)


def test_the_schedule_list_takes_as_many_queries_for_many_rows_as_for_one(admin_client):
    def add_schedules(start: int, count: int) -> None:
        for n in range(start, start + count):
            schedules.create(f"s-{n}", workflow=SIMPLE, cron="0 3 * * *")
            schedules.get(f"s-{n}").trigger()  # a last instance for the list to link

    add_schedules(0, 1)
    one = list_queries(admin_client, changelist(Schedule))
    add_schedules(1, 10)
    assert list_queries(admin_client, changelist(Schedule)) == one
    page = admin_client.get(changelist(Schedule)).content.decode()
    last = Instance.objects.get(schedule="s-7")
    assert f'<a href="{change(last)}">{last.instance_id}</a>' in page


def test_the_token_list_takes_as_many_queries_for_many_rows_as_for_one(admin_client):
    def add_tokens(start: int, count: int) -> None:
        for n in range(start, start + count):
            User.objects.create_user(f"u-{n}")
            tokens.issue(f"t-{n}", f"u-{n}", "read")

    add_tokens(0, 1)
    one = list_queries(admin_client, changelist(ApiToken))
    add_tokens(1, 10)
    assert list_queries(admin_client, changelist(ApiToken)) == one


def test_the_instance_page_shows_pretty_params_steps_and_history(admin_client):
    row = some_of_everything()
    page = admin_client.get(change(row)).content.decode()
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    assert re.search(r"<pre[^>]*>\{\n  <bdi>&quot;note&quot;</bdi>: <bdi>&quot;&lt;script", page)
    assert "charge" in page and "waitForEvent" in page  # the steps inline
    assert "instance.created" in page and "event.waiting" in page  # the history inline


def test_json_in_the_admin_isolates_each_string_so_right_to_left_text_reorders_only_itself(
    admin_client,
):
    """In a <pre> line of JSON, a right-to-left key and value (or a U+202E in one) were laid
    out as one right-to-left run: the value read before its key, the punctuation moved.
    Each string (keys too) is now its own <bdi>, escaped inside."""
    handle = get_workflow(APPROVAL).create(params={"שם": "עולם\u202e<b>", "n": 1}, id="rtl-1")
    page = admin_client.get(change(handle.row())).content.decode()
    assert "<bdi>&quot;n&quot;</bdi>: 1" in page
    assert "<bdi>&quot;שם&quot;</bdi>: <bdi>&quot;עולם\u202e&lt;b&gt;&quot;</bdi>" in page


def test_the_instance_list_filters_and_searches(admin_client):
    waiting_approval("o-1")
    get_workflow(SIMPLE).create(id="s-1")
    page = admin_client.get(changelist(Instance) + "?status__exact=waiting").content.decode()
    assert "o-1" in page and "s-1" not in page
    page = admin_client.get(changelist(Instance) + "?q=s-1").content.decode()
    assert "s-1" in page and "o-1" not in page


def test_an_instance_cannot_be_edited_added_or_deleted_while_it_runs_in_the_admin(admin_client):
    row = waiting_approval("o-1").row()
    before = snapshot()
    assert admin_client.post(change(row), {"status": "complete"}).status_code == 403
    # The add page starts an instance through the client; a row's fields add nothing.
    add = reverse("admin:workflows_app_instance_add")
    assert admin_client.post(add, {"status": "complete", "instance_id": "x"}).status_code == 400
    assert (
        admin_client.post(
            reverse("admin:workflows_app_instance_delete", args=[row.pk]), {"post": "yes"}
        ).status_code
        == 403
    )
    assert snapshot() == before


# --- actions ----------------------------------------------------------------------------


def test_pause_resume_terminate_and_restart_act_as_the_admin_user(admin_client):
    row = waiting_approval("o-1").row()
    assert act(admin_client, "pause", row) == ["Pause: 1 instance(s)."]
    assert Instance.objects.get(pk=row.pk).status == "paused"
    act(admin_client, "resume", row)
    assert Instance.objects.get(pk=row.pk).status == "running"
    act(admin_client, "terminate", row)
    assert Instance.objects.get(pk=row.pk).status == "terminated"
    act(admin_client, "restart", row)
    assert Instance.objects.get(pk=row.pk).status == "running"
    actors = dict(HistoryRecord.objects.filter(instance=row).values_list("type", "actor"))
    assert {
        actors[t]
        for t in (
            "instance.paused",
            "instance.resumed",
            "instance.terminated",
            "instance.restarted",
        )
    } == {"boss"}


def test_cancel_runs_the_compensations(admin_client):
    row = waiting_approval("o-1", amount=2).row()
    act(admin_client, "cancel", row)
    testing.run_until_idle()
    assert Instance.objects.get(pk=row.pk).status == "terminated"
    assert COMPENSATIONS == [{"amount": 2}]


def test_an_action_reports_each_instance_it_could_not_change_and_changes_the_others(admin_client):
    waiting = waiting_approval("o-1").row()
    done = get_workflow(SIMPLE).create(id="s-1")
    testing.run_until_idle()
    messages = act(admin_client, "pause", waiting, done.row())
    refused = f"Could not pause {SIMPLE}/s-1: cannot pause instance 's-1': it is already complete"
    assert any(m.startswith(refused) for m in messages), messages
    assert "Pause: 1 instance(s)." in messages
    assert Instance.objects.get(pk=waiting.pk).status == "paused"
    messages = act(admin_client, "terminate", done.row())
    assert messages == [f"Could not terminate {SIMPLE}/s-1: it had already finished (complete)"]


def test_an_action_over_more_instances_than_a_request_should_change_starts_bulk_jobs(
    admin_client, monkeypatch
):
    """ "Select all N" over a big table must not change N instances inside one request
    (loading every row and holding the request past any proxy's timeout)."""
    monkeypatch.setattr(admin_module, "ACTION_ROWS_IN_REQUEST", 2)
    for n in range(3):
        waiting_approval(f"o-{n}")
    get_workflow(SIMPLE).create(id="s-1")  # running: a second workflow, a second job
    response = admin_client.post(
        changelist(Instance),
        {"action": "terminate", "select_across": "1", "index": "0", "_selected_action": ["1"]},
        follow=True,
    )
    messages = [str(m) for m in response.context["messages"]]
    jobs = {job.workflow: job for job in BulkJob.objects.all()}
    assert {w: (j.action, j.matched, j.actor) for w, j in jobs.items()} == {
        APPROVAL: ("terminate", 3, "boss"),
        SIMPLE: ("terminate", 1, "boss"),
    }
    assert f"Started bulk terminate #{jobs[APPROVAL].pk} of 3 instance(s) of {APPROVAL}" in (
        " ".join(messages)
    )
    assert Instance.objects.filter(status="terminated").count() == 0  # not in the request
    testing.run_until_idle()  # the workers apply the jobs
    statuses = set(Instance.objects.filter(workflow=APPROVAL).values_list("status", flat=True))
    assert statuses == {"terminated"}
    simple = BulkJob.objects.get(workflow=SIMPLE)  # s-1 may have completed first: skipped
    assert simple.finished_at is not None and simple.applied + simple.skipped == 1
    act(admin_client, "pause", *Instance.objects.all()[:2])  # at the limit: in the request
    assert BulkJob.objects.count() == 2


def test_select_all_neither_counts_nor_reads_every_selected_row_before_its_jobs(
    admin_client, monkeypatch
):
    """ "Select all" over 1.07M instances first counted them all (74 ms) and read the
    workflows by SELECT DISTINCT over them all (143 ms) before the jobs' own snapshot:
    now a count up to the limit and one index probe per workflow (1 ms and 12 ms)."""
    monkeypatch.setattr(admin_module, "ACTION_ROWS_IN_REQUEST", 2)
    for n in range(3):
        waiting_approval(f"o-{n}")
    get_workflow(SIMPLE).create(id="s-1")
    table = Instance._meta.db_table
    with CaptureQueriesContext(connection) as queries:
        admin_client.post(
            changelist(Instance),
            {"action": "pause", "select_across": "1", "index": "0", "_selected_action": ["1"]},
        )
    assert BulkJob.objects.count() == 2
    reads = [q["sql"] for q in queries.captured_queries if f'FROM "{table}"' in q["sql"]]
    assert not [sql for sql in reads if "DISTINCT" in sql], reads
    counts = [sql for sql in reads if "COUNT(" in sql]
    # The changelist's own count of the selection aside, the action's is bounded.
    assert any("LIMIT 3" in sql for sql in counts), counts
    assert admin_module.workflows_of(Instance.objects.all()) == sorted([APPROVAL, SIMPLE])
    assert admin_module.workflows_of(Instance.objects.filter(workflow=SIMPLE)) == [SIMPLE]
    assert admin_module.workflows_of(Instance.objects.none()) == []


def test_a_staff_user_without_change_permission_cannot_run_actions():
    row = waiting_approval("o-1").row()
    viewer = staff_client("viewer", "view_instance")
    assert viewer.get(changelist(Instance)).status_code == 200
    before = snapshot()
    messages = act(viewer, "pause", row)
    assert snapshot() == before
    assert not any("Pause" in m for m in messages)
    operator = staff_client("operator", "view_instance", "change_instance")
    assert act(operator, "pause", row) == ["Pause: 1 instance(s)."]


def test_a_finished_instance_can_be_deleted(admin_client):
    handle = get_workflow(SIMPLE).create(id="s-1")
    testing.run_until_idle()
    response = admin_client.post(
        reverse("admin:workflows_app_instance_delete", args=[handle.row().pk]), {"post": "yes"}
    )
    assert response.status_code == 302
    assert not Instance.objects.exists() and not StepRecord.objects.exists()


# --- skip sleep, send event, restart from a step, create (SPEC section 6) -----------------


def sleeping_approval(instance_id: str) -> Instance:
    """An approval instance in its one-hour cool-off sleep."""
    handle = waiting_approval(instance_id)
    handle.send_event("approval", {"ok": True})
    testing.run_until_idle()
    assert handle.status().status == "waiting" and handle.row().wake_at is not None
    return handle.row()


def act_with_form(client: Client, action: str, fields: dict[str, Any], *rows: Instance) -> Any:
    """An action that asks for input: pick it in the list (its form page), then apply it."""
    selection = {"action": action, "index": "0", "_selected_action": [r.pk for r in rows]}
    page = client.post(changelist(Instance), selection)
    assert page.status_code == 200, page.content[:500]
    text = page.content.decode()
    assert 'name="csrfmiddlewaretoken"' in text and 'name="apply"' in text
    for pk in selection["_selected_action"]:
        assert f'name="_selected_action" value="{pk}"' in text
    return client.post(changelist(Instance), {**selection, **fields, "apply": "1"}, follow=True)


def shown_messages(response: Any) -> list[str]:
    return [str(m) for m in response.context["messages"]]


def test_skip_sleep_wakes_each_sleeping_instance_and_names_those_not_sleeping(admin_client):
    sleeping = sleeping_approval("o-1")
    waiting = waiting_approval("o-2").row()
    before = snapshot()["events"]
    messages = act(admin_client, "skip_sleep", sleeping, waiting)
    assert messages == [
        f"Could not skip sleep {APPROVAL}/o-2: instance 'o-2' is not sleeping (it is waiting)",
        "Skip sleep: 1 instance(s).",
    ]
    testing.run_until_idle()
    assert Instance.objects.get(pk=sleeping.pk).status == "complete"
    assert Instance.objects.get(pk=waiting.pk).status == "waiting"
    assert snapshot()["events"] == before
    skipped = HistoryRecord.objects.filter(type="sleep.skipped")
    assert list(skipped.values_list("instance_id", "actor")) == [(sleeping.pk, "boss")]


def test_send_event_asks_for_the_type_and_payload_and_sends_it_to_each_instance(admin_client):
    rows = [waiting_approval("o-1").row(), waiting_approval("o-2").row()]
    response = act_with_form(
        admin_client, "send_event", {"type": "approval", "payload": '{"ok": true}'}, *rows
    )
    assert response.redirect_chain[-1][0].startswith(changelist(Instance))
    assert shown_messages(response) == ["Send event: 2 instance(s)."]
    events = InboxEvent.objects.filter(type="approval")
    assert sorted(events.values_list("instance_id", "actor")) == [(r.pk, "boss") for r in rows]
    testing.run_until_idle()
    assert {Instance.objects.get(pk=r.pk).wake_at is not None for r in rows} == {True}


def test_send_event_reports_each_instance_whose_wait_refuses_the_payload(admin_client):
    waiting = waiting_approval("o-1").row()
    done = get_workflow(SIMPLE).create(id="s-1")
    testing.run_until_idle()
    response = act_with_form(
        admin_client, "send_event", {"type": "approval", "payload": '{"ok": "yes"}'}, waiting
    )
    [message] = shown_messages(response)
    assert message.startswith(f"Could not send event {APPROVAL}/o-1: payload of event 'approval'")
    assert "ok: 'yes' is not of type 'boolean'" in message
    assert not InboxEvent.objects.exists()
    response = act_with_form(
        admin_client, "send_event", {"type": "note", "payload": ""}, waiting, done.row()
    )
    messages = shown_messages(response)
    assert "Send event: 1 instance(s)." in messages
    assert any(m.startswith(f"Could not send event {SIMPLE}/s-1: ") for m in messages), messages


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"type": "approval", "payload": '{"ok": tru'}, "Not valid JSON: Expecting value"),
        ({"type": "", "payload": "{}"}, "This field is required."),
        ({"type": XSS, "payload": "{}"}, "invalid event type"),
        (
            {"type": "approval", "payload": '"' + "x" * (1024 * 1024) + '"'},
            "max_event_payload_bytes is 1048576 bytes",
        ),
    ],
    ids=["bad-json", "no-type", "invalid-type", "oversized-payload"],
)
def test_send_event_refuses_bad_input_on_its_form_and_changes_nothing(admin_client, fields, error):
    row = waiting_approval("o-1").row()
    before = snapshot()
    response = act_with_form(admin_client, "send_event", fields, row)
    assert response.status_code == 400
    page = response.content.decode()
    assert html.escape(error, quote=False) in page.replace("&#x27;", "'"), page[-3000:]
    assert XSS not in page
    assert 'value="approval"' in page or fields["type"] != "approval"  # the input is kept
    assert snapshot() == before


def test_restart_from_a_step_asks_for_the_step_and_keeps_the_checkpoints_before_it(admin_client):
    handle = get_workflow(SIMPLE).create(id="s-1")
    testing.run_until_idle()
    row = handle.row()
    one = StepRecord.objects.get(instance=row, name="one").pk
    response = act_with_form(admin_client, "restart_from_step", {"from_step": "two"}, row)
    assert shown_messages(response) == ["Restart: 1 instance(s)."]
    assert Instance.objects.get(pk=row.pk).status == "running"
    assert list(StepRecord.objects.filter(instance=row).values_list("pk", flat=True)) == [one]
    restarted = HistoryRecord.objects.get(instance=row, type="instance.restarted")
    assert restarted.actor == "boss" and "two" in json.dumps(restarted.data)
    testing.run_until_idle()
    assert Instance.objects.get(pk=row.pk).status == "complete"


def test_restart_from_a_step_refuses_bad_input_and_names_each_instance_without_it(admin_client):
    handle = get_workflow(SIMPLE).create(id="s-1")
    testing.run_until_idle()
    row = handle.row()
    before = snapshot()
    for fields, error in [
        ({"from_step": ""}, "This field is required."),
        ({"from_step": "two", "version": "0"}, "greater than or equal to 1"),
        ({"from_step": "two", "version": "7"}, "version 7"),
    ]:
        response = act_with_form(admin_client, "restart_from_step", fields, row)
        assert response.status_code == 400, fields
        assert error in response.content.decode(), (fields, response.content.decode()[-3000:])
    response = act_with_form(admin_client, "restart_from_step", {"from_step": "<b>nope"}, row)
    assert shown_messages(response) == [
        f"Could not restart {SIMPLE}/s-1: instance 's-1' has no step named '<b>nope'"
    ]
    assert "&lt;b&gt;nope" in response.content.decode()
    assert "<b>nope" not in response.content.decode()
    assert snapshot() == before


def test_the_new_actions_need_the_change_permission():
    sleeping = sleeping_approval("o-1")
    viewer = staff_client("viewer", "view_instance")
    before = snapshot()
    for action in ("skip_sleep", "send_event", "restart_from_step"):
        response = viewer.post(
            changelist(Instance),
            {"action": action, "index": "0", "_selected_action": [sleeping.pk], "apply": "1"},
            follow=True,
        )
        assert response.status_code == 200  # the list: it offers a viewer no action
        assert shown_messages(response) == [], action
    for verb in ("skip-sleep", "send-event", "restart-from-step"):
        act_url = reverse("admin:workflows_app_instance_act", args=[sleeping.pk, verb])
        assert viewer.post(act_url, {"apply": "1", "type": "approval"}).status_code == 403
    assert viewer.get(reverse("admin:workflows_app_instance_add")).status_code == 403
    assert viewer.post(reverse("admin:workflows_app_instance_add"), {}).status_code == 403
    assert "instance/add/" not in viewer.get(changelist(Instance)).content.decode()
    assert snapshot() == before


def test_an_instance_page_offers_skip_sleep_send_event_and_restart_from_a_step(admin_client):
    row = waiting_approval("o-1").row()
    other = waiting_approval("o-2").row()
    page = admin_client.get(change(row)).content.decode()
    for label in ("Skip sleep", "Send event…", "Restart from a step…"):
        assert f">{label}</button>" in page
    act_url = reverse("admin:workflows_app_instance_act", args=[row.pk, "send-event"])
    form_page = admin_client.post(act_url)
    assert form_page.status_code == 200
    assert f'action="{act_url}"' in form_page.content.decode()
    assert f'href="{change(row)}"' in form_page.content.decode()  # cancel: back to the page
    response = admin_client.post(
        act_url, {"type": "approval", "payload": '{"ok": true}', "apply": "1"}, follow=True
    )
    assert response.redirect_chain[-1][0] == change(row)
    assert shown_messages(response) == ["Send event: 1 instance(s)."]
    assert list(InboxEvent.objects.values_list("instance_id", flat=True)) == [row.pk]
    assert other.pk != row.pk
    testing.run_until_idle()
    skip_url = reverse("admin:workflows_app_instance_act", args=[row.pk, "skip-sleep"])
    assert shown_messages(admin_client.post(skip_url, follow=True)) == [
        "Skip sleep: 1 instance(s)."
    ]
    testing.run_until_idle()
    assert Instance.objects.get(pk=row.pk).status == "complete"
    assert Instance.objects.get(pk=other.pk).status == "waiting"


def test_send_event_and_restart_over_a_big_selection_start_bulk_jobs_with_their_input(
    admin_client, monkeypatch
):
    monkeypatch.setattr(admin_module, "ACTION_ROWS_IN_REQUEST", 1)
    rows = [waiting_approval("o-1").row(), waiting_approval("o-2").row()]
    everything = {"select_across": "1"}
    response = act_with_form(
        admin_client,
        "send_event",
        {**everything, "type": "approval", "payload": '{"ok": true}'},
        rows[0],
    )
    job = BulkJob.objects.get()
    assert (job.action, job.matched, job.actor) == ("send_event", 2, "boss")
    assert f"Started bulk send event #{job.pk} of 2 instance(s)" in " ".join(
        shown_messages(response)
    )
    assert not InboxEvent.objects.exists()  # not in the request
    testing.run_until_idle()
    assert InboxEvent.objects.filter(type="approval").count() == 2
    before = snapshot()
    messages = shown_messages(
        admin_client.post(
            changelist(Instance),
            {"action": "skip_sleep", "index": "0", "select_across": "1", "_selected_action": [1]},
            follow=True,
        )
    )
    assert messages == [
        "Could not skip sleep: select at most 1 instances (there is no bulk skip sleep)."
    ]
    assert snapshot() == before
    act_with_form(admin_client, "restart_from_step", {**everything, "from_step": "charge"}, rows[0])
    restart = BulkJob.objects.get(action="restart")
    assert (restart.matched, restart.options) == (2, {"from_step": "charge"})


def test_the_add_page_starts_an_instance_through_the_client(admin_client):
    add = reverse("admin:workflows_app_instance_add")
    assert "instance/add/" in admin_client.get(changelist(Instance)).content.decode()
    page = admin_client.get(add).content.decode()
    assert 'name="workflow"' in page and 'name="params"' in page and "csrfmiddlewaretoken" in page
    response = admin_client.post(
        add, {"workflow": SIMPLE, "id": "new-1", "params": '{"note": "n"}'}, follow=True
    )
    row = Instance.objects.get(instance_id="new-1")
    assert response.redirect_chain[-1][0] == change(row)
    assert shown_messages(response) == [f"Started {SIMPLE} instance new-1."]
    assert (row.workflow, row.created_by, row.params) == (SIMPLE, "boss", {"note": "n"})
    before = snapshot()
    for fields, error in [
        ({"workflow": SIMPLE, "params": "{nope"}, "Not valid JSON"),
        ({"workflow": "no-such", "params": ""}, "Select a valid choice."),
        ({"workflow": SIMPLE, "id": "a\x00b"}, "Null characters are not allowed."),
        ({"workflow": SIMPLE, "id": "new-1"}, "already has an instance with id &#x27;new-1&#x27;"),
    ]:
        response = admin_client.post(add, fields)
        assert response.status_code == 400, fields
        assert error in response.content.decode(), (fields, response.content.decode()[-2000:])
    operator = staff_client("operator", "view_instance", "change_instance")
    assert operator.get(add).status_code == 200
    assert snapshot() == before


# --- an instance's own page (issue 17, item 8) ------------------------------------------


def test_an_instance_page_offers_the_actions_and_they_act_on_that_instance(admin_client):
    row = waiting_approval("o-1").row()
    other = waiting_approval("o-2").row()
    page = admin_client.get(change(row)).content.decode()
    act_url = reverse("admin:workflows_app_instance_act", args=[row.pk, "pause"])
    assert f'action="{act_url}"' in page and ">Pause</button>" in page
    assert ">Cancel and compensate</button>" in page
    response = admin_client.post(act_url, follow=True)
    assert response.redirect_chain[-1][0] == change(row)
    assert [str(m) for m in response.context["messages"]] == ["Pause: 1 instance(s)."]
    assert Instance.objects.get(pk=row.pk).status == "paused"
    assert Instance.objects.get(pk=other.pk).status == "waiting"
    assert admin_client.get(act_url).status_code == 405
    assert (
        admin_client.post(
            reverse("admin:workflows_app_instance_act", args=[row.pk, "x"])
        ).status_code
        == 404
    )


def test_an_instance_page_offers_no_actions_to_a_viewer_and_refuses_them():
    row = waiting_approval("o-1").row()
    viewer = staff_client("viewer", "view_instance")
    page = viewer.get(change(row)).content.decode()
    assert "wf-action" not in page.replace("workflows/admin.css", "")
    before = snapshot()
    act_url = reverse("admin:workflows_app_instance_act", args=[row.pk, "terminate"])
    assert viewer.post(act_url).status_code == 403
    assert snapshot() == before


def test_history_rows_read_as_sequence_and_type_not_as_object_numbers(admin_client):
    row = waiting_approval("o-1").row()
    page = admin_client.get(change(row)).content.decode()
    assert "HistoryRecord object" not in page
    assert "#1 instance.created" in page


def test_the_instance_list_keeps_ids_on_one_line_in_few_columns(admin_client):
    waiting_approval("order-with-a-rather-long-identifier-0001")
    page = admin_client.get(changelist(Instance)).content.decode()
    assert (
        '<span class="wf-id wf-cut" title="order-with-a-rather-long-identifier-0001">'
        "order-with-a-rather-long-identifier-0001</span>"
    ) in page
    assert "workflows/admin.css" in page
    headers = re.findall(r'<th scope="col" class="(?:sortable )?column-(\w+)', page)
    assert len(headers) <= 7, headers


def test_long_list_cells_are_cut_to_their_column_and_whole_in_a_tooltip(admin_client):
    long_id = "order-" + "x" * 90
    inst = waiting_approval(long_id)
    Instance.objects.filter(pk=inst.row().pk).update(
        error_name="VeryLongErrorNameThatWouldWidenTheColumn", error_message="it <broke>"
    )
    page = admin_client.get(changelist(Instance)).content.decode()
    title = html.escape(long_id, quote=True)
    assert f'<span class="wf-id wf-cut" title="{title}">{title}</span>' in page
    assert (
        '<span class="wf-cut" title="VeryLongErrorNameThatWouldWidenTheColumn: it &lt;broke&gt;">'
        "VeryLongErrorNameThatWouldWidenTheColumn</span>"
    ) in page
    # Times to the minute without the year (this year's), whole in the tooltip.
    assert re.search(
        r'<span title="\d{4}-\d\d-\d\d \d\d:\d\d:\d\d">\d\d-\d\d \d\d:\d\d</span>', page
    )
    text = Path(finders.find("workflows/admin.css")).read_text()
    assert ".model-instance #result_list { table-layout: fixed; width: 100%; }" in text
    assert "text-overflow: ellipsis" in text


# --- tokens -----------------------------------------------------------------------------


def shown_secret(response: Any) -> str:
    """The secret on the show-once page; it must appear nowhere else."""
    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    return re.search(
        r'<code id="token-secret"[^>]*>(wf_[^<]+)</code>', response.content.decode()
    ).group(1)


def test_adding_a_token_shows_the_secret_once_and_stores_only_its_hash(admin_client):
    ops = User.objects.create_user("ops")
    response = admin_client.post(
        reverse("admin:workflows_app_apitoken_add"),
        {
            "name": "deploy",
            "user": ops.pk,
            "scope": "read",
            "workflows": APPROVAL,
            "expires": "30 days",
        },
    )
    secret = shown_secret(response)
    token = ApiToken.objects.get(name="deploy")
    assert token.token_hash == hashlib.sha256(secret.encode()).hexdigest()
    assert token.user == ops and secret.startswith(token.prefix)
    assert (token.scope, token.workflow_names) == (
        "read",
        [APPROVAL],
    ) and token.expires_at is not None
    page = admin_client.get(change(token)).content.decode()
    assert secret not in page and token.token_hash in page


@pytest.mark.parametrize("name", ["deploy\nrevoked: all", "ops\x00", "\u202enimda"])
def test_a_token_name_with_control_or_bidi_characters_is_refused(admin_client, name):
    """A token's name is the actor of every change made with it: a newline in it forged a
    line in `wf` output and logs, a NUL made every write with the token fail, and a bidi
    override reversed what an operator read. Refused in the admin and by tokens.issue,
    naming what was wrong; nothing is stored."""
    response = admin_client.post(
        reverse("admin:workflows_app_apitoken_add"), {"name": name, "scope": "read"}
    )
    assert response.status_code == 200
    (error,) = response.context["adminform"].form.errors["name"]
    # Django's own field refuses a NUL first ("Null characters are not allowed.")
    assert "must not hold control, bidi or line separator" in error or "Null characters" in error
    with pytest.raises(tokens.TokenError, match="must not hold control"):
        tokens.issue(name, scope="read")
    assert not ApiToken.objects.exists()


def test_the_token_secret_never_travels_in_a_cookie_or_a_message(admin_client):
    response = admin_client.post(
        reverse("admin:workflows_app_apitoken_add"), {"name": "svc", "scope": "write"}
    )
    secret = shown_secret(response)
    assert all(secret not in morsel.value for morsel in response.cookies.values())
    assert all(secret not in morsel.value for morsel in admin_client.cookies.values())
    later = admin_client.get(changelist(ApiToken))
    assert secret not in later.content.decode()
    assert all(secret not in str(m) for m in later.context["messages"])


def minting_client(name: str, *codenames: str) -> Client:
    return staff_client(name, "add_apitoken", "view_apitoken", *codenames)


def test_a_staff_user_may_not_mint_a_token_carrying_more_than_they_hold():
    clerk = minting_client("clerk", "view_instance")
    root = User.objects.create_superuser("root", password="pw")
    operator = User.objects.create_user("operator")
    operator.user_permissions.add(
        *Permission.objects.filter(codename__in=["view_instance", "change_instance"])
    )
    for data, reason in (
        ({"name": "svc"}, "only a superuser may create a service token"),
        (
            {"name": "as-root", "user": root.pk},
            "only a superuser may create a token for the superuser 'root'",
        ),
        (
            {"name": "as-op", "user": operator.pk},
            "permissions you do not hold: workflows_app.change_instance",
        ),
    ):
        before = snapshot()
        response = clerk.post(
            reverse("admin:workflows_app_apitoken_add"), {"scope": "write", **data}
        )
        assert (
            response.status_code == 200
            and reason in html.unescape(response.content.decode()).lower()
        ), data
        assert not ApiToken.objects.exists() and snapshot() == before


def test_a_staff_user_may_mint_a_token_for_themselves_or_a_weaker_user():
    clerk = minting_client("clerk", "view_instance")
    reader = User.objects.create_user("reader")
    reader.user_permissions.add(Permission.objects.get(codename="view_instance"))
    for name, user in (("mine", User.objects.get(username="clerk")), ("theirs", reader)):
        response = clerk.post(
            reverse("admin:workflows_app_apitoken_add"),
            {"name": name, "user": user.pk, "scope": "read"},
        )
        assert tokens.authenticate(shown_secret(response)).user == user


def test_rotating_a_token_in_the_admin_shows_the_new_secret_once(admin_client):
    token, old = tokens.issue("ci", scope="read")
    response = admin_client.post(
        changelist(ApiToken), {"action": "rotate_token", "_selected_action": [token.pk]}
    )
    new = shown_secret(response)
    assert tokens.authenticate(old) is None and tokens.authenticate(new).name == "ci"


def test_a_staff_user_may_not_rotate_a_service_token():
    token, old = tokens.issue("svc")
    clerk = minting_client("clerk", "change_apitoken")
    response = clerk.post(
        changelist(ApiToken),
        {"action": "rotate_token", "_selected_action": [token.pk]},
        follow=True,
    )
    assert any("only a superuser" in str(m) for m in response.context["messages"])
    assert tokens.authenticate(old).name == "svc"


def test_revoking_tokens_in_the_admin(admin_client):
    ApiToken.objects.create(name="svc", token_hash="1" * 64, created_at=timezone.now())
    response = admin_client.post(
        changelist(ApiToken),
        {"action": "revoke_tokens", "_selected_action": [ApiToken.objects.get().pk]},
        follow=True,
    )
    assert "Revoked 1 token(s)." in [str(m) for m in response.context["messages"]]
    assert ApiToken.objects.get().revoked_at is not None


# --- big tables -------------------------------------------------------------------------

BIG_TABLES = ("instance", "steprecord", "historyrecord", "inboxevent", "span", "errorrecord")


def unbounded_reads(client: Client, url: str) -> list[str]:
    """The statements a page makes of a big table that count or tell apart the values of
    every row (a COUNT, a SELECT DISTINCT, not bounded by a LIMIT)."""
    with CaptureQueriesContext(connection) as queries:
        response = client.get(url)
        assert response.status_code == 200, url
    return [
        q["sql"]
        for q in queries.captured_queries
        if any(f'"workflows_app_{table}"' in q["sql"] for table in BIG_TABLES)
        and ("COUNT(" in q["sql"].upper() or "DISTINCT" in q["sql"].upper())
        and "LIMIT" not in q["sql"].upper()
    ]


def test_big_table_lists_count_and_fill_their_filters_by_bounded_reads(admin_client, monkeypatch):
    # At 1M instances / 6M history records a list page took 2-3 s: two COUNTs of every row,
    # SELECT DISTINCT of every filter's column over the table, the date hierarchy's months.
    some_of_everything()
    for model in (Instance, StepRecord, HistoryRecord, InboxEvent, Span, ErrorRecord):
        assert unbounded_reads(admin_client, changelist(model)) == [], model
        filtered = changelist(model) + "?o=1"  # any query string: a filtered list
        assert unbounded_reads(admin_client, filtered) == [], model
    # The filters still offer what is there.
    page = admin_client.get(changelist(Instance)).content.decode()
    assert f"?workflow={APPROVAL}" in page
    assert "?version=1" in page
    history = admin_client.get(changelist(HistoryRecord)).content.decode()
    assert "?type=instance.created" in history
    assert f"?instance__workflow={APPROVAL}" in history


def test_a_list_longer_than_its_count_bound_says_so_and_pages_up_to_it(admin_client, monkeypatch):
    monkeypatch.setattr(admin_module, "COUNT_UP_TO", 3, raising=False)
    monkeypatch.setattr(admin_module.InstanceAdmin, "list_per_page", 2)
    for n in range(5):
        get_workflow(SIMPLE).create(id=f"many-{n}")
    page = admin_client.get(changelist(Instance)).content.decode()
    assert "3+ instances" in page
    assert "Select all 3+ instances" in page
    second = admin_client.get(changelist(Instance) + "?p=2")  # 3+ rows: two full pages of 2
    assert second.status_code == 200
    rows = re.findall(r'name="_selected_action" value="(\d+)"', second.content.decode())
    assert len(rows) == 2
    monkeypatch.setattr(admin_module, "COUNT_UP_TO", 10)
    page = admin_client.get(changelist(Instance)).content.decode()
    assert "5 instances" in page and "5+" not in page
