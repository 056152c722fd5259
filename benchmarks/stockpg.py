"""The bus on a packaged PostgreSQL with its defaults: Debian's PostgreSQL 15, JIT on.

Packaged and managed PostgreSQL servers mostly have JIT compilation on
(`jit = on`, `jit_above_cost = 100000`); the embedded server's build has none.
A statement priced above the threshold is compiled at every execution, tens of
milliseconds for a statement that reads one row. This scenario runs the hot
paths of the bus on Debian's PostgreSQL 15 (scripts/pg15.sh: its default
configuration, with `pg_stat_statements` loaded to count what was compiled) in
two databases of the same server: one with the server's defaults, one with
`ALTER DATABASE ... SET jit = off`, turn about. Each row is the default
database's number against the `jit = off` database's: the target is that JIT
costs the bus nothing (≤ 1.2×), and the `jit_functions` column of
`pg_stat_statements` says how many functions the server compiled for the bus's
statements (0 is the target).

Rows: `take(max_messages=1)` + `ack` (median), `take(10)` + `ack_many`
sequentially (jobs/s), publish → a waiting `take` (median), sequential
`publish` (median).

Run it alone with `bus bench stockpg [--quick]`; it needs Debian's postgresql-15
(scripts/ensure-pg15.sh) and starts its own cluster under `.bench/stockpg`
(`$BUS_STOCKPG_HOME`), stopped at the end.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import asyncpg

import bus
from benchmarks.result import Result

SCENARIO = "stockpg"
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "pg15.sh"
PG15_BIN = Path(os.environ.get("PG15_BIN", "/usr/lib/postgresql/15/bin"))
DEFAULT_DB = "bench_stock_default"
JIT_OFF_DB = "bench_stock_jit_off"
SCHEMA = "bench_stock"
TARGET = "≤ 1.2× jit=off"


@dataclass(frozen=True)
class Sizes:
    rounds: int
    singles: int  # take(1)+ack and publish samples per round
    batches: int  # take(10)+ack_many calls per round
    wakes: int  # publish -> waiting take samples per round


FULL = Sizes(rounds=3, singles=300, batches=60, wakes=60)
QUICK = Sizes(rounds=1, singles=40, batches=8, wakes=10)


class StockServer:
    """Debian's PostgreSQL 15 started by scripts/pg15.sh under `home`, defaults kept, pg_stat_statements loaded."""

    def __init__(self, home: Path) -> None:
        self.home = home

    def _run(self, command: str) -> str:
        env = {
            **os.environ,
            "BUS_HOME": str(self.home),
            "PG15_OPTS": "-c shared_preload_libraries=pg_stat_statements -c pg_stat_statements.track=all",
        }
        done = subprocess.run(
            ["sh", str(SCRIPT), command], env=env, check=True, capture_output=True, text=True
        )
        return done.stdout.strip()

    def start(self) -> str:
        """The server's DSN (database `postgres`), started if it was not running."""
        return self._run("start")

    def stop(self) -> None:
        self._run("stop")


def available() -> bool:
    return (PG15_BIN / "postgres").exists()


def database_dsn(dsn: str, database: str) -> str:
    return dsn.rsplit("/", 1)[0] + "/" + database


async def prepare_databases(dsn: str) -> None:
    """The two databases of the comparison (made fresh), and pg_stat_statements in the default one."""
    conn = await asyncpg.connect(dsn)
    try:
        for name in (DEFAULT_DB, JIT_OFF_DB):
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            await conn.execute(f'CREATE DATABASE "{name}"')
        await conn.execute(f'ALTER DATABASE "{JIT_OFF_DB}" SET jit = off')
    finally:
        await conn.close()
    conn = await asyncpg.connect(database_dsn(dsn, DEFAULT_DB))
    try:
        await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    finally:
        await conn.close()


async def jit_compiled(dsn: str, database: str) -> list[tuple[str, int, int]]:
    """(statement, calls, functions compiled) of every statement run in `database` that JIT compiled."""
    conn = await asyncpg.connect(database_dsn(dsn, DEFAULT_DB))
    try:
        rows = await conn.fetch(
            """SELECT s.query, s.calls, s.jit_functions
               FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
               WHERE d.datname = $1 AND s.jit_functions > 0
               ORDER BY s.jit_functions DESC""",
            database,
        )
    finally:
        await conn.close()
    return [(r["query"], r["calls"], r["jit_functions"]) for r in rows]


async def reset_statements(dsn: str) -> None:
    conn = await asyncpg.connect(database_dsn(dsn, DEFAULT_DB))
    try:
        await conn.execute("SELECT pg_stat_statements_reset()")
    finally:
        await conn.close()


@asynccontextmanager
async def bus_on(dsn: str, database: str) -> AsyncIterator[bus.Bus]:
    async with bus.connect(database_dsn(dsn, database), schema=SCHEMA) as b:
        yield b


async def measure(b: bus.Bus, sizes: Sizes, tag: str) -> dict[str, float]:
    """One round of every row on `b`, on topics of their own (dropped after)."""
    jobs, events = f"stock.jobs.{tag}", f"stock.events.{tag}"
    await b.create_topic(jobs, partitions=1, semantics="queue")
    await b.create_topic(events, partitions=1)
    out: dict[str, float] = {}
    try:
        async with b.queue_consumer(jobs, visibility_timeout=30) as q:
            await b.publish_many(jobs, [bus.Outgoing({"n": i}) for i in range(sizes.singles)])
            samples = []
            for _ in range(sizes.singles):
                started = time.perf_counter()
                got = await q.take(max_messages=1, timeout=5.0)
                await q.ack(got[0])
                samples.append(time.perf_counter() - started)
            out["take1"] = statistics.median(samples) * 1000

            await b.publish_many(jobs, [bus.Outgoing({"n": i}) for i in range(sizes.batches * 10)])
            started = time.perf_counter()
            done = 0
            for _ in range(sizes.batches):
                got = await q.take(max_messages=10, timeout=5.0)
                await q.ack_many(got)
                done += len(got)
            out["take10"] = done / (time.perf_counter() - started)

            samples = []
            for i in range(sizes.wakes):
                waiter = asyncio.create_task(q.take(max_messages=1, timeout=5.0))
                await asyncio.sleep(0.02)  # the take is waiting when the job is published
                started = time.perf_counter()
                await b.publish(jobs, {"wake": i})
                got = await waiter
                samples.append(time.perf_counter() - started)
                await q.ack(got[0])
            out["wake"] = statistics.median(samples) * 1000

        samples = []
        for i in range(sizes.singles):
            started = time.perf_counter()
            await b.publish(events, {"n": i})
            samples.append(time.perf_counter() - started)
        out["publish"] = statistics.median(samples) * 1000
    finally:
        await b.delete_topic(jobs)
        await b.delete_topic(events)
    return out


ROWS: dict[str, tuple[str, str, bool]] = {
    "take1": ("take(max_messages=1) + ack, median", "ms", False),
    "take10": ("take(10) + ack_many, sequential", "jobs/s", True),
    "wake": ("publish -> a waiting take, median", "ms", False),
    "publish": ("sequential publish, median", "ms", False),
}


def best(values: list[float], higher_is_better: bool) -> float:
    return max(values) if higher_is_better else min(values)


async def compare(dsn: str, sizes: Sizes) -> tuple[list[Result], list[tuple[str, int, int]]]:
    """Every row on the default database and on the jit=off one, turn about; best of the rounds."""
    await prepare_databases(dsn)
    seen: dict[str, dict[str, list[float]]] = {DEFAULT_DB: {}, JIT_OFF_DB: {}}
    async with bus_on(dsn, DEFAULT_DB) as on, bus_on(dsn, JIT_OFF_DB) as off:
        await reset_statements(dsn)
        for round_ in range(sizes.rounds):
            order = [(DEFAULT_DB, on), (JIT_OFF_DB, off)]
            for database, b in order if round_ % 2 == 0 else reversed(order):
                for key, value in (await measure(b, sizes, f"r{round_}")).items():
                    seen[database].setdefault(key, []).append(value)
    compiled = await jit_compiled(dsn, DEFAULT_DB)
    version = await server_version(dsn)
    rows = []
    for key, (name, unit, higher) in ROWS.items():
        rows.append(
            Result(
                scenario=SCENARIO,
                name=f"{name} (PostgreSQL {version}, defaults)",
                value=best(seen[DEFAULT_DB][key], higher),
                unit=unit,
                baseline=best(seen[JIT_OFF_DB][key], higher),
                baseline_name="same server, jit=off",
                higher_is_better=higher,
                target=TARGET,
                extra={
                    "rounds": sizes.rounds,
                    "jit_compiled_statements": len(compiled),
                    "jit_functions": sum(c[2] for c in compiled),
                },
            )
        )
    return rows, compiled


async def server_version(dsn: str) -> str:
    conn = await asyncpg.connect(dsn)
    try:
        return str(await conn.fetchval("SHOW server_version"))
    finally:
        await conn.close()


def home() -> Path:
    return Path(os.environ.get("BUS_STOCKPG_HOME", str(ROOT / ".bench" / "stockpg")))


async def run(dsn: str, quick: bool) -> list[Result]:
    """The rows on Debian's PostgreSQL 15 (`dsn`, the harness's server, is not used: the scenario is the server)."""
    del dsn
    if not available():
        raise RuntimeError("needs Debian's PostgreSQL 15 (scripts/ensure-pg15.sh)")
    server = StockServer(home())
    stock_dsn = await asyncio.to_thread(server.start)
    try:
        rows, _ = await compare(stock_dsn, QUICK if quick else FULL)
    finally:
        await asyncio.to_thread(server.stop)
    return rows


if __name__ == "__main__":
    for row in asyncio.run(run("", quick=False)):
        print(f"{row.name}: {row.value:.2f} {row.unit} vs {row.baseline:.2f} (jit=off) = {row.ratio:.2f}x")
