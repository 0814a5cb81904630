"""The durable workflow engine. Knows nothing of views, templates or channel layers."""

from .errors import ChildWorkflowFailed, NonRetryableError, WorkflowError
from .registry import WorkflowEntrypoint, register
from .step import Event, StepContext, WorkflowEvent, current_step

__all__ = [
    "ChildWorkflowFailed",
    "Event",
    "NonRetryableError",
    "StepContext",
    "WorkflowEntrypoint",
    "WorkflowError",
    "WorkflowEvent",
    "current_step",
    "register",
]
