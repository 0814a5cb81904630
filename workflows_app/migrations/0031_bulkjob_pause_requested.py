"""A bulk job's count of the instances a pause only asked to pause (in a step: they pause
at its end), apart from `applied`, which counted them as paused. Default 0; the bulk job
table is small (one row a job)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("workflows_app", "0030_instance_lease_expiry_index"),
    ]

    operations = [
        migrations.AddField(
            model_name="bulkjob",
            name="pause_requested",
            field=models.PositiveIntegerField(default=0),
        ),
    ]
