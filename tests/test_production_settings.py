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
