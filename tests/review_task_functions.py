"""Module-level Django tasks for tests/test_review_retention.py."""

from __future__ import annotations

from typing import Any

from workflows_app.tasks import task


@task(takes_context=True)
def attempt_info(context: Any) -> dict[str, Any]:
    return {
        "attempt": context.attempt,
        "started": context.task_result.started_at is not None,
        "status": context.task_result.status,
    }


@task
def echo(value: Any) -> Any:
    return value
