"""Helpers for the foundation tests: row counts to prove that refused input wrote nothing."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

import bus

Counts = Callable[[], Awaitable[dict[str, int]]]

_COUNTED = ("topics", "partitions", "messages")


@pytest.fixture
def counts(b: bus.Bus) -> Counts:
    """`await counts()` -> rows per table (topics, partitions, messages) plus the partitions' offset counters."""

    async def snapshot() -> dict[str, int]:
        async with b.pool.acquire() as conn:
            result = {
                "topics": await conn.fetchval("SELECT count(*) FROM topics"),
                "partitions": await conn.fetchval("SELECT count(*) FROM partitions"),
                "messages": await conn.fetchval("SELECT count(*) FROM messages"),
                "next_offsets": await conn.fetchval("SELECT coalesce(sum(next_offset), 0) FROM partitions"),
            }
        return {k: int(v) for k, v in result.items()}

    return snapshot
