"""A form bigger than Django takes, refused with a page that says so and names the limit."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.deprecation import MiddlewareMixin
from django.utils.http import url_has_allowed_host_and_scheme


class FormTooLargeMiddleware(MiddlewareMixin):
    """Django refuses a form over DATA_UPLOAD_MAX_MEMORY_SIZE where it is first read, and
    the CSRF check reads it before any view: the admin's and the dashboard's forms (an
    event's payload, a start's params) got Django's bare "Bad Request" page, which says
    neither that the form was too large nor what the limit is. Listed before
    CsrfViewMiddleware, this reads the form first and answers 413 with a page naming
    both; the limit is Django's, unchanged. A view exempt from the CSRF check (the JSON
    API, which reads its body itself and answers its own 413) is left alone."""

    def process_view(
        self,
        request: HttpRequest,
        view_func: Callable[..., Any],
        view_args: Any,
        view_kwargs: Any,
    ) -> HttpResponse | None:
        if request.method != "POST" or getattr(view_func, "csrf_exempt", False):
            return None
        try:
            request.POST  # noqa: B018 - read now, as the CSRF check would
        except RequestDataTooBig as exc:
            logging.getLogger("django.security.RequestDataTooBig").error(str(exc))
            return form_too_large(request)
        return None


def form_too_large(request: HttpRequest) -> TemplateResponse:
    """The 413 page: the form's size, Django's limit, and a link back to the form's page
    when it is on this site."""
    referer = request.META.get("HTTP_REFERER", "")
    back = (
        referer
        if url_has_allowed_host_and_scheme(referer, {request.get_host()}, request.is_secure())
        else ""
    )
    length = request.META.get("CONTENT_LENGTH") or ""
    return TemplateResponse(
        request,
        "workflows/form_too_large.html",
        {
            "size": int(length) if length.isdigit() else None,
            "limit": settings.DATA_UPLOAD_MAX_MEMORY_SIZE,
            "back": back,
        },
        status=413,
    ).render()
