"""Topics: create (fixed or dynamic partitions, labels, retention), idempotent re-create, conflicts, list, delete."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import asyncpg
import pytest

import bus
from bus.testing import eventually


async def test_fixed_topic_has_partitions_named_zero_to_n_minus_one(b: bus.Bus) -> None:
    info = await b.create_topic("orders", partitions=4)
    assert info.partitions == 4 and not info.dynamic
    names = await b.pool.fetch("SELECT name FROM partitions WHERE topic = 'orders' ORDER BY name")
    assert [r["name"] for r in names] == ["0", "1", "2", "3"]


async def test_topic_keeps_semantics_cleanup_retention_and_labels(b: bus.Bus) -> None:
    info = await b.create_topic(
        "jobs",
        partitions=2,
        semantics="queue",
        cleanup="compact",
        retention=timedelta(days=7),
        namespace="shop",
        task="billing",
    )
    assert (info.semantics, info.cleanup, info.retention) == ("queue", "compact", timedelta(days=7))
    assert (info.namespace, info.task) == ("shop", "billing")
    assert info.created_at is not None
    [listed] = await b.list_topics()
    assert listed == info


async def test_retention_accepts_seconds_and_none_means_forever(b: bus.Bus) -> None:
    assert (await b.create_topic("a", retention=3600)).retention == timedelta(hours=1)
    assert (await b.create_topic("b", retention=None)).retention is None


async def test_dynamic_topic_creates_named_partitions_on_first_publish(b: bus.Bus) -> None:
    info = await b.create_topic("devices", partitions=None)
    assert info.dynamic
    assert await b.pool.fetchval("SELECT count(*) FROM partitions WHERE topic = 'devices'") == 0
    rec = await b.publish("devices", b"on", partition="device-42")
    assert (rec.partition, rec.offset) == ("device-42", 0)
    await b.publish("devices", b"off", partition="customer:7")
    names = await b.pool.fetch("SELECT name FROM partitions WHERE topic = 'devices' ORDER BY name")
    assert [r["name"] for r in names] == ["customer:7", "device-42"]
    assert [m.payload for m in await b.read("devices", partition="device-42")] == [b"on"]


async def test_reading_an_unpublished_dynamic_partition_returns_nothing_and_creates_nothing(
    b: bus.Bus,
) -> None:
    await b.create_topic("devices", partitions=None)
    assert await b.read("devices", partition="never") == []
    assert await b.pool.fetchval("SELECT count(*) FROM partitions") == 0


async def test_creating_an_identical_topic_again_is_a_no_op(b: bus.Bus) -> None:
    first = await b.create_topic("orders", partitions=3, namespace="shop", retention=60)
    again = await b.create_topic("orders", partitions=3, namespace="shop", retention=timedelta(seconds=60))
    assert again == first
    assert await b.pool.fetchval("SELECT count(*) FROM partitions") == 3


async def test_creating_a_conflicting_topic_raises_and_changes_nothing(b: bus.Bus) -> None:
    first = await b.create_topic("orders", partitions=3)
    for change in (
        {"partitions": 4},
        {"partitions": None},
        {"semantics": "queue"},
        {"cleanup": "compact"},
        {"retention": 10},
        {"namespace": "shop"},
        {"task": "billing"},
    ):
        kwargs = {"partitions": 3, **change}
        with pytest.raises(bus.TopicConflictError, match="different configuration"):
            await b.create_topic("orders", **kwargs)
    assert await b.list_topics() == [first]
    assert await b.pool.fetchval("SELECT count(*) FROM partitions") == 3


async def test_conflict_is_detected_across_processes_sharing_a_schema(connect) -> None:  # type: ignore[no-untyped-def]
    one, two = await connect(), await connect()
    await one.create_topic("orders", partitions=2)
    with pytest.raises(bus.TopicConflictError):
        await two.create_topic("orders", partitions=5)


async def test_list_topics_filters_by_namespace_and_task(b: bus.Bus) -> None:
    await b.create_topic("a", namespace="shop", task="billing")
    await b.create_topic("b", namespace="shop", task="shipping")
    await b.create_topic("c", namespace="crm", task="billing")
    await b.create_topic("d")

    async def names(**kw: str) -> list[str]:
        return [t.name for t in await b.list_topics(**kw)]

    assert await names() == ["a", "b", "c", "d"]
    assert await names(namespace="shop") == ["a", "b"]
    assert await names(task="billing") == ["a", "c"]
    assert await names(namespace="shop", task="billing") == ["a"]
    assert await names(namespace="nothing") == []


async def test_delete_topic_removes_partitions_and_messages(b: bus.Bus) -> None:
    await b.create_topic("orders", partitions=2)
    await b.create_topic("kept", partitions=1)
    await b.publish_many("orders", [bus.Outgoing(b"x", partition=str(i % 2)) for i in range(6)])
    await b.publish("kept", b"stay")
    await b.delete_topic("orders")
    assert [t.name for t in await b.list_topics()] == ["kept"]
    assert await b.pool.fetchval("SELECT count(*) FROM partitions WHERE topic = 'orders'") == 0
    assert await b.pool.fetchval("SELECT count(*) FROM messages") == 1
    with pytest.raises(bus.TopicNotFoundError):
        await b.read("orders")
    with pytest.raises(bus.TopicNotFoundError):
        await b.publish("orders", b"x")


async def test_delete_of_an_unknown_topic_raises_topic_not_found(b: bus.Bus) -> None:
    with pytest.raises(bus.TopicNotFoundError, match="does not exist"):
        await b.delete_topic("ghost")


async def test_a_topic_deleted_and_recreated_elsewhere_is_seen_fresh(connect) -> None:  # type: ignore[no-untyped-def]
    one, two = await connect(), await connect()
    await one.create_topic("orders", partitions=1)
    await one.publish("orders", b"old")  # `one` now caches the topic and its partition id
    await two.delete_topic("orders")
    await two.create_topic("orders", partitions=1)
    rec = await one.publish("orders", b"new")
    assert rec.offset == 0
    assert [m.payload for m in await two.read("orders")] == [b"new"]


async def test_a_deletion_waits_for_a_publish_that_moved_a_head_instead_of_deadlocking_with_it(
    b: bus.Bus, dsn: str, schema: str
) -> None:
    # A publish moves its partition's head first and touches the partition row after (a queue
    # job's key check, a claimed partition's wake-up). A deletion that took the partition rows
    # first would then wait on the head while the publish waits on the partition row.
    await b.create_topic("orders", partitions=2)
    await b.publish("orders", b"x", partition="0")
    pid = await b.pool.fetchval("SELECT min(id) FROM partitions WHERE topic = 'orders'")
    publish = await asyncpg.connect(dsn, server_settings={"search_path": schema})
    try:
        async with publish.transaction():
            await publish.execute("UPDATE log_heads SET appends = appends WHERE partition_id = $1", pid)
            deleting = asyncio.ensure_future(b.delete_topic("orders"))
            blocker = publish.get_server_pid()
            await eventually(  # the deletion waits on the publish
                lambda: b.pool.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))", blocker
                ),
            )
            await publish.fetchval("SELECT id FROM partitions WHERE id = $1 FOR NO KEY UPDATE", pid)
        await deleting  # no deadlock was detected on either side
    finally:
        await publish.close()
    assert [t.name for t in await b.list_topics()] == []
