"""The index of admission's line without the pending debounces (workflow, priority, id)
WHERE status = 'queued' AND (admit_at IS NULL OR waiting_reason NOT LIKE 'debounced until %').

An instance whose debounce has not ended starts at its admit_at whatever comes before it,
so admission's first page and promote_stranded_queues leave those out; with the queue
index alone they read every one to find the page after them (100,000 pending debounces:
100,000 rows, 134 ms a create or a run's end of a flow-controlled workflow, and 36 ms every
5 s for promote_stranded_queues). Built concurrently on PostgreSQL, outside a transaction
(docs/operating.md, "Upgrading").
"""

from django.db import migrations, models

from workflows_app.migration_operations import AddIndexConcurrently


class Migration(migrations.Migration):
    atomic = False  # PostgreSQL builds an index concurrently only outside a transaction

    dependencies = [
        ("workflows_app", "0026_instance_version_index"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="instance",
            index=models.Index(
                condition=models.Q(
                    ("status", "queued"),
                    models.Q(
                        ("admit_at__isnull", True),
                        models.Q(("waiting_reason__startswith", "debounced until "), _negated=True),
                        _connector="OR",
                    ),
                ),
                fields=["workflow", "priority", "id"],
                name="instance_in_line",
            ),
        ),
    ]
