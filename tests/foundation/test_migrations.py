"""Migrations: versioned, recorded, into a configurable validated schema, idempotent, safe under concurrency."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

import bus
from storage import db, routines


@pytest.fixture
async def fresh_schemas(dsn: str) -> AsyncIterator[list[str]]:
    """Schema names to use (dropped at teardown)."""
    names: list[str] = []
    yield names
    conn = await asyncpg.connect(dsn)
    try:
        for name in names:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
    finally:
        await conn.close()


async def _schema_exists(dsn: str, name: str) -> bool:
    conn = await asyncpg.connect(dsn)
    try:
        return bool(await conn.fetchval("SELECT count(*) FROM pg_namespace WHERE nspname = $1", name))
    finally:
        await conn.close()


async def test_every_migration_is_recorded_once_in_version_order(b: bus.Bus) -> None:
    rows = await b.pool.fetch("SELECT version, name, applied_at FROM bus_migrations ORDER BY version")
    expected = [(v, n) for v, n, _ in db.migrations()]
    assert [(r["version"], r["name"]) for r in rows] == expected
    assert expected[:2] == [(1, "log"), (2, "groups")]


async def test_migrating_again_applies_nothing(b: bus.Bus, dsn: str) -> None:
    conn = await db.connect(dsn, b.config.schema)
    try:
        assert await db.migrate(conn, b.config.schema) == []
    finally:
        await conn.close()
    count = await b.pool.fetchval("SELECT count(*) FROM bus_migrations")
    assert count == len(db.migrations())


async def test_connect_migrates_into_the_configured_schema_only(dsn: str, fresh_schemas: list[str]) -> None:
    name = "bus_" + uuid.uuid4().hex[:10]
    fresh_schemas.append(name)
    async with bus.connect(dsn, schema=name) as b:
        await b.create_topic("t")
        tables = await b.pool.fetch(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = $1", name
        )
        assert {"bus_migrations", "topics", "partitions", "messages"} <= {r[0] for r in tables}
        assert await b.pool.fetchval("SELECT current_schema()") == name
        assert b.config.schema == name


async def test_schema_comes_from_bus_schema_and_the_keyword_wins(
    dsn: str, fresh_schemas: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from_env, from_kw = "env_" + uuid.uuid4().hex[:10], "kw_" + uuid.uuid4().hex[:10]
    fresh_schemas += [from_env, from_kw]
    monkeypatch.setenv("BUS_SCHEMA", from_env)
    async with bus.connect(dsn) as b:
        assert await b.pool.fetchval("SELECT current_schema()") == from_env
    async with bus.connect(dsn, schema=from_kw) as b:
        assert await b.pool.fetchval("SELECT current_schema()") == from_kw


async def test_a_mixed_case_schema_keeps_its_case(dsn: str, fresh_schemas: list[str]) -> None:
    name = "Bus_" + uuid.uuid4().hex[:10].upper()
    fresh_schemas.append(name)
    async with bus.connect(dsn, schema=name) as b:
        await b.create_topic("t")
        await b.publish("t", b"x")
        assert await b.pool.fetchval("SELECT current_schema()") == name
        assert len(await b.read("t")) == 1


@pytest.mark.parametrize(
    "name",
    ["", "1abc", "a-b", "a b", 'x"; DROP SCHEMA public; --', "a" * 64, "naïve", "a.b", 7],
    ids=lambda n: repr(n)[:16],
)
async def test_a_bad_schema_name_is_refused_and_nothing_is_created(dsn: str, name: object) -> None:
    with pytest.raises(bus.ValidationError, match="schema"):
        await bus.connect(dsn, schema=name)
    if isinstance(name, str) and 0 < len(name) < 64:
        assert not await _schema_exists(dsn, name)


def test_schema_names_of_63_characters_are_accepted() -> None:
    assert bus.Config.load({"schema": "_" + "a" * 62}, environ={}).schema == "_" + "a" * 62


_CONNECT_ONCE = textwrap.dedent(
    """
    import asyncio, sys
    import bus

    async def main() -> None:
        async with bus.connect(sys.argv[1], schema=sys.argv[2]) as b:
            await b.create_topic("t", partitions=3)   # all five: the same topic, a no-op after the first
            rec = await b.publish("t", b"x", partition="0")
            print(rec.offset)

    asyncio.run(main())
    """
)


@pytest.mark.slow
async def test_five_processes_connecting_to_a_new_schema_at_once_all_succeed(
    dsn: str, fresh_schemas: list[str]
) -> None:
    name = "race_" + uuid.uuid4().hex[:10]
    fresh_schemas.append(name)
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _CONNECT_ONCE,
            dsn,
            name,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for _ in range(5)
    ]
    results = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), 120)
    for proc, (_, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err.decode()[-2000:]
    assert sorted(int(out.decode().split()[-1]) for out, _ in results) == [0, 1, 2, 3, 4]
    conn = await db.connect(dsn, name)
    try:
        rows = await conn.fetch("SELECT version FROM bus_migrations ORDER BY version")
        assert [r[0] for r in rows] == [v for v, _, _ in db.migrations()]
        assert await conn.fetchval("SELECT count(*) FROM topics") == 1
        # processes that imported nothing but `bus` installed the routines of every listed statement
        made = await conn.fetch(
            "SELECT proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
            " WHERE n.nspname = $1 AND proname LIKE 'bus_stmt_%'",
            name,
        )
        assert sorted(r[0] for r in made) == sorted(routines.name_of(sql) for sql in routines.registered())
        assert len(made) == 5
    finally:
        await conn.close()
