"""The index a worker of some task queues claims by, built concurrently on PostgreSQL, and
the queue of the unfinished task instances made before 0020, taken from their params
(those whose params the payload codec cannot open here keep none: a worker of every
queue runs them). Outside a transaction: the index build and each batch of the backfill
hold the instance table's writes for no longer than they take."""

from django.db import migrations, models

from workflows_app.migration_operations import AddIndexConcurrently

BATCH = 500


def backfill_task_queues(apps, schema_editor):
    from workflows_app.models import decode_stored

    Instance = apps.get_model("workflows_app", "Instance")
    unfinished = Instance.objects.filter(
        workflow__startswith="task:", finished_at__isnull=True, queue__isnull=True
    )
    by_queue: dict[str, list[int]] = {}
    for pk, params_json in unfinished.values_list("id", "params_json").iterator():
        try:
            params = decode_stored(params_json)
        except Exception:  # sealed with a key not configured here
            continue
        queue = params.get("queue_name") if isinstance(params, dict) else None
        if isinstance(queue, str) and 0 < len(queue) <= 100:
            by_queue.setdefault(queue, []).append(pk)
    for queue, pks in by_queue.items():
        for start in range(0, len(pks), BATCH):
            Instance.objects.filter(id__in=pks[start : start + BATCH]).update(queue=queue)


class Migration(migrations.Migration):
    atomic = False  # PostgreSQL builds an index concurrently only outside a transaction

    dependencies = [
        ("workflows_app", "0020_task_queue_column"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="instance",
            index=models.Index(
                condition=models.Q(("queue__isnull", False), ("wake_at__isnull", False)),
                fields=["queue", "wake_at"],
                name="instance_queue_runnable",
            ),
        ),
        migrations.RunPython(backfill_task_queues, migrations.RunPython.noop),
    ]
