"""How changes travel: to this process's workers, to result() waiters, and to other
processes and dashboards through the channel layer. The only module that knows group names.

The channel layer is a lossy notifier: a lost message costs latency, never correctness,
because workers poll the database and dashboards re-read it on connect.
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from channels.exceptions import ChannelFull
from channels.layers import InMemoryChannelLayer, get_channel_layer

from .engine import store
from .engine.worker import notify_local

log = logging.getLogger("workflows_app.live")

WORKERS_GROUP = "wfdash.workers"
# Every instance status change (dashboard overview and instance list sockets).
OVERVIEW_GROUP = "wfdash.overview"

# The event loop the dashboard's sockets run in (daphne's). The in-memory channel layer is
# not thread-safe, so other threads hand their messages to this loop; see publish().
_socket_loop: asyncio.AbstractEventLoop | None = None
_in_flight: set[asyncio.Future[None]] = set()


class ResultWaiters:
    """Threads blocked in InstanceHandle.result() and history subscriptions (sync or
    async), by instance: woken when it changes.

    A result waits for the end only: a step's history wakes the history followers
    (every_change) and not it. Woken at each step, a result() re-read the instance row in
    the caller's thread while the engine ran the next step, and in a lone 10-step run each
    step waited for that read: 0.73 ms a step on SQLite, whose commit takes 0.012.

    An instance's entry goes when its last waiter does, so the registry holds only the
    waits in progress, however many instances were ever waited on.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # pk -> {event: whether it is woken by every change (history), not only the end's}
        self._by_instance: dict[int, dict[Any, bool]] = {}

    def _add(self, pk: int, event: Any, every_change: bool) -> None:
        with self._lock:
            self._by_instance.setdefault(pk, {})[event] = every_change

    def _remove(self, pk: int, event: Any) -> None:
        with self._lock:
            waiters = self._by_instance.get(pk, {})
            waiters.pop(event, None)
            if not waiters:
                self._by_instance.pop(pk, None)

    @contextmanager
    def waiting(self, pk: int, every_change: bool = False) -> Iterator[threading.Event]:
        event = threading.Event()
        self._add(pk, event, every_change)
        try:
            yield event
        finally:
            self._remove(pk, event)

    @asynccontextmanager
    async def awaiting(self, pk: int, every_change: bool = False) -> AsyncIterator[asyncio.Event]:
        """The async twin of waiting(): an asyncio.Event that wake() sets from any thread."""
        event = asyncio.Event()
        waker = _LoopWaker(asyncio.get_running_loop(), event)
        self._add(pk, waker, every_change)
        try:
            yield event
        finally:
            self._remove(pk, waker)

    def wake(self, pk: int | None, history_only: bool = False) -> None:
        """A change of the instance: every waiter hears it, or (history_only: records were
        appended, its state did not change) only those woken by every change."""
        if pk is None:
            return
        with self._lock:
            for event, every_change in self._by_instance.get(pk, {}).items():
                if every_change or not history_only:
                    event.set()

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_instance)


class _LoopWaker:
    """Sets an asyncio.Event in its own loop, from whatever thread wakes it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
        self.loop = loop
        self.event = event

    def set(self) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.event.set)


result_waiters = ResultWaiters()


def instance_group(pk: int) -> str:
    return f"wfdash.instance.{pk}"


def session_group(session_key: str) -> str:
    """The sockets of one login session (hashed: the key itself must not reach Redis)."""
    return "wfdash.session." + hashlib.sha256(session_key.encode()).hexdigest()[:40]


def user_group(pk: int) -> str:
    return f"wfdash.user.{pk}"


def workflow_group(name: str) -> str:
    return "wfdash.workflow." + "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:80]


def bulk_job_group(pk: int) -> str:
    return f"wfdash.bulk.{pk}"


def bulk_job_progressed(pk: int) -> None:
    """A batch of a bulk job committed: pages following the job read its progress now."""
    if not no_page_open():
        publish(bulk_job_group(pk), {"type": "wf.bulk", "pk": pk})


def is_in_process(layer: Any) -> bool:
    """Whether the layer is the in-memory one: its messages never leave this process."""
    return isinstance(layer, InMemoryChannelLayer)


def _cross_process_layer() -> Any:
    """The channel layer if it reaches other processes (Redis); None for the in-memory one."""
    layer = get_channel_layer()
    if layer is None or is_in_process(layer):
        return None
    return layer


# Whether a dashboard page is open anywhere, over a cross-process layer (Redis). Each
# process's fan-out hub keeps PAGES_KEY alive while it serves a socket; a process that
# publishes looks at the key every PAGES_LOOK_SECONDS (in its Sender's loop) and, while it
# is absent, builds no page messages: with no page open, a busy worker's updates cost it a
# Redis look-up per burst and its sender thread's time, for nobody. An absence is trusted
# for PAGES_TRUST_SECONDS from the start of the look that found it, never longer (a look
# that stalls means: publish), so a page that opens meanwhile misses at most that much;
# its hub sends its sockets their snapshots again once that has passed (fanout.Hub).
PAGES_KEY = "wfdash.pages-open"
PAGES_TTL_SECONDS = 15  # the hubs set it again every fanout.HEARTBEAT_SECONDS
PAGES_LOOK_SECONDS = 0.5
PAGES_TRUST_SECONDS = 1.0


class OpenPages:
    """This process's latest look at PAGES_KEY."""

    def __init__(self) -> None:
        self.absent_since: float | None = None  # time.monotonic() a look that found none began
        self.marked_at = -float("inf")  # time.monotonic() a hub here last set the key

    def none(self) -> bool:
        began = self.absent_since
        return began is not None and time.monotonic() - began < PAGES_TRUST_SECONDS

    def looked(self, began: float, found: bool) -> None:
        """A look that began before a hub here set the key says nothing of now."""
        if found or began < self.marked_at:
            self.absent_since = None
        else:
            self.absent_since = began


open_pages = OpenPages()


def _pages_store(layer: Any) -> tuple[Any, str] | None:
    """The Redis connection PAGES_KEY lives on (the layer's first host) and the key, or
    None for a layer that is not channels_redis's (its pages are assumed open)."""
    if layer is None or is_in_process(layer) or not hasattr(layer, "connection"):
        return None
    return layer.connection(0), f"{getattr(layer, 'prefix', 'asgi')}:{PAGES_KEY}"


async def mark_pages_open(layer: Any) -> tuple[int, float] | None:
    """Say that a page is open in this process (a hub, while it serves sockets). Returns
    when the key was made (Redis's clock, in milliseconds: pages have been open somewhere
    without a break since) and its age in seconds; None for a layer without the key.
    Other processes may have dropped messages until PAGES_TRUST_SECONDS after it was made."""
    found = _pages_store(layer)
    if found is None:
        return None
    redis, key = found
    open_pages.marked_at = time.monotonic()
    open_pages.absent_since = None
    made, now = await redis.eval(MARK_PAGES_OPEN, 1, key, PAGES_TTL_SECONDS)
    return int(made), (int(now) - int(made)) / 1000


# PAGES_KEY made with Redis's time in milliseconds, or its expiry renewed: returns when it
# was made and Redis's time now.
MARK_PAGES_OPEN = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local made = tonumber(redis.call('GET', KEYS[1]))
if made then
    redis.call('EXPIRE', KEYS[1], ARGV[1])
    return {made, now}
end
redis.call('SET', KEYS[1], now, 'EX', ARGV[1])
return {now, now}
"""


async def look_for_pages(layer: Any) -> bool:
    """One look at PAGES_KEY, for open_pages; a failed look counts as a page open.
    False if the layer has no such key (there is nothing to look at, ever)."""
    found = _pages_store(layer)
    if found is None:
        return False
    redis, key = found
    began = time.monotonic()
    try:
        present = bool(await redis.exists(key))
    except Exception:
        log.debug("could not look for open pages; publishing", exc_info=True)
        present = True
    open_pages.looked(began, present)
    return True


def no_page_open() -> bool:
    """No dashboard page can hear of a change: nobody_listens(), or over Redis no process
    had a page open at this process's latest look (PAGES_KEY). Page messages only: a
    logout's message to a session's sockets is sent whatever the look said. The look
    first (OpenPages.none() inline): over Redis with no page open, the answer without the
    channel layer's look-up (four times an instance in a herd of timers)."""
    began = open_pages.absent_since
    if began is not None and time.monotonic() - began < PAGES_TRUST_SECONDS:
        return True
    return nobody_listens()


def publish_overview(message: dict[str, Any]) -> None:
    """A change for the dashboard's lists and overview. Only a hub in this process takes
    these: over a cross-process layer the hubs tail the history table instead (see
    fanout.FAST_TAIL_SECONDS), so nothing is sent where nobody listens. A deletion goes to
    every hub (instance_changed): it leaves nothing in the history to tail."""
    if _cross_process_layer() is None:
        publish(OVERVIEW_GROUP, message)


def instance_changed(
    kind: str, pk: int | None, workflow: str | None = None, notified: bool = False
) -> None:
    """Called after a state change commits (from any thread, sync code). notified: its
    transaction told every worker already (a PostgreSQL NOTIFY they LISTEN to), so no
    hint goes through the channel layer."""
    notify_local(kind, pk)
    result_waiters.wake(pk)
    if pk is not None and not no_page_open():
        message = {"type": "wf.instance", "pk": pk, "workflow": workflow, "kind": kind}
        publish(instance_group(pk), message)
        if kind == "deleted":  # it leaves no history row for the hubs' tails to find
            publish(OVERVIEW_GROUP, message)
        else:
            publish_overview(message)
    if not notified and _cross_process_layer() is not None:
        _background_send(WORKERS_GROUP, {"type": "wf.hint", "kind": kind, "pk": pk})


# Hints that only say "something may be runnable": any one worker may act on them, so a
# burst of them is sent once, to the engine's channel, instead of to every worker.
# Not "restart": the worker running the old run must hear it, by pk, to stop that run.
WAKE_KINDS = frozenset({"created", "event", "resume", "wake", "promoted"})
ENGINE_CHANNEL = "workflows"


def _coalesce(batch: list[tuple[str, dict[str, Any]]]) -> list[tuple[str | None, dict[str, Any]]]:
    """Drop duplicates; fold every wake hint of a burst into one message to the engine
    channel (group None means: send to ENGINE_CHANNEL). Order is kept otherwise."""
    out: list[tuple[str | None, dict[str, Any]]] = []
    seen: set[tuple[Any, ...]] = set()
    woke = False
    for group, message in batch:
        if group == WORKERS_GROUP and message.get("kind") in WAKE_KINDS:
            if not woke:
                out.append((None, {"type": "wf.hint", "kind": "wake", "pk": None}))
                woke = True
            continue
        # Flat messages (status changes, hints) by their items, as built; one with a
        # nested value (a step's fields, a span's) is never repeated word for word, and
        # printing and sorting every update to compare it was a seventh of the sender's time.
        key = (group, *message.items())
        try:
            if key in seen:
                continue
            seen.add(key)
        except TypeError:
            pass
        out.append((group, message))
    return out


def instances_pruned(workflows: list[str]) -> None:
    """Retention deleted finished instances of these workflows (one batch of a prune):
    every hub reads their overview cards again. One message for the batch, not one per
    instance as a delete sends: a prune may delete thousands, and the cards are all a
    deletion's message changes. To every hub, as a deletion is: it leaves no history
    row for the tails to find."""
    if workflows and not no_page_open():
        publish(OVERVIEW_GROUP, {"type": "wf.pruned", "workflows": workflows})


def instances_promoted(pks: list[int]) -> None:
    """Queued instances were started (a place freed up): tell workers and dashboards
    (workers that LISTEN heard it from the transaction that started them)."""
    notified = store.workers_listen()
    for pk in pks:
        instance_changed("promoted", pk, notified=notified)


def queue_timed() -> None:
    """Queued instances got a time to start (a rate window opens, a debounce ends): workers
    read the queues again and wait for it (those that LISTEN heard it from the transaction)."""
    instance_changed("queued", None, notified=store.workers_listen())


def instance_terminated(pk: int, notified: bool = False) -> None:
    """An instance was terminated with its parent: a worker running it stops its run.
    notified: as instance_changed's."""
    instance_changed("terminate", pk, notified=notified)


def instance_compensating(pk: int, notified: bool = False) -> None:
    """An instance was cancelled with compensation with its parent: a worker running it lets
    its steps in flight finish, then compensates; otherwise a worker runs its compensations.
    notified: as instance_changed's."""
    instance_changed("compensate", pk, notified=notified)


def instances_scheduled(pks: list[int]) -> None:
    """Schedules started instances (a worker fired their ticks): tell dashboards."""
    for pk in pks:
        instance_changed("created", pk)


class PendingHints:
    """Hints to workers waiting to be sent, folded as they arrive: every wake hint is one
    (any worker may act on it), the others one per (kind, instance), newest last. While
    the layer cannot take them (Redis down) they stay bounded: past MAX the oldest go."""

    MAX = 10_000

    def __init__(self) -> None:
        self._by_key: dict[tuple[Any, Any], dict[str, Any]] = {}

    def put(self, message: dict[str, Any]) -> None:
        kind = message.get("kind")
        key = ("wake", None) if kind in WAKE_KINDS else (kind, message.get("pk"))
        self._by_key.pop(key, None)
        self._by_key[key] = message
        if len(self._by_key) > self.MAX:
            del self._by_key[next(iter(self._by_key))]

    def take(self) -> list[tuple[str, dict[str, Any]]]:
        taken, self._by_key = list(self._by_key.values()), {}
        return [(WORKERS_GROUP, message) for message in taken]

    def __len__(self) -> int:
        return len(self._by_key)


class Sender:
    """A long-lived loop in its own thread that sends cross-process messages (Redis).

    Callers (views, the client, the engine's loop) hand a message over and return at
    once. Hints to workers go first: they are what wakes the engine, and a burst of
    dashboard updates must not delay them. Dashboard updates are sent in order per group,
    several groups at a time; when more than MAX_UPDATES wait, the oldest are dropped
    (live updates are lossy by design: a dashboard resyncs from the database).

    Updates that find the sender idle wait GATHER_SECONDS for the rest of their burst: a
    run's updates come a few at a time over a few milliseconds (claim, step, end, spans),
    and each batch costs a Redis look-up of its groups (see _groups_with_members). Hints
    and a flush never wait.
    """

    MAX_UPDATES = 10_000
    PARALLEL_GROUPS = 8
    CHUNK = 200
    GATHER_SECONDS = 0.005

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.hints = PendingHints()
        self.updates: deque[tuple[str, dict[str, Any]]] = deque(
            maxlen=self.MAX_UPDATES
        )  # drops the oldest
        self.wake = asyncio.Event()
        self.idle = asyncio.Event()  # set when nothing is waiting to be sent
        self.idle.set()
        self.full_warned_at = -float("inf")  # time.monotonic() of the last ChannelFull warning
        self.skipped = 0  # updates not sent: nobody had joined their group
        self.incoming: deque[tuple[str, dict[str, Any]]] = deque()  # put, not yet pulled
        self.pulling = False  # a _pull is scheduled on the sender's loop, or gathering
        self.gathering = False  # updates are waiting for the rest of their burst
        self.hurry = asyncio.Event()  # a hint or a flush: gathering ends at once
        threading.Thread(
            target=self.loop.run_forever, name="wfdash-live-sender", daemon=True
        ).start()
        asyncio.run_coroutine_threadsafe(self._drain(), self.loop)
        asyncio.run_coroutine_threadsafe(self._look_for_pages(), self.loop)

    def put(self, group: str, message: dict[str, Any]) -> None:
        """From any thread. The sender's loop is woken once per burst, not per message
        (each wake is a write to its self-pipe and a turn of its loop)."""
        self.incoming.append((group, message))
        if not self.pulling or group == WORKERS_GROUP:
            self.pulling = True
            self.loop.call_soon_threadsafe(self._pull)

    def _pull(self) -> None:
        # Before draining: a message put after this wakes the loop again, unless updates
        # are gathering (the gathering's end pulls them).
        self.pulling = self.gathering
        while self.incoming:
            group, message = self.incoming.popleft()
            if group == WORKERS_GROUP:
                self.hints.put(message)
                self.hurry.set()
            else:
                self.updates.append((group, message))
        self.idle.clear()
        self.wake.set()

    async def drained(self) -> None:
        self.hurry.set()
        if self.incoming:  # put by a thread whose wake-up is not scheduled yet
            self._pull()
        await self.idle.wait()

    async def _drain(self) -> None:
        semaphore = asyncio.Semaphore(self.PARALLEL_GROUPS)

        async def send_in_order(group: str | None, messages: list[dict[str, Any]]) -> None:
            async with semaphore:
                for message in messages:
                    await self._send(group, message)

        while True:
            await self.wake.wait()
            self.wake.clear()
            if self.updates and not self.hints:
                await self._gather()
            while self.hints or self.updates:
                if self.hints:
                    for group, message in _coalesce(self.hints.take()):
                        await self._send(group, message)
                    continue
                chunk = [self.updates.popleft() for _ in range(min(self.CHUNK, len(self.updates)))]
                by_group: dict[str | None, list[dict[str, Any]]] = {}
                for group, message in _coalesce(chunk):
                    by_group.setdefault(group, []).append(message)
                joined = await self._groups_with_members(list(by_group))
                self.skipped += sum(len(by_group[g]) for g in by_group if g not in joined)
                await asyncio.gather(
                    *(send_in_order(g, ms) for g, ms in by_group.items() if g in joined)
                )
            if not self.wake.is_set():
                self.hurry.clear()  # a hint's or a flush's hurry is over
                self.idle.set()

    async def _look_for_pages(self) -> None:
        """Keep open_pages current for this process (see PAGES_KEY)."""
        while await look_for_pages(get_channel_layer()):
            await asyncio.sleep(PAGES_LOOK_SECONDS)

    async def _gather(self) -> None:
        """Let the rest of a burst of updates arrive, unless a hint or a flush hurries."""
        self.gathering = True
        try:
            await asyncio.wait_for(self.hurry.wait(), self.GATHER_SECONDS)
        except TimeoutError:
            pass
        finally:
            self.gathering = False
        self._pull()  # what was put meanwhile without waking this loop

    async def _groups_with_members(self, groups: list[str | None]) -> set[str | None]:
        """The groups (None: the engine channel) that some socket's process has joined,
        asked of Redis in one script call per host. Most of a busy worker's
        updates are for instances no page is open on: a group_send costs two round trips
        and a Lua call even to an empty group (a herd of timers spent half its CPU there).
        A layer other than channels_redis's, or a failed look, sends to them all."""
        layer = get_channel_layer()
        key_of = getattr(layer, "_group_key", None)
        named = [g for g in groups if g is not None]
        if key_of is None or not hasattr(layer, "connection") or not named:
            return set(groups)
        by_host: dict[int, list[str]] = {}
        for group in named:
            by_host.setdefault(layer.consistent_hash(group), []).append(group)
        joined: set[str | None] = {None}
        try:
            for host, names in by_host.items():
                keys = [key_of(name) for name in names]
                found = await layer.connection(host).eval(NON_EMPTY_KEYS, len(keys), *keys)
                joined.update(names[int(index) - 1] for index in found)
        except Exception:
            log.debug("could not look up group members; sending to every group", exc_info=True)
            return set(groups)
        return joined

    async def _send(self, group: str | None, message: dict[str, Any]) -> None:
        layer = get_channel_layer()
        try:
            if group is None:
                await layer.send(ENGINE_CHANNEL, message)
            else:
                await layer.group_send(group, message)
        except ChannelFull:
            # Nobody reads the engine channel (no runworker up): say so once a minute,
            # not with a traceback per message. Workers still poll (and hear NOTIFY).
            now = time.monotonic()
            if now - self.full_warned_at >= FULL_WARNING_SECONDS:
                self.full_warned_at = now
                log.warning(
                    "channel layer full: %s to %s dropped (is a `runworker workflows` running?)",
                    message.get("type"),
                    group or ENGINE_CHANNEL,
                )
        except Exception:  # a lost hint or notification costs latency only
            log.warning("could not publish %s to %s", message.get("type"), group, exc_info=True)


# The 1-based positions of the keys that hold members: one short reply to parse, not one
# per group (redis-py parses each reply in Python).
NON_EMPTY_KEYS = """
local found = {}
for i, key in ipairs(KEYS) do
    if redis.call('ZCARD', key) > 0 then found[#found + 1] = i end
end
return found
"""

_sender: Sender | None = None
_sender_lock = threading.Lock()
FULL_WARNING_SECONDS = 60.0  # a full channel layer is reported at most this often
FLUSH_SECONDS = 5.0  # the longest a process's exit waits for its last messages


def flush(timeout: float = FLUSH_SECONDS) -> bool:
    """Wait until this process's Sender has sent what it holds; False if it timed out.

    The Sender's thread is a daemon: a short-lived process (`manage.py wf pause`, a
    script, a shell) would otherwise exit with its last messages still queued, and open
    pages in other processes would never hear of its changes. Registered with atexit
    when the Sender starts; commands call it too.
    """
    sender = _sender
    if sender is None or sender.loop.is_closed():
        return True
    try:
        asyncio.run_coroutine_threadsafe(sender.drained(), sender.loop).result(timeout)
    except (TimeoutError, RuntimeError):
        log.warning("exiting with live updates not yet sent (%.0f s)", timeout)
        return False
    return True


def _background_send(group: str, message: dict[str, Any]) -> None:
    """Hand a cross-process message to this process's Sender and return at once."""
    global _sender
    with _sender_lock:
        if _sender is None or _sender.loop.is_closed():
            if _sender is None:
                atexit.register(flush)
            _sender = Sender()
        sender = _sender
    sender.put(group, message)


class EngineHooks:
    """What the worker tells the rest of the app about its runs (called in the engine's loop)."""

    def __init__(self) -> None:
        # Runs already announced as running: the list hears of a run once, not at every step.
        self._announced: weakref.WeakSet[Any] = weakref.WeakSet()

    def step_started(self, run: Any, record: Any) -> None:
        """An attempt begins (nothing is written yet): show the step running."""
        self.step_written(run, record, ())

    def step_written(self, run: Any, record: Any, history: Any) -> None:
        if history:  # history subscriptions (client.subscribe) in this process
            result_waiters.wake(run.pk, history_only=True)
        if no_page_open():
            return
        step = {
            "name": record.name,
            "kind": record.kind,
            "status": record.status,
            "attempts": record.attempts,
        }
        publish(
            instance_group(run.pk),
            {"type": "wf.step", "pk": run.pk, "step": step, "history": len(history or ())},
        )
        if run not in self._announced:
            self._announced.add(run)
            publish_overview(
                {
                    "type": "wf.instance",
                    "pk": run.pk,
                    "workflow": run.definition.name,
                    "kind": "running",
                }
            )

    def attempt_failed(self, run: Any, record: Any, exc: BaseException) -> None:
        if no_page_open():
            return
        publish(
            instance_group(run.pk),
            {
                "type": "wf.error",
                "pk": run.pk,
                "step": record.name,
                "attempt": record.attempts,
                "name": type(exc).__name__,
                "message": str(exc)[:1000],
            },
        )

    def flush(self) -> None:
        """In the engine's database thread: store queued spans and announce them, once
        per instance a flush (its page reads its detail again whatever the span: three
        messages for a woken timer's three spans were two too many)."""
        from .tracing import flush_spans

        stored = flush_spans()
        if stored and not no_page_open():
            for span in {span.instance_id: span for span in stored}.values():
                self.span_stored(span)

    def instances_pruned(self, workflows: list[str]) -> None:
        """In a database thread, after a prune's batch commits."""
        instances_pruned(workflows)

    def maintain(self) -> bool:
        """In the engine's database thread: one batch of a bulk job, if any is waiting."""
        from .bulk import process_pending

        return process_pending()

    def run_finished(self, pk: int, outcome: str) -> None:
        result_waiters.wake(pk)
        if no_page_open():
            return
        message = {"type": "wf.instance", "pk": pk, "workflow": None, "kind": outcome}
        publish(instance_group(pk), message)
        publish_overview(message)

    def span_stored(self, span: Any) -> None:
        """For the engine's span exporter, after it stores a Span row of an instance."""
        if span.instance_id is not None:
            publish(
                instance_group(span.instance_id),
                {
                    "type": "wf.span",
                    "pk": span.instance_id,
                    "span_id": span.span_id,
                    "name": span.name,
                    "status": span.status_code,
                },
            )


def bind_socket_loop() -> None:
    """Called by dashboard consumers on connect: remember the loop their groups live in."""
    global _socket_loop
    _socket_loop = asyncio.get_running_loop()


def nobody_listens() -> bool:
    """No message can reach a listener: there is no channel layer, or it is the in-memory
    one in a process where no dashboard socket has connected. The engine's hooks then
    build no messages (nine for each instance a herd of timers wakes)."""
    layer = get_channel_layer()
    if layer is None:
        return True
    if not isinstance(layer, InMemoryChannelLayer):
        return False
    return _socket_loop is None or _socket_loop.is_closed()


def publish(group: str, message: dict[str, Any]) -> None:
    """Send to a channel-layer group from any thread or loop; lossy by design, never raises.

    A cross-process layer (Redis) gets every message through the one ordered sender, from
    any thread or loop: a busy worker's burst then uses one connection, not one per
    message (a task per message exhausted the Redis connection pool). The in-memory layer
    is only safe in the loop its consumers run in, so the send is scheduled there; if no
    dashboard socket ever connected in this process, nobody can be listening.
    """
    if nobody_listens():
        return
    layer = get_channel_layer()
    if not isinstance(layer, InMemoryChannelLayer):
        _background_send(group, message)
        return
    target = _socket_loop
    assert target is not None  # nobody_listens() said a socket's loop is bound and open
    current = running_loop()

    async def send() -> None:
        try:
            await layer.group_send(group, message)
        except Exception:  # a lost notification costs a stale dashboard until the next one
            log.warning("could not publish %s to %s", message.get("type"), group, exc_info=True)

    def start() -> None:
        task = asyncio.ensure_future(send())
        _in_flight.add(task)  # a task nobody references may be garbage-collected mid-send
        task.add_done_callback(_in_flight.discard)

    try:
        if target is current:
            start()
        else:
            target.call_soon_threadsafe(start)
    except RuntimeError:  # the loop closed meanwhile
        pass


async def join_workers_group(channel_name: str) -> None:
    layer = _cross_process_layer()
    if layer is not None:
        await layer.group_add(WORKERS_GROUP, channel_name)


def running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
