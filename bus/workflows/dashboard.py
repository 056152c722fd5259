"""The dashboard's workflow pages: the runs, and one run's steps as a timeline."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bus.client import Bus

RUNS_LIMIT = 200


async def runs_page(b: Bus) -> dict[str, Any]:
    """The newest runs with their status and step counts."""
    return {"runs": await b.admin.workflows(limit=RUNS_LIMIT), "limit": RUNS_LIMIT}


async def run_page(b: Bus, workflow_id: str) -> dict[str, Any]:
    """One run: its facts and a timeline bar per step, placed by start and length within the run."""
    run = await b.admin.workflow(workflow_id)
    start = run.created_at
    end: datetime = max(
        [run.finished_at or run.updated_at, *(s.finished_at for s in run.steps)], default=start
    )
    span = max((end - start).total_seconds(), 1e-3)
    bars = []
    for s in run.steps:
        at = (s.started_at - start).total_seconds()
        took = max((s.finished_at - s.started_at).total_seconds(), 0.0)
        bars.append(
            {
                "step": s,
                "left": round(min(max(at / span, 0.0), 1.0) * 100, 2),
                "width": round(max(took / span * 100, 0.5), 2),
                "ms": f"{took * 1000:.1f}",
            }
        )
    return {"run": run, "bars": bars, "span": f"{span:.3f}"}
