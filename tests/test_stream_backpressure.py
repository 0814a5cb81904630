"""A history stream (SSE) whose client stops reading, through a real daphne process:
daphne's ASGI `send` never waits, so the stream read the whole history into the
connection's memory (workflows_app/backpressure.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from django.contrib.auth import get_user_model
from django.db.models import Max
from django.test import Client

from tests import fleet_workflows  # noqa: F401  (registers "fleet")
from tests.polling import wait_until
from tests.workers import ROOT, answers_http, database_url
from workflows_app.client import get_workflow
from workflows_app.engine import clock
from workflows_app.models import HistoryRecord, Instance

pytestmark = pytest.mark.django_db(transaction=True)

ROWS = 10000
ROW_BYTES = 1500
STREAMS = 4

BOOT = (
    "import sys, django; django.setup(); import tests.fleet_workflows; "
    "from daphne.cli import CommandLineInterface; "
    "CommandLineInterface().run(['-b', '127.0.0.1', '-p', sys.argv[1], 'wfdash.asgi:application'])"
)


def long_history(instance_id: str) -> int:
    """An instance with ROWS history records of ROW_BYTES each; its last sequence."""
    pk = get_workflow("fleet").create(id=instance_id).row().pk
    top = HistoryRecord.objects.filter(instance_id=pk).aggregate(m=Max("sequence"))["m"]
    now = clock.now()
    HistoryRecord.objects.bulk_create(
        HistoryRecord(
            instance_id=pk,
            sequence=top + 1 + i,
            created_at=now,
            type="event.sent",
            data={"type": "note", "payload": {"text": "x" * ROW_BYTES}},
        )
        for i in range(ROWS)
    )
    Instance.objects.filter(pk=pk).update(history_seq=top + ROWS)
    return top + ROWS


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def settled(pid: int, seconds: float = 1.5) -> bool:
    """The process spent no CPU for `seconds`: it does nothing more for the streams."""
    before = cpu_ticks(pid)
    time.sleep(seconds)
    return cpu_ticks(pid) == before


def open_stream(port: int, session: str, instance_id: str) -> socket.socket:
    conn = socket.socket()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that reads nothing
    conn.connect(("127.0.0.1", port))
    conn.sendall(
        f"GET /api/workflows/fleet/instances/{instance_id}/subscribe HTTP/1.1\r\n"
        f"Host: 127.0.0.1\r\nCookie: sessionid={session}\r\n\r\n".encode()
    )
    return conn


def test_history_streams_of_clients_that_do_not_read_hold_no_more_than_a_page(registered):
    """Four streams of a 15 MB history whose clients read nothing: the server held each
    whole history in memory (60 MB more, for as long as the connections stayed
    open). Twisted now pauses each stream once its connection's send buffer is full (a
    page of records read, at most); a
    client that then reads gets every record."""
    last = long_history("long-history")
    user = get_user_model().objects.create_superuser("streamer", password="pw")
    client = Client()
    client.force_login(user)
    session = client.cookies["sessionid"].value
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.TemporaryFile(mode="w+")
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "wfdash.settings",
        "DATABASE_URL": database_url(),
        "WFDASH_DEMO": "0",
        "REDIS_URL": "",
        "WFDASH_EMBEDDED_WORKER": "0",
        "PYTHONUNBUFFERED": "1",
    }
    server = subprocess.Popen(
        [sys.executable, "-c", BOOT, str(port)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    streams: list[socket.socket] = []
    try:
        wait_until(lambda: answers_http(port), 60, "daphne to answer")
        # A first stream, read to its end, so the baseline counts what any stream loads once.
        get_workflow("fleet").create(id="short-history").terminate()
        warm = open_stream(port, session, "short-history")
        warm.settimeout(30)
        body = b""
        while b"event: end" not in body:
            chunk = warm.recv(1 << 16)
            assert chunk, body[-300:]
            body += chunk
        warm.close()
        wait_until(lambda: settled(server.pid), 30, "daphne to settle")
        before = rss_mb(server.pid)
        streams = [open_stream(port, session, "long-history") for _ in range(STREAMS)]
        wait_until(lambda: settled(server.pid), 120, "the streams to stop sending")
        grew = rss_mb(server.pid) - before
        history_mb = STREAMS * ROWS * ROW_BYTES / 2**20
        # Each stream holds at most a page of READ_BATCH records read (0.75 MB of text here)
        # and the connection's send buffer: measured 3.5 MB a stream, 18 without the pacing.
        assert grew < STREAMS * 6, (
            f"{STREAMS} streams whose clients read nothing grew the server by {grew:.0f} MB "
            f"(their histories: {history_mb:.0f} MB)"
        )

        # A client that reads gets the whole history, in order, after all.
        reader = streams[0]
        reader.settimeout(30)
        body = bytearray()
        end = f"id: {last}\n".encode()
        while end not in body[-(1 << 17) :]:
            chunk = reader.recv(1 << 20)
            assert chunk, bytes(body[-300:])
            body += chunk
        assert body.count(b"\nid: ") >= ROWS, bytes(body[:300])
    finally:
        for stream in streams:
            stream.close()
        server.kill()
        server.wait(10)
        log.seek(0)
        logged = log.read()
        log.close()
        assert "Traceback" not in logged, logged[-2000:]
