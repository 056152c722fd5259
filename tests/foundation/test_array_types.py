"""Fresh connections know the built-in array types: no type introspection before their first statements."""

from __future__ import annotations

from datetime import datetime

import asyncpg

from storage import db

# What the bus's statements pass and read: arrays of int8, int4, bytea, timestamptz, float8.
STATEMENTS = [
    ("SELECT $1::bigint[]", [1, 2]),
    ("SELECT $1::int[]", [3]),
    ("SELECT $1::bytea[]", [b"x"]),
    ("SELECT $1::float8[]", [0.5]),
    ("SELECT ARRAY['infinity'::timestamptz, '2026-01-01 00:00:00+00'::timestamptz]", None),
]


def _introspections(conn: asyncpg.Connection) -> list[str]:
    seen: list[str] = []
    conn.add_query_logger(lambda r: seen.append(r.query))
    return seen


async def _run_all(conn: asyncpg.Connection) -> list[object]:
    return [await (conn.fetchval(q, arg) if arg is not None else conn.fetchval(q)) for q, arg in STATEMENTS]


async def test_a_fresh_pool_connection_runs_array_statements_without_asking_the_server_for_types(
    dsn: str, schema: str, drop_schema: None
) -> None:
    pool = await db.create_pool(dsn, schema, min_size=1, max_size=2)
    try:
        async with pool.acquire() as conn:
            seen = _introspections(conn._con)  # the proxy's connection
            values = await _run_all(conn)
        assert not [q for q in seen if "typeinfo_tree" in q], seen
        assert values[:4] == [[1, 2], [3], [b"x"], [0.5]]
        # The pool's own timestamptz codec still decodes the array's elements ('infinity' as the largest time).
        far, day = values[4]
        assert far == datetime.max and day.year == 2026
    finally:
        await pool.close()


async def test_a_fresh_single_connection_does_too(dsn: str, schema: str) -> None:
    conn = await db.connect(dsn, schema)
    try:
        seen = _introspections(conn)
        values = await _run_all(conn)
    finally:
        await conn.close()
    assert not [q for q in seen if "typeinfo_tree" in q], seen
    assert values[:4] == [[1, 2], [3], [b"x"], [0.5]]
