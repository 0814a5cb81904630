"""Worker subprocesses (`manage.py runworker workflows`) and their resident memory."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BOOT = (
    "import django; django.setup(); import bench.workflows; "
    "from django.core.management import call_command; call_command('runworker', 'workflows')"
)


def rss_mb(pid: int) -> float:
    """VmRSS of a process, from /proc (no dependency)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class WorkerProcess:
    def __init__(self, **env: str) -> None:
        full_env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "wfdash.settings",
            "WFDASH_DEMO": "0",
            "PYTHONUNBUFFERED": "1",
            "WFDASH_LOG_LEVEL": "INFO",  # wait_ready() reads the engine's "running" line
            **env,
        }
        self.log = tempfile.NamedTemporaryFile(
            mode="w+", prefix="bench-worker-", suffix=".log", delete=False
        )
        self.process = subprocess.Popen(
            [sys.executable, "-c", BOOT],
            cwd=ROOT,
            env=full_env,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            text=True,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return Path(self.log.name).read_text()

    def wait_ready(self, timeout: float = 60) -> None:
        """Until the engine logged that it runs (after migrations check, catalog sync)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if re.search(r"wfdash worker \S+ running", self.output()):
                return
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"worker exited with {self.process.returncode}:\n{self.output()[-3000:]}"
                )
            time.sleep(0.05)
        raise RuntimeError(f"worker not ready after {timeout} s:\n{self.output()[-3000:]}")

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        stop_process(self.process, self.log)

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_process(process: subprocess.Popen[bytes], log: Any) -> None:
    """SIGTERM (idempotent: stop_all() may have sent it), then kill after 20 s; drop the log."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    log.close()
    os.unlink(log.name)


def stop_all(procs: list[WorkerProcess]) -> None:
    """SIGTERM every worker first, then wait for each (they shut down in parallel)."""
    for proc in procs:
        if proc.process.poll() is None:
            proc.process.send_signal(signal.SIGTERM)
    for proc in procs:
        proc.stop()
