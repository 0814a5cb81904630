"""Property-based tests (Hypothesis) of inputs: every JSON value the engine accepts comes
back exactly (both databases), every refusal is the named error and stores nothing, the
API answers 2xx or a clear 4xx for any body or query, and the parsers raise only their
own errors. Deterministic (the `wfdash` profile of tests/conftest.py: derandomize,
bounded examples); each fault found has its explicit example here too."""

from __future__ import annotations

import json
import math
import uuid
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote, urlencode

import pytest
from django.test import Client
from hypothesis import given, settings
from hypothesis import strategies as st

from workflows_app import testing, tokens
from workflows_app.client import ITEM_FIELDS, get_workflow, schedules
from workflows_app.engine import WorkflowEntrypoint, register
from workflows_app.engine.attributes import parse_filter as parse_attribute_filter
from workflows_app.engine.cron import (
    SCHEDULE_NAME,
    check_cron,
    check_schedule_name,
    latest_fire_time,
    next_fire_time,
    zone,
)
from workflows_app.engine.durations import MAX_DURATION_MS, parse_duration
from workflows_app.engine.errors import (
    InvalidDuration,
    InvalidInput,
    SizeLimitExceeded,
    WorkflowError,
)
from workflows_app.engine.limits import (
    EVENT_TYPE_PATTERN,
    MAX_JSON_DEPTH,
    Limits,
    check_event_type,
    check_instance_id,
    check_step_name,
)
from workflows_app.models import BulkJob, HistoryRecord, InboxEvent, Instance, Schedule

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


# --- values through the engine -----------------------------------------------------------


@settings(max_examples=10)  # two runs of an instance each; the values are nested
@given(value=json_values)
def test_any_json_value_round_trips_as_params_step_output_and_event_payload(echo, value):
    handle = waiting(echo, value)
    handle.send_event("value", value)
    testing.run_until_idle()
    output = handle.status().output
    assert all(same(got, value) for got in output), output
    assert same(handle.row().params, value)
    assert same(received(handle), value)


def received(handle: Any) -> Any:
    """The payload the instance's event.received history record shows (client and API)."""
    [record] = [r for r in handle.history() if r.type == "event.received"]
    path = f"/api/workflows/{handle.workflow}/instances/{handle.id}/history"
    [shown] = [r for r in Api().call("GET", path)[1]["result"] if r["type"] == "event.received"]
    assert same(shown["data"]["payload"], record.data["payload"])
    return record.data["payload"]


@pytest.mark.parametrize(
    "payload",
    [
        {"text": "a\x00b"},  # was copied as "a\ufffdb" (jsonb refuses a NUL)
        {"big": 1e20, "zero": -0.0, "max": 1e308},  # PostgreSQL: 10**20, 0.0, a 309-digit int
        ["1e5", "-0.0", 1.5e-7, 1e15],  # look-alikes in strings, numbers jsonb keeps
        {"bb": 1, "a": [{"zz": 1, "y": 2}], "é": 3},  # PostgreSQL: {"a": …, "bb": 1, "é": 3}
    ],
)
def test_the_history_shows_a_received_event_payload_exactly(echo, payload):
    handle = waiting(echo)
    handle.send_event("value", payload)
    testing.run_until_idle()
    assert same(handle.status().output[2], payload)
    assert same(received(handle), payload)


unstorable = st.sampled_from(["\ud800", "a\udfffb", float("nan"), float("inf"), -float("inf")])


@settings(max_examples=12)
@given(good=json_values, bad=unstorable, where=st.sampled_from(["value", "list", "key"]))
def test_nan_infinity_and_lone_surrogates_are_refused_clearly_and_store_nothing(
    echo, good, bad, where
):
    if where == "key" and isinstance(bad, float):
        where = "list"
    value = {"value": bad, "list": [good, bad], "key": {str(bad): good}}[where]
    live = Instance.objects.filter(workflow=ECHO, status="waiting").first()
    handle = echo.get(live.instance_id) if live else waiting(echo)
    before = snapshot()
    with pytest.raises(InvalidInput, match="params"):
        echo.create(params=value)
    with pytest.raises(InvalidInput, match="payload"):
        handle.send_event("value", value)
    with pytest.raises(InvalidInput, match="payload"):
        echo.bulk("send_event", event_type="value", payload=value)
    assert snapshot() == before


@pytest.mark.parametrize("payload", [{"$codec": "x"}, {"$codec": "eyJ4IjoxfQ==", "plain": True}])
def test_a_payload_that_looks_like_an_envelope_shows_as_itself_in_the_history(echo, payload):
    """Copied into the history as a plain envelope, whose keys PostgreSQL's jsonb reorders
    ("plain" first): the history showed the envelope, not the payload."""
    handle = waiting(echo)
    handle.send_event("value", payload)
    testing.run_until_idle()
    assert same(handle.status().output[2], payload)
    [record] = [r for r in handle.history() if r.type == "event.received"]
    assert same(record.data["payload"], payload)


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


# --- the JSON API ------------------------------------------------------------------------


def rows() -> tuple[Any, ...]:
    """What a refused API call must leave as it was."""
    return (
        *snapshot(),
        list(Schedule.objects.order_by("id").values_list("name", "paused", "params_json")),
    )


class Api:
    def __init__(self) -> None:
        _, secret = tokens.issue(f"property-{uuid.uuid4()}")
        self.client = Client()
        self.headers = {"Authorization": f"Bearer {secret}"}

    def call(self, method: str, path: str, body: bytes = b"") -> tuple[int, Any]:
        """The answer's status and JSON; a refusal must be a 4xx naming what was wrong and
        must have changed nothing."""
        before = rows()
        response = self.client.generic(
            method, path, body, content_type="application/json", headers=self.headers
        )
        assert response.status_code < 500, response.content[:2000]
        assert response["Content-Type"] == "application/json"
        answer = json.loads(response.content)
        if response.status_code >= 400:
            assert answer["success"] is False
            assert answer["errors"][0]["message"].strip()
            assert rows() == before, f"{method} {path} {body[:200]!r} was refused but wrote"
        return response.status_code, answer


@pytest.fixture
def api(echo: Any) -> Api:
    return Api()


# Bodies: JSON of the fields an endpoint takes (and some it does not) with values of every
# type, odd numbers and strings included; some raw bytes that are not JSON or not UTF-8.
odd = json_values | st.sampled_from(
    [
        *("1 day", "0 ms", "-1 s", "9999 years", "2026-01-01T00:00:00Z", "", " ", "x" * 300),
        *("\x00", "a:b", "-x", 0, -1, 10, 2**31, 2**63, 1e-9, True),
    ]
)


def bodies(fields: list[str]) -> st.SearchStrategy[bytes]:
    objects = st.dictionaries(st.sampled_from([*fields, "nope"]), odd, max_size=4)
    raw = st.sampled_from(
        [b"{", b"[1,]", b'{"a":1,"a":2}', b"NaN", b'{"x": Infinity}', b"\xff\xfe", b"[" * 5000]
    )
    return (objects | json_values).map(lambda v: json.dumps(v).encode()) | raw


CREATE = sorted(ITEM_FIELDS)  # the fields a create body may hold


@given(body=bodies(CREATE))
def test_any_create_body_is_answered_2xx_or_a_clear_4xx(api, body):
    status, answer = api.call("POST", f"/api/workflows/{ECHO}/instances", body)
    if status in (200, 201):
        got = get_workflow(ECHO).get(answer["result"]["id"]).row().params
        sent = (json.loads(body) or {}).get("params")  # null: an empty body
        assert same(got, sent)


@given(body=bodies(CREATE).map(lambda b: b"[" + b + b"]"))
def test_any_batch_body_is_answered_2xx_or_a_clear_4xx(api, body):
    api.call("POST", f"/api/workflows/{ECHO}/instances/batch", body)


BULK = ["action", "status", "version", "attributes", "created_before", "created_after"]
BULK += ["event_type", "payload", "from_step", "to_version", "compensate"]
ACTIONS = ["pause", "resume", "terminate", "cancel", "restart", "delete", "send_event"]


@given(
    body=st.fixed_dictionaries(
        {"action": st.sampled_from(ACTIONS) | odd},
        optional={field: odd for field in BULK[1:]}
        | {"event_type": st.sampled_from(["value", "-x", "a" * 101]) | odd},
    ).map(lambda v: json.dumps(v).encode())
    | bodies(BULK)
)
def test_any_bulk_body_is_answered_2xx_or_a_clear_4xx(api, body):
    api.call("POST", f"/api/workflows/{ECHO}/bulk", body)


@given(
    query=st.dictionaries(
        st.sampled_from(["cursor", "limit", "status", "version", "attr.n", "attr.", "x"]),
        st.text(max_size=30)
        | st.sampled_from(["0", "1", "1000", "1001", "-1", "1e3", "waiting", "0001000"])
        | st.sampled_from(["2147483647", "2147483648", "9" * 30, "１０", "n=1", '"5"']),
        max_size=4,
    )
)
def test_any_list_query_is_answered_2xx_or_a_clear_4xx(api, query):
    api.call("GET", f"/api/workflows/{ECHO}/instances?{urlencode(query)}")


@settings(max_examples=15)
@given(
    kind=st.sampled_from(["status", "cancel", "skip-sleep", "event", "history", "delete"]),
    body=bodies(["status", "from_step", "version", "compensate"]),
    segment=st.text(min_size=1, max_size=20) | st.sampled_from(["value", "a" * 101]),
)
def test_any_action_on_an_instance_is_answered_2xx_or_a_clear_4xx(api, kind, body, segment):
    handle = waiting(get_workflow(ECHO))
    path = f"/api/workflows/{ECHO}/instances/{handle.id}"
    quoted = quote(segment, safe="")
    if kind == "event":
        api.call("POST", f"{path}/events/{quoted}", body)
    elif kind == "history":
        api.call("GET", f"{path}/history?{urlencode({'cursor': segment, 'limit': segment})}")
    elif kind == "delete":
        api.call("DELETE", f"/api/workflows/{ECHO}/instances/{quoted}", body)
    else:
        api.call("PATCH" if kind == "status" else "POST", f"{path}/{kind}", body)


@given(
    body=st.fixed_dictionaries(
        {
            "name": st.text(max_size=12) | st.sampled_from(["nightly", "a" * 81]),
            "cron": st.sampled_from(["0 3 * * *", "* * * * * *", "61 * * * *", "0 0 30 2 *"])
            | st.text(max_size=20),
        },
        optional={"timezone": st.text(max_size=20) | st.just("Europe/Paris"), "params": odd},
    ).map(lambda v: json.dumps(v).encode())
    | bodies(["name", "cron", "timezone", "params"])
)
def test_any_schedule_body_is_answered_2xx_or_a_clear_4xx(api, body):
    status, answer = api.call("POST", f"/api/workflows/{ECHO}/schedules", body)
    if status == 201:
        name = answer["result"]["name"]
        assert same(schedules.get(name).params, json.loads(body).get("params"))
        schedules.get(name).delete()


@settings(max_examples=15)  # three pages each
@given(
    query=st.dictionaries(
        st.sampled_from(["workflow", "status", "version", "created_from", "created_to", "q"])
        | st.sampled_from(["attrs", "tz", "after", "before", "job"]),
        st.text(max_size=30)
        | st.sampled_from(["0", "-841", "9999-12-31T23:59", "0001-01-01T00:00", ECHO, "n=1e20"])
        | st.sampled_from(['n="x', "n=1 n=2", "=", "a b=c", "waiting", "2**31", "\x00"]),
        max_size=4,
    )
)
def test_any_dashboard_list_query_is_answered_without_a_server_error(echo, client, query):
    """The dashboard's list filters (its search, attributes, dates, cursors) from any query."""
    from django.contrib.auth.models import User

    if not User.objects.filter(username="staff").exists():
        User.objects.create_superuser("staff", password="pw")
    client.force_login(User.objects.get(username="staff"))
    for path in ("/instances/", "/instances/rows/", "/instances/bulk-jobs/count/"):
        response = client.get(f"{path}?{urlencode(query)}")
        assert response.status_code < 500, (path, query)


# --- limits at their boundary ------------------------------------------------------------

SMALL = "prop-small"
LIMIT = 40


@pytest.fixture
def small(registered: list[str]) -> Any:
    @register(
        SMALL,
        limits={
            "max_params_bytes": LIMIT,
            "max_event_payload_bytes": LIMIT,
            "max_step_output_bytes": LIMIT,
        },
    )
    class Small(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            got = await step.wait_for_event("value", type="value", timeout="1 day")
            return await step.do("keep", lambda: got.payload)

    return get_workflow(SMALL)


def encoded_size(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


# Strings whose JSON is around the limit, in bytes: ASCII, escapes, 2-, 3- and 4-byte UTF-8.
near_limit = st.text(
    alphabet=st.sampled_from(["a", '"', "\\", "\n", "\x00", "é", "€", "\U0001f600"]),
    min_size=LIMIT // 4 - 2,
    max_size=LIMIT,
).filter(lambda v: abs(encoded_size(v) - LIMIT) <= 4)


@settings(max_examples=12)
@given(value=near_limit)
def test_sizes_are_enforced_in_bytes_of_json_exactly_at_the_limit(small, value):
    fits = encoded_size(value) <= LIMIT
    try:
        handle = small.create(params=value)
    except SizeLimitExceeded as exc:
        assert not fits and "max_params_bytes" in str(exc) and str(LIMIT) in str(exc)
    else:
        assert fits
    handle = small.create()
    testing.run_until_idle()
    try:
        handle.send_event("value", value)
    except SizeLimitExceeded as exc:
        assert not fits and "max_event_payload_bytes" in str(exc)
        return
    assert fits
    testing.run_until_idle()
    status = handle.status()
    assert status.status == "complete" and same(status.output, value), status


def nested(depth: int) -> Any:
    value: Any = 1
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


def test_nesting_is_refused_past_its_limit_exactly(echo):
    echo.create(params=nested(MAX_JSON_DEPTH))
    with pytest.raises(InvalidInput, match=f"{MAX_JSON_DEPTH + 1} levels deep"):
        echo.create(params=nested(MAX_JSON_DEPTH + 1))


# --- parsers ------------------------------------------------------------------------------

any_text = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=40)
duration_like = st.from_regex(
    r"\s*[0-9]{1,400}(\.[0-9]{1,20})?\s*[a-zA-Z]{0,12}\s*", fullmatch=True
)
PARSERS = settings(max_examples=100)  # no database: more examples, in about a second


@PARSERS
@given(value=any_text | duration_like | st.integers() | st.floats() | st.timedeltas())
def test_a_duration_parses_to_whole_milliseconds_or_raises_invalid_duration(value):
    try:
        ms = parse_duration(value)
    except InvalidDuration as exc:
        assert str(exc)
    else:
        assert isinstance(ms, int) and 0 <= ms <= MAX_DURATION_MS
        assert parse_duration(ms) == ms  # milliseconds parse as themselves


cron_fields = st.sampled_from(
    [
        *("*", "*/0", "*/15", "0", "59", "60", "1-5", "5-1", "L", "5L", "5#3", "5#6", "15W"),
        *("LW", "?", "MON", "jan", "1,2", "0-59/61", "-1", "1-", "#", "31", "30", "2", "7"),
    ]
) | st.text(max_size=5)


@PARSERS
@given(
    fields=st.lists(cron_fields, min_size=4, max_size=7),
    timezone=st.sampled_from(["UTC", "Europe/Paris", "Australia/Lord_Howe"]) | any_text,
)
def test_a_cron_expression_and_zone_parse_and_fire_or_raise_invalid_input(fields, timezone):
    try:
        expression = check_cron(" ".join(fields))
        zone(timezone)
    except InvalidInput as exc:
        assert str(exc)
        return
    after = datetime(2026, 10, 25, 0, 30, tzinfo=UTC)  # a DST change in Europe
    fires = next_fire_time(expression, timezone, after)
    assert fires is None or fires > after
    latest = latest_fire_time(expression, timezone, after)
    assert latest is None or latest <= after


@PARSERS
@given(value=any_text | st.from_regex(r"[a-zA-Z0-9_][a-zA-Z0-9_.:-]{0,120}", fullmatch=True))
def test_ids_types_and_names_are_accepted_or_refused_with_the_named_error(value):
    checks = {
        check_event_type: EVENT_TYPE_PATTERN,
        check_schedule_name: SCHEDULE_NAME,
        (lambda v: check_instance_id(v, Limits())): None,
        (lambda v: check_step_name(v, Limits())): None,
    }
    for check, pattern in checks.items():
        try:
            assert check(value) == value
        except WorkflowError as exc:
            assert str(exc)
            assert pattern is None or not pattern.match(value)
        else:
            assert pattern is None or pattern.match(value)


@PARSERS
@given(
    pairs=st.dictionaries(
        st.text(max_size=70) | st.sampled_from(["n", "plan", "a.b-c", "_"]),
        any_text | st.sampled_from(["5", "1.5", "1e20", "-0.0", "true", '"5"', "null", "[1]"]),
        max_size=34,
    )
)
def test_an_attribute_filter_parses_to_typed_values_or_raises_a_workflow_error(pairs):
    try:
        parsed = parse_attribute_filter(pairs)
    except WorkflowError as exc:
        assert str(exc)
    else:
        assert list(parsed) == list(pairs)
        assert all(type(v) in (str, int, float, bool) for v in parsed.values())
