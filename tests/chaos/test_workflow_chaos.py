"""Workflows under faults: member processes killed (SIGKILL) and their database connections
terminated while runs are in flight.

Every run finishes once with the results its recorded steps returned, no step is called again
once a call of it returned and was recorded (a call that began after the recorded call had
returned is a violation; one killed before its record is not), and the transaction step's row
exists exactly once per run (the table has no unique key that could hide a duplicate).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import bus
from tests.chaos.workflow_member import ROWS

ROOT = Path(__file__).resolve().parents[2]
RUNS = 40
MEMBERS = 3
FAULT_SECONDS = float(os.environ.get("CHAOS_WORKFLOW_SECONDS", "20"))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.alone,
]


def _spawn(dsn: str, schema: str, out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.chaos.workflow_member", schema, str(out)],
        cwd=ROOT,
        env={**os.environ, "BUS_DSN": dsn},
        stdout=subprocess.DEVNULL,
    )


def _calls(out: Path) -> tuple[dict[str, tuple[float, float]], list[tuple[str, str, str, float]]]:
    """Each call's (began, returned) by its id, and every call that began as (run, step, id, began)."""
    spans: dict[str, list[float]] = {}
    began: list[tuple[str, str, str, float]] = []
    for line in (out / "calls").read_text().splitlines():
        kind, wid, step, call, at = line.split()
        if kind == "S":
            spans[call] = [float(at), float("inf")]
            began.append((wid, step, call, float(at)))
        else:
            spans[call][1] = float(at)
    return {c: (s[0], s[1]) for c, s in spans.items()}, began


async def _faults(
    b: bus.Bus, dsn: str, schema: str, out: Path, members: list[subprocess.Popen[bytes]]
) -> dict[str, int]:
    rng = random.Random(int(os.environ.get("CHAOS_SEED", str(random.randrange(1 << 30)))))
    done = {"kill": 0, "terminate_backends": 0}
    deadline = time.monotonic() + FAULT_SECONDS
    while time.monotonic() < deadline:
        await asyncio.sleep(rng.uniform(0.5, 2.0))
        if rng.random() < 0.7:
            i = rng.randrange(len(members))
            members[i].send_signal(signal.SIGKILL)
            members[i].wait()
            members[i] = _spawn(dsn, schema, out)
            done["kill"] += 1
        else:
            # every bus connection of the members (and of this test's Bus): as a failover or an admin would
            await b.pool.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name = 'bus' AND pid <> pg_backend_pid()"
            )
            done["terminate_backends"] += 1
    return done


async def test_every_workflow_run_finishes_once_under_kills_and_lost_connections(
    b: bus.Bus, dsn: str, schema: str, tmp_path: Path
) -> None:
    await b.pool.execute(f"CREATE TABLE {ROWS} (workflow_id text NOT NULL, n int NOT NULL)")
    members = [_spawn(dsn, schema, tmp_path) for _ in range(MEMBERS)]
    try:
        while len(list(tmp_path.glob("ready-*"))) < MEMBERS:  # noqa: ASYNC110, ASYNC240 - the members' signal
            await asyncio.sleep(0.05)

        async def start_during_the_faults() -> None:
            for n in range(RUNS):  # spread over the faults, so that they land on runs in flight
                while True:  # a start whose connection the faults cut is started again (same id: once)
                    try:
                        await b.start_workflow("chaosflow", n, workflow_id=f"chaos-{n}")
                        break
                    except bus.StorageUnavailableError:
                        await asyncio.sleep(0.1)
                await asyncio.sleep(FAULT_SECONDS * 0.8 / RUNS)

        starting = asyncio.create_task(start_during_the_faults())
        done = await _faults(b, dsn, schema, tmp_path, members)
        await starting
        results = {}
        for n in range(RUNS):
            results[n] = await b.workflow_result(f"chaos-{n}", timeout=120)
    finally:
        for m in members:
            m.send_signal(signal.SIGKILL)
            m.wait()

    assert done["kill"] > 0
    spans, began = _calls(tmp_path)
    recorded = {
        (f"chaos-{n}", step): call
        for n, calls in results.items()
        for step, call in zip("ab", calls, strict=True)
    }
    for (wid, step), call in recorded.items():
        assert call in spans, f"{wid} {step}: its recorded result {call} was never returned by a call"
        returned = spans[call][1]
        again = [c for w, s, c, at in began if (w, s) == (wid, step) and c != call and at > returned]
        assert not again, f"{wid} step {step} was called again after its recorded call returned: {again}"
    rows = await b.pool.fetch(f"SELECT workflow_id, count(*) AS n FROM {ROWS} GROUP BY 1")
    assert {r["workflow_id"]: r["n"] for r in rows} == {f"chaos-{n}": 1 for n in range(RUNS)}
    for n in range(RUNS):
        info = await b.admin.workflow(f"chaos-{n}")
        assert info.status == "succeeded"
    print(f"workflow chaos: {RUNS} runs, faults {done}, step calls {len(began)} for {2 * RUNS} steps")
