"""Publish throughput and per-call latency of the bus next to raw asyncpg, and RSS while publishing a million messages.

Measurements (each one bus and raw, interleaved bus, raw, bus, raw; the
better of the two rounds is reported, to tame noise):

* `b.publish`, one awaited call per message, from 1, 8 and 64 concurrent
  coroutines, to a topic of 1 and of 12 partitions, against single-row
  `INSERT ... RETURNING` autocommitted into `raw_messages` (see
  `benchmarks.rawpeers`: no offset counter, no NOTIFY) over a pool of 8
  connections, same coroutines. Per-call p50/p99 beside every throughput,
  and a p99 row of its own (target: no worse than raw's). The bus's calls go
  through its Producer actor, which writes concurrent calls in one statement
  per flush;
* `b.publish_many` with 100 and 1000 messages per call, against one
  `INSERT ... SELECT FROM unnest(...)` per call.

Both sides publish the same ~100-byte JSON payloads (encoded with msgspec per
message on both sides), the same keys (1000 customers) and the same header
(raw: the same CRC-32 of the key picks the partition number). Each run uses
a fresh schema `bench_<random>`, dropped afterwards.

Run it alone with `bus bench publish` (or `python -m benchmarks.publish`); `bus bench publish
--against REV` compares this checkout with another release instead (benchmarks/against.py);
`BUS_BENCH_PUBLISH_SINGLE` overrides the messages per single-publish measurement.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import msgspec
import psutil

import bus
from benchmarks import rawpeers
from benchmarks.result import Result
from bus.config import Config
from storage.logs import get_logger

log = get_logger(__name__, scenario="publish")

SCENARIO = "publish"
TOPIC = "bench.publish"
PARTITIONS = 8  # publish_many and the RSS run
PARTITION_COUNTS = (1, 12)  # the concurrent single publishes
PUBLISHER_COUNTS = (1, 8, 64)
RAW_POOL = 8  # the raw side's pool: 1 row per transaction over 8 connections
# Concurrent callers: a hot partition moves at one commit per message without batching.
SINGLE_TARGETS = {1: 0.9, 8: 1.5, 64: 3.0}
CUSTOMERS = 1000
HEADERS = {"source": "bench"}
BASELINE = "raw asyncpg"
BATCH_TARGET = 0.8
MEMORY_BATCH = 1000
# A process that keeps memory flat may still grow a little while caches
# (prepared statements, codec tables, the allocator's arenas) fill up.
MEMORY_GROWTH_LIMIT_MIB = 32.0
MIB = 1024 * 1024

_encoder = msgspec.json.Encoder()


@dataclass(frozen=True)
class Sizes:
    """How many messages each measurement publishes."""

    single: int  # per single-publish measurement (split over the publishers)
    batched: int  # per publish_many measurement
    memory: int  # for the RSS run, in batches of MEMORY_BATCH
    rounds: int = 2  # bus, raw, bus, raw: the better round counts
    warmup: int = 200  # messages published (not timed) before each measurement


FULL = Sizes(
    single=int(os.environ.get("BUS_BENCH_PUBLISH_SINGLE", "10000")), batched=200_000, memory=1_000_000
)
QUICK = Sizes(single=1_000, batched=20_000, memory=100_000)


def payload(i: int) -> dict[str, Any]:
    """The i-th message: about 100 bytes of JSON, like a small domain event."""
    return {
        "order_id": i,
        "customer": f"cust-{i % CUSTOMERS:05d}",
        "amount": 1234.5,
        "currency": "EUR",
        "status": "created",
        "items": 3,
    }


def key(i: int) -> str:
    """The i-th message's key (1000 customers, so every partition gets traffic)."""
    return f"cust-{i % CUSTOMERS:05d}"


def raw_partition(k: str, partitions: int = PARTITIONS) -> int:
    """The partition the raw side writes to: the same CRC-32 of the key the bus uses."""
    return zlib.crc32(k.encode("utf-8")) % partitions


@dataclass
class Timing:
    """One timed run: elapsed seconds, messages, and per-call latencies in seconds."""

    seconds: float
    messages: int
    latencies: list[float]

    @property
    def rate(self) -> float:
        """Messages per second."""
        return self.messages / self.seconds if self.seconds > 0 else 0.0


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values` by the nearest-rank method."""
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


async def _concurrently(count: int, publishers: int, one: Callable[[int], Awaitable[Any]]) -> Timing:
    """Publish messages 0..count-1 with `publishers` tasks, one awaited call per message."""
    latencies: list[float] = []

    async def worker(first: int) -> None:
        clock = time.perf_counter
        for i in range(first, count, publishers):
            started = clock()
            await one(i)
            latencies.append(clock() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(publishers)))
    return Timing(time.perf_counter() - started, count, latencies)


async def _batched(count: int, size: int, one_batch: Callable[[range], Awaitable[Any]]) -> Timing:
    """Publish messages 0..count-1 in calls of `size`, one after the other."""
    latencies: list[float] = []
    clock = time.perf_counter
    started = clock()
    for first in range(0, count, size):
        call = clock()
        await one_batch(range(first, min(count, first + size)))
        latencies.append(clock() - call)
    return Timing(clock() - started, count, latencies)


class Publishers:
    """The two sides of every measurement: the bus and the raw asyncpg baseline."""

    def __init__(self, b: bus.Bus, raw: rawpeers.RawLog) -> None:
        self.b = b
        self.raw = raw

    async def bus_single(self, count: int, publishers: int, topic: str = TOPIC) -> Timing:
        """`b.publish`, one message per awaited call."""
        b = self.b

        async def one(i: int) -> None:
            await b.publish(topic, payload(i), key=key(i), headers=HEADERS)

        return await _concurrently(count, publishers, one)

    async def raw_single(self, count: int, publishers: int, partitions: int = PARTITIONS) -> Timing:
        """One autocommitted single-row INSERT per message."""
        raw = self.raw

        async def one(i: int) -> None:
            k = key(i)
            await raw.insert_one(
                raw_partition(k, partitions),
                k,
                _encoder.encode(HEADERS).decode(),
                _encoder.encode(payload(i)),
            )

        return await _concurrently(count, publishers, one)

    async def bus_batch(self, count: int, size: int) -> Timing:
        """`b.publish_many` with `size` messages per call."""
        b = self.b

        async def one_batch(ids: range) -> None:
            await b.publish_many(TOPIC, [bus.Outgoing(payload(i), key=key(i), headers=HEADERS) for i in ids])

        return await _batched(count, size, one_batch)

    async def raw_batch(self, count: int, size: int) -> Timing:
        """One `INSERT ... SELECT FROM unnest(...)` with `size` rows per call."""
        raw = self.raw

        async def one_batch(ids: range) -> None:
            keys = [key(i) for i in ids]
            await raw.insert_batch(
                [raw_partition(k) for k in keys],
                list(keys),
                [_encoder.encode(HEADERS).decode() for _ in ids],
                [_encoder.encode(payload(i)) for i in ids],
            )

        return await _batched(count, size, one_batch)


async def _interleaved(
    name: str,
    rounds: int,
    warmup: Callable[[], Awaitable[Any]],
    bus_run: Callable[[], Awaitable[Timing]],
    raw_run: Callable[[], Awaitable[Timing]],
) -> tuple[Timing, Timing]:
    """Warm both sides up, then bus, raw, bus, raw...; the better round of each side."""
    await warmup()
    best_bus: Timing | None = None
    best_raw: Timing | None = None
    for round_no in range(rounds):
        t_bus = await bus_run()
        t_raw = await raw_run()
        log.info(
            "publish_round", measurement=name, round=round_no, bus=round(t_bus.rate), raw=round(t_raw.rate)
        )
        if best_bus is None or t_bus.rate > best_bus.rate:
            best_bus = t_bus
        if best_raw is None or t_raw.rate > best_raw.rate:
            best_raw = t_raw
    assert best_bus is not None and best_raw is not None
    return best_bus, best_raw


async def _warm(
    bus_run: Callable[[int, int], Awaitable[Timing]],
    raw_run: Callable[[int, int], Awaitable[Timing]],
    count: int,
    arg: int,
) -> None:
    # Untimed: fills both pools, prepares both statements, caches the topic and partition ids.
    await bus_run(count, arg)
    await raw_run(count, arg)


def _p99_row(name: str, bus_t: Timing, raw_t: Timing, **extra: Any) -> Result:
    """The per-call p99 of a measurement next to raw's: no worse is the target."""
    return Result(
        scenario=SCENARIO,
        name=f"{name}: call p99",
        value=round(percentile(bus_t.latencies, 0.99) * 1000.0, 3),
        unit="ms",
        baseline=round(percentile(raw_t.latencies, 0.99) * 1000.0, 3),
        baseline_name=BASELINE,
        higher_is_better=False,
        target="≤ 1.0× raw",
        extra=extra,
    )


def _row(name: str, bus_t: Timing, raw_t: Timing, target: float, **extra: Any) -> Result:
    ms = 1000.0
    return Result(
        scenario=SCENARIO,
        name=name,
        value=round(bus_t.rate, 1),
        unit="msg/s",
        baseline=round(raw_t.rate, 1),
        baseline_name=BASELINE,
        higher_is_better=True,
        target=f"≥ {target}× raw",
        extra={
            "messages": bus_t.messages,
            "p50": round(percentile(bus_t.latencies, 0.50) * ms, 3),
            "p99": round(percentile(bus_t.latencies, 0.99) * ms, 3),
            "baseline_p50": round(percentile(raw_t.latencies, 0.50) * ms, 3),
            "baseline_p99": round(percentile(raw_t.latencies, 0.99) * ms, 3),
            "latency_unit": "ms per call",
            **extra,
        },
    )


def _count(n: int) -> str:
    """1_000_000 -> "1M", 100_000 -> "100k" (short labels for the table)."""
    if n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n % 1000 == 0:
        return f"{n // 1000}k"
    return str(n)


def _rss() -> int:
    return int(psutil.Process(os.getpid()).memory_info().rss)


async def memory_run(b: bus.Bus, total: int) -> list[Result]:
    """Publish `total` messages in batches of 1000 and report RSS at start, peak and end (flat = no leak)."""
    gc.collect()
    start = peak = _rss()
    tenth = start
    batches = max(1, total // MEMORY_BATCH)
    started = time.perf_counter()
    for n in range(batches):
        first = n * MEMORY_BATCH
        # Each batch is built here and dropped after the call: the process holds
        # one batch at a time, so any growth is the bus's.
        await b.publish_many(
            TOPIC,
            [
                bus.Outgoing(payload(i), key=key(i), headers=HEADERS)
                for i in range(first, first + MEMORY_BATCH)
            ],
        )
        peak = max(peak, _rss())
        if n + 1 == max(1, batches // 10):
            tenth = _rss()
    elapsed = time.perf_counter() - started
    gc.collect()
    end = _rss()
    messages = batches * MEMORY_BATCH
    info = {
        "messages": messages,
        "batch": MEMORY_BATCH,
        "start_mib": round(start / MIB, 1),
        "after_10pct_mib": round(tenth / MIB, 1),
        "peak_mib": round(peak / MIB, 1),
        "end_mib": round(end / MIB, 1),
        "rate_msg_s": round(messages / elapsed, 1),
    }
    log.info("publish_memory", **info)
    label = f"{_count(messages)} msgs, batches of {MEMORY_BATCH}"
    return [
        Result(
            SCENARIO, f"RSS at start ({label})", info["start_mib"], "MiB", higher_is_better=False, extra=info
        ),
        Result(SCENARIO, f"RSS peak ({label})", info["peak_mib"], "MiB", higher_is_better=False, extra=info),
        Result(SCENARIO, f"RSS at end ({label})", info["end_mib"], "MiB", higher_is_better=False, extra=info),
        Result(
            SCENARIO,
            f"RSS growth peak − start ({label})",
            round((peak - start) / MIB, 1),
            "MiB",
            higher_is_better=False,
            target=f"≤ {MEMORY_GROWTH_LIMIT_MIB:g} MiB",
            extra=info,
        ),
    ]


async def run(dsn: str, quick: bool) -> list[Result]:
    """The publish scenario: concurrent publishers and publish_many next to raw asyncpg, then the RSS rows.

    With BUS_BENCH_AGAINST set (`bus bench publish --against REV`): this checkout's publish
    path next to release REV's instead (benchmarks/against.py).
    """
    if os.environ.get("BUS_BENCH_AGAINST"):
        from benchmarks import against

        return await against.run(dsn, quick)
    sizes = QUICK if quick else FULL
    schema = "bench_" + uuid.uuid4().hex[:12]
    defaults = Config()
    results: list[Result] = []
    b = await bus.connect(dsn, schema=schema, cleaner_interval=0)
    try:
        # The raw side: 1 row per transaction over a pool of 8 (what a careful hand-written publisher uses).
        pool = await rawpeers.create_pool(dsn, schema, min_size=RAW_POOL, max_size=RAW_POOL)
        batch_pool = await rawpeers.create_pool(
            dsn, schema, min_size=defaults.pool_min_size, max_size=defaults.pool_max_size
        )
        try:
            raw = rawpeers.RawLog(pool)
            await raw.create()
            await b.create_topic(TOPIC, partitions=PARTITIONS)
            sides = Publishers(b, raw)

            for partitions in PARTITION_COUNTS:
                topic = f"{TOPIC}.p{partitions}"
                await b.create_topic(topic, partitions=partitions)
                for publishers in PUBLISHER_COUNTS:
                    name = (
                        f"publish, {publishers} concurrent caller{'s' if publishers > 1 else ''}, "
                        f"{partitions} partition{'s' if partitions > 1 else ''}"
                    )
                    count = max(sizes.single, publishers * 2)
                    bus_run = partial(sides.bus_single, topic=topic)
                    raw_run = partial(sides.raw_single, partitions=partitions)

                    bus_t, raw_t = await _interleaved(
                        name,
                        sizes.rounds,
                        partial(_warm, bus_run, raw_run, max(sizes.warmup, publishers * 4), publishers),
                        partial(bus_run, count, publishers),
                        partial(raw_run, count, publishers),
                    )
                    extra = {"publishers": publishers, "partitions": partitions, "raw_pool": RAW_POOL}
                    results.append(_row(name, bus_t, raw_t, SINGLE_TARGETS[publishers], **extra))
                    results.append(_p99_row(name, bus_t, raw_t, **extra))

            # publish_many against one unnest INSERT per call, with the bus's own pool bounds.
            sides = Publishers(b, rawpeers.RawLog(batch_pool))

            for size in (100, 1000):
                name = f"publish_many, {size} per call"
                count = max(size, sizes.batched - sizes.batched % size)

                bus_t, raw_t = await _interleaved(
                    name,
                    sizes.rounds,
                    partial(_warm, sides.bus_batch, sides.raw_batch, size * 2, size),
                    partial(sides.bus_batch, count, size),
                    partial(sides.raw_batch, count, size),
                )
                results.append(_row(name, bus_t, raw_t, BATCH_TARGET, per_call=size))

            results.extend(await memory_run(b, sizes.memory))
        finally:
            await pool.close()
            await batch_pool.close()
    finally:
        await b.close()
        await rawpeers.drop_schema(dsn, schema)
    return results


if __name__ == "__main__":
    from rich.console import Console

    from benchmarks.harness import main

    raise SystemExit(main(SCENARIO, quick="--quick" in sys.argv, console=Console()))
