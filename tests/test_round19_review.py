"""Round 19 review: behaviour bugs found in this round's changes (real engine, real DB)."""

from __future__ import annotations

from typing import Any

import pytest

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register
from workflows_app.engine.errors import InvalidInput

pytestmark = pytest.mark.django_db(transaction=True)


def register_versions(name: str, *versions: int) -> None:
    for version in versions:

        @register(name, version=version)
        class Flow(WorkflowEntrypoint):
            async def run(self, event: Any, step: Any, version: int = version) -> Any:
                return await step.do("v", lambda: version)


def test_a_debounce_that_would_move_a_key_onto_a_version_that_has_it_is_refused_clearly(
    registered,
):
    """A debounce moves the pending instance to the version asked for, as restart(version=)
    does; its idempotency key may be another instance's on that version. Restart refuses
    that move with a clear InvalidInput; the debounce failed on the database's constraint
    and reported, after three tries, that the instance "already exists"."""
    name = "r19-debounce-key"
    register_versions(name, 1, 2)
    wf = get_workflow(name)
    with testing.fake_clock():
        pending = wf.create(
            id="pending", version=1, idempotency_key="k", debounce_key="d", debounce="1 minute"
        )
        wf.create(id="other", version=2, idempotency_key="k")
        with pytest.raises(InvalidInput, match="idempotency key"):
            wf.create(id="next", version=2, debounce_key="d", debounce="1 minute")
        row = pending.row()
        assert (row.version, row.idempotency_key) == (1, "k")
