"""API tokens: issued once in the clear, stored only as a SHA-256 hash.

A token with a user acts with that user's permissions, narrowed by its scope (read or
write) and its list of workflows; one without a user is a service token, limited only
by its scope and workflows. `refusal()` is the one place that decides what a token may
do; `issuer_refusal()` the one place that decides who may mint which token.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import datetime, timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.utils import timezone

from .engine.durations import parse_duration
from .engine.errors import InvalidDuration
from .models import ApiToken
from .text import one_line

TOKEN_PREFIX = "wf_"
VIEW_PERMISSION = "workflows_app.view_instance"
CHANGE_PERMISSION = "workflows_app.change_instance"
DELETE_PERMISSION = "workflows_app.delete_instance"
MAX_LIFETIME = timedelta(days=3650)  # an expiry further out is a typo, not a plan


class TokenError(ValueError):
    """A token could not be issued, rotated or revoked; the message says why."""


def hash_token(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def expiry(duration: Any) -> datetime | None:
    """The expiry `duration` from now ("30d", milliseconds, a timedelta); None for no expiry."""
    if duration in (None, ""):
        return None
    try:
        delta = timedelta(milliseconds=parse_duration(duration))
    except InvalidDuration as exc:
        raise TokenError(f"expiry: {exc}") from None
    if not timedelta(0) < delta <= MAX_LIFETIME:
        raise TokenError(
            f"expiry must be more than 0 and at most {MAX_LIFETIME.days} days, got {duration!r}"
        )
    return timezone.now() + delta


def clean_workflows(workflows: Any) -> str:
    """Workflow names as stored: unique, sorted, separated by spaces ("" means all)."""
    if workflows is None:
        return ""
    names = workflows.replace(",", " ").split() if isinstance(workflows, str) else list(workflows)
    if not all(
        isinstance(n, str) and n and len(n) <= 100 and not any(c.isspace() for c in n)
        for n in names
    ):
        raise TokenError(f"workflows must be names without spaces, got {workflows!r}")
    return " ".join(sorted(set(names)))


def clean_name(name: str | None) -> str:
    """A token's name as stored: 1-100 characters, none of them a control, bidi or line
    separator character. The name is the actor of every change made with the token, in
    its history, logs, the dashboard and `wf` output: a newline in it forged a line there,
    and an actor holding a NUL is refused, so every write with the token failed."""
    name = (name or "").strip()
    if not name or len(name) > 100:
        raise TokenError(f"token name must be 1-100 characters, got {name!r}")
    if one_line(name) != name:
        raise TokenError(
            f"token name must not hold control, bidi or line separator characters, got {name!r}"
        )
    return name


def issue(
    name: str,
    username: str | None = None,
    scope: str = ApiToken.WRITE,
    workflows: Any = None,
    expires: Any = None,
) -> tuple[ApiToken, str]:
    """Create a token named `name`; returns it and the raw secret, which is never stored."""
    name = clean_name(name)
    if scope not in (ApiToken.READ, ApiToken.WRITE):
        raise TokenError(f"scope must be read or write, got {scope!r}")
    user = None
    if username:
        try:
            user = get_user_model().objects.get_by_natural_key(username)
        except get_user_model().DoesNotExist:
            raise TokenError(f"no user named {username!r}") from None
    token = ApiToken(
        name=name,
        user=user,
        scope=scope,
        workflows=clean_workflows(workflows),
        expires_at=expiry(expires),
        created_at=timezone.now(),
    )
    raw = new_secret()
    set_secret(token, raw)
    try:
        with transaction.atomic():
            token.save()
    except IntegrityError:
        raise TokenError(f"a token named {name!r} already exists") from None
    return token, raw


def set_secret(token: ApiToken, raw: str) -> None:
    token.token_hash = hash_token(raw)
    token.prefix = raw[:8]


def new_secret() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def rotate(token: ApiToken, issued_by: Any = None) -> str:
    """Give a live token a new secret (the old one stops working at once); returns it.
    issued_by: who now knows the secret (issuer_of; None from the shell)."""
    if token.revoked_at is not None:
        raise TokenError(f"token {token.name!r} is revoked; issue a new one instead")
    raw = new_secret()
    set_secret(token, raw)
    token.rotated_at = timezone.now()
    token.issued_by = issued_by
    token.save(update_fields=["token_hash", "prefix", "rotated_at", "issued_by"])
    return raw


def named(name: str) -> ApiToken:
    try:
        return ApiToken.objects.get(name=name)
    except ApiToken.DoesNotExist:
        raise TokenError(f"no token named {name!r}") from None


def revoke(name: str) -> ApiToken:
    """Revoke a token by name (idempotent: revoking twice keeps the first time)."""
    token = named(name)
    if token.revoked_at is None:
        token.revoked_at = timezone.now()
        token.save(update_fields=["revoked_at"])
    return token


def authenticate(raw: str) -> ApiToken | None:
    """The live token for this secret, or None (unknown, revoked, expired, or its user inactive)."""
    if not raw:
        return None
    digest = hash_token(raw)
    token = ApiToken.objects.select_related("user", "issued_by").filter(token_hash=digest).first()
    if (
        token is None
        or not hmac.compare_digest(token.token_hash, digest)
        or token.revoked_at is not None
    ):
        return None
    now = timezone.now()
    if token.expires_at is not None and token.expires_at <= now:
        return None
    if token.user is not None and not token.user.is_active:
        return None
    ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
    return token


def refusal(
    token: ApiToken, write: bool, workflow: str | None = None, permission: str | None = None
) -> str | None:
    """Why `token` may not read (or, with write, change) `workflow`; None when it may.

    permission: what the user of the token needs instead of view/change (delete_instance)."""
    if workflow is not None and token.workflows and workflow not in token.workflow_names:
        return f"token {token.name!r} is limited to the workflows {token.workflow_names}"
    if write and token.scope != ApiToken.WRITE:
        return (
            f"token {token.name!r} has the read scope; writing needs a token with the write scope"
        )
    needed = permission or (CHANGE_PERMISSION if write else VIEW_PERMISSION)
    if token.user is not None and not token.user.has_perm(needed):
        return f"token {token.name!r} (user {token.user.get_username()!r}) lacks the {needed} permission"
    issuer = token.issued_by
    if issuer is not None and not issuer.has_perm(needed):  # inactive: no permission at all
        return (
            f"token {token.name!r} was issued by {issuer.get_username()!r}, who lacks the "
            f"{needed} permission (a token never does more than its issuer may)"
        )
    return None


def issuer_of(user: Any) -> Any:
    """What a token minted or rotated by `user` records as its issuer: none for a
    superuser (who holds every permission), the user otherwise."""
    return None if user.is_superuser else user


def issuer_refusal(issuer: Any, user: Any) -> str | None:
    """Why `issuer` may not mint a token acting as `user` (None: a service token); None when it may.

    A token never carries more than its creator holds: service tokens (full access) are
    for superusers only, and a token bound to a user needs every permission that user has.
    """
    if issuer.is_superuser:
        return None
    if user is None:
        return "only a superuser may create a service token (one without a user: full access)"
    if user.is_superuser:
        return f"only a superuser may create a token for the superuser {user.get_username()!r}"
    if not user.is_active:  # Django counts no permission of an inactive user: none to compare
        return f"only a superuser may create a token for the inactive user {user.get_username()!r}"
    missing = sorted(user.get_all_permissions() - issuer.get_all_permissions())
    if missing:
        return (
            f"a token for {user.get_username()!r} would carry permissions you do not hold: "
            f"{', '.join(missing)}"
        )
    return None
