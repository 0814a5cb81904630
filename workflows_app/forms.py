"""Dashboard forms: they parse and validate input; the engine enforces its own rules."""

from __future__ import annotations

import json
import shlex
from datetime import UTC, datetime, timedelta
from typing import Any

from django import forms
from django.utils import timezone

from .client import InstanceHandle, get_workflow
from .converters import parse_pk
from .dashboard import ListFilters, workflow_names
from .engine.attributes import parse_filter as parse_attribute_filter
from .engine.durations import INSTANT_RANGE, parse_instant
from .engine.errors import (
    EventPayloadInvalid,
    InvalidDuration,
    InvalidEventType,
    InvalidInput,
    WorkflowError,
)
from .models import Status


class JSONField(forms.CharField):
    """A textarea of JSON; empty means null. Errors say where the JSON broke."""

    widget = forms.Textarea(
        attrs={"rows": 5, "spellcheck": "false", "class": "json", "data-json": "1"}
    )

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("required", False)
        super().__init__(strip=True, **kwargs)

    def to_python(self, value: Any) -> Any:
        text = super().to_python(value)
        if not text:
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise forms.ValidationError(
                f"Not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
            ) from None
        except (RecursionError, ValueError):  # ValueError: an integer of over 4,300 digits
            raise forms.ValidationError(
                "Not valid JSON here: nested too deeply (or a number too long) to parse"
            ) from None


def parse_attribute_text(text: str) -> dict[str, Any]:
    """`customer=c-9 plan="pro plus"`: typed like `wf list --attr` (5 is a number, "5" text)."""
    try:
        words = shlex.split(text)
        if not all("=" in word for word in words):
            raise InvalidInput(f"expected KEY=VALUE pairs, got {text!r}")
        pairs = dict(word.split("=", 1) for word in words)
        if len(pairs) != len(words):
            raise InvalidInput(f"each key once: {text!r} gives a key more than once")
        return parse_attribute_filter(pairs)
    except (ValueError, InvalidInput) as exc:
        raise forms.ValidationError(str(exc)) from None


class AttributesField(forms.CharField):
    """Search attributes typed as KEY=VALUE pairs separated by spaces."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("required", False)
        kwargs.setdefault("max_length", 2000)
        kwargs.setdefault("widget", forms.TextInput(attrs={"placeholder": "customer=c-9 plan=pro"}))
        super().__init__(**kwargs)

    def to_python(self, value: Any) -> dict[str, Any]:
        return parse_attribute_text(super().to_python(value) or "")


class CreateInstanceForm(forms.Form):
    workflow = forms.ChoiceField()
    id = forms.CharField(
        required=False, max_length=200, label="Instance id", help_text="optional; a UUID if empty"
    )
    idempotency_key = forms.CharField(required=False, max_length=200)
    params = JSONField(label="Params (JSON)")
    attributes = AttributesField(help_text="optional; KEY=VALUE separated by spaces")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["workflow"].choices = [(n, n) for n in workflow_names()]

    def create(self, actor: str) -> InstanceHandle | None:
        """Start the instance this (valid) form describes, as the dashboard and the admin
        do; None with the client's refusal on the form."""
        data = self.cleaned_data
        try:
            return get_workflow(data["workflow"]).create(
                params=data["params"],
                id=data["id"] or None,
                idempotency_key=data["idempotency_key"] or None,
                actor=actor,
                attributes=data["attributes"],
            )
        except WorkflowError as exc:
            self.add_error(None, str(exc))
            return None

    def found_instead(self, handle: InstanceHandle) -> str | None:
        """What to say when create() returned an instance its idempotency key found, started
        before with its own params (None: it started now): "Started …" would be untrue."""
        if handle.created:
            return None
        return (
            f"Started none: idempotency key {self.cleaned_data['idempotency_key']!r} found "
            f"{handle.workflow} instance {handle.id}, started before (its params are those it "
            "was started with)."
        )


class SendEventForm(forms.Form):
    type = forms.CharField(max_length=100)
    payload = JSONField(label="Payload (JSON)")

    def add_refusal(self, exc: WorkflowError) -> None:
        """The client's refusal of the event beside the field it is about: a refused payload
        is usually one field off, and the operator fixes it without retyping the rest."""
        if isinstance(exc, EventPayloadInvalid):
            self.add_error("payload", str(exc))
        elif isinstance(exc, InvalidEventType):
            self.add_error("type", str(exc))
        else:
            self.add_error(None, str(exc))


class RestartForm(forms.Form):
    from_step = forms.CharField(required=False, max_length=300)
    version = forms.IntegerField(required=False, min_value=1, max_value=2**31 - 1)


class CancelForm(forms.Form):
    compensate = forms.BooleanField(required=False)


BULK_ACTIONS = ("pause", "resume", "terminate")
MAX_BULK = 500  # one engine transaction per instance: keep a request bounded


class BulkActionForm(forms.Form):
    action = forms.ChoiceField(choices=[(a, a.title()) for a in BULK_ACTIONS])
    pk = forms.TypedMultipleChoiceField(
        coerce=int,
        choices=[],
        error_messages={"required": "select at least one instance in the list first"},
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Any pk is acceptable here; unknown ones simply match no instance.
        self.fields["pk"].valid_value = lambda value: parse_pk(str(value)) is not None  # type: ignore[attr-defined]

    def clean_pk(self) -> list[int]:
        pks: list[int] = self.cleaned_data["pk"]
        if len(pks) > MAX_BULK:
            raise forms.ValidationError(f"select at most {MAX_BULK} instances at once")
        return pks


class WallClockField(forms.DateTimeField):
    """A datetime-local input: the viewer's wall-clock time, returned tagged UTC for
    ListFilterForm to shift by the browser's offset. Django's field reads it in TIME_ZONE:
    in a project whose TIME_ZONE is not UTC every date filter was off by that zone's
    offset, and a time in its DST gap was refused though the viewer lives elsewhere."""

    widget = forms.DateTimeInput(attrs={"type": "datetime-local"})

    def to_python(self, value: Any) -> datetime | None:
        with timezone.override(UTC):
            return super().to_python(value)


class ListFilterForm(forms.Form):
    workflow = forms.ChoiceField(required=False)
    status = forms.ChoiceField(required=False, choices=[("", "any status"), *Status.choices])
    version = forms.IntegerField(required=False, min_value=1, max_value=2**31 - 1)
    created_from = WallClockField(required=False)
    created_to = WallClockField(required=False)
    q = forms.CharField(required=False, max_length=200, label="Search (id, params, output, error)")
    attrs = AttributesField(
        label="Attributes",
        help_text="exact matches, KEY=VALUE separated by spaces; quote a value with spaces",
    )
    # The browser's UTC offset in minutes, set by dashboard.js: datetime-local inputs carry
    # the viewer's wall-clock time, and every date on the page is shown in local time.
    tz = forms.IntegerField(required=False, min_value=-840, max_value=840, widget=forms.HiddenInput)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["workflow"].choices = [
            ("", "any workflow"),
            *((n, n) for n in workflow_names()),
        ]

    def filters(self) -> ListFilters:
        """The valid filters; an invalid field is ignored (and shown as an error)."""
        self.is_valid()  # fills cleaned_data with the fields that did validate
        data = self.cleaned_data
        offset = timedelta(minutes=data.get("tz") or 0)
        return ListFilters(
            workflow=data.get("workflow") or "",
            status=data.get("status") or "",
            version=data.get("version"),
            created_from=self._instant("created_from", offset),
            created_to=self._instant("created_to", offset),
            q=(data.get("q") or "").strip(),
            attributes=tuple((data.get("attrs") or {}).items()),
        )

    def _instant(self, name: str, offset: timedelta) -> datetime | None:
        """A date filter read in the viewer's time zone, as UTC; one outside the dates the
        database stores is an error on the field (ignored), not a server error."""
        value = self.cleaned_data.get(name)
        if value is None:
            return None
        try:
            return parse_instant(value - offset)
        except (OverflowError, InvalidDuration):
            shown = value.replace(tzinfo=None).isoformat(timespec="minutes")
            self.add_error(name, f"{shown} is outside the dates wfdash stores, {INSTANT_RANGE}")
            return None


BULK_JOB_ACTIONS = ("pause", "resume", "terminate", "cancel", "restart", "delete", "send_event")


class BulkJobForm(forms.Form):
    """ "Apply to all matching": the action, its options, and the list's filters as the
    query string the page was shown with."""

    action = forms.ChoiceField(
        choices=[(a, a.replace("_", " ").capitalize()) for a in BULK_JOB_ACTIONS]
    )
    filters = forms.CharField(required=False, max_length=4000, widget=forms.HiddenInput)
    event_type = forms.CharField(required=False, max_length=100, label="Event type")
    payload = JSONField(label="Payload (JSON)")
    from_step = forms.CharField(required=False, max_length=300, label="From step")
    to_version = forms.IntegerField(
        required=False, min_value=1, max_value=2**31 - 1, label="On version"
    )
