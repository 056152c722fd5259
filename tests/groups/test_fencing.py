"""Invariants 2, 3 and 4: fenced commits, one owner, offsets never backwards."""

from __future__ import annotations

import pytest

import bus
from bus.testing import eventually
from storage import leases
from tests.helpers import drain


async def test_commit_including_a_partition_that_moved_raises_and_applies_nothing(connect, fast) -> None:
    b = await connect(**fast)
    await b.create_topic("t", partitions=2)
    for i in range(20):
        await b.publish("t", {"i": i}, partition=str(i % 2))
    a = await b.consumer("g", topics=["t"], auto_commit=False, assignor="sticky").start()
    await eventually(lambda: len(a.assignment()) == 2)
    got = await drain([a], 20)
    assert len(got) == 20
    before = dict(await b.pool.fetch("SELECT partition_id, committed FROM offsets WHERE group_name='g'"))
    # A second member takes one partition away (its lease moves on once `a` releases it).
    c2 = await b.consumer("g", topics=["t"], auto_commit=False, assignor="sticky").start()
    await eventually(lambda: len(c2.assignment()) == 1 and len(a.assignment()) == 1)
    await eventually(
        lambda: b.pool.fetchval(
            "SELECT count(*) FROM offsets WHERE group_name='g' AND owner=$1", c2.member_id
        )
    )
    with pytest.raises(bus.StaleGenerationError):
        await a.commit()
    after = dict(await b.pool.fetch("SELECT partition_id, committed FROM offsets WHERE group_name='g'"))
    assert after == before  # nothing applied, not even the partition `a` still owns
    await a.close()
    await c2.close()


async def test_zombie_with_an_old_epoch_can_neither_commit_nor_fetch(connect, fast) -> None:
    b = await connect(**fast)
    await b.create_topic("t", partitions=1)
    await b.publish("t", b"x", partition="0")
    c = await b.consumer("g", topics=["t"]).start()
    await eventually(lambda: b.pool.fetchval("SELECT owner FROM offsets WHERE group_name='g'"))
    row = await b.pool.fetchrow("SELECT partition_id, owner, lease_epoch FROM offsets WHERE group_name='g'")
    pid, owner, epoch = row["partition_id"], row["owner"], row["lease_epoch"]
    # The lease moves on (as after a pause past the session): epoch + 1 for someone else.
    await b.pool.execute(
        "UPDATE offsets SET owner='someone-else', lease_epoch=lease_epoch+1 WHERE group_name='g'"
    )
    async with b.pool.acquire() as conn:
        assert await leases.commit(conn, "g", owner, [(pid, 1, epoch)]) == set()
    assert await leases.fetch(b.pool, "g", pid, owner, epoch, 0, 10) == []
    assert await b.pool.fetchval("SELECT committed FROM offsets WHERE group_name='g'") == 0
    await c.close()


async def test_expired_lease_cannot_commit_even_if_nobody_took_it(connect, fast) -> None:
    b = await connect(**fast)
    await b.create_topic("t", partitions=1)
    c = await b.consumer("g", topics=["t"]).start()
    await eventually(lambda: b.pool.fetchval("SELECT owner FROM offsets WHERE group_name='g'"))
    row = await b.pool.fetchrow("SELECT partition_id, owner, lease_epoch FROM offsets WHERE group_name='g'")
    await b.pool.execute(
        "UPDATE offsets SET lease_expires_at = now() - interval '1 second' WHERE group_name='g'"
    )
    async with b.pool.acquire() as conn:
        assert (
            await leases.commit(conn, "g", row["owner"], [(row["partition_id"], 1, row["lease_epoch"])])
            == set()
        )
    await c.close()


async def test_committed_offsets_never_move_backwards(connect, fast) -> None:
    b = await connect(**fast)
    await b.create_topic("t", partitions=1)
    for i in range(10):
        await b.publish("t", {"i": i})
    c = await b.consumer("g", topics=["t"], auto_commit=False).start()
    await drain([c], 10)
    await c.commit()
    row = await b.pool.fetchrow(
        "SELECT partition_id, owner, lease_epoch, committed FROM offsets WHERE group_name='g'"
    )
    assert row["committed"] == 10
    async with b.pool.acquire() as conn:
        await leases.commit(conn, "g", row["owner"], [(row["partition_id"], 3, row["lease_epoch"])])
    assert await b.pool.fetchval("SELECT committed FROM offsets WHERE group_name='g'") == 10
    await c.close()


async def test_a_live_lease_cannot_be_taken_by_another_member_until_released_or_expired(
    connect, fast
) -> None:
    """Invariant 4: ownership moves only after the old lease is released or has expired, even when the
    other member is already assigned the partition (as during a handover)."""
    b = await connect(**fast)
    await b.create_topic("t", partitions=2)
    a = await b.consumer("g", topics=["t"], auto_commit=False, assignor="sticky").start()
    c = await b.consumer("g", topics=["t"], auto_commit=False, assignor="sticky").start()
    await eventually(lambda: len(a.assignment()) == 1 and len(c.assignment()) == 1)
    await eventually(
        lambda: b.pool.fetchval("SELECT count(*) FROM offsets WHERE group_name='g' AND owner=$1", a.member_id)
    )
    row = await b.pool.fetchrow(
        "SELECT partition_id, lease_epoch FROM offsets WHERE group_name='g' AND owner=$1", a.member_id
    )
    pid, epoch = row["partition_id"], row["lease_epoch"]
    # `c` is (wrongly, or mid-handover) assigned a's partition too: the live lease still wins.
    await b.pool.execute(
        "UPDATE members SET assignment = array_append(assignment, $2::bigint) WHERE member_id = $1",
        c.member_id,
        pid,
    )
    assert await leases.acquire(b.pool, "g", pid, c.member_id, c.generation, 5.0) is None
    assert (
        await b.pool.fetchval("SELECT owner FROM offsets WHERE group_name='g' AND partition_id=$1", pid)
        == a.member_id
    )
    # Once the lease has expired it may move, with a new fencing epoch; the old owner's commit is refused.
    await b.pool.execute(
        "UPDATE offsets SET lease_expires_at = clock_timestamp() - interval '1 second' "
        "WHERE group_name='g' AND partition_id=$1",
        pid,
    )
    taken = await leases.acquire(b.pool, "g", pid, c.member_id, c.generation, 5.0)
    assert taken is not None and taken[0] > epoch
    async with b.pool.acquire() as conn:
        assert await leases.commit(conn, "g", a.member_id, [(pid, 1, epoch)]) == set()
    await a.close()
    await c.close()


async def test_a_consumer_commit_after_seeking_back_never_moves_the_committed_offset_backwards(
    connect, fast
) -> None:
    """Invariant 2 on the consumer's own commit statement: only an admin reset moves an offset back."""
    b = await connect(**fast)
    await b.create_topic("t", partitions=1)
    await b.publish_many("t", [bus.Outgoing({"i": i}) for i in range(10)])
    c = await b.consumer("g", topics=["t"], auto_commit=False).start()
    assert len(await drain([c], 10)) == 10
    await c.commit()
    assert await b.pool.fetchval("SELECT committed FROM offsets WHERE group_name='g'") == 10
    await c.seek(bus.TopicPartition("t", "0"), 0)
    again = await drain([c], 1)
    assert again and again[0].offset == 0
    await c.commit()  # positions 1.. after a seek back: the stored offset stays where it was
    assert await b.pool.fetchval("SELECT committed FROM offsets WHERE group_name='g'") == 10
    await c.close()
