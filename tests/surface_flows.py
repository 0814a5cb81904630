"""Small workflows shared by the surface tests (command, admin, API)."""

from __future__ import annotations

from typing import Any

from workflows_app import testing
from workflows_app.client import InstanceHandle, get_workflow
from workflows_app.engine import WorkflowEntrypoint, register
from workflows_app.models import HistoryRecord, InboxEvent, Instance, StepRecord

APPROVAL = "surface-approval"
SIMPLE = "surface-simple"
OTHER = "surface-other"
COMPENSATIONS: list[Any] = []


def register_flows() -> None:
    """Register the three test workflows (call under the `registered` fixture)."""

    @register(APPROVAL)
    class Approval(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            charge = await step.do(
                "charge",
                lambda: {"amount": (event.payload or {}).get("amount", 1)},
                compensate=COMPENSATIONS.append,
            )
            approval = await step.wait_for_event(
                "approval",
                type="approval",
                timeout="1 day",
                schema={
                    "type": "object",
                    "properties": {"ok": {"type": "boolean"}},
                    "required": ["ok"],
                },
            )
            await step.sleep("cool-off", "1 hour")
            return {"charged": charge["amount"], "ok": approval.payload["ok"]}

    @register(SIMPLE)
    class Simple(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            a = await step.do("one", lambda: 1)
            b = await step.do("two", lambda: a + 1)
            return {"sum": a + b}

    @register(OTHER)
    class Other(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            return await step.do("only", lambda: "done")


def waiting_approval(instance_id: str = "order-1", amount: int = 5) -> InstanceHandle:
    """An approval instance parked on its event wait, its charge step done."""
    handle = get_workflow(APPROVAL).create(params={"amount": amount}, id=instance_id)
    testing.run_until_idle()
    assert handle.status().status == "waiting", handle.status()
    return handle


def snapshot() -> dict[str, Any]:
    """Every row a surface could change, to prove a refused call changed nothing."""
    return {
        "instances": list(
            Instance.objects.order_by("id").values(
                "workflow",
                "instance_id",
                "status",
                "output_json",
                "error_name",
                "wake_at",
                "updated_at",
            )
        ),
        "steps": list(
            StepRecord.objects.order_by("id").values("instance_id", "name", "status", "attempts")
        ),
        "events": list(
            InboxEvent.objects.order_by("id").values("instance_id", "type", "payload_json")
        ),
        "history": HistoryRecord.objects.count(),
    }


LIMITED = "surface-limited"
OLD_VERSION_PAYLOAD_LIMIT, NEW_VERSION_PAYLOAD_LIMIT = 4000, 1000


def limited_versions() -> tuple[InstanceHandle, InstanceHandle]:
    """An instance of LIMITED's version 1, whose events may be up to 4000 bytes, and one of
    its version 2, the newest, whose events may be up to 1000: each waiting for a "go"."""
    handles = []
    for version, limit in ((1, OLD_VERSION_PAYLOAD_LIMIT), (2, NEW_VERSION_PAYLOAD_LIMIT)):

        @register(LIMITED, version=version, limits={"max_event_payload_bytes": limit})
        class Limited(WorkflowEntrypoint):
            async def run(self, event: Any, step: Any) -> Any:
                return (await step.wait_for_event("go", type="go")).payload

        handles.append(get_workflow(LIMITED).create(id=f"v{version}"))
        testing.run_until_idle()
    assert [h.row().version for h in handles] == [1, 2]
    assert {h.status().status for h in handles} == {"waiting"}
    return handles[0], handles[1]
