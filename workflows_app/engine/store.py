"""Every database read and write the engine makes.

The functions here are synchronous and each is one transaction; the engine calls them
from its database thread. Writes made on behalf of a run are fenced by the lease token of
the claim the run was made under: once an operator terminates or restarts the instance,
or another worker takes it over, the old run's writes match no row and are refused.
"""

from __future__ import annotations

import contextlib
import functools
import json
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import DatabaseError, IntegrityError, InterfaceError, OperationalError, connection, transaction
from django.db.models import Min, Q

from ..models import (
    ErrorRecord,
    HistoryRecord,
    InboxEvent,
    Instance,
    Status,
    StepKind,
    StepRecord,
    StepStatus,
    WorkflowVersion,
)
from . import clock, faults, lifecycle
from .durations import add_duration
from .errors import (
    InstanceAlreadyExists,
    InstanceNotFound,
    InvalidInput,
    InvalidTransition,
    VersionConflict,
)
from .limits import Limits

INSTANCE_TABLE = Instance._meta.db_table
STEP_TABLE = StepRecord._meta.db_table
HISTORY_TABLE = HistoryRecord._meta.db_table
STEP_COLUMNS = (
    "instance_id", "name", "kind", "seq", "status", "output_json", "attempts", "max_attempts",
    "last_error_name", "last_error_message", "last_error_stack", "started_at", "completed_at",
    "wake_at", "event_type", "event_schema_json", "has_compensation", "after",
)
# One statement whether the step is new or not: a checkpoint is an upsert keyed by name
# and kind (a compensation shares the name of the step it undoes).
UPSERT_STEP_SQL = (
    f"INSERT INTO {STEP_TABLE} ({', '.join(STEP_COLUMNS)}) VALUES ({', '.join(['%s'] * len(STEP_COLUMNS))}) "
    "ON CONFLICT (instance_id, kind, name) DO UPDATE SET "
    + ", ".join(f"{c} = excluded.{c}" for c in STEP_COLUMNS[3:])
)


# --- SQLite's writer lock ----------------------------------------------------------


LOCKED_RETRIES = 3


def retry_while_locked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Retry a one-transaction write that SQLite refused with "database is locked".

    The refusal is definite (BEGIN IMMEDIATE did not get the lock, nothing was written),
    so trying again is safe; each try already waited the busy timeout. Inside a caller's
    transaction the error is the caller's to handle, as is any other database error.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for attempt in range(LOCKED_RETRIES + 1):
            try:
                return fn(*args, **kwargs)
            except OperationalError as exc:
                retry = (
                    connection.vendor == "sqlite"
                    and "locked" in str(exc)
                    and not connection.in_atomic_block
                    and attempt < LOCKED_RETRIES
                )
                if not retry:
                    raise
        raise AssertionError("unreachable")

    return wrapper


# Told (after commit) which queued instances a transaction started; set by the app's live layer.
on_promoted: Callable[[list[int]], None] | None = None


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


@dataclass
class LoadedRun:
    instance: Instance
    steps: dict[str, StepRecord]  # by name: the workflow's own steps
    compensations: dict[str, StepRecord] = field(default_factory=dict)  # by the name of the step undone


# --- history -------------------------------------------------------------------------


def _allocate_history(pk: int, count: int) -> int:
    """Reserve `count` sequence numbers for instance pk; returns the first. Locks the row."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {INSTANCE_TABLE} SET history_seq = history_seq + %s WHERE id = %s RETURNING history_seq",
            [count, pk],
        )
        row = cursor.fetchone()
    if row is None:
        raise InstanceNotFound(f"instance #{pk} no longer exists")
    return row[0] - count + 1


def _db_time(value: datetime | None) -> Any:
    """A datetime as this database's driver wants it in raw SQL (SQLite: naive UTC text)."""
    return connection.ops.adapt_datetimefield_value(value)


def _json_placeholder() -> str:
    return "CAST(%s AS jsonb)" if connection.vendor == "postgresql" else "%s"


def _insert_history(pk: int, first_seq: int, records: Sequence[History], now: datetime) -> None:
    """One multi-row INSERT: history is written on every checkpoint, so it skips the ORM."""
    if not records:
        return
    row = f"(%s, %s, %s, %s, {_json_placeholder()}, %s)"
    params: list[Any] = []
    created = _db_time(now)
    for i, r in enumerate(records):
        params += [pk, first_seq + i, created, r.type, json.dumps(r.data, separators=(",", ":")), r.actor]
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {HISTORY_TABLE} (instance_id, sequence, created_at, type, data, actor) VALUES "
            + ", ".join([row] * len(records)),
            params,
        )


def append_history(pk: int, records: Sequence[History], now: datetime | None = None) -> None:
    """Append records to an instance's history (inside the caller's transaction)."""
    if records:
        _insert_history(pk, _allocate_history(pk, len(records)), records, now or clock.now())


# --- catalog and admission ----------------------------------------------------------


@retry_while_locked
def sync_catalog(name: str, version: int, source_hash: str, class_path: str, strict: bool) -> None:
    """Record a registered version; refuse a changed source under an existing version."""
    now = clock.now()
    with transaction.atomic():
        row = WorkflowVersion.objects.select_for_update().filter(name=name, version=version).first()
        if row is None:
            try:
                with transaction.atomic():
                    WorkflowVersion.objects.create(
                        name=name, version=version, source_hash=source_hash, class_path=class_path,
                        registered_at=now, last_seen_at=now,
                    )
            except IntegrityError:
                pass  # registered concurrently by another process; compare on the next call
            return
        if row.source_hash != source_hash:
            if strict:
                raise VersionConflict(
                    f"workflow {name!r} version {version} is already registered with different source code "
                    f"(stored hash {row.source_hash[:12]}, this code {source_hash[:12]}); "
                    f"bump the version (register({name!r}, version={version + 1})) so running instances "
                    "keep replaying on the code they started with"
                )
            row.source_hash = source_hash
        row.class_path = class_path
        row.last_seen_at = now
        row.save(update_fields=["source_hash", "class_path", "last_seen_at"])


def _lock_workflow(name: str) -> None:
    """Serialise admission decisions of one workflow (PostgreSQL: row locks on its catalog)."""
    list(WorkflowVersion.objects.select_for_update().filter(name=name).values_list("id", flat=True))


def holding_places(instances: Any) -> Any:
    """The instances of a queryset that hold a place under max_concurrent_instances."""
    return instances.filter(
        Q(status__in=lifecycle.HOLDS_PLACE - {Status.PAUSED}) | Q(status=Status.PAUSED, started_at__isnull=False)
    )


def _free_slots(name: str, limits: Limits) -> int | None:
    """Places left under max_concurrent_instances, or None for no limit."""
    if limits.max_concurrent_instances is None:
        return None
    active = holding_places(Instance.objects.filter(workflow=name)).count()
    return max(0, limits.max_concurrent_instances - active)


@retry_while_locked
def create_instances(
    name: str, version: int, limits: Limits, items: Sequence[NewInstance], actor: str = ""
) -> list[tuple[Instance, bool]]:
    """Insert instances all-or-nothing; an idempotency key already used returns its instance.

    Returns (instance, created) pairs in the order of items.
    """
    for attempt in range(3):
        try:
            with transaction.atomic():
                return _create_instances(name, version, limits, items, actor)
        except IntegrityError as exc:
            # A concurrent create with the same idempotency key or id won the race; the
            # next attempt sees its row. Anything else is a real conflict.
            if attempt == 2:
                raise InstanceAlreadyExists(f"could not create instances of {name!r}: {exc}") from None
    raise AssertionError("unreachable")


def _create_instances(
    name: str, version: int, limits: Limits, items: Sequence[NewInstance], actor: str
) -> list[tuple[Instance, bool]]:
    now = clock.now()
    keys = [i.idempotency_key for i in items if i.idempotency_key]
    existing_by_key = {
        inst.idempotency_key: inst
        for inst in Instance.objects.filter(workflow=name, version=version, idempotency_key__in=keys)
    } if keys else {}
    fresh = [i for i in items if not (i.idempotency_key and i.idempotency_key in existing_by_key)]
    ids = [i.instance_id for i in fresh]
    if len(set(ids)) != len(ids):
        raise InvalidInput("a batch names the same instance id twice")
    taken = list(Instance.objects.filter(workflow=name, instance_id__in=ids).values_list("instance_id", flat=True))
    if taken:
        raise InstanceAlreadyExists(f"workflow {name!r} already has an instance with id {taken[0]!r}")
    if limits.max_concurrent_instances is not None:
        _lock_workflow(name)
    slots = _free_slots(name, limits)
    if slots is not None and Instance.objects.filter(workflow=name, status=Status.QUEUED).exists():
        slots = 0  # earlier queued instances go first: creation order
    rows = []
    for item in fresh:
        admitted = slots is None or slots > 0
        if slots is not None and admitted:
            slots -= 1
        rows.append(
            Instance(
                workflow=name, instance_id=item.instance_id, version=version,
                status=Status.RUNNING if admitted else Status.QUEUED,
                params_json=item.params_json, idempotency_key=item.idempotency_key,
                created_by=actor, created_at=now, updated_at=now,
                started_at=now if admitted else None, wake_at=now if admitted else None,
                retention_ms=item.retention_ms, history_seq=1, trace_id=uuid.uuid4().hex,
            )
        )
    Instance.objects.bulk_create(rows)
    HistoryRecord.objects.bulk_create(
        HistoryRecord(
            instance_id=row.pk, sequence=1, created_at=now, type="instance.created",
            data={"version": version, "status": row.status}, actor=actor,
        )
        for row in rows
    )
    created = iter(rows)
    return [
        (existing_by_key[i.idempotency_key], False)
        if i.idempotency_key and i.idempotency_key in existing_by_key
        else (next(created), True)
        for i in items
    ]


def promote_queued(name: str, limits: Limits, now: datetime) -> list[int]:
    """Start queued instances of a workflow, oldest first, while there is room."""
    if not Instance.objects.filter(workflow=name, status=Status.QUEUED).exists():
        return []
    _lock_workflow(name)
    slots = _free_slots(name, limits)
    queue = Instance.objects.filter(workflow=name, status=Status.QUEUED).order_by("id")
    pks = list((queue if slots is None else queue[:slots]).values_list("id", flat=True))
    if pks:
        Instance.objects.filter(id__in=pks, status=Status.QUEUED).update(
            status=Status.RUNNING, wake_at=now, started_at=now, updated_at=now
        )
        for pk in pks:
            append_history(pk, [History("instance.started", {"from": "queued"})], now)
        if on_promoted is not None:
            callback = on_promoted
            transaction.on_commit(lambda: callback(pks))
    return pks


@retry_while_locked
def promote_all_queued(workflows: Sequence[tuple[str, Limits]]) -> int:
    """At worker start: queued instances start wherever there is room (after a restart too)."""
    now = clock.now()
    total = 0
    for name, limits in workflows:
        with transaction.atomic():
            total += len(promote_queued(name, limits, now))
    return total


# --- lookups ------------------------------------------------------------------------


def get_instance(name: str, instance_id: str) -> Instance:
    try:
        return Instance.objects.get(workflow=name, instance_id=instance_id)
    except Instance.DoesNotExist:
        raise InstanceNotFound(f"workflow {name!r} has no instance {instance_id!r}") from None


def load_run(pk: int) -> LoadedRun:
    """The instance and all its checkpoints: two queries, any size."""
    return load_runs([pk])[pk]


def load_runs(pks: Sequence[int]) -> dict[int, LoadedRun]:
    """Several instances with all their checkpoints: two queries. Buffered events are
    read when a wait asks for its type (unconsumed_events), not on every run."""
    runs = {i.pk: LoadedRun(i, {}) for i in Instance.objects.filter(id__in=list(pks))}
    for step in StepRecord.objects.filter(instance_id__in=list(runs)):
        loaded = runs[step.instance_id]
        (loaded.compensations if step.kind == StepKind.COMPENSATE else loaded.steps)[step.name] = step
    return runs


def unconsumed_events(pk: int, event_type: str, after_id: int, limit: int) -> list[InboxEvent]:
    """The oldest unconsumed events of a type sent to an instance, past after_id."""
    return list(
        InboxEvent.objects.filter(instance_id=pk, type=event_type, consumed_at__isnull=True, id__gt=after_id)
        .order_by("id")[:limit]
    )


def claim_and_load(
    worker_id: str, limit: int, lease_seconds: float, exclude: Iterable[int] = ()
) -> list[tuple[int, str, LoadedRun | None]]:
    """claim_runnable, then load_runs of what was claimed: one trip to the database thread."""
    claimed = claim_runnable(worker_id, limit, lease_seconds, exclude)
    if not claimed:
        return []
    try:
        faults.hit("after_claim")
        loaded = load_runs([pk for pk, _ in claimed])
    except DatabaseError:
        # The claims are committed but cannot run here: hand them back rather than leave
        # them leased to nobody until the leases run out (best effort: expiry is the net).
        connection.close()  # a broken connection is not reused; the release reconnects
        try:
            release(claimed)
        except DatabaseError:
            pass
        raise
    return [(pk, token, loaded.get(pk)) for pk, token in claimed]


# --- claims and leases --------------------------------------------------------------


@retry_while_locked
def claim_runnable(
    worker_id: str, limit: int, lease_seconds: float, exclude: Iterable[int] = ()
) -> list[tuple[int, str]]:
    """Lease up to `limit` runnable instances to this worker and start a run of each.

    Runnable: wake_at <= now and no live lease. PostgreSQL skips rows another worker is
    claiming (FOR UPDATE SKIP LOCKED); SQLite's IMMEDIATE transaction serialises claimers.
    The claim also marks the run as started (status and run.started), so a run costs no
    transaction of its own before its first checkpoint.
    """
    now = clock.now()
    lease_until = now + timedelta(seconds=lease_seconds)
    claimed: list[tuple[int, str]] = []
    with transaction.atomic():
        query = (
            Instance.objects.filter(wake_at__lte=now)
            .filter(Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lte=now))
            .exclude(id__in=list(exclude))
            .order_by("wake_at")
        )
        if connection.features.has_select_for_update_skip_locked:
            query = query.select_for_update(skip_locked=True, of=("self",))
        rows = list(query.values_list("id", "lease_token", "status", "run_count", "compensate_on_cancel")[:limit])
        started: list[tuple[int, int, History]] = []
        with connection.cursor() as cursor:
            for pk, old_token, status, run_count, compensating in rows:
                token = uuid.uuid4().hex
                if compensating:
                    new_status = Status.COMPENSATING
                elif status in (Status.WAITING, Status.RUNNING):
                    new_status = Status.RUNNING
                else:
                    new_status = status  # waitingForPause: the run parks it as paused
                cursor.execute(
                    f"UPDATE {INSTANCE_TABLE} SET lease_owner = %s, lease_token = %s, lease_expires_at = %s, "
                    "unproductive_claims = unproductive_claims + %s, status = %s, waiting_reason = %s, "
                    "run_count = run_count + 1, history_seq = history_seq + 1 "
                    f"WHERE id = %s AND {'lease_token IS NULL' if old_token is None else 'lease_token = %s'} "
                    "RETURNING history_seq",
                    [worker_id, token, _db_time(lease_until), 0 if old_token is None else 1, new_status,
                     "", pk, *([] if old_token is None else [old_token])],
                )
                row = cursor.fetchone()
                if row is not None:
                    claimed.append((pk, token))
                    data = {"run": run_count + 1, "from": status, "worker": worker_id}
                    started.append((pk, row[0], History("run.started", data)))
        for pk, seq, record in started:
            _insert_history(pk, seq, [record], now)
    return claimed


@retry_while_locked
def heartbeat(tokens: Sequence[str], lease_seconds: float) -> set[str]:
    """Extend the leases held under these tokens; returns the tokens that were lost."""
    if not tokens:
        return set()
    lease_until = clock.now() + timedelta(seconds=lease_seconds)
    with transaction.atomic():
        # Lock in instance order, as group commits do (write_steps): no deadlock cycle.
        rows = Instance.objects.filter(lease_token__in=list(tokens)).order_by("id")
        if connection.features.has_select_for_update:
            rows = rows.select_for_update()
        held = dict(rows.values_list("id", "lease_token"))
        Instance.objects.filter(id__in=list(held)).update(lease_expires_at=lease_until)
    return set(tokens) - set(held.values())


@retry_while_locked
def release(leases: Sequence[tuple[int, str]]) -> None:
    """Give leases back without changing status (shutdown, or runs that were cut short);
    fenced by token: a lease that moved on is left alone."""
    faults.hit("before_release")
    with transaction.atomic():
        for pk, token in leases:
            Instance.objects.filter(id=pk, lease_token=token).update(
                lease_token=None, lease_owner="", lease_expires_at=None
            )


def next_wake_at() -> datetime | None:
    """The earliest timer among unleased instances, for the worker's idle wait."""
    return Instance.objects.filter(wake_at__isnull=False, lease_token__isnull=True).aggregate(m=Min("wake_at"))["m"]


# --- writes of a run (fenced) --------------------------------------------------------


def _fence(
    pk: int, token: str, now: datetime, history_count: int, step_seq: int | None, progress: bool = False
) -> tuple[str, int]:
    """Lock the instance row if and only if this run still owns it.

    Returns (status, first history sequence number); raises LeaseLost otherwise.
    """
    sets = "history_seq = history_seq + %s, updated_at = %s"
    params: list[Any] = [history_count, _db_time(now)]
    if step_seq is not None:
        sets += ", step_seq = %s"
        params.append(step_seq)
    if progress:
        sets += ", unproductive_claims = 0"
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {INSTANCE_TABLE} SET {sets} WHERE id = %s AND lease_token = %s RETURNING status, history_seq",
            [*params, pk, token],
        )
        row = cursor.fetchone()
    if row is None:
        raise LeaseLost(f"instance #{pk}: lease {token[:8]} is no longer held")
    return row[0], row[1] - history_count + 1


@retry_while_locked
def write_step(
    pk: int,
    token: str,
    step: StepRecord,
    history: Sequence[History],
    consume_event: int | None = None,
    progress: bool = False,
    error: dict[str, Any] | None = None,
) -> str:
    """Upsert one step record with its history in one fenced transaction; returns the status.

    consume_event marks that inbox event consumed by this step in the same transaction, so
    an event is never both lost and checkpointed, nor consumed twice.
    """
    with transaction.atomic():
        status = _write_step(pk, token, step, history, consume_event, progress, error)
    faults.hit("after_checkpoint")
    return status


@dataclass
class StepWrite:
    """One run's checkpoint, queued for a group commit (write_steps)."""

    pk: int
    token: str
    step: StepRecord
    history: Sequence[History]
    consume_event: int | None = None
    progress: bool = False
    error: dict[str, Any] | None = None


@retry_while_locked
def write_steps(writes: Sequence[StepWrite]) -> list[str | LeaseLost]:
    """Several runs' checkpoints in one transaction: one commit instead of one each.

    Each write is fenced on its own, so a run that lost its lease gets its LeaseLost back
    while the others commit. Rows are locked in instance order, so two
    concurrent group commits can never deadlock on each other.
    """
    if len(writes) == 1:  # no savepoint needed: a LeaseLost rolls the one write back
        w = writes[0]
        try:
            with transaction.atomic():
                status = _write_step(w.pk, w.token, w.step, w.history, w.consume_event, w.progress, w.error)
        except LeaseLost as exc:
            return [exc]
        faults.hit("after_checkpoint")
        return [status]
    if connection.vendor == "postgresql" and connection.connection is not None and not connection.is_usable():
        # A connection the server dropped while idle (a restart, pg_terminate_backend) would
        # fail every write of the group; one round trip per group finds out first.
        connection.close()
    results: dict[int, str | LeaseLost] = {}
    with transaction.atomic():
        for index in sorted(range(len(writes)), key=lambda i: writes[i].pk):
            w = writes[index]
            # The fence is a write's first statement and changes nothing when it fails;
            # only a write consuming an event can fail after changing rows: a savepoint.
            scope = transaction.atomic() if w.consume_event is not None else contextlib.nullcontext()
            try:
                with scope:
                    results[index] = _write_step(w.pk, w.token, w.step, w.history, w.consume_event, w.progress, w.error)
            except LeaseLost as exc:
                results[index] = exc
    for _ in writes:
        faults.hit("after_checkpoint")
    return [results[i] for i in range(len(writes))]


def _write_step(
    pk: int,
    token: str,
    step: StepRecord,
    history: Sequence[History],
    consume_event: int | None,
    progress: bool,
    error: dict[str, Any] | None,
) -> str:
    faults.hit("before_checkpoint")
    now = clock.now()
    status, first_seq = _fence(pk, token, now, len(history), step.seq, progress)
    if consume_event is not None:
        taken = InboxEvent.objects.filter(id=consume_event, consumed_at__isnull=True).update(
            consumed_at=now, consumed_by=step.name
        )
        if not taken:
            raise LeaseLost(f"event #{consume_event} was consumed by another run")
    step.instance_id = pk
    with connection.cursor() as cursor:
        cursor.execute(UPSERT_STEP_SQL, [
            pk, step.name, step.kind, step.seq, step.status, step.output_json, step.attempts,
            step.max_attempts, step.last_error_name, step.last_error_message, step.last_error_stack,
            _db_time(step.started_at), _db_time(step.completed_at), _db_time(step.wake_at),
            step.event_type, step.event_schema_json, step.has_compensation, step.after,
        ])
    _insert_history(pk, first_seq, history, now)
    if error is not None:
        ErrorRecord.objects.create(instance_id=pk, created_at=now, **error)
    return status


def transient(error: BaseException | None) -> bool:
    """No error, or one a new connection may not meet again (restart, dropped connection)."""
    return error is None or isinstance(error, (OperationalError, InterfaceError))


@retry_while_locked
def rewrite_step(w: StepWrite) -> str:
    """Write a checkpoint again after a transient error, unless the first try landed.

    The error may have come after the commit (the connection dropped before the answer):
    the step row then already holds this write's status and attempt, and writing it again
    would duplicate its history. The fence makes both paths safe: a lost lease raises.
    """
    with transaction.atomic():
        held = Instance.objects.filter(id=w.pk, lease_token=w.token).values_list("status", flat=True).first()
        if held is None:
            raise LeaseLost(f"instance #{w.pk}: lease {w.token[:8]} is no longer held")
        stored = (
            StepRecord.objects.filter(instance_id=w.pk, kind=w.step.kind, name=w.step.name)
            .values_list("status", "attempts")
            .first()
        )
        if stored == (w.step.status, w.step.attempts):
            return held
        status = _write_step(w.pk, w.token, w.step, w.history, w.consume_event, w.progress, w.error)
    faults.hit("after_checkpoint")
    return status


@retry_while_locked
def finish(
    pk: int,
    token: str,
    status: str,
    limits: Limits,
    output_json: str | None = None,
    error: tuple[str, str, str] | None = None,
    history: Sequence[History] = (),
    error_record: dict[str, Any] | None = None,
) -> bool:
    """End the instance (complete, errored, terminated), free its place, start queued ones."""
    now = clock.now()
    name, message, stack = error or ("", "", "")
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {INSTANCE_TABLE} SET history_seq = history_seq + %s, updated_at = %s, status = %s, "
                "output_json = %s, error_name = %s, error_message = %s, error_stack = %s, finished_at = %s, "
                "compensate_on_cancel = %s, wake_at = NULL, waiting_reason = '', lease_token = NULL, "
                "lease_owner = '', lease_expires_at = NULL "
                "WHERE id = %s AND lease_token = %s RETURNING history_seq, retention_ms, workflow",
                [len(history), _db_time(now), status, output_json, name, message, stack, _db_time(now), False, pk, token],
            )
            row = cursor.fetchone()
        if row is None:
            return False
        last_seq, retention_ms, workflow = row
        _close_open_steps(pk, now)
        retention = retention_ms if retention_ms is not None else limits.max_retention
        if retention:
            Instance.objects.filter(id=pk).update(expires_at=add_duration(now, retention))
        _insert_history(pk, last_seq - len(history) + 1, history, now)
        if error_record is not None:
            ErrorRecord.objects.create(instance_id=pk, created_at=now, **error_record)
        if limits.max_concurrent_instances is not None:  # queues exist only under a limit
            promote_queued(workflow, limits, now)
    return True


@retry_while_locked
def park(
    pk: int, token: str, pause: bool, awaited_types: Sequence[str], reason: str = "", events_seen: int = 0
) -> str:
    """Free the worker: store when the instance is due next and release the lease.

    The wake time is read from the step rows (sleep ends, retry times, event timeouts), so
    a skip_sleep that landed during the run is honoured. An event of an awaited type that
    arrived during the run (id above events_seen) makes the instance due at once: no
    wake-up is lost. The row, not the run, says whether a pause holds: a run that stopped
    early (for a pause resumed meanwhile, or its worker shutting down) is due at once.
    """
    now = clock.now()
    with transaction.atomic():
        status, _ = _fence(pk, token, now, 0, None)
        if status in (Status.WAITING_FOR_PAUSE, Status.PAUSED):
            new_status, wake_at = Status.PAUSED, None
        elif pause:  # stopped early (a pause resumed meanwhile, a worker draining): due at once
            new_status = Status.COMPENSATING if status == Status.COMPENSATING else Status.WAITING
            wake_at = now
        else:
            new_status = Status.COMPENSATING if status == Status.COMPENSATING else Status.WAITING
            wake_at = StepRecord.objects.filter(
                instance_id=pk, status__in=(StepStatus.WAITING, StepStatus.RETRYING)
            ).aggregate(m=Min("wake_at"))["m"]
            # Only events the run did not see: one it saw and passed over (a typed wait's
            # schema refused it) must not make the instance due again and again.
            if awaited_types and InboxEvent.objects.filter(
                instance_id=pk, consumed_at__isnull=True, type__in=list(awaited_types), id__gt=events_seen
            ).exists():
                wake_at = now
        Instance.objects.filter(id=pk).update(
            status=new_status, wake_at=wake_at, waiting_reason=reason,
            lease_token=None, lease_owner="", lease_expires_at=None,
        )
        if new_status == Status.PAUSED:
            append_history(pk, [History("instance.paused", {"at": "step boundary"})], now)
    return new_status



@retry_while_locked
def begin_compensation(pk: int, token: str, data: dict[str, Any]) -> None:
    """A run failed and unwinds: show the instance compensating, record why, once.

    A replay that fails the same way finds the row compensating already and adds nothing.
    """
    now = clock.now()
    with transaction.atomic():
        status, _ = _fence(pk, token, now, 0, None)
        if status == Status.COMPENSATING:
            return
        Instance.objects.filter(id=pk).update(status=Status.COMPENSATING)
        append_history(pk, [History("compensation.started", data)], now)


VERSION_MISSING = "version-missing: "


@retry_while_locked
def wake_registered_versions(versions: Sequence[tuple[str, int]]) -> int:
    """Instances parked because their version was missing continue once it is registered."""
    now = clock.now()
    woken = 0
    for name, version in versions:
        woken += Instance.objects.filter(
            workflow=name, version=version, status=Status.WAITING, wake_at__isnull=True,
            waiting_reason__startswith=VERSION_MISSING,
        ).update(wake_at=now, waiting_reason="")
    return woken


@retry_while_locked
def park_unrunnable(pk: int, token: str, reason: str) -> None:
    """Park an instance this process cannot run (its version is not registered here)."""
    with transaction.atomic():
        try:
            _fence(pk, token, clock.now(), 0, None)
        except LeaseLost:
            return
        Instance.objects.filter(id=pk).update(
            status=Status.WAITING, wake_at=None, waiting_reason=VERSION_MISSING + reason,
            lease_token=None, lease_owner="", lease_expires_at=None,
        )


# --- operator actions ---------------------------------------------------------------


def _close_open_steps(pk: int, now: datetime) -> None:
    """A finished instance has no step still waiting, retrying or running."""
    StepRecord.objects.filter(
        instance_id=pk, status__in=(StepStatus.WAITING, StepStatus.RETRYING, StepStatus.RUNNING)
    ).update(
        status=StepStatus.FAILED, wake_at=None, completed_at=now, last_error_name="InstanceFinished",
        last_error_message="the instance finished before this step did",
    )


def _locked(name: str, instance_id: str) -> Instance:
    try:
        return Instance.objects.select_for_update().get(workflow=name, instance_id=instance_id)
    except Instance.DoesNotExist:
        raise InstanceNotFound(f"workflow {name!r} has no instance {instance_id!r}") from None


def _clear_lease() -> dict[str, Any]:
    return {"lease_token": None, "lease_owner": "", "lease_expires_at": None}


@retry_while_locked
def pause(name: str, instance_id: str, actor: str = "") -> str:
    now = clock.now()
    with transaction.atomic():
        inst = _locked(name, instance_id)
        held = inst.lease_token is not None and inst.lease_expires_at is not None and inst.lease_expires_at > now
        new_status = lifecycle.after(lifecycle.PAUSE, inst.status, instance_id, held_by_run=held)
        updates: dict[str, Any] = {"status": new_status, "updated_at": now}
        if new_status == Status.PAUSED:
            updates.update(wake_at=None, **_clear_lease())
        Instance.objects.filter(id=inst.pk).update(**updates)
        if new_status == Status.PAUSED:
            append_history(inst.pk, [History("instance.paused", {"from": inst.status}, actor)], now)
        else:
            append_history(inst.pk, [History("instance.pause_requested", {}, actor)], now)
    return new_status


@retry_while_locked
def resume(name: str, instance_id: str, limits: Limits, actor: str = "") -> str:
    """Resume a paused instance; one paused while still queued goes back through admission."""
    now = clock.now()
    with transaction.atomic():
        inst = _locked(name, instance_id)
        new_status = lifecycle.after(lifecycle.RESUME, inst.status, instance_id, admitted=inst.started_at is not None)
        if new_status == Status.QUEUED:
            Instance.objects.filter(id=inst.pk).update(status=Status.QUEUED, wake_at=None, updated_at=now)
            append_history(inst.pk, [History("instance.resumed", {"to": Status.QUEUED}, actor)], now)
            if inst.pk in promote_queued(name, limits, now):
                new_status = Status.RUNNING
        elif inst.status == Status.WAITING_FOR_PAUSE:
            Instance.objects.filter(id=inst.pk).update(status=Status.RUNNING, updated_at=now)
            append_history(inst.pk, [History("instance.resumed", {}, actor)], now)
        else:
            Instance.objects.filter(id=inst.pk).update(status=Status.RUNNING, wake_at=now, updated_at=now)
            append_history(inst.pk, [History("instance.resumed", {}, actor)], now)
    return new_status


@retry_while_locked
def terminate(name: str, instance_id: str, limits: Limits, actor: str = "", reason: str = "") -> bool:
    """Terminate a live instance; returns False if it had already finished."""
    with transaction.atomic():
        inst = _locked(name, instance_id)
        if not lifecycle.can(lifecycle.TERMINATE, inst.status):
            return False
        _terminate_locked(inst, limits, actor, reason, clock.now())
    return True


def _terminate_locked(inst: Instance, limits: Limits, actor: str, reason: str, now: datetime) -> None:
    retention = inst.retention_ms if inst.retention_ms is not None else limits.max_retention
    Instance.objects.filter(id=inst.pk).update(
        status=Status.TERMINATED, wake_at=None, finished_at=now, updated_at=now, waiting_reason="",
        compensate_on_cancel=False,
        expires_at=add_duration(now, retention) if retention else None, **_clear_lease(),
    )
    _close_open_steps(inst.pk, now)
    append_history(inst.pk, [History("instance.terminated", {"from": inst.status, "reason": reason}, actor)], now)
    promote_queued(inst.workflow, limits, now)


@retry_while_locked
def restart(name: str, instance_id: str, limits: Limits, from_step: str | None = None, actor: str = "") -> str:
    """Drop checkpoints (all, or from_step and every step started after it) and run again."""
    now = clock.now()
    with transaction.atomic():
        inst = _locked(name, instance_id)
        steps = StepRecord.objects.filter(instance_id=inst.pk)
        if from_step is not None:
            anchor = steps.exclude(kind=StepKind.COMPENSATE).filter(name=from_step).values_list("seq", flat=True).first()
            if anchor is None:
                raise InvalidInput(f"instance {instance_id!r} has no step named {from_step!r}")
            steps = steps.filter(Q(seq__gte=anchor) | ~Q(status=StepStatus.COMPLETE))
        dropped = steps.count()
        steps.delete()
        was_active = holding_places(Instance.objects.filter(id=inst.pk)).exists()
        if limits.max_concurrent_instances is not None:
            _lock_workflow(name)
        slots = _free_slots(name, limits)
        admitted = was_active or slots is None or slots > 0
        Instance.objects.filter(id=inst.pk).update(
            status=Status.RUNNING if admitted else Status.QUEUED, wake_at=now if admitted else None,
            started_at=(inst.started_at or now) if admitted else None,
            output_json=None, error_name="", error_message="", error_stack="", finished_at=None,
            expires_at=None, waiting_reason="", updated_at=now, unproductive_claims=0,
            compensate_on_cancel=False, **_clear_lease(),
        )
        append_history(
            inst.pk,
            [History("instance.restarted", {"from_step": from_step, "dropped_steps": dropped, "from": inst.status}, actor)],
            now,
        )
    return Status.RUNNING if admitted else Status.QUEUED


@retry_while_locked
def skip_sleep(name: str, instance_id: str, actor: str = "") -> int:
    """Make the current sleeps of an instance due now; returns how many were woken."""
    now = clock.now()
    with transaction.atomic():
        inst = _locked(name, instance_id)
        woken = StepRecord.objects.filter(
            instance_id=inst.pk, kind__in=(StepKind.SLEEP, StepKind.SLEEP_UNTIL), status=StepStatus.WAITING
        ).update(wake_at=now)
        if not woken:
            raise InvalidTransition(f"instance {instance_id!r} is not sleeping (it is {inst.status})")
        if inst.status in (Status.WAITING, Status.RUNNING):
            Instance.objects.filter(id=inst.pk).update(wake_at=now, updated_at=now)
        append_history(inst.pk, [History("sleep.skipped", {"count": woken}, actor)], now)
    return woken


@retry_while_locked
def send_event(
    name: str, instance_id: str, event_type: str, payload_json: str, validate: Any = None, actor: str = ""
) -> InboxEvent:
    """Store an event for an instance and make it due if it is running or waiting.

    validate(schema_json) is called with the schema of the step waiting for this type
    (if any) before anything is written; it raises to refuse the payload.
    """
    now = clock.now()
    with transaction.atomic():
        inst = _locked(name, instance_id)
        if not lifecycle.can(lifecycle.SEND_EVENT, inst.status):
            raise InvalidTransition(
                f"cannot send event {event_type!r} to instance {instance_id!r}: it is {inst.status}"
            )
        if validate is not None:
            schema = (
                StepRecord.objects.filter(
                    instance_id=inst.pk, kind=StepKind.WAIT_FOR_EVENT, status=StepStatus.WAITING,
                    event_type=event_type, event_schema_json__isnull=False,
                )
                .order_by("seq")
                .values_list("event_schema_json", flat=True)
                .first()
            )
            if schema is not None:
                validate(schema)
        event = InboxEvent.objects.create(
            instance_id=inst.pk, type=event_type, payload_json=payload_json, created_at=now, actor=actor
        )
        if inst.status in (Status.WAITING, Status.RUNNING):
            Instance.objects.filter(id=inst.pk).update(wake_at=now, updated_at=now)
        append_history(inst.pk, [History("event.sent", {"type": event_type, "event_id": event.pk}, actor)], now)
    return event


def prunable(now: datetime | None = None) -> int:
    """How many finished instances are past their retention."""
    return Instance.objects.filter(expires_at__lte=now or clock.now()).count()


def prune(now: datetime | None = None, batch: int = 500, on_batch: Callable[[int], None] | None = None) -> int:
    """Delete finished instances past their retention, with every row that belongs to them.

    One transaction per batch, so a large backlog never holds the database for long;
    on_batch hears how many each batch deleted (a progress bar).
    """
    now = now or clock.now()
    total = 0
    while True:
        with transaction.atomic():
            pks = list(Instance.objects.filter(expires_at__lte=now).values_list("id", flat=True)[:batch])
            if not pks:
                return total
            Instance.objects.filter(id__in=pks).delete()  # cascades to steps, events, history, spans
        total += len(pks)
        if on_batch is not None:
            on_batch(len(pks))


@retry_while_locked
def cancel(name: str, instance_id: str, limits: Limits, compensate: bool, actor: str = "") -> str:
    """Cancel: terminate at once, or first run the compensations of completed steps."""
    now = clock.now()
    with transaction.atomic():
        inst = _locked(name, instance_id)
        lifecycle.after(lifecycle.CANCEL, inst.status, instance_id)
        compensable = compensate and StepRecord.objects.filter(
            instance_id=inst.pk, kind=StepKind.DO, status=StepStatus.COMPLETE, has_compensation=True
        ).exists()
        if not compensable:
            append_history(inst.pk, [History("instance.cancelled", {"compensate": compensate}, actor)], now)
            _terminate_locked(inst, limits, actor, "cancelled", now)
            return Status.TERMINATED
        # The next run replays to collect the compensations, then runs them newest first.
        Instance.objects.filter(id=inst.pk).update(
            status=Status.COMPENSATING, compensate_on_cancel=True, wake_at=now, updated_at=now,
            waiting_reason="", **_clear_lease(),
        )
        append_history(inst.pk, [History("compensation.started", {"reason": "cancel"}, actor)], now)
        return Status.COMPENSATING
