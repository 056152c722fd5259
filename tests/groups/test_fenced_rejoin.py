"""A fenced member (its row swept while it was busy) joins again exactly once."""

from __future__ import annotations

import asyncio

import bus
from bus.testing import Clock, eventually
from tests.groups.heartbeats import Beats
from tests.helpers import drain

BEAT = 30.0  # seconds of the Bus's clock between beats: the test's advances bring each one


async def test_a_fenced_member_joins_again_once_even_when_many_fence_notices_queued_up(
    connect, fast, monkeypatch
) -> None:
    # No poll fallback within the test (its workers would notice their leases gone before the fence
    # does, and let the partitions go without the revoke): the workers are woken by NOTIFY alone.
    timings = {
        "heartbeat_interval": BEAT,
        "session_timeout": 100.0,
        "lease_time": 120.0,
        "max_poll_interval": 3600.0,
    }
    b = await connect(**{**fast, **timings})
    await b.create_topic("t", partitions=2)
    for i in range(10):
        await b.publish("t", {"i": i}, partition=str(i % 2))
    beats = Beats(monkeypatch)
    clock = Clock(b)
    revokes: list[float] = []

    async def slow_revoke(tps: set[bus.TopicPartition]) -> None:
        # While the first one runs, every heartbeat finds the old identity gone and queues another notice.
        revokes.append(clock.monotonic())
        if len(revokes) == 1:
            await clock.sleep(6 * BEAT)

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
    await beats.after(clock, BEAT)  # finds the identity gone: the member is fenced, the slow revoke starts
    await eventually(lambda: revokes)
    for _ in range(5):  # beats during the slow revoke: each queues another notice about the old identity
        await beats.after(clock, BEAT)
    assert c.member_id == first  # still revoking
    clock.advance(BEAT)  # the revoke is over: the member joins again
    await eventually(lambda: c.member_id != first and len(c.assignment()) == 2)
    # Longer than the slow revoke plus a session: stale notices would have acted by then.
    for _ in range(8 + 4):
        await beats.after(clock, BEAT)
    watcher.cancel()
    assert ids[0] == first and len(ids) == 2, f"joined again and again: {ids}"
    assert max(rows) == 1, f"orphaned member rows: {rows}"
    # Still consuming (what the fence cut short is read again: at least once).
    await b.publish("t", {"i": 10}, partition="0")
    got: list[bus.Message] = []

    async def the_new_one_came() -> bool:  # after what the fence cut short, if anything was
        got.extend(await c.poll(timeout=0.05))
        return {"i": 10} in [m.value(dict) for m in got]

    await eventually(the_new_one_came, every=0)
    await c.close()
