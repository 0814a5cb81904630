from __future__ import annotations

from typing import Any

websocket_urlpatterns: list[Any] = []
