"""Migration 0011: existing instances' attributes become rows the filter reads."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from workflows_app.engine import store
from workflows_app.models import Instance

START = datetime(2026, 1, 1, tzinfo=UTC)

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = [("workflows_app", "0010_history_subscribers_and_step_completion_index")]


def migrate(target=None):
    """To target (None: every app's latest migration, as the test database was made: the
    tests after this one must find it as they expect it)."""
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    target = target or executor.loader.graph.leaf_nodes()
    executor.migrate(target)
    return executor.loader.project_state(target).apps


def test_0011_backfills_rows_for_every_existing_instance_with_its_types():
    old = migrate(BEFORE)
    instance = old.get_model("workflows_app", "Instance")
    try:
        for n, attributes in enumerate(
            [{"customer": "c-1", "seats": 3.0, "vip": True}, {"customer": "c-2"}, {}]
        ):
            instance.objects.create(
                workflow="legacy",
                instance_id=f"old-{n}",
                version=1,
                status="complete",
                created_at=START,
                updated_at=START,
                trace_id=f"{n:032x}",
                attributes=attributes,
            )
    finally:
        migrate()  # through 0011, which backfills
    assert listed({"customer": "c-1", "seats": 3}) == ["old-0"]
    assert listed({"vip": True}) == ["old-0"]
    assert listed({"customer": "c-2"}) == ["old-1"]
    assert listed({"vip": 1}) == []


def listed(attributes):
    query = store.filter_attributes(Instance.objects.filter(workflow="legacy"), attributes)
    return list(store.order_by_id(query).values_list("instance_id", flat=True))
