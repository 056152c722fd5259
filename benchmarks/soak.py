"""Soak: steady producers, three consuming groups, short retention, for minutes; does the bus stay flat?

One pubsub topic (8 partitions, cleanup="delete") with a retention of a tenth
of the run, so most of what is published is retired while the run goes on.
Producers publish at a fixed rate (batches every 50 ms); three groups drain
the topic with claims and acks; the Bus's own cleaner retires history (every
second). Every tenth of the run ("per minute" at the default 10 minutes) the
sampler records publish and consume throughput, total lag, the messages
table's size on disk (heap + indexes + TOAST of every segment: the whole
partition tree), the rows still retained, dead tuples and autovacuum runs.

Targets: throughput in the last fifth >= 0.9x the first fifth (publish and
consume); on-disk size <= 2x the retained rows' own size (retained rows x the
bytes per row of a freshly built copy with the same indexes); dead tuples left
by retention ~ 0. The per-sample table goes to `extra` and a chart to
`benchmarks/results/<date>-soak[-LABEL].png`.

Size knobs (environment): BUS_BENCH_SOAK_SECONDS (default 600; --quick 60),
BUS_BENCH_SOAK_RATE (messages/s, default 2000), BUS_BENCH_SOAK_LABEL (a chart
file suffix, e.g. "before"). Only the given DSN (127.0.0.1 for the embedded
server) is contacted; the run stops by itself.

Run it alone with `bus bench soak` (or `python -m benchmarks.soak`).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import asyncpg

import bus
from benchmarks.result import Result

SCENARIO = "soak"
TOPIC = "bench.soak"
PARTITIONS = 8
GROUPS = ("audit", "billing", "search")
PAYLOAD = b"x" * 200
TICK = 0.05
RESULTS_DIR = Path(__file__).resolve().parent / "results"
MIB = 1024 * 1024

# The whole partition tree of `messages` (a plain table is its own tree).
TREE_STATS = """
SELECT coalesce(sum(pg_total_relation_size(t.relid)), 0)::bigint AS bytes,
       coalesce(sum(s.n_dead_tup), 0)::bigint AS dead,
       coalesce(sum(s.n_live_tup), 0)::bigint AS live,
       count(*) FILTER (WHERE t.isleaf)::int AS leaves
FROM (SELECT relid, isleaf FROM pg_partition_tree('messages')
      UNION ALL  -- a plain table is not a tree: itself
      SELECT 'messages'::regclass, true WHERE NOT EXISTS (SELECT 1 FROM pg_partition_tree('messages'))) t
LEFT JOIN pg_stat_user_tables s ON s.relid = t.relid
"""
# Autovacuum runs per leaf: a dropped segment takes its counter with it, so the
# soak adds up each leaf's increases itself.
LEAF_AUTOVACUUMS = """
SELECT t.relid::oid AS relid, coalesce(s.autovacuum_count, 0)::bigint AS n
FROM (SELECT relid FROM pg_partition_tree('messages') WHERE isleaf
      UNION ALL
      SELECT 'messages'::regclass WHERE NOT EXISTS (SELECT 1 FROM pg_partition_tree('messages'))) t
LEFT JOIN pg_stat_user_tables s ON s.relid = t.relid
"""
RETAINED = "SELECT coalesce(sum(p.log_end - p.log_start), 0)::bigint, coalesce(sum(p.log_end), 0)::bigint FROM partitions p"
LAG = """
SELECT coalesce(sum(p.log_end - GREATEST(o.committed, p.log_start)), 0)::bigint
FROM offsets o JOIN partitions p ON p.id = o.partition_id
"""
# A fresh copy of N rows like the soak's, with the same indexes: bytes per retained row.
REF_CREATE = """
CREATE TEMP TABLE soak_ref AS
SELECT g::bigint AS partition_id, g::bigint AS "offset", NULL::text AS key, NULL::jsonb AS headers,
       $1::bytea AS payload, clock_timestamp() AS created_at
FROM generate_series(1, $2) g
"""
REF_INDEX_1 = 'CREATE INDEX ON soak_ref (partition_id, "offset", created_at)'
REF_INDEX_2 = "CREATE INDEX ON soak_ref (partition_id, created_at)"
REF_SIZE = "SELECT pg_total_relation_size('soak_ref')"
REF_DROP = "DROP TABLE soak_ref"


@dataclass
class Sample:
    """One sampling interval."""

    t: float  # seconds since start
    publish_rate: float  # msg/s over the interval
    consume_rate: float  # deliveries/s over the interval (all groups)
    lag: int  # messages behind, all groups
    bytes: int  # messages tree on disk
    retained_rows: int
    retained_bytes: float  # retained rows x fresh bytes per row
    dead: int
    live: int
    autovacuums: int  # cumulative, over every leaf that existed
    leaves: int


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return default if not raw else float(raw)


async def _bytes_per_row(b: bus.Bus) -> float:
    n = 20_000
    async with b.pool.acquire() as conn, conn.transaction():
        await conn.execute(REF_CREATE, PAYLOAD, n)
        await conn.execute(REF_INDEX_1)
        await conn.execute(REF_INDEX_2)
        size = int(await conn.fetchval(REF_SIZE))
        await conn.execute(REF_DROP)
    return size / n


async def soak(dsn: str, seconds: float, rate: float) -> tuple[list[Sample], dict[str, Any]]:
    """Run the soak; returns the samples and a summary."""
    schema = "bench_" + uuid.uuid4().hex[:10]
    retention = max(seconds / 10, 5.0)
    interval = seconds / 10
    b = await bus.connect(dsn, schema=schema, cleaner_interval=1.0)
    published = 0
    consumed = 0
    stop = asyncio.Event()
    errors: list[str] = []
    try:
        await b.create_topic(TOPIC, partitions=PARTITIONS, retention=timedelta(seconds=retention))
        per_row = await _bytes_per_row(b)
        for g in GROUPS:  # cursors from the start: every group holds retention from message 0
            first = await b.claim(g, topic=TOPIC, worker_id="w0", start="earliest", max_messages=1)
            if first is not None:
                await first.release()

        async def produce() -> None:
            nonlocal published
            per_tick = rate * TICK
            owed = 0.0
            next_at = time.perf_counter()
            while not stop.is_set():
                owed += per_tick
                n = int(owed)
                if n:
                    owed -= n
                    try:
                        await b.publish_many(TOPIC, [PAYLOAD] * n)
                        published += n
                    except (
                        bus.BusError,
                        asyncpg.PostgresError,
                    ) as exc:  # counted and reported; the soak goes on
                        errors.append(repr(exc))
                next_at += TICK
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))

        async def consume(group: str, worker: str) -> None:
            nonlocal consumed
            while not stop.is_set():
                try:
                    c = await b.claim(group, topic=TOPIC, worker_id=worker, max_messages=500)
                    if c is None:
                        await asyncio.sleep(0.02)
                        continue
                    await c.ack()
                    consumed += len(c.messages)
                except (bus.BusError, asyncpg.PostgresError) as exc:
                    errors.append(repr(exc))

        tasks = [asyncio.create_task(produce())]
        tasks += [asyncio.create_task(consume(g, f"w{i}")) for g in GROUPS for i in range(2)]
        samples: list[Sample] = []
        seen: dict[int, int] = {}
        autovacuums = 0
        started = time.perf_counter()
        last_t, last_pub, last_con = started, 0, 0
        try:
            while (now := time.perf_counter()) - started < seconds:
                await asyncio.sleep(min(interval, seconds - (now - started)))
                now = time.perf_counter()
                pub, con = published, consumed
                async with b.pool.acquire() as conn:
                    tree = await conn.fetchrow(TREE_STATS)
                    retained, _ = await conn.fetchrow(RETAINED)
                    lag = int(await conn.fetchval(LAG))
                    for leaf in await conn.fetch(LEAF_AUTOVACUUMS):
                        relid, n = int(leaf["relid"]), int(leaf["n"])
                        autovacuums += max(0, n - seen.get(relid, 0))
                        seen[relid] = n
                samples.append(
                    Sample(
                        t=round(now - started, 1),
                        publish_rate=(pub - last_pub) / (now - last_t),
                        consume_rate=(con - last_con) / (now - last_t),
                        lag=lag,
                        bytes=int(tree["bytes"]),
                        retained_rows=int(retained),
                        retained_bytes=int(retained) * per_row,
                        dead=int(tree["dead"]),
                        live=int(tree["live"]),
                        autovacuums=autovacuums,
                        leaves=int(tree["leaves"]),
                    )
                )
                last_t, last_pub, last_con = now, pub, con
        finally:
            stop.set()
            for outcome in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(outcome, BaseException):
                    raise outcome
        async with b.pool.acquire() as conn:
            retained, total = await conn.fetchrow(RETAINED)
        summary = {
            "seconds": seconds,
            "rate": rate,
            "retention_s": retention,
            "published": published,
            "consumed": consumed,
            "retired_rows": int(total) - int(retained),
            "bytes_per_row_fresh": round(per_row, 1),
            "errors": len(errors),
            "first_errors": errors[:3],
        }
        return samples, summary
    finally:
        stop.set()
        await b.close()  # the cleaner first: it must not tick on a dropped schema
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')  # generated bench schema name
        finally:
            await conn.close()


def _fifths(samples: list[Sample], attr: str) -> tuple[float, float]:
    k = max(1, len(samples) // 5)
    first = [getattr(s, attr) for s in samples[:k]]
    last = [getattr(s, attr) for s in samples[-k:]]
    return sum(first) / len(first), sum(last) / len(last)


def chart(samples: list[Sample], path: Path, title: str) -> Path:
    """Four panels: throughput, lag, size on disk vs retained, dead tuples and autovacuum runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ts = [s.t / 60 for s in samples]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7))
    ax = axes[0][0]
    ax.plot(ts, [s.publish_rate for s in samples], marker="o", label="publish")
    ax.plot(ts, [s.consume_rate / len(GROUPS) for s in samples], marker="o", label="consume (per group)")
    ax.set_ylabel("msg/s")
    ax.set_title("Throughput")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax = axes[0][1]
    ax.plot(ts, [s.lag for s in samples], marker="o", color="#c05621")
    ax.set_ylabel("messages")
    ax.set_title("Lag (3 groups)")
    ax.set_ylim(bottom=0)
    ax = axes[1][0]
    ax.plot(ts, [s.bytes / MIB for s in samples], marker="o", label="on disk (all segments)")
    ax.plot(ts, [s.retained_bytes / MIB for s in samples], marker="o", label="retained rows")
    ax.plot(
        ts, [2 * s.retained_bytes / MIB for s in samples], linestyle="--", color="grey", label="2x retained"
    )
    ax.set_ylabel("MiB")
    ax.set_title("messages: size on disk")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax = axes[1][1]
    ax.plot(ts, [s.dead for s in samples], marker="o", color="#e53e3e", label="dead tuples")
    ax.set_ylabel("dead tuples")
    ax.set_ylim(bottom=0)
    ax2 = ax.twinx()
    ax2.step(ts, [s.autovacuums for s in samples], where="post", color="#2f855a", label="autovacuum runs")
    ax2.set_ylabel("autovacuum runs (cumulative)")
    ax.set_title("Dead tuples and autovacuum")
    for a in axes[1]:
        a.set_xlabel("minutes")
    for a in axes[0]:
        a.set_xlabel("minutes")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


async def run(dsn: str, quick: bool) -> list[Result]:
    """The soak rows: throughput stability, size on disk vs retained, dead tuples, autovacuum runs."""
    seconds = _env_number("BUS_BENCH_SOAK_SECONDS", 60.0 if quick else 600.0)
    rate = _env_number("BUS_BENCH_SOAK_RATE", 2000.0)
    label = os.environ.get("BUS_BENCH_SOAK_LABEL", "")
    samples, summary = await soak(dsn, seconds, rate)
    stem = date.today().isoformat() + ("-quick" if quick else "") + "-soak" + (f"-{label}" if label else "")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = chart(
        samples,
        RESULTS_DIR / f"{stem}.png",
        f"soak {seconds:.0f} s at {rate:.0f} msg/s, retention {summary['retention_s']:.0f} s{' (' + label + ')' if label else ''}",
    )
    pub_first, pub_last = _fifths(samples, "publish_rate")
    con_first, con_last = _fifths(samples, "consume_rate")
    # Size is judged once retention is in force (from the second sample on, the first holds no history yet).
    steady = samples[1:] or samples
    worst = max(s.bytes / s.retained_bytes if s.retained_bytes else 0.0 for s in steady)
    table = [asdict(s) for s in samples]
    extra = {**summary, "samples": table, "chart": path.name}
    name = f"{label}: " if label else ""
    return [
        Result(
            SCENARIO,
            f"{name}publish msg/s, last fifth (baseline: first fifth)",
            pub_last,
            "msg/s",
            pub_first,
            "first fifth",
            target=">= 0.9x the first fifth",
            extra=extra,
        ),
        Result(
            SCENARIO,
            f"{name}consume msg/s of 3 groups, last fifth (baseline: first fifth)",
            con_last,
            "msg/s",
            con_first,
            "first fifth",
            target=">= 0.9x the first fifth",
        ),
        Result(
            SCENARIO,
            f"{name}on-disk size / retained rows' size, worst sample",
            worst,
            "x",
            higher_is_better=False,
            target="<= 2",
            extra={"bytes_end": samples[-1].bytes, "retained_bytes_end": samples[-1].retained_bytes},
        ),
        Result(
            SCENARIO,
            f"{name}dead tuples in messages, worst sample",
            float(max(s.dead for s in samples)),
            "rows",
            higher_is_better=False,
            target="<= 1000",
            extra={"retired_rows": summary["retired_rows"]},
        ),
        Result(
            SCENARIO,
            f"{name}autovacuum runs on messages",
            float(samples[-1].autovacuums),
            "runs",
            higher_is_better=False,
        ),
    ]


def print_samples(rows: list[Result]) -> None:
    """The per-interval table, as the closing note shows it."""
    extra = rows[0].extra
    print(
        f"{'min':>5} {'pub/s':>7} {'con/s':>7} {'lag':>7} {'disk MiB':>9} {'retained MiB':>12} {'dead':>8} {'autovac':>7} {'leaves':>6}"
    )
    for s in extra["samples"]:
        print(
            f"{s['t'] / 60:5.1f} {s['publish_rate']:7.0f} {s['consume_rate']:7.0f} {s['lag']:7d} "
            f"{s['bytes'] / MIB:9.1f} {s['retained_bytes'] / MIB:12.1f} {s['dead']:8d} {s['autovacuums']:7d} {s['leaves']:6d}"
        )


if __name__ == "__main__":
    import sys

    from bus.server.embedded import ensure_server

    target = os.environ.get("BUS_DSN") or ensure_server().dsn
    result = asyncio.run(run(target, quick="--quick" in sys.argv))
    for row in result:
        ratio = "" if row.ratio is None else f" ({row.ratio:.2f}x of {row.baseline:.1f})"
        print(f"{row.name:70s} {row.value:12.2f} {row.unit}{ratio}")
    print_samples(result)
    print("chart:", RESULTS_DIR / str(result[0].extra["chart"]))
