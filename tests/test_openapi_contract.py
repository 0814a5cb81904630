"""The served OpenAPI document against the API's behaviour, operation by operation.

Walks /api/openapi.json: every operation it lists is called on the live views, made to
give each response status it documents that a client can provoke, and every answer is
validated against the documented schema (JSON Schema 2020-12, the dialect of OpenAPI 3.1,
formats checked). A status the document promises but the walk never saw, or one the walk
saw but the document does not list, fails: the document cannot drift from the code.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote

import jsonschema
import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth.models import User
from django.core.cache import cache
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from openapi_spec_validator import validate as validate_openapi
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from tests.surface_flows import APPROVAL, OTHER, SIMPLE, register_flows, waiting_approval
from workflows_app import openapi, testing, tokens
from workflows_app.client import get_workflow, schedules
from workflows_app.engine import WorkflowEntrypoint, register

pytestmark = pytest.mark.django_db(transaction=True)

DOC = openapi.document()
DOC_URI = "https://wfdash.invalid/api/openapi.json"
REGISTRY = Registry().with_resource(DOC_URI, DRAFT202012.create_resource(DOC))
HTTP_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
UNSET = object()

OPERATIONS: dict[str, tuple[str, str, dict[str, Any]]] = {
    operation["operationId"]: (path, method, operation)
    for path, item in DOC["paths"].items()
    for method, operation in item.items()
    if method in HTTP_METHODS
}

# Documented statuses no request can provoke, and why (the walk checks all the others).
UNPROVOKABLE: dict[tuple[str, str], str] = {
    ("triggerSchedule", "409"): "a new random UUID colliding with an existing instance id",
}


def pointer(*parts: str) -> str:
    """A JSON pointer into the document, as a URI fragment."""
    return "/" + "/".join(quote(p.replace("~", "~0").replace("/", "~1"), safe="") for p in parts)


def validator(*parts: str) -> jsonschema.Draft202012Validator:
    """The schema at that place in the document, its $refs resolved within the document."""
    return jsonschema.Draft202012Validator(
        {"$ref": DOC_URI + "#" + pointer(*parts)},
        registry=REGISTRY,
        format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER,
    )


def documented_response(operation_id: str, status: str) -> tuple[dict[str, Any], list[str]]:
    """The response object documented for the status, and where it is in the document."""
    path, method, operation = OPERATIONS[operation_id]
    assert status in operation["responses"], f"{operation_id} does not document {status}"
    described = operation["responses"][status]
    place = ["paths", path, method, "responses", status]
    if "$ref" in described:
        name = described["$ref"].rsplit("/", 1)[1]
        described, place = DOC["components"]["responses"][name], ["components", "responses", name]
    return described, place


def check_error_shape(response: Any) -> None:
    """Any refusal on an /api/ path: the one documented Failure body, as JSON, not stored."""
    assert response["Content-Type"] == "application/json", response.content[:200]
    validator("components", "schemas", "Failure").validate(json.loads(response.content))
    assert "no-store" in response.get("Cache-Control", ""), response.status_code


class Walker:
    """Calls operations by operationId, checks each answer against the document and
    records which documented statuses were seen."""

    def __init__(self) -> None:
        _, self.secret = tokens.issue("walker")
        self.client = Client(enforce_csrf_checks=True)
        self.seen: dict[str, set[str]] = defaultdict(set)

    def url(self, operation_id: str, **values: Any) -> str:
        path = OPERATIONS[operation_id][0]
        names = re.findall(r"{(\w+)}", path)
        defaults = {
            "name": APPROVAL,
            "instance_id": "w-1",
            "schedule": "nightly",
            "job_id": 1,
            "event_type": "approval",
        }
        filled = {n: quote(str(values.get(n, defaults.get(n, ""))), safe="") for n in names}
        return path.format(**filled)

    def call(
        self,
        operation_id: str,
        expect: int,
        body: Any = UNSET,
        raw: bytes | None = None,
        query: str = "",
        secret: Any = UNSET,
        headers: dict[str, str] | None = None,
        **values: Any,
    ) -> Any:
        path, method, _ = OPERATIONS[operation_id]
        headers = dict(headers or {})
        secret = self.secret if secret is UNSET else secret
        if secret:
            headers["Authorization"] = f"Bearer {secret}"
        if body is not UNSET and expect < 300:  # what the code takes, the document allows
            validator(
                "paths", path, method, "requestBody", "content", "application/json", "schema"
            ).validate(body)
        data = raw if raw is not None else b"" if body is UNSET else json.dumps(body).encode()
        url = self.url(operation_id, **values) + (f"?{query}" if query else "")
        response = self.client.generic(
            method.upper(), url, data, content_type="application/json", headers=headers
        )
        assert response.status_code == expect, (
            operation_id,
            response.status_code,
            response.content[:300],
        )
        self.check(operation_id, response)
        return response

    def check(self, operation_id: str, response: Any) -> None:
        status = str(response.status_code)
        described, place = documented_response(operation_id, status)
        assert "no-store" in response.get("Cache-Control", ""), (operation_id, status)
        [content_type] = list(described["content"])
        assert response["Content-Type"].split(";")[0] == content_type, (operation_id, status)
        if content_type == "application/json":
            validator(*place, "content", content_type, "schema").validate(
                json.loads(response.content)
            )
        if status == "401":
            assert response["WWW-Authenticate"].startswith("Bearer")
        if status == "429":
            assert int(response["Retry-After"]) > 0
        self.seen[operation_id].add(status)

    def provoke_common(self, operation_id: str, settings: Any) -> None:
        """The refusals every operation can meet, whether documented or not: check()
        fails on a status its operation does not document."""
        path, method, operation = OPERATIONS[operation_id]
        # An unknown workflow: 404 where the path names one (listWorkflows lists them all).
        unknown, missing = ({"name": "no-such-workflow"}, 404) if "{name}" in path else ({}, 200)
        if operation.get("security") == []:
            return  # public, and no input: the document itself
        self.call(operation_id, 401, secret=None)
        User.objects.get_or_create(username="nobody")  # a user without any permission
        _, powerless = tokens.issue(f"powerless-{operation_id}", "nobody")
        self.call(operation_id, 403, secret=powerless)
        if unknown:
            self.call(operation_id, 404, body=VALID_BODIES.get(operation_id, UNSET), **unknown)
        self.call(operation_id, 400, query="no_such_parameter=1")
        if "requestBody" in operation:
            self.call(operation_id, 400, raw=b'{"unfinished": ')
        if method == "delete":  # takes no body: one is refused, not ignored
            self.call(operation_id, 400, body={"force": True})
        settings.WFDASH = {**settings.WFDASH, "API_MAX_BODY_BYTES": 64}
        if "requestBody" in operation or method == "delete":
            self.call(operation_id, 413, body={"params": "x" * 100})
        else:  # a GET reads no body, so none is too large: it goes on to the lookup
            self.call(operation_id, missing, raw=b" " * 100, **unknown)
        settings.WFDASH = {**settings.WFDASH, "API_FAILURE_LIMIT": 1}
        self.call(operation_id, 401, secret="wf_wrong")
        self.call(operation_id, 429)
        cache.clear()  # the lock-out, so the walk goes on


# Bodies that pass the checks of the body, so that the lookup of the workflow is reached.
VALID_BODIES: dict[str, Any] = {
    "changeSchedule": {"paused": True},
    "changeStatus": {"status": "pause"},
    "createBatch": [],
    "createSchedule": {"name": "n", "cron": "0 3 * * *"},
    "startBulkJob": {"action": "pause"},
}


# --- operation by operation: success and the refusals of each one ---------------------------


def walk_openapi(w: Walker) -> None:
    assert json.loads(w.call("openapi", 200, secret=None).content) == DOC


def walk_listWorkflows(w: Walker) -> None:
    names = [wf["name"] for wf in w.call("listWorkflows", 200).json()["result"]]
    assert {APPROVAL, SIMPLE, OTHER} <= set(names)


def walk_listInstances(w: Walker) -> None:
    simple = get_workflow(SIMPLE)
    simple.create(id="s-1", attributes={"plan": "pro"})
    simple.create(id="s-2", attributes={"plan": "free"})
    testing.run_until_idle()
    simple.create(id="s-3", attributes={"plan": "pro"})

    def ids(query: str) -> tuple[list[str], Any]:
        body = w.call("listInstances", 200, name=SIMPLE, query=query).json()
        return [i["id"] for i in body["result"]], body["result_info"]

    # Each documented query parameter is honoured, not merely accepted.
    assert ids("")[0] == ["s-3", "s-2", "s-1"]
    assert ids("status=complete")[0] == ["s-2", "s-1"]
    assert ids("attr.plan=pro")[0] == ["s-3", "s-1"]
    assert ids("version=1")[0] == ["s-3", "s-2", "s-1"] and ids("version=2")[0] == []
    first, info = ids("limit=2")
    assert first == ["s-3", "s-2"] and info["per_page"] == 2
    rest, info = ids(f"limit=2&cursor={info['cursor']}")
    assert rest == ["s-1"] and info["cursor"] is None
    w.call("listInstances", 400, query="limit=0")
    assert len(ids("limit=1000")[0]) == 3
    w.call("listInstances", 400, query="limit=1001")  # the documented maximum holds
    w.call("listInstances", 400, query="status=sleepy")


def walk_createInstance(w: Walker) -> None:
    made = w.call("createInstance", 201, body={"id": "c-1", "params": {"amount": 2}}).json()
    assert made["result"]["id"] == "c-1" and made["result"]["created"] is True
    w.call("createInstance", 201, body={"idempotency_key": "k", "priority": 3})
    again = w.call("createInstance", 200, body={"idempotency_key": "k"}).json()
    assert again["result"]["created"] is False
    every_field = {
        "instance_id": "c-2",
        "params": [1, "two", None],
        "idempotency_key": "k2",
        "retention": {"success": "7 days", "error": 60000},
        "priority": 0,
        "concurrency_key": "customer-9",
        "attributes": {"plan": "pro", "seats": 5, "trial": False},
    }
    assert w.call("createInstance", 201, body=every_field).json()["result"]["id"] == "c-2"
    w.call("createInstance", 201, body={"retention": "1 day"})
    debounced = {"debounce_key": "user-7", "debounce": "5 seconds", "params": 1}
    first = w.call("createInstance", 201, body=debounced).json()["result"]
    merged = w.call("createInstance", 200, body={**debounced, "params": 2}).json()["result"]
    assert merged["id"] == first["id"] and merged["created"] is False
    w.call("createInstance", 409, body={"id": "c-1"})
    w.call("createInstance", 400, body={"id": 5})


def walk_createBatch(w: Walker) -> None:
    made = w.call("createBatch", 201, body=[{"id": "b-1"}, {"idempotency_key": "bk"}]).json()
    assert [i["created"] for i in made["result"]] == [True, True]
    w.call("createBatch", 200, body=[{"idempotency_key": "bk"}])
    w.call("createBatch", 409, body=[{"id": "b-2"}, {"id": "b-1"}])
    w.call("createBatch", 400, body={"id": "not-a-list"})


def walk_startBulkJob(w: Walker) -> None:
    waiting_approval("w-1")
    job = w.call("startBulkJob", 202, body={"action": "pause", "status": "waiting"}).json()
    assert job["result"]["matched"] == 1 and job["result"]["action"] == "pause"
    every_filter = {
        "action": "send_event",
        "status": "waiting",
        "version": 1,
        "attributes": {"plan": "pro"},
        "created_before": "2999-01-01T00:00:00Z",
        "created_after": "2000-01-01T00:00:00+02:00",
        "event_type": "approval",
        "payload": {"ok": True},
    }
    assert w.call("startBulkJob", 202, body=every_filter).json()["result"]["matched"] == 0
    restart = {"action": "restart", "from_step": "charge", "to_version": 1}
    w.call("startBulkJob", 202, body=restart)
    w.call("startBulkJob", 202, body={"action": "cancel", "compensate": False})
    w.call("startBulkJob", 400, body={"action": "explode"})


def walk_getBulkJob(w: Walker) -> None:
    waiting_approval("w-1")
    job = get_workflow(APPROVAL).bulk("pause", status="waiting")
    testing.run_until_idle()
    found = w.call("getBulkJob", 200, job_id=job.id).json()["result"]
    assert found["id"] == job.id and found["matched"] == 1
    w.call("getBulkJob", 404, job_id=job.id + 1000)
    w.call("getBulkJob", 404, job_id=job.id, name=SIMPLE)  # a job of another workflow


def walk_getInstance(w: Walker) -> None:
    waiting_approval("w-1")
    got = w.call("getInstance", 200).json()["result"]
    assert got["status"] == "waiting" and got["pending_events"][0]["type"] == "approval"

    @register("contract-parent")
    class Parent(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            await step.start("audit", OTHER)
            return await step.invoke("simple", SIMPLE)

    get_workflow("contract-parent").create(id="p-1")
    testing.run_until_idle()
    parent = w.call("getInstance", 200, name="contract-parent", instance_id="p-1").json()["result"]
    assert [s["kind"] for s in parent["steps"]] == ["startChild", "invoke"]
    assert [c["step"] for c in parent["children"]] == ["audit", "simple"]
    child = parent["children"][1]
    shown = w.call("getInstance", 200, name=SIMPLE, instance_id=child["id"]).json()["result"]
    assert shown["parent"]["id"] == "p-1"
    get_workflow(SIMPLE).create(id="done")
    testing.run_until_idle()
    assert w.call("getInstance", 200, name=SIMPLE, instance_id="done").json()["result"]["output"]
    w.call("getInstance", 404, instance_id="nope")


def walk_deleteInstance(w: Walker) -> None:
    waiting_approval("w-1")
    w.call("deleteInstance", 409)
    get_workflow(SIMPLE).create(id="done")
    testing.run_until_idle()
    w.call("deleteInstance", 200, name=SIMPLE, instance_id="done")
    w.call("deleteInstance", 404, name=SIMPLE, instance_id="done")


def walk_getHistory(w: Walker) -> None:
    waiting_approval("w-1")
    records = w.call("getHistory", 200).json()["result"]
    assert [r["sequence"] for r in records] == list(range(1, len(records) + 1))
    w.call("getHistory", 404, instance_id="nope")


def walk_getSteps(w: Walker) -> None:
    waiting_approval("w-1")
    shown = w.call("getInstance", 200).json()["result"]
    steps = w.call("getSteps", 200).json()
    assert steps["result"] == shown["steps"] and steps["result_info"]["cursor"] is None
    assert shown["steps_total"] == len(shown["steps"])
    w.call("getSteps", 400, query="cursor=x")
    w.call("getSteps", 404, instance_id="nope")


def walk_getChildren(w: Walker) -> None:
    @register("contract-fan")
    class Fan(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            for i in range(3):
                await step.start(f"child {i}", OTHER)

    get_workflow("contract-fan").create(id="f-1")
    testing.run_until_idle()
    first = w.call("getChildren", 200, name="contract-fan", instance_id="f-1", query="limit=2")
    page = first.json()
    assert [c["step"] for c in page["result"]] == ["child 0", "child 1"]
    rest = w.call(
        "getChildren",
        200,
        name="contract-fan",
        instance_id="f-1",
        query=f"cursor={page['result_info']['cursor']}",
    ).json()
    assert [c["step"] for c in rest["result"]] == ["child 2"]
    assert rest["result_info"]["cursor"] is None
    w.call("getChildren", 400, name="contract-fan", instance_id="f-1", query="limit=1001")
    w.call("getChildren", 404, instance_id="nope")


def walk_subscribeHistory(w: Walker) -> None:
    get_workflow(SIMPLE).create(id="done")
    testing.run_until_idle()
    history = w.call("getHistory", 200, name=SIMPLE, instance_id="done").json()["result"]
    response = w.call("subscribeHistory", 200, name=SIMPLE, instance_id="done")
    events = read_stream(response)
    records = [e for e in events if "id" in e]
    entry = validator("components", "schemas", "HistoryEntry")
    for event in records:
        entry.validate(json.loads(event["data"]))
    assert [int(e["id"]) for e in records] == [h["sequence"] for h in history]
    assert events[-1]["event"] == "end"
    # The documented cursor and Last-Event-ID (which wins) start the stream after them.
    after_cursor = read_stream(
        w.call("subscribeHistory", 200, name=SIMPLE, instance_id="done", query="cursor=2")
    )
    assert [int(e["id"]) for e in after_cursor if "id" in e] == [h["sequence"] for h in history[2:]]
    resumed = w.call(
        "subscribeHistory",
        200,
        name=SIMPLE,
        instance_id="done",
        query="cursor=1",
        headers={"Last-Event-ID": "3"},
    )
    assert [int(e["id"]) for e in read_stream(resumed) if "id" in e] == [
        h["sequence"] for h in history[3:]
    ]
    w.call("subscribeHistory", 404, name=SIMPLE, instance_id="nope")
    w.call("subscribeHistory", 400, name=SIMPLE, instance_id="done", query="cursor=-1")


def read_stream(response: Any) -> list[dict[str, str]]:
    """The SSE events of a stream that ends (a finished instance's)."""

    async def collect() -> str:
        return "".join([chunk.decode() async for chunk in response.streaming_content])

    events = []
    for block in async_to_sync(collect)().split("\n\n"):
        event: dict[str, str] = {}
        for line in filter(None, block.split("\n")):
            key, _, value = line.partition(":")
            event.setdefault(key or "comment", value.strip())
        if event:
            events.append(event)
    return events


def walk_changeStatus(w: Walker) -> None:
    waiting_approval("w-1")
    assert (
        w.call("changeStatus", 200, body={"status": "pause"}).json()["result"]["status"] == "paused"
    )
    w.call("changeStatus", 409, body={"status": "pause"})
    w.call("changeStatus", 200, body={"status": "terminate"})
    w.call("changeStatus", 200, body={"status": "restart", "from_step": "charge"})
    w.call("changeStatus", 200, body={"status": "restart", "version": 1})
    w.call("changeStatus", 404, body={"status": "pause"}, instance_id="nope")
    w.call("changeStatus", 400, body={"status": "explode"})


def walk_sendEvent(w: Walker) -> None:
    waiting_approval("w-1")
    sent = w.call("sendEvent", 200, body={"ok": True}, event_type="approval").json()["result"]
    assert sent == {"id": "w-1", "workflow": APPROVAL, "type": "approval"}
    w.call("sendEvent", 400, body={"ok": "not a boolean"}, event_type="approval")
    w.call("sendEvent", 404, body={}, event_type="approval", instance_id="nope")
    w.call("changeStatus", 200, body={"status": "terminate"})
    w.call("sendEvent", 409, body={"ok": True}, event_type="approval")


def walk_cancelInstance(w: Walker) -> None:
    waiting_approval("w-1")
    assert (
        w.call("cancelInstance", 200, body={"compensate": False}).json()["result"]["status"]
        == "terminated"
    )
    w.call("cancelInstance", 409)
    w.call("cancelInstance", 404, instance_id="nope")
    w.call("cancelInstance", 400, body={"compensate": "yes"})


def walk_skipSleep(w: Walker) -> None:
    handle = waiting_approval("w-1")
    w.call("skipSleep", 409)  # waiting for an event, not sleeping
    handle.send_event("approval", {"ok": True})
    testing.run_until_idle()
    assert w.call("skipSleep", 200, body={}).json()["result"]["skipped"] == 1
    w.call("skipSleep", 404, instance_id="nope")
    w.call("skipSleep", 400, body={"force": True})


def nightly() -> None:
    schedules.create("nightly", workflow=APPROVAL, cron="0 3 * * *", params={"amount": 1})


def walk_listSchedules(w: Walker) -> None:
    nightly()
    listed = w.call("listSchedules", 200).json()["result"]
    assert [s["name"] for s in listed] == ["nightly"]


def walk_createSchedule(w: Walker) -> None:
    made = w.call("createSchedule", 201, body={"name": "nightly", "cron": "0 3 * * *"}).json()
    assert len(made["result"]["next_runs"]) == 5
    full = {"name": "paris", "cron": "*/15 * * * *", "timezone": "Europe/Paris", "params": {}}
    assert w.call("createSchedule", 201, body=full).json()["result"]["timezone"] == "Europe/Paris"
    w.call("createSchedule", 409, body={"name": "nightly", "cron": "0 4 * * *"})
    w.call("createSchedule", 400, body={"name": "bad-cron", "cron": "every day"})


def walk_getSchedule(w: Walker) -> None:
    nightly()
    assert w.call("getSchedule", 200).json()["result"]["cron"] == "0 3 * * *"
    w.call("getSchedule", 404, schedule="nope")
    w.call("getSchedule", 404, name=SIMPLE)  # a schedule of another workflow


def walk_changeSchedule(w: Walker) -> None:
    nightly()
    paused = w.call("changeSchedule", 200, body={"paused": True}).json()["result"]
    assert paused["paused"] is True and paused["next_runs"] == []
    resumed = w.call("changeSchedule", 200, body={"paused": False}).json()["result"]
    assert resumed["paused"] is False and len(resumed["next_runs"]) == 5
    w.call("changeSchedule", 404, body={"paused": True}, schedule="nope")
    w.call("changeSchedule", 400, body={"paused": "yes"})


def walk_deleteSchedule(w: Walker) -> None:
    nightly()
    w.call("deleteSchedule", 200)
    w.call("deleteSchedule", 404)


def walk_triggerSchedule(w: Walker) -> None:
    nightly()
    started = w.call("triggerSchedule", 201).json()["result"]
    assert started["workflow"] == APPROVAL and started["created"] is True
    w.call("triggerSchedule", 201, body={})
    w.call("triggerSchedule", 404, schedule="nope")
    w.call("triggerSchedule", 400, body={"at": "now"})


WALKS: dict[str, Callable[[Walker], None]] = {
    name.removeprefix("walk_"): fn for name, fn in globals().items() if name.startswith("walk_")
}


@pytest.fixture(autouse=True)
def flows(registered: list[str]) -> None:
    register_flows()


@pytest.fixture
def walker() -> Iterator[Walker]:
    yield Walker()


# --- the document as a whole -----------------------------------------------------------------


def test_the_served_document_is_valid_openapi_3_1_of_json_schema_2020_12():
    response = Client().get("/api/openapi.json")
    assert response.status_code == 200 and response["Content-Type"] == "application/json"
    assert response.json() == DOC
    validate_openapi(DOC)
    assert DOC["openapi"].startswith("3.1.")
    # 3.1's schemas are JSON Schema 2020-12 (the base dialect); 3.0's `nullable` would be ignored.
    assert DOC.get("jsonSchemaDialect", "https://spec.openapis.org/oas/3.1/dialect/base").endswith(
        "/base"
    )
    assert '"nullable"' not in json.dumps(DOC)
    for schema in DOC["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)


def test_every_operation_is_walked():
    assert set(WALKS) == set(OPERATIONS)


def routes(resolver: Any, prefix: str = "") -> Iterator[str]:
    for entry in resolver.url_patterns:
        if isinstance(entry, URLResolver):
            yield from routes(entry, prefix + str(entry.pattern))
        elif isinstance(entry, URLPattern):
            yield prefix + str(entry.pattern)


def test_every_api_route_is_documented_and_every_documented_path_routes():
    mounted = {
        "/" + re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", route)
        for route in routes(get_resolver())
        if route.startswith("api/") and route != "^api/"  # the JSON 404 of any other path
    }
    assert mounted == set(DOC["paths"])


@pytest.mark.parametrize("operation_id", sorted(OPERATIONS))
def test_each_operation_answers_as_documented(operation_id, walker, settings):
    WALKS[operation_id](walker)
    walker.provoke_common(operation_id, settings)
    documented = set(OPERATIONS[operation_id][2]["responses"])
    expected = {s for s in documented if (operation_id, s) not in UNPROVOKABLE}
    assert walker.seen[operation_id] == expected


@pytest.mark.parametrize("path", sorted(DOC["paths"]))
def test_each_path_refuses_other_methods_with_405_naming_the_documented_ones(path, walker):
    methods = [m.upper() for m in DOC["paths"][path] if m in HTTP_METHODS]
    allowed = {*methods, "HEAD"} if "GET" in methods else set(methods)
    url = walker.url(next(o for o, (p, _, _) in OPERATIONS.items() if p == path))
    for method in sorted({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"} - allowed):
        response = walker.client.generic(
            method, url, headers={"Authorization": f"Bearer {walker.secret}"}
        )
        assert response.status_code == 405, (path, method, response.status_code)
        if method != "HEAD":
            check_error_shape(response)
            validator(
                "components",
                "responses",
                "MethodNotAllowed",
                "content",
                "application/json",
                "schema",
            ).validate(response.json())
        assert set(response["Allow"].split(", ")) == allowed, (path, method)


@pytest.mark.parametrize("operation_id", sorted(o for o in OPERATIONS if OPERATIONS[o][1] == "get"))
def test_every_get_answers_head_with_its_headers_and_no_body(operation_id, walker):
    waiting_approval("w-1")
    get_workflow(SIMPLE).create(id="done")
    schedules.create("nightly", workflow=APPROVAL, cron="0 3 * * *")
    job = get_workflow(APPROVAL).bulk("pause", status="waiting")
    testing.run_until_idle()
    values = {"job_id": job.id}
    if operation_id == "subscribeHistory":
        values.update(name=SIMPLE, instance_id="done")
    url = walker.url(operation_id, **values)
    auth = {"Authorization": f"Bearer {walker.secret}"}
    got, head = walker.client.get(url, headers=auth), walker.client.head(url, headers=auth)
    assert got.status_code == head.status_code == 200
    assert head["Content-Type"] == got["Content-Type"]
    assert head.content == b"" and "no-store" in head["Cache-Control"]
    if got.streaming:
        read_stream(got)


# --- the one error shape, also where Django itself would answer --------------------------------


def test_a_fault_in_a_view_is_a_json_500_in_the_documented_shape(walker, monkeypatch):
    """A bug must not turn into Django's HTML page: clients parse every API answer."""
    waiting_approval("w-1")

    def broken(handle: Any, **options: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr("workflows_app.surfaces.instance_json", broken)
    client = Client(raise_request_exception=False)
    auth = {"Authorization": f"Bearer {walker.secret}"}
    response = client.get(walker.url("getInstance"), headers=auth)
    assert response.status_code == 500
    check_error_shape(response)
    documented = ("components", "responses", "InternalServerError", "content", "application/json")
    validator(*documented, "schema").validate(response.json())
    assert "a bug" not in response.content.decode()  # the cause goes to the log, not the client
    with pytest.raises(RuntimeError, match="a bug"):  # still raised for Django's handlers
        Client().get(walker.url("getInstance"), headers=auth)


@pytest.mark.parametrize(
    "path",
    [
        "/api/workflows/",  # a trailing slash: no APPEND_SLASH redirect to HTML
        "/api/workflows/x/bulk/not-a-number",
        "/api/workflows/x/bulk/99999999999999999999999",
        "/api/workflows/x/instances/y/events/",
    ],
)
def test_a_path_the_api_does_not_route_is_a_json_404(path, walker):
    response = Client(raise_request_exception=False).get(
        path, headers={"Authorization": f"Bearer {walker.secret}"}
    )
    assert response.status_code == 404, response.content[:200]
    check_error_shape(response)


def test_a_session_post_without_csrf_token_is_the_api_401_not_a_csrf_page():
    """The API ignores sessions, so no CSRF check applies: the answer is the API's own."""
    admin = User.objects.create_superuser("admin", password="pw")
    client = Client(enforce_csrf_checks=True)
    client.force_login(admin)
    for method, path in [
        ("POST", f"/api/workflows/{APPROVAL}/instances"),
        ("DELETE", f"/api/workflows/{APPROVAL}/schedules/nightly"),
        ("POST", "/api/openapi.json"),
        ("POST", "/api/no-such-route"),
        ("POST", f"/api/workflows/{APPROVAL}/instances/w-1/subscribe"),
    ]:
        response = client.generic(method, path, b"{}", content_type="application/json")
        assert response.status_code in (401, 404, 405), (path, response.status_code)
        check_error_shape(response)
