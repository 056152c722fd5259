"""`bus workflows`: list runs, show one run's steps, cancel, resume and fork (loaded by the CLI only)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
import typer
from rich.console import Console
from rich.table import Table

import bus
from bus.tables import fit, table
from bus.workflows.types import WorkflowInfo
from storage.errors import BusError

T = TypeVar("T")

workflows_app = typer.Typer(
    help="Durable workflow runs: list (the default), show ID, cancel ID, resume ID, fork ID.",
    invoke_without_command=True,
)
console = Console()


def _run(fn: Callable[[], Awaitable[T]]) -> T:
    try:
        return asyncio.run(fn())  # type: ignore[arg-type]
    except BusError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc


def _json(data: object) -> None:
    print(msgspec.json.format(msgspec.json.encode(data), indent=2).decode())


def runs_table(runs: list[WorkflowInfo]) -> Table:
    """`bus workflows list` as a table."""
    rows = [
        [
            r.workflow_id,
            r.name,
            r.version,
            r.status,
            str(len(r.steps)),
            str(r.executions),
            f"{r.created_at:%Y-%m-%d %H:%M:%S}",
            r.error_type or "-",
        ]
        for r in runs
    ]
    t = table(
        "workflow_id",
        "name",
        "version",
        "status",
        "steps",
        "executions",
        "created",
        "error",
        numeric=("steps", "executions"),
    )
    return fit(t, rows, names=(0, 1))


def steps_table(run: WorkflowInfo) -> Table:
    """`bus workflows show ID`: the run's steps in order, with their durations and errors."""
    rows = [
        [
            str(s.seq),
            s.kind,
            s.name,
            str(s.attempts),
            f"{s.started_at:%H:%M:%S.%f}"[:-3],
            f"{(s.finished_at - s.started_at).total_seconds() * 1000:.1f}",
            s.error or "-",
        ]
        for s in run.steps
    ]
    t = table(
        "seq",
        "kind",
        "step",
        "attempts",
        "started",
        "ms",
        "error",
        numeric=("seq", "attempts", "ms"),
        title=f"{run.workflow_id}  {run.name} v{run.version}  {run.status}  executions={run.executions}",
    )
    return fit(t, rows, names=(2,))


_JSON = typer.Option(False, "--json", help="print JSON (for scripts) instead of a table")


@workflows_app.callback()
def _default(ctx: typer.Context) -> None:
    if ctx.invoked_subcommand is None:
        list_runs(status=None, name=None, limit=50, as_json=False)


@workflows_app.command("list")
def list_runs(
    status: str | None = typer.Option(None, help="pending, running, waiting, succeeded, failed, cancelled"),
    name: str | None = typer.Option(None, help="only runs of this workflow"),
    limit: int = typer.Option(50, help="at most this many runs, newest first"),
    as_json: bool = _JSON,
) -> None:
    """Workflow runs, newest first."""

    async def go() -> None:
        async with bus.connect() as b:
            runs = await b.admin.workflows(status=status, name=name, limit=limit)
        if as_json:
            _json(runs)
        else:
            console.print(runs_table(runs))

    _run(go)


@workflows_app.command()
def show(workflow_id: str, as_json: bool = _JSON) -> None:
    """One run and its recorded steps."""

    async def go() -> None:
        async with bus.connect() as b:
            run = await b.admin.workflow(workflow_id)
        if as_json:
            _json(run)
        else:
            console.print(steps_table(run))
            if run.error:
                console.print(f"[red]{run.error_type}:[/red] {run.error}")

    _run(go)


@workflows_app.command()
def cancel(workflow_id: str) -> None:
    """Cancel a run and its unfinished children."""

    async def go() -> None:
        async with bus.connect() as b:
            done = await b.admin.cancel_workflow(workflow_id)
        console.print("cancelled" if done else "not cancelled: the run had already finished")

    _run(go)


@workflows_app.command()
def resume(workflow_id: str) -> None:
    """A cancelled or failed run goes on from its last successful step."""

    async def go() -> None:
        async with bus.connect() as b:
            done = await b.admin.resume_workflow(workflow_id)
        console.print("resumed" if done else "not resumed: the run is neither cancelled nor failed")

    _run(go)


@workflows_app.command()
def fork(
    workflow_id: str,
    from_step: int = typer.Option(1, "--from-step", help="keep the records of the steps before this one"),
    new_id: str | None = typer.Option(
        None, "--new-id", help="the new run's id (default: <id>-fork-<random>)"
    ),
) -> None:
    """Start a new run of the same workflow and input, replaying the steps before --from-step."""

    async def go() -> None:
        async with bus.connect() as b:
            handle = await b.admin.fork_workflow(workflow_id, from_step, new_id=new_id)
        console.print(handle.workflow_id)

    _run(go)
