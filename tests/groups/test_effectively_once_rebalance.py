"""Effectively-once across rebalances, in the loops users write (API.md "Effectively-once, stated exactly").

Each test drives a user's loop: poll, write rows into the user's own table,
commit the offsets in the same transaction (`c.transaction()`, or the
low-level `commit(connection=)` + `rewind()`), while a second member joins
and takes a partition away. The user's table must end with every message
exactly once.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

import bus
from bus.testing import eventually
from tests.helpers import poll_until


@pytest.fixture
async def app(dsn: str) -> AsyncIterator[tuple[asyncpg.Connection, str]]:
    """The service's own connection and a table of its own (in public, PostgreSQL's default search_path)."""
    table = "seen_" + uuid.uuid4().hex[:10]
    conn = await asyncpg.connect(dsn)
    await conn.execute(f"CREATE TABLE {table} (topic text, part text, off bigint)")
    try:
        yield conn, table
    finally:
        await conn.execute(f"DROP TABLE {table}")
        await conn.close()


async def _insert(conn: Any, table: str, batch: list[bus.Message]) -> None:
    """The user's own write: one row per message."""
    await conn.executemany(
        f"INSERT INTO {table} VALUES ($1, $2, $3)", [(m.topic, m.partition, m.offset) for m in batch]
    )


async def _publish(b: bus.Bus, per_partition: int, start: int = 0) -> None:
    for i in range(start, start + per_partition):
        for p in ("0", "1"):
            await b.publish("t", {"i": i}, partition=p)


async def _low_level_unit(
    c: bus.Consumer, conn: asyncpg.Connection, table: str, batch: list[bus.Message]
) -> bool:
    """The README's low-level loop: writes + commit(connection=) in one transaction; rewind on failure."""
    try:
        async with conn.transaction():
            await _insert(conn, table, batch)
            await c.commit(connection=conn)
    except bus.StaleGenerationError:
        await c.rewind()
        return False
    return True


async def _tx_unit(c: bus.Consumer, table: str, n: int) -> bool:
    """The README's safe loop: `async with c.transaction() as tx`."""
    try:
        async with c.transaction() as tx:
            batch = await c.poll(timeout=0.2, max_records=n)
            await _insert(tx.connection, table, batch)
    except bus.StaleGenerationError:
        return False
    return True


async def _drain_into(
    table: str, conn: asyncpg.Connection, consumers: list[bus.Consumer], total: int
) -> None:
    async def done() -> bool:
        for c in consumers:
            batch = await c.poll(timeout=0.05)
            if batch:
                await _low_level_unit(c, conn, table, batch)
        return int(await conn.fetchval(f"SELECT count(DISTINCT (part, off)) FROM {table}")) >= total

    await eventually(done, timeout=20.0, every=0)


async def _exactly_once(conn: asyncpg.Connection, table: str, per_partition: int) -> None:
    rows = await conn.fetch(
        f"SELECT part, off, count(*) AS n FROM {table} GROUP BY part, off ORDER BY part, off"
    )
    dupes = [(r["part"], r["off"], r["n"]) for r in rows if r["n"] != 1]
    assert dupes == [], f"applied more than once: {dupes}"
    assert [(r["part"], r["off"]) for r in rows] == [(p, o) for p in ("0", "1") for o in range(per_partition)]


async def test_a_refused_resend_of_an_already_committed_moved_partition_loses_nothing(
    connect, fast, app
) -> None:
    """The loss found with the README's loop: a transactional commit re-sent a moved partition's old
    position, was refused, and the batch of the partition still owned was never delivered again."""
    conn, table = app
    b = await connect(**fast)
    await b.create_topic("t", partitions=2)
    await _publish(b, 4)
    a = await b.consumer("g", topics=["t"], auto_commit=False).start()
    await eventually(lambda: len(a.assignment()) == 2)
    assert await _low_level_unit(a, conn, table, await poll_until(a, 8))
    b2 = await b.consumer("g", topics=["t"], auto_commit=False).start()
    await eventually(lambda: len(a.assignment()) == 1 and len(b2.assignment()) == 1)
    await _publish(b, 4, start=4)
    kept = next(iter(a.assignment()))
    batch = await poll_until(a, 4)
    assert {m.partition for m in batch} == {kept.partition}
    # Only the kept partition's rows: the moved partition's committed position is not a move.
    assert await _low_level_unit(a, conn, table, batch)
    await _drain_into(table, conn, [a, b2], 16)
    await _exactly_once(conn, table, 8)
    await a.close()
    await b2.close()


@pytest.mark.parametrize("with_on_revoke", [False, True])
async def test_a_partition_that_moved_while_its_batch_was_processed_fails_the_commit(
    connect, fast, app, with_on_revoke: bool
) -> None:
    """A moved partition is never silently left out of commit(connection=), with or without on_revoke."""
    conn, table = app
    b = await connect(**fast)
    await b.create_topic("t", partitions=2)
    await _publish(b, 4)
    revoked: list[Any] = []

    async def on_revoke(tps: set[bus.TopicPartition]) -> None:
        revoked.append(tps)

    a = await b.consumer(
        "g", topics=["t"], auto_commit=False, on_revoke=on_revoke if with_on_revoke else None
    ).start()
    await eventually(lambda: len(a.assignment()) == 2)
    batch = await poll_until(a, 8)
    b2 = await b.consumer("g", topics=["t"], auto_commit=False).start()
    await eventually(lambda: len(a.assignment()) == 1 and len(b2.assignment()) == 1)
    # All 8 rows written, then the commit: refused as a whole, the rows roll back with it.
    assert not await _low_level_unit(a, conn, table, batch)
    assert await conn.fetchval(f"SELECT count(*) FROM {table}") == 0
    assert await b.pool.fetchval("SELECT max(committed) FROM offsets WHERE group_name = 'g'") == 0
    await _drain_into(table, conn, [a, b2], 8)
    await _exactly_once(conn, table, 4)
    assert bool(revoked) == with_on_revoke
    await a.close()
    await b2.close()


async def test_transaction_commits_writes_and_offsets_together_across_a_rebalance(connect, fast, app) -> None:
    conn, table = app
    b = await connect(**fast)
    await b.create_topic("t", partitions=2)
    await _publish(b, 4)
    a = await b.consumer("g", topics=["t"], auto_commit=False).start()
    await eventually(lambda: len(a.assignment()) == 2)
    await poll_until(a, 1)  # fetching is under way
    await a.rewind()
    refused = False
    with pytest.raises(bus.StaleGenerationError):
        async with a.transaction() as tx:
            batch = await poll_until(a, 8)
            await _insert(tx.connection, table, batch)
            b2 = await b.consumer("g", topics=["t"], auto_commit=False).start()
            await eventually(lambda: len(a.assignment()) == 1 and len(b2.assignment()) == 1)
        refused = True
    assert not refused
    # Rolled back: none of the rows, none of the offsets; the partition still owned comes again.
    assert await conn.fetchval(f"SELECT count(*) FROM {table}") == 0
    kept = next(iter(a.assignment()))
    again = await poll_until(a, 4)
    assert sorted(m.offset for m in again if m.partition == kept.partition) == [0, 1, 2, 3]
    await a.rewind()
    for c in (a, b2):
        while not await _tx_unit(c, table, 500):
            pass

    async def all_in() -> bool:
        for c in (a, b2):
            await _tx_unit(c, table, 500)
        return int(await conn.fetchval(f"SELECT count(*) FROM {table}")) >= 8

    await eventually(all_in, every=0)
    await _exactly_once(conn, table, 4)
    committed = await b.pool.fetch("SELECT committed FROM offsets WHERE group_name = 'g'")
    assert sorted(r["committed"] for r in committed) == [4, 4]
    await a.close()
    await b2.close()


async def test_transaction_rolls_back_and_rewinds_on_the_users_own_error(connect, fast, app) -> None:
    conn, table = app
    b = await connect(**fast)
    await b.create_topic("t", partitions=2)
    await _publish(b, 3)
    c = await b.consumer("g", topics=["t"], auto_commit=False).start()
    await eventually(lambda: len(c.assignment()) == 2)
    with pytest.raises(RuntimeError, match="handler failed"):
        async with c.transaction() as tx:
            first = await poll_until(c, 6)
            await _insert(tx.connection, table, first)
            raise RuntimeError("handler failed")
    assert await conn.fetchval(f"SELECT count(*) FROM {table}") == 0
    async with c.transaction() as tx:
        again = await poll_until(c, 6)
        assert sorted((m.partition, m.offset) for m in again) == sorted(
            (m.partition, m.offset) for m in first
        )
        await _insert(tx.connection, table, again)
    await _exactly_once(conn, table, 3)
    committed = await b.pool.fetch("SELECT committed FROM offsets WHERE group_name = 'g'")
    assert sorted(r["committed"] for r in committed) == [3, 3]
    # The connection given to the user saw PostgreSQL's default search_path, not the bus schema.
    async with c.transaction() as tx:
        assert await tx.connection.fetchval("SHOW search_path") == '"$user", public'
    await c.close()


async def test_rewind_delivers_what_was_polled_and_not_committed_again(connect, fast) -> None:
    b = await connect(**fast)
    await b.create_topic("t", partitions=2)
    await _publish(b, 5)
    c = await b.consumer("g", topics=["t"], auto_commit=False).start()
    await eventually(lambda: len(c.assignment()) == 2)
    first = await poll_until(c, 10)
    await c.commit()
    await _publish(b, 5, start=5)
    uncommitted = await poll_until(c, 10)
    await c.rewind()
    again = await poll_until(c, 10)
    assert sorted((m.partition, m.offset) for m in again) == sorted(
        (m.partition, m.offset) for m in uncommitted
    )
    assert not {(m.partition, m.offset) for m in first} & {(m.partition, m.offset) for m in again}
    await c.close()
