"""System checks for a project that installs wfdash: settings it cannot work with are
refused at start-up (manage.py check, runserver, migrate, wf), with what to change,
rather than failing at the first instance created."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.apps import apps
from django.conf import settings
from django.core.checks import Error, Warning, register
from django.db import DEFAULT_DB_ALIAS, router

from .setting_ranges import LOGIN_LOCKOUT_SECONDS, SETTING_RANGES, SWITCHES

APP_LABEL = "workflows_app"
# settings.WFDASH keys checked here but in neither table of setting_ranges.py.
OTHER_ENGINE_SETTINGS = (
    "RETENTION",  # E003
    "LIMITS",  # E004
    "METRICS_ADDR",
    "EMBEDDED_WORKER_QUEUES",
    "PAYLOAD_CODEC",
)


@register()
def check_use_tz(**_: Any) -> list[Error]:
    """The engine writes and compares aware UTC datetimes (its raw SQL, timers, schedules,
    spans): with USE_TZ = False Django refuses them on SQLite and reads PostgreSQL's in
    TIME_ZONE, so no instance could even be created."""
    if settings.USE_TZ:
        return []
    return [
        Error(
            "wfdash needs USE_TZ = True: its engine stores and compares timezone-aware UTC "
            "datetimes.",
            hint="Set USE_TZ = True (Django's default). TIME_ZONE may stay any zone; the "
            "dashboard shows times in the browser's zone, the API in UTC.",
            id="workflows_app.E001",
        )
    ]


@register()
def check_database(**_: Any) -> list[Error]:
    """The engine's raw SQL, transactions, LISTEN/NOTIFY, connection pool and schema check
    all use the "default" database: a router sending wfdash's models (or the user model
    its API tokens reference) to another alias would split them from the engine's."""
    misplaced: list[str] = []
    user_model = apps.get_model(settings.AUTH_USER_MODEL)
    for model in [*apps.get_app_config(APP_LABEL).get_models(), user_model]:
        label = model._meta.label
        if router.db_for_write(model) != DEFAULT_DB_ALIAS:
            misplaced.append(f"{label} is written to {router.db_for_write(model)!r}")
        elif router.db_for_read(model) != DEFAULT_DB_ALIAS:
            misplaced.append(f"{label} is read from {router.db_for_read(model)!r}")
    if not router.allow_migrate(DEFAULT_DB_ALIAS, APP_LABEL):
        misplaced.append(f"{APP_LABEL}'s migrations are not allowed on {DEFAULT_DB_ALIAS!r}")
    if not misplaced:
        return []
    return [
        Error(
            "wfdash keeps its tables in the 'default' database, and the user model in the "
            "same one, but DATABASE_ROUTERS route elsewhere: " + "; ".join(misplaced) + ".",
            hint="Make the routers return None (or 'default') for the app label "
            "'workflows_app' and the user model, and allow its migrations on 'default'; "
            "route the project's own apps to other aliases as you like.",
            id="workflows_app.E002",
        )
    ]


@register()
def check_retention(**_: Any) -> list[Error]:
    """WFDASH["RETENTION"] is read as each instance finishes: a typo there ("failure" for
    "error", "7 dayz") raised in every finish, leaving each instance that ended "running"
    for ever (and terminate() refused with the settings' error), while the checks passed.
    PRUNE_SECONDS is read as a worker starts: a bad one stopped every worker."""
    from .engine.errors import WorkflowError, shown
    from .engine.retention import settings_retention

    problems: list[str] = []
    try:
        settings_retention()
    except WorkflowError as exc:
        named = 'settings.WFDASH["RETENTION"]'
        problems.append(str(exc) if named in str(exc) else f"{named}: {exc}")
    # A worker prunes at least yearly: 1e12 s put its next prune past year 9999, an
    # OverflowError in the worker's loop after its first prune.
    prune = getattr(settings, "WFDASH", {}).get("PRUNE_SECONDS", 300)
    if not SETTING_RANGES["PRUNE_SECONDS"].admits(prune):
        problems.append(
            f'settings.WFDASH["PRUNE_SECONDS"] must be '
            f"{SETTING_RANGES['PRUNE_SECONDS'].describe()} (seconds; 0: only `wf prune` "
            f"prunes); got {shown(prune)}"
        )
    return [
        Error(
            problem,
            hint='e.g. WFDASH = {"RETENTION": {"success": "7 days", "error": "30 days"}, '
            '"PRUNE_SECONDS": 300}; see docs/operating.md, Retention.',
            id="workflows_app.E003",
        )
        for problem in problems
    ]


@register()
def check_limits(**_: Any) -> list[Error]:
    """WFDASH["LIMITS"] is read as each instance is created, and as each run starts: a typo
    there ("max_concurrent" for "max_concurrent_instances", "30 secs") refused every create
    and stopped every run with the settings' error, while the checks passed."""
    from .engine.errors import WorkflowError
    from .engine.limits import Limits

    configured = getattr(settings, "WFDASH", {}).get("LIMITS")
    try:
        if configured is not None and not isinstance(configured, dict):
            raise WorkflowError(f"must be a dict of limits, got {configured!r}")
        Limits.build(configured)
    except WorkflowError as exc:
        return [
            Error(
                f'settings.WFDASH["LIMITS"]: {exc}',
                hint='e.g. WFDASH = {"LIMITS": {"max_concurrent_instances": 50, '
                '"default_step_timeout": "10 minutes"}}; see the README.',
                id="workflows_app.E004",
            )
        ]
    return []


@register()
def check_engine_settings(**_: Any) -> list[Error]:
    """A host project's own settings.WFDASH got none of the refusals the WFDASH_*
    variables get (wfdash/settings.py): a lease of 1e12 s, 10**400, "abc", -5 or True was
    taken, then a worker failed later (an OverflowError at every claim, a TypeError as it
    started) naming no setting; "False" switched a switch on. Each value is checked
    against the same table as the variables (setting_ranges.py)."""
    from .engine.errors import shown
    from .engine.worker import worker_queues

    conf = getattr(settings, "WFDASH", {})
    if not isinstance(conf, dict):
        conf = {}  # no key to look up here
    problems: list[str] = []
    for key, bounds in SETTING_RANGES.items():
        if key == "PRUNE_SECONDS" or key not in conf:  # PRUNE_SECONDS: E003
            continue
        value = conf[key]
        if key == "METRICS_PORT" and value is None:
            continue  # no metrics port
        if not bounds.admits(value):
            problems.append(
                f'settings.WFDASH["{key}"] must be {bounds.describe()}; got {shown(value)}'
            )
    for key in SWITCHES:
        if key in conf and not isinstance(conf[key], bool):
            problems.append(
                f'settings.WFDASH["{key}"] must be True or False; got {shown(conf[key])}'
            )
    if "METRICS_ADDR" in conf and not isinstance(conf["METRICS_ADDR"], str):
        problems.append(
            'settings.WFDASH["METRICS_ADDR"] must be a host address (a string); got '
            f"{shown(conf['METRICS_ADDR'])}"
        )
    try:
        worker_queues(
            conf.get("EMBEDDED_WORKER_QUEUES"), 'settings.WFDASH["EMBEDDED_WORKER_QUEUES"]'
        )
    except ValueError as exc:
        problems.append(str(exc))
    if conf.get("PAYLOAD_CODEC"):
        from .codec import payload_codec

        try:
            payload_codec()
        except Exception as exc:  # an import path, then the class's own constructor
            problems.append(
                f'settings.WFDASH["PAYLOAD_CODEC"] cannot be loaded: {type(exc).__name__}: {exc}'
            )
    return [
        Error(
            problem,
            hint="Leave a setting out for wfdash's default; the ranges are those of the "
            "WFDASH_* variables (README, Installing into your project).",
            id="workflows_app.E005",
        )
        for problem in problems
    ]


@register()
def check_login_lockout(**_: Any) -> list[Error]:
    """throttle.login_locked_out (where the project names it as django-axes' lockout
    answer) reads AXES_COOLOFF_TIME.total_seconds(): an int (axes' hours) was an
    AttributeError at the first lockout, a million days an OverflowError. Same range as
    WFDASH_LOGIN_LOCKOUT_SECONDS."""
    from .engine.errors import shown

    if (
        getattr(settings, "AXES_LOCKOUT_CALLABLE", None)
        != "workflows_app.throttle.login_locked_out"
    ):
        return []
    cooloff = getattr(settings, "AXES_COOLOFF_TIME", None)
    if isinstance(cooloff, timedelta):
        if (
            LOGIN_LOCKOUT_SECONDS.minimum
            <= cooloff.total_seconds()
            <= LOGIN_LOCKOUT_SECONDS.maximum
        ):
            return []
        problem = (
            f"must be a duration from {LOGIN_LOCKOUT_SECONDS.minimum:.0f} to "
            f"{LOGIN_LOCKOUT_SECONDS.maximum:.0f} seconds"
        )
    else:
        problem = "must be a timedelta"
    return [
        Error(
            f"settings.AXES_COOLOFF_TIME {problem}; got {shown(cooloff)}",
            hint="e.g. AXES_COOLOFF_TIME = timedelta(minutes=15), or leave "
            'AXES_LOCKOUT_CALLABLE = "workflows_app.throttle.login_locked_out" out.',
            id="workflows_app.E006",
        )
    ]


# Django runs the command of the first app in INSTALLED_APPS that has one.
ENGINE_COMMANDS = {
    "runserver": "serves with daphne and starts the embedded worker",
    "runworker": "runs the engine on the `workflows` channel",
}


@register()
def check_command_order(commands: dict[str, str] | None = None, **_: Any) -> list[Warning]:
    """workflows_app's runserver and runworker replace daphne's, channels' and
    staticfiles'; listed after them, manage.py runs theirs: `runworker workflows` then
    serves the channel with no engine, and runserver starts no embedded worker, so no
    instance ever runs, and nothing says why."""
    from django.core.management import get_commands

    commands = get_commands() if commands is None else commands
    shadowed = [
        f"manage.py {name} is {commands[name]}'s ({name} of wfdash {what})"
        for name, what in ENGINE_COMMANDS.items()
        if commands.get(name, APP_LABEL) != APP_LABEL
    ]
    if not shadowed:
        return []
    return [
        Warning(
            "wfdash's management commands are shadowed: " + "; ".join(shadowed) + ".",
            hint="List 'workflows_app' first in INSTALLED_APPS (before 'daphne', "
            "'channels' and 'django.contrib.staticfiles').",
            id="workflows_app.W001",
        )
    ]


FORM_TOO_LARGE_MIDDLEWARE = "workflows_app.middleware.FormTooLargeMiddleware"
CSRF_MIDDLEWARE = "django.middleware.csrf.CsrfViewMiddleware"


@register()
def check_form_size_middleware(**_: Any) -> list[Warning]:
    """Without FormTooLargeMiddleware ahead of the CSRF check (which reads a form first), a
    form over DATA_UPLOAD_MAX_MEMORY_SIZE to the admin or the dashboard gets Django's bare
    "Bad Request" page, which says neither that it was too large nor what the limit is."""
    middleware = list(getattr(settings, "MIDDLEWARE", None) or [])
    if FORM_TOO_LARGE_MIDDLEWARE in middleware and (
        CSRF_MIDDLEWARE not in middleware
        or middleware.index(FORM_TOO_LARGE_MIDDLEWARE) < middleware.index(CSRF_MIDDLEWARE)
    ):
        return []
    return [
        Warning(
            "a form over DATA_UPLOAD_MAX_MEMORY_SIZE gets Django's bare 'Bad Request' page, "
            "not one naming the limit.",
            hint=f"Add {FORM_TOO_LARGE_MIDDLEWARE!r} to MIDDLEWARE, before {CSRF_MIDDLEWARE!r}.",
            id="workflows_app.W002",
        )
    ]
