"""Schedules on every surface: `wf schedules`, the JSON API, the admin and the dashboard."""

from __future__ import annotations

import html
import json
from datetime import UTC, datetime
from io import StringIO
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.urls import reverse

from tests.dashboard.helpers import make_user
from tests.surface_flows import OTHER, SIMPLE, register_flows
from tests.test_api import Api, error_of, user_api
from workflows_app import testing, tokens
from workflows_app.client import schedules
from workflows_app.engine import errors
from workflows_app.models import Instance, Schedule

pytestmark = pytest.mark.django_db(transaction=True)

XSS = "<script>alert(1)</script>"
START = datetime(2026, 6, 1, 2, 50, tzinfo=UTC)


@pytest.fixture(autouse=True)
def flows(registered: list[str]) -> None:
    register_flows()


def wf(*args: str) -> str:
    out = StringIO()
    call_command("wf", *args, stdout=out, stderr=StringIO())
    return out.getvalue()


def wf_json(*args: str) -> Any:
    return json.loads(wf(*args, "--json"))


# --- wf schedules ---------------------------------------------------------------------------


def test_wf_schedules_create_list_pause_resume_trigger_delete():
    with testing.fake_clock(START):
        created = wf_json(
            "schedules", "create", "nightly", SIMPLE, "0 3 * * *", "--params", '{"n": 1}'
        )
        assert created["next_runs"][:2] == [
            "2026-06-01T03:00:00+00:00",
            "2026-06-02T03:00:00+00:00",
        ]
        assert created["params"] == {"n": 1}
        listed = wf("schedules", "list")
        assert "nightly" in listed and "0 3 * * *" in listed and "active" in listed
        assert wf_json("schedules", "pause", "nightly")["paused"] is True
        assert "paused" in wf("schedules", "list")
        assert (
            wf_json("schedules", "resume", "nightly")["next_run_at"] == "2026-06-01T03:00:00+00:00"
        )
        started = wf_json("schedules", "trigger", "nightly")
        row = Instance.objects.get(instance_id=started["id"])
        assert (row.workflow, row.schedule, row.params) == (SIMPLE, "nightly", {"n": 1})
        assert "deleted schedule 'nightly'" in wf("schedules", "delete", "nightly")
        assert wf_json("schedules", "list") == []


def test_a_paused_schedule_shows_no_next_runs_on_any_surface(service):
    """A paused schedule fires no tick: its next fire times are none on the client, the
    API, the command and the dashboard alike, and come back when it is resumed."""
    with testing.fake_clock(START):
        schedules.create("quiet", workflow=SIMPLE, cron="0 3 * * *")
        assert wf_json("schedules", "pause", "quiet")["next_runs"] == []
        assert schedules.get("quiet").next_runs(3) == []
        api = service.get(schedules_url(name="quiet")).json()["result"]
        assert (api["paused"], api["next_run_at"], api["next_runs"]) == (True, None, [])
        listed = wf("schedules", "list")
        assert "paused" in listed and "2026-06-01 03:00" not in listed
        client = Client()
        client.force_login(make_user("viewer", "view_instance"))
        detail = client.get(reverse("workflows:schedule", args=["quiet"])).content.decode()
        assert "none while paused" in detail and "2026-06-01" not in detail
        resumed = service.patch(schedules_url(name="quiet"), {"paused": False}).json()["result"]
        assert resumed["next_runs"][0] == "2026-06-01T03:00:00+00:00"
        assert wf_json("schedules", "pause", "quiet")["next_runs"] == []
        assert wf_json("schedules", "resume", "quiet")["next_runs"][0] == (
            "2026-06-01T03:00:00+00:00"
        )


def test_wf_schedules_refuses_bad_input_with_one_line():
    with pytest.raises(CommandError, match=r"'0 25 \* \* \*' does not parse"):
        wf("schedules", "create", "bad", SIMPLE, "0 25 * * *")
    with pytest.raises(CommandError, match="needs NAME WORKFLOW CRON"):
        wf("schedules", "create", "bad", SIMPLE)
    with pytest.raises(CommandError, match="no schedule named 'missing'"):
        wf("schedules", "pause", "missing")
    with pytest.raises(CommandError, match="needs a schedule name"):
        wf("schedules", "trigger")
    wf("schedules", "create", "taken", SIMPLE, "* * * * *")
    with pytest.raises(CommandError, match="already exists"):
        wf("schedules", "create", "taken", SIMPLE, "0 * * * *")
    assert list(Schedule.objects.values_list("name", flat=True)) == ["taken"]


# --- API ------------------------------------------------------------------------------------


def schedules_url(workflow: str = SIMPLE, name: str | None = None) -> str:
    path = f"/api/workflows/{workflow}/schedules"
    return path if name is None else f"{path}/{name}"


@pytest.fixture
def service() -> Api:
    _, secret = tokens.issue("service")
    return Api(Client(enforce_csrf_checks=True), secret)


def test_api_creates_lists_gets_pauses_triggers_and_deletes_schedules(service):
    with testing.fake_clock(START):
        response = service.post(
            schedules_url(),
            {"name": "eu", "cron": "0 9 * * *", "timezone": "Europe/Paris", "params": {"r": "eu"}},
        )
        assert response.status_code == 201
        result = response.json()["result"]
        assert result["next_runs"][0] == "2026-06-01T07:00:00+00:00"
        assert [s["name"] for s in service.get(schedules_url()).json()["result"]] == ["eu"]
        assert service.get(schedules_url(name="eu")).json()["result"]["timezone"] == "Europe/Paris"
        paused = service.patch(schedules_url(name="eu"), {"paused": True}).json()["result"]
        assert paused["paused"] is True and paused["next_run_at"] is None
        triggered = service.post(schedules_url(name="eu") + "/trigger")
        assert triggered.status_code == 201
        assert Instance.objects.get(instance_id=triggered.json()["result"]["id"]).schedule == "eu"
        deleted = service.call("DELETE", schedules_url(name="eu"))
        assert deleted.json()["result"] == {"name": "eu", "workflow": SIMPLE, "deleted": True}
        assert not Schedule.objects.exists()


def test_api_answers_bad_schedule_input_with_4xx_json(service):
    schedules.create("taken", workflow=SIMPLE, cron="* * * * *")
    cases = [
        (service.post(schedules_url(), {"name": "x", "cron": "nope"}), 400, "InvalidInput"),
        (service.post(schedules_url(), {"name": "x"}), 400, "InvalidInput"),
        (
            service.post(schedules_url(), {"name": "x", "cron": "* * * * *", "tz": "UTC"}),
            400,
            "InvalidInput",
        ),
        (
            service.post(
                schedules_url(), {"name": "x", "cron": "* * * * *", "timezone": "Nowhere/City"}
            ),
            400,
            "InvalidInput",
        ),
        (
            service.post(schedules_url(), {"name": "taken", "cron": "* * * * *"}),
            409,
            "ScheduleExists",
        ),
        (service.get(schedules_url(name="missing")), 404, "ScheduleNotFound"),
        (service.get(schedules_url("surface-other", "taken")), 404, "ScheduleNotFound"),
        (service.get(schedules_url("no-such-workflow")), 404, "UnknownWorkflow"),
        (service.patch(schedules_url(name="taken"), {"paused": "yes"}), 400, "InvalidInput"),
    ]
    for response, status, code in cases:
        assert error_of(response)[:2] == (status, code)
    assert list(Schedule.objects.values_list("name", "paused")) == [("taken", False)]


def test_api_lists_pauses_and_deletes_a_schedule_whose_workflow_left_the_code(service):
    """The client, `wf schedules` and the dashboard list such a schedule (it never fires
    again) and can delete it; the API answered 404 UnknownWorkflow for its list, the
    schedule and every change, so an API user could neither see nor remove it."""
    from workflows_app.engine import WorkflowEntrypoint, register, registry

    @register("retired-report")
    class Retired(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            return None

    schedules.create("orphan", workflow="retired-report", cron="0 * * * *")
    registry.unregister("retired-report")  # the class left the code; no instance was started
    url = schedules_url("retired-report", "orphan")
    listed = service.get(schedules_url("retired-report"))
    assert [s["name"] for s in listed.json()["result"]] == ["orphan"]
    assert service.get(url).json()["result"]["workflow"] == "retired-report"
    assert service.patch(url, {"paused": True}).json()["result"]["paused"] is True
    assert error_of(service.post(url + "/trigger"))[:2] == (404, "UnknownWorkflow")
    assert service.call("DELETE", url).json()["result"]["deleted"] is True
    assert not Schedule.objects.exists()
    assert error_of(service.get(schedules_url("retired-report")))[:2] == (404, "UnknownWorkflow")
    assert error_of(service.get(url))[:2] == (404, "UnknownWorkflow")


def test_api_schedule_writes_need_a_write_token_for_the_workflow():
    schedules.create("guarded", workflow=SIMPLE, cron="* * * * *")
    reader = user_api("reader", can_change=False)
    assert reader.get(schedules_url()).status_code == 200
    assert error_of(reader.patch(schedules_url(name="guarded"), {"paused": True}))[0] == 403
    assert error_of(reader.post(schedules_url(name="guarded") + "/trigger"))[0] == 403
    assert error_of(reader.call("DELETE", schedules_url(name="guarded")))[0] == 403
    other = user_api("other", can_change=True, workflows=["surface-other"])
    assert error_of(other.get(schedules_url()))[0] == 403
    assert not Schedule.objects.get(name="guarded").paused
    assert not Instance.objects.exists()


# --- admin ----------------------------------------------------------------------------------


def staff_client(name: str, *codenames: str) -> Client:
    user = User.objects.create_user(name, is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(codename__in=codenames, content_type__app_label="workflows_app")
    )
    client = Client()
    client.force_login(user)
    return client


def test_admin_adds_a_schedule_and_pauses_resumes_and_triggers_it():
    admin = Client()
    admin.force_login(User.objects.create_superuser("boss", password="pw"))
    add = reverse("admin:workflows_app_schedule_add")
    refused = admin.post(
        add, {"name": "a", "workflow": SIMPLE, "cron": "99 * * * *", "timezone": "UTC"}
    )
    assert refused.status_code == 200 and b"does not parse" in refused.content
    response = admin.post(
        add,
        {
            "name": "a",
            "workflow": SIMPLE,
            "cron": "*/5 * * * *",
            "timezone": "UTC",
            "params": '{"k": 1}',
        },
    )
    assert response.status_code == 302
    row = Schedule.objects.get(name="a")
    assert (row.params, row.next_run_at is not None) == ({"k": 1}, True)
    changelist = reverse("admin:workflows_app_schedule_changelist")
    admin.post(changelist, {"action": "pause_schedules", "_selected_action": [row.pk]})
    assert Schedule.objects.get(name="a").paused
    admin.post(changelist, {"action": "resume_schedules", "_selected_action": [row.pk]})
    assert not Schedule.objects.get(name="a").paused
    admin.post(changelist, {"action": "trigger_schedules", "_selected_action": [row.pk]})
    assert Instance.objects.filter(schedule="a").count() == 1
    page = admin.get(changelist)
    assert Schedule.objects.get(name="a").last_instance_id.encode() in page.content


def test_admin_deletes_a_declared_schedule_only_once_its_workflow_left_the_code():
    """The client and `wf schedules delete` remove a declared schedule whose workflow was
    removed from the code (nothing else ever will); the admin refused it with 403."""
    from workflows_app.engine import WorkflowEntrypoint, register, registry

    @register("retired-nightly", schedules=["0 3 * * *"])
    class Retired(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            return None

    testing.run_until_idle()  # a worker start declares it
    admin = Client()
    admin.force_login(User.objects.create_superuser("boss", password="pw"))
    pk = Schedule.objects.get(name="retired-nightly:0").pk
    delete = reverse("admin:workflows_app_schedule_delete", args=[pk])
    assert admin.get(delete).status_code == 403  # declared by code that is still there
    registry.unregister("retired-nightly")
    assert admin.get(delete).status_code == 200
    assert admin.post(delete, {"post": "yes"}).status_code == 302
    assert not Schedule.objects.exists()


def test_admin_refuses_bad_schedule_params_as_a_form_error_naming_them():
    admin = Client(raise_request_exception=False)
    admin.force_login(User.objects.create_superuser("boss", password="pw"))
    add = reverse("admin:workflows_app_schedule_add")
    fields = {"name": "a", "workflow": SIMPLE, "cron": "* * * * *", "timezone": "UTC"}
    for params, named in (
        ("[" * 100_000, "nested too deeply"),  # the JSON parser's RecursionError
        ("[" * 200 + "]" * 200, "nesting limit"),
        ('"' + "x" * (1024 * 1024) + '"', "max_params_bytes"),
        ("NaN", "not JSON-serialisable"),
        ('"\\ud800"', "not valid Unicode"),
    ):
        response = admin.post(add, {**fields, "params": params})
        assert response.status_code == 200, (params[:20], response.status_code)
        assert named in html.unescape(response.content.decode()), params[:20]
    assert not Schedule.objects.exists()


def test_admin_schedule_actions_need_the_change_permissions():
    schedules.create("s", workflow=SIMPLE, cron="* * * * *")
    pk = Schedule.objects.get(name="s").pk
    changelist = reverse("admin:workflows_app_schedule_changelist")
    viewer = staff_client("viewer", "view_schedule")
    response = viewer.post(changelist, {"action": "pause_schedules", "_selected_action": [pk]})
    assert not Schedule.objects.get(name="s").paused and response.status_code in (200, 302, 403)
    no_instances = staff_client("scheduler", "view_schedule", "change_schedule")
    response = no_instances.post(
        changelist, {"action": "trigger_schedules", "_selected_action": [pk]}
    )
    assert response.status_code == 403
    assert not Instance.objects.exists()


# --- dashboard ------------------------------------------------------------------------------


def test_the_dashboard_lists_schedules_with_next_and_last_runs_and_links_their_instances():
    schedules.create("hourly", workflow=SIMPLE, cron="0 * * * *", params={"x": XSS})
    with testing.fake_clock(START) as clock:
        schedules.create("every-5", workflow=SIMPLE, cron="*/5 * * * *")
        clock.advance("12 minutes")
        testing.run_until_idle()
    started = Instance.objects.get(schedule="every-5")
    client = Client()
    client.force_login(make_user("viewer", "view_instance"))
    listing = client.get(reverse("workflows:schedules")).content.decode()
    assert 'data-schedule="every-5"' in listing and 'data-schedule="hourly"' in listing
    assert reverse("workflows:instance", args=[SIMPLE, started.instance_id]) in listing
    detail = client.get(reverse("workflows:schedule", args=["every-5"])).content.decode()
    assert started.instance_id in detail and "*/5 * * * *" in detail
    hourly = client.get(reverse("workflows:schedule", args=["hourly"])).content.decode()
    assert XSS not in hourly and "&lt;script&gt;" in hourly
    workflow_page = client.get(reverse("workflows:workflow", args=[SIMPLE])).content.decode()
    assert 'data-schedule="every-5"' in workflow_page
    instance_page = client.get(
        reverse("workflows:instance", args=[SIMPLE, started.instance_id])
    ).content.decode()
    assert reverse("workflows:schedule", args=["every-5"]) in instance_page
    assert client.get(reverse("workflows:schedule", args=["missing"])).status_code == 404


def test_the_schedule_page_lists_only_the_instances_of_the_schedules_workflow():
    """A schedule deleted and made again under its name for another workflow: its page
    listed the instances the old one had started (filtered by name alone)."""
    old = schedules.create("shared", workflow=SIMPLE, cron="0 3 * * *").trigger()
    schedules.get("shared").delete()
    new = schedules.create("shared", workflow=OTHER, cron="0 3 * * *").trigger()
    client = Client()
    client.force_login(make_user("viewer", "view_instance"))
    page = client.get(reverse("workflows:schedule", args=["shared"])).content.decode()
    assert reverse("workflows:instance", args=[OTHER, new.id]) in page
    assert old.id not in page


def test_a_schedule_made_again_for_its_workflow_shows_none_of_the_old_ones_ticks(service):
    """Deleted and made again under its name for the same workflow: the schedule page
    listed the old one's ticks as its own (by name and workflow). No surface shows them
    as the new one's; they stay, as instances."""
    with testing.fake_clock(START) as clock:
        schedules.create("again", workflow=SIMPLE, cron="0 * * * *")
        clock.advance("15 minutes")
        testing.run_until_idle()
        old = Instance.objects.get(schedule="again")
        assert wf("schedules", "delete", "again")
        wf("schedules", "create", "again", SIMPLE, "0 * * * *")
        client = Client()
        client.force_login(make_user("viewer", "view_instance"))
        page = client.get(reverse("workflows:schedule", args=["again"])).content.decode()
        assert old.instance_id not in page
        listing = client.get(reverse("workflows:schedules")).content.decode()
        assert old.instance_id not in listing
        assert service.get(schedules_url(name="again")).json()["result"]["last_instance_id"] is None
        assert [s["last_instance_id"] for s in wf_json("schedules", "list")] == [None]
        assert schedules.get("again").instances() == []
        clock.advance("1 hour")
        testing.run_until_idle()
        new = Instance.objects.get(
            schedule="again", scheduled_at=datetime(2026, 6, 1, 4, tzinfo=UTC)
        )
        page = client.get(reverse("workflows:schedule", args=["again"])).content.decode()
        assert new.instance_id in page and old.instance_id not in page
        assert service.get(schedules_url(name="again")).json()["result"]["last_instance_id"] == (
            new.instance_id
        )
        old_page = client.get(reverse("workflows:instance", args=[SIMPLE, old.instance_id]))
        assert old_page.status_code == 200
        schedule_link = reverse("workflows:schedule", args=["again"])
        assert schedule_link not in old_page.content.decode()  # not the new one's
        assert "again</span> (deleted)" in old_page.content.decode()
        new_page = client.get(reverse("workflows:instance", args=[SIMPLE, new.instance_id]))
        assert schedule_link in new_page.content.decode()


def test_the_dashboard_shows_a_schedules_params_decoded_and_survives_undecodable_ones():
    """With a payload codec the stored params are the codec's envelope: the schedule page
    showed that ({"$codec": "Z0FB..."}) as the params; without the codec they were written
    with, the page was a 500 (CodecError). The admin and the API show them decoded."""
    from tests.test_security_review import with_codec

    client = Client(raise_request_exception=False)
    client.force_login(make_user("viewer", "view_instance"))
    page = reverse("workflows:schedule", args=["sealed"])
    with with_codec():
        schedules.create("sealed", workflow=SIMPLE, cron="0 3 * * *", params={"card": "4242"})
        shown = client.get(page).content.decode()
        assert "4242" in shown and "$codec" not in shown
    with with_codec(None):  # the codec's setting removed: the params cannot be decoded
        response = client.get(page)
        assert response.status_code == 200
        assert "cannot decode" in response.content.decode()


def test_a_schedule_whose_params_cannot_be_decoded_can_still_be_paused_and_deleted(service):
    """Handles decoded the params when made: with the payload codec they were written with
    gone (or its key lost), schedules.get raised CodecError, so no surface could pause,
    resume or delete the schedule (the API answered 400, wf CommandError, the admin's
    delete failed) while its ticks kept starting instances."""
    from tests.test_security_review import with_codec

    with with_codec():
        schedules.create("sealed", workflow=SIMPLE, cron="0 3 * * *", params={"card": "4242"})
        schedules.create("doomed", workflow=SIMPLE, cron="0 4 * * *", params={"card": "4242"})
    with with_codec(None):
        assert schedules.get("sealed").pause().paused
        paused = service.patch(schedules_url(name="sealed"), {"paused": False})
        assert paused.status_code == 200, paused.content
        assert "cannot decode" in paused.json()["result"]["params"]
        assert "cannot decode" in service.get(schedules_url()).json()["result"][0]["params"]
        wf("schedules", "delete", "doomed")
        assert [s.name for s in schedules.list()] == ["sealed"]
        with pytest.raises(errors.CodecError):
            schedules.get("sealed").params  # noqa: B018  (reading them still names the fault)


def test_dashboard_schedule_actions_check_permissions_and_act():
    schedules.create("s", workflow=SIMPLE, cron="* * * * *")
    viewer = Client()
    viewer.force_login(make_user("viewer", "view_instance"))
    assert viewer.post(reverse("workflows:schedule-action", args=["s", "pause"])).status_code == 403
    operator = Client()
    operator.force_login(make_user("operator", "view_instance", "change_instance"))
    assert (
        operator.post(reverse("workflows:schedule-action", args=["s", "pause"])).status_code == 403
    )
    scheduler = Client()
    scheduler.force_login(
        make_user("scheduler", "view_instance", "change_instance", "change_schedule")
    )
    assert not Schedule.objects.get(name="s").paused
    response = scheduler.post(reverse("workflows:schedule-action", args=["s", "pause"]))
    assert response.status_code == 302 and Schedule.objects.get(name="s").paused
    scheduler.post(reverse("workflows:schedule-action", args=["s", "trigger"]))
    assert Instance.objects.filter(schedule="s").count() == 1
    assert (
        scheduler.get(reverse("workflows:schedule-action", args=["s", "resume"])).status_code == 405
    )
    assert (
        scheduler.post(reverse("workflows:schedule-action", args=["s", "explode"])).status_code
        == 404
    )
