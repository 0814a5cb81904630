"""daphne's runserver, plus the embedded wfdash worker started in daphne's event loop
before the first request, so timers fire with no browser connected."""

from __future__ import annotations

import asyncio
from typing import Any

from daphne.management.commands.runserver import Command as DaphneRunserver
from daphne.server import Server
from django.core.management.base import CommandError


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

    def inner_run(self, *args: Any, **options: Any) -> Any:
        # Refuse to serve with an engine that could not start: a version registered with
        # changed code would otherwise stop the embedded worker while pages still load.
        # Not migrated yet: the migration check says so; the worker waits for it.
        from workflows_app.embedded import changed_versions

        refused = changed_versions()
        if refused:
            raise CommandError(refused)
        return super().inner_run(*args, **options)
