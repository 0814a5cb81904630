"""The worker: claim runnable instances under a lease, run them, heartbeat, wake timers.

The loop is made of small steps (claim_and_start, heartbeat_once) that tests can call one
at a time; serve() only repeats them until asked to stop. Hints (new instance, event
sent, resume) only save latency: the database is the truth and a slow poll is the net.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import gc
import logging
import os
import queue
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Collection
from concurrent.futures import Future
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import DatabaseError, InterfaceError, OperationalError, connection, connections

from ..models import Status
from ..text import first_line
from . import clock, meters, registry, spans, store
from .runner import Run, awaits_child
from .store import History

log = logging.getLogger("workflows_app.engine")

# Takeovers without any step completing before an instance is declared poison and errored.
MAX_UNPRODUCTIVE_CLAIMS = 3
FLUSH_SECONDS = 0.1
CONTENDED_WAIT_SECONDS = 0.02  # a due instance that could not be claimed is looked at again after this  # spans are stored in batches at most this often while busy
PRUNE_BATCH = 500  # instances a worker deletes per transaction when pruning
DRAIN_SECONDS = 10.0  # at shutdown, how long running steps may finish (WFDASH_DRAIN_SECONDS)
ABORT_WAIT_SECONDS = 5.0  # at shutdown, how long aborted runs may take to unwind
STARTUP_ATTEMPTS = 30  # a database restarting at start-up is waited out for about this many seconds
# A stop signal met by a blocked event loop: after the drain's bound (at once when the signal
# came twice) and this long without an answer from the loop, LoopWatch gives the leases back
# and ends the process with this exit code.
STUCK_SILENT_SECONDS = 1.0
STUCK_EXIT_CODE = 3


def engine_settings() -> dict[str, Any]:
    return getattr(settings, "WFDASH", {})


def _close_broken(opened: list[Any]) -> None:
    """Close connections that saw an error and no longer answer (a backend terminated,
    a restart), also when the code that saw the error caught it: the thread reconnects."""
    for conn in opened:
        if conn.errors_occurred and not conn.in_atomic_block:
            if conn.connection is not None and conn.is_usable():
                conn.errors_occurred = False
            else:
                conn.close()


class ConnectionThreads:
    """The engine's database threads: a few threads that keep their connections.

    Each thread's connections are remembered, so close() can close them all from outside,
    except those of a thread still busy: it closes its own when its call returns. A call
    goes to a free thread through a queue and its caller's loop is woken with the result
    (call_soon_threadsafe): run_in_executor's concurrent Future, with its lock and
    condition, and the asyncio future chained to it took a tenth of the event loop's time
    in a herd of timers.
    """

    # Lanes, taken in this order by the next free thread. A claim (new work for the event
    # loop) and a heartbeat (a lease running out) go ahead of the checkpoints and span
    # stores queued before them: in a herd of timers all four threads were often busy,
    # and a claim queued behind their backlog left the loop idle. The serve loop has one
    # claim out at a time, so the calls behind them are never starved.
    FIRST, NORMAL = 0, 1

    def __init__(self, threads: int, name: str) -> None:
        self.threads = threads
        # One token in _ready per job in a lane: a thread woken by a token takes the job
        # of the first lane that has one (deque appends and pops are atomic).
        self._lanes: tuple[collections.deque[tuple[Callable[..., Any], tuple[Any, ...], Any]], ...]
        self._lanes = (collections.deque(), collections.deque())
        self._ready: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._busy: set[int] = set()
        self._connections: dict[int, list[Any]] = {}
        self._closing = False
        for number in range(threads):
            threading.Thread(target=self._serve, name=f"{name}_{number}", daemon=True).start()

    def _take(self) -> tuple[Callable[..., Any], tuple[Any, ...], Any] | None:
        for lane in self._lanes:
            with contextlib.suppress(IndexError):
                return lane.popleft()
        return None  # close() took the jobs not started

    def _serve(self) -> None:
        while self._ready.get():
            job = self._take()
            if job is None:
                continue
            fn, args, deliver = job
            try:
                result = self._call(fn, *args)
            except BaseException as exc:
                deliver(None, exc)
            else:
                deliver(result, None)

    def _put(
        self, fn: Callable[..., Any], args: tuple[Any, ...], deliver: Any, lane: int = NORMAL
    ) -> None:
        with self._lock:
            if self._closing:
                raise RuntimeError("the engine's database threads are closed")
            self._lanes[lane].append((fn, args, deliver))
            self._ready.put(True)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        ident = threading.get_ident()
        with self._lock:
            self._busy.add(ident)
        try:
            return fn(*args)
        except (OperationalError, InterfaceError):
            # A broken connection is not reused: the next call in this thread reconnects.
            connections.close_all()
            raise
        finally:
            opened = connections.all(initialized_only=True)
            _close_broken(opened)  # a closed one stays listed: closing it again is a no-op
            with self._lock:
                self._busy.discard(ident)
                self._connections[ident] = opened
                closing = self._closing
            if closing:
                connections.close_all()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """From sync code: a concurrent Future of the call."""
        future: Future[Any] = Future()

        def deliver(result: Any, error: BaseException | None) -> None:
            if not future.set_running_or_notify_cancel():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        self._put(fn, args, deliver)
        return future

    async def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self.in_lane(self.NORMAL, fn, *args)

    async def in_lane(self, lane: int, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) in a database thread, taken in `lane`'s turn (FIRST, then NORMAL)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def deliver(result: Any, error: BaseException | None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(_settle, future, result, error)

        self._put(fn, args, deliver, lane)
        return await future

    def close(self) -> None:
        """Cancel the calls not started, close the connections of every idle thread, then
        let the threads go (a busy one leaves when its call returns)."""
        with self._lock:
            self._closing = True
            while (job := self._take()) is not None:
                job[2](None, asyncio.CancelledError())
            idle = [conns for ident, conns in self._connections.items() if ident not in self._busy]
        for conns in idle:
            for conn in conns:
                conn.inc_thread_sharing()  # closing another thread's idle connection is safe
                try:
                    conn.close()
                finally:
                    conn.dec_thread_sharing()
        for _ in range(self.threads):
            self._ready.put(False)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    """On the caller's loop: hand it what its database call gave."""
    if future.done():  # the caller was cancelled meanwhile
        return
    if isinstance(error, asyncio.CancelledError):
        future.cancel()
    elif error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class StepThreads:
    """Threads for sync step callables, started as they are needed and never capped.

    A timed-out attempt is abandoned but its thread may hang on: a fixed pool would lose
    that place, and time queued for a thread would count against the next step's timeout.
    Here a step always gets a thread at once (idle ones are reused, and leave after
    IDLE_SECONDS), and the threads are daemons, so a hung one never keeps a worker
    process alive after its shutdown. Like a request, each call ends by closing its
    database connections unless CONN_MAX_AGE keeps them, so a worker holds as many
    connections as steps are using the database now.
    """

    IDLE_SECONDS = 30.0

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[
            tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None
        ] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for work that no submit has reserved yet
        self._started = 0
        self._closing = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._idle > 0:
                self._idle -= 1  # reserve an idle thread: it takes the next item
            else:
                self._started += 1
                thread = threading.Thread(
                    target=self._serve, name=f"{self.name}_{self._started}", daemon=True
                )
                thread.start()
        self._queue.put((future, fn, args))
        return future

    def _serve(self) -> None:
        try:
            while True:
                try:
                    item = self._queue.get(timeout=self.IDLE_SECONDS)
                except queue.Empty:
                    with self._lock:
                        if self._idle > 0:  # nobody reserved this thread: leave
                            self._idle -= 1
                            return
                    continue  # a submit reserved it just now: its item is on the way
                if item is None:
                    return
                future, fn, args = item
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(*args))
                    except BaseException as exc:
                        future.set_exception(exc)
                    finally:
                        _close_broken(connections.all(initialized_only=True))
                        for conn in connections.all(initialized_only=True):
                            conn.close_if_unusable_or_obsolete()
                with self._lock:
                    if self._closing:
                        return
                    self._idle += 1
        finally:
            connections.close_all()

    def close(self) -> None:
        """Let idle threads go; busy ones leave when their call returns."""
        with self._lock:
            self._closing = True
            idle, self._idle = self._idle, 0
        for _ in range(idle):
            self._queue.put(None)


class LoopWatch:
    """Keeps a worker's leases while its event loop is blocked, and says where it is stuck.

    Heartbeats run on the event loop: an async step that blocks it (time.sleep, a blocking
    HTTP client in an `async def`) or a run() looping without an await stopped them, the
    leases ran out under a step still running, and other workers ran it again beside it
    (then made the instance poison). This thread asks the loop for an answer every sixth
    of a lease; when a heartbeat is overdue it renews the leases itself, from a connection
    of its own, logging once where the loop is. A loop blocked longer than
    LOOP_STALL_RENEW_SECONDS (a run() spinning for good) is given up: its leases run out
    and other workers take its instances over. Nothing runs on the loop's side but a
    callback every sixth of a lease."""

    def __init__(self, worker: Worker, loop: asyncio.AbstractEventLoop, limit: float) -> None:
        self.worker = worker
        self.loop = loop
        self.limit = limit
        self.loop_thread = threading.get_ident()
        self.answered = time.monotonic()
        # Often enough that a stop signal meeting a blocked loop is acted on within a second.
        self.tick = min(worker.lease_seconds / 6, 1.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name=f"wfdash-loop-watch-{worker.worker_id}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _answer(self) -> None:
        self.answered = time.monotonic()

    def _watch(self) -> None:
        lease = self.worker.lease_seconds
        renewed = 0.0  # time.monotonic() of this thread's last renewal
        stalled_since: float | None = None
        gave_up = False
        try:
            while not self._stop.wait(self.tick):
                try:
                    self.loop.call_soon_threadsafe(self._answer)
                except RuntimeError:  # the loop closed
                    return
                now = time.monotonic()
                silent = now - self.answered
                if self._stuck_at_stop(now, silent):
                    self._give_up_and_exit(silent)
                    return
                if silent <= lease / 3:
                    if stalled_since is not None:
                        log.warning(
                            "worker %s: its event loop answers again, after %.1f s",
                            self.worker.worker_id,
                            now - stalled_since,
                        )
                    stalled_since, gave_up = None, False
                    continue
                if stalled_since is None:
                    stalled_since = self.answered
                    self._report_stall(silent)
                if silent > self.limit:
                    if not gave_up:
                        gave_up = True
                        log.error(
                            "worker %s: its event loop has been blocked for %.0f s; its leases "
                            "are no longer renewed: other workers take its instances over "
                            "when they run out",
                            self.worker.worker_id,
                            silent,
                        )
                    continue
                if now - renewed >= lease / 3:
                    renewed = now
                    self._renew()
        finally:
            connections.close_all()

    def _stuck_at_stop(self, now: float, silent: float) -> bool:
        """A signal asked the worker to stop, the drain's bound is over (at once after a
        second signal) and the loop does not answer: the drain cannot run on it."""
        asked = self.worker.stop_asked_at
        if asked is None or silent <= max(STUCK_SILENT_SECONDS, 2 * self.tick):
            return False
        bound = 0.0 if self.worker.hurry_asked else self.worker.drain_seconds + ABORT_WAIT_SECONDS
        return now - asked >= bound

    def _give_up_and_exit(self, silent: float) -> None:
        """What the drain would have done, from this thread: give every lease back (fenced
        by token: one already taken over is left alone), so other workers take the
        instances at once, from their last checkpoint; log which instance blocks the loop
        and where; end the process. Nothing of the blocked run is written: its writes go
        through the loop."""
        worker = self.worker
        leases: dict[int, str] = {}
        for _ in range(3):  # the dicts belong to the blocked loop; a read may meet a change
            try:
                leases = {**worker.unreleased, **worker.tokens}
                # Each run's engine task, and the task of its workflow's run() in it.
                running = [(pk, t) for pk, t in worker.tasks.items()]
                running += [(pk, getattr(r, "task", None)) for pk, r in worker.runs.items()]
                break
            except RuntimeError:
                continue
        else:
            running = []
        try:
            current = asyncio.current_task(self.loop)
        except RuntimeError:
            current = None
        stuck = next((pk for pk, task in running if current is not None and task is current), None)
        try:
            store.release(sorted(leases.items()))
            released = "their leases are released for other workers"
        except Exception as exc:
            released = f"their leases could not be released ({exc}): they run out in {worker.lease_seconds:g} s"
        finally:
            connections.close_all()
        held = ", ".join(f"#{pk}" for pk in sorted(leases)) or "none"
        log.error(
            "worker %s: %s received %.1f s ago, but its event loop has been blocked for %.1f s "
            "(%s, at %s), so no drain can run; instances held: %s, %s. Exiting with code %d",
            worker.worker_id,
            worker.stop_signal or "stop",
            time.monotonic() - (worker.stop_asked_at or 0.0),
            silent,
            f"by the run of instance #{stuck}" if stuck is not None else "by code outside a run",
            self._loop_location(),
            held,
            released,
            STUCK_EXIT_CODE,
        )
        for handler in logging.getLogger().handlers + log.handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(STUCK_EXIT_CODE)

    def _loop_location(self) -> str:
        """file:line of the loop thread's innermost frame."""
        frame = sys._current_frames().get(self.loop_thread)
        if frame is None:
            return "an unknown place"
        return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"

    def _report_stall(self, silent: float) -> None:
        frame = sys._current_frames().get(self.loop_thread)
        where = (
            "".join(traceback.format_stack(frame, limit=12)) if frame is not None else "(unknown)\n"
        )
        log.warning(
            "worker %s: its event loop has not answered for %.1f s: an async step or a "
            "run() is blocking it (time.sleep, a blocking client in async code, a loop "
            "without await); nothing else on this worker runs meanwhile. Its leases are "
            "renewed from a thread for up to %.0f s. The loop is at:\n%s",
            self.worker.worker_id,
            silent,
            self.limit,
            where.rstrip(),
        )

    def _renew(self) -> None:
        try:
            tokens = list(self.worker.tokens.values())
        except RuntimeError:  # changed while read: the loop moved after all
            return
        try:
            store.heartbeat(tokens, self.worker.lease_seconds)
        except Exception:
            log.exception("worker %s: could not renew its leases", self.worker.worker_id)
            _close_broken(connections.all(initialized_only=True))


class GroupCommit:
    """Checkpoints of concurrent runs share transactions: one commit for many steps.

    A checkpoint never waits for company: it goes at once when a database thread is
    free; the ones that arrive while all are busy go together in the next transaction.
    """

    MAX_BATCH = 100

    def __init__(self, db: ConnectionThreads, on_end: Callable[[], None] | None = None) -> None:
        self.db = db
        self.pending: list[tuple[store.StepWrite | store.FinishWrite, asyncio.Future[Any]]] = []
        self.flushing: set[asyncio.Task[None]] = (
            set()
        )  # referenced: a task may not vanish mid-flush
        # Runs whose end is queued or being written: their code is done, their slot free.
        self.ending = 0
        self.on_end = on_end

    async def __call__(self, write: store.StepWrite | store.FinishWrite) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.pending.append((write, future))
        if len(self.flushing) < self.db.threads:
            self.flushing.add(asyncio.ensure_future(self._flush()))
        if not isinstance(write, store.FinishWrite):
            return await future
        self.ending += 1
        if self.on_end is not None:
            self.on_end()
        try:
            return await future
        finally:
            self.ending -= 1

    async def _flush(self) -> None:
        try:
            await self._flush_pending()
        finally:
            # At once, not in a done callback: a write arriving in between must see a free slot.
            self.flushing.discard(asyncio.current_task())  # type: ignore[arg-type]

    async def _flush_pending(self) -> None:
        while self.pending:
            batch, self.pending = self.pending[: self.MAX_BATCH], self.pending[self.MAX_BATCH :]
            try:
                results = await self.db(store.write_steps, [write for write, _ in batch])
            except (DatabaseError, ValueError) as exc:  # ValueError: text no driver encodes
                if len(batch) > 1 and not store.transient(exc):
                    # One write the database refuses (its data) must not fail the others of
                    # its group: the transaction rolled back, so each is written on its own.
                    await self._flush_one_by_one(batch)
                else:
                    self._fail(batch, exc)  # each run retries its own (Run._write_again)
                continue
            except BaseException as exc:  # the whole transaction failed: every run hears it
                self._fail(batch, exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue
            self._settle(batch, results)

    async def _flush_one_by_one(self, batch: list[tuple[Any, asyncio.Future[Any]]]) -> None:
        for index, one in enumerate(batch):
            try:
                results = await self.db(store.write_steps, [one[0]])
            except asyncio.CancelledError as exc:
                self._fail(batch[index:], exc)  # the rest too: nobody else will settle them
                raise
            except BaseException as exc:
                self._fail([one], exc)
                continue
            self._settle([one], results)

    @staticmethod
    def _fail(batch: list[tuple[Any, asyncio.Future[Any]]], exc: BaseException) -> None:
        for _, future in batch:
            if not future.done():
                future.set_exception(exc)

    @staticmethod
    def _settle(batch: list[tuple[Any, asyncio.Future[Any]]], results: list[Any]) -> None:
        for (_, future), result in zip(batch, results):
            if future.done():
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)


_local_workers: set[Worker] = set()
_local_lock = threading.Lock()


def running_in_this_process() -> bool:
    """Whether an engine worker runs in this process (and so flushes its spans)."""
    with _local_lock:
        return bool(_local_workers)


def notify_local(kind: str = "wake", pk: int | None = None) -> None:
    """Tell every worker of this process that something changed (thread-safe)."""
    with _local_lock:
        workers = list(_local_workers)
    for worker in workers:
        worker.hint(kind, pk)


# Hints that an instance became runnable: nothing more to a worker that runs it already.
RUNNABLE_HINTS = frozenset({"created", "promoted"})

# Run outcomes after which nothing of the instance is due (Worker._nothing_due_from).
FINISHED_OUTCOMES = frozenset({Status.COMPLETE, Status.ERRORED, Status.TERMINATED})
PARKED_OUTCOMES = frozenset({Status.WAITING, Status.PAUSED, Status.COMPENSATING})

# Runs held at most, ending ones included, per place of concurrency (Worker.free_slots).
ENDING_FACTOR = 4

# Allocations of container objects between two collections of the youngest generation.
GC_FIRST_GENERATION = 50_000
_gc_tuned = False


def tune_garbage_collector() -> None:
    """Once per process, when its first worker starts: collect, then freeze what is alive
    (modules, Django, the registered workflows: never garbage, no longer walked by every
    full collection), and collect the youngest generation every GC_FIRST_GENERATION
    allocations instead of Python's 700 or 2,000 (a run allocates thousands of objects,
    nearly all freed by reference counting). 6-16 % less CPU per instance in a herd of
    timers, 3-9 % per step on SQLite (docs/performance.md). Left alone when the process
    turned the collector off or set a larger threshold; WFDASH["GC_TUNING"] = False
    leaves it alone altogether."""
    global _gc_tuned
    with _local_lock:
        if _gc_tuned or not gc.isenabled():
            return
        _gc_tuned = True
    gc.collect()
    gc.freeze()
    first, *older = gc.get_threshold()
    if first < GC_FIRST_GENERATION:
        gc.set_threshold(GC_FIRST_GENERATION, *older)


def worker_queues(value: Any, source: str) -> tuple[str, ...] | None:
    """The task queues a worker is started for (a list, or names separated by commas),
    None for every queue. ValueError, naming `source`, for anything else."""
    if value is None:
        return None
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ValueError(
            f"{source}: expected queue names (a list, or separated by commas), got {value!r}"
        )
    queues = tuple(dict.fromkeys(n.strip() for n in names))
    if not queues or "" in queues:
        raise ValueError(f"{source}: a queue name is empty in {value!r}")
    return queues


def db_threads_default() -> int:
    # SQLite has one writer at a time: one thread avoids lock contention altogether.
    return 1 if connection.vendor == "sqlite" else 4


class Worker:
    def __init__(
        self,
        *,
        worker_id: str | None = None,
        concurrency: int | None = None,
        lease_seconds: float | None = None,
        poll_seconds: float | None = None,
        db_threads: int | None = None,
        hooks: Any = None,
        queues: Any = None,
    ) -> None:
        """queues: the Django task queues this worker runs (names, or a string of them
        separated by commas); it then runs no other instance. None: every instance."""
        conf = engine_settings()
        self.queues = worker_queues(queues, "queues")
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.concurrency = concurrency or int(conf.get("WORKER_CONCURRENCY", 200))
        self.lease_seconds = lease_seconds or float(conf.get("LEASE_SECONDS", 30))
        self.poll_seconds = poll_seconds or float(conf.get("POLL_SECONDS", 5))
        # How long stop() lets running steps finish before cutting them short.
        self.drain_seconds = float(conf.get("DRAIN_SECONDS", DRAIN_SECONDS))
        self.db_threads = db_threads or db_threads_default()
        self.sleep_in_process = float(conf.get("SLEEP_IN_PROCESS_MS", 1000)) / 1000
        self.hooks = hooks
        self.runs: dict[int, Run] = {}
        self.tasks: dict[int, asyncio.Task[str]] = {}
        self.tokens: dict[int, str] = {}
        self.unreleased: dict[int, str] = {}  # leases of runs cut short, not yet given back
        self.runs_started = 0
        self.runs_ended = 0  # runs whose task ended (_run_done): run_until_idle's marker
        self.next_admission_at: Any = None  # when a queued instance may start (admit_due)
        self._admission_stale = True  # a hint came since admit_due last looked
        self._admission_checked_at = float("-inf")  # time.monotonic() of that look
        self._last_flush = 0.0
        self._flushing: asyncio.Future[None] | None = None  # see flush_in_background
        self._flush_again = False
        self._next_maintain = 0.0  # time.monotonic() of the next look for background work
        self._next_stranded = 0.0  # time.monotonic() of the next look at unlimited queues
        # time.monotonic() of the next look at the tables' growth (SQLite keeps no plans).
        self._next_plan_check = 0.0 if connection.vendor == "postgresql" else float("inf")
        # Finished instances past their retention are deleted this often (engine clock; 0: only
        # by `wf prune`), a batch at a time between runs.
        self.prune_seconds = float(conf.get("PRUNE_SECONDS", 300))
        # How long serve()'s LoopWatch keeps the leases of a blocked event loop.
        self.loop_stall_renew_seconds = float(conf.get("LOOP_STALL_RENEW_SECONDS", 300))
        self._next_prune: datetime | None = None
        self._next_catalog_touch = clock.now()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._heartbeat: asyncio.Future[None] | None = None  # serve()'s heartbeat loop
        self._stopping = False
        # Set by ask_to_stop (a signal handler): when, by which signal, and whether twice.
        self.stop_asked_at: float | None = None
        self.stop_signal = ""
        self.hurry_asked = False
        self._unsubscribe_clock: Callable[[], None] | None = None
        self.db: ConnectionThreads | None = None
        self.step_threads: StepThreads | None = None
        self.group_commit: GroupCommit | None = None
        # The earliest tick of the schedules this worker fires; looked up again when it is
        # due, when told a schedule changed, and at least every poll interval.
        self.next_tick: datetime | None = None
        # From the last claim: whether it took everything due, and if so the next timer.
        self.claimed_all_due = True
        self.next_timer: datetime | None = None
        self.next_timer_known = False  # the last claim's trip read next_timer
        # The last claim's versions no worker ran lately (_absent_of), for its runs to park.
        self._absent_versions: set[tuple[str, int]] = set()
        self._ticks_looked_up = -float("inf")
        self._full = False  # the serve loop waits for a place to claim more
        self._waiting_until: datetime | None = None  # engine time its idle wait ends
        # While a claim is out: what woke the loop meanwhile, (kind, pk) of each hint and
        # None for anything else (see _drop_wakes_the_claim_answered).
        self._woken_during_claim: list[tuple[str, int | None] | None] | None = None

    # --- life cycle ---------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self.db = ConnectionThreads(self.db_threads, "wfdash-db")
        if engine_settings().get("GROUP_COMMIT", True):
            self.group_commit = GroupCommit(self.db, self._place_freed)
        self.step_threads = StepThreads("wfdash-step")
        try:
            for attempt in range(STARTUP_ATTEMPTS):
                try:
                    await self._prepare()
                    break
                except (DatabaseError, InterfaceError) as exc:
                    # The database is restarting or dropped us: a worker outlives that.
                    if attempt == STARTUP_ATTEMPTS - 1:
                        raise
                    # A dropped connection (a failover ends every pooled one) in one line:
                    # each logged its traceback; another error keeps its traceback.
                    dropped = isinstance(exc, (OperationalError, InterfaceError))
                    log.warning(
                        "worker %s: database error at start%s; retrying",
                        self.worker_id,
                        f" ({first_line(exc)})" if dropped else "",
                        exc_info=not dropped,
                    )
                    await asyncio.sleep(min(self.poll_seconds, 1.0))
        except BaseException:
            await self._close_threads()
            raise
        with _local_lock:
            _local_workers.add(self)
        if engine_settings().get("GC_TUNING", True):
            tune_garbage_collector()
        self._unsubscribe_clock = clock.on_clock_moved(lambda: self.hint("clock"))

    async def _prepare(self) -> None:
        """Catalog this process's versions; wake and admit what they make runnable."""
        assert self.db is not None
        await self.db(store.measure_clock_offset, True)
        await self.db(sync_catalog)
        definitions = registry.all_definitions()
        await self.db(store.wake_registered_versions, [(d.name, d.version) for d in definitions])
        await self.db(store.promote_all_queued, [(d.name, d.limits()) for d in definitions])
        await self.sync_declared_schedules()

    async def sync_declared_schedules(self) -> None:
        assert self.db is not None
        self._next_catalog_touch = clock.now() + store.catalog.VERSION_TOUCH
        declared = [(d.name, d.version, d.schedules) for d in newest_definitions()]
        await self.db(store.schedules.sync_declared, declared)

    async def keep_catalog_once(self) -> None:
        """Every VERSION_TOUCH: mark this process's versions as deployed, and sync the
        declared schedules again (a newer version's workers may have gone: a rollback)."""
        if self._stopping or clock.now() < self._next_catalog_touch:
            return
        assert self.db is not None
        try:
            versions = [(d.name, d.version) for d in registry.all_definitions()]
            await self.db(store.touch_versions, versions)
            await self.sync_declared_schedules()
        except DatabaseError:  # not this loop pass's claim: it goes on, and tries next time
            log.warning("worker %s: could not refresh its catalog rows", self.worker_id)

    async def stop(self, grace_seconds: float | None = None) -> None:
        """Stop claiming; running steps may finish for a grace period (the worker's
        drain_seconds unless given) but no new step starts: each run parks at its next step
        boundary, due at once for another worker. Runs still going after the grace period
        are cut short and their leases released."""
        if grace_seconds is None:
            grace_seconds = self.drain_seconds
        self._stopping = True
        self.hint("stop")
        for run in list(self.runs.values()):
            run.drain()
        if self.tasks:
            await asyncio.wait(list(self.tasks.values()), timeout=grace_seconds)
        for run in list(self.runs.values()):
            run.abort("worker shutting down")
        if self.tasks:
            await asyncio.wait(list(self.tasks.values()), timeout=ABORT_WAIT_SECONDS)
        # Heartbeats went on while the runs finished: a lease shorter than the grace
        # period must not run out mid-drain (another worker would run the step again).
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        for pk, token in self.tokens.items():
            # A run that did not even unwind (an async step ignoring cancellation): a drain
            # is not a crash, so its lease goes back too; its writes are fenced off.
            self.unreleased.setdefault(pk, token)
        with _local_lock:
            _local_workers.discard(self)
        if self._unsubscribe_clock:
            self._unsubscribe_clock()
        await self._release_before_exit()
        await self.flush_now()
        await self._close_threads()

    async def _release_before_exit(self) -> None:
        """The drain's last release, tried again with backoff for up to ABORT_WAIT_SECONDS:
        there is no next turn of the serve loop, and a connection dropped or a database
        restarting mid-drain left the leases to run out, the takeover counted as a crash
        towards the poison limit."""
        deadline = time.monotonic() + ABORT_WAIT_SECONDS
        delay = 0.25
        while True:
            await self.release_pending()
            if not self.unreleased or time.monotonic() + delay > deadline:
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
        if self.unreleased:
            log.error(
                "worker %s: could not give back the leases of instances %s; other workers "
                "take them over when they run out (%g s)",
                self.worker_id,
                ", ".join(f"#{pk}" for pk in sorted(self.unreleased)),
                self.lease_seconds,
            )

    def ask_to_stop(self, signal_name: str) -> bool:
        """Note a stop signal; True the first time. Safe in a signal handler that interrupted
        this worker's own loop (plain attribute writes, no lock): LoopWatch reads them to
        end a process whose loop is too blocked to drain."""
        if self.stop_asked_at is None:
            self.stop_signal = signal_name
            self.stop_asked_at = time.monotonic()
            return True
        self.hurry_asked = True
        return False

    def hurry(self) -> None:
        """A second stop signal: the drain's grace is over now; the runs still going are cut
        short and their leases released, as at its end."""
        self.hurry_asked = True
        # Stopping first: a run cut short while its sync step's thread still runs releases
        # its lease only when the process is stopping (the thread ends with it).
        self._stopping = True
        self.hint("stop")
        for run in list(self.runs.values()):
            run.abort("worker shutting down")

    async def _close_threads(self) -> None:
        loop = asyncio.get_running_loop()
        for threads in (self.db, self.step_threads):
            if threads is not None:
                await loop.run_in_executor(None, threads.close)

    def hint(self, kind: str, pk: int | None = None) -> None:
        """Thread-safe: something may be runnable, or a run must stop or pause."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(self._on_hint, kind, pk)

    def _on_hint(self, kind: str, pk: int | None) -> None:
        if kind != "event":  # an event admits nobody: no look at the queue on its account
            self._admission_stale = True
        if kind in ("clock", "schedule"):
            self._ticks_looked_up = -float("inf")
        if kind == "bulk":
            self._next_maintain = 0.0
        run = self.runs.get(pk) if pk is not None else None
        if run is not None:
            if kind in ("terminate", "restart", "cancel"):
                run.abort(kind)
            elif kind == "compensate":  # a cancel that compensates: it lets steps finish
                run.start_compensating()
            elif kind == "pause":
                run.request_pause()
        if kind in RUNNABLE_HINTS and pk in self.tasks:
            return  # it runs here: the hint's other copy (NOTIFY or local) woke the claim
        self._woken(kind, pk)

    def _woken(self, kind: str = "", pk: int | None = None) -> None:
        if self._wake is None:
            return
        if self._woken_during_claim is not None:
            self._woken_during_claim.append((kind, pk) if kind else None)
        self._wake.set()

    def _drop_wakes_the_claim_answered(self, woken: list[tuple[str, int | None] | None]) -> None:
        """On PostgreSQL a create's or a promotion's hint comes twice to a worker in the
        process that made it: at once from the process, and a millisecond later through
        its NOTIFY, often while the claim the first copy woke is out. That claim took the
        instance, so the second wake-up would only be a claim that finds nothing (a round
        trip, beside the new run's first step). Kept if anything else woke the loop."""
        if self._wake is None or not self._wake.is_set() or not woken:
            return
        if all(w is not None and w[0] in RUNNABLE_HINTS and w[1] in self.tasks for w in woken):
            self._wake.clear()

    # --- one iteration at a time -----------------------------------------------------

    async def fire_due_schedules(self) -> int:
        """Start the instances of due schedule ticks (once per tick across the fleet)."""
        if self._stopping:
            return 0
        due = self.next_tick is not None and self.next_tick <= clock.now()
        if not due and time.monotonic() - self._ticks_looked_up < self.poll_seconds:
            return 0
        assert self.db is not None
        targets = [
            store.schedules.Target(d.name, d.version, d.limits()) for d in newest_definitions()
        ]
        self._ticks_looked_up = time.monotonic()
        fired, self.next_tick = await self.db(store.schedules.fire_due, targets)
        for started in fired:
            spans.creation_span(
                started.trace_id,
                started.instance_pk,
                started.workflow,
                started.instance_id,
                actor=f"{store.schedules.DECLARED_ACTOR}:{started.schedule}",
            )
        return len(fired)

    def free_slots(self) -> int:
        """Runs this worker may start now. A run whose end is only waiting for its group's
        commit holds no slot: its code is done, and the next claim goes in its place
        (a herd of timers claims while the ends before it commit). At most ENDING_FACTOR
        times `concurrency` runs are held in all."""
        ending = self.group_commit.ending if self.group_commit is not None else 0
        running = len(self.tasks) - ending
        return max(
            0, min(self.concurrency - running, ENDING_FACTOR * self.concurrency - len(self.tasks))
        )

    async def claim_and_start(self) -> int:
        """Claim as many runnable instances as there are free slots and start running them."""
        free = self.free_slots()
        if free <= 0 or self._stopping:
            return 0
        assert self.db is not None
        # Woken already (after the loop's clear, before this claim: a schedule's hint while
        # fire_due_schedules was out): not the claim's to answer, so nothing is dropped.
        woken: list[tuple[str, int | None] | None] = (
            [None] if self._wake is not None and self._wake.is_set() else []
        )
        self._woken_during_claim = woken
        try:
            claimed = await self.db.in_lane(
                ConnectionThreads.FIRST, self._admit_then_claim, free, list(self.tasks)
            )
        finally:
            self._woken_during_claim = None
        self.claimed_all_due = len(claimed) < free
        absent, self._absent_versions = self._absent_versions, set()
        for pk, token, loaded in claimed:
            self.tokens[pk] = token
            self.runs_started += 1
            task = asyncio.ensure_future(self._execute(pk, token, loaded, absent))
            self.tasks[pk] = task
            task.add_done_callback(functools.partial(self._run_done, pk))
        self._drop_wakes_the_claim_answered(woken)
        return len(claimed)

    def _admit_then_claim(
        self, free: int, exclude: list[int]
    ) -> list[tuple[int, str, store.LoadedRun | None]]:
        """Admit the queued instances whose time came (debounce, rate window), then claim:
        one trip to a database thread. Remembers when admission is due next."""
        due = self.next_admission_at is not None and self.next_admission_at <= clock.now()
        checked_long_ago = time.monotonic() - self._admission_checked_at >= self.poll_seconds
        look = self._admission_stale or checked_long_ago
        if look or due:
            # Only when something may have changed (a hint: a create, the clock moved),
            # a known admit_at came, or a poll interval passed: not on every claim.
            self._admission_stale = False
            self._admission_checked_at = time.monotonic()
        if due:  # admitted first: what starts is claimed in this trip
            _, self.next_admission_at = store.admit_due(self._admission_limits())
        # The claim ends the due sleeps of the versions this worker runs only: another's
        # instance is parked here with a reason, and the worker with its version ends them.
        # A look at the queues after a hint goes with it: is anything due, and when next?
        versions = {(d.name, d.version) for d in registry.all_definitions()}
        names = sorted({name for name, _ in versions}) if look and not due else []
        result = store.claim_and_load(
            self.worker_id, free, self.lease_seconds, exclude, versions, names, self.queues
        )
        if names:
            self.next_admission_at = result.first_admit_at
            if result.first_admit_at is not None and result.first_admit_at <= clock.now():
                self._admit_after_claim()
        claimed = result.runs
        self._absent_versions = self._absent_of(claimed)
        self.next_timer_known = result.looked_for_next_wake
        if result.looked_for_next_wake:  # PostgreSQL: read in the claim's own round trip
            self.next_timer = result.next_wake
        elif self.db_threads == 1 and len(claimed) < free:
            # Everything due is claimed. With one database thread (SQLite) the next timer
            # is looked up in this trip: a trip of its own would queue ahead of the runs
            # just claimed. With several, it goes beside them (serve).
            self.next_timer = self._next_wake_at()
            self.next_timer_known = True
        return claimed

    @staticmethod
    def _absent_of(claimed: list[tuple[int, str, store.LoadedRun | None]]) -> set[tuple[str, int]]:
        """The versions of claimed runs this process lacks (and registers on no demand)
        that no worker has run lately: one look-up a claim pass, in its trip, not one per
        instance parked (store.park_unrunnable). A failure must not lose the claims."""
        prefixes = tuple(registry.resolved_prefixes())
        missing = {
            (loaded.instance.workflow, loaded.instance.version)
            for _, _, loaded in claimed
            if loaded is not None
            and not registry.is_registered(loaded.instance.workflow, loaded.instance.version)
            and not loaded.instance.workflow.startswith(prefixes)
        }
        if not missing:
            return set()
        try:
            return store.absent_versions(missing)
        except DatabaseError:  # the claims must not be lost: parked for the short recheck
            log.warning("could not look up the versions of unrunnable instances", exc_info=True)
            return set()

    @staticmethod
    def _admission_limits() -> list[tuple[str, Any]]:
        return [(d.name, d.limits()) for d in registry.all_definitions()]

    def _admit_after_claim(self) -> None:
        """admit_due once a claim is taken: what starts is hinted, and claimed next. A
        failure must not lose the claims (they would wait out their leases): the next
        claim looks again."""
        try:
            _, self.next_admission_at = store.admit_due(self._admission_limits())
        except DatabaseError:
            log.warning("could not admit queued instances; trying again", exc_info=True)
            self._admission_stale = True

    def _run_done(self, pk: int, task: asyncio.Task[str]) -> None:
        self.runs_ended += 1
        self.tasks.pop(pk, None)
        self.tokens.pop(pk, None)
        run = self.runs.pop(pk, None)
        outcome = None if task.cancelled() or task.exception() else task.result()
        if self.hooks is not None and not task.cancelled():
            try:
                self.hooks.run_finished(pk, task.result())
            except Exception:
                log.exception("hook run_finished failed for instance #%s", pk)
        if self._wake is None:
            return
        if self._full or not self._nothing_due_from(outcome, run):
            self._woken()
        else:  # as the woken loop would: now and then, and when going idle
            self.flush_in_background(force=not self.tasks)

    def _nothing_due_from(self, outcome: str | None, run: Run | None) -> bool:
        """Whether a run's outcome leaves the serve loop nothing to look for before it
        wakes anyway: an instance without a parent that ended, or one parked until after
        the loop's wait (or until told: an event, a resume). Each needless look was a claim's round trip,
        and an event sent meanwhile waited behind it."""
        if outcome in FINISHED_OUTCOMES:  # a child's end made its parent due, unhinted
            return run is not None and run.instance.parent_id is None
        if outcome not in PARKED_OUTCOMES or run is None or self._waiting_until is None:
            return False
        return run.parked_until is None or run.parked_until >= self._waiting_until

    def _place_freed(self) -> None:
        """A run's end went to the group commit: a worker waiting for a place claims."""
        if self._full:
            self._woken()

    async def maintain_once(self, force: bool = False) -> bool:
        """One step of the app's background work (a batch of a bulk job), in a database
        thread; True if it did some (more may be waiting)."""
        maintain = getattr(self.hooks, "maintain", None)
        if maintain is None or self._stopping:
            return False
        now = time.monotonic()
        if not force and now < self._next_maintain:
            return False
        assert self.db is not None
        did = bool(await self.db(maintain))
        # Nothing to do: look again after a "bulk" hint or a poll interval, not every loop.
        self._next_maintain = now if did else now + self.poll_seconds
        return did

    async def admit_stranded_once(self, force: bool = False) -> int:
        """At most every poll interval: start what a process of another release queued
        under a limit this release dropped (store.promote_stranded_queues); returns how
        many started."""
        now = time.monotonic()
        if self._stopping or (not force and now < self._next_stranded):
            return 0
        self._next_stranded = now + self.poll_seconds
        assert self.db is not None
        try:
            return int(await self.db(store.promote_stranded_queues, self._admission_limits()))
        except DatabaseError:  # not this loop pass's claim: it goes on, and tries next time
            log.warning("worker %s: could not look at the unlimited queues", self.worker_id)
            return 0

    async def refresh_plans_once(self) -> None:
        """At most every PLAN_CHECK_SECONDS: analyze a hot table that outgrew the plans
        kept for it (store.plans), while the growth is under way, not a minute later."""
        now = time.monotonic()
        if now < self._next_plan_check or self._stopping:
            return
        self._next_plan_check = now + store.plans.PLAN_CHECK_SECONDS
        assert self.db is not None
        try:
            await self.db(store.analyze_grown_tables)
        except DatabaseError:  # not this loop pass's claim: it goes on
            log.warning("worker %s: could not look at the tables' growth", self.worker_id)

    async def prune_once(self) -> int:
        """When due, delete one batch of finished instances past their retention (the same
        store.prune as `wf prune`); returns how many. A full batch makes it due again at once,
        as does one cut short at store.catalog.PRUNE_ROWS of history and steps."""
        if not self.prune_seconds or self._stopping:
            return 0
        now = clock.now()
        if self._next_prune is not None and now < self._next_prune:
            return 0
        assert self.db is not None
        announce = getattr(self.hooks, "instances_pruned", None)
        cut: list[bool] = []
        pruned = int(
            await self.db(
                functools.partial(store.prune, on_cut=lambda: cut.append(True)),
                now,
                PRUNE_BATCH,
                None,
                1,
                announce,
            )
        )
        self._next_prune = (
            now if pruned == PRUNE_BATCH or cut else now + timedelta(seconds=self.prune_seconds)
        )
        return pruned

    async def heartbeat_once(self) -> set[str]:
        """Extend our leases; abort the runs whose lease another worker took."""
        assert self.db is not None
        tokens = dict(self.tokens)
        lost = await self.db.in_lane(
            ConnectionThreads.FIRST, store.heartbeat, list(tokens.values()), self.lease_seconds
        )
        for token in lost:
            # By token, not by instance: while the heartbeat was in flight the instance may
            # have parked and been claimed again here, and that new run's lease is fine.
            run = next((r for r in self.runs.values() if r.token == token), None)
            if run is not None:
                run.abort("lease lost")
        return lost

    def flush_in_background(self, force: bool = False) -> None:
        """flush_hooks without waiting for it: the serve loop goes on to wait for its next
        wake while spans are stored (on PostgreSQL in another database thread, so an event
        sent meanwhile is claimed at once). One at a time; a force asked for meanwhile
        flushes again after it."""
        if self._flushing is not None and not self._flushing.done():
            self._flush_again = self._flush_again or force
            return
        self._flushing = asyncio.ensure_future(self._flush_while_asked(force))

    async def _flush_while_asked(self, force: bool) -> None:
        while True:
            await self.flush_hooks(force)
            if not self._flush_again:
                return
            force, self._flush_again = True, False

    async def flush_now(self) -> None:
        """Store every queued span before returning (a background flush first ends)."""
        if self._flushing is not None:
            with contextlib.suppress(Exception):
                await self._flushing
        await self.flush_hooks(force=True)

    async def flush_hooks(self, force: bool = False) -> None:
        """Store queued spans: after runs, at most every FLUSH_SECONDS, and when idle."""
        if self.hooks is None:
            return
        now = time.monotonic()
        if force or now - self._last_flush >= FLUSH_SECONDS:
            self._last_flush = now
            assert self.db is not None
            try:
                await self.db(self.hooks.flush)
            except Exception:  # the spans stay queued for the next flush; the worker goes on
                log.warning(
                    "worker %s: could not store spans; will retry", self.worker_id, exc_info=True
                )

    async def _execute(
        self,
        pk: int,
        token: str,
        loaded: store.LoadedRun | None,
        absent: Collection[tuple[str, int]] = (),
    ) -> str:
        assert self.db is not None
        try:
            if loaded is None:
                return "aborted"  # deleted between the claim and the load
            inst = loaded.instance
            if inst.lease_token != token:
                return "aborted"
            if inst.run_count == 1:  # its first claim, even one that cannot run it
                meters.instance_started(inst.workflow, inst.created_at, inst.started_at)
            definition = registry.find_definition(inst.workflow, inst.version)
            if definition is None:
                reason = f"version {inst.version} of workflow {inst.workflow!r} is not registered in this worker"
                # absent: its version no worker ran lately (looked up once for the claim pass)
                gone = (inst.workflow, inst.version) in absent
                await self.db(store.park_unrunnable, pk, token, reason, store.VERSION_MISSING, gone)
                return Status.WAITING
            if inst.unproductive_claims >= MAX_UNPRODUCTIVE_CLAIMS:
                message = (
                    f"instance was taken over {inst.unproductive_claims} times without completing a step: "
                    "its run keeps killing or hanging its worker (poison instance); fix it in a new "
                    "version, then restart it on that version (restart(version=N))"
                )
                ended = await self.db(
                    store.finish,
                    pk,
                    token,
                    Status.ERRORED,
                    definition.limits(),
                    None,
                    ("PoisonInstance", message, ""),
                    [
                        History(
                            "instance.errored",
                            {"error": {"name": "PoisonInstance", "message": message}},
                        )
                    ],
                    {
                        "workflow": inst.workflow,
                        "source": "workflow.instance",
                        "name": "PoisonInstance",
                        "message": message,
                        "stack": "",
                        "trace_id": inst.trace_id,
                        "span_id": "",
                    },
                    inst.parent_id,  # a child's end locks its parent first and wakes it
                    None,
                    awaits_child(loaded.steps.values()),  # its step.invoke's child ends too
                )
                if ended:  # not when the lease was lost meanwhile
                    meters.instance_finished(inst.workflow, Status.ERRORED)
                return Status.ERRORED
            run = Run(
                definition,
                loaded,
                token,
                self.db,
                self.step_threads,
                self.hooks,
                self.group_commit,
                self.sleep_in_process,
            )
            self.runs[pk] = run
            if self._stopping:
                # Claimed before a stop the loop handled first (a signal while the claim's
                # answer was on its way): stop() and hurry() drained and cut short the runs
                # there were, not this one. It starts no work either.
                run.drain()
                if self.hurry_asked:
                    run.abort("worker shutting down")
            outcome = await run.execute()
            if outcome == "aborted" and run.undecodable is not None:
                # Not errored (a key restored makes it runnable again) nor left to its lease
                # (declared poison, blaming the workflow): parked, saying why.
                log.warning("instance #%s: %s", pk, run.undecodable)
                reason = f'{run.undecodable}; configure the WFDASH["PAYLOAD_CODEC"] (key) it was written with'
                await self.db(store.park_unrunnable, pk, token, reason, "")
                return Status.WAITING
            if (
                outcome == "aborted"
                and store.transient(run.abort_error)
                and (not run.sync_attempts or self._stopping)
            ):
                # Shutdown, an operator action, a dropped connection: give the lease back now
                # (fenced: a no-op when the lease is no longer ours), so the instance is
                # claimed again at once instead of when the lease runs out, and the takeover
                # is not counted as a crash. Not while a step callable still runs in a
                # thread here (another worker would run it at the same time) unless this
                # process is shutting down (its daemon step threads end with it), nor after
                # an error that would recur (the lease runs out and the takeover counts
                # towards the poison-instance limit).
                await self._release(pk, token)
            await self.flush_hooks()
            return outcome
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if store.transient(exc):
                log.warning(
                    "run of instance #%s cut short by a database error; released", pk, exc_info=True
                )
                await self._release(pk, token)
            else:
                log.exception(
                    "run of instance #%s failed inside the engine; its lease will run out", pk
                )
            return "aborted"

    async def _release(self, pk: int, token: str) -> None:
        self.unreleased[pk] = token
        await self.release_pending()

    async def release_pending(self) -> None:
        """Give back the leases of runs cut short. When the database refuses (it is down,
        or out of connections) they are tried again at every turn of the serve loop: an
        instance must not sit leased to a worker that no longer runs it until the lease
        runs out."""
        if not self.unreleased:
            return
        assert self.db is not None
        leases = list(self.unreleased.items())
        try:
            await self.db(store.release, leases)
        except Exception:
            log.warning(
                "worker %s: could not release %s leases; will retry",
                self.worker_id,
                len(leases),
                exc_info=True,
            )
            return
        for pk, token in leases:
            if self.unreleased.get(pk) == token:
                del self.unreleased[pk]

    # --- loops --------------------------------------------------------------------------

    async def serve(self, stop: asyncio.Event | None = None) -> None:
        """Run until `stop` is set (or stop() is called)."""
        await self.start()
        self._heartbeat = asyncio.ensure_future(self._heartbeat_loop())
        watch = LoopWatch(self, asyncio.get_running_loop(), self.loop_stall_renew_seconds)
        watch.start()
        listener = None
        if store.workers_listen():
            listener = store.WakeListener(self.hint)  # hints from every process, no Redis
            listener.start()
        try:
            while not self._stopping and not (stop is not None and stop.is_set()):
                assert self._wake is not None and self.db is not None
                self._wake.clear()
                timeout, due, started = self.poll_seconds, None, 0
                try:
                    await self.release_pending()
                    await self.fire_due_schedules()
                    started = await self.claim_and_start()
                    await self.refresh_plans_once()
                    await self.keep_catalog_once()
                    if await self.admit_stranded_once():
                        continue  # they are due now: claimed by the next pass
                    full = self._full = self.free_slots() <= 0
                    # Claim again at once only if the claim was cut short by the free places
                    # while places remain (more is due than it took).
                    more_due = started and not self.claimed_all_due
                    if (more_due and not full) or await self.maintain_once():
                        continue
                    if not full:  # a full worker cannot claim a due timer: a run ending wakes it
                        await self.prune_once()
                        due = (
                            self.next_timer
                            if self.next_timer_known
                            else await self.db(self._next_wake_at)
                        )
                        admission = self.next_admission_at  # a debounce ends, a rate window opens
                        if admission is not None and (due is None or admission < due):
                            due = admission
                    if self.next_tick is not None:  # an idle worker wakes for a schedule's tick
                        due = self.next_tick if due is None else min(due, self.next_tick)
                except Exception:
                    log.exception(
                        "worker %s: database error; retrying after the poll interval",
                        self.worker_id,
                    )
                if due is not None:
                    timeout = max(0.0, min(timeout, (due - clock.now()).total_seconds()))
                    if timeout == 0.0 and not started:
                        timeout = await self._contended_wait()
                self.flush_in_background(force=not self.tasks)  # going idle: store what is queued
                waiters = [asyncio.ensure_future(self._wake.wait())]
                if stop is not None:
                    waiters.append(asyncio.ensure_future(stop.wait()))
                self._waiting_until = clock.now() + timedelta(seconds=timeout)
                await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                self._waiting_until = None
                for waiter in waiters:
                    waiter.cancel()
        finally:
            try:
                await self.stop()  # first: the drain must not wait for the listener
            finally:
                self._heartbeat.cancel()  # stop() ended it once the runs had (then a no-op)
                watch.stop()
            if listener is not None:
                await asyncio.get_running_loop().run_in_executor(None, listener.stop)

    def _next_wake_at(self) -> datetime | None:
        """The next timer this worker could claim (of its queues, when started for some)."""
        if self.queues is None:
            return store.next_wake_at()
        return store.next_wake_at(self.queues)

    async def _contended_wait(self) -> float:
        """Seconds to wait when a timer is due but the claim took nothing. Another worker
        committing its claim: look again soon rather than spin on the same answer. Only
        another version's instances due, in their grace: wait until it ends."""
        versions = [(d.name, d.version) for d in registry.all_definitions()]
        try:
            claimable = await self.db(store.next_claimable_at, versions, self.queues)
        except DatabaseError:
            log.warning("could not read the next claimable time", exc_info=True)
            claimable = None
        if claimable is None:
            return CONTENDED_WAIT_SECONDS
        seconds = (claimable - clock.now()).total_seconds()
        return min(self.poll_seconds, max(CONTENDED_WAIT_SECONDS, seconds))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.lease_seconds / 3)
            try:
                await self.heartbeat_once()
            except Exception:
                log.exception("worker %s: heartbeat failed", self.worker_id)

    async def run_until_idle(self, timeout: float = 10.0) -> int:
        """Run until no instance is runnable now and none is running; returns runs made."""
        runs = 0

        async def drain() -> None:
            nonlocal runs
            while True:
                await self.release_pending()
                await self.fire_due_schedules()
                # A run that ends from here on, while the claim, maintain_once or
                # admit_stranded_once is out, may have made due what the claim did not
                # see (a child's end wakes its parent, an end promotes a queued instance,
                # a parent parks after starting its child): the wait below would not see
                # it end, and that work would wait for the other runs to end.
                ended = self.runs_ended
                started = await self.claim_and_start()
                runs += started
                if await self.maintain_once(force=True):
                    continue  # a bulk batch may have made instances runnable
                if await self.admit_stranded_once(force=True):
                    continue
                if self.runs_ended != ended:
                    continue  # claim again, with the places the ended runs freed
                if not self.tasks:
                    await self.flush_now()
                    return  # nothing ran or ended since the claim looked, and it found nothing
                await asyncio.wait(list(self.tasks.values()), return_when=asyncio.FIRST_COMPLETED)

        await asyncio.wait_for(drain(), timeout)
        return runs


def newest_definitions() -> list[registry.Definition]:
    """The newest registered version of each workflow: the one schedules start."""
    newest: dict[str, registry.Definition] = {}
    for definition in registry.all_definitions():
        if definition.version > getattr(newest.get(definition.name), "version", 0):
            newest[definition.name] = definition
    return list(newest.values())


def sync_catalog() -> None:
    """Record every registered version in the catalog; refuse changed code under an old version."""
    strict = bool(engine_settings().get("STRICT_VERSIONS", True))
    for definition in registry.all_definitions():
        store.sync_catalog(
            definition.name,
            definition.version,
            definition.source_hash,
            definition.class_path,
            strict,
        )
