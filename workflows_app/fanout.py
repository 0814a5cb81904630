"""One reader per serving process feeds every dashboard socket in it.

Sockets neither read the database per change nor join the channel layer's busy groups
themselves: the process's Hub joins those groups once, tails the history table (so
changes made by other processes — a `wf` command, a shell, the admin, another server —
reach open pages even when no channel-layer message carried them), reads each short
window's changed instances in one query, and hands every socket the same serialized
message. Messages of a stream carry a sequence number and a heartbeat repeats the last
one, so a page that missed a message notices and asks for a snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from channels.layers import get_channel_layer
from django.db import connections
from django.db.models import Max, Q

from . import access, dashboard, live
from .models import HistoryRecord, Instance, Status

log = logging.getLogger("workflows_app.fanout")

WINDOW_SECONDS = 0.05  # instances that change within it are read in one query
# A busy hub starts its flushes at least BUSY_FACTOR times what the last one took to read
# and send apart (up to MAX_WINDOW_SECONDS): sending every socket a frame per change would
# take the event loop, which also serves the API and the pages (and the frames' writes
# after the flush cost as much again). A change after a quiet spell waits WINDOW_SECONDS.
BUSY_FACTOR = 20.0
MAX_WINDOW_SECONDS = 0.4
OVERVIEW_WINDOW_SECONDS = 0.25  # one summary per workflow per window, however busy it is
# The overview's counts are a scan of the instance table (287-480 ms at 1M instances): its
# reads start at least BUSY_FACTOR times what the last one took apart, up to this (one
# open overview took a core at 1M instances re-reading four times a second).
MAX_OVERVIEW_WINDOW_SECONDS = 5.0
TAIL_SECONDS = 0.25  # how often the history table is tailed while a socket is open
# With a cross-process layer (Redis) the hub does not take the overview group's message
# per change: receiving one through channels_redis costs several Redis round trips on the
# event loop that serves the pages and the API (with 200 list sockets open it cut the API's
# create rate by a quarter). The tail, an indexed read of the history rows past the last
# seen id, is cheaper at this pace and carries the same changes.
FAST_TAIL_SECONDS = 0.05
# A run that parks (running -> waiting) writes no history row: without the engine's
# message, the hub reads instances it last saw running again until they stop, first
# after FOLLOW_SECONDS, then twice as long each time up to MAX_FOLLOW_SECONDS (a short
# run's park shows at once; a fleet's long steps are not read four times a second).
FOLLOW_SECONDS = 0.25
MAX_FOLLOW_SECONDS = 2.0
MAX_FOLLOWED = 5000
UNSETTLED = frozenset({Status.RUNNING, Status.COMPENSATING})
TAIL_BATCH = 2000  # history rows per tail query; a full batch is followed at once
GAP_SECONDS = 10.0  # how long an id the tail skipped is looked for (PostgreSQL commits
# transactions out of id order: a lower id can become visible after a higher one)
MAX_GAPS = 1000
HEARTBEAT_SECONDS = 5.0
# A resync after live.PAGES_TRUST_SECONDS waits this much more for messages sent just
# before that time ran out (a sender gathers them for 5 ms).
PAGES_RESYNC_MARGIN_SECONDS = 0.5
PAGES_MARK_TIMEOUT_SECONDS = 2.0  # a hung Redis does not hold up a socket's connect
PAGES_MADE_UNKNOWN = -1  # no key is made at this time: the next mark finds another
REJOIN_SECONDS = 60.0  # group memberships are renewed: both layers expire them
MAX_REMEMBERED = 20_000  # instances whose last pushed state is kept, to skip repeats
RETRY_SECONDS = 1.0  # after a failed read (database restarting)
# The periodic access check's answer is shared by the sockets of one session for this
# long (they were mostly opened together and re-check together); sockets re-check every
# access.RECHECK_SECONDS minus it, so a change no signal reported still closes them in time.
ACCESS_SHARED_SECONDS = 5.0

# Bulk jobs followed by a page are read at least this often while unfinished: a worker
# in another process announces its batches only through a cross-process layer (Redis).
BULK_READ_SECONDS = 0.25

# The largest frame a stream's message may be (bytes: json.dumps writes ASCII). A list
# socket's batch carries every instance that changed in a window, ~250 bytes each (up to
# ~4 KiB with long non-ASCII names and error names), however many: a herd of thousands
# changing at once made a frame of megabytes, sent to every list page, and past 1 MiB
# refused by clients that cap a message there (the websockets library's default). Past
# this, the stream's message is a `resync` instead, of the same number: each page asks
# for a snapshot of the rows it shows, as on a lost message (dashboard.js).
MAX_FRAME_BYTES = 256 * 1024

LIST_STREAM = "instances"
OVERVIEW_STREAM = "overview"

T = TypeVar("T")


INSTANCE_STREAM_PREFIX = "instance."


def instance_stream(pk: int) -> str:
    return f"{INSTANCE_STREAM_PREFIX}{pk}"


def bulk_job_stream(pk: int) -> str:
    return f"bulk.{pk}"


class Subscriber(Protocol):
    async def deliver(self, seq: int, text: str) -> None: ...

    async def resync(self) -> None:
        """Send the page its whole state again (a fresh snapshot)."""


# The hub's reads run in one thread that keeps its database connection open: asgiref's
# database_sync_to_async closes the connection after every call (CONN_MAX_AGE=0), and a
# fresh connection per read cost more than the read.
_reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wfdash-fanout")


def _read_in_thread(fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    except Exception:
        connections.close_all()  # a broken connection is replaced on the next read
        raise


def close_reader_connections() -> None:
    """Close the reader thread's connection (tests do before dropping their database)."""
    _reader.submit(connections.close_all).result(10)


def latest_history_id() -> int:
    return HistoryRecord.objects.aggregate(last=Max("id"))["last"] or 0


def history_after(after: int, gaps: list[int]) -> list[tuple[int, int, str]]:
    """(id, instance pk, type) of history rows past the tail's position or in its gaps:
    the primary key index serves it."""
    where = Q(id__gt=after) | Q(id__in=gaps) if gaps else Q(id__gt=after)
    return list(
        HistoryRecord.objects.filter(where)
        .order_by("id")
        .values_list("id", "instance_id", "type")[:TAIL_BATCH]
    )


def read_rows(pks: list[int]) -> list[Instance]:
    return list(Instance.objects.only(*dashboard.ROW_FIELDS, "history_seq").filter(pk__in=pks))


def read_bulk_jobs(pks: list[int]) -> list[dict[str, Any]]:
    """The progress JSON (as GET …/bulk-jobs/<id>/ answers) of those that exist."""
    from .client import BulkJobHandle
    from .engine import errors
    from .surfaces import bulk_job_json

    jobs = []
    for pk in pks:
        try:
            jobs.append(bulk_job_json(BulkJobHandle.find(pk)))
        except errors.BulkJobNotFound:
            continue
    return jobs


def read_workflow_summaries(names: set[str]) -> list[dashboard.WorkflowSummaryJSON]:
    """The changed workflows' cards, read together: one scan, not one per workflow."""
    return [s.as_json() for s in dashboard.workflow_summaries(among=names)]


def counted(summary: Mapping[str, Any]) -> tuple[Any, Any]:
    """What of an instance its workflow's overview card counts: its status, and when it
    finished (the hour's chart). A step's write changes neither: the card is not read
    again for it (it was, for every change of every running instance)."""
    return summary["status"], summary["finished_at"]


def overview_window(spent: float) -> float:
    """How long after a read of the overview's cards the next one starts, at the soonest."""
    return min(MAX_OVERVIEW_WINDOW_SECONDS, max(OVERVIEW_WINDOW_SECONDS, BUSY_FACTOR * spent))


class Hub:
    """The process's one listener, reader and sender for its dashboard sockets (one
    event loop: daphne's). Runs while at least one socket is subscribed."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.streams: dict[str, set[Subscriber]] = {}
        self.seqs: dict[str, int] = {}
        self.dirty: dict[int, str | None] = {}  # pk -> the latest kind of change
        # pk -> its workflow, as the engine's message named it: a deleted instance's card
        # is read again although its row is gone
        self.workflow_of: dict[int, str] = {}
        self.relayed: set[int] = set()  # pks whose pages were sent a step since their read
        self.dirty_workflows: set[str] = set()
        # pk -> (summary as sent, history_seq): a change already pushed is not pushed again
        self.pushed: OrderedDict[int, tuple[str, int]] = OrderedDict()
        self.changed = asyncio.Event()
        self.workflows_changed = asyncio.Event()
        self.bulk_changed = asyncio.Event()
        # job pk -> (its progress JSON as last sent, done): a finished job is not read again
        self.bulk_pushed: dict[int, tuple[str, bool]] = {}
        self.tasks: list[asyncio.Task[None]] = []
        # See keep_pages_open: the key's making time last seen (None before the first
        # mark, PAGES_MADE_UNKNOWN after a failed one), a resync to run.
        self.pages_made: int | None = None
        self.resync_pending = False
        self.resyncing: asyncio.Task[None] | None = None
        self.channel: str | None = None
        self.joined: set[str] = set()
        self.after = 0  # the tail's position: the highest history id seen
        self.tail_seconds = FAST_TAIL_SECONDS
        self.hears_every_change = False  # the engine's messages reach this process
        self.following: dict[int, tuple[float, float]] = {}  # pk -> (when, interval)
        self.gaps: dict[int, float] = {}  # history id -> when to stop looking for it
        self.lock = asyncio.Lock()
        self.running = False
        # (session key, user pk) -> (monotonic time, the access check's answer)
        self.access: dict[tuple[str, Any], tuple[float, bool]] = {}

    # --- subscriptions --------------------------------------------------------------

    def seq(self, stream: str) -> int:
        return self.seqs.get(stream, 0)

    async def subscribe(self, subscriber: Subscriber, stream: str) -> int:
        """Start delivering the stream to the subscriber; returns its sequence now."""
        async with self.lock:
            if not self.running:
                await self.start()
            self.streams.setdefault(stream, set()).add(subscriber)
            group = self.group_of(stream)
            if group is not None and group not in self.joined:
                await self.join(group)
        return self.seq(stream)

    async def unsubscribe(self, subscriber: Subscriber, stream: str) -> None:
        async with self.lock:
            subscribers = self.streams.get(stream, set())
            subscribers.discard(subscriber)
            if subscribers:
                return
            self.streams.pop(stream, None)
            # Nothing is numbered for a stream nobody follows; a page that opens it again
            # gets its snapshot with the number as it then is (0).
            self.seqs.pop(stream, None)
            group = self.group_of(stream)
            if group is not None and group in self.joined:
                await self.leave(group)
            if not self.streams and self.running:
                await self.stop()

    @staticmethod
    def group_of(stream: str) -> str | None:
        if stream.startswith(INSTANCE_STREAM_PREFIX):
            return live.instance_group(int(stream.removeprefix(INSTANCE_STREAM_PREFIX)))
        if stream.startswith("bulk."):
            return live.bulk_job_group(int(stream.removeprefix("bulk.")))
        return None

    async def join(self, group: str) -> None:
        layer = get_channel_layer()
        if layer is not None and self.channel is not None:
            await layer.group_add(group, self.channel)
        self.joined.add(group)

    async def leave(self, group: str) -> None:
        self.joined.discard(group)
        layer = get_channel_layer()
        if layer is not None and self.channel is not None:
            with contextlib.suppress(Exception):
                await layer.group_discard(group, self.channel)

    # --- life -----------------------------------------------------------------------

    async def start(self) -> None:
        live.bind_socket_loop()
        self.running = True
        layer = get_channel_layer()
        if layer is not None:
            # The default prefix: channels_redis receives every process-local channel of a
            # layer through one Redis key, named by it.
            self.channel = await layer.new_channel()
            # In process a message is a call: take every change's. Across processes the
            # group carries deletions only (the tail finds every other change).
            await self.join(live.OVERVIEW_GROUP)
            if live.is_in_process(layer):
                self.tail_seconds = TAIL_SECONDS
                self.hears_every_change = True
            else:
                await self.keep_pages_open()
        self.after = await self.read(latest_history_id)
        self.tasks = [
            asyncio.ensure_future(loop())
            for loop in (
                self.listen,
                self.flush,
                self.flush_workflows,
                self.follow_bulk_jobs,
                self.tail,
                self.heartbeat,
            )
        ]

    async def keep_pages_open(self) -> None:
        """Over Redis: keep live.PAGES_KEY alive while this hub serves sockets. Other
        processes may have dropped page messages until live.PAGES_TRUST_SECONDS after the
        key was made: if it was made since this hub last saw it (it had expired, or Redis
        lost it), or at its first mark less than those seconds (and a margin) ago, or if a
        mark failed, every instance page here is sent its snapshot again once they pass."""
        try:
            marked = await asyncio.wait_for(
                live.mark_pages_open(get_channel_layer()), PAGES_MARK_TIMEOUT_SECONDS
            )
        except Exception:
            log.warning("could not mark the dashboard open in Redis", exc_info=True)
            self.pages_made = PAGES_MADE_UNKNOWN  # made without our hearing it, maybe
            return
        if marked is None:
            return
        made, age = marked
        if self.pages_made is None:
            dropped = age < live.PAGES_TRUST_SECONDS + PAGES_RESYNC_MARGIN_SECONDS
        else:
            dropped = made != self.pages_made
        self.pages_made = made
        if dropped:
            self.resync_pending = True
            if self.resyncing is None or self.resyncing.done():
                self.resyncing = asyncio.ensure_future(self.resync_later())

    async def resync_later(self) -> None:
        """Instance pages only: over Redis the lists and the overview come from the tail,
        and bulk jobs are read on a timer, whatever the engine's messages did."""
        while self.resync_pending:
            self.resync_pending = False  # a mark that finds a new key meanwhile: again
            await asyncio.sleep(live.PAGES_TRUST_SECONDS + PAGES_RESYNC_MARGIN_SECONDS)
            for stream, subscribers in list(self.streams.items()):
                if not stream.startswith(INSTANCE_STREAM_PREFIX):
                    continue
                for subscriber in list(subscribers):
                    try:
                        await subscriber.resync()
                    except Exception:  # a socket closing meanwhile
                        log.debug("could not resync a socket", exc_info=True)

    async def stop(self) -> None:
        self.running = False
        self.pages_made = None  # a hub started again judges the key by its age
        if self.resyncing is not None:
            self.resyncing.cancel()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks = []
        for group in list(self.joined):
            await self.leave(group)
        self.channel = None
        await self.loop.run_in_executor(_reader, connections.close_all)

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.loop.run_in_executor(_reader, _read_in_thread, fn, *args)

    async def forever(self, step: Callable[[], Any], what: str) -> None:
        """Repeat one step; a failure (database or layer down) is logged and retried."""
        while True:
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("dashboard %s failed; retrying", what, exc_info=True)
                await asyncio.sleep(RETRY_SECONDS)

    async def session_may_view(self, session_key: str, user_pk: Any, shared: float) -> bool:
        """The periodic access check of a socket, read on the hub's thread (its kept
        connection, not the thread every synchronous view waits for) and shared by the
        sockets of a session for `shared` seconds."""
        now = time.monotonic()
        key = (session_key, user_pk)
        cached = self.access.get(key)
        if cached is not None and now - cached[0] < shared:
            return cached[1]
        allowed = await self.read(access.session_may_view, session_key, user_pk)
        self.access = {k: v for k, v in self.access.items() if now - v[0] < shared}
        self.access[key] = (now, allowed)
        return allowed

    # --- sources: the channel layer and the history tail ----------------------------

    async def listen(self) -> None:
        layer = get_channel_layer()
        if layer is None or self.channel is None:
            return
        channel = self.channel

        async def one() -> None:
            await self.on_message(await layer.receive(channel))

        await self.forever(one, "listener")

    async def on_message(self, message: dict[str, Any]) -> None:
        kind, pk = message.get("type"), message.get("pk")
        if kind == "wf.pruned":
            self.mark_workflows(message.get("workflows"))
            return
        if not isinstance(pk, int):
            return
        if kind == "wf.instance":
            if isinstance(message.get("workflow"), str):
                self.workflow_of[pk] = message["workflow"]
            self.mark(pk, message.get("kind"))
            return
        if kind == "wf.bulk":
            self.bulk_changed.set()
            return
        page = page_message(message)
        stream = instance_stream(pk)
        if page is not None and stream in self.streams:
            self.relayed.add(pk)
            for item in page:
                await self.broadcast(stream, item)

    def mark_workflows(self, names: Any) -> None:
        """Workflows whose instances went without a row to read (a prune's batch): their
        overview cards are read again, in the next window."""
        if OVERVIEW_STREAM not in self.streams or not isinstance(names, list):
            return
        self.dirty_workflows.update(name for name in names if isinstance(name, str))
        self.workflows_changed.set()

    def mark(self, pk: int, kind: str | None, replace: bool = True) -> None:
        if replace or self.dirty.get(pk) is None:
            self.dirty[pk] = kind
        self.changed.set()

    async def tail(self) -> None:
        async def one() -> None:
            found = await self.read(history_after, self.after, sorted(self.gaps))
            self.advance(found)
            self.mark_followed()
            if len(found) < TAIL_BATCH:
                await asyncio.sleep(self.tail_seconds)

        await self.forever(one, "history tail")

    def advance(self, found: list[tuple[int, int, str]]) -> None:
        """Move the tail past what it found, remembering ids it skipped for a while."""
        now = time.monotonic()
        for history_id, pk, kind in found:
            if history_id in self.gaps:
                del self.gaps[history_id]
            elif history_id > self.after:
                for missing in range(max(self.after + 1, history_id - MAX_GAPS), history_id):
                    self.gaps[missing] = now + GAP_SECONDS
                self.after = history_id
            self.mark(pk, kind, replace=False)  # an in-process kind says more
        for history_id, until in list(self.gaps.items()):
            if until < now:
                del self.gaps[history_id]
        while len(self.gaps) > MAX_GAPS:
            del self.gaps[min(self.gaps)]

    def follow(self, row: Instance) -> None:
        """Remember to read a running instance again: its parking leaves no history row."""
        if self.hears_every_change or row.status not in UNSETTLED:
            self.following.pop(row.pk, None)
        elif row.pk not in self.following and len(self.following) < MAX_FOLLOWED:
            self.following[row.pk] = (time.monotonic() + FOLLOW_SECONDS, FOLLOW_SECONDS)

    def mark_followed(self) -> None:
        now = time.monotonic()
        for pk, (due, interval) in list(self.following.items()):
            if due <= now:
                longer = min(interval * 2, MAX_FOLLOW_SECONDS)
                self.following[pk] = (now + longer, longer)
                self.mark(pk, None, replace=False)

    # --- the reads and what they send -----------------------------------------------

    async def flush(self) -> None:
        window, last_start = WINDOW_SECONDS, -float("inf")

        async def one() -> None:
            nonlocal window, last_start
            await self.changed.wait()
            self.changed.clear()
            # The window spaces flushes' starts: it delays a change only while changes
            # keep coming, not one after a quiet spell.
            since_last = time.perf_counter() - last_start
            await asyncio.sleep(max(WINDOW_SECONDS, window - since_last))
            last_start = time.perf_counter()
            await self.flush_window()
            spent = time.perf_counter() - last_start
            window = min(MAX_WINDOW_SECONDS, max(WINDOW_SECONDS, BUSY_FACTOR * spent))

        await self.forever(one, "instance reader")

    async def flush_window(self) -> None:
        dirty, self.dirty = self.dirty, {}
        relayed, self.relayed = self.relayed, set()
        workflow_of, self.workflow_of = self.workflow_of, {}
        everyone = LIST_STREAM in self.streams or OVERVIEW_STREAM in self.streams
        pks = [pk for pk in dirty if everyone or instance_stream(pk) in self.streams]
        if not pks:
            return
        changes = []
        rows = await self.read(read_rows, pks)
        for gone in set(pks).difference(row.pk for row in rows):
            self.following.pop(gone, None)  # deleted meanwhile
            before = self.pushed.pop(gone, None)
            workflow = workflow_of.get(gone) or (
                json.loads(before[0])["workflow"] if before else None
            )
            if workflow:
                self.dirty_workflows.add(workflow)  # its card counts one instance fewer
        for row in rows:
            self.follow(row)
            summary = dashboard.instance_summary(row)
            text = json.dumps(summary, sort_keys=True)
            before = self.pushed.pop(row.pk, None)
            self.remember(row.pk, (text, row.history_seq))
            kind = dirty[row.pk]
            stream = instance_stream(row.pk)
            if before is None or before[0] != text:
                changes.append({"kind": kind, "instance": summary})
                if before is None or counted(json.loads(before[0])) != counted(summary):
                    self.dirty_workflows.add(row.workflow)
                if stream in self.streams:
                    await self.broadcast(
                        stream, {"type": "instance.status", "kind": kind, "instance": summary}
                    )
            elif row.history_seq > before[1] and row.pk not in relayed and stream in self.streams:
                await self.broadcast(
                    stream, {"type": "history.appended", "count": row.history_seq - before[1]}
                )
        if changes and LIST_STREAM in self.streams:
            await self.broadcast(LIST_STREAM, {"type": "instance.batch", "changes": changes})
        if self.dirty_workflows and OVERVIEW_STREAM in self.streams:
            self.workflows_changed.set()
        elif OVERVIEW_STREAM not in self.streams:
            self.dirty_workflows.clear()

    def remember(self, pk: int, state: tuple[str, int]) -> None:
        self.pushed[pk] = state
        while len(self.pushed) > MAX_REMEMBERED:
            self.pushed.popitem(last=False)

    async def flush_workflows(self) -> None:
        window, last_start = OVERVIEW_WINDOW_SECONDS, -float("inf")

        async def one() -> None:
            nonlocal window, last_start
            await self.workflows_changed.wait()
            self.workflows_changed.clear()
            since_last = time.perf_counter() - last_start
            await asyncio.sleep(max(OVERVIEW_WINDOW_SECONDS, window - since_last))
            names, self.dirty_workflows = self.dirty_workflows, set()
            if names and OVERVIEW_STREAM in self.streams:
                last_start = time.perf_counter()
                summaries = await self.read(read_workflow_summaries, names)
                window = overview_window(time.perf_counter() - last_start)
                for summary in summaries:
                    await self.broadcast(
                        OVERVIEW_STREAM, {"type": "workflow.summary", "workflow": summary}
                    )

        await self.forever(one, "overview reader")

    async def follow_bulk_jobs(self) -> None:
        """Followed bulk jobs are read when a batch is announced, and every
        BULK_READ_SECONDS without one, until done; a change is pushed as `bulk.progress`."""

        async def one() -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.bulk_changed.wait(), BULK_READ_SECONDS)
            self.bulk_changed.clear()
            await self.flush_bulk_jobs()

        await self.forever(one, "bulk job reader")

    async def flush_bulk_jobs(self) -> None:
        followed = {int(s.removeprefix("bulk.")) for s in self.streams if s.startswith("bulk.")}
        self.bulk_pushed = {pk: t for pk, t in self.bulk_pushed.items() if pk in followed}
        pks = sorted(pk for pk in followed if not self.bulk_pushed.get(pk, ("", False))[1])
        if not pks:
            return
        for job in await self.read(read_bulk_jobs, pks):
            text = json.dumps(job, sort_keys=True)
            if self.bulk_pushed.get(job["id"], ("", False))[0] != text:
                self.bulk_pushed[job["id"]] = (text, bool(job["done"]))
                await self.broadcast(
                    bulk_job_stream(job["id"]), {"type": "bulk.progress", "job": job}
                )

    # --- sending --------------------------------------------------------------------

    async def broadcast(self, stream: str, message: dict[str, Any]) -> None:
        """Serialize once, number it in its stream and hand it to every subscriber."""
        if stream not in self.streams:
            return  # its last page closed meanwhile (an await since the caller looked)
        seq = self.seqs[stream] = self.seq(stream) + 1
        text = json.dumps({**message, "seq": seq})
        if len(text) > MAX_FRAME_BYTES:
            log.info(
                "a %s message of %d bytes sent as a resync (MAX_FRAME_BYTES %d)",
                message.get("type"),
                len(text),
                MAX_FRAME_BYTES,
            )
            text = json.dumps({"type": "resync", "reason": "too large for one frame", "seq": seq})
        for subscriber in list(self.streams.get(stream, ())):
            try:
                await subscriber.deliver(seq, text)
            except Exception:  # a socket closing meanwhile; it is unsubscribed by its own close
                log.debug("could not deliver to a socket", exc_info=True)

    async def heartbeat(self) -> None:
        rejoined = time.monotonic()

        async def one() -> None:
            nonlocal rejoined
            await asyncio.sleep(HEARTBEAT_SECONDS)
            for stream, subscribers in list(self.streams.items()):
                seq = self.seq(stream)
                text = json.dumps({"type": "heartbeat", "seq": seq})
                for subscriber in list(subscribers):
                    with contextlib.suppress(Exception):
                        await subscriber.deliver(seq, text)
            if not self.hears_every_change:
                await self.keep_pages_open()
            if time.monotonic() - rejoined > REJOIN_SECONDS:
                rejoined = time.monotonic()
                for group in list(self.joined):
                    await self.join(group)

        await self.forever(one, "heartbeat")


def page_message(message: dict[str, Any]) -> list[dict[str, Any]] | None:
    """What an instance page is sent for an engine message of its instance."""
    kind = message.get("type")
    if kind == "wf.step":
        out = [{"type": "step.written", "step": message.get("step")}]
        if message.get("history"):
            out.append({"type": "history.appended", "count": message["history"]})
        return out
    if kind == "wf.span":
        return [
            {
                "type": "span.stored",
                "span_id": message.get("span_id"),
                "name": message.get("name"),
                "status": message.get("status"),
            }
        ]
    if kind == "wf.error":
        return [
            {
                "type": "error.recorded",
                "step": message.get("step"),
                "attempt": message.get("attempt"),
                "name": message.get("name"),
                "message": message.get("message"),
            }
        ]
    return None


_hub: Hub | None = None


def hub() -> Hub:
    """This event loop's hub (a test's loop ends with the test; daphne's lives on)."""
    global _hub
    loop = asyncio.get_running_loop()
    if _hub is None or _hub.loop is not loop:
        _hub = Hub()
    return _hub
