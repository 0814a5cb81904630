"""The dashboard's WebSocket consumers, through the real ASGI stack (origin check + auth)."""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client

from wfdash.asgi import router  # the app without the embedded-engine autostart
from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register

from .helpers import make_user

pytestmark = pytest.mark.django_db(transaction=True)

RECEIVE_TIMEOUT = 5  # seconds; messages arrive in milliseconds, this only bounds a failure


def session_cookie(*perms: str, staff: bool = True) -> bytes:
    client = Client()
    client.force_login(make_user(f"u{len(perms)}{staff}", *perms, staff=staff))
    return f"sessionid={client.cookies['sessionid'].value}".encode()


async def connect(
    path: str, cookie: bytes | None, origin: bytes = b"http://testserver"
) -> tuple[WebsocketCommunicator, bool]:
    headers = [(b"origin", origin), (b"host", b"testserver")] + (
        [(b"cookie", cookie)] if cookie else []
    )
    communicator = WebsocketCommunicator(router, path, headers=headers)
    connected, _ = await communicator.connect(timeout=RECEIVE_TIMEOUT)
    return communicator, connected


async def staff_cookie() -> bytes:
    return await database_sync_to_async(session_cookie)("view_instance")


async def receive_until(
    communicator: WebsocketCommunicator, type: str, timeout: float = RECEIVE_TIMEOUT, **match: Any
) -> dict[str, Any]:
    """The next message of that type (and matching fields), skipping others (heartbeats
    among them: the whole wait is bounded, not each message)."""
    async with asyncio.timeout(timeout):
        while True:
            message = await communicator.receive_json_from(timeout=timeout)
            if message["type"] == type and all(message.get(k) == v for k, v in match.items()):
                return message


async def receive_change(communicator: WebsocketCommunicator, **match: Any) -> dict[str, Any]:
    """The next change of a list socket's batches whose fields (or instance's) match."""
    pending = communicator.__dict__.setdefault("pending_changes", [])
    while True:
        if not pending:
            pending.extend((await receive_until(communicator, "instance.batch"))["changes"])
        change = pending.pop(0)
        fields = {**change["instance"], **change}
        if all(fields.get(k) == v for k, v in match.items()):
            return change


async def test_a_foreign_origin_is_refused():
    _, connected = await connect(
        "/ws/overview/", await staff_cookie(), origin=b"https://evil.example"
    )
    assert not connected


@pytest.mark.parametrize("path", ["/ws/overview/", "/ws/instances/"])
async def test_anonymous_sockets_are_refused(path):
    _, connected = await connect(path, None)
    assert not connected


async def test_non_staff_and_staff_without_view_permission_are_refused():
    for cookie in (
        await database_sync_to_async(session_cookie)("view_instance", staff=False),
        await database_sync_to_async(session_cookie)(),
    ):
        _, connected = await connect("/ws/instances/", cookie)
        assert not connected


async def test_an_unknown_instance_is_refused():
    _, connected = await connect("/ws/instances/999999/", await staff_cookie())
    assert not connected


async def test_the_overview_sends_a_snapshot_then_summaries_when_instances_move(approval_workflow):
    inst = await get_workflow(approval_workflow).acreate(id="o1")
    communicator, connected = await connect("/ws/overview/", await staff_cookie())
    assert connected
    snapshot = await receive_until(communicator, "snapshot")
    [summary] = [w for w in snapshot["workflows"] if w["name"] == approval_workflow]
    assert summary["counts"] == {"running": 1} and summary["versions"] == [1]
    await inst.aterminate(actor="test")
    message = await receive_until(communicator, "workflow.summary")
    assert message["workflow"]["counts"] == {"terminated": 1}
    await communicator.disconnect()


async def test_the_list_socket_reports_status_changes_from_actions_and_the_engine(
    approval_workflow,
):
    communicator, connected = await connect("/ws/instances/", await staff_cookie())
    assert connected
    assert (await receive_until(communicator, "snapshot"))["instances"] == []
    inst = await get_workflow(approval_workflow).acreate(id="l1")
    created = await receive_change(communicator, id="l1")
    assert created["instance"]["status"] == "running"
    await testing.arun_until_idle()
    await receive_change(communicator, id="l1", status="waiting")
    await inst.apause(actor="test")
    await receive_change(communicator, id="l1", status="paused")
    await communicator.disconnect()


async def test_a_list_message_too_large_for_one_frame_comes_as_a_resync(
    approval_workflow, monkeypatch
):
    """A window's batch carries every instance that changed in it, however many: a herd
    of thousands changing at once sent every list page a frame of megabytes (past 1 MiB,
    clients that cap a message there, the websockets library's default, closed). Past
    fanout.MAX_FRAME_BYTES the message is now a `resync` of the same number, and the page
    asks for the rows it shows (lowered here so that one change is past it)."""
    from workflows_app import fanout

    monkeypatch.setattr(fanout, "MAX_FRAME_BYTES", 120, raising=False)
    communicator, connected = await connect("/ws/instances/", await staff_cookie())
    assert connected
    snapshot = await receive_until(communicator, "snapshot")
    inst = await get_workflow(approval_workflow).acreate(id="herd-1")
    async with asyncio.timeout(RECEIVE_TIMEOUT):
        while (message := await communicator.receive_json_from()).get("type") == "heartbeat":
            pass
    assert message == {
        "type": "resync",
        "reason": "too large for one frame",
        "seq": snapshot["seq"] + 1,
    }
    pk = (await database_sync_to_async(inst.row)()).pk
    await communicator.send_json_to({"type": "watch", "pks": [pk]})  # as dashboard.js does
    rows = (await receive_until(communicator, "snapshot"))["instances"]
    assert [(row["id"], row["status"]) for row in rows] == [("herd-1", "running")]
    await communicator.disconnect()


async def test_the_detail_socket_relays_steps_history_and_status(approval_workflow):
    inst = await get_workflow(approval_workflow).acreate(id="d1")
    pk = (await database_sync_to_async(inst.row)()).pk
    communicator, connected = await connect(f"/ws/instances/{pk}/", await staff_cookie())
    assert connected
    assert (await receive_until(communicator, "snapshot"))["instance"]["status"] == "running"
    await testing.arun_until_idle()
    started = await receive_until(communicator, "step.written")
    assert started["step"]["name"] == "prepare" and started["step"]["status"] == "running"
    done = await receive_until(communicator, "step.written")
    assert done["step"]["name"] == "prepare" and done["step"]["status"] == "complete"
    assert (await receive_until(communicator, "history.appended"))[
        "count"
    ] == 2  # started + completed
    await _until_status(lambda: receive_until(communicator, "instance.status"), "waiting")
    await inst.asend_event("approval", {"ok": True}, actor="test")
    told = ("instance.status", "history.appended")  # as a new status, or as history
    while (await communicator.receive_json_from(timeout=RECEIVE_TIMEOUT))["type"] not in told:
        pass
    await communicator.disconnect()


async def test_forged_and_malformed_client_messages_get_an_error_frame_and_change_nothing(
    approval_workflow,
):
    inst = await get_workflow(approval_workflow).acreate(id="f1")
    pk = (await database_sync_to_async(inst.row)()).pk
    communicator, connected = await connect("/ws/instances/", await staff_cookie())
    assert connected
    await receive_until(communicator, "snapshot")
    for frame in (
        json.dumps({"type": "wf.instance", "pk": pk}),
        json.dumps({"type": "terminate", "pk": pk}),
        "not json",
        json.dumps([1, 2]),
        json.dumps({"type": "watch", "pks": ["1; DROP TABLE"]}),
        json.dumps({"type": "watch", "pks": list(range(1, 1000))}),
        "x" * 10000,
    ):
        await communicator.send_to(text_data=frame)
        assert (await communicator.receive_json_from(timeout=RECEIVE_TIMEOUT))["type"] == "error"
    await communicator.send_to(bytes_data=b"\x00")
    assert (await communicator.receive_json_from(timeout=RECEIVE_TIMEOUT))["type"] == "error"
    assert (await inst.astatus()).status == "running"
    await communicator.send_json_to({"type": "watch", "pks": [pk]})
    snapshot = await receive_until(communicator, "snapshot")
    assert [i["id"] for i in snapshot["instances"]] == ["f1"]
    await communicator.send_json_to({"type": "ping"})
    await receive_until(communicator, "pong")
    await communicator.disconnect()


async def test_when_the_layer_loses_every_message_the_history_tail_still_updates_open_pages(
    approval_workflow,
):
    """The channel layer is lossy (capacity, a Redis restart); the database is the truth."""
    from channels.layers import get_channel_layer

    from workflows_app.models import Instance

    inst = await get_workflow(approval_workflow).acreate(id="lost-1")
    pk = (await database_sync_to_async(inst.row)()).pk
    cookie = await staff_cookie()
    detail, connected = await connect(f"/ws/instances/{pk}/", cookie)
    assert connected
    assert (await receive_until(detail, "snapshot"))["instance"]["status"] == "running"
    listing, connected = await connect("/ws/instances/", cookie)
    assert connected
    await receive_until(listing, "snapshot")
    layer = get_channel_layer()
    sent = layer.group_send

    async def drop(*args: Any, **kwargs: Any) -> None:
        return None  # every notification is lost

    layer.group_send = drop
    try:
        await testing.arun_until_idle()  # the instance parks: nobody is told
        await inst.apause(actor="test")
        paused = await asyncio.wait_for(
            _until_status(lambda: receive_until(detail, "instance.status"), "paused"), 1.0
        )
        listed = await asyncio.wait_for(
            _until_status(lambda: receive_change(listing, pk=pk), "paused"), 1.0
        )
    finally:
        layer.group_send = sent
    row = await database_sync_to_async(Instance.objects.get)(pk=pk)
    assert paused["instance"]["status"] == listed["instance"]["status"] == row.status
    await detail.disconnect()
    await listing.disconnect()


async def _until_status(receive: Any, status: str) -> dict[str, Any]:
    while True:
        message = await receive()
        if message["instance"]["status"] == status:
            return message


async def test_a_change_that_arrives_while_the_overview_reads_its_window_is_not_dropped(
    monkeypatch,
):
    import asyncio
    import threading

    from workflows_app import fanout

    reads: list[set] = []
    reading, go = threading.Event(), threading.Event()

    def held_first_read(names):
        reads.append(set(names))
        if len(reads) == 1:
            reading.set()
            go.wait(10)
        return []

    monkeypatch.setattr(fanout, "read_workflow_summaries", held_first_read)
    hub = fanout.Hub()
    hub.streams[fanout.OVERVIEW_STREAM] = set()
    flushing = asyncio.ensure_future(hub.flush_workflows())
    try:
        hub.dirty_workflows.add("a")
        hub.workflows_changed.set()
        assert await asyncio.to_thread(reading.wait, 10)  # the first window is being read now
        hub.dirty_workflows.add("b")
        hub.workflows_changed.set()
        go.set()
        while len(reads) < 2:
            await asyncio.sleep(0.01)
        assert reads == [{"a"}, {"b"}]
    finally:
        flushing.cancel()


async def test_a_burst_of_changes_is_read_once_for_every_list_socket_not_once_per_socket(
    approval_workflow, monkeypatch
):
    from channels.layers import get_channel_layer

    from workflows_app import fanout, live

    reads: list[int] = []
    real = fanout.read_rows
    monkeypatch.setattr(fanout, "read_rows", lambda pks: reads.append(len(pks)) or real(pks))
    wf = get_workflow(approval_workflow)
    pks = []
    for n in range(20):
        inst = await wf.acreate(id=f"b{n}")
        pks.append((await database_sync_to_async(inst.row)()).pk)
    cookie = await staff_cookie()
    sockets = []
    for _ in range(5):
        communicator, connected = await connect("/ws/instances/", cookie)
        assert connected
        await receive_until(communicator, "snapshot")
        sockets.append(communicator)
    # The engine's message per change: over the in-memory layer through the overview
    # group, as the engine sends it; over Redis the hub takes changes from the history
    # tail, so the same message is handed to it as its listener would.
    layer = get_channel_layer()
    for pk in pks:
        message = {"type": "wf.instance", "pk": pk, "workflow": None, "kind": "x"}
        if live.is_in_process(layer):
            await layer.group_send(live.OVERVIEW_GROUP, message)
        else:
            await fanout.hub().on_message(message)
    for communicator in sockets:
        seen = set()
        while len(seen) < 20:
            seen.add((await receive_change(communicator))["instance"]["id"])
        assert seen == {f"b{n}" for n in range(20)}
    # 20 changes x 5 sockets: each change read once for all of them (in a few windows:
    # over Redis the 20 sends outlast one window), not once per socket
    assert sum(reads) == 20 and len(reads) < 20, reads
    for communicator in sockets:
        await communicator.disconnect()


async def test_a_socket_that_missed_a_message_sees_the_gap_and_resyncs_to_the_database_state(
    approval_workflow, monkeypatch
):
    from workflows_app import fanout

    monkeypatch.setattr(fanout, "HEARTBEAT_SECONDS", 0.2)
    inst = await get_workflow(approval_workflow).acreate(id="gap-1")
    communicator, connected = await connect("/ws/instances/", await staff_cookie())
    assert connected
    seq = (await receive_until(communicator, "snapshot"))["seq"]
    # The socket loses the next message of its stream (as a full buffer or a dropped
    # frame would): its subscriber skips one delivery.
    (subscriber,) = fanout.hub().streams[fanout.LIST_STREAM]
    deliver = subscriber.deliver

    async def lose_one(message_seq: int, text: str) -> None:
        subscriber.deliver = deliver

    subscriber.deliver = lose_one
    await inst.apause(actor="test")
    async with asyncio.timeout(RECEIVE_TIMEOUT):  # the page can tell it missed something
        while (heartbeat := await receive_until(communicator, "heartbeat"))["seq"] == seq:
            pass
    await communicator.send_json_to({"type": "resync"})
    snapshot = await receive_until(communicator, "snapshot")
    assert snapshot["seq"] >= heartbeat["seq"]
    assert [(i["id"], i["status"]) for i in snapshot["instances"]] == [("gap-1", "paused")]
    await communicator.disconnect()


def counts_of(snapshot: dict[str, Any], workflow: str) -> dict[str, int]:
    [summary] = [w for w in snapshot["workflows"] if w["name"] == workflow]
    return summary["counts"]


async def test_resyncs_asked_for_while_a_snapshot_is_read_are_folded_into_one_read_after_it(
    approval_workflow, monkeypatch
):
    """A forged flood of `resync` frames must not read the database once per frame: those
    that come while a snapshot is read are folded into one more read, after it, which
    sees what changed meanwhile."""
    from workflows_app import consumers, fanout

    monkeypatch.setattr(consumers, "RESYNC_MIN_SECONDS", 0.0)  # the folding alone
    monkeypatch.setattr(consumers, "CLIENT_FRAMES_BURST", 1000)  # no frame is dropped
    inst = await get_workflow(approval_workflow).acreate(id="flood-1")
    reads = 0
    held, release = asyncio.Event(), asyncio.Event()
    real = consumers.OverviewConsumer.snapshot

    async def counted(self: Any) -> Any:
        nonlocal reads
        reads += 1
        snapshot = await real(self)
        if reads == 2:  # the first read a resync asked for: held until the flood is in
            held.set()
            await release.wait()
        return snapshot

    monkeypatch.setattr(consumers.OverviewConsumer, "snapshot", counted)
    communicator, connected = await connect("/ws/overview/", await staff_cookie())
    assert connected
    await receive_until(communicator, "snapshot")
    await communicator.send_json_to({"type": "resync"})
    await asyncio.wait_for(held.wait(), RECEIVE_TIMEOUT)
    for _ in range(200):
        await communicator.send_json_to({"type": "resync"})
    await communicator.send_json_to({"type": "ping"})
    await receive_until(communicator, "pong")  # every frame is handled; the read is still held
    assert reads == 2
    await inst.aterminate(actor="test")
    release.set()
    first = await receive_until(communicator, "snapshot")
    folded = await receive_until(communicator, "snapshot")
    (page,) = fanout.hub().streams[fanout.OVERVIEW_STREAM]
    await asyncio.wait_for(page.requested_snapshots, RECEIVE_TIMEOUT)  # nothing more to read
    assert reads == 3  # connect, the held read, the one the 200 frames were folded into
    assert counts_of(first, approval_workflow) == {"running": 1}
    assert counts_of(folded, approval_workflow) == {"terminated": 1}
    await communicator.disconnect()


async def test_a_page_s_requested_snapshots_start_at_most_once_per_interval(
    approval_workflow, monkeypatch
):
    """However many `resync` and `watch` frames a page sends, its snapshots are read at
    most once per RESYNC_MIN_SECONDS: the first at once, the rest folded into one that
    waits for the interval's end (and goes with the socket)."""
    from workflows_app import consumers, fanout

    monkeypatch.setattr(consumers, "RESYNC_MIN_SECONDS", 3600.0)
    monkeypatch.setattr(consumers, "CLIENT_FRAMES_BURST", 1000)  # no frame is dropped
    inst = await get_workflow(approval_workflow).acreate(id="flood-2")
    pk = (await database_sync_to_async(inst.row)()).pk
    reads = 0
    real = consumers.InstanceListConsumer.snapshot

    async def counted(self: Any) -> Any:
        nonlocal reads
        reads += 1
        return await real(self)

    monkeypatch.setattr(consumers.InstanceListConsumer, "snapshot", counted)
    communicator, connected = await connect("/ws/instances/", await staff_cookie())
    assert connected
    await receive_until(communicator, "snapshot")
    await communicator.send_json_to({"type": "watch", "pks": [pk]})  # the page's first: at once
    assert [i["id"] for i in (await receive_until(communicator, "snapshot"))["instances"]] == [
        "flood-2"
    ]
    for _ in range(100):
        await communicator.send_json_to({"type": "resync"})
        await communicator.send_json_to({"type": "watch", "pks": [pk]})
    await communicator.send_json_to({"type": "ping"})
    await receive_until(communicator, "pong")
    assert reads == 2  # connect and the first watch; 200 frames since: no read yet
    (page,) = fanout.hub().streams[fanout.LIST_STREAM]
    assert page.snapshot_wanted and not page.requested_snapshots.done()  # one read, when due
    await communicator.disconnect()
    with pytest.raises(asyncio.CancelledError):
        await page.requested_snapshots
    assert reads == 2


async def waiting_bulk_job(workflow: str, n: int) -> int:
    """n instances parked on their event and a bulk terminate of them (nothing applied yet)."""
    for i in range(n):
        await get_workflow(workflow).acreate(id=f"bulk-{i}")
    await testing.arun_until_idle()
    job = await get_workflow(workflow).abulk("terminate", status="waiting", actor="test")
    return job.id


async def test_the_bulk_job_socket_pushes_each_batch_as_it_commits(approval_workflow, monkeypatch):
    from workflows_app import bulk, fanout

    # Only the batch's own announcement can bring the update within the test's wait.
    monkeypatch.setattr(fanout, "BULK_READ_SECONDS", 3600.0)
    job_id = await waiting_bulk_job(approval_workflow, 3)
    communicator, connected = await connect(f"/ws/bulk-jobs/{job_id}/", await staff_cookie())
    assert connected
    snapshot = await receive_until(communicator, "snapshot")
    assert (snapshot["job"]["matched"], snapshot["job"]["processed"]) == (3, 0)
    await database_sync_to_async(bulk.process_batch)(job_id, 2)
    first = (await receive_until(communicator, "bulk.progress"))["job"]
    assert (first["processed"], first["applied"], first["done"]) == (2, 2, False)
    await database_sync_to_async(bulk.process_batch)(job_id, 2)
    last = (await receive_until(communicator, "bulk.progress"))["job"]
    assert (last["processed"], last["applied"], last["done"]) == (3, 3, True)
    assert [last] == await database_sync_to_async(fanout.read_bulk_jobs)([job_id])
    await communicator.disconnect()


async def test_a_bulk_job_batch_nobody_announced_still_reaches_its_page(approval_workflow):
    """A worker in another process without a cross-process layer announces nothing: the
    hub reads followed, unfinished jobs on its own."""
    from channels.layers import get_channel_layer

    from workflows_app import bulk

    job_id = await waiting_bulk_job(approval_workflow, 2)
    communicator, connected = await connect(f"/ws/bulk-jobs/{job_id}/", await staff_cookie())
    assert connected
    await receive_until(communicator, "snapshot")
    layer = get_channel_layer()
    sent = layer.group_send

    async def drop(*args: Any, **kwargs: Any) -> None:
        return None

    layer.group_send = drop
    try:
        await database_sync_to_async(bulk.process_batch)(job_id)
        progress = (await receive_until(communicator, "bulk.progress", timeout=2.0))["job"]
    finally:
        layer.group_send = sent
    assert (progress["processed"], progress["done"]) == (2, True)
    await communicator.disconnect()


async def test_an_unknown_bulk_job_is_refused():
    _, connected = await connect("/ws/bulk-jobs/999999/", await staff_cookie())
    assert not connected


async def test_a_run_that_parks_without_a_history_row_still_reaches_list_pages(
    approval_workflow,
):
    """Over a cross-process layer the hub takes changes from the history tail, and parking
    (running -> waiting) writes no history row: an instance last read running is read
    again until it settles."""
    from workflows_app import fanout
    from workflows_app.models import Instance

    inst = await get_workflow(approval_workflow).acreate(id="parks")
    pk = (await database_sync_to_async(inst.row)()).pk
    communicator, connected = await connect("/ws/instances/", await staff_cookie())
    assert connected
    await receive_until(communicator, "snapshot")
    hub = fanout.hub()
    hub.hears_every_change = False  # as over Redis: no engine message per change

    def set_status(status: str) -> None:  # a bare row change: no history row, no message
        Instance.objects.filter(pk=pk).update(status=status)

    await database_sync_to_async(set_status)("running")
    hub.mark(pk, None)  # the tail found a history row of it (run.started)
    await receive_change(communicator, id="parks", status="running")
    assert pk in hub.following
    await database_sync_to_async(set_status)("waiting")
    async with asyncio.timeout(fanout.FOLLOW_SECONDS + 5):
        await receive_change(communicator, id="parks", status="waiting")
    await asyncio.sleep(0)
    assert pk not in hub.following  # settled: no longer read again
    await communicator.disconnect()


async def test_a_resync_whose_read_fails_passes_on_what_the_hub_delivered_meanwhile():
    """A resync holds the hub's messages while its snapshot is read; if the read fails
    (the database fails over), they go on as they came and later ones follow, rather
    than being held for the socket's life."""
    from django.db import DatabaseError

    from workflows_app.consumers import DashboardConsumer

    class Hub:
        def seq(self, stream: str) -> int:
            return 7

    class Page(DashboardConsumer):
        def __init__(self) -> None:
            self.hub, self.backlog, self.sent = Hub(), None, []

        def stream(self) -> str:
            return "instance.1"

        async def snapshot(self) -> dict[str, Any] | None:
            await self.deliver(8, "held while reading")
            raise DatabaseError("the database failed over")

        async def send_text(self, text: str) -> None:
            self.sent.append(text)

    page = Page()
    with pytest.raises(DatabaseError):
        await page.resync()
    await page.deliver(9, "after")
    assert page.sent == ["held while reading", "after"]


@pytest.fixture
def brief(registered: list[str]) -> list[str]:
    """Two workflows whose instances complete at once (then kept for their retention)."""

    @register("dash-brief")
    class DashBrief(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            return await step.do("work", lambda: 1)

    @register("dash-brief-too")
    class DashBriefToo(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            return await step.do("work", lambda: 2)

    return ["dash-brief", "dash-brief-too"]


async def finish(workflow: str, *ids: str) -> None:
    for instance_id in ids:
        await get_workflow(workflow).acreate(id=instance_id, retention="1 hour")
    await testing.arun_until_idle()


class HeardByTheHub:
    """The prune and delete messages hubs take from the channel layer; `batches` is set
    once `expected` prune messages came. Installed before the hub starts: its listener
    looks its handler up before it waits for a message."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, expected: int) -> None:
        from workflows_app import fanout

        self.messages: list[dict[str, Any]] = []
        self.batches = asyncio.Event()
        real = fanout.Hub.on_message

        async def on_message(hub: fanout.Hub, message: dict[str, Any]) -> None:
            if message.get("type") == "wf.pruned" or message.get("kind") == "deleted":
                self.messages.append(message)
            if sum(m["type"] == "wf.pruned" for m in self.messages) >= expected:
                self.batches.set()
            await real(hub, message)

        monkeypatch.setattr(fanout.Hub, "on_message", on_message)


async def until_counts(
    communicator: WebsocketCommunicator, expected: dict[str, dict[str, int]]
) -> None:
    """Read the overview's summaries until each workflow's latest shows its expected counts."""
    latest: dict[str, dict[str, int]] = {}
    async with asyncio.timeout(RECEIVE_TIMEOUT):
        while any(latest.get(name) != counts for name, counts in expected.items()):
            summary = (await receive_until(communicator, "workflow.summary"))["workflow"]
            latest[summary["name"]] = summary["counts"]


async def test_an_open_overview_counts_again_as_a_worker_prunes_hearing_one_message_a_batch(
    brief, monkeypatch
):
    """Retention deletes instances without a history row the hubs' tails could find: a
    worker's prune announces each batch, once, with the workflows it touched."""
    from workflows_app.engine import worker as engine_worker
    from workflows_app.live import EngineHooks

    monkeypatch.setattr(engine_worker, "PRUNE_BATCH", 2)
    name = brief[0]
    with testing.fake_clock() as clock:
        await finish(name, *(f"p{n}" for n in range(5)))
        heard = HeardByTheHub(monkeypatch, expected=3)
        communicator, connected = await connect("/ws/overview/", await staff_cookie())
        assert connected
        assert counts_of(await receive_until(communicator, "snapshot"), name) == {"complete": 5}
        clock.advance("2 hours")
        worker = engine_worker.Worker(hooks=EngineHooks())
        await worker.start()
        try:  # a batch each time; due again at once after a full one
            assert [await worker.prune_once() for _ in range(3)] == [2, 2, 1]
        finally:
            await worker.stop()
        await until_counts(communicator, {name: {}})
        await asyncio.wait_for(heard.batches.wait(), RECEIVE_TIMEOUT)
    assert heard.messages == [{"type": "wf.pruned", "workflows": [name]}] * 3  # 5 instances
    await communicator.disconnect()


async def test_wf_prune_tells_an_open_overview_once_for_a_batch_of_several_workflows(
    brief, monkeypatch
):
    from asgiref.sync import sync_to_async
    from django.core.management import call_command

    with testing.fake_clock() as clock:
        await finish(brief[0], "a1", "a2", "a3")
        await finish(brief[1], "b1")
        await get_workflow(brief[1]).acreate(id="b-kept")  # no retention: kept
        await testing.arun_until_idle()
        heard = HeardByTheHub(monkeypatch, expected=1)
        communicator, connected = await connect("/ws/overview/", await staff_cookie())
        assert connected
        snapshot = await receive_until(communicator, "snapshot")
        assert counts_of(snapshot, brief[0]) == {"complete": 3}
        assert counts_of(snapshot, brief[1]) == {"complete": 2}
        clock.advance("2 hours")
        await sync_to_async(call_command)("wf", "prune", "--json", stdout=io.StringIO())
        await until_counts(communicator, {brief[0]: {}, brief[1]: {"complete": 1}})
        await asyncio.wait_for(heard.batches.wait(), RECEIVE_TIMEOUT)
    assert heard.messages == [{"type": "wf.pruned", "workflows": sorted(brief)}]
    await communicator.disconnect()


async def test_the_hub_forgets_the_numbering_of_a_page_s_stream_when_its_last_socket_closes(
    approval_workflow,
):
    """The hub numbers each stream's messages for the pages following it. An instance
    page's numbering stayed for the life of the hub (the process's, while any page is
    open): a dashboard left open while operators looked at instance after instance
    grew by one entry per instance page that ever got a message."""
    from workflows_app import fanout

    cookie = await staff_cookie()
    overview, connected = await connect("/ws/overview/", cookie)
    assert connected  # keeps the hub running throughout
    await receive_until(overview, "snapshot")
    hub = fanout.hub()
    for n in range(5):
        inst = await get_workflow(approval_workflow).acreate(id=f"looked-at-{n}")
        pk = (await database_sync_to_async(inst.row)()).pk
        page, connected = await connect(f"/ws/instances/{pk}/", cookie)
        assert connected
        await receive_until(page, "snapshot")
        await inst.aterminate(actor="test")
        await receive_until(page, "instance.status")
        assert hub.seq(fanout.instance_stream(pk)) > 0
        await page.disconnect()
        assert fanout.instance_stream(pk) not in hub.seqs
    assert not [s for s in hub.seqs if s.startswith(fanout.INSTANCE_STREAM_PREFIX)]
    await overview.disconnect()


def rename_sessions(to: str, back: str) -> None:
    """A real database failure of the access check: the session table is not there."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {to} RENAME TO {back}")


async def test_an_access_check_that_fails_answers_an_error_frame_and_the_socket_lives_on(
    monkeypatch, caplog
):
    """The database failing (over) while a socket re-checked its user crashed the
    consumer: the socket closed with no disconnect, so the hub kept it subscribed for
    the life of the process, and the periodic re-check died with its task."""
    from workflows_app import fanout

    monkeypatch.setattr(fanout, "ACCESS_SHARED_SECONDS", 0.0)  # every message reads
    cookie = await staff_cookie()
    communicator, connected = await connect("/ws/instances/", cookie)
    assert connected
    await receive_until(communicator, "snapshot")
    await database_sync_to_async(rename_sessions)("django_session", "django_session_away")
    try:
        await communicator.send_json_to({"type": "ping"})
        error = await receive_until(communicator, "error")
        assert error["error"].startswith("could not check access")
    finally:
        await database_sync_to_async(rename_sessions)("django_session_away", "django_session")
    await communicator.send_json_to({"type": "ping"})
    await receive_until(communicator, "pong")

    # The periodic re-check fails once, and goes on: a later silent change still closes.
    from django.contrib.auth.models import User

    from workflows_app import access

    monkeypatch.setattr(access, "RECHECK_SECONDS", 0.05)
    periodic, connected = await connect("/ws/instances/", cookie)
    assert connected
    caplog.clear()
    await database_sync_to_async(rename_sessions)("django_session", "django_session_away")
    try:
        async with asyncio.timeout(RECEIVE_TIMEOUT):
            while "could not check a dashboard socket's access" not in caplog.text:
                await asyncio.sleep(0.01)
    finally:
        await database_sync_to_async(rename_sessions)("django_session_away", "django_session")
    await database_sync_to_async(lambda: User.objects.update(is_active=False))()
    while (output := await periodic.receive_output(RECEIVE_TIMEOUT))["type"] != "websocket.close":
        pass
    assert output["code"] == 4403
    await communicator.disconnect()
    assert fanout.LIST_STREAM not in fanout.hub().streams
