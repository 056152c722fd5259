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
from datetime import UTC, datetime

import asyncpg
import pytest

import bus
from benchmarks import scale
from bus.errors import ValidationError


async def test_member_pool_fits_the_servers_max_connections(dsn: str) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
    try:
        few = await scale.check_connections(pool, 2)
        assert few["pool_max_size"] == scale.MEMBER_POOL_MAX_SIZE  # the default fits two processes
        own = scale.PUBLISHER_POOL_MAX_SIZE + scale.CONNECTIONS_BESIDE_POOL + scale.MONITOR_CONNECTIONS
        assert few["planned"] == 2 * (scale.MEMBER_POOL_MAX_SIZE + scale.CONNECTIONS_BESIDE_POOL) + own
        assert few["planned"] <= few["free"]
        # As many processes as fit only with a smaller pool: the pool shrinks and the plan still fits.
        many = (few["free"] - own) // (scale.MIN_MEMBER_POOL + scale.CONNECTIONS_BESIDE_POOL + 1)
        sized = await scale.check_connections(pool, many)
        assert scale.MIN_MEMBER_POOL <= sized["pool_max_size"] < scale.MEMBER_POOL_MAX_SIZE
        assert sized["planned"] <= sized["free"]
        assert sized["per_process"] == sized["pool_max_size"] + scale.CONNECTIONS_BESIDE_POOL
        # More than fit even with the smallest pool: refused, saying what to change.
        with pytest.raises(ValidationError, match="raise the server's max_connections"):
            await scale.check_connections(pool, few["free"])
    finally:
        await pool.close()


def test_a_kept_partitions_pause_is_the_longest_wait_of_its_messages_published_during_the_step() -> None:
    deliveries = scale.Deliveries()
    path = deliveries.new_path()
    try:
        # Partition 0: published every 0.5 s from 9.0; handled 10 ms later, except that it stopped
        # from 10.5 to 12.5 (what was published meanwhile was handled at 12.5).
        sent = [9.0 + 0.5 * i for i in range(12)]
        handled = [12.5 if 10.5 <= t < 12.5 else t + 0.01 for t in sent]
        for offset, at in enumerate(sent):
            deliveries.published(at, [bus.Record("t", "0", offset, datetime.now(UTC))])
        deliveries.published(10.0, [bus.Record("t", "1", 0, datetime.now(UTC))])  # never handled
        lines = [f"0 {offset} 1 {t}" for offset, t in enumerate(handled)]
        path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1])  # a last line cut short is not read yet
        deliveries.refresh()
        assert (("0", 11)) not in deliveries.handled
        assert deliveries.longest_wait("0", 10.0, 14.0) == pytest.approx(2.0)
        assert deliveries.longest_wait("0", 13.0, 14.0) == pytest.approx(0.01)
        assert deliveries.longest_wait("0", 20.0, 21.0) is None  # nothing published then
        # Not handled (yet): it waits still.
        assert deliveries.longest_wait("0", 14.0, 15.0) == pytest.approx(time.time() - 14.5, abs=1.0)
        assert deliveries.longest_wait("1", 9.0, 11.0) >= time.time() - 10.0 - 1
        with path.open("a") as f:
            f.write("\n")
        deliveries.refresh()
        assert deliveries.handled[("0", 11)] == pytest.approx(14.51)
    finally:
        deliveries.remove()
    assert not path.exists()


@pytest.mark.slow
@pytest.mark.alone
async def test_scale_benchmark_runs_every_step_of_a_small_group(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BUS_BENCH_SCALE_MEMBERS", "20")
    monkeypatch.setenv("BUS_BENCH_SCALE_TIMINGS", "0.5")
    monkeypatch.setenv("BUS_BENCH_SCALE_WINDOW", "1")
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
        assert r.extra["kept"] > 0 and r.extra["sampled"] > 0 and 0 < r.value < 30 and r.baseline
        assert r.target is not None and r.target.startswith("<= 0.5")
    idle = next(r for r in rows if r.name.startswith("idle statements/s"))
    assert idle.value > 0
    conns = next(r for r in rows if r.name.startswith("connections,"))
    assert 0 < conns.value <= conns.extra["planned"] <= conns.extra["free"]
