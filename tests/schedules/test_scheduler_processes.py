"""Five processes run a Bus on one schema; the scheduler leader is killed as a tick falls due."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from tests.conftest import Connect
from tests.schedules.test_schedules import EVERY_SECOND, ticks, wait_ticks

pytestmark = [pytest.mark.slow, pytest.mark.alone]

ROOT = Path(__file__).resolve().parents[2]


def start(dsn: str, schema: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.schedules.scheduler_proc", dsn, schema, "jobs", EVERY_SECOND],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )


async def test_a_tick_is_published_once_when_the_leader_dies_as_it_falls_due(
    connect: Connect, dsn: str, schema: str
) -> None:
    b = await connect(scheduler_interval=0)  # this one only watches
    await b.create_topic("jobs", partitions=1)
    procs = [start(dsn, schema) for _ in range(5)]
    try:
        for p in procs:
            assert p.stdout is not None
            assert (await asyncio.to_thread(p.stdout.readline)).strip() == b"ready"
        await wait_ticks(b, 2, timeout=20)
        owner = await b.pool.fetchval("SELECT owner FROM scheduler_lease")
        leader = next(p for p in procs if owner.startswith(f"scheduler-{p.pid}-"))
        # SIGKILL a few milliseconds after a tick falls due: the leader is firing it.
        await asyncio.sleep(1 - time.time() % 1 + 0.005)
        leader.send_signal(signal.SIGKILL)
        killed_at = time.time()
        found = await wait_ticks(b, len(await ticks(b)) + 4, timeout=20)
        assert any(t.timestamp() > killed_at + 1 for t in found)  # a new leader took over
        assert len(set(found)) == len(found), found  # no tick twice
        gaps = [later - earlier for earlier, later in zip(found, found[1:], strict=False)]
        assert set(gaps) == {timedelta(seconds=1)}, found  # none lost across the kill
        new_owner = await b.pool.fetchval("SELECT owner FROM scheduler_lease")
        assert new_owner != owner
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
