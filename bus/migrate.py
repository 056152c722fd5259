"""`bus migrate`: apply the schema's pending migrations, list them, or print their SQL.

Database and schema come from `BUS_DSN` / `BUS_SCHEMA` like every command;
without `BUS_DSN` the embedded server under `$BUS_HOME`. `--status` and
`--dry-run` write nothing. `--finalize` ends a rolling deploy: the schema's
minimum release becomes this library's, so the previous release no longer runs
on it and the schema stops keeping what only that release reads.
"""

from __future__ import annotations

import os

from rich.console import Console
from rich.table import Table

from bus.config import Config
from storage import db


async def _dsn() -> str:
    dsn = os.environ.get("BUS_DSN")
    if dsn:
        return dsn
    import anyio.to_thread

    from bus.server.embedded import ensure_server

    return (await anyio.to_thread.run_sync(lambda: ensure_server(keep=True))).dsn


async def migrate_command(console: Console, *, status: bool, dry_run: bool, finalize: bool = False) -> None:
    """The body of `bus migrate`; a BusError propagates to the CLI (exit code 2)."""
    schema = Config.load({}).schema
    with db.translate_errors():
        conn = await db.connect(await _dsn(), schema)
        try:
            if status or dry_run:
                st = await db.migration_status(conn, schema)
            else:
                applied = await db.migrate(conn, schema)
                if finalize:
                    await db.finalize(conn, schema)
                st = await db.migration_status(conn, schema)
        finally:
            await conn.close()
    if dry_run:
        pending = db.pending_sql(st)
        if not pending:
            console.print(f"-- schema {schema}: nothing to apply (version {st.schema_version})")
        for file, sql in pending:
            # Plain print: the SQL goes to a file or psql as it is, without rich markup.
            print(f"-- {file}\n{sql.rstrip()}\n")
        return
    head = (
        f"schema {schema}: version {st.schema_version}, minimum release {st.min_release or '-'}, "
        f"this library {st.library_release}"
    )
    console.print(head, markup=False, highlight=False)
    if status:
        t = Table("version", "file", "state", "applied at", show_edge=False, pad_edge=False)
        for m in st.migrations:
            at = m.applied_at.isoformat(timespec="seconds") if m.applied_at else "-"
            t.add_row(f"{m.version:03d}", m.file, m.state, at)
        console.print(t)
        waiting = sum(m.state == "pending" for m in st.migrations)
        console.print(f"{waiting} pending", highlight=False)
    else:
        console.print(
            f"applied {len(applied)} migration(s)"
            + (f": {', '.join(f'{v:03d}' for v in applied)}" if applied else ""),
            highlight=False,
        )
