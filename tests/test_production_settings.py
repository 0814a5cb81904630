"""wfdash/settings.py in production: refuses an unsafe start, and `check --deploy` is clean
under the README's production variables (read from the README, so the two cannot drift)."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError

ROOT = Path(__file__).resolve().parent.parent


def readme_production_variables() -> dict[str, str]:
    """Every DJANGO_* variable the README's production block exports (`...`: a fresh secret)."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index("## Running in production") :]
    block = block[: block.index("```", block.index("```bash") + 7)]
    pairs = re.findall(r"\b(DJANGO_[A-Z_]+)=(\S+)", block)
    assert pairs, "the README's production block exports no DJANGO_ variables"
    return {name: secrets.token_urlsafe(50) if value == "..." else value for name, value in pairs}


def manage(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """manage.py in a fresh process, with only these DJANGO_* variables set."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "WFDASH_DEMO"))}
    return subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )


def test_check_deploy_is_clean_under_the_readmes_production_variables():
    env = readme_production_variables()
    assert {"DJANGO_DEBUG", "DJANGO_HTTPS", "DJANGO_BEHIND_PROXY"} <= set(env)
    result = manage("check", "--deploy", "--fail-level", "WARNING", **env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_the_development_default_starts_as_the_readmes_first_command_does():
    result = manage("check")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"DJANGO_DEBUG": "0", "DJANGO_ALLOWED_HOSTS": "wf.example.com"},
            "DJANGO_DEBUG=0 needs DJANGO_SECRET_KEY",
        ),
        (
            {
                "DJANGO_DEBUG": "0",
                "DJANGO_ALLOWED_HOSTS": "wf.example.com",
                "DJANGO_SECRET_KEY": "wfdash-dev-insecure-change-me",
            },
            "DJANGO_DEBUG=0 needs DJANGO_SECRET_KEY",
        ),
        (
            {"DJANGO_DEBUG": "0", "DJANGO_SECRET_KEY": "k" * 60},
            "DJANGO_DEBUG=0 needs DJANGO_ALLOWED_HOSTS",
        ),
        (
            {"DJANGO_DEBUG": "0", "DJANGO_SECRET_KEY": "k" * 60, "DJANGO_ALLOWED_HOSTS": " , "},
            "DJANGO_DEBUG=0 needs DJANGO_ALLOWED_HOSTS",
        ),
    ],
)
def test_debug_off_refuses_to_start_on_the_built_in_key_or_without_hosts(env, message):
    result = manage("check", **env)
    assert result.returncode != 0 and message in result.stderr


def test_the_demo_is_off_in_production_unless_asked_for():
    production = {
        "DJANGO_DEBUG": "0",
        "DJANGO_SECRET_KEY": "k" * 60,
        "DJANGO_ALLOWED_HOSTS": "wf.example.com",
    }
    show = [
        "shell",
        "--no-imports",
        "-c",
        "from django.conf import settings; print(settings.WFDASH['DEMO'])",
    ]
    assert manage(*show, **production).stdout.strip() == "False"
    assert manage(*show, **production, WFDASH_DEMO="1").stdout.strip() == "True"
    assert manage(*show).stdout.strip() == "True"


@pytest.mark.parametrize("password", ["admin", "12345678", "password1"])
def test_weak_passwords_are_refused(password):
    with pytest.raises(ValidationError):
        validate_password(password)


SHOW_ENGINE_SETTINGS = [
    "shell",
    "--no-imports",
    "-c",
    "from django.conf import settings as s; w = s.WFDASH; print(s.DEBUG, "
    "s.SECURE_HSTS_SECONDS, s.AXES_FAILURE_LIMIT, w['LEASE_SECONDS'], "
    "w['WORKER_CONCURRENCY'], w['POLL_SECONDS'], w['SLEEP_IN_PROCESS_MS'], "
    "w['METRICS_PORT'], w['METRICS_ADDR'], w['TRACING'], s.LOGGING['loggers']['workflows_app'])",
]
EVERY_VARIABLE = [
    *("DJANGO_DEBUG", "DJANGO_HSTS_SECONDS", "DJANGO_HTTPS", "WFDASH_LOGIN_FAILURE_LIMIT"),
    *("WFDASH_LOGIN_LOCKOUT_SECONDS", "WFDASH_DB_POOL_SIZE", "WFDASH_LEASE_SECONDS"),
    *("WFDASH_WORKER_CONCURRENCY", "WFDASH_POLL_SECONDS", "WFDASH_SLEEP_IN_PROCESS_MS"),
    *("WFDASH_METRICS_PORT", "WFDASH_METRICS_ADDR", "WFDASH_TRACING", "WFDASH_LOG_LEVEL"),
]


def test_a_variable_set_but_empty_counts_as_unset():
    """`WFDASH_WORKER_CONCURRENCY=` (an env file, a compose file) ended the start in a raw
    ValueError naming no variable; an empty WFDASH_METRICS_ADDR bound the metrics port on
    every interface."""
    unset = manage(*SHOW_ENGINE_SETTINGS)
    empty = manage(*SHOW_ENGINE_SETTINGS, **dict.fromkeys(EVERY_VARIABLE, ""))
    assert empty.returncode == 0, empty.stderr
    assert empty.stdout == unset.stdout
    assert "True 0 10 30.0 200 5.0 1000 None 127.0.0.1 True" in empty.stdout


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (
            "WFDASH_WORKER_CONCURRENCY",
            "many",
            "must be a whole number from 1 to 100000; got 'many'",
        ),
        ("WFDASH_WORKER_CONCURRENCY", "0", "must be a whole number from 1 to 100000; got '0'"),
        ("WFDASH_LEASE_SECONDS", "nan", "must be a number from 0.1 to 86400; got 'nan'"),
        ("WFDASH_METRICS_PORT", "70000", "must be a whole number from 0 to 65535; got '70000'"),
        # Past these, a worker failed at every claim (the lease's end past year 9999) or
        # as it started, and the settings at import (a lockout of 10**14 s): an
        # OverflowError naming no variable.
        ("WFDASH_LEASE_SECONDS", "1e12", "must be a number from 0.1 to 86400; got '1e12'"),
        (
            "WFDASH_LOGIN_LOCKOUT_SECONDS",
            "100000000000000",
            "must be a whole number from 1 to 31536000; got '100000000000000'",
        ),
        (
            "WFDASH_SLEEP_IN_PROCESS_MS",
            "1" + "0" * 400,
            "must be a whole number from 0 to 86400000",
        ),
        # The same ranges as a host project's settings.WFDASH gets from the system checks
        # (workflows_app/setting_ranges.py): past them, the same failures later.
        ("WFDASH_POLL_SECONDS", "1e300", "must be a number from 0.01 to 86400; got '1e300'"),
        ("WFDASH_DRAIN_SECONDS", "1e12", "must be a number from 0 to 86400; got '1e12'"),
        (
            "WFDASH_MAX_SOCKETS_PER_USER",
            "1" + "0" * 400,
            "must be a whole number from 1 to 100000",
        ),
        ("DJANGO_DEBUG", "maybe", "must be 1, true, yes or on, or 0, false, no or off"),
        ("WFDASH_LOG_LEVEL", "loud", "must be DEBUG, INFO, WARNING, ERROR or CRITICAL"),
    ],
)
def test_a_malformed_variable_is_refused_naming_it_and_what_it_must_be(name, value, message):
    result = manage("check", **{name: value})
    assert result.returncode != 0
    assert f"ImproperlyConfigured: {name} {message}" in result.stderr, result.stderr[-600:]
