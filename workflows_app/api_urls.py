"""Routes of the JSON API (mounted at /api/ by workflows_app.urls)."""

from __future__ import annotations

from django.urls import path

from . import api

app_name = "api"

INSTANCE = "workflows/<str:name>/instances/<str:instance_id>"
SCHEDULE = "workflows/<str:name>/schedules/<str:schedule>"

urlpatterns = [
    path("openapi.json", api.openapi_document, name="openapi"),
    path("workflows", api.workflows, name="workflows"),
    path("workflows/<str:name>/instances", api.instances, name="instances"),
    path("workflows/<str:name>/instances/batch", api.batch, name="batch"),
    path("workflows/<str:name>/bulk", api.bulk_jobs, name="bulk-jobs"),
    path("workflows/<str:name>/bulk/<int:job_id>", api.bulk_job, name="bulk-job"),
    path(INSTANCE, api.detail, name="instance"),
    path(f"{INSTANCE}/history", api.history, name="history"),
    path(f"{INSTANCE}/steps", api.steps, name="steps"),
    path(f"{INSTANCE}/children", api.children, name="children"),
    path(f"{INSTANCE}/status", api.status, name="status"),
    path(f"{INSTANCE}/subscribe", api.subscribe, name="subscribe"),
    path(f"{INSTANCE}/events/<str:event_type>", api.events, name="event"),
    path(f"{INSTANCE}/cancel", api.cancel_view, name="cancel"),
    path(f"{INSTANCE}/skip-sleep", api.skip_sleep_view, name="skip-sleep"),
    path("workflows/<str:name>/schedules", api.schedules_view, name="schedules"),
    path(SCHEDULE, api.schedule_view, name="schedule"),
    path(f"{SCHEDULE}/trigger", api.trigger_view, name="schedule-trigger"),
]
