"""The Producer actor: concurrent pool publishes coalesced into one write per flush."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import pytest

import bus
from bus.testing import eventually
from tests.conftest import Connect


@asynccontextmanager
async def _partitions_locked(
    dsn: str, schema: str, topic: str, only: str | None = None
) -> AsyncIterator[None]:
    """Hold the heads of the topic's partitions (or only partition `only`) locked, so a flush waits (and callers gather)."""
    conn = await asyncpg.connect(dsn, server_settings={"search_path": schema})
    try:
        tx = conn.transaction()
        await tx.start()
        await conn.execute(
            "SELECT h.partition_id FROM log_heads h JOIN partitions p ON p.id = h.partition_id "
            "WHERE p.topic = $1 AND ($2::text IS NULL OR p.name = $2) FOR UPDATE OF h",
            topic,
            only,
        )
        try:
            yield
        finally:
            await tx.rollback()
    finally:
        await conn.close()


async def test_concurrent_publishes_are_coalesced_in_call_order(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=1)
    stats = b.producer_stats
    recs = await asyncio.gather(*(b.publish("t", {"i": i}) for i in range(200)))
    # Each caller its own Record; per-partition order is call order; offsets dense.
    assert [r.offset for r in recs] == list(range(200))
    assert [m.value()["i"] for m in await b.read("t", max_messages=1000)] == list(range(200))  # type: ignore[index]
    assert stats.flushes < 200 and stats.largest_flush > 1


async def test_a_lone_publish_is_written_at_once(b: bus.Bus) -> None:
    await b.create_topic("t")
    before = b.producer_stats.flushes
    await b.publish("t", b"x")
    assert b.producer_stats.flushes == before + 1 and b.producer_stats.largest_flush == 1


async def test_publishes_gather_while_a_flush_is_in_flight(b: bus.Bus, dsn: str, schema: str) -> None:
    await b.create_topic("t", partitions=1)
    await b.publish("t", b"warm")
    stats = b.producer_stats
    async with _partitions_locked(dsn, schema, "t"):
        blocked = asyncio.create_task(b.publish("t", b"first"))
        await eventually(lambda: stats.pending_calls == 0)  # the first flush is in flight, waiting
        await asyncio.sleep(0.05)
        rest = [asyncio.create_task(b.publish("t", b"%d" % i)) for i in range(50)]
        await eventually(lambda: stats.pending_calls == 50)
        flushes = stats.flushes
    await blocked
    recs = await asyncio.gather(*rest)
    assert stats.flushes == flushes + 2  # the blocked one, then all fifty together
    assert stats.largest_flush == 50
    assert [r.offset for r in recs] == list(range(2, 52))


async def test_flushes_of_other_partitions_do_not_wait_and_a_partition_keeps_its_order(
    b: bus.Bus, dsn: str, schema: str
) -> None:
    await b.create_topic("t", partitions=3)
    for p in range(3):
        await b.publish("t", b"warm", partition=p)
    async with _partitions_locked(dsn, schema, "t", only="0"):
        stuck = asyncio.create_task(b.publish("t", b"a", partition=0))
        await asyncio.sleep(0.05)
        behind = asyncio.create_task(
            b.publish_many("t", [bus.Outgoing(b"b", partition="0"), bus.Outgoing(b"c", partition="1")])
        )
        await asyncio.sleep(0.05)
        # Partition 2 is free: its flush runs beside the stuck one. The call that shares partition 0
        # waits, so it cannot commit before the earlier one (nor can a later call on its partitions).
        free = await asyncio.wait_for(b.publish("t", b"d", partition=2), 5)
        assert free.offset == 1
        after = asyncio.create_task(b.publish("t", b"e", partition=1))
        await asyncio.sleep(0.1)
        assert not stuck.done() and not behind.done() and not after.done()
    assert (await stuck).offset == 1
    assert [r.offset for r in await behind] == [2, 1]
    assert (await after).offset == 2


async def test_offsets_become_visible_in_order_to_a_reader_racing_the_publishers(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=2)
    total = 600
    done = asyncio.Event()
    seen: dict[str, list[int]] = {"0": [], "1": []}

    async def reader() -> None:
        nxt = {"0": 0, "1": 0}
        while not done.is_set() or any(nxt[p] < total // 2 for p in nxt):
            for p in nxt:
                for m in await b.read("t", partition=p, offset=nxt[p]):
                    seen[p].append(m.offset)
                    nxt[p] = m.offset + 1
            await asyncio.sleep(0)

    async def publisher(w: int) -> None:
        for i in range(w, total, 16):
            await b.publish("t", b"x", partition=str(i % 2))

    task = asyncio.create_task(reader())
    await asyncio.gather(*(publisher(w) for w in range(16)))
    done.set()
    await asyncio.wait_for(task, 30)
    # A reader that moves past an offset never finds an earlier one appear later: no gaps, ever.
    assert seen == {"0": list(range(total // 2)), "1": list(range(total // 2))}


async def test_a_message_that_fails_validation_fails_alone(b: bus.Bus) -> None:
    await b.create_topic("t")
    results = await asyncio.gather(
        *(b.publish("t", {"bad": {1, 2}} if i == 5 else {"i": i}) for i in range(20)), return_exceptions=True
    )
    assert isinstance(results[5], bus.ValidationError)
    good = [r for r in results if isinstance(r, bus.Record)]
    assert len(good) == 19 and [r.offset for r in good] == list(range(19))


async def test_a_call_the_database_refuses_fails_alone_and_its_companions_are_written(
    b: bus.Bus, dsn: str, schema: str
) -> None:
    await b.create_topic("t")
    # A trigger refusing one payload: a database error only one call of a flush runs into.
    await b.pool.execute(
        """CREATE FUNCTION refuse_boom() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN IF NEW.payload = 'boom'::bytea THEN RAISE EXCEPTION 'refused'; END IF; RETURN NEW; END $$;
           CREATE TRIGGER refuse_boom BEFORE INSERT ON messages FOR EACH ROW EXECUTE FUNCTION refuse_boom()"""
    )
    async with _partitions_locked(dsn, schema, "t"):
        calls = [
            asyncio.create_task(
                b.publish_many("t", [b"a%d" % i, b"boom"]) if i == 3 else b.publish("t", b"ok%d" % i)
            )
            for i in range(10)
        ]
        await asyncio.sleep(0.2)
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert isinstance(results[3], asyncpg.RaiseError)
    oks = [r for i, r in enumerate(results) if i != 3]
    assert all(isinstance(r, bus.Record) for r in oks)
    stored = [m.payload for m in await b.read("t")]
    assert stored == [b"ok%d" % i for i in range(10) if i != 3]  # the refused call wrote nothing, not even a0
    assert [r.offset for r in oks] == list(range(9))  # type: ignore[union-attr]


async def test_a_flood_of_callers_is_back_pressured(connect: Connect, dsn: str, schema: str) -> None:
    b = await connect(max_batch=10)
    await b.create_topic("t")
    stats = b.producer_stats
    callers = 3000
    async with _partitions_locked(dsn, schema, "t"):
        tasks = [asyncio.create_task(b.publish("t", b"%d" % i)) for i in range(callers)]
        await asyncio.sleep(0.5)
        # Pending work is bounded (4 x max_batch in the actor, the mailbox's capacity in front of it);
        # everyone else waits in `tell`, holding only its own message.
        assert stats.pending_messages <= 40
        assert b._producer._cell.mailbox._items.__len__() <= 1000
        assert not any(t.done() for t in tasks)
    recs = await asyncio.gather(*tasks)
    assert [r.offset for r in recs] == list(range(callers))
    assert stats.peak_pending_messages <= 40
    assert stats.largest_flush <= 10


async def test_a_duplicate_key_inside_one_flush_gives_both_callers_the_one_record(
    b: bus.Bus, dsn: str, schema: str
) -> None:
    await b.create_topic("t", partitions=4)
    for p in range(4):  # partitions known: the calls reach the Producer in call order
        await b.publish("t", b"warm", partition=p)
    async with _partitions_locked(dsn, schema, "t"):
        first = asyncio.create_task(b.publish("t", b"first", partition="0", idempotency_key="k"))
        await asyncio.sleep(0.05)
        tasks = [
            asyncio.create_task(b.publish("t", b"a", partition="1", idempotency_key="k")),
            asyncio.create_task(b.publish("t", b"b", partition="2", idempotency_key="k2")),
            asyncio.create_task(
                b.publish_many("t", [bus.Outgoing(b"c", partition="3", idempotency_key="k2")])
            ),
            asyncio.create_task(b.publish("t", b"d", partition="2", idempotency_key="k2")),
        ]
        await asyncio.sleep(0.1)
    r0 = await first
    ra, rb, rc, rd = await asyncio.gather(*tasks)
    assert ra == r0 and r0.partition == "0"
    assert rb == rc[0] == rd and rb.partition == "2"
    assert b.producer_stats.largest_flush == 4
    assert [m.payload for m in await b.read("t", partition="2")] == [b"warm", b"b"]
    assert len(await b.read("t", partition="1")) == len(await b.read("t", partition="3")) == 1


async def test_a_flush_of_calls_to_two_topics_keeps_each_topics_idempotency_keys_apart(
    b: bus.Bus, dsn: str, schema: str
) -> None:
    await b.create_topic("a", partitions=2)
    await b.create_topic("c", partitions=1)
    for topic, p in (
        ("a", 0),
        ("a", 1),
        ("c", 0),
    ):  # partitions known: the calls reach the Producer in call order
        await b.publish(topic, b"warm", partition=p)
    async with _partitions_locked(dsn, schema, "a"), _partitions_locked(dsn, schema, "c"):
        first = asyncio.create_task(b.publish("a", b"first", partition=0))
        await asyncio.sleep(0.05)
        tasks = [
            asyncio.create_task(b.publish("a", b"plain", partition=1)),
            asyncio.create_task(b.publish("a", b"x", partition=1, idempotency_key="k")),
            asyncio.create_task(b.publish("c", b"y", idempotency_key="k")),
            asyncio.create_task(b.publish("a", b"x again", partition=1, idempotency_key="k")),
        ]
        await asyncio.sleep(0.1)
    await first
    plain, ka, kc, again = await asyncio.gather(*tasks)
    assert b.producer_stats.largest_flush == 4  # the four calls went as one batch
    assert again == ka and (ka.topic, ka.offset) == ("a", 2) and (kc.topic, kc.offset) == ("c", 1)
    assert plain.offset == 1
    assert [m.payload for m in await b.read("a", partition="1")] == [b"warm", b"plain", b"x"]
    assert [m.payload for m in await b.read("c")] == [b"warm", b"y"]


async def test_linger_waits_for_companions(connect: Connect) -> None:
    b = await connect(linger=0.2)
    await b.create_topic("t")
    first = asyncio.create_task(b.publish("t", b"1"))
    await asyncio.sleep(0.05)
    second = asyncio.create_task(b.publish("t", b"2"))
    await asyncio.gather(first, second)
    assert b.producer_stats.flushes == 1 and b.producer_stats.largest_flush == 2


async def test_the_outbox_path_does_not_go_through_the_producer(b: bus.Bus, dsn: str, schema: str) -> None:
    await b.create_topic("t")
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            await b.publish("t", b"x", connection=conn)
            await b.publish_many("t", [b"y"], connection=conn)
    finally:
        await conn.close()
    assert b.producer_stats.flushes == 0
    assert [m.payload for m in await b.read("t")] == [b"x", b"y"]


async def test_one_wake_up_per_flush(b: bus.Bus, dsn: str, schema: str) -> None:
    await b.create_topic("t")
    got: list[str] = []
    listener = await asyncpg.connect(dsn)
    try:
        await listener.add_listener(b.channels.messages, lambda *args: got.append(args[3]))
        async with _partitions_locked(dsn, schema, "t"):
            tasks = [asyncio.create_task(b.publish("t", b"%d" % i)) for i in range(30)]
            await asyncio.sleep(0.1)
        await asyncio.gather(*tasks)
        await eventually(lambda: len(got) >= 1)
        await asyncio.sleep(0.3)
        # Thirty messages, two flushes: one wake-up each at most (the Announcer may merge the two).
        assert 1 <= len(got) <= 2, got
    finally:
        await listener.close()


@pytest.mark.parametrize("kwargs", [{"max_batch": 0}, {"linger": -1}, {"max_batch_bytes": 10}])
async def test_bad_producer_settings_are_refused(connect: Connect, kwargs: dict[str, Any]) -> None:
    with pytest.raises(bus.ValidationError, match="max_batch|linger"):
        await connect(**kwargs)


async def test_a_topic_deleted_elsewhere_fails_only_its_callers(connect: Connect) -> None:
    b = await connect()
    other = await connect()
    await b.create_topic("gone", partitions=2)
    await b.create_topic("kept")
    await b.publish("gone", b"x", partition=0)
    await b.publish("gone", b"x", partition=1)
    await other.delete_topic("gone")
    results = await asyncio.gather(
        b.publish("gone", b"y", partition=0),
        b.publish_many("gone", [bus.Outgoing(b"y", partition="0"), bus.Outgoing(b"y", partition="1")]),
        b.publish("kept", b"z"),
        return_exceptions=True,
    )
    assert isinstance(results[0], bus.TopicNotFoundError)
    assert isinstance(results[1], bus.TopicNotFoundError)
    assert isinstance(results[2], bus.Record)
    # Created again (elsewhere): the next publish finds the new partitions.
    await other.create_topic("gone", partitions=2)
    assert (await b.publish("gone", b"again", partition=0)).offset == 0


async def test_a_lone_flush_notifies_with_its_commit_and_side_by_side_flushes_through_the_announcer(
    b: bus.Bus, dsn: str, schema: str
) -> None:
    await b.create_topic("t", partitions=2)
    await b.publish("t", b"warm", partition="0")  # the Producer's first connection is open
    got: list[tuple[int, str]] = []
    listener = await asyncpg.connect(dsn)
    try:
        await listener.add_listener(
            b.channels.messages, lambda _c, pid, _ch, payload: got.append((pid, payload))
        )
        rows = await b.pool.fetch("SELECT id::text, name FROM partitions WHERE topic = $1", "t")
        ids = {r[1]: r[0] for r in rows}
        # Alone: the NOTIFY is part of the flush's own statement (sent by the Producer's backend).
        await b.publish("t", b"alone", partition="0")
        await eventually(lambda: len(got) == 1)
        assert got[0] == (got[0][0], ids["0"]) and got[0][0] in b.producer_stats.server_pids
        got.clear()
        # Partition 0's flush waits on a lock; partition 1's flush runs beside it, so its
        # wake-up comes from the Announcer (notifying commits would serialize), after its commit.
        async with _partitions_locked(dsn, schema, "t", only="0"):
            first = asyncio.create_task(b.publish("t", b"held", partition="0"))
            await asyncio.sleep(0.2)
            await b.publish("t", b"beside", partition="1")
            await eventually(lambda: len(got) == 1)
            pid, payload = got[0]
            assert payload == ids["1"] and pid not in b.producer_stats.server_pids
        await first
        await eventually(lambda: len(got) == 2)
        assert got[1][1] == ids["0"] and got[1][0] in b.producer_stats.server_pids
    finally:
        await listener.close()


async def test_flushes_whose_callers_all_gave_up_free_their_slots(b: bus.Bus, dsn: str, schema: str) -> None:
    """A flush of calls whose callers were all cancelled ends before its first wait: its slot is free again.

    More such flushes than the Producer has slots (4): a slot that stayed taken would leave
    the last publish waiting for ever.
    """
    await b.create_topic("t", partitions=1)
    await b.publish("t", b"warm")
    stats = b.producer_stats
    for _ in range(6):
        async with _partitions_locked(dsn, schema, "t"):
            blocked = asyncio.create_task(b.publish("t", b"kept"))
            await asyncio.sleep(0.05)  # its flush is out, waiting on the lock
            gave_up = [asyncio.create_task(b.publish("t", b"dropped")) for _ in range(5)]
            await eventually(lambda: stats.pending_calls == 5)
            for task in gave_up:
                task.cancel()
            await asyncio.gather(*gave_up, return_exceptions=True)
        await blocked
    last = await asyncio.wait_for(b.publish("t", b"last"), 5)
    assert last.offset == 7  # warm, six kept, then this one: the dropped calls wrote nothing
    assert [m.payload for m in await b.read("t", max_messages=100)] == [b"warm"] + [b"kept"] * 6 + [b"last"]


async def test_an_outbox_publish_on_a_repeatable_read_snapshot_behind_the_log_fails_and_writes_nothing(
    b: bus.Bus, dsn: str
) -> None:
    # The offset comes from the partition's counter: a snapshot older than another publisher's
    # commit cannot reuse that publisher's offset, its update of the counter is refused instead.
    await b.create_topic("t")
    await b.publish("t", b"first")
    conn = await asyncpg.connect(dsn)
    try:
        for isolation in ("repeatable_read", "serializable"):
            tx = conn.transaction(isolation=isolation)
            await tx.start()
            assert await conn.fetchval("SELECT 1") == 1  # the transaction's snapshot is taken here
            await b.publish("t", b"committed after that snapshot")
            with pytest.raises(asyncpg.SerializationError):
                await b.publish("t", b"from the old snapshot", connection=conn)
            await tx.rollback()
        async with conn.transaction(isolation="repeatable_read"):  # a snapshot not behind: it goes in
            rec = await b.publish("t", b"repeatable read", connection=conn)
    finally:
        await conn.close()
    assert rec.offset == 3
    assert [m.offset for m in await b.read("t")] == [0, 1, 2, 3]
    assert (await b.read("t"))[-1].payload == b"repeatable read"
