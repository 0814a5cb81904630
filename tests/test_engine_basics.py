from __future__ import annotations

import pytest

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_three_step_workflow_completes_with_its_output(registered):
    @register("three-steps")
    class ThreeSteps(WorkflowEntrypoint):
        async def run(self, event, step):
            a = await step.do("one", lambda: event.payload["x"] + 1)
            b = await step.do("two", lambda: a * 2)
            c = await step.do("three", lambda: b + 100)
            return {"result": c}

    inst = get_workflow("three-steps").create(params={"x": 1})
    assert inst.status().status == "running"
    runs = testing.run_until_idle()
    assert runs == 1
    status = inst.status()
    assert status.status == "complete"
    assert status.output == {"result": 104}
    assert [s.name for s in inst.steps()] == ["one", "two", "three"]
