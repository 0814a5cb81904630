"""What the store's modules share: table names, records passed around, history appends."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import connection
from django.db.models.base import ModelState
from django.db.models.signals import post_init, pre_init

from ...models import (
    ErrorRecord,
    HistoryRecord,
    InboxEvent,
    Instance,
    Status,
    StepKind,
    StepRecord,
    StepStatus,
)
from .. import clock
from ..errors import (
    InstanceNotFound,
)
from .dialect import (
    db_time,
    from_db_time,
    json_placeholder,
    lock_rows,
    sql_cursor,
    utc_text_times,
)
from .wakes import hint_workers

# json.dumps with options builds an encoder per call: a third of encoding a small record.
compact_json = json.JSONEncoder(separators=(",", ":")).encode

INSTANCE_TABLE = Instance._meta.db_table


STEP_TABLE = StepRecord._meta.db_table


HISTORY_TABLE = HistoryRecord._meta.db_table


INBOX_TABLE = InboxEvent._meta.db_table


ERROR_TABLE = ErrorRecord._meta.db_table
WAITING_REASON_CHARS = Instance._meta.get_field("waiting_reason").max_length


def fit_waiting_reason(reason: str) -> str:
    """A reason as the waiting_reason column holds it: cut to its length, ending in "…".
    Reasons quote names and keys (a workflow name and an instance id of 200 characters, a
    step name of 300, a concurrency key repr()'d): PostgreSQL refused a longer one, failing
    the whole write (an admission pass, a park), where SQLite stored it whole."""
    if len(reason) <= WAITING_REASON_CHARS:
        return reason
    return reason[: WAITING_REASON_CHARS - 1] + "…"


class LeaseLost(Exception):
    """The run's lease token no longer matches: someone else owns the instance now."""


@dataclass
class History:
    """A history record to append: its sequence number is allocated under the row lock."""

    type: str
    data: dict[str, Any] = field(default_factory=dict)
    actor: str = ""


@dataclass
class NewInstance:
    instance_id: str
    params_json: str
    idempotency_key: str | None = None
    retention_ms: int | None = None
    # Flow control (see Instance): priority 0-9; debounce_ms with a debounce_key.
    priority: int = 5
    concurrency_key: str | None = None
    debounce_key: str | None = None
    debounce_ms: int | None = None
    # A child workflow: the parent instance and its step that starts this one.
    parent_pk: int | None = None
    parent_step: str = ""
    parent_span: str = ""
    detached: bool | None = None  # a step.start's child (Instance.detached)
    # The lease of the parent's run that starts it: a run that lost it (a cancel, a
    # terminate, a restart overtook it) starts no child.
    parent_token: str | None = None
    schedule: str = ""  # the schedule that starts it, and the tick it fires for
    scheduled_at: datetime | None = None
    retention_error_ms: int | None = None
    attributes: dict[str, Any] = field(default_factory=dict)
    queue: str | None = None  # a Django task's queue_name (Instance.queue)


@dataclass
class LoadedRun:
    instance: Instance
    steps: dict[str, StepRecord]  # by name: the workflow's own steps
    # By the name of the step undone.
    compensations: dict[str, StepRecord] = field(default_factory=dict)
    # The oldest buffered events of the types its waiting steps wait for, read with the
    # load: type -> (events, whether they are all there are).
    events: dict[str, tuple[list[InboxEvent], bool]] = field(default_factory=dict)
    # The sleeps that had come due, ended by the claim that took this run (their
    # checkpoint and sleep.completed record are written with it).
    sleeps_ended: set[str] = field(default_factory=set)


def allocate_history(pk: int, count: int) -> int:
    """Reserve `count` sequence numbers for instance pk; returns the first. Locks the row."""
    with sql_cursor() as cursor:
        cursor.execute(
            f"UPDATE {INSTANCE_TABLE} SET history_seq = history_seq + %s WHERE id = %s RETURNING history_seq",
            [count, pk],
        )
        row = cursor.fetchone()
    if row is None:
        raise InstanceNotFound(f"instance #{pk} no longer exists")
    return row[0] - count + 1


def insert_history(pk: int, first_seq: int, records: Sequence[History], now: datetime) -> None:
    """One multi-row INSERT: history is written on every checkpoint, so it skips the ORM."""
    insert_history_rows([(pk, first_seq + i, r) for i, r in enumerate(records)], now)


def insert_history_rows(rows: Sequence[tuple[int, int, History]], now: datetime) -> None:
    """(instance, sequence, record) rows of any instances in one multi-row INSERT."""
    if not rows:
        return
    row = f"(%s, %s, %s, %s, {json_placeholder()}, %s)"
    params: list[Any] = []
    created = db_time(now)
    for pk, seq, r in rows:
        params += [pk, seq, created, r.type, compact_json(r.data), r.actor]
    with sql_cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {HISTORY_TABLE} (instance_id, sequence, created_at, type, data, actor) VALUES "
            + ", ".join([row] * len(rows)),
            params,
        )


def append_history(pk: int, records: Sequence[History], now: datetime | None = None) -> None:
    """Append records to an instance's history (inside the caller's transaction)."""
    if records:
        insert_history(pk, allocate_history(pk, len(records)), records, now or clock.now())


OPEN_STEP_STATUSES = (StepStatus.WAITING, StepStatus.RETRYING, StepStatus.RUNNING)
FINISHED_BEFORE_STEP = ("InstanceFinished", "the instance finished before this step did")


def append_histories(records: dict[int, History], now: datetime) -> None:
    """One history record for each of several instances (inside the caller's
    transaction): one sequence allocation and one INSERT for the lot, rows locked in id order."""
    if not records:
        return
    pks = sorted(records)
    with sql_cursor() as cursor:
        cursor.execute(
            f"UPDATE {INSTANCE_TABLE} SET history_seq = history_seq + 1 "
            f"WHERE id IN ({', '.join(['%s'] * len(pks))}) RETURNING id, history_seq",
            pks,
        )
        sequences = dict(cursor.fetchall())
    HistoryRecord.objects.bulk_create(
        HistoryRecord(
            instance_id=pk,
            sequence=sequences[pk],
            created_at=now,
            type=records[pk].type,
            data=records[pk].data,
            actor=records[pk].actor,
        )
        for pk in pks
        if pk in sequences
    )


def close_open_steps(pk: int | Sequence[int], now: datetime) -> None:
    """A finished instance has no step still waiting, retrying or running.

    Raw SQL: every finish runs it, and building the ORM query cost more than running it."""
    pks = [pk] if isinstance(pk, int) else list(pk)
    if not pks:
        return
    name, message = FINISHED_BEFORE_STEP
    with sql_cursor() as cursor:
        cursor.execute(
            f"UPDATE {STEP_TABLE} SET status = %s, wake_at = NULL, completed_at = %s, "
            "last_error_name = %s, last_error_message = %s "
            f"WHERE instance_id IN ({', '.join(['%s'] * len(pks))}) AND status IN (%s, %s, %s)",
            [StepStatus.FAILED, db_time(now), name, message, *pks, *OPEN_STEP_STATUSES],
        )


def wake_parent(parent_pk: int, parent_step: str, now: datetime) -> None:
    """A child finished: the parent's step.invoke waiting for it and the parent are due now.

    Both rows, in the child's finishing transaction: a parent parked meanwhile reads the
    step's wake time when it parks, one parked before finds its own wake_at set; any worker
    of the fleet then claims it, told at commit (PostgreSQL's NOTIFY): the worker that
    finished the child may not run the parent's version, or be full, and the others
    would find it only at their next poll. A paused parent stays paused (its resume makes
    it due).
    """
    woke = StepRecord.objects.filter(
        instance_id=parent_pk, kind=StepKind.INVOKE, name=parent_step, status=StepStatus.WAITING
    ).update(wake_at=now)
    if woke and Instance.objects.filter(
        id=parent_pk, status__in=(Status.WAITING, Status.RUNNING)
    ).update(wake_at=now):
        hint_workers("child", [parent_pk])


def locked_instance(name: str, instance_id: str) -> Instance:
    try:
        return lock_rows(Instance.objects.filter(workflow=name, instance_id=instance_id)).get()
    except Instance.DoesNotExist:
        raise InstanceNotFound(f"workflow {name!r} has no instance {instance_id!r}") from None


def clear_lease() -> dict[str, Any]:
    return {"lease_token": None, "lease_owner": "", "lease_expires_at": None}


def models_from_rows(model: Any, rows: list[tuple[Any, ...]]) -> list[Any]:
    """Model objects from raw rows in concrete-field order, each value converted as the
    ORM would (_readers)."""
    names, readers = _readers(model, connection.vendor, utc_text_times(connection))
    alias = connection.alias
    objects = []
    for row in rows:
        values = list(row)
        for i, read in readers:
            values[i] = read(values[i])
        objects.append(model_object(model, names, values, alias))
    return objects


def model_object(model: Any, names: Sequence[str], values: Sequence[Any], db: str | None) -> Any:
    """What Model.from_db (db: the alias it was read from) or Model(*values) (db None: a
    new, unsaved object) makes of values for every concrete field (attnames in order),
    without Model.__init__'s setattr per field and its two signals (5.4 against 1.7 µs an
    instance row), unless something listens to those signals for this model (asked only
    when something listens to them at all: the asking was four calls an object)."""
    if (pre_init.receivers or post_init.receivers) and (
        pre_init.has_listeners(model) or post_init.has_listeners(model)
    ):
        return model(*values) if db is None else model.from_db(db, names, values)
    made = model.__new__(model)
    state = made.__dict__["_state"] = ModelState()
    state.adding, state.db = db is None, db
    made.__dict__.update(zip(names, values))
    return made


def new_model_object(model: Any, given: dict[str, Any]) -> Any:
    """A new, unsaved model object: the given values (by attname), every other field at
    its default. What model(**given) makes, without Model.__init__'s look-up of each
    field's default by keyword (an instance row 47 against 12 µs, docs/performance.md)."""
    names, position, defaults, fresh = _model_template(model)
    values = list(defaults)
    for index, model_field in fresh:  # a callable default (dict, list) is made anew each time
        if model_field.attname not in given:
            values[index] = model_field.get_default()
    for name, value in given.items():
        values[position[name]] = value
    return model_object(model, names, values, None)


@functools.cache
def _model_template(
    model: Any,
) -> tuple[list[str], dict[str, int], tuple[Any, ...], list[tuple[int, Any]]]:
    """A model's attnames in field order, their positions, each field's default, and the
    fields whose default is a callable."""
    fields = model._meta.concrete_fields
    names = [field.attname for field in fields]
    fresh = [(i, f) for i, f in enumerate(fields) if f.has_default() and callable(f.default)]
    return (
        names,
        {name: index for index, name in enumerate(names)},
        tuple(field.get_default() for field in fields),
        fresh,
    )


@functools.cache
def _readers(
    model: Any, vendor: str, utc_text: bool
) -> tuple[list[str], list[tuple[int, Callable[[Any], Any]]]]:
    """A model's field names, and (column index, reader) for each column the ORM converts
    on reading: the backend's converters, then the field's own (a JSONField's text). On
    SQLite in UTC a datetime's naive text is read by from_db_time, without Django's
    parse_datetime and make_aware (loading a herd's claims through the ORM was an eighth
    of the engine's process)."""
    fields = model._meta.concrete_fields
    readers: list[tuple[int, Callable[[Any], Any]]] = []
    for i, model_field in enumerate(fields):
        if utc_text and model_field.get_internal_type() == "DateTimeField":
            readers.append((i, from_db_time))
            continue
        column = model_field.get_col(model._meta.db_table)
        converters = connection.ops.get_db_converters(column) + column.get_db_converters(connection)
        if converters:
            readers.append((i, functools.partial(_convert, converters, column)))
    return [f.attname for f in fields], readers


def _convert(converters: Sequence[Any], column: Any, value: Any) -> Any:
    for convert in converters:
        value = convert(value, column, connection)
    return value
