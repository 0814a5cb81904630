"""ASGI entry point: HTTP (Django), WebSockets (dashboard) and the `workflows` channel."""

from __future__ import annotations

import os
import sys
from typing import Any

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "wfdash.settings")
django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack
from channels.routing import ChannelNameRouter, ProtocolTypeRouter, URLRouter

from workflows_app.backpressure import SendBackpressure
from workflows_app.consumers import EngineConsumer
from workflows_app.embedded import changed_versions, start_embedded_worker
from workflows_app.origins import SameOriginValidator
from workflows_app.routing import websocket_urlpatterns

if "daphne.cli" in sys.modules:
    # daphne's command line is importing the application to serve it: a workflow's code
    # changed under a stored version refuses the embedded worker, so refuse to serve, in
    # one line and exit 1, as runserver and runworker do. It served without the engine,
    # saying so only at the first request, in the engine's traceback.
    refused = changed_versions()
    if refused:
        raise SystemExit(f"wfdash: {refused}")

router = ProtocolTypeRouter(
    {
        # A streamed response (the history's SSE) waits for a client that stops reading.
        "http": SendBackpressure(django_asgi_app),
        "websocket": SameOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
        "channel": ChannelNameRouter({"workflows": EngineConsumer.as_asgi()}),
    }
)


async def application(scope: dict[str, Any], receive: Any, send: Any) -> None:
    # Fallback for ASGI servers other than our runserver: start the embedded engine on the
    # first call. `runserver` starts it before any request arrives.
    if scope["type"] != "channel":
        start_embedded_worker()
    await router(scope, receive, send)
