"""The consumer-groups benchmark runs end to end at tiny sizes and reports every row next to its baseline.

Numbers are not checked here (speed targets belong to `bus bench`); the test
pins that each measurement completes, with member processes, and comes back
with a baseline from the same run.
"""

from __future__ import annotations

import asyncio

import pytest

from benchmarks import groups

pytestmark = [pytest.mark.slow, pytest.mark.alone]


async def test_groups_benchmark_reports_throughput_latency_failover_and_rebalance_rows(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(groups, "QUICK_MESSAGES", 2_000)
    monkeypatch.setattr(groups, "PROCESS_COUNTS", (1, 2))
    monkeypatch.setattr(groups, "QUICK_LATENCY_SECONDS", 1.0)
    monkeypatch.setattr(groups, "QUICK_DURABLE_SECONDS", 0.5)
    monkeypatch.setattr(groups, "QUICK_STATEMENT_CALLS", 20)
    monkeypatch.setattr(groups, "REBALANCE_MEMBERS", 3)
    monkeypatch.setattr(groups, "REBALANCE_PARTITIONS", 12)
    # The scenario drives its own event loop, like the harness does.
    rows = await asyncio.to_thread(asyncio.run, groups.run(dsn, True))

    by_name = {r.name: r for r in rows}
    throughput = [r for r in rows if r.name.startswith("consume throughput,")]
    assert len(throughput) == 2
    for r in throughput:
        assert r.unit == "msg/s" and r.value > 0 and r.baseline and r.baseline > 0
        assert r.extra["messages"] == 2_000
    assert "consume throughput scaling, 2 vs 1 process" in by_name

    p50 = next(r for r in rows if r.name.startswith("publish→handler latency p50,"))
    assert p50.unit == "ms" and not p50.higher_is_better
    assert 0 < p50.extra["p50"] <= p50.extra["p99"]
    # Against the raw pipeline doing the same work, with the bare NOTIFY kept as the floor row.
    assert p50.baseline_name is not None and p50.baseline_name.startswith("raw pipeline")
    assert 0 < p50.extra["pipeline_p50"] <= p50.extra["pipeline_p99"]
    floor = next(r for r in rows if "bare NOTIFY (floor)" in r.name)
    assert 0 < floor.extra["floor_p99"] and floor.baseline == p50.extra["notify_floor_p50"]

    # The two statements of the path, each next to the raw pipeline's, from the same paced steps.
    publish_stmt = next(r for r in rows if r.name.startswith("publish statement alone p50"))
    fetch_stmt = next(r for r in rows if r.name.startswith("fenced fetch of the new message alone p50"))
    for r in (publish_stmt, fetch_stmt):
        assert r.unit == "ms" and not r.higher_is_better and r.baseline and r.baseline > 0
        assert 0 < r.value <= r.extra["p99"] and r.extra["calls"] == 20 * groups.STATEMENT_ROUNDS
    assert publish_stmt.baseline_name == "raw INSERT + NOTIFY"

    failover = next(r for r in rows if r.name.startswith("failover"))
    assert failover.unit == "s" and 0 < failover.value < 60
    assert failover.extra["partitions_moved"] >= 1
    assert failover.baseline == pytest.approx(1.5 + 0.2 + 0.1 + 1.0)

    rebalance = next(r for r in rows if r.name.startswith("rebalance"))
    assert "3→4 members, 12 partitions" in rebalance.name
    assert rebalance.value > 0 and rebalance.baseline == pytest.approx(0.3)
