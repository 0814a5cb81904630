"""Search attributes and listing under odd values, found by a review (SPEC §9).

Each test failed before the fix its docstring names.
"""

from __future__ import annotations

import pytest

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register
from workflows_app.engine.attributes import MAX_ATTRIBUTES
from workflows_app.models import Instance, InstanceAttribute

pytestmark = pytest.mark.django_db(transaction=True)


def test_set_attributes_cannot_take_an_instance_past_the_key_limit(registered):
    """At most 32 attribute keys per instance (docs/operating.md); create checked it, but
    step.set_attributes checked only the keys it set, and merged them into those kept
    (store.merge_attributes): 32 at create plus 32 new ones made an instance of 64 keys
    (64 index rows). Now the merge counts kept plus set, and the step fails the instance
    at once (not retried: no retry can help) naming the limit; nothing is written. An
    upsert that only overwrites keys already there is still fine at the limit."""
    ran_after = []

    @register("attribute-key-limit")
    class AttributeKeyLimit(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.set_attributes("overwrite", {"k0": "new"})  # 32 keys still
            await step.set_attributes("one more", {"extra": 1})
            ran_after.append(1)

    full = {f"k{i}": i for i in range(MAX_ATTRIBUTES)}
    inst = get_workflow("attribute-key-limit").create(attributes=full)
    with testing.fake_clock():
        testing.run_until_idle(timeout=10)
    status = inst.status()
    assert status.status == "errored"
    assert status.error["name"] == "LimitExceeded"
    assert "max attributes is 32, got 33" in status.error["message"]
    assert ran_after == []
    (failed,) = [r for r in inst.steps() if r.name == "one more"]
    assert failed.attempts == 1
    row = Instance.objects.get(pk=inst.row().pk)
    assert row.attributes == {**full, "k0": "new"}
    assert InstanceAttribute.objects.filter(instance_id=row.pk).count() == MAX_ATTRIBUTES
    assert "extra" not in row.attributes


def test_a_debounced_create_gives_the_pending_instance_its_attributes_too(registered):
    """A create with a debounce_key that finds an instance not started yet hands it the
    new params and priority (store._debounce) and returns it: the newest call describes
    the instance. Its search attributes were dropped, though: the instance kept the
    first call's, so list(attributes=…) found it by attributes that no longer matched its
    params and never by the ones the latest create gave. Now the attributes (the JSON
    column and the rows filters read) are the newest create's, as the params are."""

    @register("debounced-attributes")
    class DebouncedAttributes(WorkflowEntrypoint):
        async def run(self, event, step):
            return event.payload

    wf = get_workflow("debounced-attributes")
    with testing.fake_clock():
        first = wf.create(
            params={"order": 1},
            debounce_key="cart-7",
            debounce="5 seconds",
            attributes={"customer": "c-1", "draft": True},
        )
        again = wf.create(
            params={"order": 2},
            debounce_key="cart-7",
            debounce="5 seconds",
            attributes={"customer": "c-2"},
        )
        assert again.id == first.id and again.created is False
        assert [i.id for i in wf.list(attributes={"customer": "c-2"}).instances] == [first.id]
        assert wf.list(attributes={"customer": "c-1"}).instances == []
        assert wf.list(attributes={"draft": True}).instances == []
        (info,) = wf.list().instances
        assert info.attributes == {"customer": "c-2"}
        row = Instance.objects.get(pk=first.row().pk)
        assert row.attributes == {"customer": "c-2"}
        assert list(
            InstanceAttribute.objects.filter(instance_id=row.pk).values_list("key", flat=True)
        ) == ["customer"]
