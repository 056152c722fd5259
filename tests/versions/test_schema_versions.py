"""Schema versions: a library older than the schema's minimum release is refused, a changed
migration is refused with its file named, earlier texts of edited migrations still open, and
`bus migrate --status | --dry-run` report without writing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest

import bus
from storage import db, routines, versions

ROOT = Path(__file__).resolve().parents[2]

MAY_RUN = "SELECT previous_release_may_run()"

# The tests migrate their schemas themselves and check what the migrations did.
pytestmark = pytest.mark.fresh_schema


async def _conn(dsn: str, schema: str) -> asyncpg.Connection:
    return await db.connect(dsn, schema)


async def test_a_library_older_than_the_schema_minimum_is_refused_naming_both(
    dsn: str, schema: str, drop_schema: None
) -> None:
    async with bus.connect(dsn, schema=schema):
        pass
    conn = await _conn(dsn, schema)
    try:
        # A schema this library created: no older release ever ran on it.
        assert (await conn.fetchrow(versions.READ_RELEASE))["min_release"] == versions.LIBRARY_RELEASE
        await conn.execute(versions.WRITE_RELEASE, "9.1.0", "9.1.0")
        applied_before = await conn.fetch(versions.APPLIED)
        with pytest.raises(bus.errors.SchemaVersionError) as err:
            async with bus.connect(dsn, schema=schema):
                pass
        text = str(err.value)
        assert "9.1.0" in text and versions.LIBRARY_RELEASE in text
        assert f"version {max(v for v, _, _ in db.migrations())}" in text
        # Refused before writing: the floor a newer release set stays, nothing is recorded.
        assert (await conn.fetchrow(versions.READ_RELEASE))["min_release"] == "9.1.0"
        assert await conn.fetch(versions.APPLIED) == applied_before
    finally:
        await conn.close()


async def test_the_minimum_release_is_never_lowered(dsn: str, schema: str, drop_schema: None) -> None:
    conn = await _conn(dsn, schema)
    try:
        await db.migrate(conn, schema)
        await conn.execute(versions.WRITE_RELEASE, "0.2.0", "0.3.0")
        await db.migrate(conn, schema)  # this library (0.2.0) may run and keeps the later floor
        assert (await conn.fetchrow(versions.READ_RELEASE))["min_release"] == "0.2.0"
    finally:
        await conn.close()


async def test_a_changed_migration_file_is_refused_with_its_name(
    dsn: str, schema: str, drop_schema: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = await _conn(dsn, schema)
    try:
        await db.migrate(conn, schema)
        original = db.migrations()
        edited = [(v, n, sql + "\n-- an edit\n" if v == 3 else sql) for v, n, sql in original]
        monkeypatch.setattr("storage.migrate.migrations", lambda: edited)
        with pytest.raises(bus.errors.SchemaVersionError, match=r"003_queues\.sql was changed"):
            await db.migrate(conn, schema)
        status = await db.migration_status(conn, schema)
        assert [m.file for m in status.migrations if m.state == "changed"] == ["003_queues.sql"]
    finally:
        await conn.close()


async def test_earlier_texts_of_edited_migrations_still_open(
    dsn: str, schema: str, drop_schema: None
) -> None:
    conn = await _conn(dsn, schema)
    try:
        await db.migrate(conn, schema)
        for file, sums in versions.RELEASED_CHECKSUMS.items():
            await conn.execute(
                "UPDATE bus_migrations SET checksum = $2 WHERE version = $1", int(file[:3]), min(sums)
            )
        assert await db.migrate(conn, schema) == []
        # A checksum that no release ever had is refused.
        await conn.execute("UPDATE bus_migrations SET checksum = $2 WHERE version = $1", 7, "0" * 64)
        with pytest.raises(bus.errors.SchemaVersionError, match=r"007_segments\.sql"):
            await db.migrate(conn, schema)
    finally:
        await conn.close()


async def test_a_schema_migrated_before_checksums_gains_them(
    dsn: str, schema: str, drop_schema: None
) -> None:
    conn = await _conn(dsn, schema)
    try:
        await db.migrate(conn, schema)
        # What 0.1.0 leaves: no checksum column, no release table.
        await conn.execute("ALTER TABLE bus_migrations DROP COLUMN checksum")
        await conn.execute("DROP TABLE bus_schema_release")
        status = await db.migration_status(conn, schema)
        assert status.min_release is None and {m.state for m in status.migrations} == {"applied"}
        assert await db.migrate(conn, schema) == []
        rows = await conn.fetch(versions.APPLIED)
        files = {v: sql for v, _, sql in db.migrations()}
        assert [r["checksum"] for r in rows] == [versions.checksum(files[r["version"]]) for r in rows]
        assert (await conn.fetchrow(versions.READ_RELEASE))["min_release"] == versions.MIN_COMPATIBLE_RELEASE
        # The release table made again without its trigger: the migrator still answers for it.
        assert await conn.fetchval(MAY_RUN) is True
        await conn.execute(versions.WRITE_RELEASE, versions.LIBRARY_RELEASE, versions.LIBRARY_RELEASE)
        assert await conn.fetchval(MAY_RUN) is False  # the trigger is back
    finally:
        await conn.close()


def _bus(dsn: str, schema: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BUS_DSN": dsn, "BUS_SCHEMA": schema, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "bus", "migrate", *args], env=env, capture_output=True, text=True, timeout=60
    )


async def test_bus_migrate_status_dry_run_and_apply(dsn: str, schema: str, drop_schema: None) -> None:
    files = [db.migration_file(v, n) for v, n, _ in db.migrations()]
    status = _bus(dsn, schema, "--status")
    assert status.returncode == 0, status.stderr
    assert (
        f"schema {schema}: version 0, minimum release -, this library {versions.LIBRARY_RELEASE}"
        in status.stdout
    )
    assert f"{len(files)} pending" in status.stdout
    assert all(f in status.stdout for f in files)

    dry = _bus(dsn, schema, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert [line[3:] for line in dry.stdout.splitlines() if line.startswith("-- 0")] == files
    assert "CREATE TABLE" in dry.stdout
    conn = await _conn(dsn, schema)
    try:
        assert await conn.fetchval(versions.MIGRATIONS_EXIST) is False  # --status and --dry-run wrote nothing
    finally:
        await conn.close()

    applied = _bus(dsn, schema)
    assert applied.returncode == 0, applied.stderr
    assert f"applied {len(files)} migration(s): 001" in applied.stdout

    status = _bus(dsn, schema, "--status")
    assert "0 pending" in status.stdout
    last = max(v for v, _, _ in db.migrations())
    assert f"version {last}, minimum release {versions.LIBRARY_RELEASE}" in status.stdout
    assert status.stdout.count(" applied ") >= len(files)
    assert "nothing to apply" in _bus(dsn, schema, "--dry-run").stdout


async def test_finalize_ends_a_rolling_deploy_and_waits_for_the_older_members_to_leave(
    dsn: str, schema: str, drop_schema: None
) -> None:
    conn = await _conn(dsn, schema)
    try:
        await db.migrate(conn, schema)
        await conn.execute(versions.WRITE_RELEASE, versions.MIN_COMPATIBLE_RELEASE, "0.1.0")  # made by 0.1.0
        # A constant of the schema, written again with the release (migration 036).
        assert await conn.fetchval(MAY_RUN) is True
        await conn.execute("INSERT INTO groups (name, start_mode) VALUES ('g', 'earliest')")
        # A live member of release 0.1.0: it records no group protocol.
        await conn.execute(
            "INSERT INTO members (group_name, member_id, client_id, host, pid, session_timeout)"
            " VALUES ('g', 'old-1', 'c', 'h', 1, 30)"
        )
        refused = _bus(dsn, schema, "--finalize")
        assert refused.returncode == 2
        assert "group(s) g" in refused.stdout + refused.stderr
        assert (await conn.fetchrow(versions.READ_RELEASE))["min_release"] == versions.MIN_COMPATIBLE_RELEASE
        await conn.execute("DELETE FROM members")
        # An earlier release's routine (a statement this release no longer has) goes with the finalize.
        earlier = "bus_stmt_" + "0" * 32
        await conn.execute(
            f'CREATE FUNCTION "{schema}".{earlier}() RETURNS int LANGUAGE sql AS $$ SELECT 1 $$'
        )
        done = _bus(dsn, schema, "--finalize")
        assert done.returncode == 0, done.stderr
        left = await conn.fetch(
            "SELECT proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
            " WHERE n.nspname = $1 AND proname LIKE 'bus_stmt_%'",
            schema,
        )
        assert sorted(r[0] for r in left) == sorted(routines.name_of(sql) for sql in routines.registered())
        assert f"minimum release {versions.LIBRARY_RELEASE}" in done.stdout
        assert await db.finalize(conn, schema) == versions.LIBRARY_RELEASE  # again: nothing changes
        assert await conn.fetchval(MAY_RUN) is False
        volatility = (
            "SELECT provolatile::text FROM pg_proc WHERE oid = 'previous_release_may_run()'::regprocedure"
        )
        assert await conn.fetchval(volatility) == "i"  # folded into the plans that call it
        # The previous release now refuses to start on the schema.
        with pytest.raises(bus.errors.SchemaVersionError):
            versions.check_library(
                schema, 21, versions.LIBRARY_RELEASE, library=versions.MIN_COMPATIBLE_RELEASE
            )
    finally:
        await conn.close()


def test_the_library_release_is_the_project_version() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert f'\nversion = "{versions.LIBRARY_RELEASE}"\n' in text


async def test_a_later_release_migration_is_listed_and_ignored(
    dsn: str, schema: str, drop_schema: None
) -> None:
    conn = await _conn(dsn, schema)
    try:
        await db.migrate(conn, schema)
        # A later release's migration, expand only, with a minimum release this library meets.
        await conn.execute(versions.RECORD, 999, "later_release", "f" * 64)
        assert await db.migrate(conn, schema) == []
        status = await db.migration_status(conn, schema)
        assert status.schema_version == 999
        assert [(m.file, m.state) for m in status.migrations][-1] == ("999_later_release.sql", "unknown")
    finally:
        await conn.close()


def test_releases_json_the_changelog_and_the_project_agree() -> None:
    releases = json.loads((ROOT / "releases.json").read_text())
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert releases["current"] == versions.LIBRARY_RELEASE
    assert f"\n## {versions.LIBRARY_RELEASE}\n" in changelog
    for release, entry in releases["releases"].items():
        assert f"\n## {release}\n" in changelog and entry["commit"] in changelog
