"""The errors of durable workflows (re-exported by `bus.errors`)."""

from __future__ import annotations

from storage.errors import BusError


class WorkflowVersionError(BusError):
    """The run's recorded steps do not match the code that replays it: run it on the code that started it.

    Register the old code under its version (`@b.workflow(name, version="1")`) beside the new one.
    """


class WorkflowNotFoundError(BusError, LookupError):
    """No run has this workflow_id (or no workflow of this name is registered)."""


class WorkflowFailedError(BusError):
    """The run failed: `error_type` and `error` say with what (its compensations have run)."""

    def __init__(self, message: str, *, workflow_id: str, error_type: str | None, error: str | None) -> None:
        super().__init__(message)
        self.workflow_id = workflow_id
        self.error_type = error_type
        self.error = error


class WorkflowCancelledError(BusError):
    """The run was cancelled (`b.admin.resume_workflow(id)` goes on from its last recorded step)."""


class StepFailedError(BusError):
    """A step raised on its last attempt: the error is recorded, and a replay raises it again."""

    def __init__(self, message: str, *, step: str, error: str) -> None:
        super().__init__(message)
        self.step = step
        self.error = error
