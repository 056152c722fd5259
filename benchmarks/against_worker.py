"""One side of `bus bench publish --against REV`: the publish path of whichever release imports as `bus`.

`benchmarks.against` runs this file under the interpreter of each release
(this checkout's, and a virtualenv built from `git archive REV`), one process
per side and round, so both sides meet the same server in alternating rounds.
It uses only the public API both releases have (`bus.connect`, `publish`,
`subscribe`, `queue_consumer`, `publish(connection=)`) and asyncpg, imports
nothing of this checkout, and prints one JSON object on stdout:

* `concurrent`: per (callers, partitions), `b.publish()` msg/s and p50 next to
  raw one-row autocommitted INSERTs (the same table as `benchmarks.rawpeers`,
  a pool of 8) measured right after it in the same process;
* `mixed`: one process publishing `rate`/s to a pubsub topic read by a group
  and `rate`/s to a queue drained by two consumers, each publisher sequential
  and paced on a schedule: publish p50 and the rate each publisher reached;
* `outbox`: a one-row transaction holding `publish(connection=conn)`, against
  the same transaction writing one row to a hand-made outbox table, p50 of
  each, interleaved call by call; again with an idempotency key (the
  hand-made table then has a unique key column).

Every run makes its own schema and drops it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

import bus

RAW_POOL = 8
CUSTOMERS = 1000
HEADERS = {"source": "bench"}

RAW_TABLE = """
CREATE TABLE raw_messages (
    id          bigserial PRIMARY KEY,
    partition   integer NOT NULL,
    key         text NULL,
    headers     jsonb NULL,
    payload     bytea NULL,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX raw_messages_created ON raw_messages (partition, created_at);
CREATE TABLE app_outbox (
    id               bigserial PRIMARY KEY,
    topic            text NOT NULL,
    key              text NULL,
    idempotency_key  text NULL UNIQUE,
    payload          jsonb NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""
RAW_INSERT = """
INSERT INTO raw_messages (partition, key, headers, payload) VALUES ($1, $2, $3::jsonb, $4)
RETURNING id, created_at
"""
OUTBOX_INSERT = """
INSERT INTO app_outbox (topic, key, idempotency_key, payload) VALUES ($1, $2, $3, $4::jsonb)
RETURNING id
"""


def payload(i: int) -> dict[str, Any]:
    """About 100 bytes of JSON, like a small domain event (the payload of `bus bench publish`)."""
    return {
        "order_id": i,
        "customer": f"cust-{i % CUSTOMERS:05d}",
        "amount": 1234.5,
        "currency": "EUR",
        "status": "created",
        "items": 3,
    }


def p50(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] * 1000.0 if ordered else 0.0


async def _callers(count: int, callers: int, one: Callable[[int], Awaitable[Any]]) -> tuple[float, float]:
    """msg/s and p50 (ms) of `count` awaited calls spread over `callers` tasks."""
    latencies: list[float] = []

    async def worker(first: int) -> None:
        clock = time.perf_counter
        for i in range(first, count, callers):
            started = clock()
            await one(i)
            latencies.append(clock() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(callers)))
    return count / (time.perf_counter() - started), p50(latencies)


async def concurrent(
    b: Any, raw: asyncpg.Pool, shapes: list[tuple[int, int]], count: int
) -> list[dict[str, Any]]:
    rows = []
    encoded_headers = json.dumps(HEADERS)
    for callers, partitions in shapes:
        topic = f"bench.c{callers}x{partitions}"
        await b.create_topic(topic, partitions=partitions)
        n = max(count, callers * 4)

        async def one(i: int, topic: str = topic) -> None:
            await b.publish(topic, payload(i), key=f"cust-{i % CUSTOMERS:05d}", headers=HEADERS)

        async def raw_one(i: int, partitions: int = partitions) -> None:
            k = f"cust-{i % CUSTOMERS:05d}"
            body = json.dumps(payload(i)).encode()
            await raw.fetchrow(RAW_INSERT, zlib.crc32(k.encode()) % partitions, k, encoded_headers, body)

        await _callers(max(50, callers * 2), callers, one)  # warm: pools, prepared statements, partition ids
        await _callers(max(50, callers * 2), callers, raw_one)
        rate, lat = await _callers(n, callers, one)
        raw_rate, raw_lat = await _callers(n, callers, raw_one)
        rows.append(
            {
                "callers": callers,
                "partitions": partitions,
                "messages": n,
                "rate": rate,
                "p50": lat,
                "raw_rate": raw_rate,
                "raw_p50": raw_lat,
            }
        )
    return rows


async def mixed(b: Any, rate: float, seconds: float) -> dict[str, Any]:
    """400/s to a topic read by a group and 400/s to a queue drained by two consumers."""
    await b.create_topic("bench.mixed.t", partitions=4)
    await b.create_topic("bench.mixed.q", partitions=4, semantics="queue")
    delivered = 0
    acked = 0

    async def handle(_m: Any) -> None:
        nonlocal delivered
        delivered += 1

    stop = asyncio.Event()

    async def drain() -> None:
        nonlocal acked
        async with b.queue_consumer("bench.mixed.q", visibility_timeout=60) as q:
            while not stop.is_set():
                jobs = await q.take(max_messages=10, timeout=0.2)
                if jobs:
                    await q.ack_many(jobs)
                    acked += len(jobs)

    latencies: list[float] = []
    published: list[int] = [0, 0]

    async def publisher(n: int, topic: str) -> None:
        clock = time.perf_counter
        started = clock()
        i = 0
        while True:
            due = started + i / rate
            now = clock()
            if now - started >= seconds:
                break
            if due > now:
                await asyncio.sleep(due - now)
            call = clock()
            await b.publish(topic, payload(i), key=f"cust-{i % CUSTOMERS:05d}")
            latencies.append(clock() - call)
            published[n] += 1
            i += 1

    sub = await b.subscribe("bench-mixed", handle, topics=["bench.mixed.t"], start="earliest")
    drainers = [asyncio.create_task(drain()) for _ in range(2)]
    try:
        await asyncio.sleep(1.0)  # the group's assignment and the consumers settle first
        await asyncio.gather(publisher(0, "bench.mixed.t"), publisher(1, "bench.mixed.q"))
    finally:
        stop.set()
        await asyncio.gather(*drainers, return_exceptions=True)
        await sub.stop()
    return {
        "offered": rate,
        "seconds": seconds,
        "reached": min(published) / seconds,
        "p50": p50(latencies),
        "delivered": delivered,
        "acked": acked,
    }


async def outbox(b: Any, count: int) -> dict[str, Any]:
    """A one-row transaction: `publish(connection=)` against a hand-made outbox row, call by call."""
    await b.create_topic("bench.outbox", partitions=4)
    result: dict[str, Any] = {}
    async with b.pool.acquire() as conn:
        for keyed in (False, True):
            bus_times: list[float] = []
            raw_times: list[float] = []
            for i in range(count + 20):
                ikey = f"{uuid.uuid4().hex}" if keyed else None
                k = f"cust-{i % CUSTOMERS:05d}"
                started = time.perf_counter()
                async with conn.transaction():
                    if keyed:
                        await b.publish(
                            "bench.outbox", payload(i), key=k, connection=conn, idempotency_key=ikey
                        )
                    else:
                        await b.publish("bench.outbox", payload(i), key=k, connection=conn)
                elapsed = time.perf_counter() - started
                started = time.perf_counter()
                async with conn.transaction():
                    await conn.fetchrow(OUTBOX_INSERT, "bench.outbox", k, ikey, json.dumps(payload(i)))
                raw_elapsed = time.perf_counter() - started
                if i >= 20:  # the first calls prepare statements
                    bus_times.append(elapsed)
                    raw_times.append(raw_elapsed)
            name = "keyed" if keyed else "plain"
            result[name] = {"p50": p50(bus_times), "raw_p50": p50(raw_times), "calls": count}
    return result


async def main(args: argparse.Namespace) -> dict[str, Any]:
    schema = "bench_" + uuid.uuid4().hex[:12]
    out: dict[str, Any] = {"bus": bus.__file__}
    b = await bus.connect(args.dsn, schema=schema, cleaner_interval=0)
    try:
        raw = await asyncpg.create_pool(
            args.dsn, min_size=RAW_POOL, max_size=RAW_POOL, server_settings={"search_path": schema}
        )
        try:
            async with raw.acquire() as conn:
                await conn.execute(RAW_TABLE)
            if "concurrent" in args.what:
                shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
                out["concurrent"] = await concurrent(b, raw, shapes, args.count)  # type: ignore[arg-type]
            if "outbox" in args.what:
                out["outbox"] = await outbox(b, args.outbox)
            if "mixed" in args.what:
                out["mixed"] = await mixed(b, args.rate, args.seconds)
        finally:
            await raw.close()
    finally:
        await b.close()
        conn = await asyncpg.connect(args.dsn)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')  # a name made above
        finally:
            await conn.close()
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--what", default="concurrent,outbox,mixed")
    parser.add_argument("--shapes", default="1x1,8x12,64x12,64x1")
    parser.add_argument("--count", type=int, default=6000)
    parser.add_argument("--outbox", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=400.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parsed = parser.parse_args()
    result = asyncio.run(main(parsed))
    print("AGAINST-RESULT " + json.dumps(result), flush=True)
