"""The retention cleaner: one actor per Bus that moves partitions' log start forward.

Every `cleaner_interval` seconds it runs one bounded pass of
`storage.retention.clean_some` (at most `max_partitions` partitions, at most
`batch` offsets each, round-robin by partition id), so a tick never holds the
database for long however much history has piled up. Several processes may
run cleaners at once: each partition is cleaned under its row lock.

Retention moves log starts; the same pass then maintains the segments of
`messages` (storage/segments.py): makes them ahead of time, retires (TRUNCATE)
and drops those whose rows are all below the log starts.
"""

from __future__ import annotations

from typing import Any

from actors.runtime import Actor, ActorRef, Message, Supervisor
from storage import idempotency, retention, segments
from storage.availability import warn_unless_said
from storage.logs import get_logger

__all__ = ["CleanNow", "Cleaner", "Tick", "start_cleaner"]


class Tick(Message, frozen=True):
    """Time for the next bounded pass."""


class CleanNow(Message, frozen=True):
    """Run one pass now (asked: the answer is the number of messages deleted)."""


class Cleaner(Actor[Tick | CleanNow]):
    """Deletes history below the watermark and past retention, a bounded amount per tick."""

    def __init__(self, pool: Any, interval: float, *, max_partitions: int = 100, batch: int = 5_000) -> None:
        self._pool = pool
        self._interval = interval
        self._max_partitions = max_partitions
        self._batch = batch
        self._after_id = 0
        self._log = get_logger(__name__, actor="cleaner")

    async def on_start(self) -> None:
        """Make the segments publishes are about to need, then schedule the ticks."""
        try:
            async with self._pool.acquire() as conn:
                await segments.maintain(conn, interval=self._interval)
        except Exception as exc:  # the first tick tries again
            self._log.warning("segment_maintenance_failed", error=repr(exc))
        self.self_ref.schedule_every(self._interval, Tick())

    async def receive(self, message: Tick | CleanNow) -> Any:
        """Run one pass; failures are logged and retried at the next tick (the database may be back)."""
        match message:
            case Tick() | CleanNow():
                try:
                    return await self._pass()
                except Exception as exc:
                    warn_unless_said(self._log, "retention_pass_failed", exc)
                    if isinstance(message, CleanNow):
                        raise
                    return 0
        return None

    async def _pass(self) -> int:
        async with self._pool.acquire() as conn:
            self._after_id, deleted = await retention.clean_some(
                conn, self._after_id, max_partitions=self._max_partitions, batch=self._batch
            )
            # Idempotency keys past their topic's dedupe window go with the same pass (bounded too).
            await idempotency.delete_expired(conn, self._batch)
            # Segments after retention: what it just retired may complete a segment.
            await segments.maintain(conn, interval=self._interval)
        if deleted:
            self._log.info("retention_deleted", count=deleted)
        return deleted


def start_cleaner(bus: Any, supervisor: Supervisor) -> ActorRef[Tick | CleanNow]:
    """Spawn the Bus's cleaner under its supervisor, ticking every `bus.config.cleaner_interval` seconds."""
    return supervisor.spawn(lambda: Cleaner(bus.pool, bus.config.cleaner_interval), "cleaner")
