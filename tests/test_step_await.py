"""An async step's coroutine runs in the run's task to its first suspension with no
deadline around it; one that suspends goes on under the attempt's deadline, which counts
from the attempt's start. No database: await_returned on its own."""

from __future__ import annotations

import asyncio
import time

import pytest

from workflows_app.engine.errors import StepTimeout
from workflows_app.engine.step import StepContext, await_returned, current_step


def attempt(seconds: float, coroutine) -> object:
    context = StepContext("inst", "step", 1)
    timed_out = StepTimeout("timed out")
    return await_returned(coroutine, context, seconds, timed_out)


async def test_a_coroutine_that_never_waits_returns_with_current_step_set():
    async def no_wait():
        return current_step().step_name

    assert await attempt(1.0, no_wait()) == "step"
    assert current_step() is None


async def test_a_coroutine_that_waits_goes_on_in_the_same_task_and_returns():
    task = asyncio.current_task()
    seen = []

    async def waits():
        for _ in range(3):
            seen.append((asyncio.current_task() is task, current_step().step_name))
            await asyncio.sleep(0)
        await asyncio.sleep(0.001)
        return len(seen)

    assert await attempt(1.0, waits()) == 3
    assert seen == [(True, "step")] * 3


async def test_an_error_after_a_wait_reaches_the_caller_as_it_was():
    async def fails():
        await asyncio.sleep(0)
        raise KeyError("late")

    with pytest.raises(KeyError, match="late"):
        await attempt(1.0, fails())


async def test_a_coroutine_past_its_deadline_is_cancelled_and_the_attempt_times_out():
    unwound = []

    async def hangs():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            unwound.append("cancelled")
            raise

    started = time.monotonic()
    with pytest.raises(StepTimeout):
        await attempt(0.05, hangs())
    assert unwound == ["cancelled"]
    assert time.monotonic() - started < 5


async def test_the_deadline_counts_the_part_run_before_the_first_wait():
    async def busy_then_waits():
        time.sleep(0.08)  # synchronous work in the first segment
        await asyncio.sleep(0.08)  # would fit in the timeout only if the deadline began here
        return "late"

    with pytest.raises(StepTimeout):
        await attempt(0.1, busy_then_waits())


async def test_a_cancelled_run_cancels_the_coroutine_it_awaits():
    unwound = []
    waiting = asyncio.Event()

    async def waits_for_ever():
        try:
            waiting.set()
            await asyncio.Event().wait()
        finally:
            unwound.append("finally")

    task = asyncio.ensure_future(attempt(30.0, waits_for_ever()))
    await waiting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert unwound == ["finally"]


async def test_a_timeout_error_raised_by_the_step_itself_is_not_a_step_timeout():
    async def raises_at_once():
        raise TimeoutError("its own")

    async def raises_after_a_wait():
        await asyncio.sleep(0)
        raise TimeoutError("its own, later")

    with pytest.raises(TimeoutError, match="its own"):
        await attempt(1.0, raises_at_once())
    with pytest.raises(TimeoutError, match="its own, later"):
        await attempt(1.0, raises_after_a_wait())


def test_a_step_context_makes_its_abandonment_event_once_and_keeps_it():
    context = StepContext("inst", "step", 1)
    assert not context.cancelled  # no event made just to answer
    event = context.abandonment()
    assert context.abandonment() is event
    assert not context.wait_cancelled(0)
    context.abandon()
    assert context.cancelled and context.wait_cancelled(0) and event.is_set()
