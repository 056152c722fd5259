"""Periodic jobs: `Bus.schedule`, `Bus.unschedule` and `Bus.schedules` (the scheduler is actors/scheduler.py).

A schedule publishes `payload` to `topic` at every tick of a cron expression in
a time zone (five fields, or six with seconds last, as croniter reads them).
Every process of a service may declare its schedules at start: the same
definition again writes nothing, a different one replaces it (from its next
tick on).
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import msgspec
from croniter import croniter

from actors.scheduler import plan
from bus.codec import encode_payload
from storage import schedules as store
from storage.errors import ValidationError
from storage.names import validate_name

if TYPE_CHECKING:
    from bus.context import BusContext

__all__ = ["CATCH_UP", "ScheduleInfo", "define", "list_schedules", "remove"]

CATCH_UP = ("one", "none", "all")


class ScheduleInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A schedule's definition, the last tick it is done with and its next tick."""

    name: str
    cron: str
    topic: str
    payload: bytes | None
    timezone: str
    catch_up: str
    last_tick: datetime
    next_tick: datetime


def validate(cron: object, timezone: object, catch_up: object) -> None:
    """ValidationError (saying what to pass) for a bad cron expression, time zone or catch_up."""
    if not isinstance(cron, str) or not croniter.is_valid(cron):
        raise ValidationError(
            f"invalid cron expression {cron!r}: use five fields 'minute hour day month weekday' "
            "(e.g. '0 3 * * *'), or six with seconds last (e.g. '* * * * * */10')"
        )
    if not isinstance(timezone, str) or not timezone:
        raise ValidationError(
            f"invalid timezone {timezone!r}: use an IANA name such as 'UTC' or 'Europe/Paris'"
        )
    try:
        ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ValidationError(
            f"unknown timezone {timezone!r}: use an IANA name such as 'UTC' or 'Europe/Paris'"
        ) from exc
    if catch_up not in CATCH_UP:
        raise ValidationError(
            f"invalid catch_up {catch_up!r}: use 'one' (publish the latest missed tick), "
            "'none' (skip missed ticks) or 'all' (publish every missed tick)"
        )


async def define(
    ctx: BusContext, name: str, cron: str, topic: str, payload: Any, timezone: str, catch_up: str
) -> bool:
    """Insert or replace the schedule `name`; False when the same definition was already there."""
    validate_name(name, "schedule name")
    validate(cron, timezone, catch_up)
    info = await ctx.topic(topic)  # TopicNotFoundError for a topic that does not exist
    data = encode_payload(payload, allow_tombstone=info.cleanup == "compact", limit=info.max_message_bytes)
    async with ctx.pool.acquire() as conn:
        return await store.define(
            conn,
            store.DefineParams(
                name=name, cron=cron, topic=topic, payload=data, timezone=timezone, catch_up=catch_up
            ),
        )


async def remove(ctx: BusContext, name: str) -> bool:
    """Delete the schedule `name`; False if there was none."""
    validate_name(name, "schedule name")
    async with ctx.pool.acquire() as conn:
        return await store.delete(conn, name)


async def list_schedules(ctx: BusContext) -> list[ScheduleInfo]:
    async with ctx.pool.acquire() as conn:
        rows = await store.list_all(conn)
    out = []
    for r in rows:
        _, _, following = plan(r["cron"], r["timezone"], r["last_tick"], r["last_tick"], "none", 0.0)
        out.append(
            ScheduleInfo(
                name=r["name"],
                cron=r["cron"],
                topic=r["topic"],
                payload=r["payload"],
                timezone=r["timezone"],
                catch_up=r["catch_up"],
                last_tick=r["last_tick"],
                next_tick=following,
            )
        )
    return out
