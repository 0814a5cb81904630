"""`python manage.py wf <verb>`: every verb, its --json output, and its refusals."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import CommandError

from tests.surface_flows import (
    APPROVAL,
    COMPENSATIONS,
    OTHER,
    SIMPLE,
    register_flows,
    snapshot,
    waiting_approval,
)
from workflows_app import testing, tokens
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register
from workflows_app.engine.errors import NonRetryableError
from workflows_app.models import ApiToken, Instance

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def flows(registered: list[str]) -> None:
    register_flows()
    COMPENSATIONS.clear()


def wf(*args: str) -> str:
    out = StringIO()
    call_command("wf", *args, stdout=out, stderr=StringIO())
    return out.getvalue()


def wf_json(*args: str) -> Any:
    return json.loads(wf(*args, "--json"))


def refused(*args: str) -> str:
    """Run a verb that must fail; returns its one-line error, after checking nothing changed."""
    before = snapshot()
    with pytest.raises(CommandError) as excinfo:
        wf(*args)
    assert snapshot() == before
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# --- start ----------------------------------------------------------------------------


def test_start_creates_an_instance_with_params_from_json(registered):
    out = wf("start", SIMPLE, "--params", '{"x": 1}', "--id", "s-1")
    assert out.strip() == f"started {SIMPLE}/s-1 (v1, running)"
    assert get_workflow(SIMPLE).get("s-1").row().params == {"x": 1}


def test_start_reads_params_from_a_file(tmp_path: Path):
    params = tmp_path / "params.json"
    params.write_text('{"amount": 7}')
    data = wf_json("start", APPROVAL, "--params", f"@{params}", "--id", "from-file")
    assert data == {
        "id": "from-file",
        "workflow": APPROVAL,
        "version": 1,
        "status": "running",
        "created": True,
    }
    assert get_workflow(APPROVAL).get("from-file").row().params == {"amount": 7}


def test_start_with_the_same_idempotency_key_returns_the_same_instance():
    first = wf_json("start", SIMPLE, "--idempotency-key", "k-1")
    second = wf_json("start", SIMPLE, "--idempotency-key", "k-1")
    assert first["id"] == second["id"]
    assert Instance.objects.filter(workflow=SIMPLE).count() == 1


class Terminal(StringIO):
    def isatty(self) -> bool:
        return True


def test_start_count_creates_many_in_batches_with_a_progress_bar(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    out = wf("start", SIMPLE, "--params", '{"x": 2}', "--count", "250")
    assert out.strip() == f"started 250 instances of {SIMPLE}"
    rows = Instance.objects.filter(workflow=SIMPLE)
    assert rows.count() == 250 and {tuple(r.params.items()) for r in rows} == {(("x", 2),)}
    assert "starting" in terminal.getvalue() and "250/250" in terminal.getvalue()
    data = wf_json("start", SIMPLE, "--count", "3")
    assert data["count"] == 3 and len(set(data["ids"])) == 3


def test_start_count_refuses_an_id_or_key_and_a_count_out_of_range():
    assert "leave them out with --count" in refused("start", SIMPLE, "--count", "2", "--id", "x")
    assert "leave them out with --count" in refused(
        "start", SIMPLE, "--count", "2", "--idempotency-key", "k"
    )
    assert refused("start", SIMPLE, "--count", "0") == (
        "--count must be from 1 to 100000 (start more in several commands), got 0"
    )
    # A few zeros too many started instances for hours (half a million in minutes).
    assert "--count must be from 1 to 100000" in refused("start", SIMPLE, "--count", "100001")
    assert "version 9" in refused("start", SIMPLE, "--count", "2", "--version", "9")


def test_start_refuses_bad_json_and_creates_nothing():
    assert refused("start", SIMPLE, "--params", "{nope").startswith("--params is not valid JSON")
    # Python's JSON parser refuses an integer of over 4,300 digits with a plain ValueError.
    assert "--params is not valid JSON" in refused("start", SIMPLE, "--params", "1" * 5000)
    assert "--payload is not valid JSON" in refused(
        "bulk", "send_event", "-w", APPROVAL, "--type", "approval", "--payload", "9" * 5000
    )


def test_arguments_that_are_not_utf8_are_refused_naming_the_argument():
    # Python keeps argv bytes that are not UTF-8 as lone surrogates (0xff -> U+DCFF); the
    # database cannot store or even look them up, so each verb must refuse them in one line.
    waiting_approval("o-1")
    assert refused("status", "\udcff") == "id is not UTF-8 text: b'\\xff'"
    assert refused("start", "\udcff") == "workflow is not UTF-8 text: b'\\xff'"
    assert "--params is not UTF-8" in refused("start", SIMPLE, "--params", '"\udcff"')
    assert "--attr is not UTF-8" in refused("list", "--attr", "k=\udcff")
    assert "--workflow is not UTF-8" in refused("bulk", "pause", "-w", "\udcff")
    assert "name is not UTF-8" in refused("token", "create", "\udcff")
    assert "name is not UTF-8" in refused("schedules", "pause", "\udcff")


def test_start_refuses_a_missing_params_file(tmp_path: Path):
    assert "cannot read" in refused("start", SIMPLE, "--params", f"@{tmp_path / 'missing.json'}")


def test_start_refuses_an_unknown_workflow():
    assert refused("start", "no-such-flow") == "no workflow named 'no-such-flow' is registered"


def test_start_refuses_an_id_that_already_exists():
    wf("start", SIMPLE, "--id", "dup")
    assert "already has an instance with id 'dup'" in refused("start", SIMPLE, "--id", "dup")


def test_start_refuses_an_invalid_instance_id():
    assert "invalid instance id" in refused("start", SIMPLE, "--id", "has space")


# --- list -----------------------------------------------------------------------------


def test_list_shows_every_workflow_newest_first_in_a_table():
    wf("start", SIMPLE, "--id", "a")
    wf("start", OTHER, "--id", "b")
    lines = wf("list").splitlines()
    assert lines[0].split() == ["WORKFLOW", "ID", "VERSION", "STATUS", "CREATED", "ERROR"]
    assert {line.split()[1] for line in lines[1:]} == {"a", "b"}


def test_list_filters_by_workflow_and_status():
    wf("start", SIMPLE, "--id", "done")
    testing.run_until_idle()
    wf("start", SIMPLE, "--id", "fresh")
    wf("start", OTHER, "--id", "elsewhere")
    data = wf_json("list", "--workflow", SIMPLE, "--status", "complete")
    assert [i["id"] for i in data["instances"]] == ["done"]
    assert data["instances"][0]["status"] == "complete"


def test_list_pages_with_a_cursor_within_one_workflow():
    for n in range(3):
        wf("start", SIMPLE, "--id", f"p{n}")
    first = wf_json("list", "--workflow", SIMPLE, "--limit", "2")
    assert [i["id"] for i in first["instances"]] == ["p2", "p1"]
    assert f"--cursor {first['cursor']}" in wf("list", "--workflow", SIMPLE, "--limit", "2")
    second = wf_json("list", "--workflow", SIMPLE, "--limit", "2", "--cursor", first["cursor"])
    assert [i["id"] for i in second["instances"]] == ["p0"] and second["cursor"] is None


def test_list_refuses_an_unknown_status_and_a_bad_cursor():
    assert "unknown status 'sleepy'" in refused("list", "--status", "sleepy")
    assert "invalid cursor" in refused("list", "--workflow", SIMPLE, "--cursor", "???")
    assert "--cursor needs --workflow" in refused("list", "--cursor", "abc")


# --- status / history -------------------------------------------------------------------


def test_status_shows_the_steps_and_what_the_instance_waits_for():
    waiting_approval("o-1", amount=9)
    out = wf("status", "o-1")
    assert out.splitlines()[0] == f"{APPROVAL}/o-1  v1  waiting"
    assert 'params:   {"amount":9}' in out
    assert "charge" in out and '{"amount":9}' in out
    assert out.splitlines()[-1].split()[:2] == ["approval", "approval"]  # pending: step name, type


def test_status_json_has_output_and_steps_of_a_finished_instance():
    wf("start", SIMPLE, "--id", "s")
    testing.run_until_idle()
    data = wf_json("status", "s", "--workflow", SIMPLE)
    assert data["status"] == "complete" and data["output"] == {"sum": 3}
    assert [(s["name"], s["status"], s["output"]) for s in data["steps"]] == [
        ("one", "complete", 1),
        ("two", "complete", 2),
    ]


def test_human_output_shows_control_characters_of_user_data_escaped():
    """An error message is user data: raw, its escape sequences would drive the operator's
    terminal (clear the screen, retitle the window, hide what follows)."""
    hostile = "\x1b[2J\x1b]0;owned\x07 card \x9b31m declined"

    @register("surface-hostile")
    class Hostile(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            def charge() -> None:
                raise NonRetryableError(hostile, name="Declined")

            await step.do("charge", charge)

    get_workflow("surface-hostile").create(id="h")
    testing.run_until_idle()
    for verb in (("status", "h"), ("list",), ("history", "h"), ("watch", "h")):
        out = wf(*verb)
        assert "Declined" in out, verb
        assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", out), (verb, out)
    assert "\\x1b[2J\\x1b]0;owned\\x07 card \\x9b31m declined" in wf("status", "h")
    assert wf_json("status", "h")["error"]["message"] == hostile  # --json: exact, escaped by JSON


# Bidi controls (U+202E RIGHT-TO-LEFT OVERRIDE reverses what follows it on a terminal that
# does bidi), DEL, C1 (U+009B is CSI to a terminal that takes 8-bit controls), NEL and the
# line separator: json.dumps(ensure_ascii=False) writes all of them raw.
TERMINAL_UNSAFE = re.compile(
    r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]"
)


def odd_text_instance() -> dict[str, Any]:
    """An errored instance whose step name, error name and message, params, output and
    attribute hold newlines that would forge a line, bidi overrides and C1 controls."""
    forged = "x\nfinished: complete\u202e enilno"

    @register("surface-odd-text")
    class OddText(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            await step.do("na\u202eme\nsecond", lambda: {"v": "o\u202ek\x9b2J\x7f\u2028"})

            def charge() -> None:
                raise NonRetryableError(forged, name="Dec\nlined")

            await step.do("charge", charge)

    get_workflow("surface-odd-text").create(
        id="odd", params={"p": "a\u202eb\x85c"}, attributes={"k": "v\u2066"}
    )
    testing.run_until_idle()
    return {"forged": forged}


def test_human_output_keeps_user_text_on_its_line_and_shows_bidi_controls_escaped():
    """A newline in an error message printed a line of its own ("finished: complete"
    after the real "finished: errored"), and U+202E reversed the rest of the line on a
    bidi terminal: an operator read what the data chose."""
    odd_text_instance()
    for verb in (("status", "odd"), ("list",), ("history", "odd"), ("watch", "odd")):
        out = wf(*verb)
        assert not TERMINAL_UNSAFE.search(out), (verb, out)
        assert not any(
            line.startswith(("finished: complete", "second")) for line in out.splitlines()
        )
    status = wf("status", "odd")
    assert "error:    Dec\\nlined: x\\nfinished: complete\\u202e enilno" in status.splitlines()
    assert 'params:   {"p":"a\\u202eb\\u0085c"}' in status.splitlines()
    assert "na\\u202eme\\nsecond" in status
    finished = wf("watch", "odd").splitlines()[-1]
    assert finished == "finished: errored  error Dec\\nlined: x\\nfinished: complete\\u202e enilno"


def test_json_output_writes_terminal_controls_as_json_escapes_of_the_same_text():
    """--json kept DEL, C1, bidi controls and U+2028 raw (JSON allows them): `wf status
    --json` on a terminal let stored text act on it. Now they are \\uNNNN escapes, which
    parse to the very same strings; other non-ASCII text stays readable."""
    odd = odd_text_instance()
    for verb in (("status", "odd"), ("list",), ("history", "odd"), ("watch", "odd")):
        out = wf(*verb, "--json")
        assert not TERMINAL_UNSAFE.search(out), (verb, out)
    data = wf_json("status", "odd")
    assert data["params"] == {"p": "a\u202eb\x85c"} and data["attributes"] == {"k": "v\u2066"}
    assert data["error"] == {"name": "Dec\nlined", "message": odd["forged"]}
    assert data["steps"][0]["output"] == {"v": "o\u202ek\x9b2J\x7f\u2028"}
    lines = [json.loads(line) for line in wf("watch", "odd", "--json").splitlines()]
    assert lines[-1]["finished"]["error"]["message"] == odd["forged"]
    wf("start", SIMPLE, "--params", '{"n": "é"}', "--id", "e-acute")
    assert '"n": "é"' in wf("status", "e-acute", "--json")  # other text stays readable


def test_a_refusal_quoting_text_shows_its_controls_escaped(tmp_path: Path):
    """Django writes a CommandError to stderr as it is: a refusal quoting a path (or a
    stored name) with an escape sequence in it retitled the operator's window."""
    path = tmp_path / "p\x1b]0;owned\x07\u202e.json"
    message = refused("start", SIMPLE, "--params", f"@{path}")
    assert not TERMINAL_UNSAFE.search(message), message
    assert message.startswith("--params: cannot read ")
    assert message.endswith("/p\\x1b]0;owned\\x07\\u202e.json: No such file or directory")


def test_status_of_an_unknown_instance_names_it():
    assert refused("status", "ghost") == "no instance 'ghost' in any workflow"
    assert (
        refused("status", "ghost", "--workflow", SIMPLE)
        == f"workflow '{SIMPLE}' has no instance 'ghost'"
    )


def test_an_id_used_by_two_workflows_needs_the_workflow_flag():
    wf("start", SIMPLE, "--id", "twin")
    wf("start", OTHER, "--id", "twin")
    message = refused("status", "twin")
    assert "exists in several workflows" in message and "--workflow" in message
    assert wf_json("status", "twin", "--workflow", OTHER)["workflow"] == OTHER


def test_history_lists_the_records_in_order():
    wf("start", SIMPLE, "--id", "h")
    testing.run_until_idle()
    entries = wf_json("history", "h")
    assert [e["sequence"] for e in entries] == list(range(1, len(entries) + 1))
    assert entries[0]["type"] == "instance.created" and entries[0]["actor"] == "cli"
    assert entries[-1]["type"] == "instance.completed"
    assert "instance.completed" in wf("history", "h")


def thirty_steps(instance_id: str) -> None:
    """A finished instance of 30 steps (one0 … one29) and their history records."""

    @register("surface-thirty")
    class Thirty(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            for i in range(30):
                await step.do(f"one{i}", lambda i=i: i)
            return 30

    get_workflow("surface-thirty").create(id=instance_id)
    testing.run_until_idle()


def test_status_shows_the_newest_steps_and_how_many_more_there_are():
    """It printed every step: 2.75 MB and 3.9 s for an instance with 50,000 of them."""
    thirty_steps("big")
    out = wf("status", "big", "--steps", "5")
    assert [n for n in (f"one{i}" for i in range(30)) if re.search(rf"^{n}\s", out, re.M)] == [
        f"one{i}" for i in range(25, 30)
    ]
    assert out.splitlines()[-1] == (
        "25 earlier step(s) not shown: --steps N shows the newest N (at most 1000); "
        "`wf history big` pages through what every step did"
    )
    data = wf_json("status", "big", "--steps", "5")  # the same shape, and how many there are
    assert [s["name"] for s in data["steps"]] == [f"one{i}" for i in range(25, 30)]
    assert data["steps_total"] == 30
    assert "not shown" not in wf("status", "big")  # 50 by default: all 30
    assert wf_json("status", "big")["steps_total"] == 30
    assert wf_json("status", "big", "--steps", "0")["steps"] == []
    for bad in ("-1", "1001"):
        assert (
            refused("status", "big", "--steps", bad) == f"--steps must be from 0 to 1000, got {bad}"
        )


def test_history_prints_a_page_and_where_the_next_one_starts():
    """It printed every record: 10 MB and 7.4 s for an instance with 50,000 steps."""
    thirty_steps("big")
    total = len(wf_json("history", "big"))
    assert total > 30
    out = wf("history", "big", "--limit", "10")
    assert [int(line.split()[0]) for line in out.splitlines()[1:-1]] == list(range(1, 11))
    assert out.splitlines()[-1] == "more: --after 10"
    out = wf("history", "big", "--limit", "10", "--after", "10")
    assert [int(line.split()[0]) for line in out.splitlines()[1:-1]] == list(range(11, 21))
    assert "more:" not in wf("history", "big", "--after", str(total - 5))
    # --json stays a list of records; the hint goes to stderr
    err = StringIO()
    out = StringIO()
    call_command("wf", "history", "big", "--json", "--limit", "7", stdout=out, stderr=err)
    assert [e["sequence"] for e in json.loads(out.getvalue())] == list(range(1, 8))
    assert err.getvalue().strip() == "more: --after 7"
    for args, message in (
        (("--limit", "0"), "--limit must be from 1 to 1000, got 0"),
        (("--limit", "1001"), "--limit must be from 1 to 1000, got 1001"),
        (("--after", "-3"), "--after must be a history sequence, 0 or more, got -3"),
    ):
        assert refused("history", "big", *args) == message


def test_history_prints_at_most_1000_records_by_default(monkeypatch):
    thirty_steps("big")
    monkeypatch.setattr("workflows_app.management.commands.wf.PAGE_MAX", 12)
    out = wf("history", "big")
    assert len(out.splitlines()) == 1 + 12 + 1 and out.splitlines()[-1] == "more: --after 12"


# --- events and actions ---------------------------------------------------------------


def test_send_event_delivers_the_payload_and_the_instance_goes_on():
    waiting_approval("o-1")
    assert wf("send-event", "o-1", "approval", "--payload", '{"ok": true}').strip() == (
        f"sent 'approval' to {APPROVAL}/o-1"
    )
    testing.run_until_idle()
    assert wf_json("status", "o-1")["steps"][1]["status"] == "complete"


def test_send_event_refuses_an_invalid_type_a_bad_payload_and_bad_json():
    waiting_approval("o-1")
    assert "invalid event type 'no spaces'" in refused("send-event", "o-1", "no spaces")
    assert "does not match the schema" in refused(
        "send-event", "o-1", "approval", "--payload", '{"ok": "yes"}'
    )
    assert "--payload is not valid JSON" in refused(
        "send-event", "o-1", "approval", "--payload", "{"
    )
    assert "no instance 'o-2'" in refused("send-event", "o-2", "approval")


def test_pause_then_resume_reports_the_new_status():
    waiting_approval("o-1")
    assert wf("pause", "o-1").strip() == f"pause: {APPROVAL}/o-1 is now paused"
    assert "cannot pause" in refused("pause", "o-1")
    assert wf_json("resume", "o-1") == {"id": "o-1", "workflow": APPROVAL, "status": "running"}
    history = [e["type"] for e in wf_json("history", "o-1")]
    assert history[-2:] == ["instance.paused", "instance.resumed"]


def test_terminate_stops_an_instance_and_refuses_a_finished_one():
    waiting_approval("o-1")
    assert wf_json("terminate", "o-1")["status"] == "terminated"
    assert refused("terminate", "o-1") == "instance 'o-1' had already finished (terminated)"


def test_restart_from_a_step_drops_it_and_later_checkpoints():
    handle = waiting_approval("o-1")
    wf("restart", "o-1", "--from-step", "approval")
    assert [s.name for s in handle.steps()] == ["charge"]
    assert "has no step named 'nope'" in refused("restart", "o-1", "--from-step", "nope")


def test_skip_sleep_wakes_the_sleeping_instance():
    with testing.fake_clock():
        handle = waiting_approval("o-1")
        assert "is not sleeping" in refused("skip-sleep", "o-1")
        handle.send_event("approval", {"ok": True})
        testing.run_until_idle()
        wf("skip-sleep", "o-1")
        testing.run_until_idle()
    assert handle.status().status == "complete"


def test_cancel_compensates_completed_steps_unless_told_not_to():
    waiting_approval("o-1", amount=3)
    assert wf_json("cancel", "o-1")["status"] == "compensating"
    testing.run_until_idle()
    assert wf_json("status", "o-1")["status"] == "terminated"
    assert COMPENSATIONS == [{"amount": 3}]
    waiting_approval("o-2")
    assert wf_json("cancel", "o-2", "--no-compensate")["status"] == "terminated"
    assert COMPENSATIONS == [{"amount": 3}]
    assert "already terminated" in refused("cancel", "o-2")


def test_prune_deletes_finished_instances_past_their_retention():
    with testing.fake_clock() as clock:
        get_workflow(SIMPLE).create(id="old", retention="1 hour")
        get_workflow(SIMPLE).create(id="kept")
        testing.run_until_idle()
        assert wf("prune").strip() == "pruned 0 finished instance(s) past their retention"
        clock.advance("2 hours")
        assert wf_json("prune") == {"pruned": 1}
    assert list(Instance.objects.values_list("instance_id", flat=True)) == ["kept"]


# --- tokens ---------------------------------------------------------------------------


def test_token_create_prints_the_token_once_and_stores_only_its_hash():
    out = wf("token", "create", "ci")
    raw = out.splitlines()[0]
    token = ApiToken.objects.get(name="ci")
    assert raw.startswith("wf_") and token.token_hash == hashlib.sha256(raw.encode()).hexdigest()
    assert raw not in {token.token_hash, token.prefix} and raw.startswith(token.prefix)
    assert token.user is None
    assert raw not in wf("token", "list")


def test_token_create_for_a_user_and_its_refusals():
    User.objects.create_user("ops")
    assert wf_json("token", "create", "ops-token", "--user", "ops")["user"] == "ops"
    assert ApiToken.objects.get(name="ops-token").user.username == "ops"
    assert refused("token", "create", "x", "--user", "nobody") == "no user named 'nobody'"
    assert refused("token", "create", "ops-token") == "a token named 'ops-token' already exists"
    assert refused("token", "create") == "wf token create needs a token name"


def test_token_create_takes_a_scope_workflows_and_an_expiry():
    made = wf_json(
        "token",
        "create",
        "reader",
        "--scope",
        "read",
        "--workflow",
        SIMPLE,
        "--workflow",
        "order-approval",
        "--expires",
        "30d",
    )
    token = ApiToken.objects.get(name="reader")
    assert (token.scope, token.workflow_names) == ("read", ["order-approval", SIMPLE])
    assert 29.9 < (token.expires_at - token.created_at).total_seconds() / 86400 <= 30
    assert made["scope"] == "read" and made["expires_at"] is not None
    assert wf_json("token", "list")[0]["workflows"] == ["order-approval", SIMPLE]
    assert "expiry" in refused("token", "create", "x", "--expires", "soon")
    assert "expiry must be more than 0" in refused("token", "create", "x", "--expires", "0s")


def test_token_rotate_prints_a_new_secret_and_the_old_one_stops_working():
    old = wf("token", "create", "ci", "--scope", "read").splitlines()[0]
    new = wf("token", "rotate", "ci").splitlines()[0]
    assert new.startswith("wf_") and new != old
    assert tokens.authenticate(old) is None and tokens.authenticate(new).scope == "read"
    wf("token", "revoke", "ci")
    assert "revoked" in refused("token", "rotate", "ci")


def test_token_revoke_marks_the_token_revoked():
    wf("token", "create", "ci")
    assert wf("token", "revoke", "ci").strip() == "revoked token 'ci'"
    assert ApiToken.objects.get(name="ci").revoked_at is not None
    assert wf_json("token", "list")[0]["revoked_at"] is not None
    assert refused("token", "revoke", "nope") == "no token named 'nope'"


# --- watch / demo / bench ---------------------------------------------------------------


def test_watch_with_the_engine_prints_each_step_and_ends_when_the_instance_finishes():
    wf("start", SIMPLE, "--id", "w")
    lines = wf("watch", "w", "--run-engine").splitlines()
    assert any("instance.created" in line for line in lines)
    assert any("step 'one' (do) complete" in line for line in lines)
    assert lines[-1] == 'finished: complete  output {"sum":3}'


def test_watch_json_prints_one_json_object_per_line():
    wf("start", SIMPLE, "--id", "w")
    records = [json.loads(line) for line in wf("watch", "w", "--run-engine", "--json").splitlines()]
    assert records[-1] == {"finished": {"status": "complete", "output": {"sum": 3}, "error": None}}
    assert [r["history"]["sequence"] for r in records if "history" in r] == list(
        range(1, 1 + sum("history" in r for r in records))
    )


def test_watch_gives_up_after_its_timeout():
    waiting_approval("o-1")
    assert (
        refused("watch", "o-1", "--timeout", "0") == "instance 'o-1' is still waiting after 0.0 s"
    )


def test_watch_refuses_a_timeout_that_is_not_a_number_of_seconds():
    """--timeout nan never gave up (nan compares false with the deadline)."""
    waiting_approval("o-1")
    for value in ("-5", "nan", "inf"):
        assert refused("watch", "o-1", "--timeout", value) == (
            f"--timeout must be a number of seconds, 0 or more, got {float(value)}"
        )


def test_demo_creates_instances_and_a_superuser_once():
    out = wf("demo", "--superuser", "admin:secret")
    assert "created superuser 'admin'" in out
    user = User.objects.get(username="admin")
    assert user.is_superuser and user.is_staff and user.check_password("secret")
    assert (
        Instance.objects.filter(
            workflow__in=["order-approval", "data-pipeline", "trial-reminder"]
        ).count()
        == 5
    )
    assert "exists; left unchanged" in wf("demo", "--superuser", "admin:other")
    user.refresh_from_db()
    assert user.check_password("secret")


def test_demo_refuses_a_malformed_superuser():
    assert (
        refused("demo", "--superuser", "admin")
        == "--superuser must be USER:PASSWORD, e.g. admin:admin"
    )


def test_bench_without_a_bench_package_fails_in_one_line(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert refused("bench").startswith("no bench package here")


def test_bench_runs_python_dash_m_bench_with_its_arguments(monkeypatch):
    calls: list[list[str]] = []
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    monkeypatch.setattr("subprocess.call", lambda argv, cwd=None: calls.append(argv) or 0)
    wf("bench", "--", "--quick", "10")
    assert calls[0][1:] == ["-m", "bench", "--quick", "10"]


def test_start_and_list_by_search_attributes():
    wf("start", SIMPLE, "--id", "a", "--attr", "customer=c-9", "--attr", "seats=5")
    wf("start", SIMPLE, "--id", "b", "--attr", "customer=c-9", "--attr", 'seats="5"')
    wf("start", SIMPLE, "--id", "c", "--attr", "customer=c-1")
    found = wf_json("list", "--workflow", SIMPLE, "--attr", "customer=c-9")["instances"]
    assert [i["id"] for i in found] == ["b", "a"]
    assert found[1]["attributes"] == {"customer": "c-9", "seats": 5}
    typed = wf_json("list", "--attr", "customer=c-9", "--attr", "seats=5")["instances"]
    assert [i["id"] for i in typed] == ["a"]
    assert "c-9" not in wf("list", "--attr", "customer=c-1")
    assert "expected KEY=VALUE" in refused("list", "--attr", "customer")
    assert "invalid attribute key 'a b'" in refused("list", "--attr", "a b=1")
    # A key twice is refused, as the API refuses it: the last value won, so a bulk
    # terminate --attr seats=5 --attr seats=6 ended every instance with 6 seats.
    twice = ("--attr", "seats=5", "--attr", "seats=6")
    assert "--attr 'seats' is given more than once" in refused("list", *twice)
    assert "more than once" in refused("bulk", "terminate", "-w", SIMPLE, *twice)
    assert "more than once" in refused("start", SIMPLE, "--id", "d", *twice)


def test_delete_removes_a_finished_instance_and_refuses_a_live_one():
    get_workflow(SIMPLE).create(id="done")
    testing.run_until_idle()
    waiting_approval("live")
    assert wf("delete", "done").strip() == f"deleted {SIMPLE}/done"
    assert "only finished" in refused("delete", "live")
    assert list(Instance.objects.values_list("instance_id", flat=True)) == ["live"]


def test_bulk_applies_an_action_to_what_a_filter_matches_and_reports_it():
    for n in range(3):
        waiting_approval(f"o-{n}")
    get_workflow(APPROVAL).create(id="vip", attributes={"tier": "gold"})
    testing.run_until_idle()
    result = wf_json("bulk", "terminate", "-w", APPROVAL, "--attr", "tier=gold")
    assert (result["matched"], result["applied"], result["done"]) == (1, 1, True)
    text = wf(
        "bulk",
        "send_event",
        "-w",
        APPROVAL,
        "--status",
        "waiting",
        "--type",
        "approval",
        "--payload",
        '{"ok": true}',
    )
    assert "matched 3, applied 3, skipped 0, failed 0" in text
    testing.run_until_idle()
    for n in range(3):  # each consumed its approval (and now sleeps its cool-off)
        steps = get_workflow(APPROVAL).get(f"o-{n}").steps()
        assert [s.status for s in steps if s.name == "approval"] == ["complete"]
    started = wf_json("bulk", "delete", "-w", APPROVAL, "--background")
    assert (started["matched"], started["done"]) == (4, False)
    testing.run_until_idle()  # workers apply it: the live ones are skipped
    assert sorted(Instance.objects.values_list("instance_id", flat=True)) == ["o-0", "o-1", "o-2"]


def test_bulk_exits_non_zero_when_some_instances_failed_after_reporting_them():
    waiting_approval("o-0")
    waiting_approval("o-1")
    out = StringIO()
    with pytest.raises(CommandError) as excinfo:  # manage.py exits with status 1
        call_command(
            "wf",
            *("bulk", "send_event", "-w", APPROVAL, "--type", "approval"),
            *("--payload", '{"ok": "yes"}'),  # fails the waiting step's schema
            stdout=out,
            stderr=StringIO(),
        )
    assert "matched 2, applied 0, skipped 0, failed 2" in out.getvalue()
    assert "does not match the schema" in out.getvalue()
    assert re.fullmatch(r"bulk send_event #\d+: 2 of 2 instances failed", str(excinfo.value))
    # Nothing failed: exit 0, whatever was skipped.
    assert "applied 0, skipped 2, failed 0" in wf("bulk", "resume", "-w", APPROVAL)


def test_bulk_refuses_bad_input_before_starting_anything():
    from workflows_app.models import BulkJob

    assert "--created-before must be an ISO" in refused(
        "bulk", "pause", "-w", APPROVAL, "--created-before", "yesterday"
    )
    assert "needs event_type" in refused("bulk", "send_event", "-w", APPROVAL)
    assert "unknown status" in refused("bulk", "pause", "-w", APPROVAL, "--status", "sleepy")
    assert not BulkJob.objects.exists()


class BatchRollbacks:
    """A real trigger that makes the database refuse recording a bulk batch's progress, as a
    deadlock, serialization failure or lock timeout would: the batch's transaction rolls
    back whole. PostgreSQL: the first `fails` batches only (a sequence, which no rollback
    undoes); SQLite: every one."""

    def __init__(self, fails: int | None = None) -> None:
        from django.db import connection

        from workflows_app.models import BulkJob

        self.connection, self.table = connection, BulkJob._meta.db_table
        self.fails = fails

    def __enter__(self) -> BatchRollbacks:
        with self.connection.cursor() as cursor:
            if self.connection.vendor == "sqlite":
                assert self.fails is None, "SQLite has nothing a rollback leaves counted"
                cursor.execute(
                    f"CREATE TRIGGER test_batch_rollback BEFORE UPDATE ON {self.table} "
                    "WHEN NEW.processed > 0 BEGIN SELECT RAISE(ABORT, 'database is locked'); END"
                )
                return self
            limit = "true" if self.fails is None else f"nextval('test_batch_tries') <= {self.fails}"
            cursor.execute("CREATE SEQUENCE test_batch_tries")
            cursor.execute(
                "CREATE FUNCTION test_batch_rollback() RETURNS trigger LANGUAGE plpgsql AS $$ "
                f"BEGIN IF NEW.processed > 0 AND {limit} THEN RAISE EXCEPTION "
                "'could not serialize access due to concurrent update' USING ERRCODE = '40001', "
                "DETAIL = 'a second line'; END IF; RETURN NEW; END $$"
            )
            cursor.execute(
                f"CREATE TRIGGER test_batch_rollback BEFORE UPDATE ON {self.table} "
                "FOR EACH ROW EXECUTE FUNCTION test_batch_rollback()"
            )
        return self

    def __exit__(self, *exc: Any) -> None:
        with self.connection.cursor() as cursor:
            if self.connection.vendor == "sqlite":
                cursor.execute("DROP TRIGGER test_batch_rollback")
                return
            cursor.execute(f"DROP TRIGGER test_batch_rollback ON {self.table}")
            cursor.execute("DROP FUNCTION test_batch_rollback()")
            cursor.execute("DROP SEQUENCE test_batch_tries")


def test_bulk_whose_batches_the_database_rolls_back_ends_in_one_line_keeping_the_job(
    monkeypatch,
):
    """A batch the database rolled back (the job itself is safe) ended `wf bulk` in a
    traceback. It is tried again; if the database keeps refusing, one line says so and
    the command exits non-zero, the job kept for the workers."""
    from workflows_app.management.commands import wf as wf_command
    from workflows_app.models import BulkJob

    monkeypatch.setattr(wf_command, "POLL_SECONDS", 0)
    waiting_approval("o-0")
    waiting_approval("o-1")
    with BatchRollbacks(), pytest.raises(CommandError) as excinfo:
        wf("bulk", "pause", "-w", APPROVAL)
    message = str(excinfo.value)
    assert "\n" not in message
    assert re.fullmatch(
        r"bulk pause #\d+: the database rolled a batch back 3 times \(.+\); 0 of 2 instances "
        r"done, the job is kept and workers finish it",
        message,
    ), message
    job = BulkJob.objects.get()
    assert (job.processed, job.finished_at) == (0, None)
    assert {i.status for i in Instance.objects.all()} == {"waiting"}
    testing.run_until_idle()  # a worker takes the job up
    job.refresh_from_db()
    assert (job.applied, job.finished_at is not None) == (2, True)
    assert {i.status for i in Instance.objects.all()} == {"paused"}


def test_bulk_takes_a_batch_the_database_rolled_back_again(monkeypatch):
    from django.db import connection

    from workflows_app.management.commands import wf as wf_command

    if connection.vendor != "postgresql":
        pytest.skip("a batch failing only once needs a sequence (PostgreSQL)")
    monkeypatch.setattr(wf_command, "POLL_SECONDS", 0)
    waiting_approval("o-0")
    with BatchRollbacks(fails=2):
        text = wf("bulk", "pause", "-w", APPROVAL)
    assert "matched 1, applied 1, skipped 0, failed 0" in text
    assert Instance.objects.get().status == "paused"


def test_a_reader_that_goes_away_ends_the_output_quietly():
    """`wf watch --json | head -1`: head's exit left a BrokenPipeError traceback on stderr
    at watch's next line."""
    from tests.workers import ROOT, database_url

    inst = waiting_approval("piped")
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "wfdash.settings",
        "DATABASE_URL": database_url(),
        "REDIS_URL": "",
        "WFDASH_DEMO": "0",
        "WFDASH_POLL_SECONDS": "0.2",
    }
    # As `manage.py wf watch`, with the test's workflows registered for its engine.
    command = (
        "import django; django.setup(); "
        "from tests.surface_flows import register_flows; register_flows(); "
        "from django.core.management import call_command; "
        "call_command('wf', 'watch', 'piped', '--json', '--run-engine', '--timeout', '60')"
    )
    watch = subprocess.Popen(
        [sys.executable, "-c", command],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert watch.stdout is not None and watch.stderr is not None
    assert json.loads(watch.stdout.readline())["history"]["type"] == "instance.created"
    watch.stdout.close()  # the reader goes; the event makes watch write again
    inst.send_event("approval", {"ok": True})
    stderr = watch.stderr.read()
    watch.stderr.close()
    assert watch.wait(60) == 1
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr


@pytest.mark.parametrize("server", ["refusing", "silent"])
def test_a_command_on_an_unreachable_database_fails_within_seconds_naming_where(server):
    """psycopg's pool waits its whole timeout (30 s, meant for a busy pool) for a
    connection it cannot make: `wf list` on a wrong DATABASE_URL answered after a minute
    (once more for the migrations check). A silent server (a blackholed address) is a
    socket that takes the connection and never answers."""
    import os
    import socket
    import subprocess
    import sys
    import time

    def run_wf(url: str, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "manage.py", "wf", *(args or ["list"])],
            cwd=Path(__file__).resolve().parent.parent,
            env={**os.environ, "DATABASE_URL": url},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        return result, time.monotonic() - started

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        url = f"postgres://wf:s3cret-pw@127.0.0.1:{port}/orders"
        # What starting Python, Django and the command takes on this machine now (a busy
        # CI runner's several seconds are not the database's): --help asks no database.
        _, start_up = run_wf(url, "--help")
        if server == "silent":
            listener.listen(8)  # the kernel completes the handshake; nobody ever speaks
        else:
            listener.close()  # nothing listens: connections are refused
        result, took = run_wf(url)
    assert result.returncode == 1, result.stderr
    assert took - start_up < 10, f"{took:.1f} s ({start_up:.1f} s to start): {result.stderr}"
    assert f"cannot connect to the database (DATABASE_URL) at 127.0.0.1:{port}/orders" in (
        result.stderr
    ), result.stderr
    assert "s3cret-pw" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
