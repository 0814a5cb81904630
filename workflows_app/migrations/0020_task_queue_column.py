"""Instance.queue: a Django task's queue_name, by which a worker started for some queues
only (runworker --queues) claims. Unfinished task instances made before it get their
queue from their params (those whose params the payload codec cannot open here keep
none: a worker of every queue runs them)."""

from django.db import migrations, models

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
    dependencies = [
        ("workflows_app", "0019_live_instances_index"),
    ]

    operations = [
        migrations.AddField(
            model_name="instance",
            name="queue",
            field=models.CharField(blank=True, max_length=100, null=True),
        ),
        migrations.AddIndex(
            model_name="instance",
            index=models.Index(
                condition=models.Q(("queue__isnull", False), ("wake_at__isnull", False)),
                fields=["queue", "wake_at"],
                name="instance_queue_runnable",
            ),
        ),
        migrations.RunPython(backfill_task_queues, migrations.RunPython.noop),
    ]
