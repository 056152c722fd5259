"""The outbox: `publish(connection=)` and `publish_many(connection=)` in the caller's transaction.

An outbox publish is one statement of the caller's transaction, on the caller's connection
whatever its search_path: no savepoint, no search_path set and put back. A single message with
an idempotency key is one call too (claim, append, fill: migration 032). Being one statement of
the caller's, it fails the caller's transaction as any statement of the caller's would.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

import bus
from storage import idempotency, versions


@pytest.fixture
async def service(dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection of the service's own: PostgreSQL's default search_path, no bus schema on it."""
    conn = await asyncpg.connect(dsn)
    try:
        yield conn
    finally:
        await conn.close()


class Statements:
    """The statements a connection runs, as PostgreSQL receives them (asyncpg's query logger)."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.seen: list[str] = []
        conn.add_query_logger(lambda record: self.seen.append(record.query))

    def during(self) -> list[str]:
        seen, self.seen = self.seen, []
        return seen


async def test_each_outbox_publish_is_one_statement_of_the_callers_transaction(
    b: bus.Bus, service: asyncpg.Connection
) -> None:
    await b.create_topic("orders", partitions=3)
    await b.create_topic("jobs", semantics="queue")

    async def publish_all() -> None:
        await b.publish("orders", {"id": 1}, key="c1", connection=service)
        await b.publish_many("orders", [bus.Outgoing(b"a", partition="1"), b"b"], connection=service)
        await b.publish_many("orders", [bus.Outgoing(b"c", partition="2")] * 3, connection=service)
        await b.publish("jobs", b"now", connection=service)
        await b.publish("jobs", b"later", delay=60, priority=5, connection=service)
        await b.publish("orders", b"keyed", idempotency_key="order-1", connection=service)
        await b.publish("orders", b"again", idempotency_key="order-1", connection=service)
        await b.publish("jobs", b"keyed job", idempotency_key="job-1", delay=60, connection=service)

    # Once first: asyncpg looks up the array types a connection has not met yet, once per connection.
    tx = service.transaction()
    await tx.start()
    await publish_all()
    await tx.rollback()
    statements = Statements(service)
    async with service.transaction():
        await publish_all()
    seen = [s for s in statements.during() if s.strip() not in ("BEGIN;", "COMMIT;")]
    assert len(seen) == 8
    assert not any("SAVEPOINT" in s.upper() or "search_path" in s for s in seen)
    assert all(f'"{b.config.schema}".' in s for s in seen)


async def test_outbox_publishes_of_every_kind_land_from_a_connection_whose_search_path_is_elsewhere(
    b: bus.Bus, service: asyncpg.Connection
) -> None:
    await b.create_topic("orders", partitions=3)
    await b.create_topic("jobs", semantics="queue")
    path = await service.fetchval("SHOW search_path")
    # The service's own tables named as the bus's (temporary ones are looked up first): left alone.
    mine = ("messages", "topics", "queue_jobs", "idempotency_keys")
    for table in mine:
        await service.execute(f"CREATE TEMP TABLE {table} (id int)")
    async with service.transaction():
        one = await b.publish("orders", {"id": 1}, partition="0", headers={"h": "v"}, connection=service)
        spread = await b.publish_many(
            "orders",
            [bus.Outgoing(b"a", partition="1"), bus.Outgoing(b"b", partition="2")],
            connection=service,
        )
        same = await b.publish_many("orders", [bus.Outgoing(b"c", partition="0")] * 2, connection=service)
        keyed = await b.publish("orders", b"k", partition="1", idempotency_key="order-1", connection=service)
        repeat = await b.publish(
            "orders", b"ignored", partition="2", idempotency_key="order-1", connection=service
        )
        batch = await b.publish_many(
            "orders",
            [
                bus.Outgoing(b"m1", partition="2", idempotency_key="m"),
                bus.Outgoing(b"m2", idempotency_key="m"),
            ],
            connection=service,
        )
        await b.publish("jobs", b"now", connection=service)
        await b.publish("jobs", b"later", delay=3600, connection=service)
        await b.publish("jobs", b"keyed later", delay=3600, idempotency_key="job-1", connection=service)
        assert await b.read("orders", partition="0") == []  # nothing visible before the commit
        assert await service.fetchval("SHOW search_path") == path
    for table in mine:
        assert await service.fetchval(f"SELECT count(*) FROM {table}") == 0
    assert (one.partition, one.offset) == ("0", 0)
    assert [(r.partition, r.offset) for r in spread] == [("1", 0), ("2", 0)]
    assert [(r.partition, r.offset) for r in same] == [("0", 1), ("0", 2)]
    assert (keyed.partition, keyed.offset) == ("1", 1)
    assert repeat == keyed  # the original's place, from another partition than the retry asked for
    assert batch[0] == batch[1] and (batch[0].partition, batch[0].offset) == ("2", 1)
    first = (await b.read("orders", partition="0"))[0]
    assert first.value() == {"id": 1} and first.headers == {"h": "v"}
    assert [m.payload for m in await b.read("orders", partition="1")] == [b"a", b"k"]
    assert [m.payload for m in await b.read("orders", partition="2")] == [b"b", b"m1"]
    async with b.queue_consumer("jobs") as q:
        taken = await q.take(max_messages=10, timeout=0)
        assert [m.payload for m in taken] == [b"now"]  # the delayed ones are not due
        await q.ack(taken[0])
    assert await b.publish("jobs", b"retry", idempotency_key="job-1") is not None
    assert len(await b.read("jobs", partition="0", max_messages=10)) == 3  # the retry wrote nothing


async def test_a_rolled_back_outbox_publish_leaves_neither_message_nor_key(
    b: bus.Bus, service: asyncpg.Connection
) -> None:
    await b.create_topic("orders", partitions=1)
    tx = service.transaction()
    await tx.start()
    await b.publish("orders", b"gone", idempotency_key="order-1", connection=service)
    await b.publish("orders", b"gone too", connection=service)
    await tx.rollback()
    assert await idempotency.count_keys(b.pool, "orders") == 0
    kept = await b.publish("orders", b"kept", idempotency_key="order-1", connection=service)
    assert kept.offset == 0  # the rolled-back offsets were never committed: no gap
    assert [m.payload for m in await b.read("orders")] == [b"kept"]


async def test_a_failed_outbox_publish_fails_the_callers_transaction_and_writes_nothing(
    b: bus.Bus, service: asyncpg.Connection
) -> None:
    await b.create_topic("orders", partitions=1)
    await service.execute("CREATE TEMP TABLE app_orders (id int)")
    for key in (None, "order-1"):
        tx = service.transaction(readonly=True)  # a transaction that may not write
        await tx.start()
        with pytest.raises(asyncpg.ReadOnlySQLTransactionError):
            await b.publish("orders", b"x", idempotency_key=key, connection=service)
        # As after any failed statement of its own: the caller's transaction is aborted.
        with pytest.raises(asyncpg.InFailedSQLTransactionError):
            await service.fetchval("SELECT count(*) FROM app_orders")
        await tx.rollback()
    assert await b.read("orders") == []
    assert await idempotency.count_keys(b.pool, "orders") == 0


async def test_an_outbox_publish_of_a_key_waits_for_the_transaction_that_holds_it(
    b: bus.Bus, dsn: str, service: asyncpg.Connection
) -> None:
    await b.create_topic("orders", partitions=2)
    other = await asyncpg.connect(dsn)
    try:
        for outcome in ("commit", "rollback"):
            key = f"order-{outcome}"
            tx = service.transaction()
            await tx.start()
            first = await b.publish(
                "orders", b"first", partition="0", idempotency_key=key, connection=service
            )

            async def retry(key: str = key) -> bus.Record:
                async with other.transaction():
                    return await b.publish(
                        "orders", b"retry", partition="1", idempotency_key=key, connection=other
                    )

            waiting = asyncio.create_task(retry())
            await asyncio.sleep(0.2)
            assert not waiting.done()  # it waits on the key the first transaction claimed
            if outcome == "commit":
                await tx.commit()
                assert await waiting == first
            else:
                await tx.rollback()
                won = await waiting
                assert (won.partition, won.offset) == ("1", 0)
    finally:
        await other.close()
    assert [m.payload for m in await b.read("orders", partition="0")] == [b"first"]
    assert [m.payload for m in await b.read("orders", partition="1")] == [b"retry"]


async def test_while_the_previous_release_may_run_an_outbox_publish_moves_its_counter(
    b: bus.Bus, service: asyncpg.Connection
) -> None:
    await b.pool.execute(versions.WRITE_RELEASE, "0.1.0", "0.1.0")  # a schema that release made
    await b.create_topic("orders", partitions=1)
    async with service.transaction():
        await b.publish("orders", b"a", connection=service)
        await b.publish_many("orders", [b"b", b"c"], connection=service)
        keyed = await b.publish("orders", b"d", idempotency_key="order-1", connection=service)
    assert keyed.offset == 3
    row = await b.pool.fetchrow("SELECT p.next_offset, p.log_end FROM partitions p WHERE p.topic = 'orders'")
    assert tuple(row) == (4, 4)


async def test_a_keyed_outbox_publish_on_a_repeatable_read_snapshot_behind_the_log_fails_and_writes_nothing(
    b: bus.Bus, service: asyncpg.Connection
) -> None:
    await b.create_topic("orders", partitions=1)
    await b.publish("orders", b"first")
    tx = service.transaction(isolation="repeatable_read")
    await tx.start()
    assert await service.fetchval("SELECT 1") == 1  # the transaction's snapshot is taken here
    await b.publish("orders", b"committed after that snapshot")
    with pytest.raises(asyncpg.SerializationError):
        await b.publish("orders", b"from the old snapshot", idempotency_key="order-1", connection=service)
    await tx.rollback()
    assert await idempotency.count_keys(b.pool, "orders") == 0
    async with service.transaction(isolation="repeatable_read"):  # a snapshot not behind: it goes in
        rec = await b.publish("orders", b"repeatable read", idempotency_key="order-1", connection=service)
    assert rec.offset == 2
    assert [m.payload for m in await b.read("orders")] == [
        b"first",
        b"committed after that snapshot",
        b"repeatable read",
    ]
