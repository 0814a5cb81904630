"""Drop the single-column index Django gave six foreign keys: each is the first column
of a unique constraint or an index of its table already, which serves every look-up by
it, and every row written paid for one more index (a step's checkpoint wrote two, a span
one). The indexes are dropped by name, not by altering the fields: SQLite would copy each
whole table (history, steps, spans) to drop an index."""

import django.db.models.deletion
from django.db import migrations, models

# (table, column, the index Django made for the foreign key: the same name on SQLite and
# PostgreSQL)
COVERED = [
    ("workflows_app_bulkjobitem", "job_id", "workflows_app_bulkjobitem_job_id_866f2ba8"),
    (
        "workflows_app_historyrecord",
        "instance_id",
        "workflows_app_historyrecord_instance_id_a57f3eb8",
    ),
    (
        "workflows_app_historysubscriber",
        "instance_id",
        "workflows_app_historysubscriber_instance_id_40f89799",
    ),
    (
        "workflows_app_instanceattribute",
        "instance_id",
        "workflows_app_instanceattribute_instance_id_a696ec6f",
    ),
    ("workflows_app_span", "instance_id", "workflows_app_span_instance_id_22347d3d"),
    ("workflows_app_steprecord", "instance_id", "workflows_app_steprecord_instance_id_e739e859"),
]


class Migration(migrations.Migration):
    dependencies = [
        ("workflows_app", "0011_attribute_rows"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    f'DROP INDEX IF EXISTS "{index}"',
                    reverse_sql=f'CREATE INDEX "{index}" ON "{table}" ("{column}")',
                )
                for table, column, index in COVERED
            ],
            state_operations=[
                migrations.AlterField(
                    model_name="bulkjobitem",
                    name="job",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="items",
                        to="workflows_app.bulkjob",
                    ),
                ),
                migrations.AlterField(
                    model_name="historyrecord",
                    name="instance",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="history",
                        to="workflows_app.instance",
                    ),
                ),
                migrations.AlterField(
                    model_name="historysubscriber",
                    name="instance",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="+",
                        to="workflows_app.instance",
                    ),
                ),
                migrations.AlterField(
                    model_name="instanceattribute",
                    name="instance",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="attribute_rows",
                        to="workflows_app.instance",
                    ),
                ),
                migrations.AlterField(
                    model_name="span",
                    name="instance",
                    field=models.ForeignKey(
                        blank=True,
                        db_index=False,
                        null=True,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="spans",
                        to="workflows_app.instance",
                    ),
                ),
                migrations.AlterField(
                    model_name="steprecord",
                    name="instance",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="steps",
                        to="workflows_app.instance",
                    ),
                ),
            ],
        ),
    ]
