"""Fixtures of the foundation tests.

The tests here share one migrated schema, emptied after each test, instead of
migrating a fresh schema per test (migrating costs far more than the tests
themselves). Tests that need a brand-new schema make their own names.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import pytest

import bus

Counts = Callable[[], Awaitable[dict[str, int]]]

LIST_TABLES = "SELECT tablename FROM pg_tables WHERE schemaname = $1 AND tablename <> 'bus_migrations'"


@pytest.fixture(scope="session")
async def shared_schema(dsn: str) -> AsyncIterator[str]:
    """One schema for the whole foundation suite, dropped at the end."""
    name = "f_" + uuid.uuid4().hex[:12]
    yield name
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
    finally:
        await conn.close()


@pytest.fixture
def schema(shared_schema: str) -> str:
    """Overrides the per-test schema: the shared one (empty at the start of every test)."""
    return shared_schema


@pytest.fixture
async def drop_schema(dsn: str, schema: str) -> AsyncIterator[None]:
    """Overrides the root fixture: empty every bus table of the shared schema after the test."""
    yield
    conn = await asyncpg.connect(dsn)
    try:
        tables = [r[0] for r in await conn.fetch(LIST_TABLES, schema)]
        if tables:
            # Test-only SQL: the names come from the catalog of a schema this suite created.
            listed = ", ".join(f'"{schema}"."{t}"' for t in tables)
            await conn.execute(f"TRUNCATE {listed} RESTART IDENTITY CASCADE")
    finally:
        await conn.close()


@pytest.fixture
def counts(b: bus.Bus) -> Counts:
    """`await counts()` -> rows per table (topics, partitions, messages) plus the partitions' offset counters."""

    async def snapshot() -> dict[str, int]:
        async with b.pool.acquire() as conn:
            result = {
                "topics": await conn.fetchval("SELECT count(*) FROM topics"),
                "partitions": await conn.fetchval("SELECT count(*) FROM partitions"),
                "messages": await conn.fetchval("SELECT count(*) FROM messages"),
                "next_offsets": await conn.fetchval("SELECT coalesce(sum(p.log_end), 0) FROM partitions p"),
            }
        return {k: int(v) for k, v in result.items()}

    return snapshot
