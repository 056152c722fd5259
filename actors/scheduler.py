"""The scheduler: one actor per Bus; the one holding the schema's lease publishes periodic jobs.

Every `scheduler_interval` seconds (sooner when a tick is due earlier) it takes
or renews the lease in `scheduler_lease`. The leader reads the schedules and,
for each tick due, publishes its job and advances the schedule's `last_tick`
in one transaction, fenced on the last tick read and on its lease
(storage/schedules.py): a tick is published once whatever number of processes
run a scheduler, and a leader that dies is replaced when its lease ends.

Ticks missed while no scheduler ran follow the schedule's `catch_up`: "all"
publishes each, "one" publishes the latest, "none" publishes none of them. A
tick is missed when it is later than the grace (two leases: what a leader's
replacement may take) when found.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from croniter import croniter

from actors.runtime import Actor, ActorRef, Message, Supervisor, Timer
from storage import schedules
from storage.availability import warn_unless_said
from storage.logs import get_logger

__all__ = ["Check", "Scheduler", "plan", "start_scheduler"]

# How many missed ticks one pass publishes for a "catch_up='all'" schedule (the next pass goes on).
MAX_TICKS_PER_PASS = 1000


class Check(Message, frozen=True):
    """Renew the lease and fire the ticks that are due."""


def plan(
    cron: str, timezone: str, last_tick: datetime, now: datetime, catch_up: str, grace: float
) -> tuple[list[datetime], datetime, datetime]:
    """(ticks to publish, the last tick the schedule is then done with, its next tick after that).

    The ticks are those after `last_tick` up to `now`; of those later than `grace` seconds
    (missed while no scheduler ran), "all" keeps each, "one" the latest, "none" none.
    `now` comes from the scheduler's wall time (the Bus's, or one a test gives it).
    """
    tz = ZoneInfo(timezone)
    it = croniter(cron, last_tick.astimezone(tz))
    due: list[datetime] = []
    tick: datetime = it.get_next(datetime)
    while tick <= now and len(due) < MAX_TICKS_PER_PASS:
        due.append(tick)
        tick = it.get_next(datetime)
    if not due:
        return [], last_tick, tick
    done = due[-1]
    late = now - timedelta(seconds=grace)
    missed = [t for t in due if t < late]
    recent = [t for t in due if t >= late]
    if catch_up == "all":
        fire = due
    elif catch_up == "one":
        fire = missed[-1:] + recent
    else:
        fire = recent
    return fire, done, tick


class Scheduler(Actor[Check]):
    """Holds (or waits for) the schema's scheduler lease and fires the due ticks while it holds it."""

    def __init__(
        self,
        pool: Any,
        publish: Callable[..., Awaitable[Any]],
        interval: float,
        lease_time: float,
        wall: Callable[[], datetime] | None = None,
    ) -> None:
        self._pool = pool
        self._publish = publish
        self._interval = interval
        self._lease_time = lease_time
        self._wall = wall  # None: the actor's clock (the Bus's time: a test's Clock moves it)
        self._owner = f"scheduler-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # the pid: operators see who leads
        self._epoch: int | None = None
        self._timer: Timer | None = None
        self._log = get_logger(__name__, actor="scheduler")

    async def on_start(self) -> None:
        self._timer = self.self_ref.schedule_once(0, Check())

    async def on_stop(self) -> None:
        """Give the lease up at once, so another process's scheduler takes over without waiting."""
        if self._timer is not None:
            self._timer.cancel()
        if self._epoch is not None:
            try:
                async with self._pool.acquire() as conn:
                    await schedules.release(conn, self._owner, self._epoch)
            except Exception as exc:  # the lease then ends by itself
                self._log.warning("scheduler_release_failed", error=repr(exc))

    async def receive(self, message: Check) -> Any:
        """One pass; a failure is logged and the next pass tries again (the database may be back)."""
        if self._timer is not None:  # one timer at a time: a Check sent from outside replaces it
            self._timer.cancel()
        delay = self._interval
        try:
            delay = await self._pass()
        except Exception as exc:
            warn_unless_said(self._log, "scheduler_pass_failed", exc)
        self._timer = self.self_ref.schedule_once(max(0.0, min(delay, self._interval)), Check())
        return None

    def _now(self) -> datetime:
        """The wall time ticks are due by: the Bus's (moved by a test's Clock), else this host's."""
        if self._wall is not None:
            return self._wall()
        return self.clock.now() or datetime.now(UTC)

    async def _pass(self) -> float:
        """Fire what is due; the seconds until the next pass is needed."""
        async with self._pool.acquire() as conn:
            self._epoch = await schedules.acquire(conn, self._owner, self._lease_time)
            if self._epoch is None:
                return self._interval
            rows = await schedules.list_all(conn)
        now = self._now()
        grace = 2 * self._lease_time
        wait = self._interval
        for row in rows:
            try:
                fire, done, following = plan(
                    row["cron"], row["timezone"], row["last_tick"], now, row["catch_up"], grace
                )
                if done != row["last_tick"]:
                    if not await self._fire(row, fire, done):
                        continue
                wait = min(wait, (following - self._now()).total_seconds())
            except Exception as exc:  # one broken schedule (its topic deleted) does not stop the others
                self._log.warning("schedule_tick_failed", schedule=row["name"], error=repr(exc))
        return wait

    async def _fire(self, row: Any, fire: list[datetime], done: datetime) -> bool:
        """Publish `fire` and advance to `done` in one transaction; False if another fired it first."""
        assert self._epoch is not None
        payload = row["payload"]  # as encoded when defined: bytes publish unchanged
        async with self._pool.acquire() as conn, conn.transaction():
            if not await schedules.advance(
                conn, row["name"], row["last_tick"], done, self._owner, self._epoch
            ):
                return False
            for tick in fire:
                headers = {"schedule": row["name"], "tick": tick.astimezone(UTC).isoformat()}
                await self._publish(row["topic"], payload, headers=headers, connection=conn)
        if fire:
            self._log.info("schedule_ticked", schedule=row["name"], ticks=len(fire))
        return True


def start_scheduler(bus: Any, supervisor: Supervisor) -> ActorRef[Check]:
    """Spawn the Bus's scheduler under its supervisor, checking every `bus.config.scheduler_interval` s."""
    interval = bus.config.scheduler_interval
    lease = max(5 * interval, 1.0)
    return supervisor.spawn(lambda: Scheduler(bus.pool, bus.publish, interval, lease), "scheduler")
