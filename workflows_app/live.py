"""How changes travel: to this process's workers, to result() waiters, and to other
processes and dashboards through the channel layer. The only module that knows group names.

The channel layer is a lossy notifier: a lost message costs latency, never correctness,
because workers poll the database and dashboards re-read it on connect.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import InMemoryChannelLayer, get_channel_layer

from .engine.worker import notify_local

log = logging.getLogger("workflows_app.live")

WORKERS_GROUP = "wfdash.workers"
OVERVIEW_GROUP = "wfdash.overview"


def instance_group(pk: int) -> str:
    return f"wfdash.instance.{pk}"


def workflow_group(name: str) -> str:
    return "wfdash.workflow." + "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:80]


def _cross_process_layer() -> Any:
    """The channel layer if it reaches other processes (Redis); None for the in-memory one."""
    layer = get_channel_layer()
    if layer is None or isinstance(layer, InMemoryChannelLayer):
        return None
    return layer


def instance_changed(kind: str, pk: int | None, workflow: str | None = None) -> None:
    """Called after a state change commits (from any thread, sync code)."""
    from .client import wake_result_waiters

    notify_local(kind, pk)
    wake_result_waiters(pk)
    layer = _cross_process_layer()
    if layer is not None:
        try:
            async_to_sync(layer.group_send)(WORKERS_GROUP, {"type": "wf.hint", "kind": kind, "pk": pk})
        except Exception:  # a lost hint costs latency only
            log.warning("could not send a %s hint for instance #%s", kind, pk, exc_info=True)


class EngineHooks:
    """What the worker tells the rest of the app about its runs."""

    def step_written(self, run: Any, record: Any, history: Any) -> None:
        pass

    def attempt_failed(self, run: Any, record: Any, exc: BaseException) -> None:
        pass

    def flush(self) -> None:
        """After each run, in the engine's database thread: store the spans it produced."""
        from .tracing import flush_spans

        flush_spans()

    def run_finished(self, pk: int, outcome: str) -> None:
        from .client import wake_result_waiters

        wake_result_waiters(pk)


async def join_workers_group(channel_name: str) -> None:
    layer = _cross_process_layer()
    if layer is not None:
        await layer.group_add(WORKERS_GROUP, channel_name)


def running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
