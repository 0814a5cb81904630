"""The version catalog and pruning: which versions exist, and removing expired instances."""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Collection, Sequence
from datetime import datetime, timedelta

from django.db import IntegrityError, connection, transaction
from django.db.models import Exists, Max, OuterRef, Q, QuerySet

from ...models import (
    Instance,
    Span,
    Status,
    StepKind,
    StepRecord,
    StepStatus,
    WorkflowVersion,
)
from .. import clock, lifecycle
from ..errors import (
    InstanceNotFound,
    InvalidTransition,
    VersionConflict,
)
from .dialect import lock_rows, retry_while_locked

log = logging.getLogger("workflows_app.engine")


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
                        name=name,
                        version=version,
                        source_hash=source_hash,
                        class_path=class_path,
                        registered_at=now,
                        last_seen_at=now,
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
            # Not strict (WFDASH_STRICT_VERSIONS=0): replaced, in one line that says so,
            # since unfinished instances of it replay on this code from now on.
            log.warning(
                'WFDASH["STRICT_VERSIONS"] is off: workflow %r version %s now runs this code '
                "(hash %s, stored %s): its unfinished instances replay on it; bump the version "
                "to keep them on the code they started with",
                name,
                version,
                source_hash[:12],
                row.source_hash[:12],
            )
            row.source_hash = source_hash
        row.class_path = class_path
        row.last_seen_at = now
        row.save(update_fields=["source_hash", "class_path", "last_seen_at"])


# A version counts as deployed while its workers keep its catalog row fresh: each worker
# touches its versions' rows every VERSION_TOUCH (and when it starts), and a row untouched
# for VERSION_LIVE is a version whose workers are gone (a rollback, a finished rollout).
VERSION_TOUCH = timedelta(minutes=10)
VERSION_LIVE = timedelta(minutes=30)


@retry_while_locked
def touch_versions(versions: Sequence[tuple[str, int]]) -> None:
    """This process runs these versions: they count as deployed for VERSION_LIVE more."""
    if not versions:
        return
    these = Q()
    for name, version in versions:
        these |= Q(name=name, version=version)
    WorkflowVersion.objects.filter(these).update(last_seen_at=clock.now())


def newer_live_versions(ours: dict[str, int]) -> dict[str, int]:
    """Of these workflows (name: this process's newest version), those of which a newer
    version's workers were seen within VERSION_LIVE, with that version: their declared
    schedules are that version's workers' to sync and fire."""
    if not ours:
        return {}
    rows = (
        WorkflowVersion.objects.filter(
            name__in=list(ours), last_seen_at__gte=clock.now() - VERSION_LIVE
        )
        .values("name")
        .annotate(newest=Max("version"))
    )
    return {row["name"]: row["newest"] for row in rows if row["newest"] > ours[row["name"]]}


VERSION_MISSING = "version-missing: "
# An instance parked for a version no worker has run for VERSION_LIVE (its class removed
# or renamed, a rollback) is looked at again this seldom, not every VERSION_RECHECK: a
# worker that starts with the version wakes it at once (wake_registered_versions), and
# thousands of such instances claimed and parked again every minute cost a worker a
# core's share and the database a write each, for as long as they stayed.
ABSENT_VERSION_RECHECK = timedelta(hours=1)


def absent_versions(
    versions: Collection[tuple[str, int]], now: datetime | None = None
) -> set[tuple[str, int]]:
    """Those of these (workflow, version) pairs no worker has run within VERSION_LIVE (no
    catalog row touched since): one query for a claim pass's unrunnable instances, not one
    per instance parked."""
    if not versions:
        return set()
    since = (now or clock.now()) - VERSION_LIVE
    live = set(
        WorkflowVersion.objects.filter(
            name__in={name for name, _ in versions},
            version__in={version for _, version in versions},
            last_seen_at__gte=since,
        ).values_list("name", "version")
    )
    return set(versions) - live


@retry_while_locked
def wake_registered_versions(versions: Sequence[tuple[str, int]]) -> int:
    """Instances parked because their version was missing continue once it is registered."""
    now = clock.now()
    woken = 0
    for name, version in versions:
        woken += Instance.objects.filter(
            workflow=name,
            version=version,
            status=Status.WAITING,
            waiting_reason__startswith=VERSION_MISSING,
        ).update(wake_at=now, waiting_reason="")
    return woken


def _awaited_by_parent() -> QuerySet[StepRecord]:
    """The step.invoke of an instance's parent still waiting for it (OuterRef: the child):
    the parent has not taken the child's output yet, and would fail without it."""
    return StepRecord.objects.filter(
        instance_id=OuterRef("parent_id"),
        name=OuterRef("parent_step"),
        kind=StepKind.INVOKE,
        status=StepStatus.WAITING,
    )


def prunable(now: datetime | None = None) -> int:
    """How many finished instances are past their retention."""
    return Instance.objects.filter(expires_at__lte=now or clock.now()).count()


# History records and steps a prune batch deletes at most (read from the instances'
# counters, no count): 500 instances of a year-long workflow each (100,000s of records)
# were one transaction of tens of millions of rows. An instance bigger than this goes alone.
PRUNE_ROWS = 50_000


def prune(
    now: datetime | None = None,
    batch: int = 500,
    on_batch: Callable[[int], None] | None = None,
    max_batches: int | None = None,
    on_pruned: Callable[[list[str]], None] | None = None,
    on_cut: Callable[[], None] | None = None,
) -> int:
    """Delete finished instances past their retention, with every row that belongs to them.

    One transaction per batch of at most `batch` instances and PRUNE_ROWS of their
    history records and steps (at least one instance), so a large backlog never holds
    the database for long;
    on_batch hears how many each batch deleted (a progress bar), on_pruned which
    workflows it deleted instances of, once it commits (open dashboards count again:
    a deletion leaves no history row for them to find); on_cut that a batch stopped at
    PRUNE_ROWS with more of its instances due (a worker then prunes again at once, as
    after a full batch). Workers prune one batch at a
    time (max_batches=1) between runs; `wf prune` clears the whole backlog.
    """
    now = now or clock.now()
    total = 0
    # A finished child whose parent's step.invoke has not taken its output yet (the
    # parent paused, parked for a missing version, or not claimed yet) stays until it has.
    expired = Instance.objects.filter(expires_at__lte=now, status__in=lifecycle.FINISHED).exclude(
        Exists(_awaited_by_parent())
    )
    _prune_orphan_spans(now, batch)
    for _ in itertools.count() if max_batches is None else range(max_batches):
        # Look before taking the write lock: on SQLite every transaction takes it at BEGIN,
        # and a worker frozen (SIGSTOP, a debugger) inside an empty prune would hold it.
        if not expired.exists():
            return total
        with transaction.atomic():
            # Locked, and the filter checked again under the lock: a restart that commits
            # meanwhile clears expires_at (PostgreSQL re-reads the row), and one that comes
            # after waits for this batch, then finds the instance gone. Rows a restart
            # holds are left for the next batch. In expiry order, along instance_expiry:
            # by id, PostgreSQL would walk the primary key whenever its statistics guess
            # many expired rows (right after a prune emptied the backlog, until the next
            # ANALYZE), over every instance when few or none are left (930 ms at 1M).
            chosen = expired.order_by("expires_at", "id")
            if connection.features.has_select_for_update_skip_locked:
                chosen = chosen.select_for_update(no_key=True, skip_locked=True)
            candidates = list(
                chosen.values_list("id", "workflow", "history_seq", "step_seq")[:batch]
            )
            rows, size = [], 0
            for pk, workflow, history, steps in candidates:
                size += history + steps
                if rows and size > PRUNE_ROWS:
                    break
                rows.append((pk, workflow))
            if not rows:
                return total
            if len(rows) < len(candidates) and on_cut is not None:
                transaction.on_commit(on_cut)
            delete_rows([pk for pk, _ in rows])
            if on_pruned is not None:
                workflows = sorted({workflow for _, workflow in rows})
                transaction.on_commit(functools.partial(on_pruned, workflows))
        total += len(rows)
        if on_batch is not None:
            on_batch(len(rows))
    return total


# A span stored with no instance (its instance deleted before the span was flushed, or
# not yet committed when it was) is shown nowhere; delete_rows takes those it can match by
# trace id, and prune the rest once they are this old.
ORPHAN_SPAN_AGE = timedelta(days=1)


def _prune_orphan_spans(now: datetime, batch: int) -> int:
    """One batch of spans with no instance older than ORPHAN_SPAN_AGE (the index on
    (instance, start_time) finds them at its NULL end)."""
    old = Span.objects.filter(instance__isnull=True, start_time__lt=now - ORPHAN_SPAN_AGE)
    if not old.exists():  # before the write lock, as for instances
        return 0
    with transaction.atomic():
        pks = list(old.values_list("id", flat=True)[:batch])
        return Span.objects.filter(id__in=pks).delete()[0]


def delete_rows(pks: Sequence[int]) -> None:
    """Delete instances with their steps, events, history, spans and errors (inside the
    caller's transaction). Spans stored before their instance was known are found by the
    instance's trace id."""
    traces = list(
        Instance.objects.filter(id__in=pks).exclude(trace_id="").values_list("trace_id", flat=True)
    )
    if traces:
        Span.objects.filter(instance__isnull=True, trace_id__in=traces).delete()
    Instance.objects.filter(id__in=pks).delete()  # cascades to steps, events, history, spans


@retry_while_locked
def delete_instances(name: str, instance_ids: Sequence[str]) -> list[int]:
    """Delete finished instances of a workflow, all or none; returns their primary keys.

    A live instance is refused (InvalidTransition: terminate it first, as Cloudflare
    Workflows deletes only finished ones): its worker would be writing to rows that vanish.
    Rows are locked first, so a restart cannot revive one while it is being deleted.
    """
    wanted = list(dict.fromkeys(instance_ids))
    with transaction.atomic():
        rows = list(
            lock_rows(Instance.objects.filter(workflow=name, instance_id__in=wanted)).values_list(
                "id", "instance_id", "status"
            )
        )
        missing = sorted(set(wanted) - {instance_id for _, instance_id, _ in rows})
        if missing:
            raise InstanceNotFound(f"workflow {name!r} has no instance {missing[0]!r}")
        live = sorted(
            (instance_id, status)
            for _, instance_id, status in rows
            if status not in lifecycle.FINISHED
        )
        if live:
            instance_id, status = live[0]
            raise InvalidTransition(
                f"cannot delete instance {instance_id!r}: it is {status}; only finished "
                "(complete, errored, terminated) instances can be deleted: terminate it first"
            )
        pks = [pk for pk, _, _ in rows]
        _refuse_awaited(pks)
        delete_rows(pks)
    return pks


def _refuse_awaited(pks: Sequence[int]) -> None:
    """A finished child whose parent's step.invoke has not taken its output yet (the parent
    paused, parked, or not run since) cannot be deleted: the parent would fail for want of
    it (ChildWorkflowFailed, InstanceNotFound). Retention keeps it the same way (prune)."""
    awaited = (
        Instance.objects.filter(id__in=list(pks))
        .filter(Exists(_awaited_by_parent()))
        .order_by("instance_id")
        .values_list("instance_id", "parent__workflow", "parent__instance_id", "parent_step")
        .first()
    )
    if awaited is not None:
        instance_id, workflow, parent_id, step = awaited
        raise InvalidTransition(
            f"cannot delete instance {instance_id!r}: its parent {workflow}/{parent_id} has not "
            f'taken its output yet (step "{step}" waits for it); delete it once the parent has '
            "run on, or terminate the parent first"
        )
