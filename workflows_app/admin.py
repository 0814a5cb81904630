"""Django admin for every wfdash model.

Engine rows are read-only here: the engine owns them, and a form saving a stale
Instance would overwrite what a worker just wrote. State changes go through the client
(admin actions pause / resume / terminate / restart / skip sleep / send event / cancel, and
the add page, which starts an instance), like every other surface.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any, ClassVar

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.core.serializers.json import DjangoJSONEncoder
from django.db import connection, models
from django.db.models import OuterRef, QuerySet, Subquery
from django.forms.models import BaseInlineFormSet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.cache import add_never_cache_headers
from django.utils.functional import cached_property
from django.utils.html import format_html
from django.utils.safestring import SafeString

from . import tokens
from .bulk import PAUSE_REQUESTED, pause_one
from .client import InstanceHandle, ScheduleHandle, WorkflowBinding, schedules, start_bulk_job
from .engine import errors, lifecycle, store
from .engine.cron import check_cron, check_schedule_name, check_zone
from .engine.limits import check_size, encode_json
from .engine.registry import all_definitions, get_definition
from .forms import CreateInstanceForm, RestartForm, SendEventForm
from .models import (
    ApiToken,
    BulkJob,
    ErrorRecord,
    HistoryRecord,
    InboxEvent,
    Instance,
    Schedule,
    Span,
    StepRecord,
    WorkflowVersion,
    decode_json,
)
from .templatetags.wfdash import bdi_json

CHANGE_INSTANCE = "workflows_app.change_instance"
# Instances an admin action changes within its request; a bigger selection becomes bulk jobs.
ACTION_ROWS_IN_REQUEST = 500
NO_BULK_JOB = ""  # run_action's bulk_action for an action no bulk job applies (skip sleep)
APPLY = "apply"  # the submit button of an action's own form page: its input is there to apply


def pretty_json(value: Any) -> SafeString:
    """User data as indented JSON in a <pre>, escaped, each string isolated (bdi_json)."""
    text = json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, cls=DjangoJSONEncoder)
    return format_html('<pre style="white-space: pre-wrap; margin: 0">{}</pre>', bdi_json(text))


def json_field(
    attribute: str | Callable[[Any], Any], description: str
) -> Callable[[Any, Any], SafeString]:
    """A read-only admin column showing a (decoded) JSON attribute of the object."""

    def show(self: Any, obj: Any) -> SafeString:
        try:
            value = attribute(obj) if callable(attribute) else getattr(obj, attribute)
        except errors.CodecError as exc:  # stored by a payload codec this process cannot undo
            value = f"[cannot decode: {exc}]"
        return pretty_json(value)

    show.short_description = description  # type: ignore[attr-defined]
    return show


# --- change lists of big tables --------------------------------------------------------
# Instances, steps, history, events, spans and errors run to millions of rows. Django's
# change list counts every row that matches (and, with show_full_result_count, every row
# again), and each "all values" sidebar filter reads SELECT DISTINCT over the whole table:
# at 1M instances and 6M history records a list page took 2-3 s, most of it those. Here the
# count stops at COUNT_UP_TO, and each sidebar filter reads a bounded number of rows.

COUNT_UP_TO = 10_000  # rows a change list counts at most (100 pages of 100)
RECENT_ROWS = 10_000  # rows a sidebar filter of free-form values (types, names) looks at
MAX_CHOICES = 1_000  # values a sidebar filter offers at most


class AtLeast(int):
    """A count cut short at this number: compares and pages as it, shows as "10,000+"."""

    def __str__(self) -> str:
        return f"{int(self):,}+"


class BoundedCountPaginator(Paginator):
    """Counts at most COUNT_UP_TO rows: the list shows "10,000+" and the first 100 pages
    of a bigger one (filters and the search narrow it; the actions' "select all" still
    takes every matching row)."""

    @cached_property
    def count(self) -> int:
        n = self.object_list.order_by()[: COUNT_UP_TO + 1].count()
        return AtLeast(COUNT_UP_TO) if n > COUNT_UP_TO else n

    def page(self, number: Any) -> Any:
        if not isinstance(self.count, AtLeast):
            return super().page(number)
        number = self.validate_number(number)  # its last page is full: there are more rows
        bottom = (number - 1) * self.per_page
        return self._get_page(self.object_list[bottom : bottom + self.per_page], number, self)


class IndexedValuesFilter(admin.AllValuesFieldListFilter):
    """The values of a column an index starts with (a workflow name: instance_wf_id,
    error_workflow), read by a loose index scan."""

    def __init__(self, field: Any, request: Any, params: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(field, request, params, *args, **kwargs)
        self.lookup_choices = store.distinct_values(field.model, field.column, MAX_CHOICES)


class CatalogVersionFilter(admin.AllValuesFieldListFilter):
    """An instance's version: those of the version catalog and of this process's
    registry (every version an instance runs under is registered), not a read of every
    instance."""

    def __init__(self, field: Any, request: Any, params: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(field, request, params, *args, **kwargs)
        versions = {d.version for d in all_definitions()}
        versions.update(WorkflowVersion.objects.values_list("version", flat=True).distinct())
        self.lookup_choices = sorted(versions)[:MAX_CHOICES]


class RecentValuesFilter(admin.AllValuesFieldListFilter):
    """A free-form column (a history or event type, an error name): the values among the
    newest RECENT_ROWS rows of its table, and the one chosen."""

    def __init__(self, field: Any, request: Any, params: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(field, request, params, *args, **kwargs)
        quote = connection.ops.quote_name
        meta = field.model._meta
        sql = (
            f"SELECT DISTINCT value FROM (SELECT {quote(field.column)} AS value "
            f"FROM {quote(meta.db_table)} ORDER BY {quote(meta.pk.column)} DESC LIMIT %s) "
            f"newest LIMIT %s"
        )
        with connection.cursor() as cursor:
            cursor.execute(sql, [RECENT_ROWS, MAX_CHOICES])
            values = {row[0] for row in cursor.fetchall()}
        if self.lookup_val:
            values.update(self.lookup_val)
        self.lookup_choices = sorted(values, key=lambda v: (v is None, v))


class BigTableAdmin(admin.ModelAdmin):
    """A change list of a table that runs to millions of rows: one bounded count, and no
    facet counts (a COUNT per sidebar choice over every matching row)."""

    paginator = BoundedCountPaginator
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER


class ReadOnlyAdmin(BigTableAdmin):
    """Rows the engine writes: viewable, never added, edited or deleted by hand."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class ReadOnlyInline(admin.TabularInline):
    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


# Rows an instance page's inline shows: the newest ones. A year-long instance has tens of
# thousands of steps and history records; a form row each made the page take minutes.
INLINE_ROWS = 100


class NewestRowsFormSet(BaseInlineFormSet):
    """The instance's newest INLINE_ROWS rows, still oldest first (the inline's order)."""

    def get_queryset(self) -> QuerySet[Any]:
        if not hasattr(self, "_queryset"):
            rows = super().get_queryset()
            reverse = (f[1:] if f.startswith("-") else f"-{f}" for f in rows.query.order_by)
            newest = rows.order_by(*reverse).values("pk")[:INLINE_ROWS]
            self._queryset = rows.filter(pk__in=Subquery(newest))
        return self._queryset


class NewestRowsInline(ReadOnlyInline):
    """An inline that shows the newest INLINE_ROWS rows of the instance and, above them,
    how many there are with a link to all of them in their own (paginated) list."""

    formset = NewestRowsFormSet

    def get_formset(self, request: HttpRequest, obj: Any = None, **kwargs: Any) -> Any:
        if obj is not None:
            total = self.model.objects.filter(instance_id=obj.pk).count()
            plural = self.model._meta.verbose_name_plural
            if total > INLINE_ROWS:
                url = (
                    reverse(f"admin:workflows_app_{self.model._meta.model_name}_changelist")
                    + f"?instance__id__exact={obj.pk}"
                )
                self.verbose_name_plural = format_html(
                    '{} (the newest {} of {}: <a href="{}">all {}</a>)',
                    plural,
                    INLINE_ROWS,
                    f"{total:,}",
                    url,
                    plural,
                )
        return super().get_formset(request, obj, **kwargs)


class StepInline(NewestRowsInline):
    model = StepRecord
    fields = readonly_fields = (
        "seq",
        "name",
        "kind",
        "status",
        "attempts",
        "started_at",
        "completed_at",
        "last_error_name",
        "last_error_message",
    )
    ordering = ("seq",)


class HistoryInline(NewestRowsInline):
    model = HistoryRecord
    fields = readonly_fields = ("sequence", "created_at", "type", "actor", "data_json")
    ordering = ("sequence",)
    data_json = json_field("data", "data")


# --- instance actions -------------------------------------------------------------------------


def run_action(
    modeladmin: admin.ModelAdmin,
    request: HttpRequest,
    queryset: QuerySet[Instance],
    verb: str,
    act: Callable[[InstanceHandle, str], Any],
    bulk_action: str | None = None,
    bulk_options: dict[str, Any] | None = None,
) -> None:
    """Apply one client call to each selected instance; report successes and each failure.
    A bigger selection ("select all" over a big table) becomes bulk jobs instead: of
    bulk_action (the verb if None; NO_BULK_JOB: there is none, the selection is refused)
    with bulk_options (WorkflowBinding.bulk_options's event_type, payload, from_step,
    to_version)."""
    require_change_permission(request)
    actor = request.user.get_username()
    # Counted up to the limit: "select all" over a big table counted every row first.
    if queryset[: ACTION_ROWS_IN_REQUEST + 1].count() > ACTION_ROWS_IN_REQUEST:
        if bulk_action == NO_BULK_JOB:
            modeladmin.message_user(
                request,
                f"Could not {verb}: select at most {ACTION_ROWS_IN_REQUEST} instances "
                f"(there is no bulk {verb}).",
                messages.ERROR,
            )
            return
        start_bulk_jobs(
            modeladmin, request, queryset, verb, actor, bulk_action or verb, bulk_options or {}
        )
        return
    done = seen = 0
    for row in queryset.order_by("id"):
        seen += 1
        try:
            if act(InstanceHandle(row.workflow, row.instance_id, row), actor) is False:
                raise errors.InvalidTransition(f"it had already finished ({row.status})")
            done += 1
        except errors.WorkflowError as exc:
            modeladmin.message_user(request, f"Could not {verb} {row}: {exc}", messages.ERROR)
    # The selection is the checked rows the list still shows: said, not left out silently.
    gone = len(checked_rows(request)) - seen
    if gone > 0:
        modeladmin.message_user(
            request,
            f"Could not {verb} {gone} selected instance(s): deleted, or no longer matching the "
            "list's filters, since the list was shown.",
            messages.ERROR,
        )
    if done:
        modeladmin.message_user(
            request, f"{verb.capitalize()}: {done} instance(s).", messages.SUCCESS
        )


def checked_rows(request: HttpRequest) -> set[str]:
    """The change list's checked rows an action was asked for (none for "select all", whose
    selection is whatever the list's filters match now, or for an instance page's button)."""
    if forms.BooleanField().to_python(request.POST.get("select_across")):
        return set()
    return set(request.POST.getlist(ACTION_CHECKBOX_NAME))


def start_bulk_jobs(
    modeladmin: admin.ModelAdmin,
    request: HttpRequest,
    queryset: QuerySet[Instance],
    verb: str,
    actor: str,
    bulk_action: str,
    bulk_options: dict[str, Any],
) -> None:
    """One background bulk job per workflow of the selection: workers apply it in batches,
    its progress shows in the bulk jobs list, and the request only snapshots the ids."""
    for workflow in workflows_of(queryset):
        try:
            selection = queryset.filter(workflow=workflow)
            options = checked_bulk_options(workflow, bulk_action, bulk_options, selection)
            job = start_bulk_job(
                workflow,
                bulk_action,
                selection,
                {"selected_in": "admin"},
                options,
                actor,
            )
        except errors.WorkflowError as exc:
            modeladmin.message_user(
                request, f"Could not start bulk {verb} of {workflow}: {exc}", messages.ERROR
            )
            continue
        modeladmin.message_user(
            request,
            f"Started bulk {verb} #{job.id} of {job.matched} instance(s) of {workflow}; "
            "workers apply it in the background.",
            messages.SUCCESS,
        )


def checked_bulk_options(
    workflow: str, action: str, options: dict[str, Any], selection: QuerySet[Instance]
) -> dict[str, Any]:
    """The client's check of an action's options against a workflow's instances of the
    selection (each one's version's limits, the versions registered), as for a bulk job
    of them; raises the client's error."""
    return WorkflowBinding(workflow).bulk_options(
        action,
        options.get("event_type"),
        options.get("payload"),
        options.get("from_step"),
        True,
        options.get("to_version"),
        selection,
    )


def workflows_of(queryset: QuerySet[Instance]) -> list[str]:
    """The workflows of a selection, in name order: one probe each for the next name past
    the last one found (a loose index scan of an index that starts with the workflow).
    SELECT DISTINCT read every row of the selection: all of them for "select all"."""
    names: list[str] = []
    query = queryset.order_by("workflow").values_list("workflow", flat=True)
    while (name := (query.filter(workflow__gt=names[-1]) if names else query).first()) is not None:
        names.append(name)
    return names


NAMED_AT_MOST = 10  # instances a message names one by one


@admin.action(description="Pause selected instances", permissions=["change"])
def pause(modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Instance]) -> None:
    # An instance a run holds is only asked to pause (at its step's end): said apart, as
    # the dashboard does, or the operator takes it for paused.
    requested: list[str] = []

    def pause_saying_requested(h: InstanceHandle, actor: str) -> None:
        if pause_one(h, actor) == PAUSE_REQUESTED:
            requested.append(f"{h.workflow}/{h.id}")

    run_action(modeladmin, request, queryset, "pause", pause_saying_requested)
    if requested:
        more = len(requested) - NAMED_AT_MOST
        modeladmin.message_user(
            request,
            f"Of those, the pause is only requested for {len(requested)}: "
            f"{', '.join(requested[:NAMED_AT_MOST])}{f' and {more} more' if more > 0 else ''} "
            "(each pauses when its running step finishes).",
            messages.WARNING,
        )


@admin.action(description="Resume selected instances", permissions=["change"])
def resume(
    modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Instance]
) -> None:
    run_action(modeladmin, request, queryset, "resume", lambda h, actor: h.resume(actor=actor))


@admin.action(description="Terminate selected instances", permissions=["change"])
def terminate(
    modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Instance]
) -> None:
    run_action(
        modeladmin, request, queryset, "terminate", lambda h, actor: h.terminate(actor=actor)
    )


@admin.action(description="Restart selected instances from the beginning", permissions=["change"])
def restart(
    modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Instance]
) -> None:
    run_action(modeladmin, request, queryset, "restart", lambda h, actor: h.restart(actor=actor))


@admin.action(
    description="Cancel selected instances (compensating completed steps)", permissions=["change"]
)
def cancel(
    modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Instance]
) -> None:
    run_action(
        modeladmin,
        request,
        queryset,
        "cancel",
        lambda h, actor: h.cancel(compensate=True, actor=actor),
    )


@admin.action(description="Skip the current sleep of selected instances", permissions=["change"])
def skip_sleep(
    modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Instance]
) -> None:
    # The client refuses an instance with no sleep to skip (InvalidTransition): reported.
    run_action(
        modeladmin,
        request,
        queryset,
        "skip sleep",
        lambda h, actor: h.skip_sleep(actor=actor),
        NO_BULK_JOB,
    )


class RestartFromStepForm(RestartForm):
    from_step = forms.CharField(
        max_length=300,
        label="From step",
        help_text="the step's name: its checkpoint and every later one are dropped",
    )
    version = forms.IntegerField(
        required=False,
        min_value=1,
        max_value=2**31 - 1,
        label="On version",
        help_text="optional: run on this registered version from now on",
    )


@admin.action(description="Restart selected instances from a step…", permissions=["change"])
def restart_from_step(
    modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Instance]
) -> HttpResponse | None:
    """Asks for the step (and a version) on a page of its own, then restarts each instance."""
    require_change_permission(request)
    form = RestartFromStepForm(request.POST if APPLY in request.POST else None)
    if form.is_valid():
        options = {
            "from_step": form.cleaned_data["from_step"],
            "to_version": form.cleaned_data["version"],
        }
        if options_fit_selection(form, queryset, "restart", options):
            run_action(
                modeladmin,
                request,
                queryset,
                "restart",
                lambda h, actor: h.restart(
                    from_step=options["from_step"], actor=actor, version=options["to_version"]
                ),
                "restart",
                options,
            )
            return None
    return action_form_page(
        modeladmin, request, form, "Restart from a step", "Restart", queryset=queryset
    )


@admin.action(description="Send an event to selected instances…", permissions=["change"])
def send_event(
    modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Instance]
) -> HttpResponse | None:
    """Asks for the event type and JSON payload on a page of its own, checks them once (as
    a bulk send does), then sends the event to each instance."""
    require_change_permission(request)
    form = SendEventForm(request.POST if APPLY in request.POST else None)
    if form.is_valid():
        options = {"event_type": form.cleaned_data["type"], "payload": form.cleaned_data["payload"]}
        if options_fit_selection(form, queryset, "send_event", options):
            run_action(
                modeladmin,
                request,
                queryset,
                "send event",
                lambda h, actor: h.send_event(
                    options["event_type"], options["payload"], actor=actor
                ),
                "send_event",
                options,
            )
            return None
    return action_form_page(modeladmin, request, form, "Send an event", "Send", queryset=queryset)


def options_fit_selection(
    form: forms.Form, queryset: QuerySet[Instance], action: str, options: dict[str, Any]
) -> bool:
    """Check the options against each workflow of the selection before any instance is
    touched; a refusal goes on the form (beside its field where the form knows it)."""
    try:
        for workflow in workflows_of(queryset):
            checked_bulk_options(workflow, action, options, queryset.filter(workflow=workflow))
    except errors.WorkflowError as exc:
        if isinstance(form, SendEventForm):
            form.add_refusal(exc)
        else:
            form.add_error(None, str(exc))  # it names the option: from_step, to_version
        return False
    return True


def require_change_permission(request: HttpRequest) -> None:
    if not request.user.has_perm(CHANGE_INSTANCE):
        raise PermissionDenied


def action_form_page(
    modeladmin: admin.ModelAdmin,
    request: HttpRequest,
    form: forms.Form,
    title: str,
    button: str,
    queryset: QuerySet[Instance] | None = None,
) -> TemplateResponse:
    """The page of an action's (or the add page's) form: it posts back to where it came
    from with the selection it was asked for (the change list's action, select-all and
    checked rows; an instance page's button needs none). 400 once it was refused."""
    kept = ("action", "select_across", "index", ACTION_CHECKBOX_NAME)
    hidden = [(name, value) for name in kept for value in request.POST.getlist(name)]
    pk = request.resolver_match.kwargs.get("pk") if request.resolver_match else None
    if pk is not None:
        back = reverse("admin:workflows_app_instance_change", args=[pk])
    elif queryset is not None:
        back = request.get_full_path()
    else:
        back = reverse("admin:workflows_app_instance_changelist")
    selected = None
    if queryset is not None:
        n = queryset[: ACTION_ROWS_IN_REQUEST + 1].count()
        selected = AtLeast(ACTION_ROWS_IN_REQUEST) if n > ACTION_ROWS_IN_REQUEST else n
    return TemplateResponse(
        request,
        "admin/workflows_app/instance/action_form.html",
        {
            **modeladmin.admin_site.each_context(request),
            "opts": modeladmin.model._meta,
            "title": title,
            "form": form,
            "button": button,
            "apply": APPLY,
            "hidden": hidden,
            "selected": selected,
            "back_url": back,
        },
        status=400 if form.is_bound else 200,
    )


# The actions an instance's own admin page offers as buttons: verb, label, admin action.
INSTANCE_PAGE_ACTIONS = {
    "pause": ("Pause", pause),
    "resume": ("Resume", resume),
    "skip-sleep": ("Skip sleep", skip_sleep),
    "send-event": ("Send event…", send_event),
    "restart": ("Restart from the beginning", restart),
    "restart-from-step": ("Restart from a step…", restart_from_step),
    "terminate": ("Terminate", terminate),
    "cancel": ("Cancel and compensate", cancel),
}


def list_time(instant: datetime) -> SafeString:
    """A list cell's time, short for a narrow column: month, day and minute this year, the
    date in another year; to the second, with the year, in its tooltip."""
    local = timezone.localtime(instant)
    short = "%m-%d %H:%M" if local.year == timezone.localtime().year else "%Y-%m-%d"
    return format_html(
        '<span title="{}">{}</span>', local.strftime("%Y-%m-%d %H:%M:%S"), local.strftime(short)
    )


@admin.register(Instance)
class InstanceAdmin(BigTableAdmin):
    # Few, compact columns: at 1,400 px with the filter sidebar every column stays visible.
    list_display = (
        "instance_label",
        "workflow_label",
        "version",
        "status",
        "created",
        "finished",
        "error_label",
    )
    list_display_links = ("instance_label",)
    change_form_template = "admin/workflows_app/instance/change_form.html"
    list_filter = (
        "status",
        ("workflow", IndexedValuesFilter),
        ("version", CatalogVersionFilter),
        "created_at",
    )
    search_fields = (
        "instance_id",
        "workflow",
        "idempotency_key",
        "concurrency_key",
        "created_by",
        "error_name",
        "error_message",
    )
    # No date_hierarchy: its links are the distinct months (or years) of every instance's
    # created_at, a scan of the table; the "created" filter narrows by date without one.
    ordering = ("-id",)
    actions = (pause, resume, skip_sleep, send_event, terminate, restart, restart_from_step, cancel)
    inlines = (StepInline, HistoryInline)
    params = json_field("params", "params")
    output_pretty = json_field("output", "output")
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "workflow",
                    "instance_id",
                    "version",
                    "status",
                    "waiting_reason",
                    "created_by",
                    "idempotency_key",
                )
            },
        ),
        (
            "Data",
            {"fields": ("params", "output_pretty", "error_name", "error_message", "error_stack")},
        ),
        (
            "Flow control and children",
            {
                "fields": (
                    "priority",
                    "concurrency_key",
                    "debounce_key",
                    "admit_at",
                    "parent",
                    "parent_step",
                )
            },
        ),
        (
            "Times",
            {
                "fields": (
                    "created_at",
                    "updated_at",
                    "started_at",
                    "finished_at",
                    "wake_at",
                    "expires_at",
                )
            },
        ),
        (
            "Engine",
            {
                "classes": ("collapse",),
                "fields": (
                    "run_count",
                    "lease_owner",
                    "lease_expires_at",
                    "unproductive_claims",
                    "trace_id",
                    "retention_ms",
                ),
            },
        ),
    )
    readonly_fields = tuple(f for _, options in fieldsets for f in options["fields"])

    class Media:
        css: ClassVar[dict[str, tuple[str, ...]]] = {"all": ("workflows/admin.css",)}

    @admin.display(description="instance", ordering="instance_id")
    def instance_label(self, obj: Instance) -> SafeString:
        # One line, monospaced, whatever its length: a UUID must not wrap onto four lines;
        # past the column's width it is cut with an ellipsis, whole in the tooltip.
        return format_html(
            '<span class="wf-id wf-cut" title="{}">{}</span>', obj.instance_id, obj.instance_id
        )

    @admin.display(description="workflow", ordering="workflow")
    def workflow_label(self, obj: Instance) -> SafeString:
        return format_html('<span class="wf-cut" title="{}">{}</span>', obj.workflow, obj.workflow)

    @admin.display(description="error", ordering="error_name")
    def error_label(self, obj: Instance) -> SafeString | str:
        """The error's name, cut to the column; the tooltip has the name and message."""
        if not obj.error_name:
            return ""
        whole = f"{obj.error_name}: {obj.error_message}" if obj.error_message else obj.error_name
        return format_html('<span class="wf-cut" title="{}">{}</span>', whole, obj.error_name)

    @admin.display(description="created", ordering="created_at")
    def created(self, obj: Instance) -> SafeString:
        return list_time(obj.created_at)

    @admin.display(description="finished", ordering="finished_at")
    def finished(self, obj: Instance) -> SafeString | str:
        return "-" if obj.finished_at is None else list_time(obj.finished_at)

    def get_urls(self) -> list[Any]:
        return [
            path(
                "<int:pk>/act/<slug:verb>/",
                self.admin_site.admin_view(self.instance_page_action),
                name="workflows_app_instance_act",
            ),
            *super().get_urls(),
        ]

    def instance_page_action(self, request: HttpRequest, pk: int, verb: str) -> HttpResponse:
        """A button of an instance's own page: the same admin action, on that one instance."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if verb not in INSTANCE_PAGE_ACTIONS:
            raise Http404(f"no action {verb!r}")
        _label, action = INSTANCE_PAGE_ACTIONS[verb]
        # It checks the change permission; one that asks for input returns its form's page.
        response = action(self, request, Instance.objects.filter(pk=pk))
        return response or redirect("admin:workflows_app_instance_change", pk)

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        can_act = request.user.has_perm(CHANGE_INSTANCE)
        buttons = [
            (verb, label, verb in ("terminate", "cancel"))
            for verb, (label, _action) in INSTANCE_PAGE_ACTIONS.items()
        ]
        return super().change_view(
            request,
            object_id,
            form_url,
            {**(extra_context or {}), "instance_actions": buttons if can_act else []},
        )

    def add_view(
        self, request: HttpRequest, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """Start an instance through the client, with the dashboard's create form and its
        checks: a model form would save an engine row no worker knows how to run."""
        if not self.has_add_permission(request):
            raise PermissionDenied
        form = CreateInstanceForm(request.POST if request.method == "POST" else None)
        if form.is_valid():
            handle = form.create(request.user.get_username())
            if handle is not None:
                found = form.found_instead(handle)
                self.message_user(
                    request,
                    found or f"Started {handle.workflow} instance {handle.id}.",
                    messages.WARNING if found else messages.SUCCESS,
                )
                return redirect("admin:workflows_app_instance_change", handle.row(refresh=False).pk)
        return action_form_page(self, request, form, "Start an instance", "Start")

    def has_add_permission(self, request: HttpRequest) -> bool:
        # Starting one is an instance write, as in the dashboard: the change permission.
        return request.user.has_perm(CHANGE_INSTANCE)

    def has_change_permission(self, request: HttpRequest, obj: Instance | None = None) -> bool:
        # The list needs it for the actions; a single instance's form is view-only.
        return obj is None and super().has_change_permission(request)

    def has_delete_permission(self, request: HttpRequest, obj: Instance | None = None) -> bool:
        # Only finished instances may go (prune does it by retention); not under a live worker.
        return (
            obj is not None
            and obj.status in lifecycle.FINISHED
            and super().has_delete_permission(request, obj)
        )

    def delete_model(self, request: HttpRequest, obj: Instance) -> None:
        # The client's delete: rows locked and the status checked again, spans stored
        # before the instance went with it, the live "deleted" update sent.
        InstanceHandle(obj.workflow, obj.instance_id, obj).delete(actor=request.user.get_username())

    def delete_view(
        self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        # The client may refuse what the page offered: a finished child its parent has not
        # taken the output of yet, or an instance restarted since the page was shown. Said
        # on the instance's page (the delete and its log entry rolled back), not a 500.
        try:
            return super().delete_view(request, object_id, extra_context)
        except errors.WorkflowError as exc:
            self.message_user(request, f"Not deleted: {exc}", messages.ERROR)
            return redirect("admin:workflows_app_instance_change", object_id)

    def get_deleted_objects(
        self, objs: Any, request: HttpRequest
    ) -> tuple[Any, Any, set[str], Any]:
        # Steps, events, history and spans belong to the instance: deleting it may take them
        # although their own admins refuse deleting them one by one. They are counted, not
        # collected: Django's collector loads every row, and the page listed each one (a
        # year-long instance has tens of thousands; 5,000 steps took 85 MB and 20 s, for
        # the confirmation page and again for the delete itself).
        deleted: list[Any] = []
        counts: dict[str, int] = {}
        for obj in objs:
            owned = []
            for relation in Instance._meta.related_objects:
                if relation.on_delete is not models.CASCADE:
                    continue  # a child instance outlives its parent (parent set to NULL)
                model = relation.related_model
                n = model._default_manager.filter(**{relation.field.name: obj.pk}).count()
                if n:
                    plural = str(model._meta.verbose_name_plural)
                    counts[plural] = counts.get(plural, 0) + n
                    owned.append(f"{n:,} {plural}")
            url = reverse("admin:workflows_app_instance_change", args=[obj.pk])
            deleted.append(format_html('Instance: <a href="{}">{}</a>', url, obj))
            if owned:
                deleted.append(owned)
        counts = {str(Instance._meta.verbose_name_plural): len(objs), **counts}
        return deleted, counts, set(), []

    def get_actions(self, request: HttpRequest, action_location: Any = None) -> dict[str, Any]:
        # action_location: Django 6.1+ passes it (the change list or change form); 5.2 never does.
        extra = {} if action_location is None else {"action_location": action_location}
        actions = super().get_actions(request, **extra)
        actions.pop("delete_selected", None)
        return actions


@admin.register(StepRecord)
class StepRecordAdmin(ReadOnlyAdmin):
    list_display = ("name", "instance", "kind", "status", "attempts", "started_at", "completed_at")
    list_filter = ("kind", "status", ("instance__workflow", IndexedValuesFilter))
    search_fields = ("name", "instance__instance_id", "instance__workflow", "last_error_message")
    list_select_related = ("instance",)
    output_pretty = json_field("shown_output", "output")
    event_schema = json_field(lambda step: decode_json(step.event_schema_json), "event schema")
    readonly_fields = fields = (
        "instance",
        "name",
        "kind",
        "seq",
        "status",
        "output_pretty",
        "attempts",
        "max_attempts",
        "last_error_name",
        "last_error_message",
        "last_error_stack",
        "started_at",
        "completed_at",
        "wake_at",
        "event_type",
        "event_schema",
        "has_compensation",
    )


@admin.register(HistoryRecord)
class HistoryRecordAdmin(ReadOnlyAdmin):
    list_display = ("instance", "sequence", "type", "actor", "created_at")
    list_filter = (("type", RecentValuesFilter), ("instance__workflow", IndexedValuesFilter))
    search_fields = ("instance__instance_id", "type", "actor")
    list_select_related = ("instance",)
    data_pretty = json_field("shown_data", "data")
    readonly_fields = fields = (
        "instance",
        "sequence",
        "created_at",
        "type",
        "actor",
        "data_pretty",
    )


@admin.register(InboxEvent)
class InboxEventAdmin(ReadOnlyAdmin):
    list_display = ("type", "instance", "actor", "created_at", "consumed_at", "consumed_by")
    list_filter = (("type", RecentValuesFilter), ("instance__workflow", IndexedValuesFilter))
    search_fields = ("type", "instance__instance_id", "actor", "consumed_by")
    list_select_related = ("instance",)
    payload_pretty = json_field("payload", "payload")
    readonly_fields = fields = (
        "instance",
        "type",
        "payload_pretty",
        "actor",
        "created_at",
        "consumed_at",
        "consumed_by",
    )


@admin.register(Span)
class SpanAdmin(ReadOnlyAdmin):
    list_display = ("name", "kind", "instance", "trace_id", "start_time", "duration", "status_code")
    list_filter = (("kind", RecentValuesFilter), ("status_code", RecentValuesFilter))
    search_fields = ("name", "trace_id", "span_id", "instance__instance_id")
    list_select_related = ("instance",)
    attributes_pretty = json_field("attributes", "attributes")
    events_pretty = json_field("events", "events")
    links_pretty = json_field("links", "links")
    readonly_fields = fields = (
        "instance",
        "name",
        "kind",
        "trace_id",
        "span_id",
        "parent_span_id",
        "start_time",
        "end_time",
        "status_code",
        "status_message",
        "attributes_pretty",
        "events_pretty",
        "links_pretty",
    )

    @admin.display(description="duration (ms)")
    def duration(self, obj: Span) -> str:
        return f"{obj.duration_ms:.1f}"


@admin.register(ErrorRecord)
class ErrorRecordAdmin(ReadOnlyAdmin):
    list_display = (
        "created_at",
        "name",
        "short_message",
        "workflow",
        "instance",
        "step_name",
        "attempt",
        "source",
    )
    list_filter = (
        ("workflow", IndexedValuesFilter),
        ("source", RecentValuesFilter),
        ("name", RecentValuesFilter),
    )
    search_fields = ("name", "message", "step_name", "trace_id", "instance__instance_id")
    list_select_related = ("instance",)
    readonly_fields = fields = (
        "instance",
        "workflow",
        "source",
        "step_name",
        "attempt",
        "name",
        "message",
        "stack",
        "trace_id",
        "span_id",
        "created_at",
    )

    @admin.display(description="message")
    def short_message(self, obj: ErrorRecord) -> str:
        return obj.message if len(obj.message) <= 80 else obj.message[:79] + "…"


@admin.register(BulkJob)
class BulkJobAdmin(ReadOnlyAdmin):
    """Bulk jobs start from the client, `wf bulk`, the API or the dashboard's list."""

    list_display = (
        "id",
        "action",
        "workflow",
        "matched",
        "applied",
        "pause_requested",
        "skipped",
        "failed",
        "actor",
        "created_at",
        "finished_at",
    )
    list_filter = ("action", "workflow")
    readonly_fields = fields = (
        "action",
        "workflow",
        "filter",
        "shown_options",
        "matched",
        "processed",
        "applied",
        "pause_requested",
        "skipped",
        "failed",
        "errors",
        "actor",
        "created_at",
        "updated_at",
        "finished_at",
    )

    @admin.display(description="options")
    def shown_options(self, obj: BulkJob) -> Any:
        return obj.plain_options  # a send_event's payload opened from its seal


@admin.register(WorkflowVersion)
class WorkflowVersionAdmin(ReadOnlyAdmin):
    list_display = ("name", "version", "short_hash", "class_path", "registered_at", "last_seen_at")
    list_filter = ("name",)
    search_fields = ("name", "class_path", "source_hash")
    readonly_fields = fields = (
        "name",
        "version",
        "source_hash",
        "class_path",
        "registered_at",
        "last_seen_at",
    )

    @admin.display(description="source hash")
    def short_hash(self, obj: WorkflowVersion) -> str:
        return obj.source_hash[:12]


@admin.action(description="Revoke selected tokens", permissions=["change"])
def revoke_tokens(
    modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[ApiToken]
) -> None:
    count = queryset.filter(revoked_at__isnull=True).update(revoked_at=timezone.now())
    modeladmin.message_user(request, f"Revoked {count} token(s).", messages.SUCCESS)


@admin.action(
    description="Rotate the selected token (a new secret, shown once)", permissions=["change"]
)
def rotate_token(
    modeladmin: ApiTokenAdmin, request: HttpRequest, queryset: QuerySet[ApiToken]
) -> HttpResponse | None:
    selected = list(queryset.select_related("user")[:2])
    if len(selected) != 1:
        modeladmin.message_user(request, "Select exactly one token to rotate.", messages.ERROR)
        return None
    token = selected[0]
    refusal = tokens.issuer_refusal(request.user, token.user)
    if refusal:
        modeladmin.message_user(
            request, f"Cannot rotate {token.name!r}: {refusal}.", messages.ERROR
        )
        return None
    try:
        secret = tokens.rotate(token, issued_by=tokens.issuer_of(request.user))
    except tokens.TokenError as exc:
        modeladmin.message_user(request, str(exc), messages.ERROR)
        return None
    return modeladmin.secret_page(request, token, secret, "rotated")


class ApiTokenForm(forms.ModelForm):
    """Adding a token: who it acts as, its scope and workflows, and when it expires."""

    expires = forms.CharField(
        required=False, help_text='e.g. "30 days" or "12h"; empty: never. At most 3650 days.'
    )

    class Meta:
        model = ApiToken
        fields = ("name", "user", "scope", "workflows")

    issuer: Any = None  # the admin user adding the token (set by ApiTokenAdmin.get_form)

    def clean_name(self) -> str:
        try:
            return tokens.clean_name(self.cleaned_data.get("name"))
        except tokens.TokenError as exc:
            raise forms.ValidationError(str(exc)) from None

    def clean_workflows(self) -> str:
        try:
            return tokens.clean_workflows(self.cleaned_data.get("workflows"))
        except tokens.TokenError as exc:
            raise forms.ValidationError(str(exc)) from None

    def clean_expires(self) -> Any:
        try:
            return tokens.expiry(self.cleaned_data.get("expires"))
        except tokens.TokenError as exc:
            raise forms.ValidationError(str(exc)) from None

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        refusal = tokens.issuer_refusal(self.issuer, cleaned.get("user"))
        if refusal:
            raise forms.ValidationError(refusal[0].upper() + refusal[1:] + ".")
        return cleaned


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """Adding or rotating a token shows its secret once, in the response page only (never
    in a message: those travel in a cookie); only the SHA-256 is stored. Nobody mints a
    token carrying more than they hold (tokens.issuer_refusal)."""

    form = ApiTokenForm
    list_display = (
        "name",
        "prefix",
        "user",
        "scope",
        "workflows",
        "created_at",
        "expires_at",
        "last_used_at",
        "revoked_at",
    )
    list_filter = ("scope", "revoked_at", "user")
    list_select_related = ("user",)  # nullable (service tokens): Django would not join it itself
    search_fields = ("name", "prefix")  # and the user's name: get_search_fields

    def get_search_fields(self, request: HttpRequest) -> tuple[str, ...]:
        """Also the user's USERNAME_FIELD: "user__username" was a FieldError on every
        search in a project whose user model has no username (e.g. logs in by email)."""
        return (*self.search_fields, f"user__{get_user_model().USERNAME_FIELD}")

    actions = (revoke_tokens, rotate_token)
    add_fields = ("name", "user", "scope", "workflows", "expires")
    all_fields = (
        "name",
        "user",
        "issued_by",
        "scope",
        "workflows",
        "prefix",
        "token_hash",
        "created_at",
        "expires_at",
        "last_used_at",
        "rotated_at",
        "revoked_at",
    )

    def get_fields(self, request: HttpRequest, obj: ApiToken | None = None) -> tuple[str, ...]:
        return self.add_fields if obj is None else self.all_fields

    def get_readonly_fields(
        self, request: HttpRequest, obj: ApiToken | None = None
    ) -> tuple[str, ...]:
        return () if obj is None else self.all_fields

    def get_form(
        self, request: HttpRequest, obj: ApiToken | None = None, change: bool = False, **kwargs: Any
    ) -> Any:
        form = super().get_form(request, obj, change=change, **kwargs)
        return type(form.__name__, (form,), {"issuer": request.user})

    def save_model(self, request: HttpRequest, obj: ApiToken, form: Any, change: bool) -> None:
        if change:
            return  # every field is read-only once issued; rotate, or revoke and issue a new one
        secret = tokens.new_secret()
        tokens.set_secret(obj, secret)
        obj.issued_by = tokens.issuer_of(request.user)
        obj.created_at = timezone.now()
        obj.expires_at = form.cleaned_data.get("expires")
        super().save_model(request, obj, form, change)
        request.wf_token_secret = secret  # type: ignore[attr-defined]  # for response_add, this request only

    def response_add(
        self, request: HttpRequest, obj: ApiToken, post_url_continue: str | None = None
    ) -> HttpResponse:
        return self.secret_page(request, obj, request.wf_token_secret, "created")  # type: ignore[attr-defined]

    def secret_page(
        self, request: HttpRequest, token: ApiToken, secret: str, verb: str
    ) -> HttpResponse:
        """The one page that ever shows the secret; never cached."""
        response = TemplateResponse(
            request,
            "admin/workflows_app/apitoken/secret.html",
            {
                **self.admin_site.each_context(request),
                "opts": self.model._meta,
                "title": f"API token {token.name} {verb}",
                "token": token,
                "secret": secret,
                "verb": verb,
                "changelist_url": reverse("admin:workflows_app_apitoken_changelist"),
            },
        )
        add_never_cache_headers(response)
        return response


# --- schedules --------------------------------------------------------------------------------


def run_schedule_action(
    modeladmin: admin.ModelAdmin,
    request: HttpRequest,
    queryset: QuerySet[Schedule],
    verb: str,
    act: Callable[[ScheduleHandle, str], Any],
) -> None:
    """Apply one client call to each selected schedule; report successes and each failure."""
    done = 0
    for row in queryset.order_by("name"):
        try:
            act(schedules.get(row.name), request.user.get_username())
            done += 1
        except errors.WorkflowError as exc:
            modeladmin.message_user(request, f"Could not {verb} {row}: {exc}", messages.ERROR)
    if done:
        modeladmin.message_user(
            request, f"{verb.capitalize()}: {done} schedule(s).", messages.SUCCESS
        )


@admin.action(description="Pause selected schedules", permissions=["change"])
def pause_schedules(
    modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Schedule]
) -> None:
    run_schedule_action(modeladmin, request, queryset, "pause", lambda s, actor: s.pause())


@admin.action(description="Resume selected schedules", permissions=["change"])
def resume_schedules(
    modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Schedule]
) -> None:
    run_schedule_action(modeladmin, request, queryset, "resume", lambda s, actor: s.resume())


@admin.action(
    description="Start one instance of each selected schedule now", permissions=["change"]
)
def trigger_schedules(
    modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Schedule]
) -> None:
    if not request.user.has_perm(CHANGE_INSTANCE):  # starting instances is an instance write
        raise PermissionDenied
    run_schedule_action(
        modeladmin, request, queryset, "trigger", lambda s, actor: s.trigger(actor=actor)
    )


class ScheduleForm(forms.ModelForm):
    """Adding a runtime schedule: validated and created through the client, like the API."""

    params = forms.CharField(
        required=False, widget=forms.Textarea(attrs={"rows": 3}), help_text="JSON; empty: null"
    )

    class Meta:
        model = Schedule
        fields = ("name", "workflow", "cron", "timezone")

    def clean_params(self) -> Any:
        text = self.cleaned_data.get("params") or "null"
        try:
            return json.loads(text)
        except ValueError as exc:
            raise forms.ValidationError(f"params are not valid JSON: {exc}") from None
        except RecursionError:
            raise forms.ValidationError("params are nested too deeply to parse as JSON") from None

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        checks = {
            "name": check_schedule_name,
            "cron": check_cron,
            "timezone": check_zone,
            "workflow": get_definition,
        }
        for field, check in checks.items():
            if field in cleaned:
                try:
                    check(cleaned[field])
                except errors.WorkflowError as exc:
                    self.add_error(field, str(exc))
        if "params" in cleaned and "workflow" in cleaned and not self.has_error("workflow"):
            # schedules.create's own checks, here so that they show on the field (save_model
            # turns an error it raises into a 403, meant for a race on the name).
            try:
                text = encode_json(cleaned["params"], "params")
                limit = get_definition(cleaned["workflow"]).limits().max_params_bytes
                check_size(text, "max_params_bytes", limit, "params")
            except errors.WorkflowError as exc:
                self.add_error("params", str(exc))
        return cleaned


@admin.register(Schedule)
class ScheduleAdmin(admin.ModelAdmin):
    """Schedules are created here (or by code, API, command) and then only paused, resumed,
    triggered or deleted: their ticks' bookkeeping belongs to the workers."""

    form = ScheduleForm
    list_display = (
        "name",
        "workflow",
        "cron",
        "timezone",
        "paused",
        "declared",
        "next_run_at",
        "last_tick_at",
        "last_instance",
    )
    list_filter = ("paused", "declared", "workflow")
    search_fields = ("name", "workflow")
    actions = (pause_schedules, resume_schedules, trigger_schedules)
    add_fields = ("name", "workflow", "cron", "timezone", "params")
    all_fields = (
        "name",
        "workflow",
        "cron",
        "timezone",
        "params_pretty",
        "paused",
        "declared",
        "next_run_at",
        "last_tick_at",
        "last_instance",
        "created_by",
        "created_at",
        "updated_at",
    )
    params_pretty = json_field("params", "params")

    def get_fields(self, request: HttpRequest, obj: Schedule | None = None) -> tuple[str, ...]:
        return self.add_fields if obj is None else self.all_fields

    def get_readonly_fields(
        self, request: HttpRequest, obj: Schedule | None = None
    ) -> tuple[str, ...]:
        return () if obj is None else self.all_fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[Schedule]:
        # The last instance's pk in the list's own query: one look-up per row made the
        # list cost a query per schedule.
        last = Instance.objects.filter(
            workflow=OuterRef("workflow"), instance_id=OuterRef("last_instance_id")
        )
        return super().get_queryset(request).annotate(last_instance_pk=Subquery(last.values("pk")))

    @admin.display(description="last instance")
    def last_instance(self, obj: Schedule) -> SafeString | str:
        if not obj.last_instance_id:
            return ""
        pk = getattr(obj, "last_instance_pk", None)
        if pk is None:
            return obj.last_instance_id
        url = reverse("admin:workflows_app_instance_change", args=[pk])
        return format_html('<a href="{}">{}</a>', url, obj.last_instance_id)

    def save_model(self, request: HttpRequest, obj: Schedule, form: Any, change: bool) -> None:
        if change:
            return  # read-only once created: pause, resume, trigger or delete it
        try:
            created = schedules.create(
                obj.name,
                workflow=obj.workflow,
                cron=obj.cron,
                params=form.cleaned_data.get("params"),
                timezone=obj.timezone,
                actor=request.user,
            )
        except errors.WorkflowError as exc:  # a race with another create of the same name
            raise PermissionDenied(str(exc)) from exc
        obj.pk = Schedule.objects.get(name=created.name).pk

    def has_add_permission(self, request: HttpRequest) -> bool:
        # A schedule starts instances: as triggering one, an instance write too.
        return request.user.has_perm(CHANGE_INSTANCE) and super().has_add_permission(request)

    def has_delete_permission(self, request: HttpRequest, obj: Schedule | None = None) -> bool:
        # As the client: a declared schedule whose workflow left the code may go.
        deletable = obj is None or not store.schedules.declared_in_code(obj)
        return deletable and super().has_delete_permission(request, obj)

    def delete_model(self, request: HttpRequest, obj: Schedule) -> None:
        schedules.get(obj.name).delete()

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        for row in queryset:
            schedules.get(row.name).delete()  # refuses a declared one
