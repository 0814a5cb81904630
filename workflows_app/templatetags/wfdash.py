"""Template helpers shared by every dashboard page."""

from __future__ import annotations

import json
from datetime import datetime

from django import template
from django.utils.html import format_html
from django.utils.safestring import SafeString

register = template.Library()


@register.simple_tag
def instance_url(instance: object) -> str:
    """The page of an instance, by workflow and instance id."""
    from ..dashboard import instance_url as url_of

    return url_of(instance)  # type: ignore[arg-type]


@register.simple_tag
def workflow_url(name: str) -> str:
    """The page of a workflow; its filtered instance list if the name has a slash."""
    from django.urls import NoReverseMatch, reverse
    from django.utils.http import urlencode

    try:
        return reverse("workflows:workflow", args=[name])
    except NoReverseMatch:
        return f"{reverse('workflows:instances')}?{urlencode({'workflow': name})}"


@register.simple_tag
def when(value: datetime | None, empty: str = "—") -> SafeString:
    """A <time> element in UTC; dashboard.js rewrites it to local time with a relative age."""
    if value is None:
        return format_html('<span class="muted">{}</span>', empty)
    return format_html(
        '<time datetime="{}" title="{} UTC">{} UTC</time>',
        value.isoformat(),
        value.strftime("%Y-%m-%d %H:%M:%S"),
        value.strftime("%Y-%m-%d %H:%M:%S"),
    )


@register.simple_tag
def badge(status: str) -> SafeString:
    """The status badge; tests and the page's JS find it by data-status."""
    return format_html('<span class="badge" data-status="{}">{}</span>', status, status)


@register.filter
def ms(value: float | None) -> str:
    """A duration in milliseconds, in the unit a reader expects."""
    if value is None:
        return "—"
    if value < 1000:
        return f"{value:.0f} ms"
    if value < 60_000:
        return f"{value / 1000:.2f} s"
    return f"{value / 60_000:.1f} min"


@register.filter
def percent(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.1f}%"


@register.filter
def compact_json(value: object) -> str:
    """One-line JSON (the template escapes it)."""
    return json.dumps(value, ensure_ascii=False, default=str)
