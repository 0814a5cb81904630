"""Property-based tests (Hypothesis) of inputs: every JSON value the engine accepts comes
back exactly (both databases), every refusal is the named error and stores nothing, the
API answers 2xx or a clear 4xx for any body or query, and the parsers raise only their
own errors. Deterministic (the `wfdash` profile of tests/conftest.py: derandomize,
bounded examples); each fault found has its explicit example here too."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register
from workflows_app.engine.errors import InvalidInput
from workflows_app.models import BulkJob, HistoryRecord, InboxEvent, Instance

pytestmark = pytest.mark.django_db(transaction=True)

ECHO = "prop-echo"


def same(a: Any, b: Any) -> bool:
    """Equal as JSON documents, strictly: types (1 is not 1.0 nor True), the sign of a
    zero, and the order of an object's keys."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# Every JSON value Python's json reads: big integers, any finite float, any text without
# a lone surrogate (those are refused: no UTF-8 for them), nested objects and arrays.
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([-0.0, 1e308, -1e308, 5e-324, 1e16, 1e20, 2.0**63, 2**63, -(2**63) - 1])
    | st.text(max_size=12)
    | st.sampled_from(["\x00", "a\x00b", "\u2028", "\U0001f600", '{"$codec":"x"}', "\\u0000"])
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


@pytest.fixture
def echo(registered: list[str]) -> Any:
    """Params go through a step's checkpoint; the output carries them and an event's payload."""

    @register(ECHO)
    class Echo(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            kept = await step.do("keep", lambda: event.payload)
            got = await step.wait_for_event("value", type="value", timeout="1 day")
            return [event.payload, kept, got.payload]

    return get_workflow(ECHO)


def snapshot() -> tuple[Any, ...]:
    """Every row a refused call could have written."""
    return (
        list(Instance.objects.order_by("id").values_list("id", "status", "params_json")),
        InboxEvent.objects.count(),
        HistoryRecord.objects.count(),
        BulkJob.objects.count(),
    )


def waiting(wf: Any, params: Any = None) -> Any:
    handle = wf.create(params=params)
    testing.run_until_idle()
    assert handle.status().status == "waiting"
    return handle


# --- bulk send_event ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [
        {"text": "a\x00b"},  # PostgreSQL: "unsupported Unicode escape sequence", a 500
        {"big": 1e20, "zero": -0.0, "max": 1e308},  # PostgreSQL: 10**20, 0.0 and a 309-digit int
    ],
)
def test_a_bulk_send_event_delivers_its_payload_exactly(echo, payload):
    handle = waiting(echo)
    job = echo.bulk("send_event", event_type="value", payload=payload)
    assert same(job.options["payload"], payload)
    testing.run_until_idle()
    assert BulkJob.objects.get(pk=job.id).applied == 1
    output = handle.status().output
    assert same(output[2], payload), output[2]


@given(payload=json_values)
def test_any_bulk_send_event_payload_is_kept_exactly(echo, payload):
    """What the job sends each instance is what it read back from its row."""
    job = echo.bulk("send_event", event_type="value", payload=payload)
    assert same(BulkJob.objects.get(pk=job.id).event_payload, payload)


# --- search attributes ---------------------------------------------------------------------


@pytest.mark.parametrize("value", [1e16, 1e20, -1e308, 2.0**63])
def test_a_whole_float_attribute_that_would_read_back_as_an_integer_is_refused(echo, value):
    """PostgreSQL's jsonb gave 1e20 back as the integer 10**20 (1e308 as a 309-digit one:
    outside 64 bits, a value no filter takes); SQLite kept the float."""
    before = snapshot()
    with pytest.raises(InvalidInput, match="give it as an integer"):
        echo.create(attributes={"f": value})
    assert snapshot() == before


def test_a_negative_zero_attribute_is_kept_as_zero_on_both_databases(echo):
    """PostgreSQL's jsonb has no -0.0 (it read 0.0 back), SQLite's text kept it."""
    handle = echo.create(attributes={"z": -0.0})
    assert same(handle.row().attributes["z"], 0.0)
    assert echo.list(attributes={"z": 0}).instances[0].id == handle.id


@given(value=st.floats(allow_nan=False, allow_infinity=False) | st.integers(-(2**63), 2**63 - 1))
def test_any_accepted_attribute_number_reads_back_exactly(echo, value):
    try:
        handle = echo.create(attributes={"n": value})
    except InvalidInput:
        assert isinstance(value, float) and value.is_integer() and abs(value) >= 1e16
        return
    assert same(handle.row().attributes["n"], value + 0 if isinstance(value, float) else value)
    found = echo.list(attributes={"n": value}, limit=1000).instances
    assert handle.id in [i.id for i in found]
