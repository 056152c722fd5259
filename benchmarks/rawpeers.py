"""Raw asyncpg baselines: what a careful engineer writes by hand, with no bus in between.

Each benchmark sets the bus next to one of these, in the same run, on the
same PostgreSQL, with the same pool size, concurrency and payloads, so the
ratio measures the bus's own cost and nothing else.

`RawLog` is the plain append-only table a service would use as its outbox:
a `bigserial` id, a partition number, key, JSON headers, bytea payload and a
timestamp, with the same secondary index the bus keeps on
`(partition, created_at)`. It has no per-partition offset counter and no
NOTIFY: those are exactly the guarantees the bus adds (dense offsets visible
in order, wake-ups for consumers), so the ratio prices them.

The statements are constants like every statement in `storage/`; the only
identifier ever interpolated is a schema name, after `validate_schema`.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from storage.names import validate_schema

CREATE_RAW_MESSAGES = """
CREATE TABLE IF NOT EXISTS raw_messages (
    id          bigserial PRIMARY KEY,
    partition   integer NOT NULL,
    key         text NULL,
    headers     jsonb NULL,
    payload     bytea NULL,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS raw_messages_created ON raw_messages (partition, created_at);
"""

INSERT_ONE = """
INSERT INTO raw_messages (partition, key, headers, payload)
VALUES ($1, $2, $3::jsonb, $4)
RETURNING id, created_at
"""

INSERT_BATCH = """
INSERT INTO raw_messages (partition, key, headers, payload)
SELECT u.part, u.k, u.h::jsonb, u.p
FROM unnest($1::int[], $2::text[], $3::text[], $4::bytea[]) AS u(part, k, h, p)
RETURNING id, created_at
"""

COUNT_RAW_MESSAGES = "SELECT count(*) FROM raw_messages"

SERVER_VERSION = "SELECT current_setting('server_version')"


async def create_pool(dsn: str, schema: str, *, min_size: int, max_size: int) -> asyncpg.Pool:
    """A plain asyncpg pool on `schema` (the same search_path setup the bus uses)."""
    pool = await asyncpg.create_pool(
        dsn,
        min_size=min_size,
        max_size=max_size,
        server_settings={"search_path": validate_schema(schema), "application_name": "bench-raw"},
    )
    assert pool is not None
    return pool


class RawLog:
    """The raw baseline for publishing: single-row INSERTs and `INSERT ... SELECT FROM unnest(...)` batches."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    async def create(self) -> None:
        """Create the baseline table (idempotent)."""
        async with self.pool.acquire() as conn:
            await conn.execute(CREATE_RAW_MESSAGES)

    async def insert_one(self, partition: int, key: str | None, headers: str | None, payload: bytes) -> Any:
        """One message, one transaction (autocommit), id and timestamp returned like the bus's Record."""
        return await self.pool.fetchrow(INSERT_ONE, partition, key, headers, payload)

    async def insert_batch(
        self,
        partitions: list[int],
        keys: list[str | None],
        headers: list[str | None],
        payloads: list[bytes],
    ) -> list[Any]:
        """Many messages in one statement (so one transaction), ids and timestamps returned."""
        return list(await self.pool.fetch(INSERT_BATCH, partitions, keys, headers, payloads))

    async def count(self) -> int:
        """How many rows the table holds (a check that every insert landed)."""
        return int(await self.pool.fetchval(COUNT_RAW_MESSAGES))


async def server_version(dsn: str) -> str:
    """The PostgreSQL server's version string."""
    conn = await asyncpg.connect(dsn)
    try:
        return str(await conn.fetchval(SERVER_VERSION))
    finally:
        await conn.close()


async def drop_schema(dsn: str, schema: str) -> None:
    """Drop a benchmark's schema and everything in it."""
    validate_schema(schema)
    conn = await asyncpg.connect(dsn)
    try:
        # The one interpolated identifier: validated just above.
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()
