"""b.worker: W jobs in hand, acks after the handler returns, retries and dead letters, graceful stop."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import bus
from bus.testing import Clock

ROOT = Path(__file__).resolve().parents[2]


async def test_worker_never_runs_more_than_its_concurrency_and_handles_every_job(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=4, semantics="queue")
    await b.publish_many("jobs", [bus.Outgoing({"n": i}) for i in range(300)])
    running = peak = 0
    seen: list[int] = []
    done = asyncio.Event()

    async def handle(job: bus.Message) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(random.random() * 0.004)
        seen.append(job.value(dict)["n"])
        running -= 1
        if len(seen) == 300:
            done.set()

    w = await b.worker("jobs", handle, concurrency=8)
    await asyncio.wait_for(done.wait(), 30)
    await w.stop()
    assert peak <= 8, f"{peak} handlers ran at once"
    assert peak == 8, f"the worker never filled its 8 slots (peak {peak}): the test did not load it"
    assert sorted(seen) == list(range(300))
    async with b.queue_consumer("jobs") as q:
        assert await q.take(timeout=0) == []  # every job acked


async def test_worker_takes_once_for_all_its_free_slots(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish_many("jobs", [bus.Outgoing({"n": i}) for i in range(16)])
    gate = asyncio.Event()
    started: list[int] = []

    async def handle(job: bus.Message) -> None:
        started.append(job.offset)
        await gate.wait()

    w = await b.worker("jobs", handle, concurrency=16)
    try:
        for _ in range(200):
            if len(started) == 16:
                break
            await asyncio.sleep(0.01)
        # One take for 16 free slots: all 16 handlers started before any returned.
        assert len(started) == 16 and w.in_hand == 16
    finally:
        gate.set()
        await w.stop()


async def test_worker_retries_a_failing_job_then_dead_letters_it(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish("jobs", {"n": 1})
    attempts: list[int] = []

    async def handle(job: bus.Message) -> None:
        attempts.append(job.attempt)
        raise RuntimeError(f"boom {job.attempt}")

    w = await b.worker("jobs", handle, concurrency=2, max_attempts=3, backoff=0)
    async with b.queue_consumer("jobs.dlq") as dlq:
        (dead,) = await dlq.take(timeout=10)
        await dlq.ack(dead)
    await w.stop()
    assert attempts == [1, 2, 3]
    assert dead.headers["dead_letter.attempts"] == "3"
    assert "boom 3" in dead.headers["dead_letter.last_error"]


async def test_worker_result_is_the_handlers_return_value(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    rec = await b.publish("jobs", {"n": 20})

    async def double(job: bus.Message) -> dict[str, int]:
        return {"twice": job.value(dict)["n"] * 2}

    async with await b.worker("jobs", double, concurrency=4):
        assert await b.job_result("jobs", rec, timeout=10) == {"twice": 40}


async def test_worker_stop_lets_the_jobs_in_hand_finish_and_ack(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish_many("jobs", [bus.Outgoing({"n": i}) for i in range(3)])
    began = asyncio.Event()
    finished: list[int] = []

    async def slow(job: bus.Message) -> None:
        began.set()
        await asyncio.sleep(0.2)
        finished.append(job.offset)

    w = await b.worker("jobs", slow, concurrency=3)
    await asyncio.wait_for(began.wait(), 10)
    await w.stop()
    assert sorted(finished) == [0, 1, 2]
    async with b.queue_consumer("jobs") as q:
        assert await q.take(timeout=0) == []


async def test_worker_refuses_a_handler_that_is_not_async(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    with pytest.raises(bus.ValidationError, match="async"):
        await b.worker("jobs", lambda job: None, concurrency=2)  # type: ignore[arg-type,return-value]
    with pytest.raises(bus.ValidationError, match="concurrency"):
        await b.worker("jobs", _noop, concurrency=0)


async def _noop(job: bus.Message) -> None:
    return None


@pytest.mark.slow
async def test_a_job_whose_worker_process_is_killed_mid_handler_comes_back(
    b: bus.Bus, dsn: str, schema: str, tmp_path: Path
) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish("jobs", {"n": 7})
    marker = tmp_path / "started"
    proc = subprocess.Popen(  # noqa: ASYNC220 - started here, polled without blocking
        [sys.executable, "-m", "tests.queues.worker_process", schema, "jobs", str(marker)],
        cwd=ROOT,
        env={**os.environ, "BUS_DSN": dsn},
    )
    try:
        for _ in range(600):
            if marker.exists() or proc.poll() is not None:
                break
            await asyncio.sleep(0.05)
        assert marker.exists(), "the worker process never started its handler"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    async with b.queue_consumer("jobs") as q:
        assert await q.take(timeout=0) == []  # still leased to the dead process: not acked
        Clock(b).advance(31)  # past its 30 s visibility timeout
        (again,) = await q.take(timeout=0)
        assert again.value(dict) == {"n": 7} and again.attempt == 2
        await q.ack(again)
