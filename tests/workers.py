"""Start real worker processes (`manage.py runworker workflows`) on the test database."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from django.db import connection

ROOT = Path(__file__).resolve().parent.parent
BOOT = (
    "import django; django.setup(); import tests.fleet_workflows; "
    "from django.core.management import call_command; call_command('runworker', 'workflows')"
)


def database_url() -> str:
    """A DATABASE_URL for the database this test process uses (the test database)."""
    s = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{s['NAME']}"
    user = s.get("USER") or ""
    auth = f"{user}@" if user else ""
    return f"postgres://{auth}{s.get('HOST') or '127.0.0.1'}:{s.get('PORT') or 5432}/{s['NAME']}"


class WorkerProcess:
    def __init__(self, env: dict[str, str] | None = None, **settings: Any) -> None:
        full_env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "wfdash.settings",
            "DATABASE_URL": database_url(),
            "WFDASH_DEMO": "0",
            "WFDASH_LEASE_SECONDS": "2",
            "WFDASH_POLL_SECONDS": "1",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.log = tempfile.TemporaryFile(mode="w+")  # not a pipe: a chatty worker never blocks
        self.process = subprocess.Popen(
            [sys.executable, "-c", BOOT], cwd=ROOT, env=full_env, stdout=subprocess.DEVNULL, stderr=self.log, text=True
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(10)

    def terminate(self, timeout: float = 20) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def stop(self) -> str:
        """Kill if still running; returns what the worker logged."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        self.log.seek(0)
        output = self.log.read()
        self.log.close()
        return output
