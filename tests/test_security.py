"""Bad input at every entry point, and the dashboard's and API's security boundaries.

Every refusal is checked three ways: a clear error naming the problem, nothing stored
(a snapshot of every row before and after), and the engine still running instances after.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import Group, Permission, User
from django.core.management import CommandError, call_command
from django.test import Client

from tests.dashboard.helpers import make_user
from tests.surface_flows import snapshot
from wfdash.asgi import router
from workflows_app import access, consumers, fanout, testing, tokens
from workflows_app.client import get_workflow
from workflows_app.consumers import CLIENT_FRAMES_BURST, CLIENT_FRAMES_PER_SECOND
from workflows_app.engine import WorkflowEntrypoint, register
from workflows_app.engine.errors import (
    InstanceNotFound,
    InvalidEventType,
    InvalidInput,
    LimitExceeded,
    UnknownWorkflow,
)

pytestmark = pytest.mark.django_db(transaction=True)

LIMIT = 512  # max_event_payload_bytes of the workflow under test
WF = "sec-waiter"
DEEP = "[" * 10_000 + "]" * 10_000
HUGE_NUMBER = "1" + "0" * 400  # 10**400 as JSON


def nested(levels: int) -> list:
    """A list nested `levels` deep, built without recursion."""
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


XSS = ["<script>alert(1)</script>", '"onmouseover=alert(1)']


@pytest.fixture
def waiter(registered: list[str]) -> Any:
    """A workflow parked on an event wait, with a small payload limit; returns its instance."""

    @register(WF, limits={"max_event_payload_bytes": LIMIT})
    class Waiter(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            got = await step.wait_for_event("wait", type="go", timeout="1 hour")
            return await step.do("after", lambda: got.payload)

    inst = get_workflow(WF).create(id="w1")
    testing.run_until_idle()
    assert inst.status().status == "waiting"
    return inst


def string_of_bytes(size: int) -> str:
    """A JSON string payload whose encoding is exactly `size` bytes."""
    return "x" * (size - 2)


def engine_still_runs(inst: Any) -> None:
    inst.send_event("go", {"fine": True})
    testing.run_until_idle()
    assert inst.status().status == "complete" and inst.status().output == {"fine": True}


def delivered(payload_json_text: str) -> Any:
    """Send a payload to a fresh instance and return what its step received."""
    inst = get_workflow(WF).create()
    testing.run_until_idle()
    inst.send_event("go", json.loads(payload_json_text))
    testing.run_until_idle()
    assert inst.status().status == "complete"
    return inst.status().output


# --- 14. the Python API ------------------------------------------------------------------


PYTHON_BAD = {  # id: (event type, payload factory, error, message)
    "invalid event type": ("bad type!", dict, InvalidEventType, "invalid event type 'bad type!'"),
    "event type of a wrong type": (5, dict, InvalidEventType, "invalid event type 5"),
    "event type too long": ("x" * 101, dict, InvalidEventType, "1-100 letters"),
    "a set": ("go", lambda: {1, 2}, InvalidInput, "not JSON-serialisable"),
    "NaN": ("go", lambda: float("nan"), InvalidInput, "not JSON-serialisable"),
    "infinity": ("go", lambda: float("inf"), InvalidInput, "not JSON-serialisable"),
    "nested 10000 levels": ("go", lambda: nested(10_000), InvalidInput, "nested too deeply"),
    "one byte over the limit": (
        "go",
        lambda: string_of_bytes(LIMIT + 1),
        LimitExceeded,
        f"max_event_payload_bytes is {LIMIT} bytes, got {LIMIT + 1} bytes",
    ),
}


@pytest.mark.parametrize("case", list(PYTHON_BAD))
def test_the_python_api_refuses_bad_events_naming_the_problem_and_stores_nothing(waiter, case):
    event_type, payload_factory, error, message = PYTHON_BAD[case]
    payload = payload_factory()
    before = snapshot()
    with pytest.raises(error) as caught:
        waiter.send_event(event_type, payload)
    assert message in str(caught.value)
    assert snapshot() == before
    engine_still_runs(waiter)


def test_the_python_api_refuses_a_payload_that_is_not_valid_unicode_with_invalid_input(waiter):
    before = snapshot()
    with pytest.raises(InvalidInput):
        waiter.send_event("go", "\ud800")
    assert snapshot() == before


def test_the_python_api_refuses_unknown_workflows_and_ids(waiter):
    before = snapshot()
    with pytest.raises(UnknownWorkflow):
        get_workflow("no-such-workflow")
    with pytest.raises(InstanceNotFound, match="no instance 'nope'"):
        get_workflow(WF).get("nope").send_event("go", {})
    with pytest.raises(InvalidInput, match="instance id must be a string"):
        get_workflow(WF).get(5)
    with pytest.raises(InvalidInput, match="not JSON-serialisable"):
        get_workflow(WF).create(params={"f": object()})
    assert snapshot() == before
    engine_still_runs(waiter)


def test_payloads_one_byte_under_and_exactly_at_the_limit_are_accepted_and_round_trip(waiter):
    for size in (LIMIT - 1, LIMIT):
        assert delivered(json.dumps(string_of_bytes(size))) == string_of_bytes(size)


def test_a_huge_integer_round_trips_exactly_through_every_layer(waiter):
    assert delivered(HUGE_NUMBER) == 10**400


# --- 14. the HTTP API --------------------------------------------------------------------


@pytest.fixture
def api() -> Any:
    _, secret = tokens.issue("sec-service")
    client = Client(raise_request_exception=False)

    def post(path: str, raw: bytes) -> tuple[int, str, str]:
        response = client.generic(
            "POST",
            path,
            raw,
            content_type="application/json",
            headers={"Authorization": f"Bearer {secret}"},
        )
        if response.status_code >= 500:
            return (
                response.status_code,
                "ServerError",
                response.content.decode(errors="replace")[:200],
            )
        body = response.json()
        if body["success"]:
            return response.status_code, "", ""
        return response.status_code, body["errors"][0]["code"], body["errors"][0]["message"]

    return post


EVENT = f"/api/workflows/{WF}/instances/w1/events/go"
HTTP_BAD = [
    (EVENT, b"{", 400, "InvalidJSON", "not valid JSON"),
    (EVENT, b'{"a": NaN}', 400, "InvalidJSON", "NaN is not valid JSON"),
    (EVENT, b"\xff\xfe{}", 400, "InvalidEncoding", "not UTF-8"),
    (EVENT, b"1e400", 400, "InvalidInput", "not JSON-serialisable"),
    (
        f"/api/workflows/{WF}/instances/w1/events/bad%20type",
        b"{}",
        400,
        "InvalidEventType",
        "invalid event type",
    ),
    (
        f"/api/workflows/{WF}/instances/nope/events/go",
        b"{}",
        404,
        "InstanceNotFound",
        "no instance 'nope'",
    ),
    ("/api/workflows/no-such/instances/w1/events/go", b"{}", 404, "UnknownWorkflow", "no-such"),
    (
        f"/api/workflows/{WF}/instances",
        b'{"id": 5}',
        400,
        "InvalidInput",
        "instance id must be a non-empty string",
    ),
    (
        f"/api/workflows/{WF}/instances",
        b'{"params": 1, "bogus": 2}',
        400,
        "InvalidInput",
        "unknown field(s) ['bogus']",
    ),
    (
        f"/api/workflows/{WF}/instances/batch",
        b'{"id": "a"}',
        400,
        "InvalidInput",
        "must be a JSON array",
    ),
]


@pytest.mark.parametrize("path,raw,status,code,message", HTTP_BAD, ids=lambda v: str(v)[:24])
def test_the_http_api_refuses_bad_input_with_a_4xx_naming_the_problem_and_stores_nothing(
    waiter, api, path, raw, status, code, message
):
    before = snapshot()
    assert api(path, raw)[:2] == (status, code)
    assert message in api(path, raw)[2]
    assert snapshot() == before
    engine_still_runs(waiter)


def test_the_http_api_refuses_json_nested_ten_thousand_levels_deep_with_400(waiter, api):
    before = snapshot()
    assert api(EVENT, DEEP.encode())[:2] == (400, "InvalidJSON")
    assert snapshot() == before


def test_the_http_api_accepts_payloads_under_and_at_the_limit(waiter, api):
    for size, name in ((LIMIT - 1, "a"), (LIMIT, "b")):
        get_workflow(WF).create(id=name)
        assert (
            api(
                f"/api/workflows/{WF}/instances/{name}/events/go",
                json.dumps(string_of_bytes(size)).encode(),
            )[0]
            == 200
        )
    assert api(f"/api/workflows/{WF}/instances/w1/events/go", HUGE_NUMBER.encode())[0] == 200
    testing.run_until_idle()
    assert get_workflow(WF).get("w1").status().output == 10**400


def test_the_http_api_refuses_a_payload_one_byte_over_the_limit_with_413(waiter, api):
    before = snapshot()
    status, _code, message = api(EVENT, json.dumps(string_of_bytes(LIMIT + 1)).encode())
    assert snapshot() == before
    assert f"max_event_payload_bytes is {LIMIT} bytes" in message
    assert status == 413


def test_the_http_api_refuses_a_payload_one_byte_over_the_limit_naming_it(waiter, api):
    before = snapshot()
    status, code, message = api(EVENT, json.dumps(string_of_bytes(LIMIT + 1)).encode())
    assert status == 413 and code == "SizeLimitExceeded"
    assert f"max_event_payload_bytes is {LIMIT} bytes, got {LIMIT + 1} bytes" in message
    assert snapshot() == before
    engine_still_runs(waiter)


def test_the_http_api_refuses_a_body_over_its_own_limit_with_413(waiter, api, settings):
    settings.WFDASH = {**settings.WFDASH, "API_MAX_BODY_BYTES": 1024}
    before = snapshot()
    assert api(EVENT, json.dumps("x" * 2000).encode())[:2] == (413, "PayloadTooLarge")
    assert snapshot() == before
    engine_still_runs(waiter)


# --- input that used to answer 500 -----------------------------------------------------


BIG_PK = "9" * 20  # over 2**64


@pytest.fixture
def operator() -> Client:
    client = Client(raise_request_exception=False)
    client.force_login(make_user("operator", "view_instance", "change_instance"))
    return client


@pytest.mark.parametrize(
    ("method", "path", "data", "status"),
    [
        ("get", "/instances/?created_from=9999-12-31T23:59&tz=-840", None, 400),
        ("get", "/instances/?created_to=9999-12-31T23:59&tz=-840", None, 400),
        ("get", "/instances/?version=" + BIG_PK, None, 400),
        ("get", f"/instances/{BIG_PK}/", None, 404),
        ("get", f"/instances/{2**63}/", None, 404),
        ("get", "/instances/0/", None, 404),
        ("get", f"/instances/{BIG_PK}/live/", None, 404),
        ("post", f"/instances/{BIG_PK}/pause/", {}, 404),
        ("get", f"/instances/rows/?since={BIG_PK}", None, 404),
        ("get", "/instances/rows/?since=²", None, 404),
        ("post", "/instances/create/", {"workflow": WF, "params": DEEP * 10}, 400),
        ("post", "/instances/create/", {"workflow": WF, "params": "1" * 5000}, 400),
        ("post", "/instances/create/", {"workflow": WF, "params": json.dumps(nested(950))}, 400),
    ],
    ids=lambda v: str(v)[:40],
)
def test_input_that_used_to_answer_500_gets_a_4xx_and_stores_nothing(
    waiter, operator, method, path, data, status
):
    before = snapshot()
    response = (
        getattr(operator, method)(path, data)
        if data is not None
        else getattr(operator, method)(path)
    )
    assert response.status_code == status, response.content[:300]
    assert snapshot() == before


@pytest.mark.parametrize("pk", [2**63, 2**64])
def test_a_bulk_action_on_a_pk_past_the_databases_range_is_refused_naming_it(waiter, operator, pk):
    before = snapshot()
    response = operator.post("/instances/bulk/", {"action": "pause", "pk": [pk]}, follow=True)
    assert response.status_code == 200
    assert any("pk" in str(m) or "valid choice" in str(m) for m in response.context["messages"])
    assert snapshot() == before


def test_an_event_payload_nested_too_deep_from_the_dashboard_is_refused_naming_it(waiter, operator):
    pk = waiter.row().pk
    before = snapshot()
    for payload, reason in (
        (DEEP * 10, "nested too deeply"),
        (json.dumps(nested(100)), "nesting limit is 64"),
    ):
        response = operator.post(f"/instances/{pk}/send-event/", {"type": "go", "payload": payload})
        assert response.status_code == 400  # the form comes back with the error beside it
        assert reason in response.content.decode(), reason
    assert snapshot() == before
    engine_still_runs(waiter)


def test_params_outputs_and_payloads_past_the_nesting_limit_are_refused_naming_it(waiter, api):
    before = snapshot()
    with pytest.raises(
        InvalidInput, match="nested 950 levels deep; the nesting limit is 64 levels"
    ):
        get_workflow(WF).create(params=nested(950))
    with pytest.raises(InvalidInput, match="nesting limit is 64"):
        waiter.send_event("go", nested(65))
    status, code, message = api(
        f"/api/workflows/{WF}/instances", json.dumps({"params": nested(200)}).encode()
    )
    assert (status, code) == (400, "InvalidInput") and "nesting limit is 64" in message
    assert snapshot() == before
    get_workflow(WF).create(id="deep-ok", params=nested(64))  # exactly at the limit is fine
    engine_still_runs(waiter)


def test_a_step_output_past_the_nesting_limit_fails_the_step_at_once(registered):
    @register("sec-deep-output")
    class DeepOutput(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            return await step.do("deep", lambda: nested(100))

    inst = get_workflow("sec-deep-output").create()
    testing.run_until_idle()
    status = inst.status()
    assert status.status == "errored" and "nesting limit is 64" in status.error["message"]
    assert inst.steps()[0].attempts == 1  # not retried: the callable would run again for nothing


async def test_watch_with_a_pk_past_the_databases_range_gets_an_error_frame_and_the_socket_lives(
    waiter,
):
    cookie = await database_sync_to_async(staff_cookie)("view_instance")
    communicator, connected = await connect("/ws/instances/", cookie)
    assert connected
    await communicator.send_json_to({"type": "watch", "pks": [1, 2**63]})
    assert "integers from 1 to 2**63-1" in await next_error(communicator)
    await communicator.send_json_to({"type": "watch", "pks": [2**63 - 1]})
    while (await communicator.receive_json_from(timeout=5))["type"] != "snapshot":
        pass
    await communicator.disconnect()


@pytest.mark.parametrize(
    "path",
    ["/ws/nope/", "/ws/instances/abc/", f"/ws/instances/{BIG_PK}/", f"/ws/instances/{2**63}/", "/"],
)
async def test_an_unknown_socket_path_is_refused_at_the_handshake(waiter, path):
    cookie = await database_sync_to_async(staff_cookie)("view_instance")
    communicator = WebsocketCommunicator(
        router,
        path,
        headers=[(b"origin", b"http://testserver"), (b"host", b"testserver"), (b"cookie", cookie)],
    )
    connected, code = await communicator.connect(timeout=5)
    assert not connected and code == 4404


# --- 14. the management command ----------------------------------------------------------


COMMAND_BAD = [
    (["send-event", "w1", "go", "--payload", "{"], "--payload is not valid JSON"),
    (["send-event", "w1", "bad type!", "--payload", "{}"], "invalid event type"),
    (["send-event", "nope", "go"], "no instance 'nope'"),
    (["send-event", "w1", "go", "--payload", "1e400"], "not JSON-serialisable"),
    (
        ["send-event", "w1", "go", "--payload", json.dumps(string_of_bytes(LIMIT + 1))],
        f"max_event_payload_bytes is {LIMIT} bytes",
    ),
    (["start", WF, "--params", "["], "--params is not valid JSON"),
    (["start", WF, "--id", "bad id!"], "invalid instance id"),
    (["start", "no-such-workflow"], "no-such-workflow"),
]


@pytest.mark.parametrize("args,message", COMMAND_BAD, ids=lambda v: str(v)[:30])
def test_the_wf_command_refuses_bad_input_with_a_command_error_and_stores_nothing(
    waiter, args, message
):
    before = snapshot()
    with pytest.raises(CommandError) as caught:
        call_command("wf", *args)
    assert message in str(caught.value)
    assert snapshot() == before
    engine_still_runs(waiter)


def test_the_wf_command_refuses_json_nested_ten_thousand_levels_with_a_command_error(waiter):
    before = snapshot()
    with pytest.raises(CommandError):
        call_command("wf", "send-event", "w1", "go", "--payload", DEEP)
    assert snapshot() == before


def test_the_wf_command_refuses_a_payload_file_that_is_not_utf8_with_a_command_error(
    waiter, tmp_path: Path
):
    bad = tmp_path / "payload.json"
    bad.write_bytes(b'{"a": "\xff\xfe"}')
    before = snapshot()
    with pytest.raises(CommandError):
        call_command("wf", "send-event", "w1", "go", "--payload", f"@{bad}")
    assert snapshot() == before


# --- 14. the WebSocket -------------------------------------------------------------------


def staff_cookie(*perms: str, staff: bool = True, name: str = "sock") -> bytes:
    client = Client()
    client.force_login(make_user(name, *perms, staff=staff))
    return f"sessionid={client.cookies['sessionid'].value}".encode()


async def connect(
    path: str,
    cookie: bytes | None,
    origin: bytes = b"http://testserver",
    host: bytes = b"testserver",
    extra: tuple[tuple[bytes, bytes], ...] = (),
) -> tuple[WebsocketCommunicator, bool]:
    headers = [(b"origin", origin), (b"host", host), *extra] + (
        [(b"cookie", cookie)] if cookie else []
    )
    communicator = WebsocketCommunicator(router, path, headers=headers)
    connected, _ = await communicator.connect(timeout=5)
    return communicator, connected


async def next_error(communicator: WebsocketCommunicator) -> str:
    while True:
        message = await communicator.receive_json_from(timeout=5)
        if message["type"] == "error":
            return message["error"]


WS_BAD = [
    ({"text_data": "{"}, "frame is not JSON"),
    ({"bytes_data": b"\xff\xfe"}, "binary frames are not accepted"),
    ({"text_data": json.dumps({"type": "terminate"})}, "unknown message"),
    ({"text_data": json.dumps({"type": 5})}, "unknown message"),
    (
        {"text_data": json.dumps({"type": "send-event", "event": "go", "payload": {}})},
        "unknown message",
    ),
    ({"text_data": "1e400"}, "unknown message"),
    ({"text_data": HUGE_NUMBER}, "unknown message"),
    ({"text_data": DEEP}, "frame larger than 8192 bytes"),
    ({"text_data": json.dumps(string_of_bytes(9000))}, "frame larger than 8192 bytes"),
]


@pytest.mark.parametrize("frame,message", WS_BAD, ids=lambda v: str(v)[:24])
async def test_a_forged_or_malformed_socket_frame_gets_an_error_frame_and_changes_nothing(
    waiter, frame, message
):
    pk = (await database_sync_to_async(waiter.row)()).pk
    cookie = await database_sync_to_async(staff_cookie)("view_instance", "change_instance")
    communicator, connected = await connect(f"/ws/instances/{pk}/", cookie)
    assert connected
    before = await database_sync_to_async(snapshot)()
    await communicator.send_to(**frame)
    assert message in await next_error(communicator)
    await communicator.send_json_to({"type": "ping"})  # the socket is still alive
    while (await communicator.receive_json_from(timeout=5))["type"] != "pong":
        pass
    assert await database_sync_to_async(snapshot)() == before
    await communicator.disconnect()
    await database_sync_to_async(engine_still_runs)(waiter)


async def test_a_socket_frame_nested_four_thousand_levels_gets_an_error_frame(waiter):
    pk = (await database_sync_to_async(waiter.row)()).pk
    cookie = await database_sync_to_async(staff_cookie)("view_instance")
    communicator, connected = await connect(f"/ws/instances/{pk}/", cookie)
    assert connected
    await communicator.send_to(text_data="[" * 4000 + "]" * 4000)
    assert "not JSON" in await next_error(communicator)
    await communicator.disconnect()


def ping_frame_of_bytes(size: int, char: str) -> str:
    """A ping frame whose UTF-8 encoding is exactly `size` bytes, padded with `char`
    (multi-byte) and ASCII to make up the rest."""
    empty = json.dumps({"type": "ping", "pad": ""})
    room = size - len(empty)
    wide = len(char.encode())
    pad = char * (room // wide) + "x" * (room % wide)
    frame = json.dumps({"type": "ping", "pad": pad}, ensure_ascii=False)
    assert len(frame.encode()) == size
    return frame


@pytest.mark.parametrize("char", ["é", "€", "😀"], ids=["2-byte", "3-byte", "4-byte"])
async def test_a_socket_frame_is_measured_in_utf8_bytes_not_characters(waiter, char):
    from workflows_app.consumers import MAX_CLIENT_FRAME

    pk = (await database_sync_to_async(waiter.row)()).pk
    cookie = await database_sync_to_async(staff_cookie)("view_instance")
    communicator, connected = await connect(f"/ws/instances/{pk}/", cookie)
    assert connected
    at_limit = ping_frame_of_bytes(MAX_CLIENT_FRAME, char)
    over = ping_frame_of_bytes(MAX_CLIENT_FRAME + 1, char)
    assert len(over) < MAX_CLIENT_FRAME  # fewer characters than bytes: len() let it in
    await communicator.send_to(text_data=over)
    assert await next_error(communicator) == f"frame larger than {MAX_CLIENT_FRAME} bytes"
    await communicator.send_to(text_data=at_limit)
    while (await communicator.receive_json_from(timeout=5))["type"] != "pong":
        pass
    await communicator.send_to(text_data="\ud800" * (MAX_CLIENT_FRAME // 3))  # no UTF-8 for it
    assert "not JSON" in await next_error(communicator)
    assert await answers_ping(communicator)
    await communicator.disconnect()


async def test_a_socket_for_an_unknown_instance_id_is_refused(waiter):
    cookie = await database_sync_to_async(staff_cookie)("view_instance")
    _, connected = await connect("/ws/instances/987654321/", cookie)
    assert not connected


# --- 15. security --------------------------------------------------------------------------


async def test_a_socket_from_a_foreign_origin_is_refused(waiter):
    pk = (await database_sync_to_async(waiter.row)()).pk
    cookie = await database_sync_to_async(staff_cookie)("view_instance")
    for origin in (b"https://evil.example", b"http://testserver.evil.example", b"null"):
        _, connected = await connect(f"/ws/instances/{pk}/", cookie, origin=origin)
        assert not connected, origin


async def test_a_socket_from_another_port_or_scheme_of_the_same_host_is_refused(waiter):
    pk = (await database_sync_to_async(waiter.row)()).pk
    cookie = await database_sync_to_async(staff_cookie)("view_instance")
    for origin, host in (
        (b"http://testserver:8001", b"testserver"),
        (b"https://testserver", b"testserver"),
        (b"http://testserver", b"testserver:8000"),
        (b"http://testserver:8000", b"testserver:8001"),
        (b"http://localhost:8000", b"testserver:8000"),
    ):
        _, connected = await connect(f"/ws/instances/{pk}/", cookie, origin=origin, host=host)
        assert not connected, (origin, host)
    for origin, host in (
        (b"http://testserver", b"testserver"),
        (b"http://testserver:8000", b"testserver:8000"),
        (b"http://TestServer:80", b"testserver"),
    ):
        communicator, connected = await connect(
            f"/ws/instances/{pk}/", cookie, origin=origin, host=host
        )
        assert connected, (origin, host)
        await communicator.disconnect()


async def test_a_socket_from_a_csrf_trusted_origin_or_through_a_trusted_https_proxy_is_admitted(
    waiter, settings
):
    settings.CSRF_TRUSTED_ORIGINS = ["https://dash.example.com", "https://*.ops.example.com"]
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    pk = (await database_sync_to_async(waiter.row)()).pk
    cookie = await database_sync_to_async(staff_cookie)("view_instance")
    proxied = ((b"x-forwarded-proto", b"https"),)
    for origin, extra, admitted in (
        (b"https://dash.example.com", (), True),
        (b"https://eu.ops.example.com", (), True),
        (b"http://dash.example.com", (), False),
        (b"https://dash.example.com:8443", (), False),
        (b"https://testserver", proxied, True),
        (b"https://testserver", (), False),
        (b"http://testserver", proxied, False),
    ):
        communicator, connected = await connect(
            f"/ws/instances/{pk}/", cookie, origin=origin, extra=extra
        )
        assert connected is admitted, (origin, extra)
        if connected:
            await communicator.disconnect()


async def test_an_anonymous_socket_is_refused(waiter):
    pk = (await database_sync_to_async(waiter.row)()).pk
    for path in (f"/ws/instances/{pk}/", "/ws/instances/", "/ws/overview/"):
        _, connected = await connect(path, None)
        assert not connected, path


def logged_in(name: str, *perms: str) -> tuple[Client, bytes]:
    client = Client()
    client.force_login(make_user(name, *perms))
    return client, f"sessionid={client.cookies['sessionid'].value}".encode()


def another_session(username: str) -> bytes:
    client = Client()
    client.force_login(User.objects.get(username=username))
    return f"sessionid={client.cookies['sessionid'].value}".encode()


async def close_code(communicator: WebsocketCommunicator) -> int:
    """Read what the socket sends until it closes; the close code."""
    while True:
        output = await communicator.receive_output(timeout=5)
        if output["type"] == "websocket.close":
            return output["code"]


async def answers_ping(communicator: WebsocketCommunicator) -> bool:
    await communicator.send_json_to({"type": "ping"})
    while True:
        output = await communicator.receive_output(timeout=5)
        if output["type"] == "websocket.close":
            return False
        if json.loads(output["text"])["type"] == "pong":
            return True


@pytest.mark.parametrize("path", ["/ws/instances/", "/ws/overview/", "detail"])
async def test_logging_out_closes_the_sessions_sockets_but_not_another_sessions(waiter, path):
    pk = (await database_sync_to_async(waiter.row)()).pk
    path = f"/ws/instances/{pk}/" if path == "detail" else path
    client, cookie = await database_sync_to_async(logged_in)("leaver", "view_instance")
    other_cookie = await database_sync_to_async(another_session)("leaver")
    mine, connected = await connect(path, cookie)
    theirs, also = await connect(path, other_cookie)
    assert connected and also
    await database_sync_to_async(client.post)("/admin/logout/")
    assert await close_code(mine) == 4403
    assert await answers_ping(theirs)
    await theirs.disconnect()


async def test_a_socket_closes_when_its_user_is_deactivated_or_loses_view_permission(waiter):
    user = await database_sync_to_async(make_user)("fading", "view_instance", "change_instance")
    for name, change in (
        ("deactivated", lambda u: (setattr(u, "is_active", False), u.save())),
        ("no longer staff", lambda u: (setattr(u, "is_staff", False), u.save())),
        (
            "lost view_instance",
            lambda u: u.user_permissions.remove(Permission.objects.get(codename="view_instance")),
        ),
    ):
        await database_sync_to_async(
            lambda: User.objects.filter(pk=user.pk).update(is_active=True, is_staff=True)
        )()
        await database_sync_to_async(
            lambda: user.user_permissions.add(Permission.objects.get(codename="view_instance"))
        )()
        communicator, connected = await connect(
            "/ws/instances/", await database_sync_to_async(another_session)("fading")
        )
        assert connected, name
        fresh = await database_sync_to_async(User.objects.get)(pk=user.pk)
        await database_sync_to_async(change)(fresh)
        assert await close_code(communicator) == 4403, name


def group_viewer(username: str) -> tuple[Group, Permission]:
    """A staff user who may view only through their group."""
    view = Permission.objects.get(codename="view_instance")
    group = Group.objects.create(name=f"{username}-viewers")
    group.permissions.add(view)
    make_user(username).groups.add(group)
    return group, view


@pytest.mark.parametrize(
    "side", ["group.permissions", "permission.group_set", "group.user_set", "user.groups"]
)
async def test_a_socket_closes_when_the_group_that_let_its_user_view_loses_that(waiter, side):
    group, view = await database_sync_to_async(group_viewer)("grouped")
    communicator, connected = await connect(
        "/ws/instances/", await database_sync_to_async(another_session)("grouped")
    )
    assert connected
    change = {
        "group.permissions": lambda: group.permissions.remove(view),
        "permission.group_set": lambda: view.group_set.remove(group),
        "group.user_set": lambda: group.user_set.clear(),
        "user.groups": lambda: User.objects.get(username="grouped").groups.remove(group),
    }[side]
    await database_sync_to_async(change)()
    assert await close_code(communicator) == 4403


async def test_a_change_no_signal_reports_closes_the_socket_at_its_next_message_or_recheck(
    waiter, monkeypatch
):
    # A message re-checks with an answer at most fanout.ACCESS_SHARED_SECONDS old.
    monkeypatch.setattr(fanout, "ACCESS_SHARED_SECONDS", 3600)
    _, cookie = await database_sync_to_async(logged_in)("quiet", "view_instance")
    communicator, connected = await connect("/ws/instances/", cookie)
    assert connected and await answers_ping(communicator)
    await database_sync_to_async(
        lambda: User.objects.filter(username="quiet").update(is_active=False)
    )()
    assert await answers_ping(communicator)  # within the window: the answer read stands
    monkeypatch.setattr(fanout, "ACCESS_SHARED_SECONDS", 0.0)  # the window has passed
    assert not await answers_ping(communicator)  # the next message reads the change

    await database_sync_to_async(
        lambda: User.objects.filter(username="quiet").update(is_active=True)
    )()
    monkeypatch.setattr(access, "RECHECK_SECONDS", 0.05)
    communicator, connected = await connect("/ws/instances/", cookie)
    assert connected
    await database_sync_to_async(
        lambda: User.objects.filter(username="quiet").update(is_active=False)
    )()
    assert await close_code(communicator) == 4403  # the periodic re-check, with no message at all


def session_reads(monkeypatch: Any) -> list[str]:
    """Every SQL statement that reads a session, from any thread, until the test ends."""
    from django.db.backends import utils

    seen: list[str] = []
    execute = utils.CursorWrapper.execute

    def counting(self: Any, sql: str, params: Any = None) -> Any:
        if "django_session" in sql:
            seen.append(sql)
        return execute(self, sql, params)

    monkeypatch.setattr(utils.CursorWrapper, "execute", counting)
    return seen


async def test_a_flood_of_client_frames_reads_the_session_once_not_per_frame(waiter, monkeypatch):
    # Each frame used to run the full access check (session, user, two permission
    # queries) on the thread every synchronous view waits for.
    monkeypatch.setattr(fanout, "ACCESS_SHARED_SECONDS", 3600)  # no window ends mid-test
    _, cookie = await database_sync_to_async(logged_in)("flooder", "view_instance")
    communicator, connected = await connect("/ws/instances/", cookie)
    assert connected
    reads = session_reads(monkeypatch)
    for _ in range(CLIENT_FRAMES_BURST // 2):  # the most a socket may send at once
        await communicator.send_json_to({"type": "ping"})
        await communicator.send_to(text_data="{")
    pongs = errors = 0
    while pongs < CLIENT_FRAMES_BURST // 2 or errors < CLIENT_FRAMES_BURST // 2:
        message = await communicator.receive_json_from(timeout=5)
        pongs += message["type"] == "pong"
        errors += message["type"] == "error"
    assert len(reads) == 1, reads
    await communicator.disconnect()


async def test_a_flood_of_frames_past_the_rate_is_dropped_with_one_error_and_the_socket_lives(
    waiter, monkeypatch
):
    now = [0.0]  # the sockets' clock, stopped: no frame is refilled unless it moves
    monkeypatch.setattr(consumers.DashboardConsumer, "monotonic", staticmethod(lambda: now[0]))
    pk = (await database_sync_to_async(waiter.row)()).pk
    cookie = await database_sync_to_async(staff_cookie)("view_instance")
    flooder, connected = await connect(f"/ws/instances/{pk}/", cookie)
    neighbour, also = await connect(f"/ws/instances/{pk}/", cookie)
    assert connected and also
    for _ in range(CLIENT_FRAMES_BURST + 100):
        await flooder.send_json_to({"type": "ping"})
    assert await answers_ping(neighbour)  # another socket of the same user is served
    received = []
    while len(received) < CLIENT_FRAMES_BURST + 1:
        message = await flooder.receive_json_from(timeout=5)
        if message["type"] not in ("snapshot", "heartbeat"):
            received.append(message)
    assert [m["type"] for m in received].count("pong") == CLIENT_FRAMES_BURST
    (error,) = [m for m in received if m["type"] == "error"]
    assert error["error"].startswith(f"too many messages: at most {CLIENT_FRAMES_BURST} at once")
    # The other 99 are dropped unanswered (with the clock stopped, none ever is).
    assert await flooder.receive_nothing(timeout=0.2)
    now[0] += CLIENT_FRAMES_BURST / CLIENT_FRAMES_PER_SECOND  # the allowance is back
    assert await answers_ping(flooder)
    await flooder.disconnect()
    await neighbour.disconnect()


def test_a_staff_user_without_change_permission_pressing_terminate_gets_403_and_nothing_changes(
    waiter,
):
    client = Client()
    client.force_login(make_user("looker", "view_instance"))
    pk = waiter.row().pk
    before = snapshot()
    response = client.post(f"/instances/{pk}/terminate/")
    assert response.status_code == 403
    assert snapshot() == before and waiter.status().status == "waiting"


def test_a_dashboard_post_without_a_csrf_token_is_refused(waiter):
    client = Client(enforce_csrf_checks=True)
    client.force_login(make_user("operator", "view_instance", "change_instance"))
    pk = waiter.row().pk
    before = snapshot()
    response = client.post(f"/instances/{pk}/terminate/")
    assert response.status_code == 403 and b"CSRF" in response.content
    assert snapshot() == before and waiter.status().status == "waiting"
    # With the token it works: the refusal was the missing token, nothing else.
    client.get(f"/instances/{pk}/", follow=True)  # redirects to the page by workflow and id
    response = client.post(
        f"/instances/{pk}/terminate/", {"csrfmiddlewaretoken": client.cookies["csrftoken"].value}
    )
    assert response.status_code == 302 and waiter.status().status == "terminated"


def test_a_revoked_api_token_is_refused(waiter):
    _, secret = tokens.issue("short-lived")
    client = Client()
    headers = {"Authorization": f"Bearer {secret}"}
    assert client.get(f"/api/workflows/{WF}/instances/w1", headers=headers).status_code == 200
    tokens.revoke("short-lived")
    before = snapshot()
    for response in (
        client.get(f"/api/workflows/{WF}/instances/w1", headers=headers),
        client.post(EVENT, "{}", content_type="application/json", headers=headers),
        client.patch(
            f"/api/workflows/{WF}/instances/w1/status",
            '{"status": "terminate"}',
            content_type="application/json",
            headers=headers,
        ),
    ):
        assert response.status_code == 401 and "revoked" in response.json()["errors"][0]["message"]
    assert snapshot() == before and waiter.status().status == "waiting"


@pytest.fixture
def failing(registered: list[str]) -> Any:
    @register("sec-xss")
    class Failing(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            await step.wait_for_event("wait", type="go", timeout="1 hour")
            await step.do(
                "explode",
                lambda: (_ for _ in ()).throw(ValueError(" ".join(XSS))),
                retries={"limit": 0},
            )

    inst = get_workflow("sec-xss").create(id="xss", params={"p": XSS})
    testing.run_until_idle()
    inst.send_event("go", {"e": XSS})
    testing.run_until_idle()
    assert inst.status().status == "errored" and XSS[0] in inst.status().error["message"]
    return inst


def test_script_in_an_error_message_and_a_payload_is_rendered_escaped(failing):
    client = Client()
    client.force_login(make_user("viewer", "view_instance"))
    pk = failing.row().pk
    for path in (f"/instances/{pk}/", f"/instances/{pk}/live/", "/errors/"):
        response = client.get(path, follow=True)
        assert response.status_code == 200, path
        page = response.content.decode()
        for raw in XSS:
            assert raw not in page, f"{path} renders {raw!r} unescaped"
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page, path
    detail = client.get(f"/instances/{pk}/", follow=True).content.decode()
    assert "onmouseover=alert(1)" in detail  # shown, but only inside an escaped attribute-safe text
    assert '"onmouseover' not in detail


# --- throttling guessed credentials ------------------------------------------------------


def test_wrong_api_tokens_are_throttled_with_429_and_retry_after_even_for_the_right_token(
    waiter, settings
):
    settings.WFDASH = {**settings.WFDASH, "API_FAILURE_LIMIT": 5, "API_LOCKOUT_SECONDS": 120}
    _, secret = tokens.issue("right")
    client = Client()
    path = f"/api/workflows/{WF}/instances/w1"
    for attempt in range(5):
        wrong = client.get(path, headers={"Authorization": f"Bearer wf_guess{attempt}"})
        assert wrong.status_code == 401, attempt
    locked = client.get(path, headers={"Authorization": f"Bearer {secret}"})
    assert locked.status_code == 429 and locked.json()["errors"][0]["code"] == "TooManyRequests"
    assert 0 < int(locked["Retry-After"]) <= 120
    # Another client address is not locked out by this one's guesses.
    other = client.get(path, headers={"Authorization": f"Bearer {secret}"}, REMOTE_ADDR="10.0.0.2")
    assert other.status_code == 200


def test_requests_without_a_token_do_not_count_as_guesses(waiter, settings):
    settings.WFDASH = {**settings.WFDASH, "API_FAILURE_LIMIT": 3}
    _, secret = tokens.issue("right")
    client = Client()
    for _ in range(5):
        assert client.get(f"/api/workflows/{WF}/instances").status_code == 401
    assert (
        client.get(
            f"/api/workflows/{WF}/instances", headers={"Authorization": f"Bearer {secret}"}
        ).status_code
        == 200
    )


def test_repeated_failed_logins_lock_the_address_out_with_429_even_for_the_right_password(
    waiter, settings
):
    User.objects.create_superuser("boss", password="a-long-passphrase")
    client = Client()
    for attempt in range(settings.AXES_FAILURE_LIMIT - 1):
        response = client.post("/admin/login/", {"username": "boss", "password": f"wrong{attempt}"})
        assert response.status_code == 200, attempt  # the form again, with its error
    locked = client.post("/admin/login/", {"username": "boss", "password": "wrong-last"})
    assert (
        locked.status_code == 429
        and int(locked["Retry-After"]) == settings.AXES_COOLOFF_TIME.total_seconds()
    )
    right = client.post("/admin/login/", {"username": "boss", "password": "a-long-passphrase"})
    assert right.status_code == 429
    assert "sessionid" not in client.cookies or client.get("/").status_code != 200
    # Another address can still log in.
    other = Client(REMOTE_ADDR="10.0.0.2")
    assert (
        other.post(
            "/admin/login/", {"username": "boss", "password": "a-long-passphrase"}
        ).status_code
        == 302
    )


def test_the_nesting_check_reads_brackets_inside_strings_and_escapes_as_text(waiter):
    tricky = [{"s": "[[[[{{{{" * 20, "e": '\\\\"]]}}' * 20, "u": "é[ü]\ud800"} for _ in range(70)]
    assert (
        get_workflow(WF).create(params=[{"s": "[" * 200} for _ in range(70)]).row().params[0]["s"]
        == "[" * 200
    )
    with pytest.raises(
        InvalidInput, match="not valid Unicode"
    ):  # the surrogate, not the nesting check
        get_workflow(WF).create(params=tricky)
