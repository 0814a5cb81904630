"""Channels' runworker; on the `workflows` channel it also runs the wfdash engine.

    python manage.py runworker workflows
    python manage.py runworker workflows --queues emails,reports   # those task queues only

Hints arrive on the channel and on the workers' group; the engine claims instances from
the database under leases, so any number of these processes can run on any machines.
SIGTERM (or SIGINT, SIGHUP) stops claiming, lets running steps finish for a grace period
and releases leases (a second signal cuts it short);
the log says what was running, how each of those runs ended, and when the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from channels.management.commands.runworker import Command as ChannelsRunworker
from channels.worker import Worker as ChannelsWorker
from django.conf import settings
from django.core.management.base import CommandError
from django.db import connection

from workflows_app.engine.worker import Worker as EngineWorker
from workflows_app.engine.worker import notify_local, worker_queues
from workflows_app.live import EngineHooks, join_workers_group

log = logging.getLogger("workflows_app.engine")
ENGINE_CHANNEL = "workflows"
LISTEN_RETRY_SECONDS = 1.0
# channels_redis drops group members older than its group_expiry (a day by default) at
# each group_send: the worker joins its group again well within it.
REJOIN_SECONDS = 3600.0
# Each drains the worker; a second one cuts the runs still going short at once. SIGHUP
# (the terminal or ssh session that started it closed) too: by default it killed the
# worker mid-step, its leases left to run out and the takeover counted as a crash towards
# the poison limit. SIGQUIT keeps its default (an immediate core dump, no drain).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


DRAIN_OUTCOMES = {
    "waiting": "parked at a step boundary, due at once for another worker",
    "paused": "paused at a step boundary",
    "aborted": "cut short; its lease is released for another worker",
}


class DrainReport(EngineHooks):
    """Logs a worker's shutdown: what was running, how each of those runs ended, the exit.

    It only watches: the drain itself (stop claiming, let steps finish, park, release
    leases) is the engine's Worker.stop().
    """

    def __init__(self) -> None:
        super().__init__()
        self.draining: dict[int, str] | None = None  # pk -> how its run ended ("" = not yet)

    def begin(self, engine: EngineWorker, signal_name: str) -> None:
        self.draining = dict.fromkeys(sorted(engine.tasks), "")
        running = ", ".join(f"#{pk}" for pk in self.draining) or "none"
        log.info(
            "wfdash worker %s: %s received; claiming nothing new. %d run(s) finishing their "
            "current step (instances %s), for up to %s s",
            engine.worker_id,
            signal_name,
            len(self.draining),
            running,
            engine.drain_seconds,
        )

    def hurry(self, engine: EngineWorker, signal_name: str) -> None:
        waiting = ", ".join(f"#{pk}" for pk in sorted(engine.tasks)) or "none"
        log.info(
            "wfdash worker %s: %s received again; cutting short the runs still going "
            "(instances %s) now",
            engine.worker_id,
            signal_name,
            waiting,
        )

    def run_finished(self, pk: int, outcome: str) -> None:
        super().run_finished(pk, outcome)
        if self.draining is not None and pk in self.draining:
            self.draining[pk] = outcome
            how = DRAIN_OUTCOMES.get(outcome, f"finished ({outcome})")
            log.info("wfdash worker: instance #%s %s", pk, how)

    def end(self, engine: EngineWorker) -> None:
        if self.draining is None:
            log.info("wfdash worker %s: stopped; exiting", engine.worker_id)
            return
        parked = sum(1 for o in self.draining.values() if o in ("waiting", "paused"))
        finished = sum(1 for o in self.draining.values() if o not in ("", "waiting", "paused"))
        unreported = [f"#{pk}" for pk, o in self.draining.items() if not o]
        log.info(
            "wfdash worker %s: drained: %d parked, %d finished or cut short%s; leases released; "
            "exiting",
            engine.worker_id,
            parked,
            finished,
            f", {len(unreported)} cancelled ({', '.join(unreported)})" if unreported else "",
        )


class EngineChannelsWorker(ChannelsWorker):
    def __init__(self, *args: Any, queues: tuple[str, ...] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.queues = queues  # --queues: the Django task queues it runs (None: everything)

    async def handle(self) -> None:
        if ENGINE_CHANNEL not in self.channels:
            await super().handle()
            return
        report = DrainReport()
        engine = EngineWorker(hooks=report, queues=self.queues)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal(sig: signal.Signals) -> None:
            if not stop.is_set():
                report.begin(engine, sig.name)
            else:
                report.hurry(engine, sig.name)
                engine.hurry()
            stop.set()

        def handler(signum: int, _frame: Any) -> None:
            # A Python-level handler, not loop.add_signal_handler: it runs between two
            # bytecodes of the main thread even while a run() spinning without an await
            # holds the loop, so LoopWatch learns of the signal and can end the process.
            sig = signal.Signals(signum)
            engine.ask_to_stop(sig.name)
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(on_signal, sig)

        previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
        # A private channel in the workers' group, so broadcast hints (terminate) reach us.
        private = await self.channel_layer.new_channel()
        try:
            await join_workers_group(private)
        except Exception as exc:
            # Redis down at start: one line saying which, not redis-py's traceback.
            raise CommandError(
                f"cannot reach Redis (REDIS_URL) at {redis_address()}: {exc}. Start Redis or fix REDIS_URL"
            ) from None
        metrics_server = serve_metrics()
        listeners = [
            asyncio.ensure_future(self.keep_listening(self.listener, c)) for c in self.channels
        ]
        listeners.append(asyncio.ensure_future(self.keep_listening(self.hints, private)))
        listeners.append(asyncio.ensure_future(self.stay_in_workers_group(private)))
        log.info(
            "wfdash worker %s running (concurrency %s%s)",
            engine.worker_id,
            engine.concurrency,
            f"; task queues {', '.join(engine.queues)} only" if engine.queues else "",
        )
        try:
            await engine.serve(stop)
        finally:
            for sig, before in previous.items():  # a signal now stops the exit as it would
                signal.signal(sig, before)
            for listener in listeners:
                listener.cancel()
            if metrics_server is not None:
                metrics_server.shutdown()
            report.end(engine)

    async def keep_listening(self, listen: Callable[[str], Awaitable[None]], channel: str) -> None:
        """A channel-layer error (Redis restarting, a read timeout) must not silence the
        worker for good: the engine would still poll, but hints would be lost until restart."""
        while True:
            try:
                await listen(channel)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning(
                    "wfdash worker: receiving on %s failed; listening again", channel, exc_info=True
                )
                await asyncio.sleep(LISTEN_RETRY_SECONDS)

    async def stay_in_workers_group(self, channel: str) -> None:
        while True:
            await asyncio.sleep(REJOIN_SECONDS)
            try:
                await join_workers_group(channel)
            except Exception:
                log.warning("wfdash worker: could not join the workers' group again", exc_info=True)

    async def hints(self, channel: str) -> None:
        while True:
            message = await self.channel_layer.receive(channel)
            notify_local(str(message.get("kind", "wake")), message.get("pk"))


def checked_queues(value: str) -> tuple[str, ...]:
    """--queues as names; CommandError for an empty name or one no task backend has."""
    try:
        queues = worker_queues(value, "--queues")
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    assert queues is not None
    try:
        from workflows_app.tasks import unknown_queues
    except ImportError:  # no tasks framework installed: nothing to check against
        return queues
    unknown = unknown_queues(queues)
    if unknown:
        raise CommandError(
            f"--queues: no task backend in TASKS has the queue(s) {', '.join(unknown)} "
            "(each backend's QUEUES)"
        )
    return queues


def wait_for_database() -> None:
    """An unreachable PostgreSQL at start: tried again with backoff (1, 2, 4… up to 15 s
    apart), one line each time, for WFDASH["START_WAIT_SECONDS"] (a database starting
    beside the worker, a restart); then CommandError, exit 1, for the supervisor (systemd's
    Restart=, Kubernetes' back-off) to start it again and show why. Without this, each of
    the engine's start-up tries waited the pool's 30 s: a quarter of an hour of tracebacks
    and pool errors, SIGTERM unanswered, before the process gave up."""
    from workflows_app.schema import unreachable_database

    limit = float(getattr(settings, "WFDASH", {}).get("START_WAIT_SECONDS", 60))
    started = time.monotonic()
    delay = 1.0
    while True:
        problem = unreachable_database()
        if problem is None:
            return
        waited = time.monotonic() - started
        if waited + delay > limit:
            raise CommandError(
                f"{problem} (tried for {waited:.0f} s, WFDASH_START_WAIT_SECONDS={limit:g})"
            )
        log.warning("wfdash worker: %s; trying again in %g s", problem, delay)
        time.sleep(delay)
        delay = min(delay * 2, 15.0)


def redis_address() -> str:
    """REDIS_URL's host and port, never its password."""
    parts = urlsplit(getattr(settings, "REDIS_URL", ""))
    if parts.scheme == "unix":
        return parts.path
    return f"{parts.hostname}:{parts.port or 6379}"


def serve_metrics() -> Any:
    """WFDASH["METRICS_PORT"]: this worker's own metrics for Prometheus to scrape."""
    conf = getattr(settings, "WFDASH", {})
    port = conf.get("METRICS_PORT")
    if not port or not conf.get("METRICS", True):
        return None
    from workflows_app import metrics

    addr = conf.get("METRICS_ADDR", "127.0.0.1")
    try:
        server = metrics.serve_process_metrics(int(port), addr)
    except OSError as exc:
        # A port another process holds (a second worker on the host with the same
        # setting) or an address not of this host: one line saying which, not a traceback.
        raise CommandError(
            f"cannot serve this worker's metrics at {addr}:{port} (WFDASH_METRICS_ADDR, "
            f"WFDASH_METRICS_PORT): {exc.strerror or exc}. Give each worker on a host a "
            "port of its own, or leave WFDASH_METRICS_PORT unset"
        ) from None
    log.info("wfdash worker metrics at http://%s:%s/metrics", addr, server.server_port)
    return server


class Command(ChannelsRunworker):
    worker_class = EngineChannelsWorker

    def add_arguments(self, parser: Any) -> None:
        super().add_arguments(parser)
        parser.add_argument(
            "--queues",
            default=None,
            help="Run only the Django tasks of these queues, separated by commas (and no "
            "other workflow instance). Default: every instance, every queue.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        queues = options.get("queues")
        if queues is not None:
            if ENGINE_CHANNEL not in options.get("channels", ()):
                raise CommandError(f"--queues is for the {ENGINE_CHANNEL!r} channel's engine")
            queues = checked_queues(queues)
            self.worker_class = functools.partial(EngineChannelsWorker, queues=queues)
        if ENGINE_CHANNEL in options.get("channels", ()):
            start_checks()
        super().handle(*args, **options)


def start_checks() -> None:
    """Before the engine starts: the database reachable, migrated, and no workflow's code
    changed under a stored version; begun again on a new connection when the server drops
    theirs (it exited 1 when a fleet's backends were ended as it started)."""
    from workflows_app.schema import begin_again_on_dropped_connection

    begin_again_on_dropped_connection(check_database_once, "wfdash worker")


def check_database_once() -> None:
    """One try of start_checks: CommandError when the database is not reachable (after
    waiting for it), not migrated, or refuses a version."""
    from workflows_app.schema import not_migrated_message, unapplied_migrations

    wait_for_database()
    pending = unapplied_migrations()
    if pending:
        raise CommandError(not_migrated_message(pending))
    refuse_changed_versions()


def refuse_changed_versions() -> None:
    """A workflow's code changed under a version the catalog has (a deploy that did not
    bump it): one line naming it and what to do, exit 1, before the worker says it runs.
    The engine's start-up refused it too, but as a traceback after 'running'."""
    from workflows_app.engine.errors import VersionConflict
    from workflows_app.engine.worker import sync_catalog

    try:
        sync_catalog()
    except VersionConflict as exc:
        raise CommandError(str(exc)) from None
    finally:
        connection.close()  # this thread's: the engine uses its own
