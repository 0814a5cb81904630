"""The migrations: they match the models; 0012 drops only indexes others cover; 0013
leaves room in the instance table's pages (PostgreSQL)."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from workflows_app.models import HistoryRecord, Span, StepRecord

pytestmark = pytest.mark.django_db(transaction=True)


def migrate(target=None):
    """To target (None: every app's latest migration, as the test database was made)."""
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(target or executor.loader.graph.leaf_nodes())


def indexed_columns(model) -> list[tuple[str, ...]]:
    """The columns of each index (and unique constraint) of a model's table, in order."""
    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, model._meta.db_table)
    return [tuple(c["columns"]) for c in found.values() if c["index"] or c["unique"]]


def test_the_models_and_the_migrations_agree():
    call_command("makemigrations", "workflows_app", check=True, dry_run=True, verbosity=0)


def test_0012_leaves_an_index_that_starts_with_each_dropped_foreign_key_and_reverses():
    for model in (StepRecord, HistoryRecord, Span):
        columns = indexed_columns(model)
        assert ("instance_id",) not in columns, model
        assert any(c[0] == "instance_id" and len(c) > 1 for c in columns), model
    migrate([("workflows_app", "0011_attribute_rows")])
    try:
        assert ("instance_id",) in indexed_columns(StepRecord)
    finally:
        migrate()
    assert ("instance_id",) not in indexed_columns(StepRecord)


def test_0013_leaves_room_in_the_instance_pages_for_updates_beside_the_row_on_postgresql():
    """A checkpoint's update of its instance row touches no indexed column: with room in
    the page PostgreSQL writes it beside the old version without an entry per index."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: SQLite has no fill factor")
    with connection.cursor() as cursor:
        cursor.execute("SELECT reloptions FROM pg_class WHERE relname = 'workflows_app_instance'")
        assert cursor.fetchone()[0] == ["fillfactor=75"]
    migrate([("workflows_app", "0012_fk_indexes_covered")])
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT reloptions FROM pg_class WHERE relname = 'workflows_app_instance'"
            )
            assert cursor.fetchone()[0] is None
    finally:
        migrate()
