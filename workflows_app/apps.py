from __future__ import annotations

import contextlib

from django.apps import AppConfig
from django.conf import settings
from django.db.backends.signals import connection_created
from django.utils.module_loading import autodiscover_modules


class WorkflowsAppConfig(AppConfig):
    name = "workflows_app"
    verbose_name = "Workflows"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Like admin.py: every installed app's workflows.py registers its workflows.
        autodiscover_modules("workflows")
        from . import access, checks, live  # noqa: F401  (checks registers the system checks)
        from .engine import store

        access.connect_signals()
        connection_created.connect(
            store.dialect.measure_clock_offset_on_connect, dispatch_uid="wfdash-clock-offset"
        )

        store.control.on_promoted = live.instances_promoted
        store.control.on_queue_timed = live.queue_timed
        store.control.on_child_terminated = live.instance_terminated
        store.control.on_child_compensating = live.instance_compensating
        store.schedules.on_fired = live.instances_scheduled
        if getattr(settings, "WFDASH", {}).get("TRACING", True):
            from . import tracing

            tracing.configure()
        else:
            # Off means no spans: the engine's went on through the global provider, and a
            # provider the project installed (Sentry's, opentelemetry-instrument's)
            # recorded and exported every run's and step's.
            from .engine import spans

            spans.set_enabled(False)
        if any(
            backend.get("BACKEND") == "workflows_app.tasks.WorkflowTaskBackend"
            for backend in getattr(settings, "TASKS", {}).values()
        ):
            # Workers register task workflows on demand. Without a tasks framework (Django
            # 5.2 without the django-tasks backport) nothing can enqueue a task: skip it.
            with contextlib.suppress(ImportError):
                from . import tasks  # noqa: F401
        if getattr(settings, "WFDASH", {}).get("METRICS", True):
            from . import metrics

            metrics.configure()
        else:
            # Off means no metrics: the engine's instruments went on through the global
            # provider, into one the project installed.
            from .engine import meters

            meters.set_enabled(False)
        if getattr(settings, "WFDASH", {}).get("DEMO", False):
            from . import demo  # noqa: F401  (registers the demo workflows)
