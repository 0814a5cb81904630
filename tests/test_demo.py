"""The demo instances tell the README's stories, with ids a reader can say aloud."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path

import pytest

import workflows_app.demo  # noqa: F401  (registers the demo workflows when WFDASH_DEMO is off)
from workflows_app import testing
from workflows_app.client import get_workflow, schedules
from workflows_app.demo.workflows import create_demo_instances
from workflows_app.models import Instance

pytestmark = pytest.mark.django_db(transaction=True)

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def status(workflow: str, instance_id: str) -> str:
    return get_workflow(workflow).get(instance_id).status().status


def test_the_demo_has_one_instance_per_readme_story_with_readable_ids():
    with testing.fake_clock() as clock:
        created = create_demo_instances()
        assert created == [
            "order-1001",
            "import-2001",
            "import-2002",
            "trial-ada",
            "trial-grace",
            "nightly-3001",
        ]
        testing.run_until_idle()
        clock.advance("5 seconds")  # the flaky pipeline's two retries come due
        testing.run_until_idle()
        clock.advance("5 seconds")
        testing.run_until_idle()

        # "an order waiting for a manager's approval"
        assert "The demo has an order" in README
        order = get_workflow("order-approval").get("order-1001")
        assert order.status().status == "waiting"
        assert [p.type for p in order.pending_events()] == ["approval"]
        # "a flaky data pipeline that retries, one that fails for good"
        assert status("data-pipeline", "import-2001") == "complete"
        extract = next(
            s
            for s in get_workflow("data-pipeline").get("import-2001").steps()
            if s.name == "extract"
        )
        assert extract.attempts == 3
        assert status("data-pipeline", "import-2002") == "errored"
        # "trial reminders sleeping for an hour and for 14 days"
        assert re.search(r"sleeping for an hour and for 14 days", README)
        assert status("trial-reminder", "trial-ada") == "waiting"
        assert status("trial-reminder", "trial-grace") == "waiting"
        # "a nightly import that runs two pipelines as child workflows"
        assert "two pipelines as child workflows" in " ".join(README.split())
        nightly = get_workflow("nightly-import").get("nightly-3001")
        assert nightly.status().output == {"rows": 15, "reminder": "nightly-3001:remind-ops"}
        assert sorted((c.id, c.workflow) for c in nightly.children()) == [
            ("nightly-3001:import-eu", "data-pipeline"),  # started in parallel
            ("nightly-3001:import-us", "data-pipeline"),
            ("nightly-3001:remind-ops", "trial-reminder"),
        ]
        clock.advance("1 hour")
        testing.run_until_idle()
        assert status("trial-reminder", "trial-ada") == "complete"
        assert status("trial-reminder", "trial-grace") == "waiting"


def test_running_the_demo_again_creates_nothing_twice():
    first = create_demo_instances()
    assert create_demo_instances() == []
    assert len(first) == 6  # the schedule starts the digests, not the demo


def test_the_demo_schedule_starts_a_digest_every_five_minutes():
    with testing.fake_clock(datetime(2026, 6, 1, 12, 1, tzinfo=UTC)) as clock:
        create_demo_instances()
        [digest] = schedules.list(workflow="daily-digest")
        assert (digest.name, digest.cron) == ("digest-every-5-minutes", "*/5 * * * *")
        clock.advance("5 minutes")
        testing.run_until_idle()
    [row] = Instance.objects.filter(schedule="digest-every-5-minutes")
    assert row.output == {"tick": "2026-06-01T12:05:00+00:00", "region": "eu", "orders": 3}
