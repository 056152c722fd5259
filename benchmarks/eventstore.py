"""Event store: append throughput with and without guards, and claim_next latency as the log grows.

Measurements:

* `store.append` of one event per call from 8 concurrent appenders, without a
  guard (the baseline) and with a guard of two conditions on the appender's own
  device whose position is its previous append (so the guard is checked,
  index-backed, and never conflicts). Interleaved unguarded, guarded,
  unguarded, guarded; the better round of each is reported.
* `claim_next` latency (median of claim_next calls, each followed by an ack)
  on a store of 10,000 events in 1,000 partitions (the baseline) and on one of
  1,000,000 events in 100,000 partitions (`--quick`: 1,000 / 100 and
  100,000 / 10,000). Events are interleaved (event i belongs to device
  i mod partitions), so each partition's events are spread over the whole log.
  The stores are bulk-loaded with COPY straight into the event store's tables.
  The first claim_next on them discovers only what its `discovery_budget`
  allows and claims (its time is its own row, with the time to discover the
  whole log, `store.discover`, as the baseline); the rest of the log is
  discovered and the timed claims follow.

Each run uses a fresh schema `bench_<random>`, dropped afterwards. Run it
alone with `bus bench eventstore` (or `python -m benchmarks.eventstore`).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

import msgspec

import bus
from benchmarks import rawpeers
from benchmarks.result import Result
from storage import eventstore as es_sql
from storage.logs import get_logger

log = get_logger(__name__, scenario="eventstore")

SCENARIO = "eventstore"
APPENDERS = 8
GUARD_TARGET = "≥ 0.7×"
FIRST_CLAIM_TARGET = "≤ 1 s"
CLAIM_TARGET = "≤ 3×"
COPY_CHUNK = 100_000

_encoder = msgspec.json.Encoder()


class BenchReading(bus.Event, tag="bench.device.reading"):
    """A measurement from one device (the benchmark's partitioned event)."""

    device_id: str
    value: int


class BenchCalibrated(bus.Event, tag="bench.device.calibrated"):
    """A second event type of the device (the guard covers it too, as a claim's guard would)."""

    device_id: str


@dataclass
class Sizes:
    """How much each measurement does."""

    appends: int
    rounds: int
    small: tuple[int, int]  # (events, partitions)
    large: tuple[int, int]
    claims: int


QUICK = Sizes(appends=800, rounds=1, small=(1_000, 100), large=(100_000, 10_000), claims=60)
FULL = Sizes(appends=8_000, rounds=2, small=(10_000, 1_000), large=(1_000_000, 100_000), claims=300)


async def _append_rate(store: bus.EventStore, count: int, guarded: bool, tag: str) -> float:
    """Events per second appended one per call by APPENDERS concurrent tasks."""
    per_worker = count // APPENDERS

    async def worker(w: int) -> None:
        last = 0
        for i in range(per_worker):
            device = f"{tag}-w{w}-d{i % 50}"
            event = BenchReading(device_id=device, value=i)
            conditions = BenchReading.to_conditions(device_id=device) + BenchCalibrated.to_conditions(
                device_id=device
            )
            guard = bus.Guard(conditions, last) if guarded else None
            recs = await store.append(event, guard=guard)
            last = recs[0].position

    started = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(APPENDERS)))
    return per_worker * APPENDERS / (time.perf_counter() - started)


async def append_rows(b: bus.Bus, sizes: Sizes) -> list[Result]:
    """Guarded vs unguarded single-event appends."""
    store = b.event_store("bench-append")
    await _append_rate(store, APPENDERS * 20, False, "warm-p")
    await _append_rate(store, APPENDERS * 20, True, "warm-g")
    plain: list[float] = []
    guarded: list[float] = []
    for r in range(sizes.rounds):
        plain.append(await _append_rate(store, sizes.appends, False, f"p{r}"))
        guarded.append(await _append_rate(store, sizes.appends, True, f"g{r}"))
    best_plain, best_guarded = max(plain), max(guarded)
    log.info("append_measured", unguarded=round(best_plain), guarded=round(best_guarded))
    return [
        Result(
            SCENARIO,
            f"append, 1 event per call, {APPENDERS} appenders, guarded (2 conditions)",
            best_guarded,
            "events/s",
            baseline=best_plain,
            baseline_name="unguarded append",
            higher_is_better=True,
            target=GUARD_TARGET,
            extra={
                "events": sizes.appends,
                "rounds": sizes.rounds,
                "all_guarded": guarded,
                "all_unguarded": plain,
            },
        )
    ]


async def bulk_load(b: bus.Bus, store: str, events: int, partitions: int) -> None:
    """Write `events` BenchReading events into a new store with COPY (event i belongs to device i mod partitions)."""
    tag = BenchReading.event_tag()
    now = datetime.now(UTC)
    async with b.pool.acquire() as conn:
        for start in range(1, events + 1, COPY_CHUNK):
            stop = min(events, start + COPY_CHUNK - 1)
            rows = []
            attrs = []
            for position in range(start, stop + 1):
                device = f"d{position % partitions}"
                rows.append(
                    (
                        store,
                        position,
                        tag,
                        _encoder.encode({"device_id": device, "value": position}).decode(),
                        now,
                    )
                )
                attrs.append((store, position, "device_id", device, tag))
                attrs.append((store, position, "value", str(position), tag))
            await conn.copy_records_to_table(
                "es_events", records=rows, columns=["store", "position", "tag", "payload", "created_at"]
            )
            await conn.copy_records_to_table(
                "es_attributes", records=attrs, columns=["store", "position", "name", "value", "tag"]
            )
        await conn.copy_records_to_table(
            "es_stores", records=[(store, events + 1, now)], columns=["name", "next_position", "created_at"]
        )


async def _claim_latency(
    b: bus.Bus, events: int, partitions: int, claims: int
) -> tuple[float, dict[str, float]]:
    """Median claim_next latency (ms) after bulk loading and a first (discovering) claim."""
    name = f"bench-claims-{partitions}"
    started = time.perf_counter()
    await bulk_load(b, name, events, partitions)
    load_s = time.perf_counter() - started
    store = b.event_store(name)
    await store.register_group("g")
    await b.pool.execute(es_sql.ANALYZE_TABLES)
    started = time.perf_counter()
    first = await store.claim_next(
        "g", partition_by="device_id", handled_types=[BenchReading], worker_id="w-0"
    )
    bootstrap_s = time.perf_counter() - started
    assert first is not None
    found_first = len(await store.partitions("g"))
    await store.ack("g", first.offset_id, first.messages[-1].position)
    started = time.perf_counter()
    left = await store.discover("g", "device_id", [BenchReading])
    discover_s = time.perf_counter() - started
    assert left == 0
    await b.pool.execute(es_sql.ANALYZE_TABLES)
    latencies: list[float] = []
    fetched = 0
    for i in range(claims + 20):
        t0 = time.perf_counter()
        claim = await store.claim_next(
            "g", partition_by="device_id", handled_types=[BenchReading], worker_id="w-1"
        )
        elapsed = time.perf_counter() - t0
        assert claim is not None
        fetched += len(claim.messages)
        await store.ack("g", claim.offset_id, claim.messages[-1].position)
        if i >= 20:  # the first ones warm the statement caches
            latencies.append(elapsed * 1000)
    extra = {
        "events": events,
        "partitions": partitions,
        "load_s": round(load_s, 2),
        "first_claim_s": round(bootstrap_s, 3),
        "partitions_found_by_first_claim": found_first,
        "discover_rest_s": round(discover_s, 2),
        "claims": claims,
        "events_per_claim": round(fetched / (claims + 20), 1),
        "p90_ms": round(statistics.quantiles(latencies, n=10)[-1], 3),
        "mean_ms": round(statistics.fmean(latencies), 3),
    }
    log.info("claim_latency_measured", **extra, p50_ms=statistics.median(latencies))
    return statistics.median(latencies), extra


async def claim_rows(b: bus.Bus, sizes: Sizes, quick: bool) -> list[Result]:
    """claim_next latency, small store (baseline) vs large store."""
    small_ms, small_extra = await _claim_latency(b, *sizes.small, sizes.claims)
    large_ms, large_extra = await _claim_latency(b, *sizes.large, sizes.claims)
    events, partitions = sizes.large
    return [
        Result(
            SCENARIO,
            f"first claim_next on an undiscovered log, {events:,} events / {partitions:,} partitions",
            large_extra["first_claim_s"],
            "s",
            baseline=large_extra["first_claim_s"] + large_extra["discover_rest_s"],
            baseline_name="discovering the whole log",
            higher_is_better=False,
            target=FIRST_CLAIM_TARGET,
            extra={"partitions_found_by_first_claim": large_extra["partitions_found_by_first_claim"]},
        ),
        Result(
            SCENARIO,
            f"claim_next p50, {events:,} events / {partitions:,} partitions",
            large_ms,
            "ms",
            baseline=small_ms,
            baseline_name=f"same, {sizes.small[0]:,} events / {sizes.small[1]:,} partitions",
            higher_is_better=False,
            target=CLAIM_TARGET,
            extra={
                "large": large_extra,
                "small": small_extra,
                "note": "quick mode: sizes 10x smaller than the full run" if quick else "full sizes",
            },
        ),
    ]


async def run(dsn: str, quick: bool) -> list[Result]:
    """The event store scenario: guarded append throughput, then claim_next latency at two sizes."""
    sizes = QUICK if quick else FULL
    schema = "bench_" + uuid.uuid4().hex[:12]
    b = await bus.connect(dsn, schema=schema)
    try:
        results = await append_rows(b, sizes)
        results.extend(await claim_rows(b, sizes, quick))
    finally:
        await b.close()
        await rawpeers.drop_schema(dsn, schema)
    return results


if __name__ == "__main__":
    from rich.console import Console

    from benchmarks.harness import main

    raise SystemExit(main(SCENARIO, quick="--quick" in sys.argv, console=Console()))
