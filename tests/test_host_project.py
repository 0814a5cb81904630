"""wfdash installed into someone else's project, as the README's "Installing into your
project" tells: a custom user model, no django.contrib.admin, no CHANNEL_LAYERS, no
TEMPLATES DIRS nor STATICFILES_DIRS, TIME_ZONE not UTC, the dashboard and API under
/ops/wf/ and its sockets mounted in the project's own ASGI URLRouter. The project is
written under tmp_path and run in subprocesses (settings cannot swap the user model in
this process), on a SQLite file of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection

ROOT = Path(__file__).resolve().parent.parent

FILES = {
    "hostsettings.py": """
        SECRET_KEY = "host-project-test-key-" + "x" * 40
        DEBUG = False
        ALLOWED_HOSTS = ["testserver"]
        INSTALLED_APPS = [
            "workflows_app",  # first: its runserver and runworker are the ones run
            "django.contrib.auth",
            "django.contrib.contenttypes",
            "django.contrib.sessions",
            "django.contrib.messages",
            "django.contrib.staticfiles",
            "channels",
            "accounts",
            "shop",
        ]
        MIDDLEWARE = [
            "django.middleware.security.SecurityMiddleware",
            "django.contrib.sessions.middleware.SessionMiddleware",
            "django.middleware.common.CommonMiddleware",
            "workflows_app.middleware.FormTooLargeMiddleware",
            "django.middleware.csrf.CsrfViewMiddleware",
            "django.contrib.auth.middleware.AuthenticationMiddleware",
            "django.contrib.messages.middleware.MessageMiddleware",
        ]
        AUTH_USER_MODEL = "accounts.Person"
        ROOT_URLCONF = "hosturls"
        ASGI_APPLICATION = "hostasgi.application"
        TEMPLATES = [{
            "BACKEND": "django.template.backends.django.DjangoTemplates",
            "APP_DIRS": True,
            "OPTIONS": {"context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]},
        }]
        import os
        DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ["HOST_DB"]}}
        USE_TZ = True
        TIME_ZONE = "America/New_York"
        STATIC_URL = "/assets/"
        DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
        LOGIN_URL = "/accounts/login/"
        WFDASH = {"EMBEDDED_WORKER": False, "TRACING": False, "METRICS": False}
    """,
    "hosturls.py": """
        from django.urls import include, path
        urlpatterns = [path("ops/wf/", include("workflows_app.urls"))]
    """,
    "hostasgi.py": """
        import os
        from django.core.asgi import get_asgi_application
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hostsettings")
        django_asgi_app = get_asgi_application()
        from channels.auth import AuthMiddlewareStack
        from channels.routing import ProtocolTypeRouter, URLRouter
        from django.urls import path
        from workflows_app.origins import SameOriginValidator
        from workflows_app.routing import websocket_urlpatterns
        application = ProtocolTypeRouter({
            "http": django_asgi_app,
            "websocket": SameOriginValidator(AuthMiddlewareStack(URLRouter([
                path("ops/wf/", URLRouter(websocket_urlpatterns)),
            ]))),
        })
    """,
    # The same project with django.contrib.admin (its models' admin pages).
    "hostadminsettings.py": """
        from hostsettings import *
        INSTALLED_APPS = [*INSTALLED_APPS, "django.contrib.admin"]
        ROOT_URLCONF = "hostadminurls"
    """,
    "hostadminurls.py": """
        from django.contrib import admin
        from django.urls import include, path
        urlpatterns = [path("backoffice/", admin.site.urls), path("ops/wf/", include("workflows_app.urls"))]
    """,
    "accounts/__init__.py": "",
    "accounts/migrations/__init__.py": "",
    "accounts/models.py": """
        from django.contrib.auth.base_user import BaseUserManager
        from django.contrib.auth.models import AbstractBaseUser, PermissionsMixin
        from django.db import models

        class PersonManager(BaseUserManager):
            def create_superuser(self, email, password=None, **extra):
                user = self.model(email=email, is_staff=True, is_superuser=True, **extra)
                user.set_password(password)
                user.save(using=self._db)
                return user

        class Person(AbstractBaseUser, PermissionsMixin):
            email = models.EmailField(unique=True)
            is_staff = models.BooleanField(default=False)
            is_active = models.BooleanField(default=True)
            USERNAME_FIELD = "email"
            objects = PersonManager()
    """,
    "shop/__init__.py": "",
    "shop/workflows.py": """
        from workflows_app.engine import WorkflowEntrypoint, register

        @register("host-nap", version=1)
        class Nap(WorkflowEntrypoint):
            async def run(self, event, step):
                await step.sleep("nap", "1 hour")
                return {"slept": True}
    """,
}


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The host project, migrated (its accounts app's migration made first)."""
    if connection.vendor != "sqlite":
        # Its subprocesses run on a SQLite file of their own whatever the leg's database:
        # on the PostgreSQL leg (CI's longest) they would repeat the SQLite leg's runs.
        pytest.skip("the host project runs on SQLite of its own; the SQLite leg runs it")
    project = tmp_path_factory.mktemp("hostproject")
    for name, text in FILES.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(textwrap.dedent(text))
    django_admin(project, "makemigrations", "accounts")
    django_admin(project, "migrate")
    return project


def host_env(project: Path, settings: str = "hostsettings") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "WFDASH_"))}
    env.pop("DATABASE_URL", None)
    env.pop("REDIS_URL", None)
    return {
        **env,
        "DJANGO_SETTINGS_MODULE": settings,
        "PYTHONPATH": os.pathsep.join([str(project), str(ROOT)]),
        "HOST_DB": str(project / "db.sqlite3"),
    }


def django_admin(project: Path, *args: str, settings: str = "hostsettings") -> str:
    done = subprocess.run(
        [sys.executable, "-m", "django", *args],
        cwd=project,
        env=host_env(project, settings),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"django {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def run_in(project: Path, script: str, settings: str = "hostsettings") -> dict:
    """Runs script after django.setup() in the host project; it prints one JSON line last."""
    preamble = "import django, json\ndjango.setup()\n"
    done = subprocess.run(
        [sys.executable, "-c", preamble + textwrap.dedent(script)],
        cwd=project,
        env=host_env(project, settings),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"host script failed:\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


LOGGED_IN = """
    from django.test import Client
    from django.test.utils import setup_test_environment
    setup_test_environment()
    from accounts.models import Person
    Person.objects.filter(email="boss@example.com").delete()
    boss = Person.objects.create_superuser("boss@example.com", "pw")
    client = Client()
    client.force_login(boss)
"""


def test_a_custom_user_model_passes_the_checks_and_owns_api_tokens(host: Path) -> None:
    """ApiToken's user and issued_by named "auth.User": a project with AUTH_USER_MODEL
    could not even migrate (fields.E301, the relation to a swapped-out model)."""
    assert "no issues" in django_admin(host, "check")
    result = run_in(
        host,
        LOGGED_IN
        + """
    from workflows_app import tokens
    from workflows_app.client import get_workflow
    token, raw = tokens.issue("host-ci", "boss@example.com")
    get_workflow("host-nap").create(id="tok-1")
    answer = Client().get(
        "/ops/wf/api/workflows/host-nap/instances/tok-1", HTTP_AUTHORIZATION=f"Bearer {raw}"
    )
    print(json.dumps({"user": token.user.email, "status": answer.status_code}))
    """,
    )
    assert result == {"user": "boss@example.com", "status": 200}


def test_the_dashboard_works_without_django_admin(host: Path) -> None:
    """The dashboard sent anonymous users to "admin:login" and linked "admin:index": in a
    project without django.contrib.admin both were a NoReverseMatch, a 500 for everyone.
    Now anonymous users go to the project's LOGIN_URL; the Admin link shows only with an
    admin to go to."""
    result = run_in(
        host,
        LOGGED_IN
        + """
    anonymous = Client().get("/ops/wf/")
    pages = ["/ops/wf/", "/ops/wf/instances/", "/ops/wf/errors/", "/ops/wf/schedules/",
             "/ops/wf/stats/", "/ops/wf/workflows/host-nap/"]
    answers = [client.get(url) for url in pages]
    print(json.dumps({
        "anonymous": [anonymous.status_code, anonymous["Location"]],
        "pages": [answer.status_code for answer in answers],
        "admin_link": any(">Admin</a>" in answer.content.decode() for answer in answers),
    }))
    """,
    )
    assert result == {
        "anonymous": [302, "/accounts/login/?next=/ops/wf/"],
        "pages": [200] * 6,
        "admin_link": False,
    }


def test_the_templates_and_static_files_ship_inside_the_app(host: Path) -> None:
    """They were in the repository's top-level templates/ and static/, which only the
    wfdash project's own DIRS and STATICFILES_DIRS named and the package did not hold: in
    any other project every dashboard page was a TemplateDoesNotExist."""
    result = run_in(
        host,
        """
    from django.contrib.staticfiles import finders
    from django.template.loader import get_template
    pages = ["overview", "instance_list", "instance_detail", "errors", "schedules",
             "schedule_detail", "metrics", "workflow_detail", "create"]
    print(json.dumps({
        "templates": [get_template(f"workflows/{name}.html").origin.name.split("/workflows_app/")[-1]
                      for name in pages],
        "static": [bool(finders.find(f"workflows/{name}"))
                   for name in ("dashboard.js", "dashboard.css", "bulk.js", "favicon.svg")],
    }))
    """,
    )
    assert result == {
        "templates": [
            f"templates/workflows/{name}.html"
            for name in (
                "overview",
                "instance_list",
                "instance_detail",
                "errors",
                "schedules",
                "schedule_detail",
                "metrics",
                "workflow_detail",
                "create",
            )
        ],
        "static": [True] * 4,
    }
    # The package's data: every template and static file the app holds.
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["workflows_app"]
    app = ROOT / "workflows_app"
    shipped = {path for pattern in globs for path in app.glob(pattern) if path.is_file()}
    held = {p for d in ("templates", "static") for p in (app / d).rglob("*") if p.is_file()}
    assert held and held <= shipped


def test_links_sockets_and_the_openapi_document_follow_the_mount_prefix(host: Path) -> None:
    """Mounted at /ops/wf/, the pages named their sockets /ws/…, where the project routes
    nothing of wfdash's, and the OpenAPI document's /api/… paths had no server to say
    they live under /ops/wf/."""
    result = run_in(
        host,
        LOGGED_IN
        + """
    import re
    from workflows_app.client import get_workflow
    inst = get_workflow("host-nap").create(id="links-1")
    urls = {"overview": "/ops/wf/", "list": "/ops/wf/instances/",
            "detail": "/ops/wf/workflows/host-nap/links-1/"}
    found = {}
    strays = []
    for key, url in urls.items():
        body = client.get(url).content.decode()
        found[key] = re.search(r'data-ws="([^"]+)"', body).group(1)
        for link in re.findall(r'(?:href|src|action|data-[a-z-]+)="(/[^"]*)"', body):
            if not link.startswith(("/ops/wf/", "/assets/")):
                strays.append(link)
    openapi = client.get("/ops/wf/api/openapi.json").json()
    print(json.dumps({"sockets": found, "strays": strays, "servers": openapi.get("servers")}))
    """,
    )
    sockets = result["sockets"]
    assert sockets["overview"] == "/ops/wf/ws/overview/"
    assert sockets["list"] == "/ops/wf/ws/instances/"
    assert sockets["detail"].startswith("/ops/wf/ws/instances/")
    assert result["strays"] == []
    assert result["servers"] == [{"url": "/ops/wf"}]


def test_a_dashboard_socket_works_without_channel_layers(host: Path) -> None:
    """With no CHANNEL_LAYERS (one process) the socket's connect called group_add on no
    layer: every dashboard socket failed its handshake. Now it opens, sends its snapshot
    and the engine's changes reach it; the project's URLRouter mounts the routes under
    /ops/wf/, where the page looks for them."""
    result = run_in(
        host,
        LOGGED_IN
        + """
    import asyncio, re
    from asgiref.sync import sync_to_async
    from channels.testing import WebsocketCommunicator
    from django.conf import settings
    from workflows_app import testing
    from workflows_app.client import get_workflow
    from hostasgi import application

    inst = get_workflow("host-nap").create(id="socket-1")
    page = client.get("/ops/wf/workflows/host-nap/socket-1/").content.decode()
    path = re.search(r'data-ws="([^"]+)"', page).group(1)
    cookie = f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"

    async def main():
        socket = WebsocketCommunicator(application, path, headers=[
            (b"cookie", cookie.encode()), (b"origin", b"http://testserver"),
            (b"host", b"testserver")])
        connected, _ = await socket.connect(timeout=10)
        snapshot = json.loads(await socket.receive_from(timeout=10))
        await testing.arun_until_idle()
        statuses = []
        while "waiting" not in statuses:
            message = json.loads(await socket.receive_from(timeout=10))
            statuses.append(message.get("instance", {}).get("status"))
        await socket.disconnect()
        return connected, snapshot["type"], statuses[-1]

    print(json.dumps(asyncio.run(main())))
    """,
    )
    assert result == [True, "snapshot", "waiting"]


def test_token_search_and_wf_demo_use_the_user_models_username_field(host: Path) -> None:
    """The admin's token search looked in user__username and `wf demo --superuser` filtered
    and created by username=: with a user model that logs in by email, every token search
    was a FieldError (a 500) and the demo's superuser could not be made."""
    django_admin(host, "migrate", settings="hostadminsettings")  # the admin's own tables
    result = run_in(
        host,
        LOGGED_IN
        + """
    from io import StringIO
    from django.core.management import call_command
    from workflows_app import tokens
    tokens.issue("searched", "boss@example.com")
    found = client.get("/backoffice/workflows_app/apitoken/", {"q": "boss@"})
    Person.objects.filter(email="ops@example.com").delete()
    notes = []
    for _ in range(2):
        out = StringIO()
        call_command("wf", "demo", "--superuser", "ops@example.com:pw", "--json", stdout=out)
        notes.append(json.loads(out.getvalue())["superuser"])
    ops = Person.objects.get(email="ops@example.com")
    print(json.dumps({
        "search": [found.status_code, "searched" in found.content.decode()],
        "notes": notes,
        "ops": [ops.is_superuser, ops.check_password("pw")],
    }))
    """,
        settings="hostadminsettings",
    )
    assert result == {
        "search": [200, True],
        "notes": [
            "created superuser 'ops@example.com'",
            "user 'ops@example.com' exists; left unchanged",
        ],
        "ops": [True, True],
    }


# --- system checks: settings wfdash cannot work with, refused at start-up ---------------


class WorkflowsElsewhere:
    """A project's router sending wfdash's tables to an alias of their own."""

    def db_for_read(self, model: type, **hints: object) -> str | None:
        return "workflows" if model._meta.app_label == "workflows_app" else None

    db_for_write = db_for_read

    def allow_migrate(self, db: str, app_label: str, **hints: object) -> bool | None:
        return db == "workflows" if app_label == "workflows_app" else None


class UsersElsewhere:
    def db_for_read(self, model: type, **hints: object) -> str | None:
        return "accounts" if model._meta.app_label == "auth" else None

    db_for_write = db_for_read


def test_use_tz_false_is_refused_by_a_system_check() -> None:
    """With USE_TZ = False the engine's first create failed deep in raw SQL ("SQLite
    backend does not support timezone-aware datetimes when USE_TZ is False"); the check
    says what to set before anything runs. A TIME_ZONE other than UTC is fine (the host
    project runs in America/New_York)."""
    from django.test import override_settings

    from workflows_app import checks

    assert checks.check_use_tz() == []
    with override_settings(USE_TZ=False, TIME_ZONE="America/New_York"):
        (error,) = checks.check_use_tz()
    assert error.id == "workflows_app.E001" and "USE_TZ = True" in error.msg


@pytest.mark.parametrize(
    ("router", "named"),
    [
        ("WorkflowsElsewhere", "workflows_app.Instance is written to 'workflows'"),
        ("UsersElsewhere", "auth.User is written to 'accounts'"),
    ],
)
def test_routing_wfdash_or_the_user_model_off_default_is_refused(router: str, named: str) -> None:
    """The engine's raw SQL, transactions, LISTEN/NOTIFY and schema check all use the
    default connection: a router sending wfdash's models (or the user model its tokens
    reference) elsewhere split them from it, to fail later in confusing ways."""
    from django.test import override_settings

    from workflows_app import checks

    assert checks.check_database() == []
    with override_settings(DATABASE_ROUTERS=[f"{__name__}.{router}"]):
        (error,) = checks.check_database()
    assert error.id == "workflows_app.E002" and named in error.msg
    if router == "WorkflowsElsewhere":
        assert "migrations are not allowed on 'default'" in error.msg


@pytest.mark.parametrize(
    ("wfdash", "named"),
    [
        ({"RETENTION": {"success": "7 days", "failure": "30 days"}}, "unknown outcome"),
        ({"RETENTION": "7 dayz"}, 'settings.WFDASH["RETENTION"]'),
        ({"PRUNE_SECONDS": "5 minutes"}, "PRUNE_SECONDS"),
        ({"PRUNE_SECONDS": -1}, "PRUNE_SECONDS"),
        # Past a year: the worker's next prune was past year 9999 (an OverflowError in its
        # loop), and float() of 10**400 an OverflowError of the check itself.
        ({"PRUNE_SECONDS": 1e12}, 'PRUNE_SECONDS"] must be a number from 0 to 31536000 (seconds'),
        ({"PRUNE_SECONDS": 10**400}, "got <an integer of about 401 digits>"),
    ],
)
def test_bad_retention_settings_are_refused_at_start_up(wfdash: dict, named: str) -> None:
    """A typo in WFDASH["RETENTION"] passed every check, then raised in each finish: the
    instances that ended stayed "running" for ever. manage.py check now refuses it."""
    from django.core.management import call_command
    from django.core.management.base import SystemCheckError
    from django.test import override_settings

    call_command("check")
    with override_settings(WFDASH=wfdash), pytest.raises(SystemCheckError) as refused:
        call_command("check")
    assert "workflows_app.E003" in str(refused.value) and named in str(refused.value)
    with override_settings(WFDASH={"RETENTION": {"error": "30 days"}, "PRUNE_SECONDS": 0}):
        call_command("check")


def test_wfdash_commands_shadowed_by_earlier_apps_are_warned_of() -> None:
    """Listed after channels (or staticfiles, daphne), workflows_app's runworker and
    runserver were not the ones manage.py ran: `runworker workflows` served the channel
    with no engine and no instance ever ran, silently."""
    from workflows_app import checks

    assert checks.check_command_order() == []  # this project lists workflows_app first
    ours = {"runserver": "workflows_app", "runworker": "workflows_app"}
    assert checks.check_command_order(commands=ours) == []
    (warning,) = checks.check_command_order(
        commands={"runserver": "django.contrib.staticfiles", "runworker": "channels"}
    )
    assert warning.id == "workflows_app.W001"
    assert "manage.py runworker is channels's" in warning.msg
    assert "manage.py runserver is django.contrib.staticfiles's" in warning.msg


@pytest.mark.django_db
@pytest.mark.parametrize("zone", ["UTC", "America/New_York", "Asia/Kolkata"])
def test_the_lists_date_filters_read_the_browsers_wall_clock_whatever_time_zone(
    zone: str,
) -> None:
    """The instance list's "created from/to" inputs carry the viewer's wall-clock time and
    the browser's offset (tz, minutes east of UTC). Django's DateTimeField read them in
    TIME_ZONE first: under America/New_York a filter was five hours off, and 02:30 on the
    day clocks spring forward there was refused as a time that does not exist."""
    from datetime import UTC, datetime

    from django.test import override_settings

    from workflows_app.forms import ListFilterForm

    with override_settings(TIME_ZONE=zone):
        form = ListFilterForm(
            {"created_from": "2026-01-15T10:00", "created_to": "2026-03-08T02:30", "tz": "60"}
        )
        filters = form.filters()
    assert not form.errors
    assert filters.created_from == datetime(2026, 1, 15, 9, 0, tzinfo=UTC)
    assert filters.created_to == datetime(2026, 3, 8, 1, 30, tzinfo=UTC)


@pytest.mark.parametrize(
    ("wfdash", "named"),
    [
        # Past a day the lease's end was past year 9999: every claim an OverflowError.
        (
            {"LEASE_SECONDS": 1e12},
            'LEASE_SECONDS"] must be a number from 0.1 to 86400; got 1000000000000.0',
        ),
        ({"LEASE_SECONDS": 10**400}, "got <an integer of about 401 digits>"),
        (
            {"LEASE_SECONDS": "abc"},
            "LEASE_SECONDS\"] must be a number from 0.1 to 86400; got 'abc'",
        ),
        ({"LEASE_SECONDS": -5}, "got -5"),
        ({"LEASE_SECONDS": True}, "got True"),
        ({"LEASE_SECONDS": float("nan")}, "got nan"),
        ({"SLEEP_IN_PROCESS_MS": 10**400}, "must be a whole number from 0 to 86400000"),
        ({"SLEEP_IN_PROCESS_MS": 1.5}, 'SLEEP_IN_PROCESS_MS"] must be a whole number'),
        ({"WORKER_CONCURRENCY": 0}, 'WORKER_CONCURRENCY"] must be a whole number from 1 to'),
        ({"POLL_SECONDS": float("inf")}, 'POLL_SECONDS"] must be a number from 0.01 to 86400'),
        ({"DRAIN_SECONDS": -1}, 'DRAIN_SECONDS"] must be a number from 0 to 86400'),
        ({"START_WAIT_SECONDS": 1e300}, 'START_WAIT_SECONDS"] must be a number from 0 to'),
        ({"LOOP_STALL_RENEW_SECONDS": "5"}, 'LOOP_STALL_RENEW_SECONDS"] must be a number'),
        ({"METRICS_PORT": 70000}, 'METRICS_PORT"] must be a whole number from 0 to 65535'),
        ({"MAX_SOCKETS_PER_USER": 10**400}, 'MAX_SOCKETS_PER_USER"] must be a whole number'),
        ({"API_MAX_BODY_BYTES": "2MB"}, 'API_MAX_BODY_BYTES"] must be a whole number from 1'),
        ({"API_FAILURE_LIMIT": 0}, 'API_FAILURE_LIMIT"] must be a whole number from 1'),
        ({"API_LOCKOUT_SECONDS": 10**12}, 'API_LOCKOUT_SECONDS"] must be a whole number from 1'),
        # A string is truthy: "False" switched the tracing on.
        ({"TRACING": "False"}, "TRACING\"] must be True or False; got 'False'"),
        ({"WAKE_NOTIFY": 0}, 'WAKE_NOTIFY"] must be True or False; got 0'),
        ({"METRICS_ADDR": 5}, 'METRICS_ADDR"] must be a host address (a string); got 5'),
        ({"EMBEDDED_WORKER_QUEUES": 5}, 'EMBEDDED_WORKER_QUEUES"]: expected queue names'),
        ({"PAYLOAD_CODEC": "no.such.Codec"}, 'PAYLOAD_CODEC"] cannot be loaded: '),
    ],
)
def test_a_host_projects_engine_setting_out_of_range_is_refused_naming_it(
    wfdash: dict, named: str
) -> None:
    """A host project's settings.WFDASH got none of the checks WFDASH_* variables get: a
    lease of 1e12 s, 10**400, "abc", -5 or True was taken, then the worker failed later
    with an OverflowError or TypeError naming no setting. The system check refuses it at
    start-up, naming the setting, its value and the range, from the table the variables
    are read with."""
    from django.core.checks import run_checks
    from django.test import override_settings

    with override_settings(WFDASH=wfdash):
        errors = [error for error in run_checks() if error.id == "workflows_app.E005"]
    assert len(errors) == 1, errors
    assert 'settings.WFDASH["' in errors[0].msg and named in errors[0].msg, errors[0].msg


def test_every_engine_setting_at_its_bounds_and_the_projects_own_pass_the_checks() -> None:
    from django.core.checks import run_checks
    from django.test import override_settings

    from workflows_app.setting_ranges import SETTING_RANGES, SWITCHES

    assert [error for error in run_checks() if error.id.startswith("workflows_app")] == []
    for bound in ("minimum", "maximum"):
        wfdash = {key: getattr(bounds, bound) for key, bounds in SETTING_RANGES.items()}
        wfdash |= dict.fromkeys(SWITCHES, bound == "maximum")
        wfdash |= {"METRICS_PORT": None, "METRICS_ADDR": "0.0.0.0"}
        with override_settings(WFDASH=wfdash):
            assert [e for e in run_checks() if e.id.startswith("workflows_app")] == []


def test_every_wfdash_setting_the_app_reads_is_checked() -> None:
    """A setting read with conf.get("X") or WFDASH.get("X") but in no table went
    unchecked; this lists what the app reads and what the checks cover."""
    import re

    from workflows_app import checks
    from workflows_app.setting_ranges import SETTING_RANGES, SWITCHES

    read = set()
    for source in (ROOT / "workflows_app").rglob("*.py"):
        text = source.read_text()
        read |= set(
            re.findall(r'(?:conf|engine_settings\(\)|\{\})\s*\)?\s*\.get\(\s*"([A-Z_]+)"', text)
        )
        read |= set(re.findall(r'_setting\("([A-Z_]+)"', text))
    checked = {*SETTING_RANGES, *SWITCHES, *checks.OTHER_ENGINE_SETTINGS}
    assert read >= {"LEASE_SECONDS", "PRUNE_SECONDS", "TRACING", "API_FAILURE_LIMIT"}, read
    assert read - checked == set()


@pytest.mark.parametrize(
    ("cooloff", "named"),
    [
        (timedelta(days=10**6), "got datetime.timedelta(days=1000000)"),
        (timedelta(0), "must be a duration from 1 to 31536000 seconds"),
        (12, "must be a timedelta; got 12"),
    ],
)
def test_a_login_lockout_wfdash_answers_past_a_year_is_refused(cooloff, named) -> None:
    """throttle.login_locked_out, the lockout answer wfdash's settings name, reads
    AXES_COOLOFF_TIME.total_seconds(): an int (axes' hours) was an AttributeError at the
    first lockout, a million days an OverflowError (WFDASH_LOGIN_LOCKOUT_SECONDS has the
    same year)."""
    from django.core.checks import run_checks
    from django.test import override_settings

    with override_settings(AXES_COOLOFF_TIME=cooloff):
        (error,) = [e for e in run_checks() if e.id == "workflows_app.E006"]
    assert "AXES_COOLOFF_TIME" in error.msg and named in error.msg, error.msg
    with override_settings(AXES_COOLOFF_TIME=cooloff, AXES_LOCKOUT_CALLABLE="someone.elses.answer"):
        assert [e for e in run_checks() if e.id == "workflows_app.E006"] == []
