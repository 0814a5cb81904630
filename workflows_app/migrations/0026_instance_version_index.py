"""The index of instances by version (version, workflow, id).

The dashboard's and the admin's lists filter by version, of one workflow or across them,
and GET …/instances?version= of one workflow, newest first (ORDER BY id DESC). Without it
PostgreSQL walked the primary key back from the newest instance and kept those of the
version: a version no recent instance runs (an old one, or one being tried on a few)
meant reading the whole table for a page (1.07M instances: 972 ms). Built concurrently
on PostgreSQL, outside a transaction (docs/operating.md, "Upgrading").
"""

from django.db import migrations, models

from workflows_app.migration_operations import AddIndexConcurrently


class Migration(migrations.Migration):
    atomic = False  # PostgreSQL builds an index concurrently only outside a transaction

    dependencies = [
        ("workflows_app", "0025_instance_status_index"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="instance",
            index=models.Index(fields=["version", "workflow", "id"], name="instance_version"),
        ),
    ]
