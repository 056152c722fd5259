"""Opening connections and pools that run bus statements in the bus schema.

Every connection the bus opens has `search_path` set to the bus schema, so
every statement in `storage/` is a constant string with unqualified names.
Through a transaction pooler (PgBouncer) nothing may live in the session:
`TransactionPooledConnection` names the schema in every transaction instead.
"""

from __future__ import annotations

import functools
import struct
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal, TypeAlias

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from storage.codecs import preload_array_types, setup_connection
from storage.errors import ConfigurationError, StorageUnavailableError
from storage.lender import Lender
from storage.names import validate_schema

#: One connection: a plain one, or one acquired from a pool.
Connection: TypeAlias = "asyncpg.Connection[asyncpg.Record] | PoolConnectionProxy[asyncpg.Record]"
#: Anything statements can run on: one connection, or the pool or the Lender (one statement, autocommit).
Conn: TypeAlias = (
    "asyncpg.Connection[asyncpg.Record] | PoolConnectionProxy[asyncpg.Record] | asyncpg.Pool[asyncpg.Record]"
    " | Lender"
)

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
    `pg_temp` goes last: a temporary table of the caller's named as a bus
    table (searched first otherwise) cannot stand in for it.
    """
    wanted = search_path(schema)
    async with conn.transaction():
        previous = await conn.fetchval(SHOW_SEARCH_PATH)
        if previous == wanted:
            yield
            return
        await conn.execute(SET_LOCAL_SEARCH_PATH, wanted + ", pg_temp")
        yield
        await conn.execute(SET_LOCAL_SEARCH_PATH, previous)


#: How the bus reaches PostgreSQL: directly (None), or through a pooler in session or transaction mode.
Pooler: TypeAlias = Literal["transaction", "session"] | None
POOLERS: tuple[Pooler, ...] = (None, "session", "transaction")


class TransactionPooledConnection(asyncpg.Connection):
    """A connection through a pooler in transaction mode (PgBouncer `pool_mode = transaction`).

    Such a pooler gives each transaction whichever server connection is free,
    so nothing may live in the session: no startup `search_path`, no session
    `SET`, no named prepared statements (`statement_cache_size=0`: asyncpg
    sends an unnamed statement's Parse again with each Bind), nothing to reset
    when a pool takes a connection back. Every statement therefore runs in a
    transaction that names the bus schema with a transaction-local
    `search_path`, at no round trip of its own:

    - a statement outside a transaction (asyncpg's extended protocol: Parse,
      Bind, Execute up to a Sync) is preceded, in the same write, by
      `SCHEMA_FOR_TRANSACTION` (Parse, Bind, Execute, no Sync): it runs in the
      implicit transaction the statement's messages open, which ends at the
      Sync, so both land on one server connection and the setting ends with
      them. It returns no row, and its replies (ParseComplete, BindComplete,
      CommandComplete) are ones asyncpg skips or overwrites there;
    - a statement without parameters (the simple protocol) is sent as one
      query string after the same setting;
    - a transaction the bus opens sends `BEGIN; SET LOCAL ...` as one query.

    A statement's description (its parameter and column types, which asyncpg
    asks for with a Parse and Describe of their own) is kept per connection
    for `DESCRIBED_LIFETIME` and dropped when the statement fails, so a
    statement run before costs one round trip, as directly. The server does
    not check a re-parsed unnamed statement's columns against that
    description: after a DDL that changes them (a migration of a newer
    release), a statement may fail once before it is described again.
    `bus_schema` is set on a subclass per schema (`pooled_connection_class`).
    """

    bus_schema = "bus"
    #: The messages of `SCHEMA_FOR_TRANSACTION` for `bus_schema` (made by `pooled_connection_class`).
    schema_messages = b""
    #: {statement: the call of its function} for the statements installed as routines in `bus_schema`
    #: (storage/routines.py; set by the migrator): the server keeps their plans between calls.
    routine_calls: dict[str, str] = {}  # noqa: RUF012 - replaced whole, per schema's class

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Descriptions of unnamed statements by query, the most recently used last.
        self._described: OrderedDict[tuple[str, Any, bool], tuple[Any, float]] = OrderedDict()

    def _set_local(self) -> str:
        # An identifier cannot be a bind parameter: the schema is validated (a plain identifier) and quoted.
        return f"SET LOCAL search_path TO {search_path(self.bus_schema)}"

    def get_reset_query(self) -> str:
        """Nothing to reset: the pooler lends another server connection to each transaction (an open
        transaction is still rolled back by asyncpg's reset)."""
        return ""

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
            return await run(f"{query.rstrip().rstrip(';')}; {self._set_local()}", timeout=timeout)
        # One implicit transaction block: the setting holds for the statements after it, and ends with them.
        return await run(
            f"{SCHEMA_FOR_SIMPLE_QUERY.format(search_path(self.bus_schema))}\n{query}", timeout=timeout
        )

    async def _get_statement(
        self,
        query: str,
        timeout: Any,  # noqa: ASYNC109 - asyncpg's signature
        *,
        named: Any = False,
        use_cache: bool = True,
        ignore_custom_codec: bool = False,
        record_class: Any = None,
    ) -> Any:
        # asyncpg's one way to a statement's description (before a Bind, an executemany, a cursor).
        kw = {"ignore_custom_codec": ignore_custom_codec, "record_class": record_class}
        key = self._described_key(query, kw)
        if named is False and use_cache:
            kept = self._described.get(key)
            if kept is not None:
                described, until = kept
                if not described.closed and time.monotonic() < until:
                    self._described.move_to_end(key)
                    return described
                del self._described[key]
        if not self.is_in_transaction():
            self._name_schema()
        statement = await self._guarded(
            super()._get_statement(query, timeout, named=named, use_cache=use_cache, **kw)  # type: ignore[misc]
        )
        if named is False and use_cache and not statement.name and not statement.prepared:
            # The server does not check an unnamed statement's result type against an earlier one's:
            # a description is used for a bounded time (and dropped at the statement's first failure).
            self._described[key] = (statement, time.monotonic() + DESCRIBED_LIFETIME)
            if len(self._described) > DESCRIBED_STATEMENTS:
                self._described.popitem(last=False)
        return statement

    def _described_key(self, query: str, kw: dict[str, Any]) -> tuple[str, Any, bool]:
        record_class = kw.get("record_class") or self._protocol.get_record_class()  # type: ignore[attr-defined]
        return (query, record_class, bool(kw.get("ignore_custom_codec")))

    def _drop_local_statement_cache(self) -> None:
        # asyncpg drops its statements when types or codecs change (reload_schema_state, set_type_codec):
        # the descriptions kept here hold the codecs of then.
        super()._drop_local_statement_cache()  # type: ignore[misc]
        self._described.clear()

    async def _do_execute(
        self,
        query: str,
        executor: Any,
        timeout: Any,  # noqa: ASYNC109 - asyncpg's signature
        retry: bool = True,
        **kw: Any,
    ) -> Any:
        # asyncpg's one path for statements with parameters (fetch, fetchrow, fetchval, execute, executemany).
        call = self.routine_calls.get(query)
        if call is not None:
            try:
                return await self._do_execute(call, executor, timeout, retry, **kw)
            except asyncpg.UndefinedFunctionError:
                # Not on this server (a role that may not create functions, a schema dropped and made
                # again): the statement itself, from now on.
                if self.is_in_transaction():
                    raise
                type(self).routine_calls = {q: c for q, c in self.routine_calls.items() if q != query}
        try:
            return await self._execute_on_schema(query, executor, timeout, retry, **kw)
        except BaseException:
            # A description kept from before a migration or a type's change could be what failed:
            # the next use describes the statement again.
            self._described.pop(self._described_key(query, kw), None)
            raise

    async def _execute_on_schema(
        self,
        query: str,
        executor: Any,
        timeout: Any,  # noqa: ASYNC109 - asyncpg's signature
        retry: bool,
        **kw: Any,
    ) -> Any:
        run = super()._do_execute  # type: ignore[misc]
        if self.is_in_transaction():
            return await run(query, executor, timeout, retry, **kw)
        if self._protocol._is_cancelling():  # type: ignore[attr-defined]
            # A cancelled statement's replies are still on their way: nothing may be written before they
            # are read, so this one waits in a transaction of its own (asyncpg waits out the cancellation).
            return await self._in_transaction(run(query, executor, timeout, retry, **kw))

        async def with_schema(statement: Any, timeout: Any) -> Any:  # noqa: ASYNC109
            # asyncpg parses an unnamed statement again with its Bind (it may meet another server
            # connection): the schema is named in that transaction too.
            if not statement.prepared:
                self._name_schema()
            return await self._guarded(executor(statement, timeout))

        return await run(query, with_schema, timeout, retry, **kw)

    def _name_schema(self) -> None:
        """Write `SCHEMA_FOR_TRANSACTION` ahead of the statement asyncpg sends next, in this same step.

        Only when the connection is free to write: not closed, and no cancelled statement's replies
        pending (asyncpg then waits them out before writing, and this would go ahead of that).
        """
        if self.is_closed() or self._protocol._is_cancelling():  # type: ignore[attr-defined]
            return
        self._transport.write(self.schema_messages)  # type: ignore[attr-defined]

    async def _guarded(self, step: Any) -> Any:
        try:
            return await step
        except asyncpg.InterfaceError as exc:
            if "another operation is in progress" in str(exc):
                # Two callers on one connection: the setting written for this one went in among the
                # other's messages, whose replies can no longer be read in order. The connection goes.
                self.terminate()
            raise

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


#: How many statement descriptions a pooled connection keeps (the bus runs fewer distinct statements).
DESCRIBED_STATEMENTS = 512
#: How long a pooled connection uses a statement's description (seconds) before it asks for it again.
DESCRIBED_LIFETIME = 60.0
#: Names the bus schema for the rest of the transaction it runs in, and returns no row (a row would be
#: read as one of the next statement's). `$1` is the search_path value (`search_path(schema)`).
SCHEMA_FOR_TRANSACTION = "SELECT WHERE pg_catalog.set_config('search_path', $1, true) IS NULL"
#: The same in a query string of the simple protocol (no parameters there): the quoted, validated schema.
SCHEMA_FOR_SIMPLE_QUERY = "SELECT pg_catalog.set_config('search_path', '{}', true);"
_TEXT_OID = 25


def _message(kind: bytes, body: bytes) -> bytes:
    return kind + struct.pack("!i", len(body) + 4) + body


def schema_setting_messages(schema: str) -> bytes:
    """The extended-protocol messages that run SCHEMA_FOR_TRANSACTION for `schema`: Parse, Bind, Execute.

    The unnamed statement and portal (the statement sent next replaces both), the value a text
    parameter, no Sync: they join the implicit transaction of the messages that follow.
    """
    value = search_path(schema).encode()
    parse = b"\0" + SCHEMA_FOR_TRANSACTION.encode() + b"\0" + struct.pack("!hi", 1, _TEXT_OID)
    bind = b"\0\0" + struct.pack("!hhi", 0, 1, len(value)) + value + struct.pack("!h", 0)
    execute = b"\0" + struct.pack("!i", 0)
    return _message(b"P", parse) + _message(b"B", bind) + _message(b"E", execute)


def through_transaction_pooler(conn: Any) -> bool:
    """Whether `conn` (a connection or a pool's proxy of one) goes through a transaction pooler."""
    return isinstance(getattr(conn, "_con", conn), TransactionPooledConnection)


@functools.cache
def pooled_connection_class(schema: str) -> type[TransactionPooledConnection]:
    """The TransactionPooledConnection subclass of `schema` (one per schema, made once)."""
    validate_schema(schema)
    return type(
        f"TransactionPooledConnection_{schema}",
        (TransactionPooledConnection,),
        {"bus_schema": schema, "schema_messages": schema_setting_messages(schema)},
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
        await setup_connection(conn)

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


async def connect(
    dsn: str, schema: str, *, pooler: Pooler = None, settings: dict[str, str] | None = None, **kwargs: Any
) -> asyncpg.Connection:
    """One connection that runs bus statements in `schema` (listeners, migrations, the Producer).

    `settings`: more session settings, sent at startup (directly only: a pooler takes none).
    """
    check_dsn(dsn)
    connect_kwargs = _connect_kwargs(schema, pooler)
    if settings and pooler is None:
        connect_kwargs["server_settings"] = {**connect_kwargs["server_settings"], **settings}
    try:
        conn: asyncpg.Connection = await asyncpg.connect(dsn, **connect_kwargs, **kwargs)
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
