"""Dashboard fan-out: N list sockets (`/ws/instances/`) on a `runserver` subprocess (the
README's set-up: daphne with the embedded worker; Redis when REDIS_URL is set).

* latency: one status change every 0.5 s through the API (pause / resume of one parked
  instance): from the request to each socket's batch showing it; p50 / p95 over every
  (socket, change), and how many of those pairs never arrived within MISS_SECONDS;
* burst: creates through the API from 4 client processes; once every instance has parked
  in the database, each socket's view (snapshot + batches, resynced on a gap as the page
  does) must match the database within STALE_SECONDS: stale sockets are counted;
* create rate through the API with no socket open and with `rate_sockets` open.

The sockets run in this process (asyncio + websockets), which competes for the same
cores as the server: the figures include the clients' own parsing.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

from .procs import ROOT

WORKFLOW = "bench-parked"
CHANGE_EVERY_SECONDS = 0.5
MISS_SECONDS = 5.0
STALE_SECONDS = 5.0
CLIENT_PROCESSES = 4
CONNECT_CONCURRENCY = 10
CONNECT_ATTEMPTS = 5
SERVER_BOOT = (
    "import django; django.setup(); import bench.workflows; "
    "from django.core.management import call_command; "
    "call_command('runserver', '--noreload', '--skip-checks', '127.0.0.1:{port}')"
)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`manage.py runserver` (daphne, embedded worker) on the bench database."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(
            mode="w+", prefix="bench-server-", suffix=".log", delete=False
        )
        env = {
            **os.environ,
            "WFDASH_DEMO": "0",
            "WFDASH_EMBEDDED_WORKER": "1",
            "PYTHONUNBUFFERED": "1",
            # Every socket of the fan-out is one user's: the server's per-user cap (100 by
            # default, a guard against one user's flood) would close all but the first.
            "WFDASH_MAX_SOCKETS_PER_USER": "100000",
        }
        # WFDASH_BENCH_SERVER_ROOT: serve from another checkout (figures before a change)
        root = os.environ.get("WFDASH_BENCH_SERVER_ROOT") or str(ROOT)
        env["PYTHONPATH"] = root
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVER_BOOT.format(port=self.port)],
            cwd=root,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:  # bounded readiness poll of a subprocess
            try:
                urllib.request.urlopen(f"{self.url}/admin/login/", timeout=1).close()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"runserver did not start; see {self.log.name}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _credentials() -> tuple[str, str]:
    """A staff session cookie for the sockets and a write token for the API."""
    from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY
    from django.contrib.auth.models import User
    from django.contrib.sessions.backends.db import SessionStore

    from workflows_app import tokens

    user, _ = User.objects.get_or_create(
        username="bench-fanout", defaults={"is_staff": True, "is_superuser": True}
    )
    session = SessionStore()
    session[SESSION_KEY] = str(user.pk)
    session[BACKEND_SESSION_KEY] = "django.contrib.auth.backends.ModelBackend"
    session[HASH_SESSION_KEY] = user.get_session_auth_hash()
    session.create()
    _, raw = tokens.issue(f"bench-fanout-{time.time_ns()}", username=user.username)
    return f"sessionid={session.session_key}", raw


class Api:
    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url, token

    def call(self, method: str, path: str, body: Any) -> Any:
        request = urllib.request.Request(
            f"{self.url}/api/{path}",
            data=json.dumps(body).encode(),
            method=method,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())

    def create(self, instance_id: str) -> None:
        self.call("POST", f"workflows/{WORKFLOW}/instances", {"id": instance_id})

    def set_status(self, instance_id: str, action: str) -> None:
        self.call(
            "PATCH", f"workflows/{WORKFLOW}/instances/{instance_id}/status", {"status": action}
        )

    def create_many(self, prefix: str, n: int) -> float:
        """n creates from CLIENT_PROCESSES processes (not threads of this one: its event
        loop, busy with hundreds of sockets, would hold the GIL and slow the clients, not
        the server); returns instances per second."""
        ids = [f"{prefix}-{i}" for i in range(n)]
        with ProcessPoolExecutor(CLIENT_PROCESSES, mp_context=get_context("spawn")) as pool:
            list(pool.map(_ping, range(CLIENT_PROCESSES)))  # started before the clock starts
            start = time.perf_counter()
            chunks = [ids[i::CLIENT_PROCESSES] for i in range(CLIENT_PROCESSES)]
            list(pool.map(_create_all, [(self.url, self.token, c) for c in chunks]))
        return n / (time.perf_counter() - start)


def _ping(_: int) -> None:
    return None


def _create_all(job: tuple[str, str, list[str]]) -> None:
    url, token, ids = job
    api = Api(url, token)
    for instance_id in ids:
        api.create(instance_id)


class ListSocket:
    """What a list page knows: pk -> status, from its snapshot and batches, resynced
    (a snapshot) when the stream's numbers skip, as dashboard.js does."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.view: dict[int, str] = {}
        self.seq: int | None = None
        self.resyncs = 0
        self.last_change = 0.0
        self.waiting_for: tuple[int, str] | None = None
        self.arrived: dict[int, float] = {}  # change number -> when it arrived here
        self.change_no = 0
        self.task: asyncio.Future[None] | None = None
        self.resync: asyncio.Future[None] | None = None

    async def run(self) -> None:
        async for text in self.ws:
            self.receive(json.loads(text), time.perf_counter())

    def receive(self, msg: dict[str, Any], now: float) -> None:
        kind, seq = msg.get("type"), msg.get("seq")
        if kind == "snapshot":
            self.seq = seq
            rows = [(i["pk"], i["status"]) for i in msg["instances"]]
        elif isinstance(seq, int) and self.seq is not None:
            expected = self.seq if kind == "heartbeat" else self.seq + 1
            if seq < expected:
                return
            self.seq = seq
            if seq > expected or kind == "resync":  # a lost message, or one too large
                self.resyncs += 1
                self.resync = asyncio.ensure_future(self.ws.send(json.dumps({"type": "resync"})))
            rows = [(c["instance"]["pk"], c["instance"]["status"]) for c in msg.get("changes", ())]
        elif kind == "instance.status":  # servers before the fan-out hub: one row a message
            rows = [(msg["instance"]["pk"], msg["instance"]["status"])]
        else:
            return
        for pk, status in rows:
            if self.view.get(pk) != status:
                self.view[pk] = status
                self.last_change = now
            if self.waiting_for == (pk, status) and self.change_no not in self.arrived:
                self.arrived[self.change_no] = now


async def _open(url: str, cookie: str, n: int) -> list[ListSocket]:
    import websockets

    ws_url = url.replace("http://", "ws://") + "/ws/instances/"
    semaphore = asyncio.Semaphore(CONNECT_CONCURRENCY)

    async def one() -> ListSocket:
        async with semaphore:
            for attempt in range(CONNECT_ATTEMPTS):
                try:
                    ws = await websockets.connect(
                        ws_url,
                        origin=url,
                        additional_headers={"Cookie": cookie},
                        max_queue=None,
                        open_timeout=60,
                    )
                    break
                except (OSError, websockets.exceptions.InvalidMessage):
                    # daphne drops a handshake its app took over 5 s to accept (a loaded
                    # box); a page reconnects, so does the bench
                    if attempt == CONNECT_ATTEMPTS - 1:
                        raise
            socket = ListSocket(ws)
            socket.receive(json.loads(await ws.recv()), time.perf_counter())
            socket.task = asyncio.ensure_future(socket.run())
            return socket

    return list(await asyncio.gather(*(one() for _ in range(n))))


async def _close(sockets: list[ListSocket]) -> None:
    for socket in sockets:
        if socket.task is not None:
            socket.task.cancel()
    await asyncio.gather(*(s.ws.close() for s in sockets), return_exceptions=True)


def _statuses(prefix: str) -> dict[int, str]:
    from workflows_app.models import Instance

    return dict(
        Instance.objects.filter(workflow=WORKFLOW, instance_id__startswith=prefix).values_list(
            "pk", "status"
        )
    )


async def _in_thread(fn: Any, *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)


async def _measure(
    server: Server,
    api: Api,
    cookie: str,
    sockets_n: int,
    changes: int,
    burst: int,
    rate_n: int,
    rate_sockets: int,
) -> dict[str, Any]:
    out: dict[str, Any] = {"fanout_sockets": sockets_n}
    # Create rate: none open, then rate_sockets open; the worker parks each batch before
    # the next is timed (its runs compete with the creates for the database).
    out["fanout_create_per_s_0_sockets"] = await _in_thread(api.create_many, "rate0", rate_n)
    await _wait_for(lambda: set(_statuses("rate0").values()) == {"waiting"}, 120)
    sockets = await _open(server.url, cookie, rate_sockets)
    out[f"fanout_create_per_s_{rate_sockets}_sockets"] = await _in_thread(
        api.create_many, "rate1", rate_n
    )
    await _wait_for(lambda: set(_statuses("rate1").values()) == {"waiting"}, 120)
    out["fanout_create_rate_ratio"] = (
        out[f"fanout_create_per_s_{rate_sockets}_sockets"] / out["fanout_create_per_s_0_sockets"]
    )
    sockets += await _open(server.url, cookie, sockets_n - rate_sockets)

    # Latency: one change every 0.5 s.
    await _in_thread(api.create, "target")
    await _wait_for(lambda: "waiting" in _statuses("target").values(), 60)
    (target_pk,) = await _in_thread(_statuses, "target")
    latencies: list[float] = []
    missed = 0
    status = "waiting"
    for n in range(changes):
        action, status = ("pause", "paused") if status != "paused" else ("resume", "waiting")
        for socket in sockets:
            socket.change_no, socket.waiting_for = n, (target_pk, status)
        sent = time.perf_counter()
        await _in_thread(api.set_status, "target", action)
        deadline = sent + MISS_SECONDS
        while time.perf_counter() < deadline and not all(n in s.arrived for s in sockets):
            await asyncio.sleep(0.01)
        got = [s.arrived[n] - sent for s in sockets if n in s.arrived]
        latencies += got
        missed += len(sockets) - len(got)
        await asyncio.sleep(max(0.0, sent + CHANGE_EVERY_SECONDS - time.perf_counter()))
    for socket in sockets:
        socket.waiting_for = None
    latencies.sort()
    out["fanout_p50_ms"] = statistics.median(latencies) * 1000 if latencies else None
    out["fanout_p95_ms"] = latencies[int(0.95 * (len(latencies) - 1))] * 1000 if latencies else None
    out["fanout_missed"] = missed
    out["fanout_changes"] = changes

    # Burst: creates, then every socket's view against the database.
    out["fanout_burst_create_per_s"] = await _in_thread(api.create_many, "burst", burst)
    await _wait_for(lambda: set(_statuses("burst").values()) == {"waiting"}, 120)
    settled = time.perf_counter()
    final = await _in_thread(_statuses, "burst")
    deadline = settled + STALE_SECONDS
    while time.perf_counter() < deadline and not all(_shows(s, final) for s in sockets):
        await asyncio.sleep(0.05)
    out["fanout_burst"] = burst
    out["fanout_stale_sockets"] = sum(not _shows(s, final) for s in sockets)
    out["fanout_burst_converged_s"] = max(0.0, max(s.last_change for s in sockets) - settled)
    out["fanout_resyncs"] = sum(s.resyncs for s in sockets)
    await _close(sockets)
    return out


def _shows(socket: ListSocket, final: dict[int, str]) -> bool:
    return all(socket.view.get(pk) == status for pk, status in final.items())


async def _wait_for(condition: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(condition):
        if time.monotonic() > deadline:
            raise TimeoutError("the server did not get there in time")
        await asyncio.sleep(0.05)


def fanout(
    sockets: int, changes: int, burst: int, rate_n: int, rate_sockets: int
) -> dict[str, Any]:
    cookie, token = _credentials()
    server = Server()
    try:
        return asyncio.run(
            _measure(
                server,
                Api(server.url, token),
                cookie,
                sockets,
                changes,
                burst,
                rate_n,
                rate_sockets,
            )
        )
    finally:
        server.stop()
