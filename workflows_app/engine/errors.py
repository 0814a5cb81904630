"""Every error the engine raises. Each class's docstring is its meaning."""

from __future__ import annotations

import math


def shown(value: object) -> str:
    """repr(value) for a refusal's message. repr() of an integer past 4,300 digits (or of
    a list or dict holding one) raises ValueError, which replaced the refusal with
    "Exceeds the limit (4300 digits) for integer string conversion": such an integer is
    shown by its size, and a long one from 10**40 too."""
    if isinstance(value, int) and abs(value) >= 10**40:
        digits = int(abs(value).bit_length() * math.log10(2)) + 1
        return f"{'-' if value < 0 else ''}<an integer of about {digits} digits>"
    try:
        return repr(value)
    except ValueError:
        return f"<a {type(value).__name__} holding an integer of over 4300 digits>"


class WorkflowError(Exception):
    """Base of every wfdash error."""


class InvalidDuration(WorkflowError, ValueError):
    """A duration was neither milliseconds, a known duration string, nor a timedelta."""


class LimitExceeded(WorkflowError, ValueError):
    """A configured limit was exceeded; the message names the limit and the value."""

    def __init__(self, limit: str, value: object, maximum: object, what: str = "") -> None:
        self.limit = limit
        self.value = value
        self.maximum = maximum
        detail = f"{what}: " if what else ""
        super().__init__(f"{detail}{limit} is {maximum}, got {value}")


class SizeLimitExceeded(LimitExceeded):
    """Params, a payload or an output is larger than its configured byte limit."""


class InvalidInput(WorkflowError, ValueError):
    """An argument was malformed (bad id, bad event type, not JSON-serialisable, …)."""


class CodecError(WorkflowError, ValueError):
    """A stored value could not be decoded: WFDASH["PAYLOAD_CODEC"] is not set, or the
    codec refused the bytes (another key, corrupted data)."""


class InvalidEventType(InvalidInput):
    """An event type does not match ^[a-zA-Z0-9_][a-zA-Z0-9_-]{0,99}$."""


class EventPayloadInvalid(InvalidInput):
    """An event payload failed the JSON Schema of the step waiting for it."""

    def __init__(self, message: str, violations: list[str]) -> None:
        self.violations = violations
        super().__init__(message)


class UnknownWorkflow(WorkflowError, LookupError):
    """No workflow of that name (or version) is registered."""


class InstanceNotFound(WorkflowError, LookupError):
    """No instance with that id exists for that workflow."""


class BulkJobNotFound(WorkflowError, LookupError):
    """No bulk job with that id (of that workflow)."""


class InstanceAlreadyExists(WorkflowError):
    """An instance with that id already exists for that workflow."""


class ScheduleExists(WorkflowError):
    """A schedule of that name already exists."""


class ScheduleNotFound(WorkflowError, LookupError):
    """No schedule of that name exists."""


class InvalidTransition(WorkflowError):
    """The action does not apply to the instance's current status."""


class VersionConflict(WorkflowError):
    """A registered version's source changed without bumping the version number."""


class DuplicateStepName(WorkflowError):
    """Two steps of one execution used the same name."""


class NonDeterminismError(WorkflowError):
    """Replay asked for a step of another kind than the checkpoint of that name holds."""


class StepTimeout(WorkflowError, TimeoutError):
    """A step attempt ran longer than its timeout; it counts as a failed attempt."""


class EventTimeout(WorkflowError, TimeoutError):
    """wait_for_event reached its timeout before an event of its type arrived."""


class StepOutputError(WorkflowError):
    """A step's output is not JSON-serialisable or exceeds max_step_output_bytes.

    Raised once, never retried: running the callable again would give the same output.
    """


class StepRaised(WorkflowError):
    """What a step raised that the engine cannot carry as it is (SystemExit or
    KeyboardInterrupt would stop the worker, StopIteration cannot cross a future, and a
    CancelledError of the step's own would read as a cancel of its run): a failed attempt,
    retried as any other, recorded under the original's name."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(safe_str(original))
        self.error_name = type(original).__name__


def safe_str(exc: BaseException) -> str:
    """str(exc), or a note saying it failed: an error must be recordable whatever it is."""
    try:
        return str(exc)
    except Exception as failure:
        return f"<str() of the {type(exc).__name__} raised {type(failure).__name__}>"


class NonRetryableError(WorkflowError):
    """Raised by user code to fail the step and the instance at once, without retries.

    The error name is `name`, else the class's own name (a subclass keeps its name).
    """

    def __init__(self, message: str = "", name: str | None = None) -> None:
        super().__init__(message)
        self.error_name = name or type(self).__name__


class WorkflowFailed(WorkflowError):
    """result(): the instance ended `errored`."""

    def __init__(self, instance_id: str, error: dict | None) -> None:
        self.instance_id = instance_id
        self.error = error or {}
        super().__init__(
            f"instance {instance_id!r} failed: {self.error.get('name')}: {self.error.get('message')}"
        )


class WorkflowTerminated(WorkflowError):
    """result(): the instance ended `terminated`."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        super().__init__(f"instance {instance_id!r} was terminated")


class ChildWorkflowFailed(WorkflowError):
    """A child workflow that step.invoke waited for errored or was terminated; not retried.

    error_name and message are the child's error (terminated: "WorkflowTerminated").
    """

    def __init__(self, workflow: str, instance_id: str, error_name: str, message: str) -> None:
        self.workflow = workflow
        self.instance_id = instance_id
        self.error_name = error_name
        self.message = message
        super().__init__(f"child {workflow}/{instance_id} failed: {error_name}: {message}")


class ResultTimeout(WorkflowError, TimeoutError):
    """result(timeout=…) expired before the instance finished."""


class EngineSignal(BaseException):
    """Control flow the engine sends through user code.

    A BaseException, so `except Exception` in a workflow cannot swallow a pause,
    a terminate or a park by accident.
    """


class Park(EngineSignal):
    """The run cannot go on now (sleep, event wait, retry delay): park the instance."""


class RunAborted(EngineSignal):
    """The run must stop: the instance was terminated, paused, restarted or its lease lost."""
