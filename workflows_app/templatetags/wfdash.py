"""Template helpers shared by every dashboard page."""

from __future__ import annotations

import json
import re
from datetime import datetime

from django import template
from django.utils.html import escape, format_html
from django.utils.safestring import SafeString, mark_safe

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
def socket_path(*parts: object) -> str:
    """A dashboard WebSocket's path, under the prefix the dashboard's pages are mounted at
    (the project mounts workflows_app.routing's routes under the same one): /ws/... at
    the root, /ops/wf/ws/... under path("ops/wf/", ...)."""
    from django.urls import reverse

    return f"{reverse('workflows:overview')}ws/{'/'.join(str(part) for part in parts)}/"


@register.simple_tag
def admin_index_url() -> str:
    """The Django admin's index, or "" in a project that does not mount the admin (the
    dashboard then shows no Admin link rather than failing to render)."""
    from django.urls import NoReverseMatch, reverse

    try:
        return reverse("admin:index")
    except NoReverseMatch:
        return ""


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


def _json_pieces(value: object, pieces: list[tuple[str, bool]]) -> None:
    """value's compact JSON as (text, is_a_string) pieces, in order."""
    if isinstance(value, dict):
        pieces.append(("{", False))
        for i, (key, item) in enumerate(value.items()):
            pieces += [(",", False)] if i else []
            pieces += [(json.dumps(key, ensure_ascii=False), True), (":", False)]
            _json_pieces(item, pieces)
        pieces.append(("}", False))
    elif isinstance(value, list):
        pieces.append(("[", False))
        for i, item in enumerate(value):
            pieces += [(",", False)] if i else []
            _json_pieces(item, pieces)
        pieces.append(("]", False))
    else:
        pieces.append((json.dumps(value, ensure_ascii=False, default=str), isinstance(value, str)))


# A JSON string token as json.dumps writes it (a raw newline or quote inside is escaped).
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def bdi_json(text: str) -> SafeString:
    """JSON text (indented or not) escaped for HTML, each string (keys too) in a <bdi>:
    right-to-left text in it reorders only that string within its line, not the keys,
    punctuation and values around it (a <pre> of the admin)."""
    html, end = [], 0
    for match in _JSON_STRING.finditer(text):
        html.append(escape(text[end : match.start()]))
        html.append(format_html("<bdi>{}</bdi>", match.group()))
        end = match.end()
    html.append(escape(text[end:]))
    return mark_safe("".join(html))


@register.filter
def json_line(text: str | None, limit: int = 300) -> SafeString:
    """Stored JSON text on one line, cut past `limit` characters, with each string (keys
    too) in a <bdi>: right-to-left text, or a U+202E in it, reorders only that string, not
    the punctuation and strings around it (as the page's JSON previews do)."""
    if text is None:
        return mark_safe("")
    try:
        value = json.loads(text)
    except ValueError:  # [REDACTED], or text that is no JSON: shown as it is
        return escape(text if len(text) <= limit else text[: limit - 1] + "…")
    pieces: list[tuple[str, bool]] = []
    _json_pieces(value, pieces)
    html, left = [], limit
    for i, (whole, is_string) in enumerate(pieces):
        cut = len(whole) > left or (len(whole) == left and i < len(pieces) - 1)
        piece = whole[: max(0, left - 1)] if cut else whole
        html.append(format_html("<bdi>{}</bdi>", piece) if is_string else escape(piece))
        left -= len(piece)
        if cut:
            html.append("…")
            break
    return mark_safe("".join(html))
