"""The OpenAPI 3.1 description of the JSON API, served at /api/openapi.json.

Written by hand next to the views; tests validate every response the API gives against
it, so the two cannot drift apart unnoticed.
"""

from __future__ import annotations

from typing import Any

from .converters import MAX_PK
from .models import Status, StepKind, StepStatus

ANY: dict[str, Any] = {"description": "any JSON value"}
TIME = {"type": "string", "format": "date-time"}
TIME_OR_NULL = {"type": ["string", "null"], "format": "date-time"}
ATTRIBUTES = {
    "type": "object",
    "propertyNames": {"pattern": "^[A-Za-z_][A-Za-z0-9_.-]{0,63}$"},
    "additionalProperties": {"type": ["string", "number", "boolean"], "pattern": "^[^\\u0000]*$"},
    "description": "search attributes: keys of letters, digits, '_', '.', '-'; "
    "string, number or boolean values",
}
DURATION = {"type": ["string", "integer"]}
# A create's attributes: null is taken as none.
ATTRIBUTES_GIVEN = {**ATTRIBUTES, "type": ["object", "null"]}
# What the server takes, so a client (or a fuzzer) that follows the document is not refused.
VERSION = {"type": "integer", "minimum": 1, "maximum": 2**31 - 1}
INSTANCE_ID = {
    "type": "string",
    "minLength": 1,
    "pattern": "^[A-Za-z0-9_][A-Za-z0-9_.:-]*$",
    "description": "letters, digits, '_', '-', '.', ':', not starting with '-', '.' or ':'; "
    'at most WFDASH["LIMITS"] max_instance_id_length characters (100 by default)',
}
EVENT_TYPE = "^[a-zA-Z0-9_][a-zA-Z0-9_-]{0,99}$"
KEY = {"type": "string", "minLength": 1, "maxLength": 200}


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def obj(
    properties: dict[str, Any], required: list[str] | None = None, closed: bool = True
) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
    }
    if closed:
        schema["additionalProperties"] = False
    return schema


def success(result: dict[str, Any], paged: bool = False) -> dict[str, Any]:
    properties: dict[str, Any] = {"success": {"const": True}, "result": result}
    if paged:
        properties["result_info"] = ref("ResultInfo")
    return obj(properties)


def json_body(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def required_body(schema: dict[str, Any], description: str) -> dict[str, Any]:
    """A request body the operation cannot do without (an empty one is refused)."""
    return {**json_body(schema, description), "required": True}


ERROR_RESPONSES = {
    "400": "BadRequest",
    "401": "Unauthorized",
    "403": "Forbidden",
    "404": "NotFound",
    "409": "Conflict",
    "413": "PayloadTooLarge",
    "429": "TooManyRequests",
}


def responses(
    ok: dict[str, Any], *errors: str, status: str = "200", also: dict[str, Any] | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {status: ok, **(also or {})}
    # 400 everywhere: every operation refuses a query parameter it does not take.
    for code in ("400", "401", *errors, "429"):
        out[code] = {"$ref": f"#/components/responses/{ERROR_RESPONSES[code]}"}
    return out


def page_limit(default: int) -> dict[str, Any]:
    """The ?limit= of a paged list: 1 to 1000 items a page."""
    return {
        "name": "limit",
        "in": "query",
        "schema": {"type": "integer", "minimum": 1, "maximum": 1000, "default": default},
    }


def instance_page(
    summary: str, operation_id: str, item: dict[str, Any], described: str
) -> dict[str, Any]:
    """A paged read of one instance's steps or children (GET …/instances/{id} shows the
    newest 1000)."""
    return {
        "parameters": [WORKFLOW, INSTANCE],
        "get": {
            "summary": summary,
            "operationId": operation_id,
            "description": READ
            + " At most `limit` a page: pass result_info.cursor back as ?cursor= for the"
            " next (null after the last).",
            "parameters": [
                {
                    "name": "cursor",
                    "in": "query",
                    "schema": {"type": "integer", "minimum": 0, "maximum": MAX_PK},
                    "description": "result_info.cursor of the previous page (default 0: "
                    "from the first)",
                },
                page_limit(1000),
            ],
            "responses": responses(
                json_body(success({"type": "array", "items": item}, paged=True), described),
                "400",
                "403",
                "404",
            ),
        },
    }


def path_param(name: str, description: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "schema": {"type": "string"},
        "description": description,
    }


WORKFLOW = path_param("name", "registered workflow name")
INSTANCE = path_param("instance_id", "instance id (scoped by workflow)")
SCHEDULE = path_param("schedule", "schedule name (of a schedule that starts this workflow)")
READ = (
    "Needs a token limited to no workflows or to this one; a token with a user needs its "
    "`workflows_app.view_instance` permission."
)
WRITE = (
    "Needs a token with the write scope, limited to no workflows or to this one; a token with a user "
    "needs its `workflows_app.change_instance` permission."
)

SCHEMAS: dict[str, Any] = {
    "ErrorInfo": {
        "type": ["object", "null"],
        "properties": {"name": {"type": "string"}, "message": {"type": "string"}},
        "required": ["name", "message"],
        "additionalProperties": False,
    },
    "Failure": obj(
        {
            "success": {"const": False},
            "errors": {
                "type": "array",
                "minItems": 1,
                "items": obj(
                    {
                        "code": {
                            "type": "string",
                            "description": "stable error code, e.g. InstanceNotFound",
                        },
                        "message": {"type": "string"},
                    }
                ),
            },
        }
    ),
    "ResultInfo": obj({"cursor": {"type": ["string", "null"]}, "per_page": {"type": "integer"}}),
    "Status": {"type": "string", "enum": list(Status.values)},
    "InstanceSummary": obj(
        {
            "id": {"type": "string"},
            "workflow": {"type": "string"},
            "version": {"type": "integer"},
            "status": ref("Status"),
            "error": ref("ErrorInfo"),
            "created_at": TIME,
            "updated_at": TIME,
            "finished_at": TIME_OR_NULL,
            "attributes": ATTRIBUTES,
        }
    ),
    "InstanceCreated": obj(
        {
            "id": {"type": "string"},
            "workflow": {"type": "string"},
            "version": {"type": "integer"},
            "status": ref("Status"),
            "created": {
                "type": "boolean",
                "description": "false when an idempotency key found an existing instance, "
                "or a debounce_key one not started yet (it took these params)",
            },
        }
    ),
    "Workflow": obj(
        {
            "name": {"type": "string"},
            "versions": {"type": "array", "items": {"type": "integer"}},
            "counts": {
                "type": "object",
                "additionalProperties": {"type": "integer"},
                "description": "instances by status (statuses without any are left out)",
            },
            "total": {"type": "integer"},
        }
    ),
    "Step": obj(
        {
            "name": {"type": "string"},
            # From the models, as Status: a kind added there (invoke, startChild) is documented.
            "kind": {"type": "string", "enum": list(StepKind.values)},
            "status": {"type": "string", "enum": list(StepStatus.values)},
            "attempts": {"type": "integer"},
            "output": ANY,
            "error": ref("ErrorInfo"),
            "started_at": TIME,
            "completed_at": TIME_OR_NULL,
            "duration_ms": {"type": ["number", "null"]},
            "wake_at": TIME_OR_NULL,
        }
    ),
    "PendingEvent": obj(
        {
            "name": {"type": "string"},
            "type": {"type": "string"},
            "timeout_at": TIME_OR_NULL,
            "schema": {"type": ["object", "null"]},
        }
    ),
    "Instance": obj(
        {
            "id": {"type": "string"},
            "workflow": {"type": "string"},
            "version": {"type": "integer"},
            "status": ref("Status"),
            "params": ANY,
            "attributes": ATTRIBUTES,
            "output": ANY,
            "error": ref("ErrorInfo"),
            "waiting_reason": {"type": "string"},
            "priority": {"type": "integer"},
            "concurrency_key": {"type": ["string", "null"]},
            "parent": {"oneOf": [{"type": "null"}, ref("InstanceRef")]},
            "children": {
                "type": "array",
                "items": ref("InstanceRef"),
                "description": "the newest 1000 at most, oldest first: …/children pages "
                "through them all",
            },
            "children_total": {"type": "integer", "description": "how many children it has"},
            "created_by": {"type": "string"},
            "created_at": TIME,
            "updated_at": TIME,
            "started_at": TIME_OR_NULL,
            "finished_at": TIME_OR_NULL,
            "steps": {
                "type": "array",
                "items": ref("Step"),
                "description": "in start order: the newest 1000 at most and every older one "
                "still open (running, retrying, waiting); …/steps pages through them all",
            },
            "steps_total": {"type": "integer", "description": "how many steps it has"},
            "pending_events": {"type": "array", "items": ref("PendingEvent")},
        }
    ),
    "HistoryEntry": obj(
        {
            "sequence": {"type": "integer"},
            "created_at": TIME,
            "type": {"type": "string"},
            "data": {"type": "object"},
            "actor": {"type": "string"},
        }
    ),
    "InstanceRef": obj(
        {
            "id": {"type": "string"},
            "workflow": {"type": "string"},
            "status": {
                "oneOf": [{"type": "null"}, ref("Status")],
                "description": "null when the token is limited to workflows without this one",
            },
            "step": {"type": "string", "description": "the parent's step that started the child"},
        }
    ),
    "InstanceState": obj(
        {"id": {"type": "string"}, "workflow": {"type": "string"}, "status": ref("Status")}
    ),
    "CreateInstance": obj(
        {
            "id": {
                **INSTANCE_ID,
                "description": "instance id; a UUID when omitted. " + INSTANCE_ID["description"],
            },
            "instance_id": {
                **INSTANCE_ID,
                "description": "alias of id (Cloudflare's name); both given must be equal",
            },
            "params": ANY,
            "idempotency_key": {
                **KEY,
                "description": "same key, same workflow and version: same instance",
            },
            "retention": {
                "oneOf": [
                    DURATION,
                    obj({"success": DURATION, "error": DURATION}, required=[]),
                ],
                "description": "keep the finished instance this long (duration string or ms; "
                '0 = forever), or by outcome: {"success": "7 days", "error": "30 days"} '
                "(error also covers terminated)",
            },
            "priority": {
                "type": "integer",
                "minimum": 0,
                "maximum": 9,
                "default": 5,
                "description": "lower starts first while queued",
            },
            "concurrency_key": {
                **KEY,
                "description": "bounded by the workflow's max_concurrent_per_key",
            },
            "debounce_key": {
                **KEY,
                "description": "with debounce: an instance of this key not started yet takes these params",
            },
            "debounce": {
                "type": ["string", "integer"],
                "description": "start this long after the last create with the debounce_key",
            },
            "attributes": ATTRIBUTES_GIVEN,
        },
        required=[],
    )
    | {"dependentRequired": {"debounce": ["debounce_key"], "debounce_key": ["debounce"]}},
    "BulkJobStart": obj(
        {
            "action": {
                "type": "string",
                "enum": [
                    "pause",
                    "resume",
                    "terminate",
                    "cancel",
                    "restart",
                    "delete",
                    "send_event",
                ],
            },
            "status": ref("Status"),
            "version": VERSION,
            "attributes": ATTRIBUTES,
            "created_before": TIME,
            "created_after": TIME,
            "event_type": {
                "type": "string",
                "pattern": EVENT_TYPE,
                "description": "send_event: the event's type",
            },
            "payload": ANY,
            "from_step": {
                "type": "string",
                "minLength": 1,
                "description": "restart: from this step",
            },
            "to_version": {
                **VERSION,
                "description": "restart: the registered version they run on from then on",
            },
            "compensate": {"type": "boolean", "default": True, "description": "cancel"},
        },
        required=["action"],
    )
    | {
        # Each action's own options, only with it (bulk_options refuses the others).
        "allOf": [
            {
                "if": {"properties": {"action": {"const": "send_event"}}},
                "then": {"required": ["event_type"]},
                "else": {"properties": {"event_type": False, "payload": False}},
            },
            {
                "if": {"properties": {"action": {"const": "restart"}}},
                "else": {"properties": {"from_step": False, "to_version": False}},
            },
            {
                "if": {"properties": {"action": {"const": "cancel"}}},
                "else": {"properties": {"compensate": {"const": True}}},
            },
        ]
    },
    "BulkJob": obj(
        {
            "id": {"type": "integer"},
            "workflow": {"type": "string"},
            "action": {"type": "string"},
            "filter": {"type": "object"},
            "options": {"type": "object"},
            "matched": {
                "type": "integer",
                "description": "instances the filter matched when the job started",
            },
            "processed": {"type": "integer"},
            "applied": {"type": "integer"},
            "pause_requested": {
                "type": "integer",
                "description": "a pause job's instances only asked to pause (in a step: they "
                "pause when it finishes), not counted in applied",
            },
            "skipped": {
                "type": "integer",
                "description": "the action did not apply (already in that state, finished, "
                "live for delete) or the instance was gone",
            },
            "failed": {"type": "integer"},
            "errors": {"type": "array", "items": {"type": "string"}},
            "done": {"type": "boolean"},
            "created_at": TIME,
            "finished_at": TIME_OR_NULL,
        }
    ),
    "InstanceDeleted": obj(
        {"id": {"type": "string"}, "workflow": {"type": "string"}, "deleted": {"const": True}}
    ),
    "StatusChange": obj(
        {
            "status": {"type": "string", "enum": ["pause", "resume", "terminate", "restart"]},
            "from_step": {
                "type": ["string", "null"],
                "minLength": 1,
                "description": "restart only: drop this step's checkpoint and later ones",
            },
            "version": {
                **VERSION,
                "type": ["integer", "null"],
                "description": "restart only: run on this registered version from now on "
                "(the kept checkpoints replay on its code); default: the instance's own",
            },
        },
        required=["status"],
    )
    | {  # from_step and version only with restart (null: not given)
        "if": {"properties": {"status": {"const": "restart"}}},
        "else": {"properties": {"from_step": {"type": "null"}, "version": {"type": "null"}}},
    },
    "Cancel": obj({"compensate": {"type": "boolean", "default": True}}, required=[]),
    "EventSent": obj(
        {"id": {"type": "string"}, "workflow": {"type": "string"}, "type": {"type": "string"}}
    ),
    "Schedule": obj(
        {
            "name": {"type": "string"},
            "workflow": {"type": "string"},
            "cron": {
                "type": "string",
                "description": "5-field cron (optionally a leading seconds field)",
            },
            "timezone": {"type": "string", "description": "IANA time zone the cron is read in"},
            "params": ANY,
            "paused": {"type": "boolean"},
            "declared": {
                "type": "boolean",
                "description": "declared in code by register(schedules=[...]): cannot be deleted here",
            },
            "next_run_at": TIME_OR_NULL,
            "last_tick_at": TIME_OR_NULL,
            "last_instance_id": {"type": ["string", "null"]},
            "created_at": TIME,
            "created_by": {"type": "string"},
            "next_runs": {
                "type": "array",
                "items": TIME,
                "description": "the next fire times (none while paused)",
            },
        },
        required=[
            "name",
            "workflow",
            "cron",
            "timezone",
            "params",
            "paused",
            "declared",
            "next_run_at",
            "last_tick_at",
            "last_instance_id",
            "created_at",
            "created_by",
        ],
    ),
    "CreateSchedule": obj(
        {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,79}$"},
            "cron": {
                "type": "string",
                "minLength": 1,
                "maxLength": 200,
                "examples": ["*/15 * * * *"],
            },
            "timezone": {"type": "string", "default": "UTC"},
            "params": ANY,
        },
        required=["name", "cron"],
    ),
    "ScheduleChange": obj({"paused": {"type": "boolean"}}),
    "ScheduleDeleted": obj(
        {"name": {"type": "string"}, "workflow": {"type": "string"}, "deleted": {"const": True}}
    ),
    "SleepSkipped": obj(
        {
            "id": {"type": "string"},
            "workflow": {"type": "string"},
            "status": ref("Status"),
            "skipped": {"type": "integer", "minimum": 1, "description": "sleeps made due now"},
        }
    ),
}


def failure(description: str) -> dict[str, Any]:
    return json_body(ref("Failure"), description)


def instance_action(
    summary: str,
    operation_id: str,
    options: dict[str, Any],
    options_note: str,
    result: str,
    result_note: str,
) -> dict[str, Any]:
    """A POST on an instance with an optional JSON object of options."""
    return {
        "parameters": [WORKFLOW, INSTANCE],
        "post": {
            "summary": summary,
            "operationId": operation_id,
            "description": WRITE,
            "requestBody": {
                "required": False,
                "description": options_note,
                "content": {"application/json": {"schema": options}},
            },
            "responses": responses(
                json_body(success(ref(result)), result_note), "400", "403", "404", "409", "413"
            ),
        },
    }


def document(mount: str = "") -> dict[str, Any]:
    """The API's description. mount: the path the dashboard's URLs are included at in a
    project that mounts them under a prefix ("/ops/wf"), given as the document's server,
    so its /api/... paths resolve under it; at the root the document has no servers."""
    instance_path = "/api/workflows/{name}/instances/{instance_id}"
    servers = {"servers": [{"url": mount}]} if mount else {}
    return {
        "openapi": "3.1.0",
        **servers,
        "info": {
            "title": "wfdash API",
            "version": "1.0.0",
            "description": (
                "Durable workflows (Cloudflare Workflows semantics). Authenticate with "
                "`Authorization: Bearer <token>` (create one with `manage.py wf token create NAME`). "
                "Every response is `{success, result}` or `{success: false, errors: [{code, message}]}`, "
                "marked `Cache-Control: no-store`; every GET also answers HEAD."
            ),
        },
        "security": [{"bearer": []}],
        "paths": {
            "/api/openapi.json": {
                "get": {
                    "summary": "This document",
                    "operationId": "openapi",
                    "security": [],
                    "responses": {
                        "200": {
                            "description": "the OpenAPI document",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        }
                    },
                }
            },
            "/api/workflows": {
                "get": {
                    "summary": "List workflows (registered, or with instances): versions and counts by status",
                    "operationId": "listWorkflows",
                    "description": "A token limited to some workflows sees only those.",
                    "responses": responses(
                        json_body(
                            success({"type": "array", "items": ref("Workflow")}),
                            "the workflows, by name",
                        ),
                        "400",
                        "403",
                    ),
                },
            },
            "/api/workflows/{name}/instances": {
                "parameters": [WORKFLOW],
                "get": {
                    "summary": "List instances, newest first",
                    "operationId": "listInstances",
                    "description": READ
                    + " Filter by search attribute with `attr.<key>=<value>` query parameters"
                    " (any number of them: exact matches, e.g. attr.customer=c-9; keys as in"
                    ' attributes; a number, true or false is typed: quote it, attr.seats="5",'
                    " to match a string). Not listed as parameters: OpenAPI names each one, and"
                    " a parameter literally named `attr.<key>` is refused.",
                    "parameters": [
                        {"name": "status", "in": "query", "schema": ref("Status")},
                        page_limit(50),
                        {
                            "name": "cursor",
                            "in": "query",
                            "schema": {"type": "string"},
                            "description": "result_info.cursor of the previous page",
                        },
                        {"name": "version", "in": "query", "schema": VERSION},
                    ],
                    "responses": responses(
                        json_body(
                            success({"type": "array", "items": ref("InstanceSummary")}, paged=True),
                            "a page",
                        ),
                        "400",
                        "403",
                        "404",
                    ),
                },
                "post": {
                    "summary": "Create an instance",
                    "operationId": "createInstance",
                    "description": WRITE,
                    "requestBody": json_body(
                        ref("CreateInstance"), "the instance; an empty body is allowed"
                    ),
                    "responses": responses(
                        json_body(success(ref("InstanceCreated")), "created"),
                        "400",
                        "403",
                        "404",
                        "409",
                        "413",
                        status="201",
                        also={
                            "200": json_body(
                                success(ref("InstanceCreated")),
                                "not created: the instance an idempotency key "
                                "already made, or the pending one a debounce_key "
                                "merged this create into (created: false)",
                            )
                        },
                    ),
                },
            },
            "/api/workflows/{name}/instances/batch": {
                "parameters": [WORKFLOW],
                "post": {
                    "summary": "Create several instances, all or none",
                    "operationId": "createBatch",
                    "description": WRITE,
                    "requestBody": required_body(
                        {"type": "array", "items": ref("CreateInstance")}, "the instances"
                    ),
                    "responses": responses(
                        json_body(
                            success({"type": "array", "items": ref("InstanceCreated")}),
                            "created (at least one is new)",
                        ),
                        "400",
                        "403",
                        "404",
                        "409",
                        "413",
                        status="201",
                        also={
                            "200": json_body(
                                success({"type": "array", "items": ref("InstanceCreated")}),
                                "every one existed: found by idempotency keys",
                            )
                        },
                    ),
                },
            },
            "/api/workflows/{name}/bulk": {
                "parameters": [WORKFLOW],
                "post": {
                    "summary": "Start a bulk job: an action on every instance a filter matches now",
                    "operationId": "startBulkJob",
                    "description": WRITE
                    + " The delete action needs `workflows_app.delete_instance`.",
                    "requestBody": required_body(ref("BulkJobStart"), "the action and the filter"),
                    "responses": responses(
                        json_body(success(ref("BulkJob")), "started; GET its address for progress"),
                        "400",
                        "403",
                        "404",
                        "413",
                        status="202",
                    ),
                },
            },
            "/api/workflows/{name}/bulk/{job_id}": {
                "parameters": [
                    WORKFLOW,
                    {
                        "name": "job_id",
                        "in": "path",
                        "required": True,
                        "schema": {"type": "integer"},
                    },
                ],
                "get": {
                    "summary": "A bulk job's progress",
                    "operationId": "getBulkJob",
                    "description": READ,
                    "responses": responses(
                        json_body(success(ref("BulkJob")), "the job"), "403", "404"
                    ),
                },
            },
            instance_path: {
                "parameters": [WORKFLOW, INSTANCE],
                "get": {
                    "summary": "An instance: status, params, output, error, steps, pending events",
                    "operationId": "getInstance",
                    "description": READ,
                    "responses": responses(
                        json_body(success(ref("Instance")), "the instance"), "403", "404"
                    ),
                },
                "delete": {
                    "summary": "Delete a finished instance with its steps, events, history and spans",
                    "operationId": "deleteInstance",
                    "description": "Needs a token with the write scope; a token with a user needs "
                    "its `workflows_app.delete_instance` permission. A live instance is refused "
                    "with 409: terminate it first.",
                    "responses": responses(
                        json_body(success(ref("InstanceDeleted")), "deleted"),
                        "400",
                        "403",
                        "404",
                        "409",
                        "413",
                    ),
                },
            },
            instance_path + "/history": {
                "parameters": [WORKFLOW, INSTANCE],
                "get": {
                    "summary": "The instance's append-only history",
                    "operationId": "getHistory",
                    "description": READ
                    + " At most `limit` records a page, in order: pass result_info.cursor back"
                    " as ?cursor= for the next (null after the last record).",
                    "parameters": [
                        {
                            "name": "cursor",
                            "in": "query",
                            "schema": {"type": "integer", "minimum": 0, "maximum": MAX_PK},
                            "description": "the records after this history sequence "
                            "(result_info.cursor of the previous page; default 0: from the start)",
                        },
                        page_limit(1000),
                    ],
                    "responses": responses(
                        json_body(
                            success({"type": "array", "items": ref("HistoryEntry")}, paged=True),
                            "records in order",
                        ),
                        "400",
                        "403",
                        "404",
                    ),
                },
            },
            instance_path + "/steps": instance_page(
                "The instance's steps, in start order",
                "getSteps",
                ref("Step"),
                "steps in start order",
            ),
            instance_path + "/children": instance_page(
                "The instances this one started (step.invoke / step.start), oldest first",
                "getChildren",
                ref("InstanceRef"),
                "children, oldest first",
            ),
            instance_path + "/subscribe": {
                "parameters": [WORKFLOW, INSTANCE],
                "get": {
                    "summary": "The instance's history as Server-Sent Events, live",
                    "operationId": "subscribeHistory",
                    "description": READ
                    + " Or, without a token, a staff session that may view the dashboard."
                    " Each history record is one event: `id:` its sequence, `data:` the"
                    " HistoryEntry as JSON. Comment lines (`: heartbeat`) come while nothing"
                    " happens; after the last record of a finished instance an `end` event"
                    " closes the stream. A reconnecting EventSource sends Last-Event-ID and"
                    " resumes after it.",
                    "parameters": [
                        {
                            "name": "cursor",
                            "in": "query",
                            "required": False,
                            "description": "start after this history sequence (default 0: all)",
                            "schema": {"type": "integer", "minimum": 0, "maximum": MAX_PK},
                        },
                        {
                            "name": "Last-Event-ID",
                            "in": "header",
                            "required": False,
                            "description": "resume after this sequence (wins over cursor)",
                            "schema": {"type": "integer", "minimum": 0, "maximum": MAX_PK},
                        },
                    ],
                    "responses": responses(
                        {
                            "description": "an event stream",
                            "content": {"text/event-stream": {"schema": {"type": "string"}}},
                        },
                        "400",
                        "403",
                        "404",
                    ),
                },
            },
            instance_path + "/status": {
                "parameters": [WORKFLOW, INSTANCE],
                "patch": {
                    "summary": "Pause, resume, terminate or restart",
                    "operationId": "changeStatus",
                    "description": WRITE,
                    "requestBody": required_body(ref("StatusChange"), "the action"),
                    "responses": responses(
                        json_body(success(ref("InstanceState")), "the new status"),
                        "400",
                        "403",
                        "404",
                        "409",
                        "413",
                    ),
                },
            },
            instance_path + "/events/{event_type}": {
                "parameters": [
                    WORKFLOW,
                    INSTANCE,
                    {
                        **path_param("event_type", "the event's type"),
                        "schema": {"type": "string", "pattern": EVENT_TYPE},
                    },
                ],
                "post": {
                    "summary": "Send an event (the body is its payload)",
                    "operationId": "sendEvent",
                    "description": WRITE,
                    "requestBody": {
                        "required": False,
                        "description": "the payload, any JSON",
                        "content": {"application/json": {"schema": ANY}},
                    },
                    "responses": responses(
                        json_body(success(ref("EventSent")), "stored for the instance"),
                        "400",
                        "403",
                        "404",
                        "409",
                        "413",
                    ),
                },
            },
            instance_path + "/cancel": instance_action(
                "Cancel, compensating completed steps first (unless compensate is false)",
                "cancelInstance",
                ref("Cancel"),
                "options",
                "InstanceState",
                "compensating or terminated",
            ),
            "/api/workflows/{name}/schedules": {
                "parameters": [WORKFLOW],
                "get": {
                    "summary": "List the workflow's cron schedules (declared and runtime)",
                    "operationId": "listSchedules",
                    "description": READ,
                    "responses": responses(
                        json_body(success({"type": "array", "items": ref("Schedule")}), "by name"),
                        "400",
                        "403",
                        "404",
                    ),
                },
                "post": {
                    "summary": "Create a cron schedule that starts an instance at every tick",
                    "operationId": "createSchedule",
                    "description": WRITE,
                    "requestBody": required_body(ref("CreateSchedule"), "the schedule"),
                    "responses": responses(
                        json_body(success(ref("Schedule")), "created, with its next runs"),
                        "400",
                        "403",
                        "404",
                        "409",
                        "413",
                        status="201",
                    ),
                },
            },
            "/api/workflows/{name}/schedules/{schedule}": {
                "parameters": [WORKFLOW, SCHEDULE],
                "get": {
                    "summary": "A schedule, with its next runs",
                    "operationId": "getSchedule",
                    "description": READ,
                    "responses": responses(
                        json_body(success(ref("Schedule")), "the schedule"), "403", "404"
                    ),
                },
                "patch": {
                    "summary": "Pause or resume a schedule (ticks missed while paused never fire)",
                    "operationId": "changeSchedule",
                    "description": WRITE,
                    "requestBody": required_body(ref("ScheduleChange"), "the new state"),
                    "responses": responses(
                        json_body(success(ref("Schedule")), "the schedule"),
                        "400",
                        "403",
                        "404",
                        "413",
                    ),
                },
                "delete": {
                    "summary": "Delete a runtime schedule (its instances stay)",
                    "operationId": "deleteSchedule",
                    "description": WRITE,
                    "responses": responses(
                        json_body(success(ref("ScheduleDeleted")), "deleted"),
                        "400",
                        "403",
                        "404",
                        "413",
                    ),
                },
            },
            "/api/workflows/{name}/schedules/{schedule}/trigger": {
                "parameters": [WORKFLOW, SCHEDULE],
                "post": {
                    "summary": "Start one instance of the schedule now",
                    "operationId": "triggerSchedule",
                    "description": WRITE,
                    "requestBody": {
                        "required": False,
                        "description": "no options: empty or {}",
                        "content": {"application/json": {"schema": obj({}, required=[])}},
                    },
                    "responses": responses(
                        json_body(success(ref("InstanceCreated")), "started"),
                        "400",
                        "403",
                        "404",
                        "409",
                        "413",
                        status="201",
                    ),
                },
            },
            instance_path + "/skip-sleep": instance_action(
                "End the instance's current sleeps now (the steps after them run)",
                "skipSleep",
                obj({}, required=[]),
                "no options: empty or {}",
                "SleepSkipped",
                "the sleeps are due now",
            ),
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": SCHEMAS,
            "responses": {
                "BadRequest": failure(
                    "invalid JSON, not UTF-8, wrong types, a limit exceeded, or a query "
                    "parameter the operation does not take"
                ),
                "Unauthorized": failure("missing, unknown, expired or revoked token"),
                "Forbidden": failure(
                    "the token's scope or workflows do not cover the request, or its user "
                    "lacks the permission it needs"
                ),
                "NotFound": failure("unknown workflow, instance or schedule"),
                "MethodNotAllowed": failure(
                    "the path does not take this method (see the Allow header)"
                ),
                "Conflict": failure(
                    "the action does not apply to the instance's status, or the id or "
                    "schedule name is taken"
                ),
                "PayloadTooLarge": failure("the body is larger than the API's request size limit"),
                "TooManyRequests": failure(
                    "too many wrong tokens from this client: wait Retry-After seconds"
                ),
                "InternalServerError": failure(
                    "a fault of the server (code InternalError); its cause is in the server's "
                    "log, not in the answer"
                ),
            },
        },
    }
