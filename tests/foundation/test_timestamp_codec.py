"""Pool connections decode timestamptz with a memo: the same values as asyncpg's own codec, shared objects."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta, timezone

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bus

ROUND_TRIP = "SELECT $1::timestamptz, $1::timestamptz::text"
PG_TEXTS = [
    "2026-11-26 12:00:00.123456+00",
    "1999-12-31 23:59:59.999999+00",
    "2000-01-01 00:00:00+00",
    "1970-01-01 00:00:00+00",
    "0001-01-01 00:00:00+00",
    "9999-12-31 23:59:59.999999+00",
    "infinity",
    "-infinity",
]


@pytest.fixture
async def plain(dsn: str) -> asyncpg.Connection:
    conn = await asyncpg.connect(dsn)
    yield conn
    await conn.close()


async def test_decoded_timestamps_equal_asyncpgs_and_equal_ones_are_one_object(
    b: bus.Bus, plain: asyncpg.Connection
) -> None:
    query = "SELECT t::timestamptz FROM unnest($1::text[]) AS t"
    expected = [r[0] for r in await plain.fetch(query, PG_TEXTS)]
    async with b.pool.acquire() as conn:
        got = [r[0] for r in await conn.fetch(query, PG_TEXTS)]
        again = [r[0] for r in await conn.fetch(query, PG_TEXTS)]
    assert got == expected
    assert [type(v) for v in got] == [type(v) for v in expected]
    assert [v.tzinfo for v in got] == [v.tzinfo for v in expected]
    assert all(a is b for a, b in zip(got[:6], again[:6], strict=True))


async def test_every_kind_of_parameter_encodes_as_asyncpgs_codec_does(
    b: bus.Bus, plain: asyncpg.Connection
) -> None:
    values: list[object] = [
        datetime(2026, 11, 26, 12, 0, 0, 123456, tzinfo=UTC),
        datetime(2026, 11, 26, 12, 0, 0, tzinfo=timezone(timedelta(hours=-5))),
        datetime(2026, 11, 26, 12, 0, 0),  # naive: local time, as asyncpg reads it
        date(2026, 11, 26),
        datetime.max,
        datetime.min,
        datetime(1969, 7, 20, 20, 17, 40, tzinfo=UTC),
    ]
    async with b.pool.acquire() as conn:
        for value in values:
            assert tuple(await conn.fetchrow(ROUND_TRIP, value)) == tuple(
                await plain.fetchrow(ROUND_TRIP, value)
            ), value
        for conn_ in (conn, plain):
            with pytest.raises(asyncpg.DataError, match="expected a datetime.date or datetime.datetime"):
                await conn_.fetchrow(ROUND_TRIP, "2026-11-26")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30), timezones=st.just(UTC)))
async def test_any_aware_timestamp_round_trips_exactly(b: bus.Bus, value: datetime) -> None:
    async with b.pool.acquire() as conn:
        back = await conn.fetchval("SELECT $1::timestamptz", value)
    assert back == value and back.tzinfo is UTC


async def test_the_memo_stays_bounded(b: bus.Bus) -> None:
    async with b.pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT '2026-01-01'::timestamptz + g * interval '1 microsecond' FROM generate_series(1, 5000) g"
        )
    assert len({r[0] for r in rows}) == 5000
    assert rows[-1][0] - rows[0][0] == timedelta(microseconds=4999)
