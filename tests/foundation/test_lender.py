"""db.Lender: pool connections kept out between the bus's own statements, lent one block at a time."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from bus.testing import eventually
from storage import db
from storage.errors import StorageUnavailableError
from tests.conftest import Connect


@pytest.fixture
async def pool(dsn: str) -> AsyncIterator[asyncpg.Pool]:
    p = await db.create_pool(dsn, "public", min_size=0, max_size=4)
    yield p
    await p.close()


async def _pid(conn: db.Connection) -> int:
    return int(await conn.fetchval("SELECT pg_backend_pid()"))


async def test_a_connection_is_kept_out_and_lent_again(pool: asyncpg.Pool) -> None:
    lender = db.Lender(pool, 2)
    async with lender.lend() as conn:
        first = await _pid(conn)
    async with lender.lend() as conn:
        assert await _pid(conn) == first  # the same backend: not given back to the pool in between
    assert lender.borrowed == 1
    assert await lender.fetchval("SELECT 41 + 1") == 42
    await lender.close()
    assert lender.borrowed == 0


async def test_lent_connections_use_generic_plans_and_the_pool_gets_them_back_reset(
    pool: asyncpg.Pool,
) -> None:
    lender = db.Lender(pool, 1)
    show = "SELECT current_setting('plan_cache_mode')"
    assert await lender.fetchval(show) == "force_generic_plan"
    async with lender.lend() as conn:
        lent = await _pid(conn)
    await lender.close()
    async with pool.acquire() as conn:
        assert await _pid(conn) == lent  # the same connection, back in the pool
        assert await conn.fetchval(show) == "auto"  # and reset by it


async def test_at_most_size_connections_are_out_and_the_next_borrower_waits(pool: asyncpg.Pool) -> None:
    lender = db.Lender(pool, 2)
    release = asyncio.Event()
    holding = 0

    async def hold() -> None:
        nonlocal holding
        async with lender.lend():
            holding += 1
            await release.wait()

    holders = [asyncio.create_task(hold()) for _ in range(2)]
    await eventually(lambda: holding == 2)
    third = asyncio.create_task(lender.fetchval("SELECT 3"))
    await asyncio.sleep(0.1)
    assert not third.done() and lender.borrowed == 2  # waits for a lent one: no third connection
    release.set()
    assert await asyncio.wait_for(third, 5) == 3
    await asyncio.gather(*holders)
    assert lender.borrowed == 2
    await lender.close()


async def test_a_server_error_gives_the_connection_back_to_the_pool(pool: asyncpg.Pool) -> None:
    """The protocol may still be reading up to ReadyForQuery: the pool, not the next statement, waits it out."""
    lender = db.Lender(pool, 1)
    assert await lender.fetchval("SELECT 1") == 1
    assert lender.borrowed == 1
    with pytest.raises(asyncpg.DivisionByZeroError):
        await lender.fetchval("SELECT 1 / 0")
    assert lender.borrowed == 0
    for _ in range(20):  # statements right after the error all work
        assert await lender.fetchval("SELECT 2") == 2
    assert lender.borrowed == 1
    await lender.close()


async def test_a_cancelled_block_or_an_open_transaction_gives_the_connection_back_to_the_pool(
    pool: asyncpg.Pool,
) -> None:
    lender = db.Lender(pool, 1)
    async with lender.lend() as conn:
        first = await _pid(conn)
    slow = asyncio.create_task(lender.fetchval("SELECT pg_sleep(5)"))
    await asyncio.sleep(0.2)
    slow.cancel()
    with pytest.raises(asyncio.CancelledError):
        await slow
    async with lender.lend() as conn:
        second = await _pid(conn)
        assert await conn.fetchval("SELECT 1") == 1  # usable: not the cancelled one mid-query
        await conn.execute("BEGIN")
    assert lender.borrowed == 0  # left inside a transaction: back to the pool (which rolls it back)
    async with lender.lend() as conn:
        assert not conn.is_in_transaction()
        assert await _pid(conn) != first or second != first
    await lender.close()


async def test_a_connection_the_server_dropped_is_replaced(dsn: str, pool: asyncpg.Pool) -> None:
    lender = db.Lender(pool, 1)
    async with lender.lend() as conn:
        victim = await _pid(conn)
    killer = await asyncpg.connect(dsn)
    try:
        await killer.execute("SELECT pg_terminate_backend($1)", victim)
    finally:
        await killer.close()
    await asyncio.sleep(0.2)  # the client sees the socket close
    for _ in range(2):  # at worst one call meets the dead connection before it is known closed
        try:
            assert await _pid_lent(lender) != victim
            break
        except (asyncpg.InterfaceError, asyncpg.PostgresConnectionError, OSError):
            continue
    assert await _pid_lent(lender) != victim
    await lender.close()


async def _pid_lent(lender: db.Lender) -> int:
    async with lender.lend() as conn:
        return await _pid(conn)


async def test_a_closed_lender_refuses_and_the_pool_closes(pool: asyncpg.Pool) -> None:
    lender = db.Lender(pool, 2)
    assert await lender.fetchval("SELECT 1") == 1
    await lender.close()
    with pytest.raises(StorageUnavailableError):
        await lender.fetchval("SELECT 1")
    await asyncio.wait_for(pool.close(), 5)  # nothing is still out


async def test_a_lender_of_size_zero_keeps_nothing_out(pool: asyncpg.Pool) -> None:
    lender = db.Lender(pool, 0)
    assert await lender.fetchval("SELECT 1") == 1
    assert lender.borrowed == 0
    async with pool.acquire() as conn:  # the pool's connection is free again at once
        assert await conn.fetchval("SELECT current_setting('plan_cache_mode')") == "auto"
    await lender.close()


async def test_a_bus_with_a_pool_of_one_still_works(connect: Connect) -> None:
    b = await connect(pool_max_size=1, pool_min_size=1)
    await b.create_topic("t", partitions=1)
    await b.publish("t", b"a")
    async with b.consumer("g", topics=["t"]) as c:
        got = []
        for _ in range(50):
            got += await c.poll(timeout=0.2)
            if got:
                break
        assert [m.payload for m in got] == [b"a"]
        await c.commit()
    async with b.pool.acquire() as conn:
        assert await conn.fetchval("SELECT 1") == 1
