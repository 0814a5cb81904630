"""The index of an instance's steps in start order (instance, seq).

Every read of an instance's steps orders them by seq: the newest N on the instance pages and
in GET …/instances/<id>, and the pages of GET …/steps (?cursor= is a seq). Without it each of
those read all of the instance's steps and sorted them (a long-running instance has tens of
thousands); with it they read the N rows asked for. Built concurrently on PostgreSQL,
outside a transaction (docs/operating.md, "Upgrading").
"""

from django.db import migrations, models

from workflows_app.migration_operations import AddIndexConcurrently


class Migration(migrations.Migration):
    atomic = False  # PostgreSQL builds an index concurrently only outside a transaction

    dependencies = [
        ("workflows_app", "0022_task_priority_indexes"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="steprecord",
            index=models.Index(fields=["instance", "seq"], name="step_seq"),
        ),
    ]
