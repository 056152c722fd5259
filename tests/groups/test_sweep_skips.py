"""The sweep never waits for a group row another transaction holds: it runs on the heartbeat's turn."""

from __future__ import annotations

import asyncio
from typing import Any

GHOST = (
    "INSERT INTO members (group_name, member_id, client_id, host, pid, session_timeout, last_heartbeat) "
    "VALUES ('g', 'ghost', 'x', 'h', 1, 1.0, now() - interval '1 minute')"
)


async def test_a_sweep_skips_a_group_held_by_another_transaction_and_the_next_one_removes_its_dead(
    connect: Any, fast: dict[str, float]
) -> None:
    # Every process sweeps at every beat, before its next beat: one that queued behind the others'
    # sweeps of the same group (or a long rebalance) would beat late. It skips the group instead;
    # the next sweep, once the row is free, removes the dead member.
    b = await connect(**fast)
    await b.pool.execute("INSERT INTO groups (name, start_mode) VALUES ('g', 'earliest')")
    async with b.pool.acquire() as holder:
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SELECT name FROM groups WHERE name = 'g' FOR NO KEY UPDATE")
        await b.pool.execute(GHOST)
        removed = await asyncio.wait_for(b.admin.sweep(), 3.0)
        assert removed == 0
        assert await b.pool.fetchval("SELECT count(*) FROM members WHERE member_id = 'ghost'") == 1
        await tx.rollback()
    # The group row is free again: the admin's sweep (or the heartbeat's own, a beat later) removes it.
    await asyncio.wait_for(b.admin.sweep(), 3.0)
    assert await b.pool.fetchval("SELECT count(*) FROM members WHERE member_id = 'ghost'") == 0
