"""Every database read and write the engine makes, split by concern.

- leases: claims, leases and heartbeats; loading what a run needs;
- runs: a run's fenced writes (checkpoints, park, finish);
- control: admission (the queue under max_concurrent_instances) and operator actions;
- catalog: the version catalog, pruning and deleting;
- bulk: bulk jobs' snapshots, batches and progress;
- plans: PostgreSQL's kept plans re-made as the tables grow;
- dialect: every SQLite/PostgreSQL difference; records: what they share.

The functions are synchronous and each is one transaction; the engine calls them from its
database threads. Callers use this package's names (store.claim_runnable, ...).
"""

from __future__ import annotations

from . import bulk, catalog, control, dialect, plans, schedules
from .catalog import (
    VERSION_MISSING,
    absent_versions,
    delete_instances,
    delete_rows,
    prunable,
    prune,
    sync_catalog,
    touch_versions,
    wake_registered_versions,
)
from .control import (
    Cancelled,
    admit_due,
    cancel,
    child_of,
    create_instances,
    get_instance,
    holding_places,
    pause,
    promote_all_queued,
    promote_queued,
    promote_stranded_queues,
    restart,
    resume,
    send_event,
    skip_sleep,
    start_child,
    terminate,
    terminate_batch,
)
from .dialect import measure_clock_offset, retry_while_locked, transient
from .leases import (
    claim_and_load,
    claim_runnable,
    heartbeat,
    load_run,
    load_runs,
    next_claimable_at,
    next_wake_at,
    release,
    unconsumed_events,
)
from .plans import analyze_grown_tables
from .records import (
    History,
    LeaseLost,
    LoadedRun,
    NewInstance,
    append_history,
    model_object,
    new_model_object,
)
from .runs import (
    FinishWrite,
    StepWrite,
    begin_compensation,
    cancel_pending,
    finish,
    merge_attributes,
    park,
    park_unrunnable,
    rewrite_step,
    write_steps,
)
from .search import (
    contains_any_case,
    distinct_values,
    filter_attributes,
    index_attributes,
    instance_workflows,
    order_by_id,
    reads_created_range,
)
from .wakes import WakeListener, hint_workers, workers_listen

__all__ = [
    "VERSION_MISSING",
    "Cancelled",
    "FinishWrite",
    "History",
    "LeaseLost",
    "LoadedRun",
    "NewInstance",
    "StepWrite",
    "WakeListener",
    "absent_versions",
    "admit_due",
    "analyze_grown_tables",
    "append_history",
    "begin_compensation",
    "bulk",
    "cancel",
    "cancel_pending",
    "catalog",
    "child_of",
    "claim_and_load",
    "claim_runnable",
    "contains_any_case",
    "control",
    "create_instances",
    "delete_instances",
    "delete_rows",
    "dialect",
    "distinct_values",
    "filter_attributes",
    "finish",
    "get_instance",
    "heartbeat",
    "hint_workers",
    "holding_places",
    "index_attributes",
    "instance_workflows",
    "load_run",
    "load_runs",
    "measure_clock_offset",
    "merge_attributes",
    "model_object",
    "new_model_object",
    "next_claimable_at",
    "next_wake_at",
    "order_by_id",
    "park",
    "park_unrunnable",
    "pause",
    "plans",
    "promote_all_queued",
    "promote_queued",
    "promote_stranded_queues",
    "prunable",
    "prune",
    "reads_created_range",
    "release",
    "restart",
    "resume",
    "retry_while_locked",
    "rewrite_step",
    "schedules",
    "send_event",
    "skip_sleep",
    "start_child",
    "sync_catalog",
    "terminate",
    "terminate_batch",
    "touch_versions",
    "transient",
    "unconsumed_events",
    "wake_registered_versions",
    "workers_listen",
    "write_steps",
]
