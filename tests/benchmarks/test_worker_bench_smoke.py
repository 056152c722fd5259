"""The worker benchmark runs end to end at its smallest size: one row, the worker beside raw SKIP LOCKED.

Numbers are not checked here (the ≥ 0.8× target belongs to `bus bench worker`); the test
pins that both sides drained every job (each raises otherwise) and measured a rate.
"""

from __future__ import annotations

import asyncio

import pytest

from benchmarks import worker

pytestmark = [pytest.mark.slow, pytest.mark.alone]


async def test_worker_benchmark_drains_every_job_beside_raw_skip_locked(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BUS_BENCH_WORKER_W", "2")
    monkeypatch.setenv("BUS_BENCH_WORKER_JOBS", "40")
    (row,) = await asyncio.to_thread(asyncio.run, worker.run(dsn, True))
    assert row.name == "40 jobs, 1 ms each, W = 2"
    assert row.value > 0 and row.baseline is not None and row.baseline > 0
    assert row.baseline_name == "raw SKIP LOCKED" and row.target == "≥ 0.8× raw"
    assert row.extra["concurrency"] == 2 and len(row.extra["worker"]) == len(row.extra["raw"]) == 1
