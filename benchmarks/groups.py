"""Consumer groups: throughput by member processes, latency, failover and rebalance time.

Four measurements, each next to a baseline from the same run on the same PostgreSQL:

1. **Consume throughput** with 1, 2 and 4 member processes over a pre-filled
   topic (16 partitions, 1,000,000 messages of ~100 bytes; quick: 20,000), from
   "members told to go" until the group's committed offsets add up to every
   message (a million, so that joining the group, a fraction of a second that
   has its own "first message after go" row, does not pass for throughput). Bus: `b.consumer(...)` polling 500 at a time with auto-commit (one
   commit per poll). Baseline: a raw asyncpg consumer per process that owns a
   fixed share of the partitions and, per partition, loops "read the next 500
   rows by offset + UPDATE the cursor row" in one transaction. Both sides
   read the same `messages` table and update the same `offsets` table.
2. **Publish→handler latency** at a paced 200 messages/s (quick 10 s, full
   30 s, in 3 turns taken in alternation with the baseline; after a CHECKPOINT
   that writes out the throughput rounds' rows, where allowed): the payload
   carries `time.time()` at send; an in-process subscription's handler
   measures arrival. Baseline: the raw pipeline doing the same work by hand
   (INSERT + NOTIFY in one transaction, a LISTEN connection wakes a reader
   that SELECTs the new rows and hands them to its "handler"); bare
   LISTEN/NOTIFY (no row) is kept as the floor. Next to it, the path's two
   statements alone at the same pace, to show how much of the gap is the
   server's: the bus's one-message append against the raw `INSERT + NOTIFY`,
   and its fenced fetch of that message against the raw `SELECT` (rows with no
   target: they explain the latency row, they are not goals of their own).
3. **Failover** after SIGKILL of one of 3 member processes (fast timings:
   heartbeat 0.2 s, session 1.5 s, rebalance delay 0.1 s): until every
   partition of the killed member is leased by a live member and a message
   published on each right after the kill has been handled. Baseline: the
   bound session_timeout + heartbeat_interval + rebalance_delay + 1 s.
4. **Rebalance** of a 10-member group over 100 partitions when an 11th member
   joins: until the group is `stable` and every partition is leased by the
   member it is assigned to. Baseline: rebalance_delay + heartbeat_interval.

Members run as OS processes (`benchmarks/groups_member.py`), so the numbers
include what real deployments pay: one pool, one Notifier and one
HeartbeatMonitor per process. Run it alone with `bus bench groups` (or
`python -m benchmarks.groups [--quick]`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, BinaryIO

import asyncpg

import bus
from benchmarks.rawpeers import create_pool, drop_schema
from benchmarks.result import Result
from storage import groups as group_sql
from storage.logs import get_logger
from storage.names import validate_schema

log = get_logger(__name__, scenario="groups")

SCENARIO = "groups"
ROOT = Path(__file__).resolve().parents[1]

THROUGHPUT_TOPIC = "bench.groups"
THROUGHPUT_PARTITIONS = 16
BATCH = 500
PAYLOAD_BYTES = 100
PROCESS_COUNTS = (1, 2, 4)
QUICK_MESSAGES, FULL_MESSAGES = 20_000, 1_000_000
QUICK_LATENCY_SECONDS, FULL_LATENCY_SECONDS = 10.0, 30.0
QUICK_DURABLE_SECONDS = 3.0  # the raw durable INSERT+NOTIFY reference (an extra, not the baseline)

LATENCY_TOPIC = "bench.latency"
LATENCY_PARTITIONS = 4
LATENCY_RATE = 200.0  # messages per second
LATENCY_ROUNDS = 3  # the bus and the raw pipeline take turns this many times
LATENCY_CHANNEL = "bench_latency"

FAILOVER_TOPIC = "bench.failover"
FAILOVER_PARTITIONS = 6
FAILOVER_MEMBERS = 3

REBALANCE_TOPIC = "bench.rebalance"
REBALANCE_PARTITIONS = 100
REBALANCE_MEMBERS = 10

# The fast timings of the group tests: short sessions, short debounce.
FAST: dict[str, Any] = {
    "heartbeat_interval": 0.2,
    "session_timeout": 1.5,
    "rebalance_delay": 0.1,
    "max_poll_interval": 0.5,
    "lease_time": 5.0,
}
# Throughput members: default session and heartbeat, a short join debounce
# (members start within a few ms of each other), no retention cleaner.
THROUGHPUT_CONFIG: dict[str, Any] = {"rebalance_delay": 0.1, "cleaner_interval": 0}

# Progress checks of the parent (the benchmark's own queries, constants like every statement).
COMMITTED_SUM = "SELECT COALESCE(sum(committed), 0) FROM offsets WHERE group_name = $1"
PARTITION_IDS = "SELECT id, name FROM partitions WHERE topic = $1 ORDER BY id"
LIVE_OWNERS = """
SELECT p.name, o.owner
FROM offsets o JOIN partitions p ON p.id = o.partition_id
WHERE o.group_name = $1 AND o.owner IS NOT NULL AND o.lease_expires_at > clock_timestamp()
"""
# Stable, at a generation newer than $2, with every assigned partition leased by its assignee.
SETTLED = """
SELECT g.state = 'stable' AND g.generation > $2
       AND (SELECT count(*) FROM members m WHERE m.group_name = g.name) = $3
       AND (SELECT count(*) FROM members m CROSS JOIN LATERAL unnest(m.assignment) AS a(pid)
            JOIN offsets o ON o.group_name = m.group_name AND o.partition_id = a.pid
            WHERE m.group_name = g.name AND o.owner = m.member_id
              AND o.lease_expires_at > clock_timestamp()) = $4 AS settled,
       g.generation
FROM groups g WHERE g.name = $1
"""
GROUP_STATE = "SELECT state FROM groups WHERE name = $1"
MEMBER_PARTITIONS = """
SELECT m.member_id, p.name
FROM members m CROSS JOIN LATERAL unnest(m.assignment) AS a(pid) JOIN partitions p ON p.id = a.pid
WHERE m.group_name = $1 AND m.pid = $2
"""
NOTIFY = "SELECT pg_notify($1, $2)"
# The durable raw baseline: what a hand-written outbox does, a row written and a NOTIFY, one commit.
CREATE_RAW_LATENCY = """
CREATE TABLE IF NOT EXISTS raw_latency (
    id bigserial PRIMARY KEY, payload bytea NOT NULL, created_at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""
INSERT_AND_NOTIFY = """
WITH i AS (INSERT INTO raw_latency (payload) VALUES ($3) RETURNING id)
SELECT pg_notify($1, $2) FROM i
"""

# The raw pipeline doing the bus's work by hand: INSERT + NOTIFY in one transaction, a LISTEN
# connection wakes, a reader SELECTs the new rows, the "handler" notes the arrival.
CREATE_RAW_PIPELINE = """
CREATE TABLE IF NOT EXISTS raw_pipeline (
    id bigserial PRIMARY KEY, sent double precision NOT NULL, payload bytea NOT NULL
)
"""
PIPELINE_INSERT_NOTIFY = """
WITH i AS (INSERT INTO raw_pipeline (sent, payload) VALUES ($2, $3) RETURNING id)
SELECT pg_notify($1, i.id::text) FROM i
"""
PIPELINE_FETCH = "SELECT id, sent, payload FROM raw_pipeline WHERE id > $1 ORDER BY id LIMIT 500"
PIPELINE_CHANNEL = "bench_pipeline"

STEP = 0.01  # how often the parent looks at progress, seconds


# -- member processes ------------------------------------------------------------------


def _temp_path(prefix: str, suffix: str) -> Path:
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix)
    os.close(fd)
    return Path(name)


def _open_for_write(path: Path) -> BinaryIO:
    return path.open("wb")


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)


class MemberProcess:
    """One `benchmarks.groups_member` process: started, told to go, stopped or killed."""

    def __init__(self, proc: asyncio.subprocess.Process, stderr_path: Path) -> None:
        self.proc = proc
        self.pid = proc.pid
        self._stderr_path = stderr_path
        self._lines: list[str] = []
        self._changed = asyncio.Event()
        self._pump = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def start(
        cls, mode: str, dsn: str, schema: str, group: str, topic: str, *options: str
    ) -> MemberProcess:
        """Spawn a member; it connects and then waits for `go`."""
        stderr_path = _temp_path("bench-member-", ".log")
        with _open_for_write(stderr_path) as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "benchmarks.groups_member",
                mode,
                "-",  # the DSN: $BUS_DSN (no password on a command line)
                schema,
                group,
                topic,
                *options,
                cwd=ROOT,
                env={**os.environ, "BUS_DSN": dsn},
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
            )
        return cls(proc, stderr_path)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            self._lines.append(line.decode().strip())
            self._changed.set()
        self._changed.set()

    async def wait_for(self, word: str, timeout: float = 60.0) -> str:  # noqa: ASYNC109
        """The first stdout line starting with `word`; raises when the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self._lines:
                if line.startswith(word):
                    return line
            if self._pump.done():
                raise RuntimeError(f"member {self.pid} exited before {word!r}: {self.stderr_tail()}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"member {self.pid} did not say {word!r} within {timeout}s: {self.stderr_tail()}"
                )
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    def stderr_tail(self, n: int = 2000) -> str:
        """The end of the process's stderr (for error messages)."""
        try:
            return self._stderr_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def send(self, word: str) -> None:
        """Write one line to the process's stdin."""
        assert self.proc.stdin is not None
        if not self.proc.stdin.is_closing():
            self.proc.stdin.write((word + "\n").encode())

    def kill(self) -> None:
        """SIGKILL: no goodbye, no commit, no release."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)

    async def stop(self, timeout: float = 20.0, *, graceful: bool = True) -> None:  # noqa: ASYNC109
        """Ask it to stop (it leaves its group cleanly); kill it if it does not (or at once if not `graceful`)."""
        if not graceful:
            self.kill()
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except TimeoutError:
                self.kill()
                await self.proc.wait()
        with contextlib.suppress(Exception):
            await self._pump
        _remove(self._stderr_path)


async def _start_all(starts: list[Awaitable[MemberProcess]]) -> list[MemberProcess]:
    """Start members together, wait until each is connected; on failure stop those that started."""
    results = await asyncio.gather(*starts, return_exceptions=True)
    procs = [r for r in results if isinstance(r, MemberProcess)]
    try:
        for r in results:
            if isinstance(r, BaseException):
                raise r
        await asyncio.gather(*(p.wait_for("ready") for p in procs))
    except BaseException:
        await _stop_all(procs)
        raise
    return procs


async def _stop_all(procs: list[MemberProcess], *, graceful: bool = True) -> None:
    await asyncio.gather(*(p.stop(graceful=graceful) for p in procs), return_exceptions=True)


async def _until(
    check: Callable[[], Awaitable[Any]],
    timeout: float,  # noqa: ASYNC109
    what: str,
    step: float = STEP,
) -> Any:
    """Look every `step` seconds (default STEP) until `check()` is truthy; its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not done within {timeout}s")
        await asyncio.sleep(step)


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


# -- 1. throughput ---------------------------------------------------------------------


async def _prefill(b: bus.Bus, topic: str, messages: int) -> None:
    pad = b"x" * PAYLOAD_BYTES
    chunk = 2000
    for first in range(0, messages, chunk):
        batch = [
            bus.Outgoing((b"%08d" % i) + pad[8:], partition=str(i % THROUGHPUT_PARTITIONS))
            for i in range(first, min(first + chunk, messages))
        ]
        await b.publish_many(topic, batch)


async def _consume_round(
    mon: asyncpg.Pool, procs: list[MemberProcess], group: str, total: int
) -> tuple[float, float]:
    """Tell `procs` to go; seconds until `group` has committed all `total` messages, and until a first message arrived."""
    started = time.perf_counter()
    for p in procs:
        p.send("go")
    first: list[float] = []

    async def note_first() -> None:
        await asyncio.wait([asyncio.ensure_future(p.wait_for("first", timeout=600)) for p in procs],
                           return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        first.append(time.perf_counter() - started)

    watcher = asyncio.ensure_future(note_first())

    async def done() -> bool:
        return int(await mon.fetchval(COMMITTED_SUM, group)) >= total

    try:
        await _until(done, timeout=600, what=f"group {group} consuming {total} messages")
        elapsed = time.perf_counter() - started
        await asyncio.wait_for(watcher, 10)
    finally:
        watcher.cancel()
    return elapsed, first[0] if first else float("nan")


async def _throughput(b: bus.Bus, mon: asyncpg.Pool, dsn: str, quick: bool) -> list[Result]:
    schema = b.config.schema
    total = QUICK_MESSAGES if quick else FULL_MESSAGES
    await b.create_topic(THROUGHPUT_TOPIC, partitions=THROUGHPUT_PARTITIONS)
    t0 = time.perf_counter()
    await _prefill(b, THROUGHPUT_TOPIC, total)
    log.info("prefilled", messages=total, seconds=round(time.perf_counter() - t0, 1))
    pids = [int(r[0]) for r in await b.pool.fetch(PARTITION_IDS, THROUGHPUT_TOPIC)]
    config = json.dumps(THROUGHPUT_CONFIG)
    rates: dict[tuple[str, int], float] = {}
    firsts: dict[tuple[str, int], float] = {}
    for n in PROCESS_COUNTS:
        raw_group, bus_group = f"raw-{n}", f"bus-{n}"
        # The raw group's cursors exist before it starts (the bus makes its own at its first rebalance).
        async with b.pool.acquire() as conn:
            await group_sql.record_group(
                conn, group_sql.RecordGroupParams(name=raw_group, start_mode="earliest", lookback_seconds=0.0)
            )
            await group_sql.materialize_offsets(conn, raw_group, pids)
        starts: list[Awaitable[MemberProcess]] = [
            MemberProcess.start(
                "raw",
                dsn,
                schema,
                raw_group,
                THROUGHPUT_TOPIC,
                "--batch",
                str(BATCH),
                "--partitions",
                ",".join(str(p) for p in pids[i::n]),
            )
            for i in range(n)
        ]
        starts += [
            MemberProcess.start(
                "poll", dsn, schema, bus_group, THROUGHPUT_TOPIC, "--batch", str(BATCH), "--config", config
            )
            for _ in range(n)
        ]
        procs = await _start_all(starts)
        try:
            raw_procs, bus_procs = procs[:n], procs[n:]
            seconds, firsts[("raw", n)] = await _consume_round(mon, raw_procs, raw_group, total)
            rates[("raw", n)] = total / seconds
            await _stop_all(raw_procs)
            seconds, firsts[("bus", n)] = await _consume_round(mon, bus_procs, bus_group, total)
            rates[("bus", n)] = total / seconds
        finally:
            await _stop_all(procs)
        log.info("throughput", processes=n, bus=round(rates[("bus", n)]), raw=round(rates[("raw", n)]))
    rows = [
        Result(
            SCENARIO,
            f"consume throughput, {n} member process{'es' if n > 1 else ''}",
            rates[("bus", n)],
            "msg/s",
            rates[("raw", n)],
            "raw asyncpg cursor consumer",
            target="≥ 0.7×",
            extra={
                "messages": total,
                "partitions": THROUGHPUT_PARTITIONS,
                "batch": BATCH,
                "per_process": rates[("bus", n)] / n,
                "baseline_per_process": rates[("raw", n)] / n,
            },
        )
        for n in PROCESS_COUNTS
    ]
    rows += [
        # What a member pays before its first message (joining, the rebalance delay, leases), inside
        # the throughput rows' time; the raw consumer owns fixed partitions and only reads its cursors.
        Result(
            SCENARIO,
            f"first message after go, {n} member process{'es' if n > 1 else ''}",
            round(firsts[("bus", n)] * 1000.0, 1),
            "ms",
            round(firsts[("raw", n)] * 1000.0, 1),
            "raw asyncpg cursor consumer",
            higher_is_better=False,
            extra={"rebalance_delay": THROUGHPUT_CONFIG["rebalance_delay"]},
        )
        for n in PROCESS_COUNTS
    ]
    lo, hi = PROCESS_COUNTS[0], PROCESS_COUNTS[-1]
    rows.append(
        Result(
            SCENARIO,
            f"consume throughput scaling, {hi} vs {lo} process",
            rates[("bus", hi)] / rates[("bus", lo)],
            "×",
            rates[("raw", hi)] / rates[("raw", lo)],
            "raw scaling",
            target="≥ 1.0",  # rising with processes (the value itself, not the ratio)
            extra={"cpus": os.cpu_count()},
        )
    )
    return rows


# -- 2. latency ------------------------------------------------------------------------


async def _paced(duration: float, send: Callable[[int], Awaitable[None]]) -> int:
    """Call `send(i)` at LATENCY_RATE per second for `duration` seconds (absolute schedule, no drift)."""
    count = round(duration * LATENCY_RATE)
    start = time.perf_counter()
    for i in range(count):
        delay = start + i / LATENCY_RATE - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        await send(i)
    return count


async def _bus_latency(b: bus.Bus, duration: float) -> tuple[list[float], list[float], list[float]]:
    """Sorted (publish→handler, inside publish(), publish returned→handler) in ms."""
    await b.create_topic(LATENCY_TOPIC, partitions=LATENCY_PARTITIONS)
    latencies: list[float] = []
    sent: dict[int, float] = {}
    returned: dict[int, float] = {}
    arrived: dict[int, float] = {}
    warm = asyncio.Event()
    warm_seen: set[int] = set()

    async def handler(m: bus.Message) -> None:
        now = time.time()
        body = json.loads(m.payload)
        if body["i"] < 0:
            warm_seen.add(body["i"])
            if len(warm_seen) == LATENCY_PARTITIONS:
                warm.set()
            return
        latencies.append((now - body["t"]) * 1000.0)
        arrived[body["i"]] = now

    sub = await b.subscribe("latency", handler, topics=[LATENCY_TOPIC], start="latest")
    try:
        await sub.wait_assigned()
        # One message per partition first: every worker has its lease and is listening.
        for p in range(LATENCY_PARTITIONS):
            await b.publish(LATENCY_TOPIC, {"t": time.time(), "i": -1 - p}, partition=str(p))
        await asyncio.wait_for(warm.wait(), 30)
        pad = "x" * 60

        async def send(i: int) -> None:
            sent[i] = time.time()
            await b.publish(LATENCY_TOPIC, {"t": sent[i], "i": i, "pad": pad})
            returned[i] = time.time()

        count = await _paced(duration, send)
        await _until(lambda: _true(len(latencies) >= count), timeout=30, what="bus latency messages handled")
    finally:
        await sub.stop()
    inside = sorted((returned[i] - sent[i]) * 1000.0 for i in returned)
    after = sorted((arrived[i] - returned[i]) * 1000.0 for i in arrived if i in returned)
    return sorted(latencies), inside, after


async def _true(value: bool) -> bool:
    return value


async def _raw_latency(dsn: str, duration: float, schema: str | None = None) -> list[float]:
    """Sorted ms from `pg_notify` sent to received; with `schema`, the notify rides on a durable INSERT."""
    listener = await asyncpg.connect(dsn)
    sender = await asyncpg.connect(dsn, server_settings={"search_path": validate_schema(schema or "public")})
    statement, pad = NOTIFY, b"x" * PAYLOAD_BYTES
    if schema is not None:
        await sender.execute(CREATE_RAW_LATENCY)
        statement = INSERT_AND_NOTIFY
    latencies: list[float] = []
    try:

        def on_notify(_c: Any, _pid: int, _channel: str, payload: str) -> None:
            latencies.append((time.time() - float(payload)) * 1000.0)

        await listener.add_listener(LATENCY_CHANNEL, on_notify)

        async def send(i: int) -> None:
            if schema is None:
                await sender.fetchval(statement, LATENCY_CHANNEL, repr(time.time()))
            else:
                await sender.fetchval(statement, LATENCY_CHANNEL, repr(time.time()), pad)

        for i in range(10):  # warm-up
            await send(i)
        await _until(lambda: _true(len(latencies) >= 10), timeout=10, what="raw notify warm-up")
        latencies.clear()
        count = await _paced(duration, send)
        await _until(lambda: _true(len(latencies) >= count), timeout=30, what="raw notifications received")
    finally:
        await listener.close()
        await sender.close()
    return sorted(latencies)


async def _raw_pipeline_latency(dsn: str, duration: float, schema: str) -> list[float]:
    """Sorted ms from the INSERT + NOTIFY call to a hand-written reader handing the row to its handler."""
    path = {"search_path": validate_schema(schema)}
    listener = await asyncpg.connect(dsn, server_settings=path)
    reader = await asyncpg.connect(dsn, server_settings=path)
    sender = await asyncpg.connect(dsn, server_settings=path)
    await sender.execute(CREATE_RAW_PIPELINE)
    pad = b"x" * PAYLOAD_BYTES
    latencies: list[float] = []
    wake = asyncio.Event()
    last = int(await reader.fetchval("SELECT coalesce(max(id), 0) FROM raw_pipeline"))

    async def read_loop() -> None:
        nonlocal last
        while True:
            await wake.wait()
            wake.clear()
            while rows := await reader.fetch(PIPELINE_FETCH, last):
                for row in rows:  # the handler: note the arrival
                    latencies.append((time.time() - row["sent"]) * 1000.0)
                last = rows[-1]["id"]

    def on_notify(_c: Any, _pid: int, _channel: str, _payload: object) -> None:
        wake.set()

    async def send(i: int) -> None:
        await sender.fetchval(PIPELINE_INSERT_NOTIFY, PIPELINE_CHANNEL, time.time(), pad)

    await listener.add_listener(PIPELINE_CHANNEL, on_notify)
    task = asyncio.get_running_loop().create_task(read_loop())
    try:
        for i in range(10):  # warm-up
            await send(i)
        await _until(lambda: _true(len(latencies) >= 10), timeout=10, what="raw pipeline warm-up")
        latencies.clear()
        count = await _paced(duration, send)
        await _until(lambda: _true(len(latencies) >= count), timeout=30, what="raw pipeline rows handled")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for conn in (listener, reader, sender):
            await conn.close()
    return sorted(latencies)


async def _latency(b: bus.Bus, dsn: str, quick: bool) -> list[Result]:
    duration = QUICK_LATENCY_SECONDS if quick else FULL_LATENCY_SECONDS
    raw = await _raw_latency(dsn, duration)
    durable = await _raw_latency(dsn, QUICK_DURABLE_SECONDS if quick else duration, b.config.schema)
    # The bus and its baseline take turns (LATENCY_ROUNDS each, the same seconds in all), and each
    # side's percentiles are over all of its rounds: this machine's speed drifts by more than the
    # difference measured over a minute, and both sides must see the same drift.
    pipeline: list[float] = []
    ours: list[float] = []
    inside: list[float] = []
    after: list[float] = []
    for _ in range(LATENCY_ROUNDS):
        pipeline += await _raw_pipeline_latency(dsn, duration / LATENCY_ROUNDS, b.config.schema)
        round_ours, round_inside, round_after = await _bus_latency(b, duration / LATENCY_ROUNDS)
        ours += round_ours
        inside += round_inside
        after += round_after
    for samples in (pipeline, ours, inside, after):
        samples.sort()
    p50, p99 = _percentile(ours, 0.5), _percentile(ours, 0.99)
    r50, r99 = _percentile(raw, 0.5), _percentile(raw, 0.99)
    q50, q99 = _percentile(pipeline, 0.5), _percentile(pipeline, 0.99)
    extra = {
        "p50": p50,
        "p99": p99,
        "pipeline_p50": q50,
        "pipeline_p99": q99,
        "notify_floor_p50": r50,
        "notify_floor_p99": r99,
        "max": ours[-1],
        "pipeline_max": pipeline[-1],
        "messages": len(ours),
        # Where the time goes: the durable publish (INSERT, counter, NOTIFY, commit with
        # fsync) vs the delivery after it returned; and a raw durable INSERT + NOTIFY.
        "publish_call_p50": _percentile(inside, 0.5),
        "publish_call_p99": _percentile(inside, 0.99),
        "after_publish_p50": _percentile(after, 0.5),
        "after_publish_p99": _percentile(after, 0.99),
        "raw_insert_notify_p50": _percentile(durable, 0.5),
        "raw_insert_notify_p99": _percentile(durable, 0.99),
        "rate": LATENCY_RATE,
        "seconds": duration,
        "rounds": LATENCY_ROUNDS,
    }
    pipeline_name = "raw pipeline (INSERT+NOTIFY → LISTEN → SELECT → handler)"
    return [
        Result(
            SCENARIO,
            f"publish→handler latency p50, {LATENCY_RATE:.0f} msg/s",
            p50,
            "ms",
            q50,
            pipeline_name,
            higher_is_better=False,
            target="≤ 1.2×",
            extra=extra,
        ),
        Result(
            SCENARIO,
            f"publish→handler latency p99, {LATENCY_RATE:.0f} msg/s",
            p99,
            "ms",
            q99,
            pipeline_name,
            higher_is_better=False,
            target="≤ 1.5×",
            extra={"p99": p99, "pipeline_p99": q99},
        ),
        # The floor: a bare NOTIFY with no row written (no commit to wait for).
        Result(
            SCENARIO,
            f"publish→handler latency p50 vs bare NOTIFY (floor), {LATENCY_RATE:.0f} msg/s",
            p50,
            "ms",
            r50,
            "raw LISTEN/NOTIFY, no row",
            higher_is_better=False,
            extra={"p99": p99, "floor_p99": r99},
        ),
    ]


# The statements alone, paced as above: where the bus's server-side time goes.
STATEMENT_TOPIC = "bench.statements"
STATEMENT_ROUNDS = 4  # the bus's statements and the raw ones take turns this many times
QUICK_STATEMENT_CALLS, FULL_STATEMENT_CALLS = 100, 400  # per side and round
LEASE_OF = "SELECT owner, lease_epoch FROM offsets WHERE group_name = $1 AND partition_id = $2"
PARTITION_OF = "SELECT id FROM partitions WHERE topic = $1"


async def _statements(b: bus.Bus, dsn: str, quick: bool) -> list[Result]:
    """The publish→handler path's two statements next to the raw pipeline's, paced at 200/s.

    Shows how much of the latency gap is the server's. Each step writes one message
    and reads it back right after, timing the two statements apart, on one connection
    per side (the bus's: one its Lender lends, as a worker's fetch gets, with generic
    plans). Bus: `storage.messages.append` of one message (partition
    counter, segmented `messages`, NOTIFY, commit) and `storage.leases.fetch` from its
    offset, fenced by the live lease of a real subscription (whose handler holds its
    first message meanwhile, so its worker reads nothing). Raw: the pipeline's
    `INSERT + NOTIFY` and its `SELECT` of the rows past the last id seen.
    """
    from storage import leases as lease_sql
    from storage import messages as log_sql

    calls = QUICK_STATEMENT_CALLS if quick else FULL_STATEMENT_CALLS
    path = {"search_path": validate_schema(b.config.schema)}
    pad = b"x" * PAYLOAD_BYTES
    await b.create_topic(STATEMENT_TOPIC, partitions=1)
    holding, release = asyncio.Event(), asyncio.Event()

    async def handler(m: bus.Message) -> None:
        holding.set()
        await release.wait()

    # Everything opened here is closed by one stack, in reverse order, whatever fails.
    async with contextlib.AsyncExitStack() as stack:
        ours = await stack.enter_async_context(b.lender.lend())  # what a worker's fetch runs on
        theirs = await asyncpg.connect(dsn, server_settings=path)
        stack.push_async_callback(theirs.close)
        listener = await asyncpg.connect(dsn, server_settings=path)
        stack.push_async_callback(listener.close)
        sub = await b.subscribe("statements", handler, topics=[STATEMENT_TOPIC], start="earliest")
        stack.push_async_callback(sub.stop)
        stack.callback(release.set)  # first of all: the held handler returns, so the stop can drain
        await sub.wait_assigned()
        await b.publish(STATEMENT_TOPIC, pad)
        await asyncio.wait_for(holding.wait(), 30)
        pid = await ours.fetchval(PARTITION_OF, STATEMENT_TOPIC)
        owner, epoch = await ours.fetchrow(LEASE_OF, "statements", pid)
        await theirs.execute(CREATE_RAW_PIPELINE)
        await listener.add_listener(PIPELINE_CHANNEL, lambda *_: None)  # both NOTIFYs have a listener
        last = {"id": int(await theirs.fetchval("SELECT coalesce(max(id), 0) FROM raw_pipeline"))}
        channel = b.channels.messages

        async def bus_step() -> tuple[float, float]:
            t0 = time.perf_counter()
            one = log_sql.Batch.of([pid], ["0"], [None], [None], [pad])
            placed = await log_sql.append(ours, one, notify=channel)
            t1 = time.perf_counter()
            rows = await lease_sql.fetch(ours, "statements", pid, owner, epoch, placed[0][1], BATCH)  # type: ignore[index]
            t2 = time.perf_counter()
            assert len(rows) == 1, "the fenced fetch must find the new message (is the lease still held?)"
            return (t1 - t0) * 1000.0, (t2 - t1) * 1000.0

        async def raw_step() -> tuple[float, float]:
            t0 = time.perf_counter()
            await theirs.fetchval(PIPELINE_INSERT_NOTIFY, PIPELINE_CHANNEL, time.time(), pad)
            t1 = time.perf_counter()
            rows = await theirs.fetch(PIPELINE_FETCH, last["id"])
            t2 = time.perf_counter()
            assert len(rows) == 1
            last["id"] = rows[-1]["id"]
            return (t1 - t0) * 1000.0, (t2 - t1) * 1000.0

        bus_times: list[tuple[float, float]] = []
        raw_times: list[tuple[float, float]] = []

        def into(times: list[tuple[float, float]], step: Callable[[], Awaitable[tuple[float, float]]]) -> Any:
            async def send(_: int) -> None:
                times.append(await step())

            return send

        for _ in range(STATEMENT_ROUNDS):
            await _paced(calls / LATENCY_RATE, into(bus_times, bus_step))
            await _paced(calls / LATENCY_RATE, into(raw_times, raw_step))
    extra = {"calls": len(bus_times), "rate": LATENCY_RATE, "rounds": STATEMENT_ROUNDS}
    rows: list[Result] = []
    for i, (name, baseline_name) in enumerate(
        (
            ("publish statement alone p50 (1 message, durable, NOTIFY)", "raw INSERT + NOTIFY"),
            ("fenced fetch of the new message alone p50", "raw SELECT past the last id"),
        )
    ):
        bus_side, raw_side = sorted(t[i] for t in bus_times), sorted(t[i] for t in raw_times)
        rows.append(
            Result(
                SCENARIO,
                f"{name}, {LATENCY_RATE:.0f}/s",
                _percentile(bus_side, 0.5),
                "ms",
                _percentile(raw_side, 0.5),
                baseline_name,
                higher_is_better=False,
                extra={**extra, "p99": _percentile(bus_side, 0.99), "raw_p99": _percentile(raw_side, 0.99)},
            )
        )
    return rows


# -- 3. failover -----------------------------------------------------------------------


def _handled(out: Path) -> set[tuple[str, int, int]]:
    got = set()
    for line in out.read_text().splitlines():
        parts = line.split()
        if len(parts) == 4:  # partition offset pid time (a line cut by a SIGKILL is shorter)
            got.add((parts[0], int(parts[1]), int(parts[2])))
    return got


async def _failover(b: bus.Bus, mon: asyncpg.Pool, procs: list[MemberProcess], out: Path) -> list[Result]:
    """`procs`: FAILOVER_MEMBERS connected members of group "failover", logging deliveries to `out`."""
    group = "failover"
    for p in procs:
        p.send("go")

    async def three_own_all() -> bool:
        state = await mon.fetchval(GROUP_STATE, group)
        owners = {r[0]: r[1] for r in await mon.fetch(LIVE_OWNERS, group)}
        return (
            state == "stable"
            and len(owners) == FAILOVER_PARTITIONS
            and len(set(owners.values())) == FAILOVER_MEMBERS
        )

    await _until(three_own_all, timeout=60, what="three members owning every partition")
    victim = procs[0]
    assigned = await mon.fetch(MEMBER_PARTITIONS, group, victim.pid)
    victim_member = assigned[0]["member_id"]
    parts = sorted(r["name"] for r in assigned)
    started = time.perf_counter()
    victim.kill()
    records = [await b.publish(FAILOVER_TOPIC, {"after_kill": p}, partition=p) for p in parts]
    leased_at: float | None = None
    handled_at: float | None = None

    async def recovered() -> bool:
        nonlocal leased_at, handled_at
        now = time.perf_counter()
        if leased_at is None:
            owners = {r[0]: r[1] for r in await mon.fetch(LIVE_OWNERS, group)}
            if all(owners.get(p) not in (None, victim_member) for p in parts):
                leased_at = now
        if handled_at is None:
            got = {(p, o) for p, o, pid in _handled(out) if pid != victim.pid}
            if all((r.partition, r.offset) in got for r in records):
                handled_at = now
        return leased_at is not None and handled_at is not None

    await _until(recovered, timeout=60, what="failover")
    assert leased_at is not None and handled_at is not None
    elapsed = max(leased_at, handled_at) - started
    bound = FAST["session_timeout"] + FAST["heartbeat_interval"] + FAST["rebalance_delay"] + 1.0
    return [
        Result(
            SCENARIO,
            f"failover after SIGKILL of 1 of {FAILOVER_MEMBERS} member processes",
            elapsed,
            "s",
            bound,
            "bound: session + heartbeat + rebalance delay + 1 s",
            higher_is_better=False,
            target="≤ 1.0×",
            extra={
                "leased_s": leased_at - started,
                "handled_s": handled_at - started,
                "partitions_moved": len(parts),
                **FAST,
            },
        )
    ]


# -- 4. rebalance ----------------------------------------------------------------------


async def _rebalance(b: bus.Bus, mon: asyncpg.Pool, procs: list[MemberProcess]) -> list[Result]:
    """`procs`: a connected process hosting ten members of group "rebalance", and one hosting the eleventh."""
    group = "rebalance"
    ten, eleventh = procs
    ten.send("go")

    async def settled(after: int, members: int) -> int | None:
        row = await mon.fetchrow(SETTLED, group, after, members, REBALANCE_PARTITIONS)
        return int(row["generation"]) if row is not None and row["settled"] else None

    generation = await _until(lambda: settled(0, REBALANCE_MEMBERS), timeout=60, what="ten members stable")
    started = time.perf_counter()
    eleventh.send("go")
    await _until(lambda: settled(generation, REBALANCE_MEMBERS + 1), timeout=60, what="eleven members stable")
    elapsed = time.perf_counter() - started
    d = await b.admin.describe_group(group)
    assert d.state == "stable" and len(d.members) == REBALANCE_MEMBERS + 1, d.state
    baseline = FAST["rebalance_delay"] + FAST["heartbeat_interval"]
    return [
        Result(
            SCENARIO,
            f"rebalance to stable, {REBALANCE_MEMBERS}→{REBALANCE_MEMBERS + 1} members, {REBALANCE_PARTITIONS} partitions",
            elapsed,
            "s",
            baseline,
            "rebalance delay + heartbeat interval",
            higher_is_better=False,
            extra={"assignor": d.assignor, "generation": d.generation, **FAST},
        )
    ]


async def _membership(b: bus.Bus, mon: asyncpg.Pool, dsn: str) -> list[Result]:
    """Failover, then rebalance; their member processes start together (startup is not measured)."""
    schema = b.config.schema
    await b.create_topic(FAILOVER_TOPIC, partitions=FAILOVER_PARTITIONS)
    await b.create_topic(REBALANCE_TOPIC, partitions=REBALANCE_PARTITIONS)
    out = _temp_path("bench-failover-", ".txt")
    config = json.dumps({**FAST, "cleaner_interval": 0})
    starts = [
        MemberProcess.start(
            "subscribe", dsn, schema, "failover", FAILOVER_TOPIC, "--out", str(out), "--config", config
        )
        for _ in range(FAILOVER_MEMBERS)
    ]
    # Ten members in one process, the eleventh in another (each waits for `go`).
    starts += [
        MemberProcess.start(
            "subscribe",
            dsn,
            schema,
            "rebalance",
            REBALANCE_TOPIC,
            "--members",
            str(REBALANCE_MEMBERS),
            "--config",
            config,
        ),
        MemberProcess.start("subscribe", dsn, schema, "rebalance", REBALANCE_TOPIC, "--config", config),
    ]
    procs = await _start_all(starts)
    try:
        rows = await _failover(b, mon, procs[:FAILOVER_MEMBERS], out)
        await _stop_all(procs[:FAILOVER_MEMBERS], graceful=False)  # measured; nothing to leave cleanly
        rows += await _rebalance(b, mon, procs[FAILOVER_MEMBERS:])
    finally:
        await _stop_all(procs, graceful=False)  # the schema is dropped next
        _remove(out)
    return rows


# -- the scenario ----------------------------------------------------------------------


async def _settle(mon: asyncpg.Pool) -> None:
    """Write out what the throughput rounds left dirty before latencies are timed.

    A million fresh rows are flushed by the next checkpoint; timed during it, every commit's
    fsync (the bus's and the raw pipeline's alike) waits behind that I/O and the latency
    rows read the disk's state, not the code's. Needs the right to CHECKPOINT (superuser
    or pg_checkpoint); without it the latencies are timed as they come.
    """
    try:
        await mon.execute("CHECKPOINT")
    except asyncpg.InsufficientPrivilegeError:
        log.info("checkpoint_not_allowed", hint="grant pg_checkpoint for steadier latency rows")


async def run(dsn: str, quick: bool) -> list[Result]:
    """All four measurements on a fresh schema (dropped afterwards)."""
    schema = "bench_groups_" + uuid.uuid4().hex[:10]
    rows: list[Result] = []
    b = await bus.connect(dsn, schema=schema, cleaner_interval=0)
    # The progress checks use their own connections: a tool that terminates the
    # bus's connections (application_name 'bus') does not stop the clock.
    mon = await create_pool(dsn, schema, min_size=1, max_size=2)
    try:
        rows += await _throughput(b, mon, dsn, quick)
        await _settle(mon)
        rows += await _latency(b, dsn, quick)
        rows += await _statements(b, dsn, quick)
        rows += await _membership(b, mon, dsn)
    finally:
        await mon.close()
        await b.close()
        await drop_schema(dsn, schema)
    return rows


if __name__ == "__main__":
    from bus.server.embedded import ensure_server

    target = os.environ.get("BUS_DSN") or ensure_server().dsn
    for row in asyncio.run(run(target, quick="--quick" in sys.argv)):
        ratio = "-" if row.ratio is None else f"{row.ratio:.2f}x"
        print(
            f"{row.name:70s} {row.value:12.3f} {row.unit:6s} baseline {row.baseline or 0:12.3f} ratio {ratio}"
        )
