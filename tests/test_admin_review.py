"""Review of the admin's new actions and their neighbours (skip sleep, send event, restart
from a step, the add page; a typed wait's schema): faults found, each with its test."""

from __future__ import annotations

import pytest

from tests.surface_flows import register_flows
from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, errors, register

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def flows(registered: list[str]) -> None:
    register_flows()


# --- a typed wait's schema ------------------------------------------------------------


def test_a_wait_whose_dynamic_reference_does_not_resolve_is_refused_where_it_is_declared():
    """check_event_schema looked up each `$ref` but not `$dynamicRef` (2020-12), which
    resolves the same way at first: such a wait was declared, and an event buffered before
    it made the payload check raise jsonschema's private _WrappedReferencingError, under
    which name the instance errored."""

    @register("dynamic-ref")
    class DynamicRef(WorkflowEntrypoint):
        async def run(self, event, step):
            schema = event.payload["schema"]
            return (await step.wait_for_event("approval", type="go", schema=schema)).payload

    dangling = get_workflow("dynamic-ref").create(params={"schema": {"$dynamicRef": "#nope"}})
    dangling.send_event("go", {"n": 1})  # buffered: no wait yet
    testing.run_until_idle()
    status = dangling.status()
    assert (status.status, status.error["name"]) == ("errored", "InvalidInput"), status
    assert "'#nope'" in status.error["message"] and "does not resolve" in status.error["message"]
    # A dynamic reference to a dynamic anchor of the schema is fine.
    anchored = {"$defs": {"m": {"$dynamicAnchor": "m", "type": "object"}}, "$dynamicRef": "#m"}
    fine = get_workflow("dynamic-ref").create(params={"schema": anchored})
    testing.run_until_idle()
    assert fine.status().status == "waiting"
    with pytest.raises(errors.EventPayloadInvalid, match="does not match"):
        fine.send_event("go", 5)
    fine.send_event("go", {"ok": True})
    testing.run_until_idle()
    assert fine.status().output == {"ok": True}
