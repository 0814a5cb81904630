"""Step semantics under odd values, found by a review against Cloudflare Workflows.

Each test failed before the fix its docstring names.
"""

from __future__ import annotations

import pytest

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize(
    ("name", "flaw"), [("a\x00b", "NUL"), ("a\ud800b", "surrogate")], ids=["nul", "surrogate"]
)
def test_a_step_name_no_database_stores_errors_the_instance_at_once(registered, name, flaw):
    """A step name holding a NUL (PostgreSQL stores none) or a lone surrogate (no UTF-8 for
    it) passed check_step_name (limits.py), so the step's checkpoint write failed inside
    the engine: the run was dropped with its lease held, the instance stayed `running`
    until the lease ran out, and after three takeovers it errored as a "poison instance"
    that named no step. (SQLite stored the NUL, so the two databases disagreed.) Now the
    name is refused like any other bad step name: the instance errors at once, saying why."""
    flow = f"odd-step-name-{flaw}"

    @register(flow)
    class OddStepName(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do(name, lambda: 1)

    inst = get_workflow(flow).create()
    testing.run_until_idle(timeout=10)
    status = inst.status()
    assert status.status == "errored"
    assert status.error["name"] == "InvalidInput"
    assert "step name" in status.error["message"]
    assert flaw in status.error["message"]
    assert inst.steps() == []
