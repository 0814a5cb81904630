"""The version catalog and pruning: which versions exist, and removing expired instances."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime

from django.db import IntegrityError, transaction

from ...models import (
    Instance,
    Status,
    WorkflowVersion,
)
from .. import clock
from ..errors import (
    VersionConflict,
)
from .dialect import retry_while_locked


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
            row.source_hash = source_hash
        row.class_path = class_path
        row.last_seen_at = now
        row.save(update_fields=["source_hash", "class_path", "last_seen_at"])


VERSION_MISSING = "version-missing: "


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
            wake_at__isnull=True,
            waiting_reason__startswith=VERSION_MISSING,
        ).update(wake_at=now, waiting_reason="")
    return woken


def prunable(now: datetime | None = None) -> int:
    """How many finished instances are past their retention."""
    return Instance.objects.filter(expires_at__lte=now or clock.now()).count()


def prune(
    now: datetime | None = None, batch: int = 500, on_batch: Callable[[int], None] | None = None
) -> int:
    """Delete finished instances past their retention, with every row that belongs to them.

    One transaction per batch, so a large backlog never holds the database for long;
    on_batch hears how many each batch deleted (a progress bar).
    """
    now = now or clock.now()
    total = 0
    while True:
        with transaction.atomic():
            pks = list(
                Instance.objects.filter(expires_at__lte=now).values_list("id", flat=True)[:batch]
            )
            if not pks:
                return total
            Instance.objects.filter(
                id__in=pks
            ).delete()  # cascades to steps, events, history, spans
        total += len(pks)
        if on_batch is not None:
            on_batch(len(pks))
