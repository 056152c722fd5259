"""Delivery: the poll fallback covers lost notifications; bounded buffers; group states."""

from __future__ import annotations

import asyncio

import pytest

import bus
from bus.testing import eventually
from tests.helpers import drain


async def test_a_message_whose_notification_never_came_is_still_delivered_by_the_poll_fallback(
    connect, fast
) -> None:
    b = await connect(**fast)
    await b.create_topic("t", partitions=1)
    async with b.consumer("g", topics=["t"]) as c:
        await c.wait_assigned()
        # Append without pg_notify, as if the notification were lost.
        await b.pool.execute(
            """WITH p AS (UPDATE partitions SET next_offset = next_offset + 1
                          WHERE topic = 't' AND name = '0' RETURNING id, next_offset - 1 AS off)
               INSERT INTO messages (partition_id, "offset", payload) SELECT id, off, '"silent"' FROM p"""
        )
        got = await drain([c], 1, timeout=fast["max_poll_interval"] * 6)
        assert [m.payload for m in got] == [b'"silent"']


async def test_a_consumer_that_does_not_poll_holds_a_bounded_buffer(connect, fast) -> None:
    b = await connect(**fast)
    await b.create_topic("t", partitions=4)
    for start in range(0, 8000, 1000):
        await b.publish_many(
            "t", [bus.Outgoing(b"x" * 50, partition=str(i % 4)) for i in range(start, start + 1000)]
        )
    c = b.consumer("g", topics=["t"], max_poll_records=100, buffer_size=500)
    await c.start()
    await c.wait_assigned()
    await asyncio.sleep(fast["max_poll_interval"] * 3)  # give the workers every chance to overfill
    assert c.buffered <= 500 + 100  # one fetch over the bound at most
    got = await drain([c], 8000, timeout=60)
    assert len(got) == 8000
    await c.close()


async def test_group_states_go_empty_preparing_rebalancing_stable_and_back_to_empty(connect, fast) -> None:
    b = await connect(**{**fast, "rebalance_delay": 0.5})
    await b.create_topic("t", partitions=2)
    seen: list[str] = []

    async def watch(stop: asyncio.Event) -> None:
        while not stop.is_set():
            row = await b.pool.fetchrow("SELECT state FROM groups WHERE name='g'")
            if row and (not seen or seen[-1] != row[0]):
                seen.append(row[0])
            await asyncio.sleep(0.01)

    stop = asyncio.Event()
    watcher = asyncio.create_task(watch(stop))
    c = await b.consumer("g", topics=["t"]).start()
    await eventually(lambda: seen and seen[-1] == "stable")
    c2 = await b.consumer("g", topics=["t"]).start()
    await eventually(lambda: seen.count("stable") >= 2)
    await c2.close()
    await c.close()
    await eventually(lambda: seen[-1] == "empty")
    stop.set()
    await watcher
    # The group row is born "empty" and the join moves it on at once; the watcher may see either first.
    assert seen[0] in ("empty", "preparing_rebalance") and "preparing_rebalance" in seen[:2]
    assert "rebalancing" in seen  # the second member's join moved partitions
    assert seen[-1] == "empty"
    assert all(s in ("empty", "preparing_rebalance", "rebalancing", "stable") for s in seen)


async def test_describe_reset_and_delete_group(connect, fast) -> None:
    b = await connect(**fast)
    await b.create_topic("t", partitions=2)
    for i in range(10):
        await b.publish("t", {"i": i}, partition=str(i % 2))
    async with b.consumer("g", topics=["t"], auto_commit=False) as c:
        await drain([c], 10)
        await c.commit()
        d = await b.admin.describe_group("g")
        assert d.total_lag == 0 and len(d.members) == 1 and d.leader == c.member_id
        assert {p.owner for p in d.partitions} == {c.member_id}
        try:
            await b.admin.reset_offsets("g", to="earliest")
            raise AssertionError("reset must be refused while members are live")
        except bus.GroupHasMembersError:
            pass
    plan = await b.admin.reset_offsets("g", to="earliest", dry_run=True)
    assert [(r.current, r.new) for r in plan] == [(5, 0), (5, 0)]
    assert (await b.admin.describe_group("g")).total_lag == 0  # dry run changed nothing
    await b.admin.reset_offsets("g", to=3)
    d = await b.admin.describe_group("g")
    assert [p.committed for p in d.partitions] == [3, 3] and d.total_lag == 4
    assert [g.name for g in await b.admin.list_groups()] == ["g"]
    await b.admin.delete_group("g")
    assert await b.admin.list_groups() == []


async def test_leaving_an_auto_commit_block_on_an_error_does_not_commit_the_batch_being_handled(
    connect, fast
) -> None:
    b = await connect(**fast)
    await b.create_topic("t", partitions=1)
    await b.publish_many("t", [bus.Outgoing({"i": i}) for i in range(6)])
    with pytest.raises(RuntimeError, match="handler failed"):
        async with b.consumer("g", topics=["t"], max_poll_records=3) as c:
            first = await drain([c], 3)
            assert [m.offset for m in first] == [0, 1, 2]
            second = await c.poll(timeout=5.0)  # commits 0..2 first (auto_commit)
            assert [m.offset for m in second] == [3, 4, 5]
            raise RuntimeError("handler failed")
    # 0..2 were committed by the second poll; 3..5 were being handled when the block failed.
    assert await b.pool.fetchval("SELECT committed FROM offsets WHERE group_name = 'g'") == 3
    async with b.consumer("g", topics=["t"]) as again:
        assert [m.offset for m in await drain([again], 3)] == [3, 4, 5]
