"""In-process engine workers for the bench: run_until_idle, or serve() in a thread."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from typing import Any

from workflows_app.engine.worker import Worker
from workflows_app.live import EngineHooks


class CountingHooks(EngineHooks):
    """EngineHooks (spans stored after each run) that also count run outcomes."""

    def __init__(self) -> None:
        super().__init__()
        self.outcomes: Counter[str] = Counter()
        self.cond = threading.Condition()

    def run_finished(self, pk: int, outcome: str) -> None:
        super().run_finished(pk, outcome)
        with self.cond:
            self.outcomes[outcome] += 1
            self.cond.notify_all()

    def wait_for(self, outcome: str, count: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.outcomes[outcome] < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
        return True


async def _run_until_idle(worker: Worker, timeout: float) -> tuple[int, float]:
    await worker.start()
    try:
        t0 = time.perf_counter()
        runs = await worker.run_until_idle(timeout)
        return runs, time.perf_counter() - t0
    finally:
        await worker.stop(grace_seconds=0)


def run_until_idle(timeout: float = 600, **worker_kwargs: Any) -> tuple[int, float]:
    """Start a worker, time run_until_idle (start-up excluded); (runs, seconds)."""
    worker = Worker(
        worker_id="bench", hooks=worker_kwargs.pop("hooks", None) or EngineHooks(), **worker_kwargs
    )
    return asyncio.run(_run_until_idle(worker, timeout))


class _SignallingWorker(Worker):
    ready: threading.Event

    async def start(self) -> None:
        await super().start()
        self.ready.set()


class ServingWorker:
    """`with ServingWorker() as w:` runs worker.serve() in a background thread's event loop."""

    def __init__(self, **worker_kwargs: Any) -> None:
        self.hooks = CountingHooks()
        self.worker = _SignallingWorker(
            worker_id="bench-serving", hooks=self.hooks, **worker_kwargs
        )
        self.worker.ready = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop_event: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._main, name="bench-serving-worker", daemon=True)
        self.error: BaseException | None = None

    def _main(self) -> None:
        async def serve() -> None:
            self.loop = asyncio.get_running_loop()
            self.stop_event = asyncio.Event()
            await self.worker.serve(self.stop_event)

        try:
            asyncio.run(serve())
        except BaseException as exc:
            self.error = exc
            self.worker.ready.set()

    def __enter__(self) -> ServingWorker:
        self.thread.start()
        if not self.worker.ready.wait(30) or self.error is not None:
            raise RuntimeError(f"serving worker did not start: {self.error!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.loop is not None and self.stop_event is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(60)
