"""A durable backend for Django's tasks framework (`django.tasks`, or the `django-tasks`
backport on Django 5.2):

    TASKS = {"default": {"BACKEND": "workflows_app.tasks.WorkflowTaskBackend"}}

Every `@task` becomes a workflow of its own, `task:<module path>`, whose one step calls the
function; `enqueue()` creates an instance of it (its id is the result id), `run_after`
makes the instance sleep durably until then, and `get_result()` reads the instance back
with Django's statuses. So tasks run on wfdash's workers, survive restarts and show in the
dashboard like any workflow.

OPTIONS: "retries" (step retries, default {"limit": 0}: Django tasks run once) and
"timeout" (a duration, default the engine's step timeout).
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import sys
import traceback
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.apps import apps
from django.conf import settings
from django.core import checks
from django.utils.module_loading import import_string

from .engine import NonRetryableError, WorkflowEntrypoint, clock, register, registry
from .engine import errors as engine_errors
from .engine.durations import parse_duration
from .engine.errors import InvalidDuration, StepRaised, shown
from .engine.limits import BACKOFFS, MAX_RETRY_LIMIT
from .engine.step import current_step
from .models import HistoryRecord, Instance, Status, StepRecord, StepStatus

try:  # Django >= 6.0
    from django.tasks import task, task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import Task, TaskContext, TaskError, TaskResult, TaskResultStatus
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist, TaskResultMismatch
    from django.tasks.signals import task_enqueued, task_finished, task_started
    from django.utils.json import normalize_json
except ImportError:  # Django 5.2: the backport
    from django_tasks import task, task_backends
    from django_tasks.backends.base import BaseTaskBackend
    from django_tasks.base import Task, TaskContext, TaskError, TaskResult, TaskResultStatus
    from django_tasks.exceptions import InvalidTaskError as InvalidTask
    from django_tasks.exceptions import TaskResultDoesNotExist, TaskResultMismatch
    from django_tasks.signals import task_enqueued, task_finished, task_started
    from django_tasks.utils import normalize_json

__all__ = [
    "InvalidTask",
    "Task",
    "TaskResult",
    "TaskResultDoesNotExist",
    "TaskResultMismatch",
    "TaskResultStatus",
    "WorkflowTaskBackend",
    "task",
    "task_enqueued",
    "task_finished",
    "task_started",
]

PREFIX = "task:"
STEP = "run"  # the name of the step that calls the task function
WAIT = "run_after"  # the sleep before it, when the task was enqueued with run_after

# Django's priorities run from -100 to 100 (higher first, default 0); wfdash's from 0 to 9
# (lower first, default 5): 0 maps to 5, 100 to 0, -100 to 9.
DJANGO_TO_WFDASH_PRIORITY_STEP = 20
MAX_QUEUE_NAME = Instance._meta.get_field("queue").max_length


def workflow_name(task: Task) -> str:
    return f"{PREFIX}{task.module_path}"


def wfdash_priority(priority: int) -> int:
    steps = int(abs(priority) / DJANGO_TO_WFDASH_PRIORITY_STEP + 0.5)  # half away from zero
    return min(9, max(0, 5 - steps if priority >= 0 else 5 + steps))


def exception_path(error_name: str) -> str:
    """A TaskError's exception_class_path from an instance's error name: a task's own
    exceptions are named by their full path already; a bare name is a builtin or one the
    engine raised around the call (StepTimeout, StepOutputError), so that
    TaskError.exception_class imports it."""
    if "." in error_name:
        return error_name
    if isinstance(getattr(builtins, error_name, None), type):
        return f"builtins.{error_name}"
    engine_error = getattr(engine_errors, error_name, None)
    if isinstance(engine_error, type) and issubclass(engine_error, BaseException):
        return f"{engine_errors.__name__}.{error_name}"
    return error_name


def params_problem(params: Any) -> str | None:
    """What makes an instance's params not an enqueue's (an instance of a task's workflow
    started another way: the dashboard, `wf start`, the API), or None."""
    if not isinstance(params, dict):
        return f"its params are {type(params).__name__}, not an enqueue's object"
    if not isinstance(params.get("args"), list) or not isinstance(params.get("kwargs"), dict):
        return 'its params have no "args" list and "kwargs" object'
    run_after = params.get("run_after")
    if run_after is not None:
        try:
            datetime.fromisoformat(run_after)
        except (TypeError, ValueError):
            return f'its "run_after" {run_after!r} is not an ISO 8601 date and time'
    return None


def not_enqueued_message(task_path: str, problem: str) -> str:
    return (
        f"not a task enqueued by Django's tasks framework: {problem}. Start "
        f"{task_path} with its enqueue() (or aenqueue()), not as a workflow instance"
    )


class TaskWorkflow(WorkflowEntrypoint):
    """The workflow of one task: sleep until run_after (if any), then one step calls it."""

    task_path = ""

    async def run(self, event: Any, step: Any) -> Any:
        params = event.payload
        problem = params_problem(params)
        if problem is not None:
            raise NonRetryableError(not_enqueued_message(self.task_path, problem), "InvalidTask")
        if params.get("run_after") is not None:
            await step.sleep_until(WAIT, datetime.fromisoformat(params["run_after"]))
        task: Task = import_string(self.task_path)
        # The backend it was enqueued on (`using(backend=...)`), whose OPTIONS apply, not
        # the one its decorator names.
        backend = task_backends[params.get("backend") or task.backend]
        options = getattr(backend, "options", {}) or {}
        retries = options.get("retries", {"limit": 0})
        instance_id = event.instance_id

        def call() -> Any:
            running = backend.running_result(instance_id)
            task_started.send(type(backend), task_result=running)
            args = list(params["args"])
            if task.takes_context:
                args.insert(0, TaskContext(task_result=running))
            try:
                value = normalize_json(task.call(*args, **params["kwargs"]))
            except BaseException as exc:
                # Named by the exception's full path (what a TaskError carries, so that its
                # exception_class imports it), with the original chained for the stack.
                path = f"{exc.__class__.__module__}.{exc.__class__.__qualname__}"
                limit = retries.get("limit", 0)
                if limit and not isinstance(exc, NonRetryableError) and running.attempts <= limit:
                    failed_attempt = StepRaised(exc)  # retried like any failed attempt
                    failed_attempt.error_name = path
                    raise failed_attempt from exc
                error = TaskError(
                    exception_class_path=path, traceback="".join(traceback.format_exception(exc))
                )
                # Sent in the handler, so that Django's own receiver logs the exception.
                send_task_finished(backend, running, TaskResultStatus.FAILED, errors=[error])
                # Django tasks run once: fail at once.
                raise NonRetryableError(engine_errors.safe_str(exc), path) from exc
            send_task_finished(backend, running, TaskResultStatus.SUCCESSFUL, value=value)
            return value

        kwargs: dict[str, Any] = {"retries": retries}
        if options.get("timeout") is not None:
            kwargs["timeout"] = options["timeout"]
        return await step.do(STEP, call, **kwargs)


def send_task_finished(
    backend: BaseTaskBackend,
    running: TaskResult,
    status: TaskResultStatus,
    errors: list[TaskError] | None = None,
    value: Any = None,
) -> None:
    """Django's task_finished for the attempt that settles the task, unless the engine
    abandoned it (it timed out): then its outcome is not the task's."""
    attempt = current_step()
    if attempt is not None and attempt.cancelled:
        return
    finished = dataclasses.replace(
        running, status=status, finished_at=clock.now(), errors=errors or []
    )
    object.__setattr__(finished, "_return_value", value)
    task_finished.send(type(backend), task_result=finished)


def register_task_workflow(task: Task) -> str:
    """Register the task's workflow in this process (once; again after an unregister)."""
    name = workflow_name(task)
    if not registry.is_registered(name, 1):
        cls = type(
            f"Task_{task.func.__qualname__}",
            (TaskWorkflow,),
            {"task_path": task.module_path, "__module__": __name__},
        )
        register(name, version=1)(cls)
    return name


def resolve_task_workflow(name: str) -> None:
    """Registry resolver: a worker meeting `task:<path>` imports the task and registers it."""
    if not name.startswith(PREFIX) or not may_import_for(name[len(PREFIX) :]):
        return
    try:
        task = import_string(name[len(PREFIX) :])
    except ImportError:
        return  # not importable here: the instance waits for a worker that has it
    if isinstance(task, Task):
        register_task_workflow(task)


def may_import_for(path: str) -> bool:
    """Whether resolving `task:<path>` may import its module: one imported already, or one
    of the project's own (an installed app's package, the settings' package). A client
    names the workflow (the API, the dashboard, `wf`): without this any token holder had
    the server import any module on its path, the standard library's included, with
    whatever it does when imported, before the name was found to be no task."""
    module = path.rpartition(".")[0]
    if not module:
        return False
    if module in sys.modules:
        return True
    own = [config.name for config in apps.get_app_configs()]
    if settings.SETTINGS_MODULE:
        own.append(settings.SETTINGS_MODULE.partition(".")[0])
    return any(module == package or module.startswith(f"{package}.") for package in own)


registry.add_resolver(resolve_task_workflow, PREFIX)


def unknown_queues(queues: Iterable[str]) -> list[str]:
    """Queues no WorkflowTaskBackend in TASKS lets a task be enqueued on (each backend's
    QUEUES; one whose QUEUES is empty takes any name): a worker started for them only
    would wait for nothing."""
    known: set[str] = set()
    for backend in task_backends.all():
        if not isinstance(backend, WorkflowTaskBackend):
            continue
        if not backend.queues:
            return []
        known |= set(backend.queues)
    return [queue for queue in queues if queue not in known]


def options_problems(options: Any) -> list[str]:
    """What is wrong with a backend's OPTIONS: found by `manage.py check` at start-up,
    where otherwise every task would fail in the worker with a traceback."""
    if not isinstance(options, dict):
        return [f"OPTIONS must be a dict, got {options!r}"]
    problems = []
    unknown = set(options) - {"retries", "timeout"}
    if unknown:
        problems.append(f"unknown option(s) {sorted(unknown)}; use retries, timeout")
    retries = options.get("retries", {})
    if not isinstance(retries, dict):
        problems.append(f'"retries" must be a dict of limit, delay, backoff, got {retries!r}')
        retries = {}
    unknown = set(retries) - {"limit", "delay", "backoff"}
    if unknown:
        problems.append(f'unknown "retries" option(s) {sorted(unknown)}; use limit, delay, backoff')
    limit = retries.get("limit", 0)
    if not isinstance(limit, int) or isinstance(limit, bool) or not 0 <= limit <= MAX_RETRY_LIMIT:
        problems.append(
            f'"retries" limit must be an integer from 0 to {MAX_RETRY_LIMIT}, got {shown(limit)}'
        )
    if retries.get("backoff", BACKOFFS[0]) not in BACKOFFS:
        problems.append(f'"retries" backoff must be one of {BACKOFFS}, got {retries["backoff"]!r}')
    for label, duration in (
        ('"retries" delay', retries.get("delay")),
        ('"timeout"', options.get("timeout")),
    ):
        if duration is not None:
            try:
                parse_duration(duration)
            except InvalidDuration as exc:
                problems.append(f"{label}: {exc}")
    return problems


class WorkflowTaskBackend(BaseTaskBackend):
    """Tasks as durable one-step workflow instances, run by wfdash's workers."""

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        return [
            *super().check(**kwargs),
            *(
                checks.Error(f"TASKS[{self.alias!r}]: {problem}", id="workflows_app.E001")
                for problem in options_problems(self.options)
            ),
        ]

    def validate_task(self, task: Task) -> None:
        super().validate_task(task)
        register_task_workflow(task)

    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        from .client import get_workflow

        self.validate_task(task)
        try:
            payload = {
                "args": normalize_json(list(args)),
                "kwargs": normalize_json(dict(kwargs)),
            }
            json.dumps(payload, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidTask(f"Task arguments must be JSON-serialisable: {exc}") from None
        if not isinstance(task.queue_name, str) or not 0 < len(task.queue_name) <= MAX_QUEUE_NAME:
            raise InvalidTask(
                f"queue_name must be a string of 1-{MAX_QUEUE_NAME} characters, "
                f"got {task.queue_name!r}"
            )
        binding = get_workflow(workflow_name(task))
        if task.run_after is not None:
            max_sleep = binding.definition().limits().max_sleep
            if (task.run_after - clock.now()).total_seconds() * 1000 > max_sleep:
                raise InvalidTask(
                    f"run_after {task.run_after.isoformat()} is further away than max_sleep "
                    f"({max_sleep} ms)"
                )
        payload.update(
            run_after=task.run_after.isoformat() if task.run_after else None,
            priority=task.priority,
            queue_name=task.queue_name,
            backend=self.alias,
        )
        [handle] = binding._create(
            [{"params": payload, "priority": wfdash_priority(task.priority)}],
            "django.tasks",
            None,
            queue=task.queue_name,
        )
        result = self._result(task, handle.row(refresh=False), None, [])
        task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> TaskResult:
        return self._read(result_id, running=False)

    def running_result(self, result_id: str) -> TaskResult:
        """The result as the attempt under way sees it (a task's context): this attempt
        counted in worker_ids and its start in started_at, as Django's backends do."""
        return self._read(result_id, running=True)

    def _read(self, result_id: str, running: bool) -> TaskResult:
        row = (
            Instance.objects.filter(instance_id=result_id, workflow__startswith=PREFIX)
            .order_by("id")
            .first()
        )
        if row is None:
            raise TaskResultDoesNotExist(result_id)
        try:
            task = import_string(row.workflow[len(PREFIX) :])
        except ImportError as exc:
            raise TaskResultDoesNotExist(
                f"{result_id}: its task cannot be imported: {exc}"
            ) from None
        params = row.params
        problem = params_problem(params)
        if problem is not None:
            raise TaskResultDoesNotExist(
                f"{result_id}: {not_enqueued_message(task.module_path, problem)}"
            )
        task = task.using(
            priority=params.get("priority"),
            queue_name=params.get("queue_name"),
            run_after=datetime.fromisoformat(params["run_after"])
            if params.get("run_after")
            else None,
            backend=params.get("backend") or self.alias,
        )
        step = StepRecord.objects.filter(instance_id=row.pk, name=STEP, kind="do").first()
        # One worker per attempt of the step, the worker of the run it was made in: a run
        # may make several (retries due soon are waited for in it), and runs that only
        # slept until run_after, or were taken over before the step began, make none.
        events = (
            HistoryRecord.objects.filter(
                instance_id=row.pk, type__in=("run.started", "step.started")
            )
            .order_by("sequence")
            .values_list("type", "data")
        )
        run_worker, worker_ids, last_attempt_at = "", [], None
        for event_type, event_data in events:
            data = event_data if isinstance(event_data, dict) else {}
            if event_type == "run.started":
                run_worker = data.get("worker", "")
            elif data.get("step") == STEP:
                worker_ids.append(run_worker)
                last_attempt_at = data.get("at")
        if running:  # this attempt's step.started is written with its outcome
            worker_ids.append(run_worker)
        result = self._result(task, row, step, worker_ids)
        if running:
            now = clock.now()
            object.__setattr__(result, "started_at", result.started_at or now)
            object.__setattr__(result, "last_attempted_at", now)
        elif last_attempt_at:
            object.__setattr__(result, "last_attempted_at", datetime.fromisoformat(last_attempt_at))
        return result

    def _result(
        self, task: Task, row: Instance, step: StepRecord | None, worker_ids: list[str]
    ) -> TaskResult:
        status = task_status(row, step)
        result = TaskResult(
            task=task,
            id=row.instance_id,
            status=status,
            enqueued_at=row.created_at,
            started_at=step.started_at if step else None,
            finished_at=row.finished_at,
            last_attempted_at=step.started_at if step else None,
            args=row.params["args"],
            kwargs=row.params["kwargs"],
            backend=self.alias,
            errors=[
                TaskError(
                    exception_class_path=exception_path(row.error_name), traceback=row.error_stack
                )
            ]
            if status == TaskResultStatus.FAILED and row.error_name
            else [],
            worker_ids=worker_ids,
        )
        if status == TaskResultStatus.SUCCESSFUL:
            object.__setattr__(result, "_return_value", row.output)
        return result


RUNNING_STATUSES = {Status.RUNNING, Status.WAITING, Status.WAITING_FOR_PAUSE, Status.COMPENSATING}


def task_status(row: Instance, step: StepRecord | None) -> TaskResultStatus:
    """Django's status of a task instance: READY until a worker runs its step (queued,
    paused, sleeping until run_after, or waiting for a retry: Django's "ready to be
    executed again"), RUNNING while one does, then SUCCESSFUL, or FAILED (errored or
    terminated)."""
    if row.status == Status.COMPLETE:
        return TaskResultStatus.SUCCESSFUL
    if row.status in (Status.ERRORED, Status.TERMINATED, Status.UNKNOWN):
        return TaskResultStatus.FAILED
    if row.status in RUNNING_STATUSES:
        if step is not None and step.status != StepStatus.RETRYING:
            return TaskResultStatus.RUNNING  # its attempt is done: the instance completes
        now = clock.now()
        run_after = row.params.get("run_after")
        due = run_after is None or datetime.fromisoformat(run_after) <= now
        if step is not None and step.wake_at is not None:
            due = step.wake_at <= now  # the retry's time
        if row.lease_token is not None and row.status == Status.RUNNING and due:
            return TaskResultStatus.RUNNING  # an attempt is in a worker now
    return TaskResultStatus.READY
