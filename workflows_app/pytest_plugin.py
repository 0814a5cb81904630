"""pytest plugin installed with wfdash: forgets workflows_app.testing's mocks around every test.

Mocks, disabled sleeps and forced timeouts live in process memory and are keyed by instance
id, which a test may reuse (`create(id="order-1")`) after the database is flushed; without
this, one test's `testing.disable_sleeps()` would end every later test's sleeps.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest


def _forget_testing_overrides() -> None:
    # Only if something imported them: the plugin loads in every pytest run in the
    # environment, and must not set up Django for projects that never use wfdash.
    module = sys.modules.get("workflows_app.engine.overrides")
    if module is not None:
        module.overrides.clear()


@pytest.fixture(autouse=True)
def _wfdash_forget_testing_overrides() -> Iterator[None]:
    _forget_testing_overrides()
    yield
    _forget_testing_overrides()
