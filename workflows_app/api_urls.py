"""Routes of the JSON API (mounted at /api/ by workflows_app.urls)."""

from __future__ import annotations

from django.urls import path

from . import api

app_name = "api"

INSTANCE = "workflows/<str:name>/instances/<str:instance_id>"

urlpatterns = [
    path("openapi.json", api.openapi_document, name="openapi"),
    path("workflows", api.workflows, name="workflows"),
    path("workflows/<str:name>/instances", api.instances, name="instances"),
    path("workflows/<str:name>/instances/batch", api.batch, name="batch"),
    path(INSTANCE, api.detail, name="instance"),
    path(f"{INSTANCE}/history", api.history, name="history"),
    path(f"{INSTANCE}/status", api.status, name="status"),
    path(f"{INSTANCE}/subscribe", api.subscribe, name="subscribe"),
    path(f"{INSTANCE}/events/<str:event_type>", api.events, name="event"),
    path(f"{INSTANCE}/cancel", api.cancel_view, name="cancel"),
    path(f"{INSTANCE}/skip-sleep", api.skip_sleep_view, name="skip-sleep"),
]
