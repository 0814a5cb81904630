"""Limits an operator lowers judge the steps that start after, not the ones already started.

A sleep's wake time and a wait's timeout are stored when it starts, and a step's result
when it ends; a replay after a deploy that lowered max_sleep, the wait-timeout bounds or
max_step_timeout errored the instance at a step it had already passed. Real engine and
database, the fake clock.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register
from workflows_app.engine.errors import InvalidInput

pytestmark = pytest.mark.django_db(transaction=True)

LOWERED = {
    "max_sleep": "1 day",
    "max_wait_for_event_timeout": "7 days",
    "max_step_timeout": "10 minutes",
}


@pytest.fixture
def long_flow(registered: list[str]) -> str:
    @register("lowered-limits")
    class LongFlow(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            slow = await step.do("slow", lambda: 1, timeout="20 minutes")
            _, approval = await asyncio.gather(  # both start before the deploy
                step.sleep("rest", "10 days"),
                step.wait_for_event("approve", type="ok", timeout="30 days"),
            )
            return {"slow": slow, "approved": approval.payload}

    return "lowered-limits"


def lower_limits(settings: Any, *keys: str) -> None:
    lowered = {key: LOWERED[key] for key in keys or LOWERED}
    settings.WFDASH = {
        **settings.WFDASH,
        "LIMITS": {**settings.WFDASH.get("LIMITS", {}), **lowered},
    }


@pytest.mark.parametrize("lowered", sorted(LOWERED))
def test_steps_started_before_a_limit_was_lowered_replay_as_they_were(long_flow, settings, lowered):
    with testing.fake_clock() as clock:
        handle = get_workflow(long_flow).create(id="old")
        testing.run_until_idle()
        lower_limits(settings, lowered)  # a deploy, while the instance sleeps its 10 days
        clock.advance("10 days")
        testing.run_until_idle()
        assert handle.status().status == "waiting"  # slept; its 30-day wait goes on
        handle.send_event("ok", {"by": "ada"})
        testing.run_until_idle()
    assert handle.status().status == "complete", handle.status().error
    assert handle.status().output == {"slow": 1, "approved": {"by": "ada"}}


def test_an_instance_started_after_them_is_held_to_the_lowered_limits(long_flow, settings):
    lower_limits(settings)
    handle = get_workflow(long_flow).create(id="new")
    testing.run_until_idle()
    error = handle.status().error
    assert handle.status().status == "errored"
    assert error["name"] == "LimitExceeded" and "max_step_timeout" in error["message"]


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"max_instance_id_length": 201}, "max_instance_id_length must be from 1 to 200"),
        ({"max_step_name_length": 0}, "max_step_name_length must be from 1 to 300"),
        (
            {"default_step_timeout": "40 minutes"},
            "default_step_timeout (2400000 ms) is outside max_step_timeout",
        ),
        (
            {"max_wait_for_event_timeout": "1 hour"},
            "default_wait_for_event_timeout (86400000 ms) is outside the wait_for_event timeout",
        ),
    ],
)
def test_limits_that_would_fail_every_create_or_step_are_refused_at_register(
    registered, limits, message
):
    """A length past its column failed the first long id's create with a database error;
    a default beyond its own bound failed every step or wait that took it."""
    with pytest.raises(InvalidInput) as refused:

        @register("inconsistent-limits", limits=limits)
        class Inconsistent(WorkflowEntrypoint):
            async def run(self, event: Any, step: Any) -> Any:
                return None

    assert message in str(refused.value)
