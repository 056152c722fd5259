"""The dead-tuples benchmark runs end to end at tiny sizes: the bus and both raw queues under one hold.

Numbers are not compared here (the target belongs to `bus bench deadtuples`);
the test pins that the hold really keeps what each system deletes: the raw
delete-on-take queue leaves exactly one dead row per job, the raw
lease-then-delete queue two, the raw rotated lease log only its jobs (its
leases are truncated, never deleted), and the bus at least the job rows its
acks delete.
"""

from __future__ import annotations

import asyncio

import pytest

from benchmarks import deadtuples

pytestmark = [pytest.mark.slow, pytest.mark.alone]


async def test_deadtuples_benchmark_counts_the_rows_each_queue_leaves_under_a_held_snapshot(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BUS_BENCH_DEAD_JOBS", "60")
    monkeypatch.setenv("BUS_BENCH_DEAD_WORKERS", "3")
    rounds = await asyncio.to_thread(asyncio.run, deadtuples.measure(dsn, 60, 3, 2, 1))

    by_system = {r.system: r for r in rounds}
    assert set(by_system) == set(deadtuples.SYSTEMS)
    assert by_system["raw delete-on-take"].dead == {"raw_jobs": 60}
    assert by_system["raw lease-then-delete"].dead == {"raw_jobs": 120}
    rotated = by_system["raw rotated lease log"]
    assert rotated.dead["raw_jobs"] == 60
    assert set(rotated.dead) <= {"raw_jobs", "raw_lease_frontier"}  # the frontier: one version per rotation
    ours = by_system["bus"]
    assert ours.dead.get("queue_jobs", 0) >= 60
    assert all(r.rate > 0 for r in rounds)

    rows = await asyncio.to_thread(asyncio.run, deadtuples.run(dsn, True))
    first = rows[0]
    assert first.target == "<= 1.0x raw lease-then-delete" and not first.higher_is_better
    assert first.baseline == 2.0
    assert first.extra["table"][0][:6] == ["round", "system", "jobs/s", "dead/job", "written/job", "dead"]
