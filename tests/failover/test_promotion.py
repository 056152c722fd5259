"""A primary failover: a synchronous standby promoted, the old primary stopped.

Runs against scripts/pgha.sh (Debian's PostgreSQL 15); skipped without its binaries.
Every publish that returned a Record is there afterwards, and the bus (no process
restarted) publishes and delivers again.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import bus
from bus.errors import StaleGenerationError, StorageUnavailableError
from bus.testing import FAST, eventually


class CourseCreated(bus.Event, tag="failover.course.created"):
    course_name: str


ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "pgha.sh"
PG15 = Path(os.environ.get("PG15_BIN", "/usr/lib/postgresql/15/bin"))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.alone,
    pytest.mark.skipif(
        not (PG15 / "postgres").exists(), reason="needs PostgreSQL 15 (scripts/ensure-pg15.sh)"
    ),
]


def _pgha(home: Path, *args: str) -> str:
    env = dict(os.environ, BUS_HOME=str(home))
    out = subprocess.run(["sh", str(SCRIPT), *args], env=env, check=True, capture_output=True, text=True)
    return out.stdout.strip()


@pytest.fixture
def ha() -> Iterator[tuple[Path, str]]:
    # Not under pytest's tmp_path: every pytest session makes its base directory owner-only again,
    # which would lock out the servers' unprivileged user in the middle of a run.
    home = Path(tempfile.mkdtemp(prefix="bus-failover-"))
    home.chmod(0o755)
    try:
        yield home, _pgha(home, "start")
    finally:
        _pgha(home, "stop")
        shutil.rmtree(home, ignore_errors=True)


async def _retry_publish(b: bus.Bus, topic: str, payload: object, deadline: float) -> bus.Record:
    while True:
        try:
            return await b.publish(topic, payload)
        except StorageUnavailableError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def test_nothing_acknowledged_is_lost_and_the_bus_reconnects(ha: tuple[Path, str]) -> None:
    home, dsn = ha
    async with bus.connect(dsn, **FAST) as b:
        await b.create_topic("orders", partitions=4)
        delivered: list[tuple[str, int]] = []
        after_promotion = asyncio.Event()

        async def handler(m: bus.Message) -> None:
            delivered.append((m.partition, m.offset))
            if promoted_at is not None:
                after_promotion.set()

        promoted_at: float | None = None
        sub = await b.subscribe("email", handler, topics=["orders"], start="earliest")
        acked: list[bus.Record] = []
        stop = asyncio.Event()

        async def publisher(n: int) -> None:
            i = 0
            while not stop.is_set():
                try:
                    acked.append(await b.publish("orders", {"p": n, "i": i}))
                    i += 1
                except StorageUnavailableError:
                    await asyncio.sleep(0.05)  # in flight during the failover: may be retried

        await b.create_topic("jobs", partitions=2, semantics="queue")
        jobs_published: list[bus.Record] = []
        jobs_acked: set[tuple[str, int]] = set()

        async def job_publisher() -> None:
            i = 0
            while not stop.is_set():
                try:
                    jobs_published.append(await b.publish("jobs", {"job": i}))
                    i += 1
                except StorageUnavailableError:
                    await asyncio.sleep(0.05)

        async def worker() -> None:
            async with b.queue_consumer("jobs", visibility_timeout=1.0) as q:
                while not stop.is_set():
                    try:
                        for job in await q.take(max_messages=10, timeout=0.2):
                            await q.ack(job)
                            jobs_acked.add((job.partition, job.offset))
                    except StorageUnavailableError:
                        await asyncio.sleep(0.05)

        commits: dict[tuple[str, str], int] = {}  # the highest committed offset each commit() returned for

        async def committer() -> None:
            async with b.consumer("ledger", topics=["orders"], start="earliest", auto_commit=False) as c:
                while not stop.is_set():
                    try:
                        batch = await c.poll(timeout=0.2)
                        if batch:
                            await c.commit()
                            for m in batch:
                                key = (m.topic, m.partition)
                                commits[key] = max(commits.get(key, 0), m.offset + 1)
                    except (StorageUnavailableError, StaleGenerationError):
                        await asyncio.sleep(0.05)

        store = b.event_store("courses")
        appended: list[int] = []

        async def appender() -> None:
            i = 0
            while not stop.is_set():
                try:
                    recs = await store.append(CourseCreated(course_name=f"c{i}"))
                    appended.extend(r.position for r in recs)
                    i += 1
                except StorageUnavailableError:
                    await asyncio.sleep(0.05)

        publishers = [asyncio.create_task(publisher(n)) for n in range(3)]
        publishers += [asyncio.create_task(f()) for f in (job_publisher, worker, appender, committer)]
        # Every loop has done its work at least once before the primary goes (a loaded machine is slow).
        await eventually(lambda: acked and commits and appended and jobs_acked and delivered, timeout=60)
        before = len(acked)
        _pgha(home, "stop-primary")
        await asyncio.to_thread(_pgha, home, "promote")
        promoted_at = time.monotonic()
        first = await _retry_publish(b, "orders", {"after": True}, promoted_at + 30)
        acked.append(first)
        to_publish = time.monotonic() - promoted_at
        await asyncio.wait_for(after_promotion.wait(), 30)
        to_deliver = time.monotonic() - promoted_at
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*publishers)
        await sub.stop()
        print(f"failover: first publish {to_publish:.2f} s, next delivery {to_deliver:.2f} s after promotion")
        assert len(acked) > before + 1

        seen: set[tuple[str, int]] = set()
        async with b.consumer("audit", topics=["orders"], start="earliest") as c:
            for _ in range(100):
                batch = await c.poll(timeout=0.5)
                if not batch:
                    break
                seen.update((m.partition, m.offset) for m in batch)
        missing = {(r.partition, r.offset) for r in acked} - seen
        assert not missing, f"{len(missing)} acknowledged publishes lost: {sorted(missing)[:5]}"

        # Commits: every commit that returned is kept.
        described = await b.admin.describe_group("ledger")
        committed = {(p.topic, p.partition): p.committed or 0 for p in described.partitions}
        assert commits
        assert all(committed[k] >= v for k, v in commits.items()), (commits, committed)

        # Events: every appended position is in the store.
        stored = {e.position for e in await store.read()}
        assert appended and not set(appended) - stored

        # Jobs: an acked job never comes back; every published job is acked or still queued.
        await asyncio.sleep(1.2)  # leases of jobs taken but not acked at the failover expire
        remaining: set[tuple[str, int]] = set()
        async with b.queue_consumer("jobs", visibility_timeout=30.0) as q:
            while batch := await q.take(max_messages=100, timeout=0.3):
                remaining.update((j.partition, j.offset) for j in batch)
        assert jobs_acked and not jobs_acked & remaining, "an acknowledged job came back"
        lost_jobs = {(r.partition, r.offset) for r in jobs_published} - jobs_acked - remaining
        assert not lost_jobs, f"{len(lost_jobs)} acknowledged jobs lost"
