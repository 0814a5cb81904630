"""Operate workflows from a shell: `python manage.py wf <verb>`.

    wf list [--workflow W] [--status S] [--attr K=V]...  wf start W [--params JSON|@file] [--id ID | --count N]
    wf status ID [--steps N] | history ID [--after SEQ] [--limit N]
    wf send-event ID TYPE [--payload JSON]
    wf pause|resume|terminate|skip-sleep|delete ID       wf restart ID [--from-step NAME] [--to-version N]
    wf cancel ID [--no-compensate]                       wf prune
    wf bulk ACTION -w W [--status S] [--attr K=V]... [--created-before ISO] [--background]
    wf token create NAME [--user U] [--scope read|write] [--workflow W]... [--expires 30d]
             | rotate NAME | revoke NAME | list
    wf watch ID [--run-engine]
    wf schedules list [--workflow W] | create NAME W CRON [--params JSON] [--timezone TZ]
             | pause NAME | resume NAME | delete NAME | trigger NAME
    wf demo [--superuser user:password]                  wf bench [-- ARGS...]

Instance ids are scoped by workflow; without --workflow an id is looked up in every
workflow and refused if it is ambiguous. Every verb takes --json for scripts. Bad input
exits non-zero with one line naming what was wrong; so does `wf bulk` (after its report)
when the action failed on some instances, or when the database rolled a batch back
BULK_BATCH_TRIES times in a row (the job is kept; workers finish it), and any verb on
a database it cannot use (not migrated: it says what to run; a PostgreSQL it cannot
connect to within seconds: it says where it looked).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError
from tqdm import tqdm

from workflows_app import bulk, live, surfaces, testing, tokens
from workflows_app.client import OPEN_STEP_STATUSES, InstanceHandle, schedules
from workflows_app.engine import clock, errors, lifecycle, store
from workflows_app.engine.attributes import parse_filter as parse_attribute_filter
from workflows_app.models import ApiToken, BulkAction, Instance, StepRecord
from workflows_app.schema import not_migrated_message, unapplied_migrations, unreachable_database
from workflows_app.text import first_line, one_line, printable, terminal_json

POLL_SECONDS = 0.5
START_BATCH = 100  # instances per create_batch of `start --count`
# `start --count` at most: a slip of the keyboard (a few more zeros) would otherwise fill the
# database for hours, a batch at a time, each committed.
START_COUNT_MAX = 100_000
BULK_BATCH_TRIES = 3  # `wf bulk`: a batch the database rolls back this often ends the command
# `wf history` prints at most this many records a run, and `wf status --steps` as many steps
# (as the API's history pages): an instance with 50,000 steps printed 10 MB of history.
PAGE_MAX = 1000
STATUS_CHILDREN = 100  # the newest children `wf status` shows (a fan-out has thousands)
STATUS_STEPS = 50  # `wf status`: the newest steps it shows by default


def parse_json_arg(value: str | None, flag: str) -> Any:
    """JSON from the command line, or from a file when it starts with @."""
    if value is None:
        return None
    if value.startswith("@"):
        path = Path(value[1:])
        try:
            value = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise CommandError(f"{flag}: cannot read {path}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise CommandError(
                f"{flag}: {path} is not UTF-8 text: {exc.reason} at byte {exc.start}"
            ) from None
    try:
        return json.loads(value)
    except ValueError as exc:  # also an integer of over 4,300 digits, which is no JSONDecodeError
        raise CommandError(f"{flag} is not valid JSON: {exc}") from None
    except RecursionError:
        raise CommandError(f"{flag} is nested too deeply to parse as JSON") from None


def parse_instant_option(value: str | None, flag: str) -> datetime | None:
    if value is None:
        return None
    try:
        instant = datetime.fromisoformat(value)
    except ValueError:
        instant = None
    if instant is None or instant.tzinfo is None:
        raise CommandError(f"{flag} must be an ISO 8601 time with an offset, got {value!r}")
    return instant


def parse_attr_options(options: Sequence[str]) -> dict[str, Any]:
    """--attr k=v options into typed attributes."""
    pairs: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep:
            raise CommandError(f"--attr {option!r}: expected KEY=VALUE")
        if key in pairs:  # as the API's ?attr.k=…&attr.k=…: the last would win unsaid
            raise CommandError(f"--attr {key!r} is given more than once; give each key once")
        pairs[key] = value
    return parse_attribute_filter(pairs)


def not_utf8(parser: argparse.ArgumentParser, options: dict[str, Any]) -> CommandError | None:
    """The refusal of the first argument whose bytes are not UTF-8, named as typed: Python
    keeps such bytes as lone surrogates, which no database query can carry."""
    labels = {
        a.dest: max(a.option_strings, key=len) if a.option_strings else (a.metavar or a.dest)
        for a in parser._actions
    }
    for dest, value in options.items():
        for text in value if isinstance(value, list) else [value]:
            if not isinstance(text, str):
                continue
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                try:
                    shown = repr(text.encode("utf-8", "surrogateescape")[:60])
                except UnicodeEncodeError:
                    shown = ascii(text[:60])
                return CommandError(f"{labels.get(dest, dest)} is not UTF-8 text: {shown}")
    return None


def find_instance(instance_id: str, workflow: str | None) -> InstanceHandle:
    """The instance with that id in --workflow, or in the one workflow that has it."""
    if workflow:
        return surfaces.binding(workflow).get(instance_id)
    workflows = sorted(
        set(Instance.objects.filter(instance_id=instance_id).values_list("workflow", flat=True))
    )
    if not workflows:
        raise CommandError(f"no instance {instance_id!r} in any workflow")
    if len(workflows) > 1:
        raise CommandError(
            f"instance id {instance_id!r} exists in several workflows ({', '.join(workflows)}); pass --workflow"
        )
    return surfaces.binding(workflows[0]).get(instance_id)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], width: int = 60) -> str:
    """A plain aligned table; long cells are cut so a row stays on one line."""

    def cell(value: Any) -> str:
        text = (
            "" if value is None else one_line(value) if isinstance(value, str) else compact(value)
        )
        return text if len(text) <= width else text[: width - 1] + "…"

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


def compact(value: Any) -> str:
    return terminal_json(value)


def error_text(error: dict[str, Any]) -> str:
    """An error as "name: message" on one line (both are the user's text)."""
    return f"{one_line(str(error['name']))}: {one_line(str(error['message']))}"


def short_time(iso_text: str | None) -> str:
    return "" if not iso_text else iso_text[:19].replace("T", " ")


def database_refusal(exc: DatabaseError) -> CommandError:
    """One line, as for bad input (--traceback shows the rest): most often a database not
    migrated yet, or one that cannot be opened or reached."""
    pending = unapplied_migrations()
    if pending:
        return CommandError(not_migrated_message(pending, "using wf"))
    return CommandError(f"the database refused: {first_line(exc)}")


class Command(BaseCommand):
    help = "Operate wfdash workflows: list, start, status, history, send-event, pause, resume, terminate, …"

    def add_arguments(self, parser: CommandParser) -> None:
        verbs = parser.add_subparsers(dest="verb", metavar="<verb>", required=True)
        self.verb_parsers: dict[str, argparse.ArgumentParser] = {}

        def verb(
            name: str, handler: Callable[[argparse.Namespace], None], help: str
        ) -> argparse.ArgumentParser:
            sub = verbs.add_parser(name, help=help, description=help)
            sub.set_defaults(handler=handler)
            self.verb_parsers[name] = sub
            sub.add_argument("--json", action="store_true", help="print JSON instead of a table")
            return sub

        def by_id(sub: argparse.ArgumentParser) -> argparse.ArgumentParser:
            sub.add_argument("id", help="instance id")
            sub.add_argument(
                "--workflow", "-w", help="the instance's workflow (needed if the id is ambiguous)"
            )
            return sub

        def attr_option(sub: argparse.ArgumentParser, help: str) -> None:
            sub.add_argument(
                "--attr",
                action="append",
                default=[],
                metavar="KEY=VALUE",
                help=help + ' (repeatable; a number, true or false is typed: quote "5" for text)',
            )

        sub = verb("list", self.do_list, "list instances, newest first")
        sub.add_argument("--workflow", "-w")
        sub.add_argument("--status", "-s")
        attr_option(sub, "only instances with this search attribute")
        sub.add_argument("--limit", "-n", type=int, default=20)
        sub.add_argument(
            "--cursor", help="next page (with --workflow): the cursor a previous list printed"
        )

        sub = verb("start", self.do_start, "start an instance of a workflow")
        sub.add_argument("workflow")
        sub.add_argument("--params", "-p", help="params as JSON, or @file.json")
        sub.add_argument("--id", dest="instance_id")
        sub.add_argument("--idempotency-key")
        sub.add_argument("--version", type=int)
        sub.add_argument("--count", type=int, default=1, help="start N instances with these params")
        sub.add_argument(
            "--priority", type=int, default=5, help="0-9, lower starts first while queued"
        )
        sub.add_argument("--concurrency-key", help="bounded by max_concurrent_per_key")
        sub.add_argument("--debounce-key", help="with --debounce: one pending instance per key")
        sub.add_argument(
            "--debounce", help='start this long after the last create, e.g. "5 seconds"'
        )
        attr_option(sub, "give the instance this search attribute")

        sub = by_id(
            verb(
                "status",
                self.do_status,
                "show an instance: status, output, error, steps, pending events",
            )
        )
        sub.add_argument(
            "--steps",
            type=int,
            default=STATUS_STEPS,
            metavar="N",
            help=f"show the newest N steps (default {STATUS_STEPS}, at most {PAGE_MAX}; "
            "also with --json)",
        )
        sub = by_id(verb("history", self.do_history, "show an instance's history records"))
        sub.add_argument(
            "--limit",
            "-n",
            type=int,
            default=PAGE_MAX,
            help=f"at most this many records (default and most: {PAGE_MAX})",
        )
        sub.add_argument(
            "--after",
            type=int,
            default=0,
            metavar="SEQ",
            help='the records after this sequence: the next page, as "more: --after SEQ" says',
        )

        sub = by_id(verb("send-event", self.do_send_event, "send an event to an instance"))
        sub.add_argument("type")
        sub.add_argument("--payload", help="payload as JSON, or @file.json")

        for name, help in (
            ("pause", "pause at the next step boundary"),
            ("resume", "resume a paused instance"),
            ("terminate", "stop an instance for good"),
            ("skip-sleep", "wake an instance's current sleep now"),
            ("delete", "delete a finished instance with its steps, events, history and spans"),
        ):
            by_id(verb(name, self.do_action, help)).set_defaults(action=name.replace("-", "_"))

        sub = by_id(
            verb("restart", self.do_restart, "run an instance again from the start or from a step")
        )
        sub.add_argument("--from-step", help="drop this step's checkpoint and every later one")
        sub.add_argument(
            "--to-version", type=int, help="run on this registered version from now on"
        )

        sub = by_id(
            verb("cancel", self.do_cancel, "cancel an instance, compensating its completed steps")
        )
        sub.add_argument(
            "--no-compensate", action="store_true", help="terminate without running compensations"
        )

        verb("prune", self.do_prune, "delete finished instances past their retention")

        sub = verb(
            "bulk",
            self.do_bulk,
            "apply an action to every instance a filter matches, in batches, with progress",
        )
        sub.add_argument("action", choices=BulkAction.values)
        sub.add_argument("--workflow", "-w", required=True)
        sub.add_argument("--status", "-s")
        sub.add_argument("--version", type=int)
        attr_option(sub, "only instances with this search attribute")
        sub.add_argument("--created-before", metavar="ISO", help="e.g. 2026-01-01T00:00:00Z")
        sub.add_argument("--created-after", metavar="ISO")
        sub.add_argument("--type", dest="event_type", help="send_event: the event type")
        sub.add_argument("--payload", help="send_event: payload as JSON, or @file.json")
        sub.add_argument("--from-step", help="restart: from this step")
        sub.add_argument("--to-version", type=int, help="restart: on this registered version")
        sub.add_argument("--no-compensate", action="store_true", help="cancel: no compensations")
        sub.add_argument(
            "--background",
            action="store_true",
            help="only start the job (workers apply it); print its id",
        )

        sub = verb("token", self.do_token, "manage API tokens")
        sub.add_argument("token_verb", choices=["create", "rotate", "revoke", "list"])
        sub.add_argument("name", nargs="?")
        sub.add_argument(
            "--user", help="act as this user (without: a service token, limited only by its scope)"
        )
        sub.add_argument(
            "--scope",
            choices=["read", "write"],
            default="write",
            help="read: list and get only; write (default): also create and act",
        )
        sub.add_argument(
            "--workflow",
            action="append",
            dest="workflows",
            metavar="NAME",
            help="limit the token to this workflow (repeat for several; default: all)",
        )
        sub.add_argument(
            "--expires",
            metavar="DURATION",
            help='expire after this long, e.g. "30d" (default: never)',
        )

        sub = verb("schedules", self.do_schedules, "list and manage cron schedules")
        sub.add_argument(
            "schedule_verb", choices=["list", "create", "pause", "resume", "delete", "trigger"]
        )
        sub.add_argument("name", nargs="?", help="schedule name")
        sub.add_argument("target", nargs="?", metavar="WORKFLOW", help="create: the workflow")
        sub.add_argument("cron", nargs="?", help='create: a cron expression, e.g. "0 3 * * *"')
        sub.add_argument("--workflow", "-w", help="list: only this workflow's schedules")
        sub.add_argument("--params", "-p", help="create: params as JSON, or @file.json")
        sub.add_argument("--timezone", default="UTC", help="create: an IANA time zone")

        sub = by_id(verb("watch", self.do_watch, "follow an instance until it finishes"))
        sub.add_argument(
            "--run-engine", action="store_true", help="run the engine in this process too"
        )
        sub.add_argument("--timeout", type=float, help="give up after this many seconds")

        sub = verb("demo", self.do_demo, "create demo instances (and optionally a superuser)")
        sub.add_argument("--superuser", metavar="USER:PASSWORD")

        sub = verb(
            "bench",
            self.do_bench,
            "run the benchmark: python -m bench (wf bench -- ARGS passes ARGS on)",
        )
        sub.add_argument("bench_args", nargs=argparse.REMAINDER)

    def execute(self, *args: Any, **options: Any) -> Any:
        """The system checks run before handle(), and Django 6's read the database's
        features: a database wf cannot use is the same one line there as in a verb."""
        unreachable = unreachable_database() if options.get("verb") != "bench" else None
        if unreachable:  # in seconds, not after the pool's wait for a connection
            raise CommandError(unreachable)
        try:
            return super().execute(*args, **options)
        except DatabaseError as exc:
            raise database_refusal(exc) from exc
        except CommandError as exc:
            # Django writes the message to stderr as it is, and refusals quote input and
            # stored names: one line, with nothing the terminal would act on.
            shown = one_line(str(exc))
            if shown == str(exc):
                raise
            raise CommandError(shown, returncode=exc.returncode) from exc

    def handle(self, *args: Any, **options: Any) -> None:
        namespace = argparse.Namespace(**options)
        refusal = not_utf8(self.verb_parsers[options["verb"]], options)
        if refusal:
            raise refusal
        try:
            options["handler"](namespace)
            self.stdout.flush()  # a closed pipe raises here, not at the interpreter's exit
        except (errors.WorkflowError, tokens.TokenError) as exc:
            raise CommandError(" ".join(str(exc).split())) from exc
        except DatabaseError as exc:
            raise database_refusal(exc) from exc
        except BrokenPipeError:
            # The reader went away (`wf list --json | head`): stop quietly, as `ls | head`
            # does. What stdout still buffers goes to /dev/null, or the interpreter's last
            # flush would print the BrokenPipeError after all.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            sys.exit(1)
        finally:
            live.flush()  # open pages in other processes hear of this command's changes

    # --- output ---------------------------------------------------------------------

    def emit(self, opts: argparse.Namespace, data: Any, human: str) -> None:
        if opts.json:
            self.stdout.write(terminal_json(data, indent=2))
        else:
            self.stdout.write(printable(human))

    # --- read verbs -----------------------------------------------------------------

    def do_list(self, opts: argparse.Namespace) -> None:
        if opts.cursor and not opts.workflow:
            raise CommandError("--cursor needs --workflow (cursors are per workflow)")
        names = [opts.workflow] if opts.workflow else surfaces.workflow_names()
        infos, cursor = [], None
        for name in names:
            page = surfaces.binding(name).list(
                status=opts.status,
                limit=opts.limit,
                cursor=opts.cursor,
                attributes=parse_attr_options(opts.attr),
            )
            infos += page.instances
            cursor = page.cursor
        infos = sorted(infos, key=lambda i: i.created_at, reverse=True)[: opts.limit]
        rows = [surfaces.info_json(i) for i in infos]
        human = table(
            ["workflow", "id", "version", "status", "created", "error"],
            [
                [
                    r["workflow"],
                    r["id"],
                    f"v{r['version']}",
                    r["status"],
                    short_time(r["created_at"]),
                    error_text(r["error"]) if r["error"] else "",
                ]
                for r in rows
            ],
        )
        if opts.workflow and cursor:
            human += f"\nmore: --cursor {cursor}"
        self.emit(opts, {"instances": rows, "cursor": cursor if opts.workflow else None}, human)

    def do_status(self, opts: argparse.Namespace) -> None:
        if not 0 <= opts.steps <= PAGE_MAX:
            raise CommandError(f"--steps must be from 0 to {PAGE_MAX}, got {opts.steps}")
        data = surfaces.instance_json(
            find_instance(opts.id, opts.workflow), steps=opts.steps, children=STATUS_CHILDREN
        )
        lines = [
            f"{data['workflow']}/{data['id']}  v{data['version']}  {data['status']}",
            f"params:   {compact(data['params'])}",
            f"created:  {short_time(data['created_at'])}"
            + (f" by {one_line(data['created_by'])}" if data["created_by"] else ""),
        ]
        if data["output"] is not None:
            lines.append(f"output:   {compact(data['output'])}")
        if data["error"]:
            lines.append(f"error:    {error_text(data['error'])}")
        if data["waiting_reason"]:
            lines.append(f"waiting:  {one_line(data['waiting_reason'])}")
        if data["parent"]:
            parent = data["parent"]
            lines.append(f"parent:   {parent['workflow']}/{parent['id']} (step {parent['step']!r})")
        hidden_children = data["children_total"] - len(data["children"])
        if hidden_children:
            lines.append(
                f"children: {data['children_total']}, the newest {len(data['children'])} below;"
                " the API's …/children lists them all"
            )
        for child in data["children"]:
            lines.append(
                f"child:    {child['workflow']}/{child['id']} {child['status']} (step {child['step']!r})"
            )
        if data["steps"]:
            lines += [
                "",
                table(
                    ["step", "kind", "status", "attempts", "ms", "output / error"],
                    [
                        [
                            s["name"],
                            s["kind"],
                            s["status"],
                            s["attempts"],
                            "" if s["duration_ms"] is None else f"{s['duration_ms']:.0f}",
                            error_text(s["error"])
                            if s["error"] and s["status"] != "complete"
                            else s["output"],
                        ]
                        for s in data["steps"]
                    ],
                ),
            ]
        hidden = data["steps_total"] - len(data["steps"])
        if hidden:
            lines += [
                "",
                f"{hidden} earlier step(s) not shown: --steps N shows the newest N (at most "
                f"{PAGE_MAX}); `wf history {data['id']}` pages through what every step did",
            ]
        if data["pending_events"]:
            lines += [
                "",
                table(
                    ["waiting for", "type", "timeout at"],
                    [
                        [p["name"], p["type"], short_time(p["timeout_at"])]
                        for p in data["pending_events"]
                    ],
                ),
            ]
        self.emit(opts, data, "\n".join(lines))

    def do_history(self, opts: argparse.Namespace) -> None:
        if not 1 <= opts.limit <= PAGE_MAX:
            raise CommandError(f"--limit must be from 1 to {PAGE_MAX}, got {opts.limit}")
        if opts.after < 0:
            raise CommandError(f"--after must be a history sequence, 0 or more, got {opts.after}")
        records = find_instance(opts.id, opts.workflow).history(
            after=opts.after, limit=opts.limit + 1
        )
        more = len(records) > opts.limit
        entries = [surfaces.history_json(h) for h in records[: opts.limit]]
        human = table(
            ["seq", "time", "type", "actor", "data"],
            [
                [h["sequence"], short_time(h["created_at"]), h["type"], h["actor"], h["data"]]
                for h in entries
            ],
        )
        hint = f"more: --after {entries[-1]['sequence']}" if more else ""
        if hint and opts.json:  # the JSON stays a list, as before; the hint goes to stderr
            self.stderr.write(hint)
        self.emit(opts, entries, human + (f"\n{hint}" if hint else ""))

    # --- write verbs ----------------------------------------------------------------

    def do_start(self, opts: argparse.Namespace) -> None:
        params = parse_json_arg(opts.params, "--params")
        if opts.count != 1:
            self.start_many(opts, params)
            return
        handle = surfaces.binding(opts.workflow).create(
            params=params,
            id=opts.instance_id,
            idempotency_key=opts.idempotency_key,
            actor="cli",
            version=opts.version,
            priority=opts.priority,
            concurrency_key=opts.concurrency_key,
            debounce_key=opts.debounce_key,
            debounce=opts.debounce,
            attributes=parse_attr_options(opts.attr),
        )
        data = surfaces.created_json(handle)
        verb = (
            "started" if data["created"] else "found (its idempotency key or debounce key named it)"
        )
        self.emit(
            opts,
            data,
            f"{verb} {data['workflow']}/{data['id']} (v{data['version']}, {data['status']})",
        )

    def start_many(self, opts: argparse.Namespace, params: Any) -> None:
        """--count N: N instances with the same params, in batches (START_BATCH at most)."""
        if not 1 <= opts.count <= START_COUNT_MAX:
            raise CommandError(
                f"--count must be from 1 to {START_COUNT_MAX} (start more in several commands), "
                f"got {opts.count}"
            )
        if opts.instance_id or opts.idempotency_key:
            raise CommandError(
                "--id and --idempotency-key name one instance; leave them out with --count"
            )
        if opts.debounce_key or opts.debounce:
            raise CommandError(
                "--debounce-key and --debounce keep one pending instance; leave them out with --count"
            )
        attributes = parse_attr_options(opts.attr)
        binding = surfaces.binding(opts.workflow)
        per_batch = min(START_BATCH, binding.definition(opts.version).limits().max_batch_size)
        ids: list[str] = []
        with self.progress(opts, opts.count, "starting") as bar:
            for start in range(0, opts.count, per_batch):
                size = min(per_batch, opts.count - start)
                item = {"params": params, "priority": opts.priority}
                item.update(concurrency_key=opts.concurrency_key, attributes=attributes)
                handles = binding.create_batch(
                    [dict(item) for _ in range(size)], actor="cli", version=opts.version
                )
                ids += [h.id for h in handles]
                bar.update(size)
        self.emit(
            opts,
            {"workflow": opts.workflow, "count": len(ids), "ids": ids},
            f"started {len(ids)} instances of {opts.workflow}",
        )

    def progress(self, opts: argparse.Namespace, total: int, what: str) -> tqdm:
        """A progress bar on stderr for long work; off with --json and when not a terminal."""
        return tqdm(
            total=total,
            desc=what,
            unit=" instances",
            disable=True if opts.json else None,
            file=sys.stderr,
        )

    def do_send_event(self, opts: argparse.Namespace) -> None:
        payload = parse_json_arg(opts.payload, "--payload")
        handle = find_instance(opts.id, opts.workflow)
        handle.send_event(opts.type, payload, actor="cli")
        self.emit(
            opts,
            {"id": handle.id, "workflow": handle.workflow, "type": opts.type, "sent": True},
            f"sent {opts.type!r} to {handle.workflow}/{handle.id}",
        )

    def do_action(self, opts: argparse.Namespace) -> None:
        handle = find_instance(opts.id, opts.workflow)
        method = getattr(handle, opts.action)
        result = method(actor="cli")
        if opts.action == "terminate" and result is False:
            raise CommandError(
                f"instance {handle.id!r} had already finished ({handle.status().status})"
            )
        if opts.action == "delete":
            self.emit(
                opts,
                {"id": handle.id, "workflow": handle.workflow, "deleted": True},
                f"deleted {handle.workflow}/{handle.id}",
            )
            return
        self.report(opts, handle, opts.action.replace("_", "-"))

    def do_restart(self, opts: argparse.Namespace) -> None:
        handle = find_instance(opts.id, opts.workflow)
        handle.restart(from_step=opts.from_step, actor="cli", version=opts.to_version)
        what = "restart" + (f" from {opts.from_step!r}" if opts.from_step else "")
        if opts.to_version is not None:
            what += f" on version {opts.to_version}"
        self.report(opts, handle, what)

    def do_cancel(self, opts: argparse.Namespace) -> None:
        handle = find_instance(opts.id, opts.workflow)
        handle.cancel(compensate=not opts.no_compensate, actor="cli")
        self.report(opts, handle, "cancel")

    def report(self, opts: argparse.Namespace, handle: InstanceHandle, what: str) -> None:
        status = handle.status().status
        self.emit(
            opts,
            {"id": handle.id, "workflow": handle.workflow, "status": status},
            f"{what}: {handle.workflow}/{handle.id} is now {status}",
        )

    def do_prune(self, opts: argparse.Namespace) -> None:
        now = clock.now()
        with self.progress(opts, store.prunable(now), "pruning") as bar:
            deleted = store.prune(now, on_batch=bar.update, on_pruned=live.instances_pruned)
        self.emit(
            opts, {"pruned": deleted}, f"pruned {deleted} finished instance(s) past their retention"
        )

    def do_bulk(self, opts: argparse.Namespace) -> None:
        """Start the job, then apply it here batch by batch (workers may take batches
        too: each is taken once), so it also finishes where no worker runs."""
        job = surfaces.binding(opts.workflow).bulk(
            opts.action,
            status=opts.status,
            version=opts.version,
            attributes=parse_attr_options(opts.attr),
            created_before=parse_instant_option(opts.created_before, "--created-before"),
            created_after=parse_instant_option(opts.created_after, "--created-after"),
            event_type=opts.event_type,
            payload=parse_json_arg(opts.payload, "--payload"),
            from_step=opts.from_step,
            compensate=not opts.no_compensate,
            actor="cli",
            to_version=opts.to_version,
        )
        if not opts.background:
            with self.progress(opts, job.matched, f"bulk {opts.action}") as bar:
                rolled_back = 0
                while not job.done:
                    before = job.processed
                    try:
                        taken = bulk.process_batch(job.id)
                    except DatabaseError as exc:
                        # The batch rolled back whole (a deadlock, a serialization failure,
                        # a lock timeout): nothing of it applied, so it is taken again.
                        rolled_back += 1
                        if rolled_back >= BULK_BATCH_TRIES:
                            job.refresh()
                            raise CommandError(
                                f"bulk {job.action} #{job.id}: the database rolled a batch back "
                                f"{rolled_back} times ({first_line(exc)}); {job.processed} of "
                                f"{job.matched} instances done, the job is kept and workers "
                                f"finish it"
                            ) from exc
                        time.sleep(POLL_SECONDS * rolled_back)
                        continue
                    rolled_back = 0
                    if taken is None:  # a worker holds its next batch
                        time.sleep(POLL_SECONDS)
                    job.refresh()
                    bar.update(job.processed - before)
        data = surfaces.bulk_job_json(job)
        human = (
            f"bulk {job.action} #{job.id}: matched {job.matched}, "
            + (
                f"applied {job.applied}, "
                + (f"{bulk.PAUSE_REQUESTED} {job.pause_requested}, " if job.pause_requested else "")
                + f"skipped {job.skipped}, failed {job.failed}"
                if job.done
                else "started (workers apply it)"
            )
            + "".join(f"\n  {one_line(str(e))}" for e in job.errors)
        )
        self.emit(opts, data, human)
        if job.failed:  # reported above; a script must not take the job for a success
            raise CommandError(
                f"bulk {job.action} #{job.id}: {job.failed} of {job.matched} instances failed"
            )

    # --- tokens ---------------------------------------------------------------------

    def do_token(self, opts: argparse.Namespace) -> None:
        if opts.token_verb == "list":
            rows = [
                {
                    "name": t.name,
                    "prefix": t.prefix,
                    "user": t.user.get_username() if t.user else None,
                    "scope": t.scope,
                    "workflows": t.workflow_names,
                    "created_at": surfaces.iso(t.created_at),
                    "expires_at": surfaces.iso(t.expires_at),
                    "last_used_at": surfaces.iso(t.last_used_at),
                    "rotated_at": surfaces.iso(t.rotated_at),
                    "revoked_at": surfaces.iso(t.revoked_at),
                }
                for t in ApiToken.objects.select_related("user").order_by("name")
            ]
            human = table(
                [
                    "name",
                    "prefix",
                    "user",
                    "scope",
                    "workflows",
                    "created",
                    "expires",
                    "last used",
                    "revoked",
                ],
                [
                    [
                        r["name"],
                        r["prefix"] + "…",
                        r["user"] or "(service)",
                        r["scope"],
                        " ".join(r["workflows"]) or "*",
                        short_time(r["created_at"]),
                        short_time(r["expires_at"]),
                        short_time(r["last_used_at"]),
                        short_time(r["revoked_at"]),
                    ]
                    for r in rows
                ],
            )
            self.emit(opts, rows, human)
            return
        if not opts.name:
            raise CommandError(f"wf token {opts.token_verb} needs a token name")
        if opts.token_verb in ("create", "rotate"):
            if opts.token_verb == "create":
                token, raw = tokens.issue(
                    opts.name, opts.user, opts.scope, opts.workflows, opts.expires
                )
            else:
                token = tokens.named(opts.name)
                raw = tokens.rotate(token)
            who = f"user {token.user.get_username()}" if token.user else "a service token"
            limits = (
                f"{token.scope} scope, workflows: {' '.join(token.workflow_names) or 'all'}, expires: "
                f"{short_time(surfaces.iso(token.expires_at)) if token.expires_at else 'never'}"
            )
            self.emit(
                opts,
                {
                    "name": token.name,
                    "token": raw,
                    "user": token.user.get_username() if token.user else None,
                    "scope": token.scope,
                    "workflows": token.workflow_names,
                    "expires_at": surfaces.iso(token.expires_at),
                },
                f"{raw}\n(token {token.name!r} for {who}; {limits}; shown once, only its hash is stored)",
            )
        else:
            token = tokens.revoke(opts.name)
            self.emit(
                opts,
                {"name": token.name, "revoked_at": surfaces.iso(token.revoked_at)},
                f"revoked token {token.name!r}",
            )

    # --- schedules ------------------------------------------------------------------

    def do_schedules(self, opts: argparse.Namespace) -> None:
        verb = opts.schedule_verb
        if verb == "list":
            rows = [surfaces.schedule_json(s) for s in schedules.list(workflow=opts.workflow)]
            human = table(
                ["name", "workflow", "cron", "timezone", "state", "next run", "last tick", "last"],
                [
                    [
                        r["name"],
                        r["workflow"],
                        r["cron"],
                        r["timezone"],
                        "paused" if r["paused"] else "active",
                        short_time(r["next_run_at"]),
                        short_time(r["last_tick_at"]),
                        r["last_instance_id"] or "",
                    ]
                    for r in rows
                ],
            )
            self.emit(opts, rows, human if rows else "no schedules")
            return
        if not opts.name:
            raise CommandError(f"wf schedules {verb} needs a schedule name")
        if verb == "create":
            if not opts.target or not opts.cron:
                raise CommandError("wf schedules create needs NAME WORKFLOW CRON")
            schedule = schedules.create(
                opts.name,
                workflow=opts.target,
                cron=opts.cron,
                params=parse_json_arg(opts.params, "--params"),
                timezone=opts.timezone,
                actor="wf",
            )
            data = surfaces.schedule_json(schedule, next_runs=3)
            self.emit(
                opts,
                data,
                f"created schedule {schedule.name!r} of {schedule.workflow!r} "
                f"({schedule.cron}, {schedule.timezone}); next runs: "
                + ", ".join(short_time(t) for t in data["next_runs"]),
            )
            return
        schedule = schedules.get(opts.name)
        if verb == "trigger":
            handle = schedule.trigger(actor="wf")
            self.emit(
                opts,
                surfaces.created_json(handle),
                f"started {handle.workflow}/{handle.id} from schedule {schedule.name!r}",
            )
        elif verb == "delete":
            schedule.delete()
            self.emit(
                opts,
                {"name": schedule.name, "deleted": True},
                f"deleted schedule {schedule.name!r}",
            )
        else:
            schedule = schedule.pause() if verb == "pause" else schedule.resume()
            self.emit(
                opts,
                surfaces.schedule_json(schedule, next_runs=3),  # as the API's change answers
                f"schedule {schedule.name!r} is {'paused' if schedule.paused else 'active'}"
                + (
                    f"; next run {short_time(surfaces.iso(schedule.next_run_at))}"
                    if schedule.next_run_at
                    else ""
                ),
            )

    # --- follow ---------------------------------------------------------------------

    def do_watch(self, opts: argparse.Namespace) -> None:
        """Poll the database (and optionally run the engine) and print what is new."""
        if opts.timeout is not None and not (math.isfinite(opts.timeout) and opts.timeout >= 0):
            # nan compared false with every deadline: watch never gave up.
            raise CommandError(
                f"--timeout must be a number of seconds, 0 or more, got {opts.timeout}"
            )
        handle = find_instance(opts.id, opts.workflow)
        deadline = None if opts.timeout is None else time.monotonic() + opts.timeout
        # Each poll reads what is new, a page at a time, not the whole instance (which made
        # every poll of an instance with 50,000 steps read 150,000 rows): the history after
        # the last record printed, the steps started after the last one seen, and those
        # open at the last poll or now (the only ones whose state can change).
        seen_history = seen_step = 0
        open_steps: dict[int, tuple[str, int]] = {}
        while True:
            if opts.run_engine:
                testing.run_until_idle()
            while True:
                entries = handle.history(after=seen_history, limit=PAGE_MAX)
                for entry in entries:
                    seen_history = entry.sequence
                    self.line(
                        opts,
                        {"history": surfaces.history_json(entry)},
                        f"{short_time(entry.created_at.isoformat())}  #{entry.sequence:<3} {entry.type}"
                        + (f"  {compact(entry.data)}" if entry.data else "")
                        + (f"  by {one_line(entry.actor)}" if entry.actor else ""),
                    )
                if len(entries) < PAGE_MAX:
                    break
            still_open: dict[int, tuple[str, int]] = {}
            report = functools.partial(self.report_steps, opts, open_steps, still_open)
            report(handle.open_steps(through=seen_step, also=list(open_steps)))
            while True:
                new = handle.steps(after=seen_step, limit=PAGE_MAX)
                report(new)
                if new:
                    seen_step = new[-1].seq
                if len(new) < PAGE_MAX:
                    break
            open_steps = still_open
            status = handle.status()
            if status.status in lifecycle.FINISHED:
                self.line(
                    opts,
                    {
                        "finished": {
                            "status": status.status,
                            "output": status.output,
                            "error": status.error,
                        }
                    },
                    f"finished: {status.status}"
                    + (f"  output {compact(status.output)}" if status.output is not None else "")
                    + (f"  error {error_text(status.error)}" if status.error else ""),
                )
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise CommandError(
                    f"instance {handle.id!r} is still {status.status} after {opts.timeout} s"
                )
            time.sleep(POLL_SECONDS)

    def report_steps(
        self,
        opts: argparse.Namespace,
        before: dict[int, tuple[str, int]],
        now: dict[int, tuple[str, int]],
        steps: list[StepRecord],
    ) -> None:
        """A line for each step new or changed since the last poll (`before`: the state of
        those open then); `now` collects those open now."""
        for step in steps:
            state = (step.status, step.attempts)
            if before.get(step.pk) != state:
                self.line(
                    opts,
                    {"step": surfaces.step_json(step)},
                    f"          step {step.name!r} ({step.kind}) {step.status}, attempt {step.attempts}",
                )
            if step.status in OPEN_STEP_STATUSES:
                now[step.pk] = state

    def line(self, opts: argparse.Namespace, data: Any, human: str) -> None:
        """One line per event: JSON lines with --json."""
        self.stdout.write(compact(data) if opts.json else printable(human))
        self.stdout.flush()

    # --- setup ----------------------------------------------------------------------

    def do_demo(self, opts: argparse.Namespace) -> None:
        from workflows_app.demo.workflows import create_demo_instances

        user_note = ""
        if opts.superuser:
            username, sep, password = opts.superuser.partition(":")
            if not username or not sep or not password:
                raise CommandError("--superuser must be USER:PASSWORD, e.g. admin:admin")
            # By the user model's USERNAME_FIELD (a custom one may log in by email), its
            # other required fields left blank as createsuperuser --noinput would.
            users = get_user_model()
            name_field = users.USERNAME_FIELD
            if users._default_manager.filter(**{name_field: username}).exists():
                user_note = f"user {username!r} exists; left unchanged"
            else:
                blanks = dict.fromkeys(users.REQUIRED_FIELDS, "")
                users._default_manager.create_superuser(
                    **{name_field: username, **blanks}, password=password
                )
                user_note = f"created superuser {username!r}"
        created = create_demo_instances(actor="demo")
        human = f"created {len(created)} demo instances" + (f"; {user_note}" if user_note else "")
        self.emit(opts, {"instances": created, "superuser": user_note or None}, human)

    def do_bench(self, opts: argparse.Namespace) -> None:
        spec = importlib.util.find_spec("bench")
        if spec is None:
            raise CommandError(
                "no bench package here: `python -m bench` needs bench/ beside manage.py"
            )
        args = opts.bench_args[1:] if opts.bench_args[:1] == ["--"] else opts.bench_args
        # Run from the folder holding the package, so `-m bench` finds it whatever the cwd.
        cwd = Path(spec.origin).parent.parent if getattr(spec, "origin", None) else None
        code = subprocess.call([sys.executable, "-m", "bench", *args], cwd=cwd)
        if code:
            raise CommandError(f"python -m bench exited with status {code}")
