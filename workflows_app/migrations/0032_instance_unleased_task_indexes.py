"""The task indexes of the due tasks no worker holds: (queue, wake_at), (priority, wake_at)
and (queue, priority, wake_at), each WHERE queue IS NOT NULL AND wake_at IS NOT NULL AND
lease_token IS NULL, in place of the same three of every due task (0021, 0022).

A running task keeps its wake_at, so those held every task the fleet's workers ran, and
the claim of a worker that runs tasks (the first due of each level of priority, of each
of its queues: a queue worker) read each of them before the first it could take: 2,000
leased tasks, 2,000 rows read a claim. The tasks whose lease ran out are read by
instance_lease_expiry (0030), as the plain claim reads them. A heartbeat's update no
longer writes the leased tasks' entries into these three.

The new ones are built concurrently on PostgreSQL, outside a transaction, before the old
ones are dropped (docs/operating.md, "Upgrading"): a worker of the previous release reads
its tasks by another index until the rollout ends.
"""

from django.db import migrations, models

from workflows_app.migration_operations import AddIndexConcurrently

UNLEASED_TASK = models.Q(
    ("lease_token__isnull", True), ("queue__isnull", False), ("wake_at__isnull", False)
)


class Migration(migrations.Migration):
    atomic = False  # PostgreSQL builds an index concurrently only outside a transaction

    dependencies = [
        ("workflows_app", "0031_bulkjob_pause_requested"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="instance",
            index=models.Index(
                condition=UNLEASED_TASK, fields=["queue", "wake_at"], name="instance_unleased_queue"
            ),
        ),
        AddIndexConcurrently(
            model_name="instance",
            index=models.Index(
                condition=UNLEASED_TASK,
                fields=["priority", "wake_at"],
                name="instance_unleased_task_prio",
            ),
        ),
        AddIndexConcurrently(
            model_name="instance",
            index=models.Index(
                condition=UNLEASED_TASK,
                fields=["queue", "priority", "wake_at"],
                name="instance_unleased_queue_prio",
            ),
        ),
        migrations.RemoveIndex(model_name="instance", name="instance_queue_runnable"),
        migrations.RemoveIndex(model_name="instance", name="instance_task_priority"),
        migrations.RemoveIndex(model_name="instance", name="instance_queue_priority"),
    ]
