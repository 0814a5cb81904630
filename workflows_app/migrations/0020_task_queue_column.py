"""Instance.queue: a Django task's queue_name, by which a worker started for some queues
only (runworker --queues) claims. A nullable column with no default: a catalog change,
no rewrite. Its index and the backfill of unfinished tasks are 0021, outside a
transaction (docs/operating.md, "Upgrading")."""

from django.db import migrations, models


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
    ]
