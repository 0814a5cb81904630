"""The public API: get_workflow → WorkflowBinding → InstanceHandle.

Sync methods for ordinary Django code, async twins prefixed `a` (Django style). Every
state change is one transaction in the engine's store; after it commits, workers are
hinted (in this process directly, in others through the channel layer) and dashboards
are told through live.py.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import functools
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import referencing.exceptions
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import DatabaseError, transaction
from django.db.models import Q, QuerySet

from . import live
from .codec import seal
from .converters import MAX_PK
from .engine import errors, meters, spans, store
from .engine.attributes import check_attributes
from .engine.durations import parse_duration
from .engine.limits import (
    Limits,
    check_event_type,
    check_instance_id,
    check_size,
    check_text,
    encode_json,
)
from .engine.registry import MAX_VERSION, Definition, all_definitions, get_definition, limits_for
from .engine.retention import parse_retention
from .engine.schemas import CHECK_RECURSED, event_validator
from .engine.store import NewInstance
from .engine.store.subscriptions import HistoryFollower, history_listener
from .engine.worker import running_in_this_process
from .models import (
    BulkAction,
    BulkJob,
    HistoryRecord,
    Instance,
    Status,
    StepKind,
    StepRecord,
    StepStatus,
    decode_json,
    open_history_data,
)
from .scheduling import ScheduleHandle, schedules
from .text import one_line
from .tracing import flush_spans

log = logging.getLogger("workflows_app.client")

DEFAULT_PRIORITY = 5  # 0-9; lower starts first while queued


@dataclass(frozen=True)
class InstanceStatus:
    status: str
    output: Any
    error: dict[str, str] | None
    waiting_reason: str = ""


@dataclass(frozen=True)
class InstanceInfo:
    id: str
    workflow: str
    version: int
    status: str
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    error: dict[str, str] | None
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Page:
    instances: list[InstanceInfo]
    cursor: str | None


@dataclass(frozen=True)
class HistoryEntry:
    sequence: int
    created_at: datetime
    type: str
    data: dict[str, Any]
    actor: str


@dataclass(frozen=True)
class PendingEvent:
    name: str
    type: str
    timeout_at: datetime | None
    schema: dict[str, Any] | None


def get_workflow(name: str) -> WorkflowBinding:
    """The binding of a registered workflow; UnknownWorkflow if there is none of that name."""
    get_definition(name)
    return WorkflowBinding(name)


def _after_commit(
    kind: str,
    instance: Instance | int | None = None,
    workflow: str | None = None,
    hinted: bool = False,
) -> None:
    """Tell workers (unless the store's transaction did: hinted) and dashboards."""
    pk = instance.pk if isinstance(instance, Instance) else instance
    if not hinted:
        store.hint_workers(kind, [pk])  # PostgreSQL: delivered to every worker at commit
    notified = store.workers_listen()  # then no hint through Redis as well
    transaction.on_commit(lambda: live.instance_changed(kind, pk, workflow, notified))


def count_ended_on_commit(workflow: str, status: str) -> None:
    """An instance an operator ended, in the metrics once its transaction commits (a bulk
    job's batch that rolls back and is taken again counts it once)."""
    transaction.on_commit(functools.partial(meters.instance_finished, workflow, status))


def _actor(actor: Any) -> str:
    """Who acted, as history records it: text both databases store (a NUL was a DataError
    on PostgreSQL and stored on SQLite; a lone surrogate a UnicodeEncodeError)."""
    if actor is None:
        return ""
    return check_text(str(getattr(actor, "username", actor))[:200], "actor")


class WorkflowBinding:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<WorkflowBinding {self.name!r}>"

    def definition(self, version: int | None = None) -> Definition:
        return get_definition(self.name, version)

    # --- create ---------------------------------------------------------------------

    def create(
        self,
        params: Any = None,
        id: str | None = None,
        idempotency_key: str | None = None,
        actor: Any = None,
        version: int | None = None,
        retention: Any = None,
        *,
        priority: int = DEFAULT_PRIORITY,
        concurrency_key: str | None = None,
        debounce_key: str | None = None,
        debounce: Any = None,
        attributes: dict[str, Any] | None = None,
    ) -> InstanceHandle:
        """Start an instance (`queued` while flow control holds it back).

        priority 0-9 (lower starts first while queued); concurrency_key with
        limits={"max_concurrent_per_key": N}; debounce_key + debounce: an instance of that
        key not started yet takes these params (and attributes) and starts `debounce` from
        now (returned with created=False), else a new one starts after `debounce`.
        attributes: search attributes (str/int/float/bool values) the list filters by.
        """
        item = {"id": id, "params": params, "idempotency_key": idempotency_key}
        item.update(retention=retention, priority=priority, concurrency_key=concurrency_key)
        item.update(debounce_key=debounce_key, debounce=debounce, attributes=attributes)
        return self._create([item], actor, version)[0]

    def create_batch(
        self, items: Sequence[dict[str, Any]], actor: Any = None, version: int | None = None
    ) -> list[InstanceHandle]:
        """Start several instances, all or none; at most max_batch_size.

        An empty list starts nothing and returns [], as Cloudflare's createBatch does.
        """
        definition = self.definition(version)
        limits = definition.limits()
        if not isinstance(items, (list, tuple)):
            raise errors.InvalidInput(
                f"create_batch expects a list of {{id, params}} objects, got {type(items).__name__}"
            )
        if len(items) > limits.max_batch_size:
            raise errors.LimitExceeded(
                "max_batch_size", len(items), limits.max_batch_size, "create_batch"
            )
        if not items:
            return []
        return self._create(items, actor, version)

    def _create(
        self,
        items: Sequence[dict[str, Any]],
        actor: Any,
        version: int | None,
        queue: str | None = None,
    ) -> list[InstanceHandle]:
        """queue: a Django task's queue_name (workflows_app.tasks): the instances' queue,
        which workers started for some queues only claim by."""
        definition = self.definition(version)
        limits = definition.limits()
        new: list[NewInstance] = []
        for position, item in enumerate(items):
            if not isinstance(item, dict):
                raise errors.InvalidInput(
                    f"batch item {position} must be an object with id and params"
                )
            unknown = set(item) - ITEM_FIELDS
            if unknown:
                raise errors.InvalidInput(
                    f"batch item {position}: unknown field(s) {sorted(unknown)}"
                )
            instance_id = item.get("id") if item.get("id") is not None else item.get("instance_id")
            if instance_id is None:
                instance_id = str(uuid.uuid4())
            check_instance_id(instance_id, limits)
            params_json = encode_json(item.get("params"), f"params of instance {instance_id!r}")
            check_size(
                params_json,
                "max_params_bytes",
                limits.max_params_bytes,
                f"params of instance {instance_id!r}",
            )
            key = item.get("idempotency_key")
            if key is not None and (not isinstance(key, str) or not key or len(key) > 200):
                raise errors.InvalidInput(
                    f"idempotency_key must be a string of 1-200 characters, got {key!r}"
                )
            if key is not None:
                check_text(key, "idempotency_key")
            success_ms, error_ms = parse_retention(item.get("retention"))
            new.append(
                NewInstance(
                    instance_id,
                    seal(params_json),
                    key,
                    success_ms,
                    retention_error_ms=error_ms,
                    attributes=check_attributes(
                        item.get("attributes"), f"attributes of instance {instance_id!r}"
                    ),
                    **flow_control(item, limits),
                    queue=queue,
                )
            )
        created = store.create_instances(
            definition.name, definition.version, limits, new, _actor(actor)
        )
        for instance, is_new in created:
            if is_new:
                spans.creation_span(
                    instance.trace_id,
                    instance.pk,
                    self.name,
                    instance.instance_id,
                    actor=_actor(actor),
                )
                _after_commit("created", instance, self.name, hinted=True)  # by the store
        if not running_in_this_process():
            try:
                flush_spans()  # no engine here to store the `create` spans (a fleet's web process)
            except DatabaseError:  # the instances exist; a span is not worth failing the create
                log.warning("could not store the create spans of %s", self.name, exc_info=True)
        return [
            InstanceHandle(self.name, instance.instance_id, instance, created=is_new)
            for instance, is_new in created
        ]

    async def acreate(self, *args: Any, **kwargs: Any) -> InstanceHandle:
        return await sync_to_async(self.create)(*args, **kwargs)

    async def acreate_batch(self, *args: Any, **kwargs: Any) -> list[InstanceHandle]:
        return await sync_to_async(self.create_batch)(*args, **kwargs)

    # --- read -----------------------------------------------------------------------

    def get(self, id: str) -> InstanceHandle:
        """The instance of this workflow with that id; InstanceNotFound otherwise."""
        if not isinstance(id, str):
            raise errors.InvalidInput(f"instance id must be a string, got {errors.shown(id)}")
        return InstanceHandle(self.name, id, store.get_instance(self.name, id))

    async def aget(self, id: str) -> InstanceHandle:
        return await sync_to_async(self.get)(id)

    def list(
        self,
        status: str | None = None,
        version: int | None = None,
        limit: int = 50,
        cursor: str | None = None,
        attributes: dict[str, Any] | None = None,
        created_before: datetime | None = None,
        created_after: datetime | None = None,
    ) -> Page:
        """Newest first, keyset-paginated: stable while instances are being created.

        attributes: exact matches, every key must hold that value.
        """
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 1000:
            raise errors.InvalidInput(
                f"limit must be an integer from 1 to 1000, got {errors.shown(limit)}"
            )
        query = self.matching(status, version, attributes, created_before, created_after)
        if cursor:
            query = query.filter(id__lt=decode_cursor(cursor))
        sorted_range = not attributes and store.reads_created_range(created_before, created_after)
        rows = list(store.order_by_id(query, sorted_range=sorted_range)[: limit + 1])
        more = len(rows) > limit
        rows = rows[:limit]
        return Page(
            [instance_info(r) for r in rows], encode_cursor(rows[-1].pk) if more and rows else None
        )

    def matching(
        self,
        status: str | None = None,
        version: int | None = None,
        attributes: dict[str, Any] | None = None,
        created_before: datetime | None = None,
        created_after: datetime | None = None,
    ) -> QuerySet[Instance]:
        """The instances of this workflow a filter selects (list() and bulk() share it)."""
        if status is not None and status not in Status.values:
            raise errors.InvalidInput(
                f"unknown status {status!r}; statuses: {', '.join(Status.values)}"
            )
        if version is not None:
            check_version(version)
        query = Instance.objects.filter(workflow=self.name)
        if status is not None:
            query = query.filter(status=status)
        if version is not None:
            query = query.filter(version=version)
        for name, bound, lookup in (
            ("created_before", created_before, "created_at__lt"),
            ("created_after", created_after, "created_at__gte"),
        ):
            if bound is not None:
                if not isinstance(bound, datetime) or bound.tzinfo is None:
                    raise errors.InvalidInput(f"{name} must be an aware datetime, got {bound!r}")
                try:  # one instant both databases take (PostgreSQL: offsets to 15:59 only)
                    in_utc = bound.astimezone(UTC)
                except OverflowError:
                    raise errors.InvalidInput(
                        f"{name} {bound.isoformat()} is out of range: in UTC it falls "
                        "outside the years 1 to 9999"
                    ) from None
                query = query.filter(**{lookup: in_utc})
        return store.filter_attributes(query, check_attributes(attributes, "attribute filter"))

    async def alist(self, *args: Any, **kwargs: Any) -> Page:
        return await sync_to_async(self.list)(*args, **kwargs)

    # --- bulk -------------------------------------------------------------------------

    def bulk(
        self,
        action: str,
        *,
        status: str | None = None,
        version: int | None = None,
        attributes: dict[str, Any] | None = None,
        created_before: datetime | None = None,
        created_after: datetime | None = None,
        event_type: str | None = None,
        payload: Any = None,
        from_step: str | None = None,
        compensate: bool = True,
        actor: Any = None,
        to_version: int | None = None,
    ) -> BulkJobHandle:
        """Apply an action to every instance the filter matches now, in the background.

        The matching instances are fixed when the job starts; workers (or `wf bulk`) apply
        the action in batches. send_event takes event_type and payload; restart from_step
        and to_version (the version they run on from then on); cancel compensate. Returns the job: .done, .matched, .applied, .refresh().
        """
        instances = self.matching(status, version, attributes, created_before, created_after)
        options = self.bulk_options(
            action, event_type, payload, from_step, compensate, to_version, instances
        )
        shown: dict[str, Any] = {
            "status": status,
            "version": version,
            "attributes": attributes or None,
            "created_before": created_before.isoformat() if created_before else None,
            "created_after": created_after.isoformat() if created_after else None,
        }
        return start_bulk_job(
            self.name,
            action,
            instances,
            {k: v for k, v in shown.items() if v is not None},
            options,
            actor,
        )

    async def abulk(self, *args: Any, **kwargs: Any) -> BulkJobHandle:
        return await sync_to_async(self.bulk)(*args, **kwargs)

    def bulk_job(self, id: int) -> BulkJobHandle:
        """A bulk job of this workflow by id; BulkJobNotFound if there is none."""
        return BulkJobHandle.find(id, self.name)

    def bulk_options(
        self,
        action: str,
        event_type: str | None,
        payload: Any,
        from_step: str | None,
        compensate: bool,
        to_version: int | None = None,
        instances: QuerySet[Instance] | None = None,
    ) -> dict[str, Any]:
        """Check the action and its options once, before any instance is touched.
        `instances`: the selection it applies to (a sent payload must fit each one's own
        version's limits); every instance of the workflow if None."""
        if action not in BulkAction.values:
            raise errors.InvalidInput(
                f"unknown bulk action {action!r}; actions: {', '.join(BulkAction.values)}"
            )
        given = {
            "event_type": event_type is not None,
            "payload": payload is not None,
            "from_step": from_step is not None,
            "compensate": compensate is not True,
            "to_version": to_version is not None,
        }
        allowed = BULK_OPTIONS.get(action, set())
        misplaced = sorted(k for k, present in given.items() if present and k not in allowed)
        if misplaced:
            raise errors.InvalidInput(
                f"bulk {action} takes no {', '.join(misplaced)}"
                + (f" (it takes {', '.join(sorted(allowed))})" if allowed else "")
            )
        if action == BulkAction.SEND_EVENT:
            if event_type is None:
                raise errors.InvalidInput("bulk send_event needs event_type")
            check_event_type(event_type)
            payload_json = encode_json(payload, f"payload of event {event_type!r}")
            with contextlib.suppress(errors.UnknownWorkflow):
                self.definition()  # a lazily registered workflow's versions are then known
            if instances is None:
                instances = Instance.objects.filter(workflow=self.name)
            check_event_payload_fits_selection(event_type, payload_json, instances)
            # Sealed as a sent event's payload is: the job keeps it until every send is made.
            # As JSON text (see BulkJob.event_payload), so it is sent exactly as given.
            return {"event_type": event_type, "payload_json": seal(payload_json)}
        if action == BulkAction.RESTART:
            if from_step is not None and (not isinstance(from_step, str) or not from_step):
                raise errors.InvalidInput(f"from_step must be a step name, got {from_step!r}")
            if from_step is not None:
                check_text(from_step, "from_step")
            if to_version is not None:
                check_version(to_version, "to_version")
                InstanceHandle(self.name, "")._workflow_version(to_version)  # registered?
            return {
                **({"from_step": from_step} if from_step else {}),
                **({"to_version": to_version} if to_version is not None else {}),
            }
        if action == BulkAction.CANCEL:
            if not isinstance(compensate, bool):
                raise errors.InvalidInput(f"compensate must be True or False, got {compensate!r}")
            return {"compensate": compensate}
        return {}

    # --- delete -----------------------------------------------------------------------

    def delete_batch(self, ids: Sequence[str], actor: Any = None) -> int:
        """Delete finished instances with every row of theirs, all or none (at most
        max_batch_size); a live one is refused with InvalidTransition: terminate it first."""
        if not isinstance(ids, (list, tuple)) or not all(isinstance(i, str) for i in ids):
            raise errors.InvalidInput(f"delete_batch expects a list of instance ids, got {ids!r}")
        maximum = self._batch_limit()
        if len(ids) > maximum:
            raise errors.LimitExceeded("max_batch_size", len(ids), maximum, "delete_batch")
        if not ids:
            return 0
        pks = store.delete_instances(self.name, ids)
        for pk in pks:
            _after_commit("deleted", pk, self.name)
        if pks:
            who = one_line(_actor(actor)) or "-"  # the caller's text: one log line, escaped
            log.info("%s deleted %d instance(s) of %s", who, len(pks), self.name)
        return len(pks)

    async def adelete_batch(self, *args: Any, **kwargs: Any) -> int:
        return await sync_to_async(self.delete_batch)(*args, **kwargs)

    def _batch_limit(self) -> int:
        try:
            return self.definition().limits().max_batch_size
        except errors.UnknownWorkflow:  # its code is gone; its instances can still go
            return Limits.build(getattr(settings, "WFDASH", {}).get("LIMITS")).max_batch_size


ITEM_FIELDS = frozenset(
    {
        "id",
        "instance_id",
        "params",
        "idempotency_key",
        "retention",
        "attributes",
        "priority",
        "concurrency_key",
        "debounce_key",
        "debounce",
    }
)


def _key(item: dict[str, Any], field: str) -> str | None:
    value = item.get(field)
    if value is not None and (not isinstance(value, str) or not value or len(value) > 200):
        raise errors.InvalidInput(f"{field} must be a string of 1-200 characters, got {value!r}")
    return value if value is None else check_text(value, field)


def flow_control(item: dict[str, Any], limits: Limits) -> dict[str, Any]:
    """The flow-control fields of a create item, checked: priority, concurrency_key,
    debounce_key with debounce. InvalidInput names the field that is wrong."""
    priority = item.get("priority")
    if priority is None:
        priority = DEFAULT_PRIORITY
    if not isinstance(priority, int) or isinstance(priority, bool) or not 0 <= priority <= 9:
        raise errors.InvalidInput(
            f"priority must be an integer from 0 to 9, got {errors.shown(priority)}"
        )
    debounce_key, debounce = _key(item, "debounce_key"), item.get("debounce")
    if (debounce_key is None) != (debounce is None):
        raise errors.InvalidInput("debounce_key and debounce go together: give both or neither")
    debounce_ms = None if debounce is None else parse_duration(debounce)
    if debounce_ms is not None and debounce_ms > limits.max_sleep:
        raise errors.LimitExceeded(
            "max_sleep", f"{debounce_ms} ms", f"{limits.max_sleep} ms", "debounce"
        )
    return {
        "priority": priority,
        "concurrency_key": _key(item, "concurrency_key"),
        "debounce_key": debounce_key,
        "debounce_ms": debounce_ms,
    }


def encode_cursor(pk: int) -> str:
    return base64.urlsafe_b64encode(f"id:{pk}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> int:
    """The instance pk a list cursor (encode_cursor's) stands for; InvalidInput for any
    other text: int() also took "id: 5", "id:1_0", "id:-5" and ids past a bigint, which
    listed other pages or none instead of saying the cursor was not one."""
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        if not CURSOR_TEXT.fullmatch(text) or not 0 < int(text[3:]) <= MAX_PK:
            raise ValueError
        return int(text[3:])
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise errors.InvalidInput(f"invalid cursor {cursor[:40]!r}") from None


CURSOR_TEXT = re.compile(r"id:[0-9]{1,19}")


# Steps an operator may act on (retry, skip a sleep, send an event): shown however old.
OPEN_STEP_STATUSES = (StepStatus.RUNNING, StepStatus.RETRYING, StepStatus.WAITING)


def wait_seconds(name: str, value: Any) -> float | None:
    """How long a caller waits, in seconds: None or inf (or past 1e18) is no bound. NaN
    waited for ever (no comparison with it is true), a string failed with TypeError and
    an integer float() cannot take with OverflowError, none naming the argument."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise errors.InvalidInput(
            f"{name} must be a number of seconds, 0 or more (or None: no bound), "
            f"got {errors.shown(value)}"
        )
    return float(value) if value < 1e18 else float("inf")


def _check_page(after: Any, limit: Any) -> None:
    if not isinstance(after, int) or isinstance(after, bool) or not 0 <= after <= MAX_PK:
        raise errors.InvalidInput(
            f"after must be a cursor from 0 to {MAX_PK}, got {errors.shown(after)}"
        )
    check_row_count("limit", limit, 1, none_allowed=True)


def check_row_count(
    name: str, value: Any, least: int, most: int = MAX_PK, none_allowed: bool = False
) -> None:
    """How many rows to read (a page's limit, the newest n): an integer from `least` to
    `most`, at most MAX_PK, what a database's LIMIT takes. One past it was "datatype
    mismatch" from SQLite and "bigint out of range" from PostgreSQL, naming neither the
    argument nor its range."""
    if value is None and none_allowed:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not least <= value <= most:
        raise errors.InvalidInput(
            f"{name} must be an integer from {least} to {most}"
            f"{' or None' if none_allowed else ''}, got {errors.shown(value)}"
        )


def check_event_payload_fits(
    workflow: str, version: int, event_type: str, payload_json: str
) -> None:
    """The one size check of a sent event's payload (a single send, the admin's, the
    dashboard's, a bulk job's): against the limits of the instance's own version, which
    may allow more than the newest's; a refusal names the workflow, version and limit."""
    check_size(
        payload_json,
        "max_event_payload_bytes",
        limits_for(workflow, version).max_event_payload_bytes,
        f"payload of event {event_type!r} for {workflow} version {version}",
    )


def check_event_payload_fits_selection(
    event_type: str, payload_json: str, instances: QuerySet[Instance]
) -> None:
    """check_event_payload_fits for each workflow version a selection holds, before any
    instance is sent to. Only the versions whose limit the payload exceeds are looked for in
    the selection (one query), not every version of a big one."""
    check_text(payload_json, f"payload of event {event_type!r}")  # its size is countable
    size = len(payload_json.encode())
    pairs = instances.order_by("workflow", "version").values_list("workflow", "version")
    registered = [(d.name, d.version) for d in all_definitions()]
    refusing = [
        (name, version)
        for name, version in registered
        if size > limits_for(name, version).max_event_payload_bytes
    ]
    if refusing and (found := pairs.filter(either_version(refusing)).first()) is not None:
        check_event_payload_fits(*found, event_type, payload_json)
    # A version whose code is gone has its workflow's newest limits, or the settings':
    # looked for only when the payload exceeds the smallest of those.
    settings_limits = Limits.build(getattr(settings, "WFDASH", {}).get("LIMITS"))
    smallest = min(
        [settings_limits.max_event_payload_bytes]
        + [limits_for(name, version).max_event_payload_bytes for name, version in registered]
    )
    if size <= smallest:
        return
    gone = pairs.exclude(either_version(registered)) if registered else pairs
    while (found := gone.first()) is not None:  # one probe per version whose code is gone
        check_event_payload_fits(*found, event_type, payload_json)
        name, version = found
        gone = gone.filter(Q(workflow__gt=name) | Q(workflow=name, version__gt=version))


def either_version(pairs: Sequence[tuple[str, int]]) -> Q:
    """Instances of any of these (workflow, version) pairs."""
    matched = Q(pk__in=[])
    for name, version in pairs:
        matched |= Q(workflow=name, version=version)
    return matched


def instance_info(row: Instance) -> InstanceInfo:
    return InstanceInfo(
        id=row.instance_id,
        workflow=row.workflow,
        version=row.version,
        status=row.status,
        created_at=row.created_at,
        updated_at=row.updated_at,
        finished_at=row.finished_at,
        error=row.error,
        attributes=row.attributes,
    )


def check_version(version: Any, field: str = "version") -> None:
    """field: the name the caller gave it (a bulk restart's is to_version)."""
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= MAX_VERSION:
        raise errors.InvalidInput(
            f"{field} must be an integer from 1 to {MAX_VERSION}, got {errors.shown(version)}"
        )


# The fields of an Instance row an InstanceHandle given it reads: its pk, and its version
# for the limits (a row read without it loads it again, one query per handle).
HANDLE_FIELDS = ("id", "workflow", "instance_id", "version")


class InstanceHandle:
    """One instance of a workflow, by id. Methods read and write the database each call."""

    def __init__(
        self, workflow: str, id: str, row: Instance | None = None, created: bool = False
    ) -> None:
        self.workflow = workflow
        self.id = id
        self._row = row
        # True when create() made this instance; False when an idempotency key found it.
        self.created = created

    def __repr__(self) -> str:
        return f"<InstanceHandle {self.workflow}/{self.id}>"

    def _limits(self) -> Limits:
        """The limits of the instance's version; the settings' limits if its code is gone.
        (Only restart(version=) changes it, and it drops the row it read.)"""
        return limits_for(self.workflow, self.row(refresh=False).version)

    def row(self, refresh: bool = True) -> Instance:
        if refresh or self._row is None:
            self._row = store.get_instance(self.workflow, self.id)
        return self._row

    # --- read -----------------------------------------------------------------------

    def status(self) -> InstanceStatus:
        row = self.row()
        return InstanceStatus(row.status, row.output, row.error, row.waiting_reason)

    def history(self, after: int = 0, limit: int | None = None) -> list[HistoryEntry]:
        """The records after sequence `after` (0: from the start), in order; at most `limit`
        of them (None: every one)."""
        if not isinstance(after, int) or isinstance(after, bool) or not 0 <= after <= MAX_PK:
            raise errors.InvalidInput(
                f"after must be a history sequence from 0 to {MAX_PK}, got {errors.shown(after)}"
            )
        check_row_count("limit", limit, 1, none_allowed=True)
        records = HistoryRecord.objects.filter(
            instance_id=self.row().pk, sequence__gt=after
        ).order_by("sequence")
        return [history_entry(h) for h in (records if limit is None else records[:limit])]

    def subscribe(self, cursor: int = 0) -> Iterator[HistoryEntry]:
        """History records after `cursor` (a history sequence; 0: from the start), then
        live ones as they are written. Ends after the last record of a finished instance,
        or when the caller stops iterating (break, close())."""
        follower = self._follower(cursor)
        with live.result_waiters.waiting(follower.pk, every_change=True) as woken:
            follower.open()
            try:
                while True:
                    woken.clear()  # a wake-up after this point is not missed by the read
                    records, finished = follower.read()
                    for record in records:
                        yield history_entry(record)
                    if finished:
                        return
                    if not records:
                        woken.wait(follower.wait_seconds)
                    follower.keep_alive()  # busy or idle: at most every REFRESH_SECONDS
            finally:
                follower.close()

    async def asubscribe(self, cursor: int = 0) -> AsyncIterator[HistoryEntry]:
        """Async twin of subscribe(): waits without holding a thread (the SSE stream)."""
        follower = await sync_to_async(self._follower)(cursor)
        async with live.result_waiters.awaiting(follower.pk, every_change=True) as woken:
            await sync_to_async(follower.open)()
            try:
                while True:
                    woken.clear()
                    records, finished = await sync_to_async(follower.read)()
                    for record in records:
                        yield history_entry(record)
                    if finished:
                        return
                    if not records:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(woken.wait(), follower.wait_seconds)
                    if follower.keep_alive_due():
                        await sync_to_async(follower.keep_alive)()
            finally:
                await asyncio.shield(sync_to_async(follower.close)())

    def _follower(self, cursor: int) -> HistoryFollower:
        if not isinstance(cursor, int) or isinstance(cursor, bool) or not 0 <= cursor <= MAX_PK:
            raise errors.InvalidInput(
                f"cursor must be a history sequence from 0 to {MAX_PK}, got {errors.shown(cursor)}"
            )
        follower = HistoryFollower(self.row().pk, cursor)
        if follower.notified:
            history_listener.ensure_started(live.result_waiters.wake)
        return follower

    def steps(
        self, last: int | None = None, after: int = 0, limit: int | None = None
    ) -> list[StepRecord]:
        """The steps in start order; with `last`, only the newest `last` of them (a long-running
        instance has tens of thousands); with `after` (a step's seq, as a page's cursor) and
        `limit`, a page: at most `limit` steps started after that one."""
        steps = StepRecord.objects.filter(instance_id=self.row().pk)
        if last is not None:
            check_row_count("last", last, 0)
            if after or limit is not None:
                raise errors.InvalidInput("give last, or after and limit, not both")
            return list(reversed(steps.order_by("-seq")[:last])) if last else []
        _check_page(after, limit)
        steps = steps.filter(seq__gt=after).order_by("seq") if after else steps.order_by("seq")
        return list(steps if limit is None else steps[:limit])

    def recent_steps(self, newest: int) -> tuple[list[StepRecord], int]:
        """The newest `newest` steps and every older one still open (running, retrying or
        waiting: what an operator acts on), in start order; and how many steps there are."""
        check_row_count("newest", newest, 0, MAX_PK - 1)  # one more is read
        rows = StepRecord.objects.filter(instance_id=self.row().pk)
        shown = list(rows.order_by("-seq")[: newest + 1])
        if len(shown) <= newest:
            return shown[::-1], len(shown)
        shown = shown[:newest]
        older = rows.filter(status__in=OPEN_STEP_STATUSES).order_by("seq")
        if shown:  # none with newest=0: every open step is older than those shown
            older = older.filter(seq__lt=shown[-1].seq)
        return [*older, *shown[::-1]], rows.count()

    def open_steps(self, through: int, also: Sequence[int] = ()) -> list[StepRecord]:
        """The steps up to seq `through` that are open (running, retrying, waiting) or whose
        pk is in `also`, in start order: what may have changed since a poll that saw the
        steps up to `through` and found those open (`wf watch` reads these, not all)."""
        return list(
            StepRecord.objects.filter(instance_id=self.row().pk, seq__lte=through)
            .filter(Q(status__in=OPEN_STEP_STATUSES) | Q(pk__in=also))
            .order_by("seq")
        )

    def step_count(self) -> int:
        return StepRecord.objects.filter(instance_id=self.row(refresh=False).pk).count()

    def parent_row(self) -> Instance | None:
        """The row of the instance that started this one (step.invoke / step.start)."""
        row = self.row()
        return None if row.parent_id is None else Instance.objects.filter(id=row.parent_id).first()

    def children_rows(self, after: int = 0, limit: int | None = None) -> list[Instance]:
        """The rows of the instances this one started, oldest first; with `after` (a child
        row's id, as a page's cursor) and `limit`, a page of them (a fan-out has thousands)."""
        _check_page(after, limit)
        rows = Instance.objects.filter(parent_id=self.row().pk, id__gt=after).order_by("id")
        return list(rows if limit is None else rows[:limit])

    def newest_children_rows(self, newest: int) -> tuple[list[Instance], int]:
        """The newest `newest` children, oldest first, and how many children there are."""
        check_row_count("newest", newest, 0, MAX_PK - 1)  # one more is read
        rows = Instance.objects.filter(parent_id=self.row().pk)
        shown = list(rows.order_by("-id")[: newest + 1])
        if len(shown) <= newest:
            return shown[::-1], len(shown)
        return shown[:newest][::-1], rows.count()

    def parent(self) -> InstanceHandle | None:
        """The parent instance's handle, or None if this one is not a child."""
        row = self.parent_row()
        return None if row is None else InstanceHandle(row.workflow, row.instance_id, row)

    def children(self) -> list[InstanceHandle]:
        """The instances this one started with step.invoke / step.start, oldest first."""
        return [InstanceHandle(c.workflow, c.instance_id, c) for c in self.children_rows()]

    def pending_events(self) -> list[PendingEvent]:
        waits = StepRecord.objects.filter(
            instance_id=self.row().pk, kind=StepKind.WAIT_FOR_EVENT, status=StepStatus.WAITING
        ).order_by("seq")
        return [
            PendingEvent(w.name, w.event_type, w.wake_at, decode_json(w.event_schema_json))
            for w in waits
        ]

    def result(self, timeout: float | None = None) -> Any:
        """Block until the instance finishes; its output, or WorkflowFailed / WorkflowTerminated."""
        seconds = wait_seconds("timeout", timeout)
        deadline = None if seconds is None else time.monotonic() + seconds
        with live.result_waiters.waiting(self.row().pk) as event:
            while True:
                row = self.row()
                if row.status == Status.COMPLETE:
                    return row.output
                if row.status == Status.ERRORED:
                    raise errors.WorkflowFailed(self.id, row.error)
                if row.status == Status.TERMINATED:
                    raise errors.WorkflowTerminated(self.id)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise errors.ResultTimeout(
                        f"instance {self.id!r} is still {row.status} after {timeout} s"
                    )
                # Woken at once by this process's engine; the 1 s re-read covers other processes.
                event.wait(1.0 if remaining is None else min(1.0, remaining))
                event.clear()

    # --- act --------------------------------------------------------------------------

    def pause(self, actor: Any = None) -> str:
        status = store.pause(self.workflow, self.id, _actor(actor))
        _after_commit("pause", self.row(refresh=False).pk, self.workflow)
        return status

    def resume(self, actor: Any = None) -> str:
        status = store.resume(self.workflow, self.id, self._limits(), _actor(actor))
        _after_commit("resume", self.row(refresh=False).pk, self.workflow)
        return status

    def terminate(self, actor: Any = None) -> bool:
        """Stop the instance for good; False if it had already finished."""
        done = store.terminate(self.workflow, self.id, self._limits(), _actor(actor))
        if done:
            count_ended_on_commit(self.workflow, Status.TERMINATED)
            _after_commit("terminate", self.row(refresh=False).pk, self.workflow)
        return done

    def restart(
        self, from_step: str | None = None, actor: Any = None, version: int | None = None
    ) -> str:
        """Run again from the beginning, or from `from_step` (its checkpoint and every later
        one dropped). `version`: run on that registered version from now on (a fixed
        version of a failing one; the kept checkpoints replay on its code), not its own."""
        if from_step is not None:
            check_text(from_step, "from_step")
        limits = self._limits() if version is None else self._workflow_version(version).limits()
        status = store.restart(self.workflow, self.id, limits, from_step, _actor(actor), version)
        pk = self.row(refresh=False).pk
        if version is not None:
            self._row = None  # its version changed: the next look reads the row
        _after_commit("restart", pk, self.workflow)
        return status

    def _workflow_version(self, version: Any) -> Definition:
        """The definition of a registered version of this workflow, or a clear error."""
        check_version(version)
        try:
            return get_definition(self.workflow, version)
        except errors.UnknownWorkflow as error:  # the workflow is known: the version is wrong
            raise errors.InvalidInput(str(error)) from None

    def skip_sleep(self, actor: Any = None) -> int:
        woken = store.skip_sleep(self.workflow, self.id, _actor(actor))
        _after_commit("wake", self.row(refresh=False).pk, self.workflow)
        return woken

    def send_event(self, type: str, payload: Any = None, actor: Any = None) -> None:
        """Deliver an event; buffered until a wait for its type consumes it (at most
        max_buffered_events of them per instance: LimitExceeded beyond)."""
        check_event_type(type)
        payload_json = encode_json(payload, f"payload of event {type!r}")
        check_event_payload_fits(self.workflow, self.row(refresh=False).version, type, payload_json)
        limits = self._limits()

        def validate(schema_json: str) -> None:
            validator = event_validator(json.loads(schema_json))
            stored = json.loads(payload_json)  # what the wait receives (a tuple is an array)
            try:
                violations = [
                    f"{'/'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}"
                    for e in validator.iter_errors(stored)
                ]
            except referencing.exceptions.Unresolvable as exc:
                # check_schema passed it (it checks the form, not where a $ref leads): no
                # payload can pass this wait, so this one is refused as not matching.
                raise errors.EventPayloadInvalid(
                    f"payload of event {type!r} cannot match the schema of the step waiting "
                    f"for it: a reference in the schema does not resolve ({exc})",
                    [f"(schema): {exc}"],
                ) from None
            except RecursionError:
                raise errors.EventPayloadInvalid(
                    f"payload of event {type!r} cannot be checked against the schema of the "
                    f"step waiting for it: {CHECK_RECURSED}",
                    [f"(root): {CHECK_RECURSED}"],
                ) from None
            if violations:
                raise errors.EventPayloadInvalid(
                    f"payload of event {type!r} does not match the schema of the step waiting for it: "
                    + "; ".join(violations),
                    violations,
                )

        event = store.send_event(
            self.workflow,
            self.id,
            type,
            seal(payload_json),
            validate,
            _actor(actor),
            limits.max_buffered_events,
        )
        _after_commit("event", event.instance_id, self.workflow, hinted=True)

    def cancel(self, compensate: bool = True, actor: Any = None) -> str:
        """Stop the instance; with compensate, first undo its completed steps, newest first."""
        return self.cancel_changed(compensate, actor).status

    def cancel_changed(self, compensate: bool = True, actor: Any = None) -> store.Cancelled:
        """cancel(), saying also whether it changed anything (False: its compensations
        were running already, a cancel of it or of its parent's, and go on undisturbed)."""
        status, changed = store.cancel(
            self.workflow, self.id, self._limits(), compensate, _actor(actor)
        )
        if status == Status.TERMINATED:
            count_ended_on_commit(self.workflow, Status.TERMINATED)
        # A worker running the instance stops its run ("cancel"), or lets the steps in
        # flight finish, then compensates ("compensate": a sync step's effect would land
        # after the cancel, unrecorded, and no compensation undo it); the hint wakes a
        # worker to run the compensations if no run holds the instance.
        if changed:
            kind = "compensate" if status == Status.COMPENSATING else "cancel"
            _after_commit(kind, self.row(refresh=False).pk, self.workflow)
        return store.Cancelled(status, changed)

    def delete(self, actor: Any = None) -> None:
        """Delete this finished instance with its steps, events, history, spans and errors;
        InvalidTransition while it is live (terminate it first)."""
        WorkflowBinding(self.workflow).delete_batch([self.id], actor=actor)


BULK_OPTIONS = {
    BulkAction.SEND_EVENT: {"event_type", "payload"},
    BulkAction.RESTART: {"from_step", "to_version"},
    BulkAction.CANCEL: {"compensate"},
}


def start_bulk_job(
    workflow: str,
    action: str,
    instances: QuerySet[Instance],
    filter_shown: dict[str, Any],
    options: dict[str, Any],
    actor: Any = None,
) -> BulkJobHandle:
    """Snapshot what `instances` matches into a new job and wake the workers for it
    (the dashboard passes its own filter's queryset; bulk() its own)."""
    job = store.bulk.create_job(workflow, action, instances, filter_shown, options, _actor(actor))
    if not job.done:
        transaction.on_commit(lambda: live.instance_changed("bulk", None))
    return BulkJobHandle(job)


class BulkJobHandle:
    """A bulk job; its figures are as of creation or the last refresh()."""

    def __init__(self, job: BulkJob) -> None:
        self._job = job

    def __repr__(self) -> str:
        return f"<BulkJobHandle #{self.id} {self.action} {self.processed}/{self.matched}>"

    @classmethod
    def find(cls, id: Any, workflow: str | None = None) -> BulkJobHandle:
        if not isinstance(id, int) or isinstance(id, bool):
            raise errors.InvalidInput(f"bulk job id must be an integer, got {errors.shown(id)}")
        job = store.bulk.get_job(id, workflow) if 0 < id <= MAX_PK else None
        if job is None:
            raise errors.BulkJobNotFound(
                f"no bulk job #{errors.shown(id)}" + (f" of {workflow!r}" if workflow else "")
            )
        return cls(job)

    def refresh(self) -> BulkJobHandle:
        job = store.bulk.get_job(self._job.pk)
        if job is not None:
            self._job = job
        return self

    async def arefresh(self) -> BulkJobHandle:
        return await sync_to_async(self.refresh)()

    def wait(self, timeout: float | None = None, poll: float = 0.2) -> BulkJobHandle:
        """Block until a worker has finished the job (ResultTimeout after timeout seconds)."""
        seconds = wait_seconds("timeout", timeout)
        if isinstance(poll, bool) or not isinstance(poll, (int, float)) or not 0 < poll <= 60:
            raise errors.InvalidInput(
                f"poll must be a number of seconds, more than 0 and at most 60, got {errors.shown(poll)}"
            )
        deadline = None if seconds is None else time.monotonic() + seconds
        while not self.refresh().done:
            if deadline is not None and time.monotonic() >= deadline:
                raise errors.ResultTimeout(
                    f"bulk job #{self.id} is at {self.processed}/{self.matched} after {timeout} s"
                )
            time.sleep(poll)
        return self

    id = property(lambda self: self._job.pk)
    workflow = property(lambda self: self._job.workflow)
    action = property(lambda self: self._job.action)
    filter = property(lambda self: self._job.filter)
    options = property(lambda self: self._job.plain_options)
    matched = property(lambda self: self._job.matched)
    processed = property(lambda self: self._job.processed)
    applied = property(lambda self: self._job.applied)
    pause_requested = property(lambda self: self._job.pause_requested)  # not in applied
    skipped = property(lambda self: self._job.skipped)
    failed = property(lambda self: self._job.failed)
    errors = property(lambda self: list(self._job.errors))
    created_at = property(lambda self: self._job.created_at)
    finished_at = property(lambda self: self._job.finished_at)
    done = property(lambda self: self._job.done)


def history_entry(record: HistoryRecord) -> HistoryEntry:
    return HistoryEntry(
        record.sequence,
        record.created_at,
        record.type,
        open_history_data(record.data),
        record.actor,
    )


def _async_twin(name: str) -> Any:
    method = getattr(InstanceHandle, name)

    async def twin(self: InstanceHandle, *args: Any, **kwargs: Any) -> Any:
        return await sync_to_async(method)(self, *args, **kwargs)

    twin.__name__ = f"a{name}"
    twin.__doc__ = f"Async twin of {name}()."
    return twin


for _name in (
    "status",
    "parent",
    "children",
    "history",
    "steps",
    "recent_steps",
    "pending_events",
    "result",
    "pause",
    "resume",
    "terminate",
    "restart",
    "skip_sleep",
    "send_event",
    "cancel",
    "delete",
):
    setattr(InstanceHandle, f"a{_name}", _async_twin(_name))

__all__ = [
    "BulkJobHandle",
    "InstanceHandle",
    "InstanceStatus",
    "Page",
    "ScheduleHandle",
    "WorkflowBinding",
    "get_workflow",
    "schedules",
]
