"""Who may watch the dashboard, decided again while a socket stays open.

A page checks its user once per request; a WebSocket lives for hours. So a socket re-checks
its session and user every RECHECK_SECONDS, on a client message (with an answer at most
fanout.ACCESS_SHARED_SECONDS old), and at once when the user changes (deactivated,
permissions or groups edited, password changed); logging out closes every socket of that
session. The signal receivers here only publish a notice to
the session's or user's group (live.py); the consumers decide.
"""

from __future__ import annotations

from importlib import import_module
from types import SimpleNamespace
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user, get_user_model, user_logged_out
from django.contrib.auth.models import Group
from django.db import transaction
from django.db.models.signals import m2m_changed, post_delete, post_save
from django.dispatch import receiver

from . import live

RECHECK_SECONDS = 30.0  # at the latest, a change no signal reported closes a socket after this
VIEW_PERMISSION = "workflows_app.view_instance"


def may_view(user: Any) -> bool:
    """Staff, active, with view_instance: what every dashboard page and socket needs."""
    return bool(
        user
        and user.is_authenticated
        and user.is_active
        and user.is_staff
        and user.has_perm(VIEW_PERMISSION)
    )


def session_may_view(session_key: str | None, user_pk: Any) -> bool:
    """The session still exists, still belongs to that user (and their current password),
    and the user, read afresh, may still view the dashboard."""
    if not session_key:
        return False
    session = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    user = get_user(SimpleNamespace(session=session))  # verifies the session's auth hash
    return user.pk == user_pk and may_view(user)


@receiver(user_logged_out)
def close_the_sessions_sockets(sender: Any, request: Any, user: Any, **kwargs: Any) -> None:
    session_key = getattr(getattr(request, "session", None), "session_key", None)
    if session_key:
        live.publish(live.session_group(session_key), {"type": "wf.logout"})


def recheck_users(pks: Any, using: str | None = None) -> None:
    """Tell the users' sockets to re-check, once the change commits. The signals fire
    inside the change's transaction (the admin saves a user and their permissions in
    one; a delete and an m2m edit always are one): told at once, a socket served by
    another process or thread read the rights as they were before it and stayed open
    until its periodic re-check. Outside a transaction this publishes at once."""
    pks = list(pks)

    def publish() -> None:
        for pk in pks:
            live.publish(live.user_group(pk), {"type": "wf.access"})

    if pks:
        transaction.on_commit(publish, using=using)


# Fields of the user whose save alone cannot change what they may view.
RIGHTS_UNCHANGED_BY = frozenset({"last_login"})


@receiver(post_save, sender=settings.AUTH_USER_MODEL)
@receiver(post_delete, sender=settings.AUTH_USER_MODEL)
def recheck_a_changed_user(sender: Any, instance: Any, **kwargs: Any) -> None:
    # A login saves the user's last_login alone: no right changed, and a re-check of each
    # of their open sockets (up to the cap, each four queries) at every login is a storm.
    if kwargs.get("update_fields") and set(kwargs["update_fields"]) <= RIGHTS_UNCHANGED_BY:
        return
    recheck_users([instance.pk], kwargs.get("using"))


def affected_users(sender: Any, instance: Any, pk_set: Any) -> list[Any]:
    """The users whose rights an m2m change of user <-> permissions, user <-> groups or
    group <-> permissions touches (pk_set: the other side's pks, None for a clear)."""
    users = get_user_model().objects
    if isinstance(instance, get_user_model()):
        return [instance.pk]
    if sender is Group.permissions.through:
        groups = (
            [instance.pk]
            if isinstance(instance, Group)
            else list(pk_set or instance.group_set.all())
        )
        return list(users.filter(groups__in=groups).values_list("pk", flat=True).distinct())
    # A group's or a permission's users, from its side: pk_set, or everyone it had before a clear.
    return (
        list(pk_set) if pk_set is not None else list(instance.user_set.values_list("pk", flat=True))
    )


def recheck_after_m2m(sender: Any, instance: Any, action: str, pk_set: Any, **kwargs: Any) -> None:
    """Re-check the sockets of every user an m2m edit touched, from either side."""
    if action == "pre_clear":  # after the clear, nothing says who had it
        instance._wfdash_cleared_users = affected_users(sender, instance, None)
    elif action == "post_clear":
        recheck_users(instance.__dict__.pop("_wfdash_cleared_users", []), kwargs.get("using"))
    elif action.startswith("post_"):
        recheck_users(affected_users(sender, instance, pk_set), kwargs.get("using"))


def connect_signals() -> None:
    user_model = get_user_model()
    for through in (
        user_model.user_permissions.through,
        user_model.groups.through,
        Group.permissions.through,
    ):
        m2m_changed.connect(
            recheck_after_m2m, sender=through, dispatch_uid=f"wfdash-access-{through.__name__}"
        )
