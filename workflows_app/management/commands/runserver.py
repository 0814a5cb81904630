"""daphne's runserver, plus the embedded wfdash worker started in daphne's event loop
before the first request, so timers fire with no browser connected."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
from typing import Any

from daphne.management.commands.runserver import Command as DaphneRunserver
from daphne.server import Server
from django.core.management.base import CommandError
from django.utils import autoreload


class EngineServer(Server):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        ready = kwargs.get("ready_callable")

        def on_ready() -> None:
            from workflows_app.embedded import start_embedded_worker

            # daphne's loop; runs once the reactor starts. start_embedded_worker has the
            # reactor drain the worker before it shuts down (SIGTERM).
            start_embedded_worker(asyncio.get_event_loop())
            if ready:
                ready()

        kwargs["ready_callable"] = on_ready
        super().__init__(*args, **kwargs)


class Command(DaphneRunserver):
    server_cls = EngineServer

    def handle(self, *args: Any, **options: Any) -> Any:
        # An unreachable PostgreSQL: one line in seconds, exit 1. Django's migration check
        # waited the connection pool's 30 s, then ended the server with a traceback naming
        # neither host nor database. Here, before the autoreloader starts its child: an
        # error in that child's thread would leave the parent waiting for a file change.
        from workflows_app.schema import unreachable_database

        problem = unreachable_database()
        if problem:
            raise CommandError(problem)
        return super().handle(*args, **options)

    def run(self, **options: Any) -> None:
        """With the autoreloader, Django's parent process waited on its child in
        subprocess.run: a SIGTERM to it (SystemExit) or a Ctrl-C there had subprocess.run
        SIGKILL the child, and the child's own SIGTERM handler only ended its main thread.
        Either way the embedded worker, in the child, died mid-step with its leases held
        until they ran out. Here the parent passes SIGTERM on to the child and waits for
        it, and the child drains its worker on SIGTERM, SIGINT or SIGHUP, as without the
        autoreloader."""
        if not options["use_reloader"]:
            return super().run(**options)
        if os.environ.get(autoreload.DJANGO_AUTORELOAD_ENV) != "true":
            sys.exit(_reloader_parent())
        _reloader_child(self.inner_run, **options)
        return None

    def inner_run(self, *args: Any, **options: Any) -> Any:
        # Refuse to serve with an engine that could not start: a version registered with
        # changed code would otherwise stop the embedded worker while pages still load.
        # Not migrated yet: the migration check says so; the worker waits for it.
        from workflows_app.embedded import changed_versions

        refused = changed_versions()
        if refused:
            raise CommandError(refused)
        global _server_thread
        _server_thread = threading.current_thread()
        return super().inner_run(*args, **options)

    def check_migrations(self) -> None:
        """Django's look for unapplied migrations, begun again on a new connection when the
        server drops it (a restart, a failover): it ended runserver's start on the
        traceback."""
        from workflows_app.schema import begin_again_on_dropped_connection

        begin_again_on_dropped_connection(super().check_migrations, "runserver")


_server_thread: threading.Thread | None = None
# How long the reloader's child waits for its server thread (the worker's drain, then the
# reactor's shutdown) after a stop signal or a file change before it exits anyway.
CHILD_STOP_SECONDS = 60.0
RELOAD_EXIT_CODE = 3  # the child's exit code that asks its parent for another (Django's)


def _reloader_parent() -> int:
    """Django's restart_with_reloader, but the child is waited for, not killed: SIGTERM is
    passed on to it; SIGINT and SIGHUP (the terminal's, sent to its whole foreground
    group, the child included) are left to it. Exit code 3 asks for a restart (a file
    changed), as in Django."""
    environ = {**os.environ, autoreload.DJANGO_AUTORELOAD_ENV: "true"}
    arguments = autoreload.get_child_arguments()
    while True:
        child = subprocess.Popen(arguments, env=environ, close_fds=False)
        signal.signal(signal.SIGTERM, functools.partial(_pass_on, child))
        for sig in (signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda signum, frame: None)
        returncode = child.wait()
        if returncode != RELOAD_EXIT_CODE:
            return returncode


def _pass_on(child: subprocess.Popen[bytes], signum: int, frame: Any) -> None:
    child.send_signal(signum)


def _reloader_child(inner_run: Any, **options: Any) -> None:
    """Django's run_with_reloader in the child, with stop signals that drain the embedded
    worker: the server runs in a thread whose reactor sets no signal handlers, and the
    main thread watches files. A file changed: Django's reloader ended the child at once
    (sys.exit(3) in this thread), the worker mid-step, its leases held until they ran out:
    the next child took those runs only then, each takeover counted towards the poison
    limit (three edits during one long step errored the run). The worker drains first
    now, as at SIGTERM, and the next child takes the runs at once."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _stop_child)
    reloader = autoreload.get_reloader()
    try:
        autoreload.start_django(reloader, inner_run, **options)
    except SystemExit as exc:
        if exc.code == RELOAD_EXIT_CODE:
            _stop_server()
            _wait_for_server()
        raise


def _stop_child(signum: int, frame: Any) -> None:
    """Stop the reactor (its shutdown drains the embedded worker, embedded.py), wait for
    the server's thread to end, then exit. A second signal, arriving during that wait,
    cuts the drain short (Worker.hurry), as in runworker."""
    from workflows_app.embedded import note_stop_signal

    first = note_stop_signal(signum)
    _stop_server()
    if not first:
        return
    _wait_for_server()
    sys.exit(0)


def _stop_server() -> None:
    """Stop the reactor; its shutdown drains the embedded worker (embedded.py)."""
    from twisted.internet import reactor

    with contextlib.suppress(Exception):  # not running yet, or stopping already
        reactor.callFromThread(_stop_reactor, reactor)


def _wait_for_server() -> None:
    server = _server_thread
    if server is not None:
        server.join(CHILD_STOP_SECONDS)


def _stop_reactor(reactor: Any) -> None:
    with contextlib.suppress(Exception):  # already stopping
        reactor.stop()
