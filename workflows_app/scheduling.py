"""The public API of cron schedules: `from workflows_app.client import schedules`.

    s = schedules.create("eu-digest", workflow="digest", cron="*/15 * * * *",
                         params={"region": "eu"}, timezone="Europe/Paris")
    s.pause(); s.resume(); s.trigger(); s.next_runs(3); s.delete()

Workers fire the ticks (engine/store/schedules.py); this module validates input, reads
and changes the rows, and tells workers when a change may move their next wake-up.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from asgiref.sync import sync_to_async
from django.db import transaction

from . import live
from .codec import seal
from .engine import clock, errors, store
from .engine.cron import check_cron, check_schedule_name, check_zone, fire_times
from .engine.limits import check_size, encode_json
from .engine.registry import get_definition
from .models import Instance, Schedule, decode_stored

if TYPE_CHECKING:
    from .client import InstanceHandle

MAX_NEXT_RUNS = 1000


def _actor(actor: Any) -> str:
    from .client import _actor as actor_name

    return actor_name(actor)


def _schedules_changed() -> None:
    """A schedule's next tick may now be earlier: workers look their next tick up again."""
    transaction.on_commit(lambda: live.instance_changed("schedule", None))


def _target(workflow: str) -> store.schedules.Target:
    definition = get_definition(workflow)  # UnknownWorkflow when not registered here
    return store.schedules.Target(definition.name, definition.version, definition.limits())


def upcoming(cron: str, timezone: str, paused: bool, count: int) -> list[datetime]:
    """The next `count` fire times of a schedule after now; none while it is paused."""
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_NEXT_RUNS:
        raise errors.InvalidInput(
            f"count must be an integer from 1 to {MAX_NEXT_RUNS}, got {errors.shown(count)}"
        )
    if paused:
        return []
    return list(itertools.islice(fire_times(cron, timezone, clock.now()), count))


@dataclass(frozen=True)
class ScheduleHandle:
    """One schedule as read from the database; its methods act on it and return fresh handles."""

    name: str
    workflow: str
    cron: str
    timezone: str
    params_json: str  # as stored: sealed by the payload codec, if one is set
    paused: bool
    declared: bool
    next_run_at: datetime | None
    last_tick_at: datetime | None
    last_instance_id: str
    created_at: datetime
    created_by: str
    # The bound of the instances it started (Schedule.started_above_pk); None: by name.
    started_above_pk: int | None = None

    @classmethod
    def from_row(cls, row: Schedule) -> ScheduleHandle:
        return cls(
            name=row.name,
            workflow=row.workflow,
            cron=row.cron,
            timezone=row.timezone,
            params_json=row.params_json,
            paused=row.paused,
            declared=row.declared,
            next_run_at=row.next_run_at,
            last_tick_at=row.last_tick_at,
            last_instance_id=row.last_instance_id,
            created_at=row.created_at,
            created_by=row.created_by,
            started_above_pk=row.started_above_pk,
        )

    @property
    def params(self) -> Any:
        """The params each tick starts an instance with. Decoded when read, not when the
        handle is made: pausing, resuming, triggering or deleting a schedule whose params
        this process cannot decode (its payload codec is not set) must not need them."""
        return decode_stored(self.params_json)

    def refresh(self) -> ScheduleHandle:
        return schedules.get(self.name)

    def pause(self) -> ScheduleHandle:
        """No tick fires until resume(); ticks missed meanwhile never fire."""
        return ScheduleHandle.from_row(store.schedules.set_paused(self.name, True))

    def resume(self) -> ScheduleHandle:
        handle = ScheduleHandle.from_row(store.schedules.set_paused(self.name, False))
        _schedules_changed()
        return handle

    def delete(self) -> None:
        """Remove a runtime schedule (a declared one is removed from its register() call)."""
        store.schedules.delete_schedule(self.name)

    def trigger(self, actor: Any = None) -> InstanceHandle:
        """Start one instance now, with the schedule's params, outside its ticks."""
        from .client import InstanceHandle, _after_commit

        row = store.schedules.get_schedule(self.name)
        instance = store.schedules.trigger(self.name, _target(row.workflow), _actor(actor))
        _after_commit("created", instance, row.workflow)
        return InstanceHandle(row.workflow, instance.instance_id, instance, created=True)

    def next_runs(self, count: int = 5) -> list[datetime]:
        """The next `count` fire times after now (aware datetimes, UTC); none while the
        schedule is paused (as this handle read it), since a paused schedule fires no tick."""
        return upcoming(self.cron, self.timezone, self.paused, count)

    def instances(self, limit: int = 20) -> list[Instance]:
        """The instances this schedule started, newest first (at most 1000, as a page of
        list(): a schedule firing every minute starts half a million a year)."""
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 1000:
            raise errors.InvalidInput(
                f"limit must be an integer from 1 to 1000, got {errors.shown(limit)}"
            )
        started = store.schedules.started_instances(self.name, self.workflow, self.started_above_pk)
        return list(started[:limit])

    async def apause(self) -> ScheduleHandle:
        return await sync_to_async(self.pause)()

    async def aresume(self) -> ScheduleHandle:
        return await sync_to_async(self.resume)()

    async def adelete(self) -> None:
        await sync_to_async(self.delete)()

    async def atrigger(self, actor: Any = None) -> InstanceHandle:
        return await sync_to_async(self.trigger)(actor)


class Schedules:
    """`workflows_app.client.schedules`: create, get and list cron schedules."""

    def create(
        self,
        name: str,
        workflow: str,
        cron: str,
        params: Any = None,
        timezone: str = "UTC",
        actor: Any = None,
    ) -> ScheduleHandle:
        """A new schedule; ScheduleExists if the name is taken, InvalidInput naming a cron
        expression or time zone that does not parse, UnknownWorkflow for an unknown workflow."""
        check_schedule_name(name)
        cron = check_cron(cron)
        check_zone(timezone)
        definition = get_definition(workflow)
        # LimitExceeded now when the workflow's max_instance_id_length holds no tick's id.
        store.schedules.tick_instance_id(
            name, clock.now(), definition.limits().max_instance_id_length
        )
        params_json = encode_json(params, f"params of schedule {name!r}")
        check_size(
            params_json,
            "max_params_bytes",
            definition.limits().max_params_bytes,
            f"params of schedule {name!r}",
        )
        row = store.schedules.create_schedule(
            # Sealed as any instance's params (its instances take them as stored).
            name,
            definition.name,
            cron,
            timezone,
            seal(params_json),
            _actor(actor),
        )
        _schedules_changed()
        return ScheduleHandle.from_row(row)

    def get(self, name: str) -> ScheduleHandle:
        """ScheduleNotFound if there is none of that name."""
        if not isinstance(name, str):
            raise errors.InvalidInput(f"schedule name must be a string, got {name!r}")
        return ScheduleHandle.from_row(store.schedules.get_schedule(name))

    def list(self, workflow: str | None = None) -> list[ScheduleHandle]:
        """Every schedule (declared and runtime), by name; or those of one workflow."""
        rows = Schedule.objects.all()
        if workflow is not None:
            rows = rows.filter(workflow=workflow)
        return [ScheduleHandle.from_row(r) for r in rows.order_by("name")]

    async def acreate(self, *args: Any, **kwargs: Any) -> ScheduleHandle:
        return await sync_to_async(self.create)(*args, **kwargs)

    async def aget(self, name: str) -> ScheduleHandle:
        return await sync_to_async(self.get)(name)

    async def alist(self, workflow: str | None = None) -> list[ScheduleHandle]:
        return await sync_to_async(self.list)(workflow)


schedules = Schedules()
