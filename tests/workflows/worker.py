"""A process that runs workflows for the kill tests.

python -m tests.workflows.worker SCHEMA OUT_DIR MODE WORKFLOW_ID

- `killable`: start (or join) the run WORKFLOW_ID of `killable` and wait for its result. With
  WF_KILL=all the process kills itself (SIGKILL) at the first kill point not yet used (a marker file
  per point in OUT_DIR), so a chain of processes dies once at each point and the last one finishes.
- `race`: wait for OUT_DIR/go, then start the run WORKFLOW_ID of `counted` and wait for its result.
- `nap-start`: start the run WORKFLOW_ID of `napper`, and kill itself once it is parked.
- `serve`: register the workflows and wait for the result of WORKFLOW_ID.
- `hold`: under the executor name WF_EXECUTOR, with a 60 s lease, start the runs WORKFLOW_ID-0..3 of
  `held` and wait for their results; their second step blocks for good while OUT_DIR/release does not
  exist (the first process is killed there; its restart finds the file and finishes them).

Every step call appends a line to OUT_DIR/calls (flushed and synced before the step returns).
The result goes to OUT_DIR/result-<pid>.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import bus
from bus.testing import FAST

LEASE = 1.5


def counted_call(out: Path, what: str) -> None:
    with (out / "calls").open("a") as f:
        f.write(f"{what} {os.getpid()}\n")
        f.flush()
        os.fsync(f.fileno())


def die_once(out: Path, label: str) -> None:
    if os.environ.get("WF_KILL") != "all":
        return
    marker = out / f"killed-{label}"
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


def register(b: bus.Bus, out: Path) -> None:
    def work(i: int) -> int:
        counted_call(out, f"step-{i}")
        die_once(out, f"inside-step-{i}")
        return i * i

    @b.workflow("killable")
    async def killable(ctx: bus.WorkflowContext, n: int) -> list[int]:
        die_once(out, "start")
        got = []
        for i in range(n):
            got.append(await ctx.step(work, i))
            die_once(out, f"after-step-{i}")
            async with ctx.transaction() as tx:
                await tx.connection.execute(
                    "INSERT INTO wf_effects (workflow_id, i) VALUES ($1, $2)", ctx.workflow_id, i
                )
                die_once(out, f"in-tx-{i}")
            die_once(out, f"after-tx-{i}")
        return got

    def race_step() -> int:
        counted_call(out, "race")
        return os.getpid()

    @b.workflow("counted")
    async def counted(ctx: bus.WorkflowContext) -> int:
        pid = int(await ctx.step(race_step))
        await ctx.sleep(0.3)
        return pid

    def before() -> None:
        counted_call(out, "before-nap")

    async def second() -> int:
        counted_call(out, "second")
        while not (out / "release").exists():  # noqa: ASYNC110 - the test's signal
            await asyncio.sleep(0.05)
        return os.getpid()

    @b.workflow("held")
    async def held(ctx: bus.WorkflowContext) -> int:
        await ctx.step(before)
        return int(await ctx.step(second))

    @b.workflow("napper")
    async def napper(ctx: bus.WorkflowContext, seconds: float) -> float:
        await ctx.step(before)
        await ctx.sleep(seconds)
        return float(await ctx.step(time.time))


async def main() -> None:
    schema, out, mode, wid = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    config: dict[str, object] = {**FAST, "lease_time": LEASE}
    if mode == "hold":
        config.update(lease_time=60.0, workflow_executor=os.environ["WF_EXECUTOR"])
    async with bus.connect(os.environ["BUS_DSN"], schema=schema, **config) as b:
        register(b, out)
        (out / f"ready-{os.getpid()}").write_text(repr(time.time()))
        if mode == "killable":
            await b.start_workflow("killable", 3, workflow_id=wid)
        elif mode == "race":
            while not (out / "go").exists():  # noqa: ASYNC110 - another process's signal
                await asyncio.sleep(0.005)
            await b.start_workflow("counted", workflow_id=wid)
        elif mode == "nap-start":
            await b.start_workflow("napper", 8.0, workflow_id=wid)
            while (await b.admin.workflow(wid)).status != "waiting":  # noqa: ASYNC110 - the database's state
                await asyncio.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        elif mode == "hold":
            runs = [f"{wid}-{i}" for i in range(4)]
            for run in runs:
                await b.start_workflow("held", workflow_id=run)
            results = [await b.workflow_result(run, timeout=90) for run in runs]
            (out / f"result-{os.getpid()}").write_text(json.dumps(results))
            return
        result = await b.workflow_result(wid, timeout=90)
        (out / f"result-{os.getpid()}").write_text(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
