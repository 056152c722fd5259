"""What the workflow admin calls return: a run and its recorded steps."""

from __future__ import annotations

from datetime import datetime

import msgspec


class StepInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One recorded step of a run: its place (`seq`, from 1), what it was, and how it ended."""

    seq: int
    name: str
    kind: str  # step | transaction | sleep | deadline | recv | wait_for | child | event | send
    attempts: int
    started_at: datetime
    finished_at: datetime
    error: str | None = None
    output: bytes | None = None  # the recorded result, JSON


class WorkflowInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A run: its workflow, status (pending, running, waiting, succeeded, failed, cancelled) and steps."""

    workflow_id: str
    name: str
    version: str
    status: str
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    executions: int  # how many times a process took the run (more than 1: it was resumed)
    parent_id: str | None = None
    error_type: str | None = None
    error: str | None = None
    owner: str | None = None
    wake_at: datetime | None = None
    steps: list[StepInfo] = msgspec.field(default_factory=list)
