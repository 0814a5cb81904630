from __future__ import annotations

from django.apps import AppConfig
from django.conf import settings
from django.utils.module_loading import autodiscover_modules


class WorkflowsAppConfig(AppConfig):
    name = "workflows_app"
    verbose_name = "Workflows"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Like admin.py: every installed app's workflows.py registers its workflows.
        autodiscover_modules("workflows")
        from . import access, live
        from .engine import store

        access.connect_signals()

        store.control.on_promoted = live.instances_promoted
        if getattr(settings, "WFDASH", {}).get("TRACING", True):
            from . import tracing

            tracing.configure()
        if getattr(settings, "WFDASH", {}).get("METRICS", True):
            from . import metrics

            metrics.configure()
        if getattr(settings, "WFDASH", {}).get("DEMO", False):
            from . import demo  # noqa: F401  (registers the demo workflows)
