from django.urls import include, path, re_path

from . import (
    api,
    converters,  # noqa: F401  (registers the pk converter)
    views,
)

app_name = "workflows"

urlpatterns = [
    path("", views.overview, name="overview"),
    path("instances/", views.instance_list, name="instances"),
    path("instances/rows/", views.instance_rows, name="instance-rows"),
    path("instances/create/", views.create_instance, name="create"),
    path("instances/bulk/", views.bulk_action, name="bulk"),
    path("instances/bulk-jobs/", views.start_bulk_job, name="bulk-job-start"),
    path("instances/bulk-jobs/count/", views.bulk_job_count, name="bulk-job-count"),
    path("instances/bulk-jobs/<int:job_id>/", views.bulk_job_progress, name="bulk-job"),
    # Pages are addressed by workflow and instance id, so an id from a log opens its page;
    # the numeric address redirects there. Live fragments and actions keep the primary key.
    path("workflows/<str:name>/", views.workflow_detail, name="workflow"),
    path("workflows/<str:name>/<str:instance_id>/", views.instance_detail, name="instance"),
    path("instances/<pk:pk>/", views.instance_by_pk, name="instance-by-pk"),
    path("instances/<pk:pk>/live/", views.instance_fragment, name="instance-live"),
    path("instances/<pk:pk>/<slug:action>/", views.instance_action, name="action"),
    path("errors/", views.error_list, name="errors"),
    path("schedules/", views.schedule_list, name="schedules"),
    path("schedules/<str:name>/", views.schedule_detail, name="schedule"),
    path("schedules/<str:name>/<slug:action>/", views.schedule_action, name="schedule-action"),
    path("metrics", api.prometheus_metrics, name="prometheus-metrics"),
    path("stats/", views.metrics_page, name="metrics"),
    path("api/", include("workflows_app.api_urls")),
    re_path(r"^api/", api.not_found),  # any other /api/ path: a JSON 404, not the HTML page
]
