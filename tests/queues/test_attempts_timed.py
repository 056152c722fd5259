"""Every failed attempt of a job carries its time, the last one too (JobFailedError.errors, dead-letter headers)."""

from __future__ import annotations

import json

import pytest

import bus


async def test_every_attempt_of_a_dead_lettered_job_is_timed(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    rec = await b.publish("jobs", {"n": 1})
    async with b.queue_consumer("jobs", max_attempts=3, dead_letter="jobs.dlq") as q:
        for attempt in (1, 2, 3):
            (job,) = await q.take(timeout=2.0)
            assert job.attempt == attempt
            await q.nack(job, error=f"failure {attempt}")
    with pytest.raises(bus.JobFailedError) as failed:
        await b.job_result("jobs", rec, timeout=2.0)
    errors = failed.value.errors
    assert [e["attempt"] for e in errors] == [1, 2, 3]
    assert [e["error"] for e in errors] == ["failure 1", "failure 2", "failure 3"]
    assert all(isinstance(e.get("at"), str) and e["at"] for e in errors), errors
    (dead,) = await b.read("jobs.dlq", partition="0")
    history = json.loads(dead.headers["dead_letter.errors"])
    assert [e["attempt"] for e in history] == [1, 2, 3] and all(e.get("at") for e in history), history
