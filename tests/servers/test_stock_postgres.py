"""The bus on Debian's PostgreSQL 15 with its default configuration (JIT on), as packaged servers run.

The embedded server's build has no JIT, so only a stock server shows a statement
of the bus priced above `jit_above_cost` and compiled at every call.
`pg_stat_statements` (loaded, nothing else changed) counts the functions the
server compiled for every statement the bus ran, nested ones included.
"""

from __future__ import annotations

from collections.abc import Iterator

import asyncpg
import msgspec
import pytest

import bus
from benchmarks import stockpg
from tests.helpers import stock_server


@pytest.fixture(scope="module")
def stock_dsn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with stock_server(tmp_path_factory.mktemp("stockpg")) as dsn:
        yield dsn


class Order(msgspec.Struct):
    id: int


async def test_a_stock_server_with_jit_on_compiles_no_statement_of_the_bus(stock_dsn: str) -> None:
    await stockpg.prepare_databases(stock_dsn)
    conn = await asyncpg.connect(stock_dsn)
    try:
        assert await conn.fetchval("SHOW jit") == "on"  # the packaged default, kept
    finally:
        await conn.close()
    dsn = stockpg.database_dsn(stock_dsn, stockpg.DEFAULT_DB)
    async with bus.connect(dsn, schema="stock") as b:
        await b.create_topic("orders", partitions=4)
        await b.create_topic("jobs", partitions=2, semantics="queue")
        await stockpg.reset_statements(stock_dsn)

        for i in range(20):
            await b.publish("orders", Order(i), key=f"c-{i % 5}")
        await b.publish_many("orders", [bus.Outgoing(Order(i), key=f"c-{i}") for i in range(50)])
        user = await asyncpg.connect(dsn)
        try:
            async with user.transaction():
                await b.publish("orders", Order(99), key="c-1", connection=user)
        finally:
            await user.close()

        async with b.consumer("billing", topics=["orders"], start="earliest") as c:
            seen = 0
            for _ in range(20):
                seen += len(await c.poll(timeout=1.0))
                await c.commit()
                if seen >= 71:
                    break
            assert seen == 71

        claim = await b.claim("reporting", topic="orders", worker_id="w-1", max_messages=10)
        assert claim is not None
        await claim.ack()

        await b.publish_many("jobs", [bus.Outgoing({"n": i}) for i in range(40)])
        async with b.queue_consumer("jobs", visibility_timeout=30, max_attempts=3) as q:
            for _ in range(10):
                (job,) = await q.take(max_messages=1, timeout=2.0)
                await q.ack(job)
            jobs = await q.take(max_messages=10, timeout=2.0)
            await q.nack(jobs[0])
            await q.ack_many(jobs[1:])

        class Opened(bus.Event, tag="account.opened"):
            account: str

        store = b.event_store("accounts")
        await store.append(Opened(account="a-1"))
        assert len(await store.read()) == 1

    compiled = await stockpg.jit_compiled(stock_dsn, stockpg.DEFAULT_DB)
    assert compiled == [], "statements JIT-compiled on a stock server:\n" + "\n".join(
        f"{functions} functions over {calls} calls: {query[:200]}" for query, calls, functions in compiled
    )


async def test_the_stock_server_bench_compares_each_row_with_jit_off(stock_dsn: str) -> None:
    rows, compiled = await stockpg.compare(stock_dsn, stockpg.QUICK)

    assert compiled == []
    assert [r.name.split(" (")[0] for r in rows] == [name for name, _, _ in stockpg.ROWS.values()]
    for row in rows:
        assert row.value > 0 and row.baseline and row.baseline > 0
        assert row.baseline_name == "same server, jit=off"
        assert row.extra["jit_functions"] == 0
        assert "PostgreSQL 15" in row.name


async def test_publishes_of_several_partitions_plan_the_heads_statements_once_per_session(
    stock_dsn: str,
) -> None:
    # The head functions run with sequential scans off; a statement of theirs with an array
    # parameter (the flush's partitions) would otherwise be planned again at every call.
    await stockpg.prepare_databases(stock_dsn)
    admin = await asyncpg.connect(stockpg.database_dsn(stock_dsn, stockpg.DEFAULT_DB))
    try:
        await admin.execute(
            f'ALTER DATABASE "{stockpg.DEFAULT_DB}" SET pg_stat_statements.track_planning = on'
        )
    finally:
        await admin.close()
    dsn = stockpg.database_dsn(stock_dsn, stockpg.DEFAULT_DB)
    async with bus.connect(dsn, schema="plans") as b:
        await b.create_topic("orders", partitions=12)
        await b.publish("orders", Order(0), key="warm")
        # On a caller's connection (the outbox) a flush of several partitions goes through
        # log_take_offsets_many, whatever the connection's settings.
        user = await asyncpg.connect(dsn)
        try:
            await stockpg.reset_statements(stock_dsn)
            for i in range(40):
                async with user.transaction():
                    await b.publish_many(
                        "orders",
                        [bus.Outgoing(Order(i), key=f"c-{i}-{k}") for k in range(6)],
                        connection=user,
                    )
        finally:
            await user.close()

    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            """SELECT s.query, s.calls, s.plans FROM pg_stat_statements s
               JOIN pg_database d ON d.oid = s.dbid
               WHERE d.datname = $1 AND NOT s.toplevel AND s.calls >= 40
                 AND s.query ~ '(log_heads|partitions)'""",
            stockpg.DEFAULT_DB,
        )
    finally:
        await conn.close()
    assert rows, "no statement of the head functions was counted"
    replanned = [(r["query"], r["calls"], r["plans"]) for r in rows if r["plans"] > r["calls"] // 4]
    assert replanned == [], "planned at (nearly) every call:\n" + "\n".join(
        f"{plans} plans over {calls} calls: {query[:200]}" for query, calls, plans in replanned
    )
