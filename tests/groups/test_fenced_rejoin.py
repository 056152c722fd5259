"""A fenced member (its row swept while it was busy) joins again exactly once."""

from __future__ import annotations

import asyncio

import bus
from bus.testing import eventually
from tests.helpers import drain


async def test_a_fenced_member_joins_again_once_even_when_many_fence_notices_queued_up(connect, fast) -> None:
    b = await connect(**fast)
    await b.create_topic("t", partitions=2)
    for i in range(10):
        await b.publish("t", {"i": i}, partition=str(i % 2))

    async def slow_revoke(tps: set[bus.TopicPartition]) -> None:
        # While this runs, every heartbeat finds the old identity gone and queues another notice.
        await asyncio.sleep(6 * fast["heartbeat_interval"])

    c = await b.consumer("g", topics=["t"], on_revoke=slow_revoke).start()
    await eventually(lambda: len(c.assignment()) == 2)
    assert len(await drain([c], 10)) == 10
    first = c.member_id
    ids: list[str | None] = []
    rows: list[int] = []

    async def watch() -> None:
        while True:
            if c.member_id != (ids[-1] if ids else None):
                ids.append(c.member_id)
            rows.append(await b.pool.fetchval("SELECT count(*) FROM members WHERE group_name = 'g'"))
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch())
    # The sweep of another process, as after a pause past the session: the row and its leases go.
    await b.pool.execute("DELETE FROM members WHERE group_name = 'g' AND member_id = $1", first)
    await b.pool.execute("UPDATE offsets SET owner = NULL, lease_expires_at = NULL WHERE group_name = 'g'")
    await eventually(lambda: c.member_id != first and len(c.assignment()) == 2)
    # Longer than the slow revoke plus a session: stale notices would have acted by then.
    await asyncio.sleep(8 * fast["heartbeat_interval"] + fast["session_timeout"])
    watcher.cancel()
    assert ids[0] == first and len(ids) == 2, f"joined again and again: {ids}"
    assert max(rows) == 1, f"orphaned member rows: {rows}"
    # Still consuming (what the fence cut short is read again: at least once).
    await b.publish("t", {"i": 10}, partition="0")
    got = await drain([c], 11)
    assert {"i": 10} in [m.value(dict) for m in got]
    await c.close()
