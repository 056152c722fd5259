"""`bus demo`'s member processes: each leaves its group on SIGTERM, and the demo stops them without
holding up its own event loop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import Process

import bus
from bus.demo import TOPIC, member_command, stop_members
from bus.testing import FAST, eventually

# A member that leaves on SIGTERM, and one that ignores it (stuck in a handler, say).
LEAVES = "import sys, time; print('ready', flush=True); time.sleep(60)"
IGNORES = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(60)"
)


async def _start(code: str) -> Process:
    proc = await anyio.open_process(
        [sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=None
    )
    assert proc.stdout is not None
    assert (await proc.stdout.receive()).strip() == b"ready"  # its SIGTERM handling is in place
    return proc


async def test_members_are_terminated_then_killed_after_the_grace_while_the_loop_runs_on() -> None:
    leaves, ignores = await _start(LEAVES), await _start(IGNORES)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.05)
            ticks += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(tick)
        await stop_members([leaves, ignores], grace=1.0)
        tg.cancel_scope.cancel()
    assert leaves.returncode == -signal.SIGTERM
    assert ignores.returncode == -signal.SIGKILL
    # The event loop kept running while stop_members waited out the grace (the Bus beside it heartbeats).
    assert ticks >= 5, ticks


async def test_members_are_stopped_when_the_demo_is_cancelled() -> None:
    member = await _start(IGNORES)
    with anyio.move_on_after(0.1) as scope:
        try:
            await anyio.sleep(60)
        finally:
            await stop_members([member], grace=0.5)
    assert scope.cancelled_caught
    assert member.returncode == -signal.SIGKILL


@pytest.mark.slow  # a member process of its own
async def test_a_member_leaves_its_group_and_exits_cleanly_on_sigterm(
    connect: Any, dsn: str, schema: str, tmp_path: Path
) -> None:
    b = await connect(**FAST)
    await b.create_topic(TOPIC, partitions=2)
    group = "demo-billing-test"
    out = tmp_path / "member.txt"
    proc = await anyio.open_process(
        member_command(schema, group, out, FAST, 0.0),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "BUS_DSN": dsn},
    )
    try:

        async def joined() -> bool:
            try:
                return len((await b.admin.describe_group(group)).members) == 1
            except bus.GroupNotFoundError:
                return False

        await eventually(joined, timeout=60)
        proc.terminate()
        with anyio.fail_after(60):  # a hang guard, not a speed bar
            await proc.wait()
        assert proc.returncode == 0  # the SIGTERM was the member's cue to leave, not its death
        assert (await b.admin.describe_group(group)).members == []
    finally:
        await stop_members([proc], grace=1.0)
