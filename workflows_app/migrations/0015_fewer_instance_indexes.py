"""Drop two indexes of the instance table that no query needs any more.

- `instance_trace` (trace_id): only span storage looked instances up by trace id; spans
  now come with their instance's key (the trace id generator knows it).
- the index Django gave the `parent` foreign key: `instance_child_per_step` (parent,
  parent_step), partial on parent IS NOT NULL, serves every look-up by parent (children
  of an instance, and the foreign key's own check when a parent is deleted).

Every insert of an instance and every update of one that moves it in an index (a claim,
an end, a park) wrote an entry into each: on PostgreSQL about 2.6 µs of the server's time
an index an update, and its WAL. The parent's index is dropped by name, not by altering
the field: SQLite would copy the whole table to drop an index.
"""

import django.db.models.deletion
from django.db import migrations, models

TABLE = "workflows_app_instance"
PARENT_INDEX = "workflows_app_instance_parent_id_3065cd5d"


class Migration(migrations.Migration):
    dependencies = [
        ("workflows_app", "0014_no_span_trace_index"),
    ]

    operations = [
        migrations.RemoveIndex(model_name="instance", name="instance_trace"),
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    f'DROP INDEX IF EXISTS "{PARENT_INDEX}"',
                    f'CREATE INDEX "{PARENT_INDEX}" ON "{TABLE}" ("parent_id")',
                )
            ],
            state_operations=[
                migrations.AlterField(
                    model_name="instance",
                    name="parent",
                    field=models.ForeignKey(
                        blank=True,
                        db_index=False,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="children",
                        to="workflows_app.instance",
                    ),
                ),
            ],
        ),
    ]
