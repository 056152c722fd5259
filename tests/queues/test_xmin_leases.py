"""A queue take leaves the partition's row alone: no lock on it, so no MultiXact beside its publishers.

The publishers of a partition update its row (the offset counter) on every
publish; a take that locked the same row (the lease row's foreign key did,
FOR KEY SHARE) turned each version's xmax into a MultiXact, and a snapshot
held open anywhere kept all of those versions for every later publish to
walk. Migration 017 keeps the cascade of the key with a trigger instead.
"""

from __future__ import annotations

import asyncio

import bus


async def test_a_take_of_fresh_jobs_does_not_wait_for_a_lock_on_the_partition_row(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish_many("jobs", [bus.Outgoing({"n": i}) for i in range(5)])
    async with b.pool.acquire() as holder, holder.transaction():
        # The strongest row lock: a take that locked the row in any mode would wait for this transaction.
        await holder.execute("SELECT 1 FROM partitions WHERE topic = 'jobs' FOR UPDATE")
        async with b.queue_consumer("jobs") as q:
            got = await asyncio.wait_for(q.take(max_messages=5, timeout=0), 5.0)
            assert [m.offset for m in got] == [0, 1, 2, 3, 4]
            assert await b.pool.fetchval("SELECT count(*) FROM queue_leases") == 1
            await q.ack_many(got)


async def test_deleting_a_queue_topic_deletes_its_leases(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=2, semantics="queue")
    await b.create_topic("other", partitions=1, semantics="queue")
    await b.publish_many("jobs", [bus.Outgoing({"n": i}, partition=str(i % 2)) for i in range(6)])
    await b.publish("other", {"n": 0})
    async with b.queue_consumer("jobs") as q, b.queue_consumer("other") as o:
        assert len(await q.take(max_messages=6, timeout=0)) == 6
        assert len(await o.take(max_messages=1, timeout=0)) == 1
        assert await b.pool.fetchval("SELECT count(*) FROM queue_leases WHERE topic = 'jobs'") == 2
        await b.delete_topic("jobs")
        assert await b.pool.fetchval("SELECT count(*) FROM queue_leases WHERE topic = 'jobs'") == 0
        # Other topics' leases stay.
        assert await b.pool.fetchval("SELECT count(*) FROM queue_leases WHERE topic = 'other'") == 1
