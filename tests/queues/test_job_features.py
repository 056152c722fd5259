"""Unique jobs, progress and job status, groups of jobs with a completion callback."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

import bus
from bus.testing import Clock

ROOT = Path(__file__).resolve().parents[2]


async def _jobs_left(b: bus.Bus, topic: str) -> int:
    """Jobs of `topic` still there (waiting or taken)."""
    depth = 0
    async with b.queue_consumer(topic, visibility_timeout=1) as q:
        while got := await q.take(max_messages=100, timeout=0):
            depth += len(got)
        # given back by close, uncounted
    return depth


async def test_a_unique_key_holds_under_32_concurrent_publishes(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=4, semantics="queue")
    recs = await asyncio.gather(
        *(b.publish("jobs", {"i": i}, unique=bus.Unique("report:42")) for i in range(32))
    )
    assert len({(r.partition, r.offset) for r in recs}) == 1
    other = await b.publish("jobs", {"i": -1}, unique=bus.Unique("report:43"))
    assert (other.partition, other.offset) != (recs[0].partition, recs[0].offset)
    assert await _jobs_left(b, "jobs") == 2


async def test_a_unique_key_is_free_again_once_its_job_is_done_and_its_period_over(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    first = await b.publish("jobs", {"i": 1}, unique=bus.Unique("k", period=timedelta(minutes=10)))
    async with b.queue_consumer("jobs") as q:
        (job,) = await q.take(timeout=0)
        again = await b.publish("jobs", {"i": 2}, unique=bus.Unique("k", period=600))
        assert again.offset == first.offset  # running: the same job
        await q.ack(job)
    within = await b.publish("jobs", {"i": 3}, unique=bus.Unique("k", period=600))
    assert within.offset == first.offset  # done, but published within the period
    Clock(b).advance(601)
    after = await b.publish("jobs", {"i": 4}, unique=bus.Unique("k", period=600))
    assert after.offset != first.offset
    plain = await b.publish("jobs", {"i": 5}, unique=bus.Unique("k2"))
    async with b.queue_consumer("jobs") as q:
        got = await q.take(max_messages=10, timeout=0)
        await q.ack_many(got)
    assert sorted(m.offset for m in got) == [after.offset, plain.offset]
    fresh = await b.publish("jobs", {"i": 6}, unique=bus.Unique("k2"))  # no period: free once done
    assert fresh.offset != plain.offset


async def test_unique_is_refused_on_pubsub_topics_and_without_a_key(b: bus.Bus) -> None:
    await b.create_topic("events", partitions=1)
    await b.create_topic("jobs", partitions=1, semantics="queue")
    with pytest.raises(bus.ValidationError, match="queue topics"):
        await b.publish("events", {"i": 1}, unique=bus.Unique("k"))
    with pytest.raises(bus.ValidationError, match="bus.Unique"):
        await b.publish("jobs", {"i": 1}, unique="k")  # type: ignore[arg-type]
    with pytest.raises(bus.ValidationError, match="non-empty"):
        await b.publish("jobs", {"i": 1}, unique=bus.Unique(""))
    assert await _jobs_left(b, "jobs") == 0


@pytest.mark.slow
async def test_a_unique_key_holds_across_processes(b: bus.Bus, dsn: str, schema: str, tmp_path: Path) -> None:
    await b.create_topic("jobs", partitions=4, semantics="queue")
    outs = [tmp_path / f"p{i}.txt" for i in range(3)]
    procs = [
        subprocess.Popen(  # noqa: ASYNC220 - started here, waited for off the event loop
            [
                sys.executable,
                "-m",
                "tests.queues.job_process",
                "unique",
                schema,
                "jobs",
                "nightly",
                "16",
                str(o),
            ],
            cwd=ROOT,
            env={**os.environ, "BUS_DSN": dsn},
        )
        for o in outs
    ]
    mine = await asyncio.gather(
        *(b.publish("jobs", {"p": "test"}, unique=bus.Unique("nightly")) for _ in range(16))
    )
    for p in procs:
        assert await asyncio.to_thread(p.wait, 120) == 0
    seen = {line for o in outs for line in o.read_text().splitlines()} | {
        f"{r.partition} {r.offset}" for r in mine
    }
    assert len(seen) == 1, seen
    assert await _jobs_left(b, "jobs") == 1


async def test_progress_is_visible_and_renews_the_lease_of_a_long_job(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    rec = await b.publish("jobs", {"n": 1})
    assert (await b.job_status("jobs", rec)).state == "waiting"
    clock = Clock(b)
    async with b.queue_consumer("jobs", visibility_timeout=30) as q, b.queue_consumer("jobs") as other:
        (job,) = await q.take(timeout=0)
        assert (await b.job_status("jobs", rec)).state == "running"
        for done in (25, 50, 75):  # 75 s of work on a 30 s visibility timeout
            clock.advance(25)
            await q.progress(job, {"done": done, "of": 100})
            assert await other.take(timeout=0) == []  # not handed out again
        status = await b.job_status("jobs", rec)
        assert status.state == "running" and status.attempts == 1
        assert status.progress == {"done": 75, "of": 100}
        await q.ack(job, result={"rows": 3})
    done = await b.job_status("jobs", rec)
    assert done.state == "done" and done.result == {"rows": 3}


async def test_a_job_that_stops_reporting_progress_comes_back_after_its_timeout(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish("jobs", {"n": 1})
    clock = Clock(b)
    async with b.queue_consumer("jobs", visibility_timeout=30) as q, b.queue_consumer("jobs") as other:
        (job,) = await q.take(timeout=0)
        clock.advance(20)
        await q.progress(job, {"step": 1})
        clock.advance(31)  # no progress for longer than the timeout
        (again,) = await other.take(timeout=0)
        assert again.offset == job.offset and again.attempt == 2
        with pytest.raises(bus.LeaseLostError):
            await q.progress(job, {"step": 2})
        await other.ack(again)


async def test_progress_must_be_json(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish("jobs", {"n": 1})
    async with b.queue_consumer("jobs") as q:
        (job,) = await q.take(timeout=0)
        with pytest.raises(bus.ValidationError, match="JSON"):
            await q.progress(job, object())
        await q.ack(job)


async def _callbacks(b: bus.Bus, topic: str) -> list[bus.Message]:
    out: list[bus.Message] = []
    async with b.queue_consumer(topic) as q:
        while got := await q.take(max_messages=100, timeout=0):
            out += got
            await q.ack_many(got)
    return out


async def test_a_group_callback_is_published_once_when_every_job_is_acked_or_dead_lettered(
    b: bus.Bus,
) -> None:
    await b.create_topic("jobs", partitions=2, semantics="queue")
    await b.create_topic("jobs.done", partitions=1, semantics="queue")
    group = await b.publish_group(
        "jobs",
        [bus.Outgoing({"n": i}) for i in range(5)],
        on_complete=bus.Outgoing({"batch": 7}, topic="jobs.done"),
    )
    assert len(group.records) == 5
    async with b.queue_consumer("jobs", max_attempts=1) as q:
        jobs = await q.take(max_messages=10, timeout=0)
        assert len(jobs) == 5
        await q.ack_many(jobs[:4])
        assert await _callbacks(b, "jobs.done") == []  # one job left
        await q.nack(jobs[4], error="bad input")  # its last attempt: dead-lettered
    (done,) = await _callbacks(b, "jobs.done")
    assert done.value(dict) == {"batch": 7} and done.headers["group.id"] == str(group.id)
    await b.publish("jobs", {"n": 99})  # a job of no group removes nothing of it
    async with b.queue_consumer("jobs") as q:
        await q.ack_many(await q.take(timeout=0))
    assert await _callbacks(b, "jobs.done") == []


async def test_publish_group_refuses_a_callback_without_topic_and_writes_nothing(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    with pytest.raises(bus.ValidationError, match="on_complete"):
        await b.publish_group("jobs", [{"n": 1}], on_complete=bus.Outgoing({"batch": 1}))
    with pytest.raises(bus.TopicNotFoundError, match="on_complete"):
        await b.publish_group("jobs", [{"n": 1}], on_complete=bus.Outgoing({"b": 1}, topic="nowhere"))
    assert await _jobs_left(b, "jobs") == 0


@pytest.mark.slow
async def test_a_group_callback_is_published_exactly_once_when_a_worker_is_killed(
    b: bus.Bus, dsn: str, schema: str, tmp_path: Path
) -> None:
    await b.create_topic("jobs", partitions=4, semantics="queue")
    await b.create_topic("jobs.done", partitions=1, semantics="queue")
    await b.publish_group(
        "jobs",
        [bus.Outgoing({"n": i}) for i in range(120)],
        on_complete=bus.Outgoing({"batch": 1}, topic="jobs.done"),
    )

    def start(name: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.queues.job_process", "work", schema, "jobs", str(tmp_path / name)],
            cwd=ROOT,
            env={**os.environ, "BUS_DSN": dsn},
        )

    procs = [start("a"), start("b")]
    try:
        for _ in range(1200):
            if (tmp_path / "a").exists():
                break
            await asyncio.sleep(0.05)
        assert (tmp_path / "a").exists(), "the first worker never acked a job"
        os.kill(procs[0].pid, signal.SIGKILL)  # mid-run, jobs in hand
        procs[0].wait(10)
        procs.append(start("c"))
        callbacks: list[bus.Message] = []
        for _ in range(600):
            callbacks += await _callbacks(b, "jobs.done")
            if callbacks:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(2.5)  # the killed worker's leases (1 s) ran out and were retaken meanwhile
        callbacks += await _callbacks(b, "jobs.done")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert len(callbacks) == 1, f"{len(callbacks)} callbacks"
    assert callbacks[0].value(dict) == {"batch": 1}
    assert await _jobs_left(b, "jobs") == 0


async def _publish_backlog(b: bus.Bus, topic: str, key: str, n: int) -> None:
    for first in range(0, n, 1000):
        await b.publish_many(
            topic, [bus.Outgoing({"i": i}, key=key) for i in range(first, min(first + 1000, n))]
        )


async def test_a_fair_queue_takes_another_keys_job_within_one_take_of_a_10000_job_backlog(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=4, semantics="queue", fair=True)
    await _publish_backlog(b, "jobs", "tenant-a", 10_000)
    other = await b.publish("jobs", {"i": "b"}, key="tenant-b")
    async with b.queue_consumer("jobs") as q:
        first = await q.take(max_messages=10, timeout=0)
        assert len(first) == 10
        assert (other.partition, other.offset) in {(m.partition, m.offset) for m in first}
        assert sum(m.key == "tenant-a" for m in first) == 9  # the rest still goes to the busy key
        await q.ack_many(first)
    late = await b.publish("jobs", {"i": "c"}, key="tenant-c")  # published behind the whole backlog
    async with b.queue_consumer("jobs") as q:
        one = await q.take(max_messages=1, timeout=0)
        two = await q.take(max_messages=1, timeout=0)
        # at most one take of the busy key's jobs before it
        assert (late.partition, late.offset) in {(m.partition, m.offset) for m in one + two}
        await q.ack_many(one + two)


async def test_without_fair_a_10000_job_backlog_delays_another_keys_job(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await _publish_backlog(b, "jobs", "tenant-a", 2_000)
    other = await b.publish("jobs", {"i": "b"}, key="tenant-b")
    async with b.queue_consumer("jobs") as q:
        first = await q.take(max_messages=10, timeout=0)
        assert other.offset not in {m.offset for m in first}  # what fair=True changes
        await q.ack_many(first)


async def test_fair_is_refused_on_pubsub_topics(b: bus.Bus) -> None:
    with pytest.raises(bus.ValidationError, match="fair"):
        await b.create_topic("events", partitions=1, fair=True)


async def test_job_status_is_refused_on_pubsub_topics(b: bus.Bus) -> None:
    await b.create_topic("events", partitions=1)
    rec = await b.publish("events", {"i": 1})
    with pytest.raises(bus.ValidationError, match="queue topics"):
        await b.job_status("events", rec)
