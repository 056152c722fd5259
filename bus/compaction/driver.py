"""What every step of a compaction run shares: the driver's connection and event loop, Spark, progress.

The job is blocking code (Spark's API is); its database calls run on a private
event loop (`Driver.q`). The Spark session is asked for only when a step needs
it, so a run with nothing to archive never waits for Spark to start.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from storage import db
from storage.compaction import sql
from storage.logs import get_logger

log = get_logger(__name__)

# The run's stage is written to its row at most this often (seconds).
PROGRESS_EVERY = 1.0


@dataclass(frozen=True)
class Progress:
    """A progress event: `stage` is plan|stage|archive|delete|done; counts so far in `counts`."""

    stage: str
    message: str
    done: int = 0
    total: int | None = None
    counts: dict[str, int] = field(default_factory=dict)


ProgressFn = Callable[[Progress], None]
#: Called with the name of each moment where a crash leaves a run half done (`CHECKPOINTS`).
CheckpointFn = Callable[[str], None]


class Driver:
    """One job execution: a driver connection, the Spark session, the open run."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        spark: Callable[[], Any],
        dsn: str,
        schema: str,
        jdbc: tuple[str, dict[str, str]],
        progress: ProgressFn | None,
        checkpoint: CheckpointFn | None,
    ) -> None:
        self.loop = loop
        self._spark = spark
        self._spark_ready: Any = None
        self.dsn = dsn
        self.schema = schema
        self.jdbc = jdbc  # (url, properties) Spark reads the database with
        self.run_id: int | None = None
        self.timings: dict[str, float] = {}
        self._stage_written: tuple[str, float] | None = None
        self._on_progress = progress or (lambda _p: None)
        self._checkpoint = checkpoint or (lambda _point: None)
        self._conn: asyncpg.Connection | None = None
        self.log = log.bind(schema=schema)

    @property
    def conn(self) -> asyncpg.Connection:
        """The driver's own connection (open for the whole job)."""
        assert self._conn is not None, "the driver is not connected"
        return self._conn

    def connect(self) -> asyncpg.Connection:
        """Open the driver's connection."""
        self._conn = self.q(db.connect(self.dsn, self.schema))
        return self._conn

    @property
    def spark(self) -> Any:
        """The Spark session, waiting for it to finish starting the first time."""
        if self._spark_ready is None:
            t0 = time.perf_counter()
            self._spark_ready = self._spark()
            self.timings["session_wait"] = round(time.perf_counter() - t0, 2)
        return self._spark_ready

    def q(self, coro: Any) -> Any:
        """Run one driver-side database call on the job's private event loop."""
        with db.translate_errors():
            return self.loop.run_until_complete(coro)

    def checkpoint(self, point: str) -> None:
        """A moment where a crash leaves the run half done: whoever asked to hear of it is told."""
        self._checkpoint(point)

    def lap(self, step: str, since: float) -> float:
        """Add the time since `since` to `step`'s timing; returns now."""
        now = time.perf_counter()
        self.timings[step] = round(self.timings.get(step, 0.0) + now - since, 2)
        return now

    def progress(self, event: Progress) -> None:
        """Tell the caller, and record the run's stage in `compaction_runs` (`bus compact --status`)."""
        self._on_progress(event)
        if self._record_due(event):
            self.q(self.conn.execute(sql.SET_STAGE, *self._stage_args(event)))

    async def progress_async(self, conn: asyncpg.Connection, event: Progress) -> None:
        """`progress` from inside the job's event loop, on the connection at hand."""
        self._on_progress(event)
        if self._record_due(event):
            await conn.execute(sql.SET_STAGE, *self._stage_args(event))

    def _record_due(self, event: Progress) -> bool:
        """Whether to write this event to the run row: a new stage, the end, or a second since the last write."""
        if self.run_id is None:
            return False
        now = time.monotonic()
        last = self._stage_written
        if last is None or last[0] != event.stage or event.stage == "done" or now - last[1] >= PROGRESS_EVERY:
            self._stage_written = (event.stage, now)
            return True
        return False

    def _stage_args(self, event: Progress) -> tuple[Any, ...]:
        return (self.run_id, event.stage, event.done, event.total, event.message[:200])
