"""Operating figures: SSE record latency and /metrics scrape time, against a real daphne.

The web server is a separate process (`daphne wfdash.asgi:application`, no embedded
worker), as in the fleet set-up: what it streams or serves was written by this process,
so a record reaches it through the database (PostgreSQL: NOTIFY; SQLite: its polling).
"""

from __future__ import annotations

import contextlib
import http.client
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from workflows_app import tokens
from workflows_app.client import get_workflow

from . import workflows  # noqa: F401  (registers the bench workflows)
from .procs import ROOT, stop_process

Figures = dict[str, Any]
WAITER = "bench-event"  # parked on wait_for_event: events buffer, history grows
STEPS = "bench-steps5"
ASGI_APP = "wfdash.asgi:application"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class WebServer:
    """daphne on a free loopback port, serving this bench's database."""

    def __init__(self) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.log = tempfile.NamedTemporaryFile(mode="w+", prefix="bench-daphne-", delete=False)
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "wfdash.settings",
            "WFDASH_EMBEDDED_WORKER": "0",
            "WFDASH_DEMO": "0",
        }
        self.process = subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port), ASGI_APP],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
        )

    def connection(self, timeout: float = 30) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"daphne exited:\n{Path(self.log.name).read_text()[-3000:]}")
            try:
                conn = self.connection(timeout=2)
                conn.request("GET", "/api/openapi.json")
                if conn.getresponse().status == 200:
                    conn.close()
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"daphne not ready after {timeout} s")

    def __enter__(self) -> WebServer:
        self.wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        stop_process(self.process, self.log)


def sse_latency(n: int) -> Figures:
    """n events sent one after the other to an instance streamed over SSE by daphne: from
    the send_event call (this process) to the `event.sent` record read from the stream.
    From the call, not from its return: the record can reach the stream before the call
    returns (its commit's NOTIFY wakes daphne at once), and timed from the return a slow
    return made the figure near zero (0.03 ms in one run)."""
    inst = get_workflow(WAITER).create(id=f"sse-{uuid.uuid4().hex[:6]}")
    _, secret = tokens.issue(f"bench-sse-{uuid.uuid4().hex[:6]}", scope="read")
    received: queue.Queue[float] = queue.Queue()
    with WebServer() as server:
        conn = server.connection()
        conn.request(
            "GET",
            f"/api/workflows/{WAITER}/instances/{inst.id}/subscribe",
            headers={"Authorization": f"Bearer {secret}"},
        )
        response = conn.getresponse()
        assert response.status == 200, response.read()[:500]

        def read_stream() -> None:
            try:
                for raw in response.fp:
                    line = raw.decode().rstrip("\n")
                    if line.startswith("data: ") and '"type":"event.sent"' in line:
                        received.put(time.time())
            except (ValueError, OSError):
                pass  # conn.close() below ended the stream under this read

        threading.Thread(target=read_stream, daemon=True).start()
        latencies = []
        for i in range(n):
            sent = time.time()
            inst.send_event("bench", {"i": i})
            latencies.append((received.get(timeout=30) - sent) * 1000)
        # Ends the reader's blocked read first: close() alone waits for the reader's lock on
        # the response, which it took back after each heartbeat (15 s apart) for minutes.
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
    return {
        "sse_latency_p50_ms": statistics.median(latencies),
        "sse_latency_p95_ms": _percentile(latencies, 0.95),
    }


def metrics_scrape(instances: int, scrapes: int) -> Figures:
    """GET /metrics (Prometheus text) from daphne with `instances` finished instances of
    several workflows in the database: time to the whole body, median and p95."""
    from .measures import _create, _prefix, run_until_idle

    prefix = _prefix("metrics")
    _create(STEPS, prefix, instances)
    run_until_idle()
    _, secret = tokens.issue(f"bench-metrics-{uuid.uuid4().hex[:6]}", scope="read")
    times = []
    size = 0
    with WebServer() as server:
        conn = server.connection()
        for _ in range(scrapes + 1):
            t0 = time.perf_counter()
            conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {secret}"})
            response = conn.getresponse()
            body = response.read()
            times.append((time.perf_counter() - t0) * 1000)
            assert response.status == 200, body[:500]
            size = len(body)
        conn.close()
    times = times[1:]  # the first pays for imports and connections
    return {
        "metrics_scrape_p50_ms": statistics.median(times),
        "metrics_scrape_p95_ms": _percentile(times, 0.95),
        "metrics_scrape_bytes": size,
        "metrics_scrape_instances": instances,
    }
