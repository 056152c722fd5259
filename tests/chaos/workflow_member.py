"""A chaos process that runs workflows: `python -m tests.chaos.workflow_member SCHEMA OUT_DIR`.

It registers `chaosflow` and serves its runs until it is killed. The workflow is the pattern
docs/workflows.md shows: a step, a transaction step that INSERTs the service's row, a short
sleep, another step. Every step call appends two lines to OUT_DIR/calls, flushed and synced:

    S workflow_id step call_id time   (the call began)
    E workflow_id step call_id time   (the call returned; its result is call_id)
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from pathlib import Path

import bus
from bus.testing import FAST

LEASE = 1.5
ROWS = "wf_chaos_rows"


def _line(out: Path, text: str) -> None:
    with (out / "calls").open("a") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())


def register(b: bus.Bus, out: Path) -> None:
    def step(wid: str, name: str) -> str:
        call = uuid.uuid4().hex
        _line(out, f"S {wid} {name} {call} {time.time():.6f}")
        time.sleep(0.2)  # the step's work: a kill lands inside some calls
        _line(out, f"E {wid} {name} {call} {time.time():.6f}")
        return call

    @b.workflow("chaosflow")
    async def chaosflow(ctx: bus.WorkflowContext, n: int) -> list[str]:
        first = await ctx.step(step, ctx.workflow_id, "a")
        async with ctx.transaction() as tx:
            await tx.connection.execute(
                f"INSERT INTO {ROWS} (workflow_id, n) VALUES ($1, $2)", ctx.workflow_id, n
            )
        await ctx.sleep(0.5)
        second = await ctx.step(step, ctx.workflow_id, "b")
        return [str(first), str(second)]


async def main() -> None:
    schema, out = sys.argv[1], Path(sys.argv[2])
    async with bus.connect(os.environ["BUS_DSN"], schema=schema, **{**FAST, "lease_time": LEASE}) as b:
        register(b, out)
        (out / f"ready-{os.getpid()}").write_text(repr(time.time()))
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
