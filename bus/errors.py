"""The errors of the public API (defined in `storage.errors`, re-exported here)."""

from bus.workflows.errors import (
    StepFailedError,
    WorkflowCancelledError,
    WorkflowFailedError,
    WorkflowNotFoundError,
    WorkflowVersionError,
)
from storage.errors import (
    BusError,
    ConcurrentAppendError,
    GroupHasMembersError,
    GroupNotFoundError,
    GroupStoppedError,
    JobFailedError,
    LeaseLostError,
    OffsetOutOfRangeError,
    RebalanceInProgressError,
    SchemaVersionError,
    StaleGenerationError,
    StorageUnavailableError,
    TopicConflictError,
    TopicNotFoundError,
    ValidationError,
)

__all__ = [
    "BusError",
    "ConcurrentAppendError",
    "GroupHasMembersError",
    "GroupNotFoundError",
    "GroupStoppedError",
    "JobFailedError",
    "LeaseLostError",
    "OffsetOutOfRangeError",
    "RebalanceInProgressError",
    "SchemaVersionError",
    "StaleGenerationError",
    "StorageUnavailableError",
    "TopicConflictError",
    "TopicNotFoundError",
    "ValidationError",
    "StepFailedError",
    "WorkflowCancelledError",
    "WorkflowFailedError",
    "WorkflowNotFoundError",
    "WorkflowVersionError",
]
