"""The statement-CPU script runs every publishing statement of this release on a local server.

Numbers are not compared here (they are for comparing releases by hand); the test pins that each
statement, planned or through the head functions, runs as the script gives it and is measured.
"""

from __future__ import annotations

import asyncio
import os

import asyncpg
import pytest

from benchmarks import statement_cpu


async def test_the_statement_cpu_script_measures_each_publishing_statement(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        backend = await conn.fetchval("SELECT pg_backend_pid()")
        local = await asyncio.to_thread(os.path.exists, f"/proc/{backend}/stat")
    finally:
        await conn.close()
    if not local:
        pytest.skip("the server does not run on this machine: its backends' CPU cannot be read")
    medians = await asyncio.to_thread(asyncio.run, statement_cpu.main(dsn, 5, 1))
    assert set(medians) == {
        f"{what}, {path}"
        for what in ("lone publish", "8-partition flush", "lone queue publish")
        for path in ("head function", "planned")
    }
    assert all(value >= 0 for value in medians.values())
