"""Helpers of the dashboard tests."""

from __future__ import annotations

from django.contrib.auth.models import Permission, User


def make_user(username: str, *perms: str, staff: bool = True) -> User:
    user = User.objects.create_user(username, password="pw", is_staff=staff)
    for codename in perms:
        user.user_permissions.add(
            Permission.objects.get(codename=codename, content_type__app_label="workflows_app")
        )
    return user
