"""Durable workflows: the bus beside DBOS Transact on the same PostgreSQL, in one run.

The same three-step workflow on both sides (two steps, then a transaction that inserts a row in
the application's table), started and waited for by 1 and by 32 concurrent callers:

* **bus**: `@b.workflow`, `ctx.step`, `ctx.transaction()`, `b.start_workflow` and
  `handle.result()`, with the Bus's defaults.
* **DBOS Transact** (PyPI `dbos`, `benchmarks/workflows_dbos.py`, a process of its own):
  `@DBOS.workflow`, `@DBOS.step`, a Postgres datasource's `@ds.transaction()`, a DBOS queue's
  `enqueue_async` and the handle's `get_result`, with its queue polled every 50 ms and results
  every 10 ms (its defaults are 1 s each).

Then the time from a killed worker's restart to its runs resuming (benchmarks/workflows_recovery.py).

Rows: workflows completed per second, start→result p50 and p99, and database transactions per
workflow (the server's commit and rollback count over the phase, background work included,
divided by the workflows run: every autocommit statement is one).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from typing import Any

import asyncpg

import bus
from benchmarks.queue import _pct
from benchmarks.result import Result

SCENARIO = "workflows"
DBOS = "DBOS Transact"


async def _xacts(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        await asyncio.sleep(1.1)  # the backends' statistics reach the shared view within a second
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        return int(await conn.fetchval("SELECT sum(xact_commit + xact_rollback) FROM pg_stat_database"))
    finally:
        await conn.close()


def step_one(i: int) -> int:
    return i + 1


def step_two(i: int) -> int:
    return i * 2


async def _bus_side(dsn: str, callers: int, runs: int) -> dict[str, Any]:
    schema = "bench_" + uuid.uuid4().hex[:10]
    b = await bus.connect(dsn, schema=schema, cleaner_interval=0)
    try:
        await b.pool.execute("CREATE TABLE payments (id text PRIMARY KEY, amount int)")

        @b.workflow("three")
        async def three(ctx: bus.WorkflowContext, i: int) -> int:
            a = int(await ctx.step(step_one, i))
            c = int(await ctx.step(step_two, a))
            async with ctx.transaction() as tx:
                await tx.connection.execute("INSERT INTO payments VALUES ($1, $2)", ctx.workflow_id, c)
            return c

        for i in range(10):  # warm-up
            await (await b.start_workflow("three", -i - 1)).result(timeout=60)
        latencies: list[float] = []
        counter = iter(range(runs))

        async def caller() -> None:
            for i in counter:
                t0 = time.perf_counter()
                handle = await b.start_workflow("three", i)
                assert await handle.result(timeout=120) == (i + 1) * 2
                latencies.append(time.perf_counter() - t0)

        before = await _xacts(dsn)
        started = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(callers)))
        seconds = time.perf_counter() - started
        after = await _xacts(dsn)
        return {"seconds": seconds, "latencies": latencies, "xacts": after - before - 2}
    finally:
        await b.close()
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')  # a generated bench schema name
        finally:
            await conn.close()


def _dbos_side(dsn: str, callers: int, runs: int) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.workflows_dbos", dsn, str(callers), str(runs)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the DBOS side failed: {done.stderr[-2000:]}")
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def _rows(callers: int, ours: dict[str, Any], theirs: dict[str, Any]) -> list[Result]:
    n_ours, n_theirs = len(ours["latencies"]), len(theirs["latencies"])
    extra = {"callers": callers, "bus_runs": n_ours, "dbos_runs": n_theirs}
    label = f"{callers} caller{'s' if callers > 1 else ''}"
    rows = [
        Result(
            SCENARIO,
            f"workflows/s, {label}",
            n_ours / ours["seconds"],
            "wf/s",
            n_theirs / theirs["seconds"],
            DBOS,
            target="≥ 2× DBOS Transact" if callers > 1 else None,
            extra=extra,
        )
    ]
    for q, name in ((0.5, "p50"), (0.99, "p99")):
        rows.append(
            Result(
                SCENARIO,
                f"start→result {name}, {label}",
                _pct(ours["latencies"], q) * 1000,
                "ms",
                _pct(theirs["latencies"], q) * 1000,
                DBOS,
                higher_is_better=False,
                target="≤ 1× DBOS Transact" if name == "p50" else None,
                extra=extra,
            )
        )
    rows.append(
        Result(
            SCENARIO,
            f"database transactions per workflow, {label}",
            ours["xacts"] / n_ours,
            "xact/wf",
            theirs["xacts"] / n_theirs,
            DBOS,
            higher_is_better=False,
            target="≤ 1× DBOS Transact",
            extra=extra,
        )
    )
    return rows


async def run(dsn: str, quick: bool) -> list[Result]:
    """Both sides at 1 and at 32 callers, one after the other on the same server."""
    rows: list[Result] = []
    for callers, runs in ((1, 50 if quick else 300), (32, 300 if quick else 3000)):
        ours = await _bus_side(dsn, callers, runs)
        theirs = await asyncio.to_thread(_dbos_side, dsn, callers, runs)
        rows += _rows(callers, ours, theirs)
    from benchmarks import workflows_recovery

    rows += await workflows_recovery.run(dsn, quick)
    return rows
