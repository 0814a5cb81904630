"""What workflows_app.testing can change in a run: mocked steps, sleeps that end at once,
event waits that time out. Empty in production, where each question is one empty check.

Kept out of the runner so that the runner's path reads as production code; the runner asks
here only through the three questions below.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TestOverrides:
    """In-process overrides used by workflows_app.testing."""

    step_mocks: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    sleeps_disabled: set[str | None] = field(default_factory=set)
    forced_event_timeouts: set[tuple[str, str]] = field(default_factory=set)

    def clear(self) -> None:
        self.step_mocks.clear()
        self.sleeps_disabled.clear()
        self.forced_event_timeouts.clear()

    def step_callable(
        self, instance_id: str, step: str, real: Callable[..., Any]
    ) -> Callable[..., Any]:
        """The callable a step attempt runs: the real one unless a test mocked it."""
        mock = self.step_mocks.get((instance_id, step)) if self.step_mocks else None
        return real if mock is None else _mocked(mock, real)

    def sleep_disabled(self, instance_id: str) -> bool:
        return bool(self.sleeps_disabled) and (
            instance_id in self.sleeps_disabled or None in self.sleeps_disabled
        )

    def take_forced_timeout(self, instance_id: str, event_type: str) -> bool:
        """Whether a test forced this wait to time out (the next wait only)."""
        forced = (instance_id, event_type)
        if forced not in self.forced_event_timeouts:
            return False
        self.forced_event_timeouts.discard(forced)
        return True


overrides = TestOverrides()


def _mocked(mock: dict[str, Any], real: Callable[..., Any]) -> Callable[[], Any]:
    """A step callable that fails `times` times with the mock's error, then returns its result."""

    def call() -> Any:
        if mock.get("error") is not None and mock["remaining"] != 0:
            if mock["remaining"] > 0:
                mock["remaining"] -= 1
            raise mock["error"]
        if "result" in mock:
            return mock["result"]
        result = real()
        return asyncio.run(result) if inspect.iscoroutine(result) else result

    return call
