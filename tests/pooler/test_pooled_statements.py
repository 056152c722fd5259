"""Statements on a pooled connection: the bus schema named in each transaction, nothing else changed."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

import bus
from storage import queues, routines


async def test_a_lone_statement_runs_in_the_bus_schema_and_leaves_no_search_path_behind(
    pooled: Any, bouncer_dsn: str, schema: str
) -> None:
    b = await pooled()
    async with b.pool.acquire() as conn:
        for i in range(10):
            assert await conn.fetchval("SELECT current_setting('search_path') || $1::text", str(i)) == (
                f'"{schema}"{i}'
            )
            assert not conn.is_in_transaction()
    plain = await asyncpg.connect(bouncer_dsn, statement_cache_size=0)
    try:
        for _ in range(5):  # whichever server connection the pooler lends
            assert schema not in await plain.fetchval("SELECT current_setting('search_path')")
    finally:
        await plain.close()


async def test_a_pooled_statement_returns_its_own_rows_and_status(pooled: Any, dsn: str, schema: str) -> None:
    b = await pooled()
    async with b.pool.acquire() as conn:
        assert await conn.execute("CREATE TABLE pooled_rows (a int PRIMARY KEY)") == "CREATE TABLE"
        assert await conn.execute("INSERT INTO pooled_rows VALUES ($1)", 1) == "INSERT 0 1"
        await conn.executemany("INSERT INTO pooled_rows VALUES ($1)", [(2,), (3,), (4,)])
        for _ in range(3):  # described once, then run again on its description
            assert [r["a"] for r in await conn.fetch("SELECT a FROM pooled_rows ORDER BY a")] == [1, 2, 3, 4]
        assert await conn.fetch("SELECT a FROM pooled_rows WHERE a > $1", 10) == []
    direct = await asyncpg.connect(dsn)
    try:  # the unqualified table went to the bus schema
        assert await direct.fetchval(f'SELECT count(*) FROM "{schema}".pooled_rows') == 4
    finally:
        await direct.close()


async def test_a_failed_pooled_statement_writes_nothing_and_the_connection_goes_on(pooled: Any) -> None:
    b = await pooled()
    async with b.pool.acquire() as conn:
        await conn.execute("CREATE TABLE pooled_once (a int PRIMARY KEY)")
        await conn.execute("INSERT INTO pooled_once VALUES ($1)", 1)
        with pytest.raises(asyncpg.UniqueViolationError):
            await conn.execute("INSERT INTO pooled_once VALUES ($1)", 1)
        with pytest.raises(asyncpg.UniqueViolationError):
            await conn.executemany("INSERT INTO pooled_once VALUES ($1)", [(2,), (1,)])
        assert not conn.is_in_transaction()
        assert [r["a"] for r in await conn.fetch("SELECT a FROM pooled_once ORDER BY a")] == [1]


async def test_a_transaction_on_a_pooled_connection_is_in_the_bus_schema(pooled: Any, schema: str) -> None:
    b = await pooled()
    async with b.pool.acquire() as conn:
        await conn.execute("CREATE TABLE pooled_tx (a int)")
        async with conn.transaction():
            assert (await conn.fetchval("SELECT current_setting('search_path')")).strip('"') == schema
            await conn.execute("INSERT INTO pooled_tx VALUES ($1)", 1)
        tx = conn.transaction()
        await tx.start()
        await conn.execute("INSERT INTO pooled_tx VALUES ($1)", 2)
        await tx.rollback()
        assert [r["a"] for r in await conn.fetch("SELECT a FROM pooled_tx")] == [1]


async def test_a_pooled_connection_goes_on_after_a_statement_timed_out(pooled: Any) -> None:
    b = await pooled()
    async with b.pool.acquire() as conn:
        with pytest.raises(asyncio.TimeoutError):
            await conn.fetchval("SELECT pg_sleep($1)", 5.0, timeout=0.3)
        assert await conn.fetchval("SELECT 1 + $1::int", 1) == 2
        assert await conn.fetchval("SELECT current_setting('search_path') = $1", "") is False


async def test_a_column_whose_type_changed_is_described_again(pooled: Any) -> None:
    b = await pooled()
    async with b.pool.acquire() as conn:
        await conn.execute("CREATE TABLE pooled_types (a int)")
        await conn.execute("INSERT INTO pooled_types VALUES ($1)", 7)
        query = "SELECT a FROM pooled_types WHERE a IS NOT NULL OR $1::bool"
        assert await conn.fetchval(query, False) == 7
        await conn.execute("ALTER TABLE pooled_types ALTER a TYPE bigint")
        await conn.execute("UPDATE pooled_types SET a = $1", 2**40)
        try:  # the kept description may meet the new type once
            value = await conn.fetchval(query, False)
        except (BufferError, asyncpg.InterfaceError, asyncpg.PostgresError, ValueError):
            value = await conn.fetchval(query, False)
        assert value == 2**40


async def _take_logged(b: Any, topic: str, n: int) -> tuple[list[Any], bytes]:
    """A take on a pooled connection of `b`, and what its connection wrote to the pooler."""
    sent: list[bytes] = []
    async with b.pool.acquire() as conn:
        transport = conn._con._transport
        write = transport.write
        transport.write = lambda data: (sent.append(bytes(data)), write(data))[1]
        try:
            taken = await queues.take(conn, topic, n, 30.0, "pooled-taker", ordered=False)
        finally:
            transport.write = write
    return taken, b"".join(sent)


async def test_a_pooled_take_runs_as_the_function_of_its_statement_whose_plan_the_server_keeps(
    pooled: Any, dsn: str, schema: str
) -> None:
    b = await pooled()
    await b.create_topic("jobs", partitions=2, semantics="queue")
    await b.publish_many("jobs", [bus.Outgoing(str(i).encode(), partition=str(i % 2)) for i in range(6)])
    taken, sent = await _take_logged(b, "jobs", 4)
    assert len(taken) == 4
    assert routines.name_of(queues.TAKE).encode() in sent
    assert queues.TAKE.encode() not in sent
    direct = await asyncpg.connect(dsn)
    try:
        body = await direct.fetchval(
            "SELECT prosrc FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
            " WHERE n.nspname = $1 AND p.proname = $2",
            schema,
            routines.name_of(queues.TAKE),
        )
        assert queues.TAKE.strip() in body  # the function is the statement's own text
        # Gone from the server (a schema made again by a role that may not create functions):
        # the statement itself runs, from then on.
        await direct.execute(f'DROP FUNCTION "{schema}".{routines.name_of(queues.TAKE)}')
    finally:
        await direct.close()
    taken, sent = await _take_logged(b, "jobs", 4)
    assert len(taken) == 2
    assert queues.TAKE.encode() in sent
