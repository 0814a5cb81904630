"""Settings for the wfdash project, read from the environment.

DATABASE_URL (default: SQLite file beside manage.py), REDIS_URL (optional; switches the
channel layer to Redis), OTEL_EXPORTER_OTLP_ENDPOINT (optional; exports spans over OTLP),
WFDASH_LEASE_SECONDS, WFDASH_WORKER_CONCURRENCY, WFDASH_EMBEDDED_WORKER.

Without DJANGO_DEBUG=0 this is a development set-up (debug pages, a built-in key, the
demo). With DJANGO_DEBUG=0 the project refuses to start on the built-in SECRET_KEY or an
empty DJANGO_ALLOWED_HOSTS; DJANGO_HTTPS=1 (HTTPS redirect, secure cookies, HSTS),
DJANGO_HSTS_* and DJANGO_BEHIND_PROXY=1 (trust X-Forwarded-Proto) make
`manage.py check --deploy` clean (see the README's production block).

A variable set but empty counts as unset; a malformed one (a number, a boolean, a log
level) stops the start with an error naming it and what it must be.
"""

from __future__ import annotations

import math
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from workflows_app.setting_ranges import LOGIN_LOCKOUT_SECONDS, SETTING_RANGES, Range

BASE_DIR = Path(__file__).resolve().parent.parent


def env(name: str, default: str = "") -> str:
    """A variable's value; set but empty counts as unset (as `VAR=` in a compose file or
    an env file leaves it), for every variable this file reads."""
    value = os.environ.get(name, "")
    return value if value.strip() else default


TRUE_WORDS, FALSE_WORDS = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def env_bool(name: str, default: bool) -> bool:
    value = env(name).strip().lower()
    if not value:
        return default
    if value not in TRUE_WORDS | FALSE_WORDS:
        raise ImproperlyConfigured(
            f"{name} must be 1, true, yes or on, or 0, false, no or off; got {os.environ[name]!r}"
        )
    return value in TRUE_WORDS


def env_number(
    name: str, default: float, minimum: float, whole: bool = True, maximum: float = math.inf
) -> Any:
    """A numeric variable, refused in one line naming it when it is not a number (of at
    least minimum): a raw ValueError from int() did not say which variable."""
    return env_in_range(name, default, Range(minimum, maximum, whole))


def env_in_range(name: str, default: float, bounds: Range) -> Any:
    """A numeric variable within bounds (one of setting_ranges.py's, which the system
    checks hold a host project's settings.WFDASH to), refused naming it and the range."""
    value = env(name).strip()
    if not value:
        return default
    try:
        number = int(value) if bounds.whole else float(value)
    except ValueError:
        number = None
    # admits() compares exactly: a whole number of 400 digits raised OverflowError in
    # math.isfinite(), naming nothing.
    if number is None or not bounds.admits(number):
        raise ImproperlyConfigured(f"{name} must be {bounds.describe()}; got {value!r}")
    return number


def wfdash_env(name: str, default: float) -> Any:
    """settings.WFDASH[key] from the variable WFDASH_<key>, in the key's range."""
    return env_in_range(name, default, SETTING_RANGES[name.removeprefix("WFDASH_")])


def env_list(name: str, default: str = "") -> list[str]:
    return [item.strip() for item in env(name, default).split(",") if item.strip()]


DEVELOPMENT_SECRET_KEY = "wfdash-dev-insecure-change-me"
SECRET_KEY = env("DJANGO_SECRET_KEY", DEVELOPMENT_SECRET_KEY)
DEBUG = env_bool("DJANGO_DEBUG", True)
DEVELOPMENT_HOSTS = "localhost,127.0.0.1,[::1],testserver"
ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS", DEVELOPMENT_HOSTS if DEBUG else "")
CSRF_TRUSTED_ORIGINS = env_list("DJANGO_CSRF_TRUSTED_ORIGINS")

if not DEBUG:
    # A production server on a key everyone can read would sign anyone's session cookie.
    if SECRET_KEY in ("", DEVELOPMENT_SECRET_KEY):
        raise ImproperlyConfigured(
            "DJANGO_DEBUG=0 needs DJANGO_SECRET_KEY: set it to a long random string, e.g. "
            "python -c 'import secrets; print(secrets.token_urlsafe(50))'"
        )
    if not ALLOWED_HOSTS:
        raise ImproperlyConfigured(
            "DJANGO_DEBUG=0 needs DJANGO_ALLOWED_HOSTS: the host names this site answers to, comma-separated"
        )

# HTTPS (production): redirect to https, cookies only over https, HSTS. Off by default so
# the development server on http://127.0.0.1:8000 keeps working.
HTTPS = env_bool("DJANGO_HTTPS", False)
SECURE_SSL_REDIRECT = HTTPS
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = HTTPS
SECURE_HSTS_SECONDS = env_number("DJANGO_HSTS_SECONDS", 365 * 86400 if HTTPS else 0, 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("DJANGO_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = env_bool("DJANGO_HSTS_PRELOAD", False)
if env_bool("DJANGO_BEHIND_PROXY", False):
    # Only behind a proxy that sets X-Forwarded-Proto itself (and strips the client's).
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

INSTALLED_APPS = [
    # First, so its runserver (daphne + embedded engine) and runworker (Channels worker +
    # engine) override those of daphne and channels.
    "workflows_app",
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "csp",
    "axes",  # locks out an address after repeated failed logins
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "workflows_app.middleware.FormTooLargeMiddleware",  # before CSRF, which reads the form
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "csp.middleware.CSPMiddleware",
    "axes.middleware.AxesMiddleware",  # last, as django-axes asks
]

# Failed logins (the admin's and the dashboard's): after AXES_FAILURE_LIMIT from one
# address, that address is refused (429, Retry-After) for AXES_COOLOFF_TIME, even with
# the right password. Failed API tokens are throttled by workflows_app/throttle.py.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = env_number("WFDASH_LOGIN_FAILURE_LIMIT", 10, 1)
# At most a year: 10**14 s was an OverflowError here, 10**12 one at the first lockout.
AXES_COOLOFF_TIME = timedelta(
    seconds=env_in_range("WFDASH_LOGIN_LOCKOUT_SECONDS", 900, LOGIN_LOCKOUT_SECONDS)
)
AXES_LOCKOUT_PARAMETERS = ["ip_address"]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_CALLABLE = "workflows_app.throttle.login_locked_out"
AXES_VERBOSE = False

# Content-Security-Policy (django-csp) for the dashboard: scripts only from our static
# files, so escaped user data could never run even if an escape were missed. Inline
# style attributes stay allowed (the trace waterfall positions its bars with them).
# The Django admin keeps its own pages as Django ships them.
CONTENT_SECURITY_POLICY = {
    "EXCLUDE_URL_PREFIXES": ["/admin/"],
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'"],
        "style-src": ["'self'"],
        "style-src-attr": ["'unsafe-inline'"],
        "img-src": ["'self'", "data:"],
        "connect-src": ["'self'"],  # the dashboard's WebSockets, same origin
        "object-src": ["'none'"],
        "base-uri": ["'self'"],
        "form-action": ["'self'"],
        "frame-ancestors": ["'none'"],
    },
}

ROOT_URLCONF = "wfdash.urls"
ASGI_APPLICATION = "wfdash.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        # The wfdash site's own pages (not found, server error); the dashboard's templates
        # are the app's (workflows_app/templates), as in any project that installs it.
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": dj_database_url.parse(
        env("DATABASE_URL", f"sqlite:///{BASE_DIR / 'db.sqlite3'}"),
        conn_max_age=0,
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["default"]["OPTIONS"] = {
        # IMMEDIATE takes the write lock at BEGIN, so a read-then-write transaction
        # (claim, create under a concurrency limit) can never fail to upgrade its lock.
        "transaction_mode": "IMMEDIATE",
        "timeout": 30,  # seconds a writer waits for the lock before "database is locked"
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
    # Tests run on a real file (WAL, several connections) rather than shared-cache memory.
    DATABASES["default"]["TEST"] = {
        "NAME": env("WFDASH_TEST_SQLITE", str(BASE_DIR / ".test-db.sqlite3"))
    }
else:
    DATABASES["default"].setdefault("OPTIONS", {})
    if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql" and env_bool(
        "WFDASH_DB_POOL", True
    ):
        # psycopg's pool (Django's "pool" option): each process holds at most this many
        # connections, and a step that uses the database borrows one for its duration
        # instead of opening its own (3.4 ms per step on this machine) or keeping one per
        # worker thread (4 workers x 50 threads exceeded max_connections = 100).
        DATABASES["default"]["OPTIONS"]["pool"] = {
            "min_size": 2,
            "max_size": env_number("WFDASH_DB_POOL_SIZE", 16, 2),  # at least min_size
            "timeout": 30,  # seconds a thread waits for a free connection before an error
        }


def redis_channel_layer(url: str) -> dict[str, Any]:
    """The Redis channel layer wfdash uses between processes (daphne, workers)."""
    return {
        "BACKEND": "wfdash.redis_layer.RedisChannelLayer",
        "CONFIG": {
            # redis-py 8 reads with a 5 s socket timeout by default, the same as the
            # layer's blocking BZPOPMIN: an idle receive() then raised TimeoutError,
            # closing dashboard sockets and killing workers' hint listeners.
            "hosts": [{"address": url, "socket_timeout": 30, "socket_connect_timeout": 5}],
            "capacity": 1000,
            "expiry": 30,
        },
    }


REDIS_URL = env("REDIS_URL")
if REDIS_URL:
    CHANNEL_LAYERS = {"default": redis_channel_layer(REDIS_URL)}
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "wfdash.memory_layer.InMemoryChannelLayer"}}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": f"django.contrib.auth.password_validation.{name}"}
    for name in (
        "UserAttributeSimilarityValidator",
        "MinimumLengthValidator",
        "CommonPasswordValidator",
        "NumericPasswordValidator",
    )
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
# The site's own static files (the error pages' stylesheet); the dashboard's are the app's.
STATICFILES_DIRS = [BASE_DIR / "static"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
LOGIN_URL = "/admin/login/"
# Where a login goes when its ?next= is missing or not on this site (an open redirect
# refused): the admin's index, as the admin's login does without one. Django's default,
# /accounts/profile/, is no page here: the user landed on a 404.
LOGIN_REDIRECT_URL = "/admin/"

LOG_LEVEL = env("WFDASH_LOG_LEVEL", "INFO").strip().upper()
if LOG_LEVEL not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
    raise ImproperlyConfigured(
        f"WFDASH_LOG_LEVEL must be DEBUG, INFO, WARNING, ERROR or CRITICAL; got {LOG_LEVEL!r}"
    )
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    # Written once whoever set up logging: under daphne the root logger's handler writes them.
    "handlers": {"console": {"class": "wfdash.logs.ConsoleHandler"}},
    "loggers": {
        "workflows_app": {
            "handlers": ["console"],
            "level": LOG_LEVEL,
        }
    },
}

# wfdash engine settings. LIMITS overrides the Cloudflare defaults for every workflow;
# register(limits=...) overrides them per workflow.
# Django's tasks framework (django.tasks; the django-tasks backport on Django 5.2): every
# @task runs as a durable one-step workflow instance on wfdash's workers.
TASKS = {"default": {"BACKEND": "workflows_app.tasks.WorkflowTaskBackend"}}

WFDASH = {
    "LIMITS": {},
    # Each number in its range of workflows_app/setting_ranges.py, which the system checks
    # hold a host project's own WFDASH to. A lease past a day (heartbeats renew it): 1e12 s
    # was "OverflowError: date value out of range" at every claim.
    "LEASE_SECONDS": wfdash_env("WFDASH_LEASE_SECONDS", 30.0),
    "WORKER_CONCURRENCY": wfdash_env("WFDASH_WORKER_CONCURRENCY", 200),
    # Run the engine inside the ASGI process (runserver). Off by default when Redis is
    # configured: then `manage.py runworker workflows` processes run it.
    "EMBEDDED_WORKER": env_bool("WFDASH_EMBEDDED_WORKER", not REDIS_URL),
    "POLL_SECONDS": wfdash_env("WFDASH_POLL_SECONDS", 5.0),
    # At SIGTERM a worker lets running steps finish for this long, then cuts them short
    # and gives their leases back (keep it under the orchestrator's kill timeout).
    "DRAIN_SECONDS": wfdash_env("WFDASH_DRAIN_SECONDS", 10.0),
    # `runworker workflows` tries an unreachable PostgreSQL again for this long at start,
    # then exits 1 saying where it looked (for systemd or Kubernetes to restart it).
    "START_WAIT_SECONDS": wfdash_env("WFDASH_START_WAIT_SECONDS", 60.0),
    "DEMO": env_bool("WFDASH_DEMO", DEBUG),  # the demo workflows: on in development only
    # OpenTelemetry spans for every run, step, sleep and wait (stored; OTLP when configured).
    "TRACING": env_bool("WFDASH_TRACING", True),
    # Refuse a changed class under an already-registered version (see registry.py).
    "STRICT_VERSIONS": env_bool("WFDASH_STRICT_VERSIONS", True),
    # A sleep ending within this many ms is waited for by its run, not parked and woken.
    # At most a day: a 400-digit one was an OverflowError as each worker started.
    "SLEEP_IN_PROCESS_MS": wfdash_env("WFDASH_SLEEP_IN_PROCESS_MS", 1000),
    # A `runworker workflows` process serves its own metrics (runs, steps, latencies) in
    # Prometheus text on this port (unset: it serves none); the web process's /metrics has
    # the fleet-wide database gauges. Bound to METRICS_ADDR: loopback unless set.
    "METRICS_PORT": wfdash_env("WFDASH_METRICS_PORT", 0) or None,
    "METRICS_ADDR": env("WFDASH_METRICS_ADDR", "127.0.0.1"),
    # Checkpoints and ends of concurrent runs share one transaction (group commit). On by
    # default. SQLite: one writer, fewer commits and thread hops (~1.7x faster per step).
    # PostgreSQL: the group's checkpoints are pipelined and its ends are one statement
    # (per step 0.66 -> 0.44 ms, a herd's CPU per instance -30 %); a group cut by a dropped
    # connection is written again by each run, never re-run.
    # PostgreSQL: the engine's hot statements are prepared on each connection (planned
    # once, not per call). Off for a pooler that cannot keep prepared statements.
    "PG_PREPARE": env_bool("WFDASH_PG_PREPARE", True),
    # The first worker of a process freezes what is alive and collects the youngest
    # generation less often (engine/worker.py, tune_garbage_collector). Off: left alone.
    "GC_TUNING": env_bool("WFDASH_GC_TUNING", True),
    "GROUP_COMMIT": env_bool("WFDASH_GROUP_COMMIT", True),
    # Dashboard sockets one user may have open at once, across processes over Redis (a
    # socket past it closes with 4429); socket_slots.DEFAULT_MAX_SOCKETS_PER_USER.
    "MAX_SOCKETS_PER_USER": wfdash_env("WFDASH_MAX_SOCKETS_PER_USER", 100),
    # A worker whose event loop is blocked (an async step calling time.sleep) keeps its
    # leases from a thread for up to this many seconds; then other workers take over.
    "LOOP_STALL_RENEW_SECONDS": wfdash_env("WFDASH_LOOP_STALL_RENEW_SECONDS", 300.0),
}
