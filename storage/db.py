"""Connections and migrations.

Every connection the bus opens has `search_path` set to the bus schema, so
every statement in `storage/` is a constant string with unqualified names.
Migrations are the numbered `.sql` files beside this module, applied in order
under an advisory lock (many processes may connect to a new database at once)
and recorded in `bus_migrations`.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from datetime import MAXYEAR, MINYEAR, UTC, date, datetime, timedelta, timezone
from typing import Any, Literal, TypeAlias

import asyncpg
import msgspec
from asyncpg.pool import PoolConnectionProxy

from storage import versions
from storage.errors import BusError, ConfigurationError, SchemaVersionError, StorageUnavailableError
from storage.logs import get_logger
from storage.names import validate_schema

log = get_logger(__name__)

#: Where a lease or expiry statement's `now` comes from: a time, or None for the server's clock
#: (`server_clock`, production's). A test's `bus.testing.Clock` moves it for one Bus.
Now: TypeAlias = Callable[[], datetime | None]


def server_clock() -> datetime | None:
    """The server's clock: None, so the statements judge by `clock_timestamp()`."""
    return None


#: One connection: a plain one, or one acquired from a pool.
Connection: TypeAlias = "asyncpg.Connection[asyncpg.Record] | PoolConnectionProxy[asyncpg.Record]"
#: Anything statements can run on: one connection, or the pool or the Lender (one statement, autocommit).
Conn: TypeAlias = (
    "asyncpg.Connection[asyncpg.Record] | PoolConnectionProxy[asyncpg.Record] | asyncpg.Pool[asyncpg.Record]"
    " | Lender"
)

_MIGRATION_FILE = re.compile(r"(\d{3})_([a-z0-9_]+)\.sql")
# A fixed key for pg_advisory_xact_lock (any int8); the schema name is mixed in
# with hashtext() so two schemas in one database migrate independently.
_MIGRATION_LOCK = 0x6275_735F


SET_LOCAL_LOCK_TIMEOUT = "SELECT set_config('lock_timeout', $1, true)"
MIGRATION_LOCK_TIMEOUT = "400ms"
MIGRATION_ATTEMPTS = 40

SHOW_SEARCH_PATH = "SELECT current_setting('search_path')"
SET_LOCAL_SEARCH_PATH = "SELECT set_config('search_path', $1, true)"


def search_path(schema: str) -> str:
    """The search_path value naming `schema`, quoted so that a mixed-case schema is not folded to lower case."""
    return '"' + validate_schema(schema) + '"'


def server_settings(schema: str, application_name: str = "bus") -> dict[str, str]:
    """Session settings of every bus connection: the bus schema first on the search_path."""
    return {"search_path": search_path(schema), "application_name": application_name}


@asynccontextmanager
async def on_schema(conn: Connection, schema: str) -> AsyncIterator[None]:
    """Run bus statements on a caller's connection (the outbox), whatever its own search_path.

    Inside a transaction (a savepoint when the caller already has one) the
    bus schema becomes the search_path, and the caller's own is put back
    before the block ends; on an error the savepoint's rollback restores it.
    """
    wanted = search_path(schema)
    async with conn.transaction():
        previous = await conn.fetchval(SHOW_SEARCH_PATH)
        if previous == wanted:
            yield
            return
        await conn.execute(SET_LOCAL_SEARCH_PATH, wanted)
        yield
        await conn.execute(SET_LOCAL_SEARCH_PATH, previous)


# Set on every connection the Lender borrows (the pool's reset undoes it when it goes back).
# The hot paths' statements are keyed lookups whose best plan does not depend on the values,
# and planning them again on every execution (what PostgreSQL does for a prepared statement
# whose generic plan it estimates costlier) is a large part of a queue take's time, with
# its CTEs and window functions. A generic plan also keeps a worker's fetch an index scan when
# the statistics of a freshly loaded partition are stale.
GENERIC_PLANS = "SELECT set_config('plan_cache_mode', 'force_generic_plan', false)"


class Lender:
    """Pool connections kept out between the bus's own statements on its hot paths.

    asyncpg's pool spends about as much Python on an acquire and a release
    (a proxy, an inactivity timer, a shielded release task, and a reset query
    unless skipped) as a short statement's round trip takes. The bus's own
    statements leave no session state behind (but GENERIC_PLANS), so up to `size` connections,
    borrowed from the pool once, stay out and are lent to them one statement
    (or one short block, `lend`) at a time. A connection that broke, was left
    inside a transaction, or whose block raised anything goes back to the
    pool (which waits out a cancelled query, closes or resets it), and a
    fresh one is borrowed when needed. The pool's
    `max_size` still bounds every connection of the Bus; the service's own
    `b.pool.acquire()` gets the rest and is reset on release as asyncpg always does.
    """

    def __init__(self, pool: asyncpg.Pool, size: int, *, generic_plans: bool = True) -> None:
        self._pool = pool
        # Through a transaction pooler no session setting stays with a connection: PostgreSQL's own plan choice.
        self._generic_plans = generic_plans
        self._size = size  # 0: nothing kept out, every use acquires from the pool (a pool of 1)
        self._idle: list[PoolConnectionProxy] = []
        self._borrowed = 0  # out of the pool: idle here, or lent
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._returning: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def borrowed(self) -> int:
        """Connections out of the pool now (idle here or lent)."""
        return self._borrowed

    @asynccontextmanager
    async def lend(self) -> AsyncIterator[PoolConnectionProxy]:
        """One connection for a short block of the bus's own statements (no session state left behind)."""
        if self._size == 0:
            async with self._pool.acquire() as acquired:
                yield acquired
            return
        conn = await self._take()
        try:
            yield conn
        except BaseException:
            # Even after a plain server error the protocol may still be reading up to the server's
            # ReadyForQuery: lent again at once, the next statement would meet "another operation
            # is in progress". The pool waits it out and resets (or closes) it; errors are rare here.
            self._give(conn, reusable=False)
            raise
        else:
            self._give(conn, reusable=True)

    async def fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        """`Connection.fetch` on a lent connection."""
        result: list[asyncpg.Record] = await self._statement("fetch", query, args)
        return result

    async def fetchrow(self, query: str, *args: Any) -> asyncpg.Record | None:
        """`Connection.fetchrow` on a lent connection."""
        result: asyncpg.Record | None = await self._statement("fetchrow", query, args)
        return result

    async def fetchval(self, query: str, *args: Any) -> Any:
        """`Connection.fetchval` on a lent connection."""
        return await self._statement("fetchval", query, args)

    async def execute(self, query: str, *args: Any) -> str:
        """`Connection.execute` on a lent connection."""
        result: str = await self._statement("execute", query, args)
        return result

    async def _statement(self, method: str, query: str, args: tuple[Any, ...]) -> Any:
        """One statement on a lent connection: `lend()` without its context manager (the hot path).

        A connection whose statement raised goes back to the pool, as in `lend()`.
        """
        if self._size == 0:
            async with self._pool.acquire() as acquired:
                return await getattr(acquired, method)(query, *args)
        conn = await self._take()
        try:
            result = await getattr(conn, method)(query, *args)
        except BaseException:
            self._give(conn, reusable=False)  # as in lend(): the pool waits out and resets it
            raise
        self._give(conn, reusable=True)
        return result

    async def close(self) -> None:
        """Give every idle connection back to the pool; lent ones go back when their block ends."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            self._borrowed -= 1
            await self._pool.release(conn)
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        if self._returning:
            await asyncio.gather(*self._returning, return_exceptions=True)

    async def _take(self) -> PoolConnectionProxy:
        while True:
            if self._closed:
                raise StorageUnavailableError("the Bus is closed; its connections are gone")
            while self._idle:
                conn = self._idle.pop()
                if _usable(conn):
                    return conn
                self._return(conn)
            if self._borrowed < self._size:
                self._borrowed += 1
                try:
                    conn = await self._pool.acquire()
                except BaseException:
                    self._borrowed -= 1
                    self._wake()
                    raise
                try:
                    if self._generic_plans:
                        await conn.execute(GENERIC_PLANS)
                except BaseException:
                    self._return(conn)
                    self._wake()
                    raise
                return conn
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                elif not waiter.cancelled():
                    self._wake()  # the wake-up it got goes to the next one
                raise

    def _give(self, conn: PoolConnectionProxy, *, reusable: bool) -> None:
        if reusable and not self._closed and _usable(conn):
            self._idle.append(conn)
        else:
            self._return(conn)
        self._wake()

    def _return(self, conn: PoolConnectionProxy) -> None:
        """Back to the pool, which resets it, or closes it if it broke (in a task: `_give` is synchronous).

        A connection that closed is back in the pool already (asyncpg detaches its proxy); releasing
        it again does nothing.
        """
        self._borrowed -= 1
        task = asyncio.get_running_loop().create_task(self._release(conn))
        self._returning.add(task)
        task.add_done_callback(self._returning.discard)

    async def _release(self, conn: PoolConnectionProxy) -> None:
        try:
            await self._pool.release(conn)
        except Exception:  # the pool terminates what it cannot reset; nothing else to do here
            log.debug("lender_release_failed", exc_info=True)

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


def _usable(conn: PoolConnectionProxy) -> bool:
    """Open, outside any transaction, and still ours (not detached by the pool when it closed)."""
    try:
        return not conn.is_closed() and not conn.is_in_transaction()
    except asyncpg.InterfaceError:  # the pool took it back: its connection closed
        return False


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


async def _setup_connection(conn: asyncpg.Connection) -> None:
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


#: How the bus reaches PostgreSQL: directly (None), or through a pooler in session or transaction mode.
Pooler: TypeAlias = Literal["transaction", "session"] | None
POOLERS: tuple[Pooler, ...] = (None, "session", "transaction")


class TransactionPooledConnection(asyncpg.Connection):
    """A connection through a pooler in transaction mode (PgBouncer `pool_mode = transaction`).

    Such a pooler gives each transaction whichever server connection is free,
    so nothing may live in the session: no startup `search_path`, no session
    `SET`, no named prepared statements (`statement_cache_size=0`). Every
    statement therefore runs in a transaction that names the bus schema with
    `SET LOCAL search_path`: a statement outside one gets its own (`BEGIN;
    SET LOCAL ...`, the statement, `COMMIT`: asyncpg's unnamed statement is
    parsed and executed under one server connection), and a transaction the
    bus opens sets it right after its `BEGIN`. `bus_schema` is set on a
    subclass per schema (`pooled_connection_class`).
    """

    bus_schema = "bus"

    def _set_local(self) -> str:
        # An identifier cannot be a bind parameter: the schema is validated (a plain identifier) and quoted.
        return f"SET LOCAL search_path TO {search_path(self.bus_schema)}"

    async def execute(
        self,
        query: str,
        *args: Any,
        timeout: float | None = None,  # noqa: ASYNC109 - asyncpg's signature
    ) -> str:
        run = super().execute
        if args or self.is_in_transaction():
            return await run(query, *args, timeout=timeout)
        if query.lstrip()[:5].upper() in ("BEGIN", "START"):  # a transaction's start (asyncpg's Transaction)
            status = await run(query, timeout=timeout)
            await run(self._set_local(), timeout=timeout)
            return status
        result: str = await self._in_transaction(run(query, timeout=timeout))
        return result

    async def _do_execute(
        self,
        query: str,
        executor: Any,
        timeout: Any,  # noqa: ASYNC109 - asyncpg's signature
        retry: bool = True,
        **kw: Any,
    ) -> Any:
        # asyncpg's one path for statements with parameters (fetch, fetchrow, fetchval, execute, executemany).
        run = super()._do_execute  # type: ignore[misc]
        if self.is_in_transaction():
            return await run(query, executor, timeout, retry, **kw)
        return await self._in_transaction(run(query, executor, timeout, retry, **kw))

    async def _simple(self, sql: str) -> None:
        await self._protocol.query(sql, None)  # type: ignore[attr-defined]

    async def _in_transaction(self, statement: Any) -> Any:
        try:
            await self._simple("BEGIN; " + self._set_local())
        except BaseException:
            statement.close()
            raise
        try:
            result = await statement
        except BaseException:
            if not self.is_closed() and self.is_in_transaction():
                await self._simple("ROLLBACK")
            raise
        await self._simple("COMMIT")
        return result


def through_transaction_pooler(conn: Any) -> bool:
    """Whether `conn` (a connection or a pool's proxy of one) goes through a transaction pooler."""
    return isinstance(getattr(conn, "_con", conn), TransactionPooledConnection)


@functools.cache
def pooled_connection_class(schema: str) -> type[TransactionPooledConnection]:
    """The TransactionPooledConnection subclass of `schema` (one per schema, made once)."""
    validate_schema(schema)
    return type(
        f"TransactionPooledConnection_{schema}", (TransactionPooledConnection,), {"bus_schema": schema}
    )


async def _set_session_search_path(conn: asyncpg.Connection, schema: str) -> None:
    await conn.execute(SET_SESSION_SEARCH_PATH, search_path(schema))


SET_SESSION_SEARCH_PATH = "SELECT set_config('search_path', $1, false)"


def _connect_kwargs(schema: str, pooler: Pooler) -> dict[str, Any]:
    """How asyncpg opens a bus connection: startup settings directly, none through a pooler."""
    if pooler is None:
        return {"server_settings": server_settings(schema)}
    if pooler == "transaction":
        return {"statement_cache_size": 0, "connection_class": pooled_connection_class(schema)}
    return {}  # session: the search_path is SET once the connection is open (no startup parameters)


def _unavailable(exc: BaseException, pooler: Pooler) -> StorageUnavailableError:
    text = str(exc)
    if pooler is None and "unsupported startup parameter" in text:
        return StorageUnavailableError(
            f"cannot connect to PostgreSQL ({text}): this DSN reaches a connection pooler (PgBouncer); "
            "pass pooler='transaction' (or pooler='session' for a session pooler) to bus.connect(), "
            "and direct_dsn= for wake-ups by LISTEN"
        )
    return StorageUnavailableError(
        f"cannot connect to PostgreSQL ({text}); check the DSN and that the server runs"
    )


_DSN_SCHEMES = ("postgresql", "postgres")


def check_dsn(dsn: object) -> str:
    """`dsn` if it is a PostgreSQL URI asyncpg can parse; ConfigurationError (never "retry it") if not.

    A typo in the scheme or a port that is not a number is the service's configuration,
    not an outage: a retry loop around `connect()` must not spin on it.
    """
    if not isinstance(dsn, str) or not dsn.strip():
        raise ConfigurationError(f"the DSN must be a postgresql:// URI, got {dsn!r}")
    scheme, sep, rest = dsn.partition("://")
    if not sep or scheme not in _DSN_SCHEMES:
        raise ConfigurationError(
            f"the DSN's scheme must be postgresql:// (or postgres://), got {scheme + sep if sep else dsn[:20]!r}: "
            "fix BUS_DSN or the dsn= argument (e.g. postgresql://user:password@host:5432/database)"
        )
    netloc = rest.split("/", 1)[0].split("?", 1)[0].rpartition("@")[2]
    for host in filter(None, netloc.split(",")):
        port = host.rsplit("]", 1)[-1].partition(":")[2] if host.startswith("[") else host.partition(":")[2]
        if port and not port.isdigit():
            raise ConfigurationError(
                f"the DSN's port must be a number, got {port!r} in {host!r}: fix the DSN"
            )
    return dsn


def _configuration(exc: BaseException) -> ConfigurationError:
    return ConfigurationError(
        f"the DSN or connection settings are wrong ({exc}); fix them, a retry cannot help"
    )


async def create_pool(
    dsn: str, schema: str, *, min_size: int = 1, max_size: int = 20, pooler: Pooler = None, **kwargs: Any
) -> asyncpg.Pool:
    """An asyncpg pool whose connections run bus statements in `schema` (see `Pooler`)."""
    check_dsn(dsn)
    from storage.availability import quiet_pool_floor_retries

    quiet_pool_floor_retries()  # a traceback per reconnect attempt while the server is away: said once instead

    async def init(conn: asyncpg.Connection) -> None:
        if pooler == "session":
            await _set_session_search_path(conn, schema)
        await _setup_connection(conn)

    try:
        pool = await asyncpg.create_pool(
            dsn, min_size=min_size, max_size=max_size, init=init, **_connect_kwargs(schema, pooler), **kwargs
        )
    except (OSError, asyncpg.PostgresError) as exc:
        raise _unavailable(exc, pooler) from exc
    except (asyncpg.ClientConfigurationError, ValueError) as exc:
        raise _configuration(exc) from exc
    assert pool is not None
    return pool


async def create_service_pool(dsn: str, *, max_size: int, pooler: Pooler = None) -> asyncpg.Pool:
    """A pool for the service's own statements: PostgreSQL's default search_path, nothing of the bus's.

    Empty until used (min_size 0). Through a transaction pooler it prepares no statements.
    """
    check_dsn(dsn)
    kwargs: dict[str, Any] = {"statement_cache_size": 0} if pooler == "transaction" else {}
    try:
        pool = await asyncpg.create_pool(dsn, min_size=0, max_size=max_size, **kwargs)
    except (OSError, asyncpg.PostgresError) as exc:
        raise _unavailable(exc, pooler) from exc
    assert pool is not None
    return pool


async def connect(dsn: str, schema: str, *, pooler: Pooler = None, **kwargs: Any) -> asyncpg.Connection:
    """One connection that runs bus statements in `schema` (listeners, migrations, the Producer)."""
    check_dsn(dsn)
    try:
        conn: asyncpg.Connection = await asyncpg.connect(dsn, **_connect_kwargs(schema, pooler), **kwargs)
    except (OSError, asyncpg.PostgresError) as exc:
        raise _unavailable(exc, pooler) from exc
    except (asyncpg.ClientConfigurationError, ValueError) as exc:
        raise _configuration(exc) from exc
    try:
        if pooler == "session":
            await _set_session_search_path(conn, schema)
        await preload_array_types(conn)
    except BaseException:
        await conn.close()
        raise
    return conn


def migrations() -> list[tuple[int, str, str]]:
    """(version, name, sql) for every migration file, in order."""
    from importlib import resources  # only when connecting: `import bus` stays light

    found = []
    for entry in resources.files("storage.migrations").iterdir():
        match = _MIGRATION_FILE.fullmatch(entry.name)
        if match:
            found.append((int(match.group(1)), match.group(2), entry.read_text(encoding="utf-8")))
    found.sort()
    versions = [v for v, _, _ in found]
    if len(versions) != len(set(versions)):
        raise RuntimeError(f"two migration files share a version number: {versions}")
    return found


async def migrate(conn: asyncpg.Connection, schema: str) -> list[int]:
    """Apply the pending migrations into `schema`; returns the versions applied."""
    validate_schema(schema)
    try:
        for attempt in range(MIGRATION_ATTEMPTS):
            try:
                return await _migrate(conn, schema)
            except asyncpg.LockNotAvailableError:
                # A migration's DDL waited past MIGRATION_LOCK_TIMEOUT for a table that running
                # processes (of this release or the previous one) use: it gave way, so it can never
                # be the one that makes their statements fail with a deadlock. Try again shortly.
                if attempt == MIGRATION_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(min(0.05 * 2**attempt, 2.0))
        raise AssertionError("unreachable")
    except asyncpg.LockNotAvailableError as exc:
        raise StorageUnavailableError(
            f"could not migrate schema {schema!r}: its tables stayed locked by other sessions ({exc}); retry"
        ) from exc
    except (asyncpg.InsufficientPrivilegeError, asyncpg.InvalidSchemaNameError) as exc:
        # The bus needs only its own schema: say which right is missing instead of a raw server error.
        raise StorageUnavailableError(
            f"PostgreSQL refused to create or use schema {schema!r} ({exc}); connect as a role that owns it, "
            "or that may create schemas (GRANT CREATE ON DATABASE), or choose another schema"
        ) from exc


async def drop_schema(conn: Connection, schema: str) -> None:
    """Drop `schema` and everything in it (a test's private schema)."""
    # Like CREATE SCHEMA in _migrate: an identifier cannot be a bind parameter, so it is
    # validated (a plain identifier) and quoted instead.
    validate_schema(schema)
    await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def _migrate(conn: asyncpg.Connection, schema: str) -> list[int]:
    applied_now: list[int] = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))", _MIGRATION_LOCK, schema)
        # Below the server's deadlock_timeout (1 s by default): a migration that meets a running
        # statement's locks fails first and is retried, instead of PostgreSQL failing that statement.
        await conn.execute(SET_LOCAL_LOCK_TIMEOUT, MIGRATION_LOCK_TIMEOUT)
        # An identifier cannot be a bind parameter: the schema name, validated by migrate(), is quoted.
        await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
        await conn.execute(SET_LOCAL_SEARCH_PATH, search_path(schema))
        await conn.execute(versions.CREATE_MIGRATIONS)
        # A library too old for the schema refuses before it writes anything.
        if await conn.fetchval(versions.RELEASE_EXISTS):
            row = await conn.fetchrow(versions.READ_RELEASE)
            if row is not None:
                schema_version = await conn.fetchval(versions.SCHEMA_VERSION)
                versions.check_library(schema, schema_version, row["min_release"])
        await conn.execute(versions.ADD_CHECKSUM)
        await conn.execute(versions.CREATE_RELEASE)
        rows = await conn.fetch(versions.APPLIED)
        files = migrations()
        by_version = {version: (name, sql) for version, name, sql in files}
        for r in rows:
            if r["version"] not in by_version:
                continue  # a later release's migration: expand-only, so this release runs beside it
            name, sql = by_version[r["version"]]
            current = versions.checksum(sql)
            if not versions.check_checksum(migration_file(r["version"], name), r.get("checksum"), current):
                await conn.execute(versions.BACKFILL, r["version"], current)
        done = {r["version"] for r in rows}
        for version, name, sql in files:
            if version in done:
                continue
            await conn.execute(sql)
            await conn.execute(versions.RECORD, version, name, versions.checksum(sql))
            applied_now.append(version)
            log.debug("migration_applied", schema=schema, version=version, name=name)
        # A schema this library creates never had an older release on it: nothing to stay
        # compatible with. One an older release made keeps that release able to run on it
        # until `finalize`.
        await _raise_min_release(
            conn, versions.LIBRARY_RELEASE if not rows else versions.MIN_COMPATIBLE_RELEASE
        )
    return applied_now


async def _raise_min_release(conn: asyncpg.Connection, floor: str) -> str:
    """Raise the schema's minimum release to `floor` (never lower it); the minimum now."""
    row = await conn.fetchrow(versions.READ_RELEASE)
    current = None if row is None else str(row["min_release"])
    wanted = floor if current is None else versions.later(current, floor)
    if wanted != current:
        await conn.execute(versions.WRITE_RELEASE, wanted, versions.LIBRARY_RELEASE)
    return wanted


async def finalize(conn: asyncpg.Connection, schema: str) -> str:
    """End a rolling deploy: raise the schema's minimum release to this library's; returns it.

    Until then the schema keeps what the previous release reads (the partitions' counters, the
    queue frontiers' rows) up to date, at a write per publish and per take on a queue. Refused
    with a SchemaVersionError, writing nothing, while a live group member of an older release
    is seen (queue consumers and claimers of that release leave no trace to check: stop them first).
    """
    await migrate(conn, schema)
    async with conn.transaction():
        await conn.execute(SET_LOCAL_SEARCH_PATH, search_path(schema))
        older = await conn.fetch(versions.LIVE_OLDER_MEMBERS)
        if older:
            groups = ", ".join(sorted({r["group_name"] for r in older}))
            raise SchemaVersionError(
                f"schema {schema!r}: {len(older)} live group member(s) of a release older than "
                f"{versions.LIBRARY_RELEASE} in group(s) {groups}; finalize once every process runs "
                f"pgactorbus {versions.LIBRARY_RELEASE} or later"
            )
        floor = await _raise_min_release(conn, versions.LIBRARY_RELEASE)
        log.info("schema_finalized", schema=schema, min_release=floor)
        return floor


def migration_file(version: int, name: str) -> str:
    """The file name of migration `version` (`007_segments.sql`)."""
    return f"{version:03d}_{name}.sql"


class AppliedMigration(msgspec.Struct, frozen=True):
    """One migration as `bus migrate --status` lists it."""

    version: int
    file: str
    state: str  # "applied" | "pending" | "changed" | "unknown" (a later release's)
    applied_at: datetime | None


class MigrationStatus(msgspec.Struct, frozen=True):
    """The schema's version, its minimum release, and every migration's state."""

    schema: str
    schema_version: int
    min_release: str | None
    library_release: str
    migrations: list[AppliedMigration]


async def migration_status(conn: asyncpg.Connection, schema: str) -> MigrationStatus:
    """Applied and pending migrations of `schema` (writes nothing)."""
    validate_schema(schema)
    async with conn.transaction(readonly=True):
        await conn.execute(SET_LOCAL_SEARCH_PATH, search_path(schema))
        rows: list[Any] = []
        if await conn.fetchval(versions.MIGRATIONS_EXIST):
            rows = (
                list(await conn.fetch(versions.APPLIED))
                if await _has_checksum(conn)
                else [{**dict(r), "checksum": None} for r in await conn.fetch(_APPLIED_NO_CHECKSUM)]
            )
        min_release = None
        if await conn.fetchval(versions.RELEASE_EXISTS):
            row = await conn.fetchrow(versions.READ_RELEASE)
            min_release = None if row is None else row["min_release"]
    applied = {r["version"]: r for r in rows}
    out: list[AppliedMigration] = []
    files = migrations()
    for version, name, sql in files:
        file = migration_file(version, name)
        r = applied.get(version)
        if r is None:
            out.append(AppliedMigration(version, file, "pending", None))
            continue
        try:
            versions.check_checksum(file, r["checksum"], versions.checksum(sql))
            state = "applied"
        except BusError:
            state = "changed"
        out.append(AppliedMigration(version, file, state, r["applied_at"]))
    known = {v for v, _, _ in files}
    for version, r in sorted(applied.items()):
        if version not in known:
            out.append(
                AppliedMigration(version, migration_file(version, r["name"]), "unknown", r["applied_at"])
            )
    out.sort(key=lambda m: m.version)
    return MigrationStatus(
        schema=schema,
        schema_version=max(applied, default=0),
        min_release=min_release,
        library_release=versions.LIBRARY_RELEASE,
        migrations=out,
    )


_APPLIED_NO_CHECKSUM = "SELECT version, name, applied_at FROM bus_migrations ORDER BY version"
_HAS_CHECKSUM = """SELECT EXISTS (SELECT 1 FROM information_schema.columns
    WHERE table_schema = current_schema() AND table_name = 'bus_migrations' AND column_name = 'checksum')"""


async def _has_checksum(conn: asyncpg.Connection) -> bool:
    return bool(await conn.fetchval(_HAS_CHECKSUM))


def pending_sql(status: MigrationStatus) -> list[tuple[str, str]]:
    """(file, sql) of every pending migration, in the order `bus migrate` would apply them."""
    pending = {m.version for m in status.migrations if m.state == "pending"}
    return [(migration_file(v, name), sql) for v, name, sql in migrations() if v in pending]


#: A lost, refused or dropped connection (asyncpg's own state errors included).
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.ConnectionDoesNotExistError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
)

#: Errors an actor outlives by retrying on its next tick: a lost or refused
#: connection, a server restarting, a deadlock victim. Anything else is a bug
#: and goes to the supervisor.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    *CONNECTION_ERRORS,
    asyncpg.DeadlockDetectedError,
    asyncpg.SerializationError,
    asyncpg.QueryCanceledError,
    StorageUnavailableError,
    TimeoutError,
)


class translate_errors:
    """Turn lost connections and server shutdowns into StorageUnavailableError (a context manager)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> Literal[False]:
        if exc is None:
            return False
        if isinstance(exc, CONNECTION_ERRORS):
            raise StorageUnavailableError(
                f"PostgreSQL is unavailable ({type(exc).__name__}: {exc}); the operation did not complete, retry it"
            ) from exc
        return False
