"""The HeartbeatMonitor writes one heartbeat statement per interval for all local members."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import pytest

from bus.testing import eventually
from storage import membership


async def test_one_heartbeat_statement_per_interval_covers_every_local_member(
    connect, fast, monkeypatch
) -> None:
    b = await connect(**fast)
    await b.create_topic("a", partitions=2)
    await b.create_topic("b", partitions=2)
    calls: list[list[str]] = []
    real = membership.heartbeat

    async def counting(conn, groups, members, lease_time, now=None):  # type: ignore[no-untyped-def]
        calls.append(list(members))
        return await real(conn, groups, members, lease_time, now)

    monkeypatch.setattr(membership, "heartbeat", counting)
    consumers = [
        await b.consumer("g1", topics=["a"]).start(),
        await b.consumer("g1", topics=["a"]).start(),
        await b.consumer("g2", topics=["b"]).start(),
    ]
    await eventually(lambda: calls and len(calls[-1]) == 3)
    start = len(calls)
    await asyncio.sleep(fast["heartbeat_interval"] * 5)
    beats = calls[start:]
    # about five beats (timing slack either way), each one statement carrying all three members
    assert 2 <= len(beats) <= 8
    assert all(len(members) == 3 for members in beats)
    for c in consumers:
        await c.close()


@pytest.mark.parametrize("n", [1])
async def test_heartbeats_keep_leases_alive_past_the_lease_time(connect, fast, n) -> None:
    b = await connect(**{**fast, "lease_time": 0.6})
    await b.create_topic("t", partitions=n)
    c = await b.consumer("g", topics=["t"]).start()
    await eventually(
        lambda: b.pool.fetchval("SELECT lease_epoch FROM offsets WHERE group_name='g' AND owner IS NOT NULL")
    )
    epoch = await b.pool.fetchval("SELECT lease_epoch FROM offsets WHERE group_name='g'")
    await asyncio.sleep(1.5)  # well past lease_time: only renewals keep it
    row = await b.pool.fetchrow(
        "SELECT lease_epoch, lease_expires_at > now() AS live FROM offsets WHERE group_name='g'"
    )
    assert row["live"] and row["lease_epoch"] == epoch
    await c.close()


async def test_heartbeats_go_on_while_every_pool_connection_is_held(connect, fast) -> None:
    # A process whose pool is taken (workers, takeovers and rebalances of a large group on a small
    # pool, a busy machine) still beats on the monitor's own connection: another process's sweep
    # finds its members alive and the group does not rebalance.
    b = await connect(**fast, pool_max_size=4)
    other = await connect(**fast)  # its monitor sweeps expired members of every group
    await b.create_topic("t", partitions=2)
    c = await b.consumer("g", topics=["t"]).start()
    await eventually(
        lambda: b.pool.fetchval("SELECT count(*) = 2 FROM offsets WHERE group_name='g' AND owner IS NOT NULL")
    )
    generation = await other.pool.fetchval("SELECT generation FROM groups WHERE name='g'")
    held = []
    try:
        while True:  # every connection the pool still has to give
            held.append(await b.pool.acquire(timeout=0.3))
    except TimeoutError:
        pass
    try:
        assert held
        await asyncio.sleep(fast["session_timeout"] * 2)  # two sessions with no pool connection
        row = await other.pool.fetchrow(
            "SELECT g.generation, (SELECT count(*) FROM members m WHERE m.group_name = g.name) AS members "
            "FROM groups g WHERE g.name = 'g'"
        )
    finally:
        for conn in held:
            await b.pool.release(conn)
    assert row["members"] == 1 and row["generation"] == generation
    await c.close()


async def test_a_heartbeat_renews_a_lease_once_a_quarter_of_it_has_run_not_at_every_beat(
    connect, fast
) -> None:
    # Rewriting every owned partition's cursor row at every beat is most of what a large idle group
    # would write; a lease is renewed once a quarter of it has run (here 5 s of 20), and stays live.
    b = await connect(**{**fast, "lease_time": 20.0})
    await b.create_topic("t", partitions=2)
    c = await b.consumer("g", topics=["t"]).start()
    query = "SELECT array_agg(lease_expires_at ORDER BY partition_id) FROM offsets WHERE group_name='g'"
    await eventually(
        lambda: b.pool.fetchval("SELECT count(*) = 2 FROM offsets WHERE group_name='g' AND owner IS NOT NULL")
    )
    first = await b.pool.fetchval(query)
    await asyncio.sleep(fast["heartbeat_interval"] * 4)  # four beats, well inside the first quarter
    assert await b.pool.fetchval(query) == first
    renewed = await eventually(
        lambda: _all_later(b, query, first),
        timeout=15.0,
    )
    assert renewed
    live = await b.pool.fetchval(
        "SELECT bool_and(lease_expires_at > clock_timestamp() + interval '10 seconds') FROM offsets WHERE group_name='g'"
    )
    assert live
    await c.close()


async def _all_later(b, query, first) -> bool:
    now = await b.pool.fetchval(query)
    return all(n > f for n, f in zip(now, first, strict=True))


async def test_a_heartbeat_renews_only_its_members_leases_and_finds_them_by_owner(connect, fast) -> None:
    # A group's cursors of 1,000 other members' partitions beside this member's two: the renewal
    # reads this member's cursors through the owner index (at 300 members a beat that scanned the
    # group's cursors once per member took ~20 ms) and renews only them.
    b = await connect(**{**fast, "lease_time": 8.0})
    await b.create_topic("t", partitions=2)
    await b.create_topic("big", partitions=1000)
    c = await b.consumer("g", topics=["t"]).start()
    await eventually(lambda: len(c.assignment()) == 2)
    await eventually(
        lambda: b.pool.fetchval(
            "SELECT count(*) = 2 FROM offsets WHERE group_name = 'g' AND owner IS NOT NULL"
        )
    )
    member = c.member_id
    assert member is not None
    await b.pool.execute(
        """INSERT INTO offsets (group_name, partition_id, committed, owner, lease_epoch, lease_expires_at)
           SELECT 'g', p.id, 0, 'other-' || (p.id % 300), 1, now() + interval '1 second'
           FROM partitions p WHERE p.topic = 'big'"""
    )
    # Every lease due for renewal: ours and the others'.
    await b.pool.execute(
        "UPDATE offsets SET lease_expires_at = now() + interval '1 second' WHERE group_name = 'g'"
    )
    await b.pool.execute("ANALYZE offsets")
    async with b.pool.acquire() as conn, conn.transaction():
        plan = "\n".join(
            r[0] for r in await conn.fetch("EXPLAIN " + membership.HEARTBEAT, ["g"], [member], 8.0, None)
        )
    assert "offsets_owner" in plan, plan
    await membership.heartbeat(b.pool, ["g"], [member], 8.0)
    renewed = await b.pool.fetch(
        "SELECT owner, lease_expires_at > now() + interval '5 seconds' AS renewed FROM offsets WHERE group_name = 'g'"
    )
    assert {r["renewed"] for r in renewed if r["owner"] == member} == {True}
    assert {r["renewed"] for r in renewed if r["owner"] != member} == {False}
    await c.close()


async def test_a_lease_on_a_partition_no_longer_assigned_to_the_member_is_not_renewed(connect, fast) -> None:
    # A rebalance moved the partition away and the old owner's release failed (the database was
    # away): its heartbeats must not keep the lease, or the new owner never gets the partition.
    b = await connect(**{**fast, "lease_time": 1.0})
    await b.create_topic("t", partitions=2)
    c = await b.consumer("g", topics=["t"]).start()
    owned = "SELECT count(*) FROM offsets WHERE group_name = 'g' AND owner IS NOT NULL AND lease_expires_at > now()"
    await eventually(lambda: _equals(b.pool.fetchval(owned), 2))
    kept, moved = await b.pool.fetchval("SELECT array_agg(id ORDER BY id) FROM partitions WHERE topic = 't'")
    # The member's assignment as a rebalance writes it, before the member has heard of it.
    await b.pool.execute("UPDATE members SET assignment = ARRAY[$1::bigint] WHERE group_name = 'g'", kept)
    live = "SELECT lease_expires_at > now() FROM offsets WHERE group_name = 'g' AND partition_id = $1"
    await eventually(lambda: _equals(b.pool.fetchval(live, moved), False), timeout=5.0)
    await asyncio.sleep(1.2)  # more than a lease: the kept one is still renewed
    assert await b.pool.fetchval(live, kept)
    await c.close()


async def _equals(value: Awaitable[object], expected: object) -> bool:
    return await value == expected
