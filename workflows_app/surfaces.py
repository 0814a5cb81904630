"""Shared by the operator surfaces (the `wf` command, the JSON API, the admin).

One place turns engine objects into JSON-ready dicts, so the command's `--json` output
and the API's `result` are the same shape, and one place finds a workflow's binding.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from .client import (
    BulkJobHandle,
    HistoryEntry,
    InstanceHandle,
    InstanceInfo,
    PendingEvent,
    ScheduleHandle,
    WorkflowBinding,
    get_workflow,
)
from .codec import shown_text
from .engine import errors, store
from .engine.registry import all_definitions
from .models import Instance, StepRecord, decode_json


def binding(name: str) -> WorkflowBinding:
    """The workflow's binding; also for a workflow no longer registered that still has
    instances, so operators can read (and stop) what it left behind."""
    try:
        return get_workflow(name)
    except errors.UnknownWorkflow:
        if Instance.objects.filter(workflow=name).exists():
            return WorkflowBinding(name)
        raise


def workflow_names() -> list[str]:
    """Registered workflows plus any that have instances in the database."""
    return sorted({d.name for d in all_definitions()} | set(store.instance_workflows()))


def iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def info_json(info: InstanceInfo) -> dict[str, Any]:
    return {
        "id": info.id,
        "workflow": info.workflow,
        "version": info.version,
        "status": info.status,
        "error": info.error,
        "created_at": iso(info.created_at),
        "updated_at": iso(info.updated_at),
        "finished_at": iso(info.finished_at),
        "attributes": info.attributes,
    }


def step_json(step: StepRecord) -> dict[str, Any]:
    error = None
    if step.last_error_name or step.last_error_message:
        error = {"name": step.last_error_name, "message": step.last_error_message}
    return {
        "name": step.name,
        "kind": step.kind,
        "status": step.status,
        "attempts": step.attempts,
        "output": step.shown_output,
        "error": error,
        "started_at": iso(step.started_at),
        "completed_at": iso(step.completed_at),
        "duration_ms": step.duration_ms,
        "wake_at": iso(step.wake_at),
    }


def history_json(entry: HistoryEntry) -> dict[str, Any]:
    return {
        "sequence": entry.sequence,
        "created_at": iso(entry.created_at),
        "type": entry.type,
        "data": entry.data,
        "actor": entry.actor,
    }


def pending_json(pending: PendingEvent) -> dict[str, Any]:
    return {
        "name": pending.name,
        "type": pending.type,
        "timeout_at": iso(pending.timeout_at),
        "schema": pending.schema,
    }


def ref_json(row: Instance | None, step: str) -> dict[str, Any] | None:
    """A parent or a child, as instance_json links it."""
    if row is None:
        return None
    return {"id": row.instance_id, "workflow": row.workflow, "status": row.status, "step": step}


def instance_json(
    handle: InstanceHandle,
    steps: int | None = None,
    open_steps: bool = False,
    children: int | None = None,
) -> dict[str, Any]:
    """Everything an operator asks about one instance: status, params, output, steps.
    With `steps`, only the newest that many steps (with open_steps, also every older one
    still open) and steps_total: how many it has; with `children`, the newest that many
    children and children_total. A year-long loop has 100,000s of steps, a fan-out
    thousands of children: every one made a response of megabytes."""
    row = handle.row()
    if steps is None:
        step_rows, steps_total = handle.steps(), None
    elif open_steps:
        step_rows, steps_total = handle.recent_steps(steps)
    else:
        step_rows = handle.steps(last=steps)
        shown = len(step_rows)
        steps_total = shown if shown < steps else handle.step_count()
    if children is None:
        child_rows, children_total = handle.children_rows(), None
    else:
        child_rows, children_total = handle.newest_children_rows(children)
    data = {
        "id": row.instance_id,
        "workflow": row.workflow,
        "version": row.version,
        "status": row.status,
        "params": row.params,
        "attributes": row.attributes,
        "output": row.output,
        "error": row.error,
        "waiting_reason": row.waiting_reason,
        "priority": row.priority,
        "concurrency_key": row.concurrency_key,
        "parent": ref_json(handle.parent_row(), row.parent_step),
        "children": [ref_json(c, c.parent_step) for c in child_rows],
        "created_by": row.created_by,
        "created_at": iso(row.created_at),
        "updated_at": iso(row.updated_at),
        "started_at": iso(row.started_at),
        "finished_at": iso(row.finished_at),
        "steps": [step_json(s) for s in step_rows],
        "pending_events": [pending_json(p) for p in handle.pending_events()],
    }
    if steps_total is not None:
        data["steps_total"] = steps_total
    if children_total is not None:
        data["children_total"] = children_total
    return data


def created_json(handle: InstanceHandle) -> dict[str, Any]:
    """What create answers: enough to find the instance again, and whether it is new
    (False when an idempotency key found one created earlier)."""
    row = handle.row(refresh=False)
    return {
        "id": row.instance_id,
        "workflow": row.workflow,
        "version": row.version,
        "status": row.status,
        "created": handle.created,
    }


def schedule_json(schedule: ScheduleHandle, next_runs: int = 0) -> dict[str, Any]:
    """A schedule for the command's --json and the API; with next_runs, its next fire times."""
    data: dict[str, Any] = {
        "name": schedule.name,
        "workflow": schedule.workflow,
        "cron": schedule.cron,
        "timezone": schedule.timezone,
        # Decoded, or a message naming why not: the schedule can still be listed and changed.
        "params": decode_json(shown_text(schedule.params_json)),
        "paused": schedule.paused,
        "declared": schedule.declared,
        "next_run_at": iso(schedule.next_run_at),
        "last_tick_at": iso(schedule.last_tick_at),
        "last_instance_id": schedule.last_instance_id or None,
        "created_at": iso(schedule.created_at),
        "created_by": schedule.created_by,
    }
    if next_runs:
        data["next_runs"] = [iso(t) for t in schedule.next_runs(next_runs)]
    return data


def bulk_job_json(job: BulkJobHandle) -> dict[str, Any]:
    """A bulk job's progress: what it matched at its start and what became of each."""
    return {
        "id": job.id,
        "workflow": job.workflow,
        "action": job.action,
        "filter": job.filter,
        "options": job.options,
        "matched": job.matched,
        "processed": job.processed,
        "applied": job.applied,
        "pause_requested": job.pause_requested,
        "skipped": job.skipped,
        "failed": job.failed,
        "errors": job.errors,
        "done": job.done,
        "created_at": iso(job.created_at),
        "finished_at": iso(job.finished_at),
    }
