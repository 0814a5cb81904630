"""Secrets: sensitive step outputs are REDACTED on every surface; the payload codec keeps
params, outputs and event payloads encoded at rest (a real Fernet codec)."""

from __future__ import annotations

import base64
import json
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import connection
from django.test import Client, override_settings
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from workflows_app import testing, tokens, tracing
from workflows_app.client import get_workflow
from workflows_app.codec import REDACTED, seal, unseal
from workflows_app.engine import WorkflowEntrypoint, register
from workflows_app.engine.errors import CodecError
from workflows_app.models import (
    BulkJob,
    HistoryRecord,
    InboxEvent,
    Instance,
    Span,
    StepRecord,
)

pytestmark = pytest.mark.django_db(transaction=True)

CARD = "4111-1111-SECRET-CARD"
_exporter = InMemorySpanExporter()
tracing.add_processor(SimpleSpanProcessor(_exporter))

CALLS: list[str] = []


def with_codec(path: str | None = "tests.codecs.FernetCodec") -> Any:
    return override_settings(WFDASH={**settings.WFDASH, "PAYLOAD_CODEC": path})


@pytest.fixture
def card_reader(registered: list[str]) -> Any:
    CALLS.clear()

    @register("card-reader")
    class CardReader(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            def read_card() -> dict[str, str]:
                CALLS.append("read")
                return {"number": CARD}

            card = await step.do("read card", read_card, sensitive=True)
            last4 = await step.do("last four", lambda: card["number"][-4:])
            approval = await step.wait_for_event("approval", type="approve")
            return {"last4": last4, "note": approval.payload["note"]}

    return get_workflow("card-reader")


def run_card_reader(wf: Any, params: Any = None, note: str = "plain-note") -> Any:
    inst = wf.create(id="c1", params=params or {"customer": "cust-plain"})
    testing.run_until_idle()
    inst.send_event("approve", {"note": note})
    testing.run_until_idle()
    return inst


def admin_client() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("boss", password="pw"))
    return client


def surfaces_text(inst: Any) -> dict[str, str]:
    """What every surface shows of the instance, as text."""
    row = inst.row()
    step = StepRecord.objects.get(instance=row, name="read card")
    history = HistoryRecord.objects.filter(instance=row).first()
    admin = admin_client()
    _, secret = tokens.issue("reader", scope="read")
    api = Client()
    auth = {"HTTP_AUTHORIZATION": f"Bearer {secret}"}
    out = StringIO()
    call_command("wf", "status", inst.id, "--json", stdout=out, stderr=StringIO())
    human = StringIO()
    call_command("wf", "status", inst.id, stdout=human, stderr=StringIO())
    history_out = StringIO()
    call_command("wf", "history", inst.id, "--json", stdout=history_out, stderr=StringIO())
    pages = {
        "dashboard": admin.get(f"/workflows/card-reader/{inst.id}/"),
        "admin step": admin.get(f"/admin/workflows_app/steprecord/{step.pk}/change/"),
        "admin instance": admin.get(f"/admin/workflows_app/instance/{row.pk}/change/"),
        "admin history": admin.get(f"/admin/workflows_app/historyrecord/{history.pk}/change/"),
        "api": api.get(f"/api/workflows/card-reader/instances/{inst.id}", **auth),
        "api history": api.get(f"/api/workflows/card-reader/instances/{inst.id}/history", **auth),
    }
    shown = {}
    for name, response in pages.items():
        assert response.status_code == 200, (name, response.status_code)
        shown[name] = response.content.decode()
    shown["cli status"] = out.getvalue() + human.getvalue()
    shown["cli history"] = history_out.getvalue()
    return shown


def test_a_sensitive_output_is_replayed_but_redacted_on_every_surface(card_reader):
    _exporter.clear()
    inst = run_card_reader(card_reader)
    assert inst.status().output == {"last4": "CARD", "note": "plain-note"}
    assert CALLS == ["read"]  # replays after the wait returned the checkpoint
    step = StepRecord.objects.get(instance=inst.row(), name="read card")
    assert step.output == {"number": CARD} and step.sensitive
    assert step.shown_output == REDACTED

    shown = surfaces_text(inst)
    for surface, text in shown.items():
        assert CARD not in text, f"the secret shows in {surface}"
    steps = {s["name"]: s for s in json.loads(shown["api"])["result"]["steps"]}
    assert steps["read card"]["output"] == REDACTED
    # The other step's output is shown as usual: redaction is per step.
    assert steps["last four"]["output"] == "CARD"
    assert REDACTED in shown["dashboard"] and REDACTED in shown["admin step"]

    history = list(HistoryRecord.objects.filter(instance=inst.row()).values_list("data", flat=True))
    assert CARD not in json.dumps(history)
    finished = _exporter.get_finished_spans()
    exported = json.dumps(
        [
            {"attributes": dict(s.attributes), "events": [dict(e.attributes) for e in s.events]}
            for s in finished
        ]
    )
    assert CARD not in exported
    read_span = next(s for s in finished if s.name == "step read card")
    assert read_span.attributes["workflow.step.sensitive"] is True
    stored = list(Span.objects.values_list("attributes", "events"))
    assert stored and CARD not in json.dumps(stored)


PLAIN_MARKERS = ("cust-plain", "plain-note", "CARD")


def raw_rows(pk: int) -> str:
    """Every stored column of the instance's rows, as the database holds them."""
    tables = {
        Instance._meta.db_table: "id",
        StepRecord._meta.db_table: "instance_id",
        InboxEvent._meta.db_table: "instance_id",
        HistoryRecord._meta.db_table: "instance_id",
    }
    text = []
    with connection.cursor() as cursor:
        for table, column in tables.items():
            cursor.execute(f"SELECT * FROM {table} WHERE {column} = %s", [pk])
            text.append(repr(cursor.fetchall()))
    return "\n".join(text)


def test_the_fernet_codec_keeps_params_outputs_and_payloads_encrypted_at_rest(card_reader):
    with with_codec():
        inst = run_card_reader(card_reader)
        assert inst.status().output == {"last4": "CARD", "note": "plain-note"}
        row = inst.row()
        rows = raw_rows(row.pk)
        for marker in PLAIN_MARKERS:
            assert marker not in rows, f"{marker!r} is stored in clear"
        token = base64.b64decode(json.loads(row.params_json)["$codec"])
        assert token.startswith(b"gAAAAA")  # a Fernet token (version byte 0x80)
        assert row.params == {"customer": "cust-plain"}

        shown = surfaces_text(inst)
        for surface in ("dashboard", "api", "cli status"):
            assert "cust-plain" in shown[surface], surface
        assert "plain-note" in shown["api history"] and "plain-note" in shown["cli history"]
        assert "plain-note" in shown["dashboard"]  # the inbox and the history timeline
        for surface, text in shown.items():
            assert CARD not in text, surface
        received = next(h for h in inst.history() if h.type == "event.received")
        assert received.data["payload"] == {"note": "plain-note"}


def test_values_written_before_the_codec_read_back_and_a_wrong_key_is_a_clear_error(
    card_reader,
):
    inst = card_reader.create(id="before", params={"customer": "cust-plain"})
    with with_codec():
        assert inst.row().params == {"customer": "cust-plain"}  # plain rows stay readable
        sealed = card_reader.create(id="after", params={"customer": "cust-plain"})
    with pytest.raises(CodecError, match="PAYLOAD_CODEC"):
        sealed.row().params  # noqa: B018
    with with_codec("tests.codecs.OtherKeyCodec"), pytest.raises(CodecError, match="InvalidToken"):
        sealed.row().params  # noqa: B018
    with with_codec("tests.codecs.OtherKeyCodec"):
        client = admin_client()
        page = client.get("/workflows/card-reader/after/")
        admin_page = client.get(f"/admin/workflows_app/instance/{sealed.row().pk}/change/")
    for response in (page, admin_page):
        assert response.status_code == 200 and "cannot decode" in response.content.decode()


def test_an_event_payload_the_codec_cannot_decode_shows_as_such_on_the_instance_page(
    card_reader,
):
    with with_codec():
        run_card_reader(card_reader)  # its event.received history record holds the sealed payload
    with with_codec("tests.codecs.OtherKeyCodec"):
        page = admin_client().get("/workflows/card-reader/c1/")
        assert page.status_code == 200  # it was a 500 traceback page
        assert "cannot decode" in page.content.decode()
        with pytest.raises(CodecError):  # the client says so, as documented
            get_workflow("card-reader").get("c1").history()


@pytest.fixture
def limit_reader(registered: list[str]) -> Any:
    @register("limit-reader")
    class LimitReader(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            try:
                limit = await step.do("read limit", lambda: 500)
            except ValueError:  # the workflow's own fallback (CodecError is a ValueError)
                limit = 0
            await step.wait_for_event("approval", type="approve")
            return {"limit": limit, "params": event.payload}

    return get_workflow("limit-reader")


def test_a_value_the_codec_cannot_decode_parks_the_run_naming_it_never_a_wrong_value(
    limit_reader,
):
    with testing.fake_clock() as clock:
        replayed = limit_reader.create(id="replayed")  # plain params: its step output is sealed
        with with_codec():
            testing.run_until_idle()
            started = limit_reader.create(id="started", params={"customer": "cust-plain"})
        replayed.send_event("approve", {})  # plain: any codec reads it
        started.send_event("approve", {})
        # A rotation lost the key: the replay of "read limit" and the params of "started"
        # cannot be decoded. Rechecked three times: never errored as a poison instance.
        with with_codec("tests.codecs.OtherKeyCodec"):
            for _ in range(3):
                testing.run_until_idle()
                clock.advance(timedelta(seconds=61))
        for inst, what in (
            (replayed, 'the output of step "read limit" of limit-reader/replayed'),
            (started, "the params of limit-reader/started"),
        ):
            row = inst.row()
            assert row.status == "waiting" and row.output_json is None, (row.status, row.output)
            assert f"cannot decode {what}: " in row.waiting_reason
            assert "PAYLOAD_CODEC" in row.waiting_reason
        # The key restored, each goes on with its real values.
        with with_codec():
            testing.run_until_idle()
            assert replayed.status().output == {"limit": 500, "params": None}
            assert started.status().output == {"limit": 500, "params": {"customer": "cust-plain"}}


def test_a_run_parked_on_an_undecodable_value_of_long_names_says_so_within_the_column(
    registered,
):
    """The reason quotes the workflow name (up to 200 characters) and the instance id (here
    200), then the codec's error and what to configure: 560 characters, past the 500 of
    waiting_reason. PostgreSQL refused the park (DataError), so the run was never parked
    and came back at each lease's end; SQLite kept the reason whole."""
    name = "w" * 200

    @register(name, limits={"max_instance_id_length": 200})
    class LongNames(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            return event.payload

    wf = get_workflow(name)
    with testing.fake_clock():
        with with_codec():
            inst = wf.create(id="i" * 200, params={"n": 1})
        with with_codec("tests.codecs.OtherKeyCodec"):
            testing.run_until_idle()
        row = inst.row()
        assert row.status == "waiting", row.status
        assert row.waiting_reason.startswith(f"cannot decode the params of {name}/")
        assert len(row.waiting_reason) == Instance._meta.get_field("waiting_reason").max_length
        assert row.waiting_reason.endswith("…")


def test_a_bulk_send_event_refused_by_a_schema_keeps_its_sealed_payload_out_of_the_job_errors(
    registered,
):
    @register("pin-reader")
    class PinReader(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            schema = {"type": "object", "properties": {"pin": {"type": "integer"}}}
            await step.wait_for_event("pin", type="pin", schema=schema)

    wf = get_workflow("pin-reader")
    with with_codec():
        wf.create(id="p1")
        testing.run_until_idle()
        job = wf.bulk("send_event", event_type="pin", payload={"pin": CARD})
        testing.run_until_idle()
        errors = BulkJob.objects.get(pk=job.id).errors
    assert len(errors) == 1 and errors[0].startswith("pin-reader/p1: the payload does not match")
    assert CARD not in json.dumps(errors)


@pytest.mark.parametrize(
    "value",
    [
        {"$codec": "not base64 at all"},
        {"$codec": "eyJ4IjoxfQ==", "plain": True},
        {"$codec": 1, "sensitive": True},
        None,
        "text",
    ],
)
def test_values_that_look_like_an_envelope_round_trip_exactly(value):
    text = json.dumps(value, separators=(",", ":"))
    for path in (None, "tests.codecs.FernetCodec"):
        with with_codec(path):
            assert json.loads(unseal(seal(text))) == value
            assert json.loads(unseal(seal(text, sensitive=True))) == value


def test_the_compensation_of_a_sensitive_step_is_redacted_on_every_surface(registered):
    """The compensation is given the sensitive output; what it returns (a refund of that
    card) was checkpointed and shown in clear on the dashboard, admin, API, CLI and spans."""

    @register("card-refund")
    class CardRefund(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            await step.do(
                "charge card",
                lambda: {"number": CARD},
                compensate=lambda card: {"refunded": card["number"]},
                sensitive=True,
            )
            await step.do("plain", lambda: "plain", compensate=lambda out: f"undid {out}")
            await step.wait_for_event("approval", type="approve")

    _exporter.clear()
    inst = get_workflow("card-refund").create(id="r1")
    testing.run_until_idle()
    inst.cancel(actor="test")
    testing.run_until_idle()
    assert inst.status().status == "terminated"
    undo = StepRecord.objects.get(instance=inst.row(), name="charge card", kind="compensate")
    assert undo.output == {"refunded": CARD} and undo.shown_output == REDACTED
    other = StepRecord.objects.get(instance=inst.row(), name="plain", kind="compensate")
    assert other.shown_output == "undid plain"  # redaction stays per step

    admin = admin_client()
    _, secret = tokens.issue("reader", scope="read")
    auth = {"HTTP_AUTHORIZATION": f"Bearer {secret}"}
    shown = {
        "dashboard": admin.get(f"/workflows/card-refund/{inst.id}/"),
        "admin step": admin.get(f"/admin/workflows_app/steprecord/{undo.pk}/change/"),
        "api": Client().get(f"/api/workflows/card-refund/instances/{inst.id}", **auth),
    }
    for name, response in shown.items():
        assert response.status_code == 200, name
        assert CARD not in response.content.decode(), f"the secret shows in {name}"
    for verb in ("status", "history"):
        for json_flag in ([], ["--json"]):
            out = StringIO()
            call_command("wf", verb, inst.id, *json_flag, stdout=out, stderr=StringIO())
            assert CARD not in out.getvalue(), f"the secret shows in wf {verb} {json_flag}"
    api_steps = json.loads(shown["api"].content)["result"]["steps"]
    assert REDACTED in [s["output"] for s in api_steps if s["kind"] == "compensate"]
    history = list(HistoryRecord.objects.filter(instance=inst.row()).values_list("data", flat=True))
    assert CARD not in json.dumps(history)
    spans = [
        (dict(s.attributes), [dict(e.attributes) for e in s.events])
        for s in _exporter.get_finished_spans()
    ]
    assert CARD not in json.dumps(spans)
    assert CARD not in json.dumps(list(Span.objects.values_list("attributes", "events")))
