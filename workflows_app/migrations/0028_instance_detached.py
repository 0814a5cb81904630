"""Instance.detached: whether a step.start (True) or a step.invoke (False) created a child,
written with the child's row. A parent's end spares its step.start children by it, whichever
run created them: one cut short before the start's checkpoint left a child only its row
tells apart. A nullable column with no default: a catalog change, no rewrite, no index.

No backfill: a child made before (NULL) has nothing but its step's START_CHILD checkpoint
to tell its kind, which end_awaited_children reads for such rows; so do the children the
previous release's workers create until the rollout ends."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("workflows_app", "0027_instance_in_line_index"),
    ]

    operations = [
        migrations.AddField(
            model_name="instance",
            name="detached",
            field=models.BooleanField(blank=True, null=True),
        ),
    ]
