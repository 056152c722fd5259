"""Releases and schema versions: which library releases may share a schema.

The schema's version is its highest applied migration. Beside it the schema
records the minimum library release that may run on it (`bus_schema_release`):
every library that migrates raises it to its own `MIN_COMPATIBLE_RELEASE` (never
lowers it), and a library older than the recorded minimum refuses to start with
a `SchemaVersionError` naming both. Migrations are expand/contract: a release
only adds what the previous release can ignore (tables, nullable columns,
indexes); it drops what the previous release still uses only in a later release
that raises `MIN_COMPATIBLE_RELEASE` past it. So the previous release keeps
running on a schema the current one migrated, and a rolling deploy can roll back.

Every applied migration's SHA-256 is recorded in `bus_migrations.checksum`; an
applied migration whose file changed is refused, with the file named. The
checksums in `RELEASED_CHECKSUMS` are earlier texts of migrations that builds
applied before checksums were recorded; databases those builds migrated still open.
"""

from __future__ import annotations

import hashlib

from storage.errors import SchemaVersionError

#: This library's release (the project's version).
LIBRARY_RELEASE = "0.2.0"

#: The oldest release that may run on a schema this library migrated. 0.1.0 ran
#: on migrations 001-013, which this release keeps as they are.
MIN_COMPATIBLE_RELEASE = "0.1.0"

#: Earlier texts of migrations edited after builds had applied them: file name -> checksums.
RELEASED_CHECKSUMS: dict[str, frozenset[str]] = {
    "004_compaction.sql": frozenset({"8fffa528f4116e51c0da5f2862f3bb4c5ac3b87f249e66439b5c7f3cf9b43205"}),
    "005_eventstore.sql": frozenset(
        {
            "873fcc57b9b099ddfdc262a0fbb3fcaaff746fad7255f8b358ac2c61f0fc5aee",
            "bb9df3b44f37312e3a4aeb58491cad4bdb5b14aae36cefc96e2a814d32ec05a4",
        }
    ),
    "007_segments.sql": frozenset({"2a79119125ad5da599a2d04d1f544187ac8490f66c045253296dea2203951c83"}),
    "009_eventstore_discovery.sql": frozenset(
        {"5d3f3478250a63c10bc0c68233b092a1c33e37f023abab932141aae5683cd99e"}
    ),
    "013_queue_leases.sql": frozenset({"289d964599f370842d44b8329bc8be4240f6307e5956dce8a4d9b4250f780c82"}),
}

# The bookkeeping tables; both are created and extended in place (IF NOT EXISTS), so a
# schema that an earlier release migrated gains them on the first connect of this one.
CREATE_MIGRATIONS = """CREATE TABLE IF NOT EXISTS bus_migrations (
    version integer PRIMARY KEY,
    name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now())"""
ADD_CHECKSUM = "ALTER TABLE bus_migrations ADD COLUMN IF NOT EXISTS checksum text"
CREATE_RELEASE = """CREATE TABLE IF NOT EXISTS bus_schema_release (
    one boolean PRIMARY KEY DEFAULT true CHECK (one),
    min_release text NOT NULL,
    written_by text NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now())"""
RELEASE_EXISTS = "SELECT to_regclass('bus_schema_release') IS NOT NULL"
READ_RELEASE = "SELECT min_release, written_by FROM bus_schema_release"
WRITE_RELEASE = """INSERT INTO bus_schema_release (min_release, written_by) VALUES ($1, $2)
    ON CONFLICT (one) DO UPDATE SET min_release = EXCLUDED.min_release, written_by = EXCLUDED.written_by,
        updated_at = now()"""
# previous_release_may_run()'s constant answer brought in line with the release now written, in
# one round trip. Only where migration 036 made the function: a schema migrated part of the way
# has the release table alone.
SYNC_RELEASE = """DO $$ BEGIN
    IF to_regprocedure('previous_release_may_run_sync()') IS NOT NULL THEN
        PERFORM previous_release_may_run_sync();
    END IF;
END $$"""
# Live group members whose library records no group protocol: release 0.1.0 (migration 018).
LIVE_OLDER_MEMBERS = """SELECT group_name, member_id FROM members
    WHERE protocol IS NULL AND last_heartbeat > clock_timestamp() - make_interval(secs => session_timeout)"""
SCHEMA_VERSION = "SELECT coalesce(max(version), 0) FROM bus_migrations"
APPLIED = "SELECT version, name, checksum, applied_at FROM bus_migrations ORDER BY version"
MIGRATIONS_EXIST = "SELECT to_regclass('bus_migrations') IS NOT NULL"
RECORD = "INSERT INTO bus_migrations (version, name, checksum) VALUES ($1, $2, $3)"
BACKFILL = "UPDATE bus_migrations SET checksum = $2 WHERE version = $1 AND checksum IS NULL"


def checksum(sql: str) -> str:
    """The SHA-256 (hex) of a migration file's text."""
    return hashlib.sha256(sql.encode("utf-8")).hexdigest()


def release_key(release: str) -> tuple[int, ...]:
    """`"0.10.1"` -> `(0, 10, 1)`: releases compare by their numbers."""
    try:
        return tuple(int(part) for part in release.split("."))
    except ValueError:
        raise SchemaVersionError(f"release {release!r} is not a version number like 0.2.0") from None


def later(a: str, b: str) -> str:
    """The later of two releases."""
    return a if release_key(a) >= release_key(b) else b


def check_library(schema: str, schema_version: int, min_release: str, library: str = LIBRARY_RELEASE) -> None:
    """Raise SchemaVersionError when `library` is older than the schema's minimum release."""
    if release_key(library) < release_key(min_release):
        raise SchemaVersionError(
            f"schema {schema!r} is at version {schema_version} and needs pgactorbus >= {min_release}; "
            f"this library is pgactorbus {library}: upgrade the library (pip install -U pgactorbus) "
            "or point it at another schema"
        )


def check_checksum(file: str, applied: str | None, current: str) -> bool:
    """Whether an applied migration still matches its file (True: record nothing; raise on a change).

    Returns False when the applied row has no checksum yet (an earlier release applied it):
    the caller records the file's."""
    if applied is None:
        return False
    if applied == current or applied in RELEASED_CHECKSUMS.get(file, frozenset()):
        return True
    raise SchemaVersionError(
        f"migration {file} was changed after it was applied (recorded checksum {applied[:12]}, "
        f"file {current[:12]}); a released migration is never edited: restore the file and add "
        "a new migration for the change"
    )
