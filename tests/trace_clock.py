"""Spans timed by the engine's clock, for tests that make a day pass with the fake clock.

The engine's spans take their times from OpenTelemetry's SDK, which reads the host's
clock, while sleeps are timed by the engine's clock: under `testing.fake_clock()` a
"day-long" sleep would end before the step after it starts. Tests that draw a trace
route the SDK's clock to the engine's clock for the block.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import opentelemetry.sdk.trace as sdk_trace

from workflows_app.engine import clock


def engine_time_ns() -> int:
    return int(clock.now().timestamp() * 1_000_000_000)


@contextmanager
def spans_on_the_engine_clock() -> Iterator[None]:
    with mock.patch.object(sdk_trace, "time_ns", engine_time_ns):
        yield


def run_a_day_long_sleep(workflow: str, instance_id: str) -> None:
    """Start `workflow` (10 ms step, 1-day sleep, 10 ms step) and run it to the end on a
    fake clock: 10 ms steps are the clock advanced by the step itself."""
    from workflows_app import testing
    from workflows_app.client import get_workflow

    with testing.fake_clock() as fake, spans_on_the_engine_clock():
        get_workflow(workflow).create(id=instance_id, params={"fake_clock": True})
        testing.run_until_idle()
        fake.advance("1 day")
        testing.run_until_idle()


DAY_SLEEPER = "day-sleeper"


def register_day_sleeper() -> None:
    """Register DAY_SLEEPER: step "first" (10 ms), sleep "overnight" (1 day), step "second"
    (10 ms), each step's 10 ms being the fake clock advanced by the step."""
    from workflows_app.engine import WorkflowEntrypoint, register

    def ten_ms(label: str):  # type: ignore[no-untyped-def]
        def work() -> dict[str, str]:
            clock.get_clock().advance(10)  # type: ignore[union-attr]
            return {"done": label}

        return work

    @register(DAY_SLEEPER)
    class DaySleeper(WorkflowEntrypoint):
        async def run(self, event, step):  # type: ignore[no-untyped-def]
            await step.do("first", ten_ms("first"))
            await step.sleep("overnight", "1 day")
            return await step.do("second", ten_ms("second"))


FLAKY = "flaky-fetch"


def register_flaky() -> None:
    """Register FLAKY: step "fetch" fails twice (ConnectionError, a multi-line message),
    then returns; attempt n takes 5·n ms of the fake clock; retries wait 1 s."""
    from workflows_app.engine import WorkflowEntrypoint, register

    calls: list[int] = []

    def fetch() -> dict[str, int]:
        calls.append(1)
        clock.get_clock().advance(5 * len(calls))  # type: ignore[union-attr]
        if len(calls) < 3:
            raise ConnectionError(f"flaky {len(calls)} <script>alert(1)</script>\nsecond line")
        return {"rows": 12}

    @register(FLAKY)
    class FlakyFetch(WorkflowEntrypoint):
        async def run(self, event, step):  # type: ignore[no-untyped-def]
            return await step.do(
                "fetch", fetch, retries={"limit": 5, "delay": "1 second", "backoff": "constant"}
            )


def run_flaky(instance_id: str, params: object = None) -> None:
    """Run a FLAKY instance through its three attempts on a fake clock."""
    from workflows_app import testing
    from workflows_app.client import get_workflow

    with testing.fake_clock() as fake, spans_on_the_engine_clock():
        get_workflow(FLAKY).create(id=instance_id, params=params)
        for _ in range(3):
            testing.run_until_idle()
            fake.advance("1 second")


NIGHT_ENDER = "night-ender"


def register_night_ender() -> None:
    """Register NIGHT_ENDER: step "first" (10 ms), then sleep "overnight" (1 day), and end:
    the trace's long break is its last stretch, its label at the axis's right edge."""
    from workflows_app.engine import WorkflowEntrypoint, register

    def ten_ms() -> dict[str, str]:
        clock.get_clock().advance(10)  # type: ignore[union-attr]
        return {"done": "first"}

    @register(NIGHT_ENDER)
    class NightEnder(WorkflowEntrypoint):
        async def run(self, event, step):  # type: ignore[no-untyped-def]
            await step.do("first", ten_ms)
            await step.sleep("overnight", "1 day")
            return {"slept": True}


LONG_WORDS = "quarterly-reconciliation-of-international-subsidiary-ledgers-in-all-regions"
LONG_STEP = "fetch the ledger snapshot of every subsidiary " + "in-every-region-" * 8
LONG_TOKEN = "tok_" + "x" * 400  # an error message's one long word: a token, a URL, an id
LONG_ERROR = "LedgerReconciliationMismatchErrorWithAVeryLongClassName"


def register_long_words() -> None:
    """Register LONG_WORDS: a step with a long name completes, then one fails for good with
    a long class name and a message holding one 400-character word."""
    from workflows_app.engine import NonRetryableError, WorkflowEntrypoint, register

    def reject() -> None:
        raise NonRetryableError(f"the ledger service refused {LONG_TOKEN}\nsecond line", LONG_ERROR)

    @register(LONG_WORDS)
    class LongWords(WorkflowEntrypoint):
        async def run(self, event, step):  # type: ignore[no-untyped-def]
            await step.do(LONG_STEP, lambda: {"ok": True})
            await step.do("reconcile", reject)


def run_to_the_end(workflow: str, instance_id: str, advance: str = "1 day") -> None:
    """Start `workflow` and run it to its end on a fake clock advanced by `advance` once."""
    from workflows_app import testing
    from workflows_app.client import get_workflow

    with testing.fake_clock() as fake, spans_on_the_engine_clock():
        get_workflow(workflow).create(id=instance_id)
        testing.run_until_idle()
        fake.advance(advance)
        testing.run_until_idle()
