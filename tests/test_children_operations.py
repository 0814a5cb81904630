"""Operator actions on one end of a parent-child link (SPEC §8): pause and resume of a
parent whose child runs, and what the API shows of a link across a token's workflows."""

from __future__ import annotations

import asyncio

import pytest
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.messages import get_messages
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from tests.test_api import Api
from workflows_app import testing, tokens
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register
from workflows_app.models import ErrorRecord, HistoryRecord, Instance

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


def test_a_token_limited_to_one_end_of_a_link_does_not_read_the_other_ends_status(client):
    """A token limited to some workflows reads no instance of the others; through a parent
    (its "children", …/children) or a child (its "parent") it read their live status. The
    link stays (the instance's own history names the other end), its status is null."""
    dad = get_workflow("op-dad").create(id="td")
    testing.run_until_idle()
    (kid,) = dad.children()
    dad.pause()

    def get(path: str, secret: str) -> dict:
        response = Api(client, secret).get(f"/api/workflows/{path}")  # checked by OpenAPI
        assert response.status_code == 200, response.content
        return response.json()["result"]

    _, only_dad = tokens.issue("only-dad", scope="read", workflows=["op-dad"])
    _, only_kid = tokens.issue("only-kid", scope="read", workflows=["op-kid"])
    _, both = tokens.issue("both", scope="read", workflows=["op-dad", "op-kid"])
    _, any_workflow = tokens.issue("any", scope="read")
    hidden = {"id": kid.id, "workflow": "op-kid", "status": None, "step": "kid"}
    assert get("op-dad/instances/td", only_dad)["children"] == [hidden]
    assert get("op-dad/instances/td/children", only_dad) == [hidden]
    assert get(f"op-kid/instances/{kid.id}", only_kid)["parent"] == {
        "id": "td",
        "workflow": "op-dad",
        "status": None,
        "step": "kid",
    }
    for secret in (both, any_workflow):
        assert get("op-dad/instances/td/children", secret)[0]["status"] == "waiting"
        assert get(f"op-kid/instances/{kid.id}", secret)["parent"]["status"] == "paused"


@pytest.mark.parametrize(
    ("workflow", "version", "says"),
    [
        (123, None, "the child's workflow must be a registered workflow name, got 123"),
        ("", None, "the child's workflow must be a registered workflow name, got ''"),
        ("op-kid", True, "the child's version must be an integer or None, got True"),
    ],
)
def test_an_invoke_of_no_workflow_name_fails_the_parent_naming_the_step(workflow, version, says):
    """step.invoke(name, 123) errored the parent with AttributeError ("'int' object has no
    attribute 'startswith'", from the registry's look-up), naming neither the step nor
    the argument; version=True started version 1 as if asked for it."""

    @register("op-bad-parent")
    class BadParent(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.invoke("kid", workflow, version=version)

    parent = get_workflow("op-bad-parent").create(id="bad")
    testing.run_until_idle()
    assert parent.status().error == {"name": "InvalidInput", "message": f'step "kid": {says}'}
    assert parent.children() == []


@pytest.mark.parametrize("kind", ["invoke", "start"])
@pytest.mark.parametrize(
    ("asks", "error"),
    [
        ({"workflow": "op-nobody"}, "UnknownWorkflow"),
        ({"workflow": "op-kid", "version": 9}, "UnknownWorkflow"),
        ({"workflow": "op-kid", "id": "not an id!"}, "InvalidInput"),
    ],
)
def test_a_child_that_cannot_be_started_fails_the_step_that_asked_for_it(kind, asks, error):
    """An error starting a child (an unknown workflow or version, a bad id) went up through
    run() with no step record, no step.failed history, no error row naming the step: the
    dashboard showed the parent errored beside no failed step, and a replay tried again
    (a workflow registered meanwhile started a child the first run never had). It fails
    the step now, as any step error: recorded on it, raised the same on a replay (a
    NonRetryableError under the original error's name, the instance's error if uncaught)."""
    tries: list[str] = []

    @register("op-careful")
    class Careful(WorkflowEntrypoint):
        async def run(self, event, step):
            ask = {**asks}
            workflow = ask.pop("workflow")
            start = step.invoke if kind == "invoke" else step.start
            try:
                await start("kid", workflow, **ask)
            except Exception as exc:  # caught, then the instance parks and replays
                tries.append(f"{type(exc).__name__}: {getattr(exc, 'error_name', '')}")
            await step.sleep("nap", "1 hour")
            return "carried on"

    with testing.fake_clock() as clock:
        parent = get_workflow("op-careful").create(id="careful")
        testing.run_until_idle()
        assert tries == [f"NonRetryableError: {error}"]
        (step,) = [s for s in parent.row().steps.all() if s.name == "kid"]
        assert (step.status, step.last_error_name, step.attempts) == ("failed", error, 1)
        failed = HistoryRecord.objects.get(instance__instance_id="careful", type="step.failed")
        assert failed.data["step"] == "kid" and failed.data["error"]["name"] == error
        (row,) = ErrorRecord.objects.filter(instance__instance_id="careful")
        assert (row.step_name, row.name, row.source) == ("kid", error, "workflow.step")

        @register("op-nobody")  # deployed meanwhile: the replay still fails the same way
        class Nobody(WorkflowEntrypoint):
            async def run(self, event, step):
                return "late"

        clock.advance("1 hour")
        testing.run_until_idle()
    assert tries == [f"NonRetryableError: {error}"] * 2
    assert parent.status().output == "carried on"
    assert parent.children() == []


@pytest.fixture
def chain(registered):
    """A workflow that invokes itself down to a last level waiting for an event: root,
    root:down, root:down:down."""

    @register("op-chain")
    class Chain(WorkflowEntrypoint):
        async def run(self, event, step):
            left = event.payload["left"]
            if not left:
                return await step.wait_for_event("go", type="go", timeout="1 day")
            return await step.invoke("down", "op-chain", {"left": left - 1})

    root = get_workflow("op-chain").create(id="root", params={"left": 2})
    testing.run_until_idle()
    assert Instance.objects.filter(workflow="op-chain", status="waiting").count() == 3
    return root


def test_a_bulk_terminate_over_a_tree_ends_it_as_terminating_its_root_does(chain):
    """docs/operating.md: a bulk terminate is terminate() for each instance. Its fast path
    ended a batch's parents and their children side by side, so a parent's own terminate
    did not end those children: no child.terminated on the parent, no "parent … ended" on
    the child, and a restart of the root did not revive them (it failed at once with
    ChildWorkflowFailed, the child "terminated on its own"), where a terminate() of the
    root, or a click on each instance in turn, revives the chain."""
    job = get_workflow("op-chain").bulk("terminate", status="waiting")
    testing.run_until_idle()
    job.refresh()
    assert job.done and job.matched == 3
    assert (job.applied, job.skipped) == (1, 2)  # the others had ended with the root
    chain_rows = Instance.objects.filter(workflow="op-chain")
    assert set(chain_rows.values_list("status", flat=True)) == {"terminated"}
    assert "child.terminated" in history_types(chain)
    reasons = HistoryRecord.objects.filter(
        instance__instance_id="root:down", type="instance.terminated"
    ).values_list("data__reason", flat=True)
    assert list(reasons) == ["parent op-chain/root ended"]

    assert chain.restart() == "running"
    testing.run_until_idle()
    assert chain.status().status == "waiting"
    assert chain_rows.filter(status="waiting").count() == 3


def test_a_restart_from_a_later_step_revives_the_started_child_the_terminate_ended(registered):
    """README: a restart of the parent revives the children its terminate ended. With
    from_step after a step.start, that step's checkpoint is kept, so its child (ended by
    the terminate, not on its own) was left terminated: the restarted parent carried on
    and completed, and the child's work silently never happened, as a full restart did
    before it revived started children."""

    @register("op-audit")
    class Audit(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("go", type="go", timeout="1 day")
            return "audited"

    @register("op-auditor")
    class Auditor(WorkflowEntrypoint):
        async def run(self, event, step):
            child_id = await step.start("audit", "op-audit")
            await step.wait_for_event("done", type="done", timeout="1 day")
            return child_id

    parent = get_workflow("op-auditor").create(id="au")
    testing.run_until_idle()
    (child,) = parent.children()
    parent.terminate()
    assert child.status().status == "terminated"

    assert parent.restart(from_step="done") == "running"
    testing.run_until_idle()
    assert parent.status().status == "waiting"
    assert child.status().status == "waiting"
    child.send_event("go")
    parent.send_event("done")
    testing.run_until_idle()
    assert (parent.status().output, child.status().output) == ("au:audit", "audited")

    # A child that ended on its own is left as it is by the parent's later restarts.
    parent.restart(from_step="done")
    testing.run_until_idle()
    assert child.status().status == "complete"


def test_the_admin_refuses_deleting_a_child_its_paused_parent_still_waits_for(admin_client):
    """docs/operating.md: deleting a finished child whose parent's step.invoke has not taken
    its output is refused, naming the parent. The admin offers Delete on every finished
    instance, and its delete raised that refusal out of delete_model: a 500 page."""
    dad = get_workflow("op-dad").create(id="ad")
    testing.run_until_idle()
    (kid,) = dad.children()
    dad.pause()
    kid.send_event("go")
    testing.run_until_idle()
    assert kid.status().status == "complete"

    url = reverse("admin:workflows_app_instance_delete", args=[kid.row().pk])
    response = admin_client.post(url, {"post": "yes"}, follow=True)
    assert response.status_code == 200
    said = [str(m) for m in get_messages(response.wsgi_request)]
    assert any("its parent op-dad/ad has not taken its output yet" in m for m in said), said
    assert Instance.objects.filter(instance_id=kid.id).exists()
    assert not LogEntry.objects.filter(action_flag=DELETION).exists()  # rolled back with it

    dad.resume()
    testing.run_until_idle()
    assert admin_client.post(url, {"post": "yes"}).status_code == 302
    assert not Instance.objects.filter(instance_id=kid.id).exists()


def test_a_bulk_cancel_over_a_tree_counts_the_children_its_parents_cancel_took_as_skipped(
    registered,
):
    """docs/operating.md: an action that does not apply counts as skipped. A cancel that
    compensates cancels the children (and theirs) with it; the job's own cancel of such a
    child then finds its compensations running and changes nothing, yet counted it
    applied (with compensate=False the same child counted skipped, being ended already)."""
    undone: list[int] = []

    @register("op-saga")
    class Saga(WorkflowEntrypoint):
        async def run(self, event, step):
            left = event.payload["left"]
            await step.do("book", lambda: left, compensate=undone.append)
            if not left:
                return await step.wait_for_event("go", type="go", timeout="1 day")
            return await step.invoke("down", "op-saga", {"left": left - 1})

    get_workflow("op-saga").create(id="saga", params={"left": 2})
    testing.run_until_idle()
    job = get_workflow("op-saga").bulk("cancel", status="waiting")
    testing.run_until_idle()
    job.refresh()
    assert job.done and (job.matched, job.applied, job.skipped) == (3, 1, 2)
    assert sorted(undone) == [0, 1, 2]  # each compensated once
    assert set(Instance.objects.values_list("status", flat=True)) == {"terminated"}


def register_fan() -> None:
    """op-fan: starts payload["children"] op-kid children, then waits for an event."""

    @register("op-fan")
    class Fan(WorkflowEntrypoint):
        async def run(self, event, step):
            count = event.payload["children"]
            await asyncio.gather(*[step.start(f"c{i}", "op-kid") for i in range(count)])
            await step.wait_for_event("go", type="go", timeout="1 day")


def test_terminating_a_fan_out_takes_as_many_statements_for_many_children_as_for_few(
    registered,
):
    """The cascade ended each child with its own statements (7 a child): a parent with 500
    children took 3,500 statements and 14 s on PostgreSQL under its row lock, a click or
    an API call that could outlast the web server's timeout. Now a few a level."""

    register_fan()

    def statements_to_terminate(children: int) -> int:
        parent = get_workflow("op-fan").create(id=f"fan-{children}", params={"children": children})
        testing.run_until_idle()
        assert len(parent.children()) == children
        with CaptureQueriesContext(connection) as queries:
            assert parent.terminate() is True
        kids = Instance.objects.filter(parent__instance_id=parent.id)
        assert set(kids.values_list("status", flat=True)) == {"terminated"}
        assert history_types(parent).count("child.terminated") == children
        reasons = HistoryRecord.objects.filter(
            instance__in=kids,
            type="instance.terminated",
            data__reason=f"parent op-fan/{parent.id} ended",
        )
        assert reasons.count() == children
        return len(queries.captured_queries)

    assert statements_to_terminate(12) == statements_to_terminate(2)


def test_restarting_a_fan_out_takes_as_many_statements_for_many_children_as_for_few(
    registered,
):
    """A restart of a parent revived the children its terminate ended with a restart()
    each: 11 statements a child under the parent's lock (12 children: 147 statements on
    SQLite, 2: 37), as the terminate cascade once took 7. Now a few a level. A child
    terminated on its own before stays as it is; the others run again, each with its
    instance.restarted record."""

    register_fan()

    def statements_to_restart(children: int) -> int:
        parent = get_workflow("op-fan").create(id=f"fan-{children}", params={"children": children})
        testing.run_until_idle()
        own = get_workflow("op-kid").get(f"fan-{children}:c0")
        own.terminate()  # on its own: not the parent's to revive
        assert parent.terminate() is True
        with CaptureQueriesContext(connection) as queries:
            assert parent.restart() == "running"
        kids = Instance.objects.filter(parent__instance_id=parent.id).exclude(id=own.row().pk)
        assert set(kids.values_list("status", flat=True)) == {"running"}
        assert own.status().status == "terminated"
        restarted = HistoryRecord.objects.filter(instance__in=kids, type="instance.restarted")
        assert restarted.count() == children - 1
        assert {(r.data["from"], r.data["dropped_steps"]) for r in restarted} == {("terminated", 1)}
        testing.run_until_idle()
        assert set(kids.values_list("status", flat=True)) == {"waiting"}
        return len(queries.captured_queries)

    assert statements_to_restart(12) == statements_to_restart(2)
