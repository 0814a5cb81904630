"""daphne's runserver, plus the embedded wfdash worker started in daphne's event loop
before the first request, so timers fire with no browser connected."""

from __future__ import annotations

import asyncio
from typing import Any

from daphne.management.commands.runserver import Command as DaphneRunserver
from daphne.server import Server


class EngineServer(Server):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        ready = kwargs.get("ready_callable")

        def on_ready() -> None:
            from workflows_app.embedded import start_embedded_worker

            start_embedded_worker(asyncio.get_event_loop())  # daphne's loop; runs once the reactor starts
            if ready:
                ready()

        kwargs["ready_callable"] = on_ready
        super().__init__(*args, **kwargs)


class Command(DaphneRunserver):
    server_cls = EngineServer
