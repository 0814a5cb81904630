"""The engine run to idle in a thread of the test, while the test acts on its instances."""

from __future__ import annotations

import threading

from workflows_app import testing


def run_engine_in_background(timeout: float = 30) -> tuple[threading.Thread, dict[str, object]]:
    """testing.run_until_idle in a thread; its box gets "runs", or "error" if it raised."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["runs"] = testing.run_until_idle(timeout=timeout)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    return thread, box
