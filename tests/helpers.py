"""What tests of several capabilities share: polling consumers until messages arrive, consuming by claims,
log starts, a Bus on a schema of its own."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import asyncpg
import pytest

import bus
from bus.testing import eventually
from storage.db import drop_schema, migrations


async def drain(consumers: list[Any], n: int, timeout: float = 20.0) -> list[Any]:  # noqa: ASYNC109 - a test helper: the deadline is the point
    """Poll all consumers round-robin until `n` messages arrived in total, or `timeout` seconds passed: what came."""
    got: list[Any] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while len(got) < n and loop.time() < deadline:
        for c in consumers:
            got.extend(await c.poll(timeout=0.05))
    return got


async def poll_until(c: bus.Consumer, n: int, timeout: float = 20.0) -> list[bus.Message]:  # noqa: ASYNC109 - a test helper: the deadline is the point
    """Poll `c` until `n` messages arrived: them, or AssertionError after `timeout` seconds."""
    got: list[bus.Message] = []

    async def more() -> bool:
        got.extend(await c.poll(timeout=0.05))
        return len(got) >= n

    await eventually(more, timeout=timeout, every=0)
    return got


async def consume_claims(b: bus.Bus, group: str, topic: str, upto: int, **claim: Any) -> None:
    """Claim and ack until the group's cursor on partition "0" reaches `upto`."""
    while True:
        c = await b.claim(group, topic=topic, worker_id="w", max_messages=upto, **claim)
        if c is None:
            return
        last = min(c.messages[-1].offset, upto - 1)
        if last < c.messages[0].offset:
            await c.release()
            return
        await c.ack(last)
        if last + 1 >= upto:
            return


async def log_start(b: bus.Bus, topic: str, partition: str = "0") -> int:
    """The first offset `partition` of `topic` still keeps (what retention and compaction moved)."""
    (stats,) = [s for s in await b.admin.topic_stats(topic) if s.partition == partition]
    return stats.log_start


@asynccontextmanager
async def bus_of_its_own(
    dsn: str, prefix: str, target: str | None = None, **config: Any
) -> AsyncIterator[tuple[bus.Bus, str]]:
    """A Bus on a new schema `prefix` + a random suffix (reached through `target`, `dsn` by default), and
    the schema's name; the Bus is closed and the schema dropped (on `dsn`) after."""
    schema = prefix + uuid.uuid4().hex[:12]
    b = await bus.connect(target or dsn, schema=schema, **config)
    try:
        yield b, schema
    finally:
        await b.close()
        conn = await asyncpg.connect(dsn)
        try:
            await drop_schema(conn, schema)
        finally:
            await conn.close()


@asynccontextmanager
async def bus_on_schema_before(
    dsn: str, schema: str, version: int, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[bus.Bus]:
    """A Bus on `schema` migrated by the migrations before `version` only: the schema an earlier
    release left (the test marks itself `fresh_schema`). The migrations are whole again after it."""
    every = migrations()
    monkeypatch.setattr("storage.migrate.migrations", lambda: [m for m in every if m[0] < version])
    try:
        old = await bus.connect(dsn, schema=schema)
        try:
            yield old
        finally:
            await old.close()
    finally:
        monkeypatch.undo()


@contextmanager
def stock_server(directory: Path) -> Iterator[str]:
    """Debian's PostgreSQL 15 with its defaults (JIT on), started in `directory`: its DSN.

    Without that server a test is skipped, or fails on CI, which installs it (scripts/ensure-pg15.sh).
    """
    from benchmarks import stockpg  # the script that starts it, part of the checkout

    if not stockpg.available():
        message = "needs Debian's PostgreSQL 15 (scripts/ensure-pg15.sh)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    server = stockpg.StockServer(directory)
    dsn = server.start()
    try:
        yield dsn
    finally:
        server.stop()
