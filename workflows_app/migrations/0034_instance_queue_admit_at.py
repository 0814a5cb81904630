"""The index of the queued instances' admit_at by workflow: (workflow, admit_at) WHERE
status = 'queued' AND admit_at IS NOT NULL.

A worker reads the first admit_at of its workflows' queues in every claim after a create's
hint (first_admit). Along instance_admit_at that read walked, in admit_at order, every
queued instance of other workflows due before the first of its own: 100,000 pending
debounces of one workflow cost every claim of a worker that does not run it 20-22 ms of
the server's time (0.02 ms without them). Through this index it is one probe a workflow
(0.03-0.05 ms). instance_admit_at stays: the previous release's admissions read the ended
debounces along it (their statement keeps the other indexes out), so without it they
would scan the table until the rollout ends. Built concurrently on PostgreSQL, outside a
transaction (docs/operating.md, "Upgrading").
"""

from django.db import migrations, models

from workflows_app.migration_operations import AddIndexConcurrently


class Migration(migrations.Migration):
    atomic = False  # PostgreSQL builds an index concurrently only outside a transaction

    dependencies = [
        ("workflows_app", "0033_schedule_started_above_pk"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="instance",
            index=models.Index(
                condition=models.Q(("admit_at__isnull", False), ("status", "queued")),
                fields=["workflow", "admit_at"],
                name="instance_queue_admit_at",
            ),
        ),
    ]
