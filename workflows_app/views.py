"""Dashboard views (thin: lookup, permission, one engine call, render or redirect).

Pages need staff + workflows_app.view_instance; actions need workflows_app.change_instance
and a POST with a CSRF token. Every action passes the user as the actor, so the history
timeline says who did what.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import permission_required, user_passes_test
from django.core.exceptions import PermissionDenied
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseRedirect,
    JsonResponse,
    QueryDict,
)
from django.shortcuts import get_object_or_404, redirect, render
from django.template.defaultfilters import pluralize
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_GET, require_POST

from . import dashboard, dashboard_metrics, forms, surfaces
from .bulk import BULK_OUTCOMES, PAUSE_REQUESTED, RESUMED, TERMINATED, pause_one
from .client import HANDLE_FIELDS, BulkJobHandle, InstanceHandle, WorkflowBinding, schedules
from .client import start_bulk_job as start_bulk_job_for
from .converters import parse_pk
from .engine import errors
from .engine.errors import WorkflowError
from .models import Instance, Status

View = Callable[..., HttpResponse]
DELETE_PERMISSION = "workflows_app.delete_instance"

# Active staff only; anyone else goes to settings.LOGIN_URL. Not the admin's
# staff_member_required: it sends them to "admin:login", which a project without
# django.contrib.admin (or with it mounted elsewhere) cannot reverse: a 500, not a login.
staff_member_required = user_passes_test(lambda user: user.is_active and user.is_staff)


def dashboard_page(view: View) -> View:
    """Staff with view permission; anyone else is sent to settings.LOGIN_URL."""
    return staff_member_required(
        require_GET(permission_required("workflows_app.view_instance", raise_exception=True)(view))
    )


def dashboard_action(view: View) -> View:
    """Staff with change permission, POST only (CSRF is enforced by the middleware)."""
    return staff_member_required(
        require_POST(
            permission_required("workflows_app.change_instance", raise_exception=True)(view)
        )
    )


def _no_nul(*texts: str) -> None:
    """A name from the URL with a NUL cannot name anything (PostgreSQL refuses it in text)."""
    if any("\x00" in text for text in texts):
        raise Http404("no such name: it contains a NUL character")


# --- pages --------------------------------------------------------------------------------


@dashboard_page
def overview(request: HttpRequest) -> HttpResponse:
    return render(
        request,
        "workflows/overview.html",
        {"summaries": dashboard.workflow_summaries(), "page": "overview", "live": True},
    )


@dashboard_page
def metrics_page(request: HttpRequest) -> HttpResponse:
    """Throughput, failure rate and p50/p95 durations per workflow and step (?window=hour|day)."""
    return render(
        request,
        "workflows/metrics.html",
        {
            "m": dashboard_metrics.metrics_page(request.GET.get("window", "hour")),
            "windows": dashboard_metrics.WINDOWS,
            "max_samples": dashboard_metrics.MAX_SAMPLES,
            "step_table_open": dashboard_metrics.STEP_TABLE_OPEN,
            "page": "metrics",
        },
    )


@dashboard_page
def instance_list(request: HttpRequest) -> HttpResponse:
    form = forms.ListFilterForm(request.GET)
    filters = form.filters()
    try:
        page = dashboard.instance_page(filters, request.GET.get("after"), request.GET.get("before"))
    except WorkflowError as exc:  # a tampered cursor
        messages.error(request, str(exc))
        return redirect("workflows:instances")
    query = request.GET.copy()
    for key in ("after", "before", "job"):
        query.pop(key, None)
    return render(
        request,
        "workflows/instance_list.html",
        {
            "page": "instances",
            "live": True,
            "form": form,
            "rows": page.rows,
            "older": page.older,
            "newer": page.newer,
            "search_stopped": page.search_stopped,
            "search_scan": f"{dashboard.SEARCH_SCAN:,}",
            "query": query.urlencode(),
            "first_page": not request.GET.get("after") and not request.GET.get("before"),
            "create_form": forms.CreateInstanceForm(),
            "bulk_actions": forms.BULK_ACTIONS,
            "bulk_job_form": forms.BulkJobForm(initial={"filters": query.urlencode()}),
            "bulk_job": _shown_job(request.GET.get("job")),
        },
        status=400 if form.errors else 200,  # the page still renders, its bad filters marked
    )


def _shown_job(job_id: str | None) -> BulkJobHandle | None:
    """The bulk job a list page follows (?job=ID), if there is one."""
    pk = parse_pk(job_id or "")
    if pk is None:
        return None
    try:
        return BulkJobHandle.find(pk)
    except WorkflowError:
        return None


@dashboard_page
def bulk_job_count(request: HttpRequest) -> HttpResponse:
    """How many instances the list's filters match: "Apply to all N matching" asks for it
    when opened, so the list page itself never pays for a COUNT over what matched."""
    if not request.user.has_perm("workflows_app.change_instance"):
        raise PermissionDenied("bulk actions need workflows_app.change_instance")
    form = forms.ListFilterForm(request.GET)
    filters = form.filters()
    if form.errors:
        return JsonResponse({"error": "invalid filters", "fields": form.errors}, status=400)
    return JsonResponse({"matching": dashboard.count_matching(filters)})


@dashboard_page
def bulk_job_progress(request: HttpRequest, job_id: int) -> HttpResponse:
    """A bulk job's progress as JSON: the list page's progress bar reads it until done."""
    try:
        job = BulkJobHandle.find(job_id)
    except WorkflowError as exc:
        raise Http404(str(exc)) from None
    return JsonResponse(surfaces.bulk_job_json(job))


@dashboard_page
def instance_rows(request: HttpRequest) -> HttpResponse:
    """Rows newer than `since` that match the list's filters: a live list prepends them."""
    since = parse_pk(request.GET.get("since", ""))
    if since is None:
        raise Http404("since must be an instance pk")
    rows = dashboard.rows_newer_than(forms.ListFilterForm(request.GET).filters(), since)
    return render(request, "workflows/instance_rows.html", {"rows": rows})


@dashboard_page
def workflow_detail(request: HttpRequest, name: str) -> HttpResponse:
    _no_nul(name)
    page = dashboard.workflow_page(name)
    if page is None:
        raise Http404(f"no workflow {name!r}")
    return render(
        request, "workflows/workflow_detail.html", {"page": "overview", "live": False, "w": page}
    )


@dashboard_page
def schedule_list(request: HttpRequest) -> HttpResponse:
    return render(
        request,
        "workflows/schedules.html",
        {"page": "schedules", "live": False, "rows": dashboard.schedule_rows()},
    )


@dashboard_page
def schedule_detail(request: HttpRequest, name: str) -> HttpResponse:
    _no_nul(name)
    page = dashboard.schedule_page(name)
    if page is None:
        raise Http404(f"no schedule {name!r}")
    return render(
        request,
        "workflows/schedule_detail.html",
        {"page": "schedules", "live": False, "s": page},
    )


SCHEDULE_ACTIONS = ("pause", "resume", "trigger")


@dashboard_action
def schedule_action(request: HttpRequest, name: str, action: str) -> HttpResponse:
    """Pause, resume or trigger: needs change_schedule besides the dashboard's change_instance."""
    if action not in SCHEDULE_ACTIONS:
        raise Http404(f"no schedule action {action!r}")
    _no_nul(name)
    if not request.user.has_perm("workflows_app.change_schedule"):
        raise PermissionDenied
    back = reverse("workflows:schedule", args=[name])
    try:
        schedule = schedules.get(name)
        if action == "trigger":
            handle = schedule.trigger(actor=request.user.get_username())
            messages.success(request, f"Started {handle.id} from schedule {name}.")
        else:
            getattr(schedule, action)()
            messages.success(request, f"Schedule {name} {action}d.")
    except WorkflowError as exc:
        messages.error(request, f"Could not {action} schedule {name}: {exc}")
    return _back(request, back)


@dashboard_page
def instance_detail(request: HttpRequest, name: str, instance_id: str) -> HttpResponse:
    _no_nul(name, instance_id)
    pk = dashboard.find_instance_pk(name, instance_id)
    if pk is None:
        raise Http404(f"workflow {name!r} has no instance {instance_id!r}")
    return render(request, "workflows/instance_detail.html", _detail_context(pk))


@dashboard_page
def instance_by_pk(request: HttpRequest, pk: int) -> HttpResponse:
    """The old numeric address: redirect to the page named by workflow and instance id."""
    row = get_object_or_404(Instance.objects.only("id", "workflow", "instance_id"), pk=pk)
    return redirect(dashboard.instance_url(row))


@dashboard_page
def instance_fragment(request: HttpRequest, pk: int) -> HttpResponse:
    """The live parts of the detail page, re-fetched when its socket reports a change."""
    return render(request, "workflows/_instance_live.html", _detail_context(pk))


def _detail_context(pk: int, event_form: forms.SendEventForm | None = None) -> dict[str, Any]:
    try:
        detail = dashboard.instance_detail(pk)
    except Instance.DoesNotExist:
        raise Http404(f"no instance #{pk}") from None
    event_type = event_form["type"].value() if event_form is not None else None
    return {
        "page": "instances",
        "live": True,
        "d": detail,
        "inst": detail.instance,
        "event_form": event_form,
        "event_schema": detail.schema_for(event_type),
    }


@dashboard_page
def error_list(request: HttpRequest) -> HttpResponse:
    workflow = request.GET.get("workflow", "")
    _no_nul(workflow)
    try:
        page = dashboard.error_page(workflow, request.GET.get("after"), request.GET.get("before"))
    except WorkflowError as exc:
        messages.error(request, str(exc))
        return redirect("workflows:errors")
    return render(
        request,
        "workflows/errors.html",
        {
            "page": "errors",
            "rows": page.rows,
            "older": page.older,
            "newer": page.newer,
            "first_page": not request.GET.get("after") and not request.GET.get("before"),
            "workflow": workflow,
            "workflows": dashboard.workflow_names(),
        },
    )


# --- actions ------------------------------------------------------------------------------


@dashboard_action
def create_instance(request: HttpRequest) -> HttpResponse:
    form = forms.CreateInstanceForm(request.POST)
    if form.is_valid():
        handle = form.create(request.user.get_username())
        if handle is not None:
            if found := form.found_instead(handle):
                messages.warning(request, found)
            else:
                messages.success(request, f"Created {handle.workflow} instance {handle.id}.")
            return redirect(dashboard.instance_url(handle.row(refresh=False)))
    return render(
        request, "workflows/create.html", {"page": "instances", "create_form": form}, status=400
    )


class ActionInputInvalid(Exception):
    """The action's form did not validate; the message lists why."""


def _form_data(form_class: type[Any], request: HttpRequest) -> dict[str, Any]:
    form = form_class(request.POST)
    if not form.is_valid():
        raise ActionInputInvalid(
            "; ".join(f"{field}: {' '.join(errs)}" for field, errs in form.errors.items())
        )
    return form.cleaned_data


def _pause(h: InstanceHandle, request: HttpRequest, actor: str) -> str:
    if pause_one(h, actor) == PAUSE_REQUESTED:
        return "Pause requested: the instance pauses when its running step finishes."
    return "Paused."


def _resume(h: InstanceHandle, request: HttpRequest, actor: str) -> str:
    # resume() reports `running` for a moment; the run may park again at once (a sleep,
    # an event wait), so the message promises only what resume does.
    h.resume(actor=actor)
    return "Resumed: the instance continues from its last checkpoint."


def _terminate(h: InstanceHandle, request: HttpRequest, actor: str) -> str:
    if h.terminate(actor=actor):
        return "Terminated."
    return "Nothing to terminate: the instance had already finished."


def _restart(h: InstanceHandle, request: HttpRequest, actor: str) -> str:
    data = _form_data(forms.RestartForm, request)
    from_step, version = data["from_step"] or None, data["version"]
    h.restart(from_step=from_step, actor=actor, version=version)
    said = f"Restarted from step “{from_step}”" if from_step else "Restarted from the beginning"
    return said + (f" on version {version}." if version is not None else ".")


def _skip_sleep(h: InstanceHandle, request: HttpRequest, actor: str) -> str:
    # An instance not sleeping is refused (InvalidTransition, naming its status): the
    # action's error message says so ("Could not skip sleep: ... (it is waiting)").
    woken = h.skip_sleep(actor=actor)
    return "Skipped the sleep." if woken == 1 else f"Skipped {woken} sleeps."


def _cancel(h: InstanceHandle, request: HttpRequest, actor: str) -> str:
    compensate = _form_data(forms.CancelForm, request)["compensate"]
    if h.cancel(compensate=compensate, actor=actor) == Status.COMPENSATING:
        return "Cancelled: compensations are running, newest step first."
    return "Cancelled."


ACTIONS: dict[str, Callable[[InstanceHandle, HttpRequest, str], str]] = {
    "pause": _pause,
    "resume": _resume,
    "terminate": _terminate,
    "restart": _restart,
    "skip-sleep": _skip_sleep,
    "cancel": _cancel,
}


@dashboard_action
def instance_action(request: HttpRequest, pk: int, action: str) -> HttpResponse:
    if action not in ACTIONS and action != "send-event":
        raise Http404(f"no action {action!r}")
    row = get_object_or_404(Instance.objects.only(*HANDLE_FIELDS), pk=pk)
    handle = InstanceHandle(row.workflow, row.instance_id, row)
    if action == "send-event":
        return _send_event_keeping_input(request, handle, row)
    try:
        messages.success(request, ACTIONS[action](handle, request, request.user.get_username()))
    except (WorkflowError, ActionInputInvalid) as exc:
        messages.error(request, f"Could not {action.replace('-', ' ')}: {exc}")
    return _back(request, dashboard.instance_url(row))


def _resume_one(h: InstanceHandle, actor: str) -> str:
    h.resume(actor=actor)
    return RESUMED


def _terminate_live(h: InstanceHandle, actor: str) -> str:
    """A bulk terminate's: an instance that had already finished is a failure to report,
    not one more "Terminated" (terminate() changes nothing and says so with False)."""
    if not h.terminate(actor=actor):
        raise errors.InvalidTransition(
            f"cannot terminate instance {h.id!r}: it is already {h.status().status}"
        )
    return TERMINATED


BULK_APPLY: dict[str, Callable[[InstanceHandle, str], str]] = {
    "pause": pause_one,
    "resume": _resume_one,
    "terminate": _terminate_live,
}


def _bulk_done(outcomes: Counter[str]) -> str:
    said = ", ".join(
        f"{outcome} {outcomes[outcome]} instance{pluralize(outcomes[outcome])}"
        for outcome in BULK_OUTCOMES
        if outcomes[outcome]
    )
    return said[:1].upper() + said[1:] + "."


def _send_event_keeping_input(
    request: HttpRequest, h: InstanceHandle, row: Instance
) -> HttpResponse:
    """Send, or show the page again with the typed event kept and the error beside the form.

    A refused payload is usually one field off: clearing it, or reporting it at the top of
    the page, would make the operator retype it and hunt for the reason.
    """
    form = forms.SendEventForm(request.POST)
    if form.is_valid():
        try:
            h.send_event(
                form.cleaned_data["type"],
                form.cleaned_data["payload"],
                actor=request.user.get_username(),
            )
        except WorkflowError as exc:
            form.add_refusal(exc)
        else:
            messages.success(request, f"Sent event “{form.cleaned_data['type']}”.")
            return _back(request, dashboard.instance_url(row))
    context = _detail_context(row.pk, event_form=form)
    return render(request, "workflows/instance_detail.html", context, status=400)


@dashboard_action
def bulk_action(request: HttpRequest) -> HttpResponse:
    form = forms.BulkActionForm(request.POST)
    if not form.is_valid():
        messages.error(request, "; ".join(" ".join(e) for e in form.errors.values()))
        return _back(request, reverse("workflows:instances"))
    action, actor = form.cleaned_data["action"], request.user.get_username()
    outcomes: Counter[str] = Counter()
    failed = []
    seen = 0
    for row in Instance.objects.filter(pk__in=form.cleaned_data["pk"]).only(*HANDLE_FIELDS):
        seen += 1
        handle = InstanceHandle(row.workflow, row.instance_id, row)
        try:
            outcomes[BULK_APPLY[action](handle, actor)] += 1
        except WorkflowError as exc:
            failed.append(f"{row.instance_id}: {exc}")
    if outcomes:
        messages.success(request, _bulk_done(outcomes))
    for error in failed[:10]:
        messages.error(request, error)
    if len(failed) > 10:
        messages.error(request, f"… and {len(failed) - 10} more failures.")
    gone = len(set(form.cleaned_data["pk"])) - seen  # said, not left out silently
    if gone:
        what = "instance no longer exists" if gone == 1 else "instances no longer exist"
        messages.error(request, f"{gone} selected {what} (deleted since the list was shown).")
    return _back(request, reverse("workflows:instances"))


@dashboard_action
def start_bulk_job(request: HttpRequest) -> HttpResponse:
    """ "Apply to all N matching": a background job over what the list's filters match now;
    the list page then follows its progress."""
    form = forms.BulkJobForm(request.POST)
    back = reverse("workflows:instances")
    if not form.is_valid():
        messages.error(request, "; ".join(" ".join(e) for e in form.errors.values()))
        return _back(request, back)
    data = form.cleaned_data
    query = QueryDict(data["filters"])
    back = f"{back}?{query.urlencode()}"
    if data["action"] == "delete" and not request.user.has_perm(DELETE_PERMISSION):
        messages.error(request, f"Deleting instances needs the {DELETE_PERMISSION} permission.")
        return HttpResponseRedirect(back)
    filter_form = forms.ListFilterForm(query)
    filters = filter_form.filters()
    if filter_form.errors:
        messages.error(request, "Fix the filters first: the job would match other instances.")
        return HttpResponseRedirect(back)
    try:
        binding = WorkflowBinding(filters.workflow)
        selection = filters.apply(Instance.objects.all())
        options = binding.bulk_options(
            data["action"],
            data["event_type"] or None,
            data["payload"],
            data["from_step"] or None,
            True,
            data["to_version"],
            selection,
        )
        job = start_bulk_job_for(
            filters.workflow,
            data["action"],
            selection,
            filters.as_json(),
            options,
            request.user.get_username(),
        )
    except WorkflowError as exc:
        messages.error(request, f"Could not start the bulk job: {exc}")
        return HttpResponseRedirect(back)
    messages.success(
        request,
        f"Started bulk {job.action.replace('_', ' ')} of {job.matched} "
        f"instance{pluralize(job.matched)}.",
    )
    followed = query.copy()
    followed["job"] = str(job.id)
    return HttpResponseRedirect(f"{reverse('workflows:instances')}?{followed.urlencode()}")


def _back(request: HttpRequest, default: str) -> HttpResponseRedirect:
    """Redirect to the page the form came from (only if it is on this site)."""
    target = request.POST.get("next", "")
    if target and url_has_allowed_host_and_scheme(
        target, {request.get_host()}, request.is_secure()
    ):
        return HttpResponseRedirect(target)
    return HttpResponseRedirect(default)
