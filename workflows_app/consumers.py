"""Channels consumers: the engine's channel (`runworker workflows`)."""

from __future__ import annotations

from typing import Any

from channels.consumer import AsyncConsumer

from .engine.worker import notify_local


class EngineConsumer(AsyncConsumer):
    """Receives hints on the `workflows` channel and passes them to this process's workers."""

    async def wf_hint(self, message: dict[str, Any]) -> None:
        notify_local(str(message.get("kind", "wake")), message.get("pk"))
