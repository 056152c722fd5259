"""The recycled test schemas (tests/conftest.py, SchemaPool): a test cannot tell one from a new schema."""

from __future__ import annotations

import re
import uuid
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

import bus
from storage import db, segments
from tests.conftest import _FINGERPRINT, _SEGMENT, SchemaPool

# Test-only SQL: what a test can read of a schema's state, besides its structure.
_TABLES = """SELECT c.relname, pg_relation_size(c.oid) AS size FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND c.relkind = 'r' ORDER BY 1"""
_SEQUENCES = """SELECT sequencename, last_value FROM pg_sequences WHERE schemaname = $1 ORDER BY 1"""
_PINNED = """SELECT p.proname, p.proconfig FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = $1 AND p.proconfig IS NOT NULL ORDER BY 1"""


# Times a migration writes (a segment's name is its end time).
_TIMES = {"bus_migrations": {"applied_at"}, "bus_schema_release": {"updated_at"}}
_TIMES["message_segments"] = {"name", "hi", "created_at"}


async def _exists(conn: asyncpg.Connection, schema: str) -> bool:
    return bool(await conn.fetchval("SELECT true FROM pg_namespace WHERE nspname = $1", schema))


def _name() -> str:
    return "t_" + uuid.uuid4().hex[:12]


async def _state(conn: asyncpg.Connection, schema: str) -> dict[str, Any]:
    """What a test could see of `schema`: tables and their sizes, rows of the non-empty ones, sequences, pins."""
    tables = {r["relname"]: r["size"] for r in await conn.fetch(_TABLES, schema)}
    rows = {}
    for table, size in tables.items():
        if size:  # names from the catalog, quoted
            rows[table] = [
                {k: v for k, v in dict(r).items() if k not in _TIMES.get(table, ())}
                for r in await conn.fetch(f'SELECT * FROM "{schema}"."{table}" ORDER BY 1')
            ]
    # The first segment is named after the time it ends: when the schema was migrated or handed out.
    tables = {re.sub(_SEGMENT, "messages_SEGMENT", t): size for t, size in tables.items()}
    pins = [
        (r["proname"], [c.replace(schema, "@") for c in r["proconfig"]])
        for r in await conn.fetch(_PINNED, schema)
    ]
    return {
        "tables": tables,
        "rows": rows,
        "sequences": [tuple(r) for r in await conn.fetch(_SEQUENCES, schema)],
        "pins": pins,
        "fingerprint": await conn.fetchval(_FINGERPRINT, schema, _SEGMENT),
    }


@pytest.fixture
async def pool(dsn: str) -> Any:
    """A pool of its own (the worker's stays untouched), its reference schema ready, resetting at once."""
    p = await SchemaPool.start(dsn, background=False)
    yield p
    await p.close()


@pytest.fixture
async def admin(dsn: str) -> Any:
    conn = await asyncpg.connect(dsn)
    made: list[str] = []
    yield conn, made
    for name in made:
        await db.drop_schema(conn, name)
    await conn.close()


async def test_a_recycled_schema_looks_like_one_just_migrated(dsn: str, pool: SchemaPool, admin: Any) -> None:
    conn, made = admin
    fresh, used, again = _name(), _name(), _name()
    made += [fresh, used, again]
    await db.migrate(conn, fresh)

    assert await pool.take(used)
    b = await bus.connect(dsn, schema=used)
    try:
        await b.create_topic("orders", partitions=3)
        await b.publish("orders", {"n": 1}, key="k")
        async with b.pool.acquire() as c:
            assert await segments.ensure(c, width=0.5, ahead=1.5, margin=0)
        await b.pool.execute("DELETE FROM topics WHERE name = 'nothing'")
    finally:
        await b.close()
    assert (await _state(conn, used))["tables"]["partitions"] > 0
    await pool.give_back(used)
    assert await _exists(conn, used)  # kept, reset

    assert await pool.take(again)  # the schema given back last
    assert not await _exists(conn, used)
    assert await _state(conn, again) == await _state(conn, fresh)
    # The migration rows carry the time of the hand-out, as a migration then would have written them.
    times = await conn.fetch(
        f'SELECT applied_at AS at FROM "{again}".bus_migrations UNION SELECT updated_at FROM "{again}".bus_schema_release'
    )
    assert len(times) == 1
    assert await conn.fetchval("SELECT now() - $1::timestamptz < interval '1 minute'", times[0]["at"])
    # Its first segment ends then too.
    first = await conn.fetchrow(f'SELECT lo, hi FROM "{again}".message_segments')
    assert first["lo"] is None
    assert first["hi"] - times[0]["at"] < timedelta(seconds=1)

    # And it works as one: the pinned functions find its tables under the new name.
    b = await bus.connect(dsn, schema=again)
    try:
        await b.create_topic("orders", partitions=1)
        await b.publish("orders", {"n": 2})
        assert await b.pool.fetchval("SELECT count(*) FROM partitions") == 1
    finally:
        await b.close()


async def test_a_schema_changed_structurally_or_in_its_migration_rows_is_dropped(
    pool: SchemaPool, admin: Any
) -> None:
    conn, made = admin
    altered, downgraded = _name(), _name()
    made += [altered, downgraded]
    assert await pool.take(altered)
    await conn.execute(f'ALTER TABLE "{altered}".topics ADD COLUMN extra int')
    await pool.give_back(altered)
    assert not await _exists(conn, altered)

    await db.migrate(conn, downgraded)
    await conn.execute(f"UPDATE \"{downgraded}\".bus_schema_release SET min_release = '0.1.0'")
    await pool.give_back(downgraded)
    assert not await _exists(conn, downgraded)
    assert pool.dropped == 2


async def test_a_bus_left_open_does_not_reach_the_next_tests_schema(
    dsn: str, pool: SchemaPool, admin: Any
) -> None:
    conn, made = admin
    first, second = _name(), _name()
    made += [first, second]
    assert await pool.take(first)
    left_open = await bus.connect(dsn, schema=first)
    try:
        await left_open.create_topic("orders", partitions=1)
        await pool.give_back(first)
        assert await pool.take(second)
        with pytest.raises(Exception):  # noqa: B017 - any failure: its schema is gone by its name
            await left_open.create_topic("late", partitions=1)
        assert await conn.fetchval(f'SELECT count(*) FROM "{second}".topics') == 0
    finally:
        await left_open.close()


@pytest.mark.fresh_schema
async def test_a_test_marked_fresh_schema_gets_no_schema(dsn: str, schema: str, drop_schema: None) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        assert not await conn.fetchval("SELECT true FROM pg_namespace WHERE nspname = $1", schema)
        assert await db.migrate(conn, schema) == [v for v, _, _ in db.migrations()]
    finally:
        await conn.close()


async def test_other_tests_get_their_schema_migrated(dsn: str, schema: str, drop_schema: None) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        assert await db.migrate(conn, schema) == []
    finally:
        await conn.close()


async def test_schemas_are_reset_in_the_background_and_a_new_one_is_made_while_a_test_runs(
    dsn: str, admin: Any
) -> None:
    conn, made = admin
    pool = await SchemaPool.start(dsn)
    try:
        first, second, third = _name(), _name(), _name()
        made += [first, second, third]
        assert await pool.take(first)
        await pool.settle()  # the next one is made while the first test runs
        assert await pool.take(second)
        b = await bus.connect(dsn, schema=second)
        await b.create_topic("orders", partitions=2)
        await b.close()
        await pool.give_back(first)
        await pool.give_back(second)
        await pool.settle()
        # Made while the tests ran: one after each hand-out that left none ready. Two are kept.
        assert (pool.recycled, pool.dropped) == (3, 1)
        assert [await _exists(conn, name) for name in (first, second)] == [True, False]
        assert await pool.take(third)
        assert await conn.fetchval(f'SELECT count(*) FROM "{third}".topics') == 0
        assert await conn.fetchval(f'SELECT count(*) FROM "{third}".message_segments') == 1
    finally:
        await pool.close()
