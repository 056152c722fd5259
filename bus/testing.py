"""A pytest plugin for testing code that uses the bus: `pytest -p bus.testing`.

Installed with pgactorbus it is also registered as a `pytest11` entry point,
so the fixtures are there without `-p`. Needs pytest-asyncio
(`pip install pgactorbus[testing]`).

Fixtures:

- `bus_client`: a connected `bus.Bus` on a fresh schema of the embedded
  PostgreSQL (or of `$BUS_TEST_DSN` when set), closed and its schema dropped
  after the test, with fast timings (`FAST`) so groups form and rebalance in
  a fraction of a second.
- `bus_config`: the keyword arguments `bus_client` connects with; override it
  in a conftest.py to change them.
- `bus_dsn` (session): the database the fixtures use.
- `bus_connect`: opens more Buses on the same schema (several members or
  services in one test); all closed after the test.

Helpers: `await wait_consumed(b, "group")` returns once the group has
committed everything published to its topics before the call;
`await eventually(check)` waits for a condition instead of a blind sleep;
`Clock(b).advance(seconds)` moves the time b's leases and expiries are judged
by (claims, event store claims, queue visibility timeouts and delays, group
partition leases and member sessions, idempotency windows, queue job
results' result_ttl) and the time b's actors' timers (heartbeats, retries,
the scheduler) wait for, so a test expires one without sleeping past it.

    from bus.testing import wait_consumed

    async def test_handler_records_orders(bus_client):
        seen = []
        async def handler(m):
            seen.append(m.value())
        await bus_client.create_topic("orders", partitions=2)
        await bus_client.publish("orders", {"id": 1})
        sub = await bus_client.subscribe("billing", handler, topics=["orders"])
        await wait_consumed(bus_client, "billing")
        await sub.stop()
        assert seen == [{"id": 1}]
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import asyncpg
import pytest

import bus
from bus.config import FAST_TIMINGS
from storage.db import drop_schema
from storage.errors import GroupNotFoundError

if TYPE_CHECKING:
    from bus.admin import GroupDescription

try:
    import pytest_asyncio
except ImportError:  # the entry point loads this module in every pytest run: never break one
    pytest_asyncio = None  # type: ignore[assignment]

_NEEDS_ASYNCIO = "bus.testing's fixtures need pytest-asyncio: pip install 'pgactorbus[testing]'"

__all__ = ["FAST", "Clock", "eventually", "wait_consumed"]

#: Timings for tests (`bus.config.FAST_TIMINGS`): heartbeats every 0.2 s, sessions of 1.5 s,
#: rebalances after 0.05 s. The project's own tests use them too (the `fast` fixture).
FAST: dict[str, Any] = dict(FAST_TIMINGS)


class Clock:
    """A movable clock for one Bus: what its statements judge leases and expiries by, and what its
    actors' timers wait for.

    `Clock(b).advance(31)` and a 30-second lease has run out for every
    statement of `b` that judges it: claims and event store claims; queue
    jobs' visibility timeouts, nack delays and delayed publishes (a take
    hands them out, a nacked job comes back), and a queue's rate window;
    consumer groups' partition leases and member sessions (b's heartbeats,
    session sweeps, rebalances and fenced commits); the dedupe windows of
    b's publishes with an idempotency key; the result_ttl of the job results
    and dead-letter outcomes b's queue consumers write, and what `b.job_result`
    still finds (expired results are deleted when it looks). Leases and sessions b
    writes from then on start at the moved time too: past an advance shorter
    than a session, b's beating members stay while a silent one expires; an
    advance longer than `lease_time` also ends the leases b's own workers hold.

    b's actors run their timers on the same clock, so an advance is also time
    gone by for them: the heartbeat that was due beats at once (then every
    `heartbeat_interval` of real or moved time), a handler's retry backoff or
    commit interval ends, the scheduler looks for due ticks (cron ticks are
    due by the moved time), queue expiry scans and restart backoffs run out.
    A test moves the clock a beat at a time and waits for what it expects
    (`eventually`) instead of sleeping through a session or a lease.

    Only `b` moves. Other Buses, in this process or another (a group's
    heartbeat monitor or a second member in a subprocess), and the server
    keep real time: a sweep of another Bus judges b's sessions by real time,
    and b's sweep judges theirs by the moved one. Publish times, rebalance
    delays, what the admin shows and the timeouts of calls a test makes
    (`poll(timeout=)`, `take(timeout=)`) stay on real time. Until advanced,
    and after `reset()`, the server's clock is used as always. Every
    `Clock(b)` of one Bus moves the same time.
    """

    def __init__(self, b: bus.Bus) -> None:
        self._time = b.context.time

    def now(self) -> datetime | None:
        """The moved time (the local clock plus every advance), or None (the server's) before any."""
        return self._time.now()

    def monotonic(self) -> float:
        """Seconds on b's monotonic clock (the process's plus every advance): what b's timers measure."""
        return self._time.monotonic()

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` of b's time: real time, or sooner when the clock is advanced past the end."""
        await self._time.sleep(seconds)

    def advance(self, seconds: timedelta | float) -> None:
        """Move the clock `seconds` forward (a ValidationError for a negative one: time does not go back)."""
        self._time.advance(seconds)

    def reset(self) -> None:
        """Back to the server's clock for statements (timers are not set back: their clock only moves forward)."""
        self._time.judge_by_server()


async def eventually(
    check: Callable[[], Awaitable[Any] | Any],
    timeout: float = 15.0,  # noqa: ASYNC109 - a test helper: the deadline is the point
    every: float = 0.05,
) -> Any:
    """Call `check` (plain or async) until it returns something truthy, and return that.

    Raises AssertionError with the last value after `timeout` seconds: a test
    waits for a condition instead of sleeping for a guessed time.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: Any = None
    while True:
        last = check()
        if isinstance(last, Awaitable):
            last = await last
        if last:
            return last
        if loop.time() >= deadline:
            raise AssertionError(f"condition not met within {timeout} s (last value: {last!r})")
        await asyncio.sleep(every)


async def wait_consumed(
    b: bus.Bus,
    group: str,
    *,
    timeout: float = 10.0,  # noqa: ASYNC109 - a test helper: the deadline is the point
    interval: float = 0.05,
) -> GroupDescription:
    """Wait until `group` has committed every message published to its topics before this call.

    "Committed" is what `describe_group` shows: a handler (`subscribe`) or a
    consumer that committed (or polled again with `auto_commit`). Waits for the
    group to appear if it has not joined yet. Raises TimeoutError naming the
    partitions still behind after `timeout` seconds.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    target: dict[tuple[str, str], int] | None = None
    behind: list[str] = []
    while True:
        try:
            d: GroupDescription | None = await b.admin.describe_group(group)
        except GroupNotFoundError:
            d = None
        if d is not None:
            if target is None:
                # The group's first sight fixes what "published so far" means.
                target = {(p.topic, p.partition): p.end_offset for p in d.partitions}
            position = {(p.topic, p.partition): p.end_offset - p.lag for p in d.partitions}
            behind = [
                f"{t}/{p} at {position.get((t, p), 0)} of {end}"
                for (t, p), end in target.items()
                if position.get((t, p), 0) < end
            ]
            if not behind:
                return d
        if loop.time() >= deadline:
            what = "has not joined yet" if d is None else "is behind on " + ", ".join(behind[:10])
            raise TimeoutError(f"group {group!r} did not consume everything within {timeout} s: it {what}")
        await asyncio.sleep(interval)


@pytest.fixture(scope="session")
def bus_dsn() -> str:
    """$BUS_TEST_DSN, or the embedded server's DSN (started once; shared through a lock)."""
    explicit = os.environ.get("BUS_TEST_DSN")
    if explicit:
        return explicit
    from bus.server.embedded import ensure_server

    return ensure_server().dsn


@pytest.fixture
def bus_config() -> dict[str, Any]:
    """Keyword arguments for `bus.connect` in `bus_client` (default: the FAST timings)."""
    return dict(FAST)


async def _bus_connect(
    bus_dsn: str, bus_config: dict[str, Any]
) -> AsyncIterator[Callable[..., Awaitable[bus.Bus]]]:
    """Open Buses on one fresh schema (`await bus_connect(**overrides)`); closed and dropped after the test."""
    schema = "bt_" + uuid.uuid4().hex[:12]
    opened: list[bus.Bus] = []

    async def open_bus(**overrides: Any) -> bus.Bus:
        config = {**bus_config, "schema": schema, **overrides}
        b = await bus.connect(bus_dsn, **config)
        opened.append(b)
        return b

    try:
        yield open_bus
    finally:
        for b in reversed(opened):
            await b.close()
        conn = await asyncpg.connect(bus_dsn)
        try:
            await drop_schema(conn, schema)
        finally:
            await conn.close()


async def _bus_client(bus_connect: Callable[..., Awaitable[bus.Bus]]) -> bus.Bus:
    """A connected Bus on a fresh schema, dropped after the test."""
    return await bus_connect()


if pytest_asyncio is not None:
    bus_connect = pytest_asyncio.fixture(_bus_connect, name="bus_connect")
    bus_client = pytest_asyncio.fixture(_bus_client, name="bus_client")
else:  # pragma: no cover - only without pytest-asyncio

    @pytest.fixture(name="bus_connect")
    def _bus_connect_unavailable() -> None:
        """Fails the test: pytest-asyncio is missing."""
        pytest.fail(_NEEDS_ASYNCIO)

    @pytest.fixture(name="bus_client")
    def _bus_client_unavailable() -> None:
        """Fails the test: pytest-asyncio is missing."""
        pytest.fail(_NEEDS_ASYNCIO)
