"""Migrations of the bus schema.

Migrations are the numbered `.sql` files of `storage/migrations/`, applied in order
under an advisory lock (many processes may connect to a new database at once)
and recorded in `bus_migrations`.
"""

from __future__ import annotations

import asyncio
import re
from datetime import datetime
from typing import Any

import asyncpg
import msgspec

from storage import versions
from storage.connections import SET_LOCAL_SEARCH_PATH, Connection, search_path
from storage.errors import BusError, SchemaVersionError, StorageUnavailableError
from storage.logs import get_logger
from storage.names import validate_schema

log = get_logger(__name__)


_MIGRATION_FILE = re.compile(r"(\d{3})_([a-z0-9_]+)\.sql")
# A fixed key for pg_advisory_xact_lock (any int8); the schema name is mixed in
# with hashtext() so two schemas in one database migrate independently.
_MIGRATION_LOCK = 0x6275_735F


SET_LOCAL_LOCK_TIMEOUT = "SELECT set_config('lock_timeout', $1, true)"
MIGRATION_LOCK_TIMEOUT = "400ms"
MIGRATION_ATTEMPTS = 40


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
        await _install_routines(conn, schema)
    return applied_now


async def _install_routines(conn: asyncpg.Connection, schema: str) -> None:
    """The functions of the statements a transaction pooler runs as routines (storage/routines.py)."""
    from storage import routines
    from storage.connections import pooled_connection_class, through_transaction_pooler

    calls = await routines.install(conn, schema)
    if through_transaction_pooler(conn):
        pooled_connection_class(schema).routine_calls = calls


async def _raise_min_release(conn: asyncpg.Connection, floor: str) -> str:
    """Raise the schema's minimum release to `floor` (never lower it); the minimum now."""
    row = await conn.fetchrow(versions.READ_RELEASE)
    current = None if row is None else str(row["min_release"])
    wanted = floor if current is None else versions.later(current, floor)
    if wanted != current:
        await conn.execute(versions.WRITE_RELEASE, wanted, versions.LIBRARY_RELEASE)
    # The release table's trigger does this on every write; a table made again without it
    # (by hand, or a restore without triggers) is given it back here (migration 036).
    await conn.execute(versions.SYNC_RELEASE)
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
        from storage import routines

        dropped = await routines.drop_unlisted(conn, schema)
        log.info("schema_finalized", schema=schema, min_release=floor, routines_dropped=len(dropped))
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
