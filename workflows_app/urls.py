from django.urls import include, path

from . import views

app_name = "workflows"

urlpatterns = [
    path("", views.overview, name="overview"),
    path("api/", include("workflows_app.api_urls")),
]
