"""Queue takes through a transaction pooler on a stock server: their routines' statements compile nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import asyncpg
import pytest

import bus
from benchmarks import stockpg
from storage import queues, routines
from tests.helpers import stock_server
from tests.pooler.conftest import _bouncer

_CALLS = (
    "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements WHERE toplevel AND query LIKE '%' || $1 || '%'"
)


@pytest.fixture(scope="module")
def stock_dsns(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """Debian's PostgreSQL 15 (defaults kept: JIT on): the server, and a database through PgBouncer in transaction mode."""
    with stock_server(tmp_path_factory.mktemp("stockpg")) as dsn:
        asyncio.run(stockpg.prepare_databases(dsn))
        for pooled in _bouncer(stockpg.database_dsn(dsn, stockpg.DEFAULT_DB), "transaction"):
            yield dsn, pooled


async def test_takes_through_the_pooler_on_a_stock_server_compile_nothing(
    stock_dsns: tuple[str, str],
) -> None:
    server, pooled = stock_dsns
    async with bus.connect(pooled, schema="stock", pooler="transaction") as b:
        await b.create_topic("jobs", partitions=2, semantics="queue")
        await b.create_topic("limited", partitions=2, semantics="queue", max_in_flight_per_key=1)
        await stockpg.reset_statements(server)
        await b.publish_many("jobs", [bus.Outgoing({"n": i}) for i in range(400)])
        await b.publish_many("limited", [bus.Outgoing({"n": i}, key=f"k{i % 4}") for i in range(20)])
        async with b.queue_consumer("jobs", visibility_timeout=30) as q:
            for _ in range(30):  # past the five custom plans a cached plan starts with
                await q.ack_many(await q.take(max_messages=10, timeout=1.0))
        async with b.queue_consumer("limited", visibility_timeout=30) as q:
            for _ in range(5):
                await q.ack_many(await q.take(max_messages=4, timeout=1.0))
        compiled = await stockpg.jit_compiled(server, stockpg.DEFAULT_DB)
    conn = await asyncpg.connect(stockpg.database_dsn(server, stockpg.DEFAULT_DB))
    try:  # the takes ran their routine, whose statement the JIT check saw (pg_stat_statements.track=all)
        calls = await conn.fetchval(_CALLS, routines.name_of(queues.TAKE))
        nested = await conn.fetchval("SELECT max(calls) FROM pg_stat_statements WHERE NOT toplevel")
    finally:
        await conn.close()
    assert calls >= 30
    assert nested >= 30
    assert compiled == [], "statements JIT-compiled on a stock server:\n" + "\n".join(
        f"{functions} functions over {calls} calls: {query[:200]}" for query, calls, functions in compiled
    )
