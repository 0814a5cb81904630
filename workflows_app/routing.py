"""WebSocket routes of the dashboard (wrapped in origin validation and auth by asgi.py)."""

from __future__ import annotations

from typing import Any

from django.urls import path

from . import consumers

websocket_urlpatterns: list[Any] = [
    path("ws/overview/", consumers.OverviewConsumer.as_asgi()),
    path("ws/instances/", consumers.InstanceListConsumer.as_asgi()),
    path("ws/instances/<int:pk>/", consumers.InstanceDetailConsumer.as_asgi()),
]
