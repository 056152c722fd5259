"""`bus workflows`: list runs, show a run's steps, cancel and resume from the command line."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

import bus
from bus.testing import eventually

pytestmark = pytest.mark.slow  # runs `python -m bus` in subprocesses


async def run_cli(dsn: str, schema: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Off the event loop: the test's own Bus executes the runs meanwhile."""
    return await asyncio.to_thread(_run_cli, dsn, schema, *args)


def _run_cli(dsn: str, schema: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BUS_DSN": dsn, "BUS_SCHEMA": schema, "COLUMNS": "160"}
    return subprocess.run(
        [sys.executable, "-m", "bus", "workflows", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def reserve_stock(sku: str) -> int:
    return len(sku)


async def test_list_show_cancel_and_resume_from_the_cli(b: bus.Bus, dsn: str, schema: str) -> None:
    @b.workflow("restock")
    async def restock(ctx: bus.WorkflowContext, sku: str) -> int:
        n = int(await ctx.step(reserve_stock, sku))
        await ctx.recv("go")
        return n

    run = await b.start_workflow("restock", "sku-42", workflow_id="restock-42")
    await b.send("restock-0", "go", None)  # another run's inbox: this one still waits

    async def stocked() -> bool:
        return len((await b.admin.workflow("restock-42")).steps) == 1

    await eventually(stocked)

    listed = await run_cli(dsn, schema, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    [row] = json.loads(listed.stdout)
    assert row["workflow_id"] == "restock-42" and row["name"] == "restock"

    shown = await run_cli(dsn, schema, "show", "restock-42")
    assert shown.returncode == 0, shown.stderr
    assert "reserve_stock" in shown.stdout and "restock-42" in shown.stdout

    cancelled = await run_cli(dsn, schema, "cancel", "restock-42")
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout
    assert (await b.admin.workflow("restock-42")).status == "cancelled"
    await b.send("restock-42", "go", None)
    resumed = await run_cli(dsn, schema, "resume", "restock-42")
    assert resumed.returncode == 0 and "resumed" in resumed.stdout
    assert await run.result(timeout=30) == 6

    missing = await run_cli(dsn, schema, "show", "nope")
    assert missing.returncode == 2 and "no workflow run" in missing.stdout
