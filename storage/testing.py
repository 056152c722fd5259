"""Statements for `bus.testing`: dropping a test's schema."""

from __future__ import annotations

import asyncpg

from storage.names import validate_schema


async def drop_schema(conn: asyncpg.Connection, schema: str) -> None:
    """Drop `schema` and everything in it (a test's private schema)."""
    # An identifier cannot be a bind parameter: validated (a plain identifier) and quoted instead.
    validate_schema(schema)
    await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
