"""The dashboard's pages and actions, through Django's test client."""

from __future__ import annotations

import json
import re

import pytest
from django.contrib.staticfiles import finders
from django.test import Client
from django.urls import reverse

from workflows_app import testing
from workflows_app.client import encode_cursor, get_workflow
from workflows_app.models import ErrorRecord, HistoryRecord, Instance

from .helpers import make_user

pytestmark = pytest.mark.django_db(transaction=True)

XSS = "<script>alert(1)</script>"


def waiting_instance(workflow: str, **kwargs):
    inst = get_workflow(workflow).create(actor="test", **kwargs)
    testing.run_until_idle()
    assert inst.status().status == "waiting"
    return inst


def page_url(row) -> str:
    """The detail page of an instance row, by workflow name and instance id."""
    return reverse("workflows:instance", args=[row.workflow, row.instance_id])


def action_url(inst, action: str) -> str:
    return reverse("workflows:action", args=[inst.row().pk, action])


# --- permissions ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["overview", "instances", "errors"])
def test_pages_redirect_anonymous_users_to_the_admin_login(name):
    response = Client().get(reverse(f"workflows:{name}"))
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")


def test_staff_without_view_permission_is_forbidden():
    client = Client()
    client.force_login(make_user("nobody"))
    assert client.get(reverse("workflows:overview")).status_code == 403


def test_non_staff_users_are_sent_to_the_login_page():
    client = Client()
    client.force_login(make_user("outsider", "view_instance", "change_instance", staff=False))
    assert client.get(reverse("workflows:instances")).status_code == 302


def test_staff_without_change_permission_gets_403_on_every_action(viewer, approval_workflow):
    inst = waiting_instance(approval_workflow)
    client = Client()
    client.force_login(viewer)
    for action in ("pause", "resume", "terminate", "restart", "skip-sleep", "send-event", "cancel"):
        assert client.post(action_url(inst, action)).status_code == 403
    assert (
        client.post(reverse("workflows:create"), {"workflow": approval_workflow}).status_code == 403
    )
    assert (
        client.post(
            reverse("workflows:bulk"), {"action": "pause", "pk": [inst.row().pk]}
        ).status_code
        == 403
    )
    assert inst.status().status == "waiting"


def test_actions_refuse_get(operator_client, approval_workflow):
    inst = waiting_instance(approval_workflow)
    assert operator_client.get(action_url(inst, "terminate")).status_code == 405
    assert inst.status().status == "waiting"


def test_actions_enforce_csrf(operator, approval_workflow):
    inst = waiting_instance(approval_workflow)
    client = Client(enforce_csrf_checks=True)
    client.force_login(operator)
    assert client.post(action_url(inst, "terminate")).status_code == 403
    assert inst.status().status == "waiting"
    page = client.get(page_url(inst.row())).content.decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
    assert (
        client.post(action_url(inst, "terminate"), {"csrfmiddlewaretoken": token}).status_code
        == 302
    )
    assert inst.status().status == "terminated"


# --- pages ---------------------------------------------------------------------------------


def test_the_overview_shows_counts_versions_and_error_rate(operator_client, approval_workflow):
    waiting_instance(approval_workflow)
    done = get_workflow(approval_workflow).create()
    done.terminate()
    page = operator_client.get(reverse("workflows:overview")).content.decode()
    assert 'data-workflow="dash-approval"' in page
    assert 'data-status="waiting"' in page and 'data-status="terminated"' in page
    assert "v1" in page
    assert "<svg" in page


def test_the_search_ignores_the_case_of_non_ascii_letters_on_both_databases(
    operator_client, approval_workflow
):
    """SQLite's LIKE folds ASCII letters only: "münchen" found "MÜNCHEN" on PostgreSQL
    (UPPER() LIKE UPPER()) and nothing on SQLite. Both compare by UPPER() now: ß (whose
    upper case is itself) does not match SS on either."""
    workflow = get_workflow(approval_workflow)
    for instance_id, city in (
        ("upper", "MÜNCHEN"),
        ("plain", "Munchen"),
        ("greek", "ΣΟΦΊΑ"),
        ("sharp", "straße"),
        ("glob", "ü*[x]?_%"),
    ):
        workflow.create(id=instance_id, params={"city": city})
    url = reverse("workflows:instances")

    def found(q: str) -> set[str]:
        page = operator_client.get(url, {"q": q}).content.decode()
        return set(re.findall(r'data-instance-id="([^"]+)"', page))

    assert found("münchen") == {"upper"}
    assert found("ÜnCh") == {"upper"}
    assert found("σοφία") == {"greek"}
    assert found("STRASSE") == set()
    assert found("STRAßE") == {"sharp"}
    # GLOB's and LIKE's own characters match as themselves.
    assert found("Ü*[X]?_%") == {"glob"}
    assert found("Ü?[X") == found("Ü_") == found("Ü%") == set()


def test_the_list_filters_searches_and_paginates_by_keyset(
    operator_client, approval_workflow, django_assert_max_num_queries
):
    workflow = get_workflow(approval_workflow)
    for n in range(55):
        workflow.create(id=f"inst-{n:03d}", idempotency_key=f"key-{n}")
    url = reverse("workflows:instances")
    with django_assert_max_num_queries(8):
        page = operator_client.get(url, {"workflow": approval_workflow}).content.decode()
    assert page.count("data-instance-id=") == 50
    assert 'data-instance-id="inst-054"' in page and 'data-instance-id="inst-004"' not in page
    older = re.search(r"after=([\w-]+)", page).group(1)
    page2 = operator_client.get(
        url, {"workflow": approval_workflow, "after": older}
    ).content.decode()
    assert page2.count("data-instance-id=") == 5
    assert "before=" in page2
    assert operator_client.get(url, {"q": "key-7"}).content.decode().count("data-instance-id=") == 1
    assert (
        'data-instance-id="inst-007"'
        in operator_client.get(url, {"q": "inst-007"}).content.decode()
    )
    assert (
        operator_client.get(url, {"status": "complete"}).content.decode().count("data-instance-id=")
        == 0
    )
    assert (
        operator_client.get(url, {"version": "2"}).content.decode().count("data-instance-id=") == 0
    )


def test_the_list_pages_back_to_newer_rows(operator_client, approval_workflow):
    rows = [get_workflow(approval_workflow).create(id=f"r{n}").row().pk for n in range(60)]
    page = operator_client.get(
        reverse("workflows:instances"), {"before": encode_cursor(rows[4])}
    ).content.decode()
    ids = re.findall(r'data-instance-id="(r\d+)"', page)
    assert ids[0] == "r54" and ids[-1] == "r5"
    assert "after=" in page and "before=" in page


def test_a_bad_cursor_is_reported_not_a_500(operator_client):
    response = operator_client.get(
        reverse("workflows:instances"), {"after": "garbage!!"}, follow=True
    )
    assert response.status_code == 200
    assert "invalid cursor" in response.content.decode()


def test_rows_newer_than_a_pk_match_the_filters(operator_client, approval_workflow):
    first = get_workflow(approval_workflow).create(id="old").row().pk
    get_workflow(approval_workflow).create(id="new")
    page = operator_client.get(
        reverse("workflows:instance-rows"), {"since": first, "workflow": approval_workflow}
    ).content.decode()
    assert 'data-instance-id="new"' in page and 'data-instance-id="old"' not in page


def test_the_detail_page_shows_steps_history_pending_events_and_only_applicable_buttons(
    operator_client, approval_workflow, django_assert_max_num_queries
):
    inst = waiting_instance(approval_workflow, params={"items": 3})
    # 13: the children are looked up whatever the steps (a restart drops the steps that
    # started them, not the children; test_orchestration_views).
    with django_assert_max_num_queries(13):
        page = operator_client.get(page_url(inst.row())).content.decode()
    assert 'data-status="waiting"' in page
    assert 'data-step="prepare"' in page and 'data-step="approval"' in page
    assert "instance.created" in page or "instance." in page
    assert "Pending events" in page and "&quot;ok&quot;" in page  # the schema, escaped
    buttons = re.findall(r"<button[^>]*>([^<]+)</button>", page)
    assert {"Pause", "Terminate", "Restart", "Send event", "Cancel"} <= set(buttons)
    assert "Restart from step" not in buttons
    assert "Resume" not in buttons and "Skip sleep" not in buttons


def test_the_errors_page_lists_newest_first_and_filters_by_workflow(
    operator_client, approval_workflow
):
    inst = get_workflow(approval_workflow).create()
    from django.utils import timezone

    for n, workflow in enumerate(["dash-approval", "other", "dash-approval"]):
        ErrorRecord.objects.create(
            instance=inst.row(),
            workflow=workflow,
            source="workflow.step",
            name=f"Err{n}",
            message="boom",
            span_id="abcd",
            created_at=timezone.now(),
        )
    page = operator_client.get(reverse("workflows:errors")).content.decode()
    assert page.index("Err2") < page.index("Err1") < page.index("Err0")
    filtered = operator_client.get(
        reverse("workflows:errors"), {"workflow": "other"}
    ).content.decode()
    assert "Err1" in filtered and "Err0" not in filtered
    assert '#span-abcd"' in page


def test_the_errors_page_pages_back_to_newer_errors(operator_client):
    """The errors page had only "Older →": from page 2 the only way back was the browser."""
    from django.utils import timezone

    from workflows_app.dashboard import PAGE_SIZE

    now = timezone.now()
    ErrorRecord.objects.bulk_create(
        ErrorRecord(workflow=workflow, source="workflow.step", name=f"E{n}", created_at=now)
        for n in range(2 * PAGE_SIZE + 5)
        for workflow in ("pager", "noise")
    )

    def get(url: str) -> tuple[list[str], dict[str, str]]:
        page = operator_client.get(url).content.decode()
        ids = re.findall(r'data-error-id="(\d+)"', page)
        pager = page[page.index('<nav class="pager">') :]
        links = {
            text: href.replace("&amp;", "&")
            for href, text in re.findall(r'<a href="([^"]+)">([^<]+)</a>', pager)
        }
        return ids, links

    base = reverse("workflows:errors") + "?workflow=pager"
    first, first_links = get(base)
    assert len(first) == PAGE_SIZE and set(first_links) == {"Older →"}  # no Newer, no Newest
    second, second_links = get(reverse("workflows:errors") + first_links["Older →"])
    assert set(second_links) == {"Newest", "← Newer", "Older →"}
    assert int(second[0]) < int(first[-1])
    third, third_links = get(reverse("workflows:errors") + second_links["Older →"])
    assert len(third) == 5 and set(third_links) == {"Newest", "← Newer"}

    back_to_second, _ = get(reverse("workflows:errors") + third_links["← Newer"])
    assert back_to_second == second
    back_to_first, back_links = get(reverse("workflows:errors") + second_links["← Newer"])
    assert back_to_first == first and "← Newer" not in back_links  # no newer rows than these
    assert all(
        ErrorRecord.objects.get(pk=pk).workflow == "pager" for pk in back_to_first
    )  # the filter rides along
    newest, _ = get(reverse("workflows:errors") + third_links["Newest"])
    assert newest == first


# --- actions -------------------------------------------------------------------------------


def test_create_makes_an_instance_and_redirects_to_it(operator_client, approval_workflow):
    response = operator_client.post(
        reverse("workflows:create"),
        {
            "workflow": approval_workflow,
            "id": "from-form",
            "params": '{"items": 2}',
        },
    )
    inst = Instance.objects.get(instance_id="from-form")
    assert response["Location"] == "/workflows/dash-approval/from-form/"
    assert inst.params == {"items": 2} and inst.created_by == "operator"


def test_create_reports_invalid_json_and_engine_errors(operator_client, approval_workflow):
    bad_json = operator_client.post(
        reverse("workflows:create"), {"workflow": approval_workflow, "params": "{nope"}
    )
    assert bad_json.status_code == 400 and "Not valid JSON" in bad_json.content.decode()
    get_workflow(approval_workflow).create(id="taken")
    taken = operator_client.post(
        reverse("workflows:create"), {"workflow": approval_workflow, "id": "taken"}
    )
    assert taken.status_code == 400 and "taken" in taken.content.decode()
    bad_id = operator_client.post(
        reverse("workflows:create"), {"workflow": approval_workflow, "id": "no spaces"}
    )
    assert bad_id.status_code == 400
    assert Instance.objects.count() == 1


def history_types(inst) -> list[tuple[str, str]]:
    return list(
        HistoryRecord.objects.filter(instance_id=inst.row().pk)
        .order_by("sequence")
        .values_list("type", "actor")
    )


def test_pause_and_resume_record_the_operator(operator_client, approval_workflow):
    inst = waiting_instance(approval_workflow)
    operator_client.post(action_url(inst, "pause"))
    assert inst.status().status == "paused"
    operator_client.post(action_url(inst, "resume"))
    assert inst.status().status == "running"
    assert ("instance.paused", "operator") in history_types(inst)
    assert ("instance.resumed", "operator") in history_types(inst)


def test_terminate_stops_the_instance(operator_client, approval_workflow):
    inst = waiting_instance(approval_workflow)
    response = operator_client.post(action_url(inst, "terminate"), follow=True)
    assert inst.status().status == "terminated"
    assert "Terminated." in response.content.decode()


def test_send_event_validates_the_payload_against_the_schema(operator_client, approval_workflow):
    inst = waiting_instance(approval_workflow)
    malformed = operator_client.post(
        action_url(inst, "send-event"), {"type": "approval", "payload": "{"}, follow=True
    )
    assert "Not valid JSON" in malformed.content.decode()
    operator_client.post(
        action_url(inst, "send-event"), {"type": "approval", "payload": '{"ok": true}'}
    )
    testing.run_until_idle()
    assert [s.name for s in inst.steps()] == ["prepare", "approval", "cool-off"]


def send_event_section(page: str) -> str:
    return re.search(r'<section data-section="send-event".*?</section>', page, re.DOTALL).group(0)


def test_a_refused_payload_stays_in_the_form_with_the_error_and_schema_beside_it(
    operator_client, approval_workflow
):
    inst = waiting_instance(approval_workflow)
    refused = operator_client.post(
        action_url(inst, "send-event"), {"type": "approval", "payload": '{"ok": "yes", "n": 1}'}
    )
    assert refused.status_code == 400
    page = refused.content.decode()
    form = send_event_section(page)
    assert ">{&quot;ok&quot;: &quot;yes&quot;, &quot;n&quot;: 1}</textarea>" in form
    assert 'id="ev-type"' in form and 'value="approval"' in form
    error = re.search(r'data-error-for="payload" role="alert">([^<]*)</p>', form).group(1)
    assert "does not match the schema" in error and "&#x27;yes&#x27; is not of type" in error
    assert '<details class="expected-payload" open>' in form and "&quot;required&quot;" in form
    assert 'data-keep="refused input"' in form  # the live refresh leaves it alone
    assert 'class="messages"' not in page  # not at the top of the page, far from the form
    assert [p.type for p in inst.pending_events()] == ["approval"]  # nothing was consumed
    bad_type = operator_client.post(action_url(inst, "send-event"), {"type": "-no", "payload": ""})
    assert bad_type.status_code == 400
    type_error = re.search(
        r'data-error-for="type" role="alert">([^<]*)</p>', bad_type.content.decode()
    )
    assert "invalid event type" in type_error.group(1)


def test_skip_sleep_wakes_the_sleeping_instance(operator_client, approval_workflow):
    inst = waiting_instance(approval_workflow)
    inst.send_event("approval", {"ok": True})
    testing.run_until_idle()
    page = operator_client.get(page_url(inst.row())).content.decode()
    assert ">Skip sleep</button>" in page
    operator_client.post(action_url(inst, "skip-sleep"))
    testing.run_until_idle()
    assert inst.status().status == "complete"
    assert inst.status().output == {"prepared": {"items": 1}, "approved": True}


def test_restart_from_a_step_drops_it_and_later_steps(operator_client, approval_workflow):
    inst = waiting_instance(approval_workflow)
    operator_client.post(action_url(inst, "restart"), {"from_step": "approval"})
    assert [s.name for s in inst.steps()] == ["prepare"]
    operator_client.post(action_url(inst, "restart"))
    assert inst.steps() == []
    assert inst.status().status == "running"


def test_restart_from_an_unknown_step_shows_the_engine_error(operator_client, approval_workflow):
    inst = waiting_instance(approval_workflow)
    response = operator_client.post(action_url(inst, "restart"), {"from_step": "nope"}, follow=True)
    assert "has no step named" in response.content.decode()


def test_cancel_with_and_without_compensation(operator_client, approval_workflow):
    inst = waiting_instance(approval_workflow)
    operator_client.post(action_url(inst, "cancel"), {"compensate": "on"})
    assert inst.status().status == "terminated"  # no step has a compensation: terminated at once
    assert ("instance.cancelled", "operator") in history_types(inst)


def test_an_action_that_does_not_apply_shows_a_message(operator_client, approval_workflow):
    inst = waiting_instance(approval_workflow)
    response = operator_client.post(action_url(inst, "resume"), follow=True)
    assert "cannot resume" in response.content.decode()
    assert inst.status().status == "waiting"


def test_unknown_actions_and_instances_are_404(operator_client, approval_workflow):
    inst = waiting_instance(approval_workflow)
    assert operator_client.post(action_url(inst, "explode")).status_code == 404
    assert (
        operator_client.post(reverse("workflows:action", args=[999999, "pause"])).status_code == 404
    )
    assert (
        operator_client.get(reverse("workflows:instance-by-pk", args=[999999])).status_code == 404
    )
    assert operator_client.get(f"/workflows/{approval_workflow}/nope/").status_code == 404


def test_actions_redirect_back_only_to_this_site(operator_client, approval_workflow):
    inst = waiting_instance(approval_workflow)
    assert (
        operator_client.post(action_url(inst, "pause"), {"next": "/instances/?status=paused"})[
            "Location"
        ]
        == "/instances/?status=paused"
    )
    assert operator_client.post(action_url(inst, "resume"), {"next": "https://evil.example/"})[
        "Location"
    ] == page_url(inst.row())


def test_bulk_actions_apply_to_each_selected_instance(operator_client, approval_workflow):
    a, b, c = (waiting_instance(approval_workflow) for _ in range(3))
    pks = [a.row().pk, b.row().pk]
    operator_client.post(reverse("workflows:bulk"), {"action": "pause", "pk": pks})
    assert [a.status().status, b.status().status, c.status().status] == [
        "paused",
        "paused",
        "waiting",
    ]
    response = operator_client.post(
        reverse("workflows:bulk"), {"action": "resume", "pk": [*pks, c.row().pk]}, follow=True
    )
    page = response.content.decode()
    assert "Resumed 2 instances." in page and "cannot resume" in page
    operator_client.post(reverse("workflows:bulk"), {"action": "terminate", "pk": pks})
    assert a.status().status == "terminated" and b.status().status == "terminated"


def test_bulk_terminate_counts_only_the_instances_it_terminated(operator_client, approval_workflow):
    """terminate() of a finished instance changes nothing (it returns False): the bulk
    message said "Terminated 2 instances." when only one was, as the admin does not."""
    live, ended = waiting_instance(approval_workflow), waiting_instance(approval_workflow)
    ended.terminate(actor="test")
    response = operator_client.post(
        reverse("workflows:bulk"),
        {"action": "terminate", "pk": [live.row().pk, ended.row().pk]},
        follow=True,
    )
    page = response.content.decode()
    assert live.status().status == "terminated"
    assert "Terminated 1 instance." in page
    assert f"{ended.id}: cannot terminate instance" in page and "already terminated" in page


def test_bulk_pause_says_which_pauses_are_only_requested(operator_client, approval_workflow):
    """pause() of an instance a run holds only asks for the pause (waitingForPause: it
    pauses when its running step finishes); the bulk message counted it among "Paused 2
    instances." as the single-instance button does not."""
    from datetime import timedelta

    from workflows_app.engine import clock

    idle, held = waiting_instance(approval_workflow), waiting_instance(approval_workflow)
    Instance.objects.filter(pk=held.row().pk).update(  # as a run running a step would
        status="running", lease_token="a-run", lease_expires_at=clock.now() + timedelta(minutes=5)
    )
    response = operator_client.post(
        reverse("workflows:bulk"),
        {"action": "pause", "pk": [idle.row().pk, held.row().pk]},
        follow=True,
    )
    page = response.content.decode()
    assert idle.status().status == "paused" and held.status().status == "waitingForPause"
    assert "Paused 1 instance, pause requested for 1 instance." in page


def test_dashboard_actions_read_each_instance_s_version_with_its_row(
    operator_client, approval_workflow
):
    """The bulk and single-instance actions read rows without `version`: each resume
    loaded it once more (one statement per instance) to read the instance's limits."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from tests.test_operating import version_loads

    a, b, c = (waiting_instance(approval_workflow) for _ in range(3))
    for inst in (a, b, c):
        inst.pause()
    with CaptureQueriesContext(connection) as queries:
        operator_client.post(
            reverse("workflows:bulk"), {"action": "resume", "pk": [a.row().pk, b.row().pk]}
        )
        operator_client.post(action_url(c, "resume"))
    assert {a.status().status, b.status().status, c.status().status} == {"running"}
    assert version_loads(queries) == 0


def test_bulk_with_nothing_selected_says_what_is_missing(operator_client, approval_workflow):
    response = operator_client.post(reverse("workflows:bulk"), {"action": "pause"}, follow=True)
    page = response.content.decode()
    assert "select at least one instance in the list first" in page
    assert "This field is required" not in page


def test_bulk_refuses_unknown_actions(operator_client, approval_workflow):
    inst = waiting_instance(approval_workflow)
    operator_client.post(reverse("workflows:bulk"), {"action": "restart", "pk": [inst.row().pk]})
    assert inst.status().status == "waiting"


# --- words an operator reads (issue 17, item 3) --------------------------------------------


@pytest.fixture
def rejecting_workflow():
    from workflows_app.engine import NonRetryableError, WorkflowEntrypoint, register, registry

    def reject():
        raise NonRetryableError("order 7 is missing its address", "ValidationError")

    @register("dash-reject")
    class DashReject(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("validate", reject, retries={"limit": 5, "delay": "1 second"})

    yield "dash-reject"
    registry.unregister("dash-reject")


def detail_page(client, inst) -> str:
    return client.get(page_url(inst.row())).content.decode()


def step_row(page: str, name: str) -> str:
    return re.search(rf'<tr data-step="{re.escape(name)}">.*?</tr>', page, re.DOTALL).group(0)


def test_a_non_retryable_failure_shows_its_error_not_an_engine_marker_nor_a_retry_budget(
    operator_client, rejecting_workflow
):
    inst = get_workflow(rejecting_workflow).create()
    testing.run_until_idle()
    assert inst.status().status == "errored"
    page = detail_page(operator_client, inst)
    row = step_row(page, "validate")
    assert re.search(r'data-field="output"></td>', row)  # not the engine's {"nonretryable": true}
    # The failed attempt unfolds under the label.
    assert re.search(
        r'data-field="attempts"><details class="attempts"><summary>1 \(not retryable\)<', row
    )
    assert "/6" not in row
    assert "order 7 is missing its address" in row
    assert "no output yet" not in page and "none: the instance errored" in page


def test_a_wait_cut_short_by_cancel_reads_cancelled_not_failed(operator_client, approval_workflow):
    inst = waiting_instance(approval_workflow)
    operator_client.post(action_url(inst, "cancel"), {"compensate": "on"})
    row = step_row(detail_page(operator_client, inst), "approval")
    assert 'data-status="cancelled"' in row and 'data-status="failed"' not in row
    assert "InstanceFinished" not in row and "the instance ended first" in row
    assert "none: the instance was terminated" in detail_page(operator_client, inst)


def test_the_head_says_what_a_waiting_instance_waits_for(operator_client, approval_workflow):
    inst = waiting_instance(approval_workflow)
    assert inst.row().waiting_reason == ""  # the engine leaves it empty for an event wait
    head = detail_page(operator_client, inst).split('data-section="actions"')[0]
    assert "waiting for event “approval” (approval)" in head
    inst.send_event("approval", {"ok": True})
    testing.run_until_idle()
    head = detail_page(operator_client, inst).split('data-section="actions"')[0]
    assert "sleeping in “cool-off” until <time" in head


def test_action_messages_say_what_happened_in_one_voice(operator_client, approval_workflow):
    inst = waiting_instance(approval_workflow)

    def say(action, data=None):
        response = operator_client.post(action_url(inst, action), data or {}, follow=True)
        return [str(m) for m in response.context["messages"]]

    assert say("pause") == ["Paused."]
    resumed = say("resume")
    assert resumed == ["Resumed: the instance continues from its last checkpoint."]
    testing.run_until_idle()
    assert inst.status().status == "waiting"  # so "now running" would have been wrong
    # Not sleeping: the store refuses (no count of 0), the message names the state.
    refused = operator_client.post(action_url(inst, "skip-sleep"))
    assert refused.status_code == 302
    [skipped] = [str(m) for m in operator_client.get(refused.url).context["messages"]]
    assert skipped == f"Could not skip sleep: instance '{inst.id}' is not sleeping (it is waiting)"
    assert say("restart", {"from_step": "approval"}) == ["Restarted from step “approval”."]
    assert say("resume") == ["Could not resume: " + str(_resume_error(inst))]
    assert say("terminate") == ["Terminated."]
    assert say("terminate") == ["Nothing to terminate: the instance had already finished."]


def _resume_error(inst):
    from workflows_app.engine.errors import WorkflowError

    try:
        inst.resume()
    except WorkflowError as exc:
        return exc
    raise AssertionError("resume of a running instance should be refused")


# --- the action bar (issue 17, item 5) -------------------------------------------------------


def action_forms(page: str) -> dict[str, str]:
    """Each action form of the detail page's action bar, by the action its URL names."""
    bar = re.search(r'<section data-section="actions".*?</section>', page, re.DOTALL).group(0)
    return {
        m.group(2): m.group(0)
        for m in re.finditer(r'<form[^>]*action="[^"]*/(\d+)/([\w-]+)/".*?</form>', bar, re.DOTALL)
    }


def test_the_action_bar_groups_stop_actions_explains_each_and_confirms_irreversible_ones(
    operator_client, approval_workflow
):
    inst = waiting_instance(approval_workflow)
    page = detail_page(operator_client, inst)
    forms = action_forms(page)
    assert set(forms) == {"pause", "restart", "terminate", "cancel"}
    # One Restart, whose step list starts with "the beginning".
    assert re.findall(r">Restart</button>", page) == [">Restart</button>"]
    assert re.search(r'<select name="from_step"><option value="">the beginning</option>', page)
    # Terminate and Cancel stand together, apart from the rest; no checkbox between them.
    stop = re.search(r'class="action-group danger-zone".*?</div>', page, re.DOTALL).group(0)
    assert ">Terminate</button>" in stop and ">Cancel</button>" in stop
    assert 'type="checkbox"' not in stop
    # Every button is described by a line that exists.
    for action, form in forms.items():
        hint_id = re.search(r'aria-describedby="([\w-]+)"', form).group(1)
        assert re.search(rf'<span class="hint" id="{hint_id}">[^<]+', page), action
    # Irreversible actions ask first; reversible ones do not, and the bar says so.
    confirming = {action for action, form in forms.items() if "data-confirm=" in form}
    assert confirming == {"restart", "terminate", "cancel"}
    assert "Pause and Resume take effect at once and can be reversed" in page
    assert "no completed step has a compensation yet" in forms["cancel"]
    operator_client.post(action_url(inst, "pause"))
    assert "data-confirm=" not in action_forms(detail_page(operator_client, inst))["resume"]


def test_pages_without_live_updates_show_no_live_indicator(operator_client):
    errors_page = operator_client.get(reverse("workflows:errors")).content.decode()
    assert "live-indicator" not in errors_page and "static" not in errors_page.lower().replace(
        "/static/", ""
    )
    assert "live-indicator" in operator_client.get(reverse("workflows:instances")).content.decode()


# --- addresses (issue 17, item 7) ------------------------------------------------------------


def test_an_instance_page_is_addressed_by_workflow_and_instance_id(
    operator_client, approval_workflow
):
    inst = get_workflow(approval_workflow).create(id="order-1001")
    response = operator_client.get("/workflows/dash-approval/order-1001/")
    assert response.status_code == 200
    assert '<h1 class="mono">order-1001</h1>' in response.content.decode()
    # Ids are scoped by workflow: the same id under another name is not this instance.
    assert operator_client.get("/workflows/other/order-1001/").status_code == 404
    # The numeric address an old link or bookmark holds redirects to the named one.
    old = operator_client.get(f"/instances/{inst.row().pk}/")
    assert old.status_code == 302 and old["Location"] == "/workflows/dash-approval/order-1001/"
    # Links on the list and the errors page use the named address; ids with ':' and '.' work.
    get_workflow(approval_workflow).create(id="tenant:7.order-2")
    listing = operator_client.get(reverse("workflows:instances")).content.decode()
    assert 'href="/workflows/dash-approval/order-1001/"' in listing
    assert operator_client.get("/workflows/dash-approval/tenant:7.order-2/").status_code == 200


def test_the_workflow_page_shows_versions_counts_and_recent_instances(
    operator_client, approval_workflow
):
    waiting_instance(approval_workflow, id="first")
    get_workflow(approval_workflow).create(id="second").terminate()
    page = operator_client.get("/workflows/dash-approval/").content.decode()
    assert '<h1 class="mono">dash-approval</h1>' in page
    assert 'data-version="1"' in page and ">yes<" in page  # registered in this process
    assert re.search(r'data-status="waiting"[^>]*>waiting <b>1</b>', page)
    assert re.search(r'data-status="terminated"[^>]*>terminated <b>1</b>', page)
    assert page.index('data-instance-id="second"') < page.index('data-instance-id="first"')
    assert operator_client.get("/workflows/no-such-workflow/").status_code == 404
    overview = operator_client.get(reverse("workflows:overview")).content.decode()
    assert '<h2><a href="/workflows/dash-approval/"' in overview


# --- escaping ------------------------------------------------------------------------------


def test_user_data_is_escaped_everywhere(operator_client, approval_workflow):
    from django.utils import timezone

    from workflows_app.models import Span

    inst = get_workflow(approval_workflow).create(
        id="xss", params={"note": XSS}, idempotency_key=XSS
    )
    testing.run_until_idle()
    inst.send_event("approval", {"ok": True, "note": XSS}, actor=XSS)
    row = inst.row()
    now = timezone.now()
    Span.objects.create(
        instance=row,
        trace_id="t" * 32,
        span_id="s" * 16,
        name=XSS,
        kind="INTERNAL",
        start_time=now,
        end_time=now,
        status_code="ERROR",
        status_message=XSS,
        attributes={"x": XSS},
        events=[{"name": XSS, "timestamp": now.isoformat()}],
    )
    ErrorRecord.objects.create(
        instance=row,
        workflow=approval_workflow,
        source="workflow.step",
        name=XSS,
        message=XSS,
        created_at=now,
    )
    Instance.objects.filter(pk=row.pk).update(
        error_name=XSS, error_message=XSS, error_stack=XSS, output_json=json.dumps({"o": XSS})
    )
    for url in (
        page_url(row),
        reverse("workflows:instances"),
        reverse("workflows:errors"),
        reverse("workflows:instance-live", args=[row.pk]),
    ):
        page = operator_client.get(url).content.decode()
        assert "<script>alert" not in page, url
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page, url


# --- read models ---------------------------------------------------------------------------


def test_summaries_bucket_completions_and_errors_by_finish_time(approval_workflow):
    from datetime import timedelta

    from django.utils import timezone

    from workflows_app.dashboard import workflow_summaries

    now = timezone.now()
    done = [get_workflow(approval_workflow).create().row().pk for _ in range(4)]
    Instance.objects.filter(pk__in=done[:3]).update(
        status="complete", finished_at=now - timedelta(minutes=1)
    )
    Instance.objects.filter(pk=done[3]).update(
        status="errored", finished_at=now - timedelta(minutes=58)
    )
    [summary] = [s for s in workflow_summaries(now=now) if s.name == approval_workflow]
    assert summary.completed_series[-1] == 3 and summary.errored_series[0] == 1
    assert summary.error_rate == 0.25 and summary.last_hour == 4 and summary.total == 4


def test_the_waterfall_nests_children_under_parents_and_marks_errors_and_events(
    operator_client, approval_workflow
):
    from datetime import timedelta

    from django.utils import timezone

    from workflows_app.dashboard import waterfall
    from workflows_app.models import Span

    row = get_workflow(approval_workflow).create().row()
    t0 = timezone.now()

    def span(span_id, parent, start_ms, end_ms, **extra):
        return Span.objects.create(
            instance=row,
            trace_id="a" * 32,
            span_id=span_id,
            parent_span_id=parent,
            name=span_id,
            kind="INTERNAL",
            start_time=t0 + timedelta(milliseconds=start_ms),
            end_time=t0 + timedelta(milliseconds=end_ms),
            **extra,
        )

    spans = [
        span("root", "", 0, 1000),
        span("late", "root", 600, 900),
        span(
            "early",
            "root",
            100,
            500,
            status_code="ERROR",
            events=[{"name": "retry", "timestamp": (t0 + timedelta(milliseconds=300)).isoformat()}],
        ),
        span("grandchild", "early", 200, 300),
        span("orphan", "missing-parent", 50, 60),
    ]
    rows, total_ms = waterfall(spans)
    assert [(w.span.name, w.depth) for w in rows] == [
        ("root", 0),
        ("early", 1),
        ("grandchild", 2),
        ("late", 1),
        ("orphan", 0),
    ]
    assert total_ms == 1000
    early = rows[1]
    assert (
        early.is_error
        and early.left == 10
        and early.width == 40
        and early.events
        == [{"left": 50.0, "name": "retry", "at_ms": (early.start_ms + early.end_ms) // 2}]
    )
    page = operator_client.get(page_url(row)).content.decode()
    assert 'class="span span-error" id="span-early"' in page and "span-detail-grandchild" in page


def test_the_created_range_is_read_in_the_viewers_time_zone(operator_client, approval_workflow):
    from datetime import timedelta

    from django.utils import timezone

    inst = get_workflow(approval_workflow).create(id="dated")
    created = timezone.now() - timedelta(hours=3)
    Instance.objects.filter(pk=inst.row().pk).update(created_at=created)
    local = created + timedelta(hours=2)  # the viewer is at UTC+2
    url = reverse("workflows:instances")

    def listed(**params):
        return 'data-instance-id="dated"' in operator_client.get(url, params).content.decode()

    after_it = (local + timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M")
    before_it = (local - timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M")
    assert listed(created_from=before_it, created_to=after_it, tz=120)
    assert not listed(created_from=after_it, tz=120)
    assert not listed(
        created_from=before_it, created_to=after_it, tz=0
    )  # read as UTC it is 2 h off


def test_a_created_range_past_the_calendar_is_shown_as_an_error_not_a_server_error(
    operator_client, approval_workflow
):
    get_workflow(approval_workflow).create(id="listed")
    url = reverse("workflows:instances")
    for params in (
        {"created_from": "0001-01-01T00:00", "tz": 120},  # two hours before the first date
        {"created_to": "9999-12-31T23:59", "tz": -120},
    ):
        response = operator_client.get(url, params)
        assert response.status_code == 400  # a 4xx, yet the page renders with the error
        page = response.content.decode()
        assert "is outside the dates wfdash stores, 0001-01-02 … 9999-12-31 UTC" in page
        assert 'data-instance-id="listed"' in page  # the bad filter is ignored


def test_dashboard_pages_forbid_scripts_from_anywhere_but_our_static_files(
    operator_client, approval_workflow
):
    get_workflow(approval_workflow).create(id="csp-1")
    for name in ("workflows:overview", "workflows:instances"):
        policy = operator_client.get(reverse(name))["Content-Security-Policy"]
        directives = dict(part.strip().split(" ", 1) for part in policy.split(";"))
        assert directives["script-src"] == "'self'"  # no inline script, no eval
        assert directives["default-src"] == "'self'" and directives["frame-ancestors"] == "'none'"
    # The admin is served as Django ships it.
    assert "Content-Security-Policy" not in operator_client.get("/admin/login/")


def test_the_favicon_is_served_for_every_page_and_linked_from_the_dashboard(client, operator):
    response = client.get("/favicon.ico")
    assert response.status_code == 301 and response["Location"] == "/static/workflows/favicon.svg"
    assert finders.find("workflows/favicon.svg")
    client.force_login(operator)
    assert 'rel="icon" href="/static/workflows/favicon.svg"' in client.get("/").content.decode()


def test_the_list_filters_by_search_attributes_and_marks_a_bad_filter(
    operator_client, approval_workflow
):
    workflow = get_workflow(approval_workflow)
    workflow.create(id="pro-9", attributes={"customer": "c-9", "plan": "pro"})
    workflow.create(id="free-9", attributes={"customer": "c-9", "plan": "free plan"})
    workflow.create(id="pro-1", attributes={"customer": "c-1", "plan": "pro"})
    url = reverse("workflows:instances")

    def shown(attrs):
        page = operator_client.get(url, {"attrs": attrs}).content.decode()
        return re.findall(r'data-instance-id="([\w-]+)"', page)

    assert shown("customer=c-9") == ["free-9", "pro-9"]
    assert shown("customer=c-9 plan=pro") == ["pro-9"]
    assert shown('plan="free plan"') == ["free-9"]
    response = operator_client.get(url, {"attrs": "customer"})
    assert response.status_code == 400
    assert "expected KEY=VALUE pairs" in response.content.decode()
    response = operator_client.get(url, {"attrs": "customer=c-9 customer=c-1"})
    assert response.status_code == 400 and "more than once" in response.content.decode()
    response = operator_client.get(url, {"attrs": "<b>=1"})
    assert response.status_code == 400 and "&lt;b&gt;" in response.content.decode()
    workflow.create(id="shown", attributes={"note": XSS, "seats": 5})
    detail = operator_client.get(page_url(workflow.get("shown").row())).content.decode()
    assert "<dt>note</dt>" in detail and "<dt>seats</dt>" in detail
    assert XSS not in detail and "&lt;script&gt;" in detail


def test_apply_to_all_matching_starts_a_bulk_job_and_the_page_follows_it(
    operator_client, approval_workflow
):
    gold = [waiting_instance(approval_workflow, attributes={"tier": "gold"}) for _ in range(3)]
    other = waiting_instance(approval_workflow, attributes={"tier": "tin"})
    url = reverse("workflows:instances")
    page = operator_client.get(url, {"attrs": "tier=gold"}).content.decode()
    assert "Apply to all matching" in page
    count = operator_client.get(reverse("workflows:bulk-job-count"), {"attrs": "tier=gold"})
    assert count.json() == {"matching": 3}
    filters = re.search(r'name="filters" value="([^"]*)"', page).group(1)
    response = operator_client.post(
        reverse("workflows:bulk-job-start"),
        {"action": "terminate", "filters": filters.replace("&amp;", "&")},
    )
    assert response.status_code == 302 and "job=" in response["Location"]
    followed = operator_client.get(response["Location"]).content.decode()
    assert "Bulk terminate" in followed and "0 of 3 processed" in followed
    job_id = int(re.search(r"job=(\d+)", response["Location"]).group(1))
    testing.run_until_idle()
    progress = operator_client.get(reverse("workflows:bulk-job", args=[job_id])).json()
    assert (progress["done"], progress["applied"], progress["matched"]) == (True, 3, 3)
    assert progress["filter"] == {"attributes": {"tier": "gold"}} and progress["workflow"] == ""
    assert {g.status().status for g in gold} == {"terminated"}
    assert other.status().status == "waiting"


def test_a_bulk_pause_job_counts_the_pauses_only_requested_apart(
    operator_client, approval_workflow
):
    """A bulk job's pause of an instance a run holds only asks for the pause
    (waitingForPause: it pauses when its running step finishes); the job counted it in
    "applied", as if paused. It is counted apart now, in the selected-list pause's words,
    on the list page and in the job's JSON (the API's job status is the same JSON)."""
    from datetime import timedelta

    from workflows_app import bulk
    from workflows_app.engine import clock

    idle, held = (waiting_instance(approval_workflow, attributes={"tier": "gold"}) for _ in "ab")
    Instance.objects.filter(pk=held.row().pk).update(  # as a run running a step would
        status="running", lease_token="a-run", lease_expires_at=clock.now() + timedelta(minutes=5)
    )
    response = operator_client.post(
        reverse("workflows:bulk-job-start"), {"action": "pause", "filters": "attrs=tier%3Dgold"}
    )
    job_id = int(re.search(r"job=(\d+)", response["Location"]).group(1))
    assert bulk.process_batch(job_id).done
    assert idle.status().status == "paused" and held.status().status == "waitingForPause"
    progress = operator_client.get(reverse("workflows:bulk-job", args=[job_id])).json()
    assert (progress["applied"], progress["pause_requested"], progress["skipped"]) == (1, 1, 0)
    assert progress["options"] == {}  # the count is kept beside the options, not shown in them
    page = operator_client.get(response["Location"]).content.decode()
    assert "2 of 2 processed: 1 applied, pause requested for 1, 0 skipped, 0 failed" in page


def test_apply_to_all_checks_permissions_per_action(operator_client, approval_workflow, viewer):
    from workflows_app.models import BulkJob

    inst = waiting_instance(approval_workflow)
    inst.terminate()
    start = reverse("workflows:bulk-job-start")
    response = operator_client.post(start, {"action": "delete", "filters": ""}, follow=True)
    assert "needs the workflows_app.delete_instance permission" in response.content.decode()
    viewing = Client()
    viewing.force_login(viewer)
    assert viewing.post(start, {"action": "pause", "filters": ""}).status_code == 403
    assert "Apply to all" not in viewing.get(reverse("workflows:instances")).content.decode()
    assert viewing.get(reverse("workflows:bulk-job-count")).status_code == 403
    assert not BulkJob.objects.exists()
    deleter = make_user("deleter", "view_instance", "change_instance", "delete_instance")
    operator_client.force_login(deleter)
    operator_client.post(start, {"action": "delete", "filters": "status=terminated"})
    testing.run_until_idle()
    assert not Instance.objects.exists()


def test_apply_to_all_refuses_bad_filters_and_options_and_starts_nothing(
    operator_client, approval_workflow
):
    from workflows_app.models import BulkJob

    waiting_instance(approval_workflow)
    start = reverse("workflows:bulk-job-start")
    for data, message in (
        ({"action": "pause", "filters": "version=x"}, "Fix the filters first"),
        ({"action": "send_event", "filters": ""}, "needs event_type"),
        ({"action": "explode", "filters": ""}, "Select a valid choice"),
        (
            {"action": "send_event", "event_type": "go", "payload": "{", "filters": ""},
            "Not valid JSON",
        ),
    ):
        page = operator_client.post(start, data, follow=True).content.decode()
        assert message in page, message
    assert not BulkJob.objects.exists()
    assert operator_client.get(reverse("workflows:bulk-job", args=[999])).status_code == 404
    bad_count = operator_client.get(reverse("workflows:bulk-job-count"), {"version": "x"})
    assert bad_count.status_code == 400


def test_the_trace_draws_an_open_wait_as_an_in_flight_span_until_it_ends(
    operator_client, approval_workflow
):
    inst = waiting_instance(approval_workflow, id="trace-open")
    page = operator_client.get(page_url(inst.row())).content.decode()
    assert page.count('class="span span-open"') == 1
    assert "waitForEvent approval" in page and "so far" in page
    inst.send_event("approval", {"ok": True}, actor="test")
    testing.run_until_idle()  # the wait ends (its span is stored); the sleep opens
    page = operator_client.get(page_url(inst.row())).content.decode()
    assert page.count('class="span span-open"') == 1
    assert 'data-start-ms="' in page and "sleep cool-off" in page


def test_a_wait_cut_short_by_a_terminate_stays_in_the_trace_ending_with_the_instance(
    operator_client, approval_workflow
):
    inst = waiting_instance(approval_workflow, id="trace-cut")
    inst.terminate(actor="test")
    page = operator_client.get(page_url(inst.row())).content.decode()
    assert 'class="span span-open"' not in page  # nothing grows once the instance ended
    assert page.count('class="span span-cut"') == 1
    assert "waitForEvent approval" in page and "cut short" in page


def test_a_search_that_stopped_at_its_bound_says_so_and_links_on(
    operator_client, approval_workflow, monkeypatch
):
    # ?q= reads dashboard.SEARCH_SCAN instances a page: a page that found too few there
    # says so, and Older searches on from where it stopped.
    from workflows_app import dashboard

    monkeypatch.setattr(dashboard, "SEARCH_SCAN", 2)
    workflow = get_workflow(approval_workflow)
    workflow.create(id="needle-1")
    for n in range(2):
        workflow.create(id=f"hay-{n}")
    url = reverse("workflows:instances")
    page = operator_client.get(url, {"q": "needle"}).content.decode()
    assert "The search reads 2 instances a page and found none of them matching" in page
    assert "No instances match." not in page
    older = re.search(r"after=([\w-]+)", page).group(1)
    on = operator_client.get(url, {"q": "needle", "after": older}).content.decode()
    assert 'data-instance-id="needle-1"' in on


def test_apply_to_all_checks_a_sent_payload_against_each_matching_versions_limit(
    operator_client, registered
):
    """The "apply to all matching" send event checked the payload against the newest
    version's limit: a job over an older version's instances, whose limit allows it, was
    refused. Each matching version's own limit applies; a refusal names it."""
    from tests.surface_flows import LIMITED, NEW_VERSION_PAYLOAD_LIMIT, limited_versions
    from workflows_app.models import BulkJob

    old, new = limited_versions()
    start = reverse("workflows:bulk-job-start")
    payload = json.dumps("x" * 2000)
    send = {"action": "send_event", "event_type": "go", "payload": payload}
    page = operator_client.post(
        start, {**send, "filters": f"workflow={LIMITED}"}, follow=True
    ).content.decode()
    assert (
        f"payload of event &#x27;go&#x27; for {LIMITED} version 2: max_event_payload_bytes is "
        f"{NEW_VERSION_PAYLOAD_LIMIT} bytes, got 2002 bytes"
    ) in page
    assert not BulkJob.objects.exists()
    response = operator_client.post(start, {**send, "filters": f"workflow={LIMITED}&version=1"})
    assert response.status_code == 302 and "job=" in response["Location"]
    testing.run_until_idle()
    assert old.status().output == "x" * 2000 and new.status().status == "waiting"


@pytest.mark.parametrize("csrf_checked", [True, False], ids=["csrf-checked", "csrf-not-checked"])
def test_a_dashboard_form_over_djangos_size_limit_gets_a_page_naming_the_limit(
    operator, approval_workflow, csrf_checked
):
    """A POST over DATA_UPLOAD_MAX_MEMORY_SIZE to the dashboard's create, send event or
    bulk job form got Django's bare "Bad Request" page. It names the limit now."""
    from tests.surface_flows import snapshot
    from tests.test_admin_review import csrf_token_of

    client = Client(enforce_csrf_checks=csrf_checked)
    client.force_login(operator)
    inst = waiting_instance(approval_workflow)
    before = snapshot()
    token = csrf_token_of(client, reverse("workflows:instances"))
    big = "x" * 3_000_000  # over DATA_UPLOAD_MAX_MEMORY_SIZE's default, 2621440 bytes
    for url, data in (
        (reverse("workflows:create"), {"workflow": approval_workflow, "params": big}),
        (action_url(inst, "send-event"), {"type": "approval", "payload": big}),
        (
            reverse("workflows:bulk-job-start"),
            {"action": "send_event", "event_type": "approval", "payload": big, "filters": ""},
        ),
    ):
        response = client.post(url, {**data, **token})
        page = response.content.decode()
        assert response.status_code == 413, (url, page[:300])
        assert "more than the 2621440 bytes (2.5\xa0MB) this site takes in one form" in page
    assert snapshot() == before
