"""Fixtures of the dashboard tests: users with given permissions, a workflow every action applies to."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client

from workflows_app.engine import WorkflowEntrypoint, register, registry

from .helpers import make_user

APPROVAL_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture
def approval_workflow() -> Iterator[str]:
    """A workflow that parks on an event, then sleeps: every dashboard action applies to it."""

    @register("dash-approval")
    class DashApproval(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            prepared = await step.do(
                "prepare", lambda: {"items": event.payload.get("items", 1) if event.payload else 1}
            )
            approval = await step.wait_for_event(
                "approval", type="approval", schema=APPROVAL_SCHEMA
            )
            await step.sleep("cool-off", "1 hour")
            return {"prepared": prepared, "approved": approval.payload["ok"]}

    yield "dash-approval"
    registry.unregister("dash-approval")


@pytest.fixture
def operator() -> User:
    return make_user("operator", "view_instance", "change_instance")


@pytest.fixture
def viewer() -> User:
    return make_user("viewer", "view_instance")


@pytest.fixture
def operator_client(operator: User) -> Client:
    client = Client()
    client.force_login(operator)
    return client
