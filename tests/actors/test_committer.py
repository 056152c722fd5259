"""The Committer: a member's handler-mode commits in one fenced statement, each fenced by its own lease."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
import pytest

import bus
from actors import spawn
from actors.committer import Commit, Committer
from actors.runtime import ActorRef, ActorStoppedError
from storage import db, leases


async def _leased(b: bus.Bus, topic: str, partitions: int) -> list[int]:
    """`partitions` partitions of a new topic, each leased by member 'm' of group 'g' (epoch 1)."""
    await b.create_topic(topic, partitions=partitions)
    conn = b.pool
    await conn.execute(
        "INSERT INTO groups (name, start_mode) VALUES ('g', 'earliest') ON CONFLICT DO NOTHING"
    )
    pids = [r[0] for r in await conn.fetch("SELECT id FROM partitions WHERE topic = $1 ORDER BY id", topic)]
    for pid in pids:
        await conn.execute(
            "INSERT INTO offsets (group_name, partition_id, committed, owner, lease_epoch, lease_expires_at)"
            " VALUES ('g', $1, 0, 'm', 1, clock_timestamp() + interval '1 minute')",
            pid,
        )
    return pids


@asynccontextmanager
async def _running(pool: asyncpg.Pool, write_timeout: float = 5.0) -> AsyncIterator[ActorRef[Commit]]:
    """A Committer of group 'g' over a Lender of `pool`, stopped (and the Lender closed) at the end."""
    lender = db.Lender(pool, 2)
    committer = spawn(lambda: Committer(lender, "g", timeout=write_timeout), "committer")
    try:
        yield committer
    finally:
        await committer.stop()
        await lender.close()


def _commit(committer, member: str, pid: int, position: int, epoch: int) -> asyncio.Future[bool]:  # type: ignore[no-untyped-def]
    reply: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    assert committer.try_tell(Commit(member, pid, position, epoch, reply))
    return reply


async def test_commits_apply_each_under_its_own_lease_in_one_statement(b: bus.Bus, monkeypatch) -> None:
    pool = b.pool
    pids = await _leased(b, "t", 3)
    statements: list[list[tuple[int, int, int]]] = []
    real = leases.commit

    async def counted(conn, group, member_id, entries, now=None):  # type: ignore[no-untyped-def]
        statements.append(list(entries))
        return await real(conn, group, member_id, entries, now)

    monkeypatch.setattr(leases, "commit", counted)
    async with _running(pool) as committer:
        # Sent in one turn: the first goes at once, the other two together in the next statement.
        ok = _commit(committer, "m", pids[0], 5, 1)
        stale = _commit(committer, "m", pids[1], 7, 0)  # an epoch the partition no longer has
        also_ok = _commit(committer, "m", pids[2], 9, 1)
        assert await asyncio.wait_for(asyncio.gather(ok, stale, also_ok), 10) == [True, False, True]
        assert len(statements) == 2 and len(statements[1]) == 2
        async with pool.acquire() as conn:
            rows = dict(
                await conn.fetch("SELECT partition_id, committed FROM offsets WHERE group_name = 'g'")
            )
        assert rows == {pids[0]: 5, pids[1]: 0, pids[2]: 9}  # the stale lease's commit wrote nothing


async def test_a_partition_asked_under_two_leases_learns_which_one_applied(b: bus.Bus) -> None:
    pool = b.pool
    (pid,) = await _leased(b, "t", 1)
    async with _running(pool) as committer:
        first = _commit(committer, "m", pid, 1, 1)
        old = _commit(committer, "m", pid, 50, 0)  # a late commit of an earlier lease of the partition
        current = _commit(committer, "m", pid, 3, 1)
        assert await asyncio.wait_for(asyncio.gather(first, old, current), 10) == [True, False, True]
        async with pool.acquire() as conn:
            assert await conn.fetchval("SELECT committed FROM offsets WHERE partition_id = $1", pid) == 3


async def test_a_write_that_hangs_fails_its_commits_after_the_timeout_and_the_next_one_goes_on(
    b: bus.Bus,
) -> None:
    pool = b.pool
    stuck_pid, free_pid = await _leased(b, "t", 2)
    # Another session holds the first partition's offsets row: a commit of it waits on the lock.
    holder = await pool.acquire()
    tx = holder.transaction()
    await tx.start()
    await holder.execute("SELECT 1 FROM offsets WHERE partition_id = $1 FOR UPDATE", stuck_pid)
    try:
        async with _running(pool, write_timeout=0.5) as committer:
            stuck = _commit(committer, "m", stuck_pid, 4, 1)
            await asyncio.sleep(0.1)
            behind = _commit(committer, "m", free_pid, 6, 1)  # waits for the write in flight
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(stuck, 10)
            assert await asyncio.wait_for(behind, 10) is True
    finally:
        await tx.rollback()
        await pool.release(holder)


async def test_commits_left_when_the_committer_stops_fail_with_actor_stopped(b: bus.Bus) -> None:
    pool = b.pool
    (pid,) = await _leased(b, "t", 1)
    lender = db.Lender(pool, 1)
    committer = spawn(lambda: Committer(lender, "g", timeout=5.0), "committer")
    first = _commit(committer, "m", pid, 1, 1)
    left = _commit(committer, "m", pid, 2, 1)
    await committer.stop()  # drains its mailbox: the write in flight ends, what is left fails
    assert await first is True
    with pytest.raises(ActorStoppedError):
        await left
    await lender.close()
