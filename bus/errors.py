"""The errors of the public API (defined in `storage.errors`, re-exported here)."""

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
    "StaleGenerationError",
    "StorageUnavailableError",
    "TopicConflictError",
    "TopicNotFoundError",
    "ValidationError",
]
