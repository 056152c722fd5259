"""Stopping a BusBroker: graceful_timeout, StopConsume, subscribers started after the broker."""

from __future__ import annotations

import asyncio

import pytest
from faststream.exceptions import StopConsume

import bus
from bus.faststream import BusBroker, TestBusBroker
from tests.faststream.brokers import fast_broker


async def test_stop_cancels_a_pubsub_handler_after_graceful_timeout(
    dsn: str, schema: str, drop_schema: None
) -> None:
    broker = fast_broker(dsn, schema, graceful_timeout=0.2)
    started = asyncio.Event()
    cancelled = asyncio.Event()

    @broker.subscriber("orders", group="billing", start="earliest", dead_letter="orders.dlq")
    async def slow(order: dict[str, int]) -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async with bus.connect(dsn, schema=schema) as b:
        await b.create_topic("orders", partitions=1)
        await broker.start()
        await broker.publish({"id": 1}, "orders")
        await asyncio.wait_for(started.wait(), 10)
        await asyncio.wait_for(broker.stop(), 10)  # does not wait for the handler's 60 s
        assert cancelled.is_set()
        # Given back uncommitted, not dead-lettered: the group's next member gets it.
        assert await b.list_topics() and "orders.dlq" not in {t.name for t in await b.list_topics()}
        again = fast_broker(dsn, schema)
        got: list[dict[str, int]] = []
        done = asyncio.Event()

        @again.subscriber("orders", group="billing")
        async def handle(order: dict[str, int]) -> None:
            got.append(order)
            done.set()

        async with again:
            await again.start()
            await asyncio.wait_for(done.wait(), 10)
        assert got == [{"id": 1}]


async def test_stop_consume_stops_the_subscriber_and_the_broker_stops(
    dsn: str, schema: str, drop_schema: None
) -> None:
    broker = fast_broker(dsn, schema)
    seen: list[int] = []
    first = asyncio.Event()

    @broker.subscriber("orders", group="billing", start="earliest")
    async def once(order: dict[str, int]) -> None:
        seen.append(order["id"])
        first.set()
        raise StopConsume

    async with bus.connect(dsn, schema=schema) as b:
        await b.create_topic("orders", partitions=1)
        await broker.start()
        await broker.publish({"id": 1}, "orders")
        await asyncio.wait_for(first.wait(), 10)
        await broker.publish({"id": 2}, "orders")
        await asyncio.sleep(0.5)
        await asyncio.wait_for(broker.stop(), 10)
        assert seen == [1]
        # Nothing committed past the message that stopped it: a new member reads both.
        again = fast_broker(dsn, schema)
        got: list[int] = []
        both = asyncio.Event()

        @again.subscriber("orders", group="billing")
        async def handle(order: dict[str, int]) -> None:
            got.append(order["id"])
            if len(got) == 2:
                both.set()

        async with again:
            await again.start()
            await asyncio.wait_for(both.wait(), 10)
        assert got == [1, 2]


async def test_in_memory_subscriber_started_after_the_broker() -> None:
    broker = BusBroker()
    got = asyncio.Event()

    async with TestBusBroker(broker) as br:
        await br.start()
        sub = br.subscriber("orders", group="billing")

        @sub
        async def late(order: dict[str, int]) -> None:
            got.set()

        await sub.start()
        await br.publish({"id": 1}, "orders")
        assert got.is_set()
        await sub.stop()
    with pytest.raises(Exception, match="not connected"):
        _ = broker.bus  # the in-memory connection went with the test client
