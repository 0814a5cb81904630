import json

import django.db.models.deletion
from django.db import migrations, models

INT64 = 2**63
BATCH = 2000  # instances per read and insert


def index_text(value):
    """engine.attributes.index_text as of this migration (frozen here on purpose)."""
    if isinstance(value, float) and value.is_integer() and -INT64 <= value < INT64:
        value = int(value)
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def backfill_attribute_rows(apps, schema_editor):
    """A row per attribute of every existing instance, from Instance.attributes."""
    instance = apps.get_model("workflows_app", "Instance")
    attribute = apps.get_model("workflows_app", "InstanceAttribute")
    db = schema_editor.connection.alias
    last = 0
    while True:
        batch = list(
            instance.objects.using(db)
            .filter(id__gt=last)
            .order_by("id")
            .values_list("id", "attributes")[:BATCH]
        )
        if not batch:
            break
        attribute.objects.using(db).bulk_create(
            attribute(instance_id=pk, key=key, value=index_text(value))
            for pk, attributes in batch
            if isinstance(attributes, dict)
            for key, value in attributes.items()
        )
        last = batch[-1][0]
    if schema_editor.connection.vendor == "postgresql":
        # Statistics now, not at autovacuum's next pass: with a filter of several keys the
        # planner walks the rarest key's rows only if it knows which values are common.
        schema_editor.execute(f"ANALYZE {attribute._meta.db_table}")


# Indexes of 0009 the filter no longer reads (it looks up the rows above on both databases:
# as fast or faster than the GIN containment on PostgreSQL, 10x faster on SQLite for a rare
# value; docs/performance.md); dropped so writes stop maintaining them.
OLD_INDEXES = {
    "postgresql": (
        "instance_attributes_gin",
        "USING gin (attributes jsonb_path_ops)",
    ),
    "sqlite": ("instance_wf_attributes", "(workflow, id, attributes)"),
}


def drop_json_indexes(apps, schema_editor):
    old = OLD_INDEXES.get(schema_editor.connection.vendor)
    if old:
        schema_editor.execute(f"DROP INDEX IF EXISTS {old[0]}")


def recreate_json_indexes(apps, schema_editor):
    old = OLD_INDEXES.get(schema_editor.connection.vendor)
    if old:
        table = apps.get_model("workflows_app", "Instance")._meta.db_table
        schema_editor.execute(f"CREATE INDEX IF NOT EXISTS {old[0]} ON {table} {old[1]}")


class Migration(migrations.Migration):
    dependencies = [
        ("workflows_app", "0010_history_subscribers_and_step_completion_index"),
    ]

    operations = [
        migrations.CreateModel(
            name="InstanceAttribute",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("key", models.CharField(max_length=64)),
                ("value", models.TextField()),
                (
                    "instance",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="attribute_rows",
                        to="workflows_app.instance",
                    ),
                ),
            ],
            options={
                "indexes": [
                    models.Index(
                        fields=["key", "value", "instance"], name="instance_attribute_lookup"
                    )
                ],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("instance", "key"), name="instance_attribute_key"
                    )
                ],
            },
        ),
        migrations.RunPython(backfill_attribute_rows, migrations.RunPython.noop),
        migrations.RunPython(drop_json_indexes, recreate_json_indexes),
    ]
