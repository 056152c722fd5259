"""BusBroker's FastStream 0.7 arguments, request/reply, get_one, batches, topics made on first use."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pydantic
import pytest
from faststream import Context
from faststream._internal.context.repository import ContextRepo
from faststream._internal.parser import DefaultCodec
from faststream.middlewares import BaseMiddleware
from faststream.specification import AsyncAPI

import bus
from bus.faststream import BusBroker, BusRouter, TestBusBroker
from tests.faststream.brokers import fast_broker


class Order(msgspec.Struct):
    id: int
    amount: int


class Refund(pydantic.BaseModel):
    id: int
    reason: str


def test_unknown_argument_raises_at_construction() -> None:
    with pytest.raises(bus.ValidationError, match="unknown configuration key"):
        BusBroker(prefetch=10)
    with pytest.raises(bus.ValidationError, match="create_topics"):
        BusBroker(create_topics="yes")  # type: ignore[arg-type]


async def test_struct_and_pydantic_arguments_both_decode_by_default() -> None:
    broker = BusBroker()
    got: list[Any] = []

    @broker.subscriber("orders", group="billing")
    async def orders(order: Order) -> None:
        got.append(order)

    @broker.subscriber("refunds", group="billing")
    async def refunds(refund: Refund) -> None:
        got.append(refund)

    async with TestBusBroker(broker) as br:
        await br.publish(Order(id=1, amount=3), "orders")
        await br.publish({"id": 2, "reason": "late"}, "refunds")
    assert got == [Order(id=1, amount=3), Refund(id=2, reason="late")]


async def test_codec_id_generator_context_and_protocol_are_honoured() -> None:
    encoded: list[Any] = []

    class Noting(DefaultCodec):
        async def encode(self, message: Any, serializer: Any = None) -> tuple[bytes, str | None]:
            encoded.append(message)
            return await super().encode(message, serializer)

    context = ContextRepo()
    context.set_global("tenant", "acme")
    broker = BusBroker(
        codec=Noting(),
        id_generator=lambda: "cid-7",
        context=context,
        protocol="postgres+bus",
        protocol_version="15",
    )
    seen: dict[str, Any] = {}

    @broker.subscriber("orders", group="billing")
    async def handle(body: str, message: Any = Context(), tenant: str = Context()) -> None:  # noqa: B008
        seen.update(cid=message.correlation_id, tenant=tenant, body=body)

    async with TestBusBroker(broker) as br:
        await br.publish("hello", "orders")
    assert seen == {"cid": "cid-7", "tenant": "acme", "body": "hello"}
    assert encoded == ["hello"]
    server = (
        AsyncAPI(broker, schema_version="3.0.0").to_specification().to_jsonable()["servers"]["development"]
    )
    assert (server["protocol"], server["protocolVersion"]) == ("postgres+bus", "15")


async def test_in_memory_refuses_what_the_database_refuses() -> None:
    broker = BusBroker()

    @broker.subscriber("jobs")
    async def work(job: dict[str, int]) -> None: ...

    with pytest.raises(bus.ValidationError, match="needs group"):
        async with TestBusBroker(broker):
            pass
    async with TestBusBroker(broker, topics={"jobs": "queue"}) as br:
        await br.publish({"n": 1}, "jobs")
        work.mock.assert_called_once_with({"n": 1})

    other = BusBroker()

    @other.subscriber("orders", group="billing")
    async def bill(order: dict[str, int]) -> None: ...

    with pytest.raises(bus.TopicNotFoundError):
        async with TestBusBroker(other, topics=["refunds"]):
            pass
    made = BusBroker(create_topics=True)
    made.subscriber("orders", group="billing")(bill)
    async with TestBusBroker(made, topics=["refunds"]) as br:
        await br.publish({"id": 1}, "orders")


async def test_middleware_rewrites_the_message_on_receive() -> None:
    class Upper(BaseMiddleware):
        async def on_receive(self) -> None:
            self.msg = msgspec.structs.replace(self.msg, payload=self.msg.payload.upper())

    broker = BusBroker(middlewares=[Upper])
    got: list[str] = []

    @broker.subscriber("words", group="g")
    async def handle(word: str) -> None:
        got.append(word)

    async with TestBusBroker(broker) as br:
        await br.publish("quiet", "words")
    assert got == ["QUIET"]


async def test_in_memory_request_get_one_and_batch() -> None:
    broker = BusBroker()
    reader = broker.subscriber("events", group="reader")
    batches: list[list[int]] = []

    @broker.subscriber("quotes", group="pricing")
    async def quote(order: Order) -> dict[str, int]:
        return {"id": order.id, "price": order.amount * 10}

    @broker.subscriber("counts", group="g", batch=True)
    async def counts(ns: list[int]) -> None:
        batches.append(ns)

    async with TestBusBroker(broker) as br:
        reply = await br.request(Order(id=1, amount=3), "quotes", timeout=5)
        assert await reply.decode() == {"id": 1, "price": 30}
        await br.publish("e1", "events")
        msg = await reader.get_one(timeout=1)
        assert msg is not None and await msg.decode() == "e1"
        assert await reader.get_one(timeout=0.01) is None
        await br.publish_batch(1, 2, 3, topic="counts")
    assert batches == [[1, 2, 3]]


async def test_broker_router_prefixes_its_subscribers_and_publishers() -> None:
    router = BusRouter(prefix="shop.")
    out = router.publisher("receipts")

    @out
    @router.subscriber("orders", group="billing")
    async def bill(order: dict[str, int]) -> dict[str, int]:
        return {"receipt": order["id"]}

    broker = BusBroker()
    broker.include_router(router)
    async with TestBusBroker(broker) as br:
        await br.publish({"id": 4}, "shop.orders")
        bill.mock.assert_called_once_with({"id": 4})
        out.mock.assert_called_once_with({"receipt": 4})


# -- real ---------------------------------------------------------------------------------------


async def test_request_reply_through_postgres(dsn: str, schema: str, drop_schema: None) -> None:
    broker = fast_broker(dsn, schema, create_topics=True)
    seen: dict[str, str] = {}

    @broker.subscriber("quotes", group="pricing", start="earliest")
    async def quote(order: Order, message: Any = Context()) -> dict[str, int]:  # noqa: B008
        seen.update(message.headers)
        return {"id": order.id, "price": order.amount * 10}

    async with broker:
        await broker.start()
        reply = await broker.request(Order(id=1, amount=3), "quotes", correlation_id="q-1", timeout=10)
        assert await reply.decode() == {"id": 1, "price": 30}
        assert reply.correlation_id == "q-1"
        assert seen["correlation_id"] == "q-1"
        assert seen["reply_to"].startswith("faststream.replies/")
        with pytest.raises(TimeoutError):
            await broker.request("nobody", "silence", timeout=0.2)


async def test_create_topics_get_one_and_iteration_through_postgres(
    dsn: str, schema: str, drop_schema: None
) -> None:
    broker = fast_broker(dsn, schema, create_topics=True)
    reader = broker.subscriber("events", group="reader", start="earliest", partitions=2)
    async with broker:
        await broker.start()
        info = await broker.bus.topic("events")
        assert (info.semantics, info.partitions) == ("pubsub", 2)
        await broker.publish_batch("e1", "e2", topic="events", partition="0")
        await broker.publish("logged", "audit")  # a publish makes its topic too
        assert (await broker.bus.topic("audit")).semantics == "pubsub"
        first = await reader.get_one(timeout=10)
        assert first is not None and await first.decode() == "e1"
        async for msg in reader:
            assert await msg.decode() == "e2"
            break
        assert await reader.get_one(timeout=0.2) is None


async def test_missing_topic_refused_without_create_topics(dsn: str, schema: str, drop_schema: None) -> None:
    broker = fast_broker(dsn, schema)

    @broker.subscriber("orders", group="billing")
    async def bill(order: dict[str, int]) -> None: ...

    async with broker:
        with pytest.raises(bus.TopicNotFoundError):
            await broker.start()
        with pytest.raises(bus.TopicNotFoundError):
            await broker.publish({"id": 1}, "orders")
    await asyncio.sleep(0)
