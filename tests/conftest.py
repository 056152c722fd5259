"""Tests talk to a real PostgreSQL: the embedded server, or BUS_TEST_DSN when set.

Every test gets a schema of its own, so tests never see each other's data
and the database can be shared (also with a PostgreSQL 15 server: see README).

`make test` runs the suite on pytest-xdist workers. Each worker has a database
of its own on the server (what a test reads server-wide, such as the sessions
it terminates, stays within it), the tests of one file run on one worker (its
module fixtures are built once), and the slow multi-process, chaos and Spark
tests run one after another on a single worker, so two of them never compete
for the cores.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

import bus
from bus.testing import FAST
from storage import db


HEAVY = "slow tests, one at a time"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Where xdist runs each test (`--dist loadgroup`): slow ones on one worker, a file's tests together."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            group = HEAVY if item.get_closest_marker("slow") else item.nodeid.split("::")[0]
            item.add_marker(pytest.mark.xdist_group(group))


async def _worker_database(dsn: str, worker: str) -> str:
    """`dsn` on the database of xdist worker `worker`, created if missing (the server's own one when
    the role may not create databases)."""
    name = f"bus_test_{worker}"
    conn = await asyncpg.connect(dsn)
    try:
        if not await conn.fetchval("SELECT true FROM pg_database WHERE datname = $1", name):
            try:
                # An identifier cannot be a bind parameter: the name is ours ("gw" and a number).
                await conn.execute(f'CREATE DATABASE "{name}"')
            except asyncpg.InsufficientPrivilegeError:
                return dsn
            except asyncpg.DuplicateDatabaseError:
                pass
    finally:
        await conn.close()
    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


@pytest.fixture(scope="session")
def dsn() -> str:
    explicit = os.environ.get("BUS_TEST_DSN")
    if explicit:
        server = explicit
    else:
        from bus.server.embedded import ensure_server

        server = ensure_server().dsn
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return server
    with ThreadPoolExecutor(1) as pool:  # the session's event loop may not be running yet
        return pool.submit(asyncio.run, _worker_database(server, worker)).result()


@pytest.fixture
def fast() -> dict[str, Any]:
    """The test timings of bus.testing (short sessions, short debounce, short poll fallback)."""
    return dict(FAST)


@pytest.fixture
def schema() -> str:
    return "t_" + uuid.uuid4().hex[:12]


@pytest.fixture
async def drop_schema(dsn: str, schema: str) -> AsyncIterator[None]:
    yield
    conn = await asyncpg.connect(dsn)
    try:
        await db.drop_schema(conn, schema)
    finally:
        await conn.close()


Connect = Callable[..., Any]


@pytest.fixture(scope="session")
def bus_target(dsn: str) -> tuple[str, dict[str, Any]]:
    """Where the tests' Buses connect and with which settings (tests/pooler: through PgBouncer)."""
    return dsn, {}


@pytest.fixture
async def connect(
    bus_target: tuple[str, dict[str, Any]], schema: str, drop_schema: None
) -> AsyncIterator[Connect]:
    """Open extra Buses on the test's schema (several members in one test)."""
    opened: list[bus.Bus] = []
    target, defaults = bus_target

    async def open_bus(**config: Any) -> bus.Bus:
        config = {"schema": schema, **defaults, **config}
        b = await bus.connect(target, **config)
        opened.append(b)
        return b

    yield open_bus
    for b in reversed(opened):
        await b.close()


@pytest.fixture
async def b(connect: Connect) -> bus.Bus:
    """A Bus on a fresh schema."""
    return await connect()


def plan_modes(monkeypatch: pytest.MonkeyPatch, module: Any, *names: str) -> list[str]:
    """Spy on storage functions `module.<name>`: the plan_cache_mode of what each call ran on.

    Reads of a large log must run where plans are generic (storage.db.GENERIC_PLANS): with
    PostgreSQL's default they are planned again on every call.
    """
    modes: list[str] = []
    for name in names:
        original = getattr(module, name)

        async def noting_the_mode(conn: Any, *args: Any, _original: Any = original, **kw: Any) -> Any:
            modes.append(await conn.fetchval("SHOW plan_cache_mode"))
            return await _original(conn, *args, **kw)

        monkeypatch.setattr(module, name, noting_the_mode)
    return modes
