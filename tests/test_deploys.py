"""Deploys: a drain (runworker's and the embedded worker's at SIGTERM), old and new
workers side by side, a takeover by a worker without the instance's version.

Each test drives real engine Workers in-process. A fleet whose processes know different
versions is simulated by registering/unregistering versions in the (process-wide)
registry between one worker's actions and another's, as separate processes would hold
different registries.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import pytest

from tests import fleet_workflows
from tests.polling import wait_until
from tests.test_worker_operations import LoopThread, new_worker
from tests.workers import ROOT, answers_http, database_url, send_http_request
from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register, registry, store
from workflows_app.engine.worker import ABORT_WAIT_SECONDS, STUCK_EXIT_CODE
from workflows_app.models import Instance, WorkflowVersion

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()


ran: list[str] = []


def define_mixed(version: int) -> None:
    if version == 1:

        @register("deploy-mixed", version=1)
        class MixedV1(WorkflowEntrypoint):
            async def run(self, event, step):
                return await step.do("which", lambda: ran.append("v1") or "v1 code")

    else:

        @register("deploy-mixed", version=2)
        class MixedV2(WorkflowEntrypoint):
            async def run(self, event, step):
                return await step.do("which", lambda: ran.append("v2") or "v2 code")


# --- 2. a pause pending at a crash must survive a version park ------------------------------


def test_a_pause_requested_before_a_crash_holds_when_a_worker_without_the_version_takes_over(
    registered, loop_thread
):
    """An operator pauses an instance while its step runs (waitingForPause); the worker
    dies (its lease runs out). A worker that lacks the instance's version claims it and
    parks it: park_unrunnable writes status=waiting, so the pause is forgotten and, once
    a worker with the version appears, the instance runs on instead of pausing."""
    gate = threading.Event()
    later: list[str] = []

    @register("deploy-pause", version=1)
    class PauseV1(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("long", lambda: gate.wait(20) and "done")
            return await step.do("after", lambda: later.append("after") or "after")

    with testing.fake_clock() as clock:
        inst = get_workflow("deploy-pause").create(id="paused-at-crash")
        doomed = new_worker(concurrency=2, lease_seconds=30)
        loop_thread.call(doomed.start())
        try:
            assert loop_thread.call(doomed.claim_and_start()) == 1
            inst.pause()  # the step runs: the pause waits for its boundary
            assert inst.status().status == "waitingForPause"
            # The worker "dies": no heartbeat, its lease runs out.
            clock.advance("1 minute")

            registry.unregister("deploy-pause", 1)  # another process, without version 1
            other = new_worker(concurrency=2)
            loop_thread.call(other.start())
            loop_thread.call(other.run_until_idle(timeout=10))
            loop_thread.call(other.stop(grace_seconds=0))
            status = inst.status().status
            assert status in ("paused", "waitingForPause"), (
                f"the pause asked for before the crash was lost: the instance is {status!r}"
            )
        finally:
            gate.set()
            loop_thread.call(doomed.stop(grace_seconds=1))


# --- 4. a drain longer than the lease: heartbeats stop before the drain ----------------------


def test_a_draining_worker_keeps_its_leases_while_its_steps_finish(registered, loop_thread):
    """Worker.serve cancels the heartbeat and then calls stop(), which lets running steps
    finish for up to 10 s (+5 s abort wait). With a lease shorter than that (LEASE_SECONDS
    is configurable; the test fleet uses 2 s) the lease runs out mid-drain: another worker
    claims the instance and runs the same step again while the first still runs it --
    a clean SIGTERM acting like a crash."""
    gate = threading.Event()
    started: list[str] = []

    @register("deploy-drain")
    class Drain(WorkflowEntrypoint):
        async def run(self, event, step):
            def long():
                started.append(threading.current_thread().name)
                gate.wait(20)
                return "done"

            return await step.do("long", long)

    inst = get_workflow("deploy-drain").create(id="drained")
    draining = new_worker(concurrency=2, lease_seconds=0.6, poll_seconds=0.2)
    stop = asyncio.Event()
    serving = loop_thread.spawn(draining.serve(stop))
    other = new_worker(concurrency=2, lease_seconds=30)
    try:
        wait_until(lambda: len(started) == 1, 20, "the step to start")
        loop_thread.loop.call_soon_threadsafe(stop.set)  # SIGTERM
        wait_until(lambda: draining._stopping, 10, "the drain to begin")
        loop_thread.call(other.start())
        deadline = time.monotonic() + 3  # five leases' worth, well inside the 10 s grace
        taken = 0
        while time.monotonic() < deadline and not taken:
            taken = loop_thread.call(other.claim_and_start())
            time.sleep(0.05)
        assert not taken and len(started) == 1, (
            f"while the draining worker still ran step 'long', its lease ran out and another "
            f"worker claimed the instance (step started {len(started)} times)"
        )
    finally:
        gate.set()
        serving.result(30)
        loop_thread.call(other.stop(grace_seconds=5))
    assert inst.status().status in ("waiting", "complete")


# --- 3. the embedded worker (runserver) is a worker too: SIGTERM must not strand leases ------


EMBEDDED_BOOT = (
    "import sys, django; django.setup(); import tests.fleet_workflows; "
    "from django.core.management import call_command; "
    "call_command('runserver', '--noreload', sys.argv[1])"
)


def start_server(boot: list[str], **settings: str) -> tuple[subprocess.Popen[str], Any, int]:
    """Start `boot` (a server process running the embedded worker) on the test database;
    the boot's last argument is filled with a free port. Returns the process, its log
    (a file) and the port. `boot` is Python's `-c` code and arguments, or a script's path
    (ending .py) and arguments."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "wfdash.settings",
        "DATABASE_URL": database_url(),
        "DJANGO_DEBUG": "1",
        "WFDASH_DEMO": "0",
        "REDIS_URL": "",
        "WFDASH_EMBEDDED_WORKER": "1",
        "PYTHONUNBUFFERED": "1",
        **settings,
    }
    log = tempfile.TemporaryFile(mode="w+")
    server = subprocess.Popen(
        [
            sys.executable,
            *([] if boot[0].endswith(".py") else ["-c"]),
            *boot[:-1],
            boot[-1].format(port=port),
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return server, log, port


def sigterm_leaves_no_lease(
    command: str, boot: list[str], instance_id: str, sig: signal.Signals = signal.SIGTERM
) -> None:
    """Start `boot` (a server process whose embedded worker takes a fleet instance in a
    step that outlives any drain grace), SIGTERM it once the instance is leased, and
    assert the process released the lease on its way out. `command` names it in messages;
    the boot's last argument is filled with a free port."""
    fleet_workflows.ensure_ledger()
    inst = get_workflow("fleet").create(id=instance_id)
    server, log, port = start_server(
        boot,
        WFDASH_LEASE_SECONDS="60",
        FLEET_STEP_SECONDS="120",  # the first step outlives the drain's grace
        WFDASH_DRAIN_SECONDS="0.5",  # which is not waited out for 10 s
    )
    try:
        # daphne starts its embedded worker at its first request
        wait_until(lambda: answers_http(port), 60, f"{command} to answer")
        wait_until(
            lambda: Instance.objects.filter(pk=inst.row().pk, lease_token__isnull=False).exists(),
            60,
            "the embedded worker to claim the instance",
        )
        server.send_signal(sig)
        server.wait(30)
        row = Instance.objects.get(pk=inst.row().pk)
        log.seek(0)
        assert row.lease_token is None, (
            f"{command} exited ({server.returncode}) leaving instance leased to "
            f"{row.lease_owner} until {row.lease_expires_at}: the next process waits out "
            f"the lease. log tail: {log.read()[-800:]}"
        )
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
        log.close()


def test_sigterm_to_runserver_releases_the_embedded_worker_s_leases(registered):
    """`manage.py runserver` runs the embedded worker (SPEC 4). A deploy/restart sends it
    SIGTERM. runworker drains (Worker.stop: park at the boundary or release the lease);
    the embedded worker is never stopped (embedded.py has no shutdown path, daphne only
    cancels its connections' application instances), so the instance it was running stays
    leased until the lease runs out, and the takeover counts toward the poison limit."""
    sigterm_leaves_no_lease("runserver", [EMBEDDED_BOOT, "127.0.0.1:{port}"], "embedded-mid-step")


def children(pid: int) -> list[int]:
    """The process ids of a process's children (Linux)."""
    with open(f"/proc/{pid}/task/{pid}/children") as listed:
        return [int(child) for child in listed.read().split()]


def start_reloading_runserver(
    tmp_path: Any, instance_id: str
) -> tuple[Any, Any, subprocess.Popen[str], Any, int]:
    """`manage.py runserver` as a developer runs it, with the autoreloader, and an instance
    of "fleet" whose first step (120 s) outlives the drain's grace (0.5 s), leases of 60 s.
    Returns the instance, the boot script, the server, its log and its port."""
    boot = tmp_path / "reloading_runserver.py"
    boot.write_text(
        "import sys, django; django.setup(); import tests.fleet_workflows\n"
        "from django.core.management import call_command\n"
        "call_command('runserver', sys.argv[1])\n"
    )
    fleet_workflows.ensure_ledger()
    inst = get_workflow("fleet").create(id=instance_id)
    server, log, port = start_server(
        [str(boot), "127.0.0.1:{port}"],
        PYTHONPATH=str(ROOT),  # a script's own folder is on sys.path, not the project's
        WFDASH_LEASE_SECONDS="60",
        FLEET_STEP_SECONDS="120",
        WFDASH_DRAIN_SECONDS="0.5",
    )
    return inst, boot, server, log, port


def stop_with_children(server: subprocess.Popen[str], log: Any) -> None:
    """Kill a reloading server still running, and its reloader's child, then close its log."""
    if server.poll() is None:
        for child in children(server.pid):
            os.kill(child, signal.SIGKILL)
        server.kill()
        server.wait(10)
    log.close()


@pytest.mark.parametrize("to", ["parent", "child"])
def test_sigterm_to_runserver_with_its_autoreloader_releases_the_embedded_worker_s_leases(
    registered, tmp_path, to
):
    """`manage.py runserver` as a developer runs it, with the autoreloader: the embedded
    worker is in the reloader's child, whose server runs in a thread without signal
    handlers. SIGTERM to the parent (the command started) ended its wait on the child in
    SystemExit, and subprocess.run then SIGKILLed the child; SIGTERM to the child ended
    its main thread. Either way the worker died mid-step, its lease held until it ran
    out. Now the parent passes SIGTERM on and waits; the child drains, then exits."""
    inst, _, server, log, port = start_reloading_runserver(tmp_path, f"reloading-{to}")
    try:
        wait_until(lambda: answers_http(port), 60, "runserver to answer")
        wait_until(
            lambda: Instance.objects.filter(pk=inst.row().pk, lease_token__isnull=False).exists(),
            60,
            "the embedded worker to claim the instance",
        )
        if to == "parent":
            server.send_signal(signal.SIGTERM)
        else:
            [child] = children(server.pid)
            os.kill(child, signal.SIGTERM)
        server.wait(30)
        row = Instance.objects.get(pk=inst.row().pk)
        log.seek(0)
        assert row.lease_token is None, (
            f"runserver exited ({server.returncode}) leaving the instance leased until "
            f"{row.lease_expires_at}. log tail: {log.read()[-1500:]}"
        )
        assert server.returncode == 0, server.returncode
    finally:
        stop_with_children(server, log)


def test_a_code_change_under_runserver_s_autoreloader_gives_the_embedded_worker_s_lease_back(
    registered, tmp_path
):
    """A file changed under `manage.py runserver`: Django's reloader ended the child
    (sys.exit(3) in its main thread) with the embedded worker mid-step, its lease held:
    the next child took the run only once the lease ran out (WFDASH_LEASE_SECONDS, 30 s
    by default), the takeover counted towards the poison limit. The child now drains its
    worker first, as at SIGTERM, and the next child takes the run at once."""
    inst, boot, server, log, port = start_reloading_runserver(tmp_path, "reloaded-mid-step")

    def leased_to() -> str | None:
        return Instance.objects.filter(pk=inst.row().pk).values_list("lease_owner", flat=True)[0]

    try:
        wait_until(lambda: answers_http(port), 60, "runserver to answer")
        wait_until(leased_to, 60, "the embedded worker to claim the instance")
        before = leased_to()
        edits = iter(range(1, 1000))

        def edited_and_seen() -> bool:
            # The reloader watches __main__'s file from its first look, which may come
            # after the server answers: edited until it says so, once.
            os.utime(boot, (time.time(), time.time() + next(edits)))
            log.seek(0)
            return f"{boot} changed, reloading." in log.read()

        wait_until(edited_and_seen, 30, "the reloader to see the edit", 0.5)
        # Well within the 60 s lease: the next child's worker takes the run at once.
        wait_until(lambda: leased_to() not in (None, before), 30, "the next child to take the run")
    except BaseException:
        log.seek(0)
        print(log.read()[-3000:])
        raise
    finally:
        stop_with_children(server, log)


# --- a rolling deploy: old and new workers side by side --------------------------------------


def run_as(loop_thread: LoopThread, worker: Any) -> None:
    loop_thread.call(worker.run_until_idle(timeout=10))


def test_an_old_worker_leaves_a_new_version_s_instance_to_the_live_new_worker(
    registered, loop_thread
):
    """New workers (v1 and v2) are up, old ones (v1 only) still serve. A v2 instance is not
    the old worker's to take: parked by it, it waited for a worker's restart while the new
    worker ran all along. A worker with its version takes it; one without only after the
    grace, then parks it to be looked at again, not for ever."""
    ran.clear()
    define_mixed(1)
    define_mixed(2)
    new = new_worker(concurrency=4)
    with testing.fake_clock() as clock:
        loop_thread.call(new.start())
        try:
            inst = get_workflow("deploy-mixed").create(id="made-by-new-web")
            assert inst.row().version == 2
            registry.unregister("deploy-mixed", 2)  # an old worker's process: v1 only
            old = new_worker(concurrency=4)
            loop_thread.call(old.start())
            run_as(loop_thread, old)
            row = inst.row()
            assert (row.status, row.lease_token, row.waiting_reason) == ("running", None, "")
            define_mixed(2)  # back in the new worker's process
            run_as(loop_thread, new)
            assert inst.status().output == "v2 code" and ran == ["v2"]

            # No worker with the version takes one for the grace: the old worker parks it,
            # and a worker with the version (live, not restarted) takes it at its recheck.
            late = get_workflow("deploy-mixed").create(id="no-taker")
            registry.unregister("deploy-mixed", 2)
            clock.advance(store.leases.FOREIGN_VERSION_GRACE)
            run_as(loop_thread, old)
            status = late.status()
            assert status.status == "waiting" and "not registered" in status.waiting_reason
            define_mixed(2)
            run_as(loop_thread, new)
            assert late.status().status == "waiting"  # not before its recheck
            clock.advance(store.leases.VERSION_RECHECK)
            run_as(loop_thread, new)
            assert late.status().output == "v2 code"
            loop_thread.call(old.stop(grace_seconds=0))
        finally:
            loop_thread.call(new.stop(grace_seconds=0))


def test_an_instance_of_a_version_no_worker_runs_any_more_is_looked_at_hourly(
    registered, loop_thread
):
    """A deploy removed a workflow's class (or renamed it, or dropped a version) while
    instances of it waited. Each was claimed and parked again every minute for good:
    3,000 such instances cost a worker about 7% of a core and the database 50 writes a
    second, measured, for as long as nobody deleted them. A version no worker has run
    for VERSION_LIVE is now looked at hourly; a worker that starts with it still wakes
    its instances at once. One whose workers are live (a rolling deploy) keeps the
    minute."""
    define_mixed(1)
    with testing.fake_clock() as clock:
        inst = get_workflow("deploy-mixed").create(id="orphaned")
        old = new_worker(concurrency=4)
        loop_thread.call(old.start())  # catalogs version 1 as deployed now
        loop_thread.call(old.stop(grace_seconds=0))
        registry.unregister("deploy-mixed", 1)  # the new release has no such class
        define_mixed(2)  # (but the workflow's name lives on)
        new = new_worker(concurrency=4)
        loop_thread.call(new.start())
        try:
            clock.advance(store.leases.FOREIGN_VERSION_GRACE)
            run_as(loop_thread, new)
            row = inst.row()
            assert "not registered" in row.waiting_reason
            assert row.wake_at == clock.now() + store.leases.VERSION_RECHECK  # v1 ran lately

            clock.advance(store.catalog.VERSION_LIVE)  # no worker with v1 since
            run_as(loop_thread, new)
            row = inst.row()
            assert (row.status, row.lease_token) == ("waiting", None)
            assert row.wake_at == clock.now() + store.catalog.ABSENT_VERSION_RECHECK
            assert "looked at again hourly" in row.waiting_reason, row.waiting_reason
            clock.advance(store.leases.VERSION_RECHECK + store.leases.FOREIGN_VERSION_GRACE)
            run_as(loop_thread, new)
            assert inst.row().wake_at == row.wake_at  # not taken again meanwhile

            define_mixed(1)  # a worker with version 1 starts: it runs it at once
            back = new_worker(concurrency=4)
            loop_thread.call(back.start())
            run_as(loop_thread, back)
            assert inst.status().output == "v1 code"
            loop_thread.call(back.stop(grace_seconds=0))
        finally:
            loop_thread.call(new.stop(grace_seconds=0))


def test_parking_a_pass_of_unrunnable_instances_costs_a_statement_each_and_one_look_up(
    registered,
):
    """park_unrunnable re-read each instance's workflow and version (the worker had them)
    and asked version_live for each: parking a claim pass of N instances of a version no
    worker runs cost 4N statements (12 instances: 48). Now the pass looks the versions up
    once (Worker._absent_of, in the claim's trip) and each park is one fenced UPDATE."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from workflows_app.engine.worker import Worker

    define_mixed(1)
    wf = get_workflow("deploy-mixed")

    def park_a_pass(count: int) -> int:
        Instance.objects.all().delete()
        handles = [wf.create(id=f"gone-{count}-{n}") for n in range(count)]
        registry.unregister("deploy-mixed", 1)  # a release without the class
        try:
            claimed = store.claim_and_load("parker", 50, 30).runs
            assert len(claimed) == count
            # One asked to pause while its step ran, before its worker died: it stays paused.
            paused_pk = claimed[0][0]
            Instance.objects.filter(pk=paused_pk).update(status="waitingForPause")
            with CaptureQueriesContext(connection) as queries:
                absent = Worker._absent_of(claimed)
                for pk, token, loaded in claimed:
                    key = (loaded.instance.workflow, loaded.instance.version)
                    store.park_unrunnable(
                        pk, token, "not here", store.VERSION_MISSING, key in absent
                    )
            assert absent == {("deploy-mixed", 1)}  # no worker ever ran it
        finally:
            define_mixed(1)
        for handle in handles:
            row = handle.row()
            assert (row.lease_token, row.lease_owner) == (None, "")
            assert row.waiting_reason.startswith(store.VERSION_MISSING + "not here; no worker")
            if row.pk == paused_pk:
                assert (row.status, row.wake_at) == ("paused", None)
            else:
                assert row.status == "waiting"
                assert row.wake_at == row.updated_at + store.catalog.ABSENT_VERSION_RECHECK
        return len(queries.captured_queries)

    assert park_a_pass(12) == 12 + 1
    assert park_a_pass(2) == 2 + 1


def test_a_park_whose_lease_was_lost_changes_nothing(registered):
    """The one-statement park is fenced by its lease, as the fence it replaced was."""
    define_mixed(1)
    inst = get_workflow("deploy-mixed").create(id="taken-over")
    [(pk, token, _)] = store.claim_and_load("parker", 5, 30).runs
    Instance.objects.filter(pk=pk).update(lease_token="another-run")
    store.park_unrunnable(pk, token, "not here", store.VERSION_MISSING, True)
    row = inst.row()
    assert (row.status, row.lease_token, row.waiting_reason) == ("running", "another-run", "")


def test_a_new_worker_leaves_an_in_flight_old_version_to_the_live_old_worker(
    registered, loop_thread
):
    """The other direction: the new code dropped version 1 while old workers still run v1
    instances in flight. The new worker does not take them from the old one."""
    ran.clear()
    define_mixed(1)
    with testing.fake_clock():
        inst = get_workflow("deploy-mixed").create(id="in-flight-v1")
        old = new_worker(concurrency=4)
        loop_thread.call(old.start())
        try:
            registry.unregister("deploy-mixed", 1)
            define_mixed(2)  # the new worker's process: v2 only
            fresh = new_worker(concurrency=4)
            loop_thread.call(fresh.start())
            run_as(loop_thread, fresh)
            loop_thread.call(fresh.stop(grace_seconds=0))
            assert inst.row().lease_token is None and not inst.status().waiting_reason
            registry.unregister("deploy-mixed", 2)
            define_mixed(1)  # back in the old worker's process
            run_as(loop_thread, old)
            assert inst.status().output == "v1 code" and ran == ["v1"]
        finally:
            loop_thread.call(old.stop(grace_seconds=0))


def test_an_idle_worker_waits_out_another_version_s_grace_instead_of_polling(
    registered, loop_thread
):
    """A serving worker whose only due instance is another version's cannot claim it for
    FOREIGN_VERSION_GRACE. Its idle wait runs until the grace ends (it looked again every
    CONTENDED_WAIT_SECONDS, 500 claims in the 10 s), then it takes and parks the instance."""
    define_mixed(1)
    define_mixed(2)
    with testing.fake_clock() as clock:
        inst = get_workflow("deploy-mixed").create(id="theirs")
        registry.unregister("deploy-mixed", 2)  # an old worker's process: v1 only
        worker = new_worker(concurrency=4, poll_seconds=3600)
        stop = asyncio.Event()
        serving = loop_thread.spawn(worker.serve(stop))
        try:
            grace_ends = inst.row().wake_at + store.leases.FOREIGN_VERSION_GRACE

            def idle_until(at: Any) -> bool:
                waiting_until = worker._waiting_until
                return waiting_until is not None and not worker.tasks and waiting_until >= at

            wait_until(lambda: idle_until(grace_ends), 20, "the idle wait to last the grace")
            assert inst.row().lease_token is None
            clock.advance(store.leases.FOREIGN_VERSION_GRACE)
            wait_until(
                lambda: "not registered" in inst.status().waiting_reason,
                20,
                "the worker to take and park the instance after the grace",
            )
        finally:
            loop_thread.loop.call_soon_threadsafe(stop.set)
            serving.result(30)


DAPHNE_BOOT = (
    "import sys, django; django.setup(); import tests.fleet_workflows; "
    "from daphne.cli import CommandLineInterface; "
    "CommandLineInterface().run(['-b', '127.0.0.1', '-p', sys.argv[1], 'wfdash.asgi:application'])"
)


def test_sigterm_to_daphne_releases_the_embedded_worker_s_leases(registered):
    """The README's production command is `daphne … wfdash.asgi:application`; without
    REDIS_URL that process runs the embedded worker too (started by the first request).
    A deploy's SIGTERM must drain it as it drains runserver's, not strand its leases."""
    sigterm_leaves_no_lease("daphne", [DAPHNE_BOOT, "{port}"], "daphne-mid-step")


def test_sighup_to_daphne_drains_the_embedded_worker_too(registered):
    """Twisted stops on SIGTERM and SIGINT only: SIGHUP (the terminal or ssh session that
    started daphne closed) killed it mid-step with the lease held until it ran out."""
    sigterm_leaves_no_lease("daphne", [DAPHNE_BOOT, "{port}"], "daphne-hung-up", signal.SIGHUP)


def sigterm_ends_a_spinning_embedded_worker(
    command: str, boot: list[str], sig: signal.Signals = signal.SIGTERM
) -> None:
    """A server whose embedded worker runs a run() spinning without an await: the event
    loop (daphne's, Twisted's reactor runs on it) is held, so the reactor's own signal
    handling, which only schedules a stop on that loop, never acts. The signal must
    still reach the worker's LoopWatch, which gives the lease back and ends the process
    (STUCK_EXIT_CODE) once the drain's bound is over, as it does for runworker."""
    fleet_workflows.ensure_ledger()
    inst = get_workflow("trouble-spins").create()
    server, log, port = start_server(boot, WFDASH_LEASE_SECONDS="3", WFDASH_DRAIN_SECONDS="0.5")

    def logged() -> str:
        log.seek(0)
        return log.read()

    request = None
    try:
        # The request starts the embedded worker; its answer may never come, since the
        # worker's spinning run() can take the loop before the page is sent.
        request = wait_until(lambda: send_http_request(port), 60, f"{command} to listen")
        wait_until(lambda: fleet_workflows.ledger_rows(), 60, "the step before the spin")
        wait_until(lambda: "its event loop has not answered" in logged(), 30, "the stall report")
        started = time.monotonic()
        server.send_signal(sig)
        try:
            code = server.wait(0.5 + ABORT_WAIT_SECONDS + 10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{command} went on spinning after {sig.name}; log: {logged()[-1500:]}")
        took = time.monotonic() - started
        assert code == STUCK_EXIT_CODE, logged()[-2000:]
        assert took < 0.5 + ABORT_WAIT_SECONDS + 5, took
        pk = inst.row().pk
        text = logged()
        assert f"{sig.name} received" in text and f"by the run of instance #{pk}" in text, text
        row = Instance.objects.get(pk=pk)
        assert (row.lease_token, row.lease_owner) == (None, "")
    finally:
        if request is not None:
            request.close()
        if server.poll() is None:
            server.kill()
            server.wait(10)
        log.close()


def test_a_second_signal_to_runserver_cuts_the_embedded_worker_s_drain_short(registered):
    """Ctrl-C twice (or SIGTERM then SIGINT) to a server whose embedded worker runs a long
    step: the second signal only asked Twisted's stopping reactor to stop again, and
    the drain waited out its whole grace (WFDASH_DRAIN_SECONDS) first. It now cuts the
    runs short at once, as runworker's second signal does, their leases released."""
    fleet_workflows.ensure_ledger()
    inst = get_workflow("fleet").create(id="hurried")
    server, log, port = start_server(
        [EMBEDDED_BOOT, "127.0.0.1:{port}"],
        WFDASH_LEASE_SECONDS="60",
        FLEET_STEP_SECONDS="120",
        WFDASH_DRAIN_SECONDS="60",
    )
    try:
        wait_until(lambda: answers_http(port), 60, "runserver to answer")
        wait_until(
            lambda: Instance.objects.filter(pk=inst.row().pk, lease_token__isnull=False).exists(),
            60,
            "the embedded worker to claim the instance",
        )
        started = time.monotonic()
        server.send_signal(signal.SIGTERM)
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            log.seek(0)
            pytest.fail(f"runserver waited out the drain's grace; log: {log.read()[-1500:]}")
        assert time.monotonic() - started < 20
        row = Instance.objects.get(pk=inst.row().pk)
        assert (row.lease_token, row.lease_owner) == (None, "")
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
        log.close()


def test_sigterm_to_runserver_whose_embedded_run_spins_gives_its_lease_back_and_exits(registered):
    sigterm_ends_a_spinning_embedded_worker("runserver", [EMBEDDED_BOOT, "127.0.0.1:{port}"])


def test_sigterm_to_daphne_whose_embedded_run_spins_gives_its_lease_back_and_exits(registered):
    sigterm_ends_a_spinning_embedded_worker("daphne", [DAPHNE_BOOT, "{port}"])


def test_sighup_to_daphne_whose_embedded_run_spins_ends_it_too(registered):
    sigterm_ends_a_spinning_embedded_worker("daphne", [DAPHNE_BOOT, "{port}"], signal.SIGHUP)


def test_sigterm_to_daphne_whose_database_is_unreachable_ends_it_at_once(registered):
    """daphne with the embedded worker, PostgreSQL down (a deploy where the database
    restarts too): the worker's look for migrations waited the pool's 30 s, took the
    failure for 'migrated', and its start-up retried for a quarter of an hour, a
    traceback every 30 s; SIGTERM waited for all of it (still running 90 s after it).
    It now says once why it waits, and a stop signal ends the server at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    server, log, port = start_server(
        [DAPHNE_BOOT, "{port}"], DATABASE_URL=f"postgres://wf:pw@127.0.0.1:{closed}/nowhere"
    )

    def logged() -> str:
        log.seek(0)
        return log.read()

    try:
        wait_until(lambda: answers_http(port), 60, "daphne to answer")  # starts the worker
        wait_until(lambda: "waits: cannot connect" in logged(), 30, "the worker to say why")
        started = time.monotonic()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"daphne still running 20 s after SIGTERM; log: {logged()[-1500:]}")
        assert time.monotonic() - started < 10
        text = logged()
        assert text.count("waits: cannot connect to the database (DATABASE_URL) at") == 1, text
        assert "Traceback" not in text and ":pw@" not in text, text[-2000:]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
        log.close()


# --- a rollout that drops a flow limit -------------------------------------------------------


def define_limited(limited: bool) -> None:
    """deploy-limit v1 as the previous release declares it (at most one at a time), or v1
    and v2 as the new release does: v2 dropped the limit, the workflow's flow limits are
    its newest version's."""

    @register("deploy-limit", version=1, limits={"max_concurrent_instances": 1})
    class LimitV1(WorkflowEntrypoint):
        async def run(self, event, step):
            return (await step.wait_for_event("go", type="go", timeout="1 day")).payload

    if not limited:

        @register("deploy-limit", version=2)
        class LimitV2(WorkflowEntrypoint):
            async def run(self, event, step):
                return (await step.wait_for_event("go", type="go", timeout="1 day")).payload


def test_what_the_previous_release_queued_under_a_limit_the_new_one_dropped_starts(
    registered, loop_thread
):
    """The new release dropped max_concurrent_instances; a web process of the previous
    release, still serving, queued a create behind an instance holding its one place,
    after the new worker had started. Under no flow control the new worker admitted at no
    end and at no admission time: the instance stayed queued until a worker restarted."""
    define_limited(True)  # the previous release's process
    new = new_worker(concurrency=4)
    with testing.fake_clock():
        loop_thread.call(new.start())
        try:
            workflow = get_workflow("deploy-limit")
            holder = workflow.create(id="holder")
            behind = workflow.create(id="queued-by-old-web")
            assert behind.row().status == "queued"
            define_limited(False)  # the new release, in the new worker's process
            run_as(loop_thread, new)
            assert behind.row().status == "waiting"  # started: waiting for its event
            holder.send_event("go", 1)
            behind.send_event("go", 2)
            run_as(loop_thread, new)
            assert (holder.status().output, behind.status().output) == (1, 2)
        finally:
            loop_thread.call(new.stop(grace_seconds=0))


def test_a_worker_whose_connection_drops_during_its_start_up_checks_starts_all_the_same(
    registered, caplog
):
    """A fleet's backends ended (a restart, a failover) while a worker was still checking
    the database at start: its worker exited 1 on the traceback. The checks now begin
    again on a new connection; a database that keeps dropping it is a CommandError."""
    from django.core.management.base import CommandError
    from django.db import connection

    from workflows_app.engine import faults
    from workflows_app.management.commands import runworker
    from workflows_app.schema import START_CHECK_TRIES

    @register("checked-at-start")
    class CheckedAtStart(WorkflowEntrypoint):
        async def run(self, event, step):
            return "ok"

    try:
        # The server ends the checks' connection under them (SQLite: an OperationalError).
        faults.configure("start_checks=terminate_backend@1")
        with caplog.at_level("WARNING", logger=runworker.log.name):
            runworker.start_checks()
        [warning] = warnings_said(caplog)  # psycopg's pool says nothing of its own
        assert warning.startswith(
            "wfdash worker: the database dropped the connection during the start-up checks ("
        ), warning
        assert WorkflowVersion.objects.filter(name="checked-at-start").exists()  # synced
        faults.configure(f"start_checks=terminate_backend@1-{START_CHECK_TRIES}")
        with pytest.raises(CommandError, match=f"dropped the connection {START_CHECK_TRIES} times"):
            runworker.start_checks()
    finally:
        faults.configure("")
        connection.close()


def end_this_thread_s_connection_from_another() -> None:
    """PostgreSQL ends this thread's open connection, as a failover or a restart ends a
    pooled one: the next statement on it fails. Waits until the backend is gone."""
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: the fault is pg_terminate_backend")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        [pid] = cursor.fetchone()
    with connection.Database.connect(**connection.get_connection_params()) as other:
        ended = other.execute("SELECT pg_terminate_backend(%s, 5000)", [pid]).fetchone()
    assert ended == (True,)


def warnings_said(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Every warning the process wrote, whoever's logger (psycopg's pool warns when it
    discards a connection the server ended)."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def define_changed_under_version_1() -> None:
    """A workflow whose code changed under version 1, as another release stored it."""
    from workflows_app.engine import clock

    @register("changed-at-start")
    class ChangedAtStart(WorkflowEntrypoint):
        async def run(self, event, step):
            return "this release's code"

    now = clock.now()
    WorkflowVersion.objects.create(
        name="changed-at-start",
        version=1,
        source_hash="0" * 64,  # another release's code
        class_path="elsewhere.ChangedAtStart",
        registered_at=now,
        last_seen_at=now,
    )


def test_daphne_and_runserver_refuse_changed_code_when_the_database_drops_the_check_s_connection(
    registered, settings
):
    """daphne (wfdash/asgi.py) and runserver check the catalog before they serve
    (changed_versions): a connection the server had ended (a failover, a restart during a
    deploy) was taken for a database that could not say yet, so a workflow whose code
    changed under a stored version was served without its engine, refused later in a
    CRITICAL line. The check now begins again on a new connection."""
    from django.db import connection

    from workflows_app import embedded

    settings.WFDASH = {**settings.WFDASH, "EMBEDDED_WORKER": True}
    define_changed_under_version_1()
    try:
        end_this_thread_s_connection_from_another()
        assert (embedded.changed_versions() or "").startswith(
            "workflow 'changed-at-start' version 1 is already registered with different"
        )
    finally:
        connection.close()


def test_the_embedded_worker_s_start_check_says_a_dropped_connection_in_one_line(
    registered, settings, caplog
):
    """The check daphne and runserver make begins again with runworker's helper: one
    warning line a try; a database that keeps dropping the connection refuses the start,
    in one line."""
    from django.db import connection

    from workflows_app import embedded
    from workflows_app.engine import faults
    from workflows_app.schema import START_CHECK_TRIES

    settings.WFDASH = {**settings.WFDASH, "EMBEDDED_WORKER": True}
    define_changed_under_version_1()
    try:
        # The server ends the check's connection under it (SQLite: an OperationalError).
        faults.configure("start_checks=terminate_backend@1")
        with caplog.at_level("WARNING", logger=embedded.log.name):
            assert (embedded.changed_versions() or "").startswith(
                "workflow 'changed-at-start' version 1 is already registered with different"
            )
        [warning] = warnings_said(caplog)
        assert warning.startswith(
            "embedded wfdash worker: the database dropped the connection during the "
            "start-up checks ("
        ), warning
        faults.configure(f"start_checks=terminate_backend@1-{START_CHECK_TRIES}")
        assert (embedded.changed_versions() or "").startswith(
            f"the database dropped the connection {START_CHECK_TRIES} times during the "
            "embedded wfdash worker's start-up checks: "
        )
    finally:
        faults.configure("")
        connection.close()


def test_runserver_s_migration_check_begins_again_when_the_database_drops_its_connection(
    registered, caplog
):
    """runserver's start looks for unapplied migrations (Django's check_migrations): a
    connection the server had ended (a failover, a restart) ended the start on the
    traceback. It now begins again on a new connection, saying so in one warning line."""
    from django.db import connection

    from workflows_app.management.commands.runserver import Command

    try:
        end_this_thread_s_connection_from_another()
        with caplog.at_level("WARNING", logger="workflows_app.engine"):
            Command().check_migrations()
        [warning] = warnings_said(caplog)
        assert warning.startswith(
            "runserver: the database dropped the connection during the start-up checks ("
        ), warning
    finally:
        connection.close()


def test_a_worker_started_just_after_a_failover_says_each_dropped_connection_in_one_line(
    registered, loop_thread, caplog
):
    """A failover ends every connection psycopg's pool holds idle: the engine's start
    (runworker's, and the embedded worker's under daphne or runserver) took them one
    after the other and started all the same, but logged each as a WARNING with its
    traceback. Each is one line now."""
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: the fault is pg_terminate_backend")

    def use_a_pooled_connection() -> None:
        connection.ensure_connection()
        connection.close()  # back to the pool, idle

    borrowers = [threading.Thread(target=use_a_pooled_connection) for _ in range(2)]
    for borrower in borrowers:
        borrower.start()
    for borrower in borrowers:
        borrower.join()
    # The pool's idle connections, and only them: the process's other connections (a
    # history listener an earlier test started, say) are no part of this start, and one
    # ended meanwhile would speak of it in this test's log, or fail a later test.
    pool = connection.pool
    idle = [pool.getconn() for _ in range(pool.get_stats().get("pool_available", 0))]
    pids = [held.info.backend_pid for held in idle]
    for held in idle:
        pool.putconn(held)
    assert len(pids) >= 2, pids
    with connection.Database.connect(**connection.get_connection_params()) as other:
        [ended] = other.execute(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 5000)) "
            "FROM unnest(CAST(%s AS integer[])) AS pid",
            [pids],
        ).fetchone()
    assert ended == len(pids)
    worker = new_worker()
    with caplog.at_level("WARNING", logger="workflows_app.engine"):
        loop_thread.call(worker.start())
    try:
        said = [r for r in caplog.records if r.name.startswith("workflows_app")]
        assert said, "the pool gave the start no connection the failover had ended"
        for record in said:
            assert not record.exc_info, record.getMessage()
            assert record.getMessage().startswith(
                f"worker {worker.worker_id}: database error at start (terminating connection "
                "due to administrator command); retrying"
            ), record.getMessage()
    finally:
        loop_thread.call(worker.stop(grace_seconds=0))
        connection.close()
        pool.check()  # any ended connection the start left idle goes: later tests get live ones
