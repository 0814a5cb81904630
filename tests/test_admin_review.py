"""Review of the admin's new actions and their neighbours (skip sleep, send event, restart
from a step, the add page; a typed wait's schema): faults found, each with its test."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from tests.surface_flows import (
    APPROVAL,
    LIMITED,
    NEW_VERSION_PAYLOAD_LIMIT,
    SIMPLE,
    limited_versions,
    register_flows,
    snapshot,
    waiting_approval,
)
from tests.test_admin import act_with_form, changelist, shown_messages
from workflows_app import admin as admin_module
from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, clock, errors, register
from workflows_app.models import BulkJob, InboxEvent, Instance

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def flows(registered: list[str]) -> None:
    register_flows()


@pytest.fixture
def admin_client() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("boss", password="pw"))
    return client


# --- a typed wait's schema ------------------------------------------------------------


def test_a_wait_whose_dynamic_reference_does_not_resolve_is_refused_where_it_is_declared():
    """check_event_schema looked up each `$ref` but not `$dynamicRef` (2020-12), which
    resolves the same way at first: such a wait was declared, and an event buffered before
    it made the payload check raise jsonschema's private _WrappedReferencingError, under
    which name the instance errored."""

    @register("dynamic-ref")
    class DynamicRef(WorkflowEntrypoint):
        async def run(self, event, step):
            schema = event.payload["schema"]
            return (await step.wait_for_event("approval", type="go", schema=schema)).payload

    dangling = get_workflow("dynamic-ref").create(params={"schema": {"$dynamicRef": "#nope"}})
    dangling.send_event("go", {"n": 1})  # buffered: no wait yet
    testing.run_until_idle()
    status = dangling.status()
    assert (status.status, status.error["name"]) == ("errored", "InvalidInput"), status
    assert "'#nope'" in status.error["message"] and "does not resolve" in status.error["message"]
    # A dynamic reference to a dynamic anchor of the schema is fine.
    anchored = {"$defs": {"m": {"$dynamicAnchor": "m", "type": "object"}}, "$dynamicRef": "#m"}
    fine = get_workflow("dynamic-ref").create(params={"schema": anchored})
    testing.run_until_idle()
    assert fine.status().status == "waiting"
    with pytest.raises(errors.EventPayloadInvalid, match="does not match"):
        fine.send_event("go", 5)
    fine.send_event("go", {"ok": True})
    testing.run_until_idle()
    assert fine.status().output == {"ok": True}


@pytest.mark.parametrize("dialect", [5, ["https://json-schema.org/draft/2020-12/schema"]])
def test_a_wait_whose_schema_names_its_dialect_by_no_text_is_refused_as_invalid_input(dialect):
    """A `$schema` that is no string: jsonschema's validator_for raised AttributeError
    (or TypeError) where the wait was declared, and the instance errored under that name
    instead of InvalidInput naming the wait."""

    @register("dialect")
    class Dialect(WorkflowEntrypoint):
        async def run(self, event, step):
            schema = {"$schema": event.payload["dialect"], "type": "object"}
            return (await step.wait_for_event("approval", type="go", schema=schema)).payload

    inst = get_workflow("dialect").create(params={"dialect": dialect})
    testing.run_until_idle()
    status = inst.status()
    assert (status.status, status.error["name"]) == ("errored", "InvalidInput"), status
    assert 'wait_for_event "approval"' in status.error["message"], status.error
    assert "$schema" in status.error["message"], status.error


def recursing_schema_workflow() -> str:
    @register("recursing-ref")
    class RecursingRef(WorkflowEntrypoint):
        async def run(self, event, step):
            schema = event.payload["schema"]
            return (await step.wait_for_event("approval", type="go", schema=schema)).payload

    return "recursing-ref"


LOOPING = {"allOf": [{"$ref": "#"}]}  # every check of a payload comes back here


def test_an_event_whose_check_recurses_without_end_is_refused_clearly_and_nothing_is_stored(
    admin_client,
):
    """A schema whose references come back to it without going down the payload (a $ref
    to itself, or to a schema it is part of) makes every payload check recurse until
    Python stops it: send_event raised RecursionError, a server error in the admin's send
    event (and the dashboard's, the API's). Refused as a payload that cannot be checked."""
    workflow = recursing_schema_workflow()
    inst = get_workflow(workflow).create(id="rec-1", params={"schema": LOOPING})
    testing.run_until_idle()
    assert inst.status().status == "waiting"
    before = snapshot()
    response = act_with_form(
        admin_client, "send_event", {"type": "go", "payload": '{"ok": true}'}, inst.row()
    )
    assert response.status_code == 200
    [message] = shown_messages(response)
    assert message.startswith(f"Could not send event {workflow}/rec-1: payload of event 'go'")
    assert "recursed too deep" in message, message
    with pytest.raises(errors.EventPayloadInvalid, match="recursed too deep"):
        inst.send_event("go", {"ok": True})
    assert snapshot() == before
    assert inst.status().status == "waiting"


def test_a_buffered_event_whose_check_recurses_without_end_is_kept_not_fatal():
    """The same check in the worker, of an event sent before its wait: the RecursionError
    errored the instance under that name, so an event from any sender ended it. The
    event is passed over as a payload that does not match: kept in the inbox, the wait
    waiting on (until its timeout, or a release that fixes the schema)."""
    inst = get_workflow(recursing_schema_workflow()).create(params={"schema": LOOPING})
    inst.send_event("go", {"ok": True})  # buffered: no wait yet
    testing.run_until_idle()
    assert inst.status().status == "waiting"
    [kept] = InboxEvent.objects.filter(instance__instance_id=inst.id)
    assert kept.consumed_at is None and kept.payload == {"ok": True}


# --- a selection that changed between the list (or an action's form) and the submit -------


def test_an_action_names_the_selected_instances_gone_from_the_list_since_it_was_shown(
    admin_client,
):
    """Django's action runs on the selected rows the list still shows: one deleted since,
    or one that no longer matches the list's filters (it finished while the operator
    typed the event), was left out without a word, and a selection left empty said
    nothing at all: the operator took the event for sent."""
    waiting = [waiting_approval(f"o-{n}").row() for n in (1, 2, 3)]
    on_list = changelist(Instance) + "?status__exact=waiting"
    selection = {"action": "send_event", "index": "0", "_selected_action": [r.pk for r in waiting]}
    assert admin_client.post(on_list, selection).status_code == 200  # the form page
    get_workflow(APPROVAL).get("o-2").terminate()  # finished: off the "waiting" list
    apply = {**selection, "type": "note", "payload": "", "apply": "1"}
    response = admin_client.post(on_list, apply, follow=True)
    assert shown_messages(response) == [
        "Could not send event 1 selected instance(s): deleted, or no longer matching the "
        "list's filters, since the list was shown.",
        "Send event: 2 instance(s).",
    ]
    assert InboxEvent.objects.count() == 2
    for row in waiting:
        handle = get_workflow(APPROVAL).get(row.instance_id)
        handle.terminate()
        handle.delete()
    response = admin_client.post(changelist(Instance), apply, follow=True)
    assert shown_messages(response) == [
        "Could not send event 3 selected instance(s): deleted, or no longer matching the "
        "list's filters, since the list was shown."
    ]
    response = admin_client.post(
        changelist(Instance), {**selection, "action": "pause"}, follow=True
    )
    assert shown_messages(response) == [
        "Could not pause 3 selected instance(s): deleted, or no longer matching the "
        "list's filters, since the list was shown."
    ]


def test_a_dashboard_bulk_action_names_the_selected_instances_deleted_since_the_list(
    admin_client,
):
    """The dashboard's selected-rows pause/resume/terminate looked the pks up and went on
    with those found: one deleted since the list was shown was left out without a word,
    and a selection all gone said nothing at all."""
    kept, deleted = waiting_approval("o-1"), waiting_approval("o-2")
    pks = [kept.row().pk, deleted.row().pk]
    deleted.terminate()
    deleted.delete()
    response = admin_client.post(
        reverse("workflows:bulk"), {"action": "terminate", "pk": pks}, follow=True
    )
    assert shown_messages(response) == [
        "Terminated 1 instance.",
        "1 selected instance no longer exists (deleted since the list was shown).",
    ]
    kept.delete()
    response = admin_client.post(
        reverse("workflows:bulk"), {"action": "pause", "pk": pks}, follow=True
    )
    assert shown_messages(response) == [
        "2 selected instances no longer exist (deleted since the list was shown)."
    ]


def test_the_admin_pause_says_which_pauses_are_only_requested(admin_client):
    """pause() of an instance a run holds only asks for the pause (waitingForPause: it
    pauses when its running step finishes). The admin said "Pause: 2 instance(s)." and
    no more, as the dashboard's messages no longer do: the operator took both for paused."""
    idle, held = waiting_approval("o-1"), waiting_approval("o-2")
    Instance.objects.filter(pk=held.row().pk).update(  # as a run running a step would
        status="running", lease_token="a-run", lease_expires_at=clock.now() + timedelta(minutes=5)
    )
    response = admin_client.post(
        changelist(Instance),
        {"action": "pause", "index": "0", "_selected_action": [idle.row().pk, held.row().pk]},
        follow=True,
    )
    assert idle.status().status == "paused" and held.status().status == "waitingForPause"
    assert shown_messages(response) == [
        "Pause: 2 instance(s).",
        f"Of those, the pause is only requested for 1: {APPROVAL}/o-2 (each pauses when its "
        "running step finishes).",
    ]


# --- the add page (and the dashboard's create) -----------------------------------------


def test_a_create_whose_idempotency_key_found_an_instance_says_it_started_none(admin_client):
    """An idempotency key that finds the instance it started before returns that one,
    params and all (the API answers 200, not 201). The admin's add page said "Started …"
    and the dashboard "Created …" as if the params just typed had started a new one."""
    fields = {"workflow": SIMPLE, "idempotency_key": "order-7", "params": '{"n": 1}'}
    add = reverse("admin:workflows_app_instance_add")
    first = admin_client.post(add, {**fields, "id": "first"}, follow=True)
    assert shown_messages(first) == [f"Started {SIMPLE} instance first."]
    again = admin_client.post(add, {**fields, "id": "again", "params": '{"n": 2}'}, follow=True)
    found = (
        f"Started none: idempotency key 'order-7' found {SIMPLE} instance first, started "
        "before (its params are those it was started with)."
    )
    assert shown_messages(again) == [found]
    assert again.redirect_chain[-1][0] == reverse(
        "admin:workflows_app_instance_change", args=[Instance.objects.get(instance_id="first").pk]
    )
    dashboard = admin_client.post(reverse("workflows:create"), fields, follow=True)
    assert shown_messages(dashboard) == [found]
    assert list(Instance.objects.values_list("instance_id", flat=True)) == ["first"]
    assert Instance.objects.get().params == {"n": 1}


# --- an event's payload against each instance's own version's limits -----------------------


def test_send_event_checks_each_instance_against_its_own_versions_payload_limit(
    admin_client, monkeypatch
):
    """The admin's send event (and a bulk send) checked the payload against the newest
    version's max_event_payload_bytes: an instance of an older version, whose limit allows
    the payload, was refused, and with several workflows selected the refusal did not say
    whose limit it was. Each instance's own version's limit applies now; a refusal names
    the workflow, the version and the limit, and nothing is sent."""
    old, new = limited_versions()
    other = waiting_approval("o-1").row()
    payload = '"' + "x" * 2000 + '"'  # 2002 bytes: over version 2's limit, under version 1's
    response = act_with_form(
        admin_client, "send_event", {"type": "go", "payload": payload}, old.row()
    )
    assert response.status_code == 200, response.content.decode()[-2000:]
    assert shown_messages(response) == ["Send event: 1 instance(s)."]
    testing.run_until_idle()
    assert old.status().status == "complete" and old.status().output == "x" * 2000
    before = snapshot()
    response = act_with_form(
        admin_client, "send_event", {"type": "go", "payload": payload}, new.row(), other
    )
    assert response.status_code == 400
    refusal = (
        f"payload of event 'go' for {LIMITED} version 2: max_event_payload_bytes is "
        f"{NEW_VERSION_PAYLOAD_LIMIT} bytes, got 2002 bytes"
    )
    assert refusal in response.content.decode().replace("&#x27;", "'")
    assert snapshot() == before
    # A selection too big for the request: the same check, before any bulk job starts.
    monkeypatch.setattr(admin_module, "ACTION_ROWS_IN_REQUEST", 1)
    fields = {"select_across": "1", "type": "go", "payload": payload}
    response = act_with_form(admin_client, "send_event", fields, new.row())
    assert refusal in response.content.decode().replace("&#x27;", "'")
    assert not BulkJob.objects.exists()


def test_a_bulk_send_checks_each_selected_version_against_its_own_payload_limit():
    """WorkflowBinding.bulk checked a send_event's payload against the newest version's
    limit: a job over an older version's instances only, which allow it, was refused."""
    old, new = limited_versions()
    payload = "x" * 2000
    job = get_workflow(LIMITED).bulk("send_event", version=1, event_type="go", payload=payload)
    assert job.matched == 1
    testing.run_until_idle()
    assert job.refresh().applied == 1 and old.status().output == payload
    with pytest.raises(errors.SizeLimitExceeded, match=f"for {LIMITED} version 2: "):
        get_workflow(LIMITED).bulk("send_event", event_type="go", payload=payload)
    assert BulkJob.objects.count() == 1 and new.status().status == "waiting"


# --- a form bigger than Django takes -----------------------------------------------------

BIG_FORM_TEXT = "x" * 3_000_000  # over DATA_UPLOAD_MAX_MEMORY_SIZE's default, 2621440 bytes


def csrf_token_of(client: Client, url: str) -> dict[str, str]:
    """The CSRF token a browser sends back with a form of the page at url (its cookie kept
    by the client): with it, the CSRF check reads the form, as a browser's post makes it."""
    page = client.get(url)
    assert page.status_code == 200
    return {"csrfmiddlewaretoken": str(page.context["csrf_token"])}


def assert_refused_as_too_large(response) -> None:
    """A 413 page saying the form was too large and what the limit is (Django's own
    refusal was a bare 400 "Bad Request" page)."""
    page = response.content.decode()
    assert response.status_code == 413, page[:500]
    assert "The form is too large" in page, page
    assert "more than the 2621440 bytes (2.5\xa0MB) this site takes in one form" in page, page
    assert "DATA_UPLOAD_MAX_MEMORY_SIZE" in page


@pytest.mark.parametrize("csrf_checked", [True, False], ids=["csrf-checked", "csrf-not-checked"])
def test_a_form_over_djangos_size_limit_gets_a_page_naming_the_limit(csrf_checked):
    """A POST over DATA_UPLOAD_MAX_MEMORY_SIZE to the admin's send event (the list's
    action, an instance page's button) or add page got Django's bare "Bad Request" page:
    the CSRF check reads the form first, before any view. The refusal names the limit
    now, which stays as it is, and nothing changes."""
    client = Client(enforce_csrf_checks=csrf_checked)
    client.force_login(User.objects.create_superuser("boss", password="pw"))
    row = waiting_approval("o-1").row()
    before = snapshot()
    token = csrf_token_of(client, changelist(Instance))
    send = {"type": "approval", "payload": BIG_FORM_TEXT, "apply": "1", **token}
    selection = {"action": "send_event", "index": "0", "_selected_action": [row.pk]}
    assert_refused_as_too_large(client.post(changelist(Instance), {**selection, **send}))
    act = reverse("admin:workflows_app_instance_act", args=[row.pk, "send-event"])
    assert_refused_as_too_large(client.post(act, send))
    add = reverse("admin:workflows_app_instance_add")
    start = {"workflow": APPROVAL, "params": BIG_FORM_TEXT, **token}
    assert_refused_as_too_large(client.post(add, start))
    assert snapshot() == before
    # A form within the limit is answered as before: here its payload is over its own limit.
    within = {"type": "approval", "payload": '"' + "x" * 2_000_000 + '"', "apply": "1", **token}
    response = client.post(act, within)
    assert response.status_code == 400 and "max_event_payload_bytes" in response.content.decode()


def test_a_project_without_the_form_size_middleware_before_csrf_is_warned(settings):
    """A host project lists its own MIDDLEWARE: without FormTooLargeMiddleware before the
    CSRF check, its forms get the bare 400 again, so `manage.py check` says so."""
    from workflows_app import checks

    assert checks.check_form_size_middleware() == []  # wfdash's own settings have it
    ours, csrf = checks.FORM_TOO_LARGE_MIDDLEWARE, checks.CSRF_MIDDLEWARE
    for middleware in ([csrf], [csrf, ours]):
        settings.MIDDLEWARE = middleware
        [warning] = checks.check_form_size_middleware()
        assert warning.id == "workflows_app.W002" and ours in warning.hint
    settings.MIDDLEWARE = [ours, csrf]
    assert checks.check_form_size_middleware() == []
