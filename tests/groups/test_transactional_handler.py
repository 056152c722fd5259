"""Effectively-once with retries and dead letters: a savepoint per message, attempts kept in the database.

The service's own table (`payments`, in `public`) is what the tests count: each good
message's row exactly once, the poison message dead-lettered once with its error history.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import AsyncIterator

import pytest

import bus
from bus.testing import eventually


@pytest.fixture
async def payments(b: bus.Bus) -> AsyncIterator[str]:
    """The service's own table, outside the bus schema, with no unique constraint (a repeat would show)."""
    name = f"payments_{uuid.uuid4().hex[:10]}"
    await b.pool.execute(f"CREATE TABLE public.{name} (order_id int NOT NULL, amount int NOT NULL)")
    try:
        yield name
    finally:
        await b.pool.execute(f"DROP TABLE IF EXISTS public.{name}")


async def _rows(b: bus.Bus, table: str) -> Counter[int]:
    return Counter(r[0] for r in await b.pool.fetch(f"SELECT order_id FROM public.{table}"))


async def test_a_poison_message_in_a_batch_rolls_back_alone_and_is_dead_lettered_once(
    connect, fast, payments
) -> None:
    b = await connect(**fast)
    await b.create_topic("orders", partitions=1)
    calls: Counter[int] = Counter()

    async def bill(m: bus.Message, tx: bus.Transaction) -> None:
        order = m.value(dict)
        calls[order["id"]] += 1
        # Unqualified: the transaction's connection sees the service's tables.
        await tx.connection.execute(f"INSERT INTO {payments} VALUES ($1, $2)", order["id"], 10)
        await b.publish("receipts", {"id": order["id"]}, connection=tx.connection)
        if order["id"] == 5:
            raise RuntimeError("card declined")

    await b.create_topic("receipts", partitions=1)
    await b.publish_many("orders", [{"id": i} for i in range(10)])  # one fetch holds them all
    sub = await b.subscribe(
        "billing",
        bill,
        topics=["orders"],
        transactional=True,
        retry=bus.Retry(max_attempts=3, backoff=0.01),
        dead_letter="orders.dlq",
    )
    await eventually(lambda: sub.dead_lettered == 1 and sub.processed == 9)
    await sub.stop()

    assert await _rows(b, payments) == Counter({i: 1 for i in range(10) if i != 5})
    # The messages before the poison ran once: its failures rolled back only its own savepoint.
    assert all(calls[i] == 1 for i in range(5)) and calls[5] == 3
    receipts = await b.read("receipts", partition="0")
    assert sorted(m.value(dict)["id"] for m in receipts) == [i for i in range(10) if i != 5]
    (dead,) = await b.read("orders.dlq", partition="0")
    assert dead.value(dict) == {"id": 5}
    h = dead.headers
    assert "card declined" in h["bus.error"] and h["bus.attempts"] == "3" and h["bus.source.offset"] == "5"
    history = json.loads(h["bus.errors"])
    assert [e["attempt"] for e in history] == [1, 2, 3] and all(e["at"] for e in history)
    assert await b.pool.fetchval("SELECT committed FROM offsets WHERE group_name = 'billing'") == 10
    assert await b.pool.fetchval("SELECT count(*) FROM handler_attempts") == 0


async def test_a_handler_that_fails_twice_then_succeeds_is_applied_once(connect, fast, payments) -> None:
    b = await connect(**fast)
    await b.create_topic("orders", partitions=1)
    attempts: list[int] = []

    async def bill(m: bus.Message, tx: bus.Transaction) -> None:
        await tx.connection.execute(f"INSERT INTO {payments} VALUES ($1, 1)", m.value(dict)["id"])
        if m.value(dict)["id"] == 1:
            attempts.append(m.attempt)
            if m.attempt < 3:
                raise ConnectionError("gateway timeout")

    for i in range(3):
        await b.publish("orders", {"id": i})
    sub = await b.subscribe(
        "billing", bill, topics=["orders"], transactional=True, retry=bus.Retry(max_attempts=3, backoff=0.01)
    )
    await eventually(lambda: sub.processed == 3)
    await sub.stop()
    assert attempts == [1, 2, 3]
    assert await _rows(b, payments) == Counter({0: 1, 1: 1, 2: 1})
    assert await b.pool.fetchval("SELECT count(*) FROM handler_attempts") == 0


async def test_the_attempt_count_survives_the_member_that_counted_it(connect, fast, payments) -> None:
    b = await connect(**fast)
    await b.create_topic("orders", partitions=1)
    seen: list[int] = []

    async def bill(m: bus.Message, tx: bus.Transaction) -> None:
        seen.append(m.attempt)
        await tx.connection.execute(f"INSERT INTO {payments} VALUES (1, 1)")
        raise RuntimeError("poison")

    await b.publish("orders", {"id": 1})
    retry = bus.Retry(max_attempts=3, backoff=30.0)  # the second attempt is not due before the stop
    sub = await b.subscribe(
        "billing", bill, topics=["orders"], transactional=True, retry=retry, dead_letter="dlq"
    )
    await eventually(lambda: seen == [1])
    await eventually(
        lambda: b.pool.fetchval("SELECT attempts FROM handler_attempts WHERE group_name = 'billing'"),
    )
    await sub.stop()

    # Another process takes the partition over: it continues the count instead of starting again.
    b2 = await connect(**fast)
    sub2 = await b2.subscribe(
        "billing",
        bill,
        topics=["orders"],
        transactional=True,
        retry=bus.Retry(max_attempts=3, backoff=0.01),
        dead_letter="dlq",
    )
    await eventually(lambda: sub2.dead_lettered == 1)
    await sub2.stop()
    assert seen == [1, 2, 3]
    assert len(await b.read("dlq", partition="0")) == 1
    assert await _rows(b, payments) == Counter()


async def test_without_a_dead_letter_topic_the_partition_stops_at_the_message(
    connect, fast, payments
) -> None:
    b = await connect(**fast)
    await b.create_topic("orders", partitions=1)

    async def bill(m: bus.Message, tx: bus.Transaction) -> None:
        await tx.connection.execute(f"INSERT INTO {payments} VALUES ($1, 1)", m.value(dict)["id"])
        if m.value(dict)["id"] == 2:
            raise ValueError("bad order")

    for i in range(4):
        await b.publish("orders", {"id": i})
    sub = await b.subscribe(
        "billing", bill, topics=["orders"], transactional=True, retry=bus.Retry(max_attempts=2, backoff=0.01)
    )
    await eventually(lambda: sub.has_error.is_set())
    await sub.stop()
    assert any("bad order" in e for e in sub.errors)
    assert await _rows(b, payments) == Counter({0: 1, 1: 1})
    assert await b.pool.fetchval("SELECT committed FROM offsets WHERE group_name = 'billing'") == 2


async def test_poll_style_transaction_with_retries_rolls_back_a_poison_message_alone(
    connect, fast, payments
) -> None:
    b = await connect(**fast)
    await b.create_topic("orders", partitions=1)
    await b.publish_many("orders", [{"id": i} for i in range(6)])
    calls: Counter[int] = Counter()
    attempts: list[int] = []
    retry = bus.Retry(max_attempts=2, backoff=0.01)
    async with b.consumer("billing", topics=["orders"]) as c:
        while True:
            async with c.transaction(retry=retry, dead_letter="orders.dlq") as tx:
                for m in await c.poll(timeout=0.5):
                    async with tx.message(m) as attempt:
                        order = m.value(dict)
                        calls[order["id"]] += 1
                        if order["id"] == 3:
                            attempts.append(attempt)
                        await tx.connection.execute(f"INSERT INTO {payments} VALUES ($1, 1)", order["id"])
                        if order["id"] == 3:
                            raise RuntimeError("card declined")
            if await b.pool.fetchval("SELECT committed FROM offsets WHERE group_name = 'billing'") == 6:
                break
    assert await _rows(b, payments) == Counter({i: 1 for i in range(6) if i != 3})
    assert calls[0] == calls[1] == calls[2] == 1 and attempts == [1, 2]
    (dead,) = await b.read("orders.dlq", partition="0")
    assert dead.headers["bus.attempts"] == "2" and dead.value(dict) == {"id": 3}
