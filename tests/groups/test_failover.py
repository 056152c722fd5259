"""Failover across OS processes: SIGKILL, graceful leave, leader death."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import bus
from bus.testing import FAST, eventually

pytestmark = [pytest.mark.slow, pytest.mark.alone]

ROOT = Path(__file__).resolve().parents[2]


def start_member(dsn: str, schema: str, group: str, topic: str, out: Path) -> subprocess.Popen[bytes]:
    args = [f"{k}={v}" for k, v in FAST.items()]
    return subprocess.Popen(
        [sys.executable, "-m", "tests.groups.member_proc", "-", schema, group, topic, str(out), *args],
        cwd=ROOT,
        env={**os.environ, "BUS_DSN": dsn},  # the password through the environment
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )


def deliveries(out: Path) -> list[tuple[str, int, int]]:
    rows = []
    for line in out.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            rows.append((parts[0], int(parts[1]), int(parts[2])))
    return rows


async def leased_by(b: bus.Bus, group: str) -> dict[str, str]:
    rows = await b.pool.fetch(
        "SELECT p.name, o.owner FROM offsets o JOIN partitions p ON p.id=o.partition_id "
        "WHERE o.group_name=$1 AND o.owner IS NOT NULL AND o.lease_expires_at > now()",
        group,
    )
    return {r[0]: r[1] for r in rows}


async def test_sigkilled_member_partitions_are_taken_over_within_the_bound_and_nothing_is_lost(
    connect, dsn, schema, tmp_path
) -> None:
    b = await connect(**FAST)
    await b.create_topic("t", partitions=6)
    out = tmp_path / "deliveries.txt"
    out.touch()
    procs = [start_member(dsn, schema, "g", "t", out) for _ in range(3)]
    try:
        acked = []
        for i in range(300):
            acked.append(await b.publish("t", {"i": i}, partition=str(i % 6)))

        async def three_members_own_all():
            try:
                d = await b.admin.describe_group("g")
            except bus.GroupNotFoundError:  # the member processes have not recorded the group yet
                return False
            owners = await leased_by(b, "g")
            return d.state == "stable" and len({o for o in owners.values()}) == 3 and len(owners) == 6

        await eventually(three_members_own_all, timeout=30)
        d = await b.admin.describe_group("g")
        victim = procs[0]
        victim_member = next(m.member_id for m in d.members if m.pid == victim.pid)
        victim_parts = {
            tp.partition for m in d.members if m.member_id == victim_member for tp in m.partitions
        }
        assert victim_parts
        t0 = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        victim.wait()

        async def keep_publishing() -> None:
            for i in range(300, 600):
                acked.append(await b.publish("t", {"i": i}, partition=str(i % 6)))

        producer = asyncio.create_task(keep_publishing())

        async def taken_over():
            owners = await leased_by(b, "g")
            return len(owners) == 6 and victim_member not in owners.values()

        await eventually(taken_over, timeout=30, every=0.05)
        elapsed = time.monotonic() - t0
        await producer
        bound = FAST["session_timeout"] + FAST["heartbeat_interval"] + FAST["rebalance_delay"] + 1.0
        assert elapsed <= bound, f"failover took {elapsed:.2f}s, bound {bound:.2f}s"

        def all_delivered():
            got = {(p, o) for p, o, _ in deliveries(out)}
            return all((r.partition, r.offset) in got for r in acked)

        await eventually(all_delivered, timeout=30)
        # per-partition order within each process's deliveries
        by_proc: dict[tuple[int, str], list[int]] = {}
        for p, o, pid in deliveries(out):
            by_proc.setdefault((pid, p), []).append(o)
        for offs in by_proc.values():
            assert offs == sorted(offs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


async def test_leader_process_dying_moves_leadership(connect, dsn, schema, tmp_path) -> None:
    b = await connect(**FAST)
    await b.create_topic("t", partitions=4)
    out = tmp_path / "d.txt"
    out.touch()
    first = start_member(dsn, schema, "g", "t", out)
    try:
        await eventually(lambda: _leader(b), timeout=20)
        leader_before = await _leader(b)
        second = start_member(dsn, schema, "g", "t", out)

        async def two_members():
            try:
                d = await b.admin.describe_group("g")
            except bus.GroupNotFoundError:
                return False
            return d.state == "stable" and len([m for m in d.members if m.partitions]) == 2

        await eventually(two_members, timeout=30)
        first.send_signal(signal.SIGKILL)
        first.wait()

        async def moved():
            leader = await _leader(b)
            owners = await leased_by(b, "g")
            return (
                leader not in (None, leader_before) and len(owners) == 4 and set(owners.values()) == {leader}
            )

        await eventually(moved, timeout=30)
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=15)
    finally:
        for p in (first,):
            if p.poll() is None:
                p.kill()


async def _leader(b: bus.Bus):
    row = await b.pool.fetchrow("SELECT leader FROM groups WHERE name='g'")
    return None if row is None else row["leader"]


async def test_a_member_silent_past_its_session_is_removed_once_even_with_two_sweepers(connect, fast) -> None:
    b1 = await connect(**fast)
    b2 = await connect(**fast)
    await b1.create_topic("t", partitions=1)
    await b1.pool.execute(
        "INSERT INTO groups (name, start_mode) VALUES ('g', 'earliest');"
        "INSERT INTO members (group_name, member_id, client_id, host, pid, session_timeout, last_heartbeat) "
        "VALUES ('g', 'ghost', 'x', 'h', 1, 1.0, now() - interval '1 minute')"
    )
    removed = await asyncio.gather(b1.admin.sweep(), b2.admin.sweep())
    # Each Bus's heartbeat monitor sweeps too: on a loaded machine one of them may get there first.
    assert sorted(removed) in ([0, 0], [0, 1], [1, 1])
    assert await b1.pool.fetchval("SELECT count(*) FROM members WHERE member_id='ghost'") == 0
    d = await b1.admin.describe_group("g")
    assert d.state == "empty"  # its only member is gone


async def test_a_paused_member_past_its_session_is_fenced_and_rejoins_when_it_wakes(
    connect, dsn, schema, tmp_path
) -> None:
    b = await connect(**FAST)
    await b.create_topic("t", partitions=4)
    out = tmp_path / "d.txt"
    out.touch()
    procs = [start_member(dsn, schema, "g", "t", out) for _ in range(2)]
    samples: list[dict[int, int]] = []
    try:

        async def two_own_all():
            owners = await leased_by(b, "g")
            return len(owners) == 4 and len(set(owners.values())) == 2

        await eventually(two_own_all, timeout=30)
        d = await b.admin.describe_group("g")
        zombie = procs[0]
        zombie_member = next(m.member_id for m in d.members if m.pid == zombie.pid)
        zombie.send_signal(signal.SIGSTOP)

        async def sample() -> None:
            rows = await b.pool.fetch("SELECT partition_id, committed FROM offsets WHERE group_name='g'")
            samples.append({r[0]: r[1] for r in rows})

        for i in range(40):
            await b.publish("t", {"i": i}, partition=str(i % 4))

        async def survivor_owns_all():
            await sample()
            owners = await leased_by(b, "g")
            return len(owners) == 4 and zombie_member not in owners.values()

        await eventually(survivor_owns_all, timeout=30)
        zombie.send_signal(signal.SIGCONT)
        for i in range(40, 80):
            await b.publish("t", {"i": i}, partition=str(i % 4))

        async def zombie_rejoined_and_all_done():
            await sample()
            d = await b.admin.describe_group("g")
            pids = {m.pid for m in d.members if m.live}
            return (
                zombie.pid in pids
                and zombie_member not in {m.member_id for m in d.members}
                and d.total_lag == 0
            )

        await eventually(zombie_rejoined_and_all_done, timeout=30)
        got = {(p, o) for p, o, _ in deliveries(out)}
        assert all((str(i % 4), i // 4) in got for i in range(80))
        # committed offsets never moved backwards while the zombie woke up
        for before, after in zip(samples, samples[1:], strict=False):
            for pid, committed in before.items():
                assert after.get(pid, committed) >= committed
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
