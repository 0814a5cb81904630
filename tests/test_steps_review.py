"""Step semantics under odd values, found by a review against Cloudflare Workflows.

Each test failed before the fix its docstring names.
"""

from __future__ import annotations

import pytest

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register
from workflows_app.engine.errors import InvalidInput

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize(
    ("name", "flaw"), [("a\x00b", "NUL"), ("a\ud800b", "surrogate")], ids=["nul", "surrogate"]
)
def test_a_step_name_no_database_stores_errors_the_instance_at_once(registered, name, flaw):
    """A step name holding a NUL (PostgreSQL stores none) or a lone surrogate (no UTF-8 for
    it) passed check_step_name (limits.py), so the step's checkpoint write failed inside
    the engine: the run was dropped with its lease held, the instance stayed `running`
    until the lease ran out, and after three takeovers it errored as a "poison instance"
    that named no step. (SQLite stored the NUL, so the two databases disagreed.) Now the
    name is refused like any other bad step name: the instance errors at once, saying why."""
    flow = f"odd-step-name-{flaw}"

    @register(flow)
    class OddStepName(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do(name, lambda: 1)

    inst = get_workflow(flow).create()
    testing.run_until_idle(timeout=10)
    status = inst.status()
    assert status.status == "errored"
    assert status.error["name"] == "InvalidInput"
    assert "step name" in status.error["message"]
    assert flaw in status.error["message"]
    assert inst.steps() == []


def test_a_retry_limit_past_what_the_attempt_columns_hold_errors_the_instance_at_once(
    registered,
):
    """`retries={"limit": 2**31}` passed the check (any non-negative integer, step.py
    _read_step_config), but the step's attempt count (limit + 1) is stored in a 32-bit
    column: on PostgreSQL the first failed attempt's checkpoint overflowed it, the run died
    inside the engine with its lease held and the instance sat `running` until it was
    declared a poison instance, while SQLite stored it. The limit is now checked against
    what the column holds, so the step fails the instance at once with a clear error."""
    ran = []

    @register("huge-retry-limit")
    class HugeRetryLimit(WorkflowEntrypoint):
        async def run(self, event, step):
            def fails():
                ran.append(1)
                raise ConnectionError("down")

            return await step.do("call", fails, retries={"limit": 2**31, "delay": "1 second"})

    inst = get_workflow("huge-retry-limit").create()
    with testing.fake_clock():
        testing.run_until_idle(timeout=10)
    status = inst.status()
    assert status.status == "errored"
    assert status.error["name"] == "InvalidInput"
    assert "retries limit" in status.error["message"]
    assert str(2**31) in status.error["message"]
    assert ran == []


def test_a_default_retry_limit_past_what_the_attempt_columns_hold_is_refused_at_register(
    registered,
):
    """The same bound for limits={"default_retry_limit": …}: refused when registered, as
    every other bad limit is, not when a step's checkpoint overflows."""
    with pytest.raises(InvalidInput, match="default_retry_limit"):

        @register("huge-default-retry-limit", limits={"default_retry_limit": 2**31})
        class HugeDefault(WorkflowEntrypoint):
            async def run(self, event, step):
                return None
