"""BusBroker as a FastStream user writes it: FastStream's broker test patterns, in memory and real."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import msgspec
import pydantic
from fast_depends.msgspec import MsgSpecSerializer
from faststream import Context, FastStream
from faststream.middlewares import AckPolicy, BaseMiddleware
from faststream.specification import AsyncAPI

import bus
from bus.faststream import BusBroker, TestBusBroker
from tests.faststream.brokers import fast_broker


class Order(pydantic.BaseModel):
    id: int
    amount: int


class OrderStruct(msgspec.Struct):
    id: int
    amount: int


class Refund(pydantic.BaseModel):
    id: int
    reason: str


async def _wait(event: asyncio.Event) -> None:
    await asyncio.wait_for(event.wait(), 10.0)


# -- in memory ----------------------------------------------------------------------------------


async def test_in_memory_routes_to_handlers_decoded_by_annotation() -> None:
    broker = BusBroker()

    @broker.subscriber("orders", group="billing")
    async def billing(order: Refund | dict[str, int]) -> None:
        assert isinstance(order, dict)

    @broker.subscriber("refunds", group="billing")
    async def refunds(refund: Refund) -> None:
        assert isinstance(refund, Refund)

    async with TestBusBroker(broker) as br:
        await br.publish(Order(id=1, amount=3), "orders", key="cust-1")
        billing.mock.assert_called_once_with({"id": 1, "amount": 3})
        await br.publish({"id": 2, "reason": "late"}, "refunds")
        refunds.mock.assert_called_once_with({"id": 2, "reason": "late"})
        refunds.mock.reset_mock()
        await br.publish({"id": 3, "amount": 1}, "orders")
        refunds.mock.assert_not_called()


async def test_msgspec_serializer_decodes_structs() -> None:
    broker = BusBroker(serializer=MsgSpecSerializer())
    got: list[OrderStruct] = []

    @broker.subscriber("orders", group="billing")
    async def billing(order: OrderStruct) -> None:
        got.append(order)

    async with TestBusBroker(broker) as br:
        await br.publish(OrderStruct(id=1, amount=3), "orders")
    assert got == [OrderStruct(id=1, amount=3)]


async def test_in_memory_publisher_decorator_and_groups() -> None:
    broker = BusBroker()
    out = broker.publisher("receipts")

    @out
    @broker.subscriber("orders", group="billing")
    async def bill(order: Order) -> dict[str, int]:
        return {"receipt": order.id}

    @broker.subscriber("orders", group="email")
    async def email(order: Order) -> None: ...

    async with TestBusBroker(broker) as br:
        await br.publish({"id": 7, "amount": 1}, "orders")
        bill.mock.assert_called_once()
        email.mock.assert_called_once()  # every group gets every message
        out.mock.assert_called_once_with({"receipt": 7})


async def test_in_memory_queue_consumers_compete() -> None:
    broker = BusBroker()

    @broker.subscriber("jobs")
    async def first(job: dict[str, int]) -> None: ...

    @broker.subscriber("jobs", title="jobs-2")
    async def second(job: dict[str, int]) -> None: ...

    async with TestBusBroker(broker, topics={"jobs": "queue"}) as br:
        await br.publish({"n": 1}, "jobs")
        assert first.mock.call_count + second.mock.call_count == 1  # one consumer took the job


async def test_in_memory_headers_and_correlation_id_reach_the_handler() -> None:
    broker = BusBroker()
    seen: dict[str, Any] = {}

    @broker.subscriber("audit2", group="g")
    async def audit2(body: str, message: Any = Context()) -> None:  # noqa: B008
        seen["headers"] = message.headers
        seen["cid"] = message.correlation_id
        seen["topic"] = message.raw_message.topic

    async with TestBusBroker(broker) as br:
        await br.publish("x", "audit2", headers={"tenant": "a"}, correlation_id="c-1")
    assert seen["headers"]["tenant"] == "a"
    assert seen["cid"] == "c-1"
    assert seen["topic"] == "audit2"


# -- real ---------------------------------------------------------------------------------------


async def test_with_real_publishes_through_postgres(dsn: str, schema: str, drop_schema: None) -> None:
    broker = fast_broker(dsn, schema)
    got = asyncio.Event()

    @broker.subscriber("orders", group="billing", start="earliest")
    async def billing(order: Order) -> None:
        got.set()

    async with bus.connect(dsn, schema=schema) as b:
        await b.create_topic("orders", partitions=2)
    async with TestBusBroker(broker, with_real=True) as br:
        await br.publish(Order(id=1, amount=3), "orders", key="cust-1")
        await _wait(got)
        billing.mock.assert_called_once_with({"id": 1, "amount": 3})


async def test_real_broker_retries_nacked_and_dead_letters(dsn: str, schema: str, drop_schema: None) -> None:
    broker = fast_broker(dsn, schema)
    attempts: list[int] = []
    done = asyncio.Event()

    @broker.subscriber(
        "orders",
        group="billing",
        start="earliest",
        retry=bus.Retry(max_attempts=2, backoff=0.01),
        dead_letter="orders.dlq",
    )
    async def flaky(order: Order) -> None:
        attempts.append(order.id)
        if order.id == 1:
            raise RuntimeError("always fails")
        done.set()

    async with broker:
        await broker.bus.create_topic("orders", partitions=1)
        await broker.bus.create_topic("orders.dlq", partitions=1)
        await broker.start()
        rec = await broker.publish({"id": 1, "amount": 1}, "orders", key="k")
        await broker.publish({"id": 2, "amount": 1}, "orders", key="k")
        await _wait(done)
        dead = await broker.bus.read("orders.dlq", "0", 0)
    assert rec.offset == 0
    assert attempts == [1, 1, 2]  # retried once, dead-lettered, the partition moved on
    assert [m.value(dict)["id"] for m in dead] == [1]


async def test_real_broker_queue_topic_competing_consumers(dsn: str, schema: str, drop_schema: None) -> None:
    broker = fast_broker(dsn, schema)
    seen: list[int] = []
    all_done = asyncio.Event()

    async def work(job: dict[str, int]) -> None:
        seen.append(job["n"])
        if len(seen) == 6:
            all_done.set()

    broker.subscriber("jobs")(work)
    broker.subscriber("jobs", title="jobs-2")(work)

    async with broker:
        await broker.bus.create_topic("jobs", partitions=1, semantics="queue")
        await broker.start()
        for n in range(6):
            await broker.publish({"n": n}, "jobs")
        await _wait(all_done)
    assert sorted(seen) == list(range(6))  # each job once, across the two consumers


async def test_middlewares_and_ack_first(dsn: str, schema: str, drop_schema: None) -> None:
    calls: list[str] = []

    class Note(BaseMiddleware):
        async def on_receive(self) -> None:
            calls.append("receive")

    broker = fast_broker(dsn, schema, middlewares=[Note])
    done = asyncio.Event()

    @broker.subscriber("orders", group="g", start="earliest", ack_policy=AckPolicy.ACK_FIRST)
    async def h(order: Order) -> None:
        calls.append("handler")
        done.set()
        raise RuntimeError("acked first: not retried")

    async with broker:
        await broker.bus.create_topic("orders", partitions=1)
        await broker.start()
        await broker.publish({"id": 1, "amount": 1}, "orders")
        await _wait(done)
        await asyncio.sleep(0.3)
    assert calls == ["receive", "handler"]  # through the middleware, once: no retry


def test_asyncapi_schema_lists_channels() -> None:
    broker = BusBroker()

    @broker.publisher("receipts")
    @broker.subscriber("orders", group="billing")
    async def bill(order: Order) -> dict[str, int]:
        return {"receipt": order.id}

    schema = AsyncAPI(broker, schema_version="3.0.0").to_specification().to_jsonable()
    channels = schema["channels"]
    assert {name: c["address"] for name, c in channels.items()} == {
        "orders:billing:Bill": "orders",
        "receipts:Publisher": "receipts",
    }
    assert schema["servers"]["development"]["protocol"] == "postgresql"
    assert set(schema["components"]["schemas"]["Order"]["properties"]) == {"id", "amount"}


def test_faststream_docs_gen_writes_the_schema(tmp_path: Any) -> None:
    """`faststream docs gen module:app`, FastStream's own CLI, on a BusBroker app."""
    import subprocess
    import sys

    (tmp_path / "svc.py").write_text(
        "from faststream import FastStream\n"
        "from bus.faststream import BusBroker\n"
        "broker = BusBroker()\n"
        "@broker.subscriber('orders', group='billing')\n"
        "async def bill(order: dict) -> None: ...\n"
        "app = FastStream(broker)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "faststream",
            "docs",
            "gen",
            "svc:app",
            "--out",
            str(tmp_path / "asyncapi.json"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    schema = json.loads((tmp_path / "asyncapi.json").read_text())
    assert [c["address"] for c in schema["channels"].values()] == ["orders"]
    assert FastStream(BusBroker()) is not None
