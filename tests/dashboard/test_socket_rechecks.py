"""Which saves of a user make their open dashboard sockets re-check access (wf.access)."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client

from .helpers import make_user

# Not transactional: the test's transaction holds the on-commit announcements, counted.
pytestmark = pytest.mark.django_db


def announced(callbacks) -> int:
    """How many of the captured on-commit callbacks are access's wf.access announcements."""
    return sum(1 for cb in callbacks if cb.__module__ == "workflows_app.access")


def test_a_login_does_not_make_the_users_sockets_recheck_but_a_rights_change_does(
    django_capture_on_commit_callbacks,
):
    """Each login saves the user's last_login alone: announced, each of their open sockets
    (up to the cap of 100) ran a fresh four-query access check on the thread synchronous
    views share, at every login. A save that can change their rights still announces."""
    make_user("viewer", "view_instance")
    user = User.objects.get(username="viewer")
    with django_capture_on_commit_callbacks() as logins:
        Client().force_login(user)  # django.contrib.auth's login: update_last_login
    assert User.objects.get(pk=user.pk).last_login is not None
    assert announced(logins) == 0
    with django_capture_on_commit_callbacks() as edits:
        user.is_staff = False
        user.save()
    assert announced(edits) == 1
    with django_capture_on_commit_callbacks() as narrow:
        user.save(update_fields=["is_active", "last_login"])
    assert announced(narrow) == 1
