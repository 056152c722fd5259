"""Queue limits and pause hold across processes (three consumer processes on one queue)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

import bus

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.alone]


def _start(dsn: str, schema: str, topic: str, out: Path, work: float, idle: float) -> subprocess.Popen[bytes]:
    args = ["tests.queues.limits_worker", "-", schema, topic, str(out), str(work), str(idle)]
    return subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env={**os.environ, "BUS_DSN": dsn})


async def _run(dsn: str, schema: str, topic: str, tmp: Path, work: float, idle: float) -> list[list[str]]:
    outs = [tmp / f"w{i}.txt" for i in range(3)]
    procs = [_start(dsn, schema, topic, o, work, idle) for o in outs]
    try:
        await asyncio.gather(*(asyncio.to_thread(p.wait) for p in procs))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0, 0]
    return [line.split() for o in outs for line in o.read_text().splitlines() if line != "R"]


async def test_max_in_flight_per_key_holds_across_three_processes(
    b: bus.Bus, dsn: str, schema: str, tmp_path: Path
) -> None:
    await b.create_topic("jobs", partitions=4, semantics="queue", max_in_flight_per_key=2)
    await b.publish_many("jobs", [bus.Outgoing({"n": i}, key=f"k{i % 3}") for i in range(60)])
    lines = await _run(dsn, schema, "jobs", tmp_path, work=0.05, idle=1.0)
    events: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for kind, key, at, *_ in lines:
        events[key].append((float(at), 1 if kind == "T" else -1))
    assert sum(len(v) for v in events.values()) == 120  # every job taken and acked once
    peaks = {}
    for key, points in events.items():
        held = peak = 0
        for _, step in sorted(points, key=lambda p: (p[0], p[1])):  # an ack before a take at one instant
            held += step
            peak = max(peak, held)
        peaks[key] = peak
    assert max(peaks.values()) <= 2, f"jobs in flight at once per key: {peaks}"
    assert 2 in peaks.values(), f"no key reached its limit, the test did not load it: {peaks}"


async def test_rate_limit_holds_across_three_processes(
    b: bus.Bus, dsn: str, schema: str, tmp_path: Path
) -> None:
    await b.create_topic("jobs", partitions=4, semantics="queue", rate_limit=bus.Rate(10, per=1.0))
    await b.publish_many("jobs", [bus.Outgoing({"n": i}) for i in range(30)])
    started = time.time()
    lines = await _run(dsn, schema, "jobs", tmp_path, work=0.0, idle=1.5)
    # (when the take returned, when it was called): the database took the job in between.
    takes = sorted((float(x[2]), float(x[3])) for x in lines if x[0] == "T")
    assert len(takes) == 30
    # More than the limit within one period, for sure: jobs whose whole take intervals fit in it.
    for _, start in takes:
        inside = [t for t in takes if t[1] >= start and t[0] < start + 1.0]
        assert len(inside) <= 10, f"{len(inside)} takes within one second: {inside}"
    assert takes[-1][0] - started >= 2.0  # 30 jobs at 10 per second need two refills


async def test_a_paused_queue_hands_out_nothing_in_any_process(
    b: bus.Bus, dsn: str, schema: str, tmp_path: Path
) -> None:
    await b.create_topic("jobs", partitions=4, semantics="queue")
    outs = [tmp_path / f"w{i}.txt" for i in range(3)]
    procs = [_start(dsn, schema, "jobs", o, 0.0, 4.0) for o in outs]
    try:
        deadline = time.monotonic() + 30
        while not all(o.exists() and o.read_text().startswith("R") for o in outs):
            assert time.monotonic() < deadline, "the workers did not start"
            await asyncio.sleep(0.1)
        await b.publish_many("jobs", [bus.Outgoing({"n": i}) for i in range(5)])
        while sum(o.read_text().count("A ") for o in outs) < 5:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await b.admin.pause_queue("jobs")
        paused_at = time.time()
        await b.publish_many("jobs", [bus.Outgoing({"n": i}) for i in range(5, 25)])
        await asyncio.sleep(1.5)
        # Before the call: a worker woken by the resume may take before the call returns here.
        resumed_at = time.time()
        await b.admin.resume_queue("jobs")
        await asyncio.gather(*(asyncio.to_thread(p.wait) for p in procs))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    takes = [float(x.split()[2]) for o in outs for x in o.read_text().splitlines() if x.startswith("T ")]
    assert len(takes) == 25
    assert not [t for t in takes if paused_at < t < resumed_at], "a job was taken while the queue was paused"
    assert sum(1 for t in takes if t >= resumed_at) == 20
