"""The index of live instances (workflow, status), partial on the unfinished statuses.

Built with CREATE INDEX CONCURRENTLY on PostgreSQL: a plain build blocks every write to
the instance table while it reads the whole table, and queues them all behind any
transaction open on it when it starts (docs/operating.md, "Upgrading"). The migration
was first released with a plain AddIndex; the state and the index are the same, so an
install that applied it has nothing to do, and one that has not builds it concurrently.
"""

from django.db import migrations, models

from workflows_app.migration_operations import AddIndexConcurrently


class Migration(migrations.Migration):
    atomic = False  # PostgreSQL builds an index concurrently only outside a transaction

    dependencies = [
        ("workflows_app", "0018_merged_create_keys"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="instance",
            index=models.Index(
                condition=models.Q(
                    (
                        "status__in",
                        [
                            "compensating",
                            "paused",
                            "queued",
                            "running",
                            "unknown",
                            "waiting",
                            "waitingForPause",
                        ],
                    )
                ),
                fields=["workflow", "status"],
                name="instance_live",
            ),
        ),
    ]
