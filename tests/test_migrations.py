"""The migrations: they match the models; 0012 drops only indexes others cover; 0013
leaves room in the instance table's pages (PostgreSQL); 0019 builds its index without
blocking writes to the instance table (PostgreSQL)."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from django.core.management import call_command
from django.db import NotSupportedError, connection, connections, models, transaction
from django.db.migrations.executor import MigrationExecutor

from workflows_app.migration_operations import AddIndexConcurrently
from workflows_app.models import HistoryRecord, Instance, Span, StepRecord

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


INSTANCE_ROW = (
    "INSERT INTO workflows_app_instance (workflow, instance_id, version, status, params_json, "
    "error_name, error_message, error_stack, created_by, created_at, updated_at, "
    "waiting_reason, lease_owner, unproductive_claims, run_count, history_seq, step_seq, "
    "compensate_on_cancel, trace_id, parent_span, parent_step, priority, schedule, attributes) "
    "VALUES ('w', %s, 1, 'queued', 'null', '', '', '', '', now(), now(), '', '', 0, 0, 0, 0, "
    "false, '', '', '', 5, '', '{}')"
)


def live_index_exists() -> bool:
    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, Instance._meta.db_table)
    return "instance_live" in found


def test_0019_builds_its_index_while_the_instance_table_takes_writes_on_postgresql():
    """A plain CREATE INDEX waits for the transactions open on the table and every write
    after it queues behind it: one slow transaction when the migration starts stops every
    create, claim and checkpoint of the fleet until the build ends. Built concurrently,
    writes go on (the build alone waits)."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: SQLite locks the whole database for any write anyway")
    migrate([("workflows_app", "0018_merged_create_keys")])
    assert not live_index_exists()
    dsn = connection.get_connection_params()
    dsn = {k: v for k, v in dsn.items() if k in ("host", "port", "user", "dbname", "password")}
    slow = psycopg.connect(**dsn)  # a transaction open on the instance table
    slow.execute(INSTANCE_ROW, ["open-while-migrating"])
    failed: list[BaseException] = []

    def build():
        try:
            migrate([("workflows_app", "0019_live_instances_index")])
        except BaseException as exc:  # reported by the test below
            failed.append(exc)
        finally:
            connections.close_all()

    migration = threading.Thread(target=build)
    migration.start()
    try:
        with psycopg.connect(**dsn, autocommit=True) as probe:
            deadline = time.monotonic() + 30
            while not probe.execute(
                "SELECT 1 FROM pg_stat_activity WHERE query ILIKE 'CREATE INDEX%%instance_live%%' "
                "AND wait_event_type IN ('Lock', 'IPC')"
            ).fetchone():
                assert time.monotonic() < deadline, "the index build never started"
                assert migration.is_alive(), failed
                time.sleep(0.02)
            # The build is waiting for the open transaction: a create goes through meanwhile.
            probe.execute("SET lock_timeout = '2s'")
            probe.execute(INSTANCE_ROW, ["created-during-the-build"])
    finally:
        slow.commit()
        slow.close()
        migration.join(60)
    try:
        assert not failed, failed
        assert live_index_exists()
    finally:
        migrate()  # the latest again: a test run after this one alone found 0019's schema


def test_0019_unapplies_and_applies_again():
    migrate([("workflows_app", "0018_merged_create_keys")])
    try:
        assert not live_index_exists()
    finally:
        migrate()
    assert live_index_exists()


def test_a_concurrent_index_in_a_migration_still_in_a_transaction_is_refused_with_the_fix():
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: elsewhere the index is built as AddIndex builds it")
    operation = AddIndexConcurrently(
        "instance", models.Index(fields=["created_by"], name="instance_test_only")
    )
    state = MigrationExecutor(connection).loader.project_state()
    after = state.clone()
    operation.state_forwards("workflows_app", after)
    refused = pytest.raises(NotSupportedError, match="set `atomic = False` on its migration")
    with transaction.atomic(), connection.schema_editor(atomic=False) as editor, refused:
        operation.database_forwards("workflows_app", editor, state, after)


# Tables with a row per instance, step, event, history record or span: millions of rows
# in production, written by every run.
BIG_TABLES = {
    "instance",
    "instanceattribute",
    "steprecord",
    "inboxevent",
    "historyrecord",
    "span",
    "errorrecord",
    "mergedcreatekey",
}
# The first migration these rules hold for (those before were released as they are).
CHECKED_FROM = 19


def operations_of(operations):
    """The operations, with those SeparateDatabaseAndState runs on the database."""
    from django.db import migrations as m

    for operation in operations:
        if isinstance(operation, m.SeparateDatabaseAndState):
            yield from operations_of(operation.database_operations)
        else:
            yield operation


def live_upgrade_faults(migration) -> list[str]:
    """What in a migration blocks a big table's writes for long on PostgreSQL, or breaks
    the workers of the previous release that run until the rollout ends."""
    from django.db import migrations as m

    faults = []
    for op in operations_of(migration.operations):
        model = getattr(op, "model_name", None) or getattr(op, "name", "")
        if model.lower() not in BIG_TABLES:
            continue
        if isinstance(op, m.AddIndex) and not isinstance(op, AddIndexConcurrently):
            faults.append(f"{op.describe()}: use AddIndexConcurrently (atomic = False)")
        elif isinstance(op, m.AddConstraint):
            faults.append(
                f"{op.describe()}: build its index concurrently first (RunSQL CREATE UNIQUE "
                "INDEX CONCURRENTLY in a non-atomic migration, then attach it)"
            )
        elif isinstance(op, m.AddField) and not (
            op.field.null or op.field.db_default is not models.NOT_PROVIDED
        ):
            faults.append(
                f"{op.describe()}: NOT NULL without db_default: the previous release's "
                "workers insert rows without it until the rollout ends"
            )
    return faults


def test_migrations_keep_big_tables_writable_and_old_workers_working():
    """docs/operating.md, "Upgrading": the rules a migration of a live fleet follows."""
    loader = MigrationExecutor(connection).loader
    found = {}
    for (app, name), migration in loader.disk_migrations.items():
        if app == "workflows_app" and int(name[:4]) >= CHECKED_FROM:
            faults = live_upgrade_faults(migration)
            if faults:
                found[name] = faults
    assert not found
