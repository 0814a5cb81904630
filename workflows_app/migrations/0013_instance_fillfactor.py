"""PostgreSQL: leave a quarter of each new page of the instance table free.

Every checkpoint updates its instance's row (history_seq, updated_at, step_seq), columns
no index holds: PostgreSQL can then write the new version beside the old one without
touching the table's twenty indexes (a HOT update), but only if the page has room. With
every page filled, two updates of the instance table in three wrote an entry into each
index in the per-step bench; with the room, one in four (the claim's and the end's change
indexed columns). Pages written before this migration keep their fill until the table
is rewritten (VACUUM FULL).
SQLite has no fill factor: nothing to do there.
"""

from django.db import migrations

TABLE = "workflows_app_instance"
FILLFACTOR = 75


def set_fillfactor(apps, schema_editor, value=FILLFACTOR):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"ALTER TABLE {TABLE} SET (fillfactor = {int(value)})")


def reset_fillfactor(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"ALTER TABLE {TABLE} RESET (fillfactor)")


class Migration(migrations.Migration):
    dependencies = [
        ("workflows_app", "0012_fk_indexes_covered"),
    ]

    operations = [migrations.RunPython(set_fillfactor, reset_fillfactor)]
