"""The Django tasks backend: every @task a durable one-step instance of its own workflow.

Runs on Django 5.2 with the django-tasks backport and on Django 6 with django.tasks;
workflows_app.tasks exports the names of whichever is installed.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from django.test import override_settings

from tests.polling import wait_until
from tests.test_worker_operations import LoopThread
from workflows_app import surfaces, testing
from workflows_app.engine import registry
from workflows_app.engine.worker import Worker
from workflows_app.live import EngineHooks
from workflows_app.models import Instance
from workflows_app.tasks import (
    InvalidTask,
    TaskResultDoesNotExist,
    TaskResultMismatch,
    TaskResultStatus,
    task,
    task_status,
    wfdash_priority,
)

pytestmark = pytest.mark.django_db(transaction=True)

START = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def tasks(registered):
    """The test tasks; their workflows are unregistered after the test like any other."""
    from tests import task_functions

    task_functions.GATE.clear()
    return task_functions


def test_enqueue_creates_an_instance_of_the_task_s_own_workflow_and_get_result_reads_it(tasks):
    result = tasks.add.enqueue(2, 3)
    assert result.status == TaskResultStatus.READY
    assert (result.args, result.kwargs) == ([2, 3], {})
    row = Instance.objects.get(instance_id=result.id)
    assert row.workflow == "task:tests.task_functions.add"
    assert row.workflow in surfaces.workflow_names()  # the dashboard lists it like any workflow
    assert tasks.add.get_result(result.id).status == TaskResultStatus.READY
    testing.run_until_idle()
    done = tasks.add.get_result(result.id)
    assert done.status == TaskResultStatus.SUCCESSFUL
    assert done.return_value == 5
    assert done.is_finished and done.finished_at is not None and done.started_at is not None
    assert done.attempts == 1 and done.worker_ids == ["testing"]
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 5


def test_a_task_that_raises_fails_once_with_django_s_error_record(tasks):
    result = tasks.explode.enqueue("boom <b>")
    testing.run_until_idle()
    failed = tasks.explode.get_result(result.id)
    assert failed.status == TaskResultStatus.FAILED
    [error] = failed.errors
    assert error.exception_class_path == "builtins.ValueError"
    assert error.exception_class is ValueError
    assert "boom <b>" in error.traceback
    with pytest.raises(ValueError, match="failed"):
        failed.return_value  # noqa: B018  (raises for a failed task, as Django's property does)
    [step] = Instance.objects.get(instance_id=result.id).steps.all()
    assert step.attempts == 1  # Django tasks run once: no engine retries by default


RETRYING_TASKS = {
    "default": {
        "BACKEND": "workflows_app.tasks.WorkflowTaskBackend",
        "OPTIONS": {"retries": {"limit": 1, "delay": 0}},
    }
}


@pytest.mark.parametrize("options", [{}, RETRYING_TASKS["default"]["OPTIONS"]])
def test_a_task_s_own_exception_is_named_by_an_importable_path_with_or_without_retries(
    tasks, options
):
    backend = {"BACKEND": "workflows_app.tasks.WorkflowTaskBackend", "OPTIONS": options}
    with override_settings(TASKS={"default": backend}):
        result = tasks.decline.enqueue(7)
        testing.run_until_idle()
        [error] = tasks.decline.get_result(result.id).errors
    assert error.exception_class_path == "tests.task_functions.PaymentDeclined"
    assert error.exception_class is tasks.PaymentDeclined
    assert "order 7 declined" in error.traceback


def test_an_error_the_engine_raises_around_the_task_is_named_by_an_importable_path(tasks):
    from workflows_app.engine.errors import StepOutputError

    result = tasks.not_a_number.enqueue()
    testing.run_until_idle()
    [error] = tasks.not_a_number.get_result(result.id).errors
    assert error.exception_class is StepOutputError


# A backend whose OPTIONS retry a failed task once, a minute later.
RETRY_ONCE = {
    "BACKEND": "workflows_app.tasks.WorkflowTaskBackend",
    "OPTIONS": {"retries": {"limit": 1, "delay": "1 minute"}},
}


def test_each_attempt_counts_when_options_retry_the_task(tasks):
    with override_settings(TASKS={"default": RETRY_ONCE}), testing.fake_clock(START) as clock:
        result = tasks.fail_first_attempt.enqueue()
        testing.run_until_idle()
        clock.advance("1 minute")
        testing.run_until_idle()
        done = tasks.fail_first_attempt.get_result(result.id)
    assert done.return_value == 2  # context.attempt counted the first, failed attempt
    assert done.attempts == 2 and done.worker_ids == ["testing", "testing"]
    assert done.started_at < START + timedelta(minutes=1) <= done.last_attempted_at


def test_a_task_waiting_for_its_retry_is_ready_again(tasks):
    with override_settings(TASKS={"default": RETRY_ONCE}), testing.fake_clock(START) as clock:
        result = tasks.fail_first_attempt.enqueue()
        testing.run_until_idle()
        waiting = tasks.fail_first_attempt.get_result(result.id)
        assert Instance.objects.get(instance_id=result.id).status == "waiting"
        clock.advance("1 minute")
        testing.run_until_idle()
        done = tasks.fail_first_attempt.get_result(result.id)
    assert waiting.status == TaskResultStatus.READY  # Django: "ready to be executed again"
    assert waiting.attempts == 1
    assert done.status == TaskResultStatus.SUCCESSFUL


def test_attempts_retried_within_one_run_count_each(tasks):
    """A retry due at once is made in the run that failed (no new run.started)."""
    with override_settings(TASKS=RETRYING_TASKS):
        result = tasks.fail_first_attempt.enqueue()
        testing.run_until_idle()
        done = tasks.fail_first_attempt.get_result(result.id)
    assert done.return_value == 2
    assert done.attempts == 2 and done.worker_ids == ["testing", "testing"]


def test_a_task_enqueued_on_another_backend_runs_with_that_backend_s_options(tasks):
    backends = {
        "default": {"BACKEND": "workflows_app.tasks.WorkflowTaskBackend"},
        "retrying": RETRYING_TASKS["default"],
    }
    with override_settings(TASKS=backends):
        on_retrying = tasks.fail_first_attempt.using(backend="retrying")
        result = on_retrying.enqueue()
        testing.run_until_idle()
        done = on_retrying.get_result(result.id)
    assert done.return_value == 2  # retried, as the "retrying" backend's OPTIONS say
    assert done.backend == "retrying"


def test_task_started_and_task_finished_are_sent_around_the_call(tasks):
    from workflows_app.tasks import task_finished, task_started

    heard = []

    def started(sender, task_result, **kwargs):
        heard.append(("started", task_result.task.name, task_result.status, task_result.attempts))

    def finished(sender, task_result, **kwargs):
        outcome = (
            task_result.return_value
            if task_result.status == TaskResultStatus.SUCCESSFUL
            else [error.exception_class for error in task_result.errors]
        )
        heard.append(("finished", task_result.task.name, task_result.status, outcome))

    task_started.connect(started)
    task_finished.connect(finished)
    try:
        tasks.add.enqueue(2, 3)
        testing.run_until_idle()
        tasks.explode.enqueue("boom")
        testing.run_until_idle()
    finally:
        task_started.disconnect(started)
        task_finished.disconnect(finished)
    assert heard == [
        ("started", "add", TaskResultStatus.RUNNING, 1),
        ("finished", "add", TaskResultStatus.SUCCESSFUL, 5),
        ("started", "explode", TaskResultStatus.RUNNING, 1),
        ("finished", "explode", TaskResultStatus.FAILED, [ValueError]),
    ]


def test_task_finished_is_sent_once_for_a_retried_task_by_its_last_attempt(tasks):
    from workflows_app.tasks import task_finished

    heard = []

    def finished(sender, task_result, **kwargs):
        heard.append((task_result.status, task_result.attempts))

    task_finished.connect(finished)
    try:
        with override_settings(TASKS=RETRYING_TASKS):
            tasks.fail_first_attempt.enqueue()
            tasks.decline.enqueue(1)
            testing.run_until_idle()
    finally:
        task_finished.disconnect(finished)
    assert sorted(heard) == [(TaskResultStatus.FAILED, 2), (TaskResultStatus.SUCCESSFUL, 2)]


def test_system_checks_report_backend_options_the_worker_could_not_use():
    from workflows_app.tasks import task_backends

    broken = {
        "BACKEND": "workflows_app.tasks.WorkflowTaskBackend",
        "OPTIONS": {"retries": 3, "timeout": "10 minuets", "retry": {}},
    }
    with override_settings(TASKS={"default": RETRYING_TASKS["default"], "broken": broken}):
        assert task_backends["default"].check() == []
        messages = [message.msg for message in task_backends["broken"].check()]
    assert messages == [
        "TASKS['broken']: unknown option(s) ['retry']; use retries, timeout",
        "TASKS['broken']: \"retries\" must be a dict of limit, delay, backoff, got 3",
        'TASKS[\'broken\']: "timeout": invalid duration "10 minuets": unknown unit "minuets"',
    ]


def test_run_after_delays_the_task_durably_on_the_engine_clock(tasks):
    with testing.fake_clock(START) as clock:
        result = tasks.add.using(run_after=START + timedelta(hours=1)).enqueue(1, 1)
        testing.run_until_idle()
        assert tasks.add.get_result(result.id).status == TaskResultStatus.READY
        assert Instance.objects.get(instance_id=result.id).status == "waiting"
        clock.advance("1 hour")
        testing.run_until_idle()
        done = tasks.add.get_result(result.id)
    assert done.status == TaskResultStatus.SUCCESSFUL and done.return_value == 2
    assert done.started_at >= START + timedelta(hours=1)
    assert done.task.run_after == START + timedelta(hours=1)


def test_priority_maps_to_the_instance_priority_scale():
    assert [wfdash_priority(p) for p in (100, 50, 0, -50, -100)] == [0, 2, 5, 8, 9]


def test_priority_is_kept_with_the_task_and_passed_to_its_instance(tasks):
    result = tasks.urgent.enqueue("now")
    assert result.task.priority == 50
    row = Instance.objects.get(instance_id=result.id)
    assert row.params["priority"] == 50
    assert row.priority == wfdash_priority(50) == 2
    assert tasks.urgent.get_result(result.id).task.priority == 50


def test_invalid_tasks_are_refused_as_django_defines_them(tasks):
    with pytest.raises(InvalidTask, match="priority"):
        tasks.add.using(priority=1000)
    with pytest.raises(InvalidTask, match="module level"):

        @task
        def local_function() -> None:  # pragma: no cover - refused before it could run
            pass

    with pytest.raises(InvalidTask, match="aware"):
        tasks.add.using(run_after=datetime(2030, 1, 1))
    with pytest.raises(InvalidTask, match="Queue 'elsewhere'"):
        tasks.add.using(queue_name="elsewhere")
    with pytest.raises(InvalidTask, match="JSON-serialisable"):
        tasks.add.enqueue(object(), 1)
    assert not Instance.objects.exists()


def test_unknown_and_mismatched_result_ids_are_refused(tasks):
    with pytest.raises(TaskResultDoesNotExist):
        tasks.add.get_result("no-such-result")
    result = tasks.add.enqueue(1, 2)
    with pytest.raises(TaskResultMismatch):
        tasks.urgent.get_result(result.id)


def test_async_tasks_and_the_async_api(tasks):
    async def scenario():
        result = await tasks.async_double.aenqueue(21)
        await testing.arun_until_idle()
        return await tasks.async_double.aget_result(result.id)

    done = asyncio.run(scenario())
    assert done.status == TaskResultStatus.SUCCESSFUL and done.return_value == 42


def test_a_task_taking_context_gets_its_running_result(tasks):
    result = tasks.with_context.enqueue(x=7)
    testing.run_until_idle()
    done = tasks.with_context.get_result(result.id)
    assert done.return_value == {"id": result.id, "status": "RUNNING", "x": 7}
    assert done.kwargs == {"x": 7}


def test_tasks_use_the_database_in_their_step(tasks):
    from django.contrib.auth.models import Group

    result = tasks.create_group.enqueue("editors")
    testing.run_until_idle()
    assert (
        tasks.create_group.get_result(result.id).return_value
        == Group.objects.get(name="editors").pk
    )


def test_a_worker_that_never_imported_the_task_runs_it(tasks):
    result = tasks.add.enqueue(20, 22)
    registry.unregister("task:tests.task_functions.add")  # as in a worker process of its own
    testing.run_until_idle()
    assert tasks.add.get_result(result.id).return_value == 42


def test_the_status_is_running_while_the_task_runs(tasks):
    result = tasks.block_until_released.enqueue()
    loop_thread = LoopThread()
    worker = Worker(worker_id="tasks", hooks=EngineHooks())
    stop = asyncio.Event()
    serving = loop_thread.spawn(worker.serve(stop))
    try:
        wait_until(
            lambda: (
                tasks.block_until_released.get_result(result.id).status == TaskResultStatus.RUNNING
            ),
            20,
            "the task to be running",
        )
        tasks.GATE.set()
        wait_until(
            lambda: tasks.block_until_released.get_result(result.id).is_finished,
            20,
            "the task to finish",
        )
    finally:
        tasks.GATE.set()
        loop_thread.loop.call_soon_threadsafe(stop.set)
        serving.result(30)
        loop_thread.close()
    assert tasks.block_until_released.get_result(result.id).return_value == "released"


def test_a_terminated_task_is_failed(tasks):
    from workflows_app.client import get_workflow

    result = tasks.add.enqueue(1, 2)
    get_workflow("task:tests.task_functions.add").get(result.id).terminate()
    row = Instance.objects.get(instance_id=result.id)
    assert task_status(row, None) == TaskResultStatus.FAILED
    assert tasks.add.get_result(result.id).status == TaskResultStatus.FAILED


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        (None, "its params are NoneType, not an enqueue's object"),
        ({}, 'its params have no "args" list and "kwargs" object'),
        ({"args": [1, 2]}, 'its params have no "args" list and "kwargs" object'),
        ({"args": 5, "kwargs": {}}, 'its params have no "args" list and "kwargs" object'),
        (
            {"args": [1, 2], "kwargs": {}, "run_after": "soon"},
            "its \"run_after\" 'soon' is not an ISO 8601 date and time",
        ),
    ],
)
def test_an_instance_of_a_task_s_workflow_not_made_by_enqueue_fails_saying_so(
    tasks, params, problem
):
    """Started as a workflow (the dashboard's create, `wf start`, the API) with params
    that are not an enqueue's: it failed with a bare KeyError or AttributeError, and
    get_result raised the same instead of Django's TaskResultDoesNotExist."""
    from workflows_app.client import get_workflow

    tasks.add.get_backend().validate_task(tasks.add)  # registers its workflow
    handle = get_workflow("task:tests.task_functions.add").create(params)
    testing.run_until_idle()
    row = Instance.objects.get(instance_id=handle.id)
    assert (row.status, row.error_name) == ("errored", "InvalidTask")
    assert row.error_message == (
        f"not a task enqueued by Django's tasks framework: {problem}. Start "
        "tests.task_functions.add with its enqueue() (or aenqueue()), not as a workflow instance"
    )
    with pytest.raises(TaskResultDoesNotExist, match="not a task enqueued"):
        tasks.add.get_result(handle.id)


def test_a_task_name_outside_the_project_imports_nothing(tasks, client):
    """A client names the workflow: `task:<path>` imported any module on the server's path
    (with whatever it does when imported) before finding it was no task."""
    import sys

    from workflows_app import tokens
    from workflows_app.client import get_workflow
    from workflows_app.engine.errors import UnknownWorkflow

    probe = "tests.import_probe"
    assert probe not in sys.modules
    with pytest.raises(UnknownWorkflow):
        get_workflow(f"task:{probe}.IMPORTED")
    _, raw = tokens.issue("probe")
    answer = client.get(
        f"/api/workflows/task:{probe}.IMPORTED/instances", HTTP_AUTHORIZATION=f"Bearer {raw}"
    )
    assert answer.status_code == 404, answer.content
    assert probe not in sys.modules
    # A task of the project's own modules still resolves (tests.task_functions is imported).
    assert get_workflow("task:tests.task_functions.add").name == "task:tests.task_functions.add"
