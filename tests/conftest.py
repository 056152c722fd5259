"""Tests talk to a real PostgreSQL: the embedded server, or BUS_TEST_DSN when set.

Every test gets a schema of its own, so tests never see each other's data
and the database can be shared (also with a PostgreSQL 15 server: see README).

`make test` runs the suite on pytest-xdist workers. Each worker has a database
of its own on the server (what a test reads server-wide, such as the sessions
it terminates, stays within it), the tests of one file run on one worker (its
module fixtures are built once), and the tests that need the cores to
themselves (marked `alone`: chaos, failover, benchmark and browser tests,
embedded servers of their own, the demo; and the Spark tests) run one after
another on a single worker, so two of them never compete for the cores; the
other slow tests (processes of the CLI, the test plugin) go with their files
(xdist groups tests only on pytest below 9.2: see pyproject.toml).

Fresh schemas are recycled. Migrating a new schema costs far more than most
tests, so a schema a test is done with is reset and handed to a later test of
the same worker instead of being dropped (`SchemaPool`):

- reset after the test: every table the test wrote to (any table with a data
  page) is truncated, the sequences go back to their start, the message
  segments are dropped; the rows the migrations wrote (`bus_migrations`,
  `bus_schema_release`) stay;
- handed out before a test: the schema is renamed to the test's new name (so
  nothing keyed by the schema name, such as LISTEN channels, advisory locks or
  a Bus a test left open, reaches the next test), the functions pinned to the
  schema's search_path follow it, and the migration rows get the time of the
  hand-out and a first message segment is made up to it, as a migration at
  that moment would have done.

A schema is dropped instead of recycled when it no longer looks as this
release migrates it: its catalog fingerprint (tables, columns, defaults,
constraints, indexes, triggers, functions, views, types, policies, sequences,
owners and privileges; segment names aside) or its migration rows differ from
those of a schema migrated at the start of the session (migration, version
and rolling-deploy tests, tests that alter or drop things), its tables were
analyzed (statistics a fresh table has not), or its reset waits for a lock a
session still holds. (With two schemas ready, one given back is dropped too.)

The resets, drops and the migrations of new schemas (one is made whenever a
hand-out leaves none ready) run on the pool's own session in a task of the
session's event loop, while the next test runs; a hand-out waits for them only
when no schema is ready. The `schema` fixture is still a new name per test and
`drop_schema` still means "the test's schema is gone after it": a test that
uses `drop_schema` (directly, or through `connect` and `b`) finds its schema
migrated before it starts. A test that needs a schema nobody has migrated (it
runs the migrations itself and checks what they did, or creates the schema
with an older release) is marked `@pytest.mark.fresh_schema`.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

import bus
from bus.testing import FAST
from storage import db

HEAVY = "tests that need the cores, one at a time"

# The Spark JVMs the tests start (the session, `spark-submit`, `bus compact`) run jobs over a few
# thousand rows: most of their time is start-up, where the optimizing compiler and the parallel
# collector's threads compete for two cores. The client compiler and the serial collector start them
# in about two thirds of the time. Production keeps `DEFAULT_DRIVER_JAVA_OPTIONS`.
SPARK_TEST_JAVA_OPTIONS = "-XX:+UseSerialGC -XX:TieredStopAtLevel=1"
os.environ.setdefault("BUS_SPARK_JAVA_OPTS", SPARK_TEST_JAVA_OPTIONS)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "fresh_schema: the test's schema is not created before it (no recycled schema is handed out)",
    )


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which turns the marks into the node ids' groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Where xdist runs each test (`--dist loadgroup`): `alone` and Spark ones one at a time on one worker,
    a file's tests together."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            alone = item.get_closest_marker("alone") or item.get_closest_marker("spark")
            group = HEAVY if alone else item.nodeid.split("::")[0]
            item.add_marker(pytest.mark.xdist_group(group))


async def _worker_database(dsn: str, worker: str) -> str:
    """`dsn` on the database of xdist worker `worker`, created if missing (the server's own one when
    the role may not create databases)."""
    name = f"bus_test_{worker}"
    conn = await asyncpg.connect(dsn)
    try:
        if not await conn.fetchval("SELECT true FROM pg_database WHERE datname = $1", name):
            try:
                # An identifier cannot be a bind parameter: the name is ours ("gw" and a number).
                await conn.execute(f'CREATE DATABASE "{name}"')
            except asyncpg.InsufficientPrivilegeError:
                return dsn
            except asyncpg.DuplicateDatabaseError:
                pass
    finally:
        await conn.close()
    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


@pytest.fixture(scope="session")
def dsn() -> str:
    explicit = os.environ.get("BUS_TEST_DSN")
    if explicit:
        server = explicit
    else:
        from bus.server.embedded import ensure_server

        server = ensure_server().dsn
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return server
    with ThreadPoolExecutor(1) as pool:  # the session's event loop may not be running yet
        return pool.submit(asyncio.run, _worker_database(server, worker)).result()


@pytest.fixture
def fast() -> dict[str, Any]:
    """The test timings of bus.testing (short sessions, short debounce, short poll fallback)."""
    return dict(FAST)


@pytest.fixture
def schema() -> str:
    return "t_" + uuid.uuid4().hex[:12]


# Test-only catalog SQL of the schema pool. The schema names in it are ours ("t_" and hex digits),
# validated by storage.db.validate_schema before any is put into a statement.

# The message segments are partitions named after their upper bound: whatever their number and
# names, a schema is reset by dropping them.
_SEGMENT = "^_?messages_[0-9]{8}_[0-9]{6}_[0-9]{6}"

# Everything a migration or a test can change in a schema's structure, as one hash; the schema's own
# name (in deparsed definitions and pinned search_paths) is replaced, so schemas compare.
_FINGERPRINT = """
WITH n AS (SELECT oid, nspname FROM pg_namespace WHERE nspname = $1),
rels AS (SELECT c.* FROM pg_class c JOIN n ON c.relnamespace = n.oid WHERE c.relname !~ $2)
SELECT md5(replace(concat_ws(E'\n',
  (SELECT string_agg(format('%s|%s|%s|%s|%s|%s|%s|%s|%s', relname, relkind, relpersistence, reloptions,
                            relacl, relowner::regrole, relrowsecurity, relforcerowsecurity,
                            pg_get_expr(relpartbound, oid)), ';' ORDER BY relname) FROM rels),
  (SELECT string_agg(format('%s.%s|%s|%s|%s|%s|%s|%s|%s', r.relname, a.attname, a.attnum,
                            format_type(a.atttypid, a.atttypmod), a.attnotnull, a.attisdropped,
                            a.attidentity, a.attgenerated, a.attacl), ';' ORDER BY r.relname, a.attnum)
     FROM pg_attribute a JOIN rels r ON r.oid = a.attrelid WHERE a.attnum > 0),
  (SELECT string_agg(format('%s.%s|%s', r.relname, d.adnum, pg_get_expr(d.adbin, d.adrelid)), ';'
                     ORDER BY r.relname, d.adnum) FROM pg_attrdef d JOIN rels r ON r.oid = d.adrelid),
  (SELECT string_agg(format('%s|%s|%s', co.conname, r.relname, pg_get_constraintdef(co.oid)), ';'
                     ORDER BY co.conname, r.relname)
     FROM pg_constraint co JOIN n ON co.connamespace = n.oid LEFT JOIN pg_class r ON r.oid = co.conrelid
     WHERE co.conname !~ $2 AND coalesce(r.relname, '') !~ $2),
  (SELECT string_agg(pg_get_indexdef(i.indexrelid), ';' ORDER BY r.relname)
     FROM pg_index i JOIN rels r ON r.oid = i.indexrelid),
  (SELECT string_agg(format('%s|%s|%s', t.tgname, t.tgenabled, pg_get_triggerdef(t.oid)), ';'
                     ORDER BY r.relname, t.tgname)
     FROM pg_trigger t JOIN rels r ON r.oid = t.tgrelid WHERE NOT t.tgisinternal),
  (SELECT string_agg(format('%s(%s)|%s|%s|%s|%s|%s|%s|%s|%s', p.proname, pg_get_function_identity_arguments(p.oid),
                            p.prokind, p.provolatile, p.prosecdef, p.proconfig, p.proacl, p.proowner::regrole,
                            pg_get_function_result(p.oid), md5(p.prosrc)), ';'
                     ORDER BY p.proname, pg_get_function_identity_arguments(p.oid))
     FROM pg_proc p JOIN n ON p.pronamespace = n.oid),
  (SELECT string_agg(format('%s|%s', r.relname, pg_get_viewdef(r.oid)), ';' ORDER BY r.relname)
     FROM rels r WHERE r.relkind IN ('v', 'm')),
  (SELECT string_agg(format('%s|%s|%s', t.typname, t.typtype, t.typacl), ';' ORDER BY t.typname)
     FROM pg_type t JOIN n ON t.typnamespace = n.oid WHERE t.typname !~ $2),
  (SELECT string_agg(format('%s|%s', e.enumtypid::regtype, e.enumlabel), ';' ORDER BY e.enumtypid::regtype::text, e.enumsortorder)
     FROM pg_enum e JOIN pg_type t ON t.oid = e.enumtypid JOIN n ON t.typnamespace = n.oid),
  (SELECT string_agg(format('%s|%s|%s|%s|%s', r.relname, p.polname, p.polcmd, pg_get_expr(p.polqual, p.polrelid),
                            pg_get_expr(p.polwithcheck, p.polrelid)), ';' ORDER BY r.relname, p.polname)
     FROM pg_policy p JOIN rels r ON r.oid = p.polrelid),
  (SELECT string_agg(format('%s|%s|%s|%s|%s|%s|%s', r.relname, s.seqtypid, s.seqstart, s.seqincrement, s.seqmax,
                            s.seqmin, s.seqcycle), ';' ORDER BY r.relname)
     FROM pg_sequence s JOIN rels r ON r.oid = s.seqrelid),
  (SELECT format('%s|%s', nspowner::regrole, nspacl) FROM pg_namespace WHERE nspname = $1)
), n_name.nspname, '@'))
FROM (SELECT nspname FROM n) AS n_name
"""

# The rows the migrations write (their times aside): a test that changed them changed the schema's
# version or release.
_MIGRATION_ROWS = """
SELECT md5(concat_ws(E'\n',
  (SELECT string_agg(format('%s|%s|%s', version, name, checksum), ';' ORDER BY version) FROM bus_migrations),
  (SELECT string_agg(format('%s|%s', min_release, written_by), ';') FROM bus_schema_release)))
"""

# What a reset has to empty: tables with a data page (a fresh one has none; once written, a table
# keeps its pages until truncated, even with every row deleted), the segments, the sequences moved.
_TOUCHED_TABLES = """
SELECT c.oid::regclass::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND c.relkind = 'r' AND c.relname !~ $2
  AND c.relname NOT IN ('bus_migrations', 'bus_schema_release') AND pg_relation_size(c.oid) > 0
"""
_SEGMENT_TABLES = """
SELECT c.oid::regclass::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND c.relkind = 'r' AND c.relname ~ $2
"""
_MOVED_SEQUENCES = """
SELECT format('%I.%I', schemaname, sequencename) FROM pg_sequences
WHERE schemaname = $1 AND (last_value IS NOT NULL OR start_value <> 1)
"""
_RESET_SEQUENCE = (
    "SELECT setval($1::regclass, s.seqstart, false) FROM pg_sequence s WHERE s.seqrelid = $1::regclass"
)
_ANALYZED = "SELECT EXISTS (SELECT 1 FROM pg_stats WHERE schemaname = $1)"
_PINNED = """
SELECT p.oid::regprocedure::text AS function, substr(c, length('search_path=') + 1) AS path
FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace, unnest(p.proconfig) AS c
WHERE n.nspname = $1 AND c LIKE 'search_path=%'
"""
# What migrating the schema at the hand-out would have written at that time: the migration rows' times
# and the first segment (up to now: storage/migrations/007_segments.sql).
# The migration rows are written anew into an emptied table (an update of every row would leave the
# table a page larger than a fresh schema's once the versions outgrow one page).
_HAND_OUT = [
    "CREATE TEMP TABLE pool_migrations ON COMMIT DROP AS SELECT * FROM bus_migrations",
    "UPDATE pool_migrations SET applied_at = now()",
    "TRUNCATE bus_migrations",
    "INSERT INTO bus_migrations SELECT * FROM pool_migrations",
    "UPDATE bus_schema_release SET updated_at = now()",
    "SELECT message_segment_create(NULL, clock_timestamp())",
]


# The pool's own sessions: its commits need not wait for the disk (the schemas are a test's).
_POOL_SESSION = {"application_name": "bus-tests-schema-pool", "synchronous_commit": "off"}
_KEEP = 2  # schemas kept ready: one handed out while the previous test's is being reset


class SchemaPool:
    """Migrated schemas of one worker, reset after a test and handed to a later one (module docstring).

    Resets, drops and new schemas are made by a task of the session's loop on a session of their
    own, while the next test runs; a hand-out waits for them only when no schema is ready.
    """

    def __init__(self, dsn: str, fingerprint: str, rows: str) -> None:
        self._dsn = dsn
        self._fingerprint = fingerprint
        self._rows = rows
        self._sessions: dict[str, asyncpg.Connection] = {}
        self._ready: list[str] = []
        self._work: asyncio.Queue[str | None] = asyncio.Queue()  # a name to reset, or None: make one
        self._worker: asyncio.Task[None] | None = None
        self._stuck: list[str] = []  # still locked by a session of their test: dropped at the end
        self.recycled = 0
        self.dropped = 0

    @classmethod
    async def start(cls, dsn: str, *, background: bool = True) -> SchemaPool:
        """Migrate a reference schema (the first one handed out) and note what it looks like."""
        conn = await asyncpg.connect(dsn, server_settings=_POOL_SESSION)
        try:
            name = "t_" + uuid.uuid4().hex[:12]
            await db.migrate(conn, name)
            pool = cls(dsn, await conn.fetchval(_FINGERPRINT, name, _SEGMENT), await pool_rows(conn, name))
        finally:
            await conn.close()
        for attempt in range(10):
            try:
                reset = await pool._reset(name)  # its first segment goes: the hand-out makes one
                break
            except asyncpg.LockNotAvailableError:  # the reset's 200 ms lock timeout met a busy catalog
                if attempt == 9:
                    raise
                await asyncio.sleep(0.2)
        if not reset:
            raise AssertionError(f"schema {name} just migrated does not look like itself")
        pool._ready.append(name)
        if background:
            pool._worker = asyncio.create_task(pool._serve())
        return pool

    async def _session(self, role: str) -> asyncpg.Connection:
        """The pool's session for `role` ("front": hand-outs, "back": the rest), opened again if a test ended it."""
        conn = self._sessions.get(role)
        if conn is None or conn.is_closed():
            conn = self._sessions[role] = await asyncpg.connect(self._dsn, server_settings=_POOL_SESSION)
        return conn

    async def take(self, name: str) -> bool:
        """Make a reset schema the schema `name` (True), unless none is ready or `name` exists."""
        db.validate_schema(name)
        if not self._ready:
            await self.settle()
        if not self._ready:
            return False
        free = self._ready.pop()  # before any await: the background task adds to the list meanwhile
        conn = await self._session("front")
        try:
            async with conn.transaction():
                # DDL takes no bind parameters: both names are validated identifiers, quoted.
                await conn.execute(f'ALTER SCHEMA "{free}" RENAME TO "{name}"')
                for row in await conn.fetch(_PINNED, name):
                    # As the migrations pinned it (SET search_path FROM CURRENT), with the new name.
                    await conn.execute(db.SET_LOCAL_SEARCH_PATH, row["path"].replace(free, name))
                    await conn.execute(f"ALTER FUNCTION {row['function']} SET search_path FROM CURRENT")
                await conn.execute(db.SET_LOCAL_SEARCH_PATH, db.search_path(name))
                for statement in _HAND_OUT:
                    await conn.execute(statement)
        except asyncpg.DuplicateSchemaError:
            self._ready.append(free)
            return False  # a fixture made the test's schema already: it keeps that one
        except Exception:  # noqa: BLE001 - the test migrates its schema itself, as without the pool
            self._stuck.append(free)
            return False
        if not self._ready and self._work.empty():
            self._work.put_nowait(None)  # one ready for the next test, made while this one runs
        return True

    async def give_back(self, name: str) -> None:
        """Reset `name` for a later test (in the background unless started without), or drop it."""
        db.validate_schema(name)
        self._work.put_nowait(name)
        if self._worker is None:
            await self._drain()

    async def settle(self) -> None:
        """Wait until every reset, drop and new schema asked for is done."""
        if self._worker is None:
            await self._drain()
        else:
            await self._work.join()

    async def _serve(self) -> None:
        while True:
            name = await self._work.get()
            await self._recycle_or_leave(name)
            self._work.task_done()

    async def _drain(self) -> None:
        while not self._work.empty():
            name = self._work.get_nowait()
            await self._recycle_or_leave(name)
            self._work.task_done()

    async def _recycle_or_leave(self, name: str | None) -> None:
        try:
            await self._recycle(name)
        except Exception:  # noqa: BLE001 - the pool goes on (a lost session: close() drops the schema)
            if name is not None:
                self._stuck.append(name)

    async def _recycle(self, name: str | None) -> None:
        conn = await self._session("back")
        if name is None:
            name = "t_" + uuid.uuid4().hex[:12]
            await db.migrate(conn, name)
        elif not await conn.fetchval("SELECT true FROM pg_namespace WHERE nspname = $1", name):
            return  # the test dropped it
        try:
            if len(self._ready) < _KEEP and await self._reset(name):
                self._ready.append(name)
                self.recycled += 1
                return
        except asyncpg.PostgresError:
            pass  # a lock held past the timeout, or a schema too changed to reset: dropped below
        self.dropped += 1
        try:
            async with conn.transaction():
                await conn.execute(db.SET_LOCAL_LOCK_TIMEOUT, "5s")
                await db.drop_schema(conn, name)
        except asyncpg.LockNotAvailableError:
            self._stuck.append(name)

    async def _reset(self, name: str) -> bool:
        conn = await self._session("back")
        async with conn.transaction():
            # A session of the test still in a transaction on the schema: not worth waiting for.
            await conn.execute(db.SET_LOCAL_LOCK_TIMEOUT, "200ms")
            # On the session's search_path, as in start(): deparsed definitions qualify names by it.
            if await conn.fetchval(_FINGERPRINT, name, _SEGMENT) != self._fingerprint:
                return False
            if await pool_rows(conn, name) != self._rows or await conn.fetchval(_ANALYZED, name):
                return False
            segments = [r[0] for r in await conn.fetch(_SEGMENT_TABLES, name, _SEGMENT)]
            if segments:
                # Names from the catalog (regclass text, quoted): dropping a partition detaches it.
                await conn.execute("DROP TABLE " + ", ".join(segments))
            touched = [r[0] for r in await conn.fetch(_TOUCHED_TABLES, name, _SEGMENT)]
            if touched:
                await conn.execute("TRUNCATE " + ", ".join(touched) + " CASCADE")
            for row in await conn.fetch(_MOVED_SEQUENCES, name):
                await conn.execute(_RESET_SEQUENCE, row[0])
        return True

    async def close(self) -> None:
        """Finish the work asked for, drop every schema left, close the sessions."""
        try:
            await self.settle()
            if self._worker is not None:
                self._worker.cancel()
            conn = await self._session("back")
            for name in self._ready + self._stuck:
                await db.drop_schema(conn, name)
        finally:
            for conn in self._sessions.values():
                await conn.close()


async def pool_rows(conn: asyncpg.Connection, name: str) -> str:
    """The hash of the migration rows of schema `name`."""
    async with conn.transaction():
        await conn.execute(db.SET_LOCAL_SEARCH_PATH, db.search_path(name))
        return str(await conn.fetchval(_MIGRATION_ROWS))


@pytest.fixture(scope="session")
async def schema_pool(dsn: str) -> AsyncIterator[SchemaPool]:
    """The worker's recycled schemas."""
    pool = await SchemaPool.start(dsn)
    yield pool
    await pool.close()


@pytest.fixture
async def drop_schema(
    request: pytest.FixtureRequest, schema_pool: SchemaPool, schema: str
) -> AsyncIterator[None]:
    """The test's schema: one migrated and reset before (unless marked fresh_schema), given back after."""
    if request.node.get_closest_marker("fresh_schema") is None:
        await schema_pool.take(schema)
    yield
    await schema_pool.give_back(schema)


Connect = Callable[..., Any]


@pytest.fixture(scope="session")
def bus_target(dsn: str) -> tuple[str, dict[str, Any]]:
    """Where the tests' Buses connect and with which settings (tests/pooler: through PgBouncer)."""
    return dsn, {}


@pytest.fixture
async def connect(
    bus_target: tuple[str, dict[str, Any]], schema: str, drop_schema: None
) -> AsyncIterator[Connect]:
    """Open extra Buses on the test's schema (several members in one test)."""
    opened: list[bus.Bus] = []
    target, defaults = bus_target

    async def open_bus(**config: Any) -> bus.Bus:
        config = {"schema": schema, **defaults, **config}
        b = await bus.connect(target, **config)
        opened.append(b)
        return b

    yield open_bus
    for b in reversed(opened):
        await b.close()


@pytest.fixture
async def b(connect: Connect) -> bus.Bus:
    """A Bus on a fresh schema."""
    return await connect()


@pytest.fixture
async def snapshot(dsn: str, schema: str, b: bus.Bus) -> AsyncIterator[asyncpg.Connection]:
    """A session of b's schema holding a REPEATABLE READ snapshot open (a pg_dump, a long report)."""
    conn = await db.connect(dsn, schema)
    tx = conn.transaction(isolation="repeatable_read")
    await tx.start()
    await conn.fetchval("SELECT count(*) FROM partitions")  # the snapshot is taken here
    try:
        yield conn
    finally:
        await tx.rollback()
        await conn.close()


def plan_modes(monkeypatch: pytest.MonkeyPatch, module: Any, *names: str) -> list[str]:
    """Spy on storage functions `module.<name>`: the plan_cache_mode of what each call ran on.

    Reads of a large log must run where plans are generic (storage.db.GENERIC_PLANS): with
    PostgreSQL's default they are planned again on every call.
    """
    modes: list[str] = []
    for name in names:
        original = getattr(module, name)

        async def noting_the_mode(conn: Any, *args: Any, _original: Any = original, **kw: Any) -> Any:
            modes.append(await conn.fetchval("SHOW plan_cache_mode"))
            return await _original(conn, *args, **kw)

        monkeypatch.setattr(module, name, noting_the_mode)
    return modes
