"""restart(version=N): an instance runs on another registered version from its restart on.

A version's code cannot change under its number (the catalog refuses it), so the fix of a
version that fails is a new version: restarting a failed instance on its own version runs
the same failing code again. Real engine and database, run_until_idle.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from tests.dashboard.helpers import make_user
from tests.test_api import Api, error_of
from tests.test_wf_command import refused as cli_refused
from tests.test_wf_command import wf
from workflows_app import testing, tokens
from workflows_app.client import get_workflow
from workflows_app.engine import NonRetryableError, WorkflowEntrypoint, register
from workflows_app.engine.errors import InvalidInput

pytestmark = pytest.mark.django_db(transaction=True)

NAME = "rs-charge"
ran: list[str] = []


def register_broken_and_fixed() -> None:
    """Version 1 fails at its second step for good; version 2 is its fix."""

    @register(NAME, version=1)
    class Broken(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            await step.do("price", lambda: ran.append("price") or 40)

            def charge() -> Any:
                ran.append("charge v1")
                raise NonRetryableError("the card API changed")

            return await step.do("charge", charge)

    @register(NAME, version=2)
    class Fixed(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            total = await step.do("price", lambda: ran.append("price") or 40)
            charged = await step.do("charge", lambda: ran.append("charge v2") or total + 2)
            return {"charged": charged}


@pytest.fixture
def broken(registered: list[str]) -> Any:
    """An instance of version 1 that errored at "charge"."""
    ran.clear()
    register_broken_and_fixed()
    handle = get_workflow(NAME).create(id="o-1", version=1)
    testing.run_until_idle()
    assert handle.status().status == "errored"
    return handle


def state(handle: Any) -> tuple[Any, ...]:
    row = handle.row()
    return row.status, row.version, [(s.name, s.status) for s in handle.steps()]


def test_restarted_on_its_fix_it_runs_the_new_code_and_replays_the_kept_checkpoints(broken):
    broken.restart(from_step="charge", version=2, actor="ops")
    assert broken.row().version == 2
    testing.run_until_idle()
    assert broken.status().status == "complete"
    assert broken.status().output == {"charged": 42}
    assert ran == ["price", "charge v1", "charge v2"]  # "price" replayed, not run again
    restarted = [h for h in broken.history() if h.type == "instance.restarted"]
    assert restarted[-1].data["version"] == 2 and restarted[-1].data["from_version"] == 1
    assert restarted[-1].actor == "ops"


def test_restarted_without_a_version_it_runs_its_own_failing_code_again(broken):
    broken.restart()
    testing.run_until_idle()
    assert (broken.status().status, broken.row().version) == ("errored", 1)
    assert ran == ["price", "charge v1", "price", "charge v1"]
    assert "version" not in next(h for h in broken.history() if h.type == "instance.restarted").data


@pytest.mark.parametrize(
    ("version", "message"),
    [
        (9, f"workflow {NAME!r} has no registered version 9; registered: [1, 2]"),
        ("2", "version must be an integer from 1 to 2147483647, got '2'"),
        (True, "version must be an integer"),
        (0, "version must be an integer"),
    ],
)
def test_a_version_not_registered_or_not_a_version_is_refused_and_changes_nothing(
    broken, version, message
):
    before = state(broken)
    with pytest.raises(InvalidInput) as refused:
        broken.restart(version=version)
    assert message in str(refused.value)
    assert state(broken) == before


def test_a_move_that_would_give_two_instances_one_idempotency_key_is_refused(registered):
    register_broken_and_fixed()
    old = get_workflow(NAME).create(id="old", version=1, idempotency_key="order-7")
    testing.run_until_idle()
    get_workflow(NAME).create(id="new", version=2, idempotency_key="order-7")
    before = state(old)
    with pytest.raises(InvalidInput) as refused:
        old.restart(version=2)
    assert "idempotency key 'order-7' is already instance 'new''s on that version" in str(
        refused.value
    )
    assert state(old) == before


def test_the_api_restarts_on_a_version_and_refuses_one_elsewhere(broken):
    _, secret = tokens.issue("service")
    api = Api(Client(), secret)
    path = f"/api/workflows/{NAME}/instances/o-1/status"
    status, code, message = error_of(api.patch(path, {"status": "pause", "version": 2}))
    assert (status, code, message) == (400, "InvalidInput", "version is taken only with restart")
    status, code, message = error_of(api.patch(path, {"status": "restart", "version": 5}))
    assert (status, code) == (400, "InvalidInput") and "no registered version 5" in message
    assert state(broken)[:2] == ("errored", 1)
    answer = api.patch(path, {"status": "restart", "version": 2}).json()["result"]
    assert answer["status"] == "running"
    testing.run_until_idle()
    assert broken.status().output == {"charged": 42}


def test_a_bulk_restart_moves_every_match_to_the_version(broken):
    second = get_workflow(NAME).create(id="o-2", version=1)
    testing.run_until_idle()
    wf_handle = get_workflow(NAME)
    with pytest.raises(InvalidInput, match="bulk pause takes no to_version"):
        wf_handle.bulk("pause", to_version=2)
    with pytest.raises(InvalidInput, match="no registered version 3"):
        wf_handle.bulk("restart", to_version=3)
    job = wf_handle.bulk("restart", status="errored", version=1, to_version=2)
    testing.run_until_idle()
    assert job.refresh().applied == 2
    for handle in (broken, second):
        assert (handle.status().status, handle.row().version) == ("complete", 2)


def test_the_command_line_restarts_on_a_version(broken):
    out = wf("restart", "o-1", "--workflow", NAME, "--to-version", "2")
    assert f"restart on version 2: {NAME}/o-1 is now running" in out
    assert "no registered version 7" in cli_refused("restart", "o-1", "--to-version", "7")


def test_the_command_line_bulk_restart_moves_the_matches_to_a_version(broken):
    wf("bulk", "restart", "-w", NAME, "--status", "errored", "--version", "1", "--to-version", "2")
    testing.run_until_idle()
    assert (broken.status().status, broken.row().version) == ("complete", 2)


def test_the_dashboard_offers_the_other_versions_and_restarts_on_the_one_chosen(broken):
    client = Client()
    client.force_login(make_user("operator", "view_instance", "change_instance"))
    page = client.get(reverse("workflows:instance", args=[NAME, "o-1"])).content.decode()
    assert '<option value="2">version 2</option>' in page
    assert '<option value="1">' not in page  # its own is the default, not offered again
    action = reverse("workflows:action", args=[broken.row().pk, "restart"])
    response = client.post(action, {"from_step": "charge", "version": "2"}, follow=True)
    assert "Restarted from step “charge” on version 2." in response.content.decode()
    testing.run_until_idle()
    assert broken.status().output == {"charged": 42}


def test_a_key_taken_on_the_version_after_the_look_is_refused_clearly(registered, monkeypatch):
    """Two moves at once: each looks before the other commits. The second's update then
    met the unique key and raised a raw IntegrityError (a 500 in the API); it is refused
    as a clear InvalidInput, and the instance is left as it was."""
    from workflows_app.engine.store import control

    register_broken_and_fixed()
    old = get_workflow(NAME).create(id="old", version=1, idempotency_key="order-8")
    testing.run_until_idle()
    get_workflow(NAME).create(id="new", version=2, idempotency_key="order-8")
    monkeypatch.setattr(control, "_check_idempotency_key_free", lambda *args: None)
    before = state(old)
    with pytest.raises(InvalidInput, match="key 'order-8' was just taken on that version"):
        old.restart(version=2)
    assert state(old) == before
