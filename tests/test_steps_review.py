"""Step semantics under odd values, found by a review against Cloudflare Workflows.

Each test failed before the fix its docstring names.
"""

from __future__ import annotations

import pytest

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import NonRetryableError, WorkflowEntrypoint, register
from workflows_app.engine.durations import parse_duration
from workflows_app.engine.errors import InvalidDuration, InvalidInput

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


class CardDeclined(NonRetryableError):
    """A subclass with an __init__ of its own that does not call NonRetryableError's."""

    def __init__(self, card: str) -> None:
        self.card = card
        Exception.__init__(self, f"card {card} declined")


def test_a_non_retryable_subclass_that_skips_the_base_init_fails_its_step_by_its_name(
    registered,
):
    """error_fields (step.py) read exc.error_name, which only NonRetryableError.__init__
    sets: a subclass whose own __init__ calls Exception.__init__ made recording the failure
    raise AttributeError inside the engine. The workflow got an AttributeError instead of
    the failure, the instance errored as "AttributeError: 'CardDeclined' object has no
    attribute 'error_name'" and the failed step was never checkpointed (no step row, no
    step.failed record). Now the class's name stands in for the missing error_name."""

    @register("declined-subclass")
    class DeclinedSubclass(WorkflowEntrypoint):
        async def run(self, event, step):
            def charge():
                raise CardDeclined("4242")

            return await step.do("charge", charge, retries={"limit": 3, "delay": 0})

    inst = get_workflow("declined-subclass").create()
    testing.run_until_idle(timeout=10)
    status = inst.status()
    assert status.status == "errored"
    assert status.error == {"name": "CardDeclined", "message": "card 4242 declined"}
    (record,) = inst.steps()
    assert (record.status, record.attempts, record.last_error_name) == (
        "failed",
        1,
        "CardDeclined",
    )
    failed = [h.data for h in inst.history() if h.type == "step.failed"]
    assert [f["error"]["name"] for f in failed] == ["CardDeclined"]


HUGE = 10**400  # an integer Python's float() refuses (past ~1.8e308)


@pytest.mark.parametrize(
    "call",
    [
        "sleep",
        "timeout",
        "retry delay",
        "wait timeout",
        "negative sleep",
        "sleep_until of 5,000 digits",
    ],
)
def test_a_duration_or_instant_too_big_for_a_float_is_an_invalid_duration(registered, call):
    """parse_duration did float(value) on any int: one past ~1e308 raised OverflowError,
    not InvalidDuration naming the value (SPEC §1), so step.sleep("x", 10**400) errored the
    instance as "OverflowError: int too large to convert to float", and the API's create
    (`{"retention": 1000…0}`, `debounce`) answered 500. (repr() of an integer of over 4,300
    digits raises too, so parse_instant's own message failed the same way.) Integers out of
    range are now refused as integers, and messages show a huge one by its size."""

    @register(f"huge-duration-{call}")
    class HugeDuration(WorkflowEntrypoint):
        async def run(self, event, step):
            if call == "sleep":
                await step.sleep("nap", HUGE)
            elif call == "timeout":
                await step.do("s", lambda: 1, timeout=HUGE)
            elif call == "retry delay":
                await step.do("s", lambda: 1, retries={"delay": HUGE})
            elif call == "wait timeout":
                await step.wait_for_event("w", type="go", timeout=HUGE)
            elif call == "negative sleep":
                await step.sleep("nap", -HUGE)
            else:
                await step.sleep_until("launch", 10**5000)

    inst = get_workflow(f"huge-duration-{call}").create()
    with testing.fake_clock():
        testing.run_until_idle(timeout=10)
    status = inst.status()
    assert status.status == "errored"
    assert status.error["name"] == "InvalidDuration", status.error
    assert "digits" in status.error["message"]
    with pytest.raises(InvalidDuration, match="longer than the longest duration"):
        parse_duration(HUGE)  # what create(retention=…, debounce=…) and the API call
