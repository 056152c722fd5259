"""Tests talk to a real PostgreSQL: the embedded server, or BUS_TEST_DSN when set.

Every test gets a schema of its own, so tests never see each other's data
and the database can be shared (also with a PostgreSQL 15 server: see README).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg
import pytest

import bus
from bus.testing import FAST
from storage import db


@pytest.fixture(scope="session")
def dsn() -> str:
    explicit = os.environ.get("BUS_TEST_DSN")
    if explicit:
        return explicit
    from bus.server.embedded import ensure_server

    return ensure_server().dsn


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
