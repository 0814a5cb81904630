"""Odd input to the JSON API, as a fuzzer (schemathesis) sent it: each is refused with a
400 that names what was wrong and changes nothing, and the OpenAPI document describes
the same rule the server applies."""

from __future__ import annotations

import pytest
from django.test import Client

from tests.surface_flows import APPROVAL, register_flows, waiting_approval
from tests.test_api import Api, base, refused
from workflows_app import tokens
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
