"""Drop the single-column index Django gave six foreign keys: each is the first column
of a unique constraint or an index of its table already, which serves every look-up by
it, and every row written paid for one more index (a step's checkpoint wrote two, a span
one). The indexes are dropped by name, not by altering the fields: SQLite would copy each
whole table (history, steps, spans) to drop an index."""

import django.db.models.deletion
from django.db import migrations, models

# (model, foreign key, the model it points to, the field's other options): the index
# Django made for each is named the same on SQLite and PostgreSQL.
COVERED = [
    ("bulkjobitem", "job", "bulkjob", {"related_name": "items"}, "866f2ba8"),
    ("historyrecord", "instance", "instance", {"related_name": "history"}, "a57f3eb8"),
    ("historysubscriber", "instance", "instance", {"related_name": "+"}, "40f89799"),
    ("instanceattribute", "instance", "instance", {"related_name": "attribute_rows"}, "a696ec6f"),
    (
        "span",
        "instance",
        "instance",
        {"related_name": "spans", "null": True, "blank": True},
        "22347d3d",
    ),
    ("steprecord", "instance", "instance", {"related_name": "steps"}, "e739e859"),
]


def index_sql(model: str, field: str, suffix: str) -> tuple[str, str]:
    """(drop, re-create) of the index Django named <table>_<column>_<suffix>."""
    table, column = f"workflows_app_{model}", f"{field}_id"
    index = f"{table}_{column}_{suffix}"
    return f'DROP INDEX IF EXISTS "{index}"', f'CREATE INDEX "{index}" ON "{table}" ("{column}")'


class Migration(migrations.Migration):
    dependencies = [
        ("workflows_app", "0011_attribute_rows"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(*index_sql(model, field, suffix))
                for model, field, _, _, suffix in COVERED
            ],
            state_operations=[
                migrations.AlterField(
                    model_name=model,
                    name=field,
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        to=f"workflows_app.{target}",
                        **options,
                    ),
                )
                for model, field, target, options, _ in COVERED
            ],
        ),
    ]
