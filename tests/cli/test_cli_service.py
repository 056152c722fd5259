"""What an operator of a first service looks at from the command line: messages with their headers
(a dead-letter topic's errors), schedules, a queue's depth, a member's heartbeat age."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest

import bus
from bus.testing import FAST

pytestmark = pytest.mark.slow  # runs `python -m bus` in subprocesses


def _env(dsn: str, schema: str) -> dict[str, str]:
    return {**os.environ, "BUS_DSN": dsn, "BUS_SCHEMA": schema, "COLUMNS": "160"}


def run_cli(dsn: str, schema: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bus", *args],
        env=_env(dsn, schema),
        capture_output=True,
        text=True,
        timeout=120,
    )


async def cli(dsn: str, schema: str, *args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(run_cli, dsn, schema, *args)


async def _dead_lettered_job(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=2, semantics="queue")
    for i in range(3):
        await b.publish("jobs", {"i": i}, partition="0", headers={"order": str(i)})
    async with b.queue_consumer("jobs", max_attempts=1, dead_letter="jobs.dlq") as q:
        (job,) = await q.take(max_messages=1, timeout=2.0)
        await q.nack(job, error="card declined")


async def test_messages_shows_a_dead_letter_topic_with_its_error_headers(
    connect: Any, dsn: str, schema: str
) -> None:
    b = await connect(**FAST)
    await _dead_lettered_job(b)
    out = await cli(dsn, schema, "messages", "jobs.dlq")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "dead_letter.last_error=card declined" in out.stdout and '{"i":0}' in out.stdout
    (line,) = (await cli(dsn, schema, "messages", "jobs.dlq", "--json")).stdout.splitlines()
    m = json.loads(line)
    assert m["headers"]["dead_letter.topic"] == "jobs" and json.loads(m["payload"]) == {"i": 0}
    assert json.loads(m["headers"]["dead_letter.errors"])[0]["error"] == "card declined"
    # A window of one partition: --partition, --offset, --limit.
    window = (
        await cli(
            dsn, schema, "messages", "jobs", "--partition", "0", "--offset", "1", "--limit", "1", "--json"
        )
    ).stdout
    assert [json.loads(x)["offset"] for x in window.splitlines()] == [1]
    last = (await cli(dsn, schema, "messages", "jobs", "--limit", "2", "--json")).stdout
    assert [json.loads(x)["offset"] for x in last.splitlines()] == [1, 2]  # the last two by default
    missing = await cli(dsn, schema, "messages", "jobs", "--partition", "7")
    assert missing.returncode == 2 and "no partition '7'" in missing.stdout


async def test_messages_follow_prints_what_is_published_after_it_started(
    connect: Any, dsn: str, schema: str
) -> None:
    b = await connect(**FAST)
    await b.create_topic("orders", partitions=1)
    await b.publish("orders", {"n": 0})
    proc = await asyncio.to_thread(
        subprocess.Popen,
        [sys.executable, "-m", "bus", "messages", "orders", "--follow", "--json"],
        env=_env(dsn, schema), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        first = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)  # type: ignore[union-attr]
        assert json.loads(first)["offset"] == 0
        await b.publish("orders", {"n": 1})
        second = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)  # type: ignore[union-attr]
        assert json.loads(second)["offset"] == 1 and json.loads(json.loads(second)["payload"]) == {"n": 1}
    finally:
        proc.terminate()
        proc.wait(30)


async def test_schedules_lists_the_periodic_publishes(connect: Any, dsn: str, schema: str) -> None:
    b = await connect(**FAST)
    await b.create_topic("jobs", semantics="queue")
    await b.schedule("nightly", cron="0 3 * * *", topic="jobs", payload={"report": "daily"})
    out = await cli(dsn, schema, "schedules")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "nightly" in out.stdout and "0 3 * * *" in out.stdout
    (s,) = json.loads((await cli(dsn, schema, "schedules", "--json")).stdout)
    assert (s["name"], s["topic"], json.loads(s["payload"])) == ("nightly", "jobs", {"report": "daily"})


async def test_topics_shows_a_queue_depth_not_its_log_size(connect: Any, dsn: str, schema: str) -> None:
    b = await connect(**FAST)
    await _dead_lettered_job(b)
    async with b.queue_consumer("jobs") as q:
        for job in await q.take(max_messages=1, timeout=2.0):
            await q.ack(job)  # acked: still in the log, no longer in the queue
    topics = {t["name"]: t for t in json.loads((await cli(dsn, schema, "topics", "--json")).stdout)}
    jobs = topics["jobs"]
    assert jobs["messages"] == 3
    assert (jobs["depth"]["waiting"], jobs["depth"]["running"], jobs["depth"]["delayed"]) == (1, 0, 0)
    assert jobs["depth"]["dead"] == 1 and jobs["depth"]["dead_letter"] == "jobs.dlq"
    out = await cli(dsn, schema, "topics")
    row = next(line for line in out.stdout.splitlines() if line.startswith("jobs "))
    assert "1/0/0/1" in row


async def test_describe_shows_each_member_heartbeat_age(connect: Any, dsn: str, schema: str) -> None:
    b = await connect(**FAST)
    await b.create_topic("orders", partitions=2)
    async with b.consumer("email", topics=["orders"]) as c:
        await c.wait_assigned()
        before = time.time()
        d = json.loads((await cli(dsn, schema, "describe", "email", "--json")).stdout)
        (member,) = d["members"]
        assert member["member_id"] == c.member_id
        assert 0 <= member["heartbeat_age"] <= time.time() - before + 30
        out = await cli(dsn, schema, "describe", "email")
        assert "HEARTBEAT-AGE" in out.stdout


async def test_a_read_only_command_loads_neither_typer_parsing_nor_structlog(
    connect: Any, dsn: str, schema: str
) -> None:
    """Start-up is what a person waits for: pydantic (typer's parameter parsing) and structlog (with
    rich's tracebacks) are most of it, and a read-only command needs neither. The speed itself is
    measured, not asserted (see the report); this pins what keeps it."""
    b = await connect(**FAST)
    await b.create_topic("orders")
    probe = (
        "import sys, json\n"
        "from bus.cli import main\n"
        "for args in (['topics', '--json'], ['groups'], ['describe', 'nope', '--json']):\n"
        "    try:\n"
        "        main(args)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(json.dumps({m: m in sys.modules for m in ('pydantic', 'structlog', 'actors.system')}))\n"
    )
    out = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", probe], env=_env(dsn, schema), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = json.loads(out.stdout.splitlines()[-1])
    assert loaded == {"pydantic": False, "structlog": False, "actors.system": False}, loaded
    assert '"name": "orders"' in out.stdout and "does not exist" in out.stdout
