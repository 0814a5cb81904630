"""Operator actions on one end of a parent-child link (SPEC §8): pause and resume of a
parent whose child runs, and what the API shows of a link across a token's workflows."""

from __future__ import annotations

import pytest

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register
from workflows_app.models import HistoryRecord

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _flows(registered):
    @register("op-kid")
    class Kid(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("go", type="go", timeout="1 day")
            if (event.payload or {}).get("grand"):
                return await step.invoke("grand", "op-kid")
            return {"kid": "done"}

    @register("op-dad")
    class Dad(WorkflowEntrypoint):
        async def run(self, event, step):
            got = await step.invoke("kid", "op-kid", params=event.payload)
            return {"got": got}


def history_types(handle) -> list[str]:
    return list(
        HistoryRecord.objects.filter(instance__instance_id=handle.id)
        .order_by("sequence")
        .values_list("type", flat=True)
    )


def test_pausing_a_parent_leaves_its_child_running_and_resume_takes_its_output():
    """README (Child workflows): a parent's pause holds the parent only, as Temporal's
    Workflow Pause does not pause child workflows; the child runs on and finishes, the
    paused parent does not run (its invoke takes no output) until it is resumed."""
    dad = get_workflow("op-dad").create(id="pd")
    testing.run_until_idle()
    (kid,) = dad.children()
    assert dad.pause() == "paused"
    assert kid.status().status == "waiting"  # not paused with its parent

    kid.send_event("go")
    testing.run_until_idle()
    assert kid.status().status == "complete"
    assert dad.status().status == "paused"
    assert "child.completed" not in history_types(dad)

    assert dad.resume() == "running"
    testing.run_until_idle()
    assert dad.status().output == {"got": {"kid": "done"}}
    assert history_types(dad)[-2:] == ["child.completed", "instance.completed"]


def test_terminating_a_paused_parent_still_ends_its_children_and_theirs():
    dad = get_workflow("op-dad").create(id="pt", params={"grand": True})
    testing.run_until_idle()
    (kid,) = dad.children()
    kid.send_event("go")
    testing.run_until_idle()
    (grand,) = kid.children()
    dad.pause()
    assert dad.terminate() is True
    assert [h.status().status for h in (dad, kid, grand)] == ["terminated"] * 3
