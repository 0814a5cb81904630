"""Instances that grow big over their life (a year-long loop of steps, sleeps and events):
what every surface shows of them stays bounded, and a step costs what it costs a small one."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from workflows_app import admin as admin_module
from workflows_app import testing
from workflows_app.client import InstanceHandle, get_workflow
from workflows_app.engine import WorkflowEntrypoint, register

pytestmark = pytest.mark.django_db(transaction=True)

LOOP = "big-loop"


@pytest.fixture(autouse=True)
def loop(registered: list[str]) -> None:
    @register(LOOP, limits={"max_steps_per_workflow": 10_000})
    class Loop(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            for i in range(event.payload["steps"]):
                await step.do(f"s{i}", lambda: {"ok": 1})
            await step.wait_for_event("ev", type="go", timeout="10 days")
            for i in range(event.payload.get("then", 0)):
                await step.do(f"t{i}", lambda: {"ok": 1})
            return "done"


def grown(steps: int, then: int = 0, instance_id: str = "big-1") -> InstanceHandle:
    """An instance parked on its event wait after `steps` completed steps."""
    handle = get_workflow(LOOP).create(id=instance_id, params={"steps": steps, "then": then})
    testing.run_until_idle()
    assert handle.status().status == "waiting", handle.status()
    return handle


@pytest.fixture
def admin_client() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("boss", password="pw"))
    return client


def cells(page: str, field: str) -> list[str]:
    return re.findall(rf'<td class="field-{field}">\s*<p>([^<]*)</p>', page)


# --- the admin's instance page -----------------------------------------------------------


def test_the_admin_instance_page_shows_the_newest_steps_and_history_and_links_to_all(
    admin_client, monkeypatch
):
    monkeypatch.setattr(admin_module, "INLINE_ROWS", 5, raising=False)
    row = grown(12).row()
    page = admin_client.get(reverse("admin:workflows_app_instance_change", args=[row.pk]))
    assert page.status_code == 200
    text = page.content.decode()
    # the newest five of 13 steps (12 + the wait), oldest first
    assert cells(text, "name") == ["s8", "s9", "s10", "s11", "ev"]
    assert cells(text, "sequence") == ["23", "24", "25", "26", "27"]  # of 27 history records
    steps = reverse("admin:workflows_app_steprecord_changelist") + f"?instance__id__exact={row.pk}"
    history = reverse("admin:workflows_app_historyrecord_changelist")
    assert f'Step records (the newest 5 of 13: <a href="{steps}">all step records</a>)' in text
    assert f'the newest 5 of 27: <a href="{history}?instance__id__exact={row.pk}">' in text
    everything = admin_client.get(steps)
    assert everything.status_code == 200 and "13 step records" in everything.content.decode()


def test_the_admin_instance_page_of_a_small_instance_shows_every_row(admin_client):
    row = grown(3).row()
    text = admin_client.get(reverse("admin:workflows_app_instance_change", args=[row.pk]))
    text = text.content.decode()
    assert cells(text, "name") == ["s0", "s1", "s2", "ev"]
    assert "the newest" not in text
