"""Channels' runworker; on the `workflows` channel it also runs the wfdash engine.

    python manage.py runworker workflows

Hints arrive on the channel and on the workers' group; the engine claims instances from
the database under leases, so any number of these processes can run on any machines.
SIGTERM stops claiming, lets running steps finish for a grace period and releases leases.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

from channels.management.commands.runworker import Command as ChannelsRunworker
from channels.worker import Worker as ChannelsWorker

from workflows_app.engine.worker import Worker as EngineWorker
from workflows_app.engine.worker import notify_local
from workflows_app.live import EngineHooks, join_workers_group

log = logging.getLogger("workflows_app.engine")
ENGINE_CHANNEL = "workflows"
LISTEN_RETRY_SECONDS = 1.0


class EngineChannelsWorker(ChannelsWorker):
    async def handle(self) -> None:
        if ENGINE_CHANNEL not in self.channels:
            await super().handle()
            return
        engine = EngineWorker(hooks=EngineHooks())
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # A private channel in the workers' group, so broadcast hints (terminate) reach us.
        private = await self.channel_layer.new_channel()
        await join_workers_group(private)
        listeners = [
            asyncio.ensure_future(self.keep_listening(self.listener, c)) for c in self.channels
        ]
        listeners.append(asyncio.ensure_future(self.keep_listening(self.hints, private)))
        log.info("wfdash worker %s running (concurrency %s)", engine.worker_id, engine.concurrency)
        try:
            await engine.serve(stop)
        finally:
            for listener in listeners:
                listener.cancel()

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

    async def hints(self, channel: str) -> None:
        while True:
            message = await self.channel_layer.receive(channel)
            notify_local(str(message.get("kind", "wake")), message.get("pk"))


class Command(ChannelsRunworker):
    worker_class = EngineChannelsWorker
