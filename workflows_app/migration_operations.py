"""Migration operations that keep the big tables (instances, steps, history, spans) open
for writes while a migration runs on a live PostgreSQL database (docs/operating.md,
"Upgrading").

Migrations import this module: what it defines must keep its name and behaviour.
"""

from __future__ import annotations

from typing import Any

from django.db import NotSupportedError, migrations


class AddIndexConcurrently(migrations.AddIndex):
    """AddIndex that builds the index with CREATE INDEX CONCURRENTLY on PostgreSQL: writes
    to the table go on during the build (a plain CREATE INDEX blocks every insert, update
    and delete of the table until it ends, and queues them behind any transaction open on
    the table when it starts). Other databases build it as AddIndex does.

    PostgreSQL cannot build concurrently inside a transaction: the migration using it must
    say `atomic = False`, and should hold nothing else (a failed concurrent build leaves an
    INVALID index of that name; `DROP INDEX CONCURRENTLY <name>` and migrate again).
    The migration state is AddIndex's, so the models and makemigrations see no difference.
    """

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        if schema_editor.connection.vendor != "postgresql":
            super().database_forwards(app_label, schema_editor, from_state, to_state)
            return
        model = to_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            self._outside_transaction(schema_editor)
            schema_editor.add_index(model, self.index, concurrently=True)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        if schema_editor.connection.vendor != "postgresql":
            super().database_backwards(app_label, schema_editor, from_state, to_state)
            return
        model = from_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            self._outside_transaction(schema_editor)
            schema_editor.remove_index(model, self.index, concurrently=True)

    def _outside_transaction(self, schema_editor: Any) -> None:
        if schema_editor.connection.in_atomic_block:
            raise NotSupportedError(
                f"{type(self).__name__} of index {self.index.name!r} cannot run inside a "
                "transaction: set `atomic = False` on its migration"
            )

    def describe(self) -> str:
        return f"{super().describe()} (concurrently on PostgreSQL)"
