"""Admission and operator control: creating instances, the queue under
max_concurrent_instances, pause, resume, terminate, restart, skip sleep, send event, cancel.

Each action is one transaction under the instance's row lock; the lifecycle table
(engine/lifecycle.py) says which action applies to which status.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from django.db import IntegrityError, connection, connections, transaction
from django.db.models import Case, Max, Q, Value, When

from ...models import (
    DEBOUNCED,
    IN_LINE_SQL,
    HistoryRecord,
    InboxEvent,
    Instance,
    InstanceAttribute,
    MergedCreateKey,
    RateLimitStart,
    Status,
    StepKind,
    StepRecord,
    StepStatus,
)
from .. import clock, lifecycle, meters, retention, spans
from ..attributes import index_text
from ..errors import (
    EventPayloadInvalid,
    InstanceAlreadyExists,
    InstanceNotFound,
    InvalidInput,
    InvalidTransition,
    LimitExceeded,
)
from ..limits import Limits
from ..registry import limits_for
from .dialect import (
    db_time,
    from_db_time,
    lock_admission,
    lock_rows,
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
    LeaseLost,
    NewInstance,
    append_histories,
    append_history,
    clear_lease,
    close_open_steps,
    fit_waiting_reason,
    insert_history,
    insert_history_rows,
    locked_instance,
    new_model_object,
    wake_parent,
)
from .search import ATTRIBUTE_TABLE, index_attributes
from .wakes import WAKE_CHANNEL, hint_workers, workers_listen

RATE_START_TABLE = RateLimitStart._meta.db_table

# Told (after commit) which queued instances a transaction started; set by the app's live layer.
on_promoted: Callable[[list[int]], None] | None = None
# Told (after commit) that queued instances got a time to start (a rate window, a debounce):
# workers read the queues again and wait for it. Set by the app's live layer.
on_queue_timed: Callable[[], None] | None = None
# Told (after commit) of a child terminated with its parent, so a worker running it stops,
# and whether every worker heard it by NOTIFY already (live.instance_changed's notified).
on_child_terminated: Callable[[int, bool], None] | None = None
# Told (after commit) of a child cancelled with compensation with its parent: a worker
# running it lets its steps in flight finish, then compensates; else one runs it.
on_child_compensating: Callable[[int, bool], None] | None = None


def lock_workflow(name: str) -> None:
    """Serialise admission decisions of one workflow across processes (see lock_admission)."""
    lock_admission(name)


def holding_places(instances: Any) -> Any:
    """The instances of a queryset that hold a place under max_concurrent_instances."""
    return instances.filter(
        Q(status__in=lifecycle.HOLDS_PLACE - {Status.PAUSED})
        | Q(status=Status.PAUSED, started_at__isnull=False)
    )


# holding_places as SQL: admission reads it on every create of a flow-controlled
# workflow, and building the ORM queries cost more than running them. In two parts,
# counted apart: the statuses that hold a place, which the indexes of (workflow, status)
# and of the keys hold (a count from the index alone), and the paused instances that
# started, which only their rows tell. Counted at once (status IN (...) OR (paused AND
# started)), each place held was a row read (a bitmap heap scan): 7.7 ms an admission (a
# create, a run's end) at max_concurrent_instances 10,000; 1.9-2.1 from the index alone.
_HOLDING = [s for s in sorted(lifecycle.HOLDS_PLACE) if s != Status.PAUSED]
HOLDING_BY_STATUS_SQL = f"status IN ({', '.join(['%s'] * len(_HOLDING))})"
HOLDING_PAUSED_SQL = "status = %s AND started_at IS NOT NULL"


def _free_slots(name: str, limits: Limits) -> int | None:
    """Places left under max_concurrent_instances, or None for no limit.

    Counts no further than the limit: past it no place is left however many more hold
    one (a limit lowered under 100,000 sleeping instances: each create and run's end
    counted them all, 58-84 ms)."""
    bound = limits.max_concurrent_instances
    if bound is None:
        return None
    held = f"SELECT count(*) FROM (SELECT 1 FROM {INSTANCE_TABLE} WHERE workflow = %s AND "
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT ({held}{HOLDING_BY_STATUS_SQL} LIMIT %s) AS held), "
            f"({held}{HOLDING_PAUSED_SQL} LIMIT %s) AS paused)",
            [name, *_HOLDING, bound, name, Status.PAUSED, bound],
        )
        by_status, paused = cursor.fetchone()
    return max(0, bound - by_status - paused)


def _starts_since(name: str, since: datetime, cap: int) -> tuple[int, datetime | None]:
    """How many starts of a rate-limited workflow its log holds after `since` (counted no
    further than `cap`, the limit: past it no start is left however many more there are;
    a limit lowered from 100,000 an hour counted them all at every admission for an
    hour), and the first of them (RateLimitStart: instance rows lose starts to deletes
    and restarts).

    A workflow whose log has no row at all (its instances started before the log
    existed, or it had no rate_limit until now) gets its log seeded first (under the
    admission lock) with the starts its instances' started_at show in the window, the
    count admission made before the log: an empty log let up to `limit` more start in
    the first period after the upgrade."""
    with connection.cursor() as cursor:
        in_window = f"FROM {RATE_START_TABLE} WHERE workflow = %s AND started_at > %s"
        count_sql = (
            f"SELECT (SELECT count(*) FROM (SELECT 1 {in_window} LIMIT %s) AS counted), "
            f"(SELECT started_at {in_window} ORDER BY started_at LIMIT 1), "
            f"(SELECT 1 FROM {RATE_START_TABLE} WHERE workflow = %s LIMIT 1)"
        )
        params = [name, db_time(since), cap, name, db_time(since), name]
        cursor.execute(count_sql, params)
        count, first, logged = cursor.fetchone()
        if logged is None:
            _seed_start_log(cursor, name, since)
            cursor.execute(count_sql, params)
            count, first, _ = cursor.fetchone()
    return count, from_db_time(first)


def _seed_start_log(cursor: Any, name: str, since: datetime) -> None:
    """The window's starts of a workflow whose log is empty, from its instances, and a
    row at `since` itself, which no later window of the same period counts (a window
    counts after its `since`, which only grows): the log is never empty again, and this
    scan of the workflow's instances is not repeated at every admission while nothing
    starts. (A period made longer may count that row once: a start held back, never one
    let through.)"""
    cursor.execute(
        f"INSERT INTO {RATE_START_TABLE} (workflow, started_at) "
        f"SELECT workflow, started_at FROM {INSTANCE_TABLE} "
        "WHERE workflow = %s AND started_at > %s",
        [name, db_time(since)],
    )
    cursor.execute(
        f"INSERT INTO {RATE_START_TABLE} (workflow, started_at) VALUES (%s, %s)",
        [name, db_time(since)],
    )


def _log_starts(name: str, count: int, now: datetime, window: timedelta) -> None:
    """Log `count` starts of a rate-limited workflow at `now` (in the admission's
    transaction, under its lock), and drop the starts its window no longer holds: the log
    keeps about `limit` rows a workflow."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"DELETE FROM {RATE_START_TABLE} WHERE workflow = %s AND started_at <= %s",
            [name, db_time(now - window)],
        )
        cursor.execute(
            f"INSERT INTO {RATE_START_TABLE} (workflow, started_at) VALUES "
            + ", ".join(["(%s, %s)"] * count),
            [value for _ in range(count) for value in (name, db_time(now))],
        )


def _take_rate_start(name: str, limits: Limits, now: datetime) -> bool:
    """Log one start of a rate-limited workflow now if its window has one left (under
    its admission lock): an instance that holds its place starts again (a restart)."""
    rate = limits.rate_limit
    assert rate is not None
    window = timedelta(milliseconds=rate.period_ms)
    started, _ = _starts_since(name, now - window, rate.limit)
    if started >= rate.limit:
        return False
    _log_starts(name, 1, now, window)
    return True


# --- admission ------------------------------------------------------------------------
#
# A queued instance starts when every bound allows it: max_concurrent_instances,
# max_concurrent_per_key for its concurrency_key, the rate_limit window, and its admit_at
# (debounce). The queue is looked at in (priority, id) order; an instance blocked by its
# key or its debounce does not hold back the ones behind it. Decisions of one workflow
# are serialised (lock_workflow), so they are race-free across processes.

# The reason of an instance whose debounce has not ended (DEBOUNCED, models): its admit_at
# is a "not before". (Any other queued instance's admit_at only says when to look at the
# queue again.)
ADMISSION_SCAN = 1000  # queued instances looked at per admission pass, at most
ADMISSION_PAGE = 100
ADMISSION_WINDOW = 1000  # queued instances in line a page's filters look through, at most
ADMISSION_EXAMINE = 3 * ADMISSION_WINDOW  # the same for one admission pass
KEYS_COUNTED_AT_ONCE = ADMISSION_PAGE  # keys whose places held one statement counts


@dataclass
class Candidate:
    """A queued instance (pk) or one being created (pk None) as admission sees it."""

    pk: int | None
    priority: int
    concurrency_key: str | None
    admit_at: datetime | None
    reason: str = ""


class Admission:
    """What one admission pass of a workflow may still start now, and why not."""

    def __init__(
        self, name: str, limits: Limits, now: datetime, keys: Collection[str | None] = ()
    ) -> None:
        self.limits = limits
        self.now = now
        self.name = name
        self.slots = _free_slots(name, limits)
        self.key_active: dict[str, int] = {}
        self.learn_keys(keys)
        self.rate_left: int | None = None
        self.rate_reopens_at: datetime | None = None
        rate = limits.rate_limit
        if rate is not None:
            window = timedelta(milliseconds=rate.period_ms)
            started, first = _starts_since(name, now - window, rate.limit)
            self.rate_left = max(0, rate.limit - started)
            # A sliding window: the oldest start in it leaving frees the next start.
            self.rate_reopens_at = (first or now) + window

    def learn_keys(self, keys: Collection[str | None]) -> None:
        """Count the active instances of the keys not counted yet.

        Each key's count stops at max_concurrent_per_key: past it the key has no place
        left however many more hold one (a limit lowered to 10 while 50,000 of one key
        run: each create and run's end counted all 50,000). So a count at the bound
        says "at least", which only key_at_bound reads (a reason names the bound alone)."""
        bound = self.limits.max_concurrent_per_key
        if bound is None:
            return
        wanted = sorted({k for k in keys if k is not None and k not in self.key_active})
        for start in range(0, len(wanted), KEYS_COUNTED_AT_ONCE):
            self._count_keys(wanted[start : start + KEYS_COUNTED_AT_ONCE], bound)

    def _count_keys(self, keys: list[str], bound: int) -> None:
        """The places held of each key, no further than the bound: a LIMIT a key, over
        one index probe (workflow, key, status) a holding status, the started paused
        ones apart (their rows tell). A status IN (...) was planned as a filter over the
        key's index entries, read from its first status on: every queued, finished or
        paused entry of a key before its first holding one. The keys are joined in, not
        named: each named key was a plan of its own (0.4 ms a key, 40-170 ms for a page
        of 100 keys)."""
        of_key = (
            f"SELECT 1 FROM {INSTANCE_TABLE} AS held WHERE held.workflow = %s "
            "AND held.concurrency_key = asked.concurrency_key AND "
        )
        parts = [f"{of_key}held.status = %s" for _ in _HOLDING]
        parts.append(f"{of_key}held.{HOLDING_PAUSED_SQL}")
        asked = " UNION ALL ".join(["SELECT %s AS concurrency_key"] * len(keys))
        params: list[Any] = []
        for status in _HOLDING:
            params += [self.name, status]
        params += [self.name, Status.PAUSED, bound, *keys]
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT asked.concurrency_key, (SELECT count(*) FROM "
                f"({' UNION ALL '.join(parts)} LIMIT %s) AS places) FROM ({asked}) AS asked",
                params,
            )
            counted = cursor.fetchall()
        for key, held in counted:
            self.key_active[key] = held

    def decide(self, candidate: Candidate) -> tuple[bool, str, datetime | None]:
        """(admitted, why not, the admit_at to keep) for the next candidate in queue order."""
        limits = self.limits
        if (
            candidate.admit_at is not None
            and candidate.admit_at > self.now
            and candidate.reason.startswith(DEBOUNCED)
        ):
            return False, candidate.reason, candidate.admit_at
        if self.slots is not None and self.slots <= 0:
            return (
                False,
                f"max_concurrent_instances ({limits.max_concurrent_instances}) reached",
                None,
            )
        key = candidate.concurrency_key
        if self.key_at_bound(key):
            return False, self.key_full(key), None
        if self.rate_left is not None and self.rate_left <= 0:
            rate = limits.rate_limit
            assert rate is not None and self.rate_reopens_at is not None
            return (
                False,
                f"rate_limit ({rate.limit} per {rate.period_label}) reached; "
                f"next start at {self.rate_reopens_at.isoformat()}",
                self.rate_reopens_at,
            )
        if self.slots is not None:
            self.slots -= 1
        if key is not None:
            self.key_active[key] = self.key_active.get(key, 0) + 1
        if self.rate_left is not None:
            self.rate_left -= 1
        return True, "", None

    def key_at_bound(self, key: str | None) -> bool:
        """Whether every place of the key (max_concurrent_per_key) is taken."""
        bound = self.limits.max_concurrent_per_key
        return key is not None and bound is not None and self.key_active.get(key, 0) >= bound

    def keys_at_bound(self) -> set[str]:
        return {key for key in self.key_active if self.key_at_bound(key)}

    def key_full(self, key: str) -> str:
        """Why the key's instances wait, within the waiting_reason column: a key of 200
        characters quoted by repr() (a zero-width space is 6 characters there, a control
        character 4) was up to 1,200, and PostgreSQL refused the write of the whole pass."""
        bound = self.limits.max_concurrent_per_key
        return fit_waiting_reason(f"max_concurrent_per_key ({bound}) reached for key {key!r}")

    @property
    def full(self) -> bool:
        """No place is left under max_concurrent_instances: nothing more starts in this pass
        (a rate window still tells the instances behind it when to look again)."""
        return self.slots is not None and self.slots <= 0


def _queued(name: str) -> Any:
    return Instance.objects.filter(workflow=name, status=Status.QUEUED)


CANDIDATE_COLUMNS = "id, priority, concurrency_key, admit_at, waiting_reason"
IN_LINE_WHERE = IN_LINE_SQL.replace("%", "%%")  # in a statement with parameters


def _line_order(candidate: Candidate) -> tuple[int, int]:
    assert candidate.pk is not None
    return candidate.priority, candidate.pk


class _QueueScan:
    """The head of the queue in admission order, a page at a time, up to ADMISSION_SCAN
    candidates; each page without the keys in skip_keys as it is then (the caller adds to
    it).

    Instances whose debounce has not ended are not read: they start at their admit_at
    whatever comes before them and hold back none behind them. Read, a thousand users'
    pending debounces filled the pass, and an instance whose debounce ended behind them
    was never reached (see _Decided.write's cut_short). The pages read the line's index
    (instance_in_line: the queue without any debounce, IN_LINE_SQL), and the debounces
    that ended, which admit_due has not decided yet, are read once with the first page,
    earliest first along the admit_at index, and merged into each page in line. Through
    the queue index, the first page's filter read every pending debounce ahead of the
    instances it kept: 100,000 of them, 100,000 rows and 134 ms a create or a run's end
    of a flow-controlled workflow. When more than ADMISSION_SCAN debounces ended at once
    (no worker admitted for a while) the pages read them in line as before, past the
    pending ones (the pass then decides or resets every one: _Decided.write).

    After the first page, the instances passed over (a skipped key's backlog) are read
    in windows of ADMISSION_WINDOW in line, up to ADMISSION_EXAMINE in all: a page's
    filters look no further than its window's last instance. (The first page skips no
    key yet: a short queue, the common case, stays one read.) Unbounded, one customer's
    100,000 instances queued behind its key made every create and every run's end of the
    workflow read all of them (70 ms a create). `examined_all` says whether the scan
    stopped at that bound with more in line (what changed behind it is decided anyway:
    _Decided.beyond)."""

    def __init__(self, name: str, now: datetime, skip_keys: Collection[str]) -> None:
        self.name, self.now, self.skip_keys = name, now, skip_keys
        self.examined_all = False
        # The ended debounces, in line order (the first page reads them); None: the
        # pages read them in line (more than ADMISSION_SCAN of them).
        self.due: list[Candidate] | None = []

    def _line(self) -> tuple[str, list[Any]]:
        """The WHERE of the line the pages and windows read, and its parameters."""
        if self.due is None:  # the queue index, past the pending debounces
            where = (
                "status = %s AND (admit_at IS NULL OR admit_at <= %s OR waiting_reason NOT LIKE %s)"
            )
            return where, [Status.QUEUED, db_time(self.now), DEBOUNCED + "%"]
        return IN_LINE_WHERE, []

    def _boundary(self, after: tuple[int, int] | None) -> tuple[int, int] | None:
        """The last instance of the window that starts after `after`; None when fewer
        than ADMISSION_WINDOW are left in line. An index-only read of the line's index."""
        line, params = self._line()
        where = ""
        if after is not None:
            where = " AND (priority, id) > (%s, %s)"  # a row value: the index's start
            params += [after[0], after[1]]
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT priority, id FROM {INSTANCE_TABLE} WHERE workflow = %s AND {line}"
                f"{where} ORDER BY priority, id LIMIT 1 OFFSET {ADMISSION_WINDOW - 1}",
                [self.name, *params],
            )
            row = cursor.fetchone()
        return None if row is None else (row[0], row[1])

    def _page_sql(
        self, after: tuple[int, int] | None, boundary: tuple[int, int] | None
    ) -> tuple[str, list[Any]]:
        line, params = self._line()
        where = ""
        if after is not None:
            where += " AND (priority, id) > (%s, %s)"
            params += [after[0], after[1]]
        if boundary is not None:
            where += " AND (priority, id) <= (%s, %s)"
            params += [boundary[0], boundary[1]]
        skip = sorted(self.skip_keys)
        if skip:
            where += (
                " AND (concurrency_key IS NULL OR concurrency_key NOT IN "
                f"({', '.join(['%s'] * len(skip))}))"
            )
            params += skip
        sql = (
            f"SELECT {CANDIDATE_COLUMNS} FROM {INSTANCE_TABLE} WHERE workflow = %s AND {line}"
            f"{where} ORDER BY priority, id LIMIT {ADMISSION_PAGE}"
        )
        return sql, [self.name, *params]

    def _first_page(self) -> list[Candidate]:
        """The first page of the line and, in the same statement, the ended debounces."""
        page, params = self._page_sql(None, None)
        # Along the admit_at index, whatever the planner thinks of the queue: by an index
        # of the queue, then a sort, it read the whole queue, pending debounces and all, on
        # a table not analyzed yet (SQLite: always; the admission bench: 15 → 17 ms a
        # create). `|| ''` keeps the indexes of status and workflow out of the choice.
        due = (
            f"SELECT {CANDIDATE_COLUMNS} FROM {INSTANCE_TABLE} WHERE admit_at IS NOT NULL "
            "AND admit_at <= %s AND status || '' = %s AND workflow || '' = %s "
            f"AND waiting_reason LIKE %s ORDER BY admit_at LIMIT {ADMISSION_SCAN + 1}"
        )
        params += [db_time(self.now), Status.QUEUED, self.name, DEBOUNCED + "%"]
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT {CANDIDATE_COLUMNS}, 0 AS ended FROM ({page}) AS line UNION ALL "
                f"SELECT {CANDIDATE_COLUMNS}, 1 AS ended FROM ({due}) AS due",
                params,
            )
            rows = cursor.fetchall()
        line = [self._candidate(row) for row in rows if not row[5]]
        ended = [self._candidate(row) for row in rows if row[5]]
        if len(ended) > ADMISSION_SCAN:
            self.due = None
            return self._page(None, None)
        self.due = sorted(ended, key=_line_order)
        return self._merged(line, None, None)

    def _page(
        self, after: tuple[int, int] | None, boundary: tuple[int, int] | None
    ) -> list[Candidate]:
        with connection.cursor() as cursor:
            cursor.execute(*self._page_sql(after, boundary))
            line = [self._candidate(row) for row in cursor.fetchall()]
        return line if self.due is None else self._merged(line, after, boundary)

    def _merged(
        self,
        line: list[Candidate],
        after: tuple[int, int] | None,
        boundary: tuple[int, int] | None,
    ) -> list[Candidate]:
        """The page: the line's and the ended debounces' in the same bounds, in line."""
        assert self.due is not None
        ended = [
            c
            for c in self.due
            if (after is None or _line_order(c) > after)
            and (boundary is None or _line_order(c) <= boundary)
            and (c.concurrency_key is None or c.concurrency_key not in self.skip_keys)
        ]
        return sorted(line + ended, key=_line_order)[:ADMISSION_PAGE] if ended else line

    @staticmethod
    def _candidate(row: Sequence[Any]) -> Candidate:
        pk, priority, key, at, reason = row[:5]
        return Candidate(pk, priority, key, from_db_time(at), reason)

    def __iter__(self) -> Iterator[list[Candidate]]:
        after: tuple[int, int] | None = None
        scanned = examined = 0
        # The first page needs no window: it skips no key yet (the common case, a short
        # queue, stays one read). The pages after it are read in windows.
        boundary: tuple[int, int] | None = None
        windowed = False
        while scanned < ADMISSION_SCAN:
            page = self._first_page() if not windowed else self._page(after, boundary)
            scanned += len(page)
            if page:
                yield page
            if len(page) == ADMISSION_PAGE:
                after = _line_order(page[-1])
                if not windowed:
                    windowed, boundary = True, self._boundary(after)
                continue
            if boundary is None:
                return  # the whole queue was read
            examined += ADMISSION_WINDOW
            if examined >= ADMISSION_EXAMINE:
                self.examined_all = True
                return
            after = boundary
            boundary = self._boundary(after)


def _changed_candidates(
    name: str, now: datetime, changed: _Changed, at_bound: Collection[str]
) -> list[Candidate]:
    """The queued instances _Decided.beyond looks at (a debounce not ended is not one)."""
    columns = "id, priority, concurrency_key, admit_at, waiting_reason"
    base = (
        f"SELECT {columns} FROM {INSTANCE_TABLE} WHERE workflow = %s AND status = %s "
        "AND (admit_at IS NULL OR admit_at <= %s OR waiting_reason NOT LIKE %s)"
    )
    params: list[Any] = [name, Status.QUEUED, db_time(now), DEBOUNCED + "%"]
    reads: list[tuple[str, list[Any]]] = []
    if changed.pks:
        pks = sorted(changed.pks)
        reads.append((f"{base} AND id IN ({', '.join(['%s'] * len(pks))})", [*params, *pks]))
    for key in sorted(set(changed.keys) - set(at_bound)):
        reads.append(
            (
                f"{base} AND concurrency_key = %s ORDER BY priority, id LIMIT {ADMISSION_PAGE}",
                [*params, key],
            )
        )
    if changed.due:
        reads.append(
            (
                f"{base} AND admit_at <= %s ORDER BY admit_at LIMIT {ADMISSION_PAGE}",
                [*params, db_time(now)],
            )
        )
    found: list[Candidate] = []
    with connection.cursor() as cursor:
        for sql, values in reads:
            cursor.execute(sql, values)
            found += [
                Candidate(pk, priority, key, from_db_time(at), reason)
                for pk, priority, key, at, reason in cursor.fetchall()
            ]
    return found


def promote_queued(
    name: str,
    limits: Limits,
    now: datetime,
    created: Collection[int] = (),
    *,
    look_at: Collection[int] = (),
    freed_keys: Collection[str | None] = (),
    due: bool = False,
) -> list[int]:
    """Start queued instances of a workflow while flow control allows; returns their pks.

    Those left queued get their reason (waiting_reason) and, when time will let them
    start (a debounce, a rate window), their admit_at: admit_due looks at them again then.
    created: instances inserted by this transaction (their history says created, not started).
    What changed, looked at even behind the ADMISSION_SCAN instances the pass reads in
    line (see _Decided.beyond): look_at, instances put back in the queue (a resume);
    freed_keys, the keys of instances that just gave their place up (an end); due, the
    instances whose admit_at came (admit_due).
    """
    if not created:  # a caller that inserted or requeued instances holds the lock already
        # Before the look at the queue: a create deciding meanwhile counted this
        # transaction's instance as holding its place and queued its own, whose row shows
        # only once it commits, which the lock waits for.
        lock_workflow(name)
        if not _queued(name).exists():
            return []
    changed = _Changed({*created, *look_at}, {k for k in freed_keys if k is not None}, due)
    # Under no flow control nothing bounds the starts: what changed starts (if its debounce
    # ended), with no read of the line, which went past every pending debounce ahead of
    # it (66 ms a pass behind 100,000). Only a worker's look at a whole queue reads it.
    whole_line = limits.flow_controlled or not (created or look_at or due)
    for _ in range(ADMISSION_TRIES):
        decided = _Decided(name, limits, now, created, changed, whole_line)
        # Those chosen must still be queued once locked: a pause or a terminate (which
        # take no admission lock when they free no place) may have taken one since the
        # scan read it. Then its place goes to the next in line: decided again. (This
        # transaction's own new rows no one else sees.)
        others = [pk for pk in decided.admitted if pk not in created]
        if not others:
            break
        queued = lock_rows(Instance.objects.filter(id__in=others, status=Status.QUEUED))
        still = set(queued.values_list("id", flat=True))
        if len(still) == len(others):
            break
        decided.admitted = [pk for pk in decided.admitted if pk in created or pk in still]
    return decided.write(created)


ADMISSION_TRIES = 3  # admission passes at most when instances chosen change under one


class _Changed(NamedTuple):
    """What an admission pass is about beyond the head of the queue (see promote_queued)."""

    pks: set[int]
    keys: set[str]
    due: bool


class _Decided:
    """One admission pass of a workflow's queue: who starts, who waits and why."""

    def __init__(
        self,
        name: str,
        limits: Limits,
        now: datetime,
        created: Collection[int],
        changed: _Changed,
        whole_line: bool = True,
    ) -> None:
        self.name, self.limits, self.now = name, limits, now
        admission = Admission(name, limits, now)
        self.admitted: list[int] = []
        self.waiting: dict[tuple[str, datetime | None], list[int]] = {}
        self.skipped: dict[str, str] = {}
        self.full = ""
        undecided = set(created)
        if not whole_line:  # no flow control: only what changed (see promote_queued)
            self.cut_short = False
            self.beyond(admission, changed, set(), set(), undecided)
            return
        scanned, self.stopped_early = 0, False
        # Keys whose places are all taken: the scan reads no more of their queue, so a
        # long backlog of one key does not hide the instances of other keys behind it.
        at_bound: set[str] = set()
        seen: set[int] = set()
        scan = _QueueScan(name, now, at_bound)
        for page in scan:
            scanned += len(page)
            admission.learn_keys({c.concurrency_key for c in page})
            for candidate in page:
                assert candidate.pk is not None
                seen.add(candidate.pk)
                if admission.full and (candidate.admit_at is None or candidate.admit_at <= now):
                    break  # the rest wait for a place
                undecided.discard(candidate.pk)
                self.decide(admission, candidate)
            else:
                at_bound.update(admission.keys_at_bound())
                continue
            self.stopped_early = True
            break
        self.cut_short = self.stopped_early or scanned >= ADMISSION_SCAN or scan.examined_all
        if self.cut_short and not self.stopped_early and not admission.full:
            self.beyond(admission, changed, seen, at_bound, undecided)
        # Why the instances the pass did not reach wait: no place left, or (the scan read
        # its ADMISSION_SCAN instances first) the ones ahead of them, whatever the limits.
        self.full = (
            f"max_concurrent_instances ({limits.max_concurrent_instances}) reached"
            if self.stopped_early
            else "queued behind the first "
            f"{ADMISSION_EXAMINE if scan.examined_all else ADMISSION_SCAN} instances in line"
        )
        # Keys whose queue the scan stopped reading, with why their instances wait.
        self.skipped = {key: admission.key_full(key) for key in at_bound}
        if undecided:  # new instances not reached (a full queue, a key at its bound): why
            rows = Instance.objects.filter(id__in=undecided).values_list(
                "id", "concurrency_key", "admit_at", "waiting_reason"
            )
            for pk, key, admit_at, was in rows:
                if admit_at is not None and admit_at > now and was.startswith(DEBOUNCED):
                    continue  # its debounce is its reason until it ends (it keeps admit_at)
                reason = admission.key_full(key) if key in at_bound else self.full
                self.waiting.setdefault((reason, None), []).append(pk)

    def beyond(
        self,
        admission: Admission,
        changed: _Changed,
        seen: set[int],
        at_bound: set[str],
        undecided: set[int],
    ) -> None:
        """The scan read its ADMISSION_SCAN instances, every one held back by its key (a
        thousand customers each at max_concurrent_per_key), and places are left: what
        changed behind them is decided too, in queue order. Else a new instance of a key
        with a free place, the next of a key whose place just freed, or one whose debounce
        just ended waited behind them while its place stayed free, until the queue ahead
        shrank under ADMISSION_SCAN. Bounded reads: the instances named, the first page of
        each freed key's queue, the first page of the due ones."""
        candidates = {
            c.pk: c
            for c in _changed_candidates(self.name, self.now, changed, at_bound)
            if c.pk not in seen
        }
        ordered = sorted(candidates.values(), key=lambda c: (c.priority, c.pk))
        admission.learn_keys({c.concurrency_key for c in ordered})
        for candidate in ordered:
            if admission.full:
                break
            assert candidate.pk is not None
            undecided.discard(candidate.pk)
            self.decide(admission, candidate)

    def decide(self, admission: Admission, candidate: Candidate) -> None:
        """Admit the candidate, or note why it waits when that changed."""
        assert candidate.pk is not None
        ok, reason, admit_at = admission.decide(candidate)
        if ok:
            self.admitted.append(candidate.pk)
        elif (reason, admit_at) != (candidate.reason, candidate.admit_at):
            self.waiting.setdefault((reason, admit_at), []).append(candidate.pk)

    def write(self, created: Collection[int]) -> list[int]:
        """Store the pass: reasons and times of those that wait, the start of the others."""
        now, admitted = self.now, self.admitted
        for (reason, admit_at), pks in self.waiting.items():
            Instance.objects.filter(id__in=pks).update(waiting_reason=reason, admit_at=admit_at)
        if not created and any(admit_at is not None for _, admit_at in self.waiting):
            # A worker learns admission times when it reads the queues after a hint (a
            # create sends its own); a run's end hints nothing, and the instance waited
            # for a poll.
            hint_workers("queued", [None])
            if on_queue_timed is not None:
                transaction.on_commit(on_queue_timed)
        if self.cut_short:
            # Due but not reached (a debounce that ended while no place was free): not due
            # again until a place frees up, so admit_due does not look at them over and
            # over. (Every instance reached got its reason and admit_at above.)
            _queued(self.name).filter(admit_at__lte=now).exclude(id__in=admitted).update(
                admit_at=None, waiting_reason=self.full
            )
        if self.skipped and not self.cut_short:
            # The same for the instances of a key the scan passed over once it was full:
            # they wait for one of its places, which a run's end of that key frees. One
            # statement for every such key, each with its reason. (Cut short, the
            # statement above left no instance due: this one, a CASE of up to a thousand
            # keys, would find none.)
            reasons = [When(concurrency_key=k, then=Value(r)) for k, r in self.skipped.items()]
            _queued(self.name).filter(
                concurrency_key__in=list(self.skipped), admit_at__lte=now
            ).exclude(id__in=admitted).update(admit_at=None, waiting_reason=Case(*reasons))
        if admitted:
            Instance.objects.filter(id__in=admitted).update(
                status=Status.RUNNING,
                wake_at=now,
                started_at=now,
                updated_at=now,
                admit_at=None,
                waiting_reason="",
            )
            rate = self.limits.rate_limit
            if rate is not None:
                _log_starts(self.name, len(admitted), now, timedelta(milliseconds=rate.period_ms))
            started = [pk for pk in admitted if pk not in created]
            for pk in started:
                append_history(pk, [History("instance.started", {"from": "queued"})], now)
            hint_workers("promoted", started)
            if on_promoted is not None and started:
                callback = on_promoted
                transaction.on_commit(lambda: callback(started))
        return admitted


@retry_while_locked
def admit_due(workflows: Sequence[tuple[str, Limits]]) -> tuple[list[int], datetime | None]:
    """Admit queued instances whose admit_at came (a debounce ended, a rate window opened).

    Only this process's workflows (it knows their limits). Returns the pks started and
    the next admit_at to wake up for. One indexed read when nothing is due.
    """
    now = clock.now()
    limits_by_name = dict(workflows)
    first = first_admit(list(limits_by_name))
    if first is None or first > now:
        return [], first
    timed = Instance.objects.filter(
        status=Status.QUEUED, admit_at__isnull=False, workflow__in=list(limits_by_name)
    )
    admitted: list[int] = []
    for name in set(timed.filter(admit_at__lte=now).values_list("workflow", flat=True)):
        limits = limits_by_name[name]
        for _ in range(ADMISSION_SCAN // ADMISSION_PAGE):
            with transaction.atomic():
                started = promote_queued(name, limits, now, due=True)
            admitted += started
            # Under no flow control a pass starts a page of the due (promote_queued): the
            # next page, as a pass that read the line started up to ADMISSION_SCAN.
            if limits.flow_controlled or len(started) < ADMISSION_PAGE:
                break
    return admitted, first_admit(list(limits_by_name))


def first_admit(names: Sequence[str]) -> datetime | None:
    """The earliest admit_at among these workflows' queued instances: admit_due's look
    after a create. Raw and prepared on PostgreSQL: the ORM's query was planned on every
    call (0.26 ms)."""
    if not names:
        return None
    with statement_cursor() as cursor:
        cursor.execute(*first_admit_statement(names))
        (first,) = cursor.fetchone()
    return from_db_time(first)


def first_admit_statement(names: Sequence[str]) -> tuple[str, list[Any]]:
    """first_admit's read as SQL and parameters (PostgreSQL pipelines it with a claim:
    see claim_and_load).

    The first admit_at of each workflow, a probe of instance_queue_admit_at each, then the
    earliest of them. MIN over all of them at once walked instance_admit_at in time order
    past every other workflow's queued instances ahead of the first of these: a workflow's
    100,000 pending debounces cost each claim of every worker not running it 20-22 ms
    (after a create's hint, that is nearly every claim). The probe's condition is spelled
    as the index's (a literal: a prepared statement's generic plan cannot prove a partial
    index's condition from a parameter), and it asks for (workflow, admit_at) order over a
    range of one workflow: asked `workflow = x ORDER BY admit_at`, the planner may walk
    instance_admit_at for each workflow instead (47,000 tuples for 3 workflows beside
    20,000 debounces of another, its statistics giving each workflow thousands of rows)."""
    timed = (
        f"SELECT admit_at FROM {INSTANCE_TABLE} WHERE status = 'queued' AND admit_at IS NOT NULL"
    )
    if connection.vendor == "postgresql":
        sql = (
            "SELECT MIN(admit_at) FROM unnest(CAST(%s AS text[])) AS names(workflow) "
            f"CROSS JOIN LATERAL ({timed} AND workflow >= names.workflow "
            "AND workflow <= names.workflow ORDER BY workflow, admit_at LIMIT 1) AS first"
        )
        return sql, [list(names)]
    one = f"SELECT ({timed} AND workflow = %s ORDER BY admit_at LIMIT 1) AS admit_at"
    return f"SELECT MIN(admit_at) FROM ({' UNION ALL '.join([one] * len(names))})", list(names)


@retry_while_locked
def create_instances(
    name: str, version: int, limits: Limits, items: Sequence[NewInstance], actor: str = ""
) -> list[tuple[Instance, bool]]:
    """Insert instances all-or-nothing; an idempotency key already used returns its instance,
    and so does a debounce key of an instance not started yet (with the new params) or the
    step of a parent that started its child already.

    Returns (instance, created) pairs in the order of items.
    """
    if len(items) == 1 and _one_statement_create(limits, items[0]):
        created = _create_at_once(name, version, items[0], actor)
        if created is not None:
            return [(created, True)]
        # The id or the idempotency key is taken: the long way says which, or returns it.
    for attempt in range(3):
        try:
            with transaction.atomic():
                return _create_instances(name, version, limits, items, actor)
        except IntegrityError as exc:
            # A concurrent create with the same idempotency key, debounce key, parent step
            # or id won the race; the next attempt sees its row. Anything else is a real conflict.
            if attempt == 2:
                raise InstanceAlreadyExists(
                    f"could not create instances of {name!r}: {exc}"
                ) from None
    raise AssertionError("unreachable")


def _one_statement_create(limits: Limits, item: NewInstance) -> bool:
    """Nothing to decide before the row exists: no queue, debounce or parent."""
    return not limits.flow_controlled and item.debounce_key is None and item.parent_pk is None


def create_in_transaction(
    name: str, version: int, limits: Limits, item: NewInstance, actor: str
) -> Instance:
    """One new instance inside the caller's transaction (a schedule's tick moves on in the
    same one): one statement where create_instances would take one; InstanceAlreadyExists
    when its id is taken."""
    if _one_statement_create(limits, item):
        created = _create_at_once(name, version, item, actor)
        if created is not None:
            return created
    [(instance, _)] = _create_instances(name, version, limits, [item], actor)
    return instance


def _check_child_ids(fresh: Sequence[NewInstance], limits: Limits) -> None:
    """A new child's id holds to its workflow's max_instance_id_length, as every id a create
    stores (the tick's and the trigger's it makes up too): its fallback ("child-<32 hex>",
    38 characters, step.child_ids) was stored under any limit. Judged when the child is
    made, not when a replay finds it (a child started before a lowered limit replays)."""
    for item in fresh:
        if item.parent_pk is not None and len(item.instance_id) > limits.max_instance_id_length:
            raise LimitExceeded(
                "max_instance_id_length",
                len(item.instance_id),
                limits.max_instance_id_length,
                f"instance id of the child of step {item.parent_step!r}",
            )


def _existing(name: str, version: int, items: Sequence[NewInstance]) -> dict[int, Instance]:
    """Items that name an instance already there, by position: same idempotency key, or
    the same parent step (a replay of step.invoke / step.start)."""
    found: dict[int, Instance] = {}
    keys = [i.idempotency_key for i in items if i.idempotency_key]
    if keys:
        by_key = {
            inst.idempotency_key: inst
            for inst in Instance.objects.filter(
                workflow=name, version=version, idempotency_key__in=keys
            )
        }
        missing = [k for k in keys if k not in by_key]
        if missing:  # keys of creates a debounce merged into an instance (see _debounce)
            by_key.update(
                (merged.idempotency_key, merged.instance)
                for merged in MergedCreateKey.objects.filter(
                    workflow=name, version=version, idempotency_key__in=missing
                ).select_related("instance")
            )
        for position, item in enumerate(items):
            if item.idempotency_key in by_key:
                found[position] = by_key[item.idempotency_key]
    for position, item in enumerate(items):
        if item.parent_pk is not None and position not in found:
            # Parent first (the order of every parent-and-child change); a parent that
            # ended meanwhile (terminated while its step ran) starts no orphan, nor does
            # a run that lost its lease (a cancel that compensates leaves the parent live
            # and its children ended: one started after would outlive it).
            # A parent a cancel is compensating starts no child (its children ended).
            status, token, cancelled = (
                lock_rows(Instance.objects.filter(id=item.parent_pk))
                .values_list("status", "lease_token", "compensate_on_cancel")
                .first()
            ) or (None, None, False)
            if status is None or status in lifecycle.FINISHED:
                raise InvalidTransition(
                    f"instance #{item.parent_pk} is {status or 'gone'}: it starts no child"
                )
            if item.parent_token is not None and (token != item.parent_token or cancelled):
                raise LeaseLost(
                    f"instance #{item.parent_pk}: lease {item.parent_token[:8]} is no longer held"
                    + (" (cancelled)" if cancelled else "")
                )
            child = Instance.objects.filter(
                parent_id=item.parent_pk, parent_step=item.parent_step
            ).first()
            if child is not None:
                if child.detached != item.detached:
                    # Made before 0028 (NULL), or by a step of the other kind (a restart
                    # on a version that changed it): the step that finds it now says.
                    Instance.objects.filter(id=child.pk).update(detached=item.detached)
                    child.detached = item.detached
                found[position] = child
    return found


def _debounce(
    name: str, version: int, item: NewInstance, now: datetime, actor: str
) -> Instance | None:
    """An instance with the item's debounce key that has not started: it takes the new
    params, search attributes, concurrency key and retention (the newest create describes
    it: kept, the old key let the new params run beside an instance of the key the create
    named, past max_concurrent_per_key, and the old retention kept for ever what the
    create asked to delete after a week), and version (it has no
    checkpoint a version could disagree with: a create of a new version after a rollout
    must not run the old code on its params) and starts debounce after now. The create's
    idempotency key, when the instance has another, is kept beside it: the create's retry
    finds the instance (_existing). None if there is none."""
    pending = lock_rows(
        Instance.objects.filter(
            workflow=name,
            debounce_key=item.debounce_key,
            started_at__isnull=True,
            status__in=(Status.QUEUED, Status.PAUSED),
        )
    ).first()
    if pending is None:
        return None
    if pending.version != version:
        _check_idempotency_key_free(pending, version)  # as restart(version=) moves one
    admit_at = now + timedelta(milliseconds=item.debounce_ms or 0)
    Instance.objects.filter(id=pending.pk).update(
        params_json=item.params_json,
        attributes=item.attributes,
        version=version,
        admit_at=admit_at,
        priority=item.priority,
        concurrency_key=item.concurrency_key,
        retention_ms=item.retention_ms,
        retention_error_ms=item.retention_error_ms,
        waiting_reason=DEBOUNCED + admit_at.isoformat(),
        updated_at=now,
    )
    data: dict[str, Any] = {"until": admit_at.isoformat()}
    if pending.version != version:
        data["version"] = version
    if pending.concurrency_key != item.concurrency_key:
        data["concurrency_key"] = item.concurrency_key
    append_history(pending.pk, [History("instance.debounced", data, actor)], now)
    key = item.idempotency_key
    if key and not (key == pending.idempotency_key and pending.version == version):
        # A concurrent create that took the key fails this one's unique check: the
        # create's next attempt finds the instance it names (create_instances).
        MergedCreateKey.objects.create(
            workflow=name, version=version, idempotency_key=key, instance_id=pending.pk
        )
    pending.refresh_from_db()
    # The rows list filters read follow the JSON column, as at create.
    InstanceAttribute.objects.filter(instance_id=pending.pk).delete()
    index_attributes([pending])
    return pending


def _create_instances(
    name: str, version: int, limits: Limits, items: Sequence[NewInstance], actor: str
) -> list[tuple[Instance, bool]]:
    now = clock.now()
    found = _existing(name, version, items)
    fresh = [i for n, i in enumerate(items) if n not in found]
    _check_child_ids(fresh, limits)
    ids = [i.instance_id for i in fresh]
    if len(set(ids)) != len(ids):
        raise InvalidInput("a batch names the same instance id twice")
    keys = [i.idempotency_key for i in fresh if i.idempotency_key]
    if len(set(keys)) != len(keys):
        raise InvalidInput("a batch names the same idempotency_key twice")
    debounce_keys = [i.debounce_key for i in fresh if i.debounce_key is not None]
    if len(set(debounce_keys)) != len(debounce_keys):
        raise InvalidInput("a batch names the same debounce_key twice")
    taken = list(
        Instance.objects.filter(workflow=name, instance_id__in=ids).values_list(
            "instance_id", flat=True
        )
    )
    if taken:
        raise InstanceAlreadyExists(
            f"workflow {name!r} already has an instance with id {taken[0]!r}"
        )
    controlled = limits.flow_controlled or bool(debounce_keys)
    if controlled:
        lock_workflow(name)
        for position, item in enumerate(items):
            if position not in found and item.debounce_key is not None:
                pending = _debounce(name, version, item, now, actor)
                if pending is not None:
                    found[position] = pending
        fresh = [i for n, i in enumerate(items) if n not in found]
    rows = [_new_row(name, version, item, actor, now, controlled) for item in fresh]
    Instance.objects.bulk_create(rows)
    index_attributes(rows)
    # Rows whose debounce has not ended take no place and free none: no admission pass
    # (it read the line past every pending debounce: 66 ms a create behind 100,000).
    deciding = [r for r in rows if r.admit_at is None or r.admit_at <= now]
    if controlled and deciding:
        admitted = set(promote_queued(name, limits, now, created={r.pk for r in deciding}))
        for row in rows:
            if row.pk in admitted:
                row.status, row.started_at, row.wake_at, row.admit_at = (
                    Status.RUNNING,
                    now,
                    now,
                    None,
                )
                row.waiting_reason = ""
        queued = [r.pk for r in rows if r.pk not in admitted]
        for row_pk, reason in Instance.objects.filter(id__in=queued).values_list(
            "id", "waiting_reason"
        ):
            next(r for r in rows if r.pk == row_pk).waiting_reason = reason
    HistoryRecord.objects.bulk_create(
        HistoryRecord(
            instance_id=row.pk,
            sequence=1,
            created_at=now,
            type="instance.created",
            data=_created_data(row),
            actor=actor,
        )
        for row in rows
    )
    # Delivered at commit (PostgreSQL): a worker runs it, or looks at its queue again.
    hint_workers("created", [row.pk for row in rows])
    created = iter(rows)
    return [(found[n], False) if n in found else (next(created), True) for n in range(len(items))]


def _new_row(
    name: str, version: int, item: NewInstance, actor: str, now: datetime, controlled: bool
) -> Instance:
    admit_at = (
        now + timedelta(milliseconds=item.debounce_ms)
        if item.debounce_key is not None and item.debounce_ms is not None
        else None
    )
    given = dict(
        workflow=name,
        instance_id=item.instance_id,
        version=version,
        # Under flow control every new instance is queued first, then admitted with the
        # queue, in one order (priority, then creation).
        status=Status.QUEUED if controlled else Status.RUNNING,
        params_json=item.params_json,
        idempotency_key=item.idempotency_key,
        created_by=actor,
        created_at=now,
        updated_at=now,
        started_at=None if controlled else now,
        wake_at=None if controlled else now,
        retention_ms=item.retention_ms,
        schedule=item.schedule,
        scheduled_at=item.scheduled_at,
        retention_error_ms=item.retention_error_ms,
        attributes=item.attributes,
        history_seq=1,
        trace_id=spans.new_trace_id(now),
        priority=item.priority,
        concurrency_key=item.concurrency_key,
        debounce_key=item.debounce_key,
        admit_at=admit_at,
        waiting_reason=DEBOUNCED + admit_at.isoformat() if admit_at else "",
        parent_id=item.parent_pk,
        parent_step=item.parent_step,
        parent_span=item.parent_span,
        detached=item.detached,
        queue=item.queue,
    )
    return new_model_object(Instance, given)


def _created_data(row: Instance) -> dict[str, Any]:
    """The data of an instance's instance.created record."""
    return {
        "version": row.version,
        "status": row.status,
        **({"priority": row.priority} if row.priority != 5 else {}),
        **({"concurrency_key": row.concurrency_key} if row.concurrency_key else {}),
        **({"debounce_key": row.debounce_key} if row.debounce_key else {}),
        **({"reason": row.waiting_reason} if row.waiting_reason else {}),
        **({"parent": {"pk": row.parent_id, "step": row.parent_step}} if row.parent_id else {}),
    }


def _create_at_once(name: str, version: int, item: NewInstance, actor: str) -> Instance | None:
    """One instance with no queue, parent or debounce, by raw SQL: on PostgreSQL one
    autocommit statement (the row, its instance.created record and the workers' NOTIFY);
    on SQLite the row and the record in one transaction, without the ORM's bulk insert
    and the look for a taken id before it (half of a create's CPU). None, with nothing
    written, when its id or idempotency key is taken."""
    now = clock.now()
    row = _new_row(name, version, item, actor, now, controlled=False)
    columns, writers = _instance_columns()
    db = connections[connection.alias]
    values = [write(row, db) for write in writers]
    keyed = item.idempotency_key is not None
    if keyed:  # the parameters of MERGED_KEY_TAKES_ID, before the id's
        at = columns.index("instance_id")
        values[at:at] = [name, version, item.idempotency_key]
    if not writes_in_one_statement():
        with transaction.atomic(), sql_cursor() as cursor:
            cursor.execute(_insert_instance_sql(columns, keyed), values)
            returned = cursor.fetchone()
            if returned is None:
                return None
            row.pk = returned[0]
            insert_history(row.pk, 1, [History("instance.created", _created_data(row), actor)], now)
            index_attributes([row])
        return _created_row(row)
    attributes = [
        part for key, value in (row.attributes or {}).items() for part in (key, index_text(value))
    ]
    with statement_cursor() as cursor:  # prepared once per shape (attribute count)
        cursor.execute(
            _create_sql(columns, len(attributes) // 2, keyed),
            [
                *values,
                db_time(now),
                json.dumps(_created_data(row)),
                actor,
                *attributes,
                WAKE_CHANNEL,
            ],
        )
        returned = cursor.fetchone()
    if returned is None:
        return None
    row.pk = returned[0]
    return _created_row(row)


@functools.cache
def _instance_columns() -> tuple[tuple[str, ...], list[Callable[[Instance, Any], Any]]]:
    """The instance table's columns but the id, and for each a writer of a row's value as
    Field.get_db_prep_save gives it. Text, whole numbers and booleans go as they are (what
    Django's preparation returns for a value of that type), datetimes through db_time; the
    rest through Django. Django's way for every column, with the connection proxy looked up
    again in each, was 145 µs a row on PostgreSQL and 170 on SQLite, a fifth of a create's
    CPU (docs/performance.md, fourteenth round)."""
    fields = [f for f in Instance._meta.concrete_fields if not f.primary_key]
    return tuple(f.column for f in fields), [_column_writer(f) for f in fields]


_INTEGER_TYPES = frozenset(
    (
        "IntegerField",
        "SmallIntegerField",
        "BigIntegerField",
        "PositiveIntegerField",
        "PositiveSmallIntegerField",
        "PositiveBigIntegerField",
    )
)


def _column_writer(field: Any) -> Callable[[Instance, Any], Any]:
    def by_django(row: Instance, db: Any) -> Any:
        return field.get_db_prep_save(field.pre_save(row, True), db)

    attname, kind = field.attname, field.get_internal_type()
    if kind in ("CharField", "TextField", "BooleanField"):
        plain = bool if kind == "BooleanField" else str

        def as_it_is(row: Instance, db: Any) -> Any:
            value = row.__dict__[attname]
            return value if value is None or type(value) is plain else by_django(row, db)

        return as_it_is
    if kind in _INTEGER_TYPES:  # PostgreSQL's backend types them (Int2, Int4...)

        def integer(row: Instance, db: Any) -> Any:
            value = row.__dict__[attname]
            if value is None or type(value) is int:
                return db.ops.adapt_integerfield_value(value, kind)
            return by_django(row, db)

        return integer
    if kind == "DateTimeField" and not (field.auto_now or field.auto_now_add):

        def instant(row: Instance, db: Any) -> Any:
            value = row.__dict__[attname]
            if value is None or value.tzinfo is not None:
                return db_time(value, db)
            return by_django(row, db)  # naive: Django warns and makes it aware

        return instant
    return by_django


def _created_row(row: Instance) -> Instance:
    """The row built for the insert, as stored: every column came from it (none has a
    database default), only the id is new. Reading the whole row back and loading its
    twenty-odd columns was a sixth of a create."""
    row._state.adding = False
    row._state.db = connection.alias
    return row


# A keyed create's id: that of the instance a debounce merged a create of the same key
# into (see _debounce), if there is one. The row then conflicts on its id and nothing is
# written: the long way returns that instance, as it returns the one of an instance's
# own key. The look rides in the create's one statement instead of a round trip before.
MERGED_KEY_TAKES_ID = (
    f"COALESCE((SELECT i.instance_id FROM {MergedCreateKey._meta.db_table} m "
    f"JOIN {INSTANCE_TABLE} i ON i.id = m.instance_id "
    "WHERE m.workflow = %s AND m.version = %s AND m.idempotency_key = %s), %s)"
)


@functools.cache
def _insert_instance_sql(columns: tuple[str, ...], keyed: bool = False) -> str:
    """The instance row's INSERT, nothing written when its id or key is taken (or, keyed,
    when its key names a merged create: MERGED_KEY_TAKES_ID)."""
    values = ["%s"] * len(columns)
    if keyed:
        values[columns.index("instance_id")] = MERGED_KEY_TAKES_ID
    return (
        f"INSERT INTO {INSTANCE_TABLE} ({', '.join(columns)}) "
        f"VALUES ({', '.join(values)}) ON CONFLICT DO NOTHING RETURNING id"
    )


@functools.cache
def _create_sql(columns: tuple[str, ...], attribute_count: int, keyed: bool = False) -> str:
    """The statement of _create_at_once for one shape (cached per shape)."""
    parts = [
        f"new AS ({_insert_instance_sql(columns, keyed)})",
        f"history AS (INSERT INTO {HISTORY_TABLE} (instance_id, sequence, created_at, type, data, actor) "
        "SELECT id, 1, %s, 'instance.created', CAST(%s AS jsonb), %s FROM new)",
    ]
    if attribute_count:  # the rows attribute filters look up (search.index_attributes)
        pairs = ", ".join(["(CAST(%s AS text), CAST(%s AS text))"] * attribute_count)
        parts.append(
            f"attributes AS (INSERT INTO {ATTRIBUTE_TABLE} (instance_id, key, value) "
            f"SELECT new.id, a.key, a.value FROM new, (VALUES {pairs}) AS a(key, value))"
        )
    parts.append("hint AS (SELECT pg_notify(%s, 'created ' || id) FROM new)")
    return f"WITH {', '.join(parts)} SELECT new.id, (SELECT count(*) FROM hint) FROM new"


# --- children ---------------------------------------------------------------------------


def start_child(
    workflow: str, version: int, limits: Limits, item: NewInstance, fallback_id: str, actor: str
) -> tuple[Instance, bool]:
    """Create the child of a parent's step once (replays find it: one per parent step).

    The readable id (item.instance_id) may be taken by an unrelated instance: the child
    then takes fallback_id, derived from the parent's pk and the step name.
    """
    try:
        [(child, created)] = create_instances(workflow, version, limits, [item], actor)
    except InstanceAlreadyExists:
        item.instance_id = fallback_id
        [(child, created)] = create_instances(workflow, version, limits, [item], actor)
    if created and child.status == Status.RUNNING and on_promoted is not None:
        on_promoted([child.pk])  # committed: workers here and elsewhere may run it now
    return child, created


def child_of(parent_pk: int, step_name: str) -> Instance | None:
    """The child a parent's step started, as it is now."""
    return Instance.objects.filter(parent_id=parent_pk, parent_step=step_name).first()


@retry_while_locked
def promote_all_queued(workflows: Sequence[tuple[str, Limits]]) -> int:
    """At worker start: queued instances start wherever there is room (after a restart too)."""
    now = clock.now()
    total = 0
    for name, limits in workflows:
        with transaction.atomic():
            total += len(promote_queued(name, limits, now))
    return total


@retry_while_locked
def promote_stranded_queues(workflows: Sequence[tuple[str, Limits]]) -> int:
    """Start the queued instances of the workflows these limits put under no flow control.

    A process of the previous release, whose code still has a limit the new code dropped,
    queues the creates it takes and starts its queue at its own runs' ends. Under no flow
    control here, nothing in this process admits (an end promotes only under flow
    control, admit_due only instances with an admit_at), so what it queued after this
    worker started waited for the next worker start."""
    names = [name for name, limits in workflows if not limits.flow_controlled]
    if not names:
        return 0
    stranded = _queued_for_a_place(names)
    return promote_all_queued([(name, limits) for name, limits in workflows if name in stranded])


def _queued_for_a_place(names: Sequence[str]) -> set[str]:
    """Those of the workflows with an instance queued for a place, not for a time
    (admit_due starts those: a debounce, a rate window). One probe of the line's index
    (IN_LINE_SQL) a workflow, in one statement: it holds no pending debounce, and a
    DISTINCT over the queue's read every one of them every 5 s (100,000: 36 ms)."""
    probes = [
        f"SELECT workflow FROM (SELECT workflow FROM {INSTANCE_TABLE} WHERE workflow = %s "
        f"AND admit_at IS NULL AND {IN_LINE_WHERE} ORDER BY priority, id LIMIT 1) AS w{n}"
        for n in range(len(names))
    ]
    with connection.cursor() as cursor:
        cursor.execute(" UNION ALL ".join(probes), list(names))
        return {name for (name,) in cursor.fetchall()}


def get_instance(name: str, instance_id: str) -> Instance:
    try:
        return Instance.objects.get(workflow=name, instance_id=instance_id)
    except Instance.DoesNotExist:
        raise InstanceNotFound(f"workflow {name!r} has no instance {instance_id!r}") from None


@retry_while_locked
def pause(name: str, instance_id: str, actor: str = "") -> str:
    now = clock.now()
    with transaction.atomic():
        inst = locked_instance(name, instance_id)
        held = (
            inst.lease_token is not None
            and inst.lease_expires_at is not None
            and inst.lease_expires_at > now
        )
        new_status = lifecycle.after(lifecycle.PAUSE, inst.status, instance_id, held_by_run=held)
        updates: dict[str, Any] = {"status": new_status, "updated_at": now}
        if new_status == Status.PAUSED:
            updates.update(wake_at=None, **clear_lease())
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
        inst = locked_instance(name, instance_id)
        new_status = lifecycle.after(
            lifecycle.RESUME, inst.status, instance_id, admitted=inst.started_at is not None
        )
        if new_status == Status.QUEUED:
            Instance.objects.filter(id=inst.pk).update(
                status=Status.QUEUED, wake_at=None, updated_at=now
            )
            append_history(
                inst.pk, [History("instance.resumed", {"to": Status.QUEUED}, actor)], now
            )
            if inst.pk in promote_queued(name, limits, now, look_at={inst.pk}):
                new_status = Status.RUNNING
        elif inst.status == Status.WAITING_FOR_PAUSE:
            Instance.objects.filter(id=inst.pk).update(status=Status.RUNNING, updated_at=now)
            append_history(inst.pk, [History("instance.resumed", {}, actor)], now)
        else:
            Instance.objects.filter(id=inst.pk).update(
                status=Status.RUNNING, wake_at=now, updated_at=now
            )
            append_history(inst.pk, [History("instance.resumed", {}, actor)], now)
    return new_status


def locked_with_parent(name: str, instance_id: str) -> Instance:
    """The instance, row-locked after its parent's row (if it has one).

    Every transaction that touches a parent and its child locks the parent first (a
    child's finish wakes its parent; a parent's terminate ends its children), so the two
    can never deadlock on PostgreSQL.
    """
    parent_pk = (
        Instance.objects.filter(workflow=name, instance_id=instance_id)
        .values_list("parent_id", flat=True)
        .first()
    )
    if parent_pk is not None:
        list(lock_rows(Instance.objects.filter(id=parent_pk)).values_list("id", flat=True))
    return locked_instance(name, instance_id)


@retry_while_locked
def terminate(
    name: str, instance_id: str, limits: Limits, actor: str = "", reason: str = ""
) -> bool:
    """Terminate a live instance; returns False if it had already finished."""
    with transaction.atomic():
        inst = locked_with_parent(name, instance_id)
        if not lifecycle.can(lifecycle.TERMINATE, inst.status):
            return False
        _terminate_locked([inst], lambda _: limits, actor, reason, clock.now())
    return True


def terminate_batch(pks: Sequence[int], actor: str = "", reason: str = "") -> list[Instance]:
    """Terminate the live instances among pks as terminate() does each, with a few
    statements for the lot (inside the caller's transaction: a bulk job's batch); returns
    the instances terminated. Rows are locked in id order, as every multi-row lock is,
    with the parents of the batch's children in the same statement: an ended child wakes
    its parent (wake_parent updates its row), and a parent is locked before its child
    everywhere (locked_with_parent): taken after the child, it could deadlock with a
    transaction holding the parent and wanting the child (its terminate's cascade). A
    parent was created before its child, so id order puts it first. (The parents' ids
    are read first, by their pks: in the locking statement, an OR with a subquery on
    parent_id is a filter over every row, not an index lookup.)

    As terminate() of each in id order (a parent before its children): an instance whose
    parent is terminated in the same batch ends with it, through the parent's cascade
    (child.terminated on the parent, which a restart of the parent revives), and is not
    returned, as a terminate() of it afterwards would find it ended already."""
    batch = set(pks)
    parents = Instance.objects.filter(id__in=list(pks), parent_id__isnull=False).values_list(
        "parent_id", flat=True
    )  # read unlocked: an instance's parent is set when it is created, never changed
    locked = lock_rows(Instance.objects.filter(id__in=sorted(batch.union(parents))).order_by("id"))
    rows = [
        row
        for row in locked.only(
            "id",
            "workflow",
            "instance_id",
            "version",
            "status",
            "retention_ms",
            "retention_error_ms",
            "parent_id",
            "parent_step",
            "concurrency_key",  # the places freed (promote_queued's freed_keys)
        )
        if row.pk in batch
    ]
    live = [row for row in rows if lifecycle.can(lifecycle.TERMINATE, row.status)]
    # A row whose parent is ended here too ends in that parent's cascade, which ends every
    # live child level by level: only the others (the roots of the batch) are ended here.
    ending = {row.pk for row in live}
    live = [row for row in live if row.parent_id not in ending]
    if live:
        _terminate_locked(
            live, lambda inst: limits_for(inst.workflow, inst.version), actor, reason, clock.now()
        )
    return live


def _terminate_locked(
    insts: Sequence[Instance],
    limits_of: Callable[[Instance], Limits],
    actor: str,
    reason: str,
    now: datetime,
) -> None:
    """End live, locked instances and their unfinished children (SPEC §8)."""
    _end_terminated(insts, limits_of, actor, reason, now)
    _terminate_children(insts, actor, now)


def _end_terminated(
    insts: Sequence[Instance],
    limits_of: Callable[[Instance], Limits],
    actor: str,
    reason: str | Callable[[Instance], str],
    now: datetime,
    wake_parents: bool = True,
) -> None:
    """End live, locked instances: one UPDATE per distinct expiry, their open steps closed,
    a history record each (`reason`, or each one's), and queued instances of their
    workflows started in their place. `wake_parents`: the parents of those that have one
    are due (a parent ending in the same transaction, as in a cascade, is not)."""
    reason_of = reason if callable(reason) else (lambda _: reason)
    by_expiry: dict[datetime | None, list[int]] = {}
    for inst in insts:
        expiry = retention.expires_at(
            Status.TERMINATED, inst.retention_ms, inst.retention_error_ms, limits_of(inst), now
        )
        by_expiry.setdefault(expiry, []).append(inst.pk)
    for expiry, pks in by_expiry.items():
        Instance.objects.filter(id__in=pks).update(
            status=Status.TERMINATED,
            wake_at=None,
            finished_at=now,
            updated_at=now,
            waiting_reason="",
            compensate_on_cancel=False,
            admit_at=None,
            expires_at=expiry,
            **clear_lease(),
        )
    pks = [inst.pk for inst in insts]
    close_open_steps(pks[0] if len(pks) == 1 else pks, now)
    append_histories(
        {
            inst.pk: History(
                "instance.terminated", {"from": inst.status, "reason": reason_of(inst)}, actor
            )
            for inst in insts
        },
        now,
    )
    for inst in insts:
        if wake_parents and inst.parent_id is not None:
            wake_parent(inst.parent_id, inst.parent_step, now)
    for workflow, inst in {inst.workflow: inst for inst in insts}.items():
        limits = limits_of(inst)
        if limits.flow_controlled:
            freed = {i.concurrency_key for i in insts if i.workflow == workflow}
            promote_queued(workflow, limits, now, freed_keys=freed)


def end_awaited_children(pk: int, now: datetime) -> None:
    """A parent that ended on its own (complete or errored) while a step.invoke of it still
    waited (a gathered branch failed, or run() returned without awaiting it) terminates that
    child, and the child's children: nothing will take its output. The children of its
    step.start steps run on: "start, don't wait" outlives the parent (detached), as does a
    child compensating (its parent's cancel(compensate=True), whose own compensation
    failed: the child's are not cut short). A step.start's child says so on its row, from
    its creation: whichever run created it, and whether or not its checkpoint was written
    (a branch stopped, a run cut short in between). One made before migration 0028 (NULL)
    is known by its step's START_CHILD checkpoint, as before. Inside the parent's
    finishing transaction, its row locked; a restart revives them (the child.terminated
    records)."""
    parent = Instance.objects.only("id", "workflow", "instance_id").get(id=pk)
    started = StepRecord.objects.filter(instance_id=pk, kind=StepKind.START_CHILD).values("name")
    spared = (
        Q(detached=True)
        | Q(detached__isnull=True, parent_step__in=started)
        | Q(status=Status.COMPENSATING)
    )
    _terminate_children([parent], "", now, spared=spared)


def _terminate_children(
    parents: Sequence[Instance], actor: str, now: datetime, spared: Q | None = None
) -> None:
    """Parents terminated or cancelled take their unfinished children (and theirs) with them;
    `spared`: the children of the first level left running.

    Level by level in a loop, not a call per level: a chain of children deeper than
    Python's stack (a workflow that recurses into a child per page) ends too. Each level
    is locked after the one above it, parents before children as everywhere, and ended
    with a few statements a slice of CASCADE_SLICE children (a parent's child.terminated
    records in one insert): a statement or more per child took a fan-out of 500 children
    3,500 statements and 14 s under the parent's lock."""
    while parents:
        by_pk = {parent.pk: parent for parent in parents}
        live = Instance.objects.filter(parent_id__in=list(by_pk), status__in=lifecycle.LIVE)
        if spared is not None:
            live, spared = live.exclude(spared), None
        children = list(lock_rows(live.order_by("id")))
        # Every worker hears it at commit (PostgreSQL), the one running a child stops it:
        # through the channel layer only, a fleet without Redis heard it at its next poll.
        hint_workers("terminate", [child.pk for child in children])
        notified = workers_listen()
        for start in range(0, len(children), CASCADE_SLICE):
            _end_children(children[start : start + CASCADE_SLICE], by_pk, actor, now)
        for child in children:
            # Counted once the transaction commits, as an operator's terminate is (client.py).
            transaction.on_commit(
                functools.partial(meters.instance_finished, child.workflow, Status.TERMINATED)
            )
            if on_child_terminated is not None:  # a worker running the child stops its run
                transaction.on_commit(functools.partial(on_child_terminated, child.pk, notified))
        parents = children


CASCADE_SLICE = 500  # children a cascade ends with one set of statements (bound parameters)


def _end_children(
    children: Sequence[Instance], parents: dict[int, Instance], actor: str, now: datetime
) -> None:
    """End locked children whose parents end in this transaction: each parent's
    child.terminated records, then the children with their "parent … ended" reason. Their
    parents are not woken: they are ending (their steps closed already)."""
    records: dict[int, list[History]] = {}
    for child in children:
        data = {"workflow": child.workflow, "id": child.instance_id}
        records.setdefault(child.parent_id, []).append(History("child.terminated", data))
    for parent_pk, parent_records in records.items():
        append_history(parent_pk, parent_records, now)

    def reason(child: Instance) -> str:
        parent = parents[child.parent_id]
        return f"parent {parent.workflow}/{parent.instance_id} ended"

    _end_terminated(
        children,
        lambda inst: limits_for(inst.workflow, inst.version),
        actor,
        reason,
        now,
        wake_parents=False,
    )


@retry_while_locked
def restart(
    name: str,
    instance_id: str,
    limits: Limits,
    from_step: str | None = None,
    actor: str = "",
    version: int | None = None,
) -> str:
    """Drop checkpoints (all, or from_step and every step started after it) and run again,
    on `version` if given (the fix of a version that fails), else on the instance's own."""
    with transaction.atomic():
        inst, child_steps, status = _restart_locked(
            name, instance_id, limits, from_step, actor, version
        )
        _restart_children_it_ended(inst, child_steps, actor)
    return status


def _restart_locked(
    name: str,
    instance_id: str,
    limits: Limits,
    from_step: str | None,
    actor: str,
    version: int | None,
) -> tuple[Instance, set[str], str]:
    """restart() of one instance inside the caller's transaction: the instance, the names
    of its steps whose children a revival looks at (the dropped steps that started
    children, and the kept step.start steps), and its new status."""
    now = clock.now()
    inst = locked_instance(name, instance_id)
    moved = version is not None and version != inst.version
    if moved:
        _move_to_version(inst, version)
    steps = StepRecord.objects.filter(instance_id=inst.pk)
    if from_step is not None:
        anchor = (
            steps.exclude(kind=StepKind.COMPENSATE)
            .filter(name=from_step)
            .values_list("seq", flat=True)
            .first()
        )
        if anchor is None:
            raise InvalidInput(f"instance {instance_id!r} has no step named {from_step!r}")
        # A step a compensation undid is done again, wherever it was: its checkpoint
        # would replay an effect no longer in force.
        undone = steps.filter(kind=StepKind.COMPENSATE, status=StepStatus.COMPLETE)
        steps = steps.filter(
            Q(seq__gte=anchor)
            | ~Q(status=StepStatus.COMPLETE)
            | Q(kind=StepKind.COMPENSATE)
            | Q(kind=StepKind.DO, name__in=list(undone.values_list("name", flat=True)))
        )
    dropped = steps.count()
    child_steps = set(
        steps.filter(kind__in=(StepKind.INVOKE, StepKind.START_CHILD)).values_list(
            "name", flat=True
        )
    )
    steps.delete()
    # A child whose step has no checkpoint (its branch was stopped after creating it and
    # before the checkpoint; the parent's end terminated it) belongs to no dropped step:
    # revived too, as the replay's step finds it by name.
    kept = StepRecord.objects.filter(instance_id=inst.pk).values_list("name", flat=True)
    child_steps.update(
        Instance.objects.filter(parent_id=inst.pk)
        .exclude(parent_step__in=kept)
        .values_list("parent_step", flat=True)
        .distinct()
    )
    # A kept step.start (a restart from a later step) says its child was started and runs
    # on: one the instance's own terminate or cancel ended is revived too, or the parent
    # would carry on and the child's work silently never happen. (A kept invoke's child
    # had finished on its own: its checkpoint holds the output.)
    child_steps.update(
        StepRecord.objects.filter(instance_id=inst.pk, kind=StepKind.START_CHILD).values_list(
            "name", flat=True
        )
    )
    # One that held a place keeps it; any other goes through admission with the queue.
    keeps_place = lifecycle.holds_place(inst.status, inst.started_at is not None)
    if keeps_place and limits.rate_limit is not None:
        # Running again is a start the rate limit counts, as a finished one's restart is:
        # it keeps its place if the window has a start left, else waits in the queue.
        lock_workflow(name)
        keeps_place = _take_rate_start(name, limits, now)
    Instance.objects.filter(id=inst.pk).update(
        **_restarted_fields(keeps_place, inst.started_at, now)
    )
    append_history(
        inst.pk,
        [
            History(
                "instance.restarted",
                {
                    "from_step": from_step,
                    "dropped_steps": dropped,
                    "from": inst.status,
                    **({"version": version, "from_version": inst.version} if moved else {}),
                },
                actor,
            )
        ],
        now,
    )
    if inst.status in lifecycle.FINISHED and inst.run_count > 0:
        # Its end was counted and it will be counted as ending again: its start is counted
        # now (at its first claim, run_count 1, before), as an operator's terminate is
        # counted where it is made. One that never ran is counted at its first claim.
        transaction.on_commit(functools.partial(meters.instance_restarted, name))
    if not keeps_place:
        lock_workflow(name)
    admitted = keeps_place or inst.pk in promote_queued(name, limits, now, created={inst.pk})
    return inst, child_steps, Status.RUNNING if admitted else Status.QUEUED


def _restarted_fields(keeps_place: bool, started_at: datetime | None, now: datetime) -> dict:
    """The columns a restart sets: running again where it kept its place, else queued."""
    return {
        "status": Status.RUNNING if keeps_place else Status.QUEUED,
        "wake_at": now if keeps_place else None,
        "started_at": (started_at or now) if keeps_place else None,
        "output_json": None,
        "error_name": "",
        "error_message": "",
        "error_stack": "",
        "finished_at": None,
        "expires_at": None,
        "waiting_reason": "",
        "admit_at": None,
        "debounce_key": None,  # a debounce key names the next instance to start, not this one
        "updated_at": now,
        "unproductive_claims": 0,
        "compensate_on_cancel": False,
        **clear_lease(),
    }


def _move_to_version(inst: Instance, version: int) -> None:
    """The instance runs on `version` from now on (inside the caller's transaction)."""
    _check_idempotency_key_free(inst, version)
    try:
        with transaction.atomic():  # a savepoint: the caller's transaction goes on
            Instance.objects.filter(id=inst.pk).update(version=version)
    except IntegrityError:  # another instance took the key on that version since the look
        raise InvalidInput(
            f"instance {inst.instance_id!r} cannot move to version {version}: its idempotency "
            f"key {inst.idempotency_key!r} was just taken on that version"
        ) from None


def _check_idempotency_key_free(inst: Instance, version: int) -> None:
    """An idempotency key names one instance of a workflow's version: moving this one to
    `version` must not make two (the database's constraint would fail the restart)."""
    key = inst.idempotency_key
    if key is None:
        return
    taken = (
        Instance.objects.filter(workflow=inst.workflow, version=version, idempotency_key=key)
        .values_list("instance_id", flat=True)
        .first()
    )
    if taken is not None:
        raise InvalidInput(
            f"instance {inst.instance_id!r} cannot move to version {version}: its idempotency key "
            f"{key!r} is already instance {taken!r}'s on that version"
        )


def _restart_children_it_ended(parent: Instance, steps: Collection[str], actor: str) -> None:
    """The children of the dropped steps (and of the kept step.start steps) that the
    parent's own terminate or cancel ended (its child.terminated records) run again with
    it: the replay finds them by step, and would otherwise fail at once on a child its
    terminate killed (or go on without a started one). A child that failed or was
    terminated on its own is found as it is. Theirs run again the same way (a revived
    child restarts from its start: all its steps are dropped, so all its children are
    looked at), level by level in a loop (a chain deeper than Python's stack is revived
    too), a few statements a slice of CASCADE_SLICE children: a restart() of each took
    11 statements a child under the parent's lock, as the terminate cascade took 7."""
    now = clock.now()
    level = _children_it_ended([parent], {parent.pk: steps})
    revived: list[int] = []
    while level:
        for start in range(0, len(level), CASCADE_SLICE):
            _revive(level[start : start + CASCADE_SLICE], actor, now)
        revived.extend(child.pk for child in level)
        level = _children_it_ended(level, None)
    hint_workers("restart", revived)


def _revive(children: Sequence[Instance], actor: str, now: datetime) -> None:
    """Restart locked, terminated children from their start (restart() without from_step,
    in one set of statements): their steps dropped, queued, each its instance.restarted
    record, then admitted through their workflows' queues."""
    pks = [child.pk for child in children]
    dropped: dict[int, int] = {}
    for pk in StepRecord.objects.filter(instance_id__in=pks).values_list("instance_id", flat=True):
        dropped[pk] = dropped.get(pk, 0) + 1
    if dropped:
        StepRecord.objects.filter(instance_id__in=pks).delete()
    # A terminated instance holds no place: each goes through admission with the queue.
    Instance.objects.filter(id__in=pks).update(**_restarted_fields(False, None, now))
    append_histories(
        {
            child.pk: History(
                "instance.restarted",
                {
                    "from_step": None,
                    "dropped_steps": dropped.get(child.pk, 0),
                    "from": child.status,
                },
                actor,
            )
            for child in children
        },
        now,
    )
    groups: dict[tuple[str, int], set[int]] = {}
    for child in children:
        groups.setdefault((child.workflow, child.version), set()).add(child.pk)
        if child.run_count > 0:  # counted as ending again: its start is counted now
            transaction.on_commit(functools.partial(meters.instance_restarted, child.workflow))
    for (workflow, version), created in groups.items():
        lock_workflow(workflow)
        promote_queued(workflow, limits_for(workflow, version), now, created=created)


def _children_it_ended(
    parents: Sequence[Instance], steps: dict[int, Collection[str]] | None
) -> list[Instance]:
    """The children (locked, in id order) of these parents that their terminate or cancel
    ended: of the given steps of each, or (None) of all. The cascade's child.terminated
    record and the child's end share one instant. A child revived since and then
    terminated on its own ended later, and is left as it is. A few statements for all the
    parents of a level."""
    pks = [parent.pk for parent in parents if steps is None or steps.get(parent.pk)]
    if not pks:
        return []
    children = list(
        lock_rows(
            Instance.objects.filter(parent_id__in=pks, status=Status.TERMINATED).order_by("id")
        )
    )
    if steps is not None:
        children = [child for child in children if child.parent_step in steps[child.parent_id]]
    if not children:
        return []
    ended: set[tuple[int, Any, datetime]] = set()
    cancelled: dict[tuple[int, Any], datetime] = {}  # (parent, child id) -> its latest cancel
    for parent_pk, kind, data, created_at in HistoryRecord.objects.filter(
        instance_id__in=pks, type__in=("child.terminated", "child.cancelled")
    ).values_list("instance_id", "type", "data", "created_at"):
        if not isinstance(data, dict):
            continue
        key = (parent_pk, data.get("id"))
        if kind == "child.terminated":
            ended.add((*key, created_at))
        else:
            cancelled[key] = max(created_at, cancelled.get(key, created_at))
    restarted = _last_restarts(
        [child.pk for child in children if (child.parent_id, child.instance_id) in cancelled]
    )
    return [
        child
        for child in children
        if (child.parent_id, child.instance_id, child.finished_at) in ended
        or _compensated_with_parent(
            cancelled.get((child.parent_id, child.instance_id)), restarted.get(child.pk)
        )
    ]


def _last_restarts(pks: Sequence[int]) -> dict[int, datetime]:
    """The latest instance.restarted record's instant of each of these instances that has one."""
    if not pks:
        return {}
    return dict(
        HistoryRecord.objects.filter(instance_id__in=pks, type="instance.restarted")
        .values("instance_id")
        .annotate(last=Max("created_at"))
        .values_list("instance_id", "last")
    )


def _compensated_with_parent(cancelled_at: datetime | None, restarted_at: datetime | None) -> bool:
    """A child its parent's cancel(compensate=True) cancelled ends when its compensations
    are done, later than the cascade's child.cancelled record: it ended with its parent
    unless it was restarted since (and then ended on its own)."""
    if cancelled_at is None:
        return False
    return restarted_at is None or restarted_at < cancelled_at


@retry_while_locked
def skip_sleep(name: str, instance_id: str, actor: str = "") -> int:
    """Make the current sleeps of an instance due now; returns how many were woken."""
    now = clock.now()
    with transaction.atomic():
        inst = locked_instance(name, instance_id)
        woken = StepRecord.objects.filter(
            instance_id=inst.pk,
            kind__in=(StepKind.SLEEP, StepKind.SLEEP_UNTIL),
            status=StepStatus.WAITING,
        ).update(wake_at=now)
        if not woken:
            raise InvalidTransition(
                f"instance {instance_id!r} is not sleeping (it is {inst.status})"
            )
        if inst.status in (Status.WAITING, Status.RUNNING):
            Instance.objects.filter(id=inst.pk).update(wake_at=now, updated_at=now)
        append_history(inst.pk, [History("sleep.skipped", {"count": woken}, actor)], now)
    return woken


@retry_while_locked
def send_event(
    name: str,
    instance_id: str,
    event_type: str,
    payload_json: str,
    validate: Any = None,
    actor: str = "",
    max_buffered: int | None = None,
) -> InboxEvent:
    """Store an event for an instance and make it due if it is running or waiting.

    validate(schema_json) is called with the schema of the step waiting for this type
    (if any) before anything is written; it raises to refuse the payload. An instance
    that holds max_buffered events no wait has taken yet (None: no bound) takes no more,
    but for one a wait of its type is there to take: LimitExceeded, and nothing is
    written.
    """
    now = clock.now()
    send = _send_event_at_once if writes_in_one_statement() else _send_event_in_raw_sql
    sent = send(
        name, instance_id, event_type, payload_json, validate is not None, actor, now, max_buffered
    )
    if sent is not None:
        return sent
    # Refused, unknown, full, or a typed wait's schema to check first: the long way says why.
    with transaction.atomic():
        inst = locked_instance(name, instance_id)
        if not lifecycle.can(lifecycle.SEND_EVENT, inst.status):
            raise InvalidTransition(
                f"cannot send event {event_type!r} to instance {instance_id!r}: it is {inst.status}"
            )
        if validate is not None:
            schemas = list(
                StepRecord.objects.filter(
                    instance_id=inst.pk,
                    kind=StepKind.WAIT_FOR_EVENT,
                    status=StepStatus.WAITING,
                    event_type=event_type,
                )
                .order_by("seq")
                .values_list("event_schema_json", flat=True)
            )
            # Refused only when no wait of this type would take it: an untyped one takes
            # anything, a typed one what its schema accepts (parallel waits each their own).
            if schemas and None not in schemas:
                refusals: list[EventPayloadInvalid] = []
                for schema in schemas:
                    try:
                        validate(schema)
                        break
                    except EventPayloadInvalid as exc:
                        refusals.append(exc)
                else:
                    raise refusals[0]  # the oldest wait's reasons
        if max_buffered is not None:
            _refuse_a_full_buffer(inst.pk, instance_id, event_type, max_buffered)
        event = InboxEvent.objects.create(
            instance_id=inst.pk,
            type=event_type,
            payload_json=payload_json,
            created_at=now,
            actor=actor,
        )
        if inst.status in (Status.WAITING, Status.RUNNING):
            Instance.objects.filter(id=inst.pk).update(wake_at=now, updated_at=now)
        append_history(
            inst.pk, [History("event.sent", {"type": event_type, "event_id": event.pk}, actor)], now
        )
        hint_workers("event", [inst.pk])
    return event


def _refuse_a_full_buffer(pk: int, instance_id: str, event_type: str, max_buffered: int) -> None:
    """LimitExceeded if the instance holds max_buffered events no wait took yet (read
    under its lock: concurrent sends wait for it). The look stops at the bound; the exact
    count is read only to say how many there are."""
    unconsumed = InboxEvent.objects.filter(instance_id=pk, consumed_at__isnull=True)
    if unconsumed[:max_buffered].count() < max_buffered:
        return
    # A wait of this type not yet given one of the unconsumed events takes this one: full
    # of events of other types, an instance still takes the one it waits for.
    waits = StepRecord.objects.filter(
        instance_id=pk,
        kind=StepKind.WAIT_FOR_EVENT,
        status=StepStatus.WAITING,
        event_type=event_type,
    ).count()
    if waits > unconsumed.filter(type=event_type).count():
        return
    raise LimitExceeded(
        "max_buffered_events",
        unconsumed.count() + 1,
        max_buffered,
        f"event {event_type!r} for instance {instance_id!r} (events sent to it that no "
        "wait_for_event has taken yet)",
    )


# send_event as one autocommit statement (PostgreSQL): lock the instance, store the event,
# make the instance due, append event.sent and notify the workers, or write nothing when
# the instance may not take the event, holds max_buffered events no wait took yet (an
# EXISTS past the first full_at of them, on the inbox_unconsumed index) or a typed wait
# must validate it first (then the caller takes the long way, which says why or
# validates). Nor when the row changed after the statement's snapshot (a run's checkpoint,
# or another send, the lock waited for): the statement reads the locked row as it is now
# but the steps and the inbox as they were, so a typed wait that checkpoint committed would
# go unseen and its schema unchecked, or the other send's event uncounted; the long way
# reads them after the lock.
SEND_EVENT_SQL = f"""
WITH inst AS (
    SELECT id, status, xmin AS version FROM {INSTANCE_TABLE}
    WHERE workflow = %(workflow)s AND instance_id = %(instance_id)s FOR NO KEY UPDATE
), ok AS (
    SELECT id, status FROM inst
    WHERE status = ANY(%(allowed)s)
      AND version = (SELECT xmin FROM {INSTANCE_TABLE} AS seen WHERE seen.id = inst.id)
      AND NOT (%(validate)s AND EXISTS (
        SELECT 1 FROM {STEP_TABLE} AS s WHERE s.instance_id = inst.id AND s.kind = %(wait_kind)s
          AND s.status = %(waiting_step)s AND s.event_type = %(type)s
          AND s.event_schema_json IS NOT NULL))
      AND NOT (%(bounded)s AND EXISTS (
        SELECT 1 FROM {INBOX_TABLE} AS e WHERE e.instance_id = inst.id AND e.consumed_at IS NULL
        LIMIT 1 OFFSET %(full_at)s))
), due AS (
    UPDATE {INSTANCE_TABLE} AS i SET history_seq = i.history_seq + 1,
        wake_at = CASE WHEN ok.status = ANY(%(wakes)s) THEN %(now)s ELSE i.wake_at END,
        updated_at = CASE WHEN ok.status = ANY(%(wakes)s) THEN %(now)s ELSE i.updated_at END
    FROM ok WHERE i.id = ok.id
    RETURNING i.id, i.history_seq
), event AS (
    INSERT INTO {INBOX_TABLE} (instance_id, type, payload_json, created_at, actor, consumed_at, consumed_by)
    SELECT id, %(type)s, %(payload)s, %(now)s, %(actor)s, NULL, '' FROM due
    RETURNING id, instance_id
), sent AS (
    INSERT INTO {HISTORY_TABLE} (instance_id, sequence, created_at, type, data, actor)
    SELECT due.id, due.history_seq, %(now)s, 'event.sent',
        jsonb_build_object('type', %(type)s::text, 'event_id', event.id), %(actor)s
    FROM due JOIN event ON event.instance_id = due.id
), hint AS (
    SELECT pg_notify(%(channel)s, 'event ' || id) FROM due
)
SELECT (SELECT id FROM event), (SELECT id FROM due), (SELECT count(*) FROM hint)
"""


# SQLite's send_event: SEND_EVENT_SQL's parts, in its IMMEDIATE transaction. The UPDATE
# takes the instance if it may take the event (and no typed wait must validate it first,
# and it holds fewer than max_buffered events no wait took), makes it due and gives the
# event.sent record its sequence.
SEND_EVENT_UPDATE_SQL = f"""
UPDATE {INSTANCE_TABLE} SET history_seq = history_seq + 1,
    wake_at = CASE WHEN status IN (%(waiting)s, %(running)s) THEN %(now)s ELSE wake_at END,
    updated_at = CASE WHEN status IN (%(waiting)s, %(running)s) THEN %(now)s ELSE updated_at END
WHERE workflow = %(workflow)s AND instance_id = %(instance_id)s
  AND status IN (SELECT value FROM json_each(%(allowed)s))
  AND NOT (%(validate)s AND EXISTS (
    SELECT 1 FROM {STEP_TABLE} AS s WHERE s.instance_id = {INSTANCE_TABLE}.id
      AND s.kind = %(wait_kind)s AND s.status = %(waiting_step)s AND s.event_type = %(type)s
      AND s.event_schema_json IS NOT NULL))
  AND NOT (%(bounded)s AND EXISTS (
    SELECT 1 FROM {INBOX_TABLE} AS e WHERE e.instance_id = {INSTANCE_TABLE}.id
      AND e.consumed_at IS NULL LIMIT 1 OFFSET %(full_at)s))
RETURNING id, history_seq
"""
SEND_EVENT_INSERT_SQL = (
    f"INSERT INTO {INBOX_TABLE} (instance_id, type, payload_json, created_at, actor, "
    "consumed_at, consumed_by) VALUES (%s, %s, %s, %s, %s, NULL, '') RETURNING id"
)


def _send_event_in_raw_sql(
    name: str,
    instance_id: str,
    event_type: str,
    payload_json: str,
    validate: bool,
    actor: str,
    now: datetime,
    max_buffered: int | None,
) -> InboxEvent | None:
    """send_event on SQLite in three raw statements, or nothing written (None) when the
    long way must say why or validate. Through the ORM (the instance locked and read, the
    event created, the instance updated, the history's sequence allocated) a send cost
    1.4 ms, nearly all of it building queries, where a commit costs 0.012."""
    when = db_time(now)
    with transaction.atomic(), sql_cursor() as cursor:
        cursor.execute(
            SEND_EVENT_UPDATE_SQL,
            {
                **_send_params(name, instance_id, event_type, validate, max_buffered),
                "allowed": json.dumps(sorted(lifecycle.statuses_allowing(lifecycle.SEND_EVENT))),
                "waiting": Status.WAITING,
                "running": Status.RUNNING,
                "now": when,
            },
        )
        taken = cursor.fetchone()
        if taken is None:
            return None
        pk, sequence = taken
        cursor.execute(SEND_EVENT_INSERT_SQL, [pk, event_type, payload_json, when, actor])
        (event_id,) = cursor.fetchone()
        event_sent = History("event.sent", {"type": event_type, "event_id": event_id}, actor)
        insert_history_rows([(pk, sequence, event_sent)], now)
    return _sent(event_id, pk, event_type, payload_json, actor, now)


def _send_event_at_once(
    name: str,
    instance_id: str,
    event_type: str,
    payload_json: str,
    validate: bool,
    actor: str,
    now: datetime,
    max_buffered: int | None,
) -> InboxEvent | None:
    with statement_cursor() as cursor:
        cursor.execute(
            SEND_EVENT_SQL,
            {
                **_send_params(name, instance_id, event_type, validate, max_buffered),
                "allowed": sorted(lifecycle.statuses_allowing(lifecycle.SEND_EVENT)),
                "wakes": [Status.WAITING, Status.RUNNING],
                "now": db_time(now),
                "payload": payload_json,
                "actor": actor,
                "channel": WAKE_CHANNEL,
            },
        )
        event_id, pk, _ = cursor.fetchone()
    if event_id is None:
        return None
    return _sent(event_id, pk, event_type, payload_json, actor, now)


def _send_params(
    name: str, instance_id: str, event_type: str, validate: bool, max_buffered: int | None
) -> dict[str, Any]:
    """The parameters both databases' short sends share: which instance, which type,
    whether a typed wait for it must send the caller the long way (to validate), and
    how many unconsumed events make the instance full (the long way says so)."""
    return {
        "workflow": name,
        "instance_id": instance_id,
        "validate": validate,
        "wait_kind": StepKind.WAIT_FOR_EVENT,
        "waiting_step": StepStatus.WAITING,
        "type": event_type,
        "bounded": max_buffered is not None,
        "full_at": 0 if max_buffered is None else max_buffered - 1,
    }


def _sent(
    event_id: int, pk: int, event_type: str, payload_json: str, actor: str, now: datetime
) -> InboxEvent:
    return InboxEvent(
        id=event_id,
        instance_id=pk,
        type=event_type,
        payload_json=payload_json,
        created_at=now,
        actor=actor,
    )


class Cancelled(NamedTuple):
    status: str
    changed: bool  # False: its compensations were running already, and go on undisturbed


@retry_while_locked
def cancel(
    name: str, instance_id: str, limits: Limits, compensate: bool, actor: str = ""
) -> Cancelled:
    """Cancel: terminate at once, or first run the compensations of completed steps; its
    unfinished children are cancelled the same way (SPEC §8)."""
    now = clock.now()
    with transaction.atomic():
        inst = locked_with_parent(name, instance_id)
        lifecycle.after(lifecycle.CANCEL, inst.status, instance_id)
        if compensate and inst.status == Status.COMPENSATING:
            # Its compensations run already: taking the lease from the run doing them
            # would run the one in flight a second time.
            return Cancelled(Status.COMPENSATING, changed=False)
        if not compensate:
            append_history(
                inst.pk, [History("instance.cancelled", {"compensate": False}, actor)], now
            )
            _terminate_locked([inst], lambda _: limits, actor, "cancelled", now)
            return Cancelled(Status.TERMINATED, changed=True)
        status = _cancel_compensating(inst, limits, actor, "cancelled", now)
        _cancel_children([inst], actor, now)
        return Cancelled(status, changed=True)


def _cancel_compensating(
    inst: Instance, limits: Limits, actor: str, reason: str, now: datetime
) -> str:
    """cancel(compensate=True) of one live, locked instance, without its children: ended at
    once if no completed step has a compensation, else compensating; returns which."""
    compensable = StepRecord.objects.filter(
        instance_id=inst.pk,
        kind=StepKind.DO,
        status=StepStatus.COMPLETE,
        has_compensation=True,
    ).exists()
    if not compensable:
        append_history(inst.pk, [History("instance.cancelled", {"compensate": True}, actor)], now)
        _end_terminated([inst], lambda _: limits, actor, reason, now)
        return Status.TERMINATED
    # A run holding a live lease keeps it: told (hint, or its next checkpoint), it starts
    # no more work, lets the steps in flight finish and checkpoint (a sync step cannot be
    # stopped: its effect would land uncompensated), then runs the compensations; an end
    # it reaches first is refused (NO_CANCEL_PENDING) and it unwinds instead. Otherwise
    # the next run replays to collect the compensations, then runs them newest first.
    live_lease = inst.lease_token is not None and (
        inst.lease_expires_at is not None and inst.lease_expires_at > now
    )
    Instance.objects.filter(id=inst.pk).update(
        status=Status.COMPENSATING,
        compensate_on_cancel=True,
        wake_at=now,
        updated_at=now,
        waiting_reason="",
        **({} if live_lease else clear_lease()),
    )
    data = {"reason": "cancel", **({"cancelled": reason} if reason != "cancelled" else {})}
    append_history(inst.pk, [History("compensation.started", data, actor)], now)
    return Status.COMPENSATING


def _cancel_children(parents: Sequence[Instance], actor: str, now: datetime) -> None:
    """Parents cancelled with compensation cancel their unfinished children (and theirs)
    the same way: each runs its own compensations, newest first, then ends terminated, as
    its own cancel(compensate=True) would (a child with none ends at once). A child
    compensating already (its own cancel, or compensate_on_failure) goes on undisturbed.
    Level by level, parents locked before children, as _terminate_children."""
    while parents:
        by_pk = {parent.pk: parent for parent in parents}
        children = list(
            lock_rows(
                Instance.objects.filter(
                    parent_id__in=list(by_pk), status__in=lifecycle.LIVE
                ).order_by("id")
            )
        )
        below = []
        notified = workers_listen()
        for child in children:
            if child.status == Status.COMPENSATING:
                continue
            parent = by_pk[child.parent_id]
            reason = f"parent {parent.workflow}/{parent.instance_id} cancelled"
            limits = limits_for(child.workflow, child.version)
            status = _cancel_compensating(child, limits, actor, reason, now)
            ended = status == Status.TERMINATED
            # child.terminated: the cascade ended it at this instant; child.cancelled: it
            # compensates first. A restart of the parent revives either (_children_it_ended).
            kind = "child.terminated" if ended else "child.cancelled"
            data = {"workflow": child.workflow, "id": child.instance_id}
            append_history(parent.pk, [History(kind, data)], now)
            # As _terminate_children: every worker hears it at commit (PostgreSQL).
            hint_workers("terminate" if ended else "compensate", [child.pk])
            if ended:
                transaction.on_commit(
                    functools.partial(meters.instance_finished, child.workflow, Status.TERMINATED)
                )
                if on_child_terminated is not None:
                    transaction.on_commit(
                        functools.partial(on_child_terminated, child.pk, notified)
                    )
            elif on_child_compensating is not None:
                transaction.on_commit(functools.partial(on_child_compensating, child.pk, notified))
            below.append(child)
        parents = below
