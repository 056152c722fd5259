"""A queue take's scan for range leases that ran out starts at its consumer's bound (ExpiryBound).

Below the bound every lease was reclaimed, so the scan does not visit the
leases acks deleted there, which a snapshot held open elsewhere keeps in the
index. The bound must never keep a lease that ran out from being reclaimed
for long: a lease a take locked and then let go is found by the periodic
full scan, and one another take wrote just before the scan (committing just
after it) lies above the bound by the margin.
"""

from __future__ import annotations

import itertools
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

import bus
from bus import queue_expiry
from bus.queues import _writer_of
from bus.testing import Clock
from storage import db
from storage import queues as queue_sql


class _Ticks:
    """The clock of an ExpiryBound's full scans, moved by hand."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


async def _server_now(conn: asyncpg.Connection) -> datetime:
    value: datetime = await conn.fetchval("SELECT clock_timestamp()")
    return value


# The range leases that still hold a job (a lease stays in its slot, holding nothing, once its
# jobs are acked or detached: migration 033).
HOLDING = """SELECT first_offset, last_offset FROM queue_leases l WHERE EXISTS (
    SELECT 1 FROM queue_jobs j WHERE j.partition_id = l.partition_id AND NOT j.detached
      AND j."offset" BETWEEN l.first_offset AND l.last_offset)"""


async def _leases(conn: asyncpg.Connection) -> list[tuple[int, int]]:
    rows = await conn.fetch(HOLDING + " ORDER BY first_offset")
    return [(r[0], r[1]) for r in rows]


async def test_a_lease_that_ran_out_is_reclaimed_by_a_bounded_take(b: bus.Bus, dsn: str, schema: str) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish_many("jobs", [b"a", b"b", b"c"])
    conn = await db.connect(dsn, schema)
    try:
        t0 = await _server_now(conn) - timedelta(seconds=60)
        expiry = queue_expiry.ExpiryBound(clock=_Ticks())
        assert expiry.for_take(t0) is None  # the first take scans fully
        first = await queue_sql.take(conn, "jobs", 1, 30.0, "one", ordered=False, now=t0, expiry=expiry)
        assert [j[queue_sql.OFFSET] for j in first] == [0]
        # It reclaimed nothing: the bound moved to the time it judged by, less the margin.
        assert expiry.bound == t0 - queue_expiry.EXPIRY_MARGIN
        second = await queue_sql.take(conn, "jobs", 1, 30.0, "two", ordered=False, now=t0, expiry=expiry)
        assert [j[queue_sql.OFFSET] for j in second] == [1]
        assert await _leases(conn) == [(0, 0), (1, 1)]
        later = t0 + timedelta(seconds=31)
        bound = expiry.for_take(later)
        assert bound is not None and bound <= t0  # a bounded scan, not a full one
        # Both leases ran out: the take reclaims them and hands their jobs out again, with the next.
        got = await queue_sql.take(conn, "jobs", 10, 30.0, "three", ordered=False, now=later, expiry=expiry)
        assert sorted((j[queue_sql.OFFSET], j[queue_sql.ATTEMPTS]) for j in got) == [(0, 2), (1, 2), (2, 1)]
        assert await _leases(conn) == [(2, 2)]
        assert expiry.bound == later - queue_expiry.EXPIRY_MARGIN
    finally:
        await conn.close()


@pytest.mark.parametrize(
    ("ordered", "limited"),
    [(True, False), (False, True), (True, True)],
    ids=["ordered", "within-limits", "limited-ordered"],
)
async def test_ordered_and_limited_takes_reclaim_from_the_bound_and_move_it(
    b: bus.Bus, dsn: str, schema: str, ordered: bool, limited: bool
) -> None:
    rate = {"rate_limit": bus.Rate(100, per=60.0)} if limited else {}
    await b.create_topic("jobs", partitions=1, semantics="queue", **rate)
    await b.publish_many("jobs", [b"a", b"b"])
    conn = await db.connect(dsn, schema)
    try:
        t0 = await _server_now(
            conn
        )  # not earlier: the jobs an ordered take detaches are visible from their publish
        # A plain take leases job 0 by range.
        (plain,) = await queue_sql.take(conn, "jobs", 1, 30.0, "plain", ordered=False, now=t0)
        assert plain[queue_sql.OFFSET] == 0 and plain[queue_sql.LEASE_ID] is not None
        assert await _leases(conn) == [(0, 0)]
        expiry = queue_expiry.ExpiryBound(clock=_Ticks())
        limited_topics: set[str] = set()

        async def take(n: int, now: datetime) -> list[Any]:
            (rows,) = await queue_sql.take_for(
                conn,
                "jobs",
                ["ours"],
                [n],
                30.0,
                ordered=ordered,
                limited_topics=limited_topics,
                now=now,
                expiry=expiry,
            )
            return rows

        (first,) = await take(1, t0)
        assert first[queue_sql.OFFSET] == 1
        assert expiry.bound == t0 - queue_expiry.EXPIRY_MARGIN
        assert ("jobs" in limited_topics) == limited
        later = t0 + timedelta(seconds=31)
        assert expiry.for_take(later) is not None
        again = await take(10, later)
        # (A limited ordered take hands out what it reclaimed on the next call.)
        again += await take(10, later)
        assert sorted((j[queue_sql.OFFSET], j[queue_sql.ATTEMPTS]) for j in again) == [(0, 2), (1, 2)]
        assert await _leases(conn) == []
        # Moved by that take's report: to the server's time at its start (before `later`), less the margin.
        assert t0 - queue_expiry.EXPIRY_MARGIN < expiry.bound < later - queue_expiry.EXPIRY_MARGIN
    finally:
        await conn.close()


async def test_a_lease_a_take_locked_and_let_go_below_the_bound_is_reclaimed_by_the_full_scan(
    b: bus.Bus, dsn: str, schema: str
) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish_many("jobs", [b"a", b"b"])
    conn = await db.connect(dsn, schema)
    holder = await db.connect(dsn, schema)
    try:
        t0 = await _server_now(conn) - timedelta(seconds=60)
        (job,) = await queue_sql.take(conn, "jobs", 1, 1.0, "gone", ordered=False, now=t0)
        assert job[queue_sql.OFFSET] == 0
        ticks = _Ticks()
        expiry = queue_expiry.ExpiryBound(full_every=10.0, clock=ticks)
        # Another take locked the run-out lease (SKIP LOCKED: ours passes over it), then rolls back.
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SELECT 1 FROM queue_leases FOR UPDATE")
        now = t0 + timedelta(seconds=30)
        got = await queue_sql.take(conn, "jobs", 10, 30.0, "ours", ordered=False, now=now, expiry=expiry)
        assert [j[queue_sql.OFFSET] for j in got] == [1]
        await tx.rollback()
        assert expiry.bound is not None and expiry.bound > t0 + timedelta(seconds=1)  # above that lease's end
        # Bounded scans do not see it until the next full scan...
        ticks.t = 9.0
        assert expiry.for_take(now) is not None
        assert (
            await queue_sql.take(conn, "jobs", 10, 30.0, "ours", ordered=False, now=now, expiry=expiry) == []
        )
        assert await _leases(conn) == [(0, 0), (1, 1)]
        # ...which reclaims it.
        ticks.t = 10.0
        assert expiry.for_take(now) is None
        back = await queue_sql.take(conn, "jobs", 10, 30.0, "ours", ordered=False, now=now, expiry=expiry)
        assert [(j[queue_sql.OFFSET], j[queue_sql.ATTEMPTS]) for j in back] == [(0, 2)]
        assert await _leases(conn) == [(1, 1)]
        # A full scan that left nothing behind: bounded again for the next period.
        assert expiry.for_take(now) is not None
    finally:
        await holder.close()
        await conn.close()


async def test_a_lease_written_before_the_scan_and_committed_after_it_is_not_hidden_by_the_bound(
    b: bus.Bus, dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await b.create_topic("jobs", partitions=2, semantics="queue")
    await b.publish_many("jobs", [bus.Outgoing(b"a", partition="0"), bus.Outgoing(b"b", partition="1")])
    conn = await db.connect(dsn, schema)
    holder = await db.connect(dsn, schema)
    try:
        first, second = sorted(await conn.fetch("SELECT id, name FROM partitions WHERE topic = 'jobs'"))
        assert (first["name"], second["name"]) == ("0", "1")
        t0 = await _server_now(conn) - timedelta(seconds=60)
        expiry = queue_expiry.ExpiryBound(clock=_Ticks())
        # A slow take: it writes its lease on partition 0 (judged at t0, a 0.1 s timeout) and
        # commits only after our scan below, whose snapshot therefore does not see the lease.
        tx = holder.transaction()
        await tx.start()
        monkeypatch.setattr(queue_sql, "_turns", itertools.repeat(1))  # partition 0 first
        (held,) = await queue_sql.take(holder, "jobs", 1, 0.1, "slow", ordered=False, now=t0)
        assert held[queue_sql.PARTITION_ID] == first["id"]
        # Ours judges 1.5 s later than the slow one wrote: its lease (ending at t0 + 0.1 s) has run
        # out by then, but this scan cannot see it. (It takes from partition 1: the slow take
        # holds partition 0's frontier.)
        monkeypatch.setattr(queue_sql, "_turns", itertools.repeat(0))
        scanned_at = t0 + timedelta(seconds=1.5)
        got = await queue_sql.take(
            conn, "jobs", 1, 30.0, "ours", ordered=False, now=scanned_at, expiry=expiry
        )
        assert [j[queue_sql.PARTITION_ID] for j in got] == [second["id"]]
        await tx.commit()
        assert expiry.bound == scanned_at - queue_expiry.EXPIRY_MARGIN
        # The next take, bounded, reclaims it: the margin put the bound below its end.
        later = scanned_at + timedelta(seconds=1)
        assert expiry.for_take(later) is not None
        back = await queue_sql.take(conn, "jobs", 10, 30.0, "ours", ordered=False, now=later, expiry=expiry)
        assert [(j[queue_sql.PARTITION_ID], j[queue_sql.ATTEMPTS]) for j in back] == [(first["id"], 2)]
    finally:
        await holder.close()
        await conn.close()


async def test_a_bound_judged_ahead_of_the_server_clock_does_not_hide_a_lease_written_by_it(
    b: bus.Bus, dsn: str, schema: str
) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish_many("jobs", [b"a", b"b"])
    conn = await db.connect(dsn, schema)
    try:
        ahead = await _server_now(conn) + timedelta(seconds=100)
        expiry = queue_expiry.ExpiryBound(clock=_Ticks())
        # Our takes judge by a clock moved ahead (a test's Clock); another taker keeps the
        # server's and leases a job for 1 s.
        (ours,) = await queue_sql.take(conn, "jobs", 1, 30.0, "ours", ordered=False, now=ahead, expiry=expiry)
        assert ours[queue_sql.OFFSET] == 0
        assert expiry.bound is not None and expiry.bound < ahead - timedelta(seconds=90)
        (real,) = await queue_sql.take(conn, "jobs", 1, 1.0, "real", ordered=False)
        assert real[queue_sql.OFFSET] == 1
        # By our clock that lease runs out long ago, and a bounded take reclaims it.
        assert expiry.for_take(ahead) is not None
        got = await queue_sql.take(conn, "jobs", 10, 30.0, "ours", ordered=False, now=ahead, expiry=expiry)
        assert [(j[queue_sql.OFFSET], j[queue_sql.ATTEMPTS]) for j in got] == [(1, 2)]
        # A judged time back below the bound (a clock reset) scans fully again.
        assert expiry.bound is not None
        assert expiry.for_take(expiry.bound - timedelta(seconds=1)) is None
        assert expiry.bound is None
    finally:
        await conn.close()


async def test_a_consumer_reclaims_a_lease_past_its_bound_by_the_bus_clock(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=2, semantics="queue")
    await b.publish_many("jobs", [bus.Outgoing({"n": i}, partition=str(i % 2)) for i in range(4)])
    async with b.queue_consumer("jobs", visibility_timeout=5) as q:
        first = await q.take(max_messages=4, timeout=0)
        assert len(first) == 4
        expiry = _writer_of(b.context).expiry("jobs")
        assert expiry.bound is not None  # the first take scanned fully and set it
        clock = Clock(b)
        # Past the leases, not past the bound's next full scan (its period runs on the Bus's clock too).
        clock.advance(6)
        assert expiry.for_take(clock.now()) is not None
        # Nothing visible now but leases that ran out: the idle wait finds them from the bound on.
        until = await queue_sql.seconds_until_visible(b.pool, "jobs", clock.now(), expiry)
        assert until is not None and until <= 0
        again = await q.take(max_messages=10, timeout=0)
        assert sorted((m.value(dict)["n"], m.attempt) for m in again) == [(0, 2), (1, 2), (2, 2), (3, 2)]
        await q.ack_many(again)
    assert await b.pool.fetch(HOLDING) == []


def _buffers(plan: Any, relation: str) -> tuple[int, int]:
    """(buffers, scans): summed over the plan's scans of `relation`."""
    buffers = scans = 0
    stack = [plan]
    while stack:
        node = stack.pop()
        if str(node.get("Relation Name", "")).startswith(relation):  # a table or its partitions
            buffers += node["Shared Hit Blocks"] + node["Shared Read Blocks"]
            scans += 1
        stack.extend(node.get("Plans", []))
    return buffers, scans


async def _explain(conn: asyncpg.Connection, statement: str, *args: Any) -> Any:
    text = await conn.fetchval("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement, *args)
    return json.loads(text)[0]["Plan"]


async def test_with_a_snapshot_held_a_bounded_scan_skips_the_leases_acks_deleted(
    b: bus.Bus, dsn: str, schema: str
) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish_many("jobs", [b"a"])
    conn = await db.connect(dsn, schema)
    report = await db.connect(dsn, schema)
    try:
        await conn.execute(db.GENERIC_PLANS)  # as the Bus's own connections plan
        expiry = queue_expiry.ExpiryBound(clock=_Ticks())
        (job,) = await queue_sql.take(conn, "jobs", 1, 30.0, "live", ordered=False, expiry=expiry)
        bound = expiry.bound
        assert bound is not None
        # A report holds its snapshot; behind it, 3,000 leases that ran out before the bound are
        # deleted (acked), and nothing may prune them.
        tx = report.transaction(isolation="repeatable_read")
        await tx.start()
        await report.fetchval("SELECT count(*) FROM queue_leases")
        await conn.execute(
            """
            WITH i AS (
                INSERT INTO queue_leases (topic, partition_id, first_offset, last_offset, leased_by, visible_at)
                SELECT 'jobs', $1, 1000 + g, 1000 + g, 'acked', $2::timestamptz - g * interval '10 ms'
                FROM generate_series(1, 3000) AS g
                RETURNING id
            )
            SELECT count(*) FROM i
            """,
            job[queue_sql.PARTITION_ID],
            bound - timedelta(seconds=1),
        )
        # The heap pages they take, each of which a scan through them reads.
        pages = await conn.fetchval(
            "SELECT count(DISTINCT (ctid::text::point)[0]) FROM queue_leases WHERE leased_by = 'acked'"
        )
        await conn.execute("DELETE FROM queue_leases WHERE leased_by = 'acked'")
        try:
            take = ["jobs", [1], 30.0, ["t"], 1, 0, None]
            full, full_scans = _buffers(await _explain(conn, queue_sql.TAKE, *take, None), "queue_leases")
            bounded, bounded_scans = _buffers(
                await _explain(conn, queue_sql.TAKE, *take, bound), "queue_leases"
            )
            assert full_scans == bounded_scans >= 1
            # The full scan visits every deleted lease's heap tuple; the bounded one starts past them.
            assert full >= pages >= 10, (pages, full, bounded)
            assert bounded * 10 <= full, (pages, full, bounded)
            until_full, _ = _buffers(
                await _explain(conn, queue_sql.SECONDS_UNTIL_VISIBLE, "jobs", None, None, None, True),
                "queue_leases",
            )
            until_bounded, _ = _buffers(
                await _explain(conn, queue_sql.SECONDS_UNTIL_VISIBLE, "jobs", None, bound, None, True),
                "queue_leases",
            )
            # (each slot of the lease table costs the bounded look an index probe of its own)
            assert until_full >= pages and until_bounded + pages <= until_full, (
                pages,
                until_full,
                until_bounded,
            )
            # Both see the same live lease.
            at = await _server_now(conn)
            until = [
                (await conn.fetchrow(queue_sql.SECONDS_UNTIL_VISIBLE, "jobs", at, x, None, True))[1]
                for x in (None, bound)
            ]
            assert until[0] == until[1] and 29 < until[0] <= 30
        finally:
            await tx.rollback()
    finally:
        await report.close()
        await conn.close()


def test_takes_judged_within_a_quarter_second_of_the_last_scan_skip_theirs() -> None:
    ticks = _Ticks()
    expiry = queue_expiry.ExpiryBound(clock=ticks)
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    assert expiry.for_take(t0) is None  # the first: full
    expiry.scanned(None, 0, t0)
    bound = expiry.bound
    assert bound == t0 - queue_expiry.EXPIRY_MARGIN
    # Judged by the test's clock: 0.1 s on, no scan; 0.25 s on, a scan from the bound.
    assert expiry.for_take(t0 + timedelta(seconds=0.1)) == queue_expiry.SKIP_SCAN
    assert expiry.for_take(t0 + queue_expiry.EXPIRY_SCAN_EVERY) == bound
    # A skipped scan reports nothing that moves the bound.
    expiry.scanned(queue_expiry.SKIP_SCAN, 0, t0 + timedelta(seconds=5))
    assert expiry.bound == bound
    # Judged by the server's clock: as far on as the bound's own clock moved.
    ticks.t = 0.1
    assert expiry.for_take(None) == queue_expiry.SKIP_SCAN
    ticks.t = 0.3
    assert expiry.for_take(None) == bound
    # A scan that may have left leases behind is followed by another at once.
    expiry.scanned(bound, queue_sql.EXPIRY_BATCH, t0 + timedelta(seconds=0.3))
    assert expiry.for_take(t0 + timedelta(seconds=0.31)) == bound


def test_an_idle_look_that_found_no_lease_ending_soon_spares_the_next_ones_the_walk() -> None:
    ticks = _Ticks()
    expiry = queue_expiry.ExpiryBound(clock=ticks)
    assert expiry.lease_look(None)  # nothing known yet
    expiry.leasing(30.0)
    expiry.looked(None, started=0.0, lease_in=None, within=2.0)
    # No lease the look saw runs out before it sleeps out, and none of this Bus's before 30 s.
    ticks.t = 1.9
    assert not expiry.lease_look(None)
    ticks.t = 2.0
    assert expiry.lease_look(None)
    # A look judged by a test's clock always looks.
    expiry.looked(None, started=2.0, lease_in=None, within=2.0)
    assert not expiry.lease_look(None)
    assert expiry.lease_look(datetime.now(UTC))
    # A take for less than the memo's rest makes the next look look again once that lease may end.
    expiry.leasing(0.5)
    ticks.t = 2.4
    assert not expiry.lease_look(None)
    ticks.t = 2.5
    assert expiry.lease_look(None)
    # ...and from now on a memo lasts no longer than that shortest timeout.
    expiry.looked(None, started=2.5, lease_in=None, within=2.0)
    ticks.t = 2.99
    assert not expiry.lease_look(None)
    ticks.t = 3.0
    assert expiry.lease_look(None)
    # A look that found a lease running out soon, or had no limit, leaves no memo.
    expiry.looked(None, started=3.0, lease_in=1.0, within=2.0)
    assert expiry.lease_look(None)
    expiry.looked(None, started=3.0, lease_in=None, within=None)
    assert expiry.lease_look(None)


async def test_an_idle_look_on_the_server_clock_sees_a_lease_another_bus_left_once_its_memo_ends(
    b: bus.Bus, dsn: str, schema: str
) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish("jobs", b"a")
    ticks = _Ticks()
    expiry = queue_expiry.ExpiryBound(clock=ticks)
    conn = await db.connect(dsn, schema)
    try:
        assert await queue_sql.seconds_until_visible(conn, "jobs", None, expiry, 2.0) is not None
        # Another process leases the job for 1 s (it never acks): this Bus's memo of an empty look
        # does not see it...
        other = await queue_sql.take(conn, "jobs", 1, 1.0, "other", ordered=False)
        assert len(other) == 1
        assert await queue_sql.seconds_until_visible(conn, "jobs", None, expiry, 2.0) is None
        assert not expiry.lease_look(None)
        # ...until the memo ends (the time the consumer slept out anyway): then the look finds it.
        ticks.t = 2.0
        until = await queue_sql.seconds_until_visible(conn, "jobs", None, expiry, 2.0)
        assert until is not None and 0 < until <= 1.0
        assert expiry.lease_look(None)  # found one: the next look looks again
    finally:
        await conn.close()


def test_full_scans_that_find_nothing_come_less_often_and_one_that_reclaims_brings_them_back() -> None:
    # A full scan walks every lease acked since a snapshot held elsewhere began: while they find
    # nothing (no take failed holding leases), each waits twice as long, up to the longest period.
    ticks = _Ticks()
    expiry = queue_expiry.ExpiryBound(full_every=10.0, clock=ticks, longest=60.0)
    judged = datetime(2026, 1, 1, tzinfo=UTC)

    def full_scans_until(end: float, reclaim_at: float | None = None) -> list[float]:
        at: list[float] = []
        while ticks.t <= end:
            start = expiry.for_take(judged)
            if start is None:
                at.append(ticks.t)
            expiry.scanned(start, 1 if start is None and ticks.t == reclaim_at else 0, judged)
            ticks.t += 1.0
        return at

    assert full_scans_until(300.0) == [0.0, 10.0, 30.0, 70.0, 130.0, 190.0, 250.0]
    # One that reclaims a lease (a take let go of leases it had locked): every 10 s again.
    assert full_scans_until(400.0, reclaim_at=310.0) == [310.0, 320.0, 330.0, 350.0, 390.0]
