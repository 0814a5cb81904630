"""Applying a bulk job's action to its instances, a batch at a time, in the worker loop.

Each instance goes through the same client call an operator's click makes (the same
checks, history records, live updates and worker hints). An action that does not apply
to an instance's status (already paused, already finished, live for delete) or an
instance deleted meanwhile counts as skipped: repeating a job, or a batch after a
crash, never fails for what is already done.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from django.db import DatabaseError, transaction

from . import live
from .client import InstanceHandle, count_ended_on_commit
from .codec import payload_codec
from .engine import errors, lifecycle, store
from .models import BulkAction, BulkJob, Status

log = logging.getLogger("workflows_app.bulk")

BATCH_SIZE = 100  # instances per transaction: a crash repeats none, a batch holds locks briefly

# What an action did to one instance, in the words of the dashboard's messages ("Paused 2
# instances, pause requested for 1 instance.", in this order) and of a bulk job's progress.
PAUSED, PAUSE_REQUESTED, RESUMED, TERMINATED = (
    "paused",
    "pause requested for",
    "resumed",
    "terminated",
)
BULK_OUTCOMES = (PAUSED, PAUSE_REQUESTED, RESUMED, TERMINATED)

# True: applied; False: skipped; PAUSE_REQUESTED: only asked (counted apart from applied).
Apply = Callable[[InstanceHandle, dict[str, Any], str], bool | str]


def pause_one(h: InstanceHandle, actor: str) -> str:
    """An instance whose run is in a step is only asked to pause (at the step's end)."""
    return PAUSE_REQUESTED if h.pause(actor=actor) == Status.WAITING_FOR_PAUSE else PAUSED


def _pause(h: InstanceHandle, options: dict[str, Any], actor: str) -> bool | str:
    outcome = pause_one(h, actor)
    return PAUSE_REQUESTED if outcome == PAUSE_REQUESTED else True


def _resume(h: InstanceHandle, options: dict[str, Any], actor: str) -> bool:
    h.resume(actor=actor)
    return True


def _cancel(h: InstanceHandle, options: dict[str, Any], actor: str) -> bool:
    # Skipped when its compensations run already: a child its parent's cancel (in this
    # job or before) is compensating, or one cancelled before.
    return h.cancel_changed(compensate=options.get("compensate", True), actor=actor).changed


def _restart(h: InstanceHandle, options: dict[str, Any], actor: str) -> bool:
    h.restart(from_step=options.get("from_step"), actor=actor, version=options.get("to_version"))
    return True


def _delete(h: InstanceHandle, options: dict[str, Any], actor: str) -> bool:
    h.delete(actor=actor)
    return True


def _send_event(h: InstanceHandle, options: dict[str, Any], actor: str) -> bool:
    payload = BulkJob(options=options).event_payload
    h.send_event(options["event_type"], payload, actor=actor)
    return True


# Terminate has its own path in process_batch (a batch in a few statements).
ACTIONS: dict[str, Apply] = {
    BulkAction.PAUSE: _pause,
    BulkAction.RESUME: _resume,
    BulkAction.CANCEL: _cancel,
    BulkAction.RESTART: _restart,
    BulkAction.DELETE: _delete,
    BulkAction.SEND_EVENT: _send_event,
}
DOES_NOT_APPLY = (errors.InvalidTransition, errors.InstanceNotFound)
# Actions an instance's status does not guard against a repeat: restart applies to every
# status (a second job of the same request would restart each instance again, mid-run),
# delete to every finished one (an errored instance restarted and completed since is no
# longer the one chosen). When their job's filter names a finished status, they skip an
# instance no longer in it: only a restart takes an instance out of a finished status.
# A live status is not checked: running and waiting alternate as an instance runs.
STATUS_CHECKED = frozenset({BulkAction.RESTART, BulkAction.DELETE})


def process_batch(job_pk: int | None = None, size: int = BATCH_SIZE) -> BulkJob | None:
    """Apply the next batch of the oldest unfinished job (or of that job), in one
    transaction with its progress; returns the job, or None when there is nothing to do."""
    with transaction.atomic():
        claimed = store.bulk.lock_next_batch(size, job_pk)
        if claimed is None:
            return None
        job, pks = claimed
        transaction.on_commit(functools.partial(live.bulk_job_progressed, job.pk))
        actor = job.actor or f"bulk#{job.pk}"
        if job.action == BulkAction.TERMINATE:
            # The common case at scale: a few statements per batch instead of a few per
            # instance; each terminated instance is announced as terminate() would: every
            # worker told at commit (PostgreSQL NOTIFY: a fleet without Redis hears it
            # only so), and through the channel layer only where they do not LISTEN.
            terminated = store.terminate_batch(pks, actor)
            store.hint_workers("terminate", [row.pk for row in terminated])
            notified = store.workers_listen()
            for row in terminated:
                count_ended_on_commit(row.workflow, Status.TERMINATED)
                transaction.on_commit(
                    functools.partial(
                        live.instance_changed, "terminate", row.pk, row.workflow, notified
                    )
                )
            return store.bulk.record_batch(
                job, pks, len(terminated), len(pks) - len(terminated), []
            )
        wanted = job.filter.get("status") if job.action in STATUS_CHECKED else None
        if wanted not in lifecycle.FINISHED:
            wanted = None
        rows = store.bulk.batch_rows(pks, locked=wanted is not None)
        if job.action == BulkAction.DELETE:  # the rest of the batch is the next one
            pks = store.bulk.within_delete_bound(pks, rows)
        apply = ACTIONS[job.action]
        applied = skipped = pause_requested = 0
        failures: list[str] = []
        for pk in pks:
            row = rows.get(pk)
            if row is None or (wanted is not None and row.status != wanted):
                skipped += 1  # deleted, or (restart, delete) restarted since the start
                continue
            handle = InstanceHandle(row.workflow, row.instance_id, row)
            try:
                outcome = apply(handle, job.options, actor)
                if outcome == PAUSE_REQUESTED:
                    pause_requested += 1  # not paused yet: "applied" would say it was
                elif outcome:
                    applied += 1
                else:
                    skipped += 1
            except DOES_NOT_APPLY:
                skipped += 1
            except DatabaseError:
                raise  # the whole batch rolls back and is taken again
            except Exception as exc:
                if not isinstance(exc, errors.WorkflowError):
                    log.exception("bulk job #%s: %s/%s", job.pk, row.workflow, row.instance_id)
                failures.append(f"{row.workflow}/{row.instance_id}: {failure_text(exc)}")
        return store.bulk.record_batch(job, pks, applied, skipped, failures, pause_requested)


def failure_text(exc: Exception) -> str:
    """What a job's errors (stored in clear) say of a failure: a schema's violations quote
    the payload's values, which a payload codec keeps sealed, so then only that it failed."""
    if isinstance(exc, errors.EventPayloadInvalid) and payload_codec() is not None:
        return (
            "the payload does not match the schema of the step waiting for it "
            "(the violations quote its values, sealed by the payload codec)"
        )
    return str(exc)


def process_pending() -> bool:
    """The worker loop's background step: one batch of any job; True if one was done.

    A database error (a deadlock with a run, a dropped connection) rolls the batch back
    whole; the next call takes it again.
    """
    try:
        return process_batch() is not None
    except DatabaseError:
        log.warning("bulk job batch failed; it will be taken again", exc_info=True)
        return False
