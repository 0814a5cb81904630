"""The index of an instance's children in the order they were started (parent, id),
partial on children.

The instance pages show the newest children and GET …/children pages through them all in
id order (?cursor= is a child's id). The only index starting with the parent was
(parent, parent_step), which gives them in no useful order: PostgreSQL walked the primary
key instead, over every instance, and kept the children. Built concurrently on
PostgreSQL, outside a transaction (docs/operating.md, "Upgrading").
"""

from django.db import migrations, models

from workflows_app.migration_operations import AddIndexConcurrently


class Migration(migrations.Migration):
    atomic = False  # PostgreSQL builds an index concurrently only outside a transaction

    dependencies = [
        ("workflows_app", "0023_step_seq_index"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="instance",
            index=models.Index(
                condition=models.Q(("parent__isnull", False)),
                fields=["parent", "id"],
                name="instance_children",
            ),
        ),
    ]
