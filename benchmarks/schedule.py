"""Periodic jobs: how late a cron tick's job is made, the bus next to pgqueuer's SchedulerManager.

Both run a schedule that ticks every second (cron with seconds), side by side
on the same PostgreSQL for the same time:

* **bus**: `b.schedule` on a topic; a tick's lateness is its message's
  `created_at` (the commit of the tick's publish) minus the tick (its `tick`
  header).
* **pgqueuer**: `SchedulerManager.schedule(...)` through its own front door
  (`run()`, in its own database); a tick's lateness is when its function is
  called minus the due time pgqueuer set (`next_run` of the previous call).

Rows: p50 and p99 lateness (lower is better), the ratio against pgqueuer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from datetime import datetime
from typing import Any

import asyncpg

import bus
from benchmarks.queue import PGQ, _pct, _pgq_install, _pgq_pool
from benchmarks.result import Result

SCENARIO = "schedule"
CRON = "* * * * * *"  # every second (croniter: seconds last)


async def _bus_lateness(dsn: str, seconds: float) -> list[float]:
    schema = "bench_" + uuid.uuid4().hex[:10]
    b = await bus.connect(dsn, schema=schema, cleaner_interval=0, scheduler_interval=1.0)
    try:
        await b.create_topic("ticks", partitions=1)
        await b.schedule("bench", cron=CRON, topic="ticks", payload={"n": 1})
        await asyncio.sleep(seconds)
        await b.unschedule("bench")
        msgs = await b.read("ticks", 0, 0, 100_000)
        return [(m.created_at - datetime.fromisoformat(m.headers["tick"])).total_seconds() for m in msgs]
    finally:
        await b.close()
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')  # a generated bench schema name
        finally:
            await conn.close()


async def _pgq_lateness(dsn: str, seconds: float) -> list[float]:
    from pgqueuer import SchedulerManager
    from pgqueuer.models import Schedule

    pool = await _pgq_pool(dsn)
    try:
        queries = await _pgq_install(pool)
        sm = SchedulerManager(queries)
        lateness: list[float] = []
        due: list[datetime] = []

        @sm.schedule("bench", CRON)
        async def tick(schedule: Schedule) -> None:
            called = time.time()
            if due:
                lateness.append(called - due[-1].timestamp())
            due.append(schedule.next_run)

        runner = asyncio.create_task(sm.run())
        await asyncio.sleep(seconds)
        sm.shutdown.set()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(runner, 10)
        await queries.uninstall()
        return lateness
    finally:
        await pool.close()


async def run(dsn: str, quick: bool) -> list[Result]:
    """p50 and p99 tick lateness of the bus's scheduler against pgqueuer's, run side by side."""
    seconds = 8.0 if quick else 60.0
    ours, theirs = await asyncio.gather(_bus_lateness(dsn, seconds), _pgq_lateness(dsn, seconds))
    if not ours or not theirs:
        raise RuntimeError(f"no ticks measured (bus {len(ours)}, pgqueuer {len(theirs)})")
    extra: dict[str, Any] = {"seconds": seconds, "bus_ticks": len(ours), "pgqueuer_ticks": len(theirs)}
    return [
        Result(
            SCENARIO,
            f"cron tick lateness {label}",
            _pct(ours, q) * 1000,
            "ms",
            _pct(theirs, q) * 1000,
            PGQ,
            higher_is_better=False,
            extra=extra,
        )
        for label, q in (("p50", 0.5), ("p99", 0.99))
    ]
