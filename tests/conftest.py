from __future__ import annotations

from collections.abc import Iterator

import pytest

from workflows_app import testing
from workflows_app.engine import clock, registry


def pytest_report_header(config: pytest.Config) -> str:
    from django.conf import settings

    return f"wfdash database: {settings.DATABASES['default']['ENGINE']}"


@pytest.fixture(autouse=True)
def _clean_engine() -> Iterator[None]:
    testing.reset()
    yield
    testing.reset()
    clock.set_clock(clock.RealClock())


@pytest.fixture
def registered() -> Iterator[list[str]]:
    """Names registered by a test are unregistered after it (the registry is process-wide)."""
    before = {d.name for d in registry.all_definitions()}
    names: list[str] = []
    yield names
    for definition in registry.all_definitions():
        if definition.name not in before:
            registry.unregister(definition.name)

