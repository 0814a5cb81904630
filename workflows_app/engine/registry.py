"""register(): the in-process catalog of workflow classes and their versions.

Each (name, version) records a hash of the class's source. The database catalog
(WorkflowVersion) remembers every hash ever registered, so a changed class under an
old version number is refused instead of silently replaying old instances on new code.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from django.conf import settings  # not in limits(): that import was a call every run

from .cron import SHORTEST_TICK_ID, check_cron
from .errors import InvalidInput, UnknownWorkflow, VersionConflict, shown
from .limits import Limits

if TYPE_CHECKING:
    from .step import Step, WorkflowEvent


class WorkflowEntrypoint:
    """Base class of a workflow: override `async def run(self, event, step)`."""

    workflow_name: str = ""
    workflow_version: int = 0
    # When True, an instance that errors runs the compensations of its completed steps.
    compensate_on_failure: bool = False

    def __init__(self, instance_id: str = "") -> None:
        self.instance_id = instance_id

    async def run(self, event: WorkflowEvent, step: Step) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError("a workflow must define async def run(self, event, step)")


@dataclass(frozen=True)
class Definition:
    name: str
    version: int
    cls: type[WorkflowEntrypoint]
    limits_overrides: dict[str, Any] = field(default_factory=dict)
    source_hash: str = ""
    # Cron expressions of register(schedules=[...]): each becomes a declared Schedule.
    schedules: tuple[str, ...] = ()
    # (the settings' LIMITS and the newest version it was built from, the Limits): every
    # run asks for its limits.
    _built_limits: list[tuple[Any, Definition, Limits]] = field(
        default_factory=list, compare=False, repr=False
    )

    @property
    def class_path(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"

    async def start(self, instance_id: str, event: WorkflowEvent, step: Step) -> Any:
        """Construct the workflow and run it, in the run's task: a constructor that raises
        fails the run as run() raising would (the instance errors), not the engine."""
        return await self.cls(instance_id).run(event, step)

    def limits(self) -> Limits:
        """Built once while the settings' LIMITS stay the same object (a test or a reload
        that assigns new settings gets new limits) and no newer version is registered.

        The flow-control limits (FLOW_LIMITS) are the workflow's, not the version's: its
        queue holds every version's instances and every version's instances hold places,
        so they come from its newest registered version, whatever version asks. A rollout
        that adds, changes or drops one applies it to the instances of older versions too
        (an older version's own would admit the queue past the new bound, or leave it
        queued after an end that frees a place)."""
        configured = getattr(settings, "WFDASH", {}).get("LIMITS")
        newest = _newest(self.name) or self
        built_from = self._built_limits[0] if self._built_limits else None
        if built_from is not None and built_from[0] is configured and built_from[1] is newest:
            return built_from[2]
        own = {k: v for k, v in self.limits_overrides.items() if k not in FLOW_LIMITS}
        flow = {k: v for k, v in newest.limits_overrides.items() if k in FLOW_LIMITS}
        built = Limits.build(configured, own, flow)
        self._built_limits[:] = [(configured, newest, built)]
        return built


_lock = threading.Lock()
_definitions: dict[str, dict[int, Definition]] = {}

# The limits admission applies to a workflow's queue as a whole (Definition.limits).
FLOW_LIMITS = frozenset({"max_concurrent_instances", "max_concurrent_per_key", "rate_limit"})


def _newest(name: str) -> Definition | None:
    with _lock:
        versions = _definitions.get(name)
        return versions[max(versions)] if versions else None


def source_hash(cls: type) -> str:
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        source = cls.__qualname__
    return hashlib.sha256(source.encode()).hexdigest()


# The version columns' range (PostgreSQL's integer): register(version=2**31) was taken,
# then every create of it failed on PostgreSQL with an IntegrityError.
MAX_VERSION = 2**31 - 1


def register(
    name: str,
    version: int = 1,
    limits: dict[str, Any] | None = None,
    schedules: Sequence[str] | None = None,
) -> Callable[[type[WorkflowEntrypoint]], type[WorkflowEntrypoint]]:
    """Class decorator: make a WorkflowEntrypoint subclass available as `name` at `version`.

    `schedules`: cron expressions (UTC) that each start an instance at every tick.
    """
    if not isinstance(name, str) or not name or len(name) > 200:
        raise InvalidInput(
            f"workflow name must be a non-empty string of at most 200 characters, got {name!r}"
        )
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= MAX_VERSION:
        raise InvalidInput(
            f"workflow version must be an integer from 1 to {MAX_VERSION}, got {shown(version)}"
        )
    own = Limits.build(limits)  # validate now, at import time, not at the first run
    if isinstance(schedules, str) or not isinstance(schedules, (list, tuple, type(None))):
        raise InvalidInput(f"schedules must be a list of cron expressions, got {schedules!r}")
    crons = tuple(check_cron(expression) for expression in schedules or ())
    _refuse_repeated_crons(name, crons)
    if crons and own.max_instance_id_length < SHORTEST_TICK_ID:
        raise InvalidInput(
            f"schedules of {name!r} need max_instance_id_length of at least {SHORTEST_TICK_ID} "
            f"(the id of a tick's instance), got {own.max_instance_id_length}"
        )

    def decorate(cls: type[WorkflowEntrypoint]) -> type[WorkflowEntrypoint]:
        if not (isinstance(cls, type) and issubclass(cls, WorkflowEntrypoint)):
            raise InvalidInput(
                f"@register({name!r}) must decorate a WorkflowEntrypoint subclass, got {cls!r}"
            )
        if not inspect.iscoroutinefunction(cls.run):
            raise InvalidInput(f"{cls.__qualname__}.run must be `async def run(self, event, step)`")
        cls.workflow_name = name
        cls.workflow_version = version
        definition = Definition(name, version, cls, dict(limits or {}), source_hash(cls), crons)
        with _lock:
            current = _definitions.get(name, {}).get(version)
            if current is not None and current.source_hash != definition.source_hash:
                _refuse_changed_source(current, definition)
            _definitions.setdefault(name, {})[version] = definition
        return cls

    return decorate


def _refuse_repeated_crons(name: str, crons: tuple[str, ...]) -> None:
    """Each declared cron is its own schedule: one listed twice started two instances at
    every tick (a copy-paste a deploy would otherwise act on silently)."""
    seen: set[str] = set()
    for cron in crons:
        fields = " ".join(cron.split())
        if fields in seen:
            raise InvalidInput(
                f"schedules of {name!r} list the cron expression {cron!r} twice: "
                "each would start an instance at every tick"
            )
        seen.add(fields)


def strict_versions() -> bool:
    """WFDASH["STRICT_VERSIONS"]: changed code under a registered version is refused (default)."""
    if not settings.configured:
        return True
    return bool(getattr(settings, "WFDASH", {}).get("STRICT_VERSIONS", True))


def _refuse_changed_source(current: Definition, new: Definition) -> None:
    """Other code under a version registered in this process: refused, unless versions are
    not strict, so instances never replay on code other than the code they started with."""
    if not strict_versions():
        logging.getLogger("workflows_app.engine").warning(
            'WFDASH["STRICT_VERSIONS"] is off: workflow %r version %s registered again in this '
            "process with different source code: %s replaces %s",
            current.name,
            current.version,
            new.class_path,
            current.class_path,
        )
        return
    raise VersionConflict(
        f"workflow {current.name!r} version {current.version} is already registered in this process "
        f"by {current.class_path} with different source code than {new.class_path}; bump the version "
        f"(register({current.name!r}, version={current.version + 1})) or set "
        'WFDASH["STRICT_VERSIONS"] = False to replace it'
    )


def unregister(name: str, version: int | None = None) -> None:
    """Forget a workflow (or one version of it) in this process; used by tests and reloads."""
    with _lock:
        if version is None:
            _definitions.pop(name, None)
        elif name in _definitions:
            _definitions[name].pop(version, None)
            if not _definitions[name]:
                del _definitions[name]


_resolvers: list[Callable[[str], None]] = []
_resolved_prefixes: set[str] = set()


def add_resolver(resolver: Callable[[str], None], prefix: str) -> None:
    """resolver(name) may register an unknown workflow whose name starts with `prefix` on
    demand (the Django tasks backend registers a task's workflow by importing the task),
    so a worker runs what it never imported: its claims take such instances as its own."""
    if resolver not in _resolvers:
        _resolvers.append(resolver)
    _resolved_prefixes.add(prefix)


def resolved_prefixes() -> list[str]:
    """The name prefixes of the workflows the resolvers may register (sorted)."""
    return sorted(_resolved_prefixes)


def _resolve(name: str) -> None:
    with _lock:
        if name in _definitions:
            return
    for resolver in tuple(_resolvers):
        resolver(name)


def get_definition(name: str, version: int | None = None) -> Definition:
    _resolve(name)
    with _lock:
        versions = _definitions.get(name)
        if not versions:
            raise UnknownWorkflow(f"no workflow named {name!r} is registered")
        if version is None:
            return versions[max(versions)]
        if version not in versions:
            raise UnknownWorkflow(
                f"workflow {name!r} has no registered version {version}; registered: {sorted(versions)}"
            )
        return versions[version]


def find_definition(name: str, version: int) -> Definition | None:
    _resolve(name)
    with _lock:
        return _definitions.get(name, {}).get(version)


def is_registered(name: str, version: int) -> bool:
    """Whether this process has that version, without asking the resolvers."""
    with _lock:
        return version in _definitions.get(name, {})


def limits_for(name: str, version: int) -> Limits:
    """The limits of an instance's version; its workflow's newest, then the settings', when
    its code is gone (operators can still stop and delete what it left behind)."""
    definition = find_definition(name, version)
    if definition is None:
        try:
            definition = get_definition(name)
        except UnknownWorkflow:
            return Limits.build(getattr(settings, "WFDASH", {}).get("LIMITS"))
    return definition.limits()


def all_definitions() -> list[Definition]:
    with _lock:
        return [d for versions in _definitions.values() for d in versions.values()]
