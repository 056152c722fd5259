"""Claims (Queen's pop): fenced leases, earliest pending partition first, labels."""

from __future__ import annotations

import asyncio

import pytest

import bus
from bus.testing import Clock
from tests.conftest import Connect, plan_modes


async def test_claim_returns_pending_messages_and_ack_advances_the_cursor(b: bus.Bus) -> None:
    await b.create_topic("orders", partitions=None)
    for i in range(3):
        await b.publish("orders", {"i": i}, partition="cust-1")
    c = await b.claim("billing", topic="orders", worker_id="w1", max_messages=2)
    assert c is not None and (c.topic, c.partition) == ("orders", "cust-1")
    assert [m.offset for m in c.messages] == [0, 1]
    await c.ack()
    c2 = await b.claim("billing", topic="orders", worker_id="w1")
    assert c2 is not None and [m.offset for m in c2.messages] == [2]
    await c2.ack()
    assert await b.claim("billing", topic="orders", worker_id="w1") is None


async def test_claim_returns_none_when_nothing_is_pending(b: bus.Bus) -> None:
    await b.create_topic("empty", partitions=4)
    assert await b.claim("g", topic="empty", worker_id="w") is None


async def test_claim_picks_partition_with_earliest_pending_message(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=None)
    await b.publish("t", b"old", partition="b")
    await b.publish("t", b"newer", partition="a")
    c = await b.claim("g", topic="t", worker_id="w")
    assert c is not None and c.partition == "b"


async def test_a_held_partition_is_not_claimed_by_another_worker(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=None)
    await b.publish("t", b"x", partition="p1")
    await b.publish("t", b"y", partition="p2")
    c1 = await b.claim("g", topic="t", worker_id="w1")
    c2 = await b.claim("g", topic="t", worker_id="w2")
    assert c1 is not None and c2 is not None
    assert {c1.partition, c2.partition} == {"p1", "p2"}
    assert await b.claim("g", topic="t", worker_id="w3") is None


async def test_concurrent_claims_never_share_a_partition(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=None)
    await b.publish_many("t", [bus.Outgoing(b"m", partition=f"p{i}") for i in range(20)])
    claims = await asyncio.gather(*(b.claim("g", topic="t", worker_id=f"w{i}") for i in range(30)))
    got = [c.partition for c in claims if c is not None]
    assert len(got) == 20 and len(set(got)) == 20


async def test_release_gives_the_same_messages_back(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=1)
    await b.publish("t", b"a")
    c = await b.claim("g", topic="t", worker_id="w1")
    assert c is not None
    assert await c.release() is True
    again = await b.claim("g", topic="t", worker_id="w2")
    assert again is not None and [m.payload for m in again.messages] == [b"a"]
    assert again.lease_epoch == c.lease_epoch + 1


async def test_expired_lease_lets_another_worker_take_it_and_fences_the_old_one(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=1)
    await b.publish("t", b"a")
    old = await b.claim("g", topic="t", worker_id="slow", lease_time=0.05)
    assert old is not None
    await asyncio.sleep(0.1)  # the lease must really expire on the server's clock
    new = await b.claim("g", topic="t", worker_id="fast")
    assert new is not None and new.messages[0].offset == 0
    with pytest.raises(bus.LeaseLostError):
        await old.ack()
    with pytest.raises(bus.LeaseLostError):
        await old.extend(10)
    await new.ack()
    assert await b.claim("g", topic="t", worker_id="fast") is None


async def test_ack_of_expired_but_not_retaken_lease_succeeds(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=1)
    await b.publish("t", b"a")
    c = await b.claim("g", topic="t", worker_id="w", lease_time=30)
    assert c is not None
    Clock(b).advance(31)  # run out, and nobody took it
    await c.ack()
    assert await b.claim("g", topic="t", worker_id="w") is None


async def test_extend_keeps_the_lease_from_others(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=1)
    await b.publish("t", b"a")
    c = await b.claim("g", topic="t", worker_id="w", lease_time=30)
    assert c is not None
    before = c.lease_expires_at
    await c.extend(60)
    assert c.lease_expires_at > before
    Clock(b).advance(31)  # past the lease it was taken with, not the extension
    assert await b.claim("g", topic="t", worker_id="other") is None


async def test_a_lease_run_out_on_the_moved_clock_goes_to_another_worker(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=1)
    await b.publish("t", b"a")
    old = await b.claim("g", topic="t", worker_id="w", lease_time=30)
    assert old is not None
    assert await b.claim("g", topic="t", worker_id="other") is None
    clock = Clock(b)
    clock.advance(31)  # past the lease: no sleeping for it
    new = await b.claim("g", topic="t", worker_id="other")
    assert new is not None and [m.offset for m in new.messages] == [0]
    assert new.lease_expires_at > old.lease_expires_at  # leased from the moved time on
    with pytest.raises(bus.LeaseLostError):
        await old.ack()
    await new.extend(5)
    clock.advance(10)  # an extension counts from the moved time too: run out again
    assert await b.claim("g", topic="t", worker_id="third") is not None


async def test_partial_ack_advances_up_to_and_including_the_offset(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=1)
    await b.publish_many("t", [b"0", b"1", b"2"])
    c = await b.claim("g", topic="t", worker_id="w")
    assert c is not None
    await c.ack(1)
    c2 = await b.claim("g", topic="t", worker_id="w")
    assert c2 is not None and [m.offset for m in c2.messages] == [2]


async def test_ack_outside_the_claimed_range_is_refused(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=1)
    await b.publish_many("t", [b"0", b"1"])
    c = await b.claim("g", topic="t", worker_id="w")
    assert c is not None
    with pytest.raises(bus.ValidationError):
        await c.ack(7)
    await c.release()
    again = await b.claim("g", topic="t", worker_id="w")
    assert again is not None and again.messages[0].offset == 0


async def test_publish_wakes_a_caught_up_partition(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=None)
    await b.publish("t", b"a", partition="p")
    c = await b.claim("g", topic="t", worker_id="w")
    assert c is not None
    await c.ack()
    assert await b.claim("g", topic="t", worker_id="w") is None
    await b.publish("t", b"b", partition="p")
    c = await b.claim("g", topic="t", worker_id="w")
    assert c is not None and [m.payload for m in c.messages] == [b"b"]


async def test_only_partitions_with_claim_cursors_run_the_wake_up(b: bus.Bus) -> None:
    """The wake-up trigger is skipped where no claim reads (a consumer group's cursor is not woken)."""
    await b.create_topic("t", partitions=None)
    await b.create_topic("g_only", partitions=1)
    await b.publish("t", b"a", partition="p")
    await b.publish("g_only", b"a")
    async with b.consumer("readers", topics=["g_only"]) as c:
        assert len(await c.poll(timeout=5)) == 1
        await c.commit()
    claimed = dict(await b.pool.fetch("SELECT topic, claimed FROM partitions"))
    assert claimed == {"t": False, "g_only": False}
    c2 = await b.claim("g", topic="t", worker_id="w")
    assert c2 is not None
    await c2.ack()
    claimed = dict(await b.pool.fetch("SELECT topic, claimed FROM partitions"))
    assert claimed == {"t": True, "g_only": False}
    pending = (
        "SELECT o.pending_since FROM offsets o JOIN partitions p ON p.id = o.partition_id WHERE p.topic = $1"
    )
    assert await b.pool.fetchval(pending, "g_only") is None
    await b.publish("g_only", b"b")
    await b.publish("t", b"b", partition="p")
    assert await b.pool.fetchval(pending, "g_only") is None  # no trigger ran there
    assert await b.pool.fetchval(pending, "t") is not None  # the claim cursor was woken


async def _ack_every_claim(b: bus.Bus) -> set[tuple[str, tuple[bytes | None, ...]]]:
    """Claim and ack until nothing is pending: (partition, payloads) of each claim."""
    got = set()
    while (c := await b.claim("g", topic="t", worker_id="w")) is not None:
        got.add((c.partition, tuple(m.payload for m in c.messages)))
        await c.ack()
    return got


async def test_one_publish_to_many_partitions_wakes_each_caught_up_one(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=None)
    names = ["p1", "p2", "p3"]
    await b.publish_many("t", [bus.Outgoing(b"a", partition=p) for p in names])
    await b.publish("t", b"x", partition="p4")
    assert await _ack_every_claim(b) == {(p, (b"a",)) for p in names} | {("p4", (b"x",))}
    # One statement bumps three partitions (and leaves a fourth alone): each of the three is pending again.
    await b.publish_many("t", [bus.Outgoing(b"b", partition=p) for p in names])
    assert await _ack_every_claim(b) == {(p, (b"b",)) for p in names}


async def test_claim_by_namespace_includes_topics_created_later(connect: Connect) -> None:
    b = await connect()
    await b.create_topic("q1", partitions=None, namespace="ns1")
    await b.publish("q1", b"m1", partition="p")
    c = await b.claim("g", namespace="ns1", worker_id="w")
    assert c is not None and c.topic == "q1"
    await c.ack()
    await b.create_topic("q2", partitions=None, namespace="ns1")
    await b.create_topic("other", partitions=None, namespace="ns2")
    await b.publish("other", b"no", partition="p")
    await b.publish("q2", b"m2", partition="p")
    # a second Bus has no cached discovery: it sees the new topic at once
    b2 = await connect()
    c = await b2.claim("g", namespace="ns1", worker_id="w")
    assert c is not None and (c.topic, [m.payload for m in c.messages]) == ("q2", [b"m2"])


async def test_a_successful_claim_marks_the_group_active(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=1)
    await b.publish_many("t", [b"a", b"b"])
    c = await b.claim("g", topic="t", worker_id="w", max_messages=1)
    assert c is not None
    await c.ack()
    await b.pool.execute("UPDATE groups SET last_active_at = now() - interval '1 hour'")
    assert await b.claim("g", topic="t", worker_id="w") is not None
    assert await b.pool.fetchval(
        "SELECT last_active_at > now() - interval '1 minute' FROM groups WHERE name = 'g'"
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"topic": "t", "worker_id": "bad name"},
        {"topic": "t", "worker_id": "w", "max_messages": 0},
        {"topic": "t", "worker_id": "w", "lease_time": -1},
        {"topic": "t", "worker_id": "w", "start": "sometime"},
        {"worker_id": "w"},
        {"topic": "t", "namespace": "x", "worker_id": "w"},
    ],
)
async def test_bad_claim_arguments_raise_validation_error_and_write_nothing(b: bus.Bus, kwargs: dict) -> None:
    await b.create_topic("t", partitions=1)
    with pytest.raises(bus.ValidationError):
        await b.claim("g", **kwargs)
    assert await b.pool.fetchval("SELECT count(*) FROM groups") == 0


async def test_claim_on_missing_topic_raises_topic_not_found(b: bus.Bus) -> None:
    with pytest.raises(bus.TopicNotFoundError):
        await b.claim("g", topic="nope", worker_id="w")


async def test_fan_out_every_group_gets_every_message(b: bus.Bus) -> None:
    await b.create_topic("events", partitions=None)
    await b.publish_many("events", [bus.Outgoing({"i": i}, partition=f"p{i % 5}") for i in range(50)])
    for group in ("g1", "g2", "g3"):
        got = []
        while (c := await b.claim(group, topic="events", worker_id="w", max_messages=7)) is not None:
            got.extend(m.value(dict)["i"] for m in c.messages)
            await c.ack()
        assert sorted(got) == list(range(50)), group
    # fan-out costs a cursor per (group, partition), never a row per message per group
    assert await b.pool.fetchval("SELECT count(*) FROM offsets") == 3 * 5


async def test_a_stopped_group_cannot_claim(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=1)
    await b.publish("t", b"x")
    await b.claim("g", topic="t", worker_id="w")
    await b.pool.execute("UPDATE groups SET status = 'stopped'")
    b2 = await bus.connect(b.dsn, schema=b.config.schema, cleaner_interval=0)
    try:
        with pytest.raises(bus.GroupStoppedError):
            await b2.claim("g", topic="t", worker_id="w")
    finally:
        await b2.close()


async def _lost_claim(b: bus.Bus) -> tuple[bus.Claim, bus.Claim]:
    """A claim whose lease expired and was taken by another worker (old, new)."""
    await b.create_topic("t", partitions=1)
    await b.publish_many("t", [b"a", b"b"])
    old = await b.claim("g", topic="t", worker_id="zombie", lease_time=30)
    assert old is not None
    Clock(b).advance(31)
    new = await b.claim("g", topic="t", worker_id="live")
    assert new is not None and new.messages[0].offset == 0
    return old, new


async def test_a_lost_claim_refuses_ack_every_time_after_extend_found_the_loss(b: bus.Bus) -> None:
    old, new = await _lost_claim(b)
    with pytest.raises(bus.LeaseLostError):
        await old.extend(10)
    for _ in range(2):  # a zombie's ack must never look like it succeeded
        with pytest.raises(bus.LeaseLostError):
            await old.ack()
    with pytest.raises(bus.LeaseLostError):
        await old.ack(0)
    with pytest.raises(bus.LeaseLostError):
        await old.extend(10)
    # nothing was applied: the new holder's lease and the cursor are untouched
    await new.extend(30)
    assert await b.pool.fetchval("SELECT committed FROM offsets") == 0
    await new.ack()
    assert await b.pool.fetchval("SELECT committed FROM offsets") == 2


async def test_a_lost_claim_refuses_release_every_time(b: bus.Bus) -> None:
    old, new = await _lost_claim(b)
    with pytest.raises(bus.LeaseLostError):
        await old.release()
    with pytest.raises(bus.LeaseLostError):
        await old.release()
    with pytest.raises(bus.LeaseLostError):
        await old.ack()
    # the new holder still holds the partition
    assert await b.claim("g", topic="t", worker_id="third") is None
    await new.ack()


async def test_a_lost_claim_refuses_extend_after_ack_found_the_loss(b: bus.Bus) -> None:
    old, new = await _lost_claim(b)
    with pytest.raises(bus.LeaseLostError):
        await old.ack()
    with pytest.raises(bus.LeaseLostError):
        await old.extend(10)
    with pytest.raises(bus.LeaseLostError):
        await old.release()
    await new.release()


async def test_a_claim_finished_by_its_own_ack_or_release_makes_a_second_one_a_no_op(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=None)
    await b.publish("t", b"a", partition="p1")
    await b.publish("t", b"b", partition="p2")
    acked = await b.claim("g", topic="t", worker_id="w")
    released = await b.claim("g", topic="t", worker_id="w")
    assert acked is not None and released is not None
    await acked.ack()
    await acked.ack()
    assert await acked.release() is True
    assert await released.release() is True
    assert await released.release() is True
    await released.ack()  # a released claim's ack is a no-op: its messages come back
    with pytest.raises(bus.LeaseLostError, match="already acked or released"):
        await acked.extend(10)
    again = await b.claim("g", topic="t", worker_id="w")
    assert again is not None and again.partition == released.partition


async def test_a_claim_reads_on_a_connection_with_generic_plans(
    b: bus.Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With the default plan_cache_mode, PostgreSQL re-plans the claim's read of the log on every
    # call once `messages` is large (its generic plan looks costlier on paper): 0.15 ms a claim.
    # The claim runs on a connection the Lender lends, whose plans are generic.
    from storage import claims as claim_sql

    await b.create_topic("t", partitions=1)
    await b.publish("t", b"x")
    modes = plan_modes(monkeypatch, claim_sql, "read_from")
    c = await b.claim("g", topic="t", worker_id="w")
    assert c is not None and [m.offset for m in c.messages] == [0]
    assert modes == ["force_generic_plan"]
