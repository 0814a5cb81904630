"""WebSocket routes of the dashboard (wrapped in origin validation and auth by asgi.py)."""

from __future__ import annotations

from typing import Any

from django.urls import path, re_path

from . import (
    consumers,
    converters,  # noqa: F401  (registers the pk converter)
)

websocket_urlpatterns: list[Any] = [
    path("ws/overview/", consumers.OverviewConsumer.as_asgi()),
    path("ws/instances/", consumers.InstanceListConsumer.as_asgi()),
    path("ws/instances/<pk:pk>/", consumers.InstanceDetailConsumer.as_asgi()),
    path("ws/bulk-jobs/<pk:pk>/", consumers.BulkJobConsumer.as_asgi()),
    re_path(r"", consumers.UnknownPathConsumer.as_asgi()),  # last: refused, not a 500 handshake
]
