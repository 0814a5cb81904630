"""Channels consumers: the engine's channel (`runworker workflows`) and the dashboard sockets.

A dashboard socket gets a full snapshot from the database on connect, then small typed
events (`instance.batch` on the list, `workflow.summary`, `instance.status`,
`step.written`, `history.appended`, `span.stored`, `error.recorded`, `bulk.progress`)
that this process's fan-out hub (fanout.py) hands it, each numbered in its stream, and a
`heartbeat` with the last number. A page that sees a number skipped sends `resync` and gets a new snapshot
(one at a time, at most one per RESYNC_MIN_SECONDS: more requests meanwhile are folded into the next).
Clients may only send `ping`, `resync` (and `watch` on the list); anything else gets an
`error` frame and changes nothing, and so does a flood (past CLIENT_FRAMES_BURST frames at
once, CLIENT_FRAMES_PER_SECOND after: dropped unread). A socket follows its session:
it closes (4403) on logout, and when its user may no longer view the dashboard, checked
whenever the user changes, every access.RECHECK_SECONDS, and on a client message with an
answer at most fanout.ACCESS_SHARED_SECONDS old. A user may hold
WFDASH["MAX_SOCKETS_PER_USER"] sockets open at once (socket_slots.py); one more is closed
with CLOSE_TOO_MANY_SOCKETS (4429) and an `error` frame saying so.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable
from typing import Any

from channels.consumer import AsyncConsumer
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from . import access, dashboard, fanout, live, socket_slots
from .converters import MAX_PK
from .engine.worker import notify_local
from .models import Instance

log = logging.getLogger("workflows_app.consumers")

MAX_CLIENT_FRAME = 8192  # bytes of UTF-8; clients only send tiny control messages
MAX_WATCHED = 500  # rows a list page may ask about (a page shows 50)
# A page's own requests for a snapshot (`resync`, a list's `watch`) start a read at most
# this often; those that come meanwhile are folded into one, read when it is due. A page
# asks only when it saw a gap, so this costs a real page nothing; a forged flood of
# frames costs a snapshot per interval, not one per frame.
RESYNC_MIN_SECONDS = 1.0
# A page sends a frame when it navigates or sees a gap; a socket's client may send
# CLIENT_FRAMES_BURST at once and CLIENT_FRAMES_PER_SECOND after that. Frames past it (a
# runaway or forged page) are dropped unread: the first of a run gets an error frame.
CLIENT_FRAMES_BURST = 60
CLIENT_FRAMES_PER_SECOND = 20.0
# A socket joins its session's and its user's groups again this often: both layers drop
# a membership after their group_expiry (a day), and a socket open longer (a wall
# display) no longer heard its logout or its user's rights change at once.
REJOIN_SECONDS = 3600.0
CLOSE_INTERNAL_ERROR = 1011
CLOSE_FORBIDDEN = 4403
CLOSE_NOT_FOUND = 4404
CLOSE_TOO_MANY_SOCKETS = 4429  # the user has WFDASH["MAX_SOCKETS_PER_USER"] open already


class UnknownPathConsumer(AsyncJsonWebsocketConsumer):
    """Any other WebSocket path: refused at the handshake (the router would answer a 500)."""

    async def connect(self) -> None:
        await self.close(code=CLOSE_NOT_FOUND)


class EngineConsumer(AsyncConsumer):
    """Receives hints on the `workflows` channel and passes them to this process's workers."""

    async def wf_hint(self, message: dict[str, Any]) -> None:
        notify_local(str(message.get("kind", "wake")), message.get("pk"))


def frame_too_large(text: str) -> bool:
    """Whether a text frame is over MAX_CLIENT_FRAME bytes of UTF-8. A character is 1 to 4
    bytes, so only a frame whose length in characters leaves it in doubt is encoded (a
    huge one is refused without copying it). A lone surrogate (no UTF-8 for it; daphne
    delivers none) counts its three bytes rather than failing the socket."""
    if len(text) > MAX_CLIENT_FRAME:
        return True
    if len(text) * 4 <= MAX_CLIENT_FRAME:
        return False
    return len(text.encode("utf-8", "surrogatepass")) > MAX_CLIENT_FRAME


def _summary(pk: int) -> dashboard.InstanceSummaryJSON | None:
    row = Instance.objects.only(*dashboard.ROW_FIELDS).filter(pk=pk).first()
    return None if row is None else dashboard.instance_summary(row)


class DashboardConsumer(AsyncJsonWebsocketConsumer):
    """Base: staff-only sockets that subscribe to a stream of this process's fan-out hub,
    send a snapshot, then relay what the hub hands them (numbered: see fanout.py)."""

    client_types: frozenset[str] = frozenset({"ping", "resync"})
    ended = False  # closed for lost access: send nothing more, even what is already queued
    holds_slot = False  # counted in its user's open sockets (socket_slots)
    recheck_task: asyncio.Task[None] | None = None
    hub: fanout.Hub | None = None
    # Messages the hub delivered while the snapshot was being read: sent after it.
    backlog: list[tuple[int, str]] | None = None
    # The page's requests for a snapshot: one task takes them (see RESYNC_MIN_SECONDS).
    snapshot_wanted = False
    requested_snapshots: asyncio.Task[None] | None = None
    requested_snapshot_at = -float("inf")  # loop time the last one's read began
    # The client's frames it may still send now (see CLIENT_FRAMES_BURST), as of frames_at.
    frames_left = 0.0
    frames_at: float | None = None  # None: no frame yet, the whole burst is left
    joined_at = 0.0  # monotonic() the socket last joined its groups
    dropping = False  # frames are being dropped; the page was told at the first
    monotonic = staticmethod(time.monotonic)  # tests control it

    def stream(self) -> str:
        raise NotImplementedError

    async def snapshot(self) -> dict[str, Any] | None:
        """The full state the page shows; None refuses the socket (e.g. unknown instance)."""
        raise NotImplementedError

    async def connect(self) -> None:
        user = self.scope.get("user")
        self.session_key = getattr(self.scope.get("session"), "session_key", None)
        if not self.session_key or not getattr(user, "is_authenticated", False):
            await self.close(code=CLOSE_FORBIDDEN)
            return
        self.user_pk = user.pk
        # Counted before anything is joined or read: a socket past the cap costs a look-up.
        if not socket_slots.connect_allowed(self.user_pk):
            await self.refuse_too_many(
                f"too many dashboard sockets opened by this user: {socket_slots.connect_burst()} "
                f"at once and {socket_slots.CONNECTS_PER_SECOND:g} a second after that",
                "too many connects",
            )
            return
        if not await socket_slots.take(self.channel_layer, self.user_pk, self):
            cap = socket_slots.max_sockets_per_user()
            await self.refuse_too_many(
                f"too many dashboard sockets open for this user: at most {cap} "
                '(WFDASH["MAX_SOCKETS_PER_USER"]); close some dashboard pages',
                f"at most {cap} sockets per user",
            )
            return
        self.holds_slot = True
        try:
            snapshot = await self.join_and_read(user)
        except BaseException:  # the database is down: nothing may keep a dead socket
            await self.leave_all()
            raise
        if snapshot is None:
            await self.leave_all()
            await self.close(code=CLOSE_FORBIDDEN)
            return
        await self.accept()
        await self.send_snapshot(snapshot, snapshot["seq"])
        self.recheck_task = asyncio.ensure_future(self.recheck_periodically())

    async def join_and_read(self, user: Any) -> dict[str, Any] | None:
        """Join the socket's groups and its hub stream and read its snapshot; None if the
        user may not view it (or it does not exist)."""
        # Joined before the access check: a logout or a permission change announced from
        # now on reaches this socket (wf_logout / wf_access run once connect returns).
        # A project without CHANNEL_LAYERS (one process, nothing to hear from others) joins
        # none: its periodic access re-check alone ends a socket whose access went.
        if self.channel_layer is not None:
            self.groups = [live.session_group(self.session_key), live.user_group(self.user_pk)]
            await self.join_groups()
        if not await database_sync_to_async(access.may_view)(user):
            return None
        self.backlog = []
        self.hub = fanout.hub()
        # Subscribed before the snapshot is read: nothing that changes after it is missed.
        seq = await self.hub.subscribe(self, self.stream())
        snapshot = await self.snapshot()
        return None if snapshot is None else {**snapshot, "seq": seq}

    async def join_groups(self) -> None:
        for group in self.groups:
            await self.channel_layer.group_add(group, self.channel_name)
        self.joined_at = self.monotonic()

    async def leave_all(self) -> None:
        """A refused or failed connect leaves its hub stream and its groups now. No
        disconnect follows a connect that raised (the server drops the consumer), and over
        Redis a group membership left behind stayed for the layer's group_expiry, a day:
        every group_send to the user or the session went on pushing to a dead channel."""
        await self.release_slot()
        await self.leave_hub()
        groups, self.groups = self.groups, []
        for group in groups:
            try:
                await self.channel_layer.group_discard(group, self.channel_name)
            except Exception:  # the layer is down: its memberships expire with it
                log.warning("could not leave a refused socket's group", exc_info=True)

    async def refuse_too_many(self, error: str, reason: str) -> None:
        """Accepted only to say why: a handshake refused gives the page no code, and it
        would take the refusal for a network failure. The page retries slowly."""
        await self.accept()
        await self.reject(error)
        await self.close(code=CLOSE_TOO_MANY_SOCKETS, reason=reason)

    async def release_slot(self) -> None:
        if self.holds_slot:
            self.holds_slot = False
            await socket_slots.release(self.channel_layer, self.user_pk, self)

    async def send_snapshot(self, snapshot: dict[str, Any], seq: int) -> None:
        """The snapshot says which message of the stream it includes; delivered ones it
        includes are not sent again."""
        await self.send_json({**snapshot, "seq": seq})
        backlog, self.backlog = self.backlog or [], None
        for message_seq, text in backlog:
            if message_seq > seq:
                await self.send_text(text)

    async def deliver(self, seq: int, text: str) -> None:
        """From the hub: one message of this socket's stream, already serialized."""
        if self.backlog is not None:
            self.backlog.append((seq, text))
        else:
            await self.send_text(text)

    async def send_text(self, text: str) -> None:
        if not self.ended:
            await self.send(text_data=text)

    async def leave_hub(self) -> None:
        hub, self.hub = self.hub, None
        if hub is not None:
            await hub.unsubscribe(self, self.stream())

    async def still_allowed(self) -> bool:
        return await database_sync_to_async(access.session_may_view)(self.session_key, self.user_pk)

    async def may_still_view(self) -> bool:
        """A client message's access check: the session's answer as the hub read it in the
        last fanout.ACCESS_SHARED_SECONDS, on the hub's own thread. Read afresh for every
        frame, it cost four queries on the thread every synchronous view waits for, and a
        page's (or a forged) flood of frames held up every page of the process. A change
        the signals report closes the socket at once (wf_access, wf_logout); one they do
        not, at the first message after that many seconds, or at the periodic re-check."""
        hub = self.hub
        if hub is None:
            return await self.still_allowed()
        return await hub.session_may_view(
            self.session_key, self.user_pk, fanout.ACCESS_SHARED_SECONDS
        )

    async def recheck_periodically(self) -> None:
        shared = min(fanout.ACCESS_SHARED_SECONDS, access.RECHECK_SECONDS / 2)
        while not self.ended:
            await asyncio.sleep(access.RECHECK_SECONDS - shared)
            await socket_slots.renew(self.channel_layer, self.user_pk, self)
            if self.monotonic() - self.joined_at >= REJOIN_SECONDS:
                try:
                    await self.join_groups()
                except Exception:  # the layer is down: the next round tries again
                    log.warning("could not renew a dashboard socket's groups", exc_info=True)
            hub = self.hub
            if hub is None:
                continue
            check = hub.session_may_view(self.session_key, self.user_pk, shared)
            if await self.checked(check) is False:
                await self.end()

    async def checked(self, check: Awaitable[bool]) -> bool | None:
        """An access check's answer; None if the database did not give one (it is down or
        failing over). The socket then stays as it is and the next check asks again:
        raised, the failure ended the consumer without its disconnect (the hub kept it
        subscribed for the life of the process) or the periodic re-check's task."""
        try:
            return await check
        except Exception:
            log.warning("could not check a dashboard socket's access", exc_info=True)
            return None

    async def wf_access(self, message: dict[str, Any]) -> None:
        """The user changed: close unless they may still view (read afresh, not shared;
        if that fails, the periodic re-check decides)."""
        if not self.ended and await self.checked(self.still_allowed()) is False:
            await self.end()

    async def wf_logout(self, message: dict[str, Any]) -> None:
        await self.end()

    async def end(self) -> None:
        self.ended = True
        await self.leave_hub()
        await self.close(code=CLOSE_FORBIDDEN)

    async def send_json(self, content: Any, close: bool = False) -> None:
        if not self.ended:
            await super().send_json(content, close)

    async def disconnect(self, code: int) -> None:
        # The slot first: leaving the hub may wait (its last socket stops it), and a
        # disconnect the server cuts short must not count against the user for good.
        await self.release_slot()
        for task in (self.recheck_task, self.requested_snapshots):
            if task is not None:
                task.cancel()
        await self.leave_hub()

    async def receive(
        self, text_data: str | None = None, bytes_data: bytes | None = None, **kwargs: Any
    ) -> None:
        if self.ended:
            return  # closed already: what the page sent meanwhile is dropped
        if not self.frame_allowed():
            if not self.dropping:
                self.dropping = True
                await self.reject(
                    f"too many messages: at most {CLIENT_FRAMES_BURST} at once and "
                    f"{CLIENT_FRAMES_PER_SECOND:g} a second; this one and those after it "
                    "are dropped until the rate falls"
                )
            return
        self.dropping = False
        allowed = await self.checked(self.may_still_view())
        if allowed is None:
            await self.reject("could not check access just now; this message was not handled")
        elif not allowed:
            await self.end()
        elif text_data is None:
            await self.reject("binary frames are not accepted")
        elif frame_too_large(text_data):
            await self.reject(f"frame larger than {MAX_CLIENT_FRAME} bytes")
        else:
            try:
                content = json.loads(text_data)
            except (ValueError, RecursionError):
                await self.reject("frame is not JSON (or is nested too deeply)")
                return
            await self.receive_json(content)

    def frame_allowed(self) -> bool:
        """Take one of the client's frames from its allowance (a token bucket)."""
        now = self.monotonic()
        refilled = (
            CLIENT_FRAMES_BURST
            if self.frames_at is None
            else self.frames_left + (now - self.frames_at) * CLIENT_FRAMES_PER_SECOND
        )
        self.frames_left = min(float(CLIENT_FRAMES_BURST), refilled)
        self.frames_at = now
        if self.frames_left < 1:
            return False
        self.frames_left -= 1
        return True

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        kind = content.get("type") if isinstance(content, dict) else None
        # A str first: a list or an object as "type" is unhashable, and the set lookup
        # raised: a forged frame ended the consumer instead of getting an error frame.
        if not isinstance(kind, str) or kind not in self.client_types:
            await self.reject(f"unknown message; this socket accepts {sorted(self.client_types)}")
        elif kind == "ping":
            await self.send_json({"type": "pong"})
        elif kind == "resync":
            self.request_snapshot()
        else:
            await self.handle_client(content)

    def request_snapshot(self) -> None:
        """The page asked for a snapshot. One task per socket reads them, one at a time and
        at most one per RESYNC_MIN_SECONDS; requests that come while one is read or before
        the next is due are folded into that next one, which reads the state (and a list's
        watched rows) as they are when it begins."""
        self.snapshot_wanted = True
        if self.requested_snapshots is None or self.requested_snapshots.done():
            self.requested_snapshots = asyncio.ensure_future(self.read_requested_snapshots())

    async def read_requested_snapshots(self) -> None:
        loop = asyncio.get_running_loop()
        while self.snapshot_wanted and not self.ended:
            due = self.requested_snapshot_at + RESYNC_MIN_SECONDS - loop.time()
            if due > 0:
                await asyncio.sleep(due)
            self.snapshot_wanted = False
            self.requested_snapshot_at = loop.time()
            try:
                await self.resync()
            except Exception:
                # As a failed read on connect does: the page reconnects, and reads its
                # snapshot then (the hub's messages held meanwhile went on: resync()).
                log.warning(
                    "could not read a dashboard snapshot; closing the socket", exc_info=True
                )
                await self.close(code=CLOSE_INTERNAL_ERROR)
                return

    async def resync(self) -> None:
        """A fresh snapshot: the page noticed a gap in the stream's numbers, or its hub
        learnt that messages may have been dropped. Messages the hub delivers while it is
        read wait and follow it, as on connect (sent before it, the snapshot's older
        number made the page see a gap and ask again)."""
        if self.hub is None or self.backlog is not None:
            return  # a snapshot is being read already
        self.backlog = []
        snapshot = None
        try:
            seq = self.hub.seq(self.stream())
            snapshot = await self.snapshot()
        finally:
            if snapshot is None:  # gone, or the read failed: what was held goes on as is
                backlog, self.backlog = self.backlog, None
                for _, text in backlog:
                    await self.send_text(text)
        if snapshot is not None:
            await self.send_snapshot(snapshot, seq)

    async def handle_client(self, content: dict[str, Any]) -> None:
        await self.reject("unsupported message")

    async def reject(self, reason: str) -> None:
        await self.send_json({"type": "error", "error": reason})


class OverviewConsumer(DashboardConsumer):
    """Per-workflow summaries; the hub reads each workflow once per window for every socket."""

    def stream(self) -> str:
        return fanout.OVERVIEW_STREAM

    async def snapshot(self) -> dict[str, Any]:
        summaries = await database_sync_to_async(dashboard.workflow_summaries)()
        return {"type": "snapshot", "workflows": [s.as_json() for s in summaries]}


class InstanceListConsumer(DashboardConsumer):
    """Status changes of any instance, in batches; the page updates its rows and
    prepends new ones."""

    client_types = frozenset({"ping", "resync", "watch"})
    watched: list[int] | None = None  # the rows the page said it shows

    def stream(self) -> str:
        return fanout.LIST_STREAM

    async def snapshot(self) -> dict[str, Any]:
        if self.watched is not None:
            rows = await database_sync_to_async(_rows)(self.watched)
            return {"type": "snapshot", "instances": rows}
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
        self.watched = pks
        self.request_snapshot()


class BulkJobConsumer(DashboardConsumer):
    """One bulk job's progress for the list page's progress bar (which polls without it)."""

    def stream(self) -> str:
        return fanout.bulk_job_stream(int(self.scope["url_route"]["kwargs"]["pk"]))

    async def snapshot(self) -> dict[str, Any] | None:
        pk = int(self.scope["url_route"]["kwargs"]["pk"])
        jobs = await database_sync_to_async(fanout.read_bulk_jobs)([pk])
        return {"type": "snapshot", "job": jobs[0]} if jobs else None


def _rows(pks: list[int]) -> list[dashboard.InstanceSummaryJSON]:
    return [
        dashboard.instance_summary(r)
        for r in Instance.objects.only(*dashboard.ROW_FIELDS).filter(pk__in=pks)
    ]


class InstanceDetailConsumer(DashboardConsumer):
    """Everything that happens to one instance; the page re-fetches its live fragment."""

    def stream(self) -> str:
        return fanout.instance_stream(int(self.scope["url_route"]["kwargs"]["pk"]))

    async def snapshot(self) -> dict[str, Any] | None:
        pk = int(self.scope["url_route"]["kwargs"]["pk"])
        summary = await database_sync_to_async(_summary)(pk)
        return None if summary is None else {"type": "snapshot", "instance": summary}
