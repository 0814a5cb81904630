"""The index of finished instances by status in id order (status, id), partial on the
finished statuses (an unfinished one has instance_live, by workflow and status).

The dashboard's instance list and the admin's filter by status across workflows, newest
first (ORDER BY id DESC). Without it PostgreSQL walked the primary key back from the
newest instance and kept those of the status: a status no recent instance has (errored
after a quiet spell, terminated, compensating) meant reading the whole table for a page.
Partial: SQLite plans without statistics and took a full (status, id) index for the
live statuses of a metrics scrape and the finished ones of a prune, where it serves
neither; it takes a partial index only for a query that spells its condition's literals.
Built concurrently on PostgreSQL, outside a transaction (docs/operating.md, "Upgrading").
"""

from django.db import migrations, models

from workflows_app.migration_operations import AddIndexConcurrently


class Migration(migrations.Migration):
    atomic = False  # PostgreSQL builds an index concurrently only outside a transaction

    dependencies = [
        ("workflows_app", "0024_instance_children_index"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="instance",
            index=models.Index(
                condition=models.Q(("status__in", ["complete", "errored", "terminated"])),
                fields=["status", "id"],
                name="instance_finished_status",
            ),
        ),
    ]
