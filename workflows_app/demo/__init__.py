"""Demo workflows the default run shows: an approval, a flaky pipeline, a long sleep."""

from .workflows import DataPipeline, OrderApproval, TrialReminder, create_demo_instances

__all__ = ["DataPipeline", "OrderApproval", "TrialReminder", "create_demo_instances"]
