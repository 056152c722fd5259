"""The HeartbeatMonitor writes one heartbeat statement per interval for all local members.

The Buses here beat every 30 s (or so) of their clock and the tests move it a
beat at a time (`Clock`, `Beats`): a beat comes when the test advances, never
in between, and a lease or session runs out without waiting for it.
"""

from __future__ import annotations

from collections.abc import Awaitable

import pytest

from bus.testing import Clock, eventually
from storage import membership
from tests.groups.heartbeats import Beats

# A beat every 30 s of the Bus's clock, a session of 100 s, leases of 120 s: far longer than a
# test, so only the test's advances bring beats and run sessions and leases out.
SLOW = {"heartbeat_interval": 30.0, "session_timeout": 100.0, "lease_time": 120.0}


async def test_one_heartbeat_statement_per_interval_covers_every_local_member(
    connect, fast, monkeypatch
) -> None:
    b = await connect(**{**fast, **SLOW})
    await b.create_topic("a", partitions=2)
    await b.create_topic("b", partitions=2)
    beats = Beats(monkeypatch)
    clock = Clock(b)
    consumers = [
        await b.consumer("g1", topics=["a"]).start(),
        await b.consumer("g1", topics=["a"]).start(),
        await b.consumer("g2", topics=["b"]).start(),
    ]
    await eventually(lambda: b.pool.fetchval("SELECT count(*) = 3 FROM members"))
    # Five intervals, five beats: each one statement carrying all three members.
    assert [len(await beats.after(clock, 30)) for _ in range(5)] == [3] * 5
    assert len(beats.calls) == 5
    for c in consumers:
        await c.close()


@pytest.mark.parametrize("n", [1])
async def test_heartbeats_keep_leases_alive_past_the_lease_time(connect, fast, monkeypatch, n) -> None:
    b = await connect(**{**fast, **SLOW, "lease_time": 40.0})
    await b.create_topic("t", partitions=n)
    beats = Beats(monkeypatch)
    clock = Clock(b)
    c = await b.consumer("g", topics=["t"]).start()
    await eventually(
        lambda: b.pool.fetchval("SELECT lease_epoch FROM offsets WHERE group_name='g' AND owner IS NOT NULL")
    )
    epoch = await b.pool.fetchval("SELECT lease_epoch FROM offsets WHERE group_name='g'")
    for _ in range(4):  # 120 s, three leases: only renewals keep it
        await beats.after(clock, 30)
    row = await b.pool.fetchrow(
        "SELECT lease_epoch, lease_expires_at > $1 AS live FROM offsets WHERE group_name='g'", clock.now()
    )
    assert row["live"] and row["lease_epoch"] == epoch
    await c.close()


async def test_heartbeats_go_on_while_every_pool_connection_is_held(connect, fast, monkeypatch) -> None:
    # A process whose pool is taken (workers, takeovers and rebalances of a large group on a small
    # pool, a busy machine) still beats on the monitor's own connection: another process's sweep
    # finds its members alive and the group does not rebalance.
    b = await connect(**{**fast, **SLOW}, pool_max_size=4)
    other = await connect(**{**fast, **SLOW})  # its sweep judges every group's members
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
    beats = Beats(monkeypatch)
    clock, others = Clock(b), Clock(other)
    try:
        assert held
        for _ in range(7):  # 210 s, two sessions with no pool connection
            others.advance(30)
            await beats.after(clock, 30)
        assert await other.admin.sweep() == 0  # judged by the moved time: b's member is alive
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
    connect, fast, monkeypatch
) -> None:
    # Rewriting every owned partition's cursor row at every beat is most of what a large idle group
    # would write; a lease is renewed once a quarter of it has run (here 30 s of 120), and stays live.
    b = await connect(**{**fast, **SLOW, "heartbeat_interval": 5.0})
    await b.create_topic("t", partitions=2)
    beats = Beats(monkeypatch)
    clock = Clock(b)
    c = await b.consumer("g", topics=["t"]).start()
    query = "SELECT array_agg(lease_expires_at ORDER BY partition_id) FROM offsets WHERE group_name='g'"
    await eventually(
        lambda: b.pool.fetchval("SELECT count(*) = 2 FROM offsets WHERE group_name='g' AND owner IS NOT NULL")
    )
    first = await b.pool.fetchval(query)
    for _ in range(4):  # four beats, 20 s: well inside the first quarter
        await beats.after(clock, 5)
    assert await b.pool.fetchval(query) == first
    for _ in range(3):  # 35 s: past it
        await beats.after(clock, 5)
    assert await _all_later(b, query, first)
    live = await b.pool.fetchval(
        "SELECT bool_and(lease_expires_at > $1::timestamptz + interval '100 seconds') FROM offsets "
        "WHERE group_name='g'",
        clock.now(),
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


async def test_a_lease_on_a_partition_no_longer_assigned_to_the_member_is_not_renewed(
    connect, fast, monkeypatch
) -> None:
    # A rebalance moved the partition away and the old owner's release failed (the database was
    # away): its heartbeats must not keep the lease, or the new owner never gets the partition.
    b = await connect(**{**fast, **SLOW, "lease_time": 40.0, "heartbeat_interval": 10.0})
    await b.create_topic("t", partitions=2)
    beats = Beats(monkeypatch)
    clock = Clock(b)
    c = await b.consumer("g", topics=["t"]).start()
    owned = "SELECT count(*) FROM offsets WHERE group_name = 'g' AND owner IS NOT NULL AND lease_expires_at > now()"
    await eventually(lambda: _equals(b.pool.fetchval(owned), 2))
    kept, moved = await b.pool.fetchval("SELECT array_agg(id ORDER BY id) FROM partitions WHERE topic = 't'")
    # The member's assignment as a rebalance writes it, before the member has heard of it.
    await b.pool.execute("UPDATE members SET assignment = ARRAY[$1::bigint] WHERE group_name = 'g'", kept)
    live = "SELECT coalesce(lease_expires_at > $2, false) FROM offsets WHERE group_name = 'g' AND partition_id = $1"
    for _ in range(5):  # 50 s, more than a lease: the moved one ran out, the kept one is still renewed
        await beats.after(clock, 10)
    assert await b.pool.fetchval(live, moved, clock.now()) is False
    assert await b.pool.fetchval(live, kept, clock.now())
    await c.close()


async def _equals(value: Awaitable[object], expected: object) -> bool:
    return await value == expected
