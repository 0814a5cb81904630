"""Bulk jobs: the snapshot of what a filter matched, and claiming and recording batches.

A job's instances are fixed when it is created (their primary keys, as item rows). Workers
take the next batch under the job's row lock (PostgreSQL: skipping a job another worker
holds) and record its progress in the transaction that applied it, deleting the batch's
item rows, so a crash repeats no part of a batch and loses none, and only the work left
is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db import connection, transaction

from ...models import BulkJob, BulkJobItem, Instance
from .. import clock
from .catalog import PRUNE_ROWS
from .dialect import lock_rows, retry_while_locked, skip_rows_being_claimed

ITEM_TABLE = BulkJobItem._meta.db_table
MAX_ERRORS_KEPT = 20  # messages of failed instances kept on the job (the count is exact)


@retry_while_locked
def create_job(
    workflow: str,
    action: str,
    instances: Any,
    filter_shown: dict[str, Any],
    options: dict[str, Any],
    actor: str = "",
) -> BulkJob:
    """Snapshot the instances a queryset matches now into a new job: one INSERT … SELECT,
    so the ids never travel through Python however many match."""
    now = clock.now()
    with transaction.atomic():
        job = BulkJob.objects.create(
            workflow=workflow,
            action=action,
            filter=filter_shown,
            options=options,
            actor=actor,
            created_at=now,
            updated_at=now,
        )
        sql, params = instances.order_by().values_list("id").query.sql_with_params()
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {ITEM_TABLE} (job_id, instance_pk) SELECT %s, matched.id "
                f"FROM ({sql}) matched",
                [job.pk, *params],
            )
            job.matched = cursor.rowcount
        job.finished_at = now if not job.matched else None
        job.save(update_fields=["matched", "finished_at"])
        return job


def lock_next_batch(size: int, job_pk: int | None = None) -> tuple[BulkJob, list[int]] | None:
    """Inside the caller's transaction: the oldest unfinished job (or that one) that no
    other worker holds, locked, with the instance pks of its next batch; None if none."""
    jobs = BulkJob.objects.filter(finished_at__isnull=True)
    if job_pk is not None:
        jobs = jobs.filter(pk=job_pk)
    job = skip_rows_being_claimed(jobs.order_by("id")).first()
    if job is None:
        return None
    pks = list(
        BulkJobItem.objects.filter(job=job, instance_pk__gt=job.last_pk)
        .order_by("instance_pk")
        .values_list("instance_pk", flat=True)[:size]
    )
    return job, pks


def batch_rows(pks: Sequence[int], locked: bool = False) -> dict[int, Instance]:
    """The batch's instances still there (deleted ones are skipped), one query; `locked`:
    their rows locked (in id order) until the batch commits, so the status read holds."""
    rows = Instance.objects.filter(pk__in=list(pks)).only(  # version: the handle's limits
        "id", "workflow", "instance_id", "version", "status", "history_seq", "step_seq"
    )
    if locked:
        rows = lock_rows(rows.order_by("id"))
    return {row.pk: row for row in rows}


def within_delete_bound(pks: Sequence[int], rows: dict[int, Instance]) -> list[int]:
    """The first pks whose instances' history records and steps (their counters) stay
    within PRUNE_ROWS, at least one: a delete batch's transaction is bounded as a prune's."""
    size = 0
    for n, pk in enumerate(pks):
        row = rows.get(pk)
        size += 0 if row is None else row.history_seq + row.step_seq
        if n and size > PRUNE_ROWS:
            return list(pks[:n])
    return list(pks)


def record_batch(
    job: BulkJob,
    pks: Sequence[int],
    applied: int,
    skipped: int,
    errors: Sequence[str],
    pause_requested: int = 0,
) -> BulkJob:
    """Inside the batch's transaction: add its outcome; finish the job after its last one.

    The batch's item rows go with it: nothing reads them again, and kept they would grow
    the table by every instance of every job for ever (a rollback keeps them, as the rest).
    """
    now = clock.now()
    if pks:
        job.last_pk = pks[-1]
        BulkJobItem.objects.filter(job=job, instance_pk__in=list(pks)).delete()
    job.processed += len(pks)
    job.applied += applied
    job.skipped += skipped
    job.failed += len(errors)
    job.pause_requested += pause_requested
    job.errors = [*job.errors, *errors][:MAX_ERRORS_KEPT]
    job.updated_at = now
    if not pks or job.processed >= job.matched:
        job.finished_at = now
    job.save(
        update_fields=[
            "processed",
            "last_pk",
            "applied",
            "pause_requested",
            "skipped",
            "failed",
            "errors",
            "updated_at",
            "finished_at",
        ]
    )
    return job


def get_job(pk: int, workflow: str | None = None) -> BulkJob | None:
    jobs = BulkJob.objects.all()
    if workflow is not None:
        jobs = jobs.filter(workflow=workflow)
    return jobs.filter(pk=pk).first()
