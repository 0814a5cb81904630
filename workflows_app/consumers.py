"""Channels consumers: the engine's channel (`runworker workflows`) and the dashboard sockets.

A dashboard socket gets a full snapshot from the database on connect, then small typed
events (`instance.status`, `step.written`, `history.appended`, `span.stored`, `error`)
relayed from channel-layer groups. The layer is lossy; the snapshot after a reconnect
repairs whatever was missed. Clients may only send `ping` (and `watch` on the list);
anything else gets an `error` frame and changes nothing. A socket follows its session:
it closes (4403) on logout, and when its user may no longer view the dashboard, checked
on every client message, every access.RECHECK_SECONDS and whenever the user changes.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from channels.consumer import AsyncConsumer
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from . import access, dashboard, live
from .converters import MAX_PK
from .engine.worker import notify_local
from .models import Instance

MAX_CLIENT_FRAME = 8192  # bytes; clients only send tiny control messages
MAX_WATCHED = 500  # rows a list page may ask about (a page shows 50)
OVERVIEW_COALESCE_SECONDS = 0.25  # one summary per workflow per window, however busy it is
LIST_COALESCE_SECONDS = (
    0.05  # the instance list reads the instances that changed in a window at once
)
CLOSE_FORBIDDEN = 4403
CLOSE_NOT_FOUND = 4404


class UnknownPathConsumer(AsyncJsonWebsocketConsumer):
    """Any other WebSocket path: refused at the handshake (the router would answer a 500)."""

    async def connect(self) -> None:
        await self.close(code=CLOSE_NOT_FOUND)


class EngineConsumer(AsyncConsumer):
    """Receives hints on the `workflows` channel and passes them to this process's workers."""

    async def wf_hint(self, message: dict[str, Any]) -> None:
        notify_local(str(message.get("kind", "wake")), message.get("pk"))


def _summary(pk: int) -> dashboard.InstanceSummaryJSON | None:
    row = Instance.objects.only(*dashboard.ROW_FIELDS).filter(pk=pk).first()
    return None if row is None else dashboard.instance_summary(row)


class DashboardConsumer(AsyncJsonWebsocketConsumer):
    """Base: staff-only sockets that join groups, send a snapshot, then relay events."""

    client_types: frozenset[str] = frozenset({"ping"})
    ended = False  # closed for lost access: send nothing more, even what is already queued
    recheck_task: asyncio.Task[None] | None = None
    flush_task: asyncio.Task[None] | None = None  # coalesced updates, where a page has them

    def groups_for(self) -> list[str]:
        return []

    async def snapshot(self) -> dict[str, Any] | None:
        """The full state the page shows; None refuses the socket (e.g. unknown instance)."""
        raise NotImplementedError

    async def connect(self) -> None:
        user = self.scope.get("user")
        self.session_key = getattr(self.scope.get("session"), "session_key", None)
        if not self.session_key or not await database_sync_to_async(access.may_view)(user):
            await self.close(code=CLOSE_FORBIDDEN)
            return
        self.user_pk = user.pk
        snapshot = await self.snapshot()
        if snapshot is None:
            await self.close(code=CLOSE_FORBIDDEN)
            return
        live.bind_socket_loop()
        self.groups = [
            *self.groups_for(),
            live.session_group(self.session_key),
            live.user_group(self.user_pk),
        ]
        for group in self.groups:
            await self.channel_layer.group_add(group, self.channel_name)
        await self.accept()
        await self.send_json(snapshot)
        self.recheck_task = asyncio.ensure_future(self.recheck_periodically())

    async def still_allowed(self) -> bool:
        return await database_sync_to_async(access.session_may_view)(self.session_key, self.user_pk)

    async def recheck_periodically(self) -> None:
        while not self.ended:
            await asyncio.sleep(access.RECHECK_SECONDS)
            await self.wf_access({})

    async def wf_access(self, message: dict[str, Any]) -> None:
        """The user changed (or the timer fired): close unless they may still view."""
        if not self.ended and not await self.still_allowed():
            await self.end()

    async def wf_logout(self, message: dict[str, Any]) -> None:
        await self.end()

    async def end(self) -> None:
        self.ended = True
        await self.close(code=CLOSE_FORBIDDEN)

    async def send_json(self, content: Any, close: bool = False) -> None:
        if not self.ended:
            await super().send_json(content, close)

    async def disconnect(self, code: int) -> None:
        for task in (self.recheck_task, self.flush_task):
            if task is not None:
                task.cancel()

    async def receive(
        self, text_data: str | None = None, bytes_data: bytes | None = None, **kwargs: Any
    ) -> None:
        if not await self.still_allowed():
            await self.end()
        elif text_data is None:
            await self.reject("binary frames are not accepted")
        elif len(text_data) > MAX_CLIENT_FRAME:
            await self.reject(f"frame larger than {MAX_CLIENT_FRAME} bytes")
        else:
            try:
                content = json.loads(text_data)
            except (ValueError, RecursionError):
                await self.reject("frame is not JSON (or is nested too deeply)")
                return
            await self.receive_json(content)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        if not isinstance(content, dict) or content.get("type") not in self.client_types:
            await self.reject(f"unknown message; this socket accepts {sorted(self.client_types)}")
        elif content["type"] == "ping":
            await self.send_json({"type": "pong"})
        else:
            await self.handle_client(content)

    async def handle_client(self, content: dict[str, Any]) -> None:
        await self.reject("unsupported message")

    async def reject(self, reason: str) -> None:
        await self.send_json({"type": "error", "error": reason})


class OverviewConsumer(DashboardConsumer):
    """Per-workflow summaries; changes are coalesced so a busy workflow costs one query per window."""

    def groups_for(self) -> list[str]:
        return [live.OVERVIEW_GROUP]

    async def snapshot(self) -> dict[str, Any]:
        self.dirty: set[str | int] = set()
        self.flush_task = None
        summaries = await database_sync_to_async(dashboard.workflow_summaries)()
        return {"type": "snapshot", "workflows": [s.as_json() for s in summaries]}

    async def wf_instance(self, message: dict[str, Any]) -> None:
        self.dirty.add(message.get("workflow") or int(message["pk"]))
        if self.flush_task is None or self.flush_task.done():
            self.flush_task = asyncio.ensure_future(self.flush())

    async def flush(self) -> None:
        # Until nothing is left: a change that arrives while a window is being read goes
        # in the next window (wf_instance starts no second flush while this one runs).
        while self.dirty:
            await asyncio.sleep(OVERVIEW_COALESCE_SECONDS)
            dirty, self.dirty = self.dirty, set()
            for summary in await database_sync_to_async(_summaries_for)(dirty):
                await self.send_json({"type": "workflow.summary", "workflow": summary})


def _summaries_for(dirty: set[str | int]) -> list[dashboard.WorkflowSummaryJSON]:
    names = {d for d in dirty if isinstance(d, str)}
    pks = [d for d in dirty if isinstance(d, int)]
    names.update(Instance.objects.filter(pk__in=pks).values_list("workflow", flat=True))
    return [s.as_json() for name in sorted(names) for s in dashboard.workflow_summaries(only=name)]


class InstanceListConsumer(DashboardConsumer):
    """Status changes of any instance; the page updates its rows and prepends new ones."""

    client_types = frozenset({"ping", "watch"})

    def groups_for(self) -> list[str]:
        return [live.OVERVIEW_GROUP]

    async def snapshot(self) -> dict[str, Any]:
        self.pending: dict[int, str | None] = {}  # pk -> the latest kind of change
        self.flush_task = None
        page = await database_sync_to_async(dashboard.instance_page)(dashboard.ListFilters())
        return {"type": "snapshot", "instances": [dashboard.instance_summary(r) for r in page.rows]}

    async def handle_client(self, content: dict[str, Any]) -> None:
        """`watch`: the page lists the pks it shows and gets their current state."""
        pks = content.get("pks")
        if (
            not isinstance(pks, list)
            or len(pks) > MAX_WATCHED
            or not all(
                isinstance(p, int) and not isinstance(p, bool) and 0 < p <= MAX_PK for p in pks
            )
        ):
            await self.reject(
                f"watch needs pks: a list of at most {MAX_WATCHED} integers from 1 to 2**63-1"
            )
            return
        rows = await database_sync_to_async(_rows)(pks)
        await self.send_json({"type": "snapshot", "instances": rows})

    async def wf_instance(self, message: dict[str, Any]) -> None:
        """Changes are read in windows of LIST_COALESCE_SECONDS: one query for all the
        instances that changed in it, not one per change (a burst costs one read)."""
        self.pending[int(message["pk"])] = message.get("kind")
        if self.flush_task is None or self.flush_task.done():
            self.flush_task = asyncio.ensure_future(self.flush())

    async def flush(self) -> None:
        while self.pending:
            await asyncio.sleep(LIST_COALESCE_SECONDS)
            pending, self.pending = self.pending, {}
            for summary in await database_sync_to_async(_rows)(list(pending)):
                kind = pending[summary["pk"]]
                await self.send_json({"type": "instance.status", "kind": kind, "instance": summary})


def _rows(pks: list[int]) -> list[dashboard.InstanceSummaryJSON]:
    return [
        dashboard.instance_summary(r)
        for r in Instance.objects.only(*dashboard.ROW_FIELDS).filter(pk__in=pks)
    ]


class InstanceDetailConsumer(DashboardConsumer):
    """Everything that happens to one instance; the page re-fetches its live fragment."""

    def groups_for(self) -> list[str]:
        return [live.instance_group(self.pk)]

    async def snapshot(self) -> dict[str, Any] | None:
        self.pk = int(self.scope["url_route"]["kwargs"]["pk"])
        summary = await database_sync_to_async(_summary)(self.pk)
        return None if summary is None else {"type": "snapshot", "instance": summary}

    async def wf_instance(self, message: dict[str, Any]) -> None:
        summary = await database_sync_to_async(_summary)(self.pk)
        if summary is not None:
            await self.send_json(
                {"type": "instance.status", "kind": message.get("kind"), "instance": summary}
            )

    async def wf_step(self, message: dict[str, Any]) -> None:
        await self.send_json({"type": "step.written", "step": message.get("step")})
        if message.get("history"):
            await self.send_json({"type": "history.appended", "count": message["history"]})

    async def wf_span(self, message: dict[str, Any]) -> None:
        await self.send_json(
            {
                "type": "span.stored",
                "span_id": message.get("span_id"),
                "name": message.get("name"),
                "status": message.get("status"),
            }
        )

    async def wf_error(self, message: dict[str, Any]) -> None:
        await self.send_json(
            {
                "type": "error.recorded",
                "step": message.get("step"),
                "attempt": message.get("attempt"),
                "name": message.get("name"),
                "message": message.get("message"),
            }
        )
