"""The scale benchmark: its connection check against the real server, its pause measure, and a small run end to end.

Numbers are not checked here (speed targets belong to `bus bench scale`): the
tests pin that the member pool is sized to fit the server's `max_connections`
(and that a plan that cannot fit is refused before any process starts), that a
kept partition's pause is read from the handlers' own timestamps, and that a
small group goes through every step with a row for each.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import asyncpg
import pytest

from benchmarks import scale
from bus.errors import ValidationError


async def test_member_pool_fits_the_servers_max_connections(dsn: str) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
    try:
        few = await scale.check_connections(pool, 2)
        assert few["pool_max_size"] == scale.MEMBER_POOL_MAX_SIZE  # the default fits two processes
        assert few["planned"] == 2 * (scale.MEMBER_POOL_MAX_SIZE + 6) + 12 <= few["free"]
        # As many processes as fit only with a smaller pool: the pool shrinks and the plan still fits.
        many = (few["free"] - 12) // 11
        sized = await scale.check_connections(pool, many)
        assert scale.MIN_MEMBER_POOL <= sized["pool_max_size"] < scale.MEMBER_POOL_MAX_SIZE
        assert sized["planned"] <= sized["free"]
        assert sized["per_process"] == sized["pool_max_size"] + scale.CONNECTIONS_BESIDE_POOL
        # More than fit even with the smallest pool: refused, saying what to change.
        with pytest.raises(ValidationError, match="raise the server's max_connections"):
            await scale.check_connections(pool, few["free"])
    finally:
        await pool.close()


def test_a_kept_partitions_pause_is_its_longest_gap_across_the_step(tmp_path: Path) -> None:
    deliveries = scale.Deliveries()
    path = deliveries.new_path()
    try:
        # Partition 0 is delivered every 0.5 s except for a 2 s hole inside the step [10, 14].
        lines = [f"0 {i} 1 {t}" for i, t in enumerate([9.0, 9.5, 10.0, 10.5, 12.5, 13.0, 13.5, 14.0, 14.5])]
        lines += ["1 0 1 9.9", "1 1 1 14.2", "1 2 1 1"]  # partition 1: nothing during the step
        path.write_text("\n".join(lines) + "\n2 0 1")  # a last line cut short is not read yet
        deliveries.refresh()
        assert deliveries.longest_gap("0", 10.0, 14.0) == pytest.approx(2.0)
        assert deliveries.longest_gap("1", 10.0, 14.0) == pytest.approx(14.2 - 9.9)
        assert "2" not in deliveries.times
        with path.open("a") as f:
            f.write(" 20.0\n")
        deliveries.refresh()
        assert deliveries.times["2"] == [20.0]
        # No delivery after the step yet: the gap runs to now.
        assert deliveries.longest_gap("2", 21.0, 22.0) >= time.time() - 20.0 - 1
    finally:
        deliveries.remove()
    assert not path.exists()


@pytest.mark.slow
async def test_scale_benchmark_runs_every_step_of_a_small_group(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BUS_BENCH_SCALE_MEMBERS", "20")
    monkeypatch.setenv("BUS_BENCH_SCALE_TIMINGS", "0.5")
    monkeypatch.setenv("BUS_BENCH_SCALE_WINDOW", "1")
    monkeypatch.setenv("BUS_BENCH_SCALE_TRICKLE", "0.5")
    monkeypatch.setenv("BUS_BENCH_SCALE_IDLE_GROWTH", "0")
    monkeypatch.setenv("BUS_BENCH_SCALE_CLAIMS", "0")
    # The scenario drives its own event loop, like the harness does.
    rows = await asyncio.to_thread(asyncio.run, scale.run(dsn, True))

    stable = [r for r in rows if r.name.startswith("stable after ")]
    assert [r.name.split(",")[0] for r in stable] == [
        "stable after cold start",
        "stable after join",
        "stable after leave",
        "stable after SIGKILL",
    ]
    for r in stable:
        assert "NOT stable" not in r.name and 0 < r.value < scale.SETTLE_TIMEOUT
        assert r.extra["generations"] >= 1 and len(r.extra["loadavg"]) == 3
    pauses = [r for r in rows if r.name.startswith("longest pause")]
    assert len(pauses) == 3
    for r in pauses:
        assert r.extra["kept"] > 0 and r.extra["longest_gap"] > 0 and r.baseline == 0.5
    idle = next(r for r in rows if r.name.startswith("idle statements/s"))
    assert idle.value > 0
    conns = next(r for r in rows if r.name.startswith("connections,"))
    assert 0 < conns.value <= conns.extra["planned"] <= conns.extra["free"]
