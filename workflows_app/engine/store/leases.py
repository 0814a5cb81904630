"""Leases and claims: which worker runs which instance, and loading what a run needs.

Runnable: wake_at <= now and no live lease. A claim leases rows to a worker under a
fresh token; heartbeats extend the leases; a crashed worker's leases run out and any
worker claims the instances again.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Collection, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from django.db import DatabaseError, connection, transaction
from django.db.models import Min, Q

from ...models import (
    InboxEvent,
    Instance,
    Status,
    StepKind,
    StepRecord,
    StepStatus,
)
from .. import clock, faults, registry
from .control import first_admit, first_admit_statement
from .dialect import (
    array_literal,
    db_time,
    from_db_time,
    lock_rows,
    measure_clock_offset,
    pipeline,
    retry_while_locked,
    sql_cursor,
    statement_cursor,
    writes_in_one_statement,
)
from .records import (
    HISTORY_TABLE,
    INBOX_TABLE,
    INSTANCE_TABLE,
    STEP_TABLE,
    History,
    LoadedRun,
    insert_history_rows,
    models_from_rows,
)


def load_run(pk: int) -> LoadedRun:
    """The instance and all its checkpoints: two queries, any size."""
    return load_runs([pk])[pk]


EVENTS_PER_LOAD = 100  # buffered events read with a load, per instance loaded


def load_runs(pks: Sequence[int]) -> dict[int, LoadedRun]:
    """Several instances with all their checkpoints, and the oldest buffered events of the
    types their waiting steps wait for: three queries, bounded whatever is buffered.
    Other events are read when a wait asks for them (unconsumed_events)."""
    ids = list(pks)
    with statement_cursor() as cursor:
        rows = []
        for sql, params in _load_statements(ids, EVENTS_PER_LOAD * len(ids)):
            cursor.execute(sql, params)
            rows.append(cursor.fetchall())
    instances, steps, events = (models_from_rows(m, r) for m, r in zip(LOADED_MODELS, rows))
    return _assemble(instances, steps, events, len(instances))


def _assemble(
    instances: Sequence[Instance],
    steps: Sequence[StepRecord],
    events: Sequence[InboxEvent],
    loaded_at_most: int,
) -> dict[int, LoadedRun]:
    """LoadedRuns from the rows read: events are the oldest EVENTS_PER_LOAD * loaded_at_most
    of the types waiting steps wait for, in id order (each type gets a prefix of its own)."""
    runs = {i.pk: LoadedRun(i, {}) for i in instances}
    awaited: set[tuple[int, str]] = set()
    for step in steps:
        loaded = runs.get(step.instance_id)
        if loaded is None:
            continue
        if step.kind == StepKind.COMPENSATE:
            loaded.compensations[step.name] = step
            continue
        loaded.steps[step.name] = step
        if step.kind == StepKind.WAIT_FOR_EVENT and step.status == StepStatus.WAITING:
            awaited.add((step.instance_id, step.event_type))
    complete = len(events) < EVENTS_PER_LOAD * loaded_at_most
    for pk, event_type in awaited:
        runs[pk].events[event_type] = ([], complete)
    for event in events:
        if (event.instance_id, event.type) in awaited:
            runs[event.instance_id].events[event.type][0].append(event)
    return runs


def unconsumed_events(pk: int, event_type: str, after_id: int, limit: int) -> list[InboxEvent]:
    """The oldest unconsumed events of a type sent to an instance, past after_id (a wait's
    first look: raw and prepared, as the claim's reads; the ORM built and the server
    planned it every time)."""
    postgres = connection.vendor == "postgresql"
    with statement_cursor() as cursor:
        cursor.execute(_unconsumed_sql(postgres), [pk, event_type, after_id, limit])
        return models_from_rows(InboxEvent, cursor.fetchall())


@functools.cache
def _unconsumed_sql(postgres: bool) -> str:
    return (
        f"SELECT {_columns(InboxEvent, 'e', postgres)} FROM {INBOX_TABLE} e "
        "WHERE e.instance_id = %s AND e.type = %s AND e.consumed_at IS NULL AND e.id > %s "
        "ORDER BY e.id LIMIT %s"
    )


class Claimed(NamedTuple):
    """What claim_and_load took, and (when it looked, in the same trip) the next timer
    and the first admit_at of the queues it was asked about (see claim_and_load)."""

    runs: list[tuple[int, str, LoadedRun | None]]
    next_wake: datetime | None = None
    looked_for_next_wake: bool = False
    first_admit_at: datetime | None = None


def claim_and_load(
    worker_id: str,
    limit: int,
    lease_seconds: float,
    exclude: Iterable[int] = (),
    versions: Collection[tuple[str, int]] | None = None,
    admission: Sequence[str] = (),
    queues: Sequence[str] | None = None,
) -> Claimed:
    """claim_runnable, then load_runs of what was claimed: one trip to the database thread.
    On PostgreSQL the next timer (next_wake_at) is read in the same round trip.

    versions: the (workflow, version) pairs the worker can run; the claim ends the due
    sleeps of those only (None: of every instance). Another is parked with a reason, and
    the worker that runs it later ends its sleep and reports it (its span).
    admission: workflows whose queues' first admit_at to read in the same trip (when
    admit_due is due next; PostgreSQL reads it in the claim's round trip).
    queues: the task queues of a worker started for some only (Instance.queue): it claims
    their instances only, and its next timer is theirs (None: every instance)."""
    if writes_in_one_statement():
        return _claim_and_load_pipelined(
            worker_id, limit, lease_seconds, exclude, versions, admission, queues
        )
    first_admit_at = first_admit(admission) if admission else None
    rows = _claim(worker_id, limit, lease_seconds, exclude, versions, queues)
    if not rows:
        return Claimed([], first_admit_at=first_admit_at)
    claimed = [(pk, token) for pk, token, _ in rows]
    try:
        faults.hit("after_claim")
        loaded = load_runs([pk for pk, _ in claimed])
    except DatabaseError:
        _release_after_failed_load(claimed)
        raise
    _mark_sleeps_ended(loaded, {pk: slept for pk, _, slept in rows if slept})
    return Claimed(
        [(pk, token, loaded.get(pk)) for pk, token in claimed],
        first_admit_at=first_admit_at,
    )


def _release_after_failed_load(claimed: Sequence[tuple[int, str]]) -> None:
    """The claims are committed but cannot run here: hand them back rather than leave
    them leased to nobody until the leases run out (best effort: expiry is the net)."""
    connection.close()  # a broken connection is not reused; the release reconnects
    with contextlib.suppress(DatabaseError):
        release(claimed)


def claim_runnable(
    worker_id: str, limit: int, lease_seconds: float, exclude: Iterable[int] = ()
) -> list[tuple[int, str]]:
    """Lease up to `limit` runnable instances to this worker and start a run of each.

    Runnable: wake_at <= now and no live lease. PostgreSQL skips rows another worker is
    claiming (FOR UPDATE SKIP LOCKED); SQLite's IMMEDIATE transaction serialises claimers.
    The claim also marks the run as started (status and run.started), so a run costs no
    transaction of its own before its first checkpoint, and ends the sleeps that came due
    (a herd of timers wakes without a checkpoint per instance for them).
    """
    return [(pk, token) for pk, token, _ in _claim(worker_id, limit, lease_seconds, exclude)]


@retry_while_locked
def _claim(
    worker_id: str,
    limit: int,
    lease_seconds: float,
    exclude: Iterable[int],
    versions: Collection[tuple[str, int]] | None = None,
    queues: Sequence[str] | None = None,
) -> list[tuple[int, str, list[str]]]:
    """claim_runnable, with the names of the sleeps each claim ended (see claim_and_load)."""
    now = clock.now()
    lease_until = now + timedelta(seconds=lease_seconds)
    if writes_in_one_statement():
        return _claim_at_once(
            _claim_params(worker_id, limit, now, lease_until, exclude, versions, queues), queues
        )
    mine = _versions_json(versions)
    due = [
        db_time(now),
        db_time(now),
        json.dumps(list(exclude)),
        db_time(now - FOREIGN_VERSION_GRACE),
        mine,
        mine,
        json.dumps(registry.resolved_prefixes()),
    ]
    where = RUNNABLE_WHERE
    if queues is not None:
        where, due = RUNNABLE_IN_QUEUES_WHERE, [*due, json.dumps(list(queues))]
    # Look before taking the write lock (SQLite takes it at BEGIN): an idle worker's poll
    # then never queues behind, nor blocks, the writers that have work.
    with sql_cursor() as cursor:
        cursor.execute(*_any_runnable_sqlite(where, due))
        if cursor.fetchone() is None:
            return []
    with transaction.atomic(), sql_cursor() as cursor:
        if queues is not None:  # tasks only: by priority, then the first due
            cursor.execute(*_tasks_by_rank_sqlite("queue IS NOT NULL", where, due, limit))
            rows = cursor.fetchall()
        elif runs_tasks():
            rows = _tasks_by_priority(cursor, due, limit)
        else:
            cursor.execute(*_first_due_sqlite(CLAIMED_NAMES, where, due, limit))
            rows = cursor.fetchall()
        return _lease_rows(rows, worker_id, lease_until, now, versions) if rows else []


def _any_runnable_sqlite(where: str, due: list[Any]) -> tuple[str, list[Any]]:
    """Whether a row is runnable on SQLite: the unleased first, by the index whose WHERE
    term the read spells (instance_unleased_runnable; of a worker of some queues,
    instance_unleased_queue), then those whose lease ran out (instance_lease_expiry).
    due[0] is the claim's now."""
    return (
        f"SELECT 1 FROM {INSTANCE_TABLE} WHERE lease_token IS NULL AND {where} UNION ALL "
        f"SELECT 1 FROM {INSTANCE_TABLE} WHERE lease_token IS NOT NULL "
        f"AND lease_expires_at <= %s AND {where} LIMIT 1",
        [*due, due[0], *due],
    )


def _first_due_sqlite(names: str, where: str, due: list[Any], limit: int) -> tuple[str, list[Any]]:
    """The first `limit` rows of `where` by wake_at on SQLite (_first_due on PostgreSQL),
    their columns `names`: the unleased by instance_unleased_runnable (its WHERE term spelt
    as a term of its own: SQLite uses a partial index only then) and those whose lease ran
    out, the first lost first, by instance_lease_expiry, merged by wake_at (then id, the
    order one index gave). A running instance stays due, so the read of instance_runnable
    went past every row the fleet's workers (and this one) held. due[0] is the claim's now."""
    picked = f"SELECT {names}, wake_at AS due_at FROM {INSTANCE_TABLE}"
    outer = ", ".join(name.split(" AS ")[-1] for name in names.split(", "))
    sql = (
        f"SELECT {outer} FROM ("
        f"SELECT * FROM ({picked} WHERE lease_token IS NULL AND {where} "
        "ORDER BY wake_at, id LIMIT %s) UNION ALL "
        f"SELECT * FROM ({picked} WHERE lease_token IS NOT NULL AND lease_expires_at <= %s "
        f"AND {where} ORDER BY lease_expires_at LIMIT %s)) ORDER BY due_at, id LIMIT %s"
    )
    return sql, [*due, limit, due[0], *due, limit, limit]


CLAIMED_NAMES = "id, lease_token, status, run_count, compensate_on_cancel, workflow, version"


def _tasks_by_priority(cursor: Any, due: list[Any], limit: int) -> list[tuple[Any, ...]]:
    """SQLite's pick of a worker that runs Django tasks (_PICKED_BY_PRIORITY on
    PostgreSQL): the first `limit` due, whose workflows keep their places and whose
    tasks' places go to the first due tasks by rank."""
    cursor.execute(
        *_first_due_sqlite(
            f"{CLAIMED_NAMES}, queue IS NOT NULL AS task", RUNNABLE_WHERE, due, limit
        )
    )
    rows = cursor.fetchall()
    places = sum(1 for row in rows if row[-1])
    workflows = [row[:-1] for row in rows if not row[-1]]
    if not places:
        return workflows
    cursor.execute(*_tasks_by_rank_sqlite("queue IS NOT NULL", RUNNABLE_WHERE, due, places))
    return workflows + cursor.fetchall()


def _tasks_by_rank_sqlite(of: str, where: str, due: list[Any], limit: int) -> tuple[str, list[Any]]:
    """The first `limit` due tasks by rank (see PRIORITY_AGING) on SQLite: the first of
    each level of priority among the unleased (instance_unleased_task_prio: its WHERE
    term spelt as its own) and the first whose lease ran out (instance_lease_expiry),
    then the first of those. due[0] is the claim's now."""
    aging_days = PRIORITY_AGING.total_seconds() / 86400
    columns = f"SELECT {CLAIMED_NAMES}, wake_at, priority FROM {INSTANCE_TABLE}"
    levels = " UNION ALL ".join(
        f"SELECT * FROM ({columns} WHERE {of} AND priority = {level} AND lease_token IS NULL "
        f"AND {where} ORDER BY wake_at, id LIMIT %s)"
        for level in range(10)
    )
    expired = (
        f"SELECT * FROM ({columns} WHERE {of} AND lease_token IS NOT NULL "
        f"AND lease_expires_at <= %s AND {where} ORDER BY lease_expires_at LIMIT %s)"
    )
    sql = (
        f"SELECT {CLAIMED_NAMES} FROM ({levels} UNION ALL {expired}) "
        f"ORDER BY julianday(wake_at) + priority * {aging_days!r}, wake_at, id LIMIT %s"
    )
    return sql, [*([*due, limit] * 10), due[0], *due, limit, limit]


# Runnable on SQLite (CLAIM_SQL's `picked` on PostgreSQL): due, not leased, and not one of
# this worker's own runs (a JSON list). Raw SQL: the ORM built the query twice per claim,
# with a parameter for each of up to 800 runs in flight.
RUNNABLE_WHERE = (
    "wake_at <= %s AND (lease_expires_at IS NULL OR lease_expires_at <= %s) "
    "AND id NOT IN (SELECT value FROM json_each(%s)) "
    "AND (wake_at <= %s OR %s IS NULL OR workflow || '@' || version IN "
    "(SELECT value FROM json_each(%s)) OR EXISTS (SELECT 1 FROM json_each(%s) AS p "
    "WHERE substr(workflow, 1, length(p.value)) = p.value))"
)
# The same for a worker of some task queues only (a JSON list), by the task indexes.
RUNNABLE_IN_QUEUES_WHERE = (
    f"{RUNNABLE_WHERE} AND queue IS NOT NULL AND queue IN (SELECT value FROM json_each(%s))"
)

# A claim takes the due instances of the versions its worker runs (or may register on
# demand: tasks), and another's only once it has been due this long: in a rolling deploy
# the worker with its version takes it (one without would park it). Parked, it is looked
# at again after VERSION_RECHECK.
FOREIGN_VERSION_GRACE = timedelta(seconds=10)
VERSION_RECHECK = timedelta(seconds=60)


def _versions_json(versions: Collection[tuple[str, int]] | None) -> str | None:
    """ "workflow@version" of each version a worker runs, as JSON (None: every version)."""
    if versions is None:
        return None
    return json.dumps(sorted(f"{name}@{version}" for name, version in versions))


def _lease_rows(
    rows: Sequence[tuple[Any, ...]],
    worker_id: str,
    lease_until: datetime,
    now: datetime,
    versions: Collection[tuple[str, int]] | None,
) -> list[tuple[int, str, list[str]]]:
    """The claim's writes on SQLite, a few statements for the whole batch (CLAIM_SQL's
    parts on PostgreSQL): lease the rows picked and start their runs, end their due
    sleeps, write their run.started and sleep.completed records. Statements per row held
    SQLite's write lock longer (a claim of ~110 with its load: 24 ms, now 18)."""
    tokens = dict(zip((row[0] for row in rows), lease_tokens(len(rows)), strict=True))
    leases, previous, runnable = [], {}, set()
    for pk, old_token, status, run_count, compensating, workflow, version in rows:
        if compensating:
            new_status = Status.COMPENSATING
        elif status in (Status.WAITING, Status.RUNNING):
            new_status = Status.RUNNING
            if versions is None or (workflow, version) in versions:
                runnable.add(pk)  # its due sleeps end in the claim
        else:
            new_status = status  # waitingForPause: the run parks it as paused
        leases.append([pk, tokens[pk], old_token, new_status, 0 if old_token is None else 1])
        previous[pk] = (status, run_count)
    with sql_cursor() as cursor:
        cursor.execute(
            f"UPDATE {INSTANCE_TABLE} SET lease_owner = %s, lease_token = json_extract(j.value, '$[1]'), "
            "lease_expires_at = %s, "
            "unproductive_claims = unproductive_claims + json_extract(j.value, '$[4]'), "
            "status = json_extract(j.value, '$[3]'), waiting_reason = '', "
            "run_count = run_count + 1, history_seq = history_seq + 1 "
            f"FROM json_each(%s) AS j WHERE {INSTANCE_TABLE}.id = json_extract(j.value, '$[0]') "
            f"AND {INSTANCE_TABLE}.lease_token IS json_extract(j.value, '$[2]') "
            f"RETURNING {INSTANCE_TABLE}.id, {INSTANCE_TABLE}.history_seq",
            [worker_id, db_time(lease_until), json.dumps(leases)],
        )
        started = dict(cursor.fetchall())
        slept = _end_due_sleeps(cursor, [pk for pk in started if pk in runnable], now)
    history = []
    for pk, seq in started.items():
        status, run_count = previous[pk]
        names = slept.get(pk, [])
        history.append(
            (
                pk,
                seq,
                History("run.started", {"run": run_count + 1, "from": status, "worker": worker_id}),
            )
        )
        history += [
            (pk, seq + n, History("sleep.completed", {"step": name}))
            for n, name in enumerate(names, 1)
        ]
    insert_history_rows(history, now)
    return [(pk, tokens[pk], slept.get(pk, [])) for pk, _, *_ in rows if pk in started]


def _end_due_sleeps(cursor: Any, pks: Sequence[int], now: datetime) -> dict[int, list[str]]:
    """The claim's ending of due sleeps on SQLite (CLAIM_SQL's `ended` on PostgreSQL):
    their checkpoints, and room for their sleep.completed records after run.started.
    Returns each instance's ended sleeps in the order the run took them."""
    if not pks:
        return {}
    cursor.execute(
        f"UPDATE {STEP_TABLE} SET status = %s, completed_at = %s, output_json = 'null' "
        f"WHERE instance_id IN ({', '.join(['%s'] * len(pks))}) AND kind IN (%s, %s) "
        "AND status = %s AND wake_at <= %s RETURNING instance_id, name, seq",
        [
            StepStatus.COMPLETE,
            db_time(now),
            *pks,
            StepKind.SLEEP,
            StepKind.SLEEP_UNTIL,
            StepStatus.WAITING,
            db_time(now),
        ],
    )
    ended: dict[int, list[tuple[int, str]]] = {}
    for pk, name, seq in cursor.fetchall():
        ended.setdefault(pk, []).append((seq, name))
    if ended:
        counts = [[pk, len(names)] for pk, names in ended.items()]
        cursor.execute(
            f"UPDATE {INSTANCE_TABLE} SET history_seq = history_seq + json_extract(j.value, '$[1]'), "
            f"unproductive_claims = 0 FROM json_each(%s) AS j WHERE {INSTANCE_TABLE}.id = json_extract(j.value, '$[0]')",
            [json.dumps(counts)],
        )
    return {pk: [name for _, name in sorted(names)] for pk, names in ended.items()}


def lease_token_sql(base: str, n: str) -> str:
    """SQL of a claim's n-th lease token from its base (see lease_token_base)."""
    return f"CAST({base} AS text) || lpad(to_hex({n}), 8, '0')"


# claim_runnable as one autocommit statement (PostgreSQL): pick and lock the due rows,
# end the sleeps that came due in them (`ended`), lease them under tokens made from the
# claim's base (the n-th picked row holds the n-th token), start their runs and write
# their run.started and sleep.completed records.
#
# Its commit does not wait for the WAL flush (`async_commit`, this transaction only): a
# claim lost in a server crash loses nothing a run did, because every checkpoint the run
# writes afterwards is a synchronous commit, and a flush of its WAL flushes the claim's
# before it. Until then the lost claim leaves the instance as it was: unleased, due, and
# run again, as a step whose checkpoint was lost is run again.
_RUNNABLE = """wake_at <= %(now)s AND (lease_expires_at IS NULL OR lease_expires_at <= %(now)s)
      AND id <> ALL(CAST(%(exclude)s AS bigint[]))
      AND (wake_at <= %(foreign_due)s OR CAST(%(versions)s AS jsonb) IS NULL
        OR workflow || '@' || version IN (
          SELECT jsonb_array_elements_text(CAST(%(versions)s AS jsonb)))
        OR EXISTS (SELECT 1 FROM jsonb_array_elements_text(CAST(%(prefixes)s AS jsonb)) AS p
          WHERE starts_with(workflow, p.value)))"""


def _first_due(columns: str) -> str:
    """The first %(limit)s rows of _RUNNABLE by wake_at, locked, skipping those another
    claim holds; `columns` and due_at (their wake_at). Read as the rows no worker holds
    (instance_unleased_runnable) and those whose lease ran out, the first lost first
    (instance_lease_expiry): a running instance stays due, so one read through
    instance_runnable went past every leased row of the fleet first (600 of them: 1.1 ms
    of the server's time a claim). A lease always has its expiry: each write of a
    lease_token writes lease_expires_at."""
    return f"""
        WITH unleased AS (
            SELECT {columns}, wake_at AS due_at FROM {INSTANCE_TABLE}
            WHERE lease_token IS NULL AND {_RUNNABLE}
            ORDER BY wake_at LIMIT %(limit)s
            FOR NO KEY UPDATE SKIP LOCKED
        ), expired AS (
            SELECT {columns}, wake_at AS due_at FROM {INSTANCE_TABLE}
            WHERE lease_token IS NOT NULL AND lease_expires_at <= %(now)s AND {_RUNNABLE}
            ORDER BY lease_expires_at LIMIT %(limit)s
            FOR NO KEY UPDATE SKIP LOCKED
        )
        SELECT * FROM unleased UNION ALL SELECT * FROM expired
        ORDER BY due_at LIMIT %(limit)s"""


_TASK_COLUMNS = """id, lease_token AS old_token, status AS old_status, compensate_on_cancel,
        workflow, version"""
_PICKED_COLUMNS = "id, old_token, old_status, compensate_on_cancel, workflow, version"
_PICKED = f"SELECT {_PICKED_COLUMNS} FROM ({_first_due(_TASK_COLUMNS)}) AS due"
# A worker that runs Django tasks (a task is an instance with a queue) takes the due tasks
# by priority: a task's rank is its wake_at put back PRIORITY_AGING for each level of
# priority (0-9, lower first), so of tasks due together the more urgent runs first, the
# same priority keeps the order they came due in, and a task waits behind more urgent
# ones enqueued at most 9 * PRIORITY_AGING after it: a flood of them cannot starve it.
# Its workflows keep their places: the due rows are picked as _PICKED does (`due`, the
# same scan), and the places of its tasks go to the first tasks by rank. Those are found
# in two passes: a read of the first of each level of priority, twice as many as there
# are places, locking nothing (_first_by_rank); then the first of those by rank
# are locked, skipping any another claim holds (locking each level's first, up to ten
# times the rows kept, made a claim of 200 tasks twice as slow). Only when `due` holds
# a task does more run (a LIMIT of 0 runs nothing below it). Rows locked and not kept
# are let go at the statement's end.
PRIORITY_AGING = timedelta(minutes=1)
_RANK = f"wake_at + priority * interval '{int(PRIORITY_AGING.total_seconds())} seconds'"


def _first_by_rank(levels: str, level: str, tasks: str, count: str) -> str:
    """The ids of the first `count` runnable tasks by rank, locking nothing: the first
    `count` of each level (`level`, a row of `levels`) by wake_at among the rows no
    worker holds (instance_unleased_task_prio, instance_unleased_queue_prio), and the
    first `count` of `tasks` whose lease ran out, the first lost first (as _first_due).
    A running task stays due: read by an index of the leased rows too, each level went
    past every task the fleet's workers held (2,000: 2,000 rows read a claim)."""
    return f"""
            SELECT t.id FROM (
                SELECT d.id, d.rank FROM {levels}, LATERAL (
                    SELECT id, {_RANK} AS rank
                    FROM {INSTANCE_TABLE}
                    WHERE lease_token IS NULL AND {level} AND {_RUNNABLE}
                    ORDER BY wake_at LIMIT {count}) AS d
                UNION ALL (
                    SELECT id, {_RANK} AS rank
                    FROM {INSTANCE_TABLE}
                    WHERE lease_token IS NOT NULL AND lease_expires_at <= %(now)s
                      AND {tasks} AND {_RUNNABLE}
                    ORDER BY lease_expires_at LIMIT {count})
            ) AS t
            ORDER BY t.rank, t.id LIMIT {count}"""


def _tasks_by_rank(candidates: str, places: str) -> str:
    """The first `places` runnable tasks by rank among the ids `candidates` selects,
    locked (see PRIORITY_AGING)."""
    return f"""
        SELECT {_TASK_COLUMNS}
        FROM {INSTANCE_TABLE}
        WHERE id = ANY(ARRAY({candidates})) AND queue IS NOT NULL AND {_RUNNABLE}
        ORDER BY {_RANK}, id LIMIT {places}
        FOR NO KEY UPDATE SKIP LOCKED"""


_PICKED_BY_PRIORITY = f"""
    WITH due AS MATERIALIZED (
        {_first_due(f"{_TASK_COLUMNS}, queue IS NOT NULL AS is_task")}
    ), places AS (SELECT count(*) AS n FROM due WHERE is_task)
    SELECT {_PICKED_COLUMNS} FROM due WHERE NOT is_task
    UNION ALL SELECT * FROM ({
    _tasks_by_rank(
        _first_by_rank(
            "generate_series(0, 9) AS level(priority)",
            "queue IS NOT NULL AND priority = level.priority",
            "queue IS NOT NULL",
            "(SELECT 2 * n FROM places)",
        ),
        "(SELECT n FROM places)",
    )
}) AS ranked"""
# A worker of some task queues only (every row a task), by rank as above: at each level
# of priority the first due of each of its queues (instance_unleased_queue_prio), with
# those of its queues whose lease ran out, the first 2 * `limit` of those by rank read,
# then the first `limit` of them locked.
_PICKED_IN_QUEUES = _tasks_by_rank(
    _first_by_rank(
        "generate_series(0, 9) AS level(priority), unnest(CAST(%(queues)s AS text[])) AS q(name)",
        "queue = q.name AND priority = level.priority",
        "queue = ANY(CAST(%(queues)s AS text[]))",
        "2 * %(limit)s",
    ),
    "%(limit)s",
)
_CLAIM_TEMPLATE = f"""
WITH picked AS ({{picked}}
), ended AS (
    UPDATE {STEP_TABLE} AS s SET status = %(complete)s, completed_at = %(now)s,
        output_json = 'null'
    FROM picked AS p
    WHERE s.instance_id = p.id AND p.old_status IN (%(waiting)s, %(running)s)
      AND NOT p.compensate_on_cancel AND s.kind IN (%(sleep)s, %(sleep_until)s)
      AND s.status = %(waiting)s AND s.wake_at <= %(now)s
      AND (CAST(%(versions)s AS jsonb) IS NULL OR p.workflow || '@' || p.version IN (
          SELECT jsonb_array_elements_text(CAST(%(versions)s AS jsonb))))
    RETURNING s.instance_id, s.name, s.seq
), ended_by AS (
    SELECT instance_id, count(*) AS slept, array_agg(name ORDER BY seq, name) AS names
    FROM ended GROUP BY instance_id
), numbered AS (
    -- Joined, not a count per row: that walked `ended` once per picked row.
    SELECT p.*, row_number() OVER () AS n, COALESCE(e.slept, 0) AS slept,
        COALESCE(e.names, CAST('{{{{}}}}' AS text[])) AS names
    FROM picked AS p LEFT JOIN ended_by AS e ON e.instance_id = p.id
), claimed AS (
    UPDATE {INSTANCE_TABLE} AS i SET
        lease_owner = %(worker)s,
        lease_token = {lease_token_sql("%(token_base)s", "p.n")},
        lease_expires_at = %(lease_until)s,
        unproductive_claims = CASE WHEN p.slept > 0 THEN 0
            ELSE i.unproductive_claims + CASE WHEN p.old_token IS NULL THEN 0 ELSE 1 END END,
        status = CASE
            WHEN p.compensate_on_cancel THEN %(compensating)s
            WHEN p.old_status IN (%(waiting)s, %(running)s) THEN %(running)s
            ELSE p.old_status END,
        waiting_reason = '',
        run_count = i.run_count + 1,
        history_seq = i.history_seq + 1 + p.slept
    FROM numbered AS p WHERE i.id = p.id AND i.id = ANY(ARRAY(SELECT id FROM picked))
    RETURNING i.id, i.lease_token, i.history_seq - p.slept AS started_seq, i.run_count,
        p.old_status, p.names{{returned_rows}}
), started AS (
    INSERT INTO {HISTORY_TABLE} (instance_id, sequence, created_at, type, data, actor)
    SELECT id, started_seq, %(now)s, 'run.started',
        jsonb_build_object('run', run_count, 'from', old_status, 'worker', %(worker)s::text), ''
    FROM claimed
), slept_history AS (
    INSERT INTO {HISTORY_TABLE} (instance_id, sequence, created_at, type, data, actor)
    SELECT c.id, c.started_seq + u.n, %(now)s, 'sleep.completed',
        jsonb_build_object('step', u.name), ''
    FROM claimed AS c, unnest(c.names) WITH ORDINALITY AS u(name, n)
), async_commit AS (
    SELECT set_config('synchronous_commit', 'off', true) AS setting
)
SELECT c.id, c.lease_token, c.names AS slept{{selected_rows}}
FROM claimed AS c, async_commit
"""


def _claim_sql(with_rows: bool, in_queues: bool = False, by_priority: bool = False) -> str:
    """CLAIM_SQL, or (with_rows) CLAIM_SQL that also returns each claimed instance's row as
    its update left it, every column in field order after (id, token, slept): the
    pipelined claim then needs no read of its own for them (a statement and half a
    millisecond of the server's time per claim). in_queues: of a worker of some task
    queues only (the %(queues)s parameter); by_priority: of a worker of every queue that
    runs Django tasks (their priority orders them)."""
    columns = [f.column for f in Instance._meta.concrete_fields] if with_rows else []
    picked = _PICKED_IN_QUEUES if in_queues else _PICKED_BY_PRIORITY if by_priority else _PICKED
    return _CLAIM_TEMPLATE.format(
        picked=picked,
        returned_rows="".join(f', i."{c}" AS "row_{c}"' for c in columns),
        selected_rows="".join(f', c."row_{c}"' for c in columns),
    )


CLAIM_SQL = _claim_sql(False)
CLAIM_WITH_ROWS_SQL = _claim_sql(True)
CLAIM_IN_QUEUES_SQL = _claim_sql(False, in_queues=True)
CLAIM_IN_QUEUES_WITH_ROWS_SQL = _claim_sql(True, in_queues=True)
CLAIM_BY_PRIORITY_SQL = _claim_sql(False, by_priority=True)
CLAIM_BY_PRIORITY_WITH_ROWS_SQL = _claim_sql(True, by_priority=True)


def runs_tasks() -> bool:
    """Whether this process's workers run Django tasks (workflows_app.tasks registered its
    resolver): their claim then orders due tasks by priority (CLAIM_BY_PRIORITY_SQL).
    A worker of no tasks claims by CLAIM_SQL, the statement it always was."""
    return bool(registry.resolved_prefixes())


def _claim_statement(queues: Sequence[str] | None, with_rows: bool) -> str:
    """The claim of a worker: of some task queues, of every instance by priority among
    tasks (runs_tasks()), or of a worker of no tasks."""
    if queues is not None:
        return CLAIM_IN_QUEUES_WITH_ROWS_SQL if with_rows else CLAIM_IN_QUEUES_SQL
    if runs_tasks():
        return CLAIM_BY_PRIORITY_WITH_ROWS_SQL if with_rows else CLAIM_BY_PRIORITY_SQL
    return CLAIM_WITH_ROWS_SQL if with_rows else CLAIM_SQL


def lease_token_base() -> str:
    """A claim's 96 random bits (24 hex digits): its n-th lease token is this followed by
    n in 8 hex digits, unique among claims as the base is. One read of the OS's random
    source a claim, whatever its size: PostgreSQL's claim made and sent a token for each
    run it might take (200 by default, 49 µs and 6.6 kB a claim, parsed by the server
    three times), since its reads look for the claimed rows before knowing how many."""
    return os.urandom(12).hex()


def lease_tokens(count: int) -> list[str]:
    """count lease tokens of one claim (SQLite's: the PostgreSQL claim makes them in SQL,
    lease_token_sql, the same way)."""
    base = lease_token_base()
    return [f"{base}{n:08x}" for n in range(1, count + 1)]


def _claim_params(
    worker_id: str,
    limit: int,
    now: datetime,
    lease_until: datetime,
    exclude: Iterable[int],
    versions: Collection[tuple[str, int]] | None,
    queues: Sequence[str] | None = None,
) -> dict[str, Any]:
    params = {
        # The versions the worker runs: whose instances it takes at once, whose sleeps it
        # ends (None: all).
        "versions": _versions_json(versions),
        # Names resolvers register on demand (tasks): as the worker's own.
        "prefixes": json.dumps(registry.resolved_prefixes()),
        "foreign_due": db_time(now - FOREIGN_VERSION_GRACE),
        "now": db_time(now),
        "lease_until": db_time(lease_until),
        "exclude": array_literal(exclude),
        "limit": limit,
        "worker": worker_id,
        "token_base": lease_token_base(),
        "compensating": Status.COMPENSATING,
        "waiting": Status.WAITING,
        "running": Status.RUNNING,
        "complete": StepStatus.COMPLETE,
        "sleep": StepKind.SLEEP,
        "sleep_until": StepKind.SLEEP_UNTIL,
    }
    if queues is not None:  # the claim is CLAIM_IN_QUEUES_SQL's (only then a parameter more)
        params["queues"] = list(queues)
    return params


def _claim_at_once(
    params: dict[str, Any], queues: Sequence[str] | None
) -> list[tuple[int, str, list[str]]]:
    """The worker's claim statement alone, with _claim_params' parameters."""
    with statement_cursor() as cursor:
        cursor.execute(_claim_statement(queues, with_rows=False), params)
        return [(pk, token, slept) for pk, token, slept in cursor.fetchall()]


def _claim_and_load_pipelined(
    worker_id: str,
    limit: int,
    lease_seconds: float,
    exclude: Iterable[int],
    versions: Collection[tuple[str, int]] | None,
    admission: Sequence[str] = (),
    queues: Sequence[str] | None = None,
) -> Claimed:
    """claim_and_load in one round trip (PostgreSQL): the claim, which returns the claimed
    rows, then the reads of their checkpoints and the events of their waiting steps, sent
    together in pipeline mode; the reads find the claimed rows by the tokens this worker
    chose."""
    now = clock.now()
    lease_until = now + timedelta(seconds=lease_seconds)
    params = _claim_params(worker_id, limit, now, lease_until, exclude, versions, queues)
    reads = _load_statements([params["token_base"], limit], EVENTS_PER_LOAD * limit, by_token=True)
    with pipeline():
        claim = statement_cursor()
        claim.execute(_claim_statement(queues, with_rows=True), params)
        cursors = []
        for sql, read_params in reads:
            cursor = statement_cursor()
            cursor.execute(sql, read_params)
            cursors.append(cursor)
        # The worker's idle wait needs the next timer: asked here it costs no trip of its
        # own (a trip beside the claimed runs took the GIL from them as they started).
        timer = statement_cursor()
        timer.execute(*_next_wake_statement(queues))
        # After a create's hint: a trip of its own before the claim was a tenth of the
        # database threads' time in a stream of one-step creates.
        if admission:
            admit = statement_cursor()
            admit.execute(*first_admit_statement(admission))
    rows = claim.fetchall()
    claimed = [(pk, token) for pk, token, *_ in rows]
    next_wake = from_db_time(timer.fetchone()[0])
    first_admit_at = from_db_time(admit.fetchone()[0]) if admission else None
    try:
        faults.hit("after_claim")
        instances = models_from_rows(Instance, [row[3:] for row in rows])
        steps, events = (
            models_from_rows(model, cursor.fetchall())
            for model, cursor in zip(LOADED_MODELS[1:], cursors)
        )
        loaded = _assemble(instances, steps, events, limit)
    except DatabaseError:
        _release_after_failed_load(claimed)
        raise
    _mark_sleeps_ended(loaded, {pk: slept for pk, _, slept, *_ in rows if slept})
    return Claimed(
        [(pk, token, loaded.get(pk)) for pk, token in claimed], next_wake, True, first_admit_at
    )


def _mark_sleeps_ended(loaded: dict[int, LoadedRun], ended: dict[int, Sequence[str]]) -> None:
    """Tell each run which sleeps its claim ended: it reports them (span, live update)
    when its replay reaches them, and writes nothing for them."""
    for pk, names in ended.items():
        if pk in loaded:
            loaded[pk].sleeps_ended = set(names)


LOADED_MODELS = (Instance, StepRecord, InboxEvent)


def _columns(model: Any, alias: str, postgres: bool) -> str:
    """A model's columns in field order. SQLite: datetimes as their text, which
    models_from_rows reads in C (as declared columns, the driver parsed each one with
    Django's regular expression)."""
    return ", ".join(
        f'{alias}."{f.column}"'
        if postgres or f.get_internal_type() != "DateTimeField"
        else f'CAST({alias}."{f.column}" AS TEXT)'
        for f in model._meta.concrete_fields
    )


def _load_statements(
    keys: Sequence[Any], events_limit: int, by_token: bool = False
) -> list[tuple[str, list[Any]]]:
    """load_runs' three reads as SQL, by instance ids; by lease token (PostgreSQL: the
    reads pipelined after a claim, which returns the instance rows itself; keys are the
    claim's token base and limit) the checkpoints' and the events' only. Building them
    with the ORM cost more than running them (0.7 of 1.1 ms per read on PostgreSQL here)."""
    postgres = connection.vendor == "postgresql"
    instances, steps, events = _load_sql(by_token, postgres)
    if by_token:
        found = list(keys)
    else:
        found = [array_literal(keys) if postgres else json.dumps(list(keys))]
    waiting = [StepKind.WAIT_FOR_EVENT, StepStatus.WAITING, events_limit]
    reads = [(steps, found), (events, [*found, *waiting])]
    return reads if by_token else [(instances, found), *reads]


@functools.cache
def _load_sql(by_token: bool, postgres: bool = True) -> tuple[str, str, str]:
    # "= ANY(array)", not "IN (subquery)": the statements are prepared, and the generic
    # plan of the IN form hash-joined a sequential scan of every step row (3.6 ms per
    # claim in a herd of 10,000 timers); an array is looked up in the index whatever the
    # plan. SQLite: the ids as one JSON list.
    if not postgres:
        ids = "IN (SELECT value FROM json_each(%s))"
    elif by_token:
        # The claim's tokens (lease_token_base), made here as the claim makes them.
        tokens = f"SELECT {lease_token_sql('%s', 'n')} FROM generate_series(1, %s) AS n"
        ids = f"= ANY(ARRAY(SELECT id FROM {INSTANCE_TABLE} WHERE lease_token = ANY(ARRAY({tokens}))))"
    else:
        ids = "= ANY(CAST(%s AS bigint[]))"
    return (
        f"SELECT {_columns(Instance, 'i', postgres)} FROM {INSTANCE_TABLE} i WHERE i.id {ids}",
        f"SELECT {_columns(StepRecord, 's', postgres)} FROM {STEP_TABLE} s WHERE s.instance_id {ids}",
        f"SELECT {_columns(InboxEvent, 'e', postgres)} FROM {INBOX_TABLE} e WHERE e.instance_id {ids} "
        "AND e.consumed_at IS NULL AND EXISTS (SELECT 1 FROM "
        f"{STEP_TABLE} w WHERE w.instance_id = e.instance_id AND w.event_type = e.type "
        "AND w.kind = %s AND w.status = %s) ORDER BY e.id LIMIT %s",
    )


@retry_while_locked
def heartbeat(tokens: Sequence[str], lease_seconds: float) -> set[str]:
    """Extend the leases held under these tokens; returns the tokens that were lost."""
    measure_clock_offset()  # at most once a minute: a long-lived worker's clock drifts
    if not tokens:
        return set()
    lease_until = clock.now() + timedelta(seconds=lease_seconds)
    with transaction.atomic():
        # Lock in instance order, as group commits do (write_steps): no deadlock cycle.
        rows = Instance.objects.filter(lease_token__in=list(tokens)).order_by("id")
        rows = lock_rows(rows)
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


NEXT_WAKE_SQL = (
    f"SELECT MIN(wake_at) FROM {INSTANCE_TABLE} WHERE wake_at IS NOT NULL AND lease_token IS NULL"
)
# A worker of some task queues only: the earliest timer of each (instance_unleased_queue).
NEXT_WAKE_IN_QUEUES_SQL = (
    f"SELECT MIN(w.at) FROM unnest(CAST(%s AS text[])) AS q(name), LATERAL (SELECT MIN(wake_at) "
    f"AS at FROM {INSTANCE_TABLE} WHERE queue = q.name AND wake_at IS NOT NULL "
    "AND lease_token IS NULL) AS w"
)
NEXT_WAKE_IN_QUEUES_SQLITE = (
    f"SELECT MIN(wake_at) FROM {INSTANCE_TABLE} WHERE queue IS NOT NULL "
    "AND queue IN (SELECT value FROM json_each(%s)) AND wake_at IS NOT NULL "
    "AND lease_token IS NULL"
)


def _next_wake_statement(queues: Sequence[str] | None) -> tuple[Any, ...]:
    """next_wake_at's statement and its parameters (NEXT_WAKE_SQL has none)."""
    if queues is None:
        return (NEXT_WAKE_SQL,)
    if connection.vendor == "postgresql":
        return NEXT_WAKE_IN_QUEUES_SQL, [list(queues)]
    return NEXT_WAKE_IN_QUEUES_SQLITE, [json.dumps(list(queues))]


def next_wake_at(queues: Sequence[str] | None = None) -> datetime | None:
    """The earliest timer among unleased instances (of these task queues only: a worker
    started for some), for the worker's idle wait (the same read the PostgreSQL claim
    pipelines)."""
    with statement_cursor() as cursor:
        cursor.execute(*_next_wake_statement(queues))
        (found,) = cursor.fetchone()
    return from_db_time(found)


def next_claimable_at(
    versions: Collection[tuple[str, int]], queues: Sequence[str] | None = None
) -> datetime | None:
    """When this worker's claim can next take something: the earliest timer of its own
    versions, or another version's plus FOREIGN_VERSION_GRACE. Asked only when a timer is
    due but the claim took nothing, so a worker whose only due instances are another
    version's waits out the grace instead of looking every CONTENDED_WAIT_SECONDS."""
    own = Q(pk__in=[])  # matches nothing: a worker with no versions owns no instance
    for name, version in versions:
        own |= Q(workflow=name, version=version)
    for prefix in registry.resolved_prefixes():
        own |= Q(workflow__startswith=prefix)
    unleased = Instance.objects.filter(wake_at__isnull=False, lease_token__isnull=True)
    if queues is not None:  # a worker of some task queues: only theirs are claimable
        unleased = unleased.filter(queue__in=list(queues))
    mine = unleased.filter(own).aggregate(at=Min("wake_at"))["at"]
    theirs = unleased.exclude(own).aggregate(at=Min("wake_at"))["at"]
    if theirs is not None:
        theirs += FOREIGN_VERSION_GRACE
    return min((at for at in (mine, theirs) if at is not None), default=None)
