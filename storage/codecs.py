"""How values cross the driver on the bus's connections: a cached timestamptz codec,
the built-in array types handed to each new connection, and int arrays as text literals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import MAXYEAR, MINYEAR, UTC, date, datetime, timedelta, timezone
from typing import Any

import asyncpg


def int_array(values: Iterable[int]) -> str:
    """An int[] / bigint[] parameter as its text literal (`$1::text::bigint[]`), for lists of many ints.

    asyncpg's binary array encoder checks every element against two ABCs;
    as text the server parses the literal in C, which costs far less per element. The values are ints, so the literal
    is digits, signs and commas (and it is a parameter: a wrong one fails to parse).
    """
    return "{" + ",".join(map(str, values)) + "}"


# timestamptz as asyncpg's tuple format gives it: microseconds since 2000-01-01 UTC.
_PG_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
_PG_INFINITY = 0x7FFF_FFFF_FFFF_FFFF
_PG_NEGATIVE_INFINITY = -0x8000_0000_0000_0000
# asyncpg's own values for PostgreSQL's infinities (naive, as asyncpg returns them).
_INFINITY = datetime(MAXYEAR, 12, 31, 23, 59, 59, 999999)
_NEGATIVE_INFINITY = datetime(MINYEAR, 1, 1)
_INFINITY_US = 252455615999999999  # _INFINITY as microseconds since the epoch
_NEGATIVE_INFINITY_US = -63082281600000000
_TIMESTAMPS_KEPT = 1024


def _timestamptz_codec() -> tuple[Callable[[Any], tuple[int]], Callable[[tuple[int]], datetime]]:
    """asyncpg's timestamptz conversion, with the decoded values of one connection remembered.

    A fetched batch of messages mostly shares a handful of `created_at`
    values (a publishing statement stamps all of its messages alike), and
    asyncpg builds a new datetime for every row (a timedelta and an aware
    addition, a noticeable part of a queue job's whole cost). Equal values
    decode to one shared (immutable) datetime. Encoding and the
    infinities behave exactly as asyncpg's binary codec (pgproto/codecs/datetime.pyx).
    """
    seen: dict[int, datetime] = {}

    def decode(value: tuple[int]) -> datetime:
        us = value[0]
        found = seen.get(us)
        if found is not None:
            return found
        if us == _PG_INFINITY:
            return _INFINITY
        if us == _PG_NEGATIVE_INFINITY:
            return _NEGATIVE_INFINITY
        if len(seen) >= _TIMESTAMPS_KEPT:
            seen.clear()
        found = seen[us] = _PG_EPOCH + timedelta(microseconds=us)
        return found

    def encode(obj: Any) -> tuple[int]:
        if not isinstance(obj, datetime):
            if isinstance(obj, date):
                local = datetime.now(UTC).astimezone().utcoffset()
                obj = datetime(obj.year, obj.month, obj.day, tzinfo=timezone(local or timedelta(0)))
            else:
                raise TypeError(
                    f"expected a datetime.date or datetime.datetime instance, got {type(obj).__name__!r}"
                )
        if obj == _INFINITY:
            return (_PG_INFINITY,)
        if obj == _NEGATIVE_INFINITY:
            return (_PG_NEGATIVE_INFINITY,)
        delta = obj.astimezone(UTC) - _PG_EPOCH
        us = (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds
        if us == _INFINITY_US:
            return (_PG_INFINITY,)
        if us == _NEGATIVE_INFINITY_US:
            return (_PG_NEGATIVE_INFINITY,)
        return (us,)

    return encode, decode


async def setup_connection(conn: asyncpg.Connection) -> None:
    """Codecs of every pool connection (see `_timestamptz_codec`)."""
    encode, decode = _timestamptz_codec()
    await conn.set_type_codec(
        "timestamptz", schema="pg_catalog", encoder=encode, decoder=decode, format="tuple"
    )
    await preload_array_types(conn)  # after the element codecs they build on


# The built-in array types the bus's statements pass and read. asyncpg knows only oid[] and
# text[] by itself: on a fresh connection, the first statement with any other array type runs
# its type introspection (a recursive catalog query, heavy for the server) before it runs.
# Many members reacting to one rebalance on fresh pool connections turn that into a burst
# that holds up every other statement on the server. The answer is the same for every
# connection (built-in types), so it is asked once per process and server version and
# handed to each new connection.
_ARRAY_TYPES = "SELECT t::regtype::oid FROM unnest($1::text[]) AS t"
_ARRAY_TYPE_NAMES = [
    "bigint[]",
    "integer[]",
    "smallint[]",
    "bytea[]",
    "timestamptz[]",
    "float8[]",
    "boolean[]",
    "jsonb[]",
]
_array_types: dict[int, list[Any]] = {}  # server major version -> asyncpg's type records


async def preload_array_types(conn: asyncpg.Connection) -> None:
    """Give `conn` the codecs of the built-in array types without asking the server again.

    Uses asyncpg's own introspection and codec registration (internal names, so anything
    missing leaves the connection as asyncpg made it: it asks on first use, as usual).
    """
    inner: Any = conn  # asyncpg's internals, not in its type stubs
    try:
        settings = inner._protocol.get_settings()  # noqa: SLF001 - no public way to share type info
        major = conn.get_server_version().major
        records = _array_types.get(major)
        if records is None:
            oids = [r[0] for r in await conn.fetch(_ARRAY_TYPES, _ARRAY_TYPE_NAMES)]
            records, _ = await inner._introspect_types(oids, None)  # noqa: SLF001
            records = _array_types.setdefault(major, list(records))
        settings.register_data_types(records)
    except AttributeError:
        return
