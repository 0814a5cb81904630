"""Child workflows' lifecycle around their parent (SPEC §8): a parent's end, a cancel's
compensations, deleting a child its parent still waits for."""

from __future__ import annotations

import pytest

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register
from workflows_app.engine.errors import InvalidTransition

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _flows(registered):
    @register("parcel")
    class Parcel(WorkflowEntrypoint):
        async def run(self, event, step):
            params = event.payload or {}
            if params.get("wait"):
                await step.wait_for_event("go", type="go", timeout="1 day")
            return {"parcel": params.get("n")}

    @register("post")
    class Post(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.invoke("send", "parcel", params={"wait": True, "n": 7})


def test_a_finished_child_its_parent_still_waits_for_cannot_be_deleted():
    """The parent (paused here) has not taken the child's output: deleting the child made
    the parent fail with ChildWorkflowFailed (InstanceNotFound) when it ran on. The delete
    is refused naming the parent, as retention keeps such a child; once the parent has
    taken the output, the child deletes."""
    parent = get_workflow("post").create(id="p1")
    testing.run_until_idle()
    (child,) = parent.children()
    parent.pause()
    child.send_event("go")
    testing.run_until_idle()
    assert child.status().status == "complete" and parent.status().status == "paused"
    with pytest.raises(InvalidTransition, match=r"post/p1 .*step \"send\" waits for it"):
        child.delete()
    with pytest.raises(InvalidTransition, match="post/p1"):  # all or none
        get_workflow("parcel").delete_batch([child.id])
    assert child.status().status == "complete"
    parent.resume()
    testing.run_until_idle()
    assert parent.status().output == {"parcel": 7}
    child.delete()
    assert parent.children() == []
