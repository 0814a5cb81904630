"""Durable state: one row per instance, one per step checkpoint, events, history, versions.

JSON values the engine must round-trip exactly (params, outputs, payloads) are stored as
JSON text, so `null` stays distinct from "no value yet" (a NULL column).
"""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from django.db import models
from django.db.models import Q

from .codec import REDACTED, is_sensitive, open_value, shown_text, shown_value, unseal


class Status(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    WAITING = "waiting"
    WAITING_FOR_PAUSE = "waitingForPause"
    COMPENSATING = "compensating"
    COMPLETE = "complete"
    ERRORED = "errored"
    TERMINATED = "terminated"
    UNKNOWN = "unknown"


# lifecycle.LIVE, in a fixed order: a partial index's condition and the queries it serves
# spell the same list.
LIVE_STATUSES = sorted(set(Status.values) - {Status.COMPLETE, Status.ERRORED, Status.TERMINATED})
LIVE_STATUSES_SQL = "status IN ({})".format(", ".join(f"'{s}'" for s in LIVE_STATUSES))

# The waiting_reason of a queued instance whose debounce holds it until its admit_at.
DEBOUNCED = "debounced until "
# Admission's line (instance_in_line): the queued instances no debounce holds (admit_at
# NULL, or a time that is a rate window's). The queries it serves spell the same condition
# (IN_LINE_SQL): SQLite uses a partial index only for a WHERE term written as its own.
IN_LINE = Q(status="queued") & (Q(admit_at__isnull=True) | ~Q(waiting_reason__startswith=DEBOUNCED))
IN_LINE_SQL = (
    "status = 'queued' AND (admit_at IS NULL OR "
    f"NOT (waiting_reason LIKE '{DEBOUNCED}%' ESCAPE '\\'))"
)

# The task indexes' rows (the claim of a worker that runs Django tasks): due tasks no
# worker holds. Their reads say `lease_token IS NULL` as a term of its own (SQLite).
UNLEASED_TASK = Q(queue__isnull=False, wake_at__isnull=False, lease_token__isnull=True)


def decode_json(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def decode_stored(text: str | None) -> Any:
    """A stored param, output or payload: through the payload codec when it was sealed."""
    return decode_json(unseal(text))


class WorkflowVersion(models.Model):
    """The catalog: every (workflow, version) ever registered, with its class's source hash."""

    name = models.CharField(max_length=200)
    version = models.PositiveIntegerField()
    source_hash = models.CharField(max_length=64)
    class_path = models.CharField(max_length=300, blank=True)
    registered_at = models.DateTimeField()
    last_seen_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["name", "version"], name="workflowversion_unique")
        ]
        ordering = ["name", "-version"]

    def __str__(self) -> str:
        return f"{self.name} v{self.version}"


class Instance(models.Model):
    workflow = models.CharField(max_length=200)
    instance_id = models.CharField(max_length=200)
    version = models.PositiveIntegerField()
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.RUNNING)
    params_json = models.TextField(default="null")
    output_json = models.TextField(null=True, blank=True)
    error_name = models.CharField(max_length=200, blank=True)
    error_message = models.TextField(blank=True)
    error_stack = models.TextField(blank=True)
    idempotency_key = models.CharField(max_length=200, null=True, blank=True)
    created_by = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # Runnable when wake_at <= now and the lease is free or expired; NULL when nothing is due
    # (queued, paused, finished, or parked without a deadline).
    wake_at = models.DateTimeField(null=True, blank=True)
    waiting_reason = models.CharField(max_length=500, blank=True)
    lease_owner = models.CharField(max_length=200, blank=True)
    # Fence: every write of a run is conditional on the token of the claim it was made under.
    lease_token = models.CharField(max_length=32, null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    # Claims since the instance last made progress; bounded to stop a poison instance.
    unproductive_claims = models.PositiveIntegerField(default=0)
    run_count = models.PositiveIntegerField(default=0)
    # Counters allocated under the row's write lock: gap-free history, step start order.
    history_seq = models.PositiveIntegerField(default=0)
    step_seq = models.PositiveIntegerField(default=0)
    compensate_on_cancel = models.BooleanField(default=False)
    trace_id = models.CharField(max_length=32, blank=True)
    # create(retention=…): kept this long after finishing; retention_ms for a success (or
    # every outcome), retention_error_ms for errored and terminated; NULL: the settings'.
    retention_ms = models.BigIntegerField(null=True, blank=True)
    retention_error_ms = models.BigIntegerField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    # Flow control (admission of queued instances): lower priority starts first; at most
    # max_concurrent_per_key active instances share a concurrency_key; a queued instance is
    # not admitted before admit_at (debounce), and admission is looked at again then (a rate
    # window opening). waiting_reason says why a queued instance waits. A Django task's
    # priority also orders it among due tasks when a worker claims (store.leases, _RANK).
    priority = models.PositiveSmallIntegerField(default=5)
    concurrency_key = models.CharField(max_length=200, null=True, blank=True)
    debounce_key = models.CharField(max_length=200, null=True, blank=True)
    admit_at = models.DateTimeField(null=True, blank=True)
    # A child workflow: the parent instance and the step (invoke / start) that started it;
    # parent_span is "<trace id>:<span id>" of the parent's run span that started it, linked
    # from the child's runs (the parent's run span links back to the child's creation span).
    # No index of its own: instance_child_per_step (parent, parent_step) serves a look-up
    # by parent, as a partial index can for "= parent", and instance_children (parent, id)
    # the children in the order they were started.
    parent = models.ForeignKey(
        "self",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="children",
        db_index=False,
    )
    parent_step = models.CharField(max_length=300, blank=True)
    parent_span = models.CharField(max_length=49, blank=True)
    # A child: True when a step.start created it ("start, don't wait": it outlives its
    # parent's end), False for a step.invoke's (ended with a parent that no longer waits).
    # NULL for an instance without a parent, and for a child created before migration
    # 0028 (or by a worker of the release before it): its parent's checkpoints tell.
    detached = models.BooleanField(null=True, blank=True)
    # The schedule that started the instance and the tick it fired for ("" / NULL otherwise).
    schedule = models.CharField(max_length=80, blank=True, default="")
    scheduled_at = models.DateTimeField(null=True, blank=True)
    # Search attributes (str/int/float/bool values) as given, never NULL; the list's
    # exact-match filters read their mirror, InstanceAttribute (one indexed row per key).
    attributes = models.JSONField(default=dict, blank=True)
    # A Django task's queue_name (NULL for every other instance): a worker started for some
    # queues only (runworker --queues) claims the instances of those queues only.
    queue = models.CharField(max_length=100, null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["workflow", "instance_id"], name="instance_id_per_workflow"
            ),
            models.UniqueConstraint(
                fields=["workflow", "version", "idempotency_key"],
                condition=Q(idempotency_key__isnull=False),
                name="instance_idempotency_key",
            ),
            # A step starts one child, whatever the replays: step.invoke / step.start.
            models.UniqueConstraint(
                fields=["parent", "parent_step"],
                condition=Q(parent__isnull=False),
                name="instance_child_per_step",
            ),
            # One not-yet-started instance per debounce key: a second create updates it.
            models.UniqueConstraint(
                fields=["workflow", "debounce_key"],
                condition=Q(
                    debounce_key__isnull=False,
                    started_at__isnull=True,
                    status__in=["queued", "paused"],
                ),
                name="instance_pending_debounce",
            ),
        ]
        indexes = [
            # claim_runnable: WHERE wake_at <= now AND lease free ORDER BY wake_at
            models.Index(
                fields=["wake_at"], name="instance_runnable", condition=Q(wake_at__isnull=False)
            ),
            # the same without the leased rows: the claim's pick of the unleased and the
            # idle wait's next timer read no running instance of the fleet's (those stay
            # due in instance_runnable while their leases last)
            models.Index(
                fields=["wake_at"],
                name="instance_unleased_runnable",
                condition=Q(wake_at__isnull=False, lease_token__isnull=True),
            ),
            # a worker of some queues only: WHERE queue = ? AND wake_at <= now ORDER BY
            # wake_at (tasks only; other instances, queue NULL, are not in it). Of the
            # rows no worker holds, as those below: a running task stays due.
            models.Index(
                fields=["queue", "wake_at"],
                name="instance_unleased_queue",
                condition=UNLEASED_TASK,
            ),
            # the claim of a worker that runs tasks: the first due task of each priority,
            # of every queue (WHERE priority = ? AND wake_at <= now ORDER BY wake_at) or
            # of one (WHERE queue = ? AND priority = ? ...). Tasks only, as above; those
            # whose lease ran out are read by instance_lease_expiry.
            models.Index(
                fields=["priority", "wake_at"],
                name="instance_unleased_task_prio",
                condition=UNLEASED_TASK,
            ),
            models.Index(
                fields=["queue", "priority", "wake_at"],
                name="instance_unleased_queue_prio",
                condition=UNLEASED_TASK,
            ),
            # the claim's pick of the due rows whose lease ran out (a worker died or hung).
            # Of the rows with an expiry, not "with a token": a read by token (a claim's
            # loads, a heartbeat) could then take it too, and read every lease of the fleet.
            models.Index(
                fields=["lease_expires_at"],
                name="instance_lease_expiry",
                condition=Q(lease_expires_at__isnull=False),
            ),
            # heartbeat: WHERE lease_token IN (the worker's tokens); only leased rows are in it
            models.Index(
                fields=["lease_token"],
                name="instance_leased",
                condition=Q(lease_token__isnull=False),
            ),
            # list(): WHERE workflow = ? [AND status = ?] ORDER BY id DESC; queue promotion by id
            models.Index(fields=["workflow", "status", "id"], name="instance_wf_status"),
            models.Index(fields=["workflow", "id"], name="instance_wf_id"),
            # admission: WHERE workflow = ? AND status = 'queued' ORDER BY priority, id
            models.Index(
                fields=["workflow", "priority", "id"],
                name="instance_queue",
                condition=Q(status="queued"),
            ),
            # admission's line without the pending debounces (IN_LINE): a page of it, and
            # whether a workflow's instances wait for a place (promote_stranded_queues),
            # read that page, not the debounces ahead of it.
            models.Index(
                fields=["workflow", "priority", "id"], name="instance_in_line", condition=IN_LINE
            ),
            # admit_due: WHERE status = 'queued' AND admit_at <= now (debounce, rate windows)
            models.Index(
                fields=["admit_at"], name="instance_admit_at", condition=Q(admit_at__isnull=False)
            ),
            # The first admit_at of each of a worker's workflows (first_admit, in every claim
            # after a create's hint): one probe a workflow, not a walk of instance_admit_at
            # past every other workflow's pending debounces.
            models.Index(
                fields=["workflow", "admit_at"],
                name="instance_queue_admit_at",
                condition=Q(status="queued", admit_at__isnull=False),
            ),
            # max_concurrent_per_key: active instances WHERE workflow = ? AND concurrency_key IN (...)
            models.Index(
                fields=["workflow", "concurrency_key", "status"],
                name="instance_concurrency_key",
                condition=Q(concurrency_key__isnull=False),
            ),
            # prune: WHERE expires_at <= now
            models.Index(
                fields=["expires_at"], name="instance_expiry", condition=Q(expires_at__isnull=False)
            ),
            # dashboard search across workflows: WHERE instance_id = ? / idempotency_key = ?
            models.Index(fields=["instance_id"], name="instance_public_id"),
            models.Index(
                fields=["idempotency_key"],
                name="instance_idem",
                condition=Q(idempotency_key__isnull=False),
            ),
            # /metrics, every scrape: unfinished instances by workflow and status (the
            # finished ones, most of a big table, are not in it); the query names the same
            # literal statuses (LIVE_STATUSES_SQL), which SQLite needs to use it.
            models.Index(
                fields=["workflow", "status"],
                name="instance_live",
                condition=Q(status__in=LIVE_STATUSES),
            ),
            # overview: runs and finishes in the last hour
            models.Index(fields=["created_at"], name="instance_created"),
            models.Index(
                fields=["finished_at"],
                name="instance_finished",
                condition=Q(finished_at__isnull=False),
            ),
            # schedule page: WHERE schedule = ? [AND id > started_above_pk] ORDER BY id DESC
            # (the instances it started)
            models.Index(
                fields=["schedule", "id"], name="instance_schedule", condition=~Q(schedule="")
            ),
            # The lists filtered by a finished status across workflows (dashboard, admin),
            # newest first: by the primary key alone a rare status meant a walk over the
            # whole table (an unfinished status has instance_live). Partial, so that SQLite,
            # which plans without statistics, never prefers it for the live statuses
            # (metrics) or a prune's expired range: it takes a partial index for literals.
            models.Index(
                fields=["status", "id"],
                name="instance_finished_status",
                condition=Q(status__in=["complete", "errored", "terminated"]),
            ),
            # An instance's children in the order they were started (the instance pages,
            # GET …/children?cursor=): partial, of children only.
            models.Index(
                fields=["parent", "id"], name="instance_children", condition=Q(parent__isnull=False)
            ),
            # The lists filtered by version (dashboard, admin, GET …/instances?version=),
            # of a workflow or across them, newest first: by the primary key alone a rare
            # version meant a walk over the whole table.
            models.Index(fields=["version", "workflow", "id"], name="instance_version"),
        ]

    def __str__(self) -> str:
        return f"{self.workflow}/{self.instance_id}"

    @property
    def params(self) -> Any:
        return decode_stored(self.params_json)

    @property
    def output(self) -> Any:
        return decode_stored(self.output_json)

    @property
    def error(self) -> dict[str, str] | None:
        if not self.error_name and not self.error_message:
            return None
        return {"name": self.error_name, "message": self.error_message}


class InstanceAttribute(models.Model):
    """One search attribute of an instance, a row per key: what list filters look up.

    Instance.attributes stays the attributes as given (shown, returned, bulk-recorded);
    these rows mirror it, written in the same transaction by every store write of
    attributes (create, step.set_attributes) and deleted with the instance. `value` is
    engine.attributes.index_text(value): JSON with one spelling per number, so "1", 1
    and true stay three values while 1 and 1.0 are one, as the JSON filter had them.
    """

    # No index of its own: the unique (instance, key) starts with it (one index less to write per row).
    instance = models.ForeignKey(
        Instance, on_delete=models.CASCADE, related_name="attribute_rows", db_index=False
    )
    key = models.CharField(max_length=64)
    value = models.TextField()

    class Meta:
        constraints = [
            # step.set_attributes: INSERT ... ON CONFLICT (instance_id, key) DO UPDATE;
            # its index also finds an instance's rows when the instance is deleted.
            models.UniqueConstraint(fields=["instance", "key"], name="instance_attribute_key"),
        ]
        indexes = [
            # list(attributes=...): WHERE key = ? AND value = ? ORDER BY instance_id DESC,
            # one index range per filtered key, walked newest first.
            models.Index(fields=["key", "value", "instance"], name="instance_attribute_lookup"),
        ]


class RateLimitStart(models.Model):
    """One start admission gave an instance of a workflow with a rate_limit (a restart's
    start too): what the limit counts.

    Not the instances' started_at: deleting or pruning an instance, or restarting it
    (which sets started_at anew), took its start out of the count, and more than `limit`
    started in a period. Written in the admission's transaction, under its lock; the
    admission drops the rows its window no longer holds. Workflows without a rate_limit
    write none.
    """

    workflow = models.CharField(max_length=200)
    started_at = models.DateTimeField()

    class Meta:
        indexes = [
            # admission: count WHERE workflow = ? AND started_at > now - period; and its
            # prune: DELETE WHERE workflow = ? AND started_at <= now - period
            models.Index(fields=["workflow", "started_at"], name="rate_limit_start"),
        ]


class MergedCreateKey(models.Model):
    """The idempotency key of a create that a debounce merged into a pending instance
    (which keeps its own key): a retry of that create finds the instance by it, as the
    retry of any keyed create does, instead of moving its start again or, once it has
    started, starting another (Temporal attaches a start's request id to the run it
    joined the same way). Keys are per workflow and version, like Instance's."""

    workflow = models.CharField(max_length=200)
    version = models.PositiveIntegerField()
    idempotency_key = models.CharField(max_length=200)
    # Indexed: deleting an instance deletes its keys.
    instance = models.ForeignKey(Instance, on_delete=models.CASCADE, related_name="+")

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["workflow", "version", "idempotency_key"], name="merged_create_key"
            ),
        ]


class Schedule(models.Model):
    """A cron schedule: each tick starts one instance of `workflow` with `params`.

    `declared` schedules come from register(schedules=[...]) and are kept in step with the
    code by the workers; the others are created at run time (client, API, command, admin).
    """

    name = models.CharField(max_length=80, unique=True)
    workflow = models.CharField(max_length=200)
    cron = models.CharField(max_length=200)
    timezone = models.CharField(max_length=64, default="UTC")
    params_json = models.TextField(default="null")
    paused = models.BooleanField(default=False)
    declared = models.BooleanField(default=False)
    # The next tick to fire; NULL while paused (resume computes it afresh from now).
    next_run_at = models.DateTimeField(null=True, blank=True)
    last_tick_at = models.DateTimeField(null=True, blank=True)
    last_instance_id = models.CharField(max_length=200, blank=True)
    created_by = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()
    # Each instance a runtime schedule starts has a greater primary key: the greatest one
    # when the schedule was created. Names are unique only among the schedules that exist,
    # so a schedule deleted and made again under its name for its workflow is another
    # schedule: its instances are those of its name and workflow above this bound
    # (store.schedules.started_instances). NULL for a declared schedule, which is its
    # declaration (one a deploy dropped and a later one brings back is the same schedule),
    # and for a schedule made before migration 0033: matched by name and workflow alone.
    started_above_pk = models.BigIntegerField(null=True, blank=True)

    class Meta:
        indexes = [
            # the worker's check: WHERE next_run_at <= now (and its earliest next tick)
            models.Index(
                fields=["next_run_at"],
                name="schedule_due",
                condition=Q(next_run_at__isnull=False),
            ),
        ]
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def params(self) -> Any:
        return decode_stored(self.params_json)


class StepKind(models.TextChoices):
    DO = "do"
    SLEEP = "sleep"
    SLEEP_UNTIL = "sleepUntil"
    WAIT_FOR_EVENT = "waitForEvent"
    COMPENSATE = "compensate"
    INVOKE = "invoke"  # step.invoke: start a child workflow and wait for its output
    START_CHILD = "startChild"  # step.start: start a child workflow, don't wait


class StepStatus(models.TextChoices):
    RUNNING = "running"
    RETRYING = "retrying"  # parked until wake_at, then the next attempt
    WAITING = "waiting"  # sleep or event wait parked until wake_at
    COMPLETE = "complete"
    FAILED = "failed"


class StepRecord(models.Model):
    """One step of one instance, keyed by name: its checkpoint and its attempt record."""

    # No index of its own: step_kind_name_per_instance starts with it (one index less to write per row).
    instance = models.ForeignKey(
        Instance, on_delete=models.CASCADE, related_name="steps", db_index=False
    )
    name = models.CharField(max_length=300)
    kind = models.CharField(max_length=16, choices=StepKind.choices)
    # Order the steps started in; restart(from_step) drops this step and every later one.
    seq = models.PositiveIntegerField()
    status = models.CharField(max_length=10, choices=StepStatus.choices)
    output_json = models.TextField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    max_attempts = models.PositiveIntegerField(default=1)
    last_error_name = models.CharField(max_length=200, blank=True)
    last_error_message = models.TextField(blank=True)
    last_error_stack = models.TextField(blank=True)
    started_at = models.DateTimeField()
    completed_at = models.DateTimeField(null=True, blank=True)
    # Sleep end, next retry attempt, or event-wait timeout: stored, so a restart keeps it.
    wake_at = models.DateTimeField(null=True, blank=True)
    event_type = models.CharField(max_length=100, blank=True)
    event_schema_json = models.TextField(null=True, blank=True)
    has_compensation = models.BooleanField(default=False)
    # The step before this one in the same branch (asyncio task) when it was first
    # checkpointed, "" for a branch's first step: replay compares it to notice steps that
    # were renamed, added, removed or reordered. NULL on rows from before it was kept.
    after = models.CharField(max_length=300, null=True, blank=True)

    class Meta:
        # A compensation is checkpointed under the name of the step it undoes, with its
        # own kind: it cannot collide with any name a workflow gives its steps.
        constraints = [
            models.UniqueConstraint(
                fields=["instance", "kind", "name"], name="step_kind_name_per_instance"
            )
        ]
        ordering = ["instance", "seq"]
        indexes = [
            # An instance's steps in start order: the newest N, and the pages of …/steps.
            models.Index(fields=["instance", "seq"], name="step_seq"),
            # metrics page: steps completed in the last hour / day
            models.Index(
                fields=["completed_at"],
                name="step_completed",
                condition=Q(completed_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.name}"

    @property
    def output(self) -> Any:
        """The value the engine replays (also that of a sensitive step)."""
        return decode_stored(self.output_json)

    @property
    def sensitive(self) -> bool:
        """Its output came from step.do(..., sensitive=True): surfaces show REDACTED."""
        return is_sensitive(self.output_json)

    @property
    def shown_output(self) -> Any:
        """The output as operators may see it."""
        return REDACTED if self.sensitive else self.output

    @property
    def label(self) -> str:
        """How history, spans and errors name it: a compensation says what it undoes."""
        return f"compensate:{self.name}" if self.kind == StepKind.COMPENSATE else self.name

    @property
    def duration_ms(self) -> float | None:
        if self.completed_at is None:
            return None
        return (self.completed_at - self.started_at).total_seconds() * 1000


class InboxEvent(models.Model):
    """An event sent to an instance; consumed by exactly one wait, in the order sent."""

    instance = models.ForeignKey(Instance, on_delete=models.CASCADE, related_name="events")
    type = models.CharField(max_length=100)
    payload_json = models.TextField(default="null")
    created_at = models.DateTimeField()
    actor = models.CharField(max_length=200, blank=True)
    consumed_at = models.DateTimeField(null=True, blank=True)
    consumed_by = models.CharField(max_length=300, blank=True)

    class Meta:
        indexes = [
            # deliver: WHERE instance = ? AND consumed_at IS NULL ORDER BY id
            models.Index(
                fields=["instance", "id"],
                name="inbox_unconsumed",
                condition=Q(consumed_at__isnull=True),
            ),
        ]
        ordering = ["id"]

    @property
    def payload(self) -> Any:
        return decode_stored(self.payload_json)

    @property
    def shown_payload_json(self) -> str | None:
        return shown_text(self.payload_json)


class HistoryRecord(models.Model):
    """Append-only, gap-free per-instance log of everything that happened to it."""

    # No index of its own: history_seq_per_instance starts with it (one index less to write per row).
    instance = models.ForeignKey(
        Instance, on_delete=models.CASCADE, related_name="history", db_index=False
    )
    sequence = models.PositiveIntegerField()
    created_at = models.DateTimeField()
    type = models.CharField(max_length=40)
    data = models.JSONField(default=dict, blank=True)
    actor = models.CharField(max_length=200, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["instance", "sequence"], name="history_seq_per_instance"
            )
        ]
        ordering = ["instance", "sequence"]

    def __str__(self) -> str:
        return f"#{self.sequence} {self.type}"

    @property
    def shown_data(self) -> dict[str, Any]:
        """The data as a page shows it: an event payload sealed by the payload codec
        decoded, or [cannot decode: …] when this process cannot (the page still renders)."""
        data = self.data
        if isinstance(data, dict) and isinstance(data.get("payload"), dict):
            return {**data, "payload": shown_value(data["payload"])}
        return data


def open_history_data(data: Any) -> Any:
    """History data as the client returns it: a sealed payload (event.received) decoded;
    CodecError when it cannot be."""
    if isinstance(data, dict) and isinstance(data.get("payload"), dict):
        return {**data, "payload": open_value(data["payload"])}
    return data


class HistorySubscriber(models.Model):
    """An open subscription to an instance's history (inst.subscribe, the SSE stream).

    On PostgreSQL a trigger on history inserts NOTIFYs channel wfdash_history only for
    instances that have an unexpired one: NOTIFY serialises commits, so checkpoints of
    instances nobody watches must not pay for it. Subscribers refresh expires_at while
    they stream and delete their row when they stop; a crashed one's row just expires.
    """

    # No index of its own: history_subscriber starts with it (one index less to write per row).
    instance = models.ForeignKey(
        Instance, on_delete=models.CASCADE, related_name="+", db_index=False
    )
    expires_at = models.DateTimeField()

    class Meta:
        indexes = [
            # the trigger: WHERE instance_id = ? AND expires_at > now()
            models.Index(fields=["instance", "expires_at"], name="history_subscriber"),
            # clean-up: WHERE expires_at < now
            models.Index(fields=["expires_at"], name="history_subscriber_expiry"),
        ]


class Span(models.Model):
    """A finished OpenTelemetry span, stored for the dashboard's trace waterfall."""

    # No index of its own: span_instance starts with it (one index less to write per row).
    instance = models.ForeignKey(
        Instance,
        on_delete=models.CASCADE,
        related_name="spans",
        null=True,
        blank=True,
        db_index=False,
    )
    trace_id = models.CharField(max_length=32)
    span_id = models.CharField(max_length=16)
    parent_span_id = models.CharField(max_length=16, blank=True)
    name = models.CharField(max_length=300)
    kind = models.CharField(max_length=16)
    start_time = models.DateTimeField()
    end_time = models.DateTimeField()
    status_code = models.CharField(max_length=8, default="UNSET")
    status_message = models.TextField(blank=True)
    attributes = models.JSONField(default=dict, blank=True)
    events = models.JSONField(default=list, blank=True)
    links = models.JSONField(default=list, blank=True)

    class Meta:
        indexes = [
            # The waterfall: WHERE instance_id = ? ORDER BY start_time. Also delete_rows'
            # spans stored before their instance was known (WHERE instance_id IS NULL AND
            # trace_id IN ...): few, found at the index's NULL end. No index on trace_id:
            # an entry for every span at a random place (a random trace id) cost more than
            # the rest of the row's insert (migration 0014).
            models.Index(fields=["instance", "start_time"], name="span_instance"),
        ]
        ordering = ["start_time"]

    @property
    def duration_ms(self) -> float:
        return (self.end_time - self.start_time).total_seconds() * 1000


class ErrorRecord(models.Model):
    """Every failed attempt and every failed instance, linked to its trace and span."""

    instance = models.ForeignKey(
        Instance, on_delete=models.CASCADE, related_name="errors", null=True, blank=True
    )
    workflow = models.CharField(max_length=200, blank=True)
    source = models.CharField(max_length=40)  # workflow.step | workflow.instance
    step_name = models.CharField(max_length=300, blank=True)
    attempt = models.PositiveIntegerField(null=True, blank=True)
    name = models.CharField(max_length=200)
    message = models.TextField(blank=True)
    stack = models.TextField(blank=True)
    trace_id = models.CharField(max_length=32, blank=True)
    span_id = models.CharField(max_length=16, blank=True)
    created_at = models.DateTimeField()

    class Meta:
        indexes = [
            # errors page: ORDER BY id DESC [WHERE workflow = ?]
            models.Index(fields=["workflow", "id"], name="error_workflow"),
        ]
        ordering = ["-id"]


class BulkAction(models.TextChoices):
    PAUSE = "pause"
    RESUME = "resume"
    TERMINATE = "terminate"
    CANCEL = "cancel"
    RESTART = "restart"
    DELETE = "delete"
    SEND_EVENT = "send_event"


class BulkJob(models.Model):
    """An action applied in the background to every instance a filter matched at its start.

    The matching instances are snapshotted (BulkJobItem rows) when the job is created, so
    instances created or changed later are not touched; workers apply the action in
    batches in instance order, each batch one transaction with its progress (`last_pk`),
    so a crash repeats nothing.
    """

    workflow = models.CharField(max_length=200, blank=True)  # "" when the filter spans workflows
    action = models.CharField(max_length=20, choices=BulkAction.choices)
    filter = models.JSONField(default=dict, blank=True)  # as given, for display
    options = models.JSONField(default=dict, blank=True)  # event type/payload, from_step, …
    matched = models.PositiveIntegerField(default=0)
    processed = models.PositiveIntegerField(default=0)
    last_pk = models.BigIntegerField(default=0)  # the snapshot is done up to this instance pk
    applied = models.PositiveIntegerField(default=0)
    # A pause job's instances in a step: asked to pause, they pause at its end (not applied).
    pause_requested = models.PositiveIntegerField(default=0)
    skipped = models.PositiveIntegerField(default=0)  # already in the target state, or gone
    failed = models.PositiveIntegerField(default=0)
    errors = models.JSONField(default=list, blank=True)  # the first messages of failures
    actor = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            # workers: WHERE finished_at IS NULL ORDER BY id
            models.Index(
                fields=["id"], name="bulkjob_pending", condition=Q(finished_at__isnull=True)
            ),
        ]
        ordering = ["-id"]

    @property
    def plain_options(self) -> dict[str, Any]:
        """The options as given: a send_event's payload opened from its seal."""
        if "payload_json" in self.options:
            shown = {k: v for k, v in self.options.items() if k != "payload_json"}
            return {**shown, "payload": self.event_payload}
        if "payload" not in self.options:
            return self.options
        return {**self.options, "payload": open_value(self.options["payload"])}

    @property
    def event_payload(self) -> Any:
        """A send_event job's payload, exactly as given. Kept as its (sealed) JSON text in
        options["payload_json"]: as a value in the jsonb column PostgreSQL refused a "\\u0000"
        in it and read 1e+20 back as an integer, -0.0 as 0.0. (Jobs made before that keep
        the value in options["payload"].)"""
        if "payload_json" in self.options:
            return decode_stored(self.options["payload_json"])
        return open_value(self.options.get("payload"))

    def __str__(self) -> str:
        return f"bulk {self.action} #{self.pk}"

    @property
    def done(self) -> bool:
        return self.finished_at is not None


class BulkJobItem(models.Model):
    """One instance a bulk job matched at its start (its pk: the instance may be deleted)."""

    # No index of its own: the unique (job, instance_pk) starts with it (one index less to write per row).
    job = models.ForeignKey(BulkJob, on_delete=models.CASCADE, related_name="items", db_index=False)
    instance_pk = models.BigIntegerField()

    class Meta:
        constraints = [
            # next batch: WHERE job = ? AND instance_pk > last_pk ORDER BY instance_pk LIMIT n
            models.UniqueConstraint(fields=["job", "instance_pk"], name="bulkjob_item")
        ]


class ApiToken(models.Model):
    """A named, revocable token for the JSON API; only its SHA-256 is stored.

    `scope` read lets it only read; write lets it also act. `workflows` (names separated
    by spaces; empty for all) confines it to those workflows. Whatever the scope, a token
    with a user never does more than that user's permissions allow, nor than its issuer's.
    """

    READ = "read"
    WRITE = "write"
    SCOPES = ((READ, "read: list and get instances"), (WRITE, "write: read, create and act"))

    name = models.CharField(max_length=100, unique=True)
    token_hash = models.CharField(max_length=64, unique=True)
    prefix = models.CharField(max_length=8, blank=True)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, null=True, blank=True
    )
    # Who minted (or last rotated) it, when not a superuser nor the shell: the token never
    # does more than they may either, now or later (its user may gain permissions).
    issued_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="issued_api_tokens",
    )
    scope = models.CharField(max_length=5, choices=SCOPES, default=WRITE)
    workflows = models.TextField(
        blank=True, default="", help_text="workflow names separated by spaces; empty: all"
    )
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    rotated_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return self.name

    @property
    def workflow_names(self) -> list[str]:
        return self.workflows.split()
