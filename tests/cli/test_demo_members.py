"""`bus demo` stops its member processes without holding up its own event loop."""

from __future__ import annotations

import signal
import subprocess
import sys

import anyio
from anyio.abc import Process

from bus.demo import stop_members

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
