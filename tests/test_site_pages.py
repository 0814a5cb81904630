"""The wfdash site's own pages (top-level templates/ and static/): what a visitor sees
when no dashboard page answers, and the admin's name."""

import pytest
from django.contrib.staticfiles import finders
from django.template.loader import get_template

pytestmark = pytest.mark.django_db


def test_an_unknown_path_gets_the_sites_not_found_page_with_the_path_escaped(client):
    response = client.get("/no-such-page/<script>alert(1)</script>")
    assert response.status_code == 404
    body = response.content.decode()
    assert "<h1>Not found</h1>" in body
    assert "/no-such-page/%3Cscript%3Ealert%281%29%3C/script%3E" in body  # quoted
    assert "<script>alert(1)" not in body
    assert "site/site.css" in body


def test_the_server_error_page_and_its_stylesheet_are_the_sites_own(settings):
    template = get_template("500.html")
    assert str(template.origin.name).startswith(str(settings.BASE_DIR / "templates"))
    assert "Server error" in template.render({})
    found = finders.find("site/site.css")
    assert found and found.startswith(str(settings.BASE_DIR / "static"))


def test_the_admin_names_the_site(admin_client):
    response = admin_client.get("/admin/")
    assert response.status_code == 200
    assert "wfdash administration" in response.content.decode()
