"""Shared by the operator surfaces (the `wf` command, the JSON API, the admin).

One place turns engine objects into JSON-ready dicts, so the command's `--json` output
and the API's `result` are the same shape, and one place finds a workflow's binding.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from .client import (
    HistoryEntry,
    InstanceHandle,
    InstanceInfo,
    PendingEvent,
    WorkflowBinding,
    get_workflow,
)
from .engine import errors
from .engine.registry import all_definitions
from .models import Instance, StepRecord


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
    stored = Instance.objects.values_list("workflow", flat=True).distinct()
    return sorted({d.name for d in all_definitions()} | set(stored))


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


def instance_json(handle: InstanceHandle) -> dict[str, Any]:
    """Everything an operator asks about one instance: status, params, output, steps."""
    row = handle.row()
    return {
        "id": row.instance_id,
        "workflow": row.workflow,
        "version": row.version,
        "status": row.status,
        "params": row.params,
        "output": row.output,
        "error": row.error,
        "waiting_reason": row.waiting_reason,
        "created_by": row.created_by,
        "created_at": iso(row.created_at),
        "updated_at": iso(row.updated_at),
        "started_at": iso(row.started_at),
        "finished_at": iso(row.finished_at),
        "steps": [step_json(s) for s in handle.steps()],
        "pending_events": [pending_json(p) for p in handle.pending_events()],
    }


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
