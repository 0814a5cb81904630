"""Dashboard views (thin: lookup, permission, one engine call, render)."""

from __future__ import annotations

from django.contrib.admin.views.decorators import staff_member_required
from django.db.models import Count
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from .engine.registry import all_definitions
from .models import Instance


@staff_member_required
def overview(request: HttpRequest) -> HttpResponse:
    counts: dict[str, dict[str, int]] = {}
    for row in Instance.objects.values("workflow", "status").annotate(n=Count("id")):
        counts.setdefault(row["workflow"], {})[row["status"]] = row["n"]
    workflows = sorted({d.name for d in all_definitions()} | set(counts))
    recent = Instance.objects.order_by("-id")[:50]
    return render(request, "workflows/overview.html", {"workflows": [(w, counts.get(w, {})) for w in workflows], "recent": recent})
