"""A runtime schedule's started_above_pk: the greatest instance id when it was created.
The instances it started are those of its name and workflow above it, so a schedule
deleted and made again under its name for its workflow no longer lists the old one's.
Nullable, no default: the schedule table is small, and the schedules made before (and
declared ones) keep NULL, matched by name and workflow as before. No index: the
listing's bound is an index condition of instance_schedule (schedule, id)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("workflows_app", "0032_instance_unleased_task_indexes"),
    ]

    operations = [
        migrations.AddField(
            model_name="schedule",
            name="started_above_pk",
            field=models.BigIntegerField(blank=True, null=True),
        ),
    ]
