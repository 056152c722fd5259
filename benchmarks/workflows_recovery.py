"""A killed worker's restart: how long until the runs it was executing resume.

One process starts RUNS runs of a two-step workflow and is killed (SIGKILL) while every run is
inside its second step (the first recorded); the same program is started again at once and the
time is taken from that start until the second step of every run has been called again (its
first call never returned, so it is called again: at least once). Side by side, in one run:

* **bus, named executor**: `bus.connect(..., workflow_executor="bench-0")`, the same name after
  the restart: the restarted process takes its runs back at once.
* **bus, no name**: the restarted process is another executor; the runs resume when their leases
  (`lease_time`) lapse.
* **DBOS Transact**: its process restarts as the same executor ("local") and recovers its pending
  workflows at launch.

python -m benchmarks.workflows_recovery SIDE DSN OUT PHASE RUNS [SCHEMA_OR_DB] [LEASE]  (a child)
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg

from benchmarks.result import Result

SCENARIO = "workflows"
ROOT = Path(__file__).resolve().parents[1]


def _called(out: Path, what: str) -> None:
    with (out / "calls").open("a") as f:
        f.write(f"{what} {time.time()!r}\n")


def _second(out: Path) -> None:
    """The second step: blocks for good until the restart (the file `release` exists)."""
    _called(out, "second")
    while not (out / "release").exists():
        time.sleep(0.02)


async def _bus_child(
    dsn: str, out: Path, phase: str, runs: int, schema: str, lease: float, name: str
) -> None:
    import bus

    config: dict[str, Any] = {"lease_time": lease, "cleaner_interval": 0}
    if name:
        config["workflow_executor"] = name
    async with bus.connect(dsn, schema=schema, **config) as b:

        def first(i: int) -> int:
            return i

        async def second() -> int:
            _called(out, "second")
            while not (out / "release").exists():  # noqa: ASYNC110 - the parent's signal
                await asyncio.sleep(0.02)
            return os.getpid()

        @b.workflow("held")
        async def held(ctx: bus.WorkflowContext, i: int) -> int:
            await ctx.step(first, i)
            return int(await ctx.step(second))

        ids = [f"held-{i}" for i in range(runs)]
        if phase == "1":
            for i, wid in enumerate(ids):
                await b.start_workflow("held", i, workflow_id=wid)
            await asyncio.sleep(3600)  # killed
        for wid in ids:
            await b.workflow_result(wid, timeout=600)


def _dbos_child(dsn: str, out: Path, phase: str, runs: int, db: str) -> None:
    import sqlalchemy as sa
    from dbos import DBOS, DBOSConfig, SetWorkflowID

    sys_url = sa.make_url(dsn).set(database=db).render_as_string(hide_password=False)
    config: DBOSConfig = {"name": "recovery", "system_database_url": sys_url, "log_level": "WARNING"}
    DBOS(config=config)

    @DBOS.step()
    def first(i: int) -> int:
        return i

    @DBOS.step()
    def second() -> int:
        _second(out)
        return os.getpid()

    @DBOS.workflow()
    def held(i: int) -> int:
        first(i)
        return second()

    DBOS.launch()
    ids = [f"held-{i}" for i in range(runs)]
    if phase == "1":
        for i, wid in enumerate(ids):
            with SetWorkflowID(wid):
                DBOS.start_workflow(held, i)
        time.sleep(3600)  # killed
    for wid in ids:
        DBOS.retrieve_workflow(wid).get_result()
    DBOS.destroy()


def _spawn(side: str, dsn: str, out: Path, phase: str, runs: int, where: str, lease: float, name: str) -> Any:
    args = [sys.executable, "-m", "benchmarks.workflows_recovery", side, dsn, str(out), phase, str(runs)]
    return subprocess.Popen([*args, where, str(lease), name], cwd=ROOT, stdout=subprocess.DEVNULL)


def _seconds(out: Path) -> list[float]:
    path = out / "calls"
    lines = path.read_text().splitlines() if path.exists() else []
    return [float(line.split()[1]) for line in lines if line.startswith("second ")]


async def _restart(side: str, dsn: str, runs: int, where: str, lease: float, name: str) -> list[float]:
    """Kill the first process with every run inside its second step; the resume delays after the restart."""
    with tempfile.TemporaryDirectory(prefix="bus-wf-recovery-") as tmp:
        return await _restart_in(Path(tmp), side, dsn, runs, where, lease, name)


async def _restart_in(
    out: Path, side: str, dsn: str, runs: int, where: str, lease: float, name: str
) -> list[float]:
    first = _spawn(side, dsn, out, "1", runs, where, lease, name)
    try:
        deadline = time.monotonic() + 120
        while len(_seconds(out)) < runs:
            if time.monotonic() > deadline or first.poll() is not None:
                raise RuntimeError(f"{side}: the runs never reached their second step")
            await asyncio.sleep(0.02)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    (out / "release").touch()  # noqa: ASYNC240 - a marker file
    started = time.time()
    second = _spawn(side, dsn, out, "2", runs, where, lease, name)
    if await asyncio.to_thread(second.wait, 600) != 0:
        raise RuntimeError(f"{side}: the restarted process failed")
    resumed = sorted(_seconds(out)[runs:])
    return [t - started for t in resumed]


async def _drop(dsn: str, sql: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def run(dsn: str, quick: bool) -> list[Result]:
    """The three sides one after the other on the same server: all resumed, seconds after the restart."""
    runs = 10 if quick else 50
    lease = 10.0 if quick else 30.0
    measured: dict[str, list[float]] = {}
    for label, name in (("named", "bench-0"), ("unnamed", "")):
        schema = "bench_" + uuid.uuid4().hex[:10]
        try:
            measured[label] = await _restart("bus", dsn, runs, schema, lease, name)
        finally:
            await _drop(dsn, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')  # a generated bench schema name
    db = "dbos_recovery_" + uuid.uuid4().hex[:8]
    try:
        measured["dbos"] = await _restart("dbos", dsn, runs, db, lease, "")
    finally:
        await _drop(dsn, f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")  # a generated database name
    extra = {"runs": runs, "lease_time": lease, "unnamed_all_resumed_s": max(measured["unnamed"])}
    rows = []
    for label, what in (("named", "named executor"), ("unnamed", "no executor name")):
        rows.append(
            Result(
                SCENARIO,
                f"restart → every run resumed, {what} ({runs} runs, lease_time {lease:g} s)",
                max(measured[label]),
                "s",
                max(measured["dbos"]),
                "DBOS Transact",
                higher_is_better=False,
                target="≤ 1× DBOS Transact" if label == "named" else None,
                extra=extra,
            )
        )
    return rows


def main() -> None:
    side, dsn, out, phase, runs = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    where, lease, name = sys.argv[6], float(sys.argv[7]), sys.argv[8]
    if side == "bus":
        asyncio.run(_bus_child(dsn, out, phase, runs, where, lease, name))
    else:
        _dbos_child(dsn, out, phase, runs, where)


if __name__ == "__main__":
    main()
