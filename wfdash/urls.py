from django.contrib import admin
from django.templatetags.static import static
from django.urls import include, path
from django.views.generic import RedirectView

# The site's admin says whose it is (Django's default header reads "Django administration").
admin.site.site_header = "wfdash administration"
admin.site.site_title = "wfdash admin"

urlpatterns = [
    path("admin/", admin.site.urls),
    # Browsers ask for /favicon.ico on every page without an icon link (the admin's, too).
    path("favicon.ico", RedirectView.as_view(url=static("workflows/favicon.svg"), permanent=True)),
    path("", include("workflows_app.urls")),
]
