"""Retention by watermark (invariant 7), the cleaner actor, dead groups, force_complete."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import bus
from actors.cleaner import CleanNow
from storage import retention
from tests.conftest import Connect
from tests.helpers import consume_claims, log_start

SHORT = timedelta(milliseconds=20)


async def _clean(b: bus.Bus) -> int:
    async with b.pool.acquire() as conn:
        _, deleted = await retention.clean_some(conn, 0, max_partitions=1000, batch=100_000)
    return deleted


async def _offsets(b: bus.Bus, topic: str = "t") -> list[int]:
    return [m.offset for m in await b.read(topic, partition="0", offset=await log_start(b, topic))]


async def test_retention_removes_what_every_group_consumed_once_retention_passed(connect: Connect) -> None:
    b = await connect(cleaner_interval=0)
    await b.create_topic("t", partitions=1, retention=SHORT)
    await b.publish_many("t", [b"%d" % i for i in range(5)])
    await consume_claims(b, "g", "t", 3)
    await asyncio.sleep(0.05)
    assert await _clean(b) == 3
    assert await log_start(b, "t") == 3
    assert await _offsets(b) == [3, 4]


async def test_retention_never_removes_at_or_above_the_low_watermark(connect: Connect) -> None:
    b = await connect(cleaner_interval=0)
    await b.create_topic("t", partitions=1, retention=SHORT)
    await b.publish_many("t", [b"%d" % i for i in range(5)])
    await consume_claims(b, "fast", "t", 4)
    await consume_claims(b, "slow", "t", 1)
    await asyncio.sleep(0.05)
    await _clean(b)
    assert await _offsets(b) == [1, 2, 3, 4]
    c = await b.claim("slow", topic="t", worker_id="w")
    assert c is not None and c.messages[0].offset == 1


async def test_retention_keeps_messages_younger_than_the_topic_retention(connect: Connect) -> None:
    b = await connect(cleaner_interval=0)
    await b.create_topic("t", partitions=1, retention=timedelta(hours=1))
    await b.publish_many("t", [b"a", b"b"])
    await consume_claims(b, "g", "t", 2)
    assert await _clean(b) == 0
    assert await _offsets(b) == [0, 1]


async def test_a_group_committing_backwards_is_not_robbed_by_a_concurrent_clean(connect: Connect) -> None:
    b = await connect(cleaner_interval=0)
    await b.create_topic("t", partitions=1, retention=SHORT)
    await b.publish_many("t", [b"%d" % i for i in range(4)])
    await consume_claims(b, "g", "t", 4)
    await asyncio.sleep(0.05)
    admin = await b.pool.acquire()
    try:
        tx = admin.transaction()
        await tx.start()
        await admin.execute("UPDATE offsets SET committed = 1 WHERE group_name = 'g'")  # admin-style reset
        cleaning = asyncio.create_task(_clean(b))
        await asyncio.sleep(0.2)
        assert not cleaning.done()  # waits for the cursor's lock
        await tx.commit()
        assert await cleaning == 1
    finally:
        await b.pool.release(admin)
    assert await _offsets(b) == [1, 2, 3]


async def test_a_late_earliest_group_holds_retention_from_when_it_joins(connect: Connect) -> None:
    b = await connect(cleaner_interval=0)
    await b.create_topic("t", partitions=1, retention=SHORT)
    await b.publish_many("t", [b"%d" % i for i in range(3)])
    await consume_claims(b, "early", "t", 3)
    assert await b.claim("late", topic="t", worker_id="w", start="earliest", max_messages=1) is not None
    await asyncio.sleep(0.05)
    assert await _clean(b) == 0
    assert await _offsets(b) == [0, 1, 2]


async def test_a_live_group_without_a_cursor_on_a_partition_holds_it(connect: Connect) -> None:
    b = await connect(cleaner_interval=0)
    await b.create_topic("t", partitions=1, retention=SHORT)
    await b.publish("t", b"x")
    await b.claim("g", topic="t", worker_id="w")  # cursor at 0, lease held
    await b.pool.execute("DELETE FROM offsets")  # a group that reads the topic, cursor not yet made
    await asyncio.sleep(0.05)
    assert await _clean(b) == 0


async def test_queue_messages_are_removed_only_once_acked(connect: Connect) -> None:
    b = await connect(cleaner_interval=0)
    await b.create_topic("jobs", partitions=1, semantics="queue", retention=SHORT)
    await b.publish_many("jobs", [b"a", b"b", b"c"])
    async with b.queue_consumer("jobs") as q:
        a, bb, c = await q.take(max_messages=3, timeout=0)
        await q.ack(a)
        await q.ack(c)
        await asyncio.sleep(0.05)
        assert await _clean(b) == 1  # b is not acked: it and everything after stay
        assert await _offsets(b, "jobs") == [1, 2]
        await q.ack(bb)
    assert await _clean(b) == 2


async def test_dead_group_stops_holding_retention_and_resumes_from_the_log_start(connect: Connect) -> None:
    b = await connect(cleaner_interval=0)
    await b.create_topic("t", partitions=1, retention=SHORT)
    await b.publish_many("t", [b"%d" % i for i in range(4)])
    await consume_claims(b, "idle", "t", 1)
    await consume_claims(b, "busy", "t", 4)
    await asyncio.sleep(0.05)
    assert await _clean(b) == 1  # idle still holds 1..3
    await b.pool.execute("UPDATE groups SET last_active_at = now() - interval '1 hour' WHERE name = 'idle'")
    assert await retention.mark_dead_groups(b.pool, 60.0) == ["idle"]
    assert await _clean(b) == 3
    await b.publish("t", b"4")
    # the dead group comes back: revived, its cursor lifted to the log start
    b2 = await connect(cleaner_interval=0)
    c = await b2.claim("idle", topic="t", worker_id="w")
    assert c is not None and [m.offset for m in c.messages] == [4]
    assert await b.pool.fetchval("SELECT status FROM groups WHERE name = 'idle'") == "active"


async def test_groups_with_live_claims_or_recent_activity_are_not_marked_dead(connect: Connect) -> None:
    b = await connect(cleaner_interval=0)
    await b.create_topic("t", partitions=1)
    await b.publish("t", b"x")
    assert await b.claim("holder", topic="t", worker_id="w", lease_time=60) is not None
    await b.claim("recent", topic="t", worker_id="w")
    await b.pool.execute("UPDATE groups SET last_active_at = now() - interval '1 hour' WHERE name = 'holder'")
    assert await retention.mark_dead_groups(b.pool, 60.0) == []


async def test_force_complete_removes_orphans_held_only_by_dead_groups(connect: Connect) -> None:
    b = await connect(cleaner_interval=0)
    await b.create_topic("t", partitions=1)  # no retention: kept until forced
    await b.publish_many("t", [b"%d" % i for i in range(3)])
    await consume_claims(b, "gone", "t", 1)
    await consume_claims(b, "live", "t", 2)
    await b.pool.execute("UPDATE groups SET status = 'dead' WHERE name = 'gone'")
    await asyncio.sleep(0.05)
    async with b.pool.acquire() as conn:
        assert await retention.force_complete(conn, "t", 0.01) == 2
        assert await retention.force_complete(conn, "t", 0.01) == 0
    assert await _offsets(b) == [2]


async def test_the_cleaner_actor_deletes_on_its_ticks(connect: Connect) -> None:
    b = await connect(cleaner_interval=0.05)
    await b.create_topic("t", partitions=1, retention=SHORT)
    await b.publish_many("t", [b"a", b"b"])
    await consume_claims(b, "g", "t", 2)
    for _ in range(100):
        if await log_start(b, "t") == 2:
            break
        await asyncio.sleep(0.05)
    assert await log_start(b, "t") == 2
    assert b._cleaner is not None
    assert await b._cleaner.ask(CleanNow()) == 0


async def test_cleaner_work_per_pass_is_bounded(connect: Connect) -> None:
    b = await connect(cleaner_interval=0)
    await b.create_topic("t", partitions=1, retention=SHORT)
    await b.publish_many("t", [b"x"] * 50)
    await consume_claims(b, "g", "t", 50)
    await asyncio.sleep(0.05)
    async with b.pool.acquire() as conn:
        _, deleted = await retention.clean_some(conn, 0, max_partitions=10, batch=20)
    assert deleted == 20 and await log_start(b, "t") == 20


async def test_a_pass_works_out_watermarks_only_for_the_partitions_of_topics_with_retention(
    connect: Connect,
) -> None:
    # A partition's watermark reads its first queue job, and a snapshot held elsewhere keeps every
    # job acked since it began in front of it: a pass must not read them for topics it cannot trim.
    b = await connect(cleaner_interval=0)
    await b.create_topic("jobs", partitions=2, semantics="queue")
    await b.create_topic("t", partitions=3, retention=SHORT)
    await b.publish_many("jobs", [{"n": i} for i in range(10)])
    await b.publish_many("t", [b"x"] * 30)
    await asyncio.sleep(0.05)
    async with b.pool.acquire() as conn, conn.transaction():  # pg_stat_xact_user_tables: this transaction's
        after, deleted = await retention.clean_some(conn, 0, max_partitions=2, batch=100)
        reads = await conn.fetchval(
            "SELECT idx_tup_fetch + seq_tup_read FROM pg_stat_xact_user_tables"
            " WHERE schemaname = current_schema() AND relname = 'queue_jobs'"
        )
        first_two = await conn.fetchval(
            "SELECT (array_agg(id ORDER BY id))[2] FROM partitions WHERE topic = 't'"
        )
    assert reads in (0, None)  # the retention topic's partitions have no jobs; the queue's were not read
    assert after == first_two and deleted > 0  # two of the retention topic's partitions, then on from there
    async with b.pool.acquire() as conn:
        assert await retention.clean_some(conn, after, max_partitions=2, batch=100) == (0, 30 - deleted)


async def test_a_queue_without_retention_retires_acked_jobs_once_their_result_expired(
    connect: Connect,
) -> None:
    b = await connect(cleaner_interval=0)
    await b.create_topic("jobs", partitions=1, semantics="queue", result_ttl=0.05)  # no retention=
    await b.create_topic("kept", partitions=1, semantics="queue")  # the default result_ttl: one day
    await b.publish_many("jobs", [b"a", b"b", b"c"])
    await b.publish_many("kept", [b"a"])
    async with b.queue_consumer("jobs") as q, b.queue_consumer("kept") as k:
        a, bb, c = await q.take(max_messages=3, timeout=0)
        await q.ack(a)
        await q.ack(c)
        await k.ack_many(await k.take(max_messages=1, timeout=0))
        await asyncio.sleep(0.1)
        assert await _clean(b) == 1  # b is still to be done: it and everything after stay
        assert await _offsets(b, "jobs") == [1, 2]
        await q.ack(bb)
    assert await _clean(b) == 2
    assert await _offsets(b, "jobs") == []
    assert await _offsets(b, "kept") == [0]  # acked, but its result (one day) has not expired
