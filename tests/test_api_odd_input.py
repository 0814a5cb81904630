"""Odd input to the JSON API, as a fuzzer (schemathesis) sent it: each is refused with a
400 that names what was wrong and changes nothing, and the OpenAPI document describes
the same rule the server applies."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

import jsonschema
import pytest
from django.db import connection
from django.test import Client
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from tests.surface_flows import APPROVAL, register_flows, waiting_approval
from tests.test_api import Api, base, error_of, refused
from workflows_app import openapi, tokens
from workflows_app.client import schedules
from workflows_app.models import BulkJob, Schedule

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def flows(registered: list[str]) -> None:
    register_flows()


@pytest.fixture
def service() -> Api:
    """A write token of no user: every answer is checked against the document (Api)."""
    _, secret = tokens.issue("service")
    return Api(Client(), secret)


SCHEDULE = f"/api/workflows/{APPROVAL}/schedules"
BULK = f"/api/workflows/{APPROVAL}/bulk"

# Every operation that takes an object of options, or none (an empty body or {}).
OBJECT_BODIES = [
    ("POST", base()),
    ("POST", f"/api/workflows/{APPROVAL}/bulk"),
    ("PATCH", base(instance_id="odd-1") + "/status"),
    ("POST", base(instance_id="odd-1") + "/cancel"),
    ("POST", base(instance_id="odd-1") + "/skip-sleep"),
    ("DELETE", base(instance_id="odd-1")),
    ("POST", SCHEDULE),
    ("PATCH", f"{SCHEDULE}/odd-s"),
    ("DELETE", f"{SCHEDULE}/odd-s"),
    ("POST", f"{SCHEDULE}/odd-s/trigger"),
]


@pytest.mark.parametrize(("method", "path"), OBJECT_BODIES)
def test_a_json_null_body_is_refused_not_taken_for_an_empty_one(service, method, path):
    """`null` created an instance (and cancelled one, triggered a schedule) with the
    defaults, as an empty body does, where `[]`, `1` or `"x"` are refused."""
    waiting_approval("odd-1")
    schedules.create("odd-s", workflow=APPROVAL, cron="0 3 * * *", actor="test")
    counts = Schedule.objects.count(), BulkJob.objects.count()
    status, code, message = refused(lambda: service.call(method, path, raw=b"null"))
    assert (status, code) == (400, "InvalidInput")
    assert message == "request body must be a JSON object, got null"
    assert (Schedule.objects.count(), BulkJob.objects.count()) == counts


# --- the document says what the server refuses ---------------------------------------------

DOC = openapi.document()
DOC_URI = "https://wfdash.invalid/api/openapi.json"
REGISTRY = Registry().with_resource(DOC_URI, DRAFT202012.create_resource(DOC))
OPERATIONS = {
    operation["operationId"]: (path, method, operation)
    for path, item in DOC["paths"].items()
    for method, operation in item.items()
    if isinstance(operation, dict) and "operationId" in operation
}
NO_BODY = object()


def documented_body_errors(operation_id: str, body: Any) -> list[str]:
    """Why the document refuses this request body (none: it says the server takes it)."""
    path, method, operation = OPERATIONS[operation_id]
    described = operation["requestBody"]
    if body is NO_BODY:
        return [] if not described.get("required") else ["the body is required"]
    escaped = path.replace("~", "~0").replace("/", "~1")
    place = f"paths/{escaped}/{method}/requestBody/content/application~1json/schema"
    validator = jsonschema.Draft202012Validator({"$ref": f"{DOC_URI}#/{place}"}, registry=REGISTRY)
    return [error.message for error in validator.iter_errors(body)]


def documented_query_errors(operation_id: str, name: str, value: Any) -> list[str]:
    operation = OPERATIONS[operation_id][2]
    [parameter] = [p for p in operation.get("parameters", []) if p["name"] == name]
    validator = jsonschema.Draft202012Validator(parameter["schema"])
    return [error.message for error in validator.iter_errors(value)]


INSTANCE = base(instance_id="odd-1")
# (operation, method, path, body, what the server's 400 names): each was a request the
# document took and the server refused (schemathesis ST202, "schema-valid request rejected").
REFUSED_BODIES = [
    ("createInstance", "POST", base(), {"id": ""}, "non-empty string"),
    ("createInstance", "POST", base(), {"instance_id": "has space"}, "invalid instance id"),
    ("createInstance", "POST", base(), {"attributes": {"": 1}}, "invalid attribute key ''"),
    ("createInstance", "POST", base(), {"idempotency_key": ""}, "idempotency_key must"),
    ("createInstance", "POST", base(), {"attributes": {"a": "x\x00y"}}, "a NUL character"),
    ("createInstance", "POST", base(), {"debounce": 1000}, "go together"),
    ("createInstance", "POST", base(), {"debounce_key": "k"}, "go together"),
    ("createInstance", "POST", base(), {"concurrency_key": ""}, "concurrency_key must"),
    ("createBatch", "POST", f"{base()}/batch", [{"id": ""}], "non-empty string"),
    ("createBatch", "POST", f"{base()}/batch", NO_BODY, "JSON array of instances, got null"),
    ("startBulkJob", "POST", BULK, {"action": "pause", "version": 0}, "version must be"),
    ("startBulkJob", "POST", BULK, {"action": "restart", "to_version": 0}, "to_version must"),
    ("startBulkJob", "POST", BULK, {"action": "restart", "from_step": ""}, "from_step must be"),
    ("startBulkJob", "POST", BULK, {"action": "send_event", "event_type": ""}, "event type ''"),
    ("startBulkJob", "POST", BULK, NO_BODY, "action must be one of"),
    ("startBulkJob", "POST", BULK, {"action": "pause", "compensate": False}, "takes no compensate"),
    ("startBulkJob", "POST", BULK, {"action": "resume", "event_type": "x"}, "takes no event_type"),
    ("startBulkJob", "POST", BULK, {"action": "cancel", "from_step": "x"}, "takes no from_step"),
    ("startBulkJob", "POST", BULK, {"action": "send_event"}, "needs event_type"),
    (
        "changeStatus",
        "PATCH",
        f"{INSTANCE}/status",
        {"status": "pause", "from_step": "x"},
        "from_step",
    ),
    (
        "changeStatus",
        "PATCH",
        f"{INSTANCE}/status",
        {"status": "pause", "version": 1},
        "version is",
    ),
    ("changeStatus", "PATCH", f"{INSTANCE}/status", {"status": "restart", "version": 0}, "version"),
    ("changeStatus", "PATCH", f"{INSTANCE}/status", NO_BODY, "status must be one of"),
    (
        "changeStatus",
        "PATCH",
        f"{INSTANCE}/status",
        {"status": "restart", "from_step": ""},
        "no step named ''",
    ),
    ("createSchedule", "POST", SCHEDULE, {"name": "s-2", "cron": ""}, "cron must be"),
    ("createSchedule", "POST", SCHEDULE, NO_BODY, "missing field(s) ['cron', 'name']"),
    ("changeSchedule", "PATCH", f"{SCHEDULE}/odd-s", NO_BODY, "paused must be true or false"),
]


@pytest.mark.parametrize(("operation_id", "method", "path", "body", "named"), REFUSED_BODIES)
def test_a_body_the_server_refuses_the_document_refuses_too(
    service, operation_id, method, path, body, named
):
    waiting_approval("odd-1")
    schedules.create("odd-s", workflow=APPROVAL, cron="0 3 * * *", actor="test")
    status, _, message = refused(
        lambda: service.call(method, path, **({} if body is NO_BODY else {"body": body}))
    )
    assert status == 400 and named in message
    assert documented_body_errors(operation_id, body), (
        f"the document takes {body!r} for {operation_id}; the server said {message!r}"
    )


PAST_A_BIGINT = 2**63
REFUSED_QUERIES = [
    ("listInstances", base(), "version", 0),
    ("getHistory", f"{INSTANCE}/history", "cursor", PAST_A_BIGINT),
    ("getSteps", f"{INSTANCE}/steps", "cursor", PAST_A_BIGINT),
    ("getChildren", f"{INSTANCE}/children", "cursor", PAST_A_BIGINT),
    ("subscribeHistory", f"{INSTANCE}/subscribe", "cursor", PAST_A_BIGINT),
]


@pytest.mark.parametrize(("operation_id", "path", "name", "value"), REFUSED_QUERIES)
def test_a_query_value_the_server_refuses_the_document_refuses_too(
    service, operation_id, path, name, value
):
    waiting_approval("odd-1")
    status, _, message = error_of(service.get(f"{path}?{name}={value}"))
    assert status == 400 and name in message
    assert documented_query_errors(operation_id, name, value)


def test_every_query_parameter_the_document_lists_is_one_the_server_takes(service):
    """The list's `attr.<key>` was documented as a parameter of that very name, and a
    client following the document sent `attr.<key>=…`: 400, invalid attribute key."""
    operation = OPERATIONS["listInstances"][2]
    valid = {"status": "running", "limit": "1", "version": "1", "cursor": None}
    for parameter in operation["parameters"]:
        value = valid.get(parameter["name"], "x")
        if value is None:
            continue  # an opaque cursor: only one the server gave is valid
        response = service.get(f"{base()}?{urlencode({parameter['name']: value})}")
        assert response.status_code == 200, (parameter["name"], response.json())


@pytest.mark.parametrize("paused", [True, False])
def test_pausing_a_schedule_deleted_meanwhile_is_404_not_500(service, monkeypatch, paused):
    """Fuzzing with two workers, a PATCH …/schedules/{name} read the schedule, a DELETE of
    it committed, and the PATCH's save(update_fields=...) found no row: DatabaseError, a
    500. set_paused now reads the row under its lock and finds it gone; the delete is made
    here right after the API's own look-up, before set_paused."""
    from workflows_app.engine.store import schedules as store

    made = schedules.create("odd-s", workflow=APPROVAL, cron="0 3 * * *", actor="test")
    if not paused:
        made.pause()
    read = store.get_schedule

    def read_then_deleted(name: str) -> Schedule:
        row = read(name)
        if not connection.in_atomic_block:  # the API's look-up, not a read in set_paused
            Schedule.objects.filter(pk=row.pk).delete()
        return row

    monkeypatch.setattr(store, "get_schedule", read_then_deleted)
    status, code, message = error_of(service.patch(f"{SCHEDULE}/odd-s", {"paused": paused}))
    assert (status, code) == (404, "ScheduleNotFound") and "'odd-s'" in message


def test_null_for_a_restart_option_means_not_given_on_both_sides(service):
    """The server takes {"from_step": null} as no from_step; the document said a string."""
    waiting_approval("odd-1")
    body = {"status": "restart", "from_step": None, "version": None}
    response = service.patch(f"{INSTANCE}/status", body)
    assert response.status_code == 200, response.json()
    assert not documented_body_errors("changeStatus", body)
    assert not documented_body_errors("changeStatus", {"status": "pause", "from_step": None})


def test_null_attributes_mean_none_on_both_sides(service):
    body = {"id": "odd-2", "attributes": None}
    assert service.post(base(), body).status_code == 201
    assert not documented_body_errors("createInstance", body)


def test_a_version_filter_of_seven_digits_is_a_version_not_a_refusal(service):
    """?version=1000000 (the document allows up to 2**31-1) was refused as 'version must
    be a positive integer': the check allowed 6 digits, as for ?limit=."""
    response = service.get(f"{base()}?version=1000000")
    assert response.status_code == 200 and response.json()["result"] == []
    status, _, message = error_of(service.get(f"{base()}?version=2147483648"))
    assert status == 400 and "version must be an integer from 1 to 2147483647" in message
