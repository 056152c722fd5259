"""FastStream and SQL publishing: what the FastStream broker and the SQL `publish` cost over the bus's own calls.

Rows, each next to its baseline measured in the same run on the same schema:

FastStream's access log (a line per message received and processed) is off (`logger=None`): both
sides measure delivery, not a log handler. The msg/s rows carry, in their `extra`, this process's
processor time per message on each side (`cpu_us_per_msg`, `baseline_cpu_us_per_msg`): what a
side costs whatever else the machine runs.

* throughput: M messages already on a topic of 4 partitions, drained by a FastStream subscriber
  (`BusBroker`, a consumer group) and by the bus's own `subscribe` (another group), handlers that
  only count; msg/s, higher is better. Target >= 0.8x.
* batch throughput: the same, drained by a FastStream `batch=True` subscriber (the handler takes
  `list[dict]`, one pipeline run and one commit per batch) against the same `subscribe` run.
  Target >= 0.8x.
* FastStream's ceiling: the most a per-message FastStream subscriber can drain whatever its broker:
  FastStream's own per-message pipeline (`SubscriberUsecase.process_message`: its scope, the
  acknowledgement and logging middlewares, fast-depends calling the handler, the ack), unchanged,
  handed M bodies already parsed and decoded, no broker I/O; msg/s against the same `subscribe`
  runs timed from the first message handled to the last (no group to join on either side: the
  ratio a long drain tends to). Every broker adds its parsing and its delivery to that, so below
  0.8x the per-message throughput target is out of reach for every FastStream broker.
* stock RedisBroker subscriber, no I/O: a subscriber of FastStream's own RedisBroker, started without
  a server, handed M messages in its wire format (`consume`, as its reader loop does). A row that
  shows a stock broker's per-message cost (needs the redis client: the bench extra).
* BusBroker subscriber pipeline, no I/O: a BusBroker subscriber fed M bus Messages in memory (what
  the group's worker calls per message): the broker's own pipeline without the bus underneath.
  Both against the same first-to-last `subscribe` runs.
* queue throughput: J jobs on a queue topic, drained by a FastStream subscriber (competing
  consumers, ten jobs a take, the acks of a take in one statement) and by the bus's own
  `queue_consumer` loop (`take(10)`, `ack_many`), each side on its own topic; msg/s, higher is
  better (no target: a row that shows the cost).
* publish->handler latency: messages published one at a time, paced, by `broker.publish` to a
  FastStream subscriber and by `b.publish` to a `subscribe` handler (both at once, alternating, on
  two topics); the p50 of handler time minus publish time (`time.time()` in one process).
  Target <= 1.3x.
* subscriber against FastStream's ceiling: the FastStream subscriber throughput row's rate against
  the ceiling row's, both from this run: how much of FastStream's own per-message ceiling the real
  subscriber (parsing, delivery, commits included) reaches (no target: a row that shows the cost).
* request/reply round trip p50 and p99: one request at a time, `broker.request` to a subscriber
  that returns the body (the reply read from the broker's partition of faststream.replies on its
  wake-up), against the same loop written on the bus (`b.publish`, a `subscribe` handler that
  `b.publish`es the reply to a reply topic, the requester's consumer `poll`ing it); ms, lower is
  better (no target).
* get_one p50: publish one message, then `get_one` it from a subscriber without a handler (a group
  member; it commits past the message) against a consumer that `poll`s and commits; ms, lower is
  better (no target).
* SQL publish: one message per call, one after the other, `SELECT publish(...)` on one connection
  against `b.publish`; the mean microseconds per message, lower is better (no target: a row that
  shows the cost).

Run it alone with `bus bench faststream`.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import suppress
from datetime import UTC, datetime
from typing import Any

import asyncpg
from faststream._internal.endpoint.subscriber import SubscriberUsecase
from faststream.message import StreamMessage

import bus
from benchmarks.result import Result
from bus.faststream import BusBroker
from bus.types import Message

SCENARIO = "faststream"
TOPIC = "bench.fs"
PARTITIONS = 4
FAST = {"heartbeat_interval": 0.2, "session_timeout": 1.5, "rebalance_delay": 0.05, "cleaner_interval": 0}


async def _until(check: Callable[[], bool], timeout: float) -> None:  # noqa: ASYNC109 - a bench's bound
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("the handlers did not get every message")
        await asyncio.sleep(0.005)


class _Clock:
    """A drain's msg/s and this process's processor time per message (µs), from `start()` on."""

    def start(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def stop(self, messages: int) -> tuple[float, float]:
        wall, cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu
        return messages / wall, cpu / messages * 1e6


def _best(runs: list[tuple[float, float]]) -> tuple[float, float]:
    """The best rate and the least processor time per message of alternated runs."""
    return max(r for r, _ in runs), min(c for _, c in runs)


def _cpu(value: tuple[float, float], baseline: tuple[float, float]) -> dict[str, float]:
    return {"cpu_us_per_msg": round(value[1], 1), "baseline_cpu_us_per_msg": round(baseline[1], 1)}


async def _throughput(
    dsn: str, schema: str, b: bus.Bus, messages: int
) -> tuple[tuple[float, float], tuple[float, float], tuple[float, float], tuple[float, float]]:
    """(FastStream, FastStream batch, subscribe, subscribe from its first message to its last)
    draining the same `messages`: each (msg/s, CPU µs/msg)."""
    for first in range(0, messages, 1000):
        await b.publish_many(TOPIC, [{"i": i} for i in range(first, min(first + 1000, messages))])

    async def faststream_side(group: str) -> tuple[float, float]:
        broker = BusBroker(dsn, schema=schema, logger=None, **FAST)
        count = [0]

        @broker.subscriber(TOPIC, group=group, start="earliest")
        async def handle(body: dict[str, int]) -> None:
            count[0] += 1

        return await _drain(broker, count)

    async def faststream_batch_side(group: str) -> tuple[float, float]:
        broker = BusBroker(dsn, schema=schema, logger=None, **FAST)
        count = [0]

        @broker.subscriber(TOPIC, group=group, start="earliest", batch=True)
        async def handle(bodies: list[dict[str, int]]) -> None:
            count[0] += len(bodies)

        return await _drain(broker, count)

    async def _drain(broker: BusBroker, count: list[int]) -> tuple[float, float]:
        clock = _Clock()
        async with broker:
            clock.start()  # from the group's start, as the subscribe side
            await broker.start()
            await _until(lambda: count[0] >= messages, 300)
            measured = clock.stop(messages)
        return measured

    async def bus_side(group: str) -> tuple[tuple[float, float], tuple[float, float]]:
        count = [0]
        clock, steady = _Clock(), _Clock()

        async def handle(m: bus.Message) -> None:
            if not count[0]:
                steady.start()  # the group has joined and fetched: delivery alone from here
            m.value(dict)
            count[0] += 1

        clock.start()
        sub = await b.subscribe(group, handle, topics=[TOPIC], start="earliest")
        try:
            await _until(lambda: count[0] >= messages, 300)
            measured, measured_steady = clock.stop(messages), steady.stop(messages - 1)
        finally:
            await sub.stop()
        return measured, measured_steady

    # Alternate the sides so none gets only the warmer cache.
    fs: list[tuple[float, float]] = []
    fs_batch: list[tuple[float, float]] = []
    own: list[tuple[float, float]] = []
    own_steady: list[tuple[float, float]] = []
    for n in range(2):
        measured, measured_steady = await bus_side(f"own-{n}")
        own.append(measured)
        own_steady.append(measured_steady)
        fs.append(await faststream_side(f"fs-{n}"))
        fs_batch.append(await faststream_batch_side(f"fs-batch-{n}"))
    return _best(fs), _best(fs_batch), _best(own), _best(own_steady)


async def _offline(broker: Any) -> Any:
    """The broker's only subscriber, started as the broker starts it, without connecting anywhere."""
    broker._setup_logger()  # what `connect()` sets up once connected
    (sub,) = broker.subscribers
    await SubscriberUsecase.start(sub)  # FastStream's own start: the handler's model, the lock
    sub._post_start()
    return sub


async def _ceiling(
    messages: int,
) -> tuple[tuple[float, float], tuple[float, float] | None, tuple[float, float]]:
    """Per-message FastStream subscribers with no broker I/O, each handed `messages` in memory: each
    (msg/s, CPU µs/msg).

    (FastStream's core pipeline with parsing and decoding free; a stock RedisBroker subscriber, None
    without the redis client; a BusBroker subscriber.)
    """

    def counting(broker: Any, **options: Any) -> list[int]:
        count = [0]

        @broker.subscriber(TOPIC, **options)
        async def handle(body: dict[str, int]) -> None:
            count[0] += 1

        return count

    async def drain(count: list[int], raw: list[Any], deliver: Callable[[Any], Any]) -> tuple[float, float]:
        clock = _Clock()
        clock.start()
        for m in raw:
            await deliver(m)
        measured = clock.stop(len(raw))
        if count[0] != len(raw):
            raise RuntimeError(f"the subscriber handled {count[0]} of {len(raw)}")
        return measured

    async def core_side() -> tuple[float, float]:
        # FastStream's own `SubscriberUsecase.process_message` (its scope, middlewares, call, ack),
        # unchanged, on a subscriber whose parser and decoder hand over bodies already decoded: what
        # every FastStream broker pays per message before any parsing or delivery of its own.
        async def parse(raw: dict[str, int]) -> StreamMessage[Any]:
            return StreamMessage(raw_message=raw, body=raw, correlation_id="c", message_id="m")

        async def decode(msg: StreamMessage[Any]) -> Any:
            return msg.body

        broker = BusBroker(logger=None)
        count = counting(broker, group="ceiling", parser=parse, decoder=decode)
        sub = await _offline(broker)

        async def deliver(raw: dict[str, int]) -> None:
            with suppress(Exception):  # as `consume`, which would run the broker's own pipeline
                await SubscriberUsecase.process_message(sub, raw)

        return await drain(count, [{"i": i} for i in range(messages)], deliver)

    async def redis_side() -> tuple[float, float]:
        from faststream.redis import RedisBroker
        from faststream.redis.testing import ChannelVisitor, build_message

        broker = RedisBroker(logger=None)
        count = counting(broker)
        sub = await _offline(broker)
        serializer = broker.config.fd_config._serializer
        visitor = ChannelVisitor()  # a Redis channel's message, as FastStream's TestRedisBroker builds it
        raw = [
            visitor.get_message(
                TOPIC,
                await build_message(
                    message={"i": i},
                    correlation_id=str(uuid.uuid4()),
                    message_format=sub.config.message_format,
                    serializer=serializer,
                ),
                sub,
            )
            for i in range(messages)
        ]
        return await drain(count, raw, sub.consume)  # what its reader loop calls per message

    async def bus_broker_side() -> tuple[float, float]:
        broker = BusBroker(logger=None)
        count = counting(broker, group="ceiling")
        sub = await _offline(broker)
        now = datetime.now(UTC)
        raw = [
            Message(
                topic=TOPIC,
                partition=str(i % PARTITIONS),
                offset=i,
                key=None,
                headers={"content-type": "application/json"},
                payload=json.dumps({"i": i}).encode(),
                created_at=now,
            )
            for i in range(messages)
        ]
        return await drain(count, raw, sub._handle)  # what the group's worker calls per message

    try:
        import faststream.redis  # noqa: F401 - needs the redis client (the bench extra)
    except ImportError:
        print("faststream[redis] is not installed: no stock RedisBroker row", file=sys.stderr)
        has_redis = False
    else:
        has_redis = True
    core: list[tuple[float, float]] = []
    stock: list[tuple[float, float]] = []
    ours: list[tuple[float, float]] = []
    for _ in range(2):  # alternate rounds, the best of each
        core.append(await core_side())
        if has_redis:
            stock.append(await redis_side())
        ours.append(await bus_broker_side())
    return _best(core), (_best(stock) if stock else None), _best(ours)


async def _latency(dsn: str, schema: str, b: bus.Bus, count: int, rate: float) -> tuple[float, float]:
    """(FastStream p50 ms, subscribe p50 ms) publish->handler.

    Both sides run at once, each on its own topic, their publishes alternating: one side measured
    after the other got a different machine (the load of the run before it).
    """
    fs_topic, own_topic = TOPIC + ".lat-fs", TOPIC + ".lat-own"
    await b.create_topic(fs_topic, partitions=PARTITIONS)
    await b.create_topic(own_topic, partitions=PARTITIONS)
    broker = BusBroker(dsn, schema=schema, logger=None, **FAST)
    fs_seen: list[float] = []
    own_seen: list[float] = []

    @broker.subscriber(fs_topic, group="lat-fs", start="latest")
    async def handle(body: dict[str, float]) -> None:
        fs_seen.append(time.time() - body["t"])

    async def own_handle(m: bus.Message) -> None:
        own_seen.append(time.time() - m.value(dict)["t"])

    async def both(i: int) -> None:
        await broker.publish({"i": i, "t": time.time()}, fs_topic, key=str(i))
        await b.publish(own_topic, {"i": i, "t": time.time()}, key=str(i))

    sub = await b.subscribe("lat-own", own_handle, topics=[own_topic], start="latest")
    try:
        async with broker:
            await broker.start()
            # Warm up until both groups have joined and delivered from every partition.
            for i in range(PARTITIONS * 2):
                await both(i)
                await asyncio.sleep(0.05)
            await _until(lambda: len(fs_seen) >= PARTITIONS and len(own_seen) >= PARTITIONS, 30)
            await asyncio.sleep(0.2)
            fs_seen.clear()
            own_seen.clear()
            for i in range(count):
                await both(i)
                await asyncio.sleep(1.0 / rate)
            await _until(lambda: len(fs_seen) >= count and len(own_seen) >= count, 60)
    finally:
        await sub.stop()
    return statistics.median(fs_seen) * 1000, statistics.median(own_seen) * 1000


async def _queue(dsn: str, schema: str, b: bus.Bus, jobs: int) -> tuple[float, float]:
    """(FastStream queue subscriber msg/s, queue_consumer take/ack_many msg/s), `jobs` each."""

    async def fill(topic: str) -> None:
        await b.create_topic(topic, partitions=1, semantics="queue")
        for first in range(0, jobs, 1000):
            await b.publish_many(topic, [{"i": i} for i in range(first, min(first + 1000, jobs))])

    async def faststream_side(topic: str) -> float:
        await fill(topic)
        broker = BusBroker(dsn, schema=schema, logger=None, **FAST)
        count = [0]

        @broker.subscriber(topic)
        async def handle(body: dict[str, int]) -> None:
            count[0] += 1

        async with broker:
            started = time.perf_counter()
            await broker.start()
            await _until(lambda: count[0] >= jobs, 300)
            elapsed = time.perf_counter() - started
        return jobs / elapsed

    async def bus_side(topic: str) -> float:
        await fill(topic)
        count = 0
        started = time.perf_counter()
        async with b.queue_consumer(topic) as q:
            while count < jobs:
                taken = await q.take(max_messages=10, timeout=1.0)
                for m in taken:
                    m.value(dict)
                    count += 1
                await q.ack_many(taken)
        return jobs / (time.perf_counter() - started)

    fs, own = [], []
    for n in range(2):
        own.append(await bus_side(f"{TOPIC}.q-own-{n}"))
        fs.append(await faststream_side(f"{TOPIC}.q-fs-{n}"))
    return max(fs), max(own)


def _p(times: list[float], q: float) -> float:
    """The q-quantile of `times` (seconds), in milliseconds."""
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def _request_reply(
    dsn: str, schema: str, b: bus.Bus, count: int
) -> tuple[tuple[float, float], tuple[float, float]]:
    """((FastStream p50, p99) ms, (raw loop p50, p99) ms): one request at a time, round trip.

    FastStream: `broker.request` to a subscriber that returns the body (the reply goes to the
    broker's partition of faststream.replies, read on its wake-up). Raw: the same loop written
    on the bus: `b.publish` the request, a `subscribe` handler `b.publish`es the reply to a reply
    topic, the requester's consumer (`poll`) reads it. Alternated rounds, each on its own topics.
    """
    fs_times: list[float] = []
    own_times: list[float] = []

    async def faststream_side(n: int, rounds: int) -> None:
        topic = f"{TOPIC}.rr-fs-{n}"
        await b.create_topic(topic, partitions=1)
        broker = BusBroker(dsn, schema=schema, logger=None, **FAST)

        @broker.subscriber(topic, group="rr-fs", start="latest")
        async def answer(body: dict[str, int]) -> dict[str, int]:
            return body

        async with broker:
            await broker.start()
            for i in range(5):  # warm up: the group joined, the reply partition made
                await broker.request({"i": i}, topic, timeout=30)
            for i in range(rounds):
                started = time.perf_counter()
                await broker.request({"i": i}, topic, timeout=30)
                fs_times.append(time.perf_counter() - started)

    async def bus_side(n: int, rounds: int) -> None:
        topic, replies = f"{TOPIC}.rr-own-{n}", f"{TOPIC}.rr-own-{n}.replies"
        await b.create_topic(topic, partitions=1)
        await b.create_topic(replies, partitions=1)

        async def answer(m: bus.Message) -> None:
            await b.publish(replies, m.value(dict), headers={"correlation_id": m.headers["correlation_id"]})

        sub = await b.subscribe("rr-own", answer, topics=[topic], start="latest")
        try:
            async with b.consumer("rr-own-requester", topics=[replies], start="latest") as requester:

                async def one(i: int) -> None:
                    cid = uuid.uuid4().hex
                    await b.publish(topic, {"i": i}, headers={"correlation_id": cid})
                    while not any(
                        m.headers.get("correlation_id") == cid for m in await requester.poll(timeout=30)
                    ):
                        pass

                for i in range(5):
                    await one(i)
                for i in range(rounds):
                    started = time.perf_counter()
                    await one(i)
                    own_times.append(time.perf_counter() - started)
        finally:
            await sub.stop()

    for n in range(2):
        await bus_side(n, count // 2)
        await faststream_side(n, count // 2)
    return (_p(fs_times, 0.5), _p(fs_times, 0.99)), (_p(own_times, 0.5), _p(own_times, 0.99))


async def _get_one(dsn: str, schema: str, b: bus.Bus, count: int) -> tuple[float, float]:
    """(FastStream get_one p50 ms, consumer poll p50 ms): publish, then wait for that message.

    FastStream: a subscriber without a handler (a group member) `get_one`s each message just
    published; raw: a consumer of another group `poll`s it (and commits, as `get_one` does).
    """
    fs_times: list[float] = []
    own_times: list[float] = []
    fs_topic, own_topic = TOPIC + ".one-fs", TOPIC + ".one-own"
    await b.create_topic(fs_topic, partitions=1)
    await b.create_topic(own_topic, partitions=1)
    broker = BusBroker(dsn, schema=schema, logger=None, **FAST)
    reader = broker.subscriber(fs_topic, group="one-fs", start="latest")
    async with broker, b.consumer("one-own", topics=[own_topic], start="latest", max_poll_records=1) as c:
        await broker.start()
        for i in range(count + 5):  # the first five warm up
            started = time.perf_counter()
            await broker.publish({"i": i}, fs_topic)
            assert await reader.get_one(timeout=30) is not None
            if i >= 5:
                fs_times.append(time.perf_counter() - started)
            started = time.perf_counter()
            await b.publish(own_topic, {"i": i})
            while not await c.poll(timeout=30, max_records=1):
                pass
            await c.commit()
            if i >= 5:
                own_times.append(time.perf_counter() - started)
    return _p(fs_times, 0.5), _p(own_times, 0.5)


async def _sql_publish(dsn: str, schema: str, b: bus.Bus, count: int) -> tuple[float, float]:
    """(SQL publish us/message, b.publish us/message), one message per call, sequential."""
    topic = TOPIC + ".sql"
    await b.create_topic(topic, partitions=PARTITIONS)
    conn = await asyncpg.connect(dsn, server_settings={"search_path": f'"{schema}"'})
    try:
        statement = await conn.prepare("SELECT * FROM publish($1, $2::jsonb, key => $3)")
        sql_times, own_times = [], []
        for _ in range(2):  # alternate rounds
            started = time.perf_counter()
            for i in range(count):
                await statement.fetchrow(topic, json.dumps({"i": i}), f"k{i}")
            sql_times.append((time.perf_counter() - started) / count)
            started = time.perf_counter()
            for i in range(count):
                await b.publish(topic, {"i": i}, key=f"k{i}")
            own_times.append((time.perf_counter() - started) / count)
    finally:
        await conn.close()
    return min(sql_times) * 1e6, min(own_times) * 1e6


async def run(dsn: str, quick: bool) -> list[Result]:
    schema = "bench_" + uuid.uuid4().hex[:10]
    b = await bus.connect(dsn, schema=schema, **FAST)
    messages, jobs, lat_count, sql_count = (2_000, 300, 60, 300) if quick else (20_000, 3_000, 400, 3_000)
    rr_count = 60 if quick else 400
    try:
        await b.create_topic(TOPIC, partitions=PARTITIONS)
        fs, fs_batch, own, own_steady = await _throughput(dsn, schema, b, messages)
        core_ceiling, stock_ceiling, bus_ceiling = await _ceiling(messages)
        fs_queue_rate, own_queue_rate = await _queue(dsn, schema, b, jobs)
        fs_p50, own_p50 = await _latency(dsn, schema, b, lat_count, 100.0)
        sql_us, own_us = await _sql_publish(dsn, schema, b, sql_count)
        rr_fs, rr_own = await _request_reply(dsn, schema, b, rr_count)
        one_fs, one_own = await _get_one(dsn, schema, b, rr_count // 2)
    finally:
        async with b.pool.acquire() as conn:
            await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')  # generated bench schema name
        await b.close()
    # The ceilings have no group to join: against `subscribe` from its first message to its last.
    steady = (own_steady, "bus subscribe, first to last message")
    from_start = (own, "bus subscribe")
    rows = [
        (
            f"FastStream's ceiling: its per-message pipeline alone, no parsing, no I/O ({messages:,} msgs)",
            core_ceiling,
            steady,
            "≥ 0.8×",  # missed: then no per-message FastStream subscriber of any broker can meet it
        ),
        (f"stock RedisBroker subscriber, no I/O ({messages:,} msgs in memory)", stock_ceiling, steady, None),
        (
            f"BusBroker subscriber pipeline, no I/O ({messages:,} msgs in memory)",
            bus_ceiling,
            steady,
            "≥ 0.8×",  # missed: then BusBroker's per-message subscriber cannot meet it over any delivery
        ),
        (
            f"FastStream subscriber throughput ({messages:,} msgs, {PARTITIONS} partitions)",
            fs,
            from_start,
            "≥ 0.8×",
        ),
        (
            f"FastStream batch subscriber throughput ({messages:,} msgs, {PARTITIONS} partitions, batch=True)",
            fs_batch,
            from_start,
            "≥ 0.8×",
        ),
    ]
    return [
        *(
            Result(SCENARIO, name, value[0], "msg/s", base[0], base_name, True, target, _cpu(value, base))
            for name, value, (base, base_name), target in rows
            if value is not None  # the stock RedisBroker row needs the redis client
        ),
        Result(
            SCENARIO,
            f"FastStream queue subscriber throughput ({jobs:,} jobs)",
            fs_queue_rate,
            "msg/s",
            own_queue_rate,
            "queue_consumer take/ack_many",
            True,
            None,
        ),
        Result(
            SCENARIO,
            f"FastStream publish→handler p50 ({lat_count} msgs at 100/s)",
            fs_p50,
            "ms",
            own_p50,
            "b.publish→subscribe",
            False,
            "≤ 1.3×",
        ),
        Result(
            SCENARIO,
            f"FastStream subscriber throughput against FastStream's own per-message ceiling ({messages:,} msgs)",
            fs[0],
            "msg/s",
            core_ceiling[0],
            "FastStream's ceiling (its pipeline alone, no I/O)",
            True,
            None,
        ),
        Result(
            SCENARIO,
            f"FastStream request/reply round trip p50 ({rr_count} requests, one at a time)",
            rr_fs[0],
            "ms",
            rr_own[0],
            "b.publish→subscribe→b.publish→consumer poll",
            False,
            None,
        ),
        Result(
            SCENARIO,
            f"FastStream request/reply round trip p99 ({rr_count} requests, one at a time)",
            rr_fs[1],
            "ms",
            rr_own[1],
            "b.publish→subscribe→b.publish→consumer poll",
            False,
            None,
        ),
        Result(
            SCENARIO,
            f"FastStream get_one p50, publish→message in hand ({rr_count // 2} msgs)",
            one_fs,
            "ms",
            one_own,
            "b.publish→consumer poll, commit",
            False,
            None,
        ),
        Result(
            SCENARIO,
            "SQL publish, one message per call",
            sql_us,
            "µs/msg",
            own_us,
            "b.publish",
            False,
            None,
        ),
    ]


if __name__ == "__main__":
    import os

    from bus.server.embedded import ensure_server

    rows = asyncio.run(run(os.environ.get("BUS_DSN") or ensure_server().dsn, quick=True))
    for row in rows:
        print(
            row.name,
            f"{row.value:.1f} {row.unit}",
            "baseline",
            f"{row.baseline:.1f}",
            f"ratio {row.ratio:.2f}",
        )
