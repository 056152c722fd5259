"""A database outage with a Bus open: PostgreSQL stopped (`-m fast`) for a while, then started on the same port.

The Bus rides it out in the same process: no actor gives up, `health()` says
degraded while the server is away and healthy once it is back, the log says
the outage once and its end once (no traceback per reconnect attempt), and
afterwards the wake-ups work again (a publish wakes a waiting take well
within the poll interval, which is 5 s here), every kind of consumer opens
and delivers, and every publish that returned a Record is delivered.

Each test runs a server of its own (stopping the shared one would disturb
every other test): the embedded one, and for the 5 s outage Debian's
PostgreSQL 15 with its default configuration too (scripts/pg15.sh), the
server users run.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

import bus
import bus.metrics
from bus.dashboard import app as dashboard_app
from bus.errors import StorageUnavailableError
from bus.server.embedded import ensure_server, restart_server, stop_server
from bus.testing import FAST, eventually

pytestmark = pytest.mark.alone

# A lost wake-up would wait for this poll: the wake-up checks below allow a fifth of it.
POLL = 5.0
WAKE_BOUND = 1.0


class Enrolled(bus.Event, tag="outage.enrolled"):
    course: str


class _Records(logging.Handler):
    """Every warning and error logged in the process (the library logs through the stdlib)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def count(self, text: str) -> int:
        return sum(text in line for line in self.lines)


ROOT = Path(__file__).resolve().parents[2]
PG15 = Path(os.environ.get("PG15_BIN", "/usr/lib/postgresql/15/bin"))


@dataclass
class Server:
    """A server of the test's own, and how to take it away for a while (then start it on the same port)."""

    dsn: str
    outage: Callable[[float], object]


def _embedded() -> Iterator[Server]:
    # Not under pytest's tmp_path, which is owner-only: the server runs as another user under root.
    home = Path(tempfile.mkdtemp(prefix="bus-outage-"))
    home.chmod(0o755)
    try:
        yield Server(ensure_server(home).dsn, lambda down: restart_server(home, down=down))
    finally:
        stop_server(home)
        shutil.rmtree(home, ignore_errors=True)


def _pg15() -> Iterator[Server]:
    if not (PG15 / "postgres").exists():
        pytest.skip("needs PostgreSQL 15 (scripts/ensure-pg15.sh)")
    home = Path(tempfile.mkdtemp(prefix="bus-outage-pg15-"))
    home.chmod(0o755)

    def pg15(*args: str) -> str:
        env = dict(os.environ, BUS_HOME=str(home))
        script = str(ROOT / "scripts" / "pg15.sh")
        return subprocess.run(
            ["sh", script, *args], env=env, check=True, capture_output=True, text=True
        ).stdout

    try:
        yield Server(pg15("start").strip(), lambda down: pg15("outage", str(down)))
    finally:
        pg15("stop")
        shutil.rmtree(home, ignore_errors=True)


# One server of each kind for the module: every test leaves it running, and works in a schema of its own.
@pytest.fixture(scope="module")
def embedded() -> Iterator[Server]:
    yield from _embedded()


@pytest.fixture(scope="module")
def pg15() -> Iterator[Server]:
    yield from _pg15()


@pytest.fixture(params=["embedded", "pg15"])
def server(request: pytest.FixtureRequest) -> Server:
    found: Server = request.getfixturevalue(request.param)
    return found


@pytest.fixture
async def records() -> AsyncIterator[_Records]:
    handler = _Records()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)


async def _wake_seconds(b: bus.Bus, q: bus.QueueConsumer, acked: set[str], tag: str) -> float:
    """From a publish to the return of a take that was waiting for it (the second of two).

    The first one warms up: on fresh connections the statements are planned (and on a server with
    JIT on, as Debian's PostgreSQL 15 by default, compiled) the first time, which is not what is
    checked here; a lost wake-up makes both wait for the poll.
    """
    await _one_wake(b, q, acked, tag + "-warm-up")
    return await _one_wake(b, q, acked, tag)


async def _one_wake(b: bus.Bus, q: bus.QueueConsumer, acked: set[str], tag: str) -> float:
    take = asyncio.ensure_future(q.take(1, timeout=3 * POLL))
    await asyncio.sleep(0.2)  # the take is waiting
    t0 = time.monotonic()
    await b.publish("jobs", {"id": tag})
    got = await take
    seconds = time.monotonic() - t0
    assert [m.value(dict)["id"] for m in got] == [tag]
    await q.ack(got[0])
    acked.add(tag)
    return seconds


async def _ride_out(server: Server, schema: str, down: float, records: _Records) -> None:
    async with bus.connect(server.dsn, schema=schema, **{**FAST, "max_poll_interval": POLL}) as b:
        await b.create_topic("orders", partitions=2)
        await b.create_topic("jobs", partitions=2, semantics="queue")
        store = b.event_store("courses")
        await store.append([Enrolled(course="algebra")])
        published: list[bus.Record] = []
        delivered: set[tuple[str, int]] = set()

        async def handler(m: bus.Message) -> None:
            delivered.add((m.partition, m.offset))

        sub = await b.subscribe("mail", handler, topics=["orders"], start="earliest")
        jobs_done: set[str] = set()
        transport = httpx.ASGITransport(app=dashboard_app(b))
        async with (
            b.queue_consumer("jobs") as q,
            httpx.AsyncClient(transport=transport, base_url="http://dash") as dashboard,
        ):
            before = await _wake_seconds(b, q, jobs_done, "before")
            assert before < WAKE_BOUND
            published += [await b.publish("orders", {"n": i}) for i in range(10)]
            await eventually(lambda: len(delivered) == 10)
            assert b.health().status == "healthy"
            schema = b.config.schema
            outages_before = bus.metrics.value("bus_database_outages_total", schema=schema)

            # Publishing goes on through the outage: what returned a Record must be delivered.
            stop_publishing = asyncio.Event()

            async def keep_publishing() -> int:
                failed = 0
                while not stop_publishing.is_set():
                    try:
                        published.append(await b.publish("orders", {"n": len(published)}))
                    except StorageUnavailableError:
                        failed += 1
                    await asyncio.sleep(0.2)
                return failed

            publisher = asyncio.ensure_future(keep_publishing())
            outage = asyncio.ensure_future(asyncio.to_thread(server.outage, down))
            during = await eventually(lambda: (h := b.health()).status == "degraded" and h, timeout=down)
            assert not during.database_available and during.unavailable_since is not None
            assert any("database cannot be reached" in p for p in during.problems)
            # The metrics and the dashboard read the same.
            if bus.metrics.ENABLED:
                assert bus.metrics.value("bus_database_available", schema=schema) == 0
            healthz = (await dashboard.get("/healthz")).json()
            assert healthz["status"] == "degraded" and not healthz["database_available"]
            await outage
            after = await eventually(lambda: (h := b.health()).ok and h, timeout=15)
            stop_publishing.set()
            assert await publisher > 0  # the outage was seen by the publishes too
            assert after.outages == 1 and after.last_outage_seconds is not None
            assert after.last_outage_seconds >= down * 0.8
            assert after.failed_actors == []
            if bus.metrics.ENABLED:
                assert bus.metrics.value("bus_database_available", schema=schema) == 1
                assert bus.metrics.value("bus_database_outages_total", schema=schema) == outages_before + 1
            assert (await dashboard.get("/healthz")).json()["status"] == "healthy"

            # The queue consumer that stayed open is woken again, not left to its poll.
            assert await _wake_seconds(b, q, jobs_done, "after") < WAKE_BOUND
        # A new queue consumer opens and is woken too.
        async with b.queue_consumer("jobs") as q2:
            assert await _wake_seconds(b, q2, jobs_done, "new") < WAKE_BOUND
        assert {"before", "after", "new"} <= jobs_done and len(jobs_done) == 6

        # The subscription that stayed open delivers everything published and acknowledged.
        published.append(await b.publish("orders", {"n": "last"}))
        wanted = {(r.partition, r.offset) for r in published}
        await eventually(lambda: wanted <= delivered, timeout=30)
        await sub.stop()
        # A new consumer group opens and reads all of it.
        seen: set[tuple[str, int]] = set()
        async with b.consumer("audit", topics=["orders"], start="earliest") as c:
            while not wanted <= seen:
                seen |= {(m.partition, m.offset) for m in await c.poll(timeout=1.0)}
        # A claim, and the event store's reads.
        claim = await b.claim("billing", topic="orders", worker_id="w-1", start="earliest")
        assert claim is not None and claim.messages
        await claim.ack()
        assert [e.message for e in await store.read()] == [Enrolled(course="algebra")]
        assert b.health().ok

    # Said once each, and nothing given up or printed per reconnect attempt.
    assert records.count("database_unavailable") == 1, records.lines
    assert records.count("database_recovered") == 1, records.lines
    for noise in ("actor.gave_up", "system_actor_failed", "supervisor.escalating", "connection floor"):
        assert records.count(noise) == 0, (noise, records.lines)


async def test_a_bus_rides_out_a_five_second_outage(server: Server, schema: str, records: _Records) -> None:
    await _ride_out(server, schema, 5.0, records)


@pytest.mark.slow
async def test_a_bus_rides_out_a_thirty_second_outage(
    embedded: Server, schema: str, records: _Records
) -> None:
    await _ride_out(embedded, schema, 30.0, records)


async def test_a_bus_that_does_not_listen_says_degraded_and_healthy_again(
    embedded: Server, schema: str, records: _Records
) -> None:
    """Without LISTEN (a transaction pooler, no direct DSN) the HeartbeatMonitor tells the outage."""
    async with bus.connect(embedded.dsn, schema=schema, **FAST, pooler="transaction") as b:
        await b.create_topic("orders", partitions=1)
        outage = asyncio.ensure_future(asyncio.to_thread(embedded.outage, 3.0))
        await eventually(lambda: b.health().status == "degraded", timeout=3.0)
        await outage
        await eventually(lambda: b.health().ok, timeout=15)
        assert (await b.publish("orders", {"n": 1})).offset == 0
    assert records.count("database_unavailable") == 1, records.lines
    assert records.count("database_recovered") == 1, records.lines
