"""Throughput while another session holds an old snapshot: does the bus depend on the xmin horizon?

A REPEATABLE READ transaction that stays open (a report, a `pg_dump`, a
forgotten `BEGIN` in psql) holds the database's xmin horizon: from its start
on, no row version anyone deletes or updates can be vacuumed or pruned. Every
row the bus updates per operation then grows a version chain that each later
statement walks, and the bus slows down the longer the snapshot stays.

The load: a steady 400 msg/s to a pubsub topic (4 partitions) read by one
consumer group (a handler subscription), and 400 jobs/s to a queue topic
(4 partitions) drained by two queue consumers (take + ack_many). Each publish
is its own `publish` call, paced on a schedule (a slow call does not lower
the offered load), and timed. Three phases run back to back:

* **free**: nobody holds a snapshot;
* **held**: a second session holds a REPEATABLE READ snapshot all along;
* **after**: the snapshot is released (autovacuum may catch up).

Each phase starts with a `CHECKPOINT` (when the role may run one: a superuser
or `pg_checkpoint`), so each meets the server's checkpoint cycle at the same
point. Without it the comparison is skewed by the server, not by the hold: a
server the bench starts itself has its first timed checkpoint
`checkpoint_timeout` (5 min) later, which falls in the held phase on every
such run, and after a checkpoint the first change to each page writes the
whole page to the WAL, which commits then wait to flush.

Per phase: delivered messages/s (handler calls), queue jobs acked/s, publish
p50/p99 (every publish of both topics), and per table the dead tuples at the
end of the phase and the row versions written per second (updates + deletes)
during it. Two rows say how far the machine can be trusted in each phase: how
late the bench's own event loop ran (p99), and the share of CPU time the
hypervisor gave to other guests (steal, from /proc/stat). On a small shared
machine both move publish latency by several times for tens of seconds, with
or without a hold: a ratio between phases whose steal differs measures the
machine. So the publish p99 is also given over only the 10 s windows in which
the hypervisor took less than 2 % of the CPU time (and how many there were):
a comparison of the database's part, where the phases have such windows.
The rows compare held and after against free, measured in the same run.
Targets: during the hold, delivered and queue throughput >= 0.95x free and
publish p99 <= 1.5x free.

Knobs (environment): BUS_BENCH_XMIN_HOLD (seconds of the held phase, default
300; --quick 20), BUS_BENCH_XMIN_FREE and BUS_BENCH_XMIN_AFTER (default 60;
--quick 10), BUS_BENCH_XMIN_RATE (messages/s to the topic, default 400),
BUS_BENCH_XMIN_QUEUE_RATE (jobs/s to the queue, default the same; 0: no queue
load, to tell the two apart). Only the given DSN
is contacted; the run drops its own schema.

Run it alone with `bus bench xmin` (or `python -m benchmarks.xmin`).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import asyncpg

import bus
from benchmarks.result import Result

SCENARIO = "xmin"
TOPIC = "bench.xmin.events"
QUEUE = "bench.xmin.jobs"
GROUP = "xmin-readers"
PARTITIONS = 4
PAYLOAD = b'{"order": 12345, "amount": 1234.5, "kind": "invoice"}'
TICK = 0.01
WINDOW = 10.0  # seconds per window of the p99 over the windows the hypervisor left alone
STEAL_LIMIT = 0.02  # a window is left alone when less than this share of the CPU time was stolen
# The tables a hot path writes per operation; their dead tuples are what a held snapshot keeps.
TABLES = (
    "partitions",
    "log_heads",
    "offsets",
    "queue_jobs",
    "queue_leases",
    "queue_frontiers",
    "queue_frontier_heads",
    "members",
    "groups",
)
TABLE_STATS = """
SELECT relname, n_dead_tup, n_tup_upd + n_tup_del AS versions
FROM pg_stat_user_tables WHERE schemaname = $1 AND relname = ANY($2::text[])
"""


@dataclass
class Phase:
    """What one phase measured."""

    name: str
    seconds: float = 0.0
    delivered: int = 0
    acked: int = 0
    latencies: list[float] = field(default_factory=list)  # publish calls, ms
    windows: dict[int, list[float]] = field(default_factory=dict)  # the same, per WINDOW seconds
    cpu: list[tuple[float, int, int]] = field(default_factory=list)  # (at, stolen, total) per second
    lags: list[float] = field(default_factory=list)  # the bench's event loop, ms late per TICK
    started: float = 0.0
    dead: dict[str, int] = field(default_factory=dict)  # at the end of the phase
    versions: dict[str, int] = field(default_factory=dict)  # updates + deletes during the phase

    @property
    def delivered_rate(self) -> float:
        return self.delivered / self.seconds if self.seconds else 0.0

    @property
    def acked_rate(self) -> float:
        return self.acked / self.seconds if self.seconds else 0.0

    def quantile(self, q: float) -> float:
        return _quantile(self.latencies, q)

    @property
    def steal(self) -> float | None:
        """The share of the CPUs' time the hypervisor took during the phase (Linux), or None."""
        total = sum(t for _, _, t in self.cpu)
        return sum(s for _, s, _ in self.cpu) / total if total else None

    def calm_windows(self) -> list[int]:
        """The phase's windows in which the hypervisor took less than STEAL_LIMIT of the CPU time."""
        stolen: dict[int, list[int]] = {}
        for at, steal, total in self.cpu:
            sums = stolen.setdefault(int((at - self.started) // WINDOW), [0, 0])
            sums[0] += steal
            sums[1] += total
        return sorted(k for k, (steal, total) in stolen.items() if total and steal / total < STEAL_LIMIT)

    def calm_p99(self) -> float:
        """Publish p99 over the calm windows only (0.0 when none had enough publishes)."""
        latencies = [ms for k in self.calm_windows() for ms in self.windows.get(k, [])]
        return _quantile(latencies, 0.99) if len(latencies) >= 100 else 0.0

    def record(self, started: float, ms: float) -> None:
        self.latencies.append(ms)
        self.windows.setdefault(int((started - self.started) // WINDOW), []).append(ms)


def _quantile(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def _cpu_times() -> tuple[int, int] | None:
    """(stolen, total) time of all CPUs since boot in clock ticks, from /proc/stat; None off Linux."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()[1:9]
    except OSError:
        return None
    values = [int(v) for v in fields]
    return values[7], sum(values)


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return default if not raw else float(raw)


async def _table_stats(conn: asyncpg.Connection, schema: str) -> tuple[dict[str, int], dict[str, int]]:
    # Statistics reach the cumulative view when a backend flushes them (at most a second late):
    # a fresh snapshot of them per call.
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    rows = await conn.fetch(TABLE_STATS, schema, list(TABLES))
    return {r["relname"]: int(r["n_dead_tup"]) for r in rows}, {
        r["relname"]: int(r["versions"]) for r in rows
    }


async def _checkpoint(conn: asyncpg.Connection) -> bool:
    """A checkpoint now, when the role may run one; whether it ran."""
    try:
        await conn.execute("CHECKPOINT")
    except asyncpg.InsufficientPrivilegeError:
        return False
    return True


async def measure(
    dsn: str, free: float, hold: float, after: float, rate: float, queue_rate: float
) -> list[Phase]:
    """Run the three phases on a fresh schema; returns them in order."""
    schema = "bench_" + uuid.uuid4().hex[:10]
    b = await bus.connect(dsn, schema=schema)
    stats_conn = await asyncpg.connect(dsn)
    holder = await asyncpg.connect(dsn)
    stop = asyncio.Event()
    current: list[Phase] = [Phase("warmup")]
    errors: list[str] = []
    in_flight: set[asyncio.Task[None]] = set()
    try:
        await b.create_topic(TOPIC, partitions=PARTITIONS)
        await b.create_topic(QUEUE, partitions=PARTITIONS, semantics="queue")

        async def handler(_m: bus.Message) -> None:
            current[0].delivered += 1

        sub = await b.subscribe(GROUP, handler, topics=[TOPIC], start="latest")

        async def one_publish(topic: str) -> None:
            started = time.perf_counter()
            try:
                await b.publish(topic, PAYLOAD)
            except (bus.BusError, asyncpg.PostgresError) as exc:  # counted and reported; the run goes on
                errors.append(repr(exc))
                return
            current[0].record(started, (time.perf_counter() - started) * 1000)

        async def produce(topic: str, rate: float) -> None:
            owed = 0.0
            next_at = time.perf_counter()
            while not stop.is_set():
                owed += rate * TICK
                while owed >= 1:
                    owed -= 1
                    task = asyncio.create_task(one_publish(topic))
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
                next_at += TICK
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))

        async def drain() -> None:
            async with b.queue_consumer(QUEUE, visibility_timeout=30.0) as q:
                while not stop.is_set():
                    try:
                        jobs = await q.take(max_messages=50, timeout=0.2)
                        if jobs:
                            await q.ack_many(jobs)
                            current[0].acked += len(jobs)
                    except (bus.BusError, asyncpg.PostgresError) as exc:
                        errors.append(repr(exc))

        async def loop_lag() -> None:
            # How late the bench's own event loop runs: a publish that waited for the CPU is not slow
            # in the database, and a machine whose CPUs another tenant takes shows here first.
            while not stop.is_set():
                at = time.perf_counter()
                await asyncio.sleep(TICK)
                current[0].lags.append((time.perf_counter() - at - TICK) * 1000)

        async def cpu_sampler() -> None:
            # The CPU time stolen per second, so that windows the hypervisor left alone can be told.
            last = _cpu_times()
            while not stop.is_set() and last is not None:
                await asyncio.sleep(1.0)
                now = _cpu_times()
                if now is None:
                    return
                current[0].cpu.append((time.perf_counter(), now[0] - last[0], now[1] - last[1]))
                last = now

        tasks = [asyncio.create_task(produce(TOPIC, rate))]
        tasks += [asyncio.create_task(loop_lag()), asyncio.create_task(cpu_sampler())]
        if queue_rate > 0:
            tasks.append(asyncio.create_task(produce(QUEUE, queue_rate)))
            tasks += [asyncio.create_task(drain()) for _ in range(2)]
        # Warm-up: prepared statements, and the group assigned and delivering (on a loaded machine
        # the assignment alone can outlast a short free phase, which would then measure nothing).
        warmup = current[0]
        await asyncio.sleep(min(5.0, free / 2))
        for _ in range(600):
            if warmup.delivered and (queue_rate <= 0 or warmup.acked):
                break
            await asyncio.sleep(0.1)
        phases: list[Phase] = []
        for name, seconds in (("free", free), ("held", hold), ("after", after)):
            phase = Phase(name)
            if name == "held":
                await holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                await holder.fetchval("SELECT count(*) FROM pg_class")  # takes the snapshot
            checkpointed = await _checkpoint(stats_conn)
            _, versions_before = await _table_stats(stats_conn, schema)
            phase.started = started = time.perf_counter()
            current[0] = phase
            await asyncio.sleep(seconds)
            phase.seconds = time.perf_counter() - started
            current[0] = Phase("tail")
            phase.dead, versions_after = await _table_stats(stats_conn, schema)
            phase.versions = {t: versions_after.get(t, 0) - versions_before.get(t, 0) for t in versions_after}
            if name == "held":
                await holder.execute("ROLLBACK")
            phases.append(phase)
        stop.set()
        await asyncio.gather(*tasks)
        if in_flight:
            await asyncio.gather(*in_flight, return_exceptions=True)
        await sub.stop()
        if errors:
            phases[0].dead["errors"] = len(errors)
        phases[0].dead["checkpointed"] = int(checkpointed)
        return phases
    finally:
        stop.set()
        await holder.close()
        await stats_conn.close()
        await b.close()
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')  # generated bench schema name
        finally:
            await conn.close()


def table(phases: list[Phase]) -> list[list[str]]:
    """The free / held / after table with the ratios against free, as rows of text cells."""
    free = phases[0]
    metrics: list[tuple[str, Any]] = [
        ("delivered msg/s", lambda p: p.delivered_rate),
        ("queue jobs/s", lambda p: p.acked_rate),
        ("publish p50 ms", lambda p: p.quantile(0.5)),
        ("publish p99 ms", lambda p: p.quantile(0.99)),
        ("bench event loop lag p99 ms", lambda p: _quantile(p.lags, 0.99)),
        ("CPU time stolen by the hypervisor %", lambda p: 100 * (p.steal or 0.0)),
        (f"{WINDOW:.0f} s windows with < {STEAL_LIMIT:.0%} stolen", lambda p: len(p.calm_windows())),
        ("publish p99 ms in those windows", lambda p: p.calm_p99()),
    ]
    metrics += [(f"dead tuples {t}", lambda p, t=t: p.dead.get(t, 0)) for t in TABLES]
    metrics += [
        (f"versions written/s {t}", lambda p, t=t: p.versions.get(t, 0) / p.seconds if p.seconds else 0.0)
        for t in TABLES
    ]
    out = [["measurement", *[p.name for p in phases], *[f"{p.name}/free" for p in phases[1:]]]]
    for label, get in metrics:
        base = float(get(free))
        values = [float(get(p)) for p in phases]
        ratios = [f"{v / base:.2f}x" if base else "-" for v in values[1:]]
        out.append([label, *[f"{v:,.2f}" if v < 100 else f"{v:,.0f}" for v in values], *ratios])
    return out


async def run(dsn: str, quick: bool) -> list[Result]:
    """The rows: throughput and publish latency during and after the hold, against the free phase."""
    hold = _env_number("BUS_BENCH_XMIN_HOLD", 20.0 if quick else 300.0)
    free = _env_number("BUS_BENCH_XMIN_FREE", 10.0 if quick else 60.0)
    after = _env_number("BUS_BENCH_XMIN_AFTER", 10.0 if quick else 60.0)
    rate = _env_number("BUS_BENCH_XMIN_RATE", 400.0)
    queue_rate = _env_number("BUS_BENCH_XMIN_QUEUE_RATE", rate)
    phases = await measure(dsn, free, hold, after, rate, queue_rate)
    free_p, held, aft = phases
    extra = {
        "free_s": free,
        "hold_s": hold,
        "after_s": after,
        "rate_topic": rate,
        "rate_queue": queue_rate,
        "table": table(phases),
        "errors": free_p.dead.pop("errors", 0),
        "checkpoint_per_phase": bool(free_p.dead.pop("checkpointed", 0)),
    }
    rows: list[Result] = []
    for phase in (held, aft):
        during = f"{phase.name} {phase.seconds:.0f} s" if phase is held else "after the hold"
        rows += [
            Result(
                SCENARIO,
                f"delivered msg/s, {during} (baseline: free)",
                phase.delivered_rate,
                "msg/s",
                free_p.delivered_rate,
                "free phase",
                target=">= 0.95x free" if phase is held else None,
                extra=extra if phase is held else {},
            ),
            Result(
                SCENARIO,
                f"queue jobs/s, {during} (baseline: free)",
                phase.acked_rate,
                "jobs/s",
                free_p.acked_rate,
                "free phase",
                target=">= 0.95x free" if phase is held else None,
            ),
            Result(
                SCENARIO,
                f"publish p50, {during} (baseline: free)",
                phase.quantile(0.5),
                "ms",
                free_p.quantile(0.5),
                "free phase",
                higher_is_better=False,
            ),
            Result(
                SCENARIO,
                f"publish p99, {during} (baseline: free)",
                phase.quantile(0.99),
                "ms",
                free_p.quantile(0.99),
                "free phase",
                higher_is_better=False,
                target="<= 1.5x free" if phase is held else None,
            ),
            Result(
                SCENARIO,
                f"publish p99 in {WINDOW:.0f} s windows with < {STEAL_LIMIT:.0%} of the CPU stolen,"
                f" {during} (baseline: free)",
                phase.calm_p99(),
                "ms",
                free_p.calm_p99(),
                "free phase",
                higher_is_better=False,
            ),
        ]
    for t in TABLES:
        if held.dead.get(t, 0) or free_p.dead.get(t, 0):
            rows.append(
                Result(
                    SCENARIO,
                    f"dead tuples in {t} at the end of the hold (baseline: free)",
                    float(held.dead.get(t, 0)),
                    "rows",
                    float(free_p.dead.get(t, 0)),
                    "free phase",
                    higher_is_better=False,
                )
            )
    return rows


def print_table(rows: list[Result], labels: int = 1) -> None:
    """The table of the first row's `extra["table"]`: its first `labels` columns left-aligned."""
    cells: list[list[str]] = rows[0].extra["table"]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    for r in cells:
        print(
            "  ".join(
                c.rjust(w) if i >= labels else c.ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    print("publish errors:", rows[0].extra["errors"])
    print(
        "a checkpoint before each phase:",
        "yes" if rows[0].extra["checkpoint_per_phase"] else "no (not allowed)",
    )


if __name__ == "__main__":
    import sys

    from bus.server.embedded import ensure_server

    target = os.environ.get("BUS_DSN") or ensure_server().dsn
    result = asyncio.run(run(target, quick="--quick" in sys.argv))
    print_table(result)
