"""API tokens: issued once in the clear, stored only as a SHA-256 hash.

A token with a user acts with that user's permissions; one without a user is a
full-access service token.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.utils import timezone

from .models import ApiToken

TOKEN_PREFIX = "wf_"


class TokenError(ValueError):
    """A token could not be issued or revoked; the message says why."""


def hash_token(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def issue(name: str, username: str | None = None) -> tuple[ApiToken, str]:
    """Create a token named `name`; returns it and the raw secret, which is never stored."""
    name = (name or "").strip()
    if not name or len(name) > 100:
        raise TokenError(f"token name must be 1-100 characters, got {name!r}")
    user = None
    if username:
        try:
            user = get_user_model().objects.get_by_natural_key(username)
        except get_user_model().DoesNotExist:
            raise TokenError(f"no user named {username!r}") from None
    raw = new_secret()
    token = ApiToken(name=name, user=user, created_at=timezone.now())
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


def revoke(name: str) -> ApiToken:
    """Revoke a token by name (idempotent: revoking twice keeps the first time)."""
    try:
        token = ApiToken.objects.get(name=name)
    except ApiToken.DoesNotExist:
        raise TokenError(f"no token named {name!r}") from None
    if token.revoked_at is None:
        token.revoked_at = timezone.now()
        token.save(update_fields=["revoked_at"])
    return token


def authenticate(raw: str) -> ApiToken | None:
    """The live token for this secret, or None (unknown, revoked, or its user inactive)."""
    if not raw:
        return None
    digest = hash_token(raw)
    token = ApiToken.objects.select_related("user").filter(token_hash=digest).first()
    if token is None or not hmac.compare_digest(token.token_hash, digest) or token.revoked_at is not None:
        return None
    if token.user is not None and not token.user.is_active:
        return None
    ApiToken.objects.filter(pk=token.pk).update(last_used_at=timezone.now())
    return token
