"""Child workflows under review: deep chains, restarts, the dashboard's link (SPEC §8)."""

from __future__ import annotations

import contextlib
import sys

import pytest

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register
from workflows_app.engine.lifecycle import LIVE
from workflows_app.models import Instance

pytestmark = pytest.mark.django_db(transaction=True)

# A cascade that recursed per level used two frames a level (a terminate failed from about
# 480 levels under the default limit of 1,000), a restart that revives three. The chain is
# kept short and the limit lowered around the call (FRAMES_SPARE above the caller's depth):
# the loop needs no more frames for 80 levels than for one, a recursion needs 160 or more.
DEEP = 80
FRAMES_SPARE = 150


@contextlib.contextmanager
def frames_spare(spare: int = FRAMES_SPARE):
    """Lower the recursion limit to the caller's depth plus `spare` frames for the block."""
    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    previous = sys.getrecursionlimit()
    sys.setrecursionlimit(depth + spare)
    try:
        yield
    finally:
        sys.setrecursionlimit(previous)


@pytest.fixture
def deep_chain(registered):
    """A chain of children DEEP levels deep (each invokes the next; the last waits), as a
    workflow that pages through work by recursing into a child builds one."""

    @register("deep-chain")
    class DeepChain(WorkflowEntrypoint):
        async def run(self, event, step):
            left = event.payload["left"]
            if not left:
                return await step.wait_for_event("go", type="go", timeout="1 day")
            return await step.invoke("down", "deep-chain", {"left": left - 1})

    root = get_workflow("deep-chain").create(id="root", params={"left": DEEP - 1})
    testing.run_until_idle(timeout=120)
    assert Instance.objects.filter(workflow="deep-chain", status="waiting").count() == DEEP
    return root


def test_terminating_the_root_of_a_deep_chain_of_children_ends_every_level(deep_chain):
    """SPEC §8: terminating a parent terminates its unfinished children (and theirs). The
    cascade recursed once per level, so a deep enough chain raised RecursionError and
    rolled the terminate back: the root could not be terminated at all."""
    with frames_spare():
        assert deep_chain.terminate() is True
    chain = Instance.objects.filter(workflow="deep-chain")
    assert not chain.filter(status__in=LIVE).exists()
    assert chain.filter(status="terminated").count() == DEEP


def test_restarting_the_terminated_root_of_a_deep_chain_revives_every_level(deep_chain):
    """A restart of a parent revives the children its own terminate ended (README, Child
    workflows), and theirs. The revival recursed through restart() once per level (a few
    frames each), so a chain about 330 deep made the restart raise RecursionError."""
    deep_chain.terminate()
    with frames_spare():
        assert deep_chain.restart() == "running"
    chain = Instance.objects.filter(workflow="deep-chain")
    assert chain.filter(status="running").count() == DEEP
    # The revived chain runs again down to the last level, which waits for its event.
    testing.run_until_idle(timeout=120)
    assert chain.filter(status="waiting").count() == DEEP


def test_a_restart_leaves_a_child_terminated_on_its_own_after_an_earlier_revival(registered):
    """README: a restart of the parent revives the children its own terminate ended; "a
    child that failed or was terminated on its own is found as it is". A child ended by
    its parent's terminate, revived by the parent's restart and then terminated on its own
    was revived again by the next restart: any child.terminated record of the parent, however
    old, counted, not whether it is what ended the child this time."""

    @register("review-kid")
    class Kid(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.wait_for_event("go", type="go", timeout="1 day")

    @register("review-strict-parent")
    class StrictParent(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.invoke("kid", "review-kid")

    parent = get_workflow("review-strict-parent").create(id="sp")
    testing.run_until_idle()
    (kid,) = parent.children()
    parent.terminate()  # the cascade ends the kid ...
    parent.restart()  # ... and the restart revives it
    testing.run_until_idle()
    assert kid.status().status == "waiting" and parent.status().status == "waiting"

    kid.terminate()  # now on its own: the parent's invoke fails
    testing.run_until_idle()
    assert parent.status().error["name"] == "ChildWorkflowFailed"
    parent.restart()
    testing.run_until_idle()
    assert kid.status().status == "terminated"
    error = parent.status().error
    assert error is not None and "WorkflowTerminated" in error["message"]


def test_a_child_output_larger_than_the_parents_step_output_limit_fails_the_invoke(registered):
    """The invoke is a step: its checkpoint holds the child's output. A child whose own
    max_step_output_bytes is higher than its parent's returned more than the parent's
    step.do could ever store, and the invoke stored it all the same. It now fails as a
    ChildWorkflowFailed naming StepOutputError (the same on replay), the child complete."""
    from workflows_app.engine import ChildWorkflowFailed
    from workflows_app.models import StepRecord

    @register("review-big-kid", limits={"max_step_output_bytes": 100_000})
    class BigKid(WorkflowEntrypoint):
        async def run(self, event, step):
            return "x" * 50_000

    @register("review-small-parent", limits={"max_step_output_bytes": 1_000})
    class SmallParent(WorkflowEntrypoint):
        async def run(self, event, step):
            try:
                await step.invoke("big", "review-big-kid")
            except ChildWorkflowFailed as exc:
                caught = [exc.instance_id, exc.error_name, exc.message]
            await step.wait_for_event("again", type="again", timeout="1 hour")
            return caught

    parent = get_workflow("review-small-parent").create(id="small")
    testing.run_until_idle()
    (kid,) = parent.children()
    assert kid.status().status == "complete"
    record = StepRecord.objects.get(instance__instance_id="small", name="big")
    assert record.status == "failed" and len(record.output_json) < 1_000
    parent.send_event("again")  # the replay raises the same from the checkpoint
    testing.run_until_idle()
    instance_id, error_name, message = parent.status().output
    assert (instance_id, error_name) == ("small:big", "StepOutputError")
    assert "50002 bytes" in message and "max_step_output_bytes" in message
