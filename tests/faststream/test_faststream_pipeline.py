"""The BusBroker subscriber's pipeline, what it writes, batch subscribers and stopping.

FastStream's steps run in FastStream's order (middlewares in, handler, middlewares out in reverse,
an error a middleware handles goes no further, replies published), and what the bus writes for
them is batched: a queue subscriber acks the jobs of one take in one statement, a pubsub
subscriber's commits are coalesced by its group, a `batch=True` subscriber commits once per batch.
Stopping commits nothing a handler did not see. The write counts are taken by wrapping the storage
functions (the real statements still run).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pydantic
import pytest
from faststream import Context
from faststream.middlewares import AckPolicy, BaseMiddleware

import bus
from bus.faststream import BusBroker, TestBusBroker
from bus.testing import FAST, eventually
from storage import leases
from storage import queues as queue_sql


class Order(pydantic.BaseModel):
    id: int
    amount: int


def _broker(dsn: str, schema: str, **kw: Any) -> BusBroker:
    return BusBroker(dsn, schema=schema, logger=None, **FAST, **kw)


@pytest.fixture
def ack_statements(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every queue ack statement sent (the number of jobs in it), in order."""
    sent: list[int] = []
    real = queue_sql.ack_many

    async def counting(conn: Any, jobs: list[tuple[int, int, int]], range_leases: Any = ()) -> Any:
        sent.append(len(jobs))
        return await real(conn, jobs, range_leases)

    monkeypatch.setattr(queue_sql, "ack_many", counting)
    return sent


@pytest.fixture
def commit_statements(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The group of every pubsub commit statement sent, in order."""
    sent: list[str] = []
    real = leases.commit

    async def counting(conn: Any, group: str, member_id: str, entries: Any, now: Any = None) -> Any:
        sent.append(group)
        return await real(conn, group, member_id, entries, now)

    monkeypatch.setattr(leases, "commit", counting)
    return sent


async def _left_on_queue(dsn: str, schema: str, topic: str) -> list[bus.Message]:
    async with bus.connect(dsn, schema=schema, **FAST) as b, b.queue_consumer(topic) as q:
        return await q.take(max_messages=100, timeout=0.2)


# -- queue topics -------------------------------------------------------------------------------


async def test_queue_subscriber_acks_each_take_in_one_statement(
    dsn: str, schema: str, drop_schema: None, ack_statements: list[int]
) -> None:
    broker = _broker(dsn, schema)
    seen: list[int] = []

    @broker.subscriber("jobs")
    async def work(job: dict[str, int]) -> None:
        seen.append(job["n"])

    async with broker:
        await broker.bus.create_topic("jobs", partitions=1, semantics="queue")
        await broker.bus.publish_many("jobs", [{"n": n} for n in range(30)])
        await broker.start()
        await eventually(lambda: sum(ack_statements) == 30)
    assert sorted(seen) == list(range(30))
    # Three takes of ten: an ack statement per take, not per job.
    assert len(ack_statements) <= 4, ack_statements
    assert await _left_on_queue(dsn, schema, "jobs") == []


async def test_queue_subscriber_nacked_job_comes_back_while_the_others_are_acked(
    dsn: str, schema: str, drop_schema: None
) -> None:
    broker = _broker(dsn, schema)
    seen: list[int] = []

    @broker.subscriber("jobs", retry=bus.Retry(max_attempts=3))
    async def work(job: dict[str, int], message: Any = Context()) -> None:  # noqa: B008
        seen.append(job["n"])
        if job["n"] == 2 and message.raw_message.attempt == 1:
            raise RuntimeError("first attempt fails: nacked, taken again")

    async with broker:
        await broker.bus.create_topic("jobs", partitions=1, semantics="queue")
        await broker.bus.publish_many("jobs", [{"n": n} for n in range(5)])
        await broker.start()
        await eventually(lambda: len(seen) == 6)
    assert sorted(seen) == [0, 1, 2, 2, 3, 4]
    assert await _left_on_queue(dsn, schema, "jobs") == []


async def test_queue_subscriber_ack_first_writes_each_ack_before_its_handler(
    dsn: str, schema: str, drop_schema: None, ack_statements: list[int]
) -> None:
    broker = _broker(dsn, schema)
    acked_before: list[int] = []

    @broker.subscriber("jobs", ack_policy=AckPolicy.ACK_FIRST)
    async def work(job: dict[str, int]) -> None:
        acked_before.append(sum(ack_statements))
        raise RuntimeError("acked first: not retried")

    async with broker:
        await broker.bus.create_topic("jobs", partitions=1, semantics="queue")
        await broker.bus.publish_many("jobs", [{"n": n} for n in range(3)])
        await broker.start()
        await eventually(lambda: len(acked_before) == 3)
        await asyncio.sleep(0.3)
    assert acked_before == [1, 2, 3]  # each job's ack written before its handler ran, none retried
    assert await _left_on_queue(dsn, schema, "jobs") == []


async def test_queue_subscriber_stopping_acks_what_it_handled(
    dsn: str, schema: str, drop_schema: None
) -> None:
    broker = _broker(dsn, schema)
    seen: list[int] = []
    done = asyncio.Event()

    @broker.subscriber("jobs")
    async def work(job: dict[str, int]) -> None:
        seen.append(job["n"])
        if len(seen) == 4:
            done.set()

    async with broker:
        await broker.bus.create_topic("jobs", partitions=1, semantics="queue")
        await broker.bus.publish_many("jobs", [{"n": n} for n in range(4)])
        await broker.start()
        await asyncio.wait_for(done.wait(), 10)
    # Stopped right after the last handler: every job it handled is acked, none given back.
    assert await _left_on_queue(dsn, schema, "jobs") == []
    assert sorted(seen) == [0, 1, 2, 3]


# -- pubsub topics ------------------------------------------------------------------------------


async def test_pubsub_subscriber_commits_are_coalesced(
    dsn: str, schema: str, drop_schema: None, commit_statements: list[str]
) -> None:
    broker = _broker(dsn, schema)
    count = [0]

    @broker.subscriber("orders", group="billing", start="earliest")
    async def bill(order: Order) -> None:
        count[0] += 1

    async with broker:
        await broker.bus.create_topic("orders", partitions=1)
        await broker.bus.publish_many("orders", [{"id": i, "amount": 1} for i in range(300)])
        await broker.start()
        await eventually(lambda: count[0] == 300)
    # Committed after the handlers, a commit per batch at most, never one per message.
    assert 1 <= commit_statements.count("billing") <= 10, commit_statements
    async with bus.connect(dsn, schema=schema, **FAST) as b:
        described = await b.admin.describe_group("billing")
    assert described.total_lag == 0  # every message committed once the subscriber stopped


async def test_middlewares_nest_and_an_error_one_handles_is_not_retried(
    dsn: str, schema: str, drop_schema: None
) -> None:
    calls: list[str] = []

    class Outer(BaseMiddleware):
        async def on_receive(self) -> None:
            calls.append("outer in")

        async def after_processed(
            self, exc_type: Any = None, exc_val: Any = None, exc_tb: Any = None
        ) -> bool:
            calls.append(f"outer out {exc_type.__name__ if exc_type else None}")
            return False

    class Swallow(BaseMiddleware):
        async def on_receive(self) -> None:
            calls.append("swallow in")

        async def consume_scope(self, call_next: Any, msg: Any) -> Any:
            calls.append("swallow scope")
            return await call_next(msg)

        async def after_processed(
            self, exc_type: Any = None, exc_val: Any = None, exc_tb: Any = None
        ) -> bool:
            calls.append(f"swallow out {exc_type.__name__ if exc_type else None}")
            return True  # handled: the error goes no further out

    broker = _broker(dsn, schema, middlewares=[Outer, Swallow])
    done = asyncio.Event()

    @broker.subscriber("orders", group="g", start="earliest", retry=bus.Retry(max_attempts=3, backoff=0.01))
    async def h(order: Order) -> None:
        calls.append("handler")
        done.set()
        raise RuntimeError("handled by Swallow")

    async with broker:
        await broker.bus.create_topic("orders", partitions=1)
        await broker.start()
        await broker.publish({"id": 1, "amount": 1}, "orders")
        await asyncio.wait_for(done.wait(), 10)
        await asyncio.sleep(0.3)
    assert calls == [
        "outer in",
        "swallow in",
        "swallow scope",
        "handler",
        "swallow out RuntimeError",
        "outer out None",  # the error stopped at Swallow: acked, committed, not retried
    ]


async def test_a_logger_gets_the_access_log_and_the_handlers_error_and_middlewares_see_the_message(
    dsn: str, schema: str, drop_schema: None
) -> None:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger(f"test.faststream.{schema}")
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    seen_on_exit: list[Any] = []

    class Watch(BaseMiddleware):
        async def after_processed(
            self, exc_type: Any = None, exc_val: Any = None, exc_tb: Any = None
        ) -> bool:
            # The message's context scope lasts until the middlewares are left.
            seen_on_exit.append(self.context.get_local("message").message_id)
            return False

    attempts: list[int] = []
    logged = BusBroker(dsn, schema=schema, logger=logger, middlewares=[Watch], **FAST)
    silent = _broker(dsn, schema, middlewares=[Watch])
    for broker, group in ((logged, "logged"), (silent, "silent")):

        @broker.subscriber(
            "orders", group=group, start="earliest", retry=bus.Retry(max_attempts=2, backoff=0.01)
        )
        async def h(order: Order) -> None:
            attempts.append(order.id)
            if len(attempts) % 2:
                raise RuntimeError(f"boom {order.id}")

    async with bus.connect(dsn, schema=schema, **FAST) as b:
        await b.create_topic("orders", partitions=1)
        await b.publish("orders", {"id": 1, "amount": 1})
    for broker in (logged, silent):
        async with broker:
            await broker.start()
            wanted = len(attempts) + 2  # failed, retried, handled
            await eventually(lambda: len(attempts) >= wanted)  # noqa: B023 - awaited right here
    assert attempts == [1, 1, 1, 1]
    assert seen_on_exit == ["orders/0@0"] * 4
    messages = [(r.levelno, r.getMessage()) for r in records]
    # FastStream's access log and its error line, from the broker with a logger only.
    assert (logging.ERROR, "RuntimeError: boom 1") in messages
    assert [m for level, m in messages if level == logging.INFO].count("Received") == 2
    assert [m for level, m in messages if level == logging.INFO].count("Processed") == 2


async def test_reply_to_gets_the_result_with_the_correlation_id(
    dsn: str, schema: str, drop_schema: None
) -> None:
    broker = _broker(dsn, schema)

    @broker.subscriber("orders", group="g", start="earliest")
    async def h(order: Order) -> dict[str, int]:
        return {"receipt": order.id}

    async with broker:
        await broker.bus.create_topic("orders", partitions=1)
        await broker.bus.create_topic("replies", partitions=1)
        await broker.start()
        await broker.publish({"id": 7, "amount": 1}, "orders", reply_to="replies", correlation_id="c-7")
        replies: list[bus.Message] = []

        async def replied() -> bool:
            replies[:] = await broker.bus.read("replies", "0", 0)
            return bool(replies)

        await eventually(replied)
    assert replies[0].value(dict) == {"receipt": 7}
    assert replies[0].headers["correlation_id"] == "c-7"


async def test_a_message_without_a_correlation_id_is_its_own(
    dsn: str, schema: str, drop_schema: None
) -> None:
    broker = _broker(dsn, schema)
    seen: list[tuple[str, str | None]] = []

    @broker.subscriber("orders", group="g", start="earliest")
    async def h(order: Order, message: Any = Context()) -> None:  # noqa: B008
        seen.append((message.message_id, message.correlation_id))

    async with broker:
        await broker.bus.create_topic("orders", partitions=1)
        await broker.bus.publish("orders", {"id": 1, "amount": 1})  # the bus's own publish: no header
        await broker.start()
        await eventually(lambda: bool(seen))
    assert seen == [("orders/0@0", "orders/0@0")]


# -- batch subscribers --------------------------------------------------------------------------


async def test_in_memory_batch_subscriber_gets_a_list() -> None:
    broker = BusBroker()

    @broker.subscriber("orders", group="billing", batch=True)
    async def bill(orders: list[Order]) -> None:
        assert all(isinstance(o, Order) for o in orders)

    async with TestBusBroker(broker) as br:
        await br.publish({"id": 1, "amount": 3}, "orders")
        bill.mock.assert_called_once_with([{"id": 1, "amount": 3}])


def test_batch_subscriber_refuses_bad_max_records() -> None:
    broker = BusBroker()
    with pytest.raises(bus.ValidationError, match="max_records"):
        broker.subscriber("orders", group="g", batch=True, max_records=0)
    assert broker.subscribers == []  # nothing registered


async def test_batch_subscriber_handles_each_message_once_and_commits_after_the_handler(
    dsn: str, schema: str, drop_schema: None
) -> None:
    broker = _broker(dsn, schema)
    batches: list[list[int]] = []

    @broker.subscriber("orders", group="billing", start="earliest", batch=True, max_records=50)
    async def bill(orders: list[Order]) -> None:
        batches.append([o.id for o in orders])

    async with broker:
        await broker.bus.create_topic("orders", partitions=2)
        await broker.bus.publish_many("orders", [{"id": i, "amount": 1} for i in range(200)])
        await broker.start()
        await eventually(lambda: sum(map(len, batches)) >= 200)
    assert sorted(i for b in batches for i in b) == list(range(200))  # each once
    assert all(len(b) <= 50 for b in batches)
    assert len(batches) < 200  # handed over in batches
    async with bus.connect(dsn, schema=schema, **FAST) as b:
        described = await b.admin.describe_group("billing")
    assert described.total_lag == 0  # committed after the handler


async def test_batch_subscriber_retries_a_nacked_batch_then_dead_letters_it(
    dsn: str, schema: str, drop_schema: None
) -> None:
    broker = _broker(dsn, schema)
    calls: list[list[int]] = []

    @broker.subscriber(
        "orders",
        group="billing",
        start="earliest",
        batch=True,
        retry=bus.Retry(max_attempts=2, backoff=0.01),
        dead_letter="orders.dlq",
    )
    async def bill(orders: list[Order]) -> None:
        calls.append([o.id for o in orders])
        if any(o.id == 1 for o in orders):
            raise RuntimeError("a bad order in the batch")

    async with broker:
        await broker.bus.create_topic("orders", partitions=1)
        await broker.bus.create_topic("orders.dlq", partitions=1)
        await broker.bus.publish_many("orders", [{"id": i, "amount": 1} for i in range(3)])
        await broker.start()
        dead: list[bus.Message] = []

        async def dead_lettered() -> bool:
            dead[:] = await broker.bus.read("orders.dlq", "0", 0)
            return len(dead) == 3

        await eventually(dead_lettered)
        await asyncio.sleep(0.2)
        await broker.publish({"id": 5, "amount": 1}, "orders")
        await eventually(lambda: calls[-1] == [5])
    assert calls[:2] == [[0, 1, 2], [0, 1, 2]]  # the batch twice (max_attempts=2), then dead-lettered
    assert [m.value(dict)["id"] for m in dead] == [0, 1, 2]
    assert dead[0].headers["bus.attempts"] == "2"
    assert dead[0].headers["bus.source.topic"] == "orders"


async def test_batch_subscriber_on_a_queue_topic_is_refused(dsn: str, schema: str, drop_schema: None) -> None:
    broker = _broker(dsn, schema)

    @broker.subscriber("jobs", batch=True)
    async def work(jobs: list[dict[str, int]]) -> None: ...

    async with broker:
        await broker.bus.create_topic("jobs", partitions=1, semantics="queue")
        with pytest.raises(bus.ValidationError, match="queue"):
            await broker.start()


@pytest.mark.parametrize("batch", [False, True])
async def test_stopping_commits_only_what_the_handler_saw(
    dsn: str, schema: str, drop_schema: None, batch: bool
) -> None:
    broker = _broker(dsn, schema)
    seen: list[int] = []

    if batch:

        @broker.subscriber("orders", group="billing", start="earliest", batch=True, max_records=20)
        async def bill_many(orders: list[Order], message: Any = Context()) -> None:  # noqa: B008
            seen.extend(m.offset for m in message.raw_message)
            await asyncio.sleep(0.05)
    else:

        @broker.subscriber("orders", group="billing", start="earliest")
        async def bill(order: Order, message: Any = Context()) -> None:  # noqa: B008
            seen.append(message.raw_message.offset)
            await asyncio.sleep(0.002)

    async with broker:
        await broker.bus.create_topic("orders", partitions=1)
        await broker.bus.publish_many("orders", [{"id": i, "amount": 1} for i in range(300)])
        await broker.start()
        await eventually(lambda: len(seen) >= 10, every=0.001)
    # Stopped in the middle of what it fetched: whatever it committed, its handler handled.
    async with bus.connect(dsn, schema=schema, **FAST) as b:
        (partition,) = (await b.admin.describe_group("billing")).partitions
    assert partition.committed is not None
    assert sorted(seen) == list(range(partition.committed))


async def test_with_real_batch_subscriber_gets_what_is_published_and_publishes_its_result(
    dsn: str, schema: str, drop_schema: None
) -> None:
    broker = _broker(dsn, schema)
    batches: list[list[Order]] = []

    @broker.subscriber("orders", group="billing", start="earliest", batch=True, max_records=50)
    @broker.publisher("totals")
    async def bill(orders: list[Order]) -> int:
        batches.append(orders)
        return sum(o.amount for o in orders)

    async with bus.connect(dsn, schema=schema, **FAST) as b:
        await b.create_topic("orders", partitions=1)
        await b.create_topic("totals", partitions=1)
    totals = broker.publishers[0]
    async with TestBusBroker(broker, with_real=True) as br:
        for i in range(3):
            await br.publish(Order(id=i, amount=i + 1), "orders", key="cust-1")
        await eventually(lambda: sum(map(len, batches)) >= 3)
        # Each message once, in order, decoded by the annotation.
        assert [o for b in batches for o in b] == [Order(id=i, amount=i + 1) for i in range(3)]
        # FastStream's handler mock sees each batch as the bodies it decoded.
        assert [c.args[0] for c in bill.mock.call_args_list] == [[o.model_dump() for o in b] for b in batches]
        # Each batch's result went through Postgres to the publisher's topic (read back by the
        # subscriber TestBusBroker starts there for the publisher's mock).
        await eventually(lambda: totals.mock.call_count >= len(batches))
        assert sorted(c.args[0] for c in totals.mock.call_args_list) == sorted(
            sum(o.amount for o in b) for b in batches
        )
    async with bus.connect(dsn, schema=schema, **FAST) as b:
        described = await b.admin.describe_group("billing")
        assert described.total_lag == 0  # committed after the handler
        stored = [m.value(int) for m in await b.read("totals", partition="0", offset=0)]
    assert sorted(stored) == sorted(sum(o.amount for o in b) for b in batches)
