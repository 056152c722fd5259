"""Workflow runs survive `kill -9` of their process: a run killed at every step boundary, inside a
step and inside a transaction step resumes in another process, calls no recorded step again and
writes each transaction step's rows once; a parked sleep wakes on time after every process died;
the same workflow_id started by two processes at once is one run."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

import bus

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.alone]

KILL_POINTS = ["start"] + [
    f"{point}-{i}" for i in range(3) for point in ("inside-step", "after-step", "in-tx", "after-tx")
]


def _spawn(
    dsn: str, schema: str, out: Path, mode: str, wid: str, kill: bool = False, executor: str | None = None
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "BUS_DSN": dsn}
    if kill:
        env["WF_KILL"] = "all"
    if executor is not None:
        env["WF_EXECUTOR"] = executor
    return subprocess.Popen(
        [sys.executable, "-m", "tests.workflows.worker", schema, str(out), mode, wid],
        cwd=ROOT,
        env=env,
    )


async def _wait(p: subprocess.Popen[bytes], timeout: float = 120.0) -> int:  # noqa: ASYNC109 - a test's bound
    deadline = time.monotonic() + timeout
    while p.poll() is None:
        if time.monotonic() > deadline:
            p.kill()
            raise AssertionError("a workflow process did not finish in time")
        await asyncio.sleep(0.05)
    return p.returncode


def _calls(out: Path) -> Counter[str]:
    path = out / "calls"
    lines = path.read_text().splitlines() if path.exists() else []
    return Counter(line.split()[0] for line in lines)


def _results(out: Path) -> list[object]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("result-*"))]


async def test_a_run_killed_at_every_step_boundary_resumes_and_calls_no_recorded_step_again(
    b: bus.Bus, dsn: str, schema: str, tmp_path: Path
) -> None:
    await b.pool.execute("CREATE TABLE wf_effects (workflow_id text NOT NULL, i int NOT NULL)")
    kills = 0
    for _ in range(len(KILL_POINTS) + 5):
        code = await _wait(_spawn(dsn, schema, tmp_path, "killable", "k-1", kill=True))
        if code == 0:
            break
        assert code == -9, f"a workflow process exited with {code}"
        kills += 1
    else:
        raise AssertionError("the run never finished")
    used = sorted(p.name.removeprefix("killed-") for p in tmp_path.glob("killed-*"))  # noqa: ASYNC240
    assert used == sorted(KILL_POINTS) and kills == len(KILL_POINTS)
    assert _results(tmp_path) == [[0, 1, 4]]
    # a step killed inside was not recorded: it is called again; every recorded step never is
    assert _calls(tmp_path) == {"step-0": 2, "step-1": 2, "step-2": 2}
    rows = await b.pool.fetch("SELECT workflow_id, i, count(*) AS n FROM wf_effects GROUP BY 1, 2 ORDER BY 2")
    assert [(r["workflow_id"], r["i"], r["n"]) for r in rows] == [("k-1", 0, 1), ("k-1", 1, 1), ("k-1", 2, 1)]
    info = await b.admin.workflow("k-1")
    assert info.status == "succeeded" and info.executions == kills + 1
    assert [(s.seq, s.kind, s.attempts) for s in info.steps] == [
        (1, "step", 1),
        (2, "transaction", 1),
        (3, "step", 1),
        (4, "transaction", 1),
        (5, "step", 1),
        (6, "transaction", 1),
    ]


async def test_a_named_executor_restarted_takes_its_runs_back_before_their_leases_lapse(
    b: bus.Bus, dsn: str, schema: str, tmp_path: Path
) -> None:
    first = _spawn(dsn, schema, tmp_path, "hold", "held", executor="orders-0")
    deadline = time.monotonic() + 60
    while _calls(tmp_path)["second"] < 4:  # every run is inside its second step
        assert time.monotonic() < deadline and first.poll() is None, (
            "the runs never reached their second step"
        )
        await asyncio.sleep(0.05)
    rows = await b.pool.fetch(
        "SELECT workflow_id, owner, lease_until FROM workflow_runs WHERE name = 'held' ORDER BY 1"
    )
    assert [(r["workflow_id"], r["owner"]) for r in rows] == [(f"held-{i}", "orders-0") for i in range(4)]
    leases = {r["workflow_id"]: r["lease_until"] for r in rows}  # 60 s from their claim
    first.kill()
    first.wait()
    (tmp_path / "release").touch()  # noqa: ASYNC240
    second = _spawn(dsn, schema, tmp_path, "hold", "held", executor="orders-0")
    assert await _wait(second) == 0
    assert _results(tmp_path) == [[second.pid] * 4]
    for wid, lease in leases.items():
        info = await b.admin.workflow(wid)
        assert info.status == "succeeded" and info.executions == 2, info
        assert info.finished_at is not None and info.finished_at < lease, (
            f"{wid} waited for its dead incarnation's lease ({info.finished_at} >= {lease})"
        )
    # the first step was recorded before the kill: called once; the second again after it
    assert _calls(tmp_path) == {"before-nap": 4, "second": 8}


async def test_a_parked_sleep_wakes_on_time_after_every_process_died(
    b: bus.Bus, dsn: str, schema: str, tmp_path: Path
) -> None:
    first = _spawn(dsn, schema, tmp_path, "nap-start", "nap-1")
    assert await _wait(first) == -9
    info = await b.admin.workflow("nap-1")
    assert info.status == "waiting" and info.wake_at is not None
    await asyncio.sleep(1.0)  # no process runs workflows for a while
    assert await _wait(_spawn(dsn, schema, tmp_path, "serve", "nap-1")) == 0
    [woke] = _results(tmp_path)
    assert isinstance(woke, float)
    readies = [p for p in tmp_path.glob("ready-*") if p.name != f"ready-{first.pid}"]  # noqa: ASYNC240
    [ready] = [float(p.read_text()) for p in readies]
    assert ready < info.wake_at.timestamp(), "the second process was not up before the wake-up time"
    late = woke - info.wake_at.timestamp()
    assert 0 <= late < 1.0, f"the sleep woke {late:.3f}s after its time"
    assert _calls(tmp_path) == {"before-nap": 1}


async def test_the_same_workflow_id_started_by_two_processes_at_once_is_one_run(
    b: bus.Bus, dsn: str, schema: str, tmp_path: Path
) -> None:
    procs = [_spawn(dsn, schema, tmp_path, "race", "race-1") for _ in range(2)]
    await asyncio.sleep(3.0)  # both connected and waiting for the signal
    (tmp_path / "go").write_text("")
    assert [await _wait(p) for p in procs] == [0, 0]
    results = _results(tmp_path)
    assert len(results) == 2 and results[0] == results[1]
    assert _calls(tmp_path) == {"race": 1}
    runs = await b.admin.workflows(name="counted")
    assert [r.workflow_id for r in runs] == ["race-1"] and runs[0].executions == 1


async def test_the_same_workflow_id_started_32_times_at_once_is_one_run(b: bus.Bus) -> None:
    calls = []

    def once() -> int:
        calls.append(1)
        return 5

    @b.workflow("single")
    async def single(ctx: bus.WorkflowContext) -> int:
        return int(await ctx.step(once))

    handles = await asyncio.gather(*(b.start_workflow("single", workflow_id="one") for _ in range(32)))
    assert await asyncio.gather(*(h.result(timeout=30) for h in handles)) == [5] * 32
    assert calls == [1]
    assert [r.workflow_id for r in await b.admin.workflows(name="single")] == ["one"]
