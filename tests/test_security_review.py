"""Found wanting by a security review: schedules through the API and the admin, tokens
minted for an inactive user, a bulk job's version out of range, values the payload codec
did not seal (a child's params, a schedule's, a bulk send_event's payload)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import Client, override_settings

from tests.dashboard.helpers import make_user
from tests.surface_flows import SIMPLE, register_flows
from workflows_app import testing, tokens
from workflows_app.client import get_workflow, schedules
from workflows_app.engine import WorkflowEntrypoint, register
from workflows_app.models import BulkJob, Instance, Schedule

pytestmark = pytest.mark.django_db(transaction=True)

SECRET = "cust-plain-SECRET"


@pytest.fixture(autouse=True)
def flows(registered: list[str]) -> None:
    register_flows()


def with_codec(path: str | None = "tests.codecs.FernetCodec") -> Any:
    return override_settings(WFDASH={**settings.WFDASH, "PAYLOAD_CODEC": path})


def user_token(name: str, *codenames: str, **token: Any) -> str:
    user = User.objects.create_user(name, is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(codename__in=codenames, content_type__app_label="workflows_app")
    )
    _, secret = tokens.issue(f"{name}-token", name, **token)
    return secret


def api(method: str, path: str, secret: str, body: Any = None) -> Any:
    data = b"" if body is None else json.dumps(body).encode()
    return Client().generic(
        method, path, data, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {secret}"
    )


def raw_column(table: str, column: str, where: str, value: Any) -> str:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {column} FROM {table} WHERE {where} = %s", [value])
        return repr(cursor.fetchall())


# --- 1. schedule writes through the API bypass change_schedule / delete_schedule -----------


def test_api_token_of_a_user_the_dashboard_refuses_may_not_pause_a_schedule():
    """The dashboard refuses a schedule pause to a user with change_instance but without
    change_schedule (tests/test_schedule_surfaces.py asserts 403). A token acting as the
    same user "never exceeds their permissions" (docs/security.md), yet the API pauses it."""
    schedules.create("nightly", workflow=SIMPLE, cron="0 3 * * *")
    operator = make_user("operator", "view_instance", "change_instance")
    dashboard = Client()
    dashboard.force_login(operator)
    assert dashboard.post("/schedules/nightly/pause/").status_code == 403
    _, secret = tokens.issue("operator-token", "operator")
    response = api("PATCH", f"/api/workflows/{SIMPLE}/schedules/nightly", secret, {"paused": True})
    assert response.status_code == 403, response.content
    assert not Schedule.objects.get(name="nightly").paused


def test_api_token_without_schedule_permissions_may_not_create_or_delete_schedules():
    secret = user_token("op2", "view_instance", "change_instance", "delete_instance")
    created = api(
        "POST",
        f"/api/workflows/{SIMPLE}/schedules",
        secret,
        {"name": "every-minute", "cron": "* * * * *"},
    )
    assert created.status_code == 403, created.content
    schedules.create("keep", workflow=SIMPLE, cron="0 3 * * *")
    deleted = api("DELETE", f"/api/workflows/{SIMPLE}/schedules/keep", secret)
    assert deleted.status_code == 403, deleted.content
    assert Schedule.objects.filter(name="keep").exists()


# --- 2. admin: adding a schedule starts instances without change_instance ------------------


def test_admin_user_without_change_instance_cannot_create_a_schedule_that_starts_instances():
    """Triggering a schedule needs change_instance ("starting instances is an instance
    write", admin.trigger_schedules); adding one that fires every minute does not."""
    user = User.objects.create_user("scheduler", is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(
            codename__in=["add_schedule", "view_schedule"], content_type__app_label="workflows_app"
        )
    )
    client = Client()
    client.force_login(user)
    client.post(
        "/admin/workflows_app/schedule/add/",
        {"name": "every-minute", "workflow": SIMPLE, "cron": "* * * * *", "timezone": "UTC"},
    )
    assert not Schedule.objects.filter(name="every-minute").exists()


# --- 4. API bulk job with a version past the database's range: 500 ---------------------------


@pytest.mark.parametrize("version", [2**63, 10**30])
def test_an_api_bulk_job_with_a_version_past_the_databases_range_is_a_4xx_not_a_500(version):
    get_workflow(SIMPLE).create(id="v1")
    secret = user_token("op", "view_instance", "change_instance")
    response = Client(raise_request_exception=False).post(
        f"/api/workflows/{SIMPLE}/bulk",
        json.dumps({"action": "pause", "version": version}),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {secret}",
    )
    assert response.status_code == 400, (response.status_code, response.content[:200])
    assert not BulkJob.objects.exists()


# --- 5. admin token minting: the "never more than you hold" check is bypassable -------------


def shown_secret(response: Any) -> str:
    return re.search(
        r'<code id="token-secret"[^>]*>(wf_[^<]+)</code>', response.content.decode()
    ).group(1)


def clerk_client() -> Client:
    clerk = User.objects.create_user("clerk", is_staff=True)
    clerk.user_permissions.add(
        *Permission.objects.filter(
            codename__in=["add_apitoken", "view_apitoken", "view_instance"],
            content_type__app_label="workflows_app",
        )
    )
    client = Client()
    client.force_login(clerk)
    return client


def test_a_clerk_may_not_mint_a_write_token_for_a_deactivated_operator():
    """issuer_refusal compares get_all_permissions(), which is empty for an inactive user:
    a clerk holding only view_instance mints a token acting as a (temporarily) deactivated
    operator; once the operator is active again the clerk's token writes."""
    operator = User.objects.create_user("operator", is_staff=True)
    operator.user_permissions.add(
        *Permission.objects.filter(
            codename__in=["view_instance", "change_instance", "delete_instance"],
            content_type__app_label="workflows_app",
        )
    )
    operator.is_active = False
    operator.save()
    response = clerk_client().post(
        "/admin/workflows_app/apitoken/add/",
        {"name": "as-operator", "user": operator.pk, "scope": "write"},
    )
    minted = re.search(r'id="token-secret"', response.content.decode()) is not None
    if minted:
        operator.is_active = True
        operator.save()
        created = api("POST", f"/api/workflows/{SIMPLE}/instances", shown_secret(response), {})
        assert created.status_code == 403, created.content[:200]
    assert not minted, "a token was minted acting as a user holding more than the clerk"


def test_a_token_minted_for_a_weaker_user_does_not_grow_beyond_its_issuer():
    """The clerk (view_instance only) mints a write token for a weaker user, as allowed;
    when that user is later made an operator, the token still may not write: it never
    does more than its issuer may, and its issuer may not write."""
    bob = User.objects.create_user("bob")
    response = clerk_client().post(
        "/admin/workflows_app/apitoken/add/", {"name": "as-bob", "user": bob.pk, "scope": "write"}
    )
    secret = shown_secret(response)
    bob.user_permissions.add(
        *Permission.objects.filter(
            codename__in=["view_instance", "change_instance"],
            content_type__app_label="workflows_app",
        )
    )
    created = api("POST", f"/api/workflows/{SIMPLE}/instances", secret, {})
    assert created.status_code == 403, created.content[:200]
    assert "issued by 'clerk'" in created.json()["errors"][0]["message"]
    assert not Instance.objects.exists()
    read = api("GET", f"/api/workflows/{SIMPLE}/instances", secret)
    assert read.status_code == 200  # what the issuer may do, the token may


# --- 3. the payload codec is bypassed for child params, schedule params, bulk payloads -------


def test_child_instance_params_are_encrypted_at_rest_like_any_params(registered):
    @register("rev-parent")
    class Parent(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            await step.start("child", "rev-child", params={"card": SECRET})
            return None

    @register("rev-child")
    class Child(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            return None

    with with_codec():
        get_workflow("rev-parent").create(id="p1")
        testing.run_until_idle()
        child = Instance.objects.get(workflow="rev-child")
        assert child.params == {"card": SECRET}  # the engine still reads it
        stored = raw_column(Instance._meta.db_table, "params_json", "id", child.pk)
    assert SECRET not in stored, f"child params stored in clear: {stored}"


def test_schedule_params_are_encrypted_at_rest():
    with with_codec():
        schedules.create("nightly", workflow=SIMPLE, cron="0 3 * * *", params={"card": SECRET})
        assert schedules.get("nightly").params == {"card": SECRET}
        stored = raw_column(Schedule._meta.db_table, "params_json", "name", "nightly")
    assert SECRET not in stored, f"schedule params stored in clear: {stored}"


def test_the_params_of_an_instance_a_schedule_starts_are_encrypted_at_rest():
    with with_codec():
        schedules.create("nightly", workflow=SIMPLE, cron="0 3 * * *", params={"card": SECRET})
        row = schedules.get("nightly").trigger().row()
        assert row.params == {"card": SECRET}
        stored = raw_column(Instance._meta.db_table, "params_json", "id", row.pk)
    assert SECRET not in stored, f"instance params stored in clear: {stored}"


def test_a_bulk_send_event_payload_is_encrypted_at_rest():
    with with_codec():
        get_workflow(SIMPLE).create(id="b1")
        get_workflow(SIMPLE).bulk("send_event", event_type="go", payload={"card": SECRET})
        stored = raw_column(BulkJob._meta.db_table, "options", "workflow", SIMPLE)
    assert SECRET not in stored, f"bulk event payload stored in clear: {stored}"
