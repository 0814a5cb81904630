"""Realistic workflows, registered when settings.WFDASH["DEMO"] is on."""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any

from ..engine import NonRetryableError, WorkflowEntrypoint, current_step, register

APPROVAL_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "by": {"type": "string"}},
    "required": ["ok"],
    "additionalProperties": False,
}


@register("order-approval", version=1)
class OrderApproval(WorkflowEntrypoint):
    """Charge, wait for a manager's approval (typed event), then ship or refund."""

    async def run(self, event: Any, step: Any) -> dict[str, Any]:
        order = event.payload or {}
        amount = order.get("amount", 42)

        def charge() -> dict[str, Any]:
            ctx = current_step()
            return {
                "amount": amount,
                "charge_id": f"ch_{hashlib.sha1(ctx.idempotency_key.encode()).hexdigest()[:10]}",
            }

        def refund(charge_output: dict[str, Any]) -> dict[str, Any]:
            return {"refunded": charge_output["charge_id"]}

        charge_result = await step.do(
            "charge card",
            charge,
            retries={"limit": 3, "delay": "2 seconds", "backoff": "exponential"},
            timeout="30 seconds",
            compensate=refund,
        )
        approval = await step.wait_for_event(
            "manager approval", type="approval", timeout="24 hours", schema=APPROVAL_SCHEMA
        )
        if not approval.payload["ok"]:
            await step.do("refund card", lambda: refund(charge_result))
            raise NonRetryableError(
                f"rejected by {approval.payload.get('by', 'the manager')}", "OrderRejected"
            )
        await step.sleep("cool-off", "10 seconds")
        shipment = await step.do("ship order", lambda: {"tracking": f"TRK-{event.instance_id[:8]}"})
        return {"charged": charge_result["amount"], "tracking": shipment["tracking"]}


@register("data-pipeline", version=1)
class DataPipeline(WorkflowEntrypoint):
    """Extract (flaky: fails its first attempts), transform in parallel, load."""

    async def run(self, event: Any, step: Any) -> dict[str, Any]:
        params = event.payload or {}
        failures = int(params.get("flaky_attempts", 2))

        def extract() -> list[int]:
            ctx = current_step()
            if ctx.attempt <= failures:
                raise ConnectionError(f"upstream API timed out (attempt {ctx.attempt})")
            return list(range(params.get("rows", 10)))

        rows = await step.do(
            "extract", extract, retries={"limit": 4, "delay": "1 second", "backoff": "linear"}
        )
        if params.get("corrupt"):
            await step.do("validate", lambda: _reject("input contains corrupt rows"))
        evens, odds = await _gather(
            step.do("sum evens", lambda: sum(r for r in rows if r % 2 == 0)),
            step.do("sum odds", lambda: sum(r for r in rows if r % 2 == 1)),
        )
        loaded = await step.do("load", lambda: {"rows": len(rows), "evens": evens, "odds": odds})
        return loaded


@register("trial-reminder", version=1)
class TrialReminder(WorkflowEntrypoint):
    """Sleep for the length of a trial (durably: a deploy or a crash loses nothing), then remind."""

    async def run(self, event: Any, step: Any) -> dict[str, Any]:
        params = event.payload or {}
        user = await step.do("load user", lambda: {"email": params.get("email", "ada@example.com")})
        await step.sleep("trial period", params.get("trial", "14 days"))
        sent = await step.do(
            "send reminder", lambda: {"to": user["email"], "template": "trial-ending"}
        )
        return sent


@register("nightly-import", version=1)
class NightlyImport(WorkflowEntrypoint):
    """A parent: two data pipelines as child workflows (waited for, in parallel), then a
    reminder started and not waited for."""

    async def run(self, event: Any, step: Any) -> dict[str, Any]:
        eu, us = await _gather(
            step.invoke("import eu", "data-pipeline", params={"rows": 6, "flaky_attempts": 0}),
            step.invoke("import us", "data-pipeline", params={"rows": 9, "flaky_attempts": 0}),
        )
        reminder = await step.start(
            "remind ops",
            "trial-reminder",
            params={"email": "ops@example.com", "trial": "1 hour"},
        )
        return {"rows": eu["rows"] + us["rows"], "reminder": reminder}


@register("daily-digest", version=1)
class DailyDigest(WorkflowEntrypoint):
    """Started by the demo's cron schedule: gathers what happened since the tick before."""

    async def run(self, event: Any, step: Any) -> dict[str, Any]:
        tick = event.scheduled_at  # the tick this instance fired for (None if started by hand)
        region = (event.payload or {}).get("region", "eu")
        counted = await step.do("count orders", lambda: {"region": region, "orders": 3})
        return {"tick": tick.isoformat() if tick else None, **counted}


# The demo's schedule (created at run time, as an operator would, by `wf demo`).
DEMO_SCHEDULE = {
    "name": "digest-every-5-minutes",
    "workflow": "daily-digest",
    "cron": "*/5 * * * *",
    "params": {"region": "eu"},
    "timezone": "Europe/Paris",
}


def _reject(reason: str) -> None:
    raise NonRetryableError(reason, "ValidationError")


async def _gather(*aws: Any) -> list[Any]:
    import asyncio

    return list(await asyncio.gather(*aws))


# One instance per story the README tells, with ids a reader can say aloud:
# (workflow, instance id, params, what it shows).
DEMO_STORIES: tuple[tuple[str, str, dict[str, Any], str], ...] = (
    (
        "order-approval",
        "order-1001",
        {"amount": 30, "customer": "c-42"},
        "an order waiting for a manager's approval",
    ),
    (
        "data-pipeline",
        "import-2001",
        {"rows": 20, "flaky_attempts": 2},
        "a flaky data pipeline that retries, then completes",
    ),
    (
        "data-pipeline",
        "import-2002",
        {"corrupt": True, "flaky_attempts": 0},
        "a data pipeline that fails for good",
    ),
    (
        "trial-reminder",
        "trial-ada",
        {"email": "ada@example.com", "trial": "1 hour"},
        "a trial reminder sleeping for an hour",
    ),
    (
        "trial-reminder",
        "trial-grace",
        {"email": "grace@example.com", "trial": "14 days"},
        "a trial reminder sleeping for 14 days",
    ),
    (
        "nightly-import",
        "nightly-3001",
        {},
        "a nightly import that runs two pipelines as child workflows",
    ),
)


def create_demo_instances(actor: str = "demo") -> list[str]:
    """The README's stories, one instance each; running it again creates nothing twice."""
    from ..client import get_workflow, schedules
    from ..engine.errors import InstanceAlreadyExists, ScheduleExists

    created = []
    for workflow, instance_id, params, _story in DEMO_STORIES:
        try:
            get_workflow(workflow).create(params=params, id=instance_id, actor=actor)
        except InstanceAlreadyExists:
            continue
        created.append(instance_id)
    with contextlib.suppress(ScheduleExists):
        schedules.create(**DEMO_SCHEDULE, actor=actor)
    return created
