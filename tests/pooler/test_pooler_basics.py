"""The bus through PgBouncer in transaction mode: no session state, the schema in every transaction."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

import bus
from bus.errors import StorageUnavailableError


async def test_connect_without_pooler_to_a_transaction_pooler_names_pooler(
    bouncer_dsn: str, schema: str
) -> None:
    with pytest.raises(StorageUnavailableError, match="pooler="):
        await bus.connect(bouncer_dsn, schema=schema)


async def test_a_bad_pooler_value_is_refused(bouncer_dsn: str, schema: str) -> None:
    with pytest.raises(bus.errors.ValidationError, match="pooler"):
        await bus.connect(bouncer_dsn, schema=schema, pooler="statement")


async def test_publish_and_read_through_the_pooler_leave_no_session_state(
    pooled: Any, bouncer_dsn: str, schema: str
) -> None:
    b = await pooled()
    await b.create_topic("orders", partitions=3)
    recs = [await b.publish("orders", {"i": i}, key=f"k{i % 5}") for i in range(30)]
    await b.publish_many("orders", [bus.Outgoing({"i": i}, partition="1") for i in range(30, 40)])
    got = [m for p in ("0", "1", "2") for m in await b.read("orders", partition=p, max_messages=100)]
    assert sorted(m.value(dict)["i"] for m in got) == list(range(40))
    for p in ("0", "1", "2"):  # dense offsets per partition
        offsets = [m.offset for m in got if m.partition == p]
        assert offsets == list(range(len(offsets)))
    assert {r.topic for r in recs} == {"orders"}
    # The pooler's server connections keep no bus search_path: a plain session through it sees none.
    conn = await asyncpg.connect(bouncer_dsn, statement_cache_size=0)
    try:
        for _ in range(5):
            assert schema not in await conn.fetchval("SELECT current_setting('search_path')")
    finally:
        await conn.close()


async def test_the_outbox_publishes_inside_the_callers_transaction_through_the_pooler(pooled: Any) -> None:
    b = await pooled()
    await b.create_topic("orders", partitions=1)
    async with b.pool.acquire() as conn:
        async with conn.transaction():
            await b.publish("orders", {"kept": True}, connection=conn)
        tx = conn.transaction()
        await tx.start()
        await b.publish("orders", {"kept": False}, connection=conn)
        await tx.rollback()
    msgs = await b.read("orders", partition="0")
    assert [m.value(dict) for m in msgs] == [{"kept": True}]


async def test_idempotent_publishing_through_the_pooler(pooled: Any) -> None:
    b = await pooled()
    await b.create_topic("orders", partitions=2, dedupe_window=60)
    first = await b.publish("orders", {"n": 1}, key="a", idempotency_key="order-1")
    again = await b.publish("orders", {"n": 1}, key="a", idempotency_key="order-1")
    assert (again.partition, again.offset) == (first.partition, first.offset)
    assert len(await b.read("orders", partition=first.partition)) == 1


@pytest.mark.parametrize("direct", [False, True], ids=["polling", "listen-direct"])
async def test_a_subscription_and_a_queue_get_work_through_the_pooler(pooled: Any, direct: bool) -> None:
    b = await pooled(direct=direct)
    await b.create_topic("orders", partitions=2)
    await b.create_topic("jobs", partitions=2, semantics="queue")
    seen: list[int] = []

    async def handle(m: bus.Message) -> None:
        seen.append(m.value(dict)["i"])

    sub = await b.subscribe("audit", handle, topics=["orders"], start="earliest")
    try:
        for i in range(20):
            await b.publish("orders", {"i": i}, key=str(i))
        await bus.testing.eventually(lambda: sorted(seen) == list(range(20)), timeout=10)
    finally:
        await sub.stop()
    for i in range(10):
        await b.publish("jobs", {"i": i})
    done: list[int] = []
    async with b.queue_consumer("jobs", visibility_timeout=10) as q:
        while len(done) < 10:
            jobs = await q.take(max_messages=4, timeout=2.0)
            assert jobs, "the queue handed out nothing through the pooler"
            for job in jobs:
                done.append(job.value(dict)["i"])
                await q.ack(job)
    assert sorted(done) == list(range(10))
