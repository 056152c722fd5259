"""Failover: how long the bus is unavailable when a synchronous standby is promoted.

Starts its own PostgreSQL 15 primary and synchronous standby (scripts/pgha.sh;
the `dsn` argument is not used), publishes from 3 tasks with a handler
subscription reading, crashes the primary (`-m immediate`) and promotes the
standby. Measured from the promotion (`pg_ctl promote` returned):

* the bus's first successful publish (retrying on StorageUnavailableError);
* the subscription's next delivery.

Baseline, measured in the same failover: a raw asyncpg connection opened on
the same multi-host DSN (target_session_attrs=read-write) that runs one
statement, retried the same way. The ratio says how much the bus's own
reconnecting adds to what the driver and the server take anyway.
Runs 3 failovers (quick: 1) and reports the median.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg

import bus
from benchmarks.result import Result
from bus.errors import StorageUnavailableError
from bus.testing import FAST

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "pgha.sh"


def _pgha(home: str, *args: str) -> str:
    env = dict(os.environ, BUS_HOME=home)
    out = subprocess.run(["sh", str(SCRIPT), *args], env=env, check=True, capture_output=True, text=True)
    return out.stdout.strip()


async def _until(action: Callable[[], Awaitable[None]], start: float, deadline: float) -> float:
    while True:
        try:
            await action()
            return time.monotonic() - start
        except (StorageUnavailableError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.02)


async def _one(home: str) -> tuple[float, float, float]:
    dsn = await asyncio.to_thread(_pgha, home, "start")
    try:
        async with bus.connect(dsn, **FAST) as b:
            await b.create_topic("orders", partitions=4)
            delivered = asyncio.Event()
            promoted: list[float] = []

            async def handler(m: bus.Message) -> None:
                if promoted:
                    delivered.set()

            sub = await b.subscribe("bench", handler, topics=["orders"], start="earliest")
            stop = asyncio.Event()

            async def publisher() -> None:
                while not stop.is_set():
                    try:
                        await b.publish("orders", {"x": 1})
                    except StorageUnavailableError:
                        await asyncio.sleep(0.05)

            tasks = [asyncio.create_task(publisher()) for _ in range(3)]
            await asyncio.sleep(1.0)
            await asyncio.to_thread(_pgha, home, "stop-primary")
            await asyncio.to_thread(_pgha, home, "promote")
            start = time.monotonic()
            promoted.append(start)
            deadline = start + 30

            async def raw() -> None:
                conn = await asyncpg.connect(dsn, timeout=2)
                try:
                    await conn.execute("SELECT 1")
                finally:
                    await conn.close()

            async def publish() -> None:
                await b.publish("orders", {"after": True})

            base, to_publish = await asyncio.gather(
                _until(raw, start, deadline), _until(publish, start, deadline)
            )
            await asyncio.wait_for(delivered.wait(), 30)
            to_deliver = time.monotonic() - start
            stop.set()
            await asyncio.gather(*tasks)
            await sub.stop()
            return to_publish, to_deliver, base
    finally:
        await asyncio.to_thread(_pgha, home, "stop")


async def run(dsn: str, quick: bool) -> list[Result]:
    runs = []
    with tempfile.TemporaryDirectory(prefix="bus-failover-") as home:
        os.chmod(home, 0o755)
        for _ in range(1 if quick else 3):
            runs.append(await _one(home))
    publish = statistics.median(r[0] for r in runs)
    deliver = statistics.median(r[1] for r in runs)
    base = statistics.median(r[2] for r in runs)
    extra = {"runs": [[round(x, 3) for x in r] for r in runs]}
    baseline_name = "raw asyncpg connect + statement"
    return [
        Result(
            "failover", "promotion to first publish", publish, "s", base, baseline_name, False, extra=extra
        ),
        Result(
            "failover",
            "promotion to next group delivery",
            deliver,
            "s",
            base,
            baseline_name,
            False,
            extra=extra,
        ),
    ]
