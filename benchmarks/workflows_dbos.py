"""DBOS Transact's side of `bus bench workflows`, in a process of its own (DBOS is a process-wide
singleton with threads of its own).

python -m benchmarks.workflows_dbos DSN CALLERS RUNS  -> one JSON line on stdout:
{"seconds": ..., "latencies": [...], "xacts": ...}

The same three-step workflow as the bus's (two steps, one transaction on the application's
table), through DBOS's front door: `@DBOS.workflow`, `@DBOS.step`, a Postgres datasource's
`@ds.transaction()`, started on a DBOS `Queue` with `enqueue_async` and waited with
`get_result`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from typing import Any

import asyncpg
import sqlalchemy as sa

# DBOS polls: its queue (default every 1 s) and a handle's result (default every 1 s). Both are set
# shorter here, in its favour: what it would take to compete on latency.
QUEUE_POLL = 0.05
RESULT_POLL = 0.01


async def _xacts(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        await asyncio.sleep(1.1)  # the backends' statistics reach the shared view within a second
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        return int(await conn.fetchval("SELECT sum(xact_commit + xact_rollback) FROM pg_stat_database"))
    finally:
        await conn.close()


async def main(dsn: str, callers: int, runs: int) -> dict[str, Any]:
    from dbos import DBOS, AsyncSQLAlchemyDatasource, DBOSConfig

    tag = uuid.uuid4().hex[:8]
    base = sa.make_url(dsn)
    sys_url = base.set(database=f"dbos_bench_{tag}").render_as_string(hide_password=False)
    app_url = base.render_as_string(hide_password=False)
    config: DBOSConfig = {"name": "bench", "system_database_url": sys_url, "log_level": "WARNING"}
    DBOS(config=config)
    ds = await AsyncSQLAlchemyDatasource.create(app_url, schema=f"dbos_app_{tag}")
    table = f"dbos_app_{tag}.payments"
    async with ds.engine.begin() as c:
        await c.execute(sa.text(f"CREATE TABLE {table} (id text PRIMARY KEY, amount int)"))

    @DBOS.step()
    async def step_one(i: int) -> int:
        return i + 1

    @DBOS.step()
    async def step_two(i: int) -> int:
        return i * 2

    @ds.transaction()
    async def pay(wid: str, amount: int) -> None:
        await ds.sql_session().execute(
            sa.text(f"INSERT INTO {table} VALUES (:id, :a)"), {"id": wid, "a": amount}
        )

    @DBOS.workflow()
    async def three(i: int) -> int:
        a = await step_one(i)
        b = await step_two(a)
        await pay(DBOS.workflow_id or "", b)
        return b

    DBOS.launch()
    try:
        queue = await DBOS.register_queue_async("bench", polling_interval_sec=QUEUE_POLL)
        for i in range(10):  # warm-up
            await (await queue.enqueue_async(three, -i - 1)).get_result(polling_interval_sec=RESULT_POLL)
        latencies: list[float] = []
        counter = iter(range(runs))

        async def caller() -> None:
            for i in counter:
                t0 = time.perf_counter()
                handle = await queue.enqueue_async(three, i)
                assert await handle.get_result(polling_interval_sec=RESULT_POLL) == (i + 1) * 2
                latencies.append(time.perf_counter() - t0)

        before = await _xacts(dsn)
        started = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(callers)))
        seconds = time.perf_counter() - started
        after = await _xacts(dsn)
        return {"seconds": seconds, "latencies": latencies, "xacts": after - before - 2}
    finally:
        DBOS.destroy(destroy_registry=True)
        await ds.engine.dispose()
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(f"DROP SCHEMA IF EXISTS dbos_app_{tag} CASCADE")  # a generated name
            await conn.execute(f"DROP DATABASE IF EXISTS dbos_bench_{tag} WITH (FORCE)")
        finally:
            await conn.close()


if __name__ == "__main__":
    out = asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
    print(json.dumps(out))
