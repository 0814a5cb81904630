"""The JSON HTTP API for other services, in Cloudflare Workflows' REST shapes.

Authentication is a bearer token (see tokens.py), never the session, so the views are
CSRF-exempt. Each view is thin: the `endpoint` wrapper authenticates, checks what the
token may do (tokens.refusal: reads need view_instance, writes change_instance and the
write scope, both the token's workflows) and turns errors into `{"success": false,
"errors": [...]}`; the handler looks the instance up, makes one client call and returns
JSON. No response may be cached: they carry instance data and differ per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import SuspiciousOperation
from django.core.signals import got_request_exception
from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.utils.cache import add_never_cache_headers
from django.utils.log import log_response
from django.views.decorators.csrf import csrf_exempt

from . import access, dashboard, openapi, socket_slots, surfaces, throttle, tokens
from .client import InstanceHandle, ScheduleHandle, schedules
from .converters import MAX_PK
from .engine import errors
from .engine.attributes import parse_filter as parse_attribute_filter
from .models import ApiToken, BulkAction, Schedule

log = logging.getLogger("workflows_app.api")

DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024
WRITE_METHODS = {"POST", "PATCH", "PUT", "DELETE"}
LIMIT_PATTERN = re.compile(
    r"[0-9]{1,6}"
)  # ASCII digits only: "²".isdigit() is True, int("²") fails

VERSION_PATTERN = re.compile(r"[0-9]{1,10}")

# Most specific first: the first class an error is an instance of decides its status.
ERROR_STATUS: tuple[tuple[type[errors.WorkflowError], int], ...] = (
    (errors.UnknownWorkflow, 404),
    (errors.InstanceNotFound, 404),
    (errors.ScheduleNotFound, 404),
    (errors.ScheduleExists, 409),
    (errors.BulkJobNotFound, 404),
    (errors.InstanceAlreadyExists, 409),
    (errors.InvalidTransition, 409),
    (errors.VersionConflict, 409),
    (errors.SizeLimitExceeded, 413),  # params or a payload over its byte limit (other limits: 400)
    (errors.WorkflowError, 400),
)


def error_status(exc: errors.WorkflowError) -> int:
    return next(status for cls, status in ERROR_STATUS if isinstance(exc, cls))


class ApiError(Exception):
    """A refusal decided by the API layer itself (auth, body, method)."""

    def __init__(
        self, status: int, code: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.headers = headers or {}


def max_body_bytes() -> int:
    return int(getattr(settings, "WFDASH", {}).get("API_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES))


def ok(result: Any, status: int = 200, **extra: Any) -> JsonResponse:
    return JsonResponse({"success": True, "result": result, **extra}, status=status)


def fail(status: int, code: str, message: str) -> JsonResponse:
    return JsonResponse(
        {"success": False, "errors": [{"code": code, "message": message}]}, status=status
    )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refused when it names a key twice (json.loads keeps the last)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        keys = [key for key, _ in pairs]
        twice = next(key for i, key in enumerate(keys) if key in keys[:i])
        raise ValueError(f"the key {twice!r} is given twice in one object")
    return obj


@dataclass
class Call:
    """One authenticated API request, as handlers see it."""

    request: HttpRequest
    token: ApiToken
    _body: Any = field(default=None, init=False)
    _read: bool = field(default=False, init=False)
    _empty: bool = field(default=True, init=False)  # no body at all (not JSON null)

    @property
    def actor(self) -> str:
        return self.token.name

    def body(self) -> Any:
        """The request body as JSON (None when empty), refused if too large or malformed."""
        if not self._read:
            limit = max_body_bytes()
            raw = self.request.read(limit + 1)  # the actual body, whatever Content-Length said
            if len(raw) > limit:
                raise ApiError(
                    413, "PayloadTooLarge", f"request body exceeds the API limit of {limit} bytes"
                )
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ApiError(
                    400,
                    "InvalidEncoding",
                    f"request body is not UTF-8: {exc.reason} at byte {exc.start}",
                ) from None
            self._empty = not text.strip()
            try:
                self._body = (
                    None
                    if self._empty
                    else json.loads(
                        text, parse_constant=_reject_constant, object_pairs_hook=_unique_keys
                    )
                )
            except (ValueError, RecursionError) as exc:
                raise ApiError(
                    400, "InvalidJSON", f"request body is not valid JSON: {exc}"
                ) from None
            self._read = True
        return self._body

    def object_body(self, allowed: set[str]) -> dict[str, Any]:
        """The body as an object with only the allowed fields ({} when empty). A JSON
        null is not an empty body: taken as one, `null` created, cancelled or triggered
        with the defaults, where every other non-object is refused."""
        body = self.body()
        if self._empty:
            return {}
        if not isinstance(body, dict):
            raise ApiError(
                400, "InvalidInput", f"request body must be a JSON object, got {json_type(body)}"
            )
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise ApiError(
                400, "InvalidInput", f"unknown field(s) {unknown}; allowed: {sorted(allowed)}"
            )
        return body


def json_type(value: Any) -> str:
    return {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        type(None): "null",
    }.get(type(value), "a number")


def bearer_secret(request: HttpRequest) -> str:
    scheme, _, secret = request.headers.get("Authorization", "").partition(" ")
    return secret.strip() if scheme.lower() == "bearer" else ""


def authorize(request: HttpRequest, workflow: str | None) -> ApiToken:
    """The request's live token, allowed to do what the request asks; else 401 / 403 (429
    while the client is locked out for guessing)."""
    retry_after = throttle.api_retry_after(request)
    if retry_after is not None:
        raise ApiError(
            429,
            "TooManyRequests",
            f"too many wrong API tokens from this client; retry in {retry_after} s",
            {"Retry-After": str(retry_after)},
        )
    secret = bearer_secret(request)
    token = tokens.authenticate(secret)
    if token is None:
        if secret:
            throttle.record_api_failure(request)
        raise ApiError(
            401,
            "Unauthorized",
            "missing, unknown, expired or revoked API token (Authorization: Bearer <token>)",
        )
    refusal = tokens.refusal(
        token,
        write=request.method in WRITE_METHODS,
        workflow=workflow,
        permission=tokens.DELETE_PERMISSION if request.method == "DELETE" else None,
    )
    if refusal:
        raise ApiError(403, "Forbidden", refusal)
    return token


def internal_error(request: HttpRequest) -> JsonResponse:
    """A fault of the code (call it while handling the exception), answered in the API's
    one error shape: Django's HTML 500 page would break every client that parses the
    answer. Logged and signalled as Django does for any view (error reporters, the test
    client); the cause stays in the log, not in the answer."""
    got_request_exception.send(sender=None, request=request)
    response = fail(500, "InternalError", "the server failed to answer; the fault is logged")
    log_response(
        "Internal Server Error: %s",
        request.path,
        response=response,
        request=request,
        exception=sys.exception(),
    )
    return response


def suspicious(exc: SuspiciousOperation) -> JsonResponse:
    """Django's refusal of a request it will not parse (over DATA_UPLOAD_MAX_NUMBER_FIELDS
    query parameters, say): a 400 naming it, as Django answers outside the API, logged
    where Django logs those. Caught as any fault, it was a 500 InternalError."""
    logging.getLogger(f"django.security.{type(exc).__name__}").error(str(exc))
    return fail(400, "InvalidInput", f"request refused: {exc}")


def uncached(response: HttpResponse) -> HttpResponse:
    add_never_cache_headers(response)  # Cache-Control: no-cache, no-store, must-revalidate, private
    return response


Handler = Callable[..., JsonResponse]


def endpoint(**methods: Handler) -> Callable[..., HttpResponse]:
    """A view dispatching by method to handlers, with auth, size limit and error mapping."""

    allowed = [*methods, "HEAD"] if "GET" in methods else list(methods)

    @csrf_exempt
    def view(request: HttpRequest, **kwargs: Any) -> HttpResponse:
        try:
            response = answer(request, kwargs)
        except SuspiciousOperation as exc:
            response = suspicious(exc)
        except Exception:
            response = internal_error(request)
        if request.method == "HEAD":
            response.content = b""  # GET's headers, no body
        return uncached(response)

    def answer(request: HttpRequest, kwargs: dict[str, Any]) -> HttpResponse:
        try:
            token = authorize(request, kwargs.get("name"))
            for key, value in kwargs.items():
                if isinstance(value, str) and "\x00" in value:  # PostgreSQL refuses the query
                    raise ApiError(404, "NotFound", f"no {key} contains a NUL character")
            handler = methods.get("GET" if request.method == "HEAD" else request.method or "")
            if handler is None:
                response = fail(
                    405,
                    "MethodNotAllowed",
                    f"{request.method} is not allowed here; allowed: {', '.join(allowed)}",
                )
                response["Allow"] = ", ".join(allowed)
                return response
            if request.GET and handler not in TAKES_QUERY:
                # Refused, not ignored: `DELETE …?force=1` must not look as if it was heard.
                raise ApiError(
                    400,
                    "InvalidInput",
                    f"unknown query parameter(s) {sorted(request.GET)}; none allowed here",
                )
            # Only where a body is read: a GET's is never read, so none is too large.
            length = request.META.get("CONTENT_LENGTH") or "0"
            if (
                request.method in WRITE_METHODS
                and length.isdigit()
                and len(length) < 20
                and int(length) > max_body_bytes()
            ):
                raise ApiError(
                    413,
                    "PayloadTooLarge",
                    f"request body of {length} bytes exceeds the API limit of {max_body_bytes()} bytes",
                )
            return handler(Call(request, token), **kwargs)
        except (ApiError, errors.WorkflowError) as exc:
            return refusal(exc)

    return view


def refusal(exc: ApiError | errors.WorkflowError) -> JsonResponse:
    """The JSON error answer for a refusal of the API layer or an engine error."""
    if isinstance(exc, errors.WorkflowError):
        return fail(error_status(exc), type(exc).__name__, str(exc))
    response = fail(exc.status, exc.code, str(exc))
    for header, value in exc.headers.items():
        response[header] = value
    if exc.status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="wfdash"'
    return response


def instance(name: str, instance_id: str) -> InstanceHandle:
    return surfaces.binding(name).get(instance_id)


# --- handlers ---------------------------------------------------------------------------


LIST_PARAMETERS = ("cursor", "limit", "status", "version", "attr.<key>")


def list_instances(call: Call, name: str) -> JsonResponse:
    query = call.request.GET
    unknown = sorted(
        k for k in query if k not in LIST_PARAMETERS[:-1] and not k.startswith(ATTR_PREFIX)
    )
    if unknown:
        raise ApiError(
            400,
            "InvalidInput",
            f"unknown query parameter(s) {unknown}; allowed: {', '.join(LIST_PARAMETERS)}",
        )
    repeated = sorted(k for k in LIST_PARAMETERS[:-1] if len(query.getlist(k)) > 1)
    if repeated:
        raise ApiError(
            400, "InvalidInput", f"{', '.join(repeated)} given more than once; give each once"
        )
    limit_text = query.get("limit", "50")
    if not LIMIT_PATTERN.fullmatch(limit_text):  # the range is the client's to check
        raise ApiError(
            400, "InvalidInput", f"limit must be an integer from 1 to 1000, got {limit_text[:20]!r}"
        )
    version_text = query.get("version")
    # Up to 10 digits: the client's check_version refuses past 2**31-1. LIMIT_PATTERN's 6
    # refused version=1000000, which the document allows, calling it not positive.
    if version_text is not None and not VERSION_PATTERN.fullmatch(version_text):
        raise ApiError(
            400,
            "InvalidInput",
            f"version must be an integer from 1 to 2147483647, got {version_text[:20]!r}",
        )
    page = surfaces.binding(name).list(
        status=query.get("status"),
        version=None if version_text is None else int(version_text),
        limit=int(limit_text),
        cursor=query.get("cursor"),
        attributes=attribute_filter(query),
    )
    return ok(
        [surfaces.info_json(i) for i in page.instances],
        result_info={"cursor": page.cursor, "per_page": int(limit_text)},
    )


ATTR_PREFIX = "attr."


def attribute_filter(query: Any) -> dict[str, Any]:
    """`?attr.customer=c-9&attr.seats=5`: exact matches; a number, true or false is typed
    (quote it, attr.seats="5", to find the string)."""
    pairs: dict[str, str] = {}
    for key in query:
        if key.startswith(ATTR_PREFIX):
            values = query.getlist(key)
            if len(values) > 1:
                raise ApiError(
                    400, "InvalidInput", f"{key} is given {len(values)} times; give it once"
                )
            pairs[key[len(ATTR_PREFIX) :]] = values[0]
    return parse_attribute_filter(pairs)


def list_workflows(call: Call) -> JsonResponse:
    """Every workflow (registered, or with instances) the token may see: versions and counts."""
    visible = set(call.token.workflow_names)
    return ok(
        [
            {"name": s.name, "versions": s.versions, "counts": s.counts, "total": s.total}
            for s in dashboard.workflow_summaries()
            if not visible or s.name in visible
        ]
    )


FLOW_CONTROL_FIELDS = ("priority", "concurrency_key", "debounce_key", "debounce")


def create_instance(call: Call, name: str) -> JsonResponse:
    body = call.object_body(
        {
            "id",
            "instance_id",
            "params",
            "idempotency_key",
            "retention",
            "attributes",
            *FLOW_CONTROL_FIELDS,
        }
    )
    ids = {key: body[key] for key in ("id", "instance_id") if key in body}
    if len(set(map(repr, ids.values()))) > 1:
        raise ApiError(
            400, "InvalidInput", "give the instance id as id or instance_id, not two different ids"
        )
    instance_id = next(iter(ids.values()), None)
    if ids and (not isinstance(instance_id, str) or not instance_id):
        raise ApiError(
            400, "InvalidInput", f"instance id must be a non-empty string, got {instance_id!r}"
        )
    handle = surfaces.binding(name).create(
        params=body.get("params"),
        id=instance_id,
        idempotency_key=body.get("idempotency_key"),
        actor=call.actor,
        retention=body.get("retention"),
        **{field: body[field] for field in FLOW_CONTROL_FIELDS if field in body},
        attributes=body.get("attributes"),
    )
    # 200 when an idempotency key found an instance created earlier: nothing new was made.
    return ok(surfaces.created_json(handle), status=201 if handle.created else 200)


def create_batch(call: Call, name: str) -> JsonResponse:
    items = call.body()
    if not isinstance(items, list):
        raise ApiError(
            400,
            "InvalidInput",
            f"request body must be a JSON array of instances, got {json_type(items)}",
        )
    handles = surfaces.binding(name).create_batch(items, actor=call.actor)
    return ok(
        [surfaces.created_json(h) for h in handles],
        status=201 if any(h.created for h in handles) else 200,
    )


# A GET of one instance shows at most this many of its steps (the newest, and every older
# one still open) and children (the newest); …/steps and …/children page through them all.
STEPS_IN_INSTANCE = 1000
CHILDREN_IN_INSTANCE = 1000


def get_instance(call: Call, name: str, instance_id: str) -> JsonResponse:
    data = surfaces.instance_json(
        instance(name, instance_id),
        steps=STEPS_IN_INSTANCE,
        open_steps=True,
        children=CHILDREN_IN_INSTANCE,
    )
    data["parent"] = visible_ref(call, data["parent"])
    data["children"] = [visible_ref(call, child) for child in data["children"]]
    return ok(data)


def visible_ref(call: Call, ref: dict[str, Any] | None) -> dict[str, Any] | None:
    """A parent or child link as this token may see it: the link itself (id, workflow,
    step: the instance's own history names them) always, the other end's status only when
    the token may read that workflow. A token limited to some workflows read the live
    status of instances of any other workflow through their parents or children."""
    visible = call.token.workflow_names
    if ref is not None and visible and ref["workflow"] not in visible:
        return {**ref, "status": None}
    return ref


def delete_instance(call: Call, name: str, instance_id: str) -> JsonResponse:
    """Only a finished instance: a live one is refused with 409 (terminate it first)."""
    call.object_body(set())
    instance(name, instance_id).delete(actor=call.actor)
    return ok({"id": instance_id, "workflow": name, "deleted": True})


BULK_FIELDS = {
    "action",
    "status",
    "version",
    "attributes",
    "created_before",
    "created_after",
    "event_type",
    "payload",
    "from_step",
    "to_version",
    "compensate",
}


def start_bulk_job(call: Call, name: str) -> JsonResponse:
    """202: the job runs in the background; GET its address for progress."""
    body = call.object_body(BULK_FIELDS)
    action = body.get("action")
    if action == BulkAction.DELETE:  # deleting needs more than changing
        refusal = tokens.refusal(call.token, True, name, tokens.DELETE_PERMISSION)
        if refusal:
            raise ApiError(403, "Forbidden", refusal)
    if not isinstance(action, str):
        raise ApiError(400, "InvalidInput", f"action must be one of {', '.join(BulkAction.values)}")
    version = body.get("version")
    if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
        raise ApiError(400, "InvalidInput", f"version must be an integer, got {json_type(version)}")
    compensate = body.get("compensate", True)
    if not isinstance(compensate, bool):
        raise ApiError(
            400, "InvalidInput", f"compensate must be true or false, got {json_type(compensate)}"
        )
    job = surfaces.binding(name).bulk(
        action,
        status=body.get("status"),
        version=version,
        attributes=body.get("attributes"),
        created_before=instant(body, "created_before"),
        created_after=instant(body, "created_after"),
        event_type=body.get("event_type"),
        payload=body.get("payload"),
        from_step=body.get("from_step"),
        compensate=compensate,
        actor=call.actor,
        to_version=body.get("to_version"),
    )
    return ok(surfaces.bulk_job_json(job), status=202)


def instant(body: dict[str, Any], key: str) -> datetime | None:
    """An ISO 8601 date-time with a UTC offset from the body, or None."""
    value = body.get(key)
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        parsed = None
    if parsed is None or parsed.tzinfo is None:
        raise ApiError(
            400,
            "InvalidInput",
            f"{key} must be an ISO 8601 date-time with an offset (2026-01-01T00:00:00Z), "
            f"got {str(value)[:40]!r}",
        )
    return parsed


def get_bulk_job(call: Call, name: str, job_id: int) -> JsonResponse:
    return ok(surfaces.bulk_job_json(surfaces.binding(name).bulk_job(job_id)))


HISTORY_PAGE = 1000  # records in a …/history response at most (a year-long instance has 100,000s)
STEPS_PAGE = 1000  # steps in a …/steps response at most
CHILDREN_PAGE = 1000  # children in a …/children response at most
PAGE_PARAMETERS = ("cursor", "limit")


def page_query(call: Call, page: int, what: str) -> tuple[int, int]:
    """The ?cursor= (an integer: `what` of the last item of the previous page; 0: from the
    start) and ?limit= (1 to `page`) of a paged read of one instance."""
    query = call.request.GET
    unknown = sorted(k for k in query if k not in PAGE_PARAMETERS)
    if unknown:
        raise ApiError(
            400, "InvalidInput", f"unknown query parameter(s) {unknown}; allowed: cursor, limit"
        )
    repeated = sorted(k for k in PAGE_PARAMETERS if len(query.getlist(k)) > 1)
    if repeated:
        raise ApiError(
            400, "InvalidInput", f"{', '.join(repeated)} given more than once; give each once"
        )
    limit_text = query.get("limit", str(page))
    if not LIMIT_PATTERN.fullmatch(limit_text) or not 1 <= int(limit_text) <= page:
        raise ApiError(
            400,
            "InvalidInput",
            f"limit must be an integer from 1 to {page}, got {limit_text[:20]!r}",
        )
    cursor_text = query.get("cursor", "0")
    if not CURSOR_PATTERN.fullmatch(cursor_text) or int(cursor_text) > MAX_PK:
        raise ApiError(
            400,
            "InvalidInput",
            f"cursor must be {what} (0 to {MAX_PK}), got {cursor_text[:30]!r}",
        )
    return int(cursor_text), int(limit_text)


def paged(
    items: list[Any], limit: int, cursor_of: Callable[[Any], int], as_json: Callable[[Any], Any]
) -> JsonResponse:
    """A page read with limit + 1 items: the first `limit`, and the next page's cursor
    (null on the last page)."""
    more = len(items) > limit
    items = items[:limit]
    return ok(
        [as_json(i) for i in items],
        result_info={"cursor": str(cursor_of(items[-1])) if more else None, "per_page": limit},
    )


def get_history(call: Call, name: str, instance_id: str) -> JsonResponse:
    """The records after ?cursor= (a history sequence; 0: from the start), at most ?limit=
    of them; result_info.cursor is the cursor of the next page (null on the last)."""
    after, limit = page_query(call, HISTORY_PAGE, "a history sequence")
    entries = instance(name, instance_id).history(after=after, limit=limit + 1)
    return paged(entries, limit, lambda h: h.sequence, surfaces.history_json)


def get_steps(call: Call, name: str, instance_id: str) -> JsonResponse:
    """The steps in start order after ?cursor= (result_info.cursor of the previous page;
    0: from the first), at most ?limit= of them."""
    after, limit = page_query(call, STEPS_PAGE, "a cursor this endpoint gave")
    rows = instance(name, instance_id).steps(after=after, limit=limit + 1)
    return paged(rows, limit, lambda s: s.seq, surfaces.step_json)


def get_children(call: Call, name: str, instance_id: str) -> JsonResponse:
    """The instances this one started, oldest first, after ?cursor= (result_info.cursor
    of the previous page; 0: from the first), at most ?limit= of them."""
    after, limit = page_query(call, CHILDREN_PAGE, "a cursor this endpoint gave")
    rows = instance(name, instance_id).children_rows(after=after, limit=limit + 1)
    return paged(
        rows,
        limit,
        lambda c: c.pk,
        lambda c: visible_ref(call, surfaces.ref_json(c, c.parent_step)),
    )


# The handlers that read a query string (their own check names what is allowed); every
# other one refuses any (endpoint).
TAKES_QUERY = frozenset({list_instances, get_history, get_steps, get_children})


def change_status(call: Call, name: str, instance_id: str) -> JsonResponse:
    body = call.object_body({"status", "from_step", "version"})
    action, from_step, version = body.get("status"), body.get("from_step"), body.get("version")
    if action not in ("pause", "resume", "terminate", "restart"):
        raise ApiError(
            400,
            "InvalidInput",
            f"status must be one of pause, resume, terminate, restart; got {action!r}",
        )
    if from_step is not None and (action != "restart" or not isinstance(from_step, str)):
        raise ApiError(
            400, "InvalidInput", "from_step must be a step name (a string), and only with restart"
        )
    if version is not None and action != "restart":
        raise ApiError(400, "InvalidInput", "version is taken only with restart")
    handle = instance(name, instance_id)
    if action == "restart":
        handle.restart(from_step=from_step, actor=call.actor, version=version)
    elif action == "terminate":
        if not handle.terminate(actor=call.actor):
            raise errors.InvalidTransition(
                f"cannot terminate instance {instance_id!r}: it has already finished"
            )
    else:
        getattr(handle, action)(actor=call.actor)
    return ok(state(handle))


def send_event(call: Call, name: str, instance_id: str, event_type: str) -> JsonResponse:
    payload = call.body()
    handle = instance(name, instance_id)
    handle.send_event(event_type, payload, actor=call.actor)
    return ok({"id": handle.id, "workflow": handle.workflow, "type": event_type})


def cancel(call: Call, name: str, instance_id: str) -> JsonResponse:
    compensate = call.object_body({"compensate"}).get("compensate", True)
    if not isinstance(compensate, bool):
        raise ApiError(
            400, "InvalidInput", f"compensate must be true or false, got {json_type(compensate)}"
        )
    handle = instance(name, instance_id)
    handle.cancel(compensate=compensate, actor=call.actor)
    return ok(state(handle))


def skip_sleep(call: Call, name: str, instance_id: str) -> JsonResponse:
    call.object_body(set())  # no options: an empty body or {}
    handle = instance(name, instance_id)
    skipped = handle.skip_sleep(actor=call.actor)
    return ok({**state(handle), "skipped": skipped})


def schedules_workflow(name: str) -> None:
    """UnknownWorkflow unless the workflow is registered, has instances, or has schedules:
    a schedule whose workflow left the code stays listed by every other surface, and
    operators must be able to see and delete it here too."""
    try:
        surfaces.binding(name)
    except errors.UnknownWorkflow:
        if not Schedule.objects.filter(workflow=name).exists():
            raise


def schedule_of(name: str, schedule: str) -> ScheduleHandle:
    """The schedule, only under the workflow it starts (token limits are per workflow)."""
    schedules_workflow(name)  # UnknownWorkflow first, as for instances
    try:
        found = schedules.get(schedule)
    except errors.ScheduleNotFound:
        found = None
    if found is None or found.workflow != name:
        # One answer whether the name is free or another workflow's: a token limited to
        # this workflow must not learn which schedules others have.
        raise errors.ScheduleNotFound(f"workflow {name!r} has no schedule {schedule!r}")
    return found


NEXT_RUNS_SHOWN = 5


def list_schedules(call: Call, name: str) -> JsonResponse:
    schedules_workflow(name)
    return ok([surfaces.schedule_json(s) for s in schedules.list(workflow=name)])


def require(call: Call, permission: str) -> None:
    """403 unless the token's user also holds `permission` (the dashboard's and the
    admin's rule for schedules): a token never does more than its user may."""
    refused = tokens.refusal(call.token, True, permission=permission)
    if refused:
        raise ApiError(403, "Forbidden", refused)


def create_schedule(call: Call, name: str) -> JsonResponse:
    require(call, "workflows_app.add_schedule")
    body = call.object_body({"name", "cron", "timezone", "params"})
    missing = sorted({"name", "cron"} - set(body))
    if missing:
        raise ApiError(400, "InvalidInput", f"missing field(s) {missing}")
    created = schedules.create(
        body["name"],
        workflow=name,
        cron=body["cron"],
        params=body.get("params"),
        timezone=body.get("timezone", "UTC"),
        actor=call.actor,
    )
    return ok(surfaces.schedule_json(created, NEXT_RUNS_SHOWN), status=201)


def get_schedule(call: Call, name: str, schedule: str) -> JsonResponse:
    return ok(surfaces.schedule_json(schedule_of(name, schedule), NEXT_RUNS_SHOWN))


def change_schedule(call: Call, name: str, schedule: str) -> JsonResponse:
    require(call, "workflows_app.change_schedule")
    paused = call.object_body({"paused"}).get("paused")
    if not isinstance(paused, bool):
        raise ApiError(
            400, "InvalidInput", f"paused must be true or false, got {json_type(paused)}"
        )
    found = schedule_of(name, schedule)
    changed = found.pause() if paused else found.resume()
    return ok(surfaces.schedule_json(changed, NEXT_RUNS_SHOWN))


def delete_schedule(call: Call, name: str, schedule: str) -> JsonResponse:
    require(call, "workflows_app.delete_schedule")
    # No options, as for an instance: `{"force": true}` is refused, not ignored.
    call.object_body(set())
    schedule_of(name, schedule).delete()
    return ok({"name": schedule, "workflow": name, "deleted": True})


def trigger_schedule(call: Call, name: str, schedule: str) -> JsonResponse:
    require(call, "workflows_app.change_schedule")
    call.object_body(set())  # no options: an empty body or {}
    handle = schedule_of(name, schedule).trigger(actor=call.actor)
    return ok(surfaces.created_json(handle), status=201)


def state(handle: InstanceHandle) -> dict[str, Any]:
    return {"id": handle.id, "workflow": handle.workflow, "status": handle.status().status}


OPENAPI_PATH = "/api/openapi.json"  # where workflows_app.urls serves it, under any prefix


@csrf_exempt
def openapi_document(request: HttpRequest) -> HttpResponse:
    """Public: the description of the API, without any data. Marked no-store like every
    other API answer (the document says so of all of them): it changes with a deploy."""
    if request.method not in ("GET", "HEAD"):
        response = fail(
            405, "MethodNotAllowed", f"{request.method} is not allowed here; allowed: GET, HEAD"
        )
        response["Allow"] = "GET, HEAD"
        return uncached(response)
    try:
        mount = (
            request.path.removesuffix(OPENAPI_PATH) if request.path.endswith(OPENAPI_PATH) else ""
        )
        response = JsonResponse(openapi.document(mount))
    except Exception:
        return uncached(internal_error(request))
    if request.method == "HEAD":
        response.content = b""
    return uncached(response)


SSE_HEARTBEAT_SECONDS = 15.0  # a comment line this often: proxies keep an idle stream open
SSE_RETRY_MS = 2000  # how soon an EventSource reconnects (with Last-Event-ID) after a drop
CURSOR_PATTERN = re.compile(r"[0-9]{1,19}")


SSE_RECHECK_SECONDS = 1.0  # a stream re-checks its token or session at most this often


def subscription_credentials(request: HttpRequest, name: str) -> Callable[[], bool]:
    """Whether the stream's credentials still hold, read afresh: the same token (not
    revoked, not expired, its user and issuer still allowed) or the same session."""
    secret = bearer_secret(request)
    if secret:

        def token_holds() -> bool:
            token = tokens.authenticate(secret)
            return token is not None and not tokens.refusal(token, write=False, workflow=name)

        return token_holds
    session_key = getattr(request.session, "session_key", None)
    user_pk = request.user.pk
    return lambda: access.session_may_view(session_key, user_pk)


def open_subscription(request: HttpRequest, name: str, instance_id: str) -> tuple[Any, int]:
    """Authorise a history stream and find where it starts.

    A bearer token, as for every API read; or, without one, a session of a staff user
    who may view the dashboard. It starts after the Last-Event-ID header (an EventSource
    reconnecting) or ?cursor= (a history sequence; default 0: the whole history).
    """
    if bearer_secret(request) or not access.may_view(request.user):
        authorize(request, name)
    if request.method not in ("GET", "HEAD"):
        error = ApiError(
            405, "MethodNotAllowed", f"{request.method} is not allowed here; allowed: GET, HEAD"
        )
        error.headers["Allow"] = "GET, HEAD"
        raise error
    unknown = sorted(set(request.GET) - {"cursor"})
    if unknown:
        raise ApiError(
            400, "InvalidInput", f"unknown query parameter(s) {unknown}; allowed: cursor"
        )
    if "\x00" in name + instance_id:  # PostgreSQL refuses the query
        raise ApiError(404, "NotFound", "no workflow or instance id contains a NUL character")
    handle = instance(name, instance_id)
    text = request.headers.get("Last-Event-ID") or request.GET.get("cursor", "0")
    if not CURSOR_PATTERN.fullmatch(text) or int(text) > MAX_PK:
        raise ApiError(
            400,
            "InvalidInput",
            f"Last-Event-ID / cursor must be a history sequence (0 to {MAX_PK}), got {text[:30]!r}",
        )
    return handle, int(text)


@csrf_exempt
async def subscribe(request: HttpRequest, name: str, instance_id: str) -> HttpResponse:
    """GET …/subscribe: the instance's history as Server-Sent Events (`id:` = sequence),
    live until it finishes. Async: a stream waits in the event loop, not in a thread."""
    try:
        handle, cursor = await sync_to_async(open_subscription)(request, name, instance_id)
    except (ApiError, errors.WorkflowError) as exc:
        return uncached(refusal(exc))
    except SuspiciousOperation as exc:
        return uncached(suspicious(exc))
    except Exception:
        return uncached(internal_error(request))
    if request.method == "HEAD":  # as every GET: its headers, and no stream to hold open
        response = HttpResponse(content_type="text/event-stream")
        response["X-Accel-Buffering"] = "no"
        return uncached(response)
    allowed = await sync_to_async(subscription_credentials)(request, name)
    response = StreamingHttpResponse(
        history_events(handle, cursor, allowed, stream_owner(request)),
        content_type="text/event-stream",
    )
    response["X-Accel-Buffering"] = "no"  # nginx: pass each event on at once
    return uncached(response)


# Open history streams of each client (a token, or a session's user) in this process.
_open_streams: Counter[tuple[str, Any]] = Counter()


def stream_owner(request: HttpRequest) -> tuple[str, Any]:
    """Whose history stream this is, for the cap on open streams: the bearer token (by its
    secret's hash: no read) or the session's user."""
    secret = bearer_secret(request)
    if secret:
        return ("token", hashlib.sha256(secret.encode()).hexdigest())
    return ("user", request.user.pk)


async def history_events(
    handle: InstanceHandle,
    cursor: int,
    allowed: Callable[[], bool] | None = None,
    owner: tuple[str, Any] | None = None,
) -> AsyncIterator[str]:
    """SSE text: one `message` per history record, heartbeat comments while none comes,
    and an `end` event after the last record of a finished instance. Ends (`event: end`
    with a reason) once its credentials no longer hold, checked at most every
    SSE_RECHECK_SECONDS, before a record is sent; or at once when its owner holds
    WFDASH["MAX_SOCKETS_PER_USER"] streams open in this process already (each stream
    holds a history listener: one client could open them without end). Counted here, in
    the stream, so one whose response is never sent holds nothing."""
    yield f"retry: {SSE_RETRY_MS}\n: history of {handle.workflow}/{handle.id} after {cursor}\n\n"
    if owner is not None:
        cap = socket_slots.max_sockets_per_user()
        if _open_streams[owner] >= cap:
            reason = json.dumps(
                {"reason": f"too many history streams open ({cap}, WFDASH_MAX_SOCKETS_PER_USER)"}
            )
            yield f"event: end\ndata: {reason}\n\n"
            return
        _open_streams[owner] += 1
    try:
        async with contextlib.aclosing(_history_event_texts(handle, cursor, allowed)) as texts:
            async for text in texts:
                yield text
    finally:
        if owner is not None:
            _open_streams[owner] -= 1
            if not _open_streams[owner]:
                del _open_streams[owner]


async def _history_event_texts(
    handle: InstanceHandle, cursor: int, allowed: Callable[[], bool] | None
) -> AsyncIterator[str]:
    records = handle.asubscribe(cursor)
    pending: asyncio.Future[Any] | None = None
    checked = time.monotonic()

    async def still_allowed() -> bool:
        nonlocal checked
        if allowed is None or time.monotonic() - checked < SSE_RECHECK_SECONDS:
            return True
        checked = time.monotonic()
        return await sync_to_async(allowed)()

    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(records))
            done, _ = await asyncio.wait({pending}, timeout=SSE_HEARTBEAT_SECONDS)
            if not await still_allowed():
                yield 'event: end\ndata: {"reason": "credentials no longer valid"}\n\n'
                return
            if not done:
                yield ": heartbeat\n\n"
                continue
            try:
                entry = pending.result()
            except StopAsyncIteration:
                pending = None
                break
            pending = None
            data = json.dumps(surfaces.history_json(entry), separators=(",", ":"))
            yield f"id: {entry.sequence}\ndata: {data}\n\n"
        yield "event: end\ndata: {}\n\n"
    finally:
        if pending is not None:  # the client went away while the stream waited
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        await records.aclose()


@csrf_exempt
def prometheus_metrics(request: HttpRequest) -> HttpResponse:
    """GET /metrics: every wfdash metric in Prometheus text. A bearer token that may read
    every workflow (read or write scope), or a staff session that may view the dashboard.
    CSRF-exempt as the API is: it changes nothing, whatever the method, and a token client's
    POST must get the JSON 405, not Django's HTML page about a missing CSRF cookie."""
    from . import metrics

    try:
        if bearer_secret(request) or not access.may_view(request.user):
            token = authorize(request, None)
            if token.workflows:
                raise ApiError(
                    403,
                    "Forbidden",
                    f"token {token.name!r} is limited to the workflows {token.workflow_names}; "
                    "metrics cover every workflow",
                )
        if request.method not in ("GET", "HEAD"):
            raise ApiError(
                405,
                "MethodNotAllowed",
                f"{request.method} is not allowed here; allowed: GET, HEAD",
                {"Allow": "GET, HEAD"},
            )
        if not getattr(settings, "WFDASH", {}).get("METRICS", True):
            # scrape() would install the meter provider the setting left out, and the
            # engine's instruments would start counting in this process.
            raise ApiError(
                404,
                "MetricsOff",
                'metrics are switched off in this deployment (WFDASH["METRICS"] = False)',
            )
        body = metrics.scrape() if request.method == "GET" else b""
    except ApiError as exc:
        return uncached(refusal(exc))
    except DatabaseError:
        # Prometheus marks the target down (up 0) instead of reading gauges that are missing.
        log.warning("GET /metrics: the database did not answer", exc_info=True)
        return uncached(
            refusal(
                ApiError(
                    503,
                    "DatabaseUnavailable",
                    "the database did not answer the metrics' queries; try again",
                    {"Retry-After": "15"},
                )
            )
        )
    return uncached(HttpResponse(body, content_type=metrics.CONTENT_TYPE_LATEST))


@csrf_exempt
def not_found(request: HttpRequest, path: str = "") -> HttpResponse:
    """Any other path under /api/: a JSON 404 (never Django's HTML page), before any auth."""
    return uncached(fail(404, "NotFound", f"no API route {request.path!r}; see /api/openapi.json"))


workflows = endpoint(GET=list_workflows)
instances = endpoint(GET=list_instances, POST=create_instance)
batch = endpoint(POST=create_batch)
bulk_jobs = endpoint(POST=start_bulk_job)
bulk_job = endpoint(GET=get_bulk_job)
detail = endpoint(GET=get_instance, DELETE=delete_instance)
history = endpoint(GET=get_history)
steps = endpoint(GET=get_steps)
children = endpoint(GET=get_children)
status = endpoint(PATCH=change_status)
events = endpoint(POST=send_event)
cancel_view = endpoint(POST=cancel)
skip_sleep_view = endpoint(POST=skip_sleep)
schedules_view = endpoint(GET=list_schedules, POST=create_schedule)
schedule_view = endpoint(GET=get_schedule, PATCH=change_schedule, DELETE=delete_schedule)
trigger_view = endpoint(POST=trigger_schedule)
