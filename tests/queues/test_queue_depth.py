"""admin.queue_depth: a queue's jobs to be done by state, per partition, not the log's size."""

from __future__ import annotations

from datetime import timedelta

import pytest

import bus


async def test_queue_depth_counts_waiting_running_delayed_and_dead_per_partition(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=2, semantics="queue")
    for i in range(4):
        await b.publish("jobs", {"i": i}, partition="0")
    for i in range(2):
        await b.publish("jobs", {"i": i}, partition="1")
    await b.publish("jobs", {"later": True}, partition="1", delay=timedelta(minutes=5))
    depth = await b.admin.queue_depth("jobs")
    assert (depth.waiting, depth.running, depth.delayed, depth.dead) == (6, 0, 1, 0)
    assert depth.dead_letter is None  # no jobs.dlq yet
    assert [(p.partition, p.waiting, p.delayed) for p in depth.partitions] == [("0", 4, 0), ("1", 2, 1)]

    async with b.queue_consumer("jobs", max_attempts=1, dead_letter="jobs.dlq") as q:
        jobs = await q.take(max_messages=10, timeout=2.0)
        assert len(jobs) == 6
        for job in jobs[:3]:
            await q.ack(job)
        poisoned = jobs[3]
        await q.nack(poisoned, error="bad")  # its last attempt: dead-lettered
        depth = await b.admin.queue_depth("jobs")
        assert (depth.waiting, depth.running, depth.delayed, depth.dead) == (0, 2, 1, 1)
        assert depth.dead_letter == "jobs.dlq"
        by_partition = {p.partition: p for p in depth.partitions}
        assert by_partition[poisoned.partition].dead == 1
        assert sum(p.running for p in depth.partitions) == 2
    # Closing gives the held jobs back: waiting again.
    depth = await b.admin.queue_depth("jobs")
    assert (depth.waiting, depth.running, depth.delayed, depth.dead) == (2, 0, 1, 1)
    # The log still stores every job; the depth counts only what is left to do.
    assert sum(s.size for s in await b.admin.topic_stats("jobs")) == 7


async def test_queue_depth_of_a_pubsub_topic_is_refused(b: bus.Bus) -> None:
    await b.create_topic("orders")
    with pytest.raises(bus.ValidationError, match="queue topic"):
        await b.admin.queue_depth("orders")
    with pytest.raises(bus.TopicNotFoundError):
        await b.admin.queue_depth("nope")
