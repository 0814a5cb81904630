"""Start real worker processes (`manage.py runworker workflows`) on the test database."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

from django.db import connection

ROOT = Path(__file__).resolve().parent.parent
BOOT = (
    # SIGUSR1 dumps every thread's stack to the log: what a stuck worker was doing.
    "import faulthandler, signal; faulthandler.register(signal.SIGUSR1, all_threads=True); "
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


def answers_http(port: int) -> bool:
    """Whether a server on this local port answers an HTTP request (a page of the admin)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(b"GET /admin/login/ HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            return conn.recv(12).startswith(b"HTTP/1.1")
    except OSError:
        return False


def send_http_request(port: int) -> socket.socket | None:
    """An open connection to a server on this local port that has been sent an HTTP
    request, its answer not waited for (None while the port refuses): starts a server's
    embedded worker even when the worker, once started, holds the loop that would answer.
    The caller closes it."""
    try:
        conn = socket.create_connection(("127.0.0.1", port), timeout=5)
    except OSError:
        return None
    try:
        conn.sendall(b"GET /admin/login/ HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    except OSError:
        conn.close()
        return None
    return conn


class WorkerProcess:
    # The workers not yet stopped, for the failure message of a multi-process test.
    live: ClassVar[list[WorkerProcess]] = []

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
            [sys.executable, "-c", BOOT],
            cwd=ROOT,
            env=full_env,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            text=True,
        )

        WorkerProcess.live.append(self)

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(10)

    def terminate(self, timeout: float = 20) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def logged(self) -> str:
        """What the worker has logged so far."""
        self.log.seek(0)
        return self.log.read()

    def serving(self) -> bool:
        """It has started its engine (it claims from now on)."""
        return "running (concurrency" in self.logged()

    def describe(self) -> str:
        """One line: alive (and where its threads are) or its exit code, how many
        tracebacks it logged, its last line. For the failure message of a test."""
        self.log.seek(0, os.SEEK_END)
        before = self.log.tell()
        alive = self.process.poll() is None
        if alive:
            os.kill(self.pid, signal.SIGUSR1)
            time.sleep(0.5)  # failure path only: let faulthandler write the dump
        self.log.seek(0)
        text = self.log.read()
        logged, dump = text[:before], text[before:]
        lines = [line for line in logged.splitlines() if line.strip()]
        state = (
            f"alive, threads: {thread_summary(dump)}"
            if alive
            else f"exit {self.process.returncode}"
        )
        tracebacks = logged.count("Traceback (most recent call last)")
        last = lines[-1][:200] if lines else ""
        return f"worker {self.pid} {state}; {tracebacks} tracebacks, last line: {last!r}"

    def stop(self) -> str:
        """Kill if still running; returns what the worker logged."""
        if self in WorkerProcess.live:
            WorkerProcess.live.remove(self)
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        self.log.seek(0)
        output = self.log.read()
        self.log.close()
        return output


def thread_summary(dump: str) -> str:
    """A faulthandler dump folded to one line: per thread its innermost frame and the
    innermost frame of wfdash's own code, counted."""
    threads: list[list[str]] = []
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            threads.append([])
        elif line.startswith("  File") and threads:
            threads[-1].append(_short(line))
    counts: Counter[str] = Counter()
    for frames in threads:
        own = next((f for f in frames if f.startswith(OWN_CODE)), "")
        if frames:
            counts[frames[0] + (f" < {own}" if own and own != frames[0] else "")] += 1
    return "; ".join(f"{n}x {where}" for where, n in counts.most_common()) or "no dump"


OWN_CODE = ("workflows_app/", "tests/")


def _short(frame: str) -> str:
    """'  File "/x/workflows_app/engine/step.py", line 12 in do' -> 'workflows_app/engine/step.py:12 do'"""
    try:
        _, path, rest = frame.split('"', 2)
        line, func = rest.split("line ", 1)[1].split(" in ", 1)
    except ValueError:
        return frame.strip()
    relative = path.split(str(ROOT) + "/", 1)[-1] if path.startswith(str(ROOT)) else Path(path).name
    return f"{relative}:{line} {func}"
