"""The held-snapshot benchmark runs end to end at tiny sizes: three phases, rows against the free phase.

Numbers are not checked here (speed targets belong to `bus bench xmin`); the
test pins that each phase measures something and that the held phase really
holds the xmin horizon (the rows the bus updates leave dead versions).
"""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from benchmarks import xmin

pytestmark = [pytest.mark.slow, pytest.mark.alone]


async def test_xmin_benchmark_reports_free_held_and_after_with_dead_versions_of_the_hold(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BUS_BENCH_XMIN_FREE", "2")
    monkeypatch.setenv("BUS_BENCH_XMIN_HOLD", "3")
    monkeypatch.setenv("BUS_BENCH_XMIN_AFTER", "2")
    monkeypatch.setenv("BUS_BENCH_XMIN_RATE", "50")
    rows = await asyncio.to_thread(asyncio.run, xmin.run(dsn, True))

    by_name = {r.name: r for r in rows}
    delivered = next(r for r in rows if r.name.startswith("delivered msg/s, held"))
    assert delivered.value > 0 and delivered.baseline and delivered.baseline > 0
    assert delivered.target == ">= 0.95x free"
    p99 = next(r for r in rows if r.name.startswith("publish p99, held"))
    assert not p99.higher_is_better and p99.value > 0 and p99.target == "<= 1.5x free"
    assert any(n.startswith("queue jobs/s, after the hold") for n in by_name)
    # The snapshot holds every version the publishes write to their partitions' head rows; the
    # partition rows themselves are only locked, never rewritten.
    held_dead = next(r for r in rows if r.name.startswith("dead tuples in log_heads"))
    assert held_dead.value > 0
    assert all(r.value == 0 for r in rows if r.name.startswith("dead tuples in partitions "))
    table = delivered.extra["table"]
    assert table[0] == ["measurement", "free", "held", "after", "held/free", "after/free"]
    assert delivered.extra["errors"] == 0
    # What says how far the machine can be trusted in each phase, and a p99 less moved by a stretch of it.
    labels = [row[0] for row in table]
    assert "bench event loop lag p99 ms" in labels and "CPU time stolen by the hypervisor %" in labels
    assert "10 s windows with < 2% stolen" in labels and "publish p99 ms in those windows" in labels
    assert any(n.startswith("publish p99 in 10 s windows with < 2% of the CPU stolen, held") for n in by_name)
    conn = await asyncpg.connect(dsn)
    try:
        may_checkpoint = await conn.fetchval(
            "SELECT rolsuper OR pg_has_role(current_user, 'pg_checkpoint', 'USAGE') FROM pg_roles"
            " WHERE rolname = current_user"
        )
    finally:
        await conn.close()
    assert delivered.extra["checkpoint_per_phase"] is may_checkpoint
