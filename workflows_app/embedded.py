"""The embedded worker: the engine running inside the ASGI server's own event loop.

Daphne has no startup hook, so `manage.py runserver` (our subclass of daphne's) starts it
from daphne's ready callback, and the ASGI application starts it on its first call as a
fallback for other servers. Running in the server's loop matters: the in-memory channel
layer only reaches consumers in the same process and event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from django.conf import settings

from .engine.worker import Worker, worker_queues
from .live import EngineHooks
from .schema import (
    begin_again_on_dropped_connection,
    not_migrated_message,
    unapplied_migrations,
    unreachable_database,
)

log = logging.getLogger("workflows_app.engine")
# The signals that stop the server (and drain its worker): the reactor's own and SIGHUP.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_worker: Worker | None = None
_task: asyncio.Task[None] | None = None
_stop: asyncio.Event | None = None
_loop: asyncio.AbstractEventLoop | None = None


def embedded_enabled() -> bool:
    return bool(getattr(settings, "WFDASH", {}).get("EMBEDDED_WORKER", False))


def embedded_queues() -> tuple[str, ...] | None:
    """WFDASH["EMBEDDED_WORKER_QUEUES"]: the Django task queues the embedded worker runs
    (then nothing else; default: everything). ValueError naming the setting when malformed."""
    setting = 'WFDASH["EMBEDDED_WORKER_QUEUES"]'
    queues = worker_queues(getattr(settings, "WFDASH", {}).get("EMBEDDED_WORKER_QUEUES"), setting)
    if queues is not None:
        with contextlib.suppress(ImportError):  # no tasks framework: nothing to check against
            from .tasks import unknown_queues

            unknown = unknown_queues(queues)
            if unknown:
                log.warning(
                    "%s: no task backend in TASKS has the queue(s) %s", setting, ", ".join(unknown)
                )
    return queues


def changed_versions() -> str | None:
    """What refuses the embedded worker's start, as one line: a workflow's code changed
    under a version the catalog has (a deploy that did not bump it), or a database that
    kept dropping the connection under the check. None when nothing does, or when the
    database cannot say yet (not reachable or not migrated: the worker waits for it,
    saying so). Called before the server serves: runserver raises it as a CommandError,
    daphne's command line exits with it (wfdash/asgi.py)."""
    from django.core.management.base import CommandError
    from django.db import DatabaseError

    from .engine.errors import VersionConflict

    if not embedded_enabled():
        return None
    try:
        begin_again_on_dropped_connection(sync_catalog_once_migrated, "embedded wfdash worker")
    except (VersionConflict, CommandError) as exc:
        return str(exc)
    except DatabaseError:  # not a dropped connection: the engine's own start says what
        return None
    return None


def sync_catalog_once_migrated() -> None:
    """The engine's catalog sync (VersionConflict for changed code), unless the database
    is not reachable or not migrated yet. A dropped connection is the caller's to try
    again: it was taken for a database that could not say, and a deploy whose code changed
    under a stored version served without its engine."""
    from django.db import connection

    from .engine.worker import sync_catalog

    if unreachable_database() or unapplied_migrations():
        return
    try:
        sync_catalog()
    finally:
        connection.close()  # this thread's: the engine and the requests use their own


def start_embedded_worker(loop: asyncio.AbstractEventLoop | None = None) -> Worker | None:
    """Start the engine in `loop` (default: the running loop) once per process."""
    global _worker, _task, _stop, _loop
    if _worker is not None or not embedded_enabled():
        return _worker
    loop = _loop = loop or asyncio.get_running_loop()
    _worker = Worker(hooks=EngineHooks(), queues=embedded_queues())
    _stop = asyncio.Event()
    _task = loop.create_task(_serve(_worker, _stop))
    drain_at_daphne_shutdown(loop)
    log.info("embedded wfdash worker %s started", _worker.worker_id)
    return _worker


def drain_at_daphne_shutdown(loop: asyncio.AbstractEventLoop) -> None:
    """Under daphne (its runserver or the `daphne` command), SIGTERM stops Twisted's
    reactor, which cancels the application's connections but knows nothing of the engine:
    have the reactor wait for the drain before it shuts down, or the runs' leases stay
    held until they expire."""
    if "twisted.internet.reactor" not in sys.modules:
        return  # another ASGI server: it has no reactor to hook
    from twisted.internet import defer, reactor

    reactor.addSystemEventTrigger(
        "before",
        "shutdown",
        lambda: defer.Deferred.fromFuture(loop.create_task(stop_embedded_worker())),
    )
    # Twisted stops on SIGTERM and SIGINT only: SIGHUP (the terminal or ssh session closed)
    # killed the server with its worker mid-step, the leases left to run out. It stops the
    # reactor too now, so the drain above runs; a handler someone set is left alone.
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers are the main thread's to set
    if signal.getsignal(signal.SIGHUP) == signal.SIG_DFL:
        signal.signal(signal.SIGHUP, lambda *_: reactor.callFromThread(_stop_reactor, reactor))
    # Once the reactor has set its own handlers (at once when it runs already).
    reactor.callWhenRunning(_tell_the_worker_of_stop_signals)


def _tell_the_worker_of_stop_signals() -> None:
    """Twisted's handlers only schedule the reactor's stop on the event loop: a run()
    spinning without an await holds that loop, so the drain never came and the server
    went on spinning until SIGKILL, its leases held until they ran out. Each stop signal
    now also reaches the worker itself (Worker.ask_to_stop, as runworker's handler does),
    for LoopWatch to give the leases back and end the process (STUCK_EXIT_CODE) once the
    drain's bound is over while the loop stays silent; a second signal cuts it short.
    The handlers set before are called as they were."""
    for sig in STOP_SIGNALS:
        before = signal.getsignal(sig)
        if not callable(before):
            continue  # SIG_DFL or SIG_IGN: nothing here stops the reactor on it
        signal.signal(sig, functools.partial(_note_stop_signal, before))


def _note_stop_signal(before: Callable[[int, Any], Any], signum: int, frame: Any) -> None:
    note_stop_signal(signum)
    before(signum, frame)


_stop_signals_seen = 0


def note_stop_signal(signum: int) -> bool:
    """Tell the embedded worker (if started) of a stop signal: the first asks it to stop,
    a second hurries its drain. True for the process's first stop signal."""
    global _stop_signals_seen
    _stop_signals_seen += 1
    worker = _worker
    if worker is not None:
        first = worker.ask_to_stop(signal.Signals(signum).name)
        if not first and _loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                _loop.call_soon_threadsafe(worker.hurry)
    return _stop_signals_seen == 1


def _stop_reactor(reactor: Any) -> None:
    with contextlib.suppress(Exception):  # already stopping (a second signal)
        reactor.stop()


async def _serve(worker: Worker, stop: asyncio.Event) -> None:
    from .engine.errors import VersionConflict

    try:
        if await _migrated(worker, stop):
            await worker.serve(stop)
    except VersionConflict as exc:
        # Another ASGI server than daphne's command line (which exits on it before
        # serving): one line, as runworker and runserver say it, not the engine's traceback.
        log.critical("embedded wfdash worker refused: %s; no workflow runs in this process", exc)
    except Exception:
        # Nothing runs from now on: say so as loudly as the log allows.
        log.critical(
            "embedded wfdash worker stopped: no workflow runs in this process", exc_info=True
        )


async def _migrated(worker: Worker, stop: asyncio.Event) -> bool:
    """Wait for the database and for `migrate`, saying so once each, instead of a
    traceback every poll interval; False if the server stops first. The pages keep
    serving meanwhile.

    An unreachable PostgreSQL is asked directly, in seconds (schema.unreachable_database):
    through the pool each look waited 30 s, the failed one counted as migrated, and the
    engine's start-up then retried for a quarter of an hour, a traceback every 30 s, with
    the server's SIGTERM unanswered until it gave up (and the engine never ran)."""
    loop = asyncio.get_running_loop()
    said = ""  # what the log said the worker waits for: "database", "migrate" or "answer"
    while not stop.is_set():
        problem = await loop.run_in_executor(None, unreachable_database)
        pending = None if problem else await loop.run_in_executor(None, unapplied_migrations)
        if problem is None and pending is not None and not pending:
            if said:
                log.info(
                    "embedded wfdash worker %s: the database is migrated",
                    worker.worker_id,
                )
            return True
        if problem:
            kind, waits_for = "database", problem
        elif pending:
            kind, waits_for = "migrate", not_migrated_message(pending)
        else:
            kind, waits_for = "answer", "the database did not answer; trying again"
        if kind != said:
            log.error("embedded wfdash worker %s waits: %s", worker.worker_id, waits_for)
            said = kind
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), worker.poll_seconds)
    return False


def embedded_worker() -> Worker | None:
    return _worker


async def stop_embedded_worker() -> None:
    """The server is shutting down (a deploy's SIGTERM): drain the embedded worker as
    runworker drains, its runs parked at their next step boundary or their leases given
    back, so the next process takes them at once instead of waiting out the leases (and
    counting the takeover towards the poison limit)."""
    if _stop is None or _task is None:
        return
    _stop.set()
    await asyncio.shield(_task)
