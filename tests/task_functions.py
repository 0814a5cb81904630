"""Module-level Django tasks for tests/test_tasks.py (tasks must be module-level functions).

Imported by that module's fixture, not at collection, so their workflows exist only in
the tests that use them.
"""

from __future__ import annotations

import threading
from typing import Any

from workflows_app.tasks import task

GATE = threading.Event()  # block_until_released waits for it


@task
def add(a: int, b: int) -> int:
    return a + b


@task(priority=50)
def urgent(label: str) -> str:
    return label


@task
def explode(message: str) -> None:
    raise ValueError(message)


@task
async def async_double(x: int) -> int:
    return x * 2


@task(takes_context=True)
def with_context(context: Any, x: int) -> dict[str, Any]:
    return {"id": context.task_result.id, "status": context.task_result.status, "x": x}


@task
def block_until_released() -> str:
    if not GATE.wait(30):
        raise TimeoutError("the test never released the gate")
    return "released"


@task
def create_group(name: str) -> int:
    from django.contrib.auth.models import Group

    return Group.objects.create(name=name).pk


class PaymentDeclined(Exception):
    """A task's own exception: its TaskError must name it by a path that imports."""


@task
def decline(order: int) -> None:
    raise PaymentDeclined(f"order {order} declined")


@task
def not_a_number() -> float:
    return float("nan")  # normalize_json lets it through; JSON has no NaN


@task(takes_context=True)
def fail_first_attempt(context: Any) -> int:
    if context.attempt == 1:
        raise RuntimeError("the first attempt fails")
    return context.attempt
