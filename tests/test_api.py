"""The JSON API: every endpoint, its refusals, and every response checked against /api/openapi.json."""

from __future__ import annotations

import io
import json
import re
from datetime import timedelta
from typing import Any
from urllib.parse import urlencode

import jsonschema
import pytest
from django.contrib.auth.models import Permission, User
from django.core.handlers.asgi import ASGIRequest
from django.test import Client
from django.urls import get_resolver, resolve
from openapi_spec_validator import validate as validate_openapi

from tests.surface_flows import (
    APPROVAL,
    COMPENSATIONS,
    OTHER,
    SIMPLE,
    register_flows,
    snapshot,
    waiting_approval,
)
from workflows_app import api, openapi, testing, tokens
from workflows_app.client import get_workflow
from workflows_app.models import ApiToken, HistoryRecord, Instance

pytestmark = pytest.mark.django_db(transaction=True)

DOC = openapi.document()
UNSET = object()


def check_against_openapi(method: str, path: str, response: Any) -> None:
    """The response must be one the document describes for this path and method."""
    route = resolve(path.split("?")[0]).route
    template = "/" + re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", route)
    assert template in DOC["paths"], f"{template} is not in the OpenAPI document"
    operation = DOC["paths"][template].get(method.lower())
    if operation is None:  # a method the path does not take: refused before anything else
        assert response.status_code in (401, 405)
        described = DOC["components"]["responses"][
            "Unauthorized" if response.status_code == 401 else "MethodNotAllowed"
        ]
    else:
        described = operation["responses"].get(str(response.status_code))
        assert described is not None, (
            f"{method} {template} does not document status {response.status_code}"
        )
        if "$ref" in described:
            described = DOC["components"]["responses"][described["$ref"].rsplit("/", 1)[1]]
    assert response["Content-Type"] == "application/json"
    schema = {**described["content"]["application/json"]["schema"], "components": DOC["components"]}
    jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    ).validate(response.json())


class Api:
    """The test client speaking to the API with a bearer token, checking every answer."""

    def __init__(self, client: Client, secret: str | None) -> None:
        self.client = client
        self.secret = secret

    def call(
        self,
        method: str,
        path: str,
        body: Any = UNSET,
        raw: bytes | None = None,
        secret: Any = UNSET,
        **headers: str,
    ) -> Any:
        secret = self.secret if secret is UNSET else secret
        if secret:
            headers.setdefault("Authorization", f"Bearer {secret}")
        data = raw if raw is not None else b"" if body is UNSET else json.dumps(body).encode()
        response = self.client.generic(
            method, path, data, content_type="application/json", headers=headers
        )
        check_against_openapi(method, path, response)
        return response

    def get(self, path: str, **kw: Any) -> Any:
        return self.call("GET", path, **kw)

    def post(self, path: str, body: Any = UNSET, **kw: Any) -> Any:
        return self.call("POST", path, body, **kw)

    def patch(self, path: str, body: Any = UNSET, **kw: Any) -> Any:
        return self.call("PATCH", path, body, **kw)

    def delete(self, path: str, **kw: Any) -> Any:
        return self.call("DELETE", path, **kw)


def base(workflow: str = APPROVAL, instance_id: str | None = None) -> str:
    path = f"/api/workflows/{workflow}/instances"
    return path if instance_id is None else f"{path}/{instance_id}"


def error_of(response: Any) -> tuple[int, str, str]:
    body = json.loads(response.content)
    assert body["success"] is False
    return response.status_code, body["errors"][0]["code"], body["errors"][0]["message"]


@pytest.fixture(autouse=True)
def flows(registered: list[str]) -> None:
    register_flows()
    COMPENSATIONS.clear()


@pytest.fixture
def service() -> Api:
    _, secret = tokens.issue("service")
    return Api(Client(enforce_csrf_checks=True), secret)


def user_api(
    name: str, can_change: bool, active: bool = True, can_view: bool = True, **token: Any
) -> Api:
    user = User.objects.create_user(name, is_active=active)
    codenames = ["view_instance"] * can_view + ["change_instance"] * can_change
    codenames += ["delete_instance"] * token.pop("can_delete", False)
    user.user_permissions.add(
        *Permission.objects.filter(codename__in=codenames, content_type__app_label="workflows_app")
    )
    _, secret = tokens.issue(f"{name}-token", name, **token)
    return Api(Client(), secret)


def refused(call: Any) -> tuple[int, str, str]:
    """Make a call that must be refused; returns (status, code, message) after checking nothing changed."""
    before = snapshot()
    response = call()
    assert snapshot() == before
    return error_of(response)


# --- the document -------------------------------------------------------------------------


def test_the_openapi_document_is_valid_openapi_3_1_and_served_without_a_token(service):
    response = Client().get("/api/openapi.json")
    assert response.status_code == 200
    assert response.json() == DOC
    validate_openapi(DOC)
    assert DOC["openapi"] == "3.1.0"


def test_every_api_route_is_described_in_the_document():
    routes = {
        "/api/" + re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", str(p.pattern))
        for p in get_resolver("workflows_app.api_urls").url_patterns
    }
    assert routes == set(DOC["paths"])


# --- authentication and permission ------------------------------------------------------


def test_it_refuses_a_request_without_a_token(service):
    response = service.get(base(), secret=None)
    assert error_of(response)[:2] == (401, "Unauthorized")
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_it_refuses_an_unknown_token_and_another_scheme(service):
    assert error_of(service.get(base(), secret="wf_not-a-real-token"))[0] == 401
    response = service.get(base(), secret=None, Authorization=f"Basic {service.secret}")
    assert error_of(response)[0] == 401


def test_it_refuses_a_revoked_token_and_changes_nothing(service):
    tokens.revoke("service")
    status, code, _ = refused(lambda: service.post(base(), {"id": "x"}))
    assert (status, code) == (401, "Unauthorized")
    assert not Instance.objects.exists()


def test_it_refuses_the_token_of_an_inactive_user():
    inactive = user_api("gone", can_change=True, active=False)
    assert error_of(inactive.get(base()))[0] == 401


def test_a_token_whose_user_may_view_but_not_change_may_read_but_not_write():
    waiting_approval("o-1")
    reader = user_api("reader", can_change=False)
    assert reader.get(base(APPROVAL, "o-1")).status_code == 200
    status, code, message = refused(
        lambda: reader.patch(base(APPROVAL, "o-1") + "/status", {"status": "pause"})
    )
    assert (status, code) == (403, "Forbidden") and "workflows_app.change_instance" in message
    assert refused(lambda: reader.post(base(), {"id": "new"}))[0] == 403
    assert (
        refused(lambda: reader.post(base(APPROVAL, "o-1") + "/events/approval", {"ok": True}))[0]
        == 403
    )
    assert refused(lambda: reader.post(base(APPROVAL, "o-1") + "/cancel"))[0] == 403
    assert refused(lambda: reader.post(base(APPROVAL, "o-1") + "/skip-sleep"))[0] == 403


def test_a_token_whose_user_has_the_change_permission_acts_under_the_token_name():
    waiting_approval("o-1")
    operator = user_api("operator", can_change=True)
    assert operator.patch(base(APPROVAL, "o-1") + "/status", {"status": "pause"}).status_code == 200
    assert HistoryRecord.objects.filter(type="instance.paused").get().actor == "operator-token"


def test_a_session_login_alone_does_not_authenticate():
    admin = User.objects.create_superuser("admin", password="pw")
    client = Client()
    client.force_login(admin)
    assert client.get(base()).status_code == 401


def test_a_used_token_records_when_it_was_last_used(service):
    assert ApiToken.objects.get(name="service").last_used_at is None
    service.get(base())
    assert ApiToken.objects.get(name="service").last_used_at is not None


# --- create -----------------------------------------------------------------------------


def test_create_starts_an_instance_and_answers_201(service):
    response = service.post(base(), {"id": "o-1", "params": {"amount": 3}})
    assert response.status_code == 201
    assert response.json() == {
        "success": True,
        "result": {
            "id": "o-1",
            "workflow": APPROVAL,
            "version": 1,
            "status": "running",
            "created": True,
        },
    }
    handle = get_workflow(APPROVAL).get("o-1")
    assert handle.row().params == {"amount": 3} and handle.row().created_by == "service"


def test_create_accepts_instance_id_an_empty_body_and_an_idempotency_key(service):
    assert service.post(base(), {"instance_id": "cf-style"}).json()["result"]["id"] == "cf-style"
    generated = service.post(base()).json()["result"]["id"]
    assert len(generated) == 36
    first = service.post(base(SIMPLE), {"idempotency_key": "k"}).json()["result"]["id"]
    again = service.post(base(SIMPLE), {"idempotency_key": "k"})
    assert again.status_code == 200  # not 201: nothing new was made
    assert again.json()["result"]["id"] == first and again.json()["result"]["created"] is False
    assert Instance.objects.filter(workflow=SIMPLE).count() == 1


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "request body is not valid JSON"),
        (b'{"params": NaN}', "NaN is not valid JSON"),
        (b"\xff\xfe{}", "request body is not UTF-8"),
        (b"[1, 2]", "request body must be a JSON object, got an array"),
        (b'{"id": 5}', "instance id must be a non-empty string, got 5"),
        (b'{"id": ""}', "instance id must be a non-empty string, got ''"),
        (b'{"id": "a", "instance_id": "b"}', "not two different ids"),
        (b'{"id": "has space"}', "invalid instance id 'has space'"),
        (b'{"idempotency_key": 7}', "idempotency_key must be a string"),
        (b'{"colour": "red"}', "unknown field(s) ['colour']"),
        (
            b'{"retention": 1e20}',
            "1e+20: longer than the longest duration wfdash stores, 1000 years",
        ),
        (
            b'{"retention": 9e18}',
            "9e+18: longer than the longest duration wfdash stores, 1000 years",
        ),
        (b'{"retention": "8000 years"}', "'8000 years': longer than the longest duration"),
    ],
)
def test_create_refuses_bad_input_with_400_naming_the_problem(service, raw, message):
    status, _, text = refused(lambda: service.post(base(), raw=raw))
    assert status == 400 and message in text


def test_create_refuses_an_id_that_exists_with_409(service):
    service.post(base(), {"id": "o-1"})
    status, code, message = refused(lambda: service.post(base(), {"id": "o-1"}))
    assert (status, code) == (409, "InstanceAlreadyExists") and "'o-1'" in message


def test_create_in_an_unknown_workflow_is_404(service):
    status, code, message = refused(lambda: service.post(base("nope"), {}))
    assert (status, code, message) == (
        404,
        "UnknownWorkflow",
        "no workflow named 'nope' is registered",
    )


def test_batch_creates_every_instance(service):
    response = service.post(
        base(SIMPLE) + "/batch", [{"id": "b1", "params": 1}, {"instance_id": "b2"}]
    )
    assert response.status_code == 201
    assert [r["id"] for r in response.json()["result"]] == ["b1", "b2"]


def test_an_empty_batch_answers_200_with_an_empty_list(service):
    response = service.post(base(SIMPLE) + "/batch", [])
    assert response.status_code == 200  # nothing was created (201 means something was)
    assert response.json()["result"] == []


def test_batch_creates_none_when_one_is_refused(service):
    service.post(base(SIMPLE), {"id": "taken"})
    status, code, _ = refused(
        lambda: service.post(base(SIMPLE) + "/batch", [{"id": "fresh"}, {"id": "taken"}])
    )
    assert (status, code) == (409, "InstanceAlreadyExists")
    assert refused(lambda: service.post(base(SIMPLE) + "/batch", {"id": "x"}))[2] == (
        "request body must be a JSON array of instances, got an object"
    )
    status, code, message = refused(
        lambda: service.post(base(SIMPLE) + "/batch", [{"id": f"i{n}"} for n in range(101)])
    )
    assert (status, code) == (400, "LimitExceeded") and "max_batch_size is 100" in message


# --- read -------------------------------------------------------------------------------


def test_list_filters_by_status_and_pages_with_a_cursor(service):
    for n in range(3):
        service.post(base(SIMPLE), {"id": f"s{n}"})
    testing.run_until_idle()
    service.post(base(SIMPLE), {"id": "fresh"})
    page = service.get(base(SIMPLE) + "?status=complete&limit=2").json()
    assert [i["id"] for i in page["result"]] == ["s2", "s1"]
    assert page["result_info"]["per_page"] == 2
    rest = service.get(
        base(SIMPLE) + f"?status=complete&limit=2&cursor={page['result_info']['cursor']}"
    ).json()
    assert [i["id"] for i in rest["result"]] == ["s0"] and rest["result_info"]["cursor"] is None


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("limit=ten", "limit must be an integer"),
        ("limit=0", "limit must be an integer from 1 to 1000, got 0"),
        ("status=sleepy", "unknown status 'sleepy'"),
        ("cursor=%3F%3F", "invalid cursor"),
        # Cursors int() took: a space, an underscore, a sign, past a bigint, zero.
        ("cursor=aWQ6IDU", "invalid cursor"),
        ("cursor=aWQ6MV8w", "invalid cursor"),
        ("cursor=aWQ6LTU", "invalid cursor"),
        ("cursor=aWQ6OTk5OTk5OTk5OTk5OTk5OTk5OTk5OTk", "invalid cursor"),
        ("cursor=aWQ6MA", "invalid cursor"),
        ("sort=asc", "unknown query parameter(s) ['sort']"),
    ],
)
def test_list_refuses_bad_query_parameters(service, query, message):
    status, _, text = error_of(service.get(base(SIMPLE) + "?" + query))
    assert status == 400 and message in text


def test_get_shows_status_params_output_and_steps(service):
    service.post(base(SIMPLE), {"id": "s", "params": {"x": 1}})
    testing.run_until_idle()
    result = service.get(base(SIMPLE, "s")).json()["result"]
    assert (result["status"], result["params"], result["output"], result["error"]) == (
        "complete",
        {"x": 1},
        {"sum": 3},
        None,
    )
    assert [(s["name"], s["output"]) for s in result["steps"]] == [("one", 1), ("two", 2)]


def test_get_shows_the_event_an_instance_waits_for(service):
    waiting_approval("o-1")
    result = service.get(base(APPROVAL, "o-1")).json()["result"]
    assert result["status"] == "waiting"
    assert [(p["name"], p["type"]) for p in result["pending_events"]] == [("approval", "approval")]


def test_an_unknown_instance_or_one_of_another_workflow_is_404(service):
    service.post(base(OTHER), {"id": "elsewhere"})
    assert error_of(service.get(base(SIMPLE, "elsewhere")))[:2] == (404, "InstanceNotFound")
    assert error_of(service.get(base("nope", "x")))[:2] == (404, "UnknownWorkflow")
    assert error_of(service.get(base(SIMPLE, "ghost") + "/history"))[0] == 404


def test_history_lists_the_records_in_order(service):
    service.post(base(SIMPLE), {"id": "h"})
    testing.run_until_idle()
    records = service.get(base(SIMPLE, "h") + "/history").json()["result"]
    assert [r["sequence"] for r in records] == list(range(1, len(records) + 1))
    assert (records[0]["type"], records[0]["actor"]) == ("instance.created", "service")
    assert records[-1]["type"] == "instance.completed"


def test_history_comes_in_pages_of_at_most_limit_records(service, monkeypatch):
    # A year-long instance has 100,000s of records: one response held them all (17 MB, 7 s).
    monkeypatch.setattr(api, "HISTORY_PAGE", 4, raising=False)
    service.post(base(SIMPLE), {"id": "h"})
    testing.run_until_idle()
    url = base(SIMPLE, "h") + "/history"
    everything = [r["sequence"] for r in instance_records("h")]
    pages, cursor = [], None
    while True:
        body = service.get(url + (f"?cursor={cursor}" if cursor else "")).json()
        pages.append([r["sequence"] for r in body["result"]])
        assert body["result_info"]["per_page"] == 4
        cursor = body["result_info"]["cursor"]
        if cursor is None:
            break
    assert len(everything) > 4 and all(len(p) <= 4 for p in pages)
    assert [s for p in pages for s in p] == everything
    two = service.get(url + "?limit=2&cursor=1").json()
    assert [r["sequence"] for r in two["result"]] == [2, 3] and two["result_info"]["cursor"] == "3"
    for query, wrong in (
        ("?limit=0", "limit"),
        ("?limit=5", "limit"),  # over the page size
        ("?cursor=x", "cursor"),
        ("?cursor=-1", "cursor"),
        ("?after=2", "unknown query parameter(s) ['after']"),
        ("?limit=1&limit=2", "limit given more than once"),
    ):
        status, code, message = error_of(service.get(url + query))
        assert (status, code) == (400, "InvalidInput") and wrong in message, (query, message)


def instance_records(instance_id: str) -> list[dict[str, Any]]:
    return [{"sequence": h.sequence} for h in get_workflow(SIMPLE).get(instance_id).history()]


# --- actions ----------------------------------------------------------------------------


def test_status_pauses_resumes_restarts_and_terminates(service):
    waiting_approval("o-1")
    path = base(APPROVAL, "o-1") + "/status"
    assert service.patch(path, {"status": "pause"}).json()["result"] == {
        "id": "o-1",
        "workflow": APPROVAL,
        "status": "paused",
    }
    assert service.patch(path, {"status": "resume"}).json()["result"]["status"] == "running"
    testing.run_until_idle()
    assert (
        service.patch(path, {"status": "restart", "from_step": "approval"}).json()["result"][
            "status"
        ]
        == "running"
    )
    assert [s.name for s in get_workflow(APPROVAL).get("o-1").steps()] == ["charge"]
    assert service.patch(path, {"status": "terminate"}).json()["result"]["status"] == "terminated"


def test_status_refuses_actions_that_do_not_apply_with_409(service):
    waiting_approval("o-1")
    path = base(APPROVAL, "o-1") + "/status"
    status, code, message = refused(lambda: service.patch(path, {"status": "resume"}))
    assert (status, code) == (409, "InvalidTransition") and "not paused" in message
    service.patch(path, {"status": "terminate"})
    assert refused(lambda: service.patch(path, {"status": "terminate"}))[:2] == (
        409,
        "InvalidTransition",
    )
    assert refused(lambda: service.patch(path, {"status": "pause"}))[0] == 409


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"status": "explode"},
            "status must be one of pause, resume, terminate, restart; got 'explode'",
        ),
        ({}, "got None"),
        ({"status": "pause", "from_step": "charge"}, "only with restart"),
        ({"status": "restart", "from_step": 3}, "from_step must be a step name"),
        ({"status": "restart", "from_step": "nope"}, "has no step named 'nope'"),
    ],
)
def test_status_refuses_bad_bodies_with_400(service, body, message):
    waiting_approval("o-1")
    status, _, text = refused(lambda: service.patch(base(APPROVAL, "o-1") + "/status", body))
    assert status == 400 and message in text


def test_an_event_delivers_the_body_as_its_payload(service):
    waiting_approval("o-1")
    response = service.post(base(APPROVAL, "o-1") + "/events/approval", {"ok": True})
    assert response.json()["result"] == {"id": "o-1", "workflow": APPROVAL, "type": "approval"}
    testing.run_until_idle()
    steps = {s["name"]: s for s in service.get(base(APPROVAL, "o-1")).json()["result"]["steps"]}
    assert steps["approval"]["output"]["payload"] == {"ok": True}


def test_an_event_is_refused_for_a_bad_type_payload_or_instance_and_nothing_is_stored(service):
    waiting_approval("o-1")
    path = base(APPROVAL, "o-1") + "/events/"
    status, code, _ = refused(lambda: service.post(path + "-dash-first", {"ok": True}))
    assert (status, code) == (400, "InvalidEventType")
    status, code, message = refused(lambda: service.post(path + "approval", {"ok": "yes"}))
    assert (status, code) == (
        400,
        "EventPayloadInvalid",
    ) and "'yes' is not of type 'boolean'" in message
    assert (
        refused(lambda: service.post(base(APPROVAL, "o-2") + "/events/approval", {"ok": True}))[0]
        == 404
    )
    service.patch(base(APPROVAL, "o-1") + "/status", {"status": "terminate"})
    assert refused(lambda: service.post(path + "approval", {"ok": True}))[:2] == (
        409,
        "InvalidTransition",
    )


def test_an_event_past_max_buffered_events_is_refused_with_400_naming_the_limit(service, settings):
    settings.WFDASH = {**settings.WFDASH, "LIMITS": {"max_buffered_events": 2}}
    waiting_approval("o-1")
    path = base(APPROVAL, "o-1") + "/events/"
    for n in range(2):  # a type it does not wait for: kept for a later wait
        assert service.post(path + "note", {"n": n}).status_code == 200
    status, code, message = refused(lambda: service.post(path + "note", {"n": 2}))
    assert (status, code) == (400, "LimitExceeded")
    assert message.endswith("max_buffered_events is 2, got 3")


def test_cancel_compensates_by_default_and_not_when_told(service):
    waiting_approval("o-1", amount=4)
    assert (
        service.post(base(APPROVAL, "o-1") + "/cancel").json()["result"]["status"] == "compensating"
    )
    testing.run_until_idle()
    assert COMPENSATIONS == [{"amount": 4}]
    waiting_approval("o-2")
    assert service.post(base(APPROVAL, "o-2") + "/cancel", {"compensate": False}).json()["result"][
        "status"
    ] == ("terminated")
    assert COMPENSATIONS == [{"amount": 4}]
    assert refused(lambda: service.post(base(APPROVAL, "o-2") + "/cancel"))[:2] == (
        409,
        "InvalidTransition",
    )


def test_skip_sleep_ends_the_current_sleep_and_is_refused_when_nothing_sleeps(service):
    handle = waiting_approval("o-1", amount=3)
    path = base(APPROVAL, "o-1") + "/skip-sleep"
    assert refused(lambda: service.post(path))[:2] == (
        409,
        "InvalidTransition",
    )  # waits for an event
    service.post(base(APPROVAL, "o-1") + "/events/approval", {"ok": True})
    testing.run_until_idle()
    assert handle.status().status == "waiting"  # now in its 1-hour cool-off
    assert refused(lambda: service.post(path, {"now": True}))[:2] == (400, "InvalidInput")
    result = service.post(path).json()["result"]
    assert result == {"id": "o-1", "workflow": APPROVAL, "status": "waiting", "skipped": 1}
    testing.run_until_idle()
    assert handle.status().status == "complete" and handle.status().output == {
        "charged": 3,
        "ok": True,
    }
    skipped = HistoryRecord.objects.get(instance__instance_id="o-1", type="sleep.skipped")
    assert skipped.actor == "service"
    assert refused(lambda: service.post(base(APPROVAL, "nobody") + "/skip-sleep"))[0] == 404


def test_cancel_refuses_a_non_boolean_compensate(service):
    waiting_approval("o-1")
    status, _, message = refused(
        lambda: service.post(base(APPROVAL, "o-1") + "/cancel", {"compensate": "no"})
    )
    assert status == 400 and message == "compensate must be true or false, got a string"


# --- protocol ---------------------------------------------------------------------------


def test_an_oversized_body_is_refused_with_413_and_changes_nothing(service, settings):
    settings.WFDASH = {**settings.WFDASH, "API_MAX_BODY_BYTES": 64}
    waiting_approval("o-1")
    big = {"ok": True, "padding": "x" * 100}
    status, code, message = refused(
        lambda: service.post(base(APPROVAL, "o-1") + "/events/approval", big)
    )
    assert (status, code) == (413, "PayloadTooLarge") and "64 bytes" in message
    assert refused(lambda: service.post(base(), {"params": "x" * 100}))[0] == 413


def test_a_body_larger_than_the_limit_is_refused_even_without_content_length(service, settings):
    """A chunked upload has no Content-Length: the body actually read is what counts."""
    settings.WFDASH = {**settings.WFDASH, "API_MAX_BODY_BYTES": 64}
    body = json.dumps({"params": "x" * 100}).encode()
    scope = {
        "type": "http",
        "method": "POST",
        "path": base(),
        "query_string": b"",
        "headers": [(b"authorization", f"Bearer {service.secret}".encode())],
    }
    response = api.instances(ASGIRequest(scope, io.BytesIO(body)), name=APPROVAL)
    assert error_of(response)[:2] == (413, "PayloadTooLarge")
    assert not Instance.objects.exists()


def test_a_wrong_method_is_405_with_the_allowed_methods(service):
    response = service.call("DELETE", base(SIMPLE))
    assert error_of(response)[:2] == (405, "MethodNotAllowed")
    assert response["Allow"] == "GET, POST, HEAD"
    assert service.call("GET", base(SIMPLE) + "/batch")["Allow"] == "POST"
    assert Client().post("/api/openapi.json").status_code == 405


def test_a_wrong_method_without_a_token_is_401_first(service):
    assert service.call("DELETE", base(SIMPLE), secret=None).status_code == 401


def test_posts_need_no_csrf_token(service):
    assert service.client.handler.enforce_csrf_checks
    assert service.post(base(), {"id": "no-csrf"}).status_code == 201


# --- what a token may do: permissions, scopes, workflows, expiry, rotation -----------------


def test_a_token_whose_user_lacks_the_view_permission_reads_nothing():
    waiting_approval("o-1")
    blind = user_api("blind", can_change=False, can_view=False)
    for path in (
        "/api/workflows",
        base(APPROVAL),
        base(APPROVAL, "o-1"),
        base(APPROVAL, "o-1") + "/history",
    ):
        status, code, message = error_of(blind.get(path))
        assert (status, code) == (403, "Forbidden"), path
        assert "lacks the workflows_app.view_instance permission" in message


def test_a_read_scoped_token_reads_but_may_not_write_even_for_a_user_who_may():
    waiting_approval("o-1")
    reader = user_api("ops", can_change=True, scope="read")
    assert reader.get(base(APPROVAL, "o-1")).status_code == 200
    status, _, message = refused(
        lambda: reader.patch(base(APPROVAL, "o-1") + "/status", {"status": "pause"})
    )
    assert status == 403 and "read scope" in message
    assert refused(lambda: reader.post(base(), {"id": "new"}))[0] == 403


def test_a_token_limited_to_some_workflows_sees_and_acts_on_only_those():
    waiting_approval("o-1")
    get_workflow(SIMPLE).create(id="s-1")
    _, secret = tokens.issue("narrow", workflows=[APPROVAL])
    narrow = Api(Client(), secret)
    assert [w["name"] for w in narrow.get("/api/workflows").json()["result"]] == [APPROVAL]
    assert narrow.get(base(APPROVAL, "o-1")).status_code == 200
    status, _, message = error_of(narrow.get(base(SIMPLE, "s-1")))
    assert status == 403 and APPROVAL in message
    assert refused(lambda: narrow.post(base(SIMPLE), {"id": "s-2"}))[0] == 403


def test_an_expired_token_is_refused():
    token, secret = tokens.issue("brief", expires="1 hour")
    expiring = Api(Client(), secret)
    assert expiring.get(base()).status_code == 200
    ApiToken.objects.filter(pk=token.pk).update(expires_at=token.created_at - timedelta(seconds=1))
    status, _, message = error_of(expiring.get(base()))
    assert status == 401 and "expired" in message


def test_a_rotated_token_works_with_its_new_secret_only():
    token, old = tokens.issue("rotating", scope="read")
    new = tokens.rotate(token)
    assert error_of(Api(Client(), old).get(base()))[0] == 401
    assert Api(Client(), new).get(base()).status_code == 200
    token.refresh_from_db()
    assert token.scope == "read" and token.rotated_at is not None


# --- API edges: caching, HEAD, unknown paths, the workflow list ---------------------------


def test_every_api_response_is_marked_no_store(service):
    waiting_approval("o-1")
    for response in (
        service.get(base(APPROVAL, "o-1")),
        service.get(base(APPROVAL, "nope")),
        service.get(base(), secret=None),
        service.post(base(), {"id": "o-2"}),
        Client().get("/api/no-such-route"),
    ):
        assert "no-store" in response["Cache-Control"], response.status_code


def test_head_answers_like_get_without_a_body(service):
    waiting_approval("o-1")
    headers = {"Authorization": f"Bearer {service.secret}"}
    for path in (base(APPROVAL, "o-1"), base(APPROVAL), "/api/workflows", "/api/openapi.json"):
        response = Client().head(path, headers=headers)
        assert response.status_code == 200, path
        assert response.content == b"" and response["Content-Type"] == "application/json"
    assert Client().head(base(APPROVAL, "nope"), headers=headers).status_code == 404


def test_an_unknown_api_path_is_a_json_404_naming_it():
    for path in ("/api/no-such-route", "/api/workflows/x/instances/y/z/w", "/api/"):
        response = Client().get(path)
        assert response.status_code == 404 and response["Content-Type"] == "application/json", path
        assert (
            response.json()["errors"][0]["code"] == "NotFound"
            and path in response.json()["errors"][0]["message"]
        )


def test_list_workflows_shows_each_workflow_with_its_versions_and_counts(service):
    waiting_approval("o-1")
    waiting_approval("o-2")
    get_workflow(SIMPLE).create(id="s-1")
    testing.run_until_idle()
    workflows = {w["name"]: w for w in service.get("/api/workflows").json()["result"]}
    assert set(workflows) >= {APPROVAL, SIMPLE, OTHER}
    assert workflows[APPROVAL] == {
        "name": APPROVAL,
        "versions": [1],
        "counts": {"waiting": 2},
        "total": 2,
    }
    assert workflows[SIMPLE]["counts"] == {"complete": 1}
    assert error_of(service.get("/api/workflows?status=x"))[:2] == (400, "InvalidInput")


@pytest.mark.parametrize("limit", ["²", "1" * 5000, "-1", "1.5", "１０"])
def test_list_refuses_a_limit_that_is_not_plain_ascii_digits_with_400(service, limit):
    status, code, message = error_of(service.get(base(SIMPLE) + "?" + urlencode({"limit": limit})))
    assert (status, code) == (400, "InvalidInput") and "limit must be an integer" in message


# --- search attributes, delete, retention (SPEC §9) ---------------------------------------


def test_create_with_attributes_and_list_by_them(service):
    service.post(base(SIMPLE), {"id": "a", "attributes": {"customer": "c-9", "seats": 5}})
    service.post(base(SIMPLE), {"id": "b", "attributes": {"customer": "c-9", "seats": "5"}})
    service.post(base(SIMPLE), {"id": "c", "attributes": {"customer": "c-1"}})
    found = service.get(base(SIMPLE) + "?attr.customer=c-9").json()["result"]
    assert [i["id"] for i in found] == ["b", "a"]
    assert found[1]["attributes"] == {"customer": "c-9", "seats": 5}
    typed = service.get(base(SIMPLE) + "?attr.customer=c-9&attr.seats=5").json()["result"]
    assert [i["id"] for i in typed] == ["a"]
    quoted = service.get(base(SIMPLE) + "?attr.seats=%225%22").json()["result"]
    assert [i["id"] for i in quoted] == ["b"]
    assert service.get(base(SIMPLE, "a")).json()["result"]["attributes"]["seats"] == 5


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("attr.a%20b=x", "invalid attribute key 'a b'"),
        ("attr.=x", "invalid attribute key ''"),
        ("attr.k=1&attr.k=2", "attr.k is given 2 times"),
        ("version=x", "version must be an integer from 1 to 2147483647"),
        ("attributes=x", "unknown query parameter(s) ['attributes']"),
    ],
)
def test_list_refuses_bad_attribute_filters_with_400(service, query, message):
    status, _, text = error_of(service.get(base(SIMPLE) + "?" + query))
    assert status == 400 and message in text


def test_create_refuses_bad_attributes_and_retention_and_stores_nothing(service):
    for body, message in (
        ({"attributes": {"plan": [1]}}, "attribute 'plan'"),
        ({"attributes": "plan"}, "must be an object"),
        ({"retention": {"sucess": "1 day"}}, "unknown outcome"),
    ):
        status, _, text = refused(lambda body=body: service.post(base(SIMPLE), body))
        assert status == 400 and message in text


def test_delete_removes_a_finished_instance_and_refuses_a_live_one_with_409(service):
    waiting_approval("live")
    service.post(base(SIMPLE), {"id": "done", "retention": {"success": "1 day"}})
    testing.run_until_idle()
    status, code, message = refused(lambda: service.delete(base(APPROVAL, "live")))
    assert (status, code) == (409, "InvalidTransition") and "terminate it first" in message
    response = service.delete(base(SIMPLE, "done"))
    assert response.json()["result"] == {"id": "done", "workflow": SIMPLE, "deleted": True}
    assert error_of(service.get(base(SIMPLE, "done")))[0] == 404
    assert error_of(service.delete(base(SIMPLE, "done")))[0] == 404


def test_delete_needs_the_delete_permission_and_the_write_scope(service):
    service.post(base(SIMPLE), {"id": "done"})
    testing.run_until_idle()
    changer = user_api("changer", can_change=True)
    status, _, message = refused(lambda: changer.delete(base(SIMPLE, "done")))
    assert status == 403 and "workflows_app.delete_instance" in message
    reader = user_api("deleter-read", can_change=True, can_delete=True, scope="read")
    assert refused(lambda: reader.delete(base(SIMPLE, "done")))[0] == 403
    deleter = user_api("deleter", can_change=True, can_delete=True)
    assert deleter.delete(base(SIMPLE, "done")).status_code == 200


def test_a_bulk_job_starts_with_202_and_its_progress_is_read_back(service):
    for n in range(3):
        waiting_approval(f"o-{n}")
    get_workflow(APPROVAL).create(id="other", attributes={"team": "b"})
    response = service.post(
        f"/api/workflows/{APPROVAL}/bulk",
        {"action": "terminate", "status": "waiting", "created_after": "2000-01-01T00:00:00Z"},
    )
    assert response.status_code == 202
    job = response.json()["result"]
    assert (job["matched"], job["applied"], job["done"]) == (3, 0, False)
    assert job["filter"]["status"] == "waiting"
    testing.run_until_idle()
    read = service.get(f"/api/workflows/{APPROVAL}/bulk/{job['id']}").json()["result"]
    assert (read["done"], read["applied"], read["skipped"], read["failed"]) == (True, 3, 0, 0)
    assert get_workflow(APPROVAL).get("o-0").status().status == "terminated"
    assert error_of(service.get(f"/api/workflows/{SIMPLE}/bulk/{job['id']}"))[:2] == (
        404,
        "BulkJobNotFound",
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "action must be one of"),
        ({"action": "explode"}, "unknown bulk action"),
        ({"action": "pause", "status": "sleepy"}, "unknown status"),
        ({"action": "pause", "created_before": "yesterday"}, "created_before must be an ISO"),
        ({"action": "pause", "created_before": "2026-01-01T00:00:00"}, "with an offset"),
        ({"action": "pause", "attributes": {"a": None}}, "attribute 'a'"),
        ({"action": "pause", "compensate": "no"}, "compensate must be true or false"),
        ({"action": "send_event"}, "needs event_type"),
        ({"action": "pause", "limit": 5}, "unknown field(s) ['limit']"),
    ],
)
def test_a_bad_bulk_request_is_refused_with_400_and_starts_nothing(service, body, message):
    from workflows_app.models import BulkJob

    status, _, text = error_of(service.post(f"/api/workflows/{APPROVAL}/bulk", body))
    assert status == 400 and message in text
    assert not BulkJob.objects.exists()


def test_bulk_needs_the_write_scope_and_delete_needs_the_delete_permission(service):
    from workflows_app.models import BulkJob

    reader = user_api("bulk-reader", can_change=False)
    assert error_of(reader.post(f"/api/workflows/{APPROVAL}/bulk", {"action": "pause"}))[0] == 403
    changer = user_api("bulk-changer", can_change=True)
    status, _, message = error_of(
        changer.post(f"/api/workflows/{APPROVAL}/bulk", {"action": "delete"})
    )
    assert status == 403 and "workflows_app.delete_instance" in message
    assert not BulkJob.objects.exists()
    assert changer.post(f"/api/workflows/{APPROVAL}/bulk", {"action": "pause"}).status_code == 202
