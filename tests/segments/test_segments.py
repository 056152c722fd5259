"""Segments (migration 007, storage/segments.py): whole-segment retirement, the DEFAULT partition, the sweep, the migration."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import asyncpg
import pytest

import bus
from storage import db, retention, segments
from tests.conftest import Connect
from tests.helpers import consume_claims

SHORT = timedelta(milliseconds=20)
WIDTH = 0.5  # seconds: segments close quickly in tests


async def _ensure(b: bus.Bus) -> list[str]:
    async with b.pool.acquire() as conn:
        return await segments.ensure(conn, width=WIDTH, ahead=3 * WIDTH, margin=0)


async def _retire(b: bus.Bus, grace: float = 3600.0) -> segments.Maintenance:
    async with b.pool.acquire() as conn:
        await retention.clean_some(conn, 0, max_partitions=1000, batch=100_000)
        return await segments.retire_and_drop(conn, grace=grace)


async def _leaf_of(b: bus.Bus, topic: str, offset: int) -> str:
    return str(
        await b.pool.fetchval(
            "SELECT m.tableoid::regclass::text FROM messages m JOIN partitions p ON p.id = m.partition_id "
            'WHERE p.topic = $1 AND m."offset" = $2',
            topic,
            offset,
        )
    )


async def _stored(b: bus.Bus) -> int:
    """Rows physically stored in `messages`, below the log start or not."""
    return int(await b.pool.fetchval("SELECT count(*) FROM messages"))


async def _wait_closed(b: bus.Bus, name: str) -> None:
    hi = await b.pool.fetchval("SELECT hi FROM message_segments WHERE name = $1", name)
    wait = await b.pool.fetchval("SELECT extract(epoch FROM $1 - clock_timestamp())::float8", hi)
    await asyncio.sleep(max(0.0, wait) + 0.01)


async def test_messages_is_partitioned_by_time_with_a_default_partition(b: bus.Bus) -> None:
    kind = await b.pool.fetchval(
        "SELECT partstrat::text FROM pg_partitioned_table WHERE partrelid = 'messages'::regclass"
    )
    assert kind == "r"
    leaves = {
        r[0] for r in await b.pool.fetch("SELECT relid::text FROM pg_partition_tree('messages') WHERE isleaf")
    }
    assert "messages_default" in leaves


async def test_publishes_land_in_the_segment_made_ahead_and_a_whole_retired_segment_is_dropped(
    connect: Connect,
) -> None:
    b = await connect(cleaner_interval=0)
    await b.create_topic("t", partitions=1, retention=SHORT)
    made = await _ensure(b)
    assert made
    await b.publish_many("t", [b"%d" % i for i in range(5)])
    seg = await _leaf_of(b, "t", 0)
    assert seg in made and await _leaf_of(b, "t", 4) == seg
    await consume_claims(b, "g", "t", 5)
    await _wait_closed(b, seg)
    done = await _retire(b)
    assert seg in done.retired and seg in done.dropped and done.swept_rows == 0
    assert await _stored(b) == 0
    assert await b.pool.fetchval("SELECT to_regclass($1)", seg) is None
    # offsets go on from where they were; nothing renumbered
    await _ensure(b)
    [m] = await b.publish_many("t", [b"5"])
    assert m.offset == 5
    assert [x.offset for x in await b.read("t", offset=5)] == [5]


async def test_retirement_leaves_no_dead_tuples(connect: Connect) -> None:
    b = await connect(cleaner_interval=0)
    await b.create_topic("t", partitions=1, retention=SHORT)
    await _ensure(b)
    await b.publish_many("t", [b"x"] * 200)
    seg = await _leaf_of(b, "t", 0)
    assert await _leaf_of(b, "t", 199) == seg
    await consume_claims(b, "g", "t", 200)
    await _wait_closed(b, seg)
    async with b.pool.acquire() as conn:
        await retention.clean_some(conn, 0, max_partitions=1000, batch=100_000)
        # retention itself is logical: nothing deleted row by row
        assert await conn.fetchval("SELECT count(*) FROM messages") == 200
        assert await conn.fetchval("SELECT message_segment_state($1)", seg) == "dead"
        async with conn.transaction():
            freed = await conn.fetchval(segments.RETIRE, seg)
            assert freed > 0
            # TRUNCATE: the heap is empty, not 200 dead tuples waiting for vacuum
            assert await conn.fetchval("SELECT pg_relation_size($1::regclass)", seg) == 0


async def test_a_live_group_behind_holds_the_segment_and_a_dead_one_does_not(connect: Connect) -> None:
    b = await connect(cleaner_interval=0)
    await b.create_topic("t", partitions=1, retention=SHORT)
    await _ensure(b)
    await b.publish_many("t", [b"%d" % i for i in range(4)])
    seg = await _leaf_of(b, "t", 0)
    await consume_claims(b, "fast", "t", 4)
    await consume_claims(b, "slow", "t", 1)
    await _wait_closed(b, seg)
    done = await _retire(b)
    assert seg not in done.retired and await _stored(b) == 4
    assert [m.offset for m in await b.read("t", offset=1)] == [1, 2, 3]
    await b.pool.execute("UPDATE groups SET status = 'dead' WHERE name = 'slow'")
    done = await _retire(b)
    assert seg in done.retired and await _stored(b) == 0


async def test_reading_below_the_log_start_is_out_of_range_while_the_rows_are_still_stored(
    connect: Connect,
) -> None:
    b = await connect(cleaner_interval=0)
    await b.create_topic("t", partitions=1, retention=SHORT)
    await _ensure(b)
    await b.publish_many("t", [b"%d" % i for i in range(3)])
    await consume_claims(b, "g", "t", 2)
    await asyncio.sleep(0.05)
    async with b.pool.acquire() as conn:
        assert await retention.clean_some(conn, 0, max_partitions=10, batch=100) == (0, 2)
    assert await _stored(b) == 3  # the segment is still open
    with pytest.raises(bus.OffsetOutOfRangeError):
        await b.read("t", offset=0)
    assert [m.offset for m in await b.read("t", offset=2)] == [2]
    [stats] = await b.admin.topic_stats("t")
    assert stats.size == 1 and stats.log_start == 2


async def test_rows_without_a_segment_go_to_the_default_partition_which_retires_whole(
    connect: Connect,
) -> None:
    b = await connect(cleaner_interval=0)
    await b.create_topic("t", partitions=1, retention=SHORT)
    await b.publish_many("t", [b"a", b"b"])
    assert await _leaf_of(b, "t", 0) == "messages_default"
    # a maintainer that starts later begins its segments after the newest DEFAULT row
    made = await _ensure(b)
    lo = await b.pool.fetchval("SELECT lo FROM message_segments WHERE name = $1", made[0])
    newest = await b.pool.fetchval("SELECT max(created_at) FROM messages_default")
    assert lo > newest
    await b.publish("t", b"c")
    assert await _leaf_of(b, "t", 2) == made[0]
    await consume_claims(b, "g", "t", 2)
    await asyncio.sleep(0.05)
    done = await _retire(b)
    assert "messages_default" in done.retired
    assert await _stored(b) == 1


async def test_a_segment_pinned_by_a_compact_topic_is_swept_after_the_grace(connect: Connect) -> None:
    b = await connect(cleaner_interval=0)
    await b.create_topic("t", partitions=1, retention=SHORT)
    await b.create_topic("c", partitions=1, cleanup="compact")
    await _ensure(b)
    async with b.pool.acquire() as conn, conn.transaction():  # one instant: one segment
        await conn.execute(
            'INSERT INTO messages (partition_id, "offset", key, payload, created_at)'
            " SELECT p.id, g, CASE WHEN p.topic = 'c' THEN 'k' END, 'x'::bytea, now() FROM partitions p,"
            " generate_series(0, CASE WHEN p.topic = 'c' THEN 0 ELSE 2 END) g"
        )
        await conn.execute("UPDATE partitions SET next_offset = CASE WHEN topic = 'c' THEN 1 ELSE 3 END")
    seg = await _leaf_of(b, "c", 0)
    assert seg.startswith("messages_2") and await _leaf_of(b, "t", 2) == seg
    await consume_claims(b, "g", "t", 3)
    await _wait_closed(b, seg)
    done = await _retire(b)  # grace not over: nothing is swept yet
    assert seg not in done.retired and done.swept_rows == 0 and await _stored(b) == 4
    done = await _retire(b, grace=0)
    assert done.swept_rows == 3 and seg not in done.retired
    assert await _stored(b) == 1
    assert [m.key for m in await b.read("c")] == ["k"]


async def test_maintain_makes_segments_only_for_delete_topics_with_a_retention(connect: Connect) -> None:
    b = await connect(cleaner_interval=0)
    await b.create_topic("forever", partitions=1)
    async with b.pool.acquire() as conn:
        assert (await segments.maintain(conn, interval=1.0)).created == []
        await b.create_topic("short", partitions=1, retention=timedelta(seconds=60))
        done = await segments.maintain(conn, interval=1.0)
        assert done.created
        segs = await segments.segments(conn)
        assert [x.name for x in segs][-len(done.created) :] == done.created
        now = await conn.fetchval("SELECT clock_timestamp()")
        assert segs[-1].hi >= now + timedelta(seconds=2 * segments.width_for(60, 60))


def test_segment_width_follows_the_retentions() -> None:
    assert segments.width_for(None, None) == segments.IDLE_WIDTH
    assert segments.width_for(60, 60) == 15
    assert segments.width_for(0.02, 0.02) == segments.MIN_WIDTH
    # a long retention beside a short one: at most SPAN segments hold it
    assert segments.width_for(60, 7 * 86_400) == 7 * 86_400 / segments.SPAN
    assert segments.width_for(30 * 86_400, 30 * 86_400) == segments.MAX_WIDTH


async def test_the_cleaner_actor_makes_segments_and_retires_them(connect: Connect) -> None:
    b = await connect(cleaner_interval=0.1)
    await b.create_topic("t", partitions=1, retention=SHORT)
    for _ in range(300):  # a segment made to catch up starts segments.CATCH_UP_MARGIN seconds later
        if await b.pool.fetchval(
            "SELECT count(*) FROM message_segments WHERE lo <= clock_timestamp() AND hi > clock_timestamp()"
        ):
            break
        await asyncio.sleep(0.05)
    await b.publish_many("t", [b"x"] * 3)
    seg = await _leaf_of(b, "t", 0)
    assert seg.startswith("messages_2"), await b.pool.fetch(
        "SELECT *, clock_timestamp() FROM message_segments"
    )
    await consume_claims(b, "g", "t", 3)
    for _ in range(300):  # the segment closes after MIN_WIDTH seconds at most, then retires on a tick
        if await b.pool.fetchval("SELECT to_regclass($1)", seg) is None:
            break
        await asyncio.sleep(0.05)
    assert await b.pool.fetchval("SELECT to_regclass($1)", seg) is None
    assert await _stored(b) == 0


@pytest.mark.fresh_schema  # made by the migrations before 007
async def test_the_migration_moves_existing_history_into_a_segment(
    dsn: str, schema: str, drop_schema: None
) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            await conn.execute(f'CREATE SCHEMA "{schema}"')  # generated test schema name
            await conn.execute(db.SET_LOCAL_SEARCH_PATH, db.search_path(schema))
            await conn.execute(
                "CREATE TABLE bus_migrations (version integer PRIMARY KEY, name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            )
            for version, name, sql in db.migrations():
                if version >= 7:
                    break
                await conn.execute(sql)
                await conn.execute(
                    "INSERT INTO bus_migrations (version, name) VALUES ($1, $2)", version, name
                )
            await conn.execute(
                "INSERT INTO topics (name, partitions, semantics, cleanup, max_message_bytes)"
                " VALUES ('old', 1, 'pubsub', 'delete', 1048576)"
            )
            pid = await conn.fetchval(
                "INSERT INTO partitions (topic, name, next_offset) VALUES ('old', '0', 3) RETURNING id"
            )
            await conn.execute(
                'INSERT INTO messages (partition_id, "offset", payload, created_at)'
                " SELECT $1, g, ('m' || g)::bytea, now() - interval '1 day' + g * interval '1 second'"
                " FROM generate_series(0, 2) g",
                pid,
            )
    finally:
        await conn.close()
    async with bus.connect(dsn, schema=schema, cleaner_interval=0) as b:
        assert [m.payload for m in await b.read("old")] == [b"m0", b"m1", b"m2"]
        first = await b.pool.fetchval("SELECT name FROM message_segments WHERE lo IS NULL")
        assert await _leaf_of(b, "old", 0) == first
        assert await b.pool.fetchval("SELECT to_regclass('messages_unsegmented')") is None
        [m] = await b.publish_many("old", [b"m3"])
        assert m.offset == 3


async def test_the_sweep_finds_rows_below_the_log_start_by_key_without_reading_the_whole_segment(
    connect: Connect,
) -> None:
    b = await connect(cleaner_interval=0)
    await b.create_topic("keep", partitions=2)  # no retention: its rows stay in the DEFAULT partition
    await b.create_topic("t", partitions=2, retention=SHORT)
    for _ in range(3):
        await b.publish_many("keep", [bus.Outgoing(b"x", partition=str(i % 2)) for i in range(1000)])
    await b.publish_many("t", [bus.Outgoing(b"y", partition=str(i % 2)) for i in range(10)])
    assert await _leaf_of(b, "keep", 0) == await _leaf_of(b, "t", 0) == "messages_default"
    async with b.pool.acquire() as conn:
        await conn.execute("ANALYZE messages_default")
        async with conn.transaction():
            # As retention would: partition "0" of t has its log start past 3 of its 5 rows.
            await conn.execute("UPDATE partitions SET log_start = 3 WHERE topic = 't' AND name = '0'")
            swept = await conn.fetchval(segments.SWEEP, "messages_default", 2)
            assert swept == 2  # the limit
            swept += await conn.fetchval(segments.SWEEP, "messages_default", 10_000)
            assert swept == 3
            assert await conn.fetchval(segments.SWEEP, "messages_default", 10_000) == 0
            scans = await conn.fetchrow(
                "SELECT seq_scan, idx_scan FROM pg_stat_xact_user_tables WHERE relid = 'messages_default'::regclass"
            )
            # Three sweeps read by key; none read the 3,010 rows of the segment.
            assert scans["seq_scan"] == 0 and scans["idx_scan"] > 0, dict(scans)
    rows = await b.pool.fetch(
        'SELECT p.name, m."offset" FROM messages m JOIN partitions p ON p.id = m.partition_id '
        "WHERE p.topic = 't' ORDER BY 1, 2"
    )
    assert [(r["name"], r["offset"]) for r in rows] == [("0", 3), ("0", 4)] + [("1", i) for i in range(5)]
    assert await _stored(b) == 3007
