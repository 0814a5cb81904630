"""What README.md and docs/*.md show a user works as written: every `wf` command line
parses with the real command, every variable, setting, URL, API name and keyword they
name exists. Cheap (no database, no server): a doc that drifts from the code fails here."""

from __future__ import annotations

import ast
import inspect
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.management.base import CommandError

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PyCF_TOP_LEVEL_AWAIT = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT  # the examples `await` at top level


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def fenced_blocks(path: Path) -> Iterator[tuple[str, int, str]]:
    """(language, line of the opening fence, text) of every ``` block, list-indented ones too."""
    lines = read(path).splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^(\s*)```(\w*)\s*$", lines[i])
        if not opening:
            i += 1
            continue
        indent, lang = opening.groups()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith("```"):
            body.append(lines[j].removeprefix(indent))
            j += 1
        yield lang, i + 1, "\n".join(body)
        i = j + 1


def shell_lines(path: Path) -> Iterator[tuple[int, str]]:
    """Each command of the bash blocks (continuations joined) and each inline `code` span."""
    for lang, start, text in fenced_blocks(path):
        if lang != "bash":
            continue
        joined = text.replace("\\\n", " ")
        for offset, line in enumerate(joined.splitlines(), 1):
            yield start + offset, line
    text = re.sub(r"```.*?```", lambda m: "\n" * m.group().count("\n"), read(path), flags=re.S)
    for span in re.finditer(r"`([^`]+)`", text):
        yield text.count("\n", 0, span.start()) + 1, span.group(1).replace("\n", " ")


def where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


# --- `manage.py wf` and `runworker` command lines --------------------------------------

PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*(=[A-Z_]+)?$")  # ID, N, NAME, K=V: a template


def wf_commands() -> Iterator[tuple[str, list[str]]]:
    """Every `wf <verb> …` the docs show with its arguments (templates with placeholders,
    alternatives `a|b` or optional `[…]` parts are left out: they are not meant literally)."""
    from workflows_app.management.commands.wf import Command

    verbs = set(Command().create_parser("manage.py", "wf")._subparsers._group_actions[0].choices)
    for path in DOCS:
        for line, text in shell_lines(path):
            for found in re.finditer(r"(?:^|[\s(])wf ([a-z-]+)\b([^#`]*)", text):
                verb, rest = found.groups()
                if verb not in verbs:
                    continue
                command = (verb + rest).split(" && ")[0].split(" | ")[0].strip().rstrip(".,;:)")
                if any(mark in command for mark in ("|", "[", "…", "...")):
                    continue
                try:
                    argv = shlex.split(command)
                except ValueError:
                    continue
                if any(PLACEHOLDER.match(arg) for arg in argv):
                    continue
                # A bare verb named in prose (`wf status`) shows no arguments to check.
                if len(argv) == 1 and not text.lstrip().startswith(("python", ".venv")):
                    continue
                yield where(path, line), argv


def test_every_wf_command_in_the_docs_parses_with_the_real_command():
    from workflows_app.management.commands.wf import Command

    commands = list(wf_commands())
    assert len(commands) > 50, "the docs' wf commands were not found"
    refused = []
    parser = Command().create_parser("manage.py", "wf")
    for place, argv in commands:
        try:
            parser.parse_args(argv)
        except (CommandError, SystemExit) as exc:
            refused.append(f"{place}: wf {shlex.join(argv)}: {exc}")
    assert not refused, "\n".join(refused)


def test_every_runworker_command_in_the_docs_parses():
    from workflows_app.management.commands.runworker import Command

    seen = 0
    parser = Command().create_parser("manage.py", "runworker")
    for path in DOCS:
        for line, text in shell_lines(path):
            for found in re.finditer(r"manage\.py runworker ([^#`|]*)", text):
                seen += 1
                try:
                    parser.parse_args(shlex.split(found.group(1)))
                except (CommandError, SystemExit) as exc:
                    pytest.fail(f"{where(path, line)}: runworker {found.group(1)}: {exc}")
    assert seen >= 3


def test_the_surfaces_examples_name_only_demo_workflows():
    """docs/surfaces.md says every example ran against the demo: the workflows its
    commands and API calls name must be demo workflows, or a reader copying them gets
    UnknownWorkflow (the schedule examples named a `digest` the demo does not have)."""
    import workflows_app.demo  # noqa: F401  (registers the demo workflows when WFDASH_DEMO is off)
    from workflows_app.engine import registry

    demo = {
        d.name for d in registry.all_definitions() if d.cls.__module__.endswith(".demo.workflows")
    }
    path = ROOT / "docs" / "surfaces.md"
    named: list[tuple[int, str]] = []
    for line, text in shell_lines(path):
        for pattern in (
            r"wf start ([\w-]+)",
            r"wf schedules create [\w-]+ ([\w-]+)",
            r"(?:-w|--workflow) ([\w-]+)",
            r"(?:\$API|/api/workflows)/([\w-]+)/",
        ):
            found = (m.group(1) for m in re.finditer(pattern, text))
            named += [(line, name) for name in found if not PLACEHOLDER.match(name)]
    assert len(named) > 20
    unknown = [f"{where(path, line)}: {name}" for line, name in named if name not in demo]
    assert not unknown, f"not demo workflows ({sorted(demo)}):\n" + "\n".join(unknown)


def test_the_bench_help_lists_every_measurement_and_the_docs_name_only_those(capsys):
    """`python -m bench --help` is where a reader finds the `--only` names; it left out
    `event_notify` and `start` (a hand-written copy of the list). The docs' `--only`
    lines (docs/bench.md, docs/performance.md) name measurements the bench has."""
    from bench.__main__ import main, plan, scaled

    names = [name for name, _ in plan(scaled(quick=True))]
    with pytest.raises(SystemExit):
        main(["--help"])
    shown = "".join(capsys.readouterr().out.split())  # argparse wraps the list anywhere
    assert ",".join(names) in shown

    unknown = []
    for path in DOCS:
        for line, text in shell_lines(path):
            for found in re.finditer(r"--only[ =]([\w,]+)", text):
                asked = [n for n in found.group(1).split(",") if n]
                unknown += [f"{where(path, line)}: {n}" for n in asked if n not in names]
    assert not unknown, "\n".join(unknown)


def test_the_bulk_api_fields_operating_md_lists_are_the_apis():
    """The bulk API's body fields as docs/operating.md lists them: `to_version` (a
    restart onto a fix) was taken by the API but missing from the list."""
    from workflows_app import api

    text = " ".join(read(ROOT / "docs" / "operating.md").split())
    listed = re.search(r"`POST /api/workflows/\{name\}/bulk` with `\{([^}]*)\}`", text)
    assert listed, "operating.md no longer lists the bulk API's fields"
    assert set(re.findall(r'"(\w+)"', listed.group(1))) == api.BULK_FIELDS


def test_every_wf_option_is_shown_in_the_docs():
    """The other way round: each option of each `wf` verb appears in a `wf <verb> …` line
    of the docs (`wf list --cursor`, `wf watch --timeout` and `wf bulk --background` had
    none), so a flag added to the command is a flag a reader can find."""
    from workflows_app.management.commands.wf import Command

    shown: dict[str, str] = {}
    for path in DOCS:
        for _, text in shell_lines(path):
            for found in re.finditer(r"wf ([a-z-]+)\b([^#`]*)", text):
                shown[found.group(1)] = shown.get(found.group(1), "") + " " + found.group(2)
    command = Command()
    command.create_parser("manage.py", "wf")
    missing = []
    # --workflow of the verbs that take an instance id is said once for all of them.
    by_id = "Without `--workflow W` the id is looked up in every workflow"
    assert by_id in " ".join(read(ROOT / "docs" / "surfaces.md").split())
    for verb, parser in command.verb_parsers.items():
        takes_id = any(action.dest == "id" for action in parser._actions)
        for action in parser._actions:
            names = [o for o in action.option_strings if o not in ("-h", "--help", "--json")]
            if not names or (takes_id and "--workflow" in names):
                continue
            if not any(
                re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", shown.get(verb, "")) for o in names
            ):
                missing.append(f"wf {verb} {max(names, key=len)}")
    assert not missing, "options no doc shows: " + ", ".join(missing)


def test_the_readme_layout_names_files_that_exist():
    """Each `name.py` and `name/` the README's Layout block lists under a folder is in that
    folder (it named an engine `store.py` that had become the package `store/`)."""
    (layout,) = [
        text for lang, _, text in fenced_blocks(ROOT / "README.md") if text.startswith("wfdash/")
    ]
    folder, missing = ROOT, []
    for line in layout.splitlines():
        rest = line
        if not line.startswith(" "):
            heads = re.match(r"((?:[\w/]+/ )+)", line + " ").group(1).split()
            folder = ROOT / heads[0]
            rest = line[len(" ".join(heads)) :]
            missing += [head for head in heads if not (ROOT / head).is_dir()]
        for name in re.findall(r"(?<![\w/.-])([a-z_]+\.py|[a-z_]+/(?:[a-z_]+)?)(?![\w.])", rest):
            target = folder / name if name.endswith((".py", "/")) else ROOT / name
            if not (target.is_file() if name.endswith(".py") else target.exists()):
                missing.append(str(target.relative_to(ROOT)))
    assert not missing, f"README Layout names what is not there: {missing}"


# --- names: environment variables, settings, URLs, the Python API ----------------------

SOURCES = [
    *(ROOT / "wfdash").rglob("*.py"),
    *(ROOT / "workflows_app").rglob("*.py"),
    *(ROOT / "bench").rglob("*.py"),
]
# Named by the docs, read by the user's own code, not wfdash's.
USERS_OWN = {"WFDASH_FERNET_KEYS"}  # README's Fernet codec example


def test_every_environment_variable_and_wfdash_setting_the_docs_name_is_read():
    code = "\n".join(read(path) for path in SOURCES)
    script = read(ROOT / "scripts" / "test")
    tests = "\n".join(read(path) for path in (ROOT / "tests").rglob("*.py"))
    docs = "\n".join(read(path) for path in DOCS)
    unread = []
    # (A family such as `DJANGO_HSTS_*` ends in "_" and is not matched; its members are.)
    for name in sorted(set(re.findall(r"\b(?:WFDASH|DJANGO)_[A-Z0-9_]*[A-Z0-9]\b", docs))):
        if (
            name not in USERS_OWN
            and not re.search(rf"[\"']{name}[\"']", code)
            and not re.search(rf"\b{name}\b", script)
            and not re.search(rf"environ\.get\([\"']{name}[\"']", tests)  # a test's own knob
        ):
            unread.append(name)
    for key in sorted(set(re.findall(r'WFDASH\[\\?"([A-Z_]+)\\?"\]', docs))):
        if not re.search(rf"[\"']{key}[\"']", code):
            unread.append(f'WFDASH["{key}"]')
    assert not unread, f"named by the docs, read nowhere: {unread}"


def test_every_http_path_the_docs_show_is_routed():
    """Each `/api/…`, `/metrics`, `/stats/`, … the docs show resolves to a view (`{name}`,
    `{id}` and `$API` filled in); sockets' `/ws/…` paths to a consumer."""
    from django.urls import Resolver404, resolve

    from workflows_app.routing import websocket_urlpatterns

    sockets = [p for p in websocket_urlpatterns if str(p.pattern)]  # not the catch-all
    found, unrouted = 0, []
    for path in DOCS:
        text = read(path).replace("$API", "/api/workflows")
        for match in re.finditer(
            r"(?:https?://[\w.:]+|(?<=[`\s(\"]))(/(?:api|metrics|stats|ws|admin|instances|"
            r"errors|schedules)\b[^\s`\"'),;?]*)",
            text,
        ):
            url = match.group(1).replace("{name}", "order-approval").replace("{id}", "1")
            url = url.replace("<id>", "1").replace("…", "x")
            if url == "/api/":  # "any other path under /api/ is a JSON 404"
                continue
            found += 1
            if url.startswith("/ws/"):
                if not any(p.pattern.match(url[1:]) for p in sockets):
                    unrouted.append(
                        f"{where(path, text.count(chr(10), 0, match.start()) + 1)}: {url}"
                    )
                continue
            try:
                view = resolve(url)
            except Resolver404:
                view = None
            if view is None or view.url_name in (None, "not_found"):
                unrouted.append(f"{where(path, text.count(chr(10), 0, match.start()) + 1)}: {url}")
    assert found > 30
    assert not unrouted, "\n".join(unrouted)


def api_names() -> dict[str, Any]:
    """What the docs' examples call their objects, and what each is."""
    from workflows_app import client, scheduling, testing
    from workflows_app.engine import clock, step

    return {
        "wf": client.WorkflowBinding,
        "inst": client.InstanceHandle,
        "page": client.Page,
        "record": client.HistoryEntry,
        "job": client.BulkJobHandle,
        "schedules": scheduling.Schedules,
        "s": scheduling.ScheduleHandle,
        "step": step.Step,
        "ctx": step.StepContext,
        "event": step.WorkflowEvent,
        "clock": clock.ControllableClock,
        "testing": testing,
    }


def has(owner: Any, attr: str) -> bool:
    fields = getattr(owner, "__dataclass_fields__", {})
    if hasattr(owner, attr) or attr in fields:
        return True
    # Attributes set in __init__ (InstanceHandle.created): named as self.<attr> there.
    init = getattr(owner, "__init__", None)
    try:
        return f"self.{attr} =" in inspect.getsource(init)
    except (TypeError, OSError):
        return False


def test_the_python_examples_compile_and_call_what_exists_with_keywords_it_takes():
    """Every ```python block compiles; its imports from workflows_app exist; and a call or
    attribute on the objects the examples use (wf, inst, step, testing, schedules, job, …)
    names a real method or field, with keyword arguments that method takes."""
    import importlib

    from workflows_app import client
    from workflows_app.engine import register

    names = api_names()
    checked, wrong = 0, []
    for path in DOCS:
        for lang, start, text in fenced_blocks(path):
            if lang != "python":
                continue
            source = text.replace("{...,", "{")  # `WFDASH = {..., "KEY": …}`: the rest of yours
            tree = compile(source, str(path), "exec", ast.PyCF_ONLY_AST | PyCF_TOP_LEVEL_AWAIT)
            for node in ast.walk(tree):
                place = where(path, start + getattr(node, "lineno", 0))
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "workflows_app"
                ):
                    module = importlib.import_module(node.module)
                    wrong += [
                        f"{place}: {node.module}.{a.name}"
                        for a in node.names
                        if not hasattr(module, a.name)
                    ]
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                    owner = names.get(node.value.id)
                    if owner is not None:
                        checked += 1
                        if not has(owner, node.attr):
                            wrong.append(f"{place}: {node.value.id}.{node.attr}")
                if not isinstance(node, ast.Call) or not node.keywords:
                    continue
                function: Any = None
                if isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
                    owner = names.get(node.func.value.id)
                    function = getattr(owner, node.func.attr, None) if owner is not None else None
                elif isinstance(node.func, ast.Name):
                    function = {"register": register, "get_workflow": client.get_workflow}.get(
                        node.func.id
                    )
                if not callable(function):
                    continue
                parameters = inspect.signature(function).parameters.values()
                if any(p.kind is p.VAR_KEYWORD for p in parameters):
                    continue
                accepted = {p.name for p in parameters}
                wrong += [
                    f"{place}: {ast.unparse(node.func)}({k.arg}=…)"
                    for k in node.keywords
                    if k.arg and k.arg not in accepted
                ]
    assert checked > 60
    assert not wrong, "\n".join(wrong)
