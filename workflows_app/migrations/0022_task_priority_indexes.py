"""The indexes by which a worker that runs Django tasks claims the first due task of each
priority: of every queue (instance_task_priority) and of some queues (--queues,
instance_queue_priority). Partial, of tasks only: other instances neither fill them nor
pay for their upkeep. Built concurrently on PostgreSQL, outside a transaction
(docs/operating.md, "Upgrading"); a worker of the previous release claims as before."""

from django.db import migrations, models

from workflows_app.migration_operations import AddIndexConcurrently


class Migration(migrations.Migration):
    atomic = False  # PostgreSQL builds an index concurrently only outside a transaction

    dependencies = [
        ("workflows_app", "0021_task_queue_index"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="instance",
            index=models.Index(
                condition=models.Q(("queue__isnull", False), ("wake_at__isnull", False)),
                fields=["priority", "wake_at"],
                name="instance_task_priority",
            ),
        ),
        AddIndexConcurrently(
            model_name="instance",
            index=models.Index(
                condition=models.Q(("queue__isnull", False), ("wake_at__isnull", False)),
                fields=["queue", "priority", "wake_at"],
                name="instance_queue_priority",
            ),
        ),
    ]
