"""`bus demo`, the main job, runs to completion and proves nothing was lost."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid

import asyncpg
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.alone]


async def test_demo_runs_to_completion_with_a_member_killed_and_nothing_lost(dsn: str) -> None:
    schema = "demo_" + uuid.uuid4().hex[:8]
    env = {**os.environ, "BUS_DSN": dsn, "BUS_SCHEMA": schema, "COLUMNS": "120"}
    try:
        proc = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "bus", "demo", "--fast", "--messages", "3000"],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "nothing lost" in proc.stdout
        assert "taken" in proc.stdout and "over after" in proc.stdout
        # It ends by saying where the data is (the password masked) and who runs that server.
        tail = proc.stdout[proc.stdout.index("Where the data is") :]
        assert f"data: schema '{schema}' in the database at" in " ".join(tail.split())
        assert "(BUS_DSN)" in tail and "bus neither started it nor stops it" in " ".join(tail.split())
    finally:
        conn = await asyncpg.connect(dsn)
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await conn.close()
