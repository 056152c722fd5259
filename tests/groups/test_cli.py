"""The group commands of the CLI: groups, describe, reset-offsets (dry run unless --execute)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

import bus
from tests.helpers import drain

pytestmark = pytest.mark.slow


def run_cli(dsn: str, schema: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BUS_DSN": dsn, "BUS_SCHEMA": schema, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "bus", *args], env=env, capture_output=True, text=True, timeout=60
    )


async def cli(dsn: str, schema: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`run_cli` off the event loop: a member of this process keeps heartbeating while the command runs
    (a blocked loop for longer than the session timeout made the member look dead to the command)."""
    return await asyncio.to_thread(run_cli, dsn, schema, *args)


async def test_groups_describe_and_reset_offsets_commands(connect, fast, dsn, schema) -> None:
    b = await connect(**fast)
    await b.create_topic("t", partitions=2)
    for i in range(6):
        await b.publish("t", {"i": i}, partition=str(i % 2))
    async with b.consumer("billing", topics=["t"]) as c:
        await drain([c], 6)
        await c.commit()

    out = await cli(dsn, schema, "groups")
    assert out.returncode == 0 and "billing" in out.stdout

    out = await cli(dsn, schema, "describe", "billing")
    assert out.returncode == 0, out.stderr
    for header in ("TOPIC", "PARTITION", "CURRENT-OFFSET", "LOG-END-OFFSET", "LAG", "CONSUMER-ID"):
        assert header in out.stdout

    out = await cli(dsn, schema, "reset-offsets", "billing", "--to", "earliest")
    assert out.returncode == 0 and "dry run" in out.stdout
    assert (await b.admin.describe_group("billing")).total_lag == 0

    out = await cli(dsn, schema, "reset-offsets", "billing", "--to", "earliest", "--execute")
    assert out.returncode == 0 and "applied" in out.stdout
    assert (await b.admin.describe_group("billing")).total_lag == 6

    out = await cli(dsn, schema, "describe", "nope")
    assert out.returncode == 2 and "does not exist" in out.stdout


async def test_reset_offsets_command_is_refused_while_members_are_live(connect, fast, dsn, schema) -> None:
    b = await connect(**fast)
    await b.create_topic("t", partitions=1)
    async with b.consumer("billing", topics=["t"]) as c:
        await c.wait_assigned()
        out = await cli(dsn, schema, "reset-offsets", "billing", "--to", "latest", "--execute")
        assert out.returncode == 2 and "live member" in out.stdout
    assert isinstance(b, bus.Bus)
